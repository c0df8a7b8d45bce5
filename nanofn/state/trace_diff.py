"""Two traces compared: where do two runs that should agree first part ways?

The headers are compared first (every scheduler setting and the number of KV blocks), then
both traces are replayed side by side. A step differs when its plans differ (what is
scheduled, where, with which blocks) or when the events it applies differ (the tokens it
delivered, new requests, aborts, stop hits); the first such step is reported with both states
right after it, which is where a user looks for the cause.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from nanofn.state.engine_state import EngineState
from nanofn.state.plan import BatchPlan, ScheduledSeq
from nanofn.state.trace import Trace, TracedStep, TraceError, replay

EVENT_FIELDS = ("sampled", "new_seqs", "aborts", "stop_hits", "dirty_blocks",
                "dirty_states")  # of Events


@dataclass(frozen=True, slots=True)
class ReplayedStep:
    """One step of a replayed trace: what it applied, what it planned, and the states just
    before and after it."""

    traced: TracedStep
    before: EngineState
    state: EngineState
    plan: BatchPlan

    @property
    def sampled_by(self) -> tuple[str, ...]:
        """The sequences whose tokens this step delivered, in the order of ``sampled``."""
        if self.traced.events.sampled is None or not self.before.undelivered:
            return ()
        return self.before.undelivered[0].seq_ids


@dataclass(frozen=True, slots=True)
class StepDifference:
    """The first step at which the traces differ; ``a`` or ``b`` is None where that trace
    has already ended."""

    step: int
    a: ReplayedStep | None
    b: ReplayedStep | None

    def plan_changes(self) -> list[tuple[str, ScheduledSeq | None, ScheduledSeq | None]]:
        """``(seq id, entry in A, entry in B)`` for each sequence scheduled differently
        (None: not scheduled in that trace), in plan order of A, then B."""
        a = {s.seq_id: s for s in self.a.plan.entries()} if self.a else {}
        b = {s.seq_id: s for s in self.b.plan.entries()} if self.b else {}
        return [(seq_id, a.get(seq_id), b.get(seq_id)) for seq_id in {**a, **b}
                if a.get(seq_id) != b.get(seq_id)]

    def event_changes(self) -> list[tuple[str, Any, Any]]:
        """``(event, value in A, value in B)`` for each kind of event that differs;
        delivered tokens as ``{seq id: token}``."""
        if self.a is None or self.b is None:
            return []
        changes = []
        for name in EVENT_FIELDS:
            a, b = _event(self.a, name), _event(self.b, name)
            if a != b:
                changes.append((name, a, b))
        return changes


@dataclass(frozen=True, slots=True)
class TraceDiff:
    header: tuple[tuple[str, Any, Any], ...]  # (setting, value in A, value in B) that differ
    step: StepDifference | None

    @property
    def identical(self) -> bool:
        return not self.header and self.step is None


def diff_traces(a: Trace, b: Trace) -> TraceDiff:
    """Where ``a`` and ``b`` first differ: their headers, and the first step (replaying both;
    a ``TraceError`` from either replay propagates, its message starting with "trace A" or
    "trace B")."""
    first = None
    for step_a, step_b in zip_longest(_named(replayed_steps(a), "A"),
                                      _named(replayed_steps(b), "B")):
        if step_a is None or step_b is None or not _same_step(step_a, step_b):
            first = StepDifference((step_a or step_b).traced.step, step_a, step_b)
            break
    return TraceDiff(header_changes(a, b), first)


def header_changes(a: Trace, b: Trace) -> tuple[tuple[str, Any, Any], ...]:
    """The scheduler settings and KV cache sizes that differ, as ``(name, a, b)``. The
    headers' ``meta`` (the model's path, ...) is not compared: only what decides plans."""
    settings_a = {**a.config.to_dict(), "num_blocks": a.num_blocks,
                  "num_state_slots": a.num_state_slots}
    settings_b = {**b.config.to_dict(), "num_blocks": b.num_blocks,
                  "num_state_slots": b.num_state_slots}
    return tuple((name, settings_a.get(name), settings_b.get(name))
                 for name in {**settings_a, **settings_b}
                 if settings_a.get(name) != settings_b.get(name))


def replayed_steps(trace: Trace) -> Iterator[ReplayedStep]:
    before = trace.initial_state()
    for traced, (state, plan) in zip(trace.steps, replay(trace)):
        yield ReplayedStep(traced, before, state, plan)
        before = state


def _named(steps: Iterator[ReplayedStep], name: str) -> Iterator[ReplayedStep]:
    try:
        yield from steps
    except TraceError as e:
        raise TraceError(f"trace {name}, {e}") from None


def _same_step(a: ReplayedStep, b: ReplayedStep) -> bool:
    return a.plan == b.plan and all(_event(a, name) == _event(b, name) for name in EVENT_FIELDS)


def _event(step: ReplayedStep, name: str) -> Any:
    value = getattr(step.traced.events, name)
    if name == "sampled":
        return None if value is None else dict(zip(step.sampled_by, map(int, value)))
    return value
