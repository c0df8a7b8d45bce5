"""The HTTP side of ``nanofn serve``: uvicorn in this process, or in ``--api-server-count N``
processes of their own (vLLM's flag) in front of the same engines.

One server process parses, renders and streams every request in Python (HTTP, JSON, SSE: tens
of microseconds a streamed chunk), under one interpreter lock: at 256 streams of one replica
it was busy 80-94% of the time on the H200 host and served 58% of what its engine makes
(``gpu_run.sh dp``), so a second replica behind it adds little. With N processes, each takes
the connections the kernel hands it from one listening socket, and talks to every engine
process over a pipe of its own (``engine_process``: an engine serves several clients, each
its own requests). Routing stays the same in each process: a prompt's first block prefers
one replica by a pure function (``routing``), so prefix affinity holds whichever process
takes the request; the load fallback counts each process's own requests in flight.

This process then only supervises: it starts the engines (all at once, each with N pipes),
waits until they are ready (an error building one is reported as with one process), binds
the socket, starts the N HTTP processes, and on SIGINT or SIGTERM passes SIGTERM on to them
(each runs the shutdown's grace period); the engines stop once every HTTP process has left
them. An HTTP process that dies takes the server down (its clients' requests cannot be
answered by another), with its exit code named.

/metrics: the HTTP processes' counters and histograms are written to files in one folder
(prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``) and any process's
/metrics adds them up; the engines' figures each process reads from its own pipes.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from nanofn.engine.options import EngineOptions
from nanofn.server.async_engine import (AsyncLLM, join_engine_process, start_engine_process,
                                        wait_until_ready)
from nanofn.server.chat_output import ChatOptions
from nanofn.server.data_parallel import DataParallelLLM, replica_setup, start_all
from nanofn.server.engine_process import EngineFacts, name_this_process
from nanofn.server.limits import ServerLimits
from nanofn.server.metrics import METRICS_FOLDER_VARIABLE

# After the shutdown's grace period, the time uvicorn gives the responses to be written before
# it cancels them.
SHUTDOWN_WRITE_S = 5.0


@dataclass(frozen=True)
class HttpOptions:
    """What an HTTP process serves and how: ``build_app``'s arguments and the address."""

    served_name: str
    api_key: str | None
    chat_options: ChatOptions
    limits: ServerLimits
    host: str
    port: int


