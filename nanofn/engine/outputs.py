"""What generation returns, shaped like vLLM's outputs (and readable the nano-vllm way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per generated token: it and the top tokens
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """When a request went through the engine (``time.time()`` seconds), with vLLM's names.
    Frozen: each output holds the metrics as they were (the engine replaces them)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # its first plan was launched
    first_token_time: float | None = None  # its first token reached the engine
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Per prompt position (None for the first): its token's logprob and the top ones.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache

    def __getitem__(self, key: str) -> Any:
        """nano-vllm's dict access: ``out["text"]`` and ``out["token_ids"]`` of the first
        completion."""
        if key == "text":
            return self.outputs[0].text
        if key == "token_ids":
            return self.outputs[0].token_ids
        raise KeyError(f"{key!r}: RequestOutput supports out['text'] and out['token_ids']")


# A request's output as what changed since its previous delta (``Engine.step_deltas``): O(new
# tokens) where a whole ``RequestOutput`` holds all of them, for a streamed request reported
# every step; ``apply_delta`` makes the whole output again. Plain tuples, as the engine
# process pickles them every step (seven times faster to pickle than named tuples).
#
# A change is ``(kept, added)``: the first ``kept`` items of the previous whole value (all of
# them, or none where it changed otherwise than by growing), then ``added``.
Change = tuple[int, Any]
# (token ids, text, logprobs or None: changes; cumulative_logprob, finish_reason, stop_reason)
CompletionDelta = tuple[Change, Change, Change | None, float | None, str | None,
                        int | str | None]
# (request_id; (prompt, prompt token ids) in the first delta only, else None; prompt logprobs
# in the first and the last, else None; metrics when replaced since the previous delta, else
# None; num_cached_tokens; finished; a CompletionDelta per completion)
OutputDelta = tuple[str, tuple[str | None, list[int]] | None,
                    list[dict[int, Logprob] | None] | None, RequestMetrics | None, int | None,
                    bool, list[CompletionDelta]]


def apply_delta(delta: OutputDelta, before: RequestOutput | None) -> RequestOutput:
    """The whole output that ``delta`` is the change of, given the request's previous whole
    output (None for its first delta). The prompt's lists are shared by a request's outputs;
    the rest is new in each."""
    request_id, prompt, prompt_logprobs, metrics, num_cached_tokens, finished, changes = delta
    if before is not None:
        prompt = before.prompt, before.prompt_token_ids
        prompt_logprobs = before.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        metrics = before.metrics if metrics is None else metrics
    completions = []
    for i, (tokens, text, logprobs, cumulative, finish_reason, stop_reason) in enumerate(changes):
        b = None if before is None else before.outputs[i]
        completions.append(CompletionOutput(
            i, _joined("" if b is None else b.text, text),
            _joined([] if b is None else b.token_ids, tokens), cumulative,
            None if logprobs is None else _joined([] if b is None else b.logprobs, logprobs),
            finish_reason, stop_reason))
    return RequestOutput(request_id, prompt[0], prompt[1], completions, finished,
                         prompt_logprobs=prompt_logprobs, metrics=metrics,
                         num_cached_tokens=num_cached_tokens)


def _joined(before: Any, change: tuple[int, Any]) -> Any:
    kept, added = change
    return (before if kept == len(before) else before[:kept]) + added
