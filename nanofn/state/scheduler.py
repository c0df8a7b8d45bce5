"""The scheduling policy: which tokens of which sequences the next step computes.

1. Running sequences first, oldest admission first, each with all its uncomputed tokens as
   far as the token budget allows (a partial prefill continues in chunks). A sequence that
   needs a block when none is free preempts the most recently admitted running sequence
   (possibly itself), which gives back every block and returns to the head of the waiting
   queue to be recomputed later.
   A sequence whose last token is still pending (sampled by the plan in flight) is
   scheduled with that token as ``PENDING_TOKEN``, unless it needs that token on the host
   (penalties count it, bad words match it, a grammar's mask depends on it), more than one
   token is pending, or that token is its last by length: then it waits.
2. Then, unless this step preempted, waiting sequences first come first served while the
   budget, ``max_num_seqs`` and the free blocks allow. A waiting sequence starts from the
   longest prefix found in the prefix cache; its prompt is cut to the budget left (chunked
   prefill) or, with chunking off, waits for a step with budget enough. The head of the
   queue blocks the ones behind it, so nobody starves.
3. A hybrid model's sequence also needs a recurrent-state slot (``state_pool.py``) to start:
   a free one, else the least recently used saved state's. It starts from the longest cached
   prefix that has both its KV blocks and a saved state (the blocks past it are recomputed,
   since the state must be); a prompt's chunks end where a state is to be saved: where its
   cached KV blocks outrun its saved states (the end of a prefix it shares with earlier
   prompts) and at the last full block of its tokens. Preemption is for blocks alone: a
   sequence that finds no state slot waits, like one that finds no block.

Step 1 runs as array operations over the batch's columns whenever the free blocks cover every
sequence's needs (the common case); otherwise it walks the sequences one by one, preempting
as it goes. Both give the same schedule: the walk is the definition, the arrays its shortcut.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from nanofn.state.batch import (HAS_STOP_IDS, IGNORE_EOS, LENGTH_LIMIT, MIN_TOKENS, NUM_BLOCKS,
                                NUM_CACHED, NUM_COLS, NUM_COMPUTED, NUM_HASHED, NUM_PENDING,
                                NUM_PREEMPTIONS, NUM_PROMPT, NUM_TOKENS, ROW, SAVE_AT, SERIAL,
                                SLOT, STATE, WAITS_FOR_TOKEN, RunningBatch, frozen, thawed,
                                with_room)
from nanofn.state.block_pool import KnownPrefix, PoolChanges, find_cached_prefix
from nanofn.state.config import SchedulerConfig, blocks_for
from nanofn.state.engine_state import EngineState, InFlight, evolve
from nanofn.state.filled import hash_pending_blocks, leaving_record
from nanofn.state.hashing import parent_hash_of, token_bytes
from nanofn.state.plan import PENDING_TOKEN, BatchPlan, SeqStart, empty_plan
from nanofn.state.policy import (at_length_limit, bad_word_bans, banned_token_ids, length_limit,
                                 may_stop_next)
from nanofn.state.records import Seq, SeqStatus
from nanofn.state.state_pool import SavedState, StateChanges
from nanofn.state.store import HASHES, TABLES, TOKENS, SeqStore

NO_ENTRIES = np.zeros((0, 3), np.int64)
NO_ENTRIES.flags.writeable = False
NO_COUNTS = np.zeros(0, np.int64)
NO_COUNTS.flags.writeable = False


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting sequence that starts now: its blocks (prefix-cache hits first), the tokens
    found cached, and the tokens it computes this step. A hybrid model's sequence: its state
    slot, the saved state it starts from (if any) and the token count at which it is to save
    its state (0: none)."""

    seq: Seq
    blocks: list[int]
    num_cached: int
    count: int
    known: KnownPrefix | None  # its prefix hits, for the next admissions to reuse
    state_slot: int = -1
    restored: SavedState | None = None
    save_at: int = 0


