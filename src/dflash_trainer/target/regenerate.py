"""Replace the assistant turns of chat data with the target's own responses (the DFlash paper's data recipe).

A drafter learns to predict what the target would write; training on responses written by another model
teaches it a distribution the target does not follow, and acceptance drops. For each conversation the system
and user turns are kept and every assistant turn is generated again, in order, each from the conversation
before it with the earlier assistant turns already regenerated. A conversation that ends in a user turn (a
prompt) gets a generated final assistant turn.

Output: `out_dir/regen-XXXXX.jsonl`, one `{"id", "messages"}` record per line, shard i holding input records
[i*shard_size, (i+1)*shard_size) in input order. A shard is written to a temporary file and renamed into place
when complete, so an interruption loses at most the shard in progress; a rerun with the same settings skips
the finished shards (checking that their ids match the input) and continues. `regen.json` holds the settings
of the run (a rerun with other settings is refused) and, once done, the totals.

Records whose regenerated reply is empty (the target stopped at once) are left out and counted, since an empty
assistant turn cannot be trained on. Generation uses transformers `generate` with a KV cache and left padding,
prompts sorted by length within a shard; when vLLM is installed and the target is on a GPU it is used instead
(same prompts, same output format).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from dflash_trainer.data.chat import ChatMessage, RecordError, normalize_record
from dflash_trainer.data.prepare import read_chat_records
from dflash_trainer.data.prompts import Prompt
from dflash_trainer.errors import UserError
from dflash_trainer.target.loader import LoadedTarget

SHARD_PATTERN = "regen-{:05d}.jsonl"
SETTINGS_FILE = "regen.json"
FORMAT = "dflash-regen/1"
DEFAULT_SHARD_SIZE = 1000


class RegenerateError(UserError, ValueError):
    """Bad input records, or an output directory that holds a different run."""


@dataclass
class Conversation:
    id: str
    messages: list[ChatMessage]


@dataclass
class RegenerateSummary:
    out_dir: str
    files: list[str] = field(default_factory=list)
    records: int = 0  # records written, over all shards
    resumed_records: int = 0  # of those, found already written by an earlier run
    empty_responses: int = 0  # records left out this run because a reply came back empty
    responses: int = 0  # assistant turns generated this run
    truncated: int = 0  # of those, cut by max_new_tokens before a stop token
    new_tokens: int = 0
    seconds: float = 0.0

    def format(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"regenerated {self.responses:,} assistant turns ({self.new_tokens:,} tokens, {rate:,.0f} tokens/s, "
            f"{self.truncated:,} cut at max_new_tokens); {self.records:,} records in {len(self.files)} shards "
            f"-> {self.out_dir}"
        )
        if self.resumed_records:
            text += f"; {self.resumed_records:,} records were already done"
        if self.empty_responses:
            text += f"; {self.empty_responses:,} records left out for an empty reply"
        return text


def regenerate(
    records: str | Path | Sequence[Any],
    target: LoadedTarget,
    out_dir: str | Path,
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    shard_size: int = DEFAULT_SHARD_SIZE,
    limit: int | None = None,
    progress: bool = True,
    engine: Literal["auto", "hf", "vllm"] = "auto",
) -> RegenerateSummary:
    """Write `records` with every assistant turn replaced by the target's response into `out_dir`.

    `records`: a chat JSONL path (records with `messages`, ShareGPT `conversations` or `prompt`[+`response`],
    optional `id`), or a list of conversations (lists of `{"role", "content"}`), such records, or `Prompt`s.
    `temperature` 0 is greedy decoding; sampling seeds derive from `seed`, the shard and the turn, so a
    resumed run writes what an uninterrupted one would have. `limit` takes the first that many records.
    `engine` `auto` picks vLLM when it is installed and the target is on a GPU, else transformers.
    """
    if max_new_tokens < 1 or batch_size < 1 or shard_size < 1:
        raise ValueError("max_new_tokens, batch_size and shard_size must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    conversations = load_conversations(records, limit=limit)
    if not conversations:
        raise RegenerateError(f"{records if isinstance(records, (str, Path)) else 'records'}: no records")
    out_path = Path(out_dir)
    settings = {
        "format": FORMAT,
        "target": target.name,
        "num_records": len(conversations),
        "shard_size": shard_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
    }
    _claim_out_dir(out_path, settings)
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    generator = _make_engine(engine, target=target, sampling=sampling, batch_size=batch_size)

    shards = [conversations[i : i + shard_size] for i in range(0, len(conversations), shard_size)]
    shard_files = [out_path / SHARD_PATTERN.format(index) for index in range(len(shards))]
    pending_turns = sum(
        len(_assistant_slots(c.messages))
        for shard, path in zip(shards, shard_files, strict=True)
        if not path.is_file()
        for c in shard
    )
    summary = RegenerateSummary(out_dir=str(out_path))
    start_time = time.perf_counter()
    with tqdm(total=pending_turns, unit="turn", desc="regenerate", disable=not progress, dynamic_ncols=True) as bar:

        def on_progress(responses: int, tokens: int) -> None:
            summary.responses += responses
            summary.new_tokens += tokens
            bar.update(responses)
            bar.set_postfix_str(f"{summary.new_tokens / max(time.perf_counter() - start_time, 1e-9):,.0f} tok/s")

        for shard_index, (shard, shard_file) in enumerate(zip(shards, shard_files, strict=True)):
            if shard_file.is_file():
                written = _check_finished_shard(shard_file, shard)
                summary.resumed_records += written
            else:
                regenerated = _regenerate_shard(
                    shard,
                    target,
                    generator,
                    seed=_derive_seed(seed, shard_index),
                    summary=summary,
                    on_progress=on_progress,
                )
                _write_shard_atomically(shard_file, regenerated)
                written = len(regenerated)
            summary.records += written
            summary.files.append(str(shard_file))
    summary.seconds = time.perf_counter() - start_time
    _write_json_atomically(out_path / SETTINGS_FILE, {**settings, "complete": True, "summary": asdict(summary)})
    return summary


# ----------------------------------------------------------------------------------------------------------
# Input records


def load_conversations(records: str | Path | Sequence[Any], *, limit: int | None = None) -> list[Conversation]:
    """Input records as `Conversation`s; errors name the file and line (or the list index) and the field."""
    conversations: list[Conversation] = []
    if isinstance(records, (str, Path)):
        path = Path(records)
        for line_no, record in read_chat_records(path):
            if limit is not None and len(conversations) >= limit:
                break
            messages = _normalize(record, where=f"{path}:{line_no}")
            conversations.append(Conversation(_record_id(record, default=f"{path.name}:{line_no}"), messages))
        return conversations
    for index, item in enumerate(records[:limit] if limit is not None else records):
        where = f"records[{index}]"
        if isinstance(item, Prompt):
            conversations.append(Conversation(item.id, _normalize({"messages": item.messages}, where=where)))
        elif isinstance(item, Mapping):
            conversations.append(Conversation(_record_id(item, default=str(index)), _normalize(item, where=where)))
        else:
            conversations.append(Conversation(str(index), _normalize({"messages": item}, where=where)))
    return conversations


def _normalize(record: Any, *, where: str) -> list[ChatMessage]:
    try:
        messages = normalize_record(record, require_assistant=False)
    except RecordError as error:
        raise RegenerateError(f"{where}: {error}") from error
    # Only role and content: the assistant turns (and any reasoning they carried) are replaced anyway.
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _record_id(record: Mapping[str, Any], *, default: str) -> str:
    value = record.get("id") if isinstance(record, Mapping) else None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else default


def _assistant_slots(messages: list[ChatMessage]) -> list[int]:
    """Message indices to generate: every assistant turn, plus one appended after a final non-assistant turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


