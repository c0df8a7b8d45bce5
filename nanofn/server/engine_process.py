"""The engine's own process, behind ``AsyncLLM``, and what it says to the server's process.

The server's Python (HTTP, JSON, middleware: ~70 µs per streamed chunk) would otherwise compete
with the engine's Python for one interpreter lock. Here the engine steps in a process of its
own and talks to the server over one pipe, in pickled messages (as vLLM's engine core does).

Server -> engine, read between steps: ``("add", request_id, prompt, params)``,
``("abort", request_id)``, ``("stop",)``.
Engine -> server: ``("ready", EngineFacts)`` once it is built (or ``("failed", error,
traceback)``), then one ``("step", outputs, refused, figures, counters)`` per step, and
``("failed", error, traceback)`` if a step raises.

An output travels as a delta (see ``encode``): the prompt once, and of each completion only
the tokens, text and logprobs it gained since the request's previous output; ``rebuild`` makes
the whole ``RequestOutput`` again on the server's side.

This module imports the engine (torch, transformers: seconds) only inside the engine process,
so that the server's process starts it before its own slow imports, which then overlap.
"""

from __future__ import annotations

import builtins
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from nanofn.engine.collector import fewer_gc_pauses
from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import CompletionOutput, RequestOutput
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
    ``ValueError`` or ``OSError`` stays one for the caller)."""
    try:
        pickle.loads(dumps((error,)))
        return error
    except Exception:
        base = next(c for c in type(error).__mro__ if getattr(builtins, c.__name__, None) is c)
        return base(str(error))


# --- the engine's process ----------------------------------------------------------------------

def run_engine_process(conn: Connection, options: EngineOptions,
                       environment: dict[str, str]) -> None:
    """The engine process's entry point: set ``environment`` (before CUDA starts: a replica's
    ``CUDA_VISIBLE_DEVICES``), build the engine, report it ready, serve commands until
    ``stop`` or until the server's end of the pipe closes (the server died)."""
    os.environ.update(environment)
    # Ctrl-C in a terminal reaches the whole process group; the server stops the engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from nanofn.engine.engine import Engine

        engine = Engine(options)
    except BaseException as error:
        _send_failure(conn, error)
        return
    try:
        conn.send_bytes(dumps(("ready", EngineFacts(engine.max_model_len,
                                                    engine.generation_defaults, engine.figures(),
                                                    engine.state.counters))))
        # On a thread: the engine loop defers Ctrl-C around launches on the main thread only,
        # and this process ignores Ctrl-C (the main thread just waits).
        serving = threading.Thread(target=_EngineServer(engine, conn).run, name="nanofn-engine")
        serving.start()
        serving.join()
    finally:
        engine.close()
        conn.close()


def _send_failure(conn: Connection, error: BaseException) -> None:
    try:
        conn.send_bytes(dumps(("failed", portable(error), traceback.format_exc())))
    except OSError:  # the server is gone
        pass


class _ServerGone(Exception):
    """The server's end of the pipe closed: it stopped without a ``stop``, or died."""


