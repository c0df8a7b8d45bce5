"""One engine step as a pure function: ``step(state, events) -> (new_state, plan)``."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from pyrsistent import pdeque, pvector

from nanofn.state.block_pool import BlockPool, release
from nanofn.state.config import SchedulerConfig
from nanofn.state.engine_state import EngineState
from nanofn.state.hashing import extend_block_hashes
from nanofn.state.plan import BatchPlan
from nanofn.state.policy import at_length_limit, may_stop, stops_on
from nanofn.state.records import FinishReason, Seq, SeqStatus
from nanofn.state.requests import NewSeq, add_seqs
from nanofn.state.scheduler import cache_known_blocks, schedule


@dataclass(frozen=True, slots=True)
class Events:
    """What happened since the last step, in the order ``step`` applies it.

    ``sampled`` delivers the tokens of the oldest plan whose tokens are not delivered yet,
    one per sequence of that plan that sampled, in plan order; ``None`` delivers nothing (a
    runner one step ahead has not finished that plan). ``stop_hits`` are sequences whose
    text reached a stop string with the token now delivered (seen by the shell's
    detokenizer); they finish with reason ``stop`` after taking that token, if ``may_stop``
    allows it. New sequences join the waiting queue before aborts apply, so a sequence can
    be aborted in the step that adds it. Aborts of sequences that are not live, stop hits of
    sequences that took no token now, and delivered tokens of sequences no longer live are
    ignored: they may have just finished on their own (an id with a token in flight cannot
    be reused, see ``check_new_seq``).
    """

    sampled: tuple[int, ...] | None = None
    stop_hits: tuple[str, ...] = ()
    new_seqs: tuple[NewSeq, ...] = ()
    aborts: tuple[str, ...] = ()


def step(state: EngineState, events: Events) -> tuple[EngineState, BatchPlan]:
    if events.sampled is not None:
        _check_delivery(state, events.sampled)
    state = replace(state, step=state.step + 1, finished=(), preempted=())
    if events.sampled is not None:
        state = apply_sampled(state, events.sampled, frozenset(events.stop_hits))
    state = add_seqs(state, events.new_seqs)
    state = finish_by_id(state, events.aborts, FinishReason.ABORT)
    return schedule(state)


def _check_delivery(state: EngineState, sampled: tuple[int, ...]) -> None:
    if not state.undelivered:
        raise ValueError(f"step {state.step + 1}: {len(sampled)} sampled tokens delivered, but "
                         f"no plan is waiting for its tokens")
    if len(sampled) != len(state.undelivered[0]):
        raise ValueError(f"step {state.step + 1}: got {len(sampled)} sampled tokens, the plan "
                         f"they belong to sampled {len(state.undelivered[0])} sequences")


def apply_sampled(state: EngineState, sampled: tuple[int, ...],
                  stop_hits: frozenset[str]) -> EngineState:
    """Append each delivered token to its sequence and finish the sequences it ends (or
    whose stop string it completes)."""
    tokens = dict(zip(state.undelivered[0], sampled))
    state = replace(state, undelivered=state.undelivered[1:])
    if not tokens:
        return state
    c = state.config
    return _update_named(state, tokens, lambda pool, seq: _take_token(
        pool, seq, tokens[seq.seq_id], stop_hits, c))


def _take_token(pool: BlockPool, seq: Seq, token: int, stop_hits: frozenset[str],
                c: SchedulerConfig) -> tuple[BlockPool, Seq]:
    """The sequence with its delivered token, finished if the token ends it."""
    seq = append_token(seq, token, c)
    known = len(seq.token_ids)
    if c.enable_prefix_caching and known % c.block_size == 0:  # it completed a known block
        pool = cache_known_blocks(pool, seq, min(seq.num_computed, known - 1), c.block_size)
    reason = finish_reason(seq, token, seq.seq_id in stop_hits, c)
    return _finish(pool, seq, reason) if reason is not None else (pool, seq)


def append_token(seq: Seq, token: int, c: SchedulerConfig) -> Seq:
    token_ids = seq.token_ids.append(token)
    hashes = seq.block_hashes
    if c.enable_prefix_caching and len(token_ids) % c.block_size == 0:
        hashes = extend_block_hashes(hashes, token_ids, c.block_size)
    return seq.with_token(token_ids, hashes)


def finish_reason(seq: Seq, last_token: int, stop_string_hit: bool,
                  c: SchedulerConfig) -> FinishReason | None:
    """Why a sequence ends with ``last_token`` (already appended), whose text may have reached
    a stop string, or None if it goes on."""
    p = seq.params
    num_output = seq.num_output_tokens
    if may_stop(p, num_output) and (stop_string_hit or stops_on(last_token, p, c.eos_token_ids)):
        return FinishReason.STOP
    if at_length_limit(p, num_output, seq.num_tokens, c.max_model_len):
        return FinishReason.LENGTH
    return None


def finish_by_id(state: EngineState, seq_ids: tuple[str, ...],
                 reason: FinishReason) -> EngineState:
    """Finish the live sequences named, wherever they are; ignore the others."""
    targets = {i for i in seq_ids if i in state.live_ids}
    if not targets:
        return state
    return _update_named(state, targets, lambda pool, seq: _finish(pool, seq, reason))


def _update_named(state: EngineState, names: Collection[str],
                  update: Callable[[BlockPool, Seq], tuple[BlockPool, Seq]]) -> EngineState:
    """Apply ``update`` to the live sequences named, running ones first and waiting ones only
    if some are not running (the waiting queue is rebuilt then); the ones it finishes leave
    their queue."""
    pool, finished = state.pool, list(state.finished)
    left = set(names)
    running: list[Seq] = []
    for seq in state.running:
        if seq.seq_id in left:
            left.discard(seq.seq_id)
            pool, seq = update(pool, seq)
            if seq.is_finished:
                finished.append(seq)
                continue
        running.append(seq)
    waiting = state.waiting
    if any(name in state.live_ids for name in left):
        kept = []
        for seq in state.waiting:
            if seq.seq_id in left:
                pool, seq = update(pool, seq)
            (finished if seq.is_finished else kept).append(seq)
        waiting = pdeque(kept)
    return _with_finished(state, pool, tuple(running), waiting, finished)


def _finish(pool: BlockPool, seq: Seq, reason: FinishReason) -> tuple[BlockPool, Seq]:
    pool = release(pool, reversed(seq.block_table))
    return pool, replace(seq, status=SeqStatus.FINISHED, finish_reason=reason,
                         block_table=pvector())


def _with_finished(state: EngineState, pool: BlockPool, running: tuple[Seq, ...], waiting,
                   finished: list[Seq]) -> EngineState:
    newly = finished[len(state.finished):]
    live = state.live_ids
    for seq in newly:
        live = live.remove(seq.seq_id)
    counters = replace(state.counters, num_finished=state.counters.num_finished + len(newly))
    return replace(state, pool=pool, running=running, waiting=waiting, live_ids=live,
                   finished=tuple(finished), counters=counters)