# ----------------------------------------------------------------------------------------------------------
# One shard


def _regenerate_shard(
    shard: list[Conversation],
    target: LoadedTarget,
    generator: Engine,
    *,
    seed: int,
    summary: RegenerateSummary,
    on_progress: Callable[[int, int], None],
) -> list[Conversation]:
    """The shard's conversations with regenerated assistant turns, in input order, minus empty replies."""
    working = [Conversation(c.id, [dict(m) for m in c.messages]) for c in shard]
    slots = [_assistant_slots(c.messages) for c in shard]
    empty: set[int] = set()
    # Round r generates the r-th assistant turn of every conversation that has one, so that turn r+1 is
    # generated from a history whose earlier turns are already the target's own.
    for round_index in range(max(len(s) for s in slots)):
        members = [i for i, s in enumerate(slots) if len(s) > round_index and i not in empty]
        if not members:
            break
        prompts = [chat_prompt_ids(target, working[i].messages[: slots[i][round_index]]) for i in members]
        outputs = generator.generate(prompts, seed=_derive_seed(seed, round_index), on_progress=on_progress)
        for member, new_ids in zip(members, outputs, strict=True):
            reply_ids, stopped = cut_at_stop(new_ids, target.stop_token_ids)
            summary.truncated += 0 if stopped else 1
            text = target.tokenizer.decode(reply_ids, skip_special_tokens=False)
            if not text.strip():
                empty.add(member)
                continue
            reply = {"role": "assistant", "content": text}
            slot = slots[member][round_index]
            if slot == len(working[member].messages):
                working[member].messages.append(reply)
            else:
                working[member].messages[slot] = reply
    summary.empty_responses += len(empty)
    return [c for i, c in enumerate(working) if i not in empty]


