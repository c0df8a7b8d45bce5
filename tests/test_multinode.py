"""Tensor parallelism across hosts, as two "hosts" on one machine (gloo on the CPU): the engine's
host runs rank 0, a ``nanofn worker --node-rank 1`` process runs rank 1, which takes its plans
over TCP. TP=2 over the two gives TP=1's tokens; a killed or stopped remote rank is the same
``WorkerFailure`` naming the rank as a local one's; a worker of another layout, or the engine
asked for on a worker host, is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from server_helpers import free_port, needs_proc, spawned_children

from nanofn import LLM, SamplingParams
from nanofn.engine.options import EngineOptions
from nanofn.runner.tensor_parallel import UNRESPONSIVE_AFTER, WorkerFailure

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
PROMPTS = [[3 + i, 7, 11, 13] for i in range(4)]
SMALL = dict(max_model_len=1024, num_kv_blocks=512)


def start_worker_host(port: int, tensor_parallel_size: int = 2) -> subprocess.Popen:
    """``nanofn worker`` as node 1 of 2, for an engine meeting it at ``port``."""
    return subprocess.Popen(
        [sys.executable, "-m", "nanofn", "worker", "--tensor-parallel-size",
         str(tensor_parallel_size), "--nnodes", "2", "--node-rank", "1", "--master-addr",
         "127.0.0.1", "--master-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def two_host_llm(model, port: int) -> LLM:
    return LLM(str(model), tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
               master_port=port, **SMALL)


def test_tp2_over_two_hosts_gives_the_tokens_of_tp1(tiny_qwen3):
    port = free_port()
    host = start_worker_host(port)
    with two_host_llm(tiny_qwen3, port) as llm:
        assert len(llm.engine.runner._workers) == 2  # a local process, a remote rank
        spread = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert host.wait(timeout=30) == 0, host.stdout.read()  # the engine closed: it left cleanly
    with LLM(str(tiny_qwen3), **SMALL) as llm:
        single = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert spread == single


@needs_proc
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_failed_remote_rank_is_a_worker_failure_naming_it(tiny_qwen3, signum):
    port = free_port()
    host = start_worker_host(port)
    llm = two_host_llm(tiny_qwen3, port)
    runner = llm.engine.runner
    [rank_pid] = spawned_children(host.pid)
    sent = []

    def send():
        while runner._num_launched < 20:
            time.sleep(0.001)
        sent.append(time.monotonic())
        os.kill(rank_pid, signum)

    threading.Thread(target=send, daemon=True).start()
    try:
        with pytest.raises(WorkerFailure) as failure:
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        elapsed = time.monotonic() - sent[0]
        message = str(failure.value)
        assert message.startswith("tensor-parallel rank 1 ")
        if signum == signal.SIGKILL:
            assert "on node 1 exited or lost its connection" in message
            assert elapsed < 3
        else:
            assert "stopped responding" in message
            assert elapsed < UNRESPONSIVE_AFTER + 2
        with pytest.raises(WorkerFailure, match="rank 1"):  # at once, and again
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        closing = time.monotonic()
        llm.close()
        assert time.monotonic() - closing < 1
        if signum == signal.SIGSTOP:
            os.kill(rank_pid, signal.SIGCONT)  # it finds its connections cut, and exits
        assert host.wait(timeout=30) == 1  # the worker host reports its rank's failure
    finally:
        llm.close()
        host.kill()


def test_a_worker_of_another_layout_is_refused_naming_both(tiny_qwen3):
    port = free_port()
    host = start_worker_host(port, tensor_parallel_size=4)  # ranks 2 and 3 of 4
    try:
        with pytest.raises(ValueError, match="--tensor-parallel-size 4 --nnodes 2 connected, "
                                             "but the engine runs tensor_parallel_size 2"):
            two_host_llm(tiny_qwen3, port)
        assert host.wait(timeout=30) != 0
        assert "the engine refused it" in host.stdout.read()
    finally:
        host.kill()


def test_the_engine_is_not_asked_for_on_a_worker_host(tiny_qwen3):
    with pytest.raises(ValueError, match="node_rank 1: the engine runs on node 0.*nanofn worker "
                                         "--nnodes 2 --node-rank 1"):
        LLM(str(tiny_qwen3), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)


@pytest.mark.parametrize("options, problem", [
    (dict(tensor_parallel_size=3, nnodes=2, master_port=1), "does not split over nnodes 2"),
    (dict(tensor_parallel_size=2, nnodes=2), "nnodes > 1 needs master_port"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1), "node_rank must be below"),
    (dict(master_port=70000), "master_port must be a TCP port"),
])
def test_bad_cluster_options_are_named(options, problem):
    with pytest.raises(ValueError, match=problem):
        EngineOptions(model="m", **options)


@pytest.mark.parametrize("command", ["worker", "serve", "generate", "bench"])
def test_a_worker_host_runs_its_ranks_whatever_the_command(command, monkeypatch):
    """``--node-rank`` above 0 makes serve, generate and bench what ``nanofn worker`` is."""
    import nanofn.runner.remote_ranks as remote_ranks
    from nanofn.cli import main

    calls = []
    monkeypatch.setattr(remote_ranks, "run_node", lambda *args: calls.append(args) or 0)
    assert main([command, "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "10.0.0.1", "--master-port", "29500"]) == 0
    assert calls == [(4, 2, 1, "10.0.0.1", 29500)]


def test_the_command_line_checks_a_worker_hosts_flags(capsys):
    from nanofn.cli import main

    assert main(["worker", "--tensor-parallel-size", "2", "--nnodes", "2",
                 "--master-port", "29500"]) == 2
    assert "node_rank 0 runs the engine" in capsys.readouterr().err
    assert main(["worker", "--tensor-parallel-size", "2", "--node-rank", "1"]) == 2
    assert "node_rank must be below nnodes (1)" in capsys.readouterr().err


def test_a_host_that_never_comes_is_named_with_the_command_to_start_it(tiny_qwen3, monkeypatch):
    from datetime import timedelta

    import nanofn.runner.remote_ranks as remote_ranks

    monkeypatch.setattr(remote_ranks, "JOIN_TIMEOUT", timedelta(seconds=2))
    port = free_port()
    with pytest.raises(TimeoutError, match=f"rank\\(s\\) 1 did not connect within 2 s: on node\\(s\\) "
                                           f"1 run nanofn worker --nnodes 2 --node-rank NODE "
                                           f"--master-addr 127.0.0.1 --master-port {port}"):
        two_host_llm(tiny_qwen3, port)


@pytest.fixture
def plan_listener():
    """The engine's ``PlanListener`` on localhost, and its port and key as a rank reads them
    from the store."""
    import pickle

    import nanofn.runner.remote_ranks as remote_ranks

    class Store(dict):
        set = dict.__setitem__

    store = Store()
    listener = remote_ranks.PlanListener("127.0.0.1", store)
    yield listener, *pickle.loads(store[remote_ranks.PLANS_KEY])
    listener.close()


def assert_a_rank_gets_through(listener, port: int, key: bytes, wait_s: float = 10) -> None:
    """A rank connects (in a thread: its handshake blocks if nothing listens) and its message
    reaches the engine's end."""
    import queue

    from nanofn.runner.remote_ranks import connect

    rank_ends = queue.SimpleQueue()
    threading.Thread(target=lambda: rank_ends.put(connect("127.0.0.1", port, key)),
                     daemon=True).start()
    engine_end = listener._connections.get(timeout=wait_s)
    rank_end = rank_ends.get(timeout=10)
    rank_end.send("hello")
    assert engine_end.recv() == "hello"
    rank_end.close()
    engine_end.close()


