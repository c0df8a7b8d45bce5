"""Tensor parallelism: every rank, rank 0 included, runs in a worker process of its own.

Every rank holds its shard of the weights and of the KV cache (its share of the KV heads) and
runs every plan; the layers' collectives go through ``torch.distributed`` (NCCL on GPUs, gloo on
CPUs). The engine's process pickles each plan once and sends it to every rank through pipes
(through TCP connections to ranks on other hosts: ``remote_ranks``, with ``nnodes > 1``);
rank 0 alone samples (within the plan's token bitmask, which goes to it alone) and sends its
tokens back, in launch order.

Why rank 0 is not in the engine's process: a rank whose peer dies can stay stuck for good
inside a C call (its NCCL kernels wait for the dead peer, and so do the device waits queued
behind them and NCCL's own abort), where no Python code runs, signal handlers included. The
engine's process joins no process group and never waits on a device, only on pipes with
timeouts: it always notices a failure, raises it, and kills the ranks.

A watchdog thread watches the workers: each beats a heart (a shared timestamp, from a thread of
its own, so that a rank busy in a long step still beats). A worker that exits, raises (it sends
its traceback), or whose heart stops for ``UNRESPONSIVE_AFTER`` seconds (a stopped process)
is recorded, and every worker is killed: the others may be stuck waiting for it, and the group
is broken anyway. The engine's next call (or the one waiting) raises a ``WorkerFailure`` naming
the rank; every later call raises the same error, and ``close`` only cleans up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nanofn.runner.model_runner import ModelRunner, RunnerConfig
from nanofn.runner.remote_ranks import (HEARTBEAT_S, PlanListener, RemoteRank,
                                        exit_description)
from nanofn.runner.timeline import DeviceTimeline
from nanofn.state.plan import BatchPlan, SampleOutput, TokenBitmask

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
STOP = b"stop"  # tells a worker to leave (a pickled plan never equals it)
UNRESPONSIVE_AFTER = 8.0  # seconds without a heartbeat before a worker counts as stopped
POLL_S = 0.1  # how often a wait for rank 0's tokens looks for a failure
LEAVE_S = 10.0  # the most close() waits for a worker to leave before killing it


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or stopped responding; the engine cannot go on."""


