"""The batch plan, the plain picklable data a runner needs to execute one step, and the
runner's answer: the tokens it sampled.

A plan is columns over the sequences it schedules plus what changed since the last plan: the
new entries of block tables, the sequences that start running (with their sampling
parameters), the token ids some sequences may not sample. A runner keeps per-sequence state
under each sequence's *slot*: block tables by appends, sampling parameters from the plan that
starts it, and the token it sampled last, which a later plan's ``PENDING_TOKEN`` stands for. A
decode step's plan is thus a few arrays of one entry per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress

import numpy as np
import xxhash

from nanofn.state.params import SamplingParams

PENDING_TOKEN = -1  # a token the previous plan sampled, not known to the scheduler yet


@dataclass(frozen=True, slots=True)
class SeqStart:
    """A sequence that starts running with this plan (new, or resumed after preemption): its
    slot's earlier contents are void; its block table is given whole from column 0. A hybrid
    model's sequence works in recurrent-state slot ``state_slot`` (-1: none), which holds its
    state after its first ``start_pos`` tokens (zeros at position 0: see ``state_restores``)."""

    slot: int
    seq_id: str
    params: SamplingParams
    num_prompt_tokens: int
    state_slot: int = -1


def _frozen(a: np.ndarray) -> np.ndarray:
    if a.flags.writeable:  # (shared constant arrays are read-only already)
        a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True, eq=False)
class BatchPlan:
    """What one step computes, per scheduled sequence ``i`` (plan order): the KV of
    ``num_scheduled[i]`` tokens at positions ``start_pos[i], start_pos[i] + 1, ...`` (their ids
    laid end to end in ``token_ids``); if ``sample[i]``, the last of them is the sequence's last
    token and the next token is sampled from its logits, never one of ``banned``'s ids for it
    (``(plan index, token ids)`` pairs).

    ``block_entries`` are ``(plan index, column, block)`` rows: the block-table entries new
    since the last plan (whole tables for the sequences of ``started``). ``histories`` give,
    for the sampling sequences whose penalties need them, ``(plan index, all token ids)``;
    such a sequence is never scheduled with a pending token. ``prompt_logprobs`` asks, per
    ``(plan index, top k, target ids)``, for the logprobs of the prompt tokens that follow
    the sequence's first ``len(target ids)`` scheduled positions.

    A hybrid model's recurrent states (``state_pool.py``): before the step's work, each
    ``state_restores`` pair ``(saved slot, working slot)`` copies a saved state into the working
    slot of a sequence that starts from it; after the work, each ``state_saves`` pair
    ``(plan index, slot)`` copies that sequence's working state, now after its last scheduled
    position, into the slot. A sequence scheduled from position 0 starts from a zero state.
    No slot is the target of two restores or of two saves (each side is one indexed copy).
    """

    step: int
    seq_ids: tuple[str, ...]
    slots: np.ndarray  # [S] int64
    start_pos: np.ndarray  # [S] int64
    num_scheduled: np.ndarray  # [S] int64
    sample: np.ndarray  # [S] bool
    token_ids: np.ndarray  # [sum(num_scheduled)] int64, PENDING_TOKEN where pending
    block_entries: np.ndarray  # [U, 3] int64
    num_decode_tokens: int  # sequences past their prompt computing one token
    started: tuple[SeqStart, ...] = ()
    banned: tuple[tuple[int, tuple[int, ...]], ...] = ()
    histories: tuple[tuple[int, tuple[int, ...]], ...] = ()
    prompt_logprobs: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    state_restores: tuple[tuple[int, int], ...] = ()
    state_saves: tuple[tuple[int, int], ...] = ()
    # Derived once, when the plan is made (several readers need them each step).
    num_tokens: int = field(init=False)
    sampling_seq_ids: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("slots", "start_pos", "num_scheduled", "sample", "token_ids",
                     "block_entries"):
            _frozen(getattr(self, name))
        all_sample = np.count_nonzero(self.sample) == len(self.sample)
        object.__setattr__(self, "num_tokens", len(self.token_ids))
        object.__setattr__(self, "sampling_seq_ids", self.seq_ids if all_sample else
                           tuple(compress(self.seq_ids, self.sample.tolist())))

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def context_lens(self) -> np.ndarray:
        """Tokens in each sequence's cache once this step has run."""
        return self.start_pos + self.num_scheduled

    @property
    def seqs(self) -> tuple[ScheduledSeq, ...]:
        return self.entries()

    def entries(self) -> tuple[ScheduledSeq, ...]:
        """The plan, one record per scheduled sequence (for display and tests; built on each
        call)."""
        ends = np.cumsum(self.num_scheduled).tolist()
        banned = dict(self.banned)
        blocks: dict[int, list[tuple[int, int]]] = {}
        for i, col, block in self.block_entries.tolist():
            blocks.setdefault(i, []).append((col, block))
        return tuple(
            ScheduledSeq(seq_id, int(self.slots[i]), tuple(self.token_ids[end - n:end].tolist()),
                         int(self.start_pos[i]), bool(self.sample[i]),
                         tuple(blocks.get(i, ())), banned.get(i, ()))
            for i, (seq_id, n, end) in enumerate(zip(self.seq_ids, self.num_scheduled.tolist(),
                                                      ends)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchPlan) and plan_digest(self) == plan_digest(other) \
            and self.seq_ids == other.seq_ids

    def __hash__(self) -> int:
        return hash(plan_digest(self))

    def __repr__(self) -> str:
        return f"BatchPlan(step={self.step}, seqs={self.entries()!r}, started={self.started!r})"


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a plan, as a record: ``token_ids`` at positions ``start_pos``
    on, into slot ``slot``; ``new_blocks`` are ``(column, block)`` entries its block table
    gains."""

    seq_id: str
    slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool
    new_blocks: tuple[tuple[int, int], ...] = ()
    banned_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


def plan_of(step: int, seqs: Sequence[ScheduledSeq], started: Sequence[SeqStart] = ()) -> BatchPlan:
    """A plan from per-sequence records (tests, and runners measuring memory); a single token
    of a sequence not starting now counts as decode."""
    entries = [(i, col, block) for i, s in enumerate(seqs) for col, block in s.new_blocks]
    starting = {s.slot for s in started}
    return BatchPlan(
        step=step,
        seq_ids=tuple(s.seq_id for s in seqs),
        slots=np.array([s.slot for s in seqs], np.int64),
        start_pos=np.array([s.start_pos for s in seqs], np.int64),
        num_scheduled=np.array([s.num_tokens for s in seqs], np.int64),
        sample=np.array([s.sample for s in seqs], bool),
        token_ids=np.array([t for s in seqs for t in s.token_ids], np.int64),
        block_entries=np.array(entries, np.int64).reshape(-1, 3),
        num_decode_tokens=sum(s.num_tokens == 1 and s.slot not in starting for s in seqs),
        started=tuple(started),
        banned=tuple((i, s.banned_token_ids) for i, s in enumerate(seqs) if s.banned_token_ids),
    )


def empty_plan(step: int) -> BatchPlan:
    return BatchPlan(step, (), _NONE, _NONE, _NONE, _NO_SAMPLES, _NONE, _NO_ENTRIES, 0)


# An empty plan's arrays, shared (read-only) by every empty plan.
_NONE, _NO_SAMPLES, _NO_ENTRIES = (_frozen(np.zeros(shape, dtype)) for shape, dtype in
                                   ((0, np.int64), (0, bool), ((0, 3), np.int64)))


def plan_digest(plan: BatchPlan) -> str:
    """A short fingerprint of everything in a plan that decides what the runner computes."""
    h = xxhash.xxh64()
    h.update(f"{plan.step}|{plan.seq_ids}|".encode())
    for a in (plan.slots, plan.start_pos, plan.num_scheduled, plan.sample, plan.token_ids,
              plan.block_entries):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr([(s.slot, s.seq_id, s.num_prompt_tokens) for s in plan.started]).encode())
    h.update(repr((plan.banned, plan.histories)).encode())
    # (What older traces' plans lack is hashed only where present: their digests stay.)
    if plan.prompt_logprobs:
        h.update(repr(plan.prompt_logprobs).encode())
    if any(s.state_slot >= 0 for s in plan.started) or plan.state_restores or plan.state_saves:
        h.update(repr(([s.state_slot for s in plan.started], plan.state_restores,
                       plan.state_saves)).encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely under the raw distribution; ties share the better rank
    top: tuple[tuple[int, float], ...]  # params.logprobs most likely (token, logprob), best first


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """What a runner sampled for one plan: a token per sampling sequence, in plan order."""

    token_ids: Sequence[int]  # a list or an int64 array
    logprobs: Sequence[TokenLogprobs | None] | None = None  # None: no row asked for logprobs
    # Per plan ``prompt_logprobs`` entry: (seq id, position of its first target, the logprobs
    # of the targets). The core ignores them; the shell collects them.
    prompt_logprobs: tuple[tuple[str, int, tuple[TokenLogprobs, ...]], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class TokenBitmask:
    """The tokens some sampling rows of a plan may sample (structured output), from the shell's
    grammars: bit ``t % 32`` of ``bits[k, t // 32]`` allows token ``t`` for sampling row
    ``rows[k]`` (an index into ``plan.sampling_seq_ids``); other rows are free."""

    rows: np.ndarray  # [R] int64
    bits: np.ndarray  # [R, words] int32
