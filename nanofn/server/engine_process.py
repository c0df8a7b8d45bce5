"""The engine's own process, behind ``AsyncLLM``, and what it says to the server's process.

The server's Python (HTTP, JSON, middleware: ~70 µs per streamed chunk) would otherwise compete
with the engine's Python for one interpreter lock. Here the engine steps in a process of its
own and talks to the server over pipes, in pickled messages (as vLLM's engine core does): one
pipe per client, the server's process or, with ``serve --api-server-count N``, each of its N
HTTP processes (``api_servers``).

Client -> engine, read between steps: ``("add", request_id, prompt, params)``,
``("abort", request_id)``, ``("stop",)`` (the client leaves; the last one to leave stops the
engine, its requests aborted). A request belongs to the client that added it (ids are unique
across clients: a second add of an id in use is refused).
Engine -> each client: ``("ready", EngineFacts)`` once it is built (or ``("failed", error,
traceback)``), then one ``("step", outputs, refused, figures, counters)`` per step with that
client's own outputs and refused adds, and ``("failed", error, traceback)`` if a step raises.
A client whose pipe closes (its process died) has its requests aborted; the others go on.
If every client's pipe closes while the engine is still being built, the engine process ends
then, its workers with it.

An output travels as an ``OutputDelta`` (``Engine.step_deltas``): the prompt once, and of
each completion only the tokens, text and logprobs it gained since the request's previous
delta; ``outputs.apply_delta`` makes the whole ``RequestOutput`` again on the client's side.

This module imports the engine (torch, transformers: seconds) only inside the engine process,
so that the server's process starts it before its own slow imports, which then overlap.
"""

from __future__ import annotations

import builtins
import ctypes
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from nanofn.engine.collector import fewer_gc_pauses
from nanofn.engine.options import EngineOptions
from nanofn.state import Counters, Figures

if TYPE_CHECKING:
    from nanofn.engine.engine import Engine


