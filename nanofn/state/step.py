"""One engine step as a pure function: ``step(state, events) -> (new_state, plan)``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pyrsistent import pdeque, pvector

from nanofn.state.block_pool import BlockPool, release
from nanofn.state.config import SchedulerConfig
from nanofn.state.engine_state import EngineState
from nanofn.state.hashing import extend_block_hashes
from nanofn.state.plan import BatchPlan
from nanofn.state.records import FinishReason, Seq, SeqStatus
from nanofn.state.requests import NewRequest, add_requests
from nanofn.state.scheduler import schedule


@dataclass(frozen=True, slots=True)
class Events:
    """What happened since the last step, in the order ``step`` applies it.

    ``sampled`` holds one token per sequence of the last plan that sampled, in plan order.
    ``stop_hits`` are sequences whose text reached a stop string (seen by the shell's
    detokenizer); they finish with reason ``stop`` after taking their sampled token.
    Aborts and stop hits of sequences that are not live are ignored (they may have just
    finished on their own).
    """

    sampled: tuple[int, ...] = ()
    stop_hits: tuple[str, ...] = ()
    aborts: tuple[str, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()


def step(state: EngineState, events: Events) -> tuple[EngineState, BatchPlan]:
    if len(events.sampled) != len(state.sampling_ids):
        raise ValueError(f"step {state.step + 1}: got {len(events.sampled)} sampled tokens, "
                         f"the last plan sampled {len(state.sampling_ids)} sequences")
    state = replace(state, step=state.step + 1, finished=(), preempted=())
    state = apply_sampled(state, events.sampled, frozenset(events.stop_hits))
    state = finish_by_id(state, events.stop_hits, FinishReason.STOP)
    state = finish_by_id(state, events.aborts, FinishReason.ABORT)
    state = add_requests(state, events.new_requests)
    return schedule(state)


def apply_sampled(state: EngineState, sampled: tuple[int, ...],
                  stop_hits: frozenset[str]) -> EngineState:
    """Append each sampled token to its sequence and finish the sequences it ends."""
    if not sampled:
        return state
    tokens = dict(zip(state.sampling_ids, sampled))
    c, pool = state.config, state.pool
    running: list[Seq] = []
    finished = list(state.finished)
    for seq in state.running:
        token = tokens.get(seq.seq_id)
        if token is None:
            running.append(seq)
            continue
        seq = append_token(seq, token, c)
        reason = FinishReason.STOP if seq.seq_id in stop_hits else finish_reason(seq, token, c)
        if reason is None:
            running.append(seq)
        else:
            pool, seq = _finish(pool, seq, reason)
            finished.append(seq)
    return _with_finished(state, pool, tuple(running), state.waiting, finished)


def append_token(seq: Seq, token: int, c: SchedulerConfig) -> Seq:
    token_ids = seq.token_ids.append(token)
    hashes = seq.block_hashes
    if c.enable_prefix_caching and len(token_ids) % c.block_size == 0:
        hashes = extend_block_hashes(hashes, token_ids, c.block_size)
    return seq.with_tokens(token_ids, hashes)


def finish_reason(seq: Seq, last_token: int, c: SchedulerConfig) -> FinishReason | None:
    """Why a sequence ends with ``last_token`` (already appended), or None if it goes on."""
    p = seq.params
    num_output = seq.num_output_tokens
    if num_output >= p.min_tokens and (
            (not p.ignore_eos and last_token in c.eos_token_ids) or last_token in p.stop_token_ids):
        return FinishReason.STOP
    if p.max_tokens is not None and num_output >= p.max_tokens:
        return FinishReason.LENGTH
    if seq.num_tokens >= c.max_model_len:
        return FinishReason.LENGTH
    return None


def finish_by_id(state: EngineState, seq_ids: tuple[str, ...],
                 reason: FinishReason) -> EngineState:
    """Finish the live sequences named, wherever they are; ignore the others."""
    targets = {i for i in seq_ids if i in state.live_ids}
    if not targets:
        return state
    pool = state.pool
    finished = list(state.finished)
    running = []
    for seq in state.running:
        if seq.seq_id in targets:
            pool, seq = _finish(pool, seq, reason)
            finished.append(seq)
        else:
            running.append(seq)
    waiting = state.waiting
    if len(finished) - len(state.finished) < len(targets):  # some are waiting
        kept = []
        for seq in state.waiting:
            if seq.seq_id in targets:
                finished.append(_finish(pool, seq, reason)[1])
            else:
                kept.append(seq)
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
    stats = replace(state.stats, num_finished=state.stats.num_finished + len(newly))
    return replace(state, pool=pool, running=running, waiting=waiting, live_ids=live,
                   finished=tuple(finished), stats=stats)
