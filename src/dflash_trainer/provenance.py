"""What an export records about where it came from, so that it describes itself and travels without the run.

An export's `config.json` carries, beside the keys the serving engines read (`export.py`):

    exported_from     {"run": NAME, "config_sha256": DIGEST}: the run's name (its directory's last component) and
                      a digest of its resolved training config. Never a path: a shipped checkpoint must not publish
                      the training machine's directory layout (an export of the same run replaces an earlier one)
    target_record     the target it drafts for (`TargetRecord`): the name and what to load it by, its
                      architecture, layer count, hidden size, vocabulary rows and the fingerprint of its
                      tokenizer's vocabulary (the one shard manifests record, `data/shards.py`)
    training_record   how it was made: dflash-trainer's version, the command, ranks, optimizer steps, the training
                      data (prompt source, prompt sets with their pip packages and licences, token counts) and a
                      digest of the exported weights (`drafter_digest`), which an evaluation report also records,
                      so that a model card shows only an evaluation of these very weights

With the target record, `eval --drafter EXPORT` finds the target by itself (`locate_target`: a built-in name, the
recorded relative path or hub id where it exists, else a converted copy in the target cache) and refuses another
target naming both (`check_target`). Paths are written only relative or shortened to `.../NAME`
(`portable_path`); the tests check an export for absolute paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

import torch

from . import __version__
from .errors import UserError

if TYPE_CHECKING:
    from .config import RunConfig
    from .targets.loader import LoadedTarget

SOURCE_KEY = "exported_from"
TARGET_KEY = "target_record"
TRAINING_KEY = "training_record"


class TargetMismatchError(UserError, ValueError):
    """An export is asked to run with another target than the one it records, or its target cannot be found."""


# ----------------------------------------------------------------------------------------------------------
# Paths and commands without the training machine's directory layout


def is_absolute_path(text: str) -> bool:
    return PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute() or text.startswith("~")


def portable_path(text: str) -> str:
    """A relative path or a name as is; an absolute one shortened to `.../LAST` (the layout above it is private)."""
    if not is_absolute_path(text):
        return text
    name = PurePosixPath(text.replace("\\", "/")).name
    return f".../{name}" if name else "..."


def portable_command(argv: Sequence[str]) -> str:
    """`dflash-trainer ARGS` with every absolute path (alone or as `key=VALUE`, `--opt=VALUE`) made portable."""
    words = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not is_absolute_path(arg):
            words.append(f"{key}={portable_path(value)}")
        else:
            words.append(portable_path(arg))
    return shlex.join(["dflash-trainer", *words])


def config_digest(config: RunConfig) -> str:
    """sha256 of the resolved training config (canonical JSON): the same for the config saved with every
    checkpoint of the run, so a later `dflash-trainer export` of the run records the same source."""
    from .config import config_to_dict

    text = json.dumps(config_to_dict(config), sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_source(run_dir: str | Path, config: RunConfig | None) -> dict[str, Any]:
    """`exported_from`: the run's name and its config's digest (None for a drafter directory without a config)."""
    return {"run": Path(run_dir).name, "config_sha256": config_digest(config) if config is not None else None}


# ----------------------------------------------------------------------------------------------------------
# The target


@dataclass(frozen=True)
class TargetRecord:
    """Which target an export drafts for: enough to find it again and to tell another target from it."""

    name: str  # display name: built-in name, directory name, GGUF stem or hub id
    name_or_path: str | None  # what to load it by (a built-in name, hub id or relative path); None if not portable
    architecture: str  # the decoder's `model_type` (llama, qwen3, qwen3_5_text): the same from a GGUF or HF copy
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_fingerprint: str

    @classmethod
    def of(cls, target: LoadedTarget, name_or_path: str) -> TargetRecord:
        return cls.from_parts(target.name, name_or_path, target.config, target.tokenizer)

    @classmethod
    def from_parts(cls, name: str, name_or_path: str, config: Any, tokenizer: Any) -> TargetRecord:
        """From the target's config and tokenizer, without its weights (`config`: full or text config)."""
        from .data.shards import tokenizer_fingerprint

        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return cls(
            name=name,
            name_or_path=None if is_absolute_path(name_or_path) else name_or_path,
            architecture=str(text.model_type),
            num_hidden_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        )

    @classmethod
    def read(cls, name_or_path: str, *, cache_dir: str | None = None) -> TargetRecord:
        """The record of a target read from its files, without loading its weights (`dflash-trainer export`)."""
        from transformers import AutoConfig, AutoTokenizer

        from .targets.loader import TargetLoadError, model_source

        source, name = model_source(name_or_path, cache_dir=cache_dir)
        try:
            config, tokenizer = AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise TargetLoadError(f"target {name_or_path!r}: cannot read config or tokenizer: {error}") from error
        return cls.from_parts(name, name_or_path, config, tokenizer)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TargetRecord:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: data.get(key) for key in fields})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (
            f"{self.name!r} ({self.architecture}, {self.num_hidden_layers} layers, hidden {self.hidden_size}, "
            f"vocabulary {self.vocab_size})"
        )

    def differences(self, other: TargetRecord) -> list[str]:
        """What tells `other` apart from this target: identity fields, then the tokenizer's vocabulary."""
        rows = [
            f"{label} {mine} vs {theirs}"
            for label, mine, theirs in (
                ("architecture", self.architecture, other.architecture),
                ("layers", self.num_hidden_layers, other.num_hidden_layers),
                ("hidden size", self.hidden_size, other.hidden_size),
                ("vocabulary rows", self.vocab_size, other.vocab_size),
            )
            if mine != theirs
        ]
        if self.tokenizer_fingerprint != other.tokenizer_fingerprint:
            rows.append("tokenizer vocabulary differs (token ids would mean other text)")
        return rows


