"""DFlash drafter checkpoints in the z-lab `DFlashDraftModel` format (what vLLM and SGLang load), and back.

An export is a directory with
  config.json        a Qwen3-style config plus the DFlash keys (see `REQUIRED_CONFIG_KEYS`)
  model.safetensors  the drafter's weights (bf16 by default), without embedding and LM head: the drafter
                     uses the target's, frozen

Weight names are the same in our `DFlashDrafter`, in z-lab checkpoints and in what vLLM (`qwen3_dflash`) and
SGLang read, with no prefix, so export and import are plain state-dict saves and loads:
  fc.weight                                   [H, K*H]    projection of the K concatenated target features
  hidden_norm.weight                          [H]         RMSNorm of the projected context
  layers.{i}.input_layernorm.weight           [H]
  layers.{i}.self_attn.q_proj.weight          [Hq*D, H]   (.bias too with attention_bias, also k/v/o)
  layers.{i}.self_attn.k_proj.weight          [Hkv*D, H]  applied to context and block tokens alike
  layers.{i}.self_attn.v_proj.weight          [Hkv*D, H]
  layers.{i}.self_attn.o_proj.weight          [H, Hq*D]
  layers.{i}.self_attn.q_norm.weight          [D]
  layers.{i}.self_attn.k_norm.weight          [D]
  layers.{i}.post_attention_layernorm.weight  [H]
  layers.{i}.mlp.gate_proj.weight             [I, H]
  layers.{i}.mlp.up_proj.weight               [I, H]
  layers.{i}.mlp.down_proj.weight             [H, I]
  norm.weight                                 [H]         final norm, read by the target's LM head
On import, `embed_tokens.*` / `lm_head.*` tensors (some checkpoints ship them) are dropped with a warning.
DFlash2 drafters (`DFlash2DraftModel`) add their architecture name, four `dflash_config` sizes and the
convolution and selector weights: `model/dflash2/export.py`.

In-block causality of sliding-window layers (DESIGN §2) is written twice: `dflash_config.sliding_causal_in_block`
(ours, per-layer exact) and, where it can express it, vLLM's `dflash_config.causal` (one flag for all layers;
full-attention layers are never causal, so `causal: false` is exact whenever sliding layers are not causal).
Importing a checkpoint without either key follows vLLM: layers that `layer_types` lists as sliding are causal
in-block, layers made sliding by `dflash_config.use_swa` (+ `swa_window_size`) are not.

Sliding-window layers carry their window the way every loader reads it: `layer_types` (one entry per layer),
`sliding_window` W and `use_sliding_window: true` (transformers' Qwen3Config, through which z-lab's
`DFlashDraftModel`, vLLM and SGLang all read the config, drops `sliding_window` when that flag is false, and the
engines then refuse or ignore the sliding layers), and `max_window_layers` where it says the same as `layer_types`
(sliding layers from that index on; a loader derives `layer_types` from it only when `layer_types` is absent).
Training applies the window as the engines do at inference (`model/attention.py`: keys within W positions of the
query, the query itself counted), so an export serves with the mask it was trained with. In-block causality: vLLM
follows `dflash_config.causal` (a non-causal sliding layer stays bidirectional only where vLLM widens its
FlashAttention window to both sides, PR #46104); SGLang runs sliding layers causal in-block whatever the config
says. `sliding_causal_in_block: true` is therefore what every engine serves alike.

An export describes itself (`provenance.py`): `exported_from` (the run's name and its training config's digest,
never a path of the training machine), `target_record` (the target's identity and tokenizer fingerprint, so that
`eval --drafter EXPORT` finds the target and refuses another one) and `training_record` (command, data, licences,
a digest of the weights); and it carries a model card, `README.md` (`model_card.py`), rewritten by
`refresh_model_card` when an evaluation of its weights exists. An existing export is replaced only by one from the
same source; replacing another run's export needs `overwrite=True`.

`check_drafter_fits_target` compares a drafter with the target it is about to run against (hidden size,
vocabulary, layer count, taps) so that a drafter of another target is refused with both values named, not found
by a matmul shape error.

Training checkpoints (`train/checkpoint.py`) hold `drafter.safetensors` (fp32) and `drafter_config.json`
(`dataclasses.asdict(DrafterModelConfig)`), written and read by `save_drafter_config` / `load_drafter_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .durable_io import fsync_dir, read_safetensors, write_bytes, write_safetensors
from .errors import OutputExistsError, UserError, is_storage_error, refuse_file_as_directory, storage_error
from .model.config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterModelConfig, default_target_layer_ids
from .model.dflash2 import DFlash2ModelConfig
from .model.dflash2 import export as dflash2_format
from .model.drafter import DFlashDrafter, build_drafter
from .model_card import CARD_FILE, has_training_record, render
from .provenance import SOURCE_KEY, TARGET_KEY, TRAINING_KEY, TargetRecord, drafter_digest

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_WEIGHTS_FILE = "drafter.safetensors"
CHECKPOINT_CONFIG_FILE = "drafter_config.json"
ARCHITECTURE = "DFlashDraftModel"
# Keys the reference loaders read from config.json: z-lab's DFlashDraftModel fails without the DFlash ones,
# vLLM/SGLang silently change behaviour without rope, norm eps or layer types.
REQUIRED_CONFIG_KEYS = (
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
)
# Tensors of the target that some checkpoints carry; our drafter always uses the target's own.
_TARGET_TENSOR_PREFIXES = ("embed_tokens.", "lm_head.")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


class CheckpointFormatError(UserError, ValueError):
    """A checkpoint directory is incomplete or describes a drafter this package cannot build."""


class DrafterMismatchError(UserError, ValueError):
    """A drafter does not fit the target it is asked to run with."""


# ----------------------------------------------------------------------------------------------------------
# Export


def export_config(config: DrafterModelConfig, *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The `config.json` of an export: `to_hf_config()` plus every key the reference loaders read."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype}: expected one of {list(_DTYPE_NAMES.values())}")
    data = config.to_hf_config().to_dict()
    rope = dict(config.rope_parameters)
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "sliding_causal_in_block": config.sliding_causal_in_block,
    }
    vllm_causal = _vllm_causal_flag(config)
    if vllm_causal is not None:
        dflash["causal"] = vllm_causal
    data.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        dflash_config=dflash,
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=rope,
        # Older loaders (transformers 4.x, as z-lab's code pins) read rope from these two keys.
        rope_theta=rope["rope_theta"],
        rope_scaling=_legacy_rope_scaling(rope),
        max_position_embeddings=config.max_position_embeddings,
        layer_types=list(config.layer_types),
        sliding_window=config.sliding_window,
        use_sliding_window=config.sliding_window is not None,
        max_window_layers=_first_of_sliding_suffix(config.layer_types),
        torch_dtype=_DTYPE_NAMES[dtype],
        dtype=_DTYPE_NAMES[dtype],
        attention_bias=config.attention_bias,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    if data["max_window_layers"] is None:
        del data["max_window_layers"]  # sliding layers that are no suffix: `layer_types` alone says which
    if isinstance(config, DFlash2ModelConfig):
        dflash2_format.add_export_keys(data, config)  # its architecture name, sizes and weights (model/dflash2/)
    return data


def _first_of_sliding_suffix(layer_types: list[str]) -> int | None:
    """`max_window_layers` as Qwen3Config reads it (layers from that index on slide), when it can say what
    `layer_types` says: the sliding layers are exactly the last ones (none: the layer count)."""
    first = len(layer_types)
    while first > 0 and layer_types[first - 1] == SLIDING_ATTENTION:
        first -= 1
    return first if SLIDING_ATTENTION not in layer_types[:first] else None


def _vllm_causal_flag(config: DrafterModelConfig) -> bool | None:
    """vLLM's one causality flag for all layers, when it can say what our per-layer setting says."""
    if not config.sliding_causal_in_block:
        return False  # no layer is causal in-block
    if all(kind == SLIDING_ATTENTION for kind in config.layer_types):
        return True
    return None  # causal sliding + non-causal full layers: vLLM's default for mixed configs, leave it unset


