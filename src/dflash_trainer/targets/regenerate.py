"""Replace the assistant turns of chat data with the target's own responses (the DFlash paper's data recipe).

A drafter learns to predict what the target would write; training on responses written by another model
teaches it a distribution the target does not follow, and acceptance drops. For each conversation the system
and user turns are kept and every assistant turn is generated again, in order, each from the conversation
before it with the earlier assistant turns already regenerated. A conversation that ends in a user turn (a
prompt) gets a generated final assistant turn.

Generation. The decoding engine (`dflash_trainer.decoding`): continuous batching over `batch_size` cache rows
(static KV cache, CUDA-graphed decode steps on a GPU), a conversation's next turn queued as soon as its previous
turn is done. Waiting prompts are served shortest first, except that the turns of multi-turn conversations come
before every single-turn prompt (most turns left first): a chain of k turns needs k replies one after another,
and served last, as their growing prompts were, chains run in waves at the end with rows idle. For the GPU main
job's 48K prompts (1,882 conversations of 2 to 8 turns) on 1,024 rows a turn-level model counts 8-12 % fewer decode
steps (rows busy 82-85 -> 92 %) and 1-4 % less attended context (`benchmarks/regen_schedule_sim.py`, two seeds);
not yet measured on a GPU.
Other engines, same prompts and output format:
- `vllm`, chosen by `auto` when vLLM is installed and the target is a local directory on a GPU. This path has
  never been run by this project (vLLM is not installed where we test): treat it as untested;
- `hf`, transformers `generate` in batches of `batch_size` in the queue's order (chains first, then by length):
  the fallback `auto` picks for targets the engine does not support (layouts it has not been checked against;
  Qwen3.5/3.6 linear-attention hybrids run on the engine, `decoding/recurrent.py`). With sampling its draws depend
  on the batch a prompt lands in, so an interrupted sampled run does not reproduce an uninterrupted one there.
With the engine, greedy replies equal transformers' `generate` and sampled ones depend only on (`seed`,
record, turn, token index) (`decoding/sampling.py`), so a resumed run writes what an uninterrupted one would.

Replies cut at `max_new_tokens` are not finished replies: the target never stopped there. `truncated="keep_open"`
(default) keeps them marked `"truncated": true` on the assistant message and ends the conversation there (later
turns would answer a reply the target never finished); tokenisation (`data/chat.py`) then trains on the
reply's content without an end-of-turn token. `truncated="drop"` leaves such records out. Either way the
summary counts them. Records whose reply is empty (the target stopped at once) are left out and counted;
prompts longer than `max_prompt_tokens` (when set) are left out and counted.

Output directory, resumable at any point:
- `regen.json`: the run's settings (a rerun with other settings or other input records is refused) and, once
  done, `complete: true` and the summary;
- `regen.partial.jsonl` while running: one line per finished input record, appended and flushed as the record
  finishes (fsync at most every `FSYNC_SECONDS`), `{"index", "id", "messages"}` or `{"index", "id",
  "dropped": reason}`. A killed run loses only the records in flight: a rerun reads this journal (a last line
  cut by the kill is discarded), skips what is in it, and continues;
- `regen-00000.jsonl`, written when all records are done (then the journal is removed): the journal's lines
  of the kept records, `{"index", "id", "messages"}`, in input order; what `prepare` reads.
Changed from the earlier format (`dflash-regen/1`: shards of 1,000 records, each written when complete): one
output file, records carry their input `index`, cut replies carry `"truncated": true` and end their
conversation. A directory in the old format is refused (delete it or use another).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import torch
from tqdm import tqdm

from dflash_trainer.data.chat import ChatMessage, RecordError, generation_prompt_ids, normalize_record
from dflash_trainer.data.prepare import read_chat_records
from dflash_trainer.data.prompts import Prompt
from dflash_trainer.decoding.batch import BatchDecoder, Completion, RequestQueue
from dflash_trainer.decoding.batch import Request as DecodeRequest
from dflash_trainer.decoding.cache import UnsupportedTargetError
from dflash_trainer.decoding.sampling import SamplingParams, derive_seed
from dflash_trainer.decoding.target import TargetRunner
from dflash_trainer.errors import UserError
from dflash_trainer.targets.loader import LoadedTarget

OUTPUT_FILE = "regen-00000.jsonl"
JOURNAL_FILE = "regen.partial.jsonl"
SETTINGS_FILE = "regen.json"
FORMAT = "dflash-regen/2"
FSYNC_SECONDS = 5.0
# Seconds between progress redraws on a terminal and in a log.
PROGRESS_SECONDS = 0.1
PROGRESS_SECONDS_IN_LOGS = 30.0
# First-turn prompts tokenised per tokenizer call (bounded: the texts of one batch are held at once).
PROMPT_BATCH = 1024
# Share of the free GPU memory the engine's KV cache may take.
CACHE_MEMORY_FRACTION = 0.6
TruncatedPolicy = Literal["keep_open", "drop"]
EngineName = Literal["auto", "engine", "hf", "vllm"]


class RegenerateError(UserError, ValueError):
    """Bad input records, or an output directory that holds a different run."""


@dataclass
class Conversation:
    id: str
    messages: list[ChatMessage]


@dataclass
class RegenerateSummary:
    out_dir: str
    engine: str = ""
    records: int = 0  # records in the output, this run and earlier ones
    resumed_records: int = 0  # input records found finished (kept or dropped) by an earlier run
    dropped: dict[str, int] = field(default_factory=dict)  # records left out, per reason, all runs
    responses: int = 0  # assistant turns generated this run
    truncated: int = 0  # of those, cut by max_new_tokens before a stop token
    new_tokens: int = 0
    seconds: float = 0.0
    # The decoding engine's counters (steps, prefill and decode seconds, cache growths); empty for other engines.
    decode_stats: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"regenerated {self.responses:,} assistant turns with {self.engine} ({self.new_tokens:,} tokens, "
            f"{rate:,.0f} tokens/s, {self.truncated:,} cut at max_new_tokens); {self.records:,} records "
            f"-> {Path(self.out_dir) / OUTPUT_FILE}"
        )
        if self.resumed_records:
            text += f"; {self.resumed_records:,} records were already done"
        if self.dropped:
            text += "; left out: " + ", ".join(f"{reason} {count:,}" for reason, count in sorted(self.dropped.items()))
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
    limit: int | None = None,
    truncated: TruncatedPolicy = "keep_open",
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    engine: EngineName = "auto",
) -> RegenerateSummary:
    """Write `records` with every assistant turn replaced by the target's response into `out_dir`.

    `records`: a chat JSONL path (records with `messages`, ShareGPT `conversations` or `prompt`[+`response`],
    optional `id`), or a list of conversations (lists of `{"role", "content"}`), such records, or `Prompt`s.
    `batch_size`: cache rows of the engine (sequences decoded at once), or the batch of `hf`. `temperature` 0
    is greedy decoding. `limit` takes the first that many records. See the module docstring for the rest.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if truncated not in ("keep_open", "drop"):
        raise ValueError(f"truncated: {truncated!r} is not one of keep_open, drop")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    conversations = load_conversations(records, limit=limit)
    if not conversations:
        raise RegenerateError(f"{records if isinstance(records, (str, Path)) else 'records'}: no records")
    out_path = Path(out_dir)
    settings = {
        "format": FORMAT,
        "target": target.name,
        "num_records": len(conversations),
        "input_fingerprint": _fingerprint(conversations),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "truncated": truncated,
        "max_prompt_tokens": max_prompt_tokens,
    }
    summary = RegenerateSummary(out_dir=str(out_path))
    if _claim_out_dir(out_path, settings):
        done = json.loads((out_path / SETTINGS_FILE).read_text())["summary"]
        summary.engine, summary.records, summary.dropped = done["engine"], done["records"], done["dropped"]
        summary.resumed_records = len(conversations)
        return summary

    journal_path = out_path / JOURNAL_FILE
    finished = _read_journal(journal_path, num_records=len(conversations))
    summary.resumed_records = len(finished)
    for entry in finished.values():
        if entry.dropped is not None:
            summary.dropped[entry.dropped] = summary.dropped.get(entry.dropped, 0) + 1
    pending = [index for index in range(len(conversations)) if index not in finished]
    # More rows than conversations would only decode padding: a conversation has one turn in flight at a time.
    rows = max(1, min(batch_size, len(pending)))
    generator = _make_engine(engine, target=target, sampling=sampling, batch_size=rows, max_new=max_new_tokens)
    summary.engine = generator.name
    start_time = time.perf_counter()
    with (
        _Journal(journal_path) as journal,
        tqdm(
            total=sum(len(_assistant_slots(conversations[i].messages)) for i in pending),
            unit="turn",
            desc="regenerate",
            disable=not progress,
            dynamic_ncols=True,
            # In a log (stderr not a terminal) every redraw is a new line: one every 30 s keeps rate and ETA visible
            # without burying the log (a redraw per reply wrote 50K lines in the GPU main job).
            mininterval=PROGRESS_SECONDS if sys.stderr.isatty() else PROGRESS_SECONDS_IN_LOGS,
        ) as bar,
    ):
        job = _Job(
            conversations=conversations,
            target=target,
            seed=seed,
            truncated=truncated,
            max_prompt_tokens=max_prompt_tokens,
            journal=journal,
            summary=summary,
            bar=bar,
        )
        queue = RequestQueue()
        for offset in range(0, len(pending), PROMPT_BATCH):
            job.start(pending[offset : offset + PROMPT_BATCH], queue)
        for completion in generator.generate(queue):
            job.finish(completion, queue)
            rate = summary.new_tokens / max(time.perf_counter() - start_time, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)  # drawn at the bar's own interval
    summary.seconds = time.perf_counter() - start_time
    if isinstance(generator, _StaticEngine):
        summary.decode_stats = asdict(generator.decoder.stats)
    summary.records = _write_output(journal_path, out_path / OUTPUT_FILE, num_records=len(conversations))
    _write_json_atomically(out_path / SETTINGS_FILE, {**settings, "complete": True, "summary": asdict(summary)})
    journal_path.unlink()
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
    turns = [m["role"] for m in messages if m["role"] != "system"]
    if not turns or turns[0] != "user":
        # A reply to no prompt (a system message alone, or an assistant turn first) is not a training example.
        raise RegenerateError(f"{where}: the conversation has no user turn before its first reply to generate")
    # Only role and content: the assistant turns (and any reasoning they carried) are replaced anyway.
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _record_id(record: Mapping[str, Any], *, default: str) -> str:
    value = record.get("id") if isinstance(record, Mapping) else None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else default


