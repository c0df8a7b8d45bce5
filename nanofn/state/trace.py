"""Traces: a run recorded as its events, replayable without a model or a GPU.

Format (JSON lines, versioned): a header ``{"format": "nanofn-trace", "version": 3,
"config": {...}, "num_blocks": n, "meta": {...}}``, then one line per step ``{"step": n, "sampled": [...],
"stop_hits": [...], "aborts": [...], "new": [{"id", "prompt", "params"}], "plan": digest}``
(empty lists left out, except "sampled": present, even empty, on every step that delivered
the tokens of a plan). Since ``step`` is pure, the events alone rebuild every state and plan;
the digest of each recorded plan lets a replay prove it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nanofn.state.config import SchedulerConfig
from nanofn.state.engine_state import EngineState, initial_state
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, plan_digest
from nanofn.state.requests import NewSeq
from nanofn.state.step import Events, step

TRACE_FORMAT = "nanofn-trace"
TRACE_VERSION = 3


class TraceError(ValueError):
    """A trace that cannot be read, or whose replay departs from what it recorded."""


@dataclass(frozen=True, slots=True)
class TracedStep:
    step: int
    events: Events
    plan_digest: str


@dataclass(frozen=True, slots=True)
class Trace:
    config: SchedulerConfig
    num_blocks: int
    steps: tuple[TracedStep, ...]
    meta: dict[str, Any] = field(default_factory=dict)


def header_line(state: EngineState, meta: dict[str, Any] | None = None) -> str:
    """The header of a trace that starts from ``state`` (an initial state)."""
    return json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION,
                       "config": state.config.to_dict(), "num_blocks": state.pool.num_blocks,
                       "meta": meta or {}})


def step_line(events: Events, plan: BatchPlan) -> str:
    line: dict[str, Any] = {"step": plan.step}
    if events.sampled is not None:  # [] delivers the tokens of a plan that sampled nothing
        line["sampled"] = [int(t) for t in events.sampled]
    if events.stop_hits:
        line["stop_hits"] = list(events.stop_hits)
    if events.aborts:
        line["aborts"] = list(events.aborts)
    if events.new_seqs:
        line["new"] = [{"id": r.seq_id, "prompt": list(r.prompt_token_ids),
                        "params": r.params.to_dict()} for r in events.new_seqs]
    line["plan"] = plan_digest(plan)
    return json.dumps(line)


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
    if version != TRACE_VERSION:
        older = isinstance(version, int) and version < TRACE_VERSION
        raise TraceError(f"trace version {version!r} is not supported: this nanofn reads "
                         f"version {TRACE_VERSION}" + (
                             "; the trace was written by an older nanofn, whose plans differ "
                             "from this one's (replay it with the nanofn that wrote it)"
                             if older else ""))
    try:
        config = SchedulerConfig.from_dict(header["config"])
        num_blocks = header["num_blocks"]
        initial_state(config, num_blocks)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"line 1: the header's config is not usable ({type(e).__name__}: {e})") \
            from None
    steps = tuple(_parse_step(number, row) for number, row in enumerate(rows, start=2))
    return Trace(config, num_blocks, steps, header.get("meta", {}))


def _parse_step(line_number: int, row: str) -> TracedStep:
    try:
        d = json.loads(row)
        events = Events(
            sampled=tuple(d["sampled"]) if "sampled" in d else None,
            stop_hits=tuple(d.get("stop_hits", ())),
            aborts=tuple(d.get("aborts", ())),
            new_seqs=tuple(NewSeq(r["id"], tuple(r["prompt"]),
                                  SamplingParams.from_dict(r["params"]))
                           for r in d.get("new", ())),
        )
        return TracedStep(d["step"], events, d["plan"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise TraceError(f"line {line_number}: {type(e).__name__}: {e}") from None


def replay(trace: Trace, check: bool = False) -> Iterator[tuple[EngineState, BatchPlan]]:
    """Every ``(state, plan)`` of the recorded run, in order. With ``check``, raise
    ``TraceError`` at the first plan whose digest differs from the recorded one."""
    state = initial_state(trace.config, trace.num_blocks)
    for traced in trace.steps:
        state, plan = step(state, traced.events)
        if plan.step != traced.step:
            raise TraceError(f"replay reached step {plan.step} where the trace has step "
                             f"{traced.step}")
        if check and plan_digest(plan) != traced.plan_digest:
            raise TraceError(f"step {traced.step}: the replayed plan differs from the recorded "
                             f"one ({plan_digest(plan)} != {traced.plan_digest})")
        yield state, plan
