"""Drives the pure core with the fake runner, as the engine shell would."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanofn.state import (EngineState, Events, FinishReason, NewRequest, SamplingParams,
                          SchedulerConfig, header_line, initial_state, step, step_line)
from properties.fake_runner import FakeRunner, stop_string_hit


@dataclass
class Driver:
    """Holds the current state, the fake runner and the trace; ``advance`` is one engine step.

    ``pipelined`` mimics an engine whose runner works one step ahead: a plan's tokens are
    delivered only after the next plan has been launched, so plans carry pending tokens.
    """

    config: SchedulerConfig
    pipelined: bool = False
    state: EngineState = field(init=False)
    runner: FakeRunner = field(init=False)
    in_flight: deque = field(default_factory=deque)  # the tokens of launched plans, oldest first
    ready: tuple[int, ...] | None = None  # tokens to deliver at the next step
    trace_lines: list[str] = field(default_factory=list)
    outputs: dict[str, tuple[tuple[int, ...], FinishReason]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = initial_state(self.config)
        self.runner = FakeRunner(self.config.num_blocks, self.config.block_size)
        self.trace_lines.append(header_line(self.config))

    @property
    def busy(self) -> bool:
        return self.state.has_unfinished or self.ready is not None or bool(self.in_flight)

    def advance(self, new_requests: Sequence[NewRequest] = (), aborts: Sequence[str] = (),
                stop_hits: Sequence[str] = ()):
        events = Events(sampled=self.ready, stop_hits=self._content_stop_hits() + tuple(stop_hits),
                        aborts=tuple(aborts), new_requests=tuple(new_requests))
        self.state, plan = step(self.state, events)
        self.trace_lines.append(step_line(events, plan))
        for seq in self.state.finished:
            self.outputs[seq.seq_id] = (seq.output_token_ids, seq.finish_reason)
        if plan.seqs:
            self.in_flight.append(self.runner.execute(plan))
        # As the engine: wait for the oldest plan unless the one just launched is alone in flight.
        wait = len(self.in_flight) >= 2 or (self.in_flight and (not self.pipelined or not plan.seqs))
        self.ready = self.in_flight.popleft() if wait else None
        return events, plan

    def _content_stop_hits(self) -> tuple[str, ...]:
        """Sequences whose output, with the token now delivered, reaches the test's content
        defined "stop string" (the shell's detokenizer does this for real stop strings)."""
        if self.ready is None:
            return ()
        live = {seq.seq_id: seq for seq in (*self.state.running, *self.state.waiting)}
        hits = []
        for seq_id, token in zip(self.state.awaiting[0], self.ready):
            seq = live.get(seq_id)
            if seq is None:
                continue
            output = seq.output_token_ids + (token,)
            if len(output) >= seq.params.min_tokens and stop_string_hit(output):
                hits.append(seq_id)
        return tuple(hits)

    def drain(self, max_steps: int) -> None:
        """Step with no new events until every sequence has finished."""
        for _ in range(max_steps):
            if not self.busy:
                return
            self.advance()
        raise AssertionError(f"not finished after {max_steps} steps: {self.state.live_ids}")


def run_workload(config: SchedulerConfig,
                 workload: Sequence[tuple[int, tuple[int, ...], SamplingParams]],
                 pipelined: bool = False,
                 max_steps: int = 5000) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
    """Submit request ``i`` (id ``r{i}``) at the engine step ``arrival``; run to the end."""
    driver = Driver(config, pipelined)
    pending = sorted(((arrival, i, prompt, params)
                      for i, (arrival, prompt, params) in enumerate(workload)), key=lambda r: r[:2])
    while pending:
        due = [r for r in pending if r[0] <= driver.state.step]
        pending = pending[len(due):]
        driver.advance([NewRequest(f"r{i}", prompt, params) for _, i, prompt, params in due])
    driver.drain(max_steps)
    return driver.outputs
