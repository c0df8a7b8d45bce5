"""The engine shell: tokenizer, the pure core's ``step``, the runner and the trace, connected.

One ``step()``:
1. the tokens of the oldest plan not yet delivered are detokenized (stop strings are found
   here);
2. they, the stop-string hits, the aborts and the new requests go to ``state.step`` as events;
3. the new plan is written to the trace and launched on the device;
4. the oldest launched plan's tokens are fetched for the next call. With async scheduling
   (the default) a plan launched alone is not waited for: the next call schedules while the
   device computes, and its plan reads the pending tokens on the device.
So the outputs of a call show tokens sampled by earlier calls' plans.
"""

from __future__ import annotations

import gc
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO, Union

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanofn.engine.detokenizer import Detokenizer
from nanofn.engine.options import EngineOptions
from nanofn.model import resolve_dtype
from nanofn.outputs import CompletionOutput, Logprob, RequestOutput
from nanofn.runner.model_runner import ModelRunner, RunnerConfig
from nanofn.runner.sampler import DeviceSample, SampleOutput, TokenLogprobs
from nanofn.runner.tensor_parallel import TensorParallelExecutor
from nanofn.state import (BatchPlan, EngineState, Events, Figures, FinishReason, InvalidRequest,
                          NewRequest,
                          SamplingParams, SchedulerConfig, check_new_request, figures,
                          header_line, initial_state, step, step_line)

PromptInput = Union[str, Sequence[int], Mapping[str, Any]]


@dataclass
class _Completion:
    """The shell's view of one output sequence."""

    seq_id: str
    index: int
    detokenizer: Detokenizer
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[_Completion]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]  # requests that advanced or finished in this call
    num_prefill_tokens: int  # tokens of the plan launched by this call
    num_decode_tokens: int


