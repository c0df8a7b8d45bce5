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


def plain(max_model_len: int) -> CoreSetup:
    """One sequence at a time, whole prompts, no cache, more blocks than anyone needs."""
    return CoreSetup(scheduler_config(max_num_seqs=1, max_num_batched_tokens=max_model_len,
                                      max_model_len=max_model_len, enable_prefix_caching=False,
                                      enable_chunked_prefill=False), num_blocks=64)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(caching=st.just(True), chunking=st.just(True)), pipelined=st.booleans(),
       data=st.data())
def test_outputs_equal_a_plain_run(setup, pipelined, data):
    max_model_len = setup.config.max_model_len
    workload = data.draw(workloads(max_model_len))
    assert run_workload(setup, workload, pipelined) == run_workload(plain(max_model_len), workload)


@settings(max_examples=examples(200), deadline=None)
@given(setup=setups(), pipelined=st.booleans(), data=st.data())
def test_outputs_equal_under_any_configuration(setup, pipelined, data):
    max_model_len = setup.config.max_model_len
    workload = data.draw(workloads(max_model_len))
    assert run_workload(setup, workload, pipelined) == run_workload(plain(max_model_len), workload)


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
