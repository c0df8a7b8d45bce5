"""``diff_traces`` and ``run_series`` on random runs of the loop with the fake runner: a trace
equals itself, an edit is found at its own step, and the series add up."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanofn.state import NewSeq, diff_traces, parse_trace, replay, run_series
from properties.driver import Driver
from properties.profile import examples
from properties.strategies import CoreSetup, requests, setups


def recorded(setup: CoreSetup, workload, pipelined: bool) -> list[str]:
    """The trace lines of a run of ``workload`` (all submitted at the first step)."""
    driver = Driver(setup, pipelined)
    driver.advance([NewSeq(f"r{i}", prompt, params) for i, (prompt, params) in
                    enumerate(workload)])
    driver.drain()
    return driver.trace_lines


def workloads(setup: CoreSetup):
    return st.lists(requests(setup.config.max_model_len), min_size=1, max_size=6)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), pipelined=st.booleans(), data=st.data())
def test_a_changed_delivered_token_is_found_at_its_step(setup, pipelined, data):
    lines = recorded(setup, data.draw(workloads(setup)), pipelined)
    assert diff_traces(parse_trace(lines), parse_trace(lines)).identical
    deliveries = [(i, j) for i, line in enumerate(lines[1:], 1)
                  for j in range(len(json.loads(line).get("sampled", [])))]
    i, j = data.draw(st.sampled_from(deliveries))
    row = json.loads(lines[i])
    row["sampled"][j] += 1
    diff = diff_traces(parse_trace(lines), parse_trace(lines[:i] + [json.dumps(row)]
                                                       + lines[i + 1:]))
    assert diff.header == () and diff.step.step == row["step"]
    (name, a, b), = diff.step.event_changes()
    assert name == "sampled" and len(a) == len(b) == len(row["sampled"])
    assert [seq_id for seq_id in a if a[seq_id] != b[seq_id]] == [list(a)[j]]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), data=st.data())
def test_a_trace_cut_short_differs_at_its_first_missing_step(setup, data):
    lines = recorded(setup, data.draw(workloads(setup)), pipelined=True)
    cut = data.draw(st.integers(1, len(lines) - 1))
    diff = diff_traces(parse_trace(lines), parse_trace(lines[:cut]))
    assert diff.step.step == json.loads(lines[cut])["step"]
    assert diff.step.b is None and diff.step.a.traced.line == cut + 1


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), pipelined=st.booleans(), data=st.data())
def test_the_series_add_up_to_the_runs_totals(setup, pipelined, data):
    pairs = list(replay(parse_trace(recorded(setup, data.draw(workloads(setup)), pipelined))))
    series = run_series(pairs)
    blocks = zip(series.blocks_used, series.blocks_cached, series.blocks_free)
    assert all(sum(counts) == setup.num_blocks for counts in blocks)
    assert sum(series.prefill_tokens) + sum(series.decode_tokens) == sum(
        plan.num_tokens for _, plan in pairs)
    final = pairs[-1][0].counters
    assert sum(series.preemptions) == final.num_preemptions
    assert sum(series.cached_tokens) == final.num_cached_tokens
    assert series.running[-1] == series.waiting[-1] == 0