def schedule(state: EngineState) -> tuple[EngineState, BatchPlan]:
    c = state.config
    batch = state.batch
    cols = thawed(batch.cols)
    counts = wanted_counts(cols, c)
    if not state.waiting and not counts.any():  # nothing to compute: the state stays
        return state, empty_plan(state.step)
    pool = PoolChanges(state.pool)
    states = None if state.states is None else StateChanges(state.states, state.step)
    grow = np.maximum(blocks_for(cols[:, NUM_COMPUTED] + counts, c.block_size)
                      - cols[:, NUM_BLOCKS], 0)
    if int(grow.sum()) <= pool.num_free:
        blocks, kept, victims = pool.allocate(int(grow.sum())), len(batch), []
    else:
        counts, grow, blocks, kept, victims = schedule_under_pressure(batch, pool, states, c)
    waiting, slots = state.waiting, state.free_slots
    for i, victim in victims:
        waiting = waiting.appendleft(victim)
        slots = slots.cons(int(cols[i, SLOT]))
    if victims:
        cols, counts, grow = cols[:kept], counts[:kept], grow[:kept]

    admissions: list[Admission] = []
    budget = c.max_num_batched_tokens - int(counts.sum())
    store, key, hashed = batch.store, batch.write_key, False
    known: KnownPrefix | None = None
    while (not victims and waiting and budget > 0 and kept + len(admissions) < c.max_num_seqs
           and waiting.left.num_pending == 0):
        if c.enable_prefix_caching and not hashed:
            # The running sequences' filled blocks join the prefix cache before it is searched.
            store, cols = hash_pending_blocks(store, cols, pool, c.block_size, key)
            hashed = True
        admission = admit(pool, states, waiting.left, budget, c, known)
        if admission is None:
            break
        admissions.append(admission)
        known = admission.known or known
        waiting = waiting.popleft()
        budget -= admission.count

    if blocks or admissions:
        store, cols = _write_new_blocks(store, cols, grow, blocks, admissions, key)
        cols, slots = _append_admitted(store, cols, admissions, slots, state.next_serial, c)
    if blocks or admissions or hashed:
        key = store.claim()
    ids, specs = batch.ids, batch.specs
    if victims or admissions:
        ids = ids[:kept] + tuple(a.seq.seq_id for a in admissions)
        specs = specs[:kept] + tuple(a.seq.spec for a in admissions)
        counts = np.concatenate([counts, np.array([a.count for a in admissions], np.int64)])
    new_batch, plan, sampling = _plan(state.step, store, key, cols, counts, grow, blocks, ids,
                                      specs, admissions, pool, states, c)

    counters = state.counters
    if victims or admissions:
        counters = replace(counters, num_preemptions=counters.num_preemptions + len(victims),
                           num_admitted_tokens=counters.num_admitted_tokens
                           + sum(a.seq.num_tokens for a in admissions),
                           num_cached_tokens=counters.num_cached_tokens
                           + sum(a.num_cached for a in admissions))
    undelivered = state.undelivered
    if not plan.is_empty:
        undelivered += (InFlight(sampling.tobytes(), plan.sampling_seq_ids),)
    new_state = evolve(state, pool=pool.build(), waiting=waiting, batch=new_batch,
                       free_slots=slots, next_serial=state.next_serial + len(admissions),
                       undelivered=undelivered,
                       preempted=tuple(victim.seq_id for _, victim in victims),
                       counters=counters,
                       states=state.states if states is None else states.build())
    return new_state, plan


def ready(cols: np.ndarray) -> np.ndarray:
    """Which running sequences can be scheduled now: nothing pending, or only their last
    token, which is not their last by length and which sampling does not need on the host
    (penalties and bad words read the history, a grammar's mask depends on the token)."""
    pending = cols[:, NUM_PENDING]
    one_pending = (pending == 1) & ~at_length_limit(cols[:, NUM_TOKENS] + 1, cols[:, LENGTH_LIMIT])
    if cols[:, WAITS_FOR_TOKEN].any():
        one_pending &= cols[:, WAITS_FOR_TOKEN] == 0
    return (pending == 0) | one_pending


def wanted_counts(cols: np.ndarray, c: SchedulerConfig) -> np.ndarray:
    """``uncomputed(cols)``, as far as the token budget goes in batch order."""
    if not len(cols):  # (an idle engine's first step: its arrays would cost more than nothing)
        return NO_COUNTS
    wanted = uncomputed(cols)
    if wanted.sum() <= c.max_num_batched_tokens:
        return wanted
    before = np.cumsum(wanted) - wanted
    return np.clip(c.max_num_batched_tokens - before, 0, wanted)


