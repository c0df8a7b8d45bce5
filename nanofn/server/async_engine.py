"""``AsyncLLM``: the engine in a process of its own, for asyncio callers (the server).

The engine process (``engine_process``) takes the callers' commands (add a request, abort one)
between steps, steps while there is work, and sends one message per step. Here a reader thread
waits on the pipe (the wait releases the interpreter lock, so the HTTP side runs meanwhile) and
hands each request's outputs to the event loop of the caller that asked for it. A caller never
waits for a step and the engine never waits for a caller: outputs go to a slot per request that
holds the newest one.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
import pickle
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import RequestOutput, apply_delta
from nanofn.server.engine_process import EngineFacts, dumps, run_engine_process
from nanofn.state import Counters, Figures, InvalidRequest, SamplingParams


@dataclass(frozen=True)
class ReplicaView:
    """What the metrics and /health read of one engine (a data-parallel replica)."""

    figures: Figures
    counters: Counters
    failure: BaseException | None

if TYPE_CHECKING:
    from nanofn.engine.engine import PromptInput

STOP_TIMEOUT_S = 30.0  # for the engine process to abort its requests and free the device


@dataclass
class _Stream:
    """Where a request's outputs go, on its caller's event loop: only the latest is kept. An
    output holds everything so far, so a caller that falls behind the engine skips to the newest
    one instead of working through a backlog (as vLLM's output collector merges them)."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event
    latest: RequestOutput | BaseException | None = None
    last: RequestOutput | None = None  # the reader thread's newest, the base of the next delta


class EngineDead(RuntimeError):
    """The engine process stopped on an error (or was closed); every request after it fails
    with this."""


class RemoteTraceback(Exception):
    """The traceback of an error raised in the engine process (shown as its cause)."""

    def __str__(self) -> str:
        return f"\n\n{self.args[0]}"


class AsyncLLM:
    """``environment``: variables to set in the engine process before the engine starts (a
    data-parallel replica's ``CUDA_VISIBLE_DEVICES``). ``AsyncLLM.attach`` makes one on a pipe
    of an engine process started elsewhere (``start_engine_process``: an HTTP process of
    ``serve --api-server-count N``)."""

    def __init__(self, model: str, environment: Mapping[str, str] | None = None,
                 **options: Any):
        engine_options = EngineOptions.from_kwargs(model, **options)
        process, (conn,) = start_engine_process(engine_options, environment or {}, 1)
        try:
            # The same tokenizer, for the server (tokenize, chat templates, echo), loaded while
            # the engine process starts (imported here: torch and transformers take seconds).
            from nanofn.engine.engine import load_tokenizer

            tokenizer = load_tokenizer(engine_options)
            facts = wait_until_ready(process, conn)
        except BaseException:
            process.terminate()
            process.join()
            conn.close()
            raise
        self._process: multiprocessing.process.BaseProcess | None = process
        self._serve(conn, facts, tokenizer, process.pid, "")

    @classmethod
    def attach(cls, conn: Connection, facts: EngineFacts, tokenizer: Any, engine_pid: int,
               id_prefix: str) -> AsyncLLM:
        """A client of an engine process that another process started and keeps: ``conn`` is
        this client's pipe, whose ``ready`` message gave ``facts``; the requests' default ids
        start with ``id_prefix`` (unique among the engine's clients). ``close`` leaves the
        engine; it stops once its last client has left."""
        llm = cls.__new__(cls)
        llm._process = None
        llm._serve(conn, facts, tokenizer, engine_pid, id_prefix)
        return llm

    def _serve(self, conn: Connection, facts: EngineFacts, tokenizer: Any, engine_pid: int,
               id_prefix: str) -> None:
        self._conn, self.tokenizer, self._engine_pid = conn, tokenizer, engine_pid
        self.max_model_len = facts.max_model_len
        self.generation_defaults = facts.generation_defaults
        self._figures, self._counters = facts.figures, facts.counters
        self._lock = threading.Lock()  # sends on the pipe; the streams against the end
        self._streams: dict[str, _Stream] = {}
        self._id_prefix, self._ids = id_prefix, itertools.count()
        self._closing = False
        self._ended = False  # the engine process is gone
        self.failure: BaseException | None = None
        atexit.register(self.close)  # before multiprocessing's exit hook waits for the process
        self._reader = threading.Thread(target=self._read, name="nanofn-engine-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def engine_pid(self) -> int:
        """The engine process's id (for logs and tests)."""
        return self._engine_pid

    def figures(self) -> Figures:
        """From the engine's state after its latest step (an immutable record)."""
        return self._figures

    def counters(self) -> Counters:
        """The core's running totals after the engine's latest step."""
        return self._counters

    def views(self) -> list[ReplicaView]:
        """The one engine, as the metrics and /health read a data-parallel server's replicas."""
        return [ReplicaView(self._figures, self._counters, self.failure)]

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it advances (each holds everything so far), the last one
        finished. Raises the engine's ``InvalidRequest`` if it cannot be served, ``EngineDead``
        once the engine has stopped. Leaving the iteration early (a client gone) aborts the
        request."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Event())
        if request_id is None:
            request_id = f"req-{self._id_prefix}{next(self._ids)}"
        self._add(request_id, stream, dumps(("add", request_id, prompt, params)))
        finished = False
        try:
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                output, stream.latest = stream.latest, None
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished and self._streams.get(request_id) is stream:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step (unknown or finished ids are ignored)."""
        with self._lock:
            self._send_quietly(dumps(("abort", request_id)))

    def abort_all(self, error: Callable[[], BaseException]) -> None:
        """Abort every request in flight: each one's ``generate`` raises an ``error()`` of its
        own (the server's shutdown, once its requests have had their time)."""
        with self._lock:
            streams = list(self._streams.items())
            self._streams.clear()
            for request_id, _ in streams:
                self._send_quietly(dumps(("abort", request_id)))
        for _, stream in streams:
            _call_in(stream.loop, _deliver, [(stream, error())])

    def close(self) -> None:
        """Stop the engine process (requests in flight are aborted) and wait until it has
        freed the engine; attached (``attach``), leave it (this client's requests aborted)."""
        atexit.unregister(self.close)
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._send_quietly(dumps(("stop",)))
        if self._process is not None:
            join_engine_process(self._process)
        self._reader.join(timeout=STOP_TIMEOUT_S)  # the engine closes this client's pipe
        self._conn.close()

    # --- the caller's side ----------------------------------------------------------------

    def _add(self, request_id: str, stream: _Stream, command: bytes) -> None:
        with self._lock:
            if self._ended or self._closing:
                raise EngineDead(f"the engine stopped: {self.failure!r}" if self.failure
                                 else "the engine is closed")
            if request_id in self._streams:
                raise InvalidRequest(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            try:
                self._conn.send_bytes(command)
            except OSError as error:
                del self._streams[request_id]
                raise EngineDead(f"the engine process is gone: {error!r}") from None

    def _send_quietly(self, command: bytes) -> None:
        """Send a command that has nothing left to do once the engine is gone."""
        try:
            self._conn.send_bytes(command)
        except OSError:
            pass

    # --- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        error = self._take_messages()
        with self._lock:
            self._ended = True
            if not self._closing:
                self.failure = error
            streams = list(self._streams.values())
            self._streams.clear()
        why = f"the engine stopped: {error!r}" if error else "the engine is closed"
        for stream in streams:
            _call_in(stream.loop, _deliver, [(stream, EngineDead(why))])

    def _take_messages(self) -> BaseException | None:
        """Take the engine's steps until it ends; what ended it (None: closed)."""
        try:
            while True:
                message = pickle.loads(self._conn.recv_bytes())
                if message[0] == "failed":
                    error = message[1]
                    error.__cause__ = RemoteTraceback(message[2])
                    return error
                self._take_step(*message[1:])
        except (EOFError, OSError):
            if self._closing:
                return None
            if self._process is None:  # another process's child: its exit code is not ours
                return RuntimeError(f"the engine process (pid {self._engine_pid}) exited")
            self._process.join(timeout=1)
            return RuntimeError(f"the engine process exited (exit code "
                                f"{self._process.exitcode})")
        except BaseException as error:  # a bug here: fail the requests rather than hang them
            return error

    def _take_step(self, deltas: list, refused: list, figures: Figures,
                   counters: Counters) -> None:
        """One step's outputs to their callers' loops, in one call per loop (a wake-up of a
        loop is a system call: one per step, not one per request)."""
        self._figures, self._counters = figures, counters
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for delta in deltas:
            stream = self._streams.get(delta[0])  # its request id
            if stream is None:
                continue
            output = stream.last = apply_delta(delta, stream.last)
            if output.finished:
                self._streams.pop(delta[0], None)
            batches.setdefault(stream.loop, []).append((stream, output))
        for request_id, error in refused:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, error))
        for loop, batch in batches.items():
            _call_in(loop, _deliver, batch)


def start_engine_process(options: EngineOptions, environment: Mapping[str, str],
                         clients: int) -> tuple[multiprocessing.process.BaseProcess,
                                                list[Connection]]:
    """Start an engine process (``engine_process.run_engine_process``) with a pipe for each of
    ``clients`` clients: (the process, this side's end of each pipe)."""
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(clients)]
    # Not a daemon: it starts tensor-parallel workers of its own. Its clients stop it, and it
    # stops by itself when their ends of the pipes close.
    process = context.Process(target=run_engine_process, name="nanofn-engine",
                              args=([theirs for _, theirs in pipes], options, dict(environment)))
    process.start()
    for _, theirs in pipes:
        theirs.close()
    return process, [ours for ours, _ in pipes]


def join_engine_process(process: multiprocessing.process.BaseProcess) -> None:
    """Wait for an engine process told to stop (or left by its last client); kill it if it
    has not ended within ``STOP_TIMEOUT_S``."""
    process.join(timeout=STOP_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


def wait_until_ready(process: multiprocessing.process.BaseProcess,
                     conn: Connection) -> EngineFacts:
    """The engine's facts once it is built, from one client's pipe; raises what building it
    raised."""
    try:
        message = pickle.loads(conn.recv_bytes())
    except EOFError:
        process.join()
        raise RuntimeError(f"the engine process exited while starting (exit code "
                           f"{process.exitcode})") from None
    if message[0] == "failed":
        raise message[1] from RemoteTraceback(message[2])
    return message[1]


def _call_in(loop: asyncio.AbstractEventLoop, function, *args) -> None:
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the caller's loop has closed
        pass


def _deliver(batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """On the caller's loop: each stream's newest output replaces one not yet taken, but not
    an error (an output of the step that raced it is no longer news)."""
    for stream, item in batch:
        if not isinstance(stream.latest, BaseException):
            stream.latest = item
        stream.ready.set()
