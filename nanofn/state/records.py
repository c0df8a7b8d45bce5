"""Requests and sequences: what a user asked, and how far the engine has got with it."""

from __future__ import annotations

from dataclasses import dataclass, fields
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
class SeqSpec:
    """What was asked of one sequence (the shell turns a request for ``n`` samples into ``n``
    sequences). Never changes."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_step: int


@dataclass(frozen=True, slots=True)
class Seq:
    """How far the engine has got with a sequence.

    ``token_ids`` holds the prompt followed by the generated tokens known so far; after them
    come ``num_pending`` tokens that plans already sampled but whose values have not been
    delivered yet (a runner working one step ahead). The KV of the first ``num_computed``
    positions is in the cache (or is being written by the step that scheduled them), in the
    blocks of ``block_table``. ``block_hashes[i]`` is the chained hash of full known block
    ``i``, computed once when the block fills, whether or not it is cached.
    """

    spec: SeqSpec
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
        return self.spec.seq_id

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.spec.prompt_token_ids)

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
        return len(self.token_ids) - len(self.spec.prompt_token_ids)

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

    # The two updates every decode step makes. They build the new record through its slot
    # setters, which costs half of the generated frozen ``__init__`` (one ``object.__setattr__``
    # per field); the record is still frozen once built.

    def with_token(self, token_ids: PVector, block_hashes: PVector) -> Seq:
        """A pending token became known: it is the last of ``token_ids`` now."""
        seq = _new(Seq)
        _set_spec(seq, self.spec)
        _set_token_ids(seq, token_ids)
        _set_block_hashes(seq, block_hashes)
        _set_block_table(seq, self.block_table)
        _set_num_computed(seq, self.num_computed)
        _set_num_pending(seq, self.num_pending - 1)
        _set_status(seq, self.status)
        _set_finish_reason(seq, self.finish_reason)
        _set_num_preemptions(seq, self.num_preemptions)
        _set_num_cached_tokens(seq, self.num_cached_tokens)
        return seq

    def with_progress(self, block_table: PVector, num_computed: int, num_pending: int) -> Seq:
        seq = _new(Seq)
        _set_spec(seq, self.spec)
        _set_token_ids(seq, self.token_ids)
        _set_block_hashes(seq, self.block_hashes)
        _set_block_table(seq, block_table)
        _set_num_computed(seq, num_computed)
        _set_num_pending(seq, num_pending)
        _set_status(seq, self.status)
        _set_finish_reason(seq, self.finish_reason)
        _set_num_preemptions(seq, self.num_preemptions)
        _set_num_cached_tokens(seq, self.num_cached_tokens)
        return seq


def slot_setters(cls: type) -> tuple:
    """The setters of a frozen slotted dataclass's fields, in declaration order."""
    return tuple(cls.__dict__[f.name].__set__ for f in fields(cls))


_new = object.__new__
(_set_spec, _set_token_ids, _set_block_hashes, _set_block_table, _set_num_computed,
 _set_num_pending, _set_status, _set_finish_reason, _set_num_preemptions,
 _set_num_cached_tokens) = slot_setters(Seq)
