"""The whole engine state: one immutable value per step."""

from __future__ import annotations

from dataclasses import dataclass

from pyrsistent import PSet, pdeque, pset
from pyrsistent.typing import PDeque

from nanofn.state.block_pool import BlockPool, new_block_pool
from nanofn.state.config import SchedulerConfig, check_num_blocks
from nanofn.state.records import Seq


@dataclass(frozen=True, slots=True)
class Counters:
    """Totals since the engine started."""

    num_preemptions: int = 0
    num_admitted_tokens: int = 0  # tokens of sequences at admission (re-admissions too)
    num_cached_tokens: int = 0  # of which were found in the prefix cache
    num_finished: int = 0


@dataclass(frozen=True, slots=True)
class EngineState:
    """Every live sequence is in exactly one of ``waiting`` and ``running``.

    ``finished`` and ``preempted`` say what the step that produced this state did.
    ``undelivered`` lists, oldest first, for every plan whose sampled tokens have not been
    delivered, the sequences that sampled, in plan order: the next delivery must carry one
    token for each sequence of ``undelivered[0]``.
    """

    config: SchedulerConfig
    step: int
    pool: BlockPool
    waiting: PDeque  # of Seq: the head is admitted first
    running: tuple[Seq, ...]  # in admission order: preemption takes the last
    live_ids: PSet
    undelivered: tuple[tuple[str, ...], ...] = ()
    unreported_releases: tuple[str, ...] = ()  # released since the last plan with work
    finished: tuple[Seq, ...] = ()
    preempted: tuple[str, ...] = ()
    counters: Counters = Counters()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.live_ids)


def initial_state(config: SchedulerConfig, num_blocks: int) -> EngineState:
    """The state before the first step, with a KV cache of ``num_blocks`` blocks."""
    check_num_blocks(config, num_blocks)
    return EngineState(
        config=config,
        step=0,
        pool=new_block_pool(num_blocks),
        waiting=pdeque(),
        running=(),
        live_ids=pset(),
    )
