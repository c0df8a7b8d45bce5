"""The scheduling configuration: the limits and switches the pure core decides a step by.

Its values come from the engine's options (``nanofn.engine.options``, the one home of their
defaults) and the model; the size of the KV cache, which the runner measures, is given to
``initial_state`` apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``eos_token_ids`` come from the model; a sequence stops on any of them unless its params
    say ``ignore_eos``. Prompt token ids must be below ``vocab_size`` when it is known."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    eos_token_ids: tuple[int, ...]
    vocab_size: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_for(self.max_model_len, self.block_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulerConfig:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown scheduler setting(s): {', '.join(unknown)}")
        return cls(**d)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def check_num_blocks(config: SchedulerConfig, num_blocks: int) -> None:
    """A KV cache must hold at least one sequence of ``max_model_len`` tokens."""
    if not isinstance(num_blocks, int) or num_blocks < config.max_blocks_per_seq:
        raise ValueError(
            f"num_blocks ({num_blocks}) is too few for one sequence of max_model_len "
            f"{config.max_model_len}: it needs {config.max_blocks_per_seq} blocks of "
            f"{config.block_size} tokens; lower max_model_len or give the KV cache more memory")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _problems(c: SchedulerConfig):
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if not _is_int(getattr(c, name)):
            yield f"{name} must be an integer, got {getattr(c, name)!r}"
            return
    for name in ("enable_prefix_caching", "enable_chunked_prefill"):
        if not isinstance(getattr(c, name), bool):
            yield f"{name} must be True or False, got {getattr(c, name)!r}"
    if not MIN_BLOCK_SIZE <= c.block_size <= MAX_BLOCK_SIZE:
        yield (f"block_size must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
               f"got {c.block_size}")
    if c.max_num_seqs < 1:
        yield f"max_num_seqs must be >= 1, got {c.max_num_seqs}"
    if c.max_model_len < 1:
        yield f"max_model_len must be >= 1, got {c.max_model_len}"
    if c.max_num_batched_tokens < c.max_num_seqs:
        yield (f"max_num_batched_tokens ({c.max_num_batched_tokens}) must be >= "
               f"max_num_seqs ({c.max_num_seqs}) so that every running sequence can decode")
    if not c.enable_chunked_prefill and c.max_num_batched_tokens < c.max_model_len:
        yield (f"without chunked prefill, max_num_batched_tokens ({c.max_num_batched_tokens}) "
               f"must be >= max_model_len ({c.max_model_len}) so that any prompt fits one step")