def run_http_server(llm: Any, http: HttpOptions, sock: socket.socket | None = None,
                    announce: bool = True, ignore_interrupt: bool = False) -> None:
    """Serve ``llm`` over HTTP until SIGTERM (and SIGINT, unless ``ignore_interrupt``) has let
    the requests in flight end; on ``sock`` if given, else on ``http``'s address."""
    import uvicorn

    from nanofn.server.app import build_app

    app = build_app(llm, http.served_name, http.api_key, http.chat_options, http.limits)
    config = uvicorn.Config(app, host=http.host, port=http.port, log_level="warning",
                            timeout_graceful_shutdown=http.limits.shutdown_timeout
                            + SHUTDOWN_WRITE_S)
    server = _server_class()(config, app.state.shutdown.begin,
                             http.served_name if announce else None, ignore_interrupt)
    server.run(sockets=None if sock is None else [sock])


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn stops taking connections on SIGINT or SIGTERM and lets the requests in
        flight finish (or their clients go); then it raises the signal again, which would
        kill the process before the engine closes. Here ``run`` returns. ``on_shutdown`` is
        called as the shutdown starts (the app's grace period); ``announced`` (a served name)
        is said to be served once the server listens."""

        def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None],
                     announced: str | None, ignore_interrupt: bool):
            super().__init__(config)
            self.on_shutdown, self.announced = on_shutdown, announced
            self.ignore_interrupt = ignore_interrupt

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not (self.ignore_interrupt and sig == signal.SIGINT):
                super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list | None = None) -> None:
            self.on_shutdown()
            await super().shutdown(sockets)

        async def startup(self, sockets: list | None = None) -> None:
            """Say where the server listens once it does (the engine is up by then)."""
            await super().startup(sockets)
            if self.started and self.announced is not None:
                host = self.config.host
                port = self.servers[0].sockets[0].getsockname()[1]  # the one taken for --port 0
                print(f"serving {self.announced} at http://"
                      f"{f'[{host}]' if ':' in host else host}:{port}", file=sys.stderr,
                      flush=True)

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server


# --- several HTTP processes ---------------------------------------------------------------------

@dataclass
class _Engine:
    """A replica's engine process, one pipe end per HTTP process, and its facts."""

    process: BaseProcess
    conns: list[Connection]
    facts: EngineFacts


def serve_in_processes(model: str, options: Mapping[str, Any], data_parallel_size: int,
                       api_server_count: int, http: HttpOptions) -> int:
    """``nanofn serve`` with ``api_server_count`` (> 1) HTTP processes in front of
    ``data_parallel_size`` engines; returns the exit code (0 after SIGINT or SIGTERM)."""
    engine_options, environments = replica_setup(model, data_parallel_size, options)
    engines = start_all([lambda env=env: _start_engine(engine_options, env, api_server_count)
                         for env in environments], _stop_engine)
    try:
        sock = _listening_socket(http.host, http.port)
    except OSError:
        for engine in engines:
            _stop_engine(engine)
        raise
    metrics_folder = tempfile.mkdtemp(prefix="nanofn-metrics-")
    os.environ[METRICS_FOLDER_VARIABLE] = metrics_folder  # read as the HTTP processes import
    context = multiprocessing.get_context("spawn")
    servers = [context.Process(
        target=_http_process, name=f"nanofn-api-{index}",
        args=(index, http, engine_options, sock, [e.conns[index] for e in engines],
              [e.facts for e in engines], [e.process.pid for e in engines]))
        for index in range(api_server_count)]
    try:
        for server in servers:
            server.start()
    finally:
        del os.environ[METRICS_FOLDER_VARIABLE]
        sock.close()
        for engine in engines:
            for conn in engine.conns:
                conn.close()
    try:
        return _supervise(servers)
    finally:
        for engine in engines:
            _stop_engine(engine)
        shutil.rmtree(metrics_folder, ignore_errors=True)


def _start_engine(options: EngineOptions, environment: Mapping[str, str],
                  clients: int) -> _Engine:
    process, conns = start_engine_process(options, environment, clients)
    try:
        # every pipe's "ready" read (the HTTP process behind it reads steps only); one kept
        facts = [wait_until_ready(process, conn) for conn in conns][0]
    except BaseException:
        _close_and_join(process, conns)
        raise
    return _Engine(process, conns, facts)


def _stop_engine(engine: _Engine) -> None:
    _close_and_join(engine.process, engine.conns)


def _close_and_join(process: BaseProcess, conns: list[Connection]) -> None:
    """Close this side's pipes (an engine stops once its last client's pipe closes) and wait
    for the process (``join_engine_process``)."""
    for conn in conns:
        conn.close()
    join_engine_process(process)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The socket the HTTP processes share (bound here, so that port 0 picks one port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _supervise(servers: list[BaseProcess]) -> int:
    """Wait for the HTTP processes; SIGINT or SIGTERM here becomes SIGTERM there. One that
    ends on its own (a crash) stops the others: exit code 1."""
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    crashed = None
    try:
        while any(server.is_alive() for server in servers):
            connection.wait([s.sentinel for s in servers if s.is_alive()], timeout=1.0)
            ended = [s for s in servers if not s.is_alive()]
            if ended and not stopping:
                crashed = ended[0]
                print(f"nanofn serve: HTTP process {crashed.name} exited (exit code "
                      f"{crashed.exitcode}); stopping the server", file=sys.stderr, flush=True)
                stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if crashed is None else 1


def _http_process(index: int, http: HttpOptions, options: EngineOptions, sock: socket.socket,
                  conns: list[Connection], facts: list[EngineFacts], pids: list[int]) -> None:
    """An HTTP process: a client of every engine, serving the connections it accepts on
    ``sock``. Ctrl-C reaches it through the supervisor (as SIGTERM), once."""
    name_this_process(f"nanofn-api-{index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (uvicorn's handler, later, ignores it too)
    from nanofn.engine.engine import load_tokenizer

    tokenizer = load_tokenizer(options)
    replicas = [AsyncLLM.attach(conn, fact, tokenizer, pid, f"{index}-")
                for conn, fact, pid in zip(conns, facts, pids)]
    llm = replicas[0] if len(replicas) == 1 else DataParallelLLM(replicas, options.block_size)
    try:
        run_http_server(llm, http, sock, announce=index == 0, ignore_interrupt=True)
    finally:
        llm.close()
