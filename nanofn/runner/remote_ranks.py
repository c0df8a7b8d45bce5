"""Tensor-parallel ranks on other hosts: how they reach the engine, and how the engine watches
them as it watches its own workers.

Layout (``nnodes`` hosts, ``tensor_parallel_size / nnodes`` ranks each): node 0 runs the engine
and ranks 0..L-1 in worker processes as on one host; node k runs ``nanofn worker`` (``run_node``),
which starts ranks kL..(k+1)L-1. Every rank joins one process group (NCCL, or gloo on CPUs)
through the engine's ``TCPStore`` at ``master_addr:master_port``, torch.distributed's own
rendezvous.

Plans reach a remote rank the way they reach a local one: the engine pickles each plan once and
writes the same bytes to every rank's connection. A local rank's is a pipe; a remote rank's is a
TCP connection (``multiprocessing.connection``, authenticated with a key that the engine
publishes in the store, beside the port it listens on), so the worker code cannot tell them
apart. Why not a broadcast over the process group: it would put a collective (and, on GPUs, a
second communicator on the CPU) into every step of every rank, whose failure modes are the
group's (a rank stuck for good in a C call); a socket is read by one Python call, fails with an
end of file, and keeps the engine's process out of the group (see ``tensor_parallel``).
A 256-sequence decode plan pickles to 10.5 kB in 33 us (once a step, for all ranks). Written
every 5 ms with nothing coming back, as the engine writes them, it reaches the reader a median
~70 us later over a pipe and over TCP on localhost alike, with Nagle's algorithm off
(``without_delay``; ``benchmarks/experiments/plan_transport.py``, a shared 2-core CPU machine).
On a real network add the link's latency once a step, which async scheduling overlaps with the
device's work.

Watching: a remote rank sends a heartbeat every ``HEARTBEAT_S`` over a second connection, the
control connection, which also carries its traceback if it fails. The engine's
``RemoteRank`` turns those into what a local worker offers (``is_alive``, a heart's ``value``,
a reports pipe), so ``TensorParallelExecutor``'s watchdog treats both alike: a remote rank that
dies (its connections end), raises, or stops beating is the same ``WorkerFailure``, naming the
rank. ``kill`` tells a remote rank to exit at once, and cuts its connections: a rank that
cannot hear it (stopped) exits on the end of file once it runs again.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import (Client, Connection, Listener, answer_challenge,
                                        deliver_challenge)
from typing import Any

PLANS_KEY = "nanofn/plan_listener"  # in the store: (port, authentication key)
JOIN_TIMEOUT = timedelta(minutes=5)  # for the other hosts' ranks to connect
HELLO_TIMEOUT_S = 10.0  # for a connection to say which rank it is
BEAT = "beat"
KILL = "kill"
POLL_S = 0.1
HEARTBEAT_S = 0.5


class PlanListener:
    """Where the other hosts' ranks connect for their plans; its port and key go into the
    store, where they look for them."""

    def __init__(self, address: str, store: Any):
        self._key = secrets.token_bytes(32)
        self._listener = Listener((address, 0))  # authenticated by _authenticated
        store.set(PLANS_KEY, pickle.dumps((self._listener.address[1], self._key)))
        self._connections: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="nanofn-plan-listener", daemon=True).start()

    def _accept(self) -> None:
        """Until closed: each authenticated connection, to ``accept_ranks``. A peer that fails
        the authentication, goes away during it (a reset is an ``OSError`` too) or says nothing
        for ``HELLO_TIMEOUT_S`` is dropped."""
        while not self._closed.is_set():
            try:
                connection = self._listener.accept()
            except Exception:
                time.sleep(0.01)  # (an error that persists, no file descriptors left, say)
                continue
            try:
                self._connections.put(without_delay(self._authenticated(connection)))
            except Exception:
                connection.close()

    def _authenticated(self, connection: Connection) -> Connection:
        """``connection`` once its peer has proved it holds the key (as ``Listener`` does
        with an ``authkey``), each read waiting ``HELLO_TIMEOUT_S`` at most: a peer that
        connects and then says nothing (its host gone down mid-handshake, with no reset)
        would otherwise hold this thread, and every rank after it, for good."""
        _set_receive_timeout(connection, HELLO_TIMEOUT_S)
        deliver_challenge(connection, self._key)
        answer_challenge(connection, self._key)
        _set_receive_timeout(connection, 0.0)  # (0: none)
        return connection

    def accept_ranks(self, config: Any, check: Callable[[], None]) -> list[RemoteRank]:
        """The remote ranks of ``config`` once each has connected twice (plans, control), in
        rank order; ``check`` is called while waiting (it raises if this host's ranks fail).
        A rank of another layout is refused, naming both."""
        expected = range(config.ranks_per_node, config.tp_size)
        halves: dict[tuple[str, int], Connection] = {}
        try:
            self._take_halves(halves, expected, config, check)
        except BaseException:
            for connection in halves.values():  # the ranks that came see the end, and exit
                connection.close()
            raise
        return [RemoteRank(rank, rank // config.ranks_per_node, halves["plans", rank],
                           halves["control", rank]) for rank in expected]

    def _take_halves(self, halves: dict, expected: range, config: Any,
                     check: Callable[[], None]) -> None:
        """Fill ``halves`` with each expected rank's two connections, by (kind, rank)."""
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while len(halves) < 2 * len(expected):
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(_missing_ranks(expected, halves, config))
            try:
                connection = self._connections.get(timeout=POLL_S)
            except queue.Empty:
                continue
            hello = _hello(connection)
            if hello is not None:
                kind, rank = _checked_hello(hello, connection, config, expected, halves)
                halves[kind, rank] = connection

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def without_delay(connection: Connection) -> Connection:
    """``connection`` with Nagle's algorithm off. The engine writes a plan and expects nothing
    back on that connection, so with it on, a plan smaller than a segment waited for the
    receiver's delayed acknowledgement of the one before: on localhost, 10.5 kB plans every
    5 ms arrived a median 15 ms late, against 66 us with it off
    (``benchmarks/experiments/plan_transport.py``)."""
    _set_option(connection, socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _set_receive_timeout(connection: Connection, seconds: float) -> None:
    """Make each read of ``connection`` fail (``BlockingIOError``) after ``seconds`` without
    data (``SO_RCVTIMEO``; 0: wait for ever)."""
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    _set_option(connection, socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def _set_option(connection: Connection, level: int, option: int, value: int | bytes) -> None:
    """A socket option of ``connection``'s socket (through a duplicate of its descriptor)."""
    with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(level, option, value)


def connect(master_addr: str, port: int, key: bytes) -> Connection:
    """A remote rank's connection to the engine's ``PlanListener``."""
    return without_delay(Client((master_addr, port), authkey=key))


def _hello(connection: Connection) -> tuple | None:
    """What a new connection says it is, or None (and it is closed) if it says nothing."""
    try:
        if connection.poll(HELLO_TIMEOUT_S):
            return connection.recv()
    except (EOFError, OSError, pickle.UnpicklingError):
        pass
    connection.close()
    return None


def _checked_hello(hello: tuple, connection: Connection, config: Any, expected: range,
                   halves: dict) -> tuple[str, int]:
    """(kind, rank) of a rank's hello; a rank of another layout, or twice the same, is told
    why and the engine's start fails with the same words."""
    kind, rank, tp_size, nnodes = hello
    problem = None
    if (tp_size, nnodes) != (config.tp_size, config.nnodes):
        problem = (f"a worker started with --tensor-parallel-size {tp_size} --nnodes {nnodes} "
                   f"connected, but the engine runs tensor_parallel_size {config.tp_size} over "
                   f"nnodes {config.nnodes}")
    elif rank not in expected or (kind, rank) in halves:
        problem = (f"a worker connected as tensor-parallel rank {rank}, which is not a rank "
                   f"still awaited on another host (ranks {expected.start} to "
                   f"{expected.stop - 1}; is a --node-rank given twice?)")
    if problem is not None:
        with contextlib.suppress(OSError):
            connection.send(("refused", problem))
        connection.close()
        raise ValueError(problem)
    return kind, rank


def _missing_ranks(expected: range, halves: dict, config: Any) -> str:
    missing = sorted({rank for rank in expected if ("plans", rank) not in halves
                      or ("control", rank) not in halves})
    nodes = sorted({rank // config.ranks_per_node for rank in missing})
    return (f"tensor-parallel rank(s) {', '.join(map(str, missing))} did not connect within "
            f"{JOIN_TIMEOUT.total_seconds():.0f} s: on node(s) {', '.join(map(str, nodes))} run "
            f"nanofn worker --nnodes {config.nnodes} --node-rank NODE --master-addr "
            f"{config.master_addr} --master-port {config.master_port} --tensor-parallel-size "
            f"{config.tp_size}")


class _Heart:
    """A remote rank's last heartbeat, as the engine's clock saw it arrive (the hosts' clocks
    differ)."""

    def __init__(self) -> None:
        self.value = time.monotonic()


class RemoteRank:
    """The engine's handle on a rank running on another host, shaped as a local worker
    process's (``is_alive``, ``join``, ``kill``, ``exitcode``) with a heart and a reports pipe
    as the watchdog reads them; ``plans`` is its plan connection."""

    def __init__(self, rank: int, node: int, plans: Connection, control: Connection):
        self.rank, self.node, self.plans = rank, node, plans
        self.heart = _Heart()
        self.exitcode = None
        self.reports, self._report_sink = multiprocessing.Pipe(duplex=False)
        self._control = control
        self._control_lock = threading.Lock()  # its closing, against kill's use of it
        self._lost = threading.Event()
        threading.Thread(target=self._listen, name=f"nanofn-remote-rank{rank}",
                         daemon=True).start()

    def _listen(self) -> None:
        """Beats and a traceback from the rank, until its control connection ends."""
        try:
            while True:
                message = self._control.recv()
                if message == BEAT:
                    self.heart.value = time.monotonic()
                else:  # (when, traceback): timed by this host's clock, as local reports are
                    self._report_sink.send((time.monotonic(), message[1]))
        except (EOFError, OSError):
            pass
        finally:
            self._lost.set()
            with self._control_lock:
                self._control.close()
            self._report_sink.close()

    def is_alive(self) -> bool:
        return not self._lost.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._lost.wait(timeout)

    def kill(self) -> None:
        """Tell the rank to exit now, and cut both connections. The reader thread closes the
        control connection once it ends, which may be now: not while this writes to its
        descriptor or shuts it down, whose number the next file or socket opened would take."""
        with self._control_lock:
            with contextlib.suppress(OSError, ValueError):
                self._control.send(KILL)
            _shut_down(self._control)
        _shut_down(self.plans)


def _shut_down(connection: Connection) -> None:
    """End a connection's socket for both sides, waking a thread blocked reading it."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        duplicate = socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        with duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)


def exit_description(worker: Any) -> str:
    """How a dead worker ended, for a ``WorkerFailure``."""
    if isinstance(worker, RemoteRank):
        return (f"on node {worker.node} exited or lost its connection to the engine (its "
                f"process or host is gone)")
    return f"exited (code {worker.exitcode})"


# --- a host that runs workers only --------------------------------------------------------------

def run_node(tensor_parallel_size: int, nnodes: int, node_rank: int, master_addr: str,
             master_port: int) -> int:
    """``nanofn worker``: start this host's ranks and wait for them; the exit code is 0 when
    every one left cleanly (the engine closed), else 1 (the others are killed then)."""
    if not 0 < node_rank < nnodes:
        raise ValueError(f"node_rank must be in 1..{nnodes - 1} for a worker host (node 0 runs "
                         f"the engine), got {node_rank}")
    if tensor_parallel_size % nnodes:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not split over "
                         f"nnodes {nnodes}")
    per_node = tensor_parallel_size // nnodes
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=remote_rank_main, name=f"nanofn-tp{rank}", args=(
        rank, tensor_parallel_size, nnodes, master_addr, master_port)) for rank in ranks]
    for process in processes:
        process.start()
    # SIGTERM (a job manager's stop) ends the ranks too, through the ``finally`` below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print(f"nanofn worker: node {node_rank} of {nnodes}, tensor-parallel ranks {ranks.start} to "
          f"{ranks.stop - 1}, for the engine at {master_addr}:{master_port}", file=sys.stderr,
          flush=True)
    try:
        return _wait_for_ranks(processes)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


def _wait_for_ranks(processes: list) -> int:
    while True:
        codes = [process.exitcode for process in processes]
        if any(code not in (None, 0) for code in codes):
            return 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


class _LockedSender:
    """A connection's ``send`` for two threads (heartbeats, a failure's traceback)."""

    def __init__(self, connection: Connection):
        self._connection, self._lock = connection, threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self._connection.send(message)


def remote_rank_main(rank: int, tensor_parallel_size: int, nnodes: int, master_addr: str,
                     master_port: int) -> None:
    """One rank on a worker host: find the engine through the store, connect, take its part
    and run plans as a local rank does (``tensor_parallel.run_rank``)."""
    import torch.distributed as dist

    from nanofn.runner.tensor_parallel import run_rank

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is run_node's to handle
    store = dist.TCPStore(master_addr, master_port, is_master=False, timeout=JOIN_TIMEOUT)
    port, key = pickle.loads(store.get(PLANS_KEY))
    hello = (rank, tensor_parallel_size, nnodes)
    plans = connect(master_addr, port, key)
    plans.send(("plans", *hello))
    control = connect(master_addr, port, key)
    control.send(("control", *hello))
    reply = plans.recv()
    if reply[0] == "refused":
        print(f"nanofn worker: rank {rank}: the engine refused it: {reply[1]}", file=sys.stderr)
        sys.exit(2)
    _, hf_config, config = reply
    reports = _LockedSender(control)
    threading.Thread(target=_beat, args=(reports,), daemon=True).start()
    threading.Thread(target=_exit_when_told, args=(control,), daemon=True).start()
    run_rank(hf_config, config, (master_addr, master_port), plans, reports)


def _beat(reports: _LockedSender) -> None:
    with contextlib.suppress(OSError):
        while True:
            reports.send(BEAT)
            time.sleep(HEARTBEAT_S)


def _exit_when_told(control: Connection) -> None:
    """Exit at once when the engine says so, or is gone: this rank may be stuck in a
    collective with a dead peer, where nothing else would end it."""
    with contextlib.suppress(EOFError, OSError):
        while control.recv() != KILL:
            pass
    os._exit(1)
