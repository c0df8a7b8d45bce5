"""Traces: a run recorded as its events, replayable without a model or a GPU.

Format (JSON lines, versioned): a header ``{"format": "nanofn-trace", "version": 4,
"config": {...}, "num_blocks": n, "meta": {...}}``, then one line per step ``{"step": n,
"sampled": [...], "stop_hits": [...], "aborts": [...], "dirty": [...], "new": [{"id", "prompt",
"params"}], "plan": digest}`` (empty lists left out, except "sampled": present, even empty, on
every step that delivered the tokens of a plan). Since ``step`` is pure, the events alone
rebuild every state and plan; the digest of each step (``step_digest``: its plan and the
tokens it delivered) lets a replay prove it, so a token changed in a trace fails ``check``.

Version 4 added the delivered tokens to the digest and "dirty" (blocks a failed launch may
have written); version 3 traces are refused with a message saying so. Version 5 added a hybrid
model's recurrent-state slots: "num_state_slots" in the header and "dirty_states" (saved
states a failed launch may have written) in a step; a version 4 trace reads as one without
them.

``read_trace`` (and ``replay`` given a path) is the one place in ``nanofn/state`` that reads a
file: replaying a recorded run is what a user does in a Python session, and the reading stays
at the edge (the whole trace is parsed before the first step replays).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import xxhash

from nanofn.state.config import SchedulerConfig
from nanofn.state.engine_state import EngineState, initial_state
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, plan_digest
from nanofn.state.requests import NewSeq
from nanofn.state.step import Events, step

TRACE_FORMAT = "nanofn-trace"
TRACE_VERSION = 5
READABLE_VERSIONS = (4, 5)


class PathLike(Protocol):
    """A file's path (``pathlib.Path``, ``os.DirEntry``, ...), as ``open`` takes it."""

    def __fspath__(self) -> str: ...


class TraceError(ValueError):
    """A trace that cannot be read, or whose replay departs from what it recorded."""


@dataclass(frozen=True, slots=True)
class TracedStep:
    step: int
    events: Events
    digest: str  # step_digest of the recorded step
    line: int  # in the trace file


@dataclass(frozen=True, slots=True)
class Trace:
    config: SchedulerConfig
    num_blocks: int
    steps: tuple[TracedStep, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    num_state_slots: int | None = None  # a hybrid model's recurrent-state slots

    def initial_state(self) -> EngineState:
        return initial_state(self.config, self.num_blocks, self.num_state_slots)


def header_line(state: EngineState, meta: dict[str, Any] | None = None) -> str:
    """The header of a trace that starts from ``state`` (an initial state)."""
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION,
              "config": state.config.to_dict(), "num_blocks": state.pool.num_blocks}
    if state.states is not None:
        header["num_state_slots"] = state.states.num_slots
    return json.dumps({**header, "meta": meta or {}})


def step_line(events: Events, plan: BatchPlan) -> str:
    line: dict[str, Any] = {"step": plan.step}
    if events.sampled is not None:  # [] delivers the tokens of a plan that sampled nothing
        line["sampled"] = [int(t) for t in events.sampled]
    if events.stop_hits:
        line["stop_hits"] = list(events.stop_hits)
    if events.aborts:
        line["aborts"] = list(events.aborts)
    if events.dirty_blocks:
        line["dirty"] = [int(b) for b in events.dirty_blocks]
    if events.dirty_states:
        line["dirty_states"] = [int(slot) for slot in events.dirty_states]
    if events.new_seqs:
        line["new"] = [{"id": r.seq_id, "prompt": list(r.prompt_token_ids),
                        "params": r.params.to_dict()} for r in events.new_seqs]
    line["plan"] = step_digest(events, plan)
    return json.dumps(line)


def step_digest(events: Events, plan: BatchPlan) -> str:
    """The fingerprint of a step: its plan's (``plan_digest``) and the tokens it delivered,
    which async plans do not show (they carry ``PENDING_TOKEN``)."""
    h = xxhash.xxh64(plan_digest(plan).encode())
    if events.sampled is not None:
        h.update(b"|" + np.asarray(events.sampled, "<i8").tobytes())
    return h.hexdigest()