class Engine:
    def __init__(self, options: EngineOptions):
        self.options = options
        model_dir = _model_dir(options.model)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = _load_tokenizer(options.tokenizer or model_dir)
        self.max_model_len = _max_model_len(self.hf_config, options.max_model_len)
        self.eos_token_ids = _eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        device = torch.device(options.device if options.device != "auto" else
                              "cuda" if torch.cuda.is_available() else "cpu")
        # The scheduling limits are checked now, before the costly part (weights, KV cache,
        # CUDA graphs); the cache size comes from the runner.
        scheduler_config = SchedulerConfig(
            num_blocks=-(-self.max_model_len // options.block_size),
            block_size=options.block_size,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=options.enable_prefix_caching,
            enable_chunked_prefill=options.enable_chunked_prefill,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.hf_config.vocab_size,
        )
        runner_config = RunnerConfig(
            model_dir=model_dir,
            dtype=resolve_dtype(self.hf_config, options.dtype),
            device=device,
            block_size=options.block_size,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            gpu_memory_utilization=options.gpu_memory_utilization,
            kv_cache_memory_bytes=options.kv_cache_memory_bytes,
            num_kv_blocks=options.num_kv_blocks,
            seed=options.seed,
            enforce_eager=options.enforce_eager,
            kernel_backend=options.kernel_backend,
            tp_size=options.tensor_parallel_size,
        )
        self.runner = (ModelRunner(self.hf_config, runner_config) if runner_config.tp_size == 1
                       else TensorParallelExecutor(self.hf_config, runner_config))
        self.scheduler_config = replace(scheduler_config, num_blocks=self.runner.num_blocks)
        self.state: EngineState = initial_state(self.scheduler_config)
        self._trace: TextIO | None = None
        if options.trace:
            self._trace = open(options.trace, "w", buffering=1)
            self._trace.write(header_line(self.scheduler_config, {
                "model": str(model_dir), "dtype": str(runner_config.dtype),
                "tensor_parallel_size": runner_config.tp_size}) + "\n")
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._completions: dict[str, tuple[_Request, _Completion]] = {}  # by seq id
        self._new: list[NewRequest] = []
        self._aborts: list[str] = []
        self._aborted_before_start: list[_Request] = []
        self._in_flight: deque[tuple[BatchPlan, DeviceSample]] = deque()  # launched, not waited for
        self._delivery: tuple[BatchPlan, SampleOutput] | None = None  # waited for, not delivered
        # Everything loaded so far lives as long as the engine: keep it out of the cyclic
        # collector's way, which would otherwise walk the model's objects every full
        # collection, while the scheduler makes many short-lived records per step.
        gc.collect()
        gc.freeze()

    # --- requests -------------------------------------------------------------------------

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it starts at the next ``step()``. Raises ``InvalidRequest`` (a
        ``ValueError``) naming the problem, leaving the engine as it was."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        news = [NewRequest(self._fresh_seq_id(seq_id), tuple(token_ids), child)
                for seq_id, child in _children(request_id, params)]
        for new in news:
            if new.request_id in self._completions:
                raise InvalidRequest(f"request_id {new.request_id!r} is already in use")
            check_new_request(self.state, new)
        request = _Request(request_id, text, token_ids, [
            _Completion(new.request_id, i, Detokenizer(self.tokenizer, token_ids, params), [],
                        [] if params.logprobs is not None else None,
                        0.0 if params.logprobs is not None else None)
            for i, new in enumerate(news)])
        self._requests[request_id] = request
        for completion in request.completions:
            self._completions[completion.seq_id] = (request, completion)
        self._new.extend(news)
        return request_id

    def _fresh_seq_id(self, seq_id: str) -> str:
        """The id to give the core: ``seq_id``, unless an earlier sequence of that id still
        has a sampled token in flight (it finished a step ahead of its last token), which the
        new one must not receive; then ``seq_id~N``. Outputs keep the user's request id."""
        if any(seq_id in ids for ids in self.state.awaiting):
            return f"{seq_id}~{next(self._ids)}"
        return seq_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; unknown or finished ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        seq_ids = {c.seq_id for c in request.completions}
        queued = [n for n in self._new if n.request_id in seq_ids]
        if queued:  # not in the core yet: it never starts
            self._new = [n for n in self._new if n.request_id not in seq_ids]
            for completion in request.completions:
                completion.finish_reason = "abort"
            self._forget(request)
            self._aborted_before_start.append(request)
        else:
            self._aborts.extend(seq_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted_before_start)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    def figures(self) -> Figures:
        return figures(self.state)

    # --- the step -------------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> StepResult:
        """One engine step. Returns the requests that got a token or finished (with
        ``only_finished``, just the finished ones, which is cheaper for batch generation)."""
        sampled, stop_hits, advanced = self._take_sampled()
        events = Events(sampled=sampled, stop_hits=stop_hits, aborts=tuple(self._aborts),
                        new_requests=tuple(self._new))
        self._aborts, self._new = [], []
        self.state, plan = step(self.state, events)
        if plan.seqs:  # first, so that the device starts while the host does the rest
            self._in_flight.append((plan, self.runner.launch(plan)))
        if self._trace is not None:
            self._trace.write(step_line(events, plan) + "\n")
        finished = self._finish(self.state.finished) + self._aborted_before_start
        self._aborted_before_start = []
        self._wait_for_tokens(launched_alone=bool(plan.seqs) and len(self._in_flight) == 1)
        reported = finished if only_finished else _unique(advanced + finished)
        return StepResult([self._output(r) for r in reported],
                          plan.num_prefill_tokens, plan.num_decode_tokens)

    def _wait_for_tokens(self, launched_alone: bool) -> None:
        """Bring the oldest launched plan's tokens to the host for the next step. With async
        scheduling, a plan just launched with nothing ahead of it is not waited for: the next
        step is scheduled while the device works on it."""
        if not self._in_flight or (self.options.async_scheduling and launched_alone):
            return
        plan, launched = self._in_flight.popleft()
        self._delivery = (plan, launched.wait())

    def _take_sampled(self) -> tuple[tuple[int, ...] | None, tuple[str, ...], list[_Request]]:
        """Hand the delivered tokens to their completions; find stop strings. Tokens of
        sequences that finished meanwhile (they were sampled one step ahead) are dropped."""
        if self._delivery is None:
            return None, (), []
        plan, out = self._delivery
        self._delivery = None
        stop_hits, advanced = [], []
        for seq_id, token, logprobs in zip(plan.sampling_seq_ids, out.token_ids, out.logprobs):
            owner = self._completions.get(seq_id)
            if owner is None:  # finished while this token was in flight
                continue
            request, completion = owner
            completion.token_ids.append(token)
            if logprobs is not None:
                self._add_logprobs(completion, logprobs)
            if completion.detokenizer.add(token, len(completion.token_ids)):
                stop_hits.append(seq_id)
            advanced.append(request)
        return tuple(out.token_ids), tuple(stop_hits), advanced

    def _finish(self, seqs) -> list[_Request]:
        done = []
        for seq in seqs:
            request, completion = self._completions.pop(seq.seq_id)
            completion.finish_reason = seq.finish_reason.value
            if seq.finish_reason is FinishReason.STOP and not completion.detokenizer.stopped:
                completion.detokenizer.drop_last_token()  # a stop token, not a stop string
            if request.finished:
                self._forget(request)
                done.append(request)
        return done

    def _forget(self, request: _Request) -> None:
        del self._requests[request.request_id]
        for completion in request.completions:
            self._completions.pop(completion.seq_id, None)

    def _add_logprobs(self, completion: _Completion, lp: TokenLogprobs) -> None:
        entry = {token: Logprob(value, rank, self.tokenizer.decode([token]))
                 for rank, (token, value) in enumerate(lp.top, start=1)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))
        completion.logprobs.append(entry)
        completion.cumulative_logprob += lp.logprob

    def _output(self, request: _Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=c.index,
            text=c.detokenizer.visible_text(c.finish_reason is not None),
            token_ids=list(c.token_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
        ) for c in request.completions]
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             outputs, request.finished)

    # --- helpers --------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt: a string, a sequence of token ids, or a
        dict with ``prompt_token_ids`` or ``prompt``."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequest("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        return None, _token_list(prompt)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if isinstance(self.runner, TensorParallelExecutor):
            self.runner.close()


