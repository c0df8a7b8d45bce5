"""Drives the pure core with the fake runner, as the engine shell would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanofn.state import (EngineState, Events, FinishReason, NewRequest, SamplingParams,
                          SchedulerConfig, header_line, initial_state, step, step_line)
from properties.fake_runner import FakeRunner, stop_string_hit


@dataclass
class Driver:
    """Holds the current state, the fake runner and the trace; ``advance`` is one engine step."""

    config: SchedulerConfig
    state: EngineState = field(init=False)
    runner: FakeRunner = field(init=False)
    sampled: tuple[int, ...] = ()
    stop_hits: tuple[str, ...] = ()
    trace_lines: list[str] = field(default_factory=list)
    outputs: dict[str, tuple[tuple[int, ...], FinishReason]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = initial_state(self.config)
        self.runner = FakeRunner(self.config.num_blocks, self.config.block_size)
        self.trace_lines.append(header_line(self.config))

    def advance(self, new_requests: Sequence[NewRequest] = (), aborts: Sequence[str] = (),
                stop_hits: Sequence[str] = ()):
        events = Events(sampled=self.sampled, stop_hits=self.stop_hits + tuple(stop_hits),
                        aborts=tuple(aborts), new_requests=tuple(new_requests))
        self.state, plan = step(self.state, events)
        self.trace_lines.append(step_line(events, plan))
        for seq in self.state.finished:
            self.outputs[seq.seq_id] = (seq.output_token_ids, seq.finish_reason)
        self.sampled = self.runner.execute(plan)
        self.stop_hits = self._content_stop_hits(plan)
        return events, plan

    def _content_stop_hits(self, plan) -> tuple[str, ...]:
        """Sequences whose output, with the token just sampled, reaches the test's content
        defined "stop string" (the shell's detokenizer does this for real stop strings)."""
        running = {seq.seq_id: seq for seq in self.state.running}
        hits = []
        for seq_id, token in zip(self.state.sampling_ids, self.sampled):
            seq = running[seq_id]
            output = seq.output_token_ids + (token,)
            if len(output) >= seq.params.min_tokens and stop_string_hit(output):
                hits.append(seq_id)
        return tuple(hits)

    def drain(self, max_steps: int) -> None:
        """Step with no new events until every sequence has finished."""
        for _ in range(max_steps):
            if not self.state.has_unfinished and not self.sampled:
                return
            self.advance()
        raise AssertionError(f"not finished after {max_steps} steps: {self.state.live_ids}")


def run_workload(config: SchedulerConfig,
                 workload: Sequence[tuple[int, tuple[int, ...], SamplingParams]],
                 max_steps: int = 5000) -> dict[str, tuple[tuple[int, ...], FinishReason]]:
    """Submit request ``i`` (id ``r{i}``) at the engine step ``arrival``; run to the end."""
    driver = Driver(config)
    pending = sorted(((arrival, i, prompt, params)
                      for i, (arrival, prompt, params) in enumerate(workload)), key=lambda r: r[:2])
    while pending:
        due = [r for r in pending if r[0] <= driver.state.step]
        pending = pending[len(due):]
        driver.advance([NewRequest(f"r{i}", prompt, params) for _, i, prompt, params in due])
    driver.drain(max_steps)
    return driver.outputs
