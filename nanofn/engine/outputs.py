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
