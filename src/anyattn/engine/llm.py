"""`LLM`: the engine's front door, in the shape vLLM users know.

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct GGUF
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    for delta in llm.stream("Tell me a joke", SamplingParams(max_tokens=64)):
        print(delta, end="", flush=True)

One step: the scheduler picks requests and token counts, the model runner runs them, the
sampler picks next tokens, the scheduler records them. With asynchronous scheduling (the
default on CUDA) a step is launched while the previous one still runs: the previous step's
tokens are reserved and fed to the model from the device, then read back and applied
(`Scheduler.advance` / `Scheduler.resolve`). Output text is decoded when read, except for
requests with stop strings, decoded each step to find them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from anyattn.async_copy import HostCopy
from anyattn.config import BatchLimits
from anyattn.engine.arguments import (
    check_generate_args,
    check_params,
    check_token_ids,
    encode_text,
    parse_device,
    parse_memory,
)
from anyattn.engine.backend_choice import (
    parse_backend_request,
    use_backend_pair,
    use_fastest_backends,
)
from anyattn.engine.block_manager import BlockManager
from anyattn.engine.detokenizer import OutputText
from anyattn.engine.loader import load_model
from anyattn.engine.model_runner import ModelRunner
from anyattn.engine.outputs import CompletionOutput, RequestOutput
from anyattn.engine.sampler import Sampler, make_generator
from anyattn.engine.sampling_params import SamplingParams
from anyattn.engine.scheduler import ScheduledBatch, Scheduler
from anyattn.engine.sequence import Sequence as Request
from anyattn.engine.sequence import SequenceStatus
from anyattn.types import check_positive_int, parse_dtype

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

_DEFAULT_KV_CACHE_MEMORY = 1 << 30
_DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class _Launched:
    """A step queued on the device: the batch rows it samples and their tokens."""

    rows: list[int]
    tokens: HostCopy


@dataclass
class _Tracked:
    """What the engine keeps per request besides the scheduler's view of it."""

    request: Request
    output: RequestOutput
    generator: torch.Generator | None
    text: OutputText


