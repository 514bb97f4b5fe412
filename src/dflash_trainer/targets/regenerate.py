"""Replace the assistant turns of chat data with the target's own responses (the DFlash paper's data recipe).

A drafter learns to predict what the target would write; training on responses written by another model
teaches it a distribution the target does not follow, and acceptance drops. For each conversation the system
and user turns are kept and every assistant turn is generated again, in order, each from the conversation
before it with the earlier assistant turns already regenerated. A conversation that ends in a user turn (a
prompt) gets a generated final assistant turn.

Generation (`regen_engines.py`): by default the decoding engine (`dflash_trainer.decoding`): continuous batching
over `batch_size` cache rows, a conversation's next turn queued as soon as its previous turn is done; or a server
speaking the OpenAI chat completions API (`engine="openai"`, `endpoint.py`), e.g. vLLM or SGLang serving the target.
Waiting prompts are served shortest first, except that the turns of multi-turn conversations come before every
single-turn prompt (most turns left first): a chain of k turns needs k replies one after another, and served last,
as their growing prompts were, chains run in waves at the end with rows idle. For the math-first recipe's 48K prompts
(1,882 conversations of 2 to 8 turns) on 1,024 rows a turn-level model counts 8-12 % fewer decode steps (rows busy
82-85 -> 92 %) and 1-4 % less attended context (`benchmarks/regen_schedule_sim.py`, two seeds); not yet measured on
a GPU.

Several ranks (`team`, `regen_ranks.py`): under torchrun each rank answers its share of the records into its own
journal and the first rank merges them; the output equals a one-rank run's for greedy decoding.

Replies cut at `max_new_tokens` are not finished replies: the target never stopped there. `truncated="keep_open"`
(default) keeps them marked `"truncated": true` on the assistant message and ends the conversation there (later
turns would answer a reply the target never finished); tokenisation (`data/chat.py`) then trains on the
reply's content without an end-of-turn token. `truncated="drop"` leaves such records out. Either way the
summary counts them. Records whose reply is empty (the target stopped at once) are left out and counted;
prompts longer than `max_prompt_tokens` (when set) are left out and counted.

Reasoning. The engines of this process write the reply as the target wrote it, `<think>...</think>` included. A
server with a reasoning parser returns the thinking apart: it is kept on the assistant message as
`reasoning_content`, which tokenisation drops or writes back as `<think>` text per `keep_reasoning` (`prepare
--keep-reasoning`, `prepare.keep_reasoning`), as it does with `<think>` text in the content. A reply cut inside its
thinking (no answer yet) is kept as the target wrote it, `<think>` and the thinking as its content.

Bad records. A record that is not a conversation is refused with its file and line (or list index) before any
generation. A record the tokenizer or its chat template fails on, and a request the server rejects (HTTP 4xx: a
prompt beyond its context), fail the run naming the record (`on_error="raise"`) or are left out and counted, the
first message of each reason kept for the summary (`on_error="skip"`, as `prepare --on-error skip`).

Record ids: a record's own `id` (a prompt set's `HumanEval/0`), else `FILE:LINE` of the input (or the list index):
written with the record, and the sample id `prepare` gives its tokens.

Output directory (`regen_journal.py`), resumable at any point: `regen.json` (settings, then the summary), one
journal per rank of finished records (a killed run loses only the records in flight), and when all are done
`regen-00000.jsonl`: `{"index", "id", "messages"}` per kept record, in input order; what `prepare` reads. A
directory of the earlier format (`dflash-regen/1`: shards of 1,000 records) is refused (delete it or use another).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from ..config import EndpointConfig
from ..data.chat import ChatMessage, RecordError, generation_prompt_ids, normalize_record
from ..data.prepare import read_chat_records
from ..data.prompts import Prompt
from ..decoding.batch import Completion, RequestQueue
from ..decoding.batch import Request as DecodeRequest
from ..decoding.sampling import SamplingParams, derive_seed
from .endpoint import ChatEndpoint
from .loader import LoadedTarget
from .regen_engines import ENGINES, EndpointEngine, Engine, Reply, StaticEngine, make_engine
from .regen_journal import (
    FORMAT,
    OUTPUT_FILE,
    SETTINGS_FILE,
    Journal,
    RegenerateError,
    claim_out_dir,
    journal_path,
    read_journals,
    read_settings,
    remove_journals,
    write_json_atomically,
    write_output,
)
from .regen_ranks import RegenTeam, share

__all__ = ["OUTPUT_FILE", "RegenerateError", "RegenerateSummary", "cut_at_stop", "load_conversations", "regenerate"]

# Seconds between progress redraws on a terminal and in a log.
PROGRESS_SECONDS = 0.1
PROGRESS_SECONDS_IN_LOGS = 30.0
# First-turn prompts tokenised per tokenizer call (bounded: the texts of one batch are held at once).
PROMPT_BATCH = 1024
TruncatedPolicy = Literal["keep_open", "drop"]
OnError = Literal["raise", "skip"]
EngineName = Literal["auto", "engine", "hf", "vllm", "openai"]


@dataclass
class Conversation:
    id: str
    messages: list[ChatMessage]
    where: str = ""  # FILE:LINE or records[INDEX], for messages


@dataclass
class RegenerateSummary:
    out_dir: str
    engine: str = ""
    records: int = 0  # records in the output, this run and earlier ones
    resumed_records: int = 0  # input records found finished (kept or dropped) by an earlier run
    dropped: dict[str, int] = field(default_factory=dict)  # records left out, per reason, all runs
    examples: dict[str, str] = field(default_factory=dict)  # the first message per reason of a bad record, this run
    responses: int = 0  # assistant turns generated this run
    truncated: int = 0  # of those, cut by max_new_tokens before a stop token
    new_tokens: int = 0
    seconds: float = 0.0
    ranks: int = 1
    # The decoding engine's counters (steps, prefill and decode seconds, cache growths); one rank's engine only.
    decode_stats: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds > 0 else 0.0
        on = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        text = (
            f"regenerated {self.responses:,} assistant turns with {self.engine}{on} ({self.new_tokens:,} tokens, "
            f"{rate:,.0f} tokens/s, {self.truncated:,} cut at max_new_tokens); {self.records:,} records "
            f"-> {Path(self.out_dir) / OUTPUT_FILE}"
        )
        if self.resumed_records:
            text += f"; {self.resumed_records:,} records were already done"
        if self.dropped:
            text += "; left out: " + ", ".join(f"{reason} {count:,}" for reason, count in sorted(self.dropped.items()))
        for reason, example in sorted(self.examples.items()):
            text += f"\n  first {reason}: {example}"
        return text


def regenerate(
    records: str | Path | Sequence[Any],
    target: LoadedTarget | None,
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
    endpoint: EndpointConfig | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    on_error: OnError = "raise",
    team: RegenTeam | None = None,
    recurrent_state_dtype: torch.dtype | None = None,
) -> RegenerateSummary:
    """Write `records` with every assistant turn replaced by the target's response into `out_dir`.

    `records`: a chat JSONL path (records with `messages`, ShareGPT `conversations` or `prompt`[+`response`],
    optional `id`), or a list of conversations (lists of `{"role", "content"}`), such records, or `Prompt`s.
    `batch_size`: cache rows of the engine (sequences decoded at once), or the batch of `hf`. `temperature` 0
    is greedy decoding. `limit` takes the first that many records. `engine="openai"` asks the server of `endpoint`;
    `target` may then be None, with the `tokenizer` that measures prompts (queue order, `max_prompt_tokens`).
    `team`: the ranks sharing the work (every rank calls this with the same arguments); one process by default.
    `recurrent_state_dtype`: our engine's delta-rule states of a hybrid target (None: float32; `recurrent.py`).
    On a team, the first rank returns the whole run's summary, the others their own part's. See the module
    docstring for the rest.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if truncated not in ("keep_open", "drop"):
        raise ValueError(f"truncated: {truncated!r} is not one of keep_open, drop")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error: {on_error!r} is not one of raise, skip")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if engine not in ENGINES:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
    server = None
    if engine == "openai":
        if endpoint is None:
            raise ValueError("engine='openai' needs the endpoint settings")
        server = ChatEndpoint(endpoint)
        tokenizer = tokenizer or (target.tokenizer if target is not None else None)
    elif target is None:
        raise ValueError(f"engine {engine!r} runs the target in this process: pass the loaded target")
    else:
        tokenizer = target.tokenizer
    if tokenizer is None:
        raise ValueError("no tokenizer to measure the prompts with: pass the target or its tokenizer")
    team = team or RegenTeam()
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    conversations = load_conversations(records, limit=limit)
    if not conversations:
        raise RegenerateError(f"{records if isinstance(records, (str, Path)) else 'records'}: no records")
    out_path = Path(out_dir)
    # A server is asked first: one that is down or serves another model fails the run before any work.
    name = server.check_model() if server is not None else target.name if target is not None else ""
    settings = {
        "format": FORMAT,
        "target": name,
        "num_records": len(conversations),
        "input_fingerprint": _fingerprint(conversations),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "truncated": truncated,
        "max_prompt_tokens": max_prompt_tokens,
    }
    summary = RegenerateSummary(out_dir=str(out_path), ranks=team.size)
    if team.settle(lambda: claim_out_dir(out_path, settings)):
        done = read_settings(out_path)["summary"]
        summary.engine, summary.records, summary.dropped = done["engine"], done["records"], done["dropped"]
        summary.resumed_records = len(conversations)
        return summary

    own_journal = journal_path(out_path, team.rank)
    finished = read_journals(out_path, num_records=len(conversations), own=own_journal)
    mine = range(len(conversations))
    if team.size > 1:
        work = [(len(_assistant_slots(c.messages)), sum(len(m["content"]) for m in c.messages)) for c in conversations]
        mine = share(work, team.rank, team.size)
    pending = [index for index in mine if index not in finished]
    summary.resumed_records = len(mine) - len(pending)
    start_time = time.perf_counter()
    generator: Engine | None = None
    if pending:
        with (
            Journal(own_journal) as journal,
            tqdm(
                total=sum(len(_assistant_slots(conversations[i].messages)) for i in pending),
                unit="turn",
                desc="regenerate" if team.size == 1 else f"regenerate (rank 0 of {team.size}: its share)",
                disable=not progress or team.rank != 0,
                dynamic_ncols=True,
                # In a log (stderr not a terminal) every redraw is a new line: one every 30 s keeps rate and ETA
                # visible without burying the log (a redraw per reply wrote 50K lines in the GPU main job).
                mininterval=PROGRESS_SECONDS if sys.stderr.isatty() else PROGRESS_SECONDS_IN_LOGS,
            ) as bar,
        ):
            job = _Job(
                conversations=conversations,
                tokenizer=tokenizer,
                stop_token_ids=list(target.stop_token_ids) if target is not None else [],
                seed=seed,
                truncated=truncated,
                max_prompt_tokens=max_prompt_tokens,
                on_error=on_error,
                journal=journal,
                summary=summary,
                bar=bar,
            )
            if server is not None:
                generator = EndpointEngine(
                    server,
                    sampling=sampling,
                    max_new=max_new_tokens,
                    messages_of=job.prompt_messages,
                    label_of=job.label,
                )
            else:
                # More rows than conversations would only decode padding: a conversation has one turn in flight.
                rows = max(1, min(batch_size, len(pending)))
                generator = make_engine(
                    engine,
                    target=target,
                    sampling=sampling,
                    batch_size=rows,
                    max_new=max_new_tokens,
                    recurrent_state_dtype=recurrent_state_dtype,
                )
            summary.engine = generator.name
            queue = RequestQueue()
            for offset in range(0, len(pending), PROMPT_BATCH):
                job.start(pending[offset : offset + PROMPT_BATCH], queue)
            for answer in generator.generate(queue):
                job.finish(answer, queue)
                rate = summary.new_tokens / max(time.perf_counter() - start_time, 1e-9)
                status = generator.status()
                # Drawn at the bar's own interval.
                bar.set_postfix_str(f"{rate:,.0f} tok/s" + (f", {status}" if status else ""), refresh=False)
    summary.seconds = time.perf_counter() - start_time
    if isinstance(generator, StaticEngine):
        summary.decode_stats = asdict(generator.decoder.stats)

    parts = team.gather(asdict(summary))
    if parts is None:  # not the first rank: the first one merges
        return summary
    merged = _merged_summary(summary, parts)
    merged.records, merged.dropped = write_output(out_path, num_records=len(conversations))
    write_json_atomically(out_path / SETTINGS_FILE, {**settings, "complete": True, "summary": asdict(merged)})
    remove_journals(out_path)
    return merged


