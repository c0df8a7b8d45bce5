"""The server's limits: what one request may ask of it, checked before it costs much (the
body's size before the body is read, in ``app``; the sequences and a prompt's length before
the prompt is tokenized, in ``prompts``), and how long a shutdown waits for the requests in
flight. ``nanofn serve`` has a flag for each. Standard library only: the command line reads the
defaults without loading the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = 128
    """Most sequences one request may start: ``n``, times the number of prompts of a batched
    completion."""
    max_request_body_bytes: int = 32 * 1024 * 1024
    """A larger body is refused (413) before it is read."""
    max_chars_per_token: int = 32
    """A prompt of more than ``max_model_len`` times this many characters cannot fit, and is
    refused without tokenizing it. English averages about 4 characters a token; 32 leaves room
    for long runs of spaces or symbols, which tokenizers merge into long tokens."""
    shutdown_timeout: float = 30.0
    """Seconds the requests in flight get to finish after SIGTERM."""

    def __post_init__(self):
        for name in ("max_n", "max_request_body_bytes", "max_chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
