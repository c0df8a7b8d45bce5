"""Tensor parallelism: rank 0 runs in the engine's process, ranks 1.. in worker processes.

Every rank holds its shard of the weights and of the KV cache (its share of the KV heads) and
runs every plan; the layers' collectives go through ``torch.distributed`` (NCCL on GPUs, gloo on
CPUs). Plans reach the workers through pipes; only rank 0 samples, and its tokens are the
result.

A watchdog thread in rank 0 watches the workers: each beats a heart (a shared timestamp, from
a thread of its own, so that a rank busy in a long step still beats). A worker that exits, or
whose heart stops for ``UNRESPONSIVE_AFTER`` seconds (a stopped process), is recorded with its
traceback and killed, which breaks the collectives rank 0 may wait in; rank 0's next call (or
the one that was waiting) raises a ``WorkerFailure`` naming the rank. The executor is broken
from then on: every call raises the same error, and ``close`` only cleans up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import socket
import threading
import time
import traceback
import warnings
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanofn.runner.model_runner import ModelRunner, RunnerConfig
from nanofn.runner.sampler import DeviceSample
from nanofn.state.plan import BatchPlan, TokenBitmask

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
STOP = b"stop"  # tells a worker to leave (a pickled plan never equals it)
HEARTBEAT_S = 0.5
UNRESPONSIVE_AFTER = 8.0  # seconds without a heartbeat before a worker counts as stopped
RELEASE_AFTER_FAILURE_S = 20.0  # the most close() waits for rank 0's device after a failure


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or stopped responding; the engine cannot go on."""


class TensorParallelExecutor:
    def __init__(self, hf_config: Any, config: RunnerConfig):
        size = config.tp_size
        _dump_stacks_later()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        self._pipes, self._workers, self._hearts = [], [], []
        self._failure: str | None = None  # set by the watchdog
        self._closed = threading.Event()
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            heart = context.Value("d", time.monotonic(), lock=False)
            worker = context.Process(target=_worker_main, daemon=True, name=f"nanofn-tp{rank}",
                                     args=(hf_config, _rank_config(config, rank), init_method,
                                           theirs, heart))
            worker.start()
            self._pipes.append(ours)
            self._workers.append(worker)
            self._hearts.append(heart)
        try:
            self._wait_for_workers()
            threading.Thread(target=self._watch, name="nanofn-tp-watchdog", daemon=True).start()
            own = _rank_config(config, 0)
            _join_group(own, init_method)
            self.runner = self._guarded(ModelRunner, hf_config, own)
        except BaseException:
            self.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def timeline(self):
        return self.runner.timeline

    @timeline.setter
    def timeline(self, timeline) -> None:
        self.runner.timeline = timeline

    def launch(self, plan: BatchPlan, token_bitmask: TokenBitmask | None = None) -> _WatchedSample:
        """Every rank runs the plan; rank 0 alone samples, so the mask stays here."""
        self._raise_if_failed()
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)  # once for all workers
        self._guarded(self._send, message)
        masked = () if token_bitmask is None else (token_bitmask,)
        return _WatchedSample(self, self._guarded(self.runner.launch, plan, *masked))

    def _send(self, message: bytes) -> None:
        for pipe in self._pipes:
            pipe.send_bytes(message)

    def _guarded(self, call, *args):
        """``call(*args)``, with a failure of any kind while a worker has failed reported as
        that worker's failure (a collective broken by its death, a pipe it closed...)."""
        try:
            return call(*args)
        except Exception as error:
            self._check_workers(wait_s=UNRESPONSIVE_AFTER + 2 * HEARTBEAT_S)
            if self._failure is not None:
                raise WorkerFailure(self._failure) from error
            raise

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise WorkerFailure(self._failure)

    def close(self) -> None:
        """Stop the workers (killing any that does not leave) and leave the group; quiet,
        also after a worker failed."""
        self._closed.set()
        for pipe, worker in zip(self._pipes, self._workers):
            if worker.is_alive():
                with contextlib.suppress(OSError):
                    pipe.send_bytes(STOP)
        for worker in self._workers:
            worker.join(timeout=10 if self._failure is None else 1)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        self._pipes, self._workers = [], []
        if self._failure is None:
            self._release()
            return
        # A dead rank leaves this rank's collective kernels waiting for it on the device, and
        # freeing memory waits for them: release in a thread of its own, so that close()
        # returns whatever the device does.
        release = threading.Thread(target=self._release_after_failure, daemon=True)
        release.start()
        release.join(RELEASE_AFTER_FAILURE_S)
        if release.is_alive():
            warnings.warn(f"rank 0 could not give its device memory back within "
                          f"{RELEASE_AFTER_FAILURE_S:.0f} s of the failure of another rank; "
                          f"it is held until this process exits", RuntimeWarning, stacklevel=2)

    def _release(self) -> None:
        """Rank 0's runner first (see ``_leave_group``), then the group."""
        if hasattr(self, "runner"):
            self.runner.close()
        _leave_group_quietly()

    def _release_after_failure(self) -> None:
        """Abort the group first, from a thread of its own: that ends the collective kernels
        left waiting for the dead rank; then free the runner, whose graphs the abort may wait
        for."""
        abort = threading.Thread(target=_leave_group_quietly, daemon=True)
        abort.start()
        if hasattr(self, "runner"):
            self.runner.close()
        abort.join()

    def _watch(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            self._check_workers()
            if self._failure is not None:
                return

    def _check_workers(self, wait_s: float = 0.0) -> None:
        """Record the first worker that has exited or stopped beating (waiting up to
        ``wait_s`` for it to show), and kill the stopped one."""
        deadline = time.monotonic() + wait_s
        while self._failure is None:
            for rank, (pipe, worker, heart) in enumerate(
                    zip(self._pipes, self._workers, self._hearts), start=1):
                report = ""
                with contextlib.suppress(OSError, EOFError):
                    if pipe.poll():
                        report = f":\n{pipe.recv()}"
                if not worker.is_alive():
                    self._failure = (f"tensor-parallel rank {rank} exited (code "
                                     f"{worker.exitcode}){report}")
                elif time.monotonic() - heart.value > UNRESPONSIVE_AFTER:
                    worker.kill()
                    self._failure = (f"tensor-parallel rank {rank} stopped responding (no "
                                     f"heartbeat for {UNRESPONSIVE_AFTER:.0f} s) and was "
                                     f"killed{report}")
                elif report:
                    self._failure = f"tensor-parallel rank {rank} failed{report}"
                if self._failure is not None:
                    return
            if time.monotonic() >= deadline:
                return
            time.sleep(HEARTBEAT_S / 5)

    def _wait_for_workers(self) -> None:
        """Each worker says hello before joining the process group; one that dies first
        (typically: a script without a main guard re-running itself) is reported at once
        instead of after the rendezvous timeout."""
        for rank, (pipe, worker) in enumerate(zip(self._pipes, self._workers), start=1):
            while not pipe.poll(0.1):
                if not worker.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited while starting (code "
                        f"{worker.exitcode}). Workers are spawned processes: a script that "
                        f"creates an LLM with tensor_parallel_size > 1 must do so under "
                        f"`if __name__ == '__main__':`")
            pipe.recv()


class _WatchedSample:
    """Rank 0's sampled tokens; waiting for them reports a failed worker as such."""

    def __init__(self, executor: TensorParallelExecutor, sample: DeviceSample):
        self._executor, self._sample = executor, sample

    def done(self) -> bool:
        return self._sample.done()

    def wait(self):
        """Spin on the copy's event (as CUDA's own wait does) so that a failed worker, which
        would leave NCCL's kernels waiting for ever, is noticed."""
        while not self._sample.done():
            self._executor._raise_if_failed()
        return self._executor._guarded(self._sample.wait)


def _rank_config(config: RunnerConfig, rank: int) -> RunnerConfig:
    """Rank r runs on the r-th GPU counted from the one asked for (``cuda:N``)."""
    device = config.device
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank)
    return replace(config, tp_rank=rank, device=device)


