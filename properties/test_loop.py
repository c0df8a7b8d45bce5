"""The engine loop's pipeline, example by example, with the fake runner (the state machine in
test_engine_machine.py drives the same loop with random events)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nanofn.engine.loop import EngineLoop
from nanofn.state import (FinishReason, InvalidRequest, NewSeq, SamplingParams, initial_state,
                          parse_trace, replay)
from properties.driver import Driver, run_workload
from properties.fake_runner import FakeRunner, LaunchFailed, check_running_contexts
from properties.strategies import CoreSetup, scheduler_config

SETUP = CoreSetup(scheduler_config(), num_blocks=16)
LONG = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class CountingRunner(FakeRunner):
    """The fake runner, remembering how many plans were launched and how many waited for."""

    def __init__(self):
        super().__init__(SETUP.num_blocks, SETUP.config.block_size)
        self.launched = self.waited = 0

    def launch(self, plan):
        self.launched += 1
        sampled = super().launch(plan)
        runner = self

        class Pending:
            def wait(self):
                runner.waited += 1
                return sampled.wait()

            def done(self):
                return True
        return Pending()


def test_the_loop_needs_neither_torch_nor_transformers():
    code = ("import sys, nanofn.engine.loop; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_keeps_one_plan_in_flight(async_scheduling):
    runner = CountingRunner()
    loop = EngineLoop(initial_state(SETUP.config, SETUP.num_blocks), runner,
                      async_scheduling=async_scheduling)
    loop.add(NewSeq("a", (1, 2, 3), LONG))
    first = loop.step()
    second = loop.step()
    assert runner.launched == 2
    if async_scheduling:  # the first plan is still computing when the second is scheduled
        assert runner.waited == 1 and second.delivered is None
        assert second.plan.seqs[0].token_ids == (-1,)  # its input is the pending token
    else:
        assert runner.waited == 2 and second.delivered.plan is first.plan
    finished = []
    while loop.has_work():
        finished += loop.step().finished
    assert [(s.seq_id, len(s.output_token_ids)) for s in finished] == [("a", 6)]
    assert runner.launched == runner.waited
    assert not loop.state.undelivered and loop.state.pool.num_free == SETUP.num_blocks


def test_a_sequence_aborted_before_its_first_step_finishes_at_that_step():
    driver = Driver(SETUP, pipelined=True)
    driver.loop.add(NewSeq("a", (1, 2), LONG))
    driver.loop.abort("a")
    result = driver.advance()
    assert [(s.seq_id, s.finish_reason) for s in result.finished] == [("a", FinishReason.ABORT)]
    assert result.plan.is_empty and not driver.loop.has_work()


def test_an_invalid_sequence_is_refused_and_leaves_the_queue_as_it_was():
    driver = Driver(SETUP)
    driver.loop.add(NewSeq("a", (1, 2), LONG))
    with pytest.raises(InvalidRequest, match="'a' is already in use"):
        driver.loop.add(NewSeq("a", (3,), LONG))
    with pytest.raises(InvalidRequest, match="longer than max_model_len"):
        driver.loop.add(NewSeq("b", (1,) * 64, LONG))
    driver.drain()
    assert list(driver.outputs) == ["a"]


def test_an_id_whose_last_token_is_in_flight_is_renamed_not_refused():
    driver = Driver(SETUP, pipelined=True)
    driver.advance([NewSeq("a", (1, 2), LONG)])
    driver.advance(aborts=["a"])  # a is gone, its second plan's token still in flight
    assert driver.loop.add(NewSeq("a", (5, 6), LONG)) == "a~0"
    driver.drain()
    assert driver.outputs["a"][1] is FinishReason.ABORT
    assert len(driver.outputs["a~0"][0]) == 6


def test_stop_hits_from_the_delivery_hook_finish_after_min_tokens_only():
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, ignore_eos=True)
    for pipelined in (False, True):
        driver = Driver(SETUP, pipelined)
        driver.advance([NewSeq("a", (1, 2), params)])
        driver.forced_stops.add("a")  # "a stop string" in every token from now on
        while "a" in driver.state.live_ids:
            driver.advance()
            if "a" in driver.state.live_ids:
                driver.forced_stops.add("a")
        tokens, reason = driver.outputs["a"]
        assert (len(tokens), reason) == (4, FinishReason.STOP)


def test_a_failed_launch_leaves_no_sequence_over_blocks_it_may_have_written():
    """A step that preempts hands the victim's blocks out again in its plan; if the launch
    fails after writing into one, the victim, running again in the state as it was, must not
    go on over it (the loop ends it with the plan's sequences)."""
    setup = CoreSetup(scheduler_config(max_num_seqs=2, enable_prefix_caching=False), num_blocks=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    driver = Driver(setup)
    driver.advance([NewSeq("a", tuple(range(1, 16)), params)])
    driver.advance([NewSeq("b", tuple(range(1, 41)), params)])
    assert driver.state.pool.num_free == 0  # a's next token takes a block of b, preempted
    driver.runner.fail(after=1)
    failure = driver.advance()
    assert isinstance(failure, LaunchFailed) and failure.plan.seq_ids == ("a",)
    while driver.loop.has_work():
        driver.advance()
        check_running_contexts(driver.runner, driver.state)
    alone = run_workload(setup, [(0, tuple(range(1, 41)), params)])["r0"][0]
    assert alone[:len(driver.outputs["b"][0])] == driver.outputs["b"][0]


def test_the_trace_the_loop_writes_replays_to_the_same_plans():
    driver = Driver(CoreSetup(scheduler_config(max_num_seqs=2), num_blocks=8), pipelined=True)
    plans = [driver.advance([NewSeq(f"r{i}", tuple(range(i + 1, i + 30)), LONG)]).plan
             for i in range(4)]
    while driver.loop.has_work():
        plans.append(driver.advance().plan)
    replayed = [plan for _, plan in replay(parse_trace(driver.trace_lines), check=True)]
    assert replayed == plans


def test_host_work_runs_after_the_launch_and_before_the_wait():
    order = []
    runner = CountingRunner()
    launch = runner.launch

    def logged_launch(plan):
        order.append("launch")
        pending = launch(plan)
        wait = pending.wait

        class Logged:
            def wait(self):
                order.append("wait")
                return wait()

            def done(self):
                return True
        return Logged()

    runner.launch = logged_launch
    loop = EngineLoop(initial_state(SETUP.config, SETUP.num_blocks), runner, async_scheduling=False)
    loop.add(NewSeq("a", (1, 2, 3), LONG))
    loop.step(while_waiting=lambda: order.append("host work"))
    assert order == ["launch", "host work", "wait"]
    while loop.has_work():
        loop.step()
    order.clear()
    loop.step(while_waiting=lambda: order.append("host work"))
    assert order == []  # nothing in flight: nothing to overlap with
