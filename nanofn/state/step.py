"""One engine step as a pure function: ``step(state, events) -> (new_state, plan)``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
from pyrsistent import pdeque

from nanofn.state.batch import (HAS_STOP_IDS, IGNORE_EOS, LENGTH_LIMIT, MIN_TOKENS, NUM_PENDING,
                                NUM_PROMPT, NUM_TOKENS, ROW, SERIAL, SLOT, STATE, RunningBatch,
                                select, thawed, with_room)
from nanofn.state.block_pool import PoolChanges
from nanofn.state.config import SchedulerConfig
from nanofn.state.decode import decode_step
from nanofn.state.engine_state import EngineState, evolve
from nanofn.state.filled import leaving_record
from nanofn.state.hashing import block_hashes
from nanofn.state.plan import BatchPlan
from nanofn.state.policy import ends_on, finishing, length_limit, stops_on
from nanofn.state.records import FinishReason, Seq, SeqStatus
from nanofn.state.requests import NewSeq, add_seqs
from nanofn.state.scheduler import schedule
from nanofn.state.state_pool import StateChanges
from nanofn.state.store import TOKENS


@dataclass(frozen=True, slots=True)
class Events:
    """What happened since the last step, in the order ``step`` applies it.

    ``sampled`` delivers the tokens of the oldest plan whose tokens are not delivered yet,
    one per sequence of that plan that sampled, in plan order; ``None`` delivers nothing (a
    runner one step ahead has not finished that plan). ``stop_hits`` are sequences whose
    text reached a stop string with the token now delivered (seen by the shell's
    detokenizer); they finish with reason ``stop`` after taking that token, if ``may_stop``
    allows it. New sequences join the waiting queue before aborts apply, so a sequence can
    be aborted in the step that adds it. ``dirty_blocks`` are blocks whose device contents
    are unknown (a launch that failed may have written them): they leave the prefix cache
    once the aborts apply (an aborted sequence caches the blocks it filled as it leaves, and
    the failed launch's step may have handed its blocks out again); so do the saved recurrent
    states of the ``dirty_states`` slots. Aborts of sequences that are not live, stop hits of
    sequences that took no token now, and delivered tokens of sequences no longer live are
    ignored: they may have just finished on their own (an id with a token in flight cannot
    be reused, see ``check_new_seq``).
    """

    sampled: Sequence[int] | np.ndarray | None = None
    stop_hits: tuple[str, ...] = ()
    new_seqs: tuple[NewSeq, ...] = ()
    aborts: tuple[str, ...] = ()
    dirty_blocks: tuple[int, ...] = ()
    dirty_states: tuple[int, ...] = ()

    @property
    def delivers_only(self) -> bool:
        """Whether the events are a delivery of sampled tokens and nothing else."""
        return self.sampled is not None and not (self.stop_hits or self.new_seqs
                                                 or self.aborts or self.dirty_blocks
                                                 or self.dirty_states)


def step(state: EngineState, events: Events) -> tuple[EngineState, BatchPlan]:
    """The next state and plan: ``full_step``'s, through the plain decode step's shortcut
    (``decode.py``) when that applies."""
    if events.sampled is None:
        return full_step(state, events)
    sampled = _delivered_tokens(state, events.sampled)
    return (decode_step(state, sampled, events.delivers_only)
            or _full_step(state, events, sampled))


def full_step(state: EngineState, events: Events) -> tuple[EngineState, BatchPlan]:
    """The step by definition: deliver the sampled tokens, add the new sequences, apply the
    aborts, forget the dirty blocks and states, schedule."""
    sampled = None if events.sampled is None else _delivered_tokens(state, events.sampled)
    return _full_step(state, events, sampled)


def _full_step(state: EngineState, events: Events,
               sampled: np.ndarray | None) -> tuple[EngineState, BatchPlan]:
    state = evolve(state, step=state.step + 1, finished=(), preempted=())
    if sampled is not None:
        state = apply_sampled(state, sampled, frozenset(events.stop_hits))
    state = add_seqs(state, events.new_seqs)
    state = finish_by_id(state, events.aborts, FinishReason.ABORT)
    state = forget_blocks(state, events.dirty_blocks)
    state = forget_states(state, events.dirty_states)
    return schedule(state)


def _delivered_tokens(state: EngineState, sampled) -> np.ndarray:
    """The delivered tokens as int64, once checked: a plan is waiting for exactly this many,
    and each is a token id."""
    if not state.undelivered:
        raise ValueError(f"step {state.step + 1}: {len(sampled)} sampled tokens delivered, but "
                         f"no plan is waiting for its tokens")
    if len(sampled) != len(state.undelivered[0]):
        raise ValueError(f"step {state.step + 1}: got {len(sampled)} sampled tokens, the plan "
                         f"they belong to sampled {len(state.undelivered[0])} sequences")
    tokens = np.asarray(sampled)
    vocab_size = state.config.vocab_size
    # (As unsigned, a negative id is past any bound: one comparison checks both ends.)
    bound = np.uint64(vocab_size if vocab_size is not None else 1 << 63)
    if len(tokens) and (tokens.dtype.kind not in "iu" or np.count_nonzero(
            (tokens.view(np.uint64) if tokens.dtype == np.int64 else tokens.astype(np.uint64))
            >= bound)):
        bad = next(t for t in sampled if not _is_token(t, vocab_size))
        vocab = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"step {state.step + 1}: sampled token {bad!r} is not a token id in "
                         f"{vocab}")
    return tokens.astype(np.int64, copy=False)


def _is_token(t: object, vocab_size: int | None) -> bool:
    return (isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0
            and (vocab_size is None or t < vocab_size))


def forget_blocks(state: EngineState, blocks: tuple[int, ...]) -> EngineState:
    """The state with these blocks out of the prefix cache (free ones become plain)."""
    if not blocks:
        return state
    pool = PoolChanges(state.pool)
    pool.forget(blocks)
    return evolve(state, pool=pool.build())


def forget_states(state: EngineState, slots: tuple[int, ...]) -> EngineState:
    """The state with the saved recurrent states of these slots out of the prefix cache."""
    if not slots or state.states is None:
        return state
    states = StateChanges(state.states, state.step)
    states.forget(slots)
    return evolve(state, states=states.build())


# --- delivered tokens ------------------------------------------------------------------------

def apply_sampled(state: EngineState, sampled: np.ndarray,
                  stop_hits: frozenset[str]) -> EngineState:
    """Append each delivered token to its sequence and finish the sequences it ends (or whose
    stop string it completes). Running sequences take theirs in a few vectorized operations;
    a sequence preempted with a token in flight takes it in its waiting record."""
    in_flight, undelivered = state.undelivered[0], state.undelivered[1:]
    batch = state.batch
    rows = _rows_of(batch, in_flight.serials)
    if rows is None:  # every running sequence, in batch order: whole columns, no gathers
        rows = slice(None)
    else:
        running = rows >= 0
        if not running.all():
            state = _deliver_to_waiting(state, in_flight.seq_ids, sampled, ~running, stop_hits)
            rows, sampled = rows[running], sampled[running]
        if not len(rows):
            return evolve(state, undelivered=undelivered)
    c = state.config
    cols = thawed(batch.cols)
    store, cols = with_room(batch.store, cols, TOKENS, rows, key=batch.write_key)
    lengths = cols[rows, NUM_TOKENS].copy()
    store.append(TOKENS, cols[rows, ROW], lengths, sampled)
    cols[rows, NUM_TOKENS] = lengths + 1
    cols[rows, NUM_PENDING] -= 1
    pool = PoolChanges(state.pool)  # (blocks the tokens fill are hashed later: filled.py)
    batch = RunningBatch(cols, batch.specs, batch.ids, store, store.claim())
    reasons = _finish_reasons(batch, rows, sampled, stop_hits, c)
    return finish_rows(evolve(state, batch=batch, undelivered=undelivered), pool, reasons)


def _rows_of(batch: RunningBatch, serials: np.ndarray) -> np.ndarray | None:
    """The batch row of each stint (serials increase along the batch), or -1 where it ended;
    None when the stints are exactly the batch's rows, in order (the common case)."""
    if not len(batch):
        return np.full(len(serials), -1)
    batch_serials = batch.cols[:, SERIAL]
    if len(serials) == len(batch) and (serials == batch_serials).all():
        return None
    rows = np.minimum(np.searchsorted(batch_serials, serials), len(batch) - 1)
    return np.where(batch_serials[rows] == serials, rows, -1)


def _finish_reasons(batch: RunningBatch, rows: np.ndarray | slice, tokens: np.ndarray,
                    stop_hits: Collection[str], c: SchedulerConfig) -> dict[int, FinishReason]:
    """Why each of ``rows`` (which just took ``tokens``) finishes, for those that do."""
    cols = batch.cols
    num_tokens = cols[rows, NUM_TOKENS]
    indices = np.arange(len(batch))[rows]
    ends = ends_on(tokens, True, c.eos_token_ids)
    if ends.any():
        ends &= cols[rows, IGNORE_EOS] == 0
    special = cols[rows, HAS_STOP_IDS]
    if special.any():
        for j in np.flatnonzero(special).tolist():
            ends[j] |= stops_on(int(tokens[j]), batch.specs[indices[j]].params, c.eos_token_ids)
    if stop_hits:
        position = {row: j for j, row in enumerate(indices.tolist())}
        for seq_id in stop_hits:
            j = position.get(batch.index(seq_id), None)
            if j is not None:
                ends[j] = True
    stop, done = finishing(ends, num_tokens, cols[rows, NUM_PROMPT], cols[rows, MIN_TOKENS],
                           cols[rows, LENGTH_LIMIT])
    if not done.any():
        return {}
    return {int(indices[j]): FinishReason.STOP if stop[j] else FinishReason.LENGTH
            for j in np.flatnonzero(done).tolist()}


def _deliver_to_waiting(state: EngineState, seq_ids: tuple[str, ...], sampled: np.ndarray,
                        mask: np.ndarray, stop_hits: frozenset[str]) -> EngineState:
    """Tokens of stints no longer running: a sequence preempted with its token in flight takes
    it in its waiting record (and may finish by it); tokens of finished ones are dropped."""
    c = state.config
    waiting, finished = state.waiting, list(state.finished)
    for j in np.flatnonzero(mask).tolist():
        seq_id = seq_ids[j]
        if seq_id not in state.live_ids:
            continue
        seqs = list(waiting)
        k = next(k for k, seq in enumerate(seqs) if seq.seq_id == seq_id)
        seq = _with_token(seqs[k], int(sampled[j]), c)
        reason = _record_finish_reason(seq, seq_id in stop_hits, c)
        if reason is None:
            seqs[k] = seq
        else:
            del seqs[k]
            finished.append(replace(seq, status=SeqStatus.FINISHED, finish_reason=reason))
        waiting = pdeque(seqs)
    newly = [s.seq_id for s in finished[len(state.finished):]]
    return _counted(evolve(state, waiting=waiting, finished=tuple(finished)), newly)


def _with_token(seq: Seq, token: int, c: SchedulerConfig) -> Seq:
    tokens = seq.token_ids + (token,)
    hashes = seq.block_hashes
    if c.enable_prefix_caching and len(tokens) % c.block_size == 0:
        hashes = block_hashes(tokens, c.block_size)
    return replace(seq, token_ids=tokens, block_hashes=hashes, num_pending=seq.num_pending - 1)


def _record_finish_reason(seq: Seq, stop_string_hit: bool,
                          c: SchedulerConfig) -> FinishReason | None:
    """Why a sequence (a record) ends with its newest token, or None if it goes on."""
    p = seq.params
    stops, finishes = finishing(
        stop_string_hit or stops_on(seq.token_ids[-1], p, c.eos_token_ids), seq.num_tokens,
        seq.num_prompt_tokens, p.min_tokens, length_limit(p, seq.num_prompt_tokens,
                                                          c.max_model_len))
    return FinishReason.STOP if stops else FinishReason.LENGTH if finishes else None


# --- finishing ---------------------------------------------------------------------------------

def finish_by_id(state: EngineState, seq_ids: tuple[str, ...],
                 reason: FinishReason) -> EngineState:
    """Finish the live sequences named, wherever they are; ignore the others."""
    targets = {i for i in seq_ids if i in state.live_ids}
    if not targets:
        return state
    rows = {}
    for seq_id in targets:
        row = state.batch.index(seq_id)
        if row is not None:
            rows[row] = reason
    state = finish_rows(state, PoolChanges(state.pool), rows)
    if len(rows) < len(targets):
        kept, finished = [], list(state.finished)
        for seq in state.waiting:
            if seq.seq_id in targets:
                finished.append(replace(seq, status=SeqStatus.FINISHED, finish_reason=reason))
            else:
                kept.append(seq)
        newly = [seq.seq_id for seq in finished[len(state.finished):]]
        state = _counted(evolve(state, waiting=pdeque(kept), finished=tuple(finished)), newly)
    return state


def finish_rows(state: EngineState, pool: PoolChanges,
                reasons: dict[int, FinishReason]) -> EngineState:
    """Finish the running rows named (in batch order): each gives back its blocks, its slot
    and its state slot, and leaves as a finished record. Freezes ``pool`` into the new state."""
    if not reasons:
        new_pool = pool.build()
        return state if new_pool is state.pool else evolve(state, pool=new_pool)
    batch = state.batch
    finished, slots = list(state.finished), state.free_slots
    keep = np.ones(len(batch), bool)
    c = state.config
    rows = sorted(reasons)
    finished += [leaving_record(batch, i, pool, c.block_size, c.enable_prefix_caching,
                                SeqStatus.FINISHED, reasons[i]) for i in rows]
    # (Their blocks go back after every record is hashed, as one release in row order: each
    # record's hashing reads only its own row, so that is the order one by one would give.)
    pool.release(np.concatenate([batch.table(i)[::-1] for i in rows]))
    for slot in batch.cols[rows, SLOT].tolist():
        slots = slots.cons(slot)
    states = state.states
    if states is not None:
        changes = StateChanges(states, state.step)
        changes.release(batch.cols[rows, STATE].tolist())
        states = changes.build()
    keep[rows] = False
    state = evolve(state, pool=pool.build(), batch=select(batch, keep), free_slots=slots,
                    finished=tuple(finished), states=states)
    return _counted(state, [batch.ids[i] for i in rows])


def _counted(state: EngineState, newly_finished: list[str]) -> EngineState:
    """The state with these sequences gone from the live ones and counted as finished."""
    if not newly_finished:
        return state
    counters = replace(state.counters,
                       num_finished=state.counters.num_finished + len(newly_finished))
    return evolve(state, live_ids=state.live_ids.update_known({}, newly_finished),
                   counters=counters)

