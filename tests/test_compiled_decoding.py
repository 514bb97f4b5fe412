"""The drafter compiled for decoding (`DFlashDrafter.compile_for_decoding`): the same drafts as the eager drafter, so
speculative decoding stays lossless with the same accepted lengths, for DFlash and DFlash2; the evaluation and the
CLI take the option and the report records it; with Inductor a decoding step runs fewer kernels."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from decoding_helpers import cpu_target, one_thread, tiny_qwen3_target  # noqa: F401 (one_thread: autouse fixture)
from dflash_trainer import cli
from dflash_trainer.decoding.plain import target_generate_batch
from dflash_trainer.decoding.speculative import SpeculativeDecoder
from dflash_trainer.model.drafter import DFlashDrafter
from test_dflash2_decoding import dflash2_drafter
from test_dflash2_decoding import prompts as dflash2_prompts
from test_speculative import drafter_for


def drafter_of(algorithm: str, target, block_size: int = 4) -> DFlashDrafter:
    """A random two-layer drafter; DFlash2's with its convolutions and selector away from their no-op start."""
    if algorithm == "dflash":
        return drafter_for(target, block_size=block_size, seed=1)
    return dflash2_drafter(target, block_size=block_size, seed=1)


def prompts() -> list[list[int]]:
    return dflash2_prompts(3)


class GraphCounter:
    """A dynamo backend that runs the traced graph as it is (same ops, same numbers) and counts the graphs."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return graph_module.forward


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2"])
def test_the_compiled_drafter_drafts_what_the_eager_one_drafts(algorithm):
    torch._dynamo.reset()
    target = tiny_qwen3_target()
    eager = drafter_of(algorithm, target)
    compiled = copy.deepcopy(eager)
    counter = GraphCounter()
    compiled.compile_for_decoding(backend=counter)
    common = dict(max_new_tokens=20, stop_token_ids=[])
    reference = target_generate_batch(target, prompts(), **common).results
    for batch in (prompts(), prompts()[:1]):  # three rows, then one (a size-1 batch compiles once more)
        expected = SpeculativeDecoder(target, eager, batch, **common).run().results
        got = SpeculativeDecoder(target, compiled, batch, **common).run().results
        assert [r.output_ids for r in got] == [r.output_ids for r in expected]
        assert [r.accepted_lengths for r in got] == [r.accepted_lengths for r in expected]
        assert [r.output_ids for r in got] == [r.output_ids for r in reference[: len(batch)]]
    # Through compiled code, and a handful of graphs (symbolic sizes), not one per call or per module.
    assert 2 <= counter.graphs <= 14, counter.graphs


@pytest.mark.parametrize("asked", [True, None], ids=["asked", "default-on-cpu"])
def test_evaluate_compiles_the_drafter_when_asked_and_says_so(tiny_chat_tokenizer, tmp_path, monkeypatch, asked):
    from dflash_trainer.eval.runner import evaluate

    model = tiny_qwen3_target(vocab=len(tiny_chat_tokenizer))
    target = cpu_target(model, tiny_chat_tokenizer, "tiny-qwen3")
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{2 * i} w{3 * i}"}) + "\n" for i in range(3))
    )
    torch._dynamo.reset()  # no graphs of other tests' backends in the code objects' caches
    calls = []
    counter = GraphCounter()
    original = DFlashDrafter.compile_for_decoding

    def without_inductor(self, backend="inductor"):  # the CPU suite has no C++ compiler to count on
        calls.append(backend)
        original(self, backend=counter)

    monkeypatch.setattr(DFlashDrafter, "compile_for_decoding", without_inductor)
    report = evaluate(
        target,
        drafter_of("dflash", model),
        [str(prompt_file)],
        num_prompts=3,
        max_new_tokens=8,
        progress=False,
        batch_size=3,
        out_dir=tmp_path / "eval",
        compile_drafter=asked,
    )
    assert report.datasets[0].exact_matches == 3  # lossless with the compiled drafter
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["compiled_drafter"] is bool(asked)
    if asked is None:  # the default compiles on a GPU only: on the CPU, compiling costs more than it saves
        assert calls == [] and counter.graphs == 0 and not report.compiled_drafter
        return
    assert calls == ["inductor"] and report.compiled_drafter
    assert 1 <= counter.graphs <= 8, counter.graphs  # decoded through compiled code, within dynamo's cache limit
    assert "drafter compiled" in report.format_table()


def test_the_eval_command_takes_the_compile_option():
    args = cli.build_parser().parse_args(["eval", "--drafter", "runs/x/export", "--compile-drafter"])
    assert args.compile_drafter is True
    assert cli.build_parser().parse_args(["eval", "--drafter", "runs/x/export"]).compile_drafter is None
    args = cli.build_parser().parse_args(["eval", "--drafter", "runs/x/export", "--no-compile-drafter"])
    assert args.compile_drafter is False


def _ops_per_step(decoder: SpeculativeDecoder) -> int:
    """Eager aten ops that launch work (views left out) plus Inductor's fused kernels, in one decoding step."""
    views = {"view", "as_strided", "expand", "slice", "select", "unsqueeze", "t", "transpose", "empty", "detach"}
    views |= {"alias", "squeeze", "permute", "empty_strided", "_unsafe_view", "reshape", "unbind", "split", "to"}
    views |= {"split_with_sizes", "narrow", "expand_as", "view_as", "contiguous", "flatten", "item", "_to_copy"}
    views |= {"resolve_conj", "resolve_neg", "result_type", "_local_scalar_dense", "lift_fresh", "unflatten"}

    def counts(event) -> bool:
        return event.name.startswith("aten::") and event.name[6:] not in views

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        decoder._step(decoder.cache.max_len)
    events = profile.events()
    fused = sum("cpp_fused" in event.name for event in events)
    leaves = sum(counts(event) and not any(counts(child) for child in event.cpu_children) for event in events)
    return fused + leaves


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU kernels need a C++ compiler")
def test_with_inductor_a_dflash2_step_runs_fewer_kernels():
    """Why the option exists: at batch 1 a step's time follows its kernel count (compile_for_decoding)."""
    import torch._inductor.config as inductor_config

    # Fused kernels show in the profile. Through the config's own patch: monkeypatch's undo on a sub-config deletes
    # the key (torch 2.13), and every later Inductor compile in the process then fails on it.
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        torch._dynamo.reset()
        target = tiny_qwen3_target()
        eager = drafter_of("dflash2", target, block_size=8)
        compiled = copy.deepcopy(eager)
        compiled.compile_for_decoding()
        ops = {}
        for name, drafter in (("eager", eager), ("compiled", compiled)):
            decoder = SpeculativeDecoder(target, drafter, prompts()[:1], max_new_tokens=40, stop_token_ids=[])
            with torch.inference_mode():  # as `run` decodes
                decoder._prefill()
                decoder._step(decoder.cache.max_len)  # compiles the batch-1 shapes
                ops[name] = _ops_per_step(decoder)
        # The two-layer drafter's norms, MLPs, convolutions and walk: about a third of the step's ops eager.
        assert ops["compiled"] < 0.85 * ops["eager"], ops