def _legacy_rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    if rope.get("rope_type", "default") == "default":
        return None
    return {key: value for key, value in rope.items() if key != "rope_theta"}


def export_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    extra_metadata: dict[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    target: TargetRecord | None = None,
    training: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `config.json` + `model.safetensors` + `README.md` into `out_dir`, atomically (temporary directory,
    then rename).

    `extra_metadata` (JSON-serialisable) goes under `training_metadata` in config.json; `source`
    (`provenance.run_source`: run name and config digest) under `exported_from`; `target` under `target_record`;
    `training` (`provenance.training_record`) under `training_record`, with the digest of the exported weights
    added. `evaluation`: an `eval.json` report, shown in the model card when it is of these weights. An existing
    `out_dir` is replaced only when it is an export of the same source (or `overwrite`); any other non-empty
    directory is refused before anything is written."""
    out_dir = Path(out_dir)
    source = None if source is None else dict(source)
    _refuse_foreign_directory(out_dir, source, overwrite=overwrite)
    config = export_config(drafter.config, dtype=dtype)
    if extra_metadata is not None:
        config["training_metadata"] = extra_metadata
    if source is not None:
        config[SOURCE_KEY] = source
    if target is not None:
        config[TARGET_KEY] = target.to_json()
    state = {
        name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, tensor in drafter.export_state_dict().items()
    }
    if training is not None:
        config[TRAINING_KEY] = {**training, "weights_digest": drafter_digest(state)}
    config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"  # fails early on unserialisable metadata
    card = render(config, evaluation) if has_training_record(config) else None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp_dir, ignore_errors=True)
    try:
        temp_dir.mkdir()
        write_safetensors(temp_dir / WEIGHTS_FILE, state, metadata={"format": "pt"})
        write_bytes(temp_dir / CONFIG_FILE, config_text.encode("utf-8"))
        if card is not None:
            write_bytes(temp_dir / CARD_FILE, card.encode("utf-8"))
        fsync_dir(temp_dir)
        _replace_directory(temp_dir, out_dir)
    except OSError as error:
        if is_storage_error(error):
            raise storage_error("the export", out_dir, error) from error
        raise
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return out_dir


def refresh_model_card(export_dir: str | Path, evaluation: Mapping[str, Any] | None) -> bool:
    """Rewrite the export's `README.md` with `evaluation` (an `eval.json` report) when the export is one of ours
    and the report is of its weights; returns whether the card now shows it."""
    export_dir = Path(export_dir)
    if not (export_dir / CONFIG_FILE).is_file():
        return False
    config = _read_json(export_dir / CONFIG_FILE)
    if not has_training_record(config):
        return False
    from .model_card import matching_evaluation

    shown = matching_evaluation(config, evaluation) is not None
    if shown:
        write_bytes(export_dir / CARD_FILE, render(config, evaluation).encode("utf-8"))
    return shown


def read_export_config(path: str | Path) -> dict[str, Any] | None:
    """An export directory's config.json (None for a directory that is no export, e.g. a training checkpoint)."""
    path = Path(path)
    return _read_json(path / CONFIG_FILE) if _is_export(path) else None


def check_drafter_fits_target(
    config: DrafterModelConfig, target_config: Any, *, drafter_source: str | Path, target_name: str
) -> None:
    """Refuse to run a drafter against a target it was not trained for, naming both values."""
    text = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
    pairs = [
        ("hidden size", config.hidden_size, text.hidden_size),
        ("vocabulary rows", config.vocab_size, text.vocab_size),
        ("target layers", config.num_target_layers, text.num_hidden_layers),
    ]
    rows = [f"{what} {mine} (drafter) vs {theirs} (target)" for what, mine, theirs in pairs if mine != theirs]
    if not rows and max(config.target_layer_ids) >= text.num_hidden_layers:
        rows.append(f"taps {config.target_layer_ids} vs {text.num_hidden_layers} target layers")
    if rows:
        raise DrafterMismatchError(
            f"drafter {drafter_source} does not fit target {target_name!r}: {'; '.join(rows)}. Pass the target it "
            "was trained for (--target, or the checkpoint's config.yaml when --target is left out)"
        )


def read_drafter_config(path: str | Path) -> DrafterModelConfig:
    """The drafter architecture of an export or a training checkpoint directory, without loading weights."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return drafter_config_from_export(_read_json(path / CONFIG_FILE), source=path / CONFIG_FILE)
    if (path / CHECKPOINT_CONFIG_FILE).is_file():
        return load_drafter_config(path / CHECKPOINT_CONFIG_FILE)
    raise CheckpointFormatError(f"{path}: no {CONFIG_FILE} (nor {CHECKPOINT_CONFIG_FILE}): not a drafter directory")


def _refuse_foreign_directory(out_dir: Path, source: dict[str, Any] | None, *, overwrite: bool) -> None:
    refuse_file_as_directory(out_dir)
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not _is_export(out_dir):
        raise OutputExistsError(f"{out_dir}: not empty and not a DFlash export; refusing to replace it")
    existing = _read_json(out_dir / CONFIG_FILE).get(SOURCE_KEY)
    if overwrite or existing == source:
        return
    raise OutputExistsError(
        f"{out_dir}: holds an export of {_describe_source(existing)}, not of {_describe_source(source)}; "
        "choose another --out, or pass --overwrite to replace it"
    )


def _describe_source(source: object) -> str:
    if isinstance(source, Mapping):
        return f"run {source.get('run')!r} (config {str(source.get('config_sha256'))[:19]})"
    return str(source) if source else "an unrecorded source"


def _is_export(path: Path) -> bool:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (
        ARCHITECTURE in (config.get("architectures") or []) or dflash2_format.is_dflash2_export(config)
    )


def _replace_directory(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing `target` is moved aside first and deleted after the swap."""
    if not target.exists():
        new.rename(target)
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Import


def import_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a drafter from an export (ours or z-lab's: `config.json` + `model.safetensors` or a sharded index)
    or from one of our training checkpoints (`drafter_config.json` + `drafter.safetensors`)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: drafter checkpoint directory not found")
    if not (path / CONFIG_FILE).is_file() and (path / CHECKPOINT_CONFIG_FILE).is_file():
        return load_training_drafter(path, device=device, dtype=dtype)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointFormatError(f"{path}: no {CONFIG_FILE} (nor {CHECKPOINT_CONFIG_FILE})")
    config = drafter_config_from_export(_read_json(config_path), source=config_path)
    return _build_drafter(config, _read_export_weights(path), source=path, device=device, dtype=dtype)


def drafter_config_from_export(data: dict[str, Any], *, source: str | Path = CONFIG_FILE) -> DrafterModelConfig:
    """Rebuild `DrafterModelConfig` from an export's config.json (ours, z-lab's, or written for vLLM)."""
    architectures = data.get("architectures") or []
    if ARCHITECTURE not in architectures and not dflash2_format.is_dflash2_export(data):
        raise CheckpointFormatError(f"{source}: architectures {architectures} lacks {ARCHITECTURE}")
    dflash = data.get("dflash_config")
    if not isinstance(dflash, dict):
        raise CheckpointFormatError(f"{source}: dflash_config: missing (not a DFlash drafter config)")
    if dflash.get("mask_token_id") is None:
        raise CheckpointFormatError(f"{source}: dflash_config.mask_token_id: missing")
    if dflash.get("attention_sink_bias"):
        raise CheckpointFormatError(f"{source}: dflash_config.attention_sink_bias: not supported by this drafter")
    if data.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"{source}: hidden_act {data['hidden_act']!r}: only silu is supported")
    for key, own_key in (("target_hidden_size", "hidden_size"), ("draft_vocab_size", "vocab_size")):
        if data.get(key) is not None and data[key] != data.get(own_key):
            raise CheckpointFormatError(f"{source}: {key} {data[key]}: must equal {own_key} {data.get(own_key)}")

    hidden = _required(data, "hidden_size", source)
    heads = _required(data, "num_attention_heads", source)
    num_layers = _required(data, "num_hidden_layers", source)
    num_target_layers = _required(data, "num_target_layers", source)
    layer_types, sliding_window = _layer_types(data, dflash, num_layers, source)
    target_layer_ids = dflash.get("target_layer_ids")
    if target_layer_ids is None:
        # z-lab's loader default: as many taps as drafter layers, spread like ours.
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    try:
        config = DrafterModelConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or hidden // heads,
            intermediate_size=_required(data, "intermediate_size", source),
            num_hidden_layers=num_layers,
            vocab_size=_required(data, "vocab_size", source),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
            block_size=_required(data, "block_size", source),
            mask_token_id=dflash["mask_token_id"],
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_parameters(data),
            max_position_embeddings=data.get("max_position_embeddings", 40960),
            layer_types=layer_types,
            sliding_window=sliding_window,
            sliding_causal_in_block=_sliding_causal(data, dflash, layer_types, source),
            attention_bias=bool(data.get("attention_bias", False)),
        )
        if dflash2_format.is_dflash2_export(data):
            config = dflash2_format.config_from_export(config, data)
        return config
    except ValueError as error:
        raise CheckpointFormatError(f"{source}: {error}") from error


