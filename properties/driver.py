"""Drives the engine loop with the fake runner, as the engine shell does with its model runner."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

from nanofn.engine.loop import Delivery, EngineLoop, LoopStep
from nanofn.state import EngineState, FinishReason, NewSeq, SamplingParams, initial_state
from properties.fake_runner import FakeRunner, stop_string_hit
from properties.strategies import CoreSetup


class Driver:
    """An ``EngineLoop`` over a ``FakeRunner``; ``advance`` is one engine step.

    ``pipelined`` is the loop's async scheduling: a plan's tokens are delivered only after the
    next plan has been launched, so plans carry pending tokens. Stop strings are the test's
    content-defined ones (``stop_string_hit``) plus the ones a test forces on a sequence.
    """

    def __init__(self, setup: CoreSetup, pipelined: bool = False):
        self.setup = setup
        self.runner = FakeRunner(setup.num_blocks, setup.config.block_size)
        self.trace = io.StringIO()
        self.loop = EngineLoop(initial_state(setup.config, setup.num_blocks), self.runner,
                               async_scheduling=pipelined, trace=self.trace)
        self.forced_stops: set[str] = set()
        self.outputs: dict[str, tuple[tuple[int, ...], FinishReason]] = {}

    @property
    def state(self) -> EngineState:
        return self.loop.state

    @property
    def trace_lines(self) -> list[str]:
        return self.trace.getvalue().splitlines()

    def advance(self, new_seqs: Sequence[NewSeq] = (), aborts: Sequence[str] = (),
                stop_hits: Sequence[str] = ()) -> LoopStep:
        for new in new_seqs:
            self.loop.add(new)
        for seq_id in aborts:
            self.loop.abort(seq_id)
        self.forced_stops.update(stop_hits)
        result = self.loop.step(self._stop_hits)
        for seq in result.finished:
            self.outputs[seq.seq_id] = (seq.output_token_ids, seq.finish_reason)
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
            if seq_id in self.forced_stops or stop_string_hit(seq.output_token_ids + (token,)):
                self.forced_stops.discard(seq_id)
                yield seq_id

    def drain(self) -> None:
        """Step with no new events until every sequence has finished and no token is in
        flight, within a bound generous for any schedule (each live sequence's every position
        computed a few times over, for preemptions)."""
        live = len(self.state.live_ids) + 1
        max_steps = 4 * live * self.setup.config.max_model_len + 100
        for _ in range(max_steps):
            if not self.loop.has_work():
                return
            self.advance()
        raise AssertionError(f"not finished after {max_steps} steps: {self.state.live_ids}")


def run_workload(setup: CoreSetup,
                 workload: Sequence[tuple[int, tuple[int, ...], SamplingParams]],
                 pipelined: bool = False) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
    """Submit sequence ``i`` (id ``r{i}``) at the engine step ``arrival``; run to the end."""
    driver = Driver(setup, pipelined)
    pending = sorted(((arrival, i, prompt, params)
                      for i, (arrival, prompt, params) in enumerate(workload)), key=lambda r: r[:2])
    while pending:
        due = [r for r in pending if r[0] <= driver.state.step]
        pending = pending[len(due):]
        driver.advance([NewSeq(f"r{i}", prompt, params) for _, i, prompt, params in due])
    driver.drain()
    return driver.outputs