class LLM:
    """A model with a paged KV cache, continuous batching and a chosen attention backend.

    Args:
        model: a GGUF file or a Hugging Face folder (config.json + safetensors); default: the
            embedded SmolLM2-135M-Instruct GGUF.
        backend: an attention backend name (or class) to use for every layer instead of
            selecting one; a pair `("TRITON", "FLASHINFER")` or `"TRITON,FLASHINFER"` runs
            decodes on the first and prefills (and the prefill rows of mixed steps) on the
            second over one KV cache (docs/per_phase.md); "fastest" (or
            `ANYATTN_BACKEND=fastest`) times the backends that fit each layer config under this
            engine's limits and takes the decode and prefill choices as such a pair when they
            differ and can share a cache, else the fastest overall
            (`anyattn.selector.measure_backends`; cached on disk; `backend_notes` says which).
        dtype: model dtype; default float32 on the CPU, bfloat16 on CUDA.
        device: "cpu" or "cuda"; default CUDA when available.
        block_size: KV block size; default 16.
        kv_cache_memory: bytes for the KV cache of all layers (int or "512MiB"); capped at
            what `max_num_seqs` sequences of `max_model_len` tokens can use.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: per-step token budget (chunked prefill splits longer prompts).
        max_model_len: longest prompt + output; default min(model's context, 4096).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        kv_cache_dtype: "auto" or an fp8 / half cache dtype.
        enforce_eager: never capture CUDA graphs for decode steps.
        async_scheduling: launch each step before the previous one's tokens reach the host
            (default on CUDA, off on the CPU). Greedy and seeded requests get the synchronous
            engine's tokens; a request ending by eos or a stop may compute one extra token,
            which is dropped (and moves the draws of unseeded sampled requests in that step).
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        backend: str | type | tuple[str | type, str | type] | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        block_size: int | None = None,
        kv_cache_memory: int | str = _DEFAULT_KV_CACHE_MEMORY,
        *,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool | None = None,
    ) -> None:
        if model is not None and not isinstance(model, str | os.PathLike):
            raise TypeError(
                f"LLM: model must be a path to a .gguf file or a Hugging Face folder (got "
                f"{type(model).__name__})."
            )
        if async_scheduling is not None and not isinstance(async_scheduling, bool):
            raise TypeError(
                f"LLM: async_scheduling must be a bool or None (got {async_scheduling!r})."
            )
        self.device = parse_device(device)
        default_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = default_dtype if dtype is None else parse_dtype(dtype, argument="LLM: dtype")
        self.block_size = 16 if block_size is None else block_size
        for name, value in (
            ("block_size", self.block_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", 1 if max_model_len is None else max_model_len),
        ):
            check_positive_int("LLM", name, value)
        memory = parse_memory(kv_cache_memory)
        request = parse_backend_request(backend)
        loaded = load_model(
            model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            backend=request.backend,
            kv_cache_dtype=kv_cache_dtype,
            max_positions=_DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len,
        )
        self.model, self.model_config = loaded.model, loaded.config
        self.tokenizer, self.model_path = loaded.tokenizer, loaded.path
        context = self.model_config.max_position_embeddings
        self.max_model_len = (
            min(context, _DEFAULT_MAX_MODEL_LEN) if max_model_len is None else max_model_len
        )
        if self.max_model_len > context:
            raise ValueError(
                f"LLM: max_model_len exceeds the model's context (got {self.max_model_len}, "
                f"expected <= {context})."
            )
        limits = BatchLimits(max_num_seqs, max_num_batched_tokens, self.max_model_len)
        self.backend_notes: list[str] = []  # per-phase or measured choices, and why
        if request.is_fastest:
            self.backend_notes = use_fastest_backends(self.model, self.device, limits)
        elif request.prefill_backend is not None:
            self.backend_notes = [use_backend_pair(self.model, request.prefill_backend)]
        num_blocks = self._num_blocks(memory, kv_cache_dtype, limits)
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=self.block_size,
            limits=limits,
            device=self.device,
            dtype=self.dtype,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=enforce_eager,
        )
        self.block_manager = BlockManager(num_blocks, self.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
        )
        self.sampler = Sampler()
        self.async_scheduling = (
            self.device.type == "cuda" if async_scheduling is None else async_scheduling
        )
        self._in_flight: tuple[ScheduledBatch, _Launched] | None = None
        self._ids = itertools.count()
        self._requests: dict[int, _Tracked] = {}
        self._with_stops: dict[int, _Tracked] = {}  # unfinished requests with stop strings
        # the output of the latest `stream` call (token counts for callers that print rates)
        self.last_stream_output: RequestOutput | None = None
        eos = self.model_config.eos_token_ids
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = tuple(sorted(set(eos) | ({tokenizer_eos} - {None})))

    def _num_blocks(self, memory: int, kv_cache_dtype: str, limits: BatchLimits) -> int:
        per_block = sum(
            layer.kv_cache_spec(self.block_size, self.dtype, kv_cache_dtype).page_size_bytes
            for layer in self.model.attention_layers()
        )
        useful = limits.max_num_reqs * -(-limits.max_model_len // self.block_size)
        num_blocks = min(memory // per_block, useful) + 1  # + the null block
        if num_blocks < 2:
            raise ValueError(
                f"LLM: kv_cache_memory holds no KV block (got {memory} bytes, one block of all "
                f"layers needs {per_block})."
            )
        return num_blocks

    @property
    def backend_names(self) -> list[str]:
        """The attention backends the layers run on (both of a per-phase pair)."""
        return self.runner.backend_names

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string (with the chat template when `chat`) or token ids
        (a list, a 1-D array or tensor of ints). TypeError: another type, or ids that are not
        integers; ValueError: ids outside the vocabulary, or `chat` with ids."""
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt, chat)
        return check_token_ids(prompt, chat, self.model_config.vocab_size)

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, chat: bool = False
    ) -> int:
        """Queue one request; returns its id. Drive it with `step()`; read its state from the
        returned outputs. `abort_request` drops it."""
        params = check_params(params)
        return self._add(prompt, self.encode_prompt(prompt, chat), params)

    def _add(self, prompt: object, token_ids: list[int], params: SamplingParams) -> int:
        request_id = next(self._ids)
        request = Request(request_id, token_ids, params, self.eos_token_ids)
        text = OutputText(self.tokenizer, request.output_token_ids, params.stop)
        completion = CompletionOutput(request.output_token_ids, text)
        output = RequestOutput(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, [completion]
        )
        generator = make_generator(params, self.device)
        self._requests[request_id] = _Tracked(request, output, generator, text)
        if params.stop:
            self._with_stops[request_id] = self._requests[request_id]
        self.scheduler.add(request)
        return request_id

    def abort_request(self, request_id: int) -> None:
        """Stop a request now (finish reason "abort") and forget it; unknown ids are ignored."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        if entry.request.status != SequenceStatus.FINISHED:
            self.scheduler.finish(entry.request, "abort")
        self._mark_finished(entry)

    def has_unfinished_requests(self) -> bool:
        """Whether any queued request still has work (or a failure to report)."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that changed (a new token,
        finished or failed). With asynchronous scheduling a step's tokens are returned by the
        next call, which launches its own step before it waits for them."""
        batch = self.scheduler.schedule()
        for seq in batch.failed:
            entry = self._requests[seq.request_id]
            entry.output.error = seq.error
            self._mark_finished(entry)
        changed = [self._requests[seq.request_id].output for seq in batch.failed]
        in_flight, self._in_flight = self._in_flight, None
        try:
            launched = self._launch(batch) if batch.seqs else None
        finally:  # the step in flight is applied even when this one failed to launch
            if in_flight is not None:
                changed += self._resolve(*in_flight)
        if launched is not None:
            self.scheduler.advance(batch, launched.rows)
            if self.async_scheduling:
                self._in_flight = (batch, launched)
            else:
                changed += self._resolve(batch, launched)
        return changed

    def _launch(self, batch: ScheduledBatch) -> _Launched:
        """Queue the step's forward and sampling; nothing is read back yet."""
        seqs = batch.seqs
        out = self.runner.execute(self.scheduler.input_batch, batch.slots, batch.num_new_tokens)
        entries = [self._requests[seqs[i].request_id] for i in out.sample_rows]
        tokens = self.sampler.sample(
            out.logits, [e.request.params for e in entries], [e.generator for e in entries]
        )
        if self.async_scheduling:  # only a step scheduled before these are read uses them
            self.runner.record_sampled(batch.slots[out.sample_rows], tokens)
        return _Launched(out.sample_rows, HostCopy(tokens))

    def _resolve(self, batch: ScheduledBatch, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched step's tokens, hand them to the scheduler and the stop-string
        checks; returns the outputs that changed."""
        sampled: list[int | None] = [None] * len(batch.seqs)
        for row, token in zip(launched.rows, launched.tokens.tolist(), strict=True):
            sampled[row] = token
        filled = self.scheduler.resolve(batch, sampled)
        finished = [seq for seq in filled if seq.is_finished]
        for entry in list(self._with_stops.values()):  # only requests with stop strings
            was_finished = entry.request.status == SequenceStatus.FINISHED
            stop = entry.text.update(was_finished)
            if stop is not None:  # a stop string in the last token still reads "stop"
                self.scheduler.finish(entry.request, "stop", stop_reason=stop)
                if not was_finished:
                    finished.append(entry.request)
        for seq in finished:
            self._mark_finished(self._requests[seq.request_id])
        return [self._requests[seq.request_id].output for seq in filled]

    def _mark_finished(self, entry: _Tracked) -> None:
        self._with_stops.pop(entry.request.request_id, None)
        entry.output.finished = True
        entry.output.outputs[0].finish_reason = entry.request.finish_reason

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Run `prompts` (a string, token ids, or a list of either) to completion with `params`
        (one for all, or one per prompt), string prompts in the chat template when `chat`.
        Returns one `RequestOutput` per prompt, in order; a failed request (e.g. a prompt longer
        than `max_model_len`) has `error` set. TypeError / ValueError for a bad prompt or params,
        before anything is queued."""
        prompts, params = check_generate_args(prompts, params)
        # Encode every prompt before queueing any, so that a bad one leaves nothing behind.
        encoded = [self.encode_prompt(p, chat) for p in prompts]
        ids = [self._add(p, e, sp) for p, e, sp in zip(prompts, encoded, params, strict=True)]
        outputs = [self._requests[i].output for i in ids]
        try:
            while not all(o.finished for o in outputs):
                self.step()
        finally:
            for request_id in ids:  # on an interrupt, stop what is still running
                self.abort_request(request_id)
        return outputs

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Generate one prompt, yielding its text as it appears; text that may still start a
        stop string, or is half a multi-byte character, is held back until settled. Closing
        the iterator aborts the request. TypeError / ValueError for a bad prompt or params;
        ValueError when the request fails (e.g. a prompt longer than `max_model_len`)."""
        params = check_params(params)
        request_id = self.add_request(prompt, params, chat)
        output = self._requests[request_id].output
        self.last_stream_output = output
        hold = max((len(stop) - 1 for stop in params.stop), default=0)
        shown = 0
        try:
            is_done = False
            while not is_done:
                if not output.finished:
                    self.step()
                is_done = output.finished
                text = output.outputs[0].text
                ready = len(text) if is_done else max(len(text.rstrip("\ufffd")) - hold, shown)
                if ready > shown:
                    yield text[shown:ready]
                    shown = ready
        finally:
            self.abort_request(request_id)
        if output.error:
            raise ValueError(output.error)
