"""The engine shell: the tokenizer, detokenizers and outputs around an ``EngineLoop``.

The loop (``nanofn.engine.loop``) owns the core state and the plans in flight; the shell turns
prompts into sequences for it, watches the delivered tokens for stop strings, and turns
sequences back into ``RequestOutput``s. With async scheduling the outputs of a call show tokens
sampled by earlier calls' plans.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO, Union

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanofn.engine.detokenizer import Detokenizer
from nanofn.engine.loop import Delivery, EngineLoop
from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import CompletionOutput, Logprob, RequestOutput
from nanofn.runner.model_runner import ModelRunner, RunnerConfig
from nanofn.runner.tensor_parallel import TensorParallelExecutor
from nanofn.state import (EngineState, Figures, FinishReason, InvalidRequest, NewSeq,
                          SamplingParams, Seq, TokenLogprobs, figures, initial_state)
from nanofn.state.policy import may_stop

PromptInput = Union[str, Sequence[int], Mapping[str, Any]]


@dataclass
class _SeqOutput:
    """The shell's view of one output sequence of a request."""

    seq_id: str  # the core's id
    index: int
    detokenizer: Detokenizer
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None


@dataclass
class _Request:
    """A user's request: one prompt, ``n`` output sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_SeqOutput]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


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
        # Checked now, before the costly part (weights, KV cache, CUDA graphs).
        self.scheduler_config = options.scheduler_config(self.max_model_len, self.eos_token_ids,
                                                         self.hf_config.vocab_size)
        runner_config = _runner_config(options, model_dir, self.max_model_len)
        self.runner = (ModelRunner(self.hf_config, runner_config) if runner_config.tp_size == 1
                       else TensorParallelExecutor(self.hf_config, runner_config))
        state = initial_state(self.scheduler_config, self.runner.num_blocks)
        self._trace: TextIO | None = open(options.trace, "w", buffering=1) if options.trace else None
        self.loop = EngineLoop(state, self.runner, async_scheduling=options.async_scheduling,
                               trace=self._trace, trace_meta={
                                   "model": str(model_dir), "dtype": str(self.runner.dtype),
                                   "tensor_parallel_size": runner_config.tp_size})
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[str, tuple[_Request, _SeqOutput]] = {}  # by the core's id
        # Everything loaded so far lives as long as the engine: keep it out of the cyclic
        # collector's way, which would otherwise walk the model's objects every full
        # collection, while the scheduler makes many short-lived records per step.
        gc.collect()
        gc.freeze()

    @property
    def state(self) -> EngineState:
        return self.loop.state

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
        news = [NewSeq(seq_id, tuple(token_ids), child)
                for seq_id, child in _children(request_id, params)]
        seq_ids = self._add_all(news)
        request = _Request(request_id, text, token_ids, [
            _SeqOutput(seq_id, i, Detokenizer(self.tokenizer, token_ids, params), [],
                       [] if params.logprobs is not None else None,
                       0.0 if params.logprobs is not None else None)
            for i, seq_id in enumerate(seq_ids)])
        self._requests[request_id] = request
        for seq in request.seqs:
            self._seqs[seq.seq_id] = (request, seq)
        return request_id

    def _add_all(self, news: list[NewSeq]) -> list[str]:
        """Queue every sequence of a request, or none."""
        seq_ids: list[str] = []
        try:
            for new in news:
                seq_ids.append(self.loop.add(new))
        except InvalidRequest:
            for seq_id in seq_ids:
                self.loop.abort(seq_id)
            raise
        return seq_ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; unknown or finished ids are ignored."""
        request = self._requests.get(request_id)
        if request is not None:
            for seq in request.seqs:
                self.loop.abort(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    def figures(self) -> Figures:
        return figures(self.loop.state)

    # --- the step -------------------------------------------------------------------------

    def step(self, only_finished: bool = False) -> StepResult:
        """One engine step. Returns the requests that got a token or finished (with
        ``only_finished``, just the finished ones, which is cheaper for batch generation)."""
        result = self.loop.step(self._take_delivery)
        finished = self._finish(result.finished)
        advanced = [] if only_finished or result.delivered is None else \
            self._advanced(result.delivered)
        reported = finished if only_finished else _unique(advanced + finished)
        return StepResult([self._output(r) for r in reported],
                          result.plan.num_prefill_tokens, result.plan.num_decode_tokens)

    def _take_delivery(self, delivery: Delivery) -> Iterable[str]:
        """Hand the delivered tokens to their sequences; return those whose stop string they
        complete. Tokens of sequences that finished meanwhile (they were sampled one step
        ahead) are dropped."""
        out = delivery.output
        for seq_id, token, logprobs in zip(delivery.plan.sampling_seq_ids, out.token_ids,
                                           out.logprobs):
            owner = self._seqs.get(seq_id)
            if owner is None:  # finished while this token was in flight
                continue
            seq = owner[1]
            seq.token_ids.append(token)
            if logprobs is not None:
                self._add_logprobs(seq, logprobs)
            detokenizer = seq.detokenizer
            if detokenizer.add(token, may_stop(detokenizer.params, len(seq.token_ids))):
                yield seq_id

    def _advanced(self, delivery: Delivery) -> list[_Request]:
        return [owner[0] for seq_id in delivery.plan.sampling_seq_ids
                if (owner := self._seqs.get(seq_id)) is not None]

    def _finish(self, seqs: tuple[Seq, ...]) -> list[_Request]:
        done = []
        for seq in seqs:
            owner = self._seqs.pop(seq.seq_id, None)
            if owner is None:
                continue
            request, output = owner
            output.finish_reason = seq.finish_reason.value
            if seq.finish_reason is FinishReason.STOP and not output.detokenizer.stopped:
                output.detokenizer.drop_last_token()  # a stop token, not a stop string
            if request.finished:
                del self._requests[request.request_id]
                done.append(request)
        return done

    def _add_logprobs(self, seq: _SeqOutput, lp: TokenLogprobs) -> None:
        entry = {token: Logprob(value, rank, self.tokenizer.decode([token]))
                 for rank, (token, value) in enumerate(lp.top, start=1)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self.tokenizer.decode([lp.token_id]))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.logprob

    def _output(self, request: _Request) -> RequestOutput:
        outputs = [CompletionOutput(
            index=s.index,
            text=s.detokenizer.visible_text(s.finish_reason is not None),
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason,
        ) for s in request.seqs]
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


def _runner_config(options: EngineOptions, model_dir: Path, max_model_len: int) -> RunnerConfig:
    device = torch.device(options.device if options.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    return RunnerConfig(
        model_dir=model_dir,
        dtype=options.dtype,
        device=device,
        block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max_model_len,
        gpu_memory_utilization=options.gpu_memory_utilization,
        kv_cache_memory_bytes=options.kv_cache_memory_bytes,
        num_kv_blocks=options.num_kv_blocks,
        seed=options.seed,
        enforce_eager=options.enforce_eager,
        kernel_backend=options.kernel_backend,
        tp_size=options.tensor_parallel_size,
    )


def _children(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """One core sequence per sample: ``n > 1`` becomes ids ``id:0 .. id:n-1``, each with n=1
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
