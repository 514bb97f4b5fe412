"""The decoding engine: one fast path for regeneration, the evaluation baseline and speculative verification.

Modules, bottom up (import from them; this package imports nothing):

    cache.py         StaticKVCache: per-layer [rows, kv_heads, max_len, head_dim], a length per row kept by the
                     caller; update(key, value, layer_idx) is what the HF attention modules call
    attention.py     position masks, the attention function the target's layers call (GQA folded, no repeat_kv)
    target.py        TargetRunner.forward(cache, ids [k, T], positions [k, T], rows= | kv_len=) -> logits, taps
    sampling.py      greedy / Gumbel-max sampling with noise from (request seed, new-token index)
    graphs.py        StepGraphs: fixed-shape steps captured once per key as CUDA graphs, eager on CPU
    batch.py         BatchDecoder: continuous batching (regeneration, and the plain baseline via plain.py)
    drafter_step.py  DraftProposer: the drafter's block proposal over a static context cache
    speculative.py   SpeculativeDecoder: verify + accept + propose as one fixed-shape step, rows in parallel
    plain.py, runs.py  batch/single-prompt entry points and their results

Where a hybrid target (linear-attention layers, issue 11) plugs in: `TargetRunner` refuses it today via
`cache.check_supported_layer_types`. It needs per-row recurrent states beside the KV buffers in the cache (prefill
writes them; a decode step advances them in place), and for speculative verification a snapshot before the
verify step plus a restore-and-re-advance over the committed tokens of each row (or per-position states from the
kernel, selected at each row's committed length) inside `SpeculativeDecoder._step`.
"""