def _join_group(config: RunnerConfig, init_method: str) -> None:
    """Join the process group as ``config.tp_rank``, on ``config.device`` (already the rank's
    own, see ``_rank_config``)."""
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=config.tp_rank,
                            world_size=config.tp_size, timeout=COLLECTIVE_TIMEOUT)


def _worker_main(hf_config: Any, config: RunnerConfig, init_method: str, pipe, heart) -> None:
    _dump_stacks_later()
    threading.Thread(target=_beat, args=(heart,), daemon=True).start()
    try:
        pipe.send("started")
        _join_group(config, init_method)
        runner = ModelRunner(hf_config, config)
        while (message := pipe.recv_bytes()) != STOP:
            plan = pickle.loads(message)
            runner.forward(plan)
            runner.keep_sampled_tokens(plan)
        runner.close()  # first: see _leave_group
    except Exception:
        pipe.send(traceback.format_exc())
        raise
    finally:
        _leave_group()


def _beat(heart) -> None:
    """The worker's heartbeat, from its own thread: beats while the rank computes or waits,
    stops only with the process (exited, killed or stopped)."""
    while True:
        heart.value = time.monotonic()
        time.sleep(HEARTBEAT_S)


def _leave_group_quietly() -> None:
    with contextlib.suppress(Exception):
        _leave_group()


def _leave_group() -> None:
    """Leave the process group. NCCL's destroy waits for the other ranks; its abort is local,
    but it too waits for the CUDA graphs that captured the communicator's kernels to be
    destroyed (on two H200s it hung for good with the decode graphs alive): close the rank's
    runner, graphs included, before calling this. gloo's destroy is quick."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()  # (private: torch has no public abort)
    else:
        dist.destroy_process_group()


def _dump_stacks_later() -> None:
    """``NANOFN_DUMP_STACKS_AFTER=S``: print every thread's stack every S seconds (to see
    where a rank waits; from faulthandler's own thread, so also when the main thread is stuck
    inside a C call; not under pytest, whose faulthandler plugin cancels the timer)."""
    import faulthandler
    import os
    after = os.environ.get("NANOFN_DUMP_STACKS_AFTER")
    if after:
        faulthandler.dump_traceback_later(float(after), repeat=True, exit=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