def uncomputed(cols: np.ndarray) -> np.ndarray:
    """Each ready sequence's uncomputed tokens, up to where it is to save its recurrent state."""
    wanted = (cols[:, NUM_TOKENS] + cols[:, NUM_PENDING] - cols[:, NUM_COMPUTED]) * ready(cols)
    if cols[:, SAVE_AT].any():
        saving = cols[:, SAVE_AT] > cols[:, NUM_COMPUTED]
        wanted[saving] = np.minimum(wanted, cols[:, SAVE_AT] - cols[:, NUM_COMPUTED])[saving]
    return wanted


def schedule_under_pressure(batch: RunningBatch, pool: PoolChanges,
                            states: StateChanges | None, c: SchedulerConfig):
    """The running sequences one by one, in batch order, when the free blocks may not cover
    them all: each takes the tokens the budget and the blocks allow; one that fits none
    preempts the most recently admitted sequence not yet scheduled (or itself).
    Returns (counts, blocks added per row, the blocks in row order, rows kept, and the
    preempted rows with their waiting records, in order of preemption); the preempted rows are
    the last ones."""
    cols, bs = batch.cols, c.block_size
    n = len(batch)
    counts, grow = np.zeros(n, np.int64), np.zeros(n, np.int64)
    wanted_all = uncomputed(cols)
    blocks: list[int] = []
    victims: list[tuple[int, Seq]] = []
    budget, end, i = c.max_num_batched_tokens, n, 0
    while i < end:
        computed, table_len = int(cols[i, NUM_COMPUTED]), int(cols[i, NUM_BLOCKS])
        wanted = min(int(wanted_all[i]), budget)
        count = 0
        while wanted:
            count = min(wanted, (table_len + pool.num_free) * bs - computed)
            if count > 0:
                break
            victim = end - 1
            victims.append((victim, preempt(pool, states, batch, victim, c)))
            end = victim
            if victim == i:
                count = 0
                break
        if count:
            added = blocks_for(computed + count, bs) - table_len
            blocks += pool.allocate(max(added, 0))
            counts[i], grow[i] = count, max(added, 0)
            budget -= count
        i += 1
    return counts, grow, blocks, end, victims


def preempt(pool: PoolChanges, states: StateChanges | None, batch: RunningBatch, i: int,
            c: SchedulerConfig) -> Seq:
    """Give back all of row ``i``'s blocks (the last ones become the first to be evicted) and
    its state slot; it becomes a waiting record that keeps its tokens, pending ones included,
    and will recompute them."""
    seq = leaving_record(batch, i, pool, c.block_size, c.enable_prefix_caching,
                         SeqStatus.WAITING)
    pool.release(batch.table(i)[::-1])
    if states is not None:
        states.release([int(batch.cols[i, STATE])])
    return seq


