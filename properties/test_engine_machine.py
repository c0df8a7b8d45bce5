"""Random arrivals, aborts, stop strings and sampled tokens driven through ``step`` with tiny
block pools; all nine invariants of DESIGN.md are checked along the way."""

from __future__ import annotations

import copy
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanofn.state import (Events, InvalidRequest, NewSeq, SamplingParams, check_new_seq,
                          parse_trace, replay, step)
from nanofn.engine import loop
from nanofn.state import scheduler
from nanofn.state.decode import decode_step, find_plain_run
from nanofn.state.step import full_step
from nanofn.state.plan import PENDING_TOKEN
from properties.driver import Driver, run_workload
from properties.fake_runner import check_running_contexts
from properties.invariants import check_all
from properties.profile import examples, steps
from properties.strategies import (MAX_MODEL_LEN, prompts, requests, sampling_params,
                                   setups)

# Every preemption, as (free blocks when it was decided, victim before, victim after).
preemptions: list = []
_real_preempt = scheduler.preempt
_real_step = step


def _spying_preempt(pool, states, batch, i, config):
    free = pool.num_free
    victim = _real_preempt(pool, states, batch, i, config)
    preemptions.append((free, batch.seq(i), victim))
    return victim


def _step_checking_the_shortcut(state, events):
    """``step``, asserting on every step where the plain decode shortcut applies that it gives
    the state and plan the general path (``full_step``) gives from the same state and events,
    and on every state whose batch carries the shortcut's memo (``PlainRun``) that the memo
    says what the checks it stands for find."""
    twin = copy.deepcopy(state)  # (a state's first step may write its store in place)
    if state.batch.plain_run is not None:
        memo_steps.append(1)
        assert find_plain_run(state.batch, state.config.block_size) == state.batch.plain_run, \
            "the plain decode memo departs from the checks it stands for"
    new_state, plan = _real_step(state, events)
    if events.sampled is not None:
        sampled = np.asarray(events.sampled, np.int64)
        shortcut = decode_step(twin, sampled, events.delivers_only)
        if shortcut is not None:
            event("plain decode step (shortcut)")
            shortcut_steps.append(1)
            by_definition = full_step(state, events)
            assert shortcut == by_definition == (new_state, plan), \
                "the plain decode shortcut departs from full_step"
    return new_state, plan


class EngineMachine(RuleBasedStateMachine):
    @initialize(setup=setups(), pipelined=st.booleans())
    def start(self, setup, pipelined):
        self.driver = Driver(setup, pipelined)
        self.new: list[NewSeq] = []
        self.aborts: list[str] = []
        self.stops: list[str] = []
        self.recorded = []  # every (state, plan), to compare with the replay
        self.snapshots = []  # (a state, a deep copy of it then): later steps must not change it
        self.count = 0

    @rule(batch=st.lists(requests(), min_size=1, max_size=4))
    def add_requests(self, batch):
        for prompt, params in batch:
            self.new.append(NewSeq(f"r{self.count}", prompt, params))
            self.count += 1

    @rule(kind=st.sampled_from(["empty", "too long", "duplicate", "negative token", "n=2"]))
    def add_invalid_request(self, kind):
        live = sorted(self.driver.state.live_ids)
        if kind == "duplicate" and not live:
            return
        bad = {
            "empty": NewSeq("bad", (), SamplingParams()),
            "too long": NewSeq("bad", (1,) * MAX_MODEL_LEN, SamplingParams(max_tokens=1)),
            "duplicate": NewSeq(live[0] if live else "", (1, 2), SamplingParams()),
            "negative token": NewSeq("bad", (1, -3), SamplingParams()),
            "n=2": NewSeq("bad", (1, 2), SamplingParams(n=2)),
        }[kind]
        before = copy.deepcopy(self.driver.state)
        with pytest.raises(InvalidRequest):
            check_new_seq(self.driver.state, bad)
        with pytest.raises(InvalidRequest):
            self.driver.loop.add(bad)
        with pytest.raises(InvalidRequest):
            step(self.driver.state, Events(new_seqs=(bad,)))
        assert self.driver.state == before

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.driver.state.live_ids) + ["unknown-id"]
        self.aborts.append(data.draw(st.sampled_from(ids)))

    @rule(data=st.data())
    def stop_string_seen(self, data):
        ids = sorted(self.driver.state.live_ids)
        if ids:
            self.stops.append(data.draw(st.sampled_from(ids)))

    @rule(times=st.integers(1, 6))
    def advance(self, times):
        for _ in range(times):
            self.advance_once()

    def advance_once(self):
        before = copy.deepcopy(self.driver.state)
        old_state = self.driver.state
        preemptions.clear()
        plan = self.driver.advance(self.new, self.aborts, self.stops).plan
        self.new, self.aborts, self.stops = [], [], []
        assert old_state == before, "step mutated its input"  # invariant 8
        state = self.driver.state
        check_all(state, plan)  # invariants 1 to 4 and 6
        for free_blocks, victim_before, victim in preemptions:  # invariant 5
            assert free_blocks == 0, "preempted while blocks were free"
            assert victim.token_ids == victim_before.token_ids, "preemption lost tokens"
            assert not victim.block_table and victim.num_computed == 0
        assert len(state.preempted) == len(preemptions)
        check_running_contexts(self.driver.runner, state)
        self.driver.runner.check_cache_contents(state)
        self.recorded.append((state, plan))
        checked_steps.append(1)
        if len(self.recorded) % 3 == 1:
            self.snapshots.append((state, copy.deepcopy(state)))
        _note_coverage(old_state, state, plan)

    @invariant()
    def finished_hold_nothing(self):
        if hasattr(self, "driver"):
            assert all(not seq.block_table for seq in self.driver.state.finished)

    def teardown(self):
        if not hasattr(self, "driver"):
            return
        self.driver.advance(self.new)
        self.driver.drain()  # invariant 6: everyone finishes
        assert self.driver.state.pool.num_free == self.driver.state.pool.num_blocks
        for kept, snapshot in self.snapshots:  # invariant 8: no later step changed them
            assert kept == snapshot
        # Invariant 9: the trace rebuilds every state and plan.
        trace = parse_trace(self.driver.trace_lines)
        replayed = list(replay(trace, check=True))
        assert [s for s, _ in replayed[:len(self.recorded)]] == [s for s, _ in self.recorded]
        assert [p for _, p in replayed[:len(self.recorded)]] == [p for _, p in self.recorded]


