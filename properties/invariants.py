"""The invariants of DESIGN.md as checks over a state and the plan that came with it."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection
from itertools import chain

from nanofn.state import PENDING_TOKEN, BatchPlan, EngineState, FinishReason, Seq, SeqStatus
from nanofn.state.batch import SLOT
from nanofn.state.hashing import block_hash, block_hashes
from nanofn.state.policy import stop_token_ids


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def check_block_accounting(state: EngineState) -> None:
    """1. Every block is free or owned; reference counts equal holders; free + owned = total."""
    pool = state.pool
    holders = Counter(b for seq in state.running for b in seq.block_table)
    for block, count in enumerate(pool.ref_counts):
        assert count == holders.get(block, 0), f"block {block}: ref {count}, holders {holders.get(block, 0)}"
    plain = list(pool.plain_free)
    lru = list(pool.cached_free())
    cached = dict(pool.cached_blocks())
    assert len(plain) == pool.num_plain_free
    assert len(lru) == pool.num_cached_free
    free = plain + lru
    assert len(free) == len(set(free)), "a block is free twice"
    assert set(free) == {b for b, c in enumerate(pool.ref_counts) if c == 0}
    assert len(free) + sum(1 for c in pool.ref_counts if c) == pool.num_blocks
    assert all(b in cached for b in lru), "a block in the LRU queue is not cached"
    assert not any(b in cached for b in plain), "a plain free block is cached"
    assert len(pool.by_hash) == len(cached)
    for h, block in pool.by_hash.items():
        assert cached[block].block_hash == h
    assert all(pool.by_hash.get(e.block_hash) == b for b, e in cached.items())


def check_sharing(state: EngineState) -> None:
    """2. Two sequences share a block only if it is full and their prefixes up to it are equal."""
    bs = state.config.block_size
    where = defaultdict(list)
    for seq in state.running:
        for i, block in enumerate(seq.block_table):
            where[block].append((seq, i))
    for block, places in where.items():
        if len(places) < 2:
            continue
        indexes = {i for _, i in places}
        assert len(indexes) == 1, f"block {block} at different indexes {indexes}"
        (i,) = indexes
        end = (i + 1) * bs
        assert all(seq.num_computed >= end for seq, _ in places), f"shared block {block} not full"
        prefixes = {tuple(seq.token_ids[:end]) for seq, _ in places}
        assert len(prefixes) == 1, f"block {block} shared by different prefixes"


def check_sequences(state: EngineState) -> None:
    """3 and 6. A running sequence has exactly the blocks its computed tokens need; waiting and
    finished ones hold none; every live sequence is in exactly one queue."""
    bs = state.config.block_size
    for seq in state.running:
        assert seq.status is SeqStatus.RUNNING
        assert len(seq.block_table) == blocks_for(seq.num_computed, bs), seq.seq_id
        assert seq.num_computed <= seq.num_positions <= state.config.max_model_len
    for seq in state.waiting:
        assert seq.status is SeqStatus.WAITING
        assert len(seq.block_table) == 0 and seq.num_computed == 0, seq.seq_id
    for seq in state.finished:
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason is not None
        assert len(seq.block_table) == 0, f"finished {seq.seq_id} holds blocks"
        assert seq.seq_id not in state.live_ids
    ids = [s.seq_id for s in state.running] + [s.seq_id for s in state.waiting]
    assert len(ids) == len(set(ids)), "a sequence is queued twice"
    assert set(ids) == set(state.live_ids)
    assert len(state.running) <= state.config.max_num_seqs


def check_plan(state: EngineState, plan: BatchPlan) -> None:
    """4. The plan respects the limits, and says exactly what the state scheduled; and a step
    that preempts admits no one (DESIGN's scheduling policy: waiting sequences start only in
    a step that preempted no one)."""
    c = state.config
    assert plan.step == state.step
    assert not (state.preempted and plan.started), (
        f"admitted {[s.seq_id for s in plan.started]} in a step that preempted {state.preempted}")
    entries = plan.entries()
    assert len(entries) <= c.max_num_seqs
    assert plan.num_tokens <= c.max_num_batched_tokens
    ids = [s.seq_id for s in entries]
    assert len(ids) == len(set(ids))
    running = {seq.seq_id: seq for seq in state.running}
    slots = dict(zip(state.batch.ids, state.batch.col(SLOT).tolist()))
    assert len(set(slots.values())) == len(slots), "two running sequences share a slot"
    assert not set(slots.values()) & set(state.free_slots), "a running sequence's slot is free"
    assert len(slots) + len(state.free_slots) == c.max_num_seqs
    for s in entries:
        seq = running[s.seq_id]
        assert s.num_tokens >= 1
        assert s.context_len <= c.max_model_len
        assert s.context_len == seq.num_computed
        known = tuple(seq.token_ids[s.start_pos:s.context_len])
        pending = s.context_len - s.start_pos - len(known)
        assert pending in (0, 1) and s.token_ids == known + (PENDING_TOKEN,) * pending
        if pending:  # only the last token, and never for one that needs it (history, grammars)
            assert s.sample and not seq.params.waits_for_token
        if s.sample:
            assert seq.num_uncomputed == 1 and seq.num_pending >= 1
        assert s.slot == slots[s.seq_id]
        if not c.enable_chunked_prefill:
            assert s.sample or pending, "a chunk without chunked prefill"
    assert (state.undelivered[-1].seq_ids if entries else ()) == plan.sampling_seq_ids
    assert {s.seq_id for s in plan.started} <= set(ids)
    check_prompt_logprobs(plan, entries, running)


def check_prompt_logprobs(plan: BatchPlan, entries, running: dict) -> None:
    """Every scheduled prompt position of a sequence that wants prompt logprobs, except the
    prompt's last, asks for the logprob of the prompt token after it; nothing else does."""
    asked = {plan.seq_ids[i]: (k, targets) for i, k, targets in plan.prompt_logprobs}
    for s in entries:
        seq = running[s.seq_id]
        prompt, k = seq.spec.prompt_token_ids, seq.params.prompt_logprobs
        end = min(s.context_len, len(prompt) - 1)
        if k is None or s.start_pos >= end:
            assert s.seq_id not in asked
        else:
            assert asked[s.seq_id] == (k, prompt[s.start_pos + 1:end + 1])