def parse_trace(lines: Iterable[str]) -> Trace:
    rows = (line for line in lines if line.strip())
    try:
        header = json.loads(next(rows))
    except StopIteration:
        raise TraceError("the trace is empty") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"line 1: not JSON ({e})") from None
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(f"line 1: not a {TRACE_FORMAT} header")
    version = header.get("version")
    if version not in READABLE_VERSIONS:
        older = isinstance(version, int) and version < TRACE_VERSION
        raise TraceError(f"trace version {version!r} is not supported: this nanofn reads "
                         f"versions {' and '.join(map(str, READABLE_VERSIONS))}" + (
                             "; the trace was written by an older nanofn, whose plans differ "
                             "from this one's (replay it with the nanofn that wrote it)"
                             if older else ""))
    try:
        config = SchedulerConfig.from_dict(header["config"])
        num_blocks, num_state_slots = header["num_blocks"], header.get("num_state_slots")
        initial_state(config, num_blocks, num_state_slots)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"line 1: the header's config is not usable ({type(e).__name__}: {e})") \
            from None
    steps = tuple(_parse_step(number, row) for number, row in enumerate(rows, start=2))
    return Trace(config, num_blocks, steps, header.get("meta", {}), num_state_slots)


def _parse_step(line_number: int, row: str) -> TracedStep:
    try:
        d = json.loads(row)
        if not isinstance(d, dict):
            raise TypeError(f"a step is a JSON object, not {type(d).__name__}")
        events = Events(
            sampled=_ints(d["sampled"], "sampled") if "sampled" in d else None,
            stop_hits=_strings(d.get("stop_hits", []), "stop_hits"),
            aborts=_strings(d.get("aborts", []), "aborts"),
            new_seqs=tuple(NewSeq(r["id"], _ints(r["prompt"], "prompt"),
                                  SamplingParams.from_dict(r["params"]))
                           for r in d.get("new", ())),
            dirty_blocks=_ints(d.get("dirty", []), "dirty"),
            dirty_states=_ints(d.get("dirty_states", []), "dirty_states"),
        )
        step_number, digest = d["step"], d["plan"]
        if not isinstance(step_number, int) or not isinstance(digest, str):
            raise TypeError("step must be an integer and plan a digest string")
        return TracedStep(step_number, events, digest, line_number)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TraceError(f"line {line_number}: {type(e).__name__}: {e}") from None


def _ints(values: Any, name: str) -> tuple[int, ...]:
    """A list of token or block ids (non-negative integers below 2**62)."""
    if not isinstance(values, list) or not all(
            type(v) is int and 0 <= v < 1 << 62 for v in values):
        raise ValueError(f"{name} must be a list of non-negative integers, got {values!r:.80}")
    return tuple(values)


def _strings(values: Any, name: str) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name} must be a list of strings, got {values!r:.80}")
    return tuple(values)


def read_trace(path: str | PathLike) -> Trace:
    """The trace in the file at ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f)
    except UnicodeDecodeError as e:
        raise TraceError(f"{path} is not a text file ({e})") from None


def replay(trace: Trace | str | PathLike,
           check: bool = False) -> Iterator[tuple[EngineState, BatchPlan]]:
    """Every ``(state, plan)`` of the recorded run, in order; ``trace`` is a parsed ``Trace``
    or the path of a trace file (read at once, so a missing or malformed file raises here).
    With ``check``, raise ``TraceError`` at the first plan whose digest differs from the
    recorded one."""
    if isinstance(trace, str) or hasattr(trace, "__fspath__"):
        trace = read_trace(trace)
    elif not isinstance(trace, Trace):
        raise TypeError(f"replay takes a Trace or the path of a trace file, not "
                        f"{type(trace).__name__}")
    return _replay(trace, check)


def _replay(trace: Trace, check: bool) -> Iterator[tuple[EngineState, BatchPlan]]:
    state = trace.initial_state()
    for traced in trace.steps:
        try:
            state, plan = step(state, traced.events)
        except ValueError as e:  # events the core refuses: a corrupted trace
            raise TraceError(f"line {traced.line}: the core refuses the step's events: {e}") \
                from None
        if plan.step != traced.step:
            raise TraceError(f"line {traced.line}: replay reached step {plan.step} where the "
                             f"trace has step {traced.step}")
        if check and step_digest(traced.events, plan) != traced.digest:
            raise TraceError(f"line {traced.line}: step {traced.step} replayed differs from the "
                             f"recorded one (its plan or its delivered tokens)")
        yield state, plan