def _fingerprint(conversations: list[Conversation]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for conversation in conversations:
        digest.update(json.dumps([conversation.id, conversation.messages], ensure_ascii=False).encode())
    return digest.hexdigest()


def _assistant_slots(messages: list[ChatMessage]) -> list[int]:
    """Message indices to generate: every assistant turn, plus one appended after a final non-assistant turn."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] != "assistant":
        slots.append(len(messages))
    return slots


def cut_at_stop(new_ids: Sequence[int], stop_token_ids: Sequence[int]) -> tuple[list[int], bool]:
    """(the reply's token ids before the first stop token, whether a stop token was produced)."""
    stops = set(stop_token_ids)
    for position, token_id in enumerate(new_ids):
        if token_id in stops:
            return list(new_ids[:position]), True
    return list(new_ids), False


# ----------------------------------------------------------------------------------------------------------
# The conversations in flight


@dataclass
class _Job:
    """Turn by turn: queue a conversation's next turn, take a finished reply, write finished records."""

    conversations: list[Conversation]
    target: LoadedTarget
    seed: int
    truncated: TruncatedPolicy
    max_prompt_tokens: int | None
    journal: _Journal
    summary: RegenerateSummary
    bar: tqdm
    working: dict[int, list[ChatMessage]] = field(default_factory=dict)

    def start(self, indices: Sequence[int], queue: RequestQueue) -> None:
        """Queue the first turns of these conversations (their prompts tokenised in one call)."""
        for index in indices:
            self.working[index] = [dict(m) for m in self.conversations[index].messages]
        prefixes = [self._prompt_messages(index, 0) for index in indices]
        for index, prompt in zip(indices, generation_prompt_ids(self.target.tokenizer, prefixes), strict=True):
            self._push(index, 0, prompt, queue)

    def _prompt_messages(self, index: int, turn: int) -> list[ChatMessage]:
        messages = self.working[index]
        return messages[: _assistant_slots(messages)[turn]]

    def _queue_turn(self, index: int, turn: int, queue: RequestQueue) -> None:
        (prompt,) = generation_prompt_ids(self.target.tokenizer, [self._prompt_messages(index, turn)])
        self._push(index, turn, prompt, queue)

    def _push(self, index: int, turn: int, prompt: list[int], queue: RequestQueue) -> None:
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            self._drop(index, "prompt_too_long")
            return
        turns = len(_assistant_slots(self.working[index]))
        # Single-turn prompts (priority 1) after every turn of a multi-turn conversation, most turns left first
        # (priority -turns left, this one included): see the module docstring.
        priority = 1 if turns == 1 else -(turns - turn)
        queue.push(
            DecodeRequest(key=(index, turn), prompt=prompt, seed=derive_seed(self.seed, index, turn), priority=priority)
        )

    def finish(self, completion: Completion, queue: RequestQueue) -> None:
        key = completion.key
        assert isinstance(key, tuple)
        index, turn = key
        messages = self.working[index]
        slots = _assistant_slots(messages)
        reply_ids, stopped = cut_at_stop(completion.tokens, self.target.stop_token_ids)
        self.summary.responses += 1
        self.summary.new_tokens += len(completion.tokens)
        self.bar.update(1)
        text = self.target.tokenizer.decode(reply_ids, skip_special_tokens=False)
        if not text.strip():
            self._drop(index, "empty_reply", remaining_turns=len(slots) - turn - 1)
            return
        reply: ChatMessage = {"role": "assistant", "content": text}
        slot = slots[turn]
        if not stopped:
            self.summary.truncated += 1
            if self.truncated == "drop":
                self._drop(index, "truncated", remaining_turns=len(slots) - turn - 1)
                return
            reply["truncated"] = True
            del messages[slot:]  # the conversation ends inside this reply
            self.bar.update(len(slots) - turn - 1)
        if slot == len(messages):
            messages.append(reply)
        else:
            messages[slot] = reply
        if stopped and turn + 1 < len(slots):
            self._queue_turn(index, turn + 1, queue)
            return
        self.journal.write({"index": index, "id": self.conversations[index].id, "messages": messages})
        del self.working[index]

    def _drop(self, index: int, reason: str, remaining_turns: int = 0) -> None:
        self.summary.dropped[reason] = self.summary.dropped.get(reason, 0) + 1
        self.bar.update(remaining_turns)
        self.journal.write({"index": index, "id": self.conversations[index].id, "dropped": reason})
        del self.working[index]


# ----------------------------------------------------------------------------------------------------------
# Engines: a queue of prompts in, completions out as they finish


class _EngineGenerator:
    name = ""

    def generate(self, queue: RequestQueue) -> Iterator[Completion]:
        raise NotImplementedError


class _StaticEngine(_EngineGenerator):
    """The decoding engine: continuous batching over a static KV cache (see `decoding/batch.py`)."""

    name = "the decoding engine"

    def __init__(self, target: LoadedTarget, *, sampling: SamplingParams, rows: int, max_new: int) -> None:
        runner = TargetRunner(target.model)
        budget = None
        if target.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(target.device)
            budget = int(CACHE_MEMORY_FRACTION * free)
        self.decoder = BatchDecoder(
            runner,
            rows=rows,
            max_new_tokens=max_new,
            stop_token_ids=target.stop_token_ids,
            sampling=sampling,
            memory_budget=budget,
        )

    def generate(self, queue: RequestQueue) -> Iterator[Completion]:
        return self.decoder.generate(queue)


class _HFGenerate(_EngineGenerator):
    """transformers `generate`: batches of `batch_size` prompts of similar length, left-padded, KV cache."""

    name = "transformers generate"

    def __init__(self, target: LoadedTarget, *, sampling: SamplingParams, batch_size: int, max_new: int) -> None:
        from transformers import GenerationConfig

        self.target = target
        self.batch_size = batch_size
        pad_id = target.tokenizer.pad_token_id
        if pad_id is None:
            raise ValueError(f"target {target.name}: the tokenizer has no pad token (load_target sets one)")
        self.pad_id = int(pad_id)
        # Set explicitly: unset knobs are filled from the model's generation_config (Qwen2.5 ships
        # repetition_penalty 1.05, Qwen3 top_k 20), and the run must do what its settings say. Sampling-only
        # knobs stay unset (None) for greedy decoding: transformers would warn that it ignores them.
        sample = not sampling.greedy
        self.generation_config = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            top_k=0 if sample else None,
            repetition_penalty=1.0,
            eos_token_id=list(target.stop_token_ids),
            pad_token_id=self.pad_id,
        )

    def generate(self, queue: RequestQueue) -> Iterator[Completion]:
        stops = set(self.target.stop_token_ids)
        while queue:
            batch = queue.pop(self.batch_size)
            for request, row in zip(batch, self._generate_batch(batch), strict=True):
                tokens = _trim_after_stop(row, stops)
                yield Completion(request.key, tokens, stopped=bool(tokens) and tokens[-1] in stops)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[DecodeRequest]) -> list[list[int]]:
        device = self.target.device
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, P]
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.prompt) :] = torch.tensor(request.prompt, dtype=torch.long)
            attention_mask[row, width - len(request.prompt) :] = 1
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(batch[0].seed)
            output = self.target.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
            )  # [B, P + new]
        return output[:, width:].tolist()