def test_a_remote_rank_s_connections_send_each_message_at_once(plan_listener):
    """Nagle's algorithm off at both ends of a remote rank's connections: the engine writes a
    plan and nothing answers it, so with it on a plan waited for the delayed acknowledgement of
    the one before (a median 13-15 ms on localhost: ``benchmarks/experiments/plan_transport.py``)."""
    import socket

    from nanofn.runner.remote_ranks import connect

    listener, port, key = plan_listener
    rank_end = connect("127.0.0.1", port, key)
    engine_end = listener._connections.get(timeout=10)
    try:
        for connection in (rank_end, engine_end):
            with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        rank_end.close()
        engine_end.close()


def test_a_connection_reset_before_it_says_who_it_is_leaves_the_listener_listening(plan_listener):
    """A peer that resets its connection during the authentication (a port scanner, a rank's
    host going down) is dropped; the next rank still connects."""
    import socket
    import struct

    listener, port, key = plan_listener
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as stray:
            stray.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert_a_rank_gets_through(listener, port, key)


def test_a_peer_that_connects_and_says_nothing_does_not_hold_up_the_ranks(plan_listener,
                                                                          monkeypatch):
    """A peer that connects and then says nothing (its host gone down mid-handshake, with no
    reset) is dropped after ``HELLO_TIMEOUT_S``; it held the accept thread for good, so that no
    rank could connect after it."""
    import socket

    import nanofn.runner.remote_ranks as remote_ranks

    monkeypatch.setattr(remote_ranks, "HELLO_TIMEOUT_S", 1.0)
    listener, port, key = plan_listener
    with socket.create_connection(("127.0.0.1", port)) as silent:
        silent.recv(1)  # the challenge: the accept thread is reading this peer's answer now
        assert_a_rank_gets_through(listener, port, key, wait_s=20)


def connect_as_rank(port: int, rank: int, tensor_parallel_size: int = 2) -> tuple:
    """Connect to the engine meeting its ranks at ``port`` as a remote rank of ``nnodes`` 2
    does, saying hello on both connections: (plans, control)."""
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    import nanofn.runner.remote_ranks as remote_ranks

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    plans_port, key = pickle.loads(store.get(remote_ranks.PLANS_KEY))
    hello = (rank, tensor_parallel_size, 2)
    plans = remote_ranks.connect("127.0.0.1", plans_port, key)
    plans.send(("plans", *hello))
    control = remote_ranks.connect("127.0.0.1", plans_port, key)
    control.send(("control", *hello))
    return plans, control