def chat_prompt_ids(target: LoadedTarget, messages: list[ChatMessage]) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the assistant generation prompt."""
    # Rendered to text and tokenised without extra special tokens, as `data.chat` tokenises training data.
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(target.tokenizer(text, add_special_tokens=False)["input_ids"])


def cut_at_stop(new_ids: Sequence[int], stop_token_ids: Iterable[int]) -> tuple[list[int], bool]:
    """(the reply's token ids before the first stop token, whether a stop token was produced)."""
    stops = set(stop_token_ids)
    for position, token_id in enumerate(new_ids):
        if token_id in stops:
            return list(new_ids[:position]), True
    return list(new_ids), False


def _derive_seed(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ----------------------------------------------------------------------------------------------------------
# Engines: prompts in, new token ids out (stop token included, padding removed)


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float


class Engine:
    def generate(
        self, prompts: list[list[int]], *, seed: int, on_progress: Callable[[int, int], None]
    ) -> list[list[int]]:
        raise NotImplementedError


class HFEngine(Engine):
    """transformers `generate`: batches of `batch_size` prompts of similar length, left-padded, KV cache."""

    def __init__(self, target: LoadedTarget, *, sampling: Sampling, batch_size: int) -> None:
        self.target = target
        self.batch_size = batch_size
        pad_id = target.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(f"target {target.name}: the tokenizer has no pad token (load_target sets one)")
        self.pad_id = int(pad_id)
        # Set explicitly: unset knobs are filled from the model's generation_config (Qwen2.5 ships
        # repetition_penalty 1.05, Qwen3 top_k 20), and the run must do what its settings say. Sampling-only
        # knobs stay unset (None) for greedy decoding: transformers would warn that it ignores them.
        sample = sampling.temperature > 0
        self.generation_config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            top_k=0 if sample else None,
            repetition_penalty=1.0,
            eos_token_id=list(target.stop_token_ids),
            pad_token_id=self.pad_id,
        )

    def generate(
        self, prompts: list[list[int]], *, seed: int, on_progress: Callable[[int, int], None]
    ) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[list[int]] = [[] for _ in prompts]
        stops = set(self.target.stop_token_ids)
        for batch_index, start in enumerate(range(0, len(order), self.batch_size)):
            indices = order[start : start + self.batch_size]
            new_ids = self._generate_batch([prompts[i] for i in indices], seed=_derive_seed(seed, batch_index))
            tokens = 0
            for index, row in zip(indices, new_ids, strict=True):
                results[index] = _trim_after_stop(row, stops)
                tokens += len(results[index])
            on_progress(len(indices), tokens)
        return results

    def _generate_batch(self, prompts: list[list[int]], *, seed: int) -> list[list[int]]:
        device = self.target.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            output = self.target.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
            )  # [B, P + new]
        return output[:, width:].tolist()


