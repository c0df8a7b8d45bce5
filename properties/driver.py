"""Drives the engine loop with the fake runner, as the engine shell does with its model runner."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

import xxhash

from nanofn.engine.loop import Delivery, EngineLoop, LoopStep
from nanofn.state import EngineState, FinishReason, NewSeq, SamplingParams, Seq, initial_state
from nanofn.state import hashing
from properties.fake_runner import FakeRunner, LaunchFailed, stop_string_hit
from properties.invariants import check_output
from properties.strategies import CoreSetup


class Driver:
    """An ``EngineLoop`` over a ``FakeRunner``; ``advance`` is one engine step.

    ``pipelined`` is the loop's async scheduling: a plan's tokens are delivered only after the
    next plan has been launched, so plans carry pending tokens. Stop strings are the test's
    content-defined ones (``stop_string_hit``) plus the ones a test forces on a sequence. A
    launch the runner fails is left to the loop, as the engine leaves it: the next step
    aborts the plan's sequences and forgets the blocks it may have written.
    """

    def __init__(self, setup: CoreSetup, pipelined: bool = False):
        self.setup = setup
        self.runner = FakeRunner(setup.num_blocks, setup.config.block_size,
                                 num_state_slots=setup.num_state_slots)
        self.trace = io.StringIO()
        self.loop = EngineLoop(initial_state(setup.config, setup.num_blocks,
                                             setup.num_state_slots),
                               self.runner, async_scheduling=pipelined, trace=self.trace)
        self.forced_stops: set[str] = set()
        # Per sequence, the counts of output tokens at which a stop string was reported.
        self.stop_hits: dict[str, set[int]] = {}
        self.finished: dict[str, Seq] = {}

    @property
    def state(self) -> EngineState:
        return self.loop.state

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
        """Each finished sequence's output tokens and finish reason."""
        return {seq_id: (seq.output_token_ids, seq.finish_reason)
                for seq_id, seq in self.finished.items()}

    @property
    def trace_lines(self) -> list[str]:
        return self.trace.getvalue().splitlines()

    def advance(self, new_seqs: Sequence[NewSeq] = (), aborts: Sequence[str] = (),
                stop_hits: Sequence[str] = ()) -> LoopStep | LaunchFailed:
        """One step, or the runner's failure of its launch (the loop then stays as it was,
        its events queued for the next step)."""
        for new in new_seqs:
            self.loop.add(new)
        for seq_id in aborts:
            self.loop.abort(seq_id)
        self.forced_stops.update(stop_hits)
        try:
            result = self.loop.step(self._stop_hits)
        except LaunchFailed as failure:
            return failure
        for seq in result.finished:
            self.finished[seq.seq_id] = seq
        return result

    def _stop_hits(self, delivery: Delivery) -> Iterator[str]:
        """Sequences whose output, with the token now delivered, reaches the test's
        content-defined "stop string", or that a test said to stop; the core decides whether
        they may stop yet (as the shell's detokenizer finds real stop strings)."""
        live = {seq.seq_id: seq for seq in (*self.state.running, *self.state.waiting)}
        for seq_id, token in zip(delivery.plan.sampling_seq_ids, delivery.output.token_ids):
            seq = live.get(seq_id)
            if seq is None:
                continue
            output = seq.output_token_ids + (token,)
            if seq_id in self.forced_stops or stop_string_hit(output):
                self.forced_stops.discard(seq_id)
                self.stop_hits.setdefault(seq_id, set()).add(len(output))
                yield seq_id

    def check_output(self, seq: Seq) -> None:
        """A finished sequence's output means what its parameters say (``check_output``)."""
        c = self.setup.config
        check_output(seq, self.stop_hits.get(seq.seq_id, ()), c.max_model_len, c.eos_token_ids)

    def drain(self, advance: Callable[[], object] | None = None) -> None:
        """Step (with ``advance``, by default ``self.advance``) with no new events until every
        sequence has finished and no token is in flight, within a bound generous for any
        schedule (each live sequence's every position computed a few times over, for
        preemptions)."""
        advance = advance or self.advance
        live = len(self.state.live_ids) + 1
        max_steps = 4 * live * self.setup.config.max_model_len + 100
        for _ in range(max_steps):
            if not self.loop.has_work():
                return
            advance()
        raise AssertionError(f"not finished after {max_steps} steps: {self.state.live_ids}")


@contextlib.contextmanager
def block_hashing(setup: CoreSetup) -> Iterator[None]:
    """Run the core with the setup's block hash: ``weak_hash`` distinct values, if set (so
    that different blocks often share a hash, and only their tokens tell them apart), else
    the real one."""
    if setup.weak_hash is None:
        yield
        return

    def weak_digest(data: bytes, seed: int) -> int:
        return xxhash.xxh64_intdigest(data, seed) % setup.weak_hash

    with mock.patch.object(hashing, "digest", weak_digest):
        yield


def run_workload(setup: CoreSetup,
                 workload: Sequence[tuple[int, tuple[int, ...], SamplingParams]],
                 pipelined: bool = False) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
    """Submit sequence ``i`` (id ``r{i}``) at the engine step ``arrival``; run to the end, and
    check that every output means what its parameters say."""
    with block_hashing(setup):
        driver = Driver(setup, pipelined)
        pending = sorted(((arrival, i, prompt, params)
                          for i, (arrival, prompt, params) in enumerate(workload)),
                         key=lambda r: r[:2])
        while pending:
            due = [r for r in pending if r[0] <= driver.state.step]
            pending = pending[len(due):]
            driver.advance([NewSeq(f"r{i}", prompt, params) for _, i, prompt, params in due])
        driver.drain()
    for seq in driver.finished.values():
        driver.check_output(seq)
    return driver.outputs