def check_hashes(state: EngineState) -> None:
    """Every cached block's hash is the chained hash of what it holds, and every record's
    block hashes are those of its tokens (a running one's may lag: hashing is lazy)."""
    for block, entry in state.pool.cached_blocks():
        assert block_hash(entry.parent_hash, entry.token_ids) == entry.block_hash, block
    if not state.config.enable_prefix_caching:
        return
    bs = state.config.block_size
    for seq in (*state.running, *state.waiting, *state.finished):
        expected = block_hashes(seq.token_ids, bs)
        if seq.status is SeqStatus.RUNNING:
            expected = expected[:len(seq.block_hashes)]
        assert seq.block_hashes == expected, f"{seq.seq_id}: wrong block hashes"


def check_release_order(old: EngineState, new: EngineState) -> None:
    """The cached free blocks queue for eviction least recently freed first: those queued
    before the step, then those it freed, in the order their last holder gave them back. The
    sequences that left the batch did so in the order ``finished`` then ``preempted`` list
    them, each giving back its block table from the last block to the first, so that its
    last blocks are evicted first and its prefix stays cached longest. (Blocks the step took
    back out of the queue, by a prefix hit, an eviction or a dirty mark, are out of it.)"""
    tables = {seq.seq_id: seq.block_table for seq in old.running}
    holders = list(old.pool.ref_counts)
    freed = []
    for seq_id in chain((seq.seq_id for seq in new.finished), new.preempted):
        for block in reversed(tables.get(seq_id, ())):
            holders[block] -= 1
            if not holders[block]:
                freed.append(block)
    queued = list(new.pool.cached_free())
    still = set(queued)
    expected = [block for block in chain(old.pool.cached_free(), freed) if block in still]
    assert queued == expected, f"eviction order {queued}, expected {expected}"


