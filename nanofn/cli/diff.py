"""``nanofn diff A B``: the first step at which two traces differ, and both states there.

The comparison itself is pure (``nanofn.state.trace_diff``); this module words it: the
settings that differ, what each plan did differently at the first differing step (which
sequence, its positions, blocks and tokens), the tokens delivered differently, and the two
states right after that step side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanofn.cli import _scheduled, _short
from nanofn.state import EngineState, Seq
from nanofn.state.plan import PENDING_TOKEN, ScheduledSeq
from nanofn.state.trace_diff import StepDifference, TraceDiff

MAX_COLUMN = 48  # a wider A value pushes its B value along rather than widening every row
EVENT_NAMES = {"sampled": "delivered tokens", "new_seqs": "new requests", "aborts": "aborts",
               "stop_hits": "stop-string hits", "dirty_blocks": "dirty blocks",
               "dirty_states": "dirty state slots"}


def describe_diff(diff: TraceDiff, num_steps: int) -> list[str]:
    """The report's lines; ``num_steps`` is trace A's length."""
    if diff.identical:
        return [f"identical: the same settings and the same {num_steps} steps (plans and "
                f"delivered tokens)"]
    lines = []
    if diff.header:
        lines.append("settings differ:")
        lines += [f"  {name}: {a} in A, {b} in B" for name, a, b in diff.header]
    if diff.step is None:
        lines.append(f"the {num_steps} steps are the same (plans and delivered tokens)")
    else:
        lines += _describe_step(diff.step)
    return lines


def _describe_step(d: StepDifference) -> list[str]:
    if d.a is None or d.b is None:
        ended, going = ("A", d.b) if d.a is None else ("B", d.a)
        other = "B" if ended == "A" else "A"
        return [f"first difference at step {d.step}: trace {ended} has ended; trace {other} "
                f"goes on (line {going.traced.line}) with "
                f"{len(going.plan.seq_ids)} seqs: "
                + " ".join(_scheduled(s) for s in going.plan.entries())]
    lines = [f"first difference at step {d.step} (line {d.a.traced.line} of A, line "
             f"{d.b.traced.line} of B):"]
    plan_changes = d.plan_changes()
    if plan_changes:
        lines.append("  plans:")
        lines += _columns([(f"seq {seq_id}", _entry(a), _entry(b))
                           for seq_id, a, b in plan_changes], indent=4)
    if d.a.state.preempted != d.b.state.preempted:
        lines += _columns([("preempted", " ".join(d.a.state.preempted) or "none",
                            " ".join(d.b.state.preempted) or "none")], indent=2)
    for name, a, b in d.event_changes():
        lines.append(f"  {EVENT_NAMES[name]}:")
        lines += _columns(_event_rows(name, a, b), indent=4)
    lines.append(f"state after step {d.step}, side by side (* where A and B differ):")
    lines += _state_rows(d.a.state, d.b.state, {seq_id for seq_id, _, _ in plan_changes})
    return lines


def _entry(s: ScheduledSeq | None) -> str:
    if s is None:
        return "not scheduled"
    tokens = ["pending" if t == PENDING_TOKEN else t for t in s.token_ids]
    blocks = " new blocks " + _short([f"{col}:{block}" for col, block in s.new_blocks]) \
        if s.new_blocks else ""
    return f"{_scheduled(s)} tokens {_short(tokens)}{blocks}"


def _event_rows(name: str, a: Any, b: Any) -> list[tuple[str, str, str]]:
    if name == "sampled" and a is not None and b is not None:
        return [(f"seq {seq_id}", str(a.get(seq_id, "-")), str(b.get(seq_id, "-")))
                for seq_id in {**a, **b} if a.get(seq_id) != b.get(seq_id)]
    if name == "new_seqs":
        a, b = ([f"{r.seq_id} ({len(r.prompt_token_ids)} prompt tokens)" for r in v]
                for v in (a, b))
    return [("", _short(list(a)) if a is not None else "none",
             _short(list(b)) if b is not None else "none")]


def _state_rows(a: EngineState, b: EngineState, named: set[str]) -> list[str]:
    """The sequences that differ or are ``named`` (scheduled differently), then the pools."""
    seqs_a, seqs_b = _seqs(a), _seqs(b)
    shown = [seq_id for seq_id in {**seqs_a, **seqs_b}
             if seq_id in named or _seq_rows(seqs_a.get(seq_id), seqs_b.get(seq_id), True)]
    rows = [row for seq_id in shown for row in _titled(
        f"seq {seq_id}", _seq_rows(seqs_a.get(seq_id), seqs_b.get(seq_id), False))]
    rows += _titled("block pool", _pool_rows(a, b))
    if a.states is not None or b.states is not None:
        rows += _titled("state slots", _state_slot_rows(a, b))
    lines = _columns(rows, indent=2, heading=True)
    same = len({**seqs_a, **seqs_b}) - len(shown)
    if same:
        lines.append(f"  ({same} other live or just finished sequences are the same in both)")
    return lines


def _titled(title: str, rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Rows whose labels are indented under ``title``, which heads the first."""
    return [(f"{title if i == 0 else '':<12}{label}", a, b)
            for i, (label, a, b) in enumerate(rows)]