def admit(pool: PoolChanges, states: StateChanges | None, seq: Seq, budget: int,
          c: SchedulerConfig, known: KnownPrefix | None = None) -> Admission | None:
    """Start a waiting sequence, or None if it must wait (not enough budget, blocks or, for a
    hybrid model, state slots). ``known``: an earlier admission of this step's prefix hits
    (see ``find_cached_prefix``)."""
    bs = c.block_size
    hits: list[int] = []
    if c.enable_prefix_caching:
        data, width = token_bytes(seq.token_array()), 4 * bs
    # A request for prompt logprobs reads nothing from the cache, as in vLLM: cached positions
    # would have no logits (it still caches the blocks it computes).
    if c.enable_prefix_caching and seq.params.prompt_logprobs is None:
        # Leave at least one token to compute, so that there are logits to sample from.
        limit = (seq.num_tokens - 1) // bs
        hits = find_cached_prefix(pool, seq.block_hashes, data, limit, known)
    restored, save_at = None, 0
    if states is not None:
        num_kv_hits = len(hits)
        if hits:  # a prefix is usable only as far as a saved state reaches
            usable, restored = states.find(seq.block_hashes, data, num_kv_hits, bs)
            hits = hits[:usable]
        if c.enable_prefix_caching:
            save_at = first_save_point(states, seq, len(hits), num_kv_hits, c)
        if not (states.can_take() or restored is not None):
            return None
    cached = len(hits) * bs
    count = seq.num_tokens - cached
    if save_at:
        count = min(count, save_at - cached)
    if count > budget:
        if not c.enable_chunked_prefill:
            return None
        count = budget
    free_hits = pool.num_unowned(hits)
    needed = blocks_for(cached + count, bs) - len(hits)
    if needed > pool.num_free - free_hits:
        return None
    pool.take_cached(hits)
    blocks = hits + pool.allocate(needed)
    if c.enable_prefix_caching:  # now, so that the sequences admitted next can hit them
        full = range(len(hits), min(cached + count, seq.num_tokens) // bs)
        hashes = seq.block_hashes
        pool.cache_many([blocks[b] for b in full], [hashes[b] for b in full],
                        [parent_hash_of(hashes, b) for b in full],
                        [data[b * width:(b + 1) * width] for b in full])
    state_slot = -1 if states is None else _working_slot(states, seq, restored, len(hits))
    return Admission(seq, blocks, cached, count,
                     KnownPrefix(seq.block_hashes, data, hits) if hits else None,
                     state_slot, restored, save_at)


def _working_slot(states: StateChanges, seq: Seq, restored: SavedState | None,
                  num_hits: int) -> int:
    """A starting hybrid sequence's state slot (``admit`` checked there is one): a free slot,
    or an evicted saved state's, never that of the state it starts from, unless no other is
    left: then it works in that one, and starts with no copy (``_plan`` sees the slots equal)."""
    if restored is None:
        return states.take()
    key = seq.block_hashes[num_hits - 1]
    states.restore(key)
    slot = states.take(keep=key)
    return states.adopt(key) if slot is None else slot


def first_save_point(states: StateChanges, seq: Seq, num_hits: int, num_kv_hits: int,
                     c: SchedulerConfig) -> int:
    """Where a starting hybrid sequence first saves its recurrent state for the prefix cache
    (0: nowhere): the end of the prefix its cached KV blocks reach past its usable saved
    states (a prefix shared with earlier prompts), else the last full block of its tokens.
    Not where a state is saved already; without chunked prefill, only at its last token."""
    bs = c.block_size
    points = [num_kv_hits * bs] if num_kv_hits > num_hits else []
    points.append(seq.num_tokens // bs * bs)
    for point in points:
        if (point > num_hits * bs and (c.enable_chunked_prefill or point == seq.num_tokens)
                and not states.holds(seq.block_hashes[point // bs - 1])):
            return point
    return 0


def _write_new_blocks(store: SeqStore, cols: np.ndarray, grow: np.ndarray, blocks: list[int],
                      admissions: list[Admission], key: object) -> tuple[SeqStore, np.ndarray]:
    """The running rows' new blocks written to their tables, with rows to spare for the
    admitted sequences (whose rows are wide enough for all they hold)."""
    grown = np.flatnonzero(grow)
    widths = (max((a.seq.num_tokens for a in admissions), default=0),
              max((len(a.blocks) for a in admissions), default=0),
              max((len(a.seq.block_hashes) for a in admissions), default=0))
    store, cols = with_room(store, cols, TABLES, grown, grow[grown], len(admissions), widths,
                            key)
    if len(grown):
        lengths = cols[grown, NUM_BLOCKS]
        if (grow[grown] == 1).all():  # a decode step: at most a block each
            store.append(TABLES, cols[grown, ROW], lengths, np.array(blocks, np.int64))
        else:
            first = 0
            for i, length in zip(grown.tolist(), lengths.tolist()):
                store.extend(TABLES, int(cols[i, ROW]), length, blocks[first:first + grow[i]])
                first += int(grow[i])
        cols[:, NUM_BLOCKS] += grow
    return store, cols


def _append_admitted(store: SeqStore, cols: np.ndarray, admissions: list[Admission], slots,
                     next_serial: int, c: SchedulerConfig):
    """The admitted sequences as new rows (columns, and store rows holding their tokens,
    blocks and hashes); they take slots and serials."""
    if not admissions:
        return cols, slots
    rows = store.take_rows(len(admissions)).tolist()
    new = []
    for k, (a, row) in enumerate(zip(admissions, rows)):
        seq, p = a.seq, a.seq.params
        store.extend(TOKENS, row, 0, seq.token_array())
        store.extend(TABLES, row, 0, a.blocks)
        store.extend(HASHES, row, 0, np.array(seq.block_hashes, np.uint64))
        new.append((next_serial + k, slots.first, row, seq.num_tokens, a.num_cached,
                    len(a.blocks), len(seq.block_hashes), seq.num_prompt_tokens,
                    length_limit(p, seq.num_prompt_tokens, c.max_model_len), p.min_tokens,
                    p.ignore_eos, bool(p.stop_token_ids), p.waits_for_token, seq.num_preemptions,
                    a.num_cached, a.state_slot, a.save_at))
        slots = slots.rest
    admitted = np.zeros((len(admissions), NUM_COLS), np.int64)
    admitted[:, _ADMITTED_COLS] = new
    return np.concatenate([cols, admitted]), slots


# The columns an admission sets, in the order ``_append_admitted`` lists them (the others: 0).
_ADMITTED_COLS = [SERIAL, SLOT, ROW, NUM_TOKENS, NUM_COMPUTED, NUM_BLOCKS, NUM_HASHED, NUM_PROMPT,
                  LENGTH_LIMIT, MIN_TOKENS, IGNORE_EOS, HAS_STOP_IDS, WAITS_FOR_TOKEN,
                  NUM_PREEMPTIONS, NUM_CACHED, STATE, SAVE_AT]


def _plan(step: int, store: SeqStore, key: object, cols: np.ndarray, counts: np.ndarray,
          grow: np.ndarray, blocks: list[int], ids: tuple[str, ...], specs: tuple,
          admissions: list[Admission], pool: PoolChanges, states: StateChanges | None,
          c: SchedulerConfig):
    """Count the scheduled tokens as computed (and their sampled tokens as pending), record
    the blocks they fill in the prefix cache (and the recurrent states they save), and lay the
    plan out. Returns the new batch, the plan, and the serials of the sampling sequences."""
    starts = cols[:, NUM_COMPUTED].copy()
    everyone = len(counts) > 0 and bool(counts.all())  # (all() of nothing is true)
    scheduled = slice(None) if everyone else np.flatnonzero(counts)
    if not everyone and not len(scheduled):
        return RunningBatch(frozen(cols), specs, ids, store, key), empty_plan(step), None
    known = cols[:, NUM_TOKENS]
    sample = (starts + counts == known + cols[:, NUM_PENDING])[scheduled]
    token_ids = _gather_tokens(store, cols[scheduled, ROW], starts[scheduled], counts[scheduled],
                               known[scheduled])
    cols[:, NUM_COMPUTED] = starts + counts
    indices = np.arange(len(cols))[scheduled]
    sampling = indices[sample]
    cols[sampling, NUM_PENDING] += 1
    if c.enable_prefix_caching:
        cache_computed_blocks(store, cols[:len(cols) - len(admissions)], starts, pool,
                               c.block_size)
    index_in_plan = np.full(len(cols), -1)
    index_in_plan[scheduled] = np.arange(len(indices))
    saves = (save_states(store, cols, states, index_in_plan, c.block_size)
             if states is not None and cols[:, SAVE_AT].any() else ())
    new_batch = RunningBatch(frozen(cols), specs, ids, store, key)
    num_running = len(cols) - len(admissions)
    num_decode = int(np.count_nonzero(
        (counts[scheduled] == 1) & (starts[scheduled] >= cols[scheduled, NUM_PROMPT])))
    plan = BatchPlan(
        step=step,
        seq_ids=ids if everyone else tuple(itertools.compress(ids, (counts > 0).tolist())),
        slots=cols[scheduled, SLOT].copy(),
        start_pos=starts[scheduled],
        num_scheduled=counts[scheduled].copy(),
        sample=sample,
        token_ids=token_ids,
        block_entries=_block_entries(cols, grow, blocks, admissions, index_in_plan, num_running),
        num_decode_tokens=num_decode,
        started=tuple(SeqStart(int(cols[num_running + k, SLOT]), a.seq.seq_id, a.seq.params,
                               a.seq.num_prompt_tokens, a.state_slot)
                      for k, a in enumerate(admissions)),
        banned=_banned(new_batch, sampling, index_in_plan, c),
        histories=_histories(new_batch, sampling, index_in_plan),
        prompt_logprobs=(_prompt_logprobs(new_batch, starts, counts, index_in_plan)
                         if num_decode < len(token_ids) else ()),  # only prompt chunks have any
        state_restores=tuple((a.restored.slot, a.state_slot) for a in admissions
                             if a.restored is not None and a.restored.slot != a.state_slot),
        state_saves=saves,
    )
    return new_batch, plan, cols[sampling, SERIAL]


def save_states(store: SeqStore, cols: np.ndarray, states: StateChanges,
                index_in_plan: np.ndarray, bs: int) -> tuple[tuple[int, int], ...]:
    """``(plan index, slot)`` for each hybrid sequence whose computed tokens reach its save
    point (``SAVE_AT``) in this step: its state there is saved under the hash of its last full
    block (when a slot can be had). Its next save point is the last full block of its tokens,
    if that lies further and holds no saved state; else none (``cols`` is updated)."""
    saves = []
    for i in np.flatnonzero(cols[:, SAVE_AT] == cols[:, NUM_COMPUTED]).tolist():
        point, row = int(cols[i, SAVE_AT]), int(cols[i, ROW])
        hashes = store.arrays[HASHES][row]
        slot = states.save(int(hashes[point // bs - 1]), point,
                           token_bytes(store.arrays[TOKENS][row, :point]))
        if slot is not None:
            saves.append((int(index_in_plan[i]), slot))
        end = int(cols[i, NUM_TOKENS]) // bs * bs
        later = end > point and not states.holds(int(hashes[end // bs - 1]))
        cols[i, SAVE_AT] = end if later else 0
    return tuple(saves)


def _banned(batch: RunningBatch, sampling: np.ndarray, index_in_plan: np.ndarray,
            c: SchedulerConfig) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(plan index, token ids)`` for the sampling sequences that may not sample some tokens:
    stopping ones before ``min_tokens`` (``policy.banned_token_ids``), and the last tokens of
    bad words they would complete."""
    cols, specs = batch.cols, batch.specs
    banned: dict[int, tuple[int, ...]] = {}
    min_tokens = cols[sampling, MIN_TOKENS]
    if min_tokens.any():
        before = cols[sampling, NUM_COMPUTED] - cols[sampling, NUM_PROMPT]
        held = ~may_stop_next(before, min_tokens)  # (the policy decides for these alone)
        for i, num_before in zip(sampling[held].tolist(), before[held].tolist()):
            banned[i] = banned_token_ids(specs[i].params, num_before, c.eos_token_ids)
    waiting = (sampling[cols[sampling, WAITS_FOR_TOKEN] != 0].tolist()
               if cols[:, WAITS_FOR_TOKEN].any() else [])
    for i in waiting:
        bad_words = specs[i].params.bad_words_token_ids
        if bad_words:  # a word's end is matched against the output's last tokens alone
            tokens = batch.tokens(i)
            start = max(int(cols[i, NUM_PROMPT]), len(tokens) - max(map(len, bad_words)) + 1)
            banned[i] = banned.get(i, ()) + bad_word_bans(bad_words, tokens[start:].tolist())
    return tuple((int(index_in_plan[i]), ids) for i, ids in sorted(banned.items()) if ids)


def _histories(batch: RunningBatch, sampling: np.ndarray,
               index_in_plan: np.ndarray) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(plan index, all token ids)`` for the sampling sequences whose penalties need them."""
    with_history = batch.cols[sampling, WAITS_FOR_TOKEN] != 0
    if not with_history.any():
        return ()
    return tuple((int(index_in_plan[i]), tuple(batch.tokens(i).tolist()))
                 for i in sampling[with_history].tolist() if batch.specs[i].params.has_penalties)


def _prompt_logprobs(batch: RunningBatch, starts: np.ndarray, counts: np.ndarray,
                     index_in_plan: np.ndarray) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """``(plan index, top k, target token ids)`` for the scheduled prompt chunks of sequences
    that want prompt logprobs: the logits at positions ``p`` of the chunk give the logprob of
    prompt token ``p + 1`` (so a chunk ending the prompt has one target fewer than tokens)."""
    num_prompt = batch.cols[:, NUM_PROMPT]
    in_prompt = np.flatnonzero((counts > 0) & (starts < num_prompt - 1))
    entries = []
    for i in in_prompt.tolist():
        k = batch.specs[i].params.prompt_logprobs
        if k is not None:
            start, end = int(starts[i]), min(int(starts[i] + counts[i]), int(num_prompt[i]) - 1)
            targets = batch.specs[i].prompt_token_ids[start + 1:end + 1]
            entries.append((int(index_in_plan[i]), k, targets))
    return tuple(entries)


def _gather_tokens(store: SeqStore, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                   known: np.ndarray) -> np.ndarray:
    """The ids of the scheduled positions laid end to end; ``PENDING_TOKEN`` past the known."""
    if int(counts.sum()) != len(counts):
        rows, known = np.repeat(rows, counts), np.repeat(known, counts)
        starts = np.repeat(starts, counts) + _counting_up(counts)
    tokens = store.arrays[TOKENS][rows, np.minimum(starts, known - 1)]
    tokens[starts >= known] = PENDING_TOKEN
    return tokens


def cache_computed_blocks(store: SeqStore, cols: np.ndarray, starts: np.ndarray,
                           pool: PoolChanges, bs: int) -> None:
    """Record in the prefix cache the blocks of running sequences that became full of
    computed, known tokens in this step (their hashes were taken when they filled with known
    tokens; admitted sequences recorded theirs at admission)."""
    known = cols[:, NUM_TOKENS]
    starts = starts[:len(cols)]
    if not (starts < known).any():  # only pending tokens computed (async decode): none filled
        return
    old = np.minimum(starts, known) // bs
    # Only hashed blocks: the pending ones are cached when hashed (filled.py).
    new = np.minimum(np.minimum(cols[:, NUM_COMPUTED], known) // bs, cols[:, NUM_HASHED])
    rows = np.flatnonzero(new > old)
    if not len(rows):
        return
    counts = (new - old)[rows]
    store_rows = np.repeat(cols[rows, ROW], counts)
    index = np.repeat(old[rows], counts) + _counting_up(counts)
    parents = np.where(index > 0, store.arrays[HASHES][store_rows, np.maximum(index - 1, 0)], 0)
    tokens = store.arrays[TOKENS][store_rows[:, None], index[:, None] * bs + np.arange(bs)]
    pool.cache_many(store.arrays[TABLES][store_rows, index].tolist(),
                    store.arrays[HASHES][store_rows, index].tolist(), parents.tolist(),
                    [row.tobytes() for row in np.ascontiguousarray(tokens, dtype="<u4")])


def _block_entries(cols: np.ndarray, grow: np.ndarray, blocks: list[int],
                   admissions: list[Admission], index_in_plan: np.ndarray,
                   num_running: int) -> np.ndarray:
    """``(plan index, column, block)`` for every block-table entry new in this step."""
    if not blocks and not admissions:
        return NO_ENTRIES
    grown = np.flatnonzero(grow)
    if not admissions and len(blocks) == len(grown):  # a decode step: one block each
        return entry_rows(index_in_plan[grown], cols[grown, NUM_BLOCKS] - 1, blocks)
    parts = []
    if len(grown):
        counts = grow[grown]
        first = np.repeat(cols[grown, NUM_BLOCKS] - counts, counts)
        parts.append(entry_rows(np.repeat(index_in_plan[grown], counts),
                                first + _counting_up(counts), blocks))
    if admissions:
        lengths = np.array([len(a.blocks) for a in admissions], np.int64)
        parts.append(entry_rows(
            np.repeat(index_in_plan[num_running:], lengths), _counting_up(lengths),
            np.fromiter(itertools.chain.from_iterable(a.blocks for a in admissions), np.int64,
                        int(lengths.sum()))))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def entry_rows(plan_indices: np.ndarray, columns: np.ndarray, blocks) -> np.ndarray:
    """Block entries ``(plan index, column, block)`` from their three columns (``np.stack``
    costs several times more)."""
    out = np.empty((len(columns), 3), np.int64)
    out[:, 0], out[:, 1], out[:, 2] = plan_indices, columns, blocks
    return out


def _counting_up(counts: np.ndarray) -> np.ndarray:
    """``0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ..``: each run's offsets."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
