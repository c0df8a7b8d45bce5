"""A run as per-step series (sequences, KV blocks, tokens, preemptions, prefix-cache hits),
read off its replayed states and plans: the numbers behind ``nanofn replay --plot``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nanofn.state.engine_state import EngineState
from nanofn.state.plan import BatchPlan


@dataclass(frozen=True, slots=True)
class RunSeries:
    """Column ``i`` of each series describes the state right after step ``steps[i]``.
    ``blocks_used + blocks_cached + blocks_free == num_blocks`` at every step: owned blocks,
    free blocks still holding a cached prefix (a later hit can take them back), and plain free
    ones. ``cached_tokens`` are the prompt tokens that admissions at that step found in the
    prefix cache. A hybrid model's run also has its recurrent-state slots:
    ``states_working + states_saved + states_free == num_state_slots`` (0 for other models)."""

    num_blocks: int
    steps: tuple[int, ...]
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    blocks_used: tuple[int, ...]
    blocks_cached: tuple[int, ...]
    blocks_free: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    preemptions: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    num_state_slots: int = 0
    states_working: tuple[int, ...] = ()
    states_saved: tuple[int, ...] = ()
    states_free: tuple[int, ...] = ()


def run_series(replayed: Iterable[tuple[EngineState, BatchPlan]]) -> RunSeries:
    """The series of a run from its ``(state, plan)`` pairs in step order (as ``replay``
    yields them)."""
    rows, state_rows = [], []
    num_blocks, num_state_slots, cached_so_far = 0, 0, 0
    for state, plan in replayed:
        pool, cached_total = state.pool, state.counters.num_cached_tokens
        num_blocks = pool.num_blocks
        rows.append((plan.step, len(state.batch), len(state.waiting), pool.num_used,
                     pool.num_cached_free, pool.num_plain_free, plan.num_prefill_tokens,
                     plan.num_decode_tokens, len(state.preempted), cached_total - cached_so_far))
        cached_so_far = cached_total
        if state.states is not None:
            states = state.states
            num_state_slots = states.num_slots
            state_rows.append((states.num_working, states.num_saved, states.num_free))
    columns = tuple(zip(*rows)) if rows else ((),) * 10
    state_columns = tuple(zip(*state_rows)) if state_rows else ((),) * 3
    return RunSeries(num_blocks, *columns, num_state_slots, *state_columns)