def read_target_record(export_config: Mapping[str, Any]) -> TargetRecord | None:
    """The target record of an export's config.json (None: an export without one, e.g. z-lab's or an older one)."""
    data = export_config.get(TARGET_KEY)
    return TargetRecord.from_json(data) if isinstance(data, Mapping) else None


def locate_target(record: TargetRecord, *, cache_dir: str | None = None) -> str | None:
    """What to load the recorded target by on this machine, or None: the built-in name, the recorded relative path
    or hub id when it is here, else a converted copy in the target cache (`<cache>/targets/NAME[-...]`)."""
    from .targets.loader import BUILTIN_GGUF_TARGETS, cache_root

    recorded = record.name_or_path
    if recorded in BUILTIN_GGUF_TARGETS:
        return recorded
    if recorded and Path(recorded).expanduser().exists():
        return recorded
    if recorded and _in_hub_cache(recorded):
        return recorded
    targets_dir = cache_root(cache_dir) / "targets"
    if targets_dir.is_dir():
        for candidate in sorted(targets_dir.iterdir()):
            named = candidate.name == record.name or candidate.name.startswith(f"{record.name}-")
            if named and (candidate / "config.json").is_file():
                return str(candidate)
    return None


def _in_hub_cache(name: str) -> bool:
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id
        return False


def check_target(record: TargetRecord, target: LoadedTarget, name_or_path: str, *, drafter_source: str | Path) -> None:
    """Refuse to run an export with another target than the one it records, naming both."""
    loaded = TargetRecord.of(target, name_or_path)
    differences = record.differences(loaded)
    if differences:
        raise TargetMismatchError(
            f"drafter {drafter_source} was trained for target {record.describe()}, not {loaded.describe()}: "
            f"{'; '.join(differences)}. Pass the target it was trained for with --target"
        )


# ----------------------------------------------------------------------------------------------------------
# Training data and weights


def data_record(config: RunConfig) -> dict[str, Any]:
    """The training data of a run: its prompt source, the prompt sets behind it (pip package and licence each),
    and the token counts of its shards' manifest when it is there.

    The sets of a mixture are those that can give it prompts under the run's `prepare.limit` and category shares
    (`prepare.shares`, else the mixture's defaults): `prompts.contributing_sets`, which leaves a set out only when
    it is certain to give none and never builds the mixture. A set listed may still give none for other reasons
    (a limit smaller than the sets)."""
    from .data.prompts import PROMPT_SETS, contributing_sets, split_set_name

    source = config.prepare.source
    record: dict[str, Any] = {
        "source": portable_path(source) if source else None,
        "limit": config.prepare.limit,
        "answered_by_target": config.prepare.regenerate,
        "max_new_tokens": config.prepare.max_new_tokens if config.prepare.regenerate else None,
        "shards": portable_path(config.data.train_shards),
        "sets": [],
    }
    name = split_set_name(source, "all")[0] if source else ""
    for set_name in contributing_sets(name, config.prepare.limit, config.prepare.shares):
        if set_name in PROMPT_SETS:
            builtin = PROMPT_SETS[set_name]
            package = f"{builtin.package.package}=={builtin.package.version}"
            record["sets"].append({"name": set_name, "package": package, "licence": builtin.licence})
    manifest = Path(config.data.train_shards) / "manifest.json"
    try:
        counts = json.loads(manifest.read_text(encoding="utf-8"))
        record.update({key: int(counts[key]) for key in ("num_samples", "num_tokens", "num_loss_tokens")})
    except (OSError, ValueError, KeyError, TypeError):
        pass  # shards elsewhere (another machine) or older: the counts are left out
    return record


def training_record(
    config: RunConfig | None, *, command: str | None, ranks: int | None, steps: int | None
) -> dict[str, Any]:
    return {
        "dflash_trainer_version": __version__,
        "command": command,
        "ranks": ranks,
        "steps": steps,
        "data": data_record(config) if config is not None else None,
    }


def drafter_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes and bf16 values: equal for a drafter, its bf16 export, and that
    export read back in float32 (bf16 -> fp32 -> bf16 is exact), so an evaluation names the weights it ran."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        digest.update(f"{name}:{list(tensor.shape)};".encode())
        digest.update(tensor.view(torch.int16).numpy().tobytes())
    return "sha256:" + digest.hexdigest()
