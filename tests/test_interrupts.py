"""An interrupt (or an exception) anywhere in a call is a transaction's abort: the call's
requests are aborted, the plans in flight settled, and the LLM stays usable with every KV block
free, no request left and a trace that still replays with ``--check``.

Each test raises ``KeyboardInterrupt`` at the k-th call of one point of the step loop, then
checks the engine and runs the same batch again, which must give the tokens of a run that was
never interrupted."""

from __future__ import annotations

import itertools

import pytest

import nanofn.engine.loop as loop_module
import nanofn.llm as llm_module
from nanofn import LLM, SamplingParams
from nanofn.engine.engine import Engine
from nanofn.runner.sampler import DeviceSample
from nanofn.state.block_pool import BULK_RELEASE, PoolChanges
from nanofn.state import parse_trace, replay

PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(20 + 9 * i)] for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True,
                         stop=["\x00 never"] if i % 2 else None) for i in range(6)]
# (where, attribute, the calls a generate makes of it at least)
POINTS = [
    (loop_module, "step", 8),  # the pure core
    (Engine, "_take_delivery", 8),  # the shell's delivery hook (stop strings)
    (Engine, "_decode_some", 4),  # host work while the device computes
    (Engine, "_finish", 8),  # finished records into outputs
    (Engine, "_take_output", 3),
    (DeviceSample, "wait", 8),  # waiting for the sampled tokens
    (loop_module, "step_line", 8),  # the trace
    (llm_module._Progress, "update", 8),  # the progress bar
    (Engine, "add_request", 4),
    (Engine, "tokenize", 4),
]


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128) as llm:
        return tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def raise_at_call(monkeypatch, owner, name: str, k: int) -> None:
    original = getattr(owner, name)
    calls = itertools.count(1)

    def interrupted(*args, **kwargs):
        if next(calls) == k:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


def assert_clean(llm: LLM) -> None:
    engine, state = llm.engine, llm.engine.state
    assert not engine.has_unfinished_requests()
    assert not state.has_unfinished and not state.batch.ids and not len(state.waiting)
    assert state.pool.num_free == state.pool.num_blocks, "a KV block is still owned"
    assert engine.loop.settled(engine.loop.num_launched)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("point", POINTS, ids=[f"{p[1]}" for p in POINTS])
def test_an_interrupt_anywhere_leaves_the_llm_usable(tiny_qwen3, reference, tmp_path,
                                                     monkeypatch, point, async_scheduling):
    owner, name, calls = point
    trace = tmp_path / "trace.jsonl"
    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128, trace=str(trace),
             async_scheduling=async_scheduling) as llm:
        for k in sorted({1, 2, calls // 2 + 1, calls}):
            with monkeypatch.context() as patch:
                raise_at_call(patch, owner, name, k)
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert_clean(llm)
            assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference, k
            assert_clean(llm)
    assert sum(1 for _ in replay(parse_trace(trace.read_text().splitlines()), check=True)) > 0


def test_a_failed_launch_is_rolled_back_and_its_blocks_leave_the_prefix_cache(tiny_qwen3,
                                                                              reference,
                                                                              monkeypatch):
    """The launch may have written part of the plan's blocks: its sequences are aborted and
    those blocks are no longer trusted as cached prefixes."""
    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128) as llm:
        runner = llm.engine.loop.runner
        for k in (1, 2, 5):
            with monkeypatch.context() as patch:
                raise_at_call(patch, runner, "launch", k)
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert_clean(llm)
            cached = {e.block_hash for _, e in llm.engine.state.pool.cached_blocks()}
            assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference
            assert cached <= {e.block_hash for _, e in llm.engine.state.pool.cached_blocks()}


def test_beam_search_and_chat_settle_too(tiny_qwen3, monkeypatch):
    from nanofn import BeamSearchParams

    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128) as llm:
        before = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
        with monkeypatch.context() as patch:
            raise_at_call(patch, loop_module, "step", 3)
            with pytest.raises(KeyboardInterrupt):
                llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
        assert_clean(llm)
        again = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4))
        assert [s.token_ids for s in again[0].sequences] == [s.token_ids for s in before[0].sequences]
        with monkeypatch.context() as patch:
            raise_at_call(patch, loop_module, "step", 2)
            with pytest.raises(KeyboardInterrupt):
                llm.chat([{"role": "user", "content": "hi"}],
                         SamplingParams(max_tokens=5), use_tqdm=False)
        assert_clean(llm)


def test_automatic_request_ids_skip_the_ones_users_took(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128) as llm:
        engine = llm.engine
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="0")
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="1")
        automatic = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
                     for _ in range(3)]
        assert len(set(automatic) | {"0", "1"}) == 5
        while engine.has_unfinished_requests():
            engine.step()