def _merged_summary(own: RegenerateSummary, parts: list[dict[str, Any]]) -> RegenerateSummary:
    """The run's summary from every rank's (counters summed, wall time the longest rank's)."""
    if len(parts) == 1:
        return own
    merged = RegenerateSummary(out_dir=own.out_dir, ranks=len(parts), decode_stats=own.decode_stats)
    merged.engine = next((part["engine"] for part in parts if part["engine"]), "")
    for part in parts:
        merged.resumed_records += part["resumed_records"]
        merged.responses += part["responses"]
        merged.truncated += part["truncated"]
        merged.new_tokens += part["new_tokens"]
        merged.seconds = max(merged.seconds, part["seconds"])
        for reason, example in part["examples"].items():
            merged.examples.setdefault(reason, example)
    return merged


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
            where = f"{path}:{line_no}"
            messages = _normalize(record, where=where)
            conversations.append(Conversation(_record_id(record, default=f"{path.name}:{line_no}"), messages, where))
        return conversations
    for index, item in enumerate(records[:limit] if limit is not None else records):
        where = f"records[{index}]"
        if isinstance(item, Prompt):
            conversations.append(Conversation(item.id, _normalize({"messages": item.messages}, where=where), where))
        elif isinstance(item, Mapping):
            record_id = _record_id(item, default=str(index))
            conversations.append(Conversation(record_id, _normalize(item, where=where), where))
        else:
            conversations.append(Conversation(str(index), _normalize({"messages": item}, where=where), where))
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


