"""The engine shell: the tokenizer, detokenizers and outputs around an ``EngineLoop``.

The loop (``nanofn.engine.loop``) owns the core state and the plans in flight; the shell turns
prompts into sequences for it, watches the delivered tokens for stop strings, and turns
sequences back into ``RequestOutput``s. With async scheduling the outputs of a call show tokens
sampled by earlier calls' plans.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO, Union

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from nanofn.engine.collector import freeze_while_alive
from nanofn.engine.detokenizer import Detokenizer, decode_output
from nanofn.engine.generation_config import generation_defaults
from nanofn.engine.loop import Delivery, EngineLoop, LoopStep
from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import (CompletionDelta, CompletionOutput, Logprob, OutputDelta,
                                   RequestMetrics, RequestOutput)
from nanofn.engine.structured import Grammars
from nanofn.runner.model_runner import ModelRunner, RunnerConfig, check_kv_cache_size
from nanofn.runner.tensor_parallel import TensorParallelExecutor
from nanofn.state import (EngineState, Figures, FinishReason, InvalidRequest, NewSeq,
                          SamplingParams, Seq, TokenLogprobs, figures, initial_state)
from nanofn.state.policy import may_stop

PromptInput = Union[str, Sequence[int], Mapping[str, Any]]


@dataclass
class _SeqOutput:
    """The shell's view of one output sequence of a request.

    Only a *watched* sequence (one with stop strings or logprobs) takes its tokens as they are
    delivered, into ``token_ids`` and its incremental ``detokenizer``; the others are decoded
    once, when they finish, from the core's record (or on demand, for streamed outputs).
    """

    seq_id: str  # the core's id
    index: int
    params: SamplingParams
    detokenizer: Detokenizer | None  # watched sequences
    token_ids: list[int]  # delivered so far (watched sequences); all of them once finished
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # once finished and decoded
    shown_token_ids: list[int] | None = None  # what the text shows, once finished
    # What its latest ``OutputDelta`` left it at: (the token list, its length then, the text,
    # the logprob list, its length then); None before the first
    sent: tuple | None = None

    @property
    def watched(self) -> bool:
        return self.detokenizer is not None


@dataclass
class _Request:
    """A user's request: one prompt, ``n`` output sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool  # reported whenever it advances, not only when it finishes
    seqs: list[_SeqOutput]
    metrics: RequestMetrics
    num_cached_tokens: int | None = None  # known once a sequence finishes
    # Per prompt position (None for the first, and until computed), when asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    reported_tokens: int = 0  # its tokens when ``step()`` last reported it (streamed)
    sent_metrics: RequestMetrics | None = None  # those of its latest ``OutputDelta`` (None: none)

    def __post_init__(self) -> None:
        # The outputs' copy, one for all of them: a streamed request's outputs (one a step)
        # would otherwise copy a long prompt every step, the engine's own stays private
        self.output_prompt_token_ids = list(self.prompt_token_ids)

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
        # The language model's part (of a vision-language config: its text_config; else the same)
        self.text_config = self.hf_config.get_text_config()
        self.tokenizer = load_tokenizer(options)
        self.max_model_len = _max_model_len(self.text_config, options.max_model_len)
        self.eos_token_ids = _eos_token_ids(model_dir, self.text_config, self.tokenizer)
        # The sampling fields the generation config sets (vLLM's get_diff_sampling_param).
        self.generation_defaults = generation_defaults(options.generation_config, model_dir)
        # Checked now, before the costly part (weights, KV cache, CUDA graphs).
        self.scheduler_config = options.scheduler_config(self.max_model_len, self.eos_token_ids,
                                                         self.text_config.vocab_size)
        runner_config = _runner_config(options, model_dir, self.max_model_len,
                                       self.text_config.hidden_size)
        check_kv_cache_size(self.hf_config, runner_config)
        self._trace: TextIO | None = (open(options.trace, "w", buffering=1) if options.trace
                                      else None)
        try:
            self.runner = (ModelRunner(self.hf_config, runner_config)
                           if runner_config.tp_size == 1
                           else TensorParallelExecutor(self.hf_config, runner_config))
        except BaseException:
            if self._trace is not None:
                self._trace.close()
            raise
        state = initial_state(self.scheduler_config, self.runner.num_blocks,
                              self.runner.num_state_slots)
        self.grammars = Grammars(self.tokenizer, self.text_config.vocab_size, self.eos_token_ids)
        self.loop = EngineLoop(state, self.runner, async_scheduling=options.async_scheduling,
                               trace=self._trace, trace_meta={
                                   "model": str(model_dir), "dtype": str(self.runner.dtype),
                                   "tensor_parallel_size": runner_config.tp_size},
                               token_masks=self.grammars.bitmask)
        self._ids = itertools.count()
        self.closed = False
        self._unfinished_step: LoopStep | None = None  # taken from the loop, not yet handled
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[str, tuple[_Request, _SeqOutput]] = {}  # by the core's id
        self._watched: dict[str, _SeqOutput] = {}  # the live ones with stop strings or logprobs
        self._undecoded: dict[str, _Request] = {}  # finished, their text left to decode_texts
        self._to_decode: deque[tuple[_Request, _SeqOutput]] = deque()  # decoded while waiting
        self._awaiting_first_token: set[str] = set()  # started sequences, for the metrics
        # Everything loaded so far lives as long as the engine: keep it out of the cyclic
        # collector's way, which would otherwise walk the model's objects every full
        # collection, while the scheduler makes many short-lived records per step.
        self._unfreeze = freeze_while_alive(self)

    @property
    def state(self) -> EngineState:
        return self.loop.state

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the generation config's defaults (see ``generation_config``
        in ``EngineOptions``): what a request without params samples with."""
        return SamplingParams(**self.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache now, as vLLM's: only while no request is unfinished (False
        then, and nothing changes). The blocks leave the cache through a step of their own
        (events, no plan), so a trace of the run replays it and the next step does not pay it."""
        if self._requests or self.loop.has_work():
            return False
        self.loop.forget_cached_blocks()
        self.loop.step()
        return True

    # --- requests -------------------------------------------------------------------------

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True) -> str:
        """Queue a request; it starts at the next ``step()``. Raises ``InvalidRequest`` (a
        ``ValueError``) naming the problem, leaving the engine as it was. ``stream``: its
        text is decoded as the tokens come and ``step()`` reports it whenever it advances;
        otherwise only when it finishes (and its text is decoded once, at the end)."""
        self._check_open()
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = self._new_id() if request_id is None else request_id
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        arrival_time = time.time()
        params = self._with_bad_word_ids(params)
        text, token_ids = self.tokenize(prompt)
        token_ids = self._truncated(token_ids, params.truncate_prompt_tokens)
        news = [NewSeq(seq_id, tuple(token_ids), child)
                for seq_id, child in _children(request_id, params)]
        matchers = (self.grammars.matchers_for(request_id, params.structured_outputs, len(news))
                    if params.structured_outputs is not None else [])
        seq_ids: list[str] = []
        try:
            for new in news:  # every sequence of the request, or none
                seq_ids.append(self.loop.add(new))
            for seq_id, matcher in zip(seq_ids, matchers):
                self.grammars.add(seq_id, matcher)
            watched = stream or bool(params.stop) or params.logprobs is not None
            request = _Request(request_id, text, token_ids, stream, [
                _SeqOutput(seq_id, i, params,
                           Detokenizer(self.tokenizer, token_ids, params) if watched else None,
                           [], [] if params.logprobs is not None else None,
                           0.0 if params.logprobs is not None else None)
                for i, seq_id in enumerate(seq_ids)], RequestMetrics(arrival_time),
                prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(token_ids))
            for seq in request.seqs:
                self._seqs[seq.seq_id] = (request, seq)
                if watched:
                    self._watched[seq.seq_id] = seq
            self._requests[request_id] = request
        except BaseException:  # an interrupt, say: the core must not run what nobody owns
            for seq_id in seq_ids:
                self.loop.abort(seq_id)
                self._seqs.pop(seq_id, None)
                self._watched.pop(seq_id, None)
                self.grammars.remove(seq_id)
            raise
        return request_id

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the token sequences of its bad words, as vLLM tokenizes them: each
        word alone and after a space (to ban it at the start of the text and inside it)."""
        if not params.bad_words or params.bad_words_token_ids:
            return params
        sequences: list[tuple[int, ...]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return replace(params, bad_words_token_ids=tuple(sequences))

    def _truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last ``keep`` tokens (-1: ``max_model_len``), as vLLM truncates."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        return token_ids[-keep:]

    def _new_id(self) -> str:
        """The next automatic request id that no request in the engine has (a user may have
        taken one of the numbers)."""
        while (request_id := str(next(self._ids))) in self._requests:
            pass
        return request_id

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

    def step(self, only_finished: bool = False, decode_finished: bool = True) -> StepResult:
        """One engine step. Returns the requests that got a token or finished (with
        ``only_finished``, just the finished ones, which is cheaper for batch generation).

        ``decode_finished=False`` leaves the text of finished sequences that need no stop
        strings empty, for ``decode_texts`` to fill in later: the next steps decode a few of
        them each while the device computes, instead of this one before its launch."""
        return self._step(self._output, only_finished, decode_finished)

    def step_deltas(self) -> StepResult:
        """``step()``, with each request it reports as an ``OutputDelta``: what the request
        gained since its previous delta (all of it in its first). A streamed request's whole
        output copies every token it has, every step; its delta costs the new ones
        (``outputs.apply_delta`` makes the whole output again). What the engine process sends
        the server (``engine_process``)."""
        return self._step(self._delta, False, True)

    def _step(self, report: Callable[[_Request], Any], only_finished: bool,
              decode_finished: bool) -> StepResult:
        self._check_open()
        if self._unfinished_step is not None:  # a step interrupted after the core's step
            self._finish(self._unfinished_step.finished)
            self._unfinished_step = None
        if self._requests and not self.loop.has_work():
            self._no_progress()
        result = self._unfinished_step = self.loop.step(self._take_delivery, self._decode_some)
        if result.plan.started:
            self._note_scheduled(result.plan.started)
        finished = self._finish(result.finished, decode_finished)
        self._unfinished_step = None
        if only_finished:
            outputs = [report(r) for r in finished]
        else:
            advanced = ([] if result.delivered is None else
                        [r for r in self._advanced(result.delivered) if r.stream and self._due(r)])
            outputs = [report(r) for r in _unique(advanced + finished)]
        return StepResult(outputs, result.plan.num_prefill_tokens, result.plan.num_decode_tokens)

    def _note_scheduled(self, started: Sequence[Any]) -> None:
        """Metrics: the requests whose first plan this is, and which await their first token."""
        now = time.time()
        for start in started:
            owner = self._seqs.get(start.seq_id)
            if owner is not None and owner[0].metrics.first_scheduled_time is None:
                owner[0].metrics = replace(owner[0].metrics, first_scheduled_time=now)
                self._awaiting_first_token.add(start.seq_id)

    def _take_delivery(self, delivery: Delivery) -> list[str]:
        """Hand the delivered tokens to the watched sequences; return those whose stop string
        they complete (or whose grammar ends). Tokens of sequences that finished meanwhile (they
        were sampled one step ahead) are dropped; the others' tokens wait in the core."""
        if self._awaiting_first_token:
            self._note_first_tokens(delivery.plan.sampling_seq_ids)
        if delivery.output.prompt_logprobs:
            self._take_prompt_logprobs(delivery.output.prompt_logprobs)
        if not self._watched and not self.grammars.matchers:
            return []
        out = delivery.output
        tokens = out.token_ids.tolist() if hasattr(out.token_ids, "tolist") else out.token_ids
        stop_hits = self._advance_grammars(delivery.plan.sampling_seq_ids, tokens)
        for i, seq_id in enumerate(delivery.plan.sampling_seq_ids):
            seq = self._watched.get(seq_id)
            if seq is None:
                continue
            seq.token_ids.append(tokens[i])
            logprobs = out.logprobs[i] if out.logprobs is not None else None
            if seq.logprobs is not None and logprobs is not None:
                self._add_logprobs(seq, logprobs)
            if seq.detokenizer.add(tokens[i], may_stop(len(seq.token_ids), seq.params.min_tokens)):
                stop_hits.append(seq_id)
        return stop_hits

    def _take_prompt_logprobs(self, chunks: tuple) -> None:
        """Store a plan's prompt logprobs by position (a preempted sequence recomputes its
        prompt: the same positions again). With ``n > 1`` every sample computes them; the
        first sequence's are kept."""
        for seq_id, position, logprobs in chunks:
            owner = self._seqs.get(seq_id)
            if owner is None or owner[1].index != 0 or owner[0].prompt_logprobs is None:
                continue
            request = owner[0]
            detokenize = owner[1].params.detokenize
            for offset, lp in enumerate(logprobs):
                request.prompt_logprobs[position + offset] = self._logprob_entry(lp, detokenize)

    def _note_first_tokens(self, seq_ids: tuple[str, ...]) -> None:
        """Metrics: the first token time of the requests awaiting one that these tokens reach
        (a set operation over the delivery only while some request awaits its first token)."""
        now = time.time()
        for seq_id in self._awaiting_first_token.intersection(seq_ids):
            self._awaiting_first_token.discard(seq_id)
            owner = self._seqs.get(seq_id)
            if owner is not None and owner[0].metrics.first_token_time is None:
                owner[0].metrics = replace(owner[0].metrics, first_token_time=now)
    def _advance_grammars(self, seq_ids: Sequence[str], tokens: list[int]) -> list[str]:
        """Advance the constrained sequences' matchers; the ids of those whose grammar ended."""
        if not self.grammars.matchers:
            return []
        return [seq_id for seq_id, token in zip(seq_ids, tokens)
                if self.grammars.accept(seq_id, token)]

    def _due(self, request: _Request) -> bool:
        """Whether a streamed request that advanced is reported now: always at a
        ``stream_interval`` of 1, else at its first tokens and once it has that many new ones
        since it was last reported (a finished request always is)."""
        interval = self.options.stream_interval
        if interval == 1:
            return True
        tokens = sum(len(s.token_ids) for s in request.seqs)
        if request.reported_tokens and tokens - request.reported_tokens < interval:
            return False
        request.reported_tokens = tokens
        return True

    def _advanced(self, delivery: Delivery) -> list[_Request]:
        return [owner[0] for seq_id in delivery.plan.sampling_seq_ids
                if (owner := self._seqs.get(seq_id)) is not None]

    def _finish(self, seqs: tuple[Seq, ...], decode: bool = True) -> list[_Request]:
        """Take the core's finished records: their tokens are the output; the unwatched ones'
        text is decoded once, now or (``decode`` off) in ``decode_texts``. Taking the same
        records again (after an interrupted step) completes what was left."""
        done = []
        for seq in seqs:
            owner = self._seqs.get(seq.seq_id)
            if owner is None:
                continue
            request, output = owner
            if output.finish_reason is None:
                self._take_output(request, output, seq, decode)
            self._awaiting_first_token.discard(seq.seq_id)
            if request.finished and request.request_id in self._requests:
                self._finish_metrics(request)
                if not decode:
                    self._undecoded[request.request_id] = request
                del self._requests[request.request_id]
                done.append(request)
            self._watched.pop(seq.seq_id, None)
            self.grammars.remove(seq.seq_id)
            del self._seqs[seq.seq_id]
        return done

    def _finish_metrics(self, request: _Request) -> None:
        now, metrics = time.time(), request.metrics
        num_tokens = sum(len(s.token_ids) for s in request.seqs)
        tokens = {} if not num_tokens else {  # its only token may have come with the finish
            "last_token_time": now, "first_token_time": metrics.first_token_time or now}
        request.metrics = replace(metrics, finished_time=now, num_generation_tokens=num_tokens,
                                  **tokens)

    def _stop_reason(self, output: _SeqOutput, reason: FinishReason,
                     by_string: bool) -> int | str | None:
        """What ended a stopped sequence, as vLLM reports it: the stop string, or the stop
        token id; None for an end-of-sequence token (and for any other finish)."""
        if reason is not FinishReason.STOP:
            return None
        if by_string:
            return output.detokenizer.stop_string
        last = output.token_ids[-1] if output.token_ids else None
        if last in self.eos_token_ids and not output.params.ignore_eos:
            return None
        return last if last in output.params.stop_token_ids else None

    def _take_output(self, request: _Request, output: _SeqOutput, seq: Seq,
                     decode: bool) -> None:
        reason = seq.finish_reason
        output.token_ids = list(seq.output_token_ids)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = seq.num_cached_tokens
        by_string = output.watched and output.detokenizer.stopped
        output.stop_reason = self._stop_reason(output, reason, by_string)
        dropped = (reason is FinishReason.STOP and not by_string
                   and not output.params.include_stop_str_in_output)
        if output.watched:
            if dropped:
                output.detokenizer.drop_last_token()
            output.text = output.detokenizer.visible_text(True)
        else:  # a stop token's text is not part of the output, as in vLLM
            output.shown_token_ids = output.token_ids[:-1] if dropped else output.token_ids
            if decode:
                self._decode(request, output)
            else:
                self._to_decode.append((request, output))
        output.finish_reason = reason.value  # last: the output is whole

    def abort_and_settle(self, request_ids: Sequence[str]) -> None:
        """After a call was interrupted: abort its requests and step until they have left and
        every plan launched so far has been delivered, so that their blocks are free, the
        device has finished their work and nothing of them is left (their outputs are
        dropped). Other requests go on as in any step."""
        for request_id in request_ids:
            self.abort_request(request_id)
        launches = self.loop.num_launched
        while (any(request_id in self._requests for request_id in request_ids)
               or not self.loop.settled(launches)):
            self.step(only_finished=True)
        for request_id in request_ids:
            self._undecoded.pop(request_id, None)

    def _no_progress(self) -> None:
        """Requests the core does not know any more (a bug, or an interrupt at a point not
        yet made safe): raise rather than step for ever, and forget them."""
        stale = list(self._requests)
        for request_id in stale:
            for seq in self._requests.pop(request_id).seqs:
                self._seqs.pop(seq.seq_id, None)
                self._watched.pop(seq.seq_id, None)
                self.grammars.remove(seq.seq_id)
        raise RuntimeError(f"requests {stale} are unfinished but the engine has nothing to "
                           f"step (the core does not know them); they were dropped")

    def _decode_some(self) -> None:
        """While the device computes: decode texts left for later, as long as the device is
        busy (a text of a thousand tokens takes the host about a millisecond, longer than a
        decode step of a few sequences), so that few remain when the device has finished."""
        while self._to_decode and self.loop.device_busy():
            request, output = self._to_decode.popleft()
            if output.text is None:
                self._decode(request, output)

    def _decode(self, request: _Request, output: _SeqOutput) -> None:
        if not output.params.detokenize:
            output.text = ""
            return
        output.text = decode_output(self.tokenizer, request.prompt_token_ids,
                                    output.shown_token_ids, output.params)

    def decode_texts(self, outputs: Sequence[RequestOutput]) -> None:
        """Fill in the texts that ``step(decode_finished=False)`` left empty in these outputs."""
        for out in outputs:
            request = self._undecoded.pop(out.request_id, None)
            if request is None:
                continue
            for completion, seq in zip(out.outputs, request.seqs):
                if seq.text is None:
                    self._decode(request, seq)
                completion.text = seq.text

    def _add_logprobs(self, seq: _SeqOutput, lp: TokenLogprobs) -> None:
        seq.logprobs.append(self._logprob_entry(lp, seq.params.detokenize))
        seq.cumulative_logprob += lp.logprob

    def _logprob_entry(self, lp: TokenLogprobs, detokenize: bool) -> dict[int, Logprob]:
        """vLLM's form: the top tokens by rank, and the chosen token with its own rank."""
        def text(token: int) -> str | None:
            return self.tokenizer.decode([token]) if detokenize else None

        entry = {token: Logprob(value, rank, text(token))
                 for rank, (token, value) in enumerate(lp.top, start=1)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, text(lp.token_id))
        return entry

    def _output(self, request: _Request) -> RequestOutput:
        """The request as it stands: finished, or streamed (then every sequence is watched)."""
        outputs = []
        for s in request.seqs:
            outputs.append(CompletionOutput(
                index=s.index, text=_text(s),
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.output_prompt_token_ids,
                             outputs, request.finished,
                             prompt_logprobs=None if request.prompt_logprobs is None
                             else list(request.prompt_logprobs),
                             metrics=request.metrics,
                             num_cached_tokens=request.num_cached_tokens)

    def _delta(self, request: _Request) -> OutputDelta:
        """What ``_output(request)`` gained since the request's previous delta (the whole of
        it the first time): the prompt once; its prompt logprobs the first and the last time
        (with n > 1 the first output may precede some of them); its metrics when replaced;
        each completion's new tokens, text and logprobs."""
        first, finished, metrics = request.sent_metrics is None, request.finished, request.metrics
        prompt = (request.prompt, request.output_prompt_token_ids) if first else None
        delta = (request.request_id, prompt,
                 None if request.prompt_logprobs is None or not (first or finished)
                 else list(request.prompt_logprobs),
                 metrics if first or metrics is not request.sent_metrics else None,
                 request.num_cached_tokens, finished, [_completion_delta(s) for s in request.seqs])
        request.sent_metrics = metrics
        return delta

    # --- helpers --------------------------------------------------------------------------

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt: a string, a sequence of token ids, or a
        dict with ``prompt_token_ids`` or ``prompt``."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if prompt.get("multi_modal_data"):
                raise InvalidRequest("multi_modal_data (images, video) is not supported: nanofn "
                                     "takes text only (a vision-language checkpoint runs its "
                                     "language model)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequest("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        return None, _token_list(prompt)

    def close(self) -> None:
        """Close the trace, stop the workers and give the device memory back (weights, KV
        cache, graphs) now rather than when the engine is collected. Later calls raise."""
        self._unfreeze()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if not self.closed:
            self.closed = True
            self.runner.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close() or the end of its `with` "
                               "block): create a new LLM")


def _runner_config(options: EngineOptions, model_dir: Path, max_model_len: int,
                   hidden_size: int) -> RunnerConfig:
    if options.node_rank != 0:
        raise ValueError(f"node_rank {options.node_rank}: the engine runs on node 0; the other "
                         f"hosts run workers only: nanofn worker --nnodes {options.nnodes} "
                         f"--node-rank {options.node_rank} --master-addr {options.master_addr} "
                         f"--master-port {options.master_port} --tensor-parallel-size "
                         f"{options.tensor_parallel_size}")
    device = torch.device(options.device if options.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    local_ranks = options.tensor_parallel_size // options.nnodes
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        last = (device.index or 0) + local_ranks
        if last > count:
            raise ValueError(f"device {options.device!r} with {local_ranks} tensor-parallel "
                             f"rank(s) on this host needs GPUs up to cuda:{last - 1}, "
                             f"but torch sees {count} CUDA GPU(s)")
    elif options.kernel_backend in ("triton", "flash"):
        raise ValueError(f"kernel_backend {options.kernel_backend!r} needs a CUDA device; this "
                         f"engine runs on {device.type} (use 'torch' or 'auto')")
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
        num_state_slots=options.num_state_slots,
        load_format=options.load_format,
        quantization=options.quantization,
        kv_cache_dtype="fp8" if options.kv_cache_dtype.startswith("fp8") else "auto",
        seed=options.seed,
        enforce_eager=options.enforce_eager,
        disable_custom_all_reduce=options.disable_custom_all_reduce,
        expert_parallel=options.enable_expert_parallel,
        kernel_backend=options.kernel_backend,
        tp_size=options.tensor_parallel_size,
        nnodes=options.nnodes,
        master_addr=options.master_addr,
        master_port=options.master_port,
        cpu_threads=options.cpu_threads_for(hidden_size) if device.type == "cpu" else None,
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(options: EngineOptions) -> Any:
    """The tokenizer an engine with these options uses (the server's process loads it this way,
    without the model). Raises ``FileNotFoundError`` naming a missing folder or file."""
    return _load_tokenizer(options.tokenizer or _model_dir(options.model))


def _load_tokenizer(path: str | Path) -> Any:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{str(folder)!r} has no tokenizer (none of "
                                f"{', '.join(TOKENIZER_FILES)}); pass tokenizer=FOLDER")
    tokenizer = AutoTokenizer.from_pretrained(folder)
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


def _text(s: _SeqOutput) -> str:
    """A sequence's text as its output shows it: whole once finished (and decoded), the
    visible part while streamed (every streamed sequence is watched)."""
    if not s.params.detokenize:
        return ""
    return (s.text or "") if s.finish_reason is not None else s.detokenizer.visible_text(False)


def _completion_delta(s: _SeqOutput) -> CompletionDelta:
    """What the sequence's output gained since ``s.sent``, which it moves on."""
    text = _text(s)
    if s.sent is None:
        tokens, text_change, logprobs = (0, list(s.token_ids)), (0, text), (
            None if s.logprobs is None else (0, list(s.logprobs)))
    else:
        sent_tokens, num_tokens, sent_text, sent_logprobs, num_logprobs = s.sent
        tokens = _grown(sent_tokens, num_tokens, s.token_ids)
        text_change = ((len(sent_text), text[len(sent_text):]) if text.startswith(sent_text)
                       else (0, text))
        logprobs = (None if s.logprobs is None
                    else _grown(sent_logprobs, num_logprobs, s.logprobs))
    s.sent = (s.token_ids, len(s.token_ids), text, s.logprobs,
              0 if s.logprobs is None else len(s.logprobs))
    return tokens, text_change, logprobs, s.cumulative_logprob, s.finish_reason, s.stop_reason


def _grown(before: list | None, length: int, now: list) -> tuple[int, list]:
    """``(kept, added)`` of ``now`` against the first ``length`` items of ``before`` (the list
    it was then): a list that only grew is the same object (tokens and logprobs are appended
    as they come); one replaced (a finished sequence's tokens from the core) is compared."""
    if now is before or (before is not None and now[:length] == before[:length]):
        return length, now[length:]
    return 0, list(now)


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