def check_output(seq: Seq, stop_hits: Collection[int], max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> None:
    """A finished sequence's output means what its parameters say. ``stop_hits``: the counts
    of output tokens at which the shell reported a stop string. No token before the last
    would have stopped it; it stopped (reason ``stop``) exactly when its last token was a stop
    token, EOS (unless it ignores EOS) or completed a stop string, past ``min_tokens``; a
    ``length`` finish is at ``max_tokens`` or ``max_model_len``; and within ``min_tokens`` it
    sampled no token that stops (the core bans them; a grammar's own mask aside, which the
    fake runner does not apply)."""
    p, output, reason = seq.params, seq.output_token_ids, seq.finish_reason
    stopping = stop_token_ids(p, eos_token_ids)

    def stops_at(count: int) -> bool:
        return count > p.min_tokens and (output[count - 1] in stopping or count in stop_hits)

    n = len(output)
    assert not any(stops_at(k) for k in range(1, n)), f"{seq.seq_id} went on past a stop: {output}"
    assert (n > 0 and stops_at(n)) == (reason is FinishReason.STOP), (
        f"{seq.seq_id} finished ({reason.value}) at {n} tokens: {output}")
    if reason is FinishReason.LENGTH:
        assert n == p.max_tokens or seq.num_tokens == max_model_len, f"{seq.seq_id}: length at {n}"
    assert n <= (p.max_tokens or n) and seq.num_tokens <= max_model_len
    if p.structured_outputs is None:
        early = [t for t in output[:p.min_tokens] if t in stopping]
        assert not early, f"{seq.seq_id} sampled {early} before min_tokens={p.min_tokens}"


def check_state_slots(state: EngineState, plan: BatchPlan) -> None:
    """The second resource (a hybrid model's recurrent-state slots): free + working + saved =
    all slots, each slot in one place; each running sequence holds exactly one, waiting and
    finished ones none; a starting sequence's plan names its slot, a restore writes only a
    starting sequence's slot, and a save goes to a saved state of the end of that
    sequence's chunk, a whole number of blocks. No slot is written twice in one plan: the
    runner makes a plan's copies as one indexed copy, whose order for a repeated target is
    undefined on a GPU."""
    states = state.states
    waiting_or_done = (*state.waiting, *state.finished)
    assert all(seq.state_slot == -1 for seq in waiting_or_done), "a waiting sequence holds a slot"
    if states is None:
        assert all(seq.state_slot == -1 for seq in state.running)
        assert not plan.state_restores and not plan.state_saves
        return
    working = {seq.seq_id: seq.state_slot for seq in state.running}
    saved = {entry.slot: entry for _, entry in states.saved.items()}
    everyone = list(states.free) + list(working.values()) + list(saved)
    assert sorted(everyone) == list(range(states.num_slots)), (
        f"free {states.free}, working {working}, saved {sorted(saved)}")
    assert len(states.saved) == len(saved), "two saved states in one slot"
    started = {s.seq_id: s.state_slot for s in plan.started}
    assert all(working[seq_id] == slot for seq_id, slot in started.items())
    assert {target for _, target in plan.state_restores} <= set(started.values()), (
        "a restore into a slot no starting sequence works in")
    for copies in (plan.state_restores, plan.state_saves):
        targets = [target for _, target in copies]
        assert len(set(targets)) == len(targets), f"a slot written twice in one plan: {copies}"
    ends = plan.start_pos + plan.num_scheduled
    for i, target in plan.state_saves:
        entry = saved.get(target)
        assert entry is not None and entry.num_tokens == ends[i], (
            f"save of {plan.seq_ids[i]} to slot {target}: {entry}")
        assert ends[i] % state.config.block_size == 0


def check_all(state: EngineState, plan: BatchPlan) -> None:
    check_state_slots(state, plan)
    check_block_accounting(state)
    check_hashes(state)
    check_sharing(state)
    check_sequences(state)
    check_plan(state, plan)
