"""Invariant 7: with a model that is a pure function of the token prefix, outputs do not
depend on prefix caching, chunked prefill or preemption (and ``run_workload`` checks that they
mean what their parameters say)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanofn.state import NewSeq, SamplingParams
from properties.driver import Driver, run_workload
from properties.profile import examples
from properties.strategies import CoreSetup, scheduler_config, setups, workloads


def plain(max_model_len: int, hybrid: bool = False) -> CoreSetup:
    """One sequence at a time, whole prompts, no cache, more blocks than anyone needs (a
    hybrid model's: one state slot, all it needs)."""
    return CoreSetup(scheduler_config(max_num_seqs=1, max_num_batched_tokens=max_model_len,
                                      max_model_len=max_model_len, enable_prefix_caching=False,
                                      enable_chunked_prefill=False), num_blocks=64,
                     num_state_slots=1 if hybrid else None)


def plain_for(setup: CoreSetup) -> CoreSetup:
    """The plain run of the same model as ``setup``'s (a hybrid's, or not)."""
    return plain(setup.config.max_model_len, setup.num_state_slots is not None)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(caching=st.just(True), chunking=st.just(True)), pipelined=st.booleans(),
       data=st.data())
def test_outputs_equal_a_plain_run(setup, pipelined, data):
    max_model_len = setup.config.max_model_len
    workload = data.draw(workloads(max_model_len))
    assert run_workload(setup, workload, pipelined) == run_workload(plain_for(setup), workload)


@settings(max_examples=examples(200), deadline=None)
@given(setup=setups(), pipelined=st.booleans(), data=st.data())
def test_outputs_equal_under_any_configuration(setup, pipelined, data):
    max_model_len = setup.config.max_model_len
    workload = data.draw(workloads(max_model_len))
    assert run_workload(setup, workload, pipelined) == run_workload(plain_for(setup), workload)


def test_a_tight_pool_really_preempts_and_hits_the_cache():
    """The stressed configuration above is not vacuous: on a fixed workload it preempts,
    chunks and hits the prefix cache, and still gives the plain run's outputs."""
    tight = CoreSetup(scheduler_config(max_num_batched_tokens=16), num_blocks=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [tuple(range(1, 21)), tuple(range(1, 25)), tuple(range(1, 18)) + (7,)]
    driver = Driver(tight)
    plan = driver.advance([NewSeq(f"r{i}", p, params) for i, p in enumerate(prompts)]).plan
    chunked = any(not s.sample for s in plan.seqs)
    while driver.loop.has_work():
        plan = driver.advance().plan
        chunked |= any(not s.sample for s in plan.seqs)
    counters = driver.state.counters
    assert counters.num_preemptions > 0 and counters.num_cached_tokens > 0 and chunked
    workload = [(0, p, params) for p in prompts]
    assert driver.outputs == run_workload(plain(tight.config.max_model_len), workload)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(caching=st.just(True), chunking=st.just(True),
                    hybrid=st.integers(1, 8)), pipelined=st.booleans(), data=st.data())
def test_a_hybrid_model_s_outputs_equal_a_plain_run(setup, pipelined, data):
    """Invariant 7 for a hybrid model, whose fake model reads a state standing for the whole
    prefix: prefix caching of blocks and saved states, chunks cut where states are saved,
    preemption and few state slots change no output."""
    workload = data.draw(workloads(setup.config.max_model_len))
    assert run_workload(setup, workload, pipelined) == run_workload(plain_for(setup), workload)


def test_a_tight_hybrid_pool_really_saves_restores_and_preempts():
    """The hybrid runs above are not vacuous: on a fixed workload of prompts behind one
    prefix, arriving one after another, a tight pool saves states, starts sequences from
    them, preempts and evicts saved states, and still gives the plain run's outputs."""
    tight = CoreSetup(scheduler_config(max_num_batched_tokens=20, max_num_seqs=2),
                      num_blocks=5, num_state_slots=3)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    shared = tuple(range(1, 34))
    prompts = [shared + (40 + i,) * (i + 1) for i in range(4)]
    workload = [(3 * i, p, params) for i, p in enumerate(prompts)]
    driver = Driver(tight)
    restores = saves = 0
    pending = list(enumerate(workload))
    while pending or driver.loop.has_work():
        due = [(i, p) for i, (arrival, p, _) in pending if arrival <= driver.state.step]
        pending = [(i, w) for i, w in pending if w[0] > driver.state.step]
        plan = driver.advance([NewSeq(f"r{i}", p, params) for i, p in due]).plan
        restores += len(plan.state_restores)
        saves += len(plan.state_saves)
    counters = driver.state.counters
    assert restores and saves and counters.num_preemptions > 0
    assert driver.outputs == run_workload(plain_for(tight), workload)
