"""The engine loop: the pipeline between the pure core and a runner, with no torch and no model.

One ``step()``:

1. the tokens of the oldest launched plan that were waited for are shown to the caller's
   ``on_delivery`` (the shell detokenizes them there and names the sequences whose stop string
   they complete);
2. they, those stop-string hits, the aborts and the new sequences go to the core's ``step``
   as events, which gives the next state and plan;
3. the plan is launched on the runner and its events are written to the trace;
4. the oldest launched plan's tokens are waited for, for the next step. With async scheduling a
   plan launched with nothing ahead of it is not waited for: the next step is scheduled while
   the runner computes it, and its plan reads the pending tokens on the device.

The engine drives this loop with its model runner; the property suite drives the same loop with
a fake runner, so the pipeline users run is the one the Hypothesis machine checks.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from nanofn.state import (BatchPlan, EngineState, Events, InvalidRequest, NewSeq, SampleOutput,
                          Seq, check_new_seq, header_line, step, step_line)
from nanofn.state.requests import has_token_in_flight


class Pending(Protocol):
    """A launched plan's sampled tokens, on their way."""

    def wait(self) -> SampleOutput: ...

    def done(self) -> bool:
        """Whether ``wait`` would return at once (asks the device; never blocks)."""
        ...


class Runner(Protocol):
    """Executes plans: ``launch`` queues a (non-empty) plan's work and returns at once."""

    def launch(self, plan: BatchPlan) -> Pending: ...


@dataclass(frozen=True, slots=True)
class Delivery:
    """The tokens a runner sampled for ``plan``: one per ``plan.sampling_seq_ids``."""

    plan: BatchPlan
    output: SampleOutput


@dataclass(frozen=True, slots=True)
class LoopStep:
    """What one step did: the plan it launched (maybe empty), the tokens the core took, and the
    sequences that finished."""

    plan: BatchPlan
    delivered: Delivery | None
    finished: tuple[Seq, ...]


OnDelivery = Callable[[Delivery], Iterable[str]]


class EngineLoop:
    """Owns the current core state and the plans in flight; turns ``add``, ``abort`` and
    ``step`` calls into the core's events. ``trace``, if given, receives the run's trace (a
    header now, then a line per step).
    """

    def __init__(self, state: EngineState, runner: Runner, *, async_scheduling: bool = True,
                 trace: TextIO | None = None, trace_meta: dict[str, Any] | None = None):
        self.runner = runner
        self.async_scheduling = async_scheduling
        self._state = state
        self._trace = trace
        self._new: list[NewSeq] = []
        self._aborts: list[str] = []
        self._in_flight: deque[tuple[BatchPlan, Pending]] = deque()  # launched, not waited for
        self._ready: Delivery | None = None  # waited for, not delivered to the core
        self._renames = itertools.count()
        if trace is not None:
            trace.write(header_line(state, trace_meta) + "\n")

    @property
    def state(self) -> EngineState:
        return self._state

    def add(self, new: NewSeq) -> str:
        """Queue a sequence for the next step; raise ``InvalidRequest`` (touching nothing) if
        the core could not take it. Returns the id the core knows it by: ``new.seq_id``,
        unless an earlier sequence of that id still has a sampled token in flight, which the
        new one must not receive; then ``seq_id~N``."""
        state = self._state
        if new.seq_id not in state.live_ids and has_token_in_flight(state, new.seq_id):
            new = NewSeq(f"{new.seq_id}~{next(self._renames)}", new.prompt_token_ids, new.params)
        if any(queued.seq_id == new.seq_id for queued in self._new):
            raise InvalidRequest(f"request_id {new.seq_id!r} is already in use")
        check_new_seq(state, new)
        self._new.append(new)
        return new.seq_id

    def abort(self, seq_id: str) -> None:
        """Finish a sequence at the next step, wherever it is (queued ones too); unknown or
        finished ids are ignored."""
        self._aborts.append(seq_id)

    def has_work(self) -> bool:
        """Whether stepping would do anything: live or queued sequences, or tokens in flight."""
        return (self._state.has_unfinished or bool(self._new) or self._ready is not None
                or bool(self._in_flight))

    def device_busy(self) -> bool:
        """Whether the oldest launched plan, whose tokens the step waits for, is still being
        computed: host work done now costs the device nothing."""
        return bool(self._in_flight) and not self._in_flight[0][1].done()

    def step(self, on_delivery: OnDelivery | None = None,
             while_waiting: Callable[[], None] | None = None) -> LoopStep:
        """One step. ``on_delivery`` sees the delivery the core is about to take, if any, and
        returns the ids of the sequences whose stop string it completes. ``while_waiting`` runs
        after the launch, before waiting for the device: host work that can use the time the
        device computes (it should stop once ``device_busy`` is false, or it delays the next
        launch)."""
        delivered, self._ready = self._ready, None
        stop_hits = ()
        if delivered is not None and on_delivery is not None:
            stop_hits = tuple(on_delivery(delivered))
        events = Events(sampled=None if delivered is None else tuple(delivered.output.token_ids),
                        stop_hits=stop_hits, aborts=tuple(self._aborts),
                        new_seqs=tuple(self._new))
        self._state, plan = step(self._state, events)
        self._new, self._aborts = [], []
        if not plan.is_empty:  # first, so that the device starts while the host does the rest
            self._in_flight.append((plan, self.runner.launch(plan)))
        if self._trace is not None:
            self._trace.write(step_line(events, plan) + "\n")
        if while_waiting is not None and self._in_flight:
            while_waiting()
        self._wait_for_tokens(launched_alone=not plan.is_empty and len(self._in_flight) == 1)
        return LoopStep(plan, delivered, self._state.finished)

    def _wait_for_tokens(self, launched_alone: bool) -> None:
        """Bring the oldest launched plan's tokens to the host for the next step."""
        if not self._in_flight or (self.async_scheduling and launched_alone):
            return
        plan, pending = self._in_flight.popleft()
        self._ready = Delivery(plan, pending.wait())
