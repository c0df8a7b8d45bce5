"""Random arrivals, aborts, stop strings, failed launches and sampled tokens driven through the
engine loop with tiny block pools. After every step, the teardown's drain included, the checks
of ``invariants.py`` (DESIGN.md's invariants, the order of eviction, what finished outputs
mean) and of ``fake_runner.py`` (what the device holds) run over the new state and plan."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections import Counter
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nanofn.engine import loop
from nanofn.state import (Events, InvalidRequest, NewSeq, SamplingParams, check_new_seq,
                          parse_trace, replay, scheduler, step)
from nanofn.state.decode import decode_step, find_plain_run
from nanofn.state.plan import PENDING_TOKEN
from nanofn.state.step import full_step
from nanofn.state.store import TOKENS
from properties.driver import Driver, block_hashing, run_workload
from properties.fake_runner import (LaunchFailed, check_cached_blocks_computed,
                                    check_running_contexts, check_states)
from properties.invariants import check_all, check_release_order
from properties.profile import coverage_floor, examples, steps
from properties.strategies import requests, sampling_params, setups

step_module = sys.modules["nanofn.state.step"]  # (``nanofn.state.step`` is the function)
coverage: Counter = Counter()  # how often the properties met what they check, for the totals

# Every preemption, as (free blocks when it was decided, victim before, victim after).
preemptions: list = []
_real_preempt = scheduler.preempt
_real_step = step
_real_decode_step = decode_step
decoded: list = []  # what the plain decode step gave in the step being checked (None: not plain)


def _spying_preempt(pool, states, batch, i, config):
    free = pool.num_free
    victim = _real_preempt(pool, states, batch, i, config)
    preemptions.append((free, batch.seq(i), victim))
    return victim


def _spying_decode_step(state, sampled, delivers_only):
    result = _real_decode_step(state, sampled, delivers_only)
    decoded.append(result)
    return result


def _step_checking_the_shortcut(state, events):
    """``step``, asserting on every step where the plain decode shortcut applies that it gives
    the state and plan the general path (``full_step``) gives from the same state and events
    (a second step of that state), and on every state whose batch carries the shortcut's memo
    (``PlainRun``) that the memo says what the checks it stands for find."""
    if state.batch.plain_run is not None:
        coverage["states with the plain decode memo"] += 1
        assert find_plain_run(state.batch, state.config.block_size) == state.batch.plain_run, \
            "the plain decode memo departs from the checks it stands for"
    decoded.clear()
    new_state, plan = _real_step(state, events)
    if decoded and decoded[0] is not None:
        event("plain decode step (shortcut)")
        coverage["plain decode steps"] += 1
        assert full_step(state, events) == (new_state, plan), \
            "the plain decode shortcut departs from full_step"
    return new_state, plan


class EngineMachine(RuleBasedStateMachine):
    """The machine; ``machine_for`` gives it the setups its runs start from."""

    def start(self, setup, pipelined, plain, twice):
        """``plain``: True for a run whose requests all suit the plain decode step; ``twice``:
        every state that took a delivery is stepped a second time (``step_again``)."""
        self.exits = contextlib.ExitStack()
        self.failed = False
        self.exits.enter_context(block_hashing(setup))
        self.driver = Driver(setup, pipelined)
        self.plain, self.twice = plain, twice
        self.new: list[NewSeq] = []
        self.aborts: list[str] = []
        self.stops: list[str] = []
        self.recorded = []  # every (state, plan), to compare with the replay
        self.snapshots = []  # (a state, a deep copy of it then): later steps must not change it
        self.count = 0
        # add_requests' prompts, in order, each again when it is asked again
        self.new_prompts: list[tuple[int, ...]] = []
        # The sequences of launches that failed since the last step, which the next step ends,
        # and the blocks they handed out, which it drops from the prefix cache (as dirty).
        self.doomed: set[str] = set()
        self.dirty: set[int] = set()
        self.dirty_states: set[int] = set()  # and the state slots it wrote (a hybrid model's)

    @property
    def max_model_len(self) -> int:
        return self.driver.setup.config.max_model_len

    @rule(data=st.data())
    def add_requests(self, data):
        batch = data.draw(st.lists(requests(self.max_model_len, self.plain), min_size=1,
                                   max_size=4))
        for prompt, params in batch:
            self.add(prompt, params)
            self.new_prompts.append(prompt)

    @rule(data=st.data())
    def add_a_prompt_again(self, data):
        """An earlier random request's prompt, maybe with more tokens after it (a conversation's
        next turn, a retry): with prefix caching its blocks are cached, and a hybrid model's
        state saved at one of their ends is restored. Random prompts meet a saved state too
        seldom (none in some runs); so did earlier ones drawn from all of them (none in a CI run:
        with 1-8 state slots the older states are mostly evicted), so half the time it is one
        of the four latest. A prompt asked again counts as the latest once more: a state is
        saved where a second asking meets the first's cached blocks and restored at a third,
        so with only random prompts among the latest two runs in eight still restored 0 and 7
        (2026-12-07; 24-336 in twelve runs since)."""
        if not self.new_prompts:
            return
        recent = data.draw(st.booleans())
        earlier = data.draw(st.sampled_from(self.new_prompts[-4:] if recent else self.new_prompts))
        tail = data.draw(st.lists(st.integers(1, 39), max_size=20))
        prompt = (earlier + tuple(tail))[:self.max_model_len - 1]
        self.add(prompt, data.draw(sampling_params(len(prompt), self.max_model_len, self.plain)))
        self.new_prompts.append(earlier)

    def add(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        self.new.append(NewSeq(f"r{self.count}", prompt, params))
        self.count += 1

    @rule(kind=st.sampled_from(["empty", "too long", "duplicate", "negative token", "n=2"]))
    def add_invalid_request(self, kind):
        live = sorted(self.driver.state.live_ids)
        if kind == "duplicate" and not live:
            return
        bad = {
            "empty": NewSeq("bad", (), SamplingParams()),
            "too long": NewSeq("bad", (1,) * self.max_model_len, SamplingParams(max_tokens=1)),
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

    @rule(after=st.integers(0, 40))
    def fail_next_launch(self, after):
        """The runner fails its next launch once it has computed ``after`` positions of it."""
        self.driver.runner.fail(after)

    @rule(after=st.integers(0, 40))
    def fail_next_eviction(self, after):
        """The runner fails the next launch that hands out a block the prefix cache lists
        (which the loop must drop from the cache) once it has computed ``after`` positions."""
        def evicts(_, blocks: set[int]) -> bool:  # (the loop's state is the one before the step)
            return any(block in blocks for block, _ in self.driver.state.pool.cached_blocks())
        self.driver.runner.fail(after, evicts, kind="eviction")

    @rule(after=st.integers(0, 40))
    def fail_next_state_copy(self, after):
        """The runner fails the next launch that restores a hybrid sequence's saved state or
        saves one (whose slots the loop must mark dirty) once it has computed ``after``
        positions: a random failure meets such a launch too seldom (none in some runs)."""
        self.driver.runner.fail(after, lambda plan, _: bool(plan.state_restores
                                                            or plan.state_saves),
                                kind="state copy")

    @rule(times=st.integers(1, 6))
    def advance(self, times):
        for _ in range(times):
            self.advance_once()

    def advance_once(self) -> bool:
        """One step, checked; False if its launch failed. (While it runs, the run counts as
        failed: a teardown after a failed check leaves the run as it is, so that the failed
        check's error is the one reported.)"""
        self.failed = True
        committed = self.step_and_check()
        self.failed = False
        return committed

    def step_and_check(self) -> bool:
        old = self.driver.state
        before = copy.deepcopy(old)
        preemptions.clear()
        result = self.driver.advance(self.new, self.aborts, self.stops)
        self.new, self.aborts, self.stops = [], [], []
        assert old == before, "step mutated its input"  # invariant 8
        if isinstance(result, LaunchFailed):
            self.after_a_failed_launch(old, result)
            return False
        took_the_shortcut = bool(decoded) and decoded[0] is not None
        self.check_step(old, result.plan)
        if self.twice and result.delivered is not None:
            self.step_again(old, before, result.delivered.output.token_ids, took_the_shortcut)
        return True

    def step_again(self, state, private, delivered, took_the_shortcut: bool):
        """Invariant 8 where it is hardest: step ``state``, which the loop just stepped, a
        second time, with other tokens delivered. The state the loop went on with must not
        change, and the second branch must be what the same step gives from ``private``, a
        deep copy of ``state`` (the store's fill marks keep the branches apart)."""
        events = Events(sampled=[(t + 1) % self.driver.runner.vocab_size for t in delivered])
        current = self.driver.state
        seen = current.running
        branch = step(state, events)
        assert current.running == seen, "stepping an earlier state again changed a later one"
        assert branch == step(private, events), "a second branch read what the first wrote"
        coverage["states stepped again"] += 1
        if took_the_shortcut:
            coverage["states stepped again after a plain decode step"] += 1

    def after_a_failed_launch(self, old, failure: LaunchFailed):
        """The loop stays where it was; the next step must end the plan's sequences and drop
        from the prefix cache the blocks the launch may have written (as its events, which the
        trace records: the step may well hand those blocks out again and so hide that their
        cached contents were kept)."""
        assert self.driver.state is old
        self.doomed.update(failure.plan.seq_ids)
        self.dirty.update(failure.new_blocks)
        self.dirty_states.update([s.state_slot for s in failure.plan.started
                                  if s.state_slot >= 0])
        if failure.plan.state_restores or failure.plan.state_saves:
            coverage["failed launches that restore or save states"] += 1
        coverage["failed launches"] += 1
        runner = self.driver.runner
        if any(not all(map(runner.holds_computed, runner.kv.block(block)))
               for block, _ in old.pool.cached_blocks()):
            coverage["failed launches that wrote cached blocks"] += 1

    def check_step(self, old, plan):
        """Every check of a step the loop committed, from ``old`` to its state with ``plan``."""
        state, runner = self.driver.state, self.driver.runner
        check_all(state, plan)  # invariants 1 to 4 and 6
        for free_blocks, victim_before, victim in preemptions:  # invariant 5
            assert free_blocks == 0, "preempted while blocks were free"
            assert victim.token_ids == victim_before.token_ids, "preemption lost tokens"
            assert not victim.block_table and victim.num_computed == 0
        assert len(state.preempted) == len(preemptions)
        check_release_order(old, state)
        check_running_contexts(runner, state)
        check_cached_blocks_computed(runner, state)
        check_states(runner, state)
        for seq in state.finished:
            self.driver.check_output(seq)
        self.check_failed_launches_undone(state)
        self.recorded.append((state, plan))
        coverage["steps checked"] += 1
        if len(self.recorded) % 3 == 1:
            self.snapshots.append((state, copy.deepcopy(state)))
        _note_coverage(old, state, plan)

    def check_failed_launches_undone(self, state):
        """The first step after failed launches ended their sequences and marked the blocks
        they handed out dirty (its events, as the trace records them)."""
        assert not self.doomed & set(state.live_ids), "a failed launch's sequence lives on"
        if self.dirty or self.dirty_states:
            events = json.loads(self.driver.trace.getvalue().rsplit("\n", 2)[-2])
            kept = self.dirty - set(events.get("dirty", ()))
            assert not kept, f"blocks {kept} of a failed launch were not marked dirty"
            kept = self.dirty_states - set(events.get("dirty_states", ()))
            assert not kept, f"state slots {kept} of a failed launch were not marked dirty"
        self.doomed.clear()
        self.dirty.clear()
        self.dirty_states.clear()

    @invariant()
    def finished_hold_nothing(self):
        if hasattr(self, "driver"):
            assert all(not seq.block_table for seq in self.driver.state.finished)

    def teardown(self):
        if hasattr(self, "exits"):
            with self.exits:
                if not self.failed:
                    self.finish()

    def finish(self):
        """Run everyone to the end, checking every step (invariant 6: everyone finishes);
        then invariants 8 and 9 over the whole run."""
        while not self.advance_once():  # (the requests added since the last step, in)
            pass
        self.driver.drain(self.advance_once)
        assert self.driver.state.pool.num_free == self.driver.state.pool.num_blocks
        states = self.driver.state.states
        assert states is None or states.num_working == 0, "a finished run holds a state slot"
        for kept, snapshot in self.snapshots:  # invariant 8: no later step changed them
            assert kept == snapshot
        # Invariant 9: the trace rebuilds every state and plan.
        trace = parse_trace(self.driver.trace_lines)
        replayed = list(replay(trace, check=True))
        assert [s for s, _ in replayed] == [s for s, _ in self.recorded]
        assert [p for _, p in replayed] == [p for _, p in self.recorded]


def _note_coverage(old, new, plan) -> None:
    """Tell Hypothesis's statistics which mechanisms this step exercised."""
    if new.preempted:
        event("preemption")
    if new.counters.num_cached_tokens > old.counters.num_cached_tokens:
        event("prefix cache hit")
    if any(not s.sample for s in plan.seqs):
        event("chunked prefill")
    if new.pool.num_cached_free < old.pool.num_cached_free and new.pool.num_plain_free == 0:
        coverage["evictions or reuses of cached free blocks"] += 1
    for seq in new.finished:
        event(f"finished: {seq.finish_reason.value}")
    if any(PENDING_TOKEN in s.token_ids for s in plan.seqs):
        event("pending token scheduled")
    if any(seq.num_pending for seq in new.waiting):
        event("preempted with a token in flight")
    if new.batch.store.width(TOKENS) > old.batch.store.width(TOKENS) and not plan.started:
        coverage["rows widened by decoding"] += 1
    if plan.started and _met_a_hash_collision(old, new, plan):
        coverage["admissions past a hash collision"] += 1
    if plan.state_restores:
        coverage["hybrid sequences started from a saved state"] += len(plan.state_restores)
    if plan.state_saves:
        coverage["hybrid states saved"] += len(plan.state_saves)
    if new.states is not None and new.states.num_free == 0 and plan.started:
        coverage["hybrid admissions with no free state slot"] += 1


def _met_a_hash_collision(old, new, plan) -> bool:
    """Whether a sequence that started in this step has a block whose hash the prefix cache
    listed for other tokens (a weak hash's collision, which must not count as a hit)."""
    bs = new.config.block_size
    started = {s.seq_id for s in plan.started}
    for seq in new.running:
        if seq.seq_id not in started:
            continue
        for i, block_hash in enumerate(seq.block_hashes):
            block = old.pool.by_hash.get(block_hash)
            if (block is not None and old.pool.cached[block].token_ids
                    != seq.token_ids[i * bs:(i + 1) * bs]):
                return True
    return False


def machine_for(setup_strategy: st.SearchStrategy) -> type[EngineMachine]:
    """``EngineMachine`` whose runs start from setups drawn from ``setup_strategy``."""

    class Machine(EngineMachine):
        @initialize(setup=setup_strategy, pipelined=st.booleans(),
                    plain=st.sampled_from([None, True]), twice=st.booleans())
        def begin(self, setup, pipelined, plain, twice):
            self.start(setup, pipelined, plain, twice)

    Machine.TestCase.settings = settings(
        max_examples=examples(300 // len(SETUP_FAMILIES)), stateful_step_count=steps(40),
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    return Machine


# The machine runs a quarter of its examples in each family of setups. Drawn from one strategy,
# a run's examples crowded into some families now and then (Hypothesis builds examples from
# earlier ones), and a count below fell from hundreds to a handful: a CI run failed the floor
# of failed launches that copy states (0 of 1), a local one that of hybrid admissions without a
# free slot (3 of 5).
# The hybrid family with prefix caching has 3-8 state slots: with 1 or 2 nearly every saved
# state was evicted before a prompt came again (a CI run saved 24 and restored none); the one
# without caching keeps 1-8, where admissions find no free slot.
SETUP_FAMILIES = (setups(caching=st.just(False), hybrid=st.none()),
                  setups(caching=st.just(True), hybrid=st.none()),
                  setups(caching=st.just(False), hybrid=st.integers(1, 8)),
                  setups(caching=st.just(True), hybrid=st.integers(3, 8)))


def test_engine_state_machine():
    coverage.clear()
    with (mock.patch.object(scheduler, "preempt", _spying_preempt),
          mock.patch.object(loop, "step", _step_checking_the_shortcut),
          mock.patch.object(step_module, "decode_step", _spying_decode_step)):
        for family in SETUP_FAMILIES:
            machine_for(family).TestCase().runTest()
    print(f"state machine: {dict(coverage)}")
    # The properties met what they are there for. Counts over random runs: each floor is well
    # under the fewest seen in default runs (in brackets), so that a run falls short only when
    # the property stopped meeting its case, not by chance.
    # (The fewest of six runs with the setups in families, 2026-11-27, in brackets.)
    for what, least in (("plain decode steps", 100),  # (1,544)
                        ("states stepped again after a plain decode step", 50),  # (481)
                        ("failed launches that wrote cached blocks", 1),  # (32)
                        ("rows widened by decoding", 3),  # (49)
                        ("admissions past a hash collision", 3),  # (8: CI on f319325; 44-102)
                        # (17 of six runs once the caching hybrid family had 3-8 slots and
                        # prompts were asked again mostly among the recent ones, 2026-11-29;
                        # before, a CI run saved 24 states and restored none)
                        ("hybrid states saved", 5),
                        ("hybrid sequences started from a saved state", 10),  # (28)
                        ("hybrid admissions with no free state slot", 5),  # (203)
                        ("failed launches that restore or save states", 1)):  # (10)
        assert coverage[what] >= coverage_floor(least), f"{what}: {coverage[what]}"


@st.composite
def mostly_plain_requests(draw, max_model_len: int):
    """(arrival step, prompt, params): requests the plain decode step can take, now and then
    one that needs its tokens on the host (which the shortcut must leave to the general path)."""
    prompt, params = draw(requests(max_model_len, plain=draw(st.integers(0, 9)) > 0))
    return draw(st.integers(0, 6)), prompt, params


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(setup=setups(), pipelined=st.booleans(), data=st.data())
def _decode_shortcut_agrees(setup, pipelined, data):
    workload = data.draw(st.lists(mostly_plain_requests(setup.config.max_model_len),
                                  min_size=1, max_size=6))
    with (mock.patch.object(loop, "step", _step_checking_the_shortcut),
          mock.patch.object(step_module, "decode_step", _spying_decode_step)):
        run_workload(setup, workload, pipelined)


def test_the_plain_decode_shortcut_gives_what_full_step_gives():
    coverage.clear()
    _decode_shortcut_agrees()
    assert coverage["plain decode steps"] >= coverage_floor(100), \
        "the property hardly ever met a plain decode step"
    assert coverage["states with the plain decode memo"] >= coverage_floor(50), \
        "the property hardly ever met a batch with the decode memo"
