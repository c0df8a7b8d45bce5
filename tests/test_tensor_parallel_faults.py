"""A tensor-parallel worker (rank 0 included: every rank runs in a worker process) that dies or
stops mid-generate (gloo on the CPU): the call fails within seconds with an error naming the
rank, every later call fails the same way at once, ``close`` is quiet and no worker process is
left. The engine's process joins no process group, so a rank stuck for good in a collective
(as NCCL's are when a peer dies) cannot hang it."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

import nanofn.runner.tensor_parallel as tensor_parallel
from nanofn import LLM, SamplingParams
from nanofn.runner.model_runner import ModelRunner
from nanofn.runner.tensor_parallel import UNRESPONSIVE_AFTER, WorkerFailure

LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
PROMPTS = [[3 + i, 7, 11, 13] for i in range(4)]


def fault_mid_generate(tiny_qwen3, rank: int, signum: int) -> tuple[str, float, list]:
    """Send ``signum`` to ``rank`` 20 steps into a long generate; the error, the seconds from
    the signal to the error, and the worker processes. ``close`` must take no time: the
    failure ended every worker. (Counted in steps, not seconds: on a GPU the tiny model's
    whole generate takes under a second.)"""
    llm = LLM(str(tiny_qwen3), tensor_parallel_size=2, max_model_len=1024, num_kv_blocks=512)
    runner, workers = llm.engine.runner, list(llm.engine.runner._workers)
    sent = []

    def send():
        while runner._num_launched < 20:
            time.sleep(0.001)
        sent.append(time.monotonic())
        os.kill(workers[rank].pid, signum)

    threading.Thread(target=send, daemon=True).start()
    with pytest.raises(WorkerFailure) as failure:
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    elapsed = time.monotonic() - sent[0]
    with pytest.raises(WorkerFailure, match=f"rank {rank}"):  # at once, not an EOFError
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    closing = time.monotonic()
    llm.close()  # quiet
    assert time.monotonic() - closing < 1
    return str(failure.value), elapsed, workers


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_failed_worker_is_reported_by_rank_within_seconds(tiny_qwen3, rank, signum, capfd):
    message, elapsed, workers = fault_mid_generate(tiny_qwen3, rank, signum)
    assert message.startswith(f"tensor-parallel rank {rank} ")
    if signum == signal.SIGSTOP:
        assert "stopped responding" in message
        assert elapsed < UNRESPONSIVE_AFTER + 2
    else:
        assert "exited" in message
        assert elapsed < 3
    assert not any(w.is_alive() for w in workers), "a worker process was left"
    assert "Traceback" not in capfd.readouterr().err  # close() said nothing


def test_every_rank_runs_in_a_worker_and_the_engine_joins_no_group(tiny_qwen3):
    with LLM(str(tiny_qwen3), tensor_parallel_size=2, max_model_len=128,
             num_kv_blocks=64) as llm:
        assert len(llm.engine.runner._workers) == 2
        assert llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
        assert not dist.is_initialized()
        with pytest.raises(ValueError, match="take the runner's new_timeline"):
            llm.engine.runner.timeline = object()  # a timeline of this process cannot work


def nccl_like_worker_main(*args) -> None:
    """A worker whose collectives behave as NCCL's when a peer dies: they wait for ever (gloo's
    raise). Its heart goes on beating, so only the dead peer gives the failure away."""
    def waits_for_ever_on_failure(collective):
        def wrapped(*a, **k):
            try:
                return collective(*a, **k)
            except Exception:
                threading.Event().wait()
        return wrapped

    for name in ("all_reduce", "all_gather", "broadcast"):
        setattr(dist, name, waits_for_ever_on_failure(getattr(dist, name)))
    tensor_parallel._worker_main(*args)


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-killed", "rank1-killed"])
def test_a_rank_stuck_in_a_collective_does_not_hang_the_engine(tiny_qwen3, monkeypatch, victim):
    monkeypatch.setattr(tensor_parallel, "_worker_main", nccl_like_worker_main)
    message, elapsed, workers = fault_mid_generate(tiny_qwen3, victim, signal.SIGKILL)
    assert message.startswith(f"tensor-parallel rank {victim} exited")
    assert elapsed < 3
    assert not any(w.is_alive() for w in workers), "the stuck rank was left"


def raising_worker_main(hf_config, config, *args) -> None:
    """A worker whose runner raises in its 20th forward pass, if it is the rank that
    ``RAISE_ON_RANK`` names."""
    if config.tp_rank == int(os.environ["RAISE_ON_RANK"]):
        forward, calls = ModelRunner.forward, itertools.count(1)

        def failing_forward(self, plan):
            if next(calls) == 20:
                raise RuntimeError("injected failure")
            return forward(self, plan)

        ModelRunner.forward = failing_forward
    tensor_parallel._worker_main(hf_config, config, *args)


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "rank1"])
def test_a_worker_that_raises_is_named_with_its_traceback(tiny_qwen3, monkeypatch, capfd, rank):
    """Its peer fails too, in the collective it waited in: the first to raise is named."""
    monkeypatch.setattr(tensor_parallel, "_worker_main", raising_worker_main)
    monkeypatch.setenv("RAISE_ON_RANK", str(rank))
    llm = LLM(str(tiny_qwen3), tensor_parallel_size=2, max_model_len=1024, num_kv_blocks=512)
    workers = list(llm.engine.runner._workers)
    with pytest.raises(WorkerFailure) as failure:
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    message = str(failure.value)
    assert message.startswith(f"tensor-parallel rank {rank} ")
    assert "RuntimeError: injected failure" in message
    llm.close()
    assert not any(w.is_alive() for w in workers), "a worker process was left"
    assert "Traceback" not in capfd.readouterr().err  # the traceback is in the error alone


def exiting_worker_main(*args) -> None:
    """A worker that dies before it says hello, as one of a script without a main guard does
    (it re-runs the script, which fails to start processes of its own)."""
    os._exit(3)


def test_a_worker_that_dies_while_starting_is_named_with_the_likely_cause(tiny_qwen3,
                                                                          monkeypatch):
    """Its pipe's end polls as a message: reading it was a bare ``EOFError``."""
    monkeypatch.setattr(tensor_parallel, "_worker_main", exiting_worker_main)
    with pytest.raises(RuntimeError, match=r"rank 0 exited while starting \(code 3\). Workers "
                                           r"are spawned processes.*__name__ == '__main__'"):
        LLM(str(tiny_qwen3), tensor_parallel_size=2, max_model_len=1024, num_kv_blocks=512)