class _VLLMGenerate(_EngineGenerator):
    """vLLM on the target's weights directory (never run by this project: untested)."""

    name = "vLLM"

    def __init__(self, target: LoadedTarget, *, sampling: SamplingParams, max_new: int) -> None:
        from vllm import LLM

        if target.model_dir is None:
            raise ValueError(f"target {target.name}: vLLM needs a local model directory")
        self.sampling = sampling
        self.max_new = max_new
        self.stop_token_ids = list(target.stop_token_ids)
        free, total = torch.cuda.mem_get_info(target.device)
        # The transformers copy of the target already sits on this GPU; give vLLM most of what is left.
        self.llm = LLM(
            model=target.model_dir,
            tokenizer=target.model_dir,
            dtype=str(target.dtype).removeprefix("torch."),
            gpu_memory_utilization=0.9 * free / total,
        )

    def generate(self, queue: RequestQueue) -> Iterator[Completion]:
        from vllm import SamplingParams as VLLMSampling

        while queue:
            batch = queue.pop(len(queue))  # one round: vLLM schedules the batches itself
            params = [
                VLLMSampling(
                    max_tokens=self.max_new,
                    temperature=self.sampling.temperature,
                    top_p=1.0 if self.sampling.greedy else self.sampling.top_p,
                    stop_token_ids=self.stop_token_ids,
                    skip_special_tokens=False,
                    seed=request.seed,
                )
                for request in batch
            ]
            prompts = [{"prompt_token_ids": request.prompt} for request in batch]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            stops = set(self.stop_token_ids)
            for request, output in zip(batch, outputs, strict=True):
                tokens = list(output.outputs[0].token_ids)
                yield Completion(request.key, tokens, stopped=bool(tokens) and tokens[-1] in stops)