@dataclass(frozen=True)
class EngineFacts:
    """What the server reads of the engine, sent once when it is ready."""

    max_model_len: int
    generation_defaults: dict[str, Any]
    figures: Figures
    counters: Counters


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else its nearest built-in class with its message (so a
    ``ValueError`` or ``OSError`` stays one for the caller); a ``RuntimeError`` naming it where
    that class takes more than a message (``UnicodeDecodeError``: five arguments)."""
    try:
        pickle.loads(dumps((error,)))
        return error
    except Exception:
        base = next(c for c in type(error).__mro__ if getattr(builtins, c.__name__, None) is c)
        try:
            return base(str(error))
        except TypeError:
            return RuntimeError(f"{type(error).__name__}: {error}")


# --- the engine's process ----------------------------------------------------------------------

def run_engine_process(conns: list[Connection], options: EngineOptions,
                       environment: dict[str, str]) -> None:
    """The engine process's entry point: set ``environment`` (before CUDA starts: a replica's
    ``CUDA_VISIBLE_DEVICES``), build the engine, report it ready to each client, serve their
    commands until every client has sent ``stop`` or gone (its end of the pipe closed)."""
    os.environ.update(environment)
    name_this_process("nanofn-engine")
    # Ctrl-C in a terminal reaches the whole process group; the server stops the engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _ended_if_abandoned(conns):
            from nanofn.engine.engine import Engine

            engine = Engine(options)
    except BaseException as error:
        _send_failure(conns, error)
        return
    try:
        ready = dumps(("ready", EngineFacts(engine.max_model_len, engine.generation_defaults,
                                            engine.figures(), engine.state.counters)))
        for conn in conns:
            conn.send_bytes(ready)
        # On a thread: the engine loop defers Ctrl-C around launches on the main thread only,
        # and this process ignores Ctrl-C (the main thread just waits).
        serving = threading.Thread(target=_EngineServer(engine, conns).run, name="nanofn-engine")
        serving.start()
        serving.join()
    finally:
        engine.close()
        for conn in conns:
            conn.close()


@contextmanager
def _ended_if_abandoned(conns: list[Connection]) -> Iterator[None]:
    """While the engine builds (minutes on GPUs): once every client's pipe has ended (the
    server was stopped, by SIGTERM or even SIGKILL, before the engine was ready), kill this
    process's workers and exit, rather than build on for no one and only then fail to say it
    is ready. The watching stops before "ready" goes out, which the clients' commands follow."""
    stop, stop_writer = os.pipe()
    watcher = threading.Thread(target=_exit_once_every_client_left, args=(conns, stop),
                               name="nanofn-build-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        os.close(stop_writer)  # (the watcher reads the end of file)
        watcher.join()
        os.close(stop)


def _exit_once_every_client_left(conns: list[Connection], stop: int) -> None:
    """Exit once every one of ``conns`` has ended, unless ``stop`` can be read first. A client
    sends nothing before "ready": a pipe that can be read has ended."""
    waiting = list(conns)
    while waiting:
        ready = connection.wait([*waiting, stop])
        if stop in ready:
            return
        waiting = [conn for conn in waiting if conn not in ready]
    for worker in multiprocessing.active_children():  # (tensor-parallel ranks)
        worker.kill()
    os._exit(1)


def name_this_process(name: str) -> None:
    """Show this process as ``name`` (15 characters at most) in ``ps``, ``top`` and
    /proc/PID/comm, where Linux lets it; elsewhere nothing."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _send_failure(conns: list[Connection], error: BaseException) -> None:
    message = dumps(("failed", portable(error), traceback.format_exc()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:  # that client is gone
            pass


class _EveryClientGone(Exception):
    """The last client's end of its pipe closed: it stopped without a ``stop``, or died."""


class _EngineServer:
    """Takes its clients' commands between steps, steps while there is work, sends each client
    its part of each step's outputs."""

    def __init__(self, engine: Engine, conns: list[Connection]):
        self.engine = engine
        self.clients = dict(enumerate(conns))  # the clients still here, by index
        self.owner: dict[str, int] = {}  # per live request, the client that added it
        self.refused: list[tuple[int, str, BaseException]] = []  # adds refused since the last send

    def run(self) -> None:
        try:
            with fewer_gc_pauses():  # as LLM.generate steps
                self._serve()
        except _EveryClientGone:
            pass
        except BaseException as error:  # a bug, or a dead tensor-parallel worker
            _send_failure(list(self.clients.values()), error)

    def _serve(self) -> None:
        while self._take_commands(wait=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests() or self.refused:
                self._step()
        while self.engine.has_unfinished_requests():  # the last client's, aborted
            self._step()

    def _take_commands(self, wait: bool) -> bool:
        """Apply the commands that came (with ``wait``, block for one); False once the last
        client has sent ``stop``."""
        if not self.clients:  # the last one's pipe broke as a step was sent
            return False
        conns = list(self.clients.values())
        if len(conns) == 1:  # one poll: cheaper than a selector a step
            ready = conns if conns[0].poll(None if wait else 0) else []
        else:
            ready = connection.wait(conns, timeout=None if wait else 0)
        for index, conn in list(self.clients.items()):
            if conn in ready:
                self._take_client_commands(index, conn)
        return bool(self.clients)

    def _take_client_commands(self, index: int, conn: Connection) -> None:
        """Every command that has come from one client: its adds, aborts and ``stop``."""
        try:
            while conn.poll():
                command = pickle.loads(conn.recv_bytes())
                kind = command[0]
                if kind == "stop":
                    self._leave(index)
                    return
                if kind == "add":
                    self._add(index, *command[1:])
                elif kind == "abort" and self.owner.get(command[1]) == index:
                    self.engine.abort_request(command[1])
        except (EOFError, OSError):  # the client's process died
            self._leave(index)
            if not self.clients:
                raise _EveryClientGone from None

    def _leave(self, index: int) -> None:
        """A client goes: its pipe closes (its reader sees the end), its requests are aborted
        (their last outputs go nowhere)."""
        self.clients.pop(index).close()
        for request_id in [r for r, owner in self.owner.items() if owner == index]:
            self.engine.abort_request(request_id)

    def _add(self, client: int, request_id: str, prompt: Any, params: Any) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except Exception as error:  # goes back to the caller that asked
            self.refused.append((client, request_id, portable(error)))
            return
        self.owner[request_id] = client

    def _step(self) -> None:
        """One engine step, and one message to each client with its own outputs."""
        outputs = (self.engine.step_deltas().outputs if self.engine.has_unfinished_requests()
                   else [])
        deltas: dict[int, list] = {index: [] for index in self.clients}
        for delta in outputs:  # (request_id, ..., finished, completions)
            client = self.owner.get(delta[0])
            if client in deltas:
                deltas[client].append(delta)
            if delta[5]:
                self.owner.pop(delta[0], None)
        refused: dict[int, list] = {index: [] for index in self.clients}
        for client, request_id, error in self.refused:
            if client in refused:
                refused[client].append((request_id, error))
        self.refused = []
        figures, counters = self.engine.figures(), self.engine.state.counters
        for index, conn in list(self.clients.items()):
            try:
                conn.send_bytes(dumps(("step", deltas[index], refused[index], figures,
                                       counters)))
            except OSError:  # the client's process died
                self._leave(index)
