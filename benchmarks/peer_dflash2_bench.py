"""Training-step benchmark of the peer's DFlash2 drafter trainer (speculators==0.9.0), beside `dflash-trainer bench`.

What trains is speculators' own code, called through its API:
  * drafter decoder config: `speculators.train.cli.create_transformer_layer_config` (the `speculators train` default
    construction path, draft architecture qwen3);
  * model: `speculators.models.dflash2.DFlash2DraftModel.from_training_args` (DFlash's backbone with the grouped
    dynamic convolution around every attention and MLP sublayer, the candidate selector, its `torch.compile`d
    forward on CUDA, its flex-attention block mask);
  * loss: the forward's own, with the call kwargs of `DFlash2DraftModel.get_trainer_kwargs` (the unary DFlash loss,
    fused Triton kernels by default, plus its selector term weighted by `--selector-loss-alpha`, as it ships);
  * step: `speculators.train.trainer.Trainer.train_epoch` (bf16 autocast, forward, zero_grad, backward,
    clip_grad_norm_(1.0), optimizer step(s), scheduler step) with `speculators.train.optimizers.build_optimizers`
    (AdamW by default, `--optimizer muon` for its Muon + AdamW pair) and a cosine schedule, warm-up ratio 0.04.

Only the data source is replaced. Instead of its file or vLLM-backed DataLoader, an in-memory loader yields one packed
row per step in the format of speculators' collate function ([1, T] tensors, `document_ids` -1 on padding,
`error_records`). Its hidden states come from a randomly initialised verifier (bf16) in the same process, through
forward hooks: the outputs of the tapped decoder layers, and the last layer's output before the final norm
(speculators applies the verifier's norm and LM head itself to make its targets).

Settings (`--setting`; every value can be overridden by its flag):
  * paper: the setting of recipes/bench-qwen3-8b.yaml. Qwen3-8B-shaped verifier, 5 drafter layers, taps
    [1, 9, 17, 25, 33], packed rows of 8,192 tokens = documents 3,072 + 3,072 + 2,048, every token supervised,
    1,365 anchors per row (455 per document), CE against the verifier's argmax with exponential slot weights,
    AdamW lr 6e-4, full attention in every drafter layer, mask token 151669.
  * smollm2: the batch shape of recipes/smollm2-135m-gpu-dflash2.yaml (and bench-smollm2.yaml). SmolLM2-135M-shaped
    verifier (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1,536, vocab 49,152, tied embeddings),
    5 drafter layers, taps [1, 8, 14, 20, 27], one packed row of up to 16,384 tokens (the recipe's token budget)
    of documents shaped like its regenerated data (a prompt of 30-232 unsupervised tokens, then a reply of 256 tokens
    for 28 % of the documents, else 4-114; the distribution of `smollm2_documents` in src/dflash_trainer/bench.py),
    anchors = the sum over documents of min(64, reply - 1) (the recipe's 64 per document), CE with D-PACE slot
    weights, AdamW lr 2e-3, full attention, mask token 16.
  Block size 8 by default (the published DFlash2 checkpoints'); `--block-size 16` for the DFlash2 recipe's and the
  paper's DFlash block.
  The peer draws its anchors per row, uniformly over the supervised positions, not per document: the number of
  blocks per step is ours, their spread over the documents is its own.

Phases, each timed the same way:
  (a) drafter_only: the verifier runs once; its hidden states stay on the device and every step reuses them;
  (b) end_to_end (`--e2e-steps N`): before every drafter step the loader runs the verifier forward over the row's
      documents (new random tokens, same lengths; no LM head; see `PackedRow.hidden_states` for the batching).
Timing: a device synchronisation and `time.perf_counter()` at the end of every step (the Trainer's
`step_callback`); the first `--warmup` steps (torch.compile, Triton autotuning) are left out; reported: the median
step in ms, min / mean / max, target tokens per second at the median step (real tokens of the row / median step),
block positions per second, peak device memory allocated and reserved over the phase (the verifier's weights
included), the first step's seconds, the loss of every step (a forward hook keeps the detached loss; read after the
phase, so no extra syncs).

FLOPs per step (stated, not measured), Nq = anchors x block size, T = real tokens of the row:
  drafter = Nq * (6 * P_trainable + 4 * H * V)   (DESIGN §5 without attention: BENCHMARKS.md's MFU convention;
            P_trainable includes the selector's two [V, rank] codebooks, which are row look-ups, not matmuls, so
            `drafter_flops_matmul` gives the count without them)
  attention_fwd = 4 * heads * head_dim * Nq * (mean context per anchor + block) * layers   (reported beside it)
  verifier = 2 * (P_verifier - embedding - LM head) * T + 4 * layers * heads * head_dim * sum(doc^2 / 2)
  MFU = FLOPs (drafter; drafter + verifier end to end) / median step / `--peak-tflops` (790: the H200's bf16 peak
  measured for DESIGN §5).

`--device cpu --tiny` runs the same code path on tiny shapes (a 6-layer verifier of hidden 128, vocab 1,024; 2
drafter layers; rows of 1,024 tokens; SDPA attention; the eager loss, as speculators' fused loss needs Triton), to
check the harness end to end without a GPU. On CPU speculators does not compile its forward (it compiles only when
CUDA is available).

Output: a log on stdout and, with `--out`, a JSON file (arguments, versions, model sizes, FLOPs, phases).
Run it with speculators on the path, e.g. through benchmarks/peer_dflash2_bench.sh.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import importlib
import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
import tempfile
import time
import traceback
import types
from contextlib import nullcontext
from pathlib import Path

T_START = time.perf_counter()

SETTINGS = {
    "paper": dict(
        total_seq_len=8192,
        doc_lens="3072,3072,2048",
        max_anchors=1365,
        target_layer_ids="1,9,17,25,33",
        per_position_loss_weight="fixed-exp-decay",
        lr=6e-4,
        mask_token_id=151669,
    ),
    "smollm2": dict(
        total_seq_len=16384,
        doc_lens="smollm2",
        anchors_per_doc=64,
        target_layer_ids="1,8,14,20,27",
        per_position_loss_weight="dpace",
        lr=2e-3,
        mask_token_id=16,
    ),
}
TINY = dict(total_seq_len=1024, anchors_per_doc=16, target_layer_ids="1,2,3", num_layers=2)


def log(msg: str) -> None:
    print(f"[peer-dflash2 {time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="paper")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check of the harness)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=None, help="drafter layers (default 5)")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated verifier layers tapped")
    p.add_argument("--total-seq-len", type=int, default=None, help="packed row width")
    p.add_argument(
        "--doc-lens",
        default=None,
        help="comma-separated document lengths, all supervised (paper), or 'smollm2' for the SmolLM2 data shape",
    )
    p.add_argument("--max-anchors", type=int, default=None, help="anchors per row (default: the setting's)")
    p.add_argument("--anchors-per-doc", type=int, default=None, help="smollm2 documents: anchors per document")
    p.add_argument("--attn", default=None, choices=["simple_flex_attention", "sdpa", "eager"])
    p.add_argument("--sliding-window", type=int, default=0, help="0: full attention in every drafter layer")
    p.add_argument("--loss-fn", default="ce", help="speculators loss spec (its DFlash2 default is kl_div)")
    p.add_argument("--loss-impl", default=None, choices=["fused", "eager"])
    p.add_argument("--per-position-loss-weight", default=None, choices=["fixed-exp-decay", "dpace"])
    p.add_argument("--gamma", type=float, default=None, help="slot-weight decay (default: 7 / 5 / 4 for B 16 / 10 / 8)")
    p.add_argument("--dpace-alpha", type=float, default=0.5)
    p.add_argument("--selector-loss-alpha", type=float, default=1.0)
    p.add_argument("--conv-kernel-size", type=int, default=2)
    p.add_argument("--conv-group-size", type=int, default=16)
    p.add_argument("--selector-rank", type=int, default=None, help="default 256 (32 with --tiny)")
    p.add_argument("--selector-top-k", type=int, default=16)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--e2e-warmup", type=int, default=2)
    p.add_argument("--e2e-steps", type=int, default=0, help="0: no end-to-end phase")
    p.add_argument("--time-budget", type=float, default=1e9, help="skip the end-to-end phase after this many s")
    p.add_argument("--eager-block-mask", action="store_true", help="torch's uncompiled create_block_mask")
    p.add_argument("--no-autotuner-patch", action="store_true")
    p.add_argument(
        "--no-fallback", action="store_true", help="do not retry a failing first phase with other loss paths"
    )
    p.add_argument("--stack-dump-s", type=float, default=0.0, help="dump Python stacks every N s until a step ends")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "peer_dflash2_work"))
    p.add_argument("--out", default="")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    defaults = dict(SETTINGS[args.setting], num_layers=5, selector_rank=256)
    if args.tiny:
        defaults.update(TINY, selector_rank=32, mask_token_id=None)
        if args.setting == "paper":
            defaults.update(doc_lens="384,384,256", max_anchors=96)
    defaults["attn"] = "simple_flex_attention" if args.device.startswith("cuda") else "sdpa"
    defaults["loss_impl"] = "fused" if args.device.startswith("cuda") else "eager"
    defaults["gamma"] = {16: 7.0, 10: 5.0, 8: 4.0}.get(args.block_size, 7.0)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------------------------------------------- imports


def _stub_package(name: str) -> None:
    """Make `name` (and its submodules) importable as empty modules whose attributes are dummies."""

    class Dummy:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{name} is stubbed in this benchmark")

    class Module(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Dummy

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname == name or fullname.startswith(name + "."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = Module(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    sys.meta_path.insert(0, Finder())


def import_peer() -> list[str]:
    """Import speculators. Its data modules import `datasets` and `openai` at module level, for the file and vLLM
    data path this benchmark replaces; a package that fails to import is stubbed (returned, and recorded)."""
    stubbed = []
    for name in ("datasets", "openai"):
        try:
            __import__(name)
        except Exception as error:
            log(f"import {name} failed ({type(error).__name__}: {error}); stubbed (only the data path uses it)")
            _stub_package(name)
            stubbed.append(name)
    for module in ("speculators", "speculators.models.dflash2", "speculators.train.cli", "speculators.train.trainer"):
        importlib.import_module(module)
    return stubbed


def unshare_fused_loss_autotuners() -> list[str]:
    """speculators' fused loss decorates its forward and backward Triton kernels with one `triton.autotune` object,
    so both autotuners hold the same `configs` and `keys` lists, which Dynamo (torch 2.11) refuses to trace inside
    the compiled forward ("ListVariable ... is already tracked for mutation"). The backward one gets its own copies:
    same configs, keys and kernels."""
    from speculators.losses import fused

    forward, backward = fused.loss_forward_kernel, fused.loss_backward_kernel
    shared = [a for a in ("configs", "keys") if getattr(forward, a, None) is getattr(backward, a, None)]
    for attr in shared:
        setattr(backward, attr, copy.deepcopy(getattr(backward, attr)))
    return shared


def tv_metric_outside_the_graph() -> None:
    """speculators' DFlash2 forward also computes an acceptance metric with the fused TV kernel, under no_grad, after
    its fused unary loss: the same Triton forward kernel twice in one compiled graph, which Dynamo (torch 2.11)
    refuses to trace for the same reason as above (the kernel's configs list wrapped twice). The metric's call runs
    outside the graph instead (a graph break at that call): the same kernel, launched eagerly, still in the timed
    step."""
    import torch
    from speculators.losses import utils

    find_kernel = utils._fused_kernel

    def fused_kernel(name: str):
        kernel = find_kernel(name)
        return torch.compiler.disable(kernel) if name == "fused_tv_loss" else kernel

    utils._fused_kernel = fused_kernel


# ---------------------------------------------------------------------------------------------------- data


def verifier_config(args: argparse.Namespace):
    """The verifier's config: our benchmarks' shapes (`dflash_trainer.shapes`, on PYTHONPATH from src/), tiny with
    `--tiny`."""
    from transformers import AutoConfig

    from dflash_trainer.shapes import QWEN3_8B, SMOLLM2_135M

    shape = dict(SMOLLM2_135M if args.setting == "smollm2" else QWEN3_8B)
    if args.tiny:
        shape.update(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=6)
        shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    config = AutoConfig.for_model(**shape)
    config.hidden_act = "silu"
    config.architectures = ["LlamaForCausalLM" if args.setting == "smollm2" else "Qwen3ForCausalLM"]
    return config


def documents(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(length, supervised from this position on) per document of the row."""
    if args.doc_lens != "smollm2":
        return [(int(n), 0) for n in args.doc_lens.split(",") if n]
    import numpy as np

    rng = np.random.default_rng(args.seed)
    docs, used = [], 0
    while True:
        prompt = int(rng.integers(30, 233))
        reply = 256 if rng.random() < 0.28 else int(rng.integers(4, 115))
        if args.tiny:
            prompt, reply = max(8, prompt // 4), max(4, reply // 4)
        if used + prompt + reply > args.total_seq_len:
            return docs
        docs.append((prompt + reply, prompt))
        used += prompt + reply


class PackedRow:
    """The row's fixed tensors (as speculators' collate function builds them) and its hidden states."""

    def __init__(self, args, docs, verifier, taps, device):
        import torch

        self.args, self.docs, self.verifier, self.taps, self.device = args, docs, verifier, taps, device
        self.width = args.total_seq_len
        self.tokens = sum(n for n, _ in docs)
        assert self.tokens <= self.width, f"documents hold {self.tokens} tokens, more than the row's {self.width}"
        loss_mask = torch.zeros(1, self.width, dtype=torch.long)
        position_ids = torch.zeros(1, self.width, dtype=torch.long)
        document_ids = torch.full((1, self.width), -1, dtype=torch.long)
        offset = 0
        for d, (length, supervised_from) in enumerate(docs):
            loss_mask[0, offset + supervised_from : offset + length] = 1
            position_ids[0, offset : offset + length] = torch.arange(length)
            document_ids[0, offset : offset + length] = d
            offset += length
        self.loss_mask, self.position_ids, self.document_ids = (
            t.to(device) for t in (loss_mask, position_ids, document_ids)
        )

    def hidden_states(self, seed: int):
        """Random tokens through the verifier: the taps' outputs [1, T, K*H], the last layer's output before the
        final norm [1, T, H] and the token ids [1, T]. Documents of one length go through in one batch, without
        padding (the paper's: two forwards); when there are more than 4 lengths (SmolLM2's ~65 documents), all go
        through in one right-padded batch with an attention mask, as a forward per document would be bound by
        kernel launches."""
        import torch

        lengths = [n for n, _ in self.docs]
        offsets = [sum(lengths[:d]) for d in range(len(lengths))]
        by_length: dict[int, list[int]] = {}
        for d, n in enumerate(lengths):
            by_length.setdefault(n, []).append(d)
        groups = list(by_length.values()) if len(by_length) <= 4 else [list(range(len(lengths)))]
        vocab = self.verifier.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        ids = [torch.randint(0, vocab - vocab // 16, (n,), generator=g) for n in lengths]  # spare the top rows
        hidden = last = None
        input_ids = torch.zeros(1, self.width, dtype=torch.long, device=self.device)
        for group in groups:
            taps, final = self._forward([ids[d] for d in group])
            if hidden is None:
                hidden = taps.new_zeros(1, self.width, taps.shape[-1])
                last = final.new_zeros(1, self.width, final.shape[-1])
            for row, d in enumerate(group):
                n, offset = lengths[d], offsets[d]
                hidden[0, offset : offset + n] = taps[row, :n]
                last[0, offset : offset + n] = final[row, :n]
                input_ids[0, offset : offset + n] = ids[d].to(self.device)
        return hidden, last, input_ids

    def _forward(self, sequences):
        """One verifier forward over `sequences` (right-padded, masked only when their lengths differ)."""
        import torch

        model = self.verifier.model
        longest = max(len(x) for x in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        attention = torch.zeros(len(sequences), longest, dtype=torch.long)
        for i, x in enumerate(sequences):
            ids[i, : len(x)], attention[i, : len(x)] = x, 1
        mask = None if bool(attention.all()) else attention.to(self.device)
        captured: dict = {}

        def keep_output(tap):
            def hook(module, inputs, output):
                captured[tap] = output[0] if isinstance(output, tuple) else output

            return hook

        def keep_last(module, inputs):
            captured["last"] = inputs[0]  # the final norm's input: the last layer's output

        handles = [model.layers[t].register_forward_hook(keep_output(t)) for t in self.taps]
        handles.append(model.norm.register_forward_pre_hook(keep_last))
        try:
            with torch.no_grad():
                model(input_ids=ids.to(self.device), attention_mask=mask, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return torch.cat([captured[t] for t in self.taps], dim=-1), captured["last"]

    def batch(self, features) -> dict:
        hidden, last, input_ids = features
        return {
            "hidden_states": hidden,
            "input_ids": input_ids,
            "verifier_last_hidden_states": last,
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
            "document_ids": self.document_ids,
            "error_records": 0,
        }


class InMemoryLoader:
    """Stands in for the DataLoader the Trainer iterates (len + iter, no batch sampler)."""

    batch_sampler = None

    def __init__(self, n: int, make_batch):
        self.n, self.make_batch = n, make_batch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield self.make_batch(i)


# ---------------------------------------------------------------------------------------------------- models


def build_verifier(vcfg, device):
    import torch
    from transformers import AutoModelForCausalLM

    vcfg._attn_implementation = "sdpa"
    with torch.device(device) if device.type == "cuda" else nullcontext():
        verifier = AutoModelForCausalLM.from_config(vcfg, dtype=torch.bfloat16)
    return verifier.to(device).eval().requires_grad_(False)


def write_verifier_stub(verifier, vcfg, directory: Path) -> None:
    """config.json and the tensors speculators reads from a verifier checkpoint (embedding, final norm, LM head;
    with tied embeddings it takes the embedding as the head, as for a real tied checkpoint)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    vcfg.save_pretrained(directory)
    tensors = {
        "model.embed_tokens.weight": verifier.model.embed_tokens.weight,
        "model.norm.weight": verifier.model.norm.weight,
    }
    if not vcfg.tie_word_embeddings:
        tensors["lm_head.weight"] = verifier.lm_head.weight
    save_file(
        {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors")
    )


def build_drafter(args, stub: Path, vocab: int, taps: list[int], device):
    import torch
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.train.cli import create_transformer_layer_config

    full = [] if args.sliding_window else list(range(args.num_layers))
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(stub),
        num_layers=args.num_layers,
        draft_arch="qwen3",
        hidden_act=None,
        sliding_window=args.sliding_window or 2048,
        full_attention_indices=full,
        mrope_full_head_hack=True,
    )
    if args.eager_block_mask:
        import speculators.models.dflash.core as dflash_core
        from torch.nn.attention.flex_attention import create_block_mask

        dflash_core._compiled_create_block_mask = create_block_mask
    with torch.device(device) if device.type == "cuda" else nullcontext():
        model = DFlash2DraftModel.from_training_args(
            verifier_config=layer_config,
            t2d=None,
            d2t=None,
            draft_vocab_size=vocab,
            block_size=args.block_size,
            verifier_name_or_path=str(stub),
            mask_token_id=args.mask_token_id,
            draft_attn_impl=args.attn,
            target_layer_ids=taps,
            sample_from_anchor=None,
            sliding_window_non_causal=None,
            conv_kernel_size=args.conv_kernel_size,
            conv_group_size=args.conv_group_size,
            selector_rank=args.selector_rank,
            selector_top_k=args.selector_top_k,
        )
    return model, layer_config


def trainer_kwargs(args, implementation: str) -> tuple[dict, dict]:
    from speculators.models.dflash2 import DFlash2DraftModel

    return DFlash2DraftModel.get_trainer_kwargs(
        loss_fn=args.loss_fn,
        loss_implementation=implementation,
        dflash_decay_gamma=args.gamma,
        max_anchors=args.max_anchors,
        per_position_loss_weight=args.per_position_loss_weight,
        dpace_alpha=args.dpace_alpha,
        selector_loss_alpha=args.selector_loss_alpha,
    )


def make_trainer(model, args, call_kwargs, loader, on_cuda: bool):
    import torch
    from speculators.model import SpeculatorModel
    from speculators.train.trainer import Trainer, TrainerConfig

    class BenchTrainer(Trainer):
        def setup_model(self):
            if on_cuda:
                return super().setup_model()
            # CPU check: the Trainer moves the model to cuda:<local rank> and autocasts on the accelerator's type.
            self.local_rank, self.device_type = "cpu", "cpu"
            SpeculatorModel.verify_training_compatible(self.model)
            if self.config.gradient_checkpointing:
                self.model.gradient_checkpointing_enable()

    config = TrainerConfig(
        lr=args.lr,
        num_epochs=1,
        save_path=str(Path(args.workdir) / "checkpoints"),
        train_call_kwargs=call_kwargs[0],
        val_call_kwargs=call_kwargs[1],
        optimizer=args.optimizer,
        weight_decay=0.01,
        muon_lr=args.lr,
        scheduler_type="cosine",
        scheduler_warmup_ratio=0.04,
        # A long schedule, so the timed steps run in its warm-up; with --tiny the run's own length, so the check
        # sees the learning rate reach its value and the loss move.
        scheduler_total_steps=args.warmup + args.steps if args.tiny else 100_000,
        hidden_states_dtype=torch.bfloat16,
        log_freq=10**9,  # its step timer synchronises on log steps: none after step 0
        gradient_checkpointing=args.gradient_checkpointing,
    )
    trainer = BenchTrainer(model, config, loader, None)
    if not on_cuda:
        trainer.global_step = 1  # step 0 is a log step, whose timer calls torch.accelerator.synchronize()
    return trainer


# ---------------------------------------------------------------------------------------------------- FLOPs


def flop_model(args, model, layer_config, vcfg, verifier, docs) -> dict:
    nq = args.max_anchors * args.block_size
    hidden, vocab = vcfg.hidden_size, vcfg.vocab_size
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    codebooks = sum(
        p.numel() for n, p in model.candidate_selector.named_parameters() if p.requires_grad and "codebook" in n
    )
    # Mean context an anchor sees: the positions of its document before it (within the window, if any), averaged
    # over the supervised positions of the row (where the anchors are drawn).
    contexts = [min(p, args.sliding_window) if args.sliding_window else p for n, start in docs for p in range(start, n)]
    mean_context = sum(contexts) / max(1, len(contexts))
    attention_fwd = (
        4
        * layer_config.num_attention_heads
        * layer_config.head_dim
        * nq
        * (mean_context + args.block_size)
        * args.num_layers
    )
    verifier_matmul = sum(p.numel() for p in verifier.parameters()) - verifier.model.embed_tokens.weight.numel()
    if not vcfg.tie_word_embeddings:
        verifier_matmul -= verifier.lm_head.weight.numel()
    verifier_attention = sum(
        4 * vcfg.num_hidden_layers * vcfg.num_attention_heads * vcfg.head_dim * n * (n + 1) / 2 for n, _ in docs
    )
    tokens = sum(n for n, _ in docs)
    return {
        "tokens_per_step": tokens,
        "anchors_per_step": args.max_anchors,
        "block_positions_per_step": nq,
        "mean_context_per_anchor": mean_context,
        "drafter_trainable_params": trainable,
        "selector_codebook_params": codebooks,
        "drafter_flops": nq * (6 * trainable + 4 * hidden * vocab),
        "drafter_flops_matmul": nq * (6 * (trainable - codebooks) + 4 * hidden * vocab),
        "drafter_attention_fwd_flops": attention_fwd,
        "verifier_fwd_flops": 2 * verifier_matmul * tokens + verifier_attention,
        "formulas": {
            "drafter": "Nq * (6 * P_trainable + 4 * H * V)",
            "drafter_matmul": "Nq * (6 * (P_trainable - selector codebooks) + 4 * H * V)",
            "attention_fwd": "4 * heads * head_dim * Nq * (mean_context + block) * layers",
            "verifier": "2 * (P - embedding - LM head) * T + 4 * layers * heads * head_dim * sum(doc^2 / 2)",
        },
    }


# ---------------------------------------------------------------------------------------------------- timing


def run_phase(name, trainer, loader, warmup, epoch, *, tokens, nq, device, args):
    """One pass of `train_epoch` over `loader`; a synchronised timestamp at the end of every step."""
    import torch

    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    stamps, losses = [], []
    model = trainer.model

    def keep_loss(module, inputs, output):
        _, loss, metrics = output
        losses.append(
            (
                loss.detach(),
                metrics.get("unary_loss_sum", loss).detach(),
                metrics.get("selector_loss_sum", loss).detach(),
            )
        )

    def step_done():
        sync()
        stamps.append(time.perf_counter())
        faulthandler.cancel_dump_traceback_later()
        log(f"  {name} step {len(stamps)}: {stamps[-1] - (stamps[-2] if len(stamps) > 1 else started):.3f} s")

    trainer.train_loader = loader
    hook = model.register_forward_hook(keep_loss)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    started = time.perf_counter()
    if args.stack_dump_s > 0:
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True, file=sys.stdout)
    try:
        trainer.train_epoch(epoch, step_callback=step_done)
    finally:
        faulthandler.cancel_dump_traceback_later()
        hook.remove()
    times = [b - a for a, b in zip([started, *stamps[:-1]], stamps, strict=True)]
    timed = sorted(times[warmup:])
    values = [[float(x) for x in triple] for triple in losses]
    phase = {
        "step_s": times,
        "first_step_s": times[0] if times else None,
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "loss": [v[0] for v in values],
        "unary_loss": [v[1] for v in values],
        "selector_loss": [v[2] for v in values],
        "loss_finite": all(math.isfinite(x) for v in values for x in v),
    }
    if timed:
        median = timed[len(timed) // 2] if len(timed) % 2 else (timed[len(timed) // 2 - 1] + timed[len(timed) // 2]) / 2
        phase.update(
            median_step_ms=1e3 * median,
            min_step_ms=1e3 * timed[0],
            mean_step_ms=1e3 * sum(timed) / len(timed),
            max_step_ms=1e3 * timed[-1],
            tokens_per_s=tokens / median,
            block_positions_per_s=nq / median,
        )
    if on_cuda:
        phase["peak_mem_alloc_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        phase["peak_mem_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
    summary = f"phase {name}: first step {times[0]:.2f} s" if times else f"phase {name}: no steps"
    if timed:
        summary += f", median {phase['median_step_ms']:.1f} ms, {phase['tokens_per_s']:,.0f} target tok/s"
    if on_cuda:
        summary += f", peak {phase['peak_mem_alloc_GiB']:.1f} GiB"
    if values:
        summary += f"; loss {values[0][0]:.4f} -> {values[-1][0]:.4f} (selector {values[-1][2]:.4f})"
    log(summary)
    return phase


def add_mfu(phase: dict, flops: float, peak_tflops: float) -> None:
    if "median_step_ms" in phase:
        phase["tflops_per_s"] = flops / (phase["median_step_ms"] / 1e3) / 1e12
        phase["mfu"] = phase["tflops_per_s"] / peak_tflops


# ---------------------------------------------------------------------------------------------------- main


def environment(device) -> dict:
    from importlib.metadata import version

    import torch
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    for package in ("speculators", "triton"):
        try:
            env[package] = version(package)
        except Exception:
            env[package] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main() -> None:
    args = parse_args()
    import torch

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    result: dict = {"tag": args.tag, "argv": sys.argv, "args": vars(args), "phases": {}}

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2, default=str))

    result["stubbed_modules"] = import_peer()
    result["env"] = environment(device)
    log(f"env {result['env']}")
    if args.loss_impl == "fused" and not args.no_autotuner_patch:
        try:
            result["fused_autotuner_lists_unshared"] = unshare_fused_loss_autotuners()
            tv_metric_outside_the_graph()
            result["tv_metric_outside_the_graph"] = True
        except Exception as error:
            log(f"fused-loss autotuner fix not applied: {type(error).__name__}: {error}")
    torch.manual_seed(args.seed)

    vcfg = verifier_config(args)
    if args.mask_token_id is None:  # tiny: the top row, which the random documents never use
        args.mask_token_id = vcfg.vocab_size - 1
    taps = [int(x) for x in args.target_layer_ids.split(",")]
    docs = documents(args)
    if args.max_anchors is None:  # smollm2: up to `anchors_per_doc` per document, where t and t + 1 are supervised
        args.max_anchors = sum(min(args.anchors_per_doc, n - start - 1) for n, start in docs)
    started = time.perf_counter()
    verifier = build_verifier(vcfg, device)
    log(
        f"verifier: {sum(p.numel() for p in verifier.parameters()) / 1e9:.3f}B parameters in "
        f"{time.perf_counter() - started:.1f} s"
    )
    stub = Path(args.workdir) / f"verifier-{args.setting}{'-tiny' if args.tiny else ''}"
    write_verifier_stub(verifier, vcfg, stub)

    row = PackedRow(args, docs, verifier, taps, device)
    supervised = int(row.loss_mask.sum())
    assert args.max_anchors <= supervised, f"{args.max_anchors} anchors but {supervised} supervised positions"
    result["data"] = {
        "documents": len(docs),
        "document_lengths": [n for n, _ in docs],
        "supervised_from": [s for _, s in docs],
        "row_width": row.width,
        "tokens_per_step": row.tokens,
        "supervised_tokens_per_step": supervised,
        "anchors_per_step": args.max_anchors,
    }
    log(
        f"row: {len(docs)} documents, {row.tokens} tokens ({supervised} supervised) in a row of {row.width}, "
        f"{args.max_anchors} anchors of block {args.block_size}"
    )
    started = time.perf_counter()
    static_features = row.hidden_states(0)
    if on_cuda:
        torch.cuda.synchronize()
    log(f"hidden states {tuple(static_features[0].shape)} in {time.perf_counter() - started:.1f} s")

    started = time.perf_counter()
    model, layer_config = build_drafter(args, stub, vcfg.vocab_size, taps, device)
    result["model"] = {
        "drafter_layers": args.num_layers,
        "layer_types": getattr(layer_config, "layer_types", None),
        "attention": args.attn,
        "block_size": model.block_size,
        "target_layer_ids": model.target_layer_ids,
        "mask_token_id": model.config.mask_token_id,
        "conv_kernel_size": model.config.conv_kernel_size,
        "conv_group_size": model.config.conv_group_size,
        "selector_rank": model.config.selector_rank,
        "selector_top_k": model.config.selector_top_k,
        "drafter_trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "drafter_total_params": sum(p.numel() for p in model.parameters()),
        "verifier_params": sum(p.numel() for p in verifier.parameters()),
    }
    log(f"drafter built in {time.perf_counter() - started:.1f} s: {result['model']}")
    flops = flop_model(args, model, layer_config, vcfg, verifier, docs)
    result["flops"] = flops
    save()

    nq = args.max_anchors * args.block_size
    timing = dict(tokens=row.tokens, nq=nq, device=device, args=args)
    steps = args.warmup + args.steps
    trainer = make_trainer(
        model, args, trainer_kwargs(args, args.loss_impl), InMemoryLoader(steps, lambda i: None), on_cuda
    )
    result["optimizers"] = [type(o).__name__ for o in trainer.optimizers]

    # (a) drafter only. On CUDA the fused loss is traced into the compiled forward; if that fails, retry with the
    # fused loss run eagerly (a graph break), then with speculators' eager loss. The JSON says which path ran.
    def fused_outside_compile():
        from speculators.losses import fused

        for name in ("fused_ce_loss", "fused_kl_div_loss", "fused_tv_loss"):
            setattr(fused, name, torch.compiler.disable(getattr(fused, name)))

    def eager_loss():
        kwargs = trainer_kwargs(args, "eager")
        trainer.config = trainer.config._replace(train_call_kwargs=kwargs[0], val_call_kwargs=kwargs[1])

    attempts = [(f"{args.loss_impl} loss, speculators' default path", None)]
    if on_cuda and args.loss_impl == "fused" and not args.no_fallback:
        attempts += [("fused loss outside torch.compile", fused_outside_compile), ("eager loss", eager_loss)]
    result["loss_path_errors"] = []
    for i, (description, prepare) in enumerate(attempts):
        if prepare is not None:
            torch._dynamo.reset()
            model.zero_grad(set_to_none=True)
            prepare()
        log(f"drafter only: {description}")
        try:
            loader = InMemoryLoader(steps, lambda i: row.batch(static_features))
            phase = run_phase("drafter_only", trainer, loader, args.warmup, 0, **timing)
        except Exception:
            result["loss_path_errors"].append({"path": description, "error": traceback.format_exc()[-6000:]})
            save()
            log(f"drafter only FAILED with {description}:\n{traceback.format_exc()[-3000:]}")
            if i == len(attempts) - 1:
                raise
            continue
        result["loss_path"] = description
        add_mfu(phase, flops["drafter_flops"], args.peak_tflops)
        result["phases"]["drafter_only"] = phase
        save()
        break

    # (b) end to end: the verifier forward in the loader before every drafter step.
    if args.e2e_steps and time.perf_counter() - T_START < args.time_budget:
        del static_features
        gc.collect()
        loader = InMemoryLoader(args.e2e_warmup + args.e2e_steps, lambda i: row.batch(row.hidden_states(1 + i)))
        try:
            phase = run_phase("end_to_end", trainer, loader, args.e2e_warmup, 1, **timing)
            add_mfu(phase, flops["drafter_flops"] + flops["verifier_fwd_flops"], args.peak_tflops)
            alone = []
            for j in range(3):
                if on_cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                row.hidden_states(1000 + j)
                if on_cuda:
                    torch.cuda.synchronize()
                alone.append(time.perf_counter() - t)
            phase["verifier_forward_alone_ms"] = [1e3 * t for t in alone]
            log(f"verifier forward alone: {', '.join(f'{1e3 * t:.1f}' for t in alone)} ms")
        except Exception:
            phase = {"error": traceback.format_exc()[-6000:]}
            log(f"end to end FAILED:\n{traceback.format_exc()[-3000:]}")
        result["phases"]["end_to_end"] = phase
    elif args.e2e_steps:
        log("end to end skipped: over the time budget")

    try:
        from torch._dynamo.utils import counters

        result["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
        result["dynamo_unique_graphs"] = counters["stats"].get("unique_graphs", 0)
    except Exception:
        pass
    result["wall_s"] = time.perf_counter() - T_START
    save()
    finite = all(p.get("loss_finite", False) for p in result["phases"].values())
    log(f"done in {result['wall_s']:.0f} s; losses finite: {finite}")
    if not finite:
        sys.exit(1)


if __name__ == "__main__":
    main()
