"""``AsyncLLM``: the engine on a thread of its own, for asyncio callers (the server).

The engine thread owns the ``Engine``: it takes the callers' commands (add a request, abort
one) from a queue between steps, steps while there is work, and hands each request's outputs
to the event loop of the caller that asked for it. A caller never waits for a step and the
engine never waits for a caller: outputs go to a slot per request that holds the newest one.
The pure core is unchanged: arrivals and cancellations become its ``Events`` through the engine, as in ``LLM``.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nanofn.engine.engine import Engine, PromptInput
from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import RequestOutput
from nanofn.engine.collector import fewer_gc_pauses
from nanofn.state import Figures, SamplingParams


@dataclass
class _Stream:
    """Where a request's outputs go, on its caller's event loop: only the latest is kept. An
    output holds everything so far, so a caller that falls behind the engine skips to the newest
    one instead of working through a backlog (as vLLM's output collector merges them)."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event
    latest: RequestOutput | BaseException | None = None


class EngineDead(RuntimeError):
    """The engine thread stopped on an error; every request after it fails with this."""


class AsyncLLM:
    def __init__(self, model: str, **options: Any):
        self.engine = Engine(EngineOptions.from_kwargs(model, **options))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._ids = itertools.count()
        self._stopping = False
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nanofn-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def figures(self) -> Figures:
        """From the engine's latest state: an immutable record, so any thread may read it."""
        return self.engine.figures()

    async def generate(self, prompt: PromptInput, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it advances (each holds everything so far), the last one
        finished. Raises the engine's ``InvalidRequest`` if it cannot be served. Leaving the
        iteration early (a client gone) aborts the request."""
        if self.failure is not None:
            raise EngineDead(f"the engine stopped: {self.failure!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Event())
        accepted: asyncio.Future = loop.create_future()
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        self._commands.put(("add", request_id, prompt, params, stream, accepted))
        await accepted  # raises what add_request raised
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
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step (unknown or finished ids are ignored)."""
        self._commands.put(("abort", request_id))

    def close(self) -> None:
        """Stop the engine thread (requests in flight are aborted) and free the engine."""
        self._stopping = True
        self._commands.put(("wake",))
        self._thread.join(timeout=30)
        self.engine.close()

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with fewer_gc_pauses():  # as LLM.generate steps (the process's collector setting)
                self._serve()
        except BaseException as error:  # a bug, or a dead tensor-parallel worker
            self.failure = error
            for stream in list(self._streams.values()):
                _send(stream, EngineDead(f"the engine stopped: {error!r}"))
            self._streams.clear()

    def _serve(self) -> None:
        while not self._stopping:
            self._take_commands(wait=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self._step()
        self._abort_all()

    def _take_commands(self, wait: bool) -> None:
        """Apply the queued commands; with ``wait``, block until there is one."""
        try:
            command = self._commands.get(timeout=None) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, stream, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except Exception as error:
                stream.loop.call_soon_threadsafe(_settle, accepted, error)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_settle, accepted, None)
        elif kind == "abort":
            self.engine.abort_request(command[1])

    def _step(self) -> None:
        """One engine step; its outputs reach each event loop in one call (a wake-up of the
        loop is a system call: one per step, not one per request)."""
        result = self.engine.step()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in result.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches.setdefault(stream.loop, []).append((stream, output))
        for loop, batch in batches.items():
            _call_in(loop, _deliver, batch)

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self._step()


def _send(stream: _Stream, item: RequestOutput | BaseException) -> None:
    _call_in(stream.loop, _deliver, [(stream, item)])


def _call_in(loop: asyncio.AbstractEventLoop, function, *args) -> None:
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the caller's loop has closed
        pass


def _deliver(batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """On the caller's loop: each stream's newest output replaces one not yet taken."""
    for stream, item in batch:
        stream.latest = item
        stream.ready.set()


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