def _prompt_ids(
    tokenizer: PreTrainedTokenizerBase, conversations: list[list[ChatMessage]]
) -> list[list[int] | Exception]:
    """`generation_prompt_ids` of each conversation, or what the tokenizer or its template raised on it (one call
    for all; one call per conversation when that fails, so that the error lands on its own record)."""
    try:
        return list(generation_prompt_ids(tokenizer, conversations))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # templates raise many types; a Rust panic (pyo3) is a BaseException
        results: list[list[int] | Exception] = []
        for messages in conversations:
            try:
                results.append(generation_prompt_ids(tokenizer, [messages])[0])
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:
                results.append(
                    error if isinstance(error, Exception) else RuntimeError(f"{type(error).__name__}: {error}")
                )
        return results


# ----------------------------------------------------------------------------------------------------------
# The conversations in flight


@dataclass
class _Job:
    """Turn by turn: queue a conversation's next turn, take a finished reply, write finished records."""

    conversations: list[Conversation]
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: list[int]
    seed: int
    truncated: TruncatedPolicy
    max_prompt_tokens: int | None
    on_error: OnError
    journal: Journal
    summary: RegenerateSummary
    bar: tqdm
    working: dict[int, list[ChatMessage]] = field(default_factory=dict)

    def start(self, indices: Sequence[int], queue: RequestQueue) -> None:
        """Queue the first turns of these conversations (their prompts tokenised in one call)."""
        for index in indices:
            self.working[index] = [dict(m) for m in self.conversations[index].messages]
        prefixes = [self._prompt_prefix(index, 0) for index in indices]
        for index, prompt in zip(indices, _prompt_ids(self.tokenizer, prefixes), strict=True):
            self._push(index, 0, prompt, queue)

    def prompt_messages(self, key: Hashable) -> list[ChatMessage]:
        """The conversation before turn `key = (index, turn)`: what the target answers."""
        assert isinstance(key, tuple)
        index, turn = key
        return self._prompt_prefix(index, turn)

    def label(self, key: Hashable) -> str:
        assert isinstance(key, tuple)
        index, turn = key
        conversation = self.conversations[index]
        return f"record {conversation.id} ({conversation.where}), turn {turn + 1}"

    def _prompt_prefix(self, index: int, turn: int) -> list[ChatMessage]:
        messages = self.working[index]
        return messages[: _assistant_slots(messages)[turn]]

    def _queue_turn(self, index: int, turn: int, queue: RequestQueue) -> None:
        (prompt,) = _prompt_ids(self.tokenizer, [self._prompt_prefix(index, turn)])
        self._push(index, turn, prompt, queue)

    def _push(self, index: int, turn: int, prompt: list[int] | Exception, queue: RequestQueue) -> None:
        if isinstance(prompt, Exception):
            reason = prompt.reason if isinstance(prompt, RecordError) else "tokenizer_error"
            problem = str(prompt) if isinstance(prompt, RecordError) else f"{type(prompt).__name__}: {prompt}"
            problem = f"the tokenizer failed on turn {turn + 1}'s prompt: {problem}"
            self._bad_record(index, reason, problem, remaining_turns=self._turns_left(index, turn) + 1)
            return
        if not prompt:
            problem = f"turn {turn + 1}'s prompt renders as no tokens"
            self._bad_record(index, "tokenizer_error", problem, remaining_turns=self._turns_left(index, turn) + 1)
            return
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            self._drop(index, "prompt_too_long", remaining_turns=self._turns_left(index, turn) + 1)
            return
        turns = len(_assistant_slots(self.working[index]))
        # Single-turn prompts (priority 1) after every turn of a multi-turn conversation, most turns left first
        # (priority -turns left, this one included): see the module docstring.
        priority = 1 if turns == 1 else -(turns - turn)
        queue.push(
            DecodeRequest(key=(index, turn), prompt=prompt, seed=derive_seed(self.seed, index, turn), priority=priority)
        )

    def finish(self, answer: Completion | Reply, queue: RequestQueue) -> None:
        reply = answer if isinstance(answer, Reply) else self._decoded(answer)
        key = reply.key
        assert isinstance(key, tuple)
        index, turn = key
        messages = self.working[index]
        slots = _assistant_slots(messages)
        self.bar.update(1)
        if reply.rejected is not None:
            problem = f"the server refused turn {turn + 1}: {reply.rejected}"
            self._bad_record(index, "rejected_by_server", problem, remaining_turns=self._turns_left(index, turn))
            return
        self.summary.responses += 1
        self.summary.new_tokens += reply.new_tokens
        text, reasoning = reply.text, reply.reasoning
        if not text.strip() and reasoning.strip() and not reply.stopped:
            # Cut inside its thinking, before any answer: kept as the target wrote it (see the module docstring).
            text, reasoning = f"<think>\n{reasoning}", ""
        if not text.strip():
            self._drop(index, "empty_reply", remaining_turns=len(slots) - turn - 1)
            return
        message: ChatMessage = {"role": "assistant", "content": text}
        if reasoning.strip():
            message["reasoning_content"] = reasoning
        slot = slots[turn]
        if not reply.stopped:
            self.summary.truncated += 1
            if self.truncated == "drop":
                self._drop(index, "truncated", remaining_turns=len(slots) - turn - 1)
                return
            message["truncated"] = True
            del messages[slot:]  # the conversation ends inside this reply
            self.bar.update(len(slots) - turn - 1)
        if slot == len(messages):
            messages.append(message)
        else:
            messages[slot] = message
        if reply.stopped and turn + 1 < len(slots):
            self._queue_turn(index, turn + 1, queue)
            return
        self.journal.write({"index": index, "id": self.conversations[index].id, "messages": messages})
        del self.working[index]

    def _decoded(self, completion: Completion) -> Reply:
        reply_ids, stopped = cut_at_stop(completion.tokens, self.stop_token_ids)
        text = self.tokenizer.decode(reply_ids, skip_special_tokens=False)
        return Reply(completion.key, text=text, stopped=stopped, new_tokens=len(completion.tokens))

    def _turns_left(self, index: int, turn: int) -> int:
        """Turns of the conversation after `turn`: not generated once the record is dropped there."""
        return len(_assistant_slots(self.working[index])) - turn - 1

    def _bad_record(self, index: int, reason: str, problem: str, *, remaining_turns: int) -> None:
        """A record the tokenizer or the server cannot take: the run fails naming it, or it is left out."""
        conversation = self.conversations[index]
        message = f"{conversation.where}: record {conversation.id}: {problem}"
        if self.on_error == "raise":
            raise RegenerateError(
                f"{message} (records finished so far are kept; on_error=skip leaves such records out)"
            )
        self.summary.examples.setdefault(reason, message)
        self._drop(index, reason, remaining_turns=remaining_turns)

    def _drop(self, index: int, reason: str, remaining_turns: int = 0) -> None:
        self.summary.dropped[reason] = self.summary.dropped.get(reason, 0) + 1
        self.bar.update(remaining_turns)
        self.journal.write({"index": index, "id": self.conversations[index].id, "dropped": reason})
        del self.working[index]