def _make_engine(
    engine: EngineName, *, target: LoadedTarget, sampling: SamplingParams, batch_size: int, max_new: int
) -> _EngineGenerator:
    if engine not in ("auto", "engine", "hf", "vllm"):
        raise ValueError(f"engine: {engine!r} is not one of auto, engine, hf, vllm")
    if engine == "auto" and _vllm_available() and target.device.type == "cuda" and target.model_dir:
        engine = "vllm"
    if engine == "vllm":
        return _VLLMGenerate(target, sampling=sampling, max_new=max_new)
    if engine in ("auto", "engine"):
        try:
            return _StaticEngine(target, sampling=sampling, rows=batch_size, max_new=max_new)
        except UnsupportedTargetError as error:
            if engine == "engine":
                raise
            print(f"regenerate: {error}; using transformers generate (slower)")
    return _HFGenerate(target, sampling=sampling, batch_size=batch_size, max_new=max_new)


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _trim_after_stop(row: list[int], stops: set[int]) -> list[int]:
    """Drop what follows the first stop token (transformers pads finished rows up to the longest one)."""
    for position, token_id in enumerate(row):
        if token_id in stops:
            return row[: position + 1]
    return row


# ----------------------------------------------------------------------------------------------------------
# Output directory: settings, journal, final file


