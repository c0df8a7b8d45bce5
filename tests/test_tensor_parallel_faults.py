"""A tensor-parallel worker that dies or stops mid-generate (gloo on the CPU): the call fails
within seconds with an error naming the rank, every later call fails the same way at once,
``close`` is quiet and no worker process is left."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nanofn import LLM, SamplingParams
from nanofn.runner.tensor_parallel import UNRESPONSIVE_AFTER, WorkerFailure

LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
PROMPTS = [[3 + i, 7, 11, 13] for i in range(4)]


def fault_mid_generate(tiny_qwen3, signum: int) -> tuple[str, float, list]:
    """Send ``signum`` to rank 1 a moment into a long generate; the error, the seconds from
    the signal to the error, and the worker processes."""
    llm = LLM(str(tiny_qwen3), tensor_parallel_size=2, max_model_len=1024, num_kv_blocks=512)
    workers = list(llm.engine.runner._workers)
    sent = []

    def send():
        time.sleep(1.0)
        sent.append(time.monotonic())
        os.kill(workers[0].pid, signum)

    threading.Thread(target=send, daemon=True).start()
    with pytest.raises(WorkerFailure) as failure:
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    elapsed = time.monotonic() - sent[0]
    with pytest.raises(WorkerFailure, match="rank 1"):  # at once, not an EOFError
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()  # quiet
    return str(failure.value), elapsed, workers


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_failed_worker_is_reported_by_rank_within_seconds(tiny_qwen3, signum, capfd):
    message, elapsed, workers = fault_mid_generate(tiny_qwen3, signum)
    assert message.startswith("tensor-parallel rank 1 ")
    if signum == signal.SIGSTOP:
        assert "stopped responding" in message
        assert elapsed < UNRESPONSIVE_AFTER + 2
    else:
        assert "exited" in message
        assert elapsed < 3
    assert not any(w.is_alive() for w in workers), "a worker process was left"
    assert "Traceback" not in capfd.readouterr().err  # close() said nothing