def test_requests_the_core_does_not_know_are_an_error_not_a_spin(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128) as llm:
        engine = llm.engine
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="a")
        engine.loop._new.clear()  # as if the core had never been told
        with pytest.raises(RuntimeError, match=r"requests \['a'\] are unfinished"):
            engine.step()
        assert not engine.has_unfinished_requests()
        assert tokens(llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))


@pytest.mark.parametrize("tensor_parallel_size", [1, 2], ids=["tp1", "tp2-gloo"])
def test_ctrl_c_during_a_launch_waits_for_the_launch_to_end(tiny_qwen3, reference, monkeypatch,
                                                            tensor_parallel_size):
    """A real SIGINT in the middle of a launch (with two ranks: after the plan reached rank 0,
    as it is sent to rank 1) is held back until the launch is whole, then interrupts."""
    import os
    import signal

    with LLM(str(tiny_qwen3), num_kv_blocks=24, max_model_len=128,
             tensor_parallel_size=tensor_parallel_size) as llm:
        runner = llm.engine.loop.runner
        owner, name = (runner, "launch") if tensor_parallel_size == 1 else (runner._pipes[1],
                                                                             "send_bytes")
        for k in (1, 4):
            calls = itertools.count(1)
            original = getattr(owner, name)

            def with_ctrl_c(*args, original=original, calls=calls, k=k):
                if next(calls) == k:
                    os.kill(os.getpid(), signal.SIGINT)
                return original(*args)

            with monkeypatch.context() as patch:
                patch.setattr(owner, name, with_ctrl_c)
                with pytest.raises(KeyboardInterrupt):
                    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            assert_clean(llm)
            assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == reference


@pytest.mark.parametrize("point", [(PoolChanges, "_free"), (loop_module, "step")],
                         ids=["bulk-release", "reset-prefix-cache-step"])
def test_an_interrupt_in_a_bulk_release_or_a_cache_reset_leaves_the_llm_usable(
        tiny_qwen3, monkeypatch, point):
    """A batch finishing together gives back 64+ blocks in one array-counted release
    (``BULK_RELEASE``), and ``reset_prefix_cache`` runs a step of its own: Ctrl-C in either
    leaves every block free and the next run's tokens unchanged."""
    prompts = [[(5 * i + j) % 300 + 3 for j in range(96)] for i in range(10)]  # 7 blocks each
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(tiny_qwen3), num_kv_blocks=200, max_model_len=128) as llm:
        released = []
        with monkeypatch.context() as patch:  # (the batch's blocks do go back in one release)
            release = PoolChanges.release
            patch.setattr(PoolChanges, "release", lambda self, blocks: (
                released.append(len(blocks)) or release(self, blocks)))
            expected = tokens(llm.generate(prompts, params, use_tqdm=False))
        assert max(released) >= BULK_RELEASE
        owner, name = point
        with monkeypatch.context() as patch:
            raise_at_call(patch, owner, name, 1)
            with pytest.raises(KeyboardInterrupt):
                if name == "_free":
                    llm.generate(prompts, params, use_tqdm=False)
                else:
                    llm.reset_prefix_cache()
        assert_clean(llm)
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert_clean(llm)


def test_a_hybrid_launch_that_fails_after_writing_leaves_no_stale_state(tiny_checkpoint,
                                                                        monkeypatch):
    """A hybrid model's launch that ran (its restores, its steps, its saves) and then raised:
    its sequences are aborted, every state slot is free or saved again, and what it may have
    overwritten (saved states evicted for its slots) leaves the prefix cache, so the prompts
    run again give the tokens of a clean run. Two state slots: a prompt's save evicts the
    state it started from, and a failure at any launch of the run is tried."""
    shared = "You are a helpful assistant. Answer briefly and precisely, in one sentence. "
    prompts = [shared + question for question in ("What is the capital of France?",
                                                 "Name a prime number.", "Who wrote Hamlet?")]
    options = dict(num_kv_blocks=24, max_model_len=128, num_state_slots=2, max_num_seqs=1)
    params = PARAMS[1]
    model = str(tiny_checkpoint("qwen3_5"))
    with LLM(model, **options) as clean:
        expected = [tokens(clean.generate([p], params, use_tqdm=False)) for p in prompts]
    with LLM(model, **options) as llm:
        runner = llm.engine.loop.runner
        launch = runner.launch
        for k in range(1, 25):
            calls = 0

            def launch_then_fail(plan, *args):
                nonlocal calls
                calls += 1
                sample = launch(plan, *args)
                if calls == k:
                    sample.wait()  # (its work done: the device holds what it wrote)
                    raise KeyboardInterrupt
                return sample

            with monkeypatch.context() as patch:
                patch.setattr(runner, "launch", launch_then_fail)
                try:
                    for prompt in prompts:
                        llm.generate([prompt], params, use_tqdm=False)
                except KeyboardInterrupt:
                    pass
            assert_clean(llm)
            assert llm.engine.state.states.num_working == 0
            again = [tokens(llm.generate([p], params, use_tqdm=False)) for p in prompts]
            assert again == expected, k