def _claim_out_dir(out_path: Path, settings: dict[str, Any]) -> bool:
    """Create `out_path` or check that the run found there has the same settings; True if it is complete."""
    out_path.mkdir(parents=True, exist_ok=True)
    settings_path = out_path / SETTINGS_FILE
    if settings_path.is_file():
        previous = json.loads(settings_path.read_text())
        changed = [key for key in settings if previous.get(key) != settings[key]]
        if changed:
            details = ", ".join(f"{key}: {previous.get(key)!r} -> {settings[key]!r}" for key in changed)
            hint = " (the input records changed)" if "input_fingerprint" in changed else ""
            raise RegenerateError(
                f"{out_path} holds a regeneration run with other settings{hint} ({details}); "
                "use another output directory or delete it"
            )
        return bool(previous.get("complete"))
    if any(out_path.glob("regen-*.jsonl")) or (out_path / JOURNAL_FILE).exists():
        raise RegenerateError(
            f"{out_path} holds regenerated records but no {SETTINGS_FILE}; delete them or pick another directory"
        )
    _write_json_atomically(settings_path, {**settings, "complete": False})
    return False


@dataclass(frozen=True)
class _JournalEntry:
    offset: int  # byte offset of its line in the journal
    dropped: str | None  # the reason, or None for a kept record


