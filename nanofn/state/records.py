"""Sequences: what was asked of each, and how far the engine has got with it."""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

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
    """One sequence, as a record: the waiting and finished ones are kept so; the running ones
    live as columns of the state's ``RunningBatch``, which shows each as a ``Seq`` on demand.

    ``token_ids`` holds the prompt followed by the generated tokens known so far; after them
    come ``num_pending`` tokens that plans already sampled but whose values have not been
    delivered yet (a runner working one step ahead). The KV of the first ``num_computed``
    positions is in the cache (or is being written by the step that scheduled them), in the
    blocks of ``block_table``. ``block_hashes[i]`` is the chained hash of full known block
    ``i``, computed once, whether or not it is cached. A waiting or finished record has the
    hashes of all its full blocks; a running one's may lag behind the blocks decoding has
    filled, which are hashed when needed (``nanofn/state/filled.py``).
    """

    spec: SeqSpec
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    block_table: tuple[int, ...] = ()
    num_computed: int = 0
    num_pending: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens found in the prefix cache at the last admission
    state_slot: int = -1  # a running hybrid model's sequence: its recurrent-state slot
    # ``token_ids`` as an array, built once (a memo: not compared, not copied by ``replace``)
    _token_array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def token_array(self) -> np.ndarray:
        """``token_ids`` as a read-only int64 array, kept. A new sequence's record is given the
        array its prompt was validated as, so a long prompt is converted from its tuple once
        (~40 us for 2,000 tokens), not again when it is hashed for the cache and stored."""
        tokens = self._token_array
        if tokens is None:
            tokens = self.remember_token_array(np.frombuffer(array.array("q", self.token_ids),
                                                             np.int64))
        return tokens

    def remember_token_array(self, tokens: np.ndarray) -> np.ndarray:
        """Keep ``tokens`` (an int64 array equal to ``token_ids``, made read-only here) as the
        record's ``token_array``; returns it."""
        tokens.flags.writeable = False
        object.__setattr__(self, "_token_array", tokens)
        return tokens

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
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        """Positions still to run through the model before the next token can be sampled."""
        return len(self.token_ids) + self.num_pending - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