def _seqs(state: EngineState) -> dict[str, Seq]:
    return {seq.seq_id: seq for seq in (*state.running, *state.waiting, *state.finished)}


def _seq_rows(a: Seq | None, b: Seq | None, only_differing: bool) -> list[tuple[str, str, str]]:
    fields = [("status", _status), ("tokens", _counts), ("computed", lambda s: s.num_computed),
              ("blocks", lambda s: _short(s.block_table)),
              ("preemptions", lambda s: s.num_preemptions)]
    if any(s is not None and s.state_slot >= 0 for s in (a, b)):  # a hybrid model's
        fields.append(("state slot", lambda s: s.state_slot))
    rows = [(label, "absent" if a is None else str(show(a)),
             "absent" if b is None else str(show(b))) for label, show in fields]
    if a is not None and b is not None:
        rows.append(_token_row(a.token_ids, b.token_ids))
    return [row for row in rows if row[1] != row[2]] if only_differing else rows


def _status(seq: Seq) -> str:
    return seq.status.value + (f" ({seq.finish_reason.value})" if seq.finish_reason else "")


def _counts(seq: Seq) -> str:
    pending = f" + {seq.num_pending} pending" if seq.num_pending else ""
    return (f"{seq.num_tokens} ({seq.num_prompt_tokens} prompt + {seq.num_output_tokens} "
            f"output){pending}")


def _token_row(a: Sequence[int], b: Sequence[int]) -> tuple[str, str, str]:
    """The token ids from the first position where they differ (all the same: their count)."""
    if a == b:
        return "token ids", f"the same {len(a)}", f"the same {len(b)}"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token ids from {first}", _short(a[first:]), _short(b[first:])


def _state_slot_rows(a: EngineState, b: EngineState) -> list[tuple[str, str, str]]:
    def slots(state: EngineState) -> str:
        states = state.states
        if states is None:
            return "none"
        return f"{states.num_working} working, {states.num_saved} saved, {states.num_free} free"

    def saved(state: EngineState) -> str:
        if state.states is None:
            return "none"
        return _short([f"{entry.slot}:{entry.num_tokens}"
                       for _, entry in state.states.saved_by_age()])

    return [("slots", slots(a), slots(b)), ("saved (slot:tokens)", saved(a), saved(b))]


def _pool_rows(a: EngineState, b: EngineState) -> list[tuple[str, str, str]]:
    def owned(state: EngineState) -> str:
        pool = state.pool
        return (f"{pool.num_used} owned, {pool.num_cached_free} cached, "
                f"{pool.num_plain_free} free")

    return [("blocks", owned(a), owned(b)),
            ("prefix cache entries", str(len(a.pool.by_hash)), str(len(b.pool.by_hash))),
            ("preemptions so far", str(a.counters.num_preemptions),
             str(b.counters.num_preemptions)),
            ("cached prompt tokens", str(a.counters.num_cached_tokens),
             str(b.counters.num_cached_tokens))]


def _columns(rows: list[tuple[str, str, str]], indent: int, heading: bool = False) -> list[str]:
    """``label  A  B`` rows aligned in columns, each marked ``*`` when A and B differ; with
    ``heading``, under an ``A  B`` line."""
    labels = max((len(label) for label, _, _ in rows), default=0)
    width = min(MAX_COLUMN, max((len(a) for _, a, _ in rows), default=0))
    lines = [f"{' ' * indent} {'':<{labels}}  {'A':<{width}}  B"] if heading else []
    for label, a, b in rows:
        mark = "*" if a != b else " "
        lines.append(f"{' ' * indent}{mark}{label:<{labels}}  {a:<{width}}  {b}")
    return lines