def _read_journal(path: Path, *, num_records: int) -> dict[int, _JournalEntry]:
    """Where each finished input record's line is in a journal left by an earlier run (only offsets and drop
    reasons are kept in memory); a last line cut short by a kill is removed from the file."""
    if not path.is_file():
        return {}
    entries: dict[int, _JournalEntry] = {}
    with path.open("r+b") as f:
        offset = 0
        for line_no, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                f.truncate(offset)  # the write in progress when the run was killed
                break
            try:
                entry = json.loads(line)
                index = entry["index"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
                raise RegenerateError(f"{path}:{line_no}: not a regeneration journal entry ({error})") from error
            if not isinstance(index, int) or not 0 <= index < num_records:
                raise RegenerateError(f"{path}:{line_no}: index {index!r} outside the {num_records} input records")
            entries[index] = _JournalEntry(offset=offset, dropped=entry.get("dropped"))
            offset += len(line)
    return entries


class _Journal:
    """Append-only record journal: every line flushed at once, fsync at most every FSYNC_SECONDS."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None
        self._last_sync = 0.0

    def __enter__(self) -> _Journal:
        self._file = self.path.open("a", encoding="utf-8")
        self._last_sync = time.monotonic()
        return self

    def write(self, entry: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()  # in the OS: survives the process being killed
        if time.monotonic() - self._last_sync > FSYNC_SECONDS:
            os.fsync(self._file.fileno())  # on disk: survives the machine going down
            self._last_sync = time.monotonic()

    def __exit__(self, *exc_info: object) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _write_output(journal: Path, output: Path, *, num_records: int) -> int:
    """The journal's kept records in input order into `output` (atomically, line by line); returns how many."""
    entries = _read_journal(journal, num_records=num_records)
    missing = num_records - len(entries)
    if missing:
        raise RegenerateError(f"{journal}: {missing} input records unfinished at the end of the run")
    kept = 0
    temp = output.with_name(f".{output.name}.tmp")
    with journal.open("rb") as source, temp.open("wb") as f:
        for index in range(num_records):
            entry = entries[index]
            if entry.dropped is None:
                source.seek(entry.offset)
                f.write(source.readline())
                kept += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, output)
    return kept


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)
