"""The decoding engine: one fast path for regeneration, the evaluation baseline and speculative verification.

Modules, bottom up (import from them; this package imports nothing):

    hybrid_kernels.py  what a hybrid's layers run besides transformers' own: fla's convolution, norms and in-place
                     delta rule on a GPU
    recurrent.py     RecurrentStates: per-row conv / delta-rule states of linear-attention (Gated DeltaNet) layers
                     of hybrid targets, held by the cache; rolled back after a verify step by re-advancing the
                     delta rule over each row's kept tokens (`commit`)
    cache.py         StaticKVCache: per attention layer [rows, kv_heads, max_len, head_dim], a length per row kept by
                     the caller; update(key, value, layer_idx) is what the HF attention modules call
    attention.py     position masks, the attention function the target's layers call (GQA folded, no repeat_kv)
    target.py        TargetRunner.forward(cache, ids [k, T], positions [k, T], rows= | kv_len=, verify=) -> logits, taps
    sampling.py      greedy / Gumbel-max sampling with noise from (request seed, new-token index)
    graphs.py        StepGraphs: fixed-shape steps captured once per key as CUDA graphs, eager on CPU
    batch.py         BatchDecoder: continuous batching (regeneration, and the plain baseline via plain.py)
    drafter_step.py  DraftProposer: the drafter's block proposal over a static context cache
    speculative.py   SpeculativeDecoder: verify + accept + commit + propose as one fixed-shape step, rows in parallel
    plain.py, runs.py  batch/single-prompt entry points and their results

Targets: Llama, Qwen2, Qwen3 (full and sliding-window attention) and Qwen3.5/3.6 hybrids (linear attention beside
full attention); `target.py` says how each is checked.
"""