def _required(data: dict[str, Any], key: str, source: str | Path) -> Any:
    if data.get(key) is None:
        raise CheckpointFormatError(f"{source}: {key}: missing")
    return data[key]


def _rope_parameters(data: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; 4.x configs (z-lab's) carry `rope_theta` + `rope_scaling`."""
    if data.get("rope_parameters"):
        return dict(data["rope_parameters"])
    scaling = dict(data.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_type": rope_type, **scaling, "rope_theta": float(data.get("rope_theta", 1e6))}


def _sliding_from_use_swa(data: dict[str, Any], dflash: dict[str, Any]) -> bool:
    """vLLM's reading: `use_swa` makes every layer slide unless `layer_types` lists sliding layers itself."""
    layer_types = data.get("layer_types")
    return bool(dflash.get("use_swa")) and (layer_types is None or SLIDING_ATTENTION not in layer_types)


def _layer_types(
    data: dict[str, Any], dflash: dict[str, Any], num_layers: int, source: str | Path
) -> tuple[list[str], int | None]:
    window = dflash.get("swa_window_size") or data.get("sliding_window")
    layer_types = data.get("layer_types")
    if _sliding_from_use_swa(data, dflash):
        layer_types = [SLIDING_ATTENTION] * num_layers
    elif layer_types is None:
        if data.get("use_sliding_window") and window:
            # What Qwen3Config derives when layer_types is absent (and what vLLM then sees).
            first_sliding = data.get("max_window_layers", num_layers)
            layer_types = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    unknown = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise CheckpointFormatError(f"{source}: layer_types: unsupported {sorted(unknown)}")
    if len(layer_types) != num_layers:
        raise CheckpointFormatError(f"{source}: layer_types has {len(layer_types)} entries for {num_layers} layers")
    if SLIDING_ATTENTION not in layer_types:
        return list(layer_types), None
    if not window:
        raise CheckpointFormatError(f"{source}: sliding_window: missing for sliding_attention layers")
    return list(layer_types), int(window)


def _sliding_causal(data: dict[str, Any], dflash: dict[str, Any], layer_types: list[str], source: str | Path) -> bool:
    if "sliding_causal_in_block" in dflash:
        return bool(dflash["sliding_causal_in_block"])
    if SLIDING_ATTENTION not in layer_types:
        return False
    if dflash.get("causal") is not None:
        if dflash["causal"] and FULL_ATTENTION in layer_types:
            raise CheckpointFormatError(
                f"{source}: dflash_config.causal true makes full-attention layers causal in-block; not supported"
            )
        return bool(dflash["causal"])
    # vLLM's default: layers listed as sliding are causal in-block, layers made sliding by use_swa are not.
    return not _sliding_from_use_swa(data, dflash)


def _read_export_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS_FILE).is_file():
        return read_safetensors(path / WEIGHTS_FILE, what="the drafter's weight file")
    index_path = path / WEIGHTS_INDEX_FILE
    if not index_path.is_file():
        raise CheckpointFormatError(f"{path}: no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE})")
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{index_path}: weight_map: missing")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(read_safetensors(path / shard, what="a shard of the drafter's weights"))
    return state


def _build_drafter(
    config: DrafterModelConfig,
    state: dict[str, torch.Tensor],
    *,
    source: Path,
    device: str | torch.device,
    dtype: torch.dtype,
) -> DFlashDrafter:
    dropped = sorted(name for name in state if name.startswith(_TARGET_TENSOR_PREFIXES))
    if dropped:
        warnings.warn(
            f"{source}: ignoring {dropped}: the drafter uses the target's embedding and LM head", stacklevel=3
        )
        state = {name: tensor for name, tensor in state.items() if name not in dropped}
    with torch.device(device):
        drafter = build_drafter(config)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointFormatError(
            f"{source}: weights do not match the config: missing {missing}, unexpected {unexpected}"
        )
    try:
        drafter.load_state_dict(state)
    except RuntimeError as error:  # shape mismatches
        raise CheckpointFormatError(f"{source}: {error}") from error
    return cast_keeping_rope_fp32(drafter, dtype)


def cast_keeping_rope_fp32(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """`drafter.to(dtype)` except the RoPE inverse frequencies, which stay float32: rounded to bf16 they are off
    by up to 2^-9 relative, a phase error of about a radian at position 1000 (serving engines keep them fp32)."""
    rope_buffers = {name: buffer.clone() for name, buffer in drafter.rotary_emb.named_buffers()}
    drafter.to(dtype=dtype)
    for name, buffer in rope_buffers.items():
        setattr(drafter.rotary_emb, name, buffer)
    return drafter


# ----------------------------------------------------------------------------------------------------------
# Training checkpoints


def drafter_config_json(config: DrafterModelConfig) -> str:
    """`drafter_config.json` of a training checkpoint: every field of `DrafterModelConfig`."""
    return json.dumps(dataclasses.asdict(config), indent=2) + "\n"


def save_drafter_config(config: DrafterModelConfig, path: str | Path) -> None:
    """Write `drafter_config_json(config)` atomically (temporary file, then rename)."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_text(drafter_config_json(config))
    temp.replace(path)


def load_drafter_config(path: str | Path) -> DrafterModelConfig:
    data = _read_json(Path(path))
    config_class = DFlash2ModelConfig if data.get("algorithm") == "dflash2" else DrafterModelConfig
    known = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointFormatError(f"{path}: unknown keys {unknown} (known: {sorted(known)})")
    try:
        return config_class(**data)
    except (TypeError, ValueError) as error:
        raise CheckpointFormatError(f"{path}: {error}") from error


def load_training_drafter(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """The drafter of a training checkpoint directory (`drafter_config.json` + `drafter.safetensors`)."""
    path = Path(path)
    config = load_drafter_config(path / CHECKPOINT_CONFIG_FILE)
    weights = path / CHECKPOINT_WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointFormatError(f"{path}: no {CHECKPOINT_WEIGHTS_FILE}")
    state = read_safetensors(weights, what="the drafter's weight file")
    return _build_drafter(config, state, source=path, device=device, dtype=dtype)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise CheckpointFormatError(f"{path}: cannot read: {error}") from error
    except ValueError as error:
        raise CheckpointFormatError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return data
