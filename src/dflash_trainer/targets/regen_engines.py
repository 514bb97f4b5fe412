"""The engines that answer regeneration's prompts: a queue of requests in, replies out as they finish.

Each engine takes the `RequestQueue` that regeneration fills, and refills while the engine runs (a conversation's
next turn is pushed when its previous reply comes back), and yields one item per request: a `Completion` (new token
ids; the engines that run the target in this process) or a `Reply` (text; a server). Engines:
- `engine`: our decoding engine (`decoding/batch.py`): continuous batching over a static KV cache, CUDA-graphed
  decode steps on a GPU. Greedy replies equal transformers' `generate`; sampled ones depend only on (seed, record,
  turn, token index), so a resumed run writes what an uninterrupted one would.
- `hf`: transformers `generate` in batches of `batch_size` in the queue's order: the fallback `auto` picks for
  targets the engine does not support. With sampling its draws depend on the batch a prompt lands in.
- `vllm`: vLLM in this process, chosen by `auto` when vLLM is installed and the target is a local directory on a
  GPU. This path has never been run by this project (vLLM is not installed where we test): treat it as untested.
- `openai`: a server speaking the OpenAI chat completions API (`endpoint.py`), e.g. vLLM or SGLang serving the
  target on GPUs of their own; it renders the prompts itself from the conversation's messages.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

from ..data.chat import ChatMessage
from ..decoding.batch import BatchDecoder, Completion, RequestQueue
from ..decoding.batch import Request as DecodeRequest
from ..decoding.cache import UnsupportedTargetError
from ..decoding.sampling import SamplingParams
from ..decoding.target import TargetRunner
from .endpoint import ChatEndpoint, ChatRequest, EndpointPool
from .loader import LoadedTarget

# Share of the free GPU memory the engine's KV cache may take.
CACHE_MEMORY_FRACTION = 0.6
ENGINES = ("auto", "engine", "hf", "vllm", "openai")


@dataclass(frozen=True)
class Reply:
    """A reply as text (a server's): what `Completion` is for the engines that return token ids."""

    key: Hashable
    text: str  # without the stop token
    stopped: bool  # the target ended its turn (False: cut at max_new_tokens)
    new_tokens: int  # tokens generated, the stop token included
    reasoning: str = ""  # the server's reasoning field, apart from the text
    rejected: str | None = None  # the server refused the request: its message


class Engine:
    name = ""

    def generate(self, queue: RequestQueue) -> Iterator[Completion | Reply]:
        raise NotImplementedError

    def status(self) -> str:
        """A few words for the progress bar (requests in flight), or nothing."""
        return ""


class StaticEngine(Engine):
    """The decoding engine: continuous batching over a static KV cache (see `decoding/batch.py`)."""

    name = "the decoding engine"

    def __init__(
        self,
        target: LoadedTarget,
        *,
        sampling: SamplingParams,
        rows: int,
        max_new: int,
        recurrent_state_dtype: torch.dtype | None = None,
    ) -> None:
        runner = TargetRunner(target.model, recurrent_state_dtype=recurrent_state_dtype)
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


class HFGenerate(Engine):
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


class VLLMGenerate(Engine):
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


class EndpointEngine(Engine):
    """A server answers each request from the conversation's messages; up to `concurrency` requests at once."""

    def __init__(
        self,
        endpoint: ChatEndpoint,
        *,
        sampling: SamplingParams,
        max_new: int,
        messages_of: Callable[[Hashable], list[ChatMessage]],
        label_of: Callable[[Hashable], str],
    ) -> None:
        self.endpoint = endpoint
        self.sampling = sampling
        self.max_new = max_new
        self.messages_of = messages_of
        self.label_of = label_of
        self.name = f"the server at {endpoint.url} ({endpoint.model})"
        self.pool = EndpointPool(endpoint, endpoint.settings.concurrency)

    def generate(self, queue: RequestQueue) -> Iterator[Reply]:
        pool = self.pool
        try:
            while queue or pool.in_flight:
                while queue and pool.in_flight < pool.concurrency:
                    (request,) = queue.pop(1)
                    pool.submit(self._chat_request(request))
                answer = pool.take()
                yield Reply(
                    answer.key,
                    text=answer.content,
                    stopped=answer.stopped,
                    new_tokens=answer.completion_tokens,
                    reasoning=answer.reasoning,
                    rejected=answer.rejected,
                )
        finally:
            pool.close()

    def status(self) -> str:
        return f"{self.pool.in_flight} in flight"

    def _chat_request(self, request: DecodeRequest) -> ChatRequest:
        greedy = self.sampling.greedy
        return ChatRequest(
            key=request.key,
            label=self.label_of(request.key),
            # Role and content: what the chat template renders of the earlier turns.
            messages=[{"role": m["role"], "content": m["content"]} for m in self.messages_of(request.key)],
            max_tokens=self.max_new,
            temperature=0.0 if greedy else self.sampling.temperature,
            top_p=1.0 if greedy else self.sampling.top_p,
            seed=None if greedy else request.seed,
        )


def make_engine(
    engine: str,
    *,
    target: LoadedTarget | None,
    sampling: SamplingParams,
    batch_size: int,
    max_new: int,
    recurrent_state_dtype: torch.dtype | None = None,
) -> Engine:
    """The engine named by `engine` that runs `target` in this process (`openai` is built by the caller).
    `recurrent_state_dtype`: our engine's delta-rule states of a hybrid target (None: float32)."""
    if engine not in ENGINES or engine == "openai":
        raise ValueError(f"engine: {engine!r} is not one of auto, engine, hf, vllm")
    assert target is not None, "the engines of this process need the target"
    if engine == "auto" and _vllm_available() and target.device.type == "cuda" and target.model_dir:
        engine = "vllm"
    if engine == "vllm":
        return VLLMGenerate(target, sampling=sampling, max_new=max_new)
    if engine in ("auto", "engine"):
        try:
            return StaticEngine(
                target, sampling=sampling, rows=batch_size, max_new=max_new, recurrent_state_dtype=recurrent_state_dtype
            )
        except UnsupportedTargetError as error:
            if engine == "engine":
                raise
            print(f"regenerate: {error}; using transformers generate (slower)")
    return HFGenerate(target, sampling=sampling, batch_size=batch_size, max_new=max_new)


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _trim_after_stop(row: list[int], stops: set[int]) -> list[int]:
    """Drop what follows the first stop token (transformers pads finished rows up to the longest one)."""
    for position, token_id in enumerate(row):
        if token_id in stops:
            return row[: position + 1]
    return row
