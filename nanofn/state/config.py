"""The scheduling configuration: everything the pure core needs to decide a step."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and switches of the scheduler and the block pool.

    ``eos_token_ids`` come from the model; a sequence stops on any of them unless its
    params say ``ignore_eos``. ``num_blocks`` is the size of the KV cache, which the runner
    decides from the device's memory.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # prompt token ids must be below it, when known

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

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


def _problems(c: SchedulerConfig):
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
    if c.num_blocks < c.max_blocks_per_seq:
        yield (f"num_blocks ({c.num_blocks}) is too few for one sequence of max_model_len "
               f"{c.max_model_len}: it needs {c.max_blocks_per_seq} blocks of {c.block_size} "
               f"tokens; lower max_model_len or give the KV cache more memory")
