"""The scheduling policy: which tokens of which sequences the next step computes.

1. Running sequences first, oldest admission first, each with all its uncomputed tokens as
   far as the token budget allows (a partial prefill continues in chunks). A sequence that
   needs a block when none is free preempts the most recently admitted running sequence
   (possibly itself), which gives back every block and returns to the head of the waiting
   queue to be recomputed later.
   A sequence whose last token is still pending (sampled by the plan in flight) is
   scheduled with that token as ``PENDING_TOKEN``, unless it needs its history (penalties),
   more than one token is pending, or that token is its last by length: then it waits.
2. Then, unless this step preempted, waiting sequences first come first served while the
   budget, ``max_num_seqs`` and the free blocks allow. A waiting sequence starts from the
   longest prefix found in the prefix cache; its prompt is cut to the budget left (chunked
   prefill) or, with chunking off, waits for a step with budget enough. The head of the
   queue blocks the ones behind it, so nobody starves.
"""

from __future__ import annotations

from dataclasses import replace

from pyrsistent import pvector

from nanofn.state.block_pool import (BlockPool, CachedBlock, allocate, cache_block,
                                     find_cached_prefix, release, take_cached)
from nanofn.state.config import SchedulerConfig, blocks_for
from nanofn.state.engine_state import EngineState
from nanofn.state.hashing import parent_hash_of
from nanofn.state.plan import PENDING_TOKEN, BatchPlan, ScheduledSeq
from nanofn.state.policy import at_length_limit, banned_token_ids
from nanofn.state.records import Seq, SeqStatus, slot_setters


def schedule(state: EngineState) -> tuple[EngineState, BatchPlan]:
    c = state.config
    pool, waiting = state.pool, state.waiting
    budget = c.max_num_batched_tokens
    queue = list(state.running)
    running: list[Seq] = []  # the running sequences after this step, in admission order
    chunks: list[ScheduledSeq] = []
    preempted: list[str] = []

    i = 0
    while i < len(queue):
        seq = queue[i]
        i += 1
        if budget == 0 or not _ready(seq, c):
            running.append(seq)
            continue
        wanted = min(seq.num_uncomputed, budget)
        while (count := _tokens_that_fit(seq, wanted, pool, c.block_size)) == 0:
            victim = queue.pop() if i < len(queue) else seq
            pool, victim = preempt(pool, victim)
            waiting = waiting.appendleft(victim)
            preempted.append(victim.seq_id)
            if victim.seq_id == seq.seq_id:
                break
        if count:
            pool, chunk, seq = _schedule_chunk(pool, seq, count, c)
            running.append(seq)
            chunks.append(chunk)
            budget -= count

    admitted_tokens = cached_tokens = 0
    while (not preempted and waiting and budget > 0 and len(running) < c.max_num_seqs
           and waiting.left.num_pending == 0):
        admission = _admit(pool, waiting.left, budget, c)
        if admission is None:
            break
        pool, chunk, seq = admission
        waiting = waiting.popleft()
        running.append(seq)
        chunks.append(chunk)
        budget -= chunk.num_tokens
        admitted_tokens += seq.num_tokens
        cached_tokens += seq.num_cached_tokens

    counters = state.counters
    counters = replace(counters, num_preemptions=counters.num_preemptions + len(preempted),
                       num_admitted_tokens=counters.num_admitted_tokens + admitted_tokens,
                       num_cached_tokens=counters.num_cached_tokens + cached_tokens)
    # Runners skip empty plans: a release rides along until a plan with work carries it.
    released = (state.unreported_releases + tuple(seq.seq_id for seq in state.finished)
                + tuple(preempted))
    plan = BatchPlan(state.step, tuple(chunks), released)
    undelivered = state.undelivered + (plan.sampling_seq_ids,) if chunks else state.undelivered
    new_state = replace(state, pool=pool, waiting=waiting, running=tuple(running),
                        undelivered=undelivered, preempted=tuple(preempted), counters=counters,
                        unreported_releases=() if chunks else released)
    return new_state, plan


def _ready(seq: Seq, c: SchedulerConfig) -> bool:
    """Whether a running sequence can be scheduled now: nothing pending, or only its last
    token, which is not its last by length and whose history nobody needs (penalties)."""
    pending = seq.num_pending
    if pending == 0:
        return True
    params = seq.spec.params
    if pending > 1 or params.has_penalties:
        return False
    positions = len(seq.token_ids) + 1  # the pending token counts
    return not at_length_limit(params, positions - len(seq.spec.prompt_token_ids), positions,
                               c.max_model_len)


def _tokens_that_fit(seq: Seq, wanted: int, pool: BlockPool, block_size: int) -> int:
    """How many of ``wanted`` new tokens fit in the sequence's blocks plus the free ones."""
    capacity = (len(seq.block_table) + pool.num_free) * block_size - seq.num_computed
    return min(wanted, capacity)


