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

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool

    def __getitem__(self, key: str) -> Any:
        """nano-vllm's dict access: ``out["text"]`` and ``out["token_ids"]`` of the first
        completion."""
        if key == "text":
            return self.outputs[0].text
        if key == "token_ids":
            return self.outputs[0].token_ids
        raise KeyError(f"{key!r}: RequestOutput supports out['text'] and out['token_ids']")