def _note_coverage(old, new, plan) -> None:
    """Tell Hypothesis's statistics which mechanisms this step exercised."""
    if new.preempted:
        event("preemption")
    if new.counters.num_cached_tokens > old.counters.num_cached_tokens:
        event("prefix cache hit")
    if any(not s.sample for s in plan.seqs):
        event("chunked prefill")
    if new.pool.num_cached_free < old.pool.num_cached_free and new.pool.num_plain_free == 0:
        event("eviction or reuse of a cached free block")
    for seq in new.finished:
        event(f"finished: {seq.finish_reason.value}")
    if any(PENDING_TOKEN in s.token_ids for s in plan.seqs):
        event("pending token scheduled")
    if any(seq.num_pending for seq in new.waiting):
        event("preempted with a token in flight")


EngineMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=steps(40), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


checked_steps: list = []  # one entry per step whose invariants were checked


def test_engine_state_machine():
    checked_steps.clear()
    with (mock.patch.object(scheduler, "preempt", _spying_preempt),
          mock.patch.object(loop, "step", _step_checking_the_shortcut)):
        EngineMachine.TestCase().runTest()
    print(f"state machine: {len(checked_steps)} steps checked")


@st.composite
def mostly_plain_requests(draw) -> tuple[int, tuple[int, ...], SamplingParams]:
    """(arrival step, prompt, params): requests the plain decode step can take, now and then
    one that needs its tokens on the host (which the shortcut must leave to the general path)."""
    prompt = draw(prompts())
    room = MAX_MODEL_LEN - len(prompt)
    params = SamplingParams(temperature=0.0, ignore_eos=draw(st.booleans()),
                            max_tokens=draw(st.one_of(st.integers(1, room), st.none())))
    if draw(st.integers(0, 9)) == 0:
        params = draw(sampling_params(len(prompt)))
    return draw(st.integers(0, 6)), prompt, params


shortcut_steps: list = []  # one entry per step the shortcut took and the property checked
memo_steps: list = []  # one entry per state with the shortcut's memo, checked


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setup=setups(), pipelined=st.booleans(),
       workload=st.lists(mostly_plain_requests(), min_size=1, max_size=6))
def _decode_shortcut_agrees(setup, pipelined, workload):
    with mock.patch.object(loop, "step", _step_checking_the_shortcut):
        run_workload(setup, workload, pipelined)


def test_the_plain_decode_shortcut_gives_what_full_step_gives():
    shortcut_steps.clear()
    memo_steps.clear()
    _decode_shortcut_agrees()
    assert len(shortcut_steps) > 100, "the property hardly ever met a plain decode step"
    assert len(memo_steps) > 50, "the property hardly ever met a batch with the decode memo"
