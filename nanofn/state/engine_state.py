"""The whole engine state: one immutable value per step."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
from pyrsistent import pdeque, plist
from pyrsistent.typing import PDeque, PList

from nanofn.state.batch import RunningBatch, empty_batch
from nanofn.state.block_pool import BlockPool, new_block_pool
from nanofn.state.config import SchedulerConfig, check_num_blocks
from nanofn.state.pdict import PDict
from nanofn.state.records import Seq
from nanofn.state.state_pool import StatePool, new_state_pool


@dataclass(frozen=True, slots=True)
class Counters:
    """Totals since the engine started."""

    num_preemptions: int = 0
    num_admitted_tokens: int = 0  # tokens of sequences at admission (re-admissions too)
    num_cached_tokens: int = 0  # of which were found in the prefix cache
    num_finished: int = 0


@dataclass(frozen=True, slots=True)
class InFlight:
    """The stints (``RunningBatch`` serials) a launched plan samples, in plan order, whose
    tokens are not delivered yet, and their sequences' ids. Serials are held as bytes:
    immutable, and read back without a copy."""

    serials_bytes: bytes
    seq_ids: tuple[str, ...]
    _id_set: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)

    def samples(self, seq_id: str) -> bool:
        """Whether the plan samples a sequence of this id. (A set of the ids is built on the
        first question and kept: every new request asks every plan in flight, and a tuple of
        256 ids costs ~10 us to scan.)"""
        ids = self._id_set
        if ids is None:
            ids = frozenset(self.seq_ids)
            object.__setattr__(self, "_id_set", ids)
        return seq_id in ids

    @property
    def serials(self) -> np.ndarray:
        return np.frombuffer(self.serials_bytes, np.int64)

    def __len__(self) -> int:
        return len(self.serials_bytes) // 8


@dataclass(frozen=True, slots=True)
class EngineState:
    """Every live sequence is either waiting (a ``Seq`` record in ``waiting``) or running (a
    row of ``batch``); ``running`` shows the batch as records.

    ``finished`` and ``preempted`` say what the step that produced this state did.
    ``undelivered`` lists, oldest first, the stints each launched plan samples whose tokens
    have not been delivered: the next delivery must carry one token per stint of
    ``undelivered[0]``. ``free_slots`` are the runner slots no running sequence holds.
    ``states`` are a hybrid model's recurrent-state slots (None for other models).
    """

    config: SchedulerConfig
    step: int
    pool: BlockPool
    waiting: PDeque  # of Seq: the head is admitted first
    batch: RunningBatch  # in admission order: preemption takes the last
    live_ids: PDict  # seq id -> True, for every waiting or running sequence
    free_slots: PList
    next_serial: int = 0
    undelivered: tuple[InFlight, ...] = ()
    finished: tuple[Seq, ...] = ()
    preempted: tuple[str, ...] = ()
    counters: Counters = Counters()
    states: StatePool | None = None

    @property
    def has_unfinished(self) -> bool:
        return bool(len(self.live_ids))

    @property
    def running(self) -> tuple[Seq, ...]:
        """The running sequences as records, in admission order (built on each call)."""
        return self.batch.seqs()


def initial_state(config: SchedulerConfig, num_blocks: int,
                  num_state_slots: int | None = None) -> EngineState:
    """The state before the first step, with a KV cache of ``num_blocks`` blocks and, for a
    hybrid model, ``num_state_slots`` recurrent-state slots."""
    check_num_blocks(config, num_blocks)
    if num_state_slots is not None and (type(num_state_slots) is not int or num_state_slots < 1):
        raise ValueError(f"num_state_slots must be a positive integer (a hybrid model's running "
                         f"sequence needs one), got {num_state_slots!r}")
    return EngineState(
        config=config,
        step=0,
        pool=new_block_pool(num_blocks),
        waiting=pdeque(),
        batch=empty_batch(),
        live_ids=PDict(),
        free_slots=plist(range(config.max_num_seqs)),
        states=None if num_state_slots is None else new_state_pool(num_state_slots),
    )


def _make_evolve():
    """``evolve(state, **changes)``, generated with one line per field (as dataclasses
    generates ``__init__``): a few times cheaper than ``dataclasses.replace``, and the step
    makes several states. The new state is as frozen as any."""
    names = [f.name for f in fields(EngineState)]
    setters = {f"set_{name}": EngineState.__dict__[name].__set__ for name in names}
    lines = [f"def evolve(state, *, {', '.join(f'{n}=_KEEP' for n in names)}):",
             "    new = _new(EngineState)"]
    lines += [f"    set_{n}(new, state.{n} if {n} is _KEEP else {n})" for n in names]
    lines.append("    return new")
    namespace = {"_KEEP": object(), "_new": object.__new__, "EngineState": EngineState,
                 **setters}
    exec("\n".join(lines), namespace)
    return namespace["evolve"]


evolve = _make_evolve()