class TensorParallelExecutor:
    """A ``Runner`` over ``config.tp_size`` worker processes, one per rank."""

    def __init__(self, hf_config: Any, config: RunnerConfig):
        _dump_stacks_later()
        # The rendezvous store lives here, on a port the system picks as it listens: a free
        # port found first and taken later by rank 0 could be taken by another process meanwhile
        # (NCCL opens many), as one was on two H200s. A store is a key-value server, no group.
        # Across hosts it listens on the port they were told (master_port).
        self._store = dist.TCPStore(config.master_addr, config.master_port or 0, is_master=True,
                                    wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        store_address = (config.master_addr, self._store.port)
        # Ranks on other hosts connect to this listener for their plans (see remote_ranks)
        listener = PlanListener(config.master_addr, self._store) if config.nnodes > 1 else None
        context = multiprocessing.get_context("spawn")
        self._pipes, self._reports, self._workers, self._hearts = [], [], [], []
        self._failure: str | None = None  # set once, by the first check that finds one
        self._tracebacks: dict[int, tuple[float, str]] = {}  # rank -> (when, traceback) it sent
        self._checking = threading.Lock()  # one check at a time, none after close
        self._closed = threading.Event()
        self._results: dict[int, SampleOutput] = {}  # received, by launch index, not yet taken
        self._num_launched = self._num_received = 0
        self._timeline: RankZeroTimeline | None = None
        for rank in range(config.ranks_per_node):  # this host's ranks
            ours, theirs = context.Pipe()
            reports, report_end = context.Pipe(duplex=False)
            heart = context.Value("d", time.monotonic(), lock=False)
            worker = context.Process(target=_worker_main, daemon=True, name=f"nanofn-tp{rank}",
                                     args=(hf_config, rank_config(config, rank),
                                           store_address, theirs, report_end, heart))
            worker.start()
            theirs.close()  # the worker holds its ends: its death reads as an end of file here
            report_end.close()
            self._pipes.append(ours)
            self._reports.append(reports)
            self._workers.append(worker)
            self._hearts.append(heart)
        try:
            if listener is not None:
                self._connect_remote_ranks(listener, hf_config, config)
            self._wait_for_workers()
            threading.Thread(target=self._watch, name="nanofn-tp-watchdog", daemon=True).start()
            ready = [self._receive(pipe) for pipe in self._pipes]  # once each runner is built
            # (the ranks agreed on the blocks and state slots)
            self.num_blocks, self.num_state_slots, self.dtype = ready[0]
        except BaseException:
            for worker in self._workers:  # a start that failed: nothing to wait for (ranks
                worker.kill()  # may be waiting for the group's other members for minutes)
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _connect_remote_ranks(self, listener: PlanListener, hf_config: Any,
                              config: RunnerConfig) -> None:
        """Take the other hosts' ranks as they connect, in rank order after this host's, each
        sent its part (while this host's own workers start). All are workers before the first
        part goes: if sending one fails, the failed start kills every one."""
        remotes = listener.accept_ranks(config, self._raise_if_local_worker_died)
        for remote in remotes:
            self._pipes.append(remote.plans)
            self._reports.append(remote.reports)
            self._workers.append(remote)
            self._hearts.append(remote.heart)
        for remote in remotes:
            remote.plans.send(("config", hf_config, rank_config(config, remote.rank)))

    def _raise_if_local_worker_died(self) -> None:
        for rank, worker in enumerate(self._workers):
            if not worker.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited while waiting for the "
                                   f"other hosts' ranks (code {worker.exitcode})")

    def new_timeline(self) -> RankZeroTimeline:
        """A device timeline kept by rank 0, whose events this process cannot read."""
        return RankZeroTimeline(self)

    @property
    def timeline(self) -> RankZeroTimeline | None:
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: RankZeroTimeline | None) -> None:
        """Rank 0 marks every plan it launches on its own timeline from now on (None: no
        more)."""
        if timeline is not None and not isinstance(timeline, RankZeroTimeline):
            raise ValueError("with several ranks the devices are driven by worker processes, "
                             "whose CUDA events this one cannot read: take the runner's "
                             "new_timeline()")
        self._timeline = timeline
        self.send_to_rank_0(TimelineCommand("attach" if timeline is not None else "detach"))

    def send_to_rank_0(self, command: TimelineCommand) -> None:
        """``command`` for rank 0 alone, in order with the plans."""
        self._raise_if_failed()
        self._guarded(self._pipes[0].send_bytes, _pickled(command))

    def ask_rank_0(self, command: TimelineCommand) -> Any:
        """Rank 0's answer to ``command``, which comes back in order with the plans' tokens."""
        self.send_to_rank_0(command)
        self._num_launched += 1
        return self._take(self._num_launched - 1)

    def launch(self, plan: BatchPlan, token_bitmask: TokenBitmask | None = None) -> RankZeroTokens:
        """Send the plan to every rank, pickled once; the mask, if any, goes ahead of rank 0's
        copy (rank 0 alone samples)."""
        self._raise_if_failed()
        message = _pickled(plan)
        self._guarded(self._send, message, token_bitmask)
        self._num_launched += 1
        return RankZeroTokens(self, self._num_launched - 1)

    def _send(self, message: bytes, token_bitmask: TokenBitmask | None) -> None:
        if token_bitmask is not None:
            self._pipes[0].send_bytes(_pickled(token_bitmask))
        for pipe in self._pipes:
            pipe.send_bytes(message)

    def _collect(self, index: int, timeout: float) -> bool:
        """Whether the tokens of launch ``index`` are here, reading what rank 0 sent (in launch
        order) for up to ``timeout`` seconds; raises a failed worker's ``WorkerFailure``."""
        self._raise_if_failed()
        rank_0 = self._pipes[0]
        while index not in self._results and self._guarded(rank_0.poll, timeout):
            self._results[self._num_received] = self._guarded(rank_0.recv)
            self._num_received += 1
        return index in self._results

    def _take(self, index: int) -> SampleOutput:
        while not self._collect(index, POLL_S):
            pass
        return self._results.pop(index)

    def _receive(self, pipe) -> Any:
        """The next message from a worker, watching for failures meanwhile."""
        while not self._guarded(pipe.poll, POLL_S):
            self._raise_if_failed()
        return self._guarded(pipe.recv)

    def _guarded(self, call, *args):
        """``call(*args)``, with a failure of any kind while a worker has failed reported as
        that worker's failure (a pipe it closed by dying...)."""
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
        """Stop the workers, killing any that does not leave within ``LEAVE_S`` seconds (no
        process group lives here, so nothing in this process can hang on them); quiet, also
        after a failure."""
        with self._checking:
            self._closed.set()
        for pipe, worker in zip(self._pipes, self._workers):
            if worker.is_alive():
                with contextlib.suppress(OSError):
                    pipe.send_bytes(STOP)
        deadline = time.monotonic() + LEAVE_S
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        for pipe in self._pipes + self._reports:
            pipe.close()
        self._pipes, self._reports, self._workers = [], [], []
        self._store = None  # its server stops with it

    def _watch(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            self._check_workers()
            if self._failure is not None:
                return

    def _check_workers(self, wait_s: float = 0.0) -> None:
        """Record a failure if a worker has failed (waiting up to ``wait_s`` for one to show)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._checking:
                if self._failure is None and not self._closed.is_set():
                    self._failure = self._find_failure()
            if self._failure is not None or time.monotonic() >= deadline:
                return
            time.sleep(HEARTBEAT_S / 5)

    def _find_failure(self) -> str | None:
        """The failed rank that most likely broke the others, as a ``WorkerFailure`` message,
        and every worker killed; None if all are well. A rank that died without a word (killed,
        crashed) or stopped beating comes first: the others' collectives fail because of it;
        among ranks that raised, the first to raise."""
        silent, raised = [], []
        for rank, (worker, heart) in enumerate(zip(self._workers, self._hearts)):
            alive = worker.is_alive()  # before reading: a dead worker's report is all there
            with contextlib.suppress(OSError, EOFError):
                if rank not in self._tracebacks and self._reports[rank].poll():
                    self._tracebacks[rank] = self._reports[rank].recv()
            when, report = self._tracebacks.get(rank, (0.0, ""))
            name = f"tensor-parallel rank {rank}"
            if not alive:
                message = f"{name} {exit_description(worker)}"
                if report:
                    raised.append((when, f"{message}:\n{report}"))
                else:
                    silent.append(message)
            elif time.monotonic() - heart.value > UNRESPONSIVE_AFTER:
                silent.append(f"{name} stopped responding (no heartbeat for "
                              f"{UNRESPONSIVE_AFTER:.0f} s) and was killed")
            elif report:
                raised.append((when, f"{name} failed:\n{report}"))
        if not silent and not raised:
            return None
        for worker in self._workers:
            worker.kill()
        return silent[0] if silent else min(raised)[1]

    def _wait_for_workers(self) -> None:
        """Each worker says hello before joining the process group; one that dies first
        (typically: a script without a main guard re-running itself) is reported at once
        instead of after the rendezvous timeout."""
        for rank, (pipe, worker) in enumerate(zip(self._pipes, self._workers)):
            while not pipe.poll(POLL_S):
                if not worker.is_alive():
                    raise _died_while_starting(rank, worker)
            try:
                pipe.recv()
            except (EOFError, OSError):  # (a dead worker's pipe polls as ready: its end)
                worker.join(timeout=LEAVE_S)  # (its exit code)
                raise _died_while_starting(rank, worker) from None


def _died_while_starting(rank: int, worker: Any) -> RuntimeError:
    if isinstance(worker, RemoteRank):
        return RuntimeError(f"tensor-parallel rank {rank} {exit_description(worker)}, while "
                            f"starting")
    return RuntimeError(f"tensor-parallel rank {rank} exited while starting (code "
                        f"{worker.exitcode}). Workers are spawned processes: a script that "
                        f"creates an LLM with tensor_parallel_size > 1 must do so under "
                        f"`if __name__ == '__main__':`")


def _pickled(message: Any) -> bytes:
    """A message for the ranks' pipes (plans, masks, timeline commands)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class TimelineCommand:
    """For rank 0's device timeline: ``attach`` it to the runner (a new one), ``detach`` it,
    ``begin`` or ``end`` the run, or ``report`` (answered with ``TimelineReport``)."""

    action: str


@dataclass(frozen=True)
class TimelineReport:
    """What rank 0's ``DeviceTimeline`` measured: its ``busy_seconds`` and ``by_label``."""

    busy_seconds: float
    by_label: dict[str, tuple[int, float, float]]

    def wait(self) -> TimelineReport:  # (sent back as a launched plan's tokens are)
        return self


class RankZeroTimeline:
    """``DeviceTimeline``'s interface for a tensor-parallel engine: rank 0 (which launches
    every plan its device runs, as the others do theirs in step) keeps the events, and
    reports what they measured when asked."""

    def __init__(self, executor: TensorParallelExecutor):
        self._executor = executor
        self._report: TimelineReport | None = None

    def begin(self) -> None:
        self._report = None
        self._executor.send_to_rank_0(TimelineCommand("begin"))

    def end(self) -> None:
        self._executor.send_to_rank_0(TimelineCommand("end"))

    def busy_seconds(self) -> float:
        return self._reported().busy_seconds

    def by_label(self) -> dict[str, tuple[int, float, float]]:
        return self._reported().by_label

    def _reported(self) -> TimelineReport:
        if self._report is None:
            self._report = self._executor.ask_rank_0(TimelineCommand("report"))
        return self._report


class RankZeroTokens:
    """A launched plan's sampled tokens, which rank 0 sends back; waiting for them raises a
    failed worker's ``WorkerFailure`` within seconds rather than waiting for ever."""

    def __init__(self, executor: TensorParallelExecutor, index: int):
        self._executor, self._index = executor, index

    def done(self) -> bool:
        return self._executor._collect(self._index, timeout=0)

    def wait(self) -> SampleOutput:
        return self._executor._take(self._index)


def rank_config(config: RunnerConfig, rank: int) -> RunnerConfig:
    """Rank r runs on its host's (r mod ranks per host)-th GPU counted from the one asked for
    (``cuda:N``)."""
    device = config.device
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + rank % config.ranks_per_node)
    return replace(config, tp_rank=rank, device=device)