def _children(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """One core request per sample: ``n > 1`` becomes ids ``id:0 .. id:n-1``, each with n=1
    and, when seeded, its own seed (so the samples differ)."""
    if params.n == 1:
        return [(request_id, params)]
    return [(f"{request_id}:{i}", replace(params, n=1,
                                          seed=None if params.seed is None else params.seed + i))
            for i in range(params.n)]


def _token_list(ids: Any) -> list[int]:
    """Token ids as a list (the core checks each id); anything else is an ``InvalidRequest``."""
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Sequence):
        raise InvalidRequest(f"a prompt must be a string, a list of token ids or a dict, "
                             f"got {type(ids).__name__}")
    return list(ids)


def _unique(requests: list[_Request]) -> list[_Request]:
    return list({id(r): r for r in requests}.values())


def _model_dir(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist (nanofn loads local "
                                f"Hugging Face folders; it does not download)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path / 'config.json')!r} is missing: {str(path)!r} is not "
                                f"a Hugging Face model folder")
    return path


def _load_tokenizer(path: str | Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"the tokenizer in {str(path)!r} is not a fast (tokenizers) one; nanofn "
                         f"needs tokenizer.json")
    return tokenizer


def _max_model_len(hf_config: Any, asked: int | None) -> int:
    limit = hf_config.max_position_embeddings
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len {asked} is longer than the model's "
                         f"max_position_embeddings {limit}")
    return asked


def _eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    if (model_dir / "generation_config.json").is_file():
        sources.insert(0, GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for source in sources:
        for token in ([source] if isinstance(source, int) else source or []):
            if token not in ids:
                ids.append(token)
    return tuple(ids)
