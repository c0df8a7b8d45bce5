"""Figures derived from a state, for progress bars, logs and dashboards."""

from __future__ import annotations

from dataclasses import dataclass

from nanofn.state.engine_state import EngineState


@dataclass(frozen=True, slots=True)
class Figures:
    step: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float  # cached tokens / tokens at admission, since the start
    num_preemptions: int
    num_finished: int
    # a hybrid model's recurrent-state slots (0 for other models): working and saved states
    state_slots_total: int = 0
    state_slots_working: int = 0
    state_slots_saved: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


def figures(state: EngineState) -> Figures:
    s = state.counters
    return Figures(
        step=state.step,
        num_running=len(state.batch),
        num_waiting=len(state.waiting),
        kv_blocks_used=state.pool.num_used,
        kv_blocks_total=state.pool.num_blocks,
        prefix_cache_hit_rate=s.num_cached_tokens / s.num_admitted_tokens if s.num_admitted_tokens else 0.0,
        num_preemptions=s.num_preemptions,
        num_finished=s.num_finished,
        **({} if state.states is None else {
            "state_slots_total": state.states.num_slots,
            "state_slots_working": state.states.num_working,
            "state_slots_saved": state.states.num_saved}),
    )