def _join_group(config: RunnerConfig, store_address: tuple[str, int]) -> None:
    """Join the process group as ``config.tp_rank``, on ``config.device`` (already the rank's
    own, see ``rank_config``), through the engine's store at ``store_address``."""
    if config.device.type == "cuda":
        torch.cuda.set_device(config.device)
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    store = dist.TCPStore(*store_address, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=config.tp_rank,
                            world_size=config.tp_size, timeout=COLLECTIVE_TIMEOUT)


def _worker_main(hf_config: Any, config: RunnerConfig, store_address: tuple[str, int], pipe,
                 reports, heart) -> None:
    # Ctrl-C in a terminal reaches the whole process group: it is the engine's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _dump_stacks_later()
    threading.Thread(target=_beat, args=(heart,), daemon=True).start()
    run_rank(hf_config, config, store_address, pipe, reports)


def run_rank(hf_config: Any, config: RunnerConfig, store_address: tuple[str, int], pipe,
             reports) -> None:
    """A rank's life, wherever it runs: join the group, build the runner, run plans from
    ``pipe`` until told to stop; a failure's traceback goes to ``reports`` and ends the
    process."""
    try:
        pipe.send("started")
        _join_group(config, store_address)
        runner = ModelRunner(hf_config, config)
        pipe.send((runner.num_blocks, runner.num_state_slots, runner.dtype))
        if config.tp_rank == 0:
            _serve_rank_0(runner, pipe, reports)
        else:
            _serve(runner, pipe)
        runner.close()  # first: see _leave_group
        _leave_group()
    except Exception:
        _report_and_exit(reports)