def preempt(pool: BlockPool, seq: Seq) -> tuple[BlockPool, Seq]:
    """Give back all of a running sequence's blocks (the last ones become the first to be
    evicted); it keeps its tokens and will recompute them."""
    pool = release(pool, reversed(seq.block_table))
    seq = replace(seq, status=SeqStatus.WAITING, num_computed=0, block_table=pvector(),
                  num_preemptions=seq.num_preemptions + 1)
    return pool, seq


def _schedule_chunk(pool: BlockPool, seq: Seq, count: int,
                    c: SchedulerConfig) -> tuple[BlockPool, ScheduledSeq, Seq]:
    """Give the sequence blocks for ``count`` more positions, record the blocks they fill in
    the prefix cache, and count them as computed (the runner computes them this step). A
    chunk that reaches the sequence's last position samples a token, pending until delivered."""
    start = seq.num_computed
    end = start + count
    bs = c.block_size
    table = seq.block_table
    if end > len(table) * bs:
        pool, new_blocks = allocate(pool, blocks_for(end, bs) - len(table))
        table = table.extend(new_blocks)
    known = len(seq.token_ids)
    sample = end == known + seq.num_pending
    new_seq = seq.with_progress(table, end, seq.num_pending + sample)
    if c.enable_prefix_caching and min(end, known) // bs > min(start, known) // bs:
        pool = cache_known_blocks(pool, new_seq, min(start, known), bs)
    return pool, _scheduled(new_seq, start, end, known, sample, c), new_seq


def cache_known_blocks(pool: BlockPool, seq: Seq, old_limit: int, block_size: int) -> BlockPool:
    """Record in the prefix cache the blocks that became full of computed, known tokens since
    the first ``old_limit`` positions were."""
    limit = min(seq.num_computed, seq.num_tokens)
    hashes = seq.block_hashes
    for j in range(old_limit // block_size, limit // block_size):
        tokens = tuple(seq.token_ids[j * block_size:(j + 1) * block_size])
        pool = cache_block(pool, seq.block_table[j],
                           CachedBlock(hashes[j], parent_hash_of(hashes, j), tokens))
    return pool


def _admit(pool: BlockPool, seq: Seq, budget: int,
           c: SchedulerConfig) -> tuple[BlockPool, ScheduledSeq, Seq] | None:
    """Start a waiting sequence, or None if it must wait (not enough budget or blocks)."""
    bs = c.block_size
    hits: tuple[int, ...] = ()
    if c.enable_prefix_caching:
        # Leave at least one token to compute, so that there are logits to sample from.
        limit = (seq.num_tokens - 1) // bs
        hits = find_cached_prefix(pool, seq.block_hashes,
                                  lambda i: seq.token_ids[i * bs:(i + 1) * bs], limit)
    cached = len(hits) * bs
    count = seq.num_tokens - cached
    if count > budget:
        if not c.enable_chunked_prefill:
            return None
        count = budget
    free_hits = sum(1 for b in hits if pool.ref_counts[b] == 0)
    if blocks_for(cached + count, bs) - len(hits) > pool.num_free - free_hits:
        return None
    pool = take_cached(pool, hits)
    seq = replace(seq, status=SeqStatus.RUNNING, block_table=pvector(hits), num_computed=cached,
                  num_cached_tokens=cached)
    return _schedule_chunk(pool, seq, count, c)


_PENDING_ONLY = (PENDING_TOKEN,)


def _scheduled(seq: Seq, start: int, end: int, known: int, sample: bool,
               c: SchedulerConfig) -> ScheduledSeq:
    """The plan's entry for positions ``start .. end - 1`` of ``seq``, of which the first
    ``known`` are known tokens."""
    if end <= known:
        tokens = (seq.token_ids[start],) if end - start == 1 else tuple(seq.token_ids[start:end])
    elif start == known:
        tokens = _PENDING_ONLY
    else:
        tokens = tuple(seq.token_ids[start:known]) + _PENDING_ONLY
    spec = seq.spec
    params = spec.params
    num_prompt = len(spec.prompt_token_ids)
    entry = _new(ScheduledSeq)  # the slot setters: half the cost of the frozen __init__
    _set_seq_id(entry, spec.seq_id)
    _set_token_ids(entry, tokens)
    _set_start_pos(entry, start)
    _set_block_table(entry, seq.block_table)
    _set_sample(entry, sample)
    _set_params(entry, params)
    _set_num_prompt_tokens(entry, num_prompt)
    _set_history(entry, seq.token_ids if params.has_penalties else None)
    _set_banned(entry, banned_token_ids(params, end - num_prompt, c.eos_token_ids)
                if sample else ())
    return entry


_new = object.__new__
(_set_seq_id, _set_token_ids, _set_start_pos, _set_block_table, _set_sample, _set_params,
 _set_num_prompt_tokens, _set_history, _set_banned) = slot_setters(ScheduledSeq)
