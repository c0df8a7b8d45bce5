"""Tensor parallelism: rank 0 runs in the engine's process, ranks 1.. in worker processes.

Every rank holds its shard of the weights and of the KV cache (its share of the KV heads) and
runs every plan; the layers' collectives go through ``torch.distributed`` (NCCL on GPUs, gloo on
CPUs). Plans reach the workers through pipes; only rank 0 samples, and its tokens are the
result.
"""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import traceback
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nanofn.runner.model_runner import ModelRunner, RunnerConfig
from nanofn.runner.sampler import DeviceSample
from nanofn.state.plan import BatchPlan

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
STOP = b"stop"  # tells a worker to leave (a pickled plan never equals it)


class TensorParallelExecutor:
    def __init__(self, hf_config: Any, config: RunnerConfig):
        size = config.tp_size
        _dump_stacks_later()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        self._pipes, self._workers = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            worker = context.Process(target=_worker_main, daemon=True, name=f"nanofn-tp{rank}",
                                     args=(hf_config, _rank_config(config, rank), init_method, theirs))
            worker.start()
            self._pipes.append(ours)
            self._workers.append(worker)
        self._wait_for_workers()
        own = _rank_config(config, 0)
        _join_group(own, init_method)
        self.runner = ModelRunner(hf_config, own)

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

    def launch(self, plan: BatchPlan) -> DeviceSample:
        self._check_workers()
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)  # once for all workers
        for pipe in self._pipes:
            pipe.send_bytes(message)
        return self.runner.launch(plan)

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.send_bytes(STOP)
        for worker in self._workers:
            worker.join(timeout=30)
        self._pipes, self._workers = [], []
        _leave_group()

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

    def _check_workers(self) -> None:
        for rank, (pipe, worker) in enumerate(zip(self._pipes, self._workers), start=1):
            if pipe.poll():
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{pipe.recv()}")
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {worker.exitcode})")


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


def _worker_main(hf_config: Any, config: RunnerConfig, init_method: str, pipe) -> None:
    _dump_stacks_later()
    try:
        pipe.send("started")
        _join_group(config, init_method)
        runner = ModelRunner(hf_config, config)
        while (message := pipe.recv_bytes()) != STOP:
            plan = pickle.loads(message)
            runner.forward(plan)
            runner.keep_sampled_tokens(plan)
    except Exception:
        pipe.send(traceback.format_exc())
        raise
    finally:
        _leave_group()


def _leave_group() -> None:
    """Leave the process group. NCCL's destroy waits for the other ranks (and hung at the
    end of every TP run on two H200s, with the decode graphs holding NCCL kernels); its abort
    is local and immediate. gloo's destroy is quick."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()  # (private: torch has no public abort)
    else:
        dist.destroy_process_group()


def _dump_stacks_later() -> None:
    """``NANOFN_DUMP_STACKS_AFTER=S``: print every thread's stack after S seconds (to see
    where a rank waits)."""
    import faulthandler
    import os
    after = os.environ.get("NANOFN_DUMP_STACKS_AFTER")
    if after:
        faulthandler.dump_traceback_later(float(after), exit=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