def _serve(runner: ModelRunner, pipe) -> None:
    """Run each plan as it comes, taking rank 0's sampled tokens for the next plan."""
    while (message := pipe.recv_bytes()) != STOP:
        plan = pickle.loads(message)
        runner.forward(plan)
        runner.keep_sampled_tokens(plan)


def _serve_rank_0(runner: ModelRunner, pipe, reports) -> None:
    """Launch each plan as it comes, within the token bitmask sent ahead of it if any. A thread
    sends each plan's tokens back once they reach the host, so that this one goes on
    launching the next plan while the device computes (the overlap of async scheduling)."""
    samples = queue.SimpleQueue()
    sender = threading.Thread(target=_send_tokens, args=(samples, pipe, reports), daemon=True)
    sender.start()
    token_bitmask = timeline = None
    while (message := pipe.recv_bytes()) != STOP:
        received = pickle.loads(message)
        if isinstance(received, TokenBitmask):
            token_bitmask = received
            continue
        if isinstance(received, TimelineCommand):
            timeline = _follow(received, runner, timeline, samples)
            continue
        samples.put(runner.launch(received, token_bitmask))
        token_bitmask = None
    samples.put(None)
    sender.join()


def _follow(command: TimelineCommand, runner: ModelRunner, timeline: DeviceTimeline | None,
            samples: queue.SimpleQueue) -> DeviceTimeline | None:
    """Rank 0's timeline after ``command`` (a report goes back in order with the tokens)."""
    if command.action == "attach":
        timeline = runner.timeline = DeviceTimeline(runner.device)
    elif command.action == "detach":
        runner.timeline = None
    elif command.action == "begin":
        timeline.begin()
    elif command.action == "end":
        timeline.end()
    else:
        samples.put(TimelineReport(timeline.busy_seconds(), timeline.by_label()))
    return timeline


def _send_tokens(samples: queue.SimpleQueue, pipe, reports) -> None:
    try:
        while (sample := samples.get()) is not None:
            pipe.send(sample.wait())
    except Exception:
        _report_and_exit(reports)


def _report_and_exit(reports) -> NoReturn:
    """Send the engine the current exception's traceback, and leave at once: leaving the
    process group or freeing device memory may hang behind a dead peer, and the engine has
    what it needs to say what happened."""
    with contextlib.suppress(OSError):
        reports.send((time.monotonic(), traceback.format_exc()))
    os._exit(1)


def _beat(heart) -> None:
    """The worker's heartbeat, from its own thread: beats while the rank computes or waits,
    stops only with the process (exited, killed or stopped)."""
    while True:
        heart.value = time.monotonic()
        time.sleep(HEARTBEAT_S)


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
    after = os.environ.get("NANOFN_DUMP_STACKS_AFTER")
    if after:
        faulthandler.dump_traceback_later(float(after), repeat=True, exit=False)