class _EngineServer:
    """Takes commands between steps, steps while there is work, sends each step's outputs."""

    def __init__(self, engine: Engine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.sent: dict[str, RequestOutput | None] = {}  # per live request, its last output
        self.refused: list[tuple[str, BaseException]] = []  # adds refused since the last send

    def run(self) -> None:
        try:
            with fewer_gc_pauses():  # as LLM.generate steps
                self._serve()
        except _ServerGone:
            pass
        except BaseException as error:  # a bug, or a dead tensor-parallel worker
            _send_failure(self.conn, error)

    def _serve(self) -> None:
        while self._take_commands(wait=not self.engine.has_unfinished_requests()):
            if self.engine.has_unfinished_requests() or self.refused:
                self._step()
        for request_id in list(self.sent):
            self.engine.abort_request(request_id)
        while self.engine.has_unfinished_requests():
            self._step()

    def _take_commands(self, wait: bool) -> bool:
        """Apply the commands that came (with ``wait``, block for one); False on ``stop``."""
        if not wait and not self._has_command():
            return True
        while True:
            try:
                command = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError) as error:
                raise _ServerGone from error
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self.engine.abort_request(command[1])
            if not self._has_command():
                return True

    def _has_command(self) -> bool:
        try:
            return self.conn.poll()
        except OSError as error:
            raise _ServerGone from error

    def _add(self, request_id: str, prompt: Any, params: Any) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except Exception as error:  # goes back to the caller that asked
            self.refused.append((request_id, portable(error)))
            return
        self.sent[request_id] = None

    def _step(self) -> None:
        """One engine step, and one message with its outputs."""
        outputs = self.engine.step().outputs if self.engine.has_unfinished_requests() else []
        deltas = []
        for output in outputs:
            deltas.append(encode(output, self.sent.get(output.request_id)))
            if output.finished:
                self.sent.pop(output.request_id, None)
            else:
                self.sent[output.request_id] = output
        refused, self.refused = self.refused, []
        message = dumps(("step", deltas, refused, self.engine.figures(),
                         self.engine.state.counters))
        try:
            self.conn.send_bytes(message)
        except OSError as error:
            raise _ServerGone from error


# --- outputs as deltas ---------------------------------------------------------------------------

def encode(output: RequestOutput, before: RequestOutput | None) -> tuple:
    """``output`` as what changed since ``before`` (the request's previous output, or None for
    its first): the prompt only the first time; its prompt logprobs the first and the last time
    (with n > 1 the first output may precede some of them); its metrics when they were
    replaced; per completion ``(kept, added)`` of its tokens, text and logprobs."""
    first = before is None
    completions = []
    for i, c in enumerate(output.outputs):
        b = None if first else before.outputs[i]
        completions.append((
            _tail([] if b is None else b.token_ids, c.token_ids),
            _tail("" if b is None else b.text, c.text),
            None if c.logprobs is None else _tail([] if b is None else b.logprobs, c.logprobs),
            c.cumulative_logprob, c.finish_reason, c.stop_reason))
    return (output.request_id,
            (output.prompt, output.prompt_token_ids) if first else None,
            output.prompt_logprobs if first or output.finished else None,
            output.metrics if first or output.metrics is not before.metrics else None,
            output.num_cached_tokens, output.finished, completions)


def rebuild(delta: tuple, before: RequestOutput | None) -> RequestOutput:
    """The whole output that ``encode`` made ``delta`` of, given the request's previous one.
    The prompt's lists are shared by a request's outputs; the rest is new in each."""
    request_id, prompt, prompt_logprobs, metrics, num_cached_tokens, finished, changes = delta
    if before is not None:
        prompt = before.prompt, before.prompt_token_ids
        prompt_logprobs = before.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        metrics = before.metrics if metrics is None else metrics
    completions = []
    for i, (tokens, text, logprobs, cumulative, finish_reason, stop_reason) in enumerate(changes):
        b = None if before is None else before.outputs[i]
        completions.append(CompletionOutput(
            i, _joined("" if b is None else b.text, text),
            _joined([] if b is None else b.token_ids, tokens), cumulative,
            None if logprobs is None else _joined([] if b is None else b.logprobs, logprobs),
            finish_reason, stop_reason))
    return RequestOutput(request_id, prompt[0], prompt[1], completions, finished,
                         prompt_logprobs=prompt_logprobs, metrics=metrics,
                         num_cached_tokens=num_cached_tokens)


def _tail(before: Any, now: Any) -> tuple[int, Any]:
    """(how much of ``before`` starts ``now``: all of it or nothing, what follows it)."""
    kept = len(before)
    if now[:kept] != before:
        kept = 0
    return kept, now[kept:]


def _joined(before: Any, change: tuple[int, Any]) -> Any:
    kept, added = change
    return (before if kept == len(before) else before[:kept]) + added