class VLLMEngine(Engine):
    """vLLM on the target's weights directory: one call per round, vLLM schedules the batches itself."""

    def __init__(self, target: LoadedTarget, *, sampling: Sampling) -> None:
        from vllm import LLM

        if target.model_dir is None:
            raise ValueError(f"target {target.name}: vLLM needs a local model directory")
        self.sampling = sampling
        self.stop_token_ids = list(target.stop_token_ids)
        free, total = torch.cuda.mem_get_info(target.device)
        # The transformers copy of the target already sits on this GPU; give vLLM most of what is left.
        self.llm = LLM(
            model=target.model_dir,
            tokenizer=target.model_dir,
            dtype=str(target.dtype).removeprefix("torch."),
            gpu_memory_utilization=0.9 * free / total,
        )

    def generate(
        self, prompts: list[list[int]], *, seed: int, on_progress: Callable[[int, int], None]
    ) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p if self.sampling.temperature > 0 else 1.0,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=False,
            seed=seed,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = [list(output.outputs[0].token_ids) for output in outputs]
        on_progress(len(results), sum(len(r) for r in results))
        return results


def _make_engine(
    engine: Literal["auto", "hf", "vllm"], *, target: LoadedTarget, sampling: Sampling, batch_size: int
) -> Engine:
    if engine == "auto":
        engine = "vllm" if _vllm_available() and target.device.type == "cuda" and target.model_dir else "hf"
    if engine == "vllm":
        return VLLMEngine(target, sampling=sampling)
    if engine == "hf":
        return HFEngine(target, sampling=sampling, batch_size=batch_size)
    raise ValueError(f"engine: {engine!r} is not one of auto, hf, vllm")


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _trim_after_stop(row: list[int], stops: set[int]) -> list[int]:
    """Drop what follows the first stop token (transformers pads finished rows up to the longest one)."""
    for position, token_id in enumerate(row):
        if token_id in stops:
            return row[: position + 1]
    return row


# ----------------------------------------------------------------------------------------------------------
# Output directory: settings, finished shards, atomic writes


def _claim_out_dir(out_path: Path, settings: dict[str, Any]) -> None:
    """Create `out_path` or check that the run found there has the same settings; drop unfinished shards."""
    out_path.mkdir(parents=True, exist_ok=True)
    settings_path = out_path / SETTINGS_FILE
    if settings_path.is_file():
        previous = json.loads(settings_path.read_text())
        changed = [key for key in settings if previous.get(key) != settings[key]]
        if changed:
            details = ", ".join(f"{key}: {previous.get(key)!r} -> {settings[key]!r}" for key in changed)
            raise RegenerateError(
                f"{out_path} holds a regeneration run with other settings ({details}); "
                "use another output directory or delete it"
            )
    elif any(out_path.glob("regen-*.jsonl")):
        raise RegenerateError(
            f"{out_path} holds regen shards but no {SETTINGS_FILE}; delete them or pick another directory"
        )
    else:
        _write_json_atomically(settings_path, {**settings, "complete": False})
    for leftover in out_path.glob(".regen-*.tmp"):
        leftover.unlink()


def _check_finished_shard(path: Path, shard: list[Conversation]) -> int:
    """Number of records in a finished shard, after checking they are this shard's records (in order)."""
    expected = [c.id for c in shard]
    written = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                written.append(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise RegenerateError(f"{path}:{line_no}: not a regenerated record ({error})") from error
    remaining = iter(expected)
    # Written ids are the expected ones in order, some possibly left out (empty replies).
    if not all(any(written_id == e for e in remaining) for written_id in written):
        raise RegenerateError(
            f"{path}: its record ids do not match input records {expected[0]}..{expected[-1]}; "
            "the input changed since this directory was written"
        )
    return len(written)


def _write_shard_atomically(path: Path, conversations: list[Conversation]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    with temp.open("w", encoding="utf-8") as f:
        for conversation in conversations:
            record = {"id": conversation.id, "messages": conversation.messages}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)