def test_a_remote_rank_that_dies_while_starting_is_named_as_remote(tiny_qwen3):
    """A remote rank that takes its part and dies before it starts (it could not unpickle the
    config: another transformers on its host, say) is named as a rank on node 1 that lost its
    connection, not as a local spawned worker (``code None``, and advice about a script's
    main guard that has nothing to do with it)."""
    import queue

    port = free_port()
    errors = queue.SimpleQueue()

    def rank_that_dies_on_its_part():
        try:
            plans, control = connect_as_rank(port, 1)
            if plans.poll(60):
                plans.recv_bytes()  # its part, which it cannot read
            plans.close()
            control.close()
        except Exception as error:
            errors.put(error)

    rank = threading.Thread(target=rank_that_dies_on_its_part, daemon=True)
    rank.start()
    with pytest.raises(RuntimeError) as failure:
        two_host_llm(tiny_qwen3, port)
    rank.join(timeout=10)
    assert errors.empty(), errors.get()
    message = str(failure.value)
    assert "tensor-parallel rank 1 on node 1 exited or lost its connection" in message
    assert "__main__" not in message


def test_the_ranks_after_one_whose_part_cannot_be_sent_are_cut_off_too(tiny_qwen3,
                                                                       monkeypatch):
    """Ranks 2 and 3 of 4 connect from node 1; rank 2's connections are reset then (its host
    went down), so sending it its part fails and the start with it. Rank 3's connections end
    too: it was not yet among the workers that a failed start kills, and its handle (held by
    its reader thread) kept them open, rank 3 waiting for its part for good."""
    import queue
    import socket
    import struct

    from nanofn.runner.remote_ranks import PlanListener

    port = free_port()
    ranks = queue.SimpleQueue()  # each fake rank's (plans, control), in rank order

    def connect_ranks_2_and_3():
        for rank in (2, 3):
            ranks.put(connect_as_rank(port, rank, tensor_parallel_size=4))

    threading.Thread(target=connect_ranks_2_and_3, daemon=True).start()
    accept = PlanListener.accept_ranks

    def accept_then_reset_rank_2(self, config, check):
        remotes = accept(self, config, check)
        for connection in ranks.get(timeout=10):
            with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.close()
        assert remotes[0].plans.poll(10)  # the reset has reached the engine's end
        return remotes

    monkeypatch.setattr(PlanListener, "accept_ranks", accept_then_reset_rank_2)
    with pytest.raises(OSError):
        LLM(str(tiny_qwen3), tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1",
            master_port=port, **SMALL)
    plans, control = ranks.get(timeout=10)
    assert plans.poll(20), "rank 3's plan connection was left open"
    with pytest.raises(EOFError):
        plans.recv()
    plans.close()
    control.close()


def test_a_remote_rank_killed_as_its_connection_ends_touches_no_other_descriptor(monkeypatch):
    """The watchdog kills a remote rank just as its control connection ends (the rank died with
    the others), which its reader thread then closes. It closed it while ``kill`` was using its
    descriptor, whose number a socket opened meanwhile took (put there with ``dup2`` here): kill
    shut that socket down. The reader thread now waits until kill is done."""
    import socket
    from multiprocessing.connection import Connection

    from nanofn.runner.remote_ranks import RemoteRank

    reached = threading.Event()  # the reader thread has closed the control connection, or waits to

    class Control(Connection):
        def close(self):
            super().close()
            reached.set()

    class TellingLock:
        """A lock that sets ``reached`` when a thread has to wait for it."""

        def __init__(self):
            self._lock = threading.Lock()

        def __enter__(self):
            if not self._lock.acquire(blocking=False):
                reached.set()
                self._lock.acquire()

        def __exit__(self, *_):
            self._lock.release()

    engine_control, rank_control = socket.socketpair()
    engine_plans, rank_plans = socket.socketpair()
    control = Control(engine_control.detach())
    rank = RemoteRank(1, 1, Connection(engine_plans.detach()), control)
    rank._control_lock = TellingLock()
    descriptor = control.fileno()
    other, other_peer = socket.socketpair()  # another socket of the engine's process
    fromfd, planted = socket.fromfd, []

    def fromfd_as_the_rank_ends(fd, *args):
        if fd == descriptor and not reached.is_set():  # kill, about to shut the control down
            rank_control.close()
            assert reached.wait(10)
            if control.closed:
                planted.append(os.dup2(other.fileno(), fd))  # the next one opened takes it
        return fromfd(fd, *args)

    monkeypatch.setattr(socket, "fromfd", fromfd_as_the_rank_ends)
    try:
        rank.kill()
        rank.join(10)
        assert not rank.is_alive()
        other_peer.sendall(b"x")  # (a broken pipe if kill shut the other end down)
        assert other.recv(1) == b"x", "kill shut down another socket"
    finally:
        for fd in planted:
            os.close(fd)
        for sock in (other, other_peer, rank_plans):
            sock.close()
