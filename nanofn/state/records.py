"""Requests and sequences: what a user asked, and how far the engine has got with it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pyrsistent import PVector

from nanofn.state.params import SamplingParams


class SeqStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-sequence token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Request:
    """What a user asked. Never changes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_step: int


@dataclass(frozen=True, slots=True)
class Seq:
    """The evolving part of a request.

    ``token_ids`` holds the prompt followed by the generated tokens known so far; after them
    come ``num_pending`` tokens that plans already sampled but whose values have not been
    delivered yet (a runner working one step ahead). The KV of the first ``num_computed``
    positions is in the cache (or is being written by the step that scheduled them), in the
    blocks of ``block_table``. ``block_hashes[i]`` is the chained hash of full known block
    ``i``, computed once when the block fills, whether or not it is cached.
    """

    request: Request
    token_ids: PVector
    block_hashes: PVector
    block_table: PVector
    num_computed: int = 0
    num_pending: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens found in the prefix cache at the last admission

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens."""
        return len(self.token_ids)

    @property
    def num_positions(self) -> int:
        """Known tokens plus pending ones: the positions the sequence occupies."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Known generated tokens."""
        return len(self.token_ids) - len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def num_uncomputed(self) -> int:
        """Positions still to run through the model before the next token can be sampled."""
        return len(self.token_ids) + self.num_pending - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    # The two updates every decode step makes, spelled out because they are the hot path
    # (a direct constructor call costs half of ``dataclasses.replace``).

    def with_token(self, token_ids: PVector, block_hashes: PVector) -> Seq:
        """A pending token became known: it is the last of ``token_ids`` now."""
        return Seq(request=self.request, token_ids=token_ids, block_hashes=block_hashes,
                   block_table=self.block_table, num_computed=self.num_computed,
                   num_pending=self.num_pending - 1, status=self.status,
                   finish_reason=self.finish_reason, num_preemptions=self.num_preemptions,
                   num_cached_tokens=self.num_cached_tokens)

    def with_progress(self, block_table: PVector, num_computed: int, num_pending: int) -> Seq:
        return Seq(request=self.request, token_ids=self.token_ids,
                   block_hashes=self.block_hashes, block_table=block_table,
                   num_computed=num_computed, num_pending=num_pending, status=self.status,
                   finish_reason=self.finish_reason, num_preemptions=self.num_preemptions,
                   num_cached_tokens=self.num_cached_tokens)
