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

import contextlib
import itertools
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from nanofn.state import (BatchPlan, EngineState, Events, InvalidRequest, NewSeq, SampleOutput,
                          Seq, check_new_seq, header_line, step, step_line)
from nanofn.state.plan import TokenBitmask
from nanofn.state.requests import has_token_in_flight


class Pending(Protocol):
    """A launched plan's sampled tokens, on their way."""

    def wait(self) -> SampleOutput: ...

    def done(self) -> bool:
        """Whether ``wait`` would return at once (asks the device; never blocks)."""
        ...


class Runner(Protocol):
    """Executes plans: ``launch`` queues a (non-empty) plan's work and returns at once. A
    ``token_bitmask`` (structured output) limits what some rows may sample."""

    def launch(self, plan: BatchPlan, token_bitmask: TokenBitmask | None = None) -> Pending: ...


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
    header now, then a line per step). ``token_masks``, if given, gives each plan's bitmask
    (the shell's grammars), or None for a plan with no constrained row.
    """

    def __init__(self, state: EngineState, runner: Runner, *, async_scheduling: bool = True,
                 trace: TextIO | None = None, trace_meta: dict[str, Any] | None = None,
                 token_masks: Callable[[BatchPlan], TokenBitmask | None] | None = None):
        self.runner = runner
        self.token_masks = token_masks
        self.async_scheduling = async_scheduling
        self._state = state
        self._trace = trace
        self._new: dict[str, NewSeq] = {}  # by id, in arrival order
        self._aborts: list[str] = []
        self._dirty: list[int] = []  # blocks a failed launch may have written
        self._dirty_states: list[int] = []  # and recurrent-state slots
        # launched, not waited for: (launch index, plan, its tokens on their way)
        self._in_flight: deque[tuple[BatchPlan, Pending]] = deque()
        self.num_launched = 0
        self._num_delivered = 0  # plans whose tokens the core has taken (in launch order)
        self._ready: Delivery | None = None  # waited for, not delivered to the core
        self._shown: tuple[Delivery, tuple[str, ...]] | None = None  # and its stop hits
        # A step committed but not yet returned (an interruption came after its launch):
        self._unreported: LoopStep | None = None
        self._untraced: tuple[Events, BatchPlan] | None = None  # its trace line's, until written
        self._launched_alone = False
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
        if new.seq_id in self._new:
            raise InvalidRequest(f"request_id {new.seq_id!r} is already in use")
        check_new_seq(state, new)
        self._new[new.seq_id] = new
        return new.seq_id

    def abort(self, seq_id: str) -> None:
        """Finish a sequence at the next step, wherever it is (queued ones too); unknown or
        finished ids are ignored."""
        self._aborts.append(seq_id)

    def forget_cached_blocks(self) -> None:
        """Drop every block (and saved recurrent state) from the prefix cache at the next step
        (as those of a failed launch are: the step's ``dirty_blocks`` and ``dirty_states``
        events, which the trace records)."""
        self._dirty.extend(block for block, _ in self._state.pool.cached_blocks())
        if self._state.states is not None:
            self._dirty_states.extend(entry.slot for _, entry in self._state.states.saved.items())

    def has_work(self) -> bool:
        """Whether stepping would do anything: live or queued sequences, or tokens in flight."""
        return (self._state.has_unfinished or bool(self._new) or bool(self._aborts)
                or self._ready is not None or bool(self._in_flight))

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
        launch).

        A step is a transaction. If it raises (an exception or an interrupt) before its plan
        is launched, the loop is as it was: the delivery and the queued events wait for the
        next step (``on_delivery`` is not shown the same delivery twice). If the launch
        raises, the plan is not applied either: the core's state stays as it was, and the next
        step aborts the plan's sequences and drops the blocks it was to write from the prefix
        cache, since the device may have run part of it. It also aborts the sequences that
        hold, in the state as it was, a block the plan was to compute into: the plan's step
        may have preempted them (or finished them) and handed their blocks out again. After
        the launch the step has happened; after a later interruption (the trace,
        ``while_waiting``, the wait) the next call finishes that step and returns it, rather
        than stepping again."""
        if self._unreported is None:
            self._advance(on_delivery)
        if self._untraced is not None:  # (formatted now: after the launch, not before)
            self._trace.write(step_line(*self._untraced) + "\n")
            self._untraced = None
        if while_waiting is not None and self._in_flight:
            while_waiting()
        self._wait_for_tokens(self._launched_alone)
        result, self._unreported = self._unreported, None
        return result

    def _advance(self, on_delivery: OnDelivery | None) -> None:
        """The step's transaction: the delivery and the queued events to the core, the plan
        launched, all committed at once (see ``step``)."""
        delivered = self._ready
        stop_hits: tuple[str, ...] = ()
        if delivered is not None and on_delivery is not None:
            if self._shown is None or self._shown[0] is not delivered:
                self._shown = (delivered, tuple(on_delivery(delivered)))
            stop_hits = self._shown[1]
        events = Events(sampled=None if delivered is None else delivered.output.token_ids,
                        stop_hits=stop_hits, aborts=tuple(self._aborts),
                        new_seqs=tuple(self._new.values()), dirty_blocks=tuple(self._dirty),
                        dirty_states=tuple(self._dirty_states))
        state, plan = step(self._state, events)
        interrupted = False
        if not plan.is_empty:
            mask = self.token_masks(plan) if self.token_masks is not None else None
            try:
                with _interrupts_deferred() as deferred:
                    pending = (self.runner.launch(plan) if mask is None
                               else self.runner.launch(plan, mask))
                interrupted = deferred.happened
            except BaseException:
                self._aborts.extend(plan.seq_ids)
                self._aborts.extend(_holders(self._state, _written_blocks(plan, state)))
                self._dirty.extend(plan.block_entries[:, 2].tolist())
                self._dirty_states.extend(written_state_slots(plan))
                raise
            self._in_flight.append((plan, pending))
            self.num_launched += 1
        # Committed: from here on, what an interruption leaves is finished by the next call.
        self._state, self._ready, self._shown = state, None, None
        self._num_delivered += delivered is not None
        self._new, self._aborts, self._dirty, self._dirty_states = {}, [], [], []
        self._untraced = (events, plan) if self._trace is not None else None
        self._launched_alone = not plan.is_empty and len(self._in_flight) == 1
        self._unreported = LoopStep(plan, delivered, state.finished)
        if interrupted:  # Ctrl-C during the launch: now that the step is whole
            raise KeyboardInterrupt

    def settled(self, launches: int) -> bool:
        """Whether every plan among the first ``launches`` launched has been delivered to the
        core (``num_launched`` counts them)."""
        return self._num_delivered >= launches

    def _wait_for_tokens(self, launched_alone: bool) -> None:
        """Bring the oldest launched plan's tokens to the host for the next step (if the wait
        is interrupted, the plan stays in flight, to be waited for again)."""
        if not self._in_flight or (self.async_scheduling and launched_alone):
            return
        plan, pending = self._in_flight[0]
        output = pending.wait()
        self._in_flight.popleft()
        self._ready = Delivery(plan, output)


def _written_blocks(plan: BatchPlan, state: EngineState) -> set[int]:
    """The blocks of ``plan``'s new table entries that it computes into (not prefix-cache
    hits, which lie below a sequence's first scheduled position)."""
    entries = plan.block_entries
    computed = entries[:, 1] * state.config.block_size >= plan.start_pos[entries[:, 0]]
    return set(entries[computed, 2].tolist())


def _holders(state: EngineState, blocks: set[int]) -> list[str]:
    """The running sequences whose block tables hold any of ``blocks``."""
    return [seq.seq_id for seq in state.running if blocks.intersection(seq.block_table)]


def written_state_slots(plan: BatchPlan) -> list[int]:
    """The recurrent-state slots a plan writes that a state before it may hold a saved state
    in: the starting sequences' (a slot taken from an evicted saved state) and the saves'."""
    return [s.state_slot for s in plan.started if s.state_slot >= 0] + [
        slot for _, slot in plan.state_saves]


class _Deferred:
    happened = False


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[_Deferred]:
    """Hold back Ctrl-C (SIGINT) while a plan is launched: a launch cut in the middle may
    have sent the plan to some tensor-parallel ranks and not to others, whose collectives
    would then pair with the wrong plan's. Only the main thread receives signals; elsewhere
    this does nothing."""
    deferred = _Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield deferred
        return

    def hold(signum, frame) -> None:
        deferred.happened = True

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield deferred
    finally:
        signal.signal(signal.SIGINT, previous)
