"""Example-based tests of the pure core's policies (the properties/ suite checks invariants)."""

from __future__ import annotations

import ast
import copy
import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanofn.state import (Events, FinishReason, InvalidRequest, NewSeq, SamplingParams,
                          SchedulerConfig, TraceError, check_new_seq, figures,
                          header_line, initial_state, parse_trace, replay, step, step_line)
from nanofn.state.block_pool import (BULK_RELEASE, CachedBlock, KnownPrefix, PoolChanges,
                                    find_cached_prefix, new_block_pool)
from nanofn.state.decode import decode_step
from nanofn.state.engine_state import EngineState, evolve
from nanofn.state.hashing import (ROOT_HASH, block_hash, block_hashes, block_hashes_sharing,
                                  token_bytes)
from nanofn.state.plan import PENDING_TOKEN
from nanofn.state.policy import banned_token_ids, may_stop, stops_on
from nanofn.state.step import full_step
from nanofn.state.store import TABLES, TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@dataclass(frozen=True)
class Setup:
    config: SchedulerConfig
    num_blocks: int


def config(num_blocks=16, **overrides) -> Setup:
    base = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                enable_prefix_caching=True, enable_chunked_prefill=True, eos_token_ids=(0,),
                vocab_size=None)
    return Setup(SchedulerConfig(**{**base, **overrides}), num_blocks)


def start(setup: Setup):
    return initial_state(setup.config, setup.num_blocks)


def deliver(state, token=5):
    """The tokens of the oldest undelivered plan, all ``token``; None if none is awaited."""
    return (token,) * len(state.undelivered[0]) if state.undelivered else None


def run(state, sampled_token=5, **events):
    return step(state, Events(sampled=deliver(state, sampled_token), **events))


def request(rid: str, prompt, params=GREEDY) -> NewSeq:
    return NewSeq(rid, tuple(prompt), params)


# --- purity -----------------------------------------------------------------------------

def test_importing_the_core_loads_no_torch():
    code = "import sys, nanofn.state; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_core_imports_nothing_impure():
    """An allowlist: records, pure data structures, numpy arrays, hashing and JSON; no torch,
    clocks, randomness, files, processes or logging."""
    allowed = {"__future__", "array", "collections", "dataclasses", "enum", "functools", "itertools",
               "json", "struct", "typing", "numpy", "pyrsistent", "xxhash", "nanofn"}
    core = pathlib.Path(__file__).parent.parent / "nanofn" / "state"
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                assert not name.startswith("nanofn.") or name.startswith("nanofn.state"), \
                    f"{path.name} imports {name} from outside the core"


# --- block pool ---------------------------------------------------------------------------

def allocate(pool, count):
    changes = PoolChanges(pool)
    blocks = changes.allocate(count)
    return changes.build(), tuple(blocks)


def release(pool, blocks):
    changes = PoolChanges(pool)
    changes.release(blocks)
    return changes.build()


def cache_block(pool, block, entry):
    changes = PoolChanges(pool)
    changes.cache(block, entry)
    return changes.build()


def test_allocation_takes_plain_blocks_before_evicting_cached_ones_least_recent_first():
    pool = new_block_pool(4)
    pool, (a, b, c, d) = allocate(pool, 4)
    for block, token in ((a, 1), (b, 2)):
        pool = cache_block(pool, block, CachedBlock(block_hash(ROOT_HASH, [token]), ROOT_HASH,
                                                    token_bytes([token])))
    pool = release(pool, [b, c, a, d])  # b is freed before a: b is the least recently used
    assert pool.num_free == 4 and pool.num_plain_free == 2
    pool, first_two = allocate(pool, 2)
    assert set(first_two) == {c, d}
    assert len(pool.by_hash) == 2  # no cached block evicted yet
    pool, (third,) = allocate(pool, 1)
    assert third == b and len(pool.by_hash) == 1
    pool, (fourth,) = allocate(pool, 1)
    assert fourth == a and len(pool.by_hash) == 0


def test_block_hashes_chain_each_block_to_its_prefix():
    """Equal blocks behind different prefixes hash differently; a prompt's hashes are each
    block's ``block_hash`` under the one before."""
    tokens = [5, 6, 7, 8, 1, 2, 1, 2]
    hashes = block_hashes(tokens, 2)
    assert hashes[2] != hashes[3]  # the same block [1, 2], after different prefixes
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        assert h == block_hash(parent, tokens[2 * i:2 * i + 2])
        parent = h


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40),
       st.integers(0, 40))
def test_hashes_taken_from_a_known_sequence_are_the_sequences_own(a, b, shared):
    """A common start, then other tokens (from a small alphabet: they may match too)."""
    known, ids = np.array(b, np.int64), np.array(b[:shared] + a, np.int64)
    assert block_hashes_sharing(ids, 4, known, block_hashes(b, 4)) == block_hashes(ids, 4)
    assert block_hashes_sharing(ids, 4, None, ()) == block_hashes(ids, 4)


def test_a_hash_hit_is_confirmed_against_the_stored_tokens():
    pool = new_block_pool(2)
    pool, (block,) = allocate(pool, 1)
    h = block_hash(ROOT_HASH, [1, 2])
    pool = cache_block(pool, block, CachedBlock(h, ROOT_HASH, token_bytes([1, 2])))
    assert find_cached_prefix(PoolChanges(pool), [h], token_bytes([1, 2]), limit=1) == [block]
    # A forged collision: same hash, other tokens. It must not count as a hit.
    assert find_cached_prefix(PoolChanges(pool), [h], token_bytes([3, 4]), limit=1) == []


def test_a_prefix_hit_ends_at_the_first_block_whose_tokens_or_parent_differ():
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, 2)

    def pool_caching(parents):  # block i holds block i of the tokens, after parents[i]
        pool, blocks = allocate(new_block_pool(3), 3)
        for i, (block, h) in enumerate(zip(blocks, hashes)):
            entry = CachedBlock(h, parents[i], token_bytes(tokens[2 * i:2 * i + 2]))
            pool = cache_block(pool, block, entry)
        return PoolChanges(pool), list(blocks)

    pool, blocks = pool_caching([ROOT_HASH, hashes[0], hashes[1]])
    assert find_cached_prefix(pool, hashes, token_bytes(tokens), limit=3) == blocks
    assert find_cached_prefix(pool, hashes, token_bytes(tokens), limit=2) == blocks[:2]
    # forged collisions: block 1's hash over other tokens, block 2's after another parent
    assert find_cached_prefix(pool, hashes, token_bytes([1, 2, 9, 9, 5, 6]), limit=3) == blocks[:1]
    pool, blocks = pool_caching([ROOT_HASH, hashes[0], hashes[1] ^ 1])
    assert find_cached_prefix(pool, hashes, token_bytes(tokens), limit=3) == blocks[:2]


def test_a_prefix_found_earlier_in_the_step_is_reused_only_where_tokens_match():
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, 2)
    pool, blocks = allocate(new_block_pool(3), 3)
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        parent = hashes[i - 1] if i else ROOT_HASH
        pool = cache_block(pool, block, CachedBlock(h, parent, token_bytes(tokens[2 * i:2 * i + 2])))
    changes = PoolChanges(pool)
    known = KnownPrefix(hashes[:2], token_bytes(tokens[:4]), list(blocks[:2]))
    # the known two blocks, then the walk goes on to the third
    assert find_cached_prefix(changes, hashes, token_bytes(tokens), 3, known) == list(blocks)
    # a forged collision: the known sequence's hashes over other tokens take nothing known,
    # and the walk stops where the stored tokens differ
    forged = token_bytes([1, 2, 9, 9, 5, 6])
    assert find_cached_prefix(changes, hashes, forged, 3, known) == [blocks[0]]
    # another prefix: the known one does not apply
    other = block_hashes([7, 8, 3, 4], 2)
    assert find_cached_prefix(changes, other, token_bytes([7, 8, 3, 4]), 2, known) == []


def test_content_evicted_and_cached_again_in_one_step_is_counted_once():
    pool, (a, b) = allocate(new_block_pool(2), 2)
    entry = CachedBlock(block_hash(ROOT_HASH, [1]), ROOT_HASH, token_bytes([1]))
    pool = release(cache_block(pool, a, entry), [a, b])  # a: cached free, b: plain free
    changes = PoolChanges(pool)
    first, second = changes.allocate(2)  # b, then a, whose content leaves the cache
    changes.cache(second, entry)  # and comes back, in the block that computed it again
    pool = changes.build()
    assert (first, second) == (b, a)
    assert len(pool.by_hash) == 1 and pool.by_hash.get(entry.block_hash) == a


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_bulk_release_is_the_release_of_each_block_in_turn(data):
    """From ``BULK_RELEASE`` blocks on, release counts with arrays: it must give the pool
    (counts, the eviction queue's order, the plain stack) of releasing them one at a time."""
    num_blocks = 40
    owners = data.draw(st.lists(st.lists(st.integers(0, num_blocks - 1), min_size=6, max_size=12,
                                         unique=True), min_size=12, max_size=24))
    changes = PoolChanges(new_block_pool(num_blocks))
    changes.allocate(num_blocks)
    for owner in owners:  # a reference for each sequence that holds the block
        changes.take_cached(owner)
    for block in data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=30, unique=True)):
        changes.cache(block, CachedBlock(block_hash(ROOT_HASH, [block]), ROOT_HASH,
                                         token_bytes([block])))
    changes.release(range(num_blocks))  # allocate's references: the unowned go free
    pool = changes.build()
    blocks = [b for owner in data.draw(st.permutations(owners)) for b in reversed(owner)]
    assert len(blocks) >= BULK_RELEASE
    one_by_one = pool
    for block in blocks:
        one_by_one = release(one_by_one, [block])
    assert release(pool, blocks) == one_by_one
    assert release(pool, np.array(blocks)) == one_by_one
    with pytest.raises(ValueError, match="released more often"):
        release(pool, blocks + blocks[-1:])


def test_releasing_a_block_twice_is_an_error():
    pool, (block,) = allocate(new_block_pool(1), 1)
    pool = release(pool, [block])
    with pytest.raises(ValueError, match="released more often"):
        release(pool, [block])


# --- requests -----------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    (request("a", []), "prompt is empty"),
    (request("a", range(1, 125), SamplingParams(max_tokens=8)), "longer than max_model_len 128"),
    (request("a", [1, -1]), "prompt token id -1"),
    (request("a", [1, 1000]), r"prompt token id 1000 is not an integer in \[0, 1000\)"),
    (request("a", [1, 2.0]), "prompt token id 2.0 is not an integer"),
    (request("a", [1, "7"]), "prompt token id '7' is not an integer"),
    (request("a", [1, 2**70]), f"prompt token id {2**70} is not an integer"),
    (request("a", [[1, 2]]), r"prompt token id \[1, 2\] is not an integer"),
    (request("a", [1, [2, 3]]), r"prompt token id \[2, 3\] is not an integer"),
    (request("", [1]), "request_id must be a non-empty string"),
    (request("a", [1], SamplingParams(n=2)), "n=2"),
    (request("a", [1], SamplingParams(stop_token_ids=[5, 1000])), r"stop_token_ids \[1000\] are not"),
])
def test_invalid_requests_are_rejected_with_a_reason(bad, message):
    state = start(config(vocab_size=1000))
    with pytest.raises(InvalidRequest, match=message):
        check_new_seq(state, bad)
    with pytest.raises(InvalidRequest, match=message):
        step(state, Events(new_seqs=(request("ok", [1, 2]), bad)))


def test_a_duplicate_live_id_is_rejected_but_a_finished_id_can_be_reused():
    state, _ = step(start(config()), Events(new_seqs=(request("a", [1, 2]),)))
    with pytest.raises(InvalidRequest, match="'a' is already in use"):
        check_new_seq(state, request("a", [3]))
    state, _ = run(state, aborts=("a",))
    check_new_seq(state, request("a", [3]))


def test_deliveries_must_match_the_plan_they_belong_to():
    state, _ = step(start(config()), Events(new_seqs=(request("a", [1, 2]),)))
    with pytest.raises(ValueError, match="got 2 sampled tokens, the plan they belong to sampled 1"):
        step(state, Events(sampled=(3, 4)))
    with pytest.raises(ValueError, match="no plan is waiting for its tokens"):
        step(start(config()), Events(sampled=()))


def test_a_schedule_with_nothing_to_compute_keeps_the_state():
    """Nobody waits and no running sequence can be scheduled (an idle engine; a prompt whose
    last token is in flight): the schedule is the state itself and an empty plan, the same
    as laying it out in full would give (the state unchanged), at a fraction of the cost."""
    from nanofn.state.scheduler import schedule

    idle = start(config())
    kept, plan = schedule(idle)
    assert kept is idle and plan.is_empty
    one_token = replace(GREEDY, max_tokens=1)
    state, plan = step(idle, Events(new_seqs=(request("a", [1, 2, 3], one_token),)))
    assert not plan.is_empty
    kept, plan = schedule(state)  # its last token is pending: it waits for it
    assert kept is state and plan.is_empty and plan.step == state.step
    waiting = step(state, Events(new_seqs=(request("b", [4, 5]),)))[1]
    assert [s.seq_id for s in waiting.seqs] == ["b"]  # one waiting: the full schedule


def test_dirty_blocks_stay_out_of_the_cache_that_an_aborted_sequence_leaves_them_to():
    """A sequence leaving the batch caches the blocks decoding filled; aborted in the step
    that names those blocks dirty (a failed launch may have written them), it must not put
    them back in the prefix cache."""
    state = step(start(config()), Events(new_seqs=(request("h", range(1, 16)),)))[0]
    state = run(state)[0]  # its 16th token, computed: a full block, hashed once needed
    (seq,) = state.running
    assert seq.num_computed == 16 and not list(state.pool.cached_blocks())
    state = run(state, aborts=("h",), dirty_blocks=seq.block_table)[0]
    assert not list(state.pool.cached_blocks())


def test_a_runner_one_step_ahead_gets_plans_with_pending_tokens():
    """Tokens delivered one plan late: the next plan computes the pending token in place
    (PENDING_TOKEN), and finishing by length never schedules beyond the last token."""
    params = replace(GREEDY, max_tokens=3)
    state, plan = step(start(config()), Events(new_seqs=(request("a", [1, 2]),)))
    state, plan = step(state, Events())  # nothing delivered yet
    (s,) = plan.seqs
    assert (s.token_ids, s.start_pos, s.sample) == ((PENDING_TOKEN,), 2, True)
    assert state.running[0].num_pending == 2
    state, plan = step(state, Events(sampled=(7,)))  # the first plan's token
    assert state.running[0].token_ids[-1] == 7 and plan.seqs[0].start_pos == 3
    state, plan = step(state, Events(sampled=(8,)))
    assert plan.seqs[0].start_pos == 4
    late = step(start(config()), Events(new_seqs=(request("b", [1, 2], params),)))[0]
    late, plan = step(late, Events())
    assert plan.seqs[0].token_ids == (PENDING_TOKEN,)
    late, plan = step(late, Events())
    assert plan.is_empty and late.running[0].num_pending == 2  # at most one pending per plan
    late, plan = step(late, Events(sampled=(4,)))
    assert plan.seqs[0].token_ids == (PENDING_TOKEN,)  # its third and last token is sampled
    late, plan = step(late, Events(sampled=(5,)))
    assert plan.is_empty  # one pending token is its last by max_tokens: nothing beyond it
    late, _ = step(late, Events(sampled=(6,)))
    (seq,) = late.finished
    assert seq.output_token_ids == (4, 5, 6) and seq.finish_reason is FinishReason.LENGTH


# --- finishing ----------------------------------------------------------------------------

def finish_after(tokens, params, cfg=None, prompt=(1, 2, 3)):
    """Feed ``tokens`` as the sampled tokens of one request; return (outputs, reason)."""
    state, _ = step(start(cfg or config()), Events(new_seqs=(request("a", prompt, params),)))
    for token in tokens:
        state, _ = step(state, Events(sampled=(token,)))
        if state.finished:
            (seq,) = state.finished
            assert not seq.block_table and state.pool.num_free == state.pool.num_blocks
            return seq.output_token_ids, seq.finish_reason
    return None


def test_eos_stops_unless_ignored():
    assert finish_after([4, 0, 4], GREEDY) == ((4, 0), FinishReason.STOP)
    assert finish_after([4, 0, 4], replace(GREEDY, ignore_eos=True, max_tokens=3)) == \
        ((4, 0, 4), FinishReason.LENGTH)


def test_stop_token_ids_and_min_tokens():
    params = replace(GREEDY, stop_token_ids=(9,), min_tokens=3)
    assert finish_after([9, 0, 5, 9], params) == ((9, 0, 5, 9), FinishReason.STOP)
    assert finish_after([5, 9], replace(params, min_tokens=0)) == ((5, 9), FinishReason.STOP)


def test_min_tokens_is_the_first_token_that_may_stop_minus_one():
    """The min_tokens boundary, pinned: with min_tokens=2 the 3rd token is the first that may
    stop, whether it is EOS, a stop token id or the end of a stop string; and exactly the
    samples before it are told not to be a stopping token."""
    params = replace(GREEDY, stop_token_ids=(9,), min_tokens=2)
    assert finish_after([0, 9, 0, 4], params) == ((0, 9, 0), FinishReason.STOP)
    assert finish_after([9, 9, 9, 4], params) == ((9, 9, 9), FinishReason.STOP)
    state, plan = step(start(config()), Events(new_seqs=(request("a", [1, 2], params),)))
    banned = [plan.seqs[0].banned_token_ids]
    for token in (4, 4, 4):
        state, plan = step(state, Events(sampled=(token,), stop_hits=("a",)))
        banned.append(plan.seqs[0].banned_token_ids if plan.seqs else None)
    assert banned == [(9, 0), (9, 0), (), None]  # the 3rd token's stop hit finished it
    assert state.finished[0].output_token_ids == (4, 4, 4)


def test_the_stopping_policy_has_one_definition():
    params = SamplingParams(min_tokens=1, stop_token_ids=(7,))
    assert [may_stop(n, params.min_tokens) for n in (1, 2)] == [False, True]
    assert banned_token_ids(params, 0, (2,)) == (7, 2)
    assert banned_token_ids(params, 1, (2,)) == ()
    assert banned_token_ids(replace(params, ignore_eos=True), 0, (2,)) == (7,)
    assert stops_on(2, params, (2,)) and not stops_on(2, replace(params, ignore_eos=True), (2,))


def test_max_tokens_and_max_model_len():
    assert finish_after([4] * 10, replace(GREEDY, max_tokens=2)) == ((4, 4), FinishReason.LENGTH)
    short = config(max_model_len=32, num_blocks=2)
    result = finish_after([4] * 40, replace(GREEDY, max_tokens=None), short, prompt=range(1, 30))
    assert result == ((4, 4, 4), FinishReason.LENGTH)


def test_a_stop_string_finishes_after_taking_its_token():
    state, _ = step(start(config()), Events(new_seqs=(request("a", [1, 2]),)))
    state, plan = step(state, Events(sampled=(7,), stop_hits=("a",)))
    assert plan.is_empty
    (seq,) = state.finished
    assert seq.output_token_ids == (7,) and seq.finish_reason is FinishReason.STOP


def test_abort_works_on_waiting_and_running_sequences_and_ignores_unknown_ids():
    cfg = config(max_num_seqs=1)
    state, _ = step(start(cfg), Events(new_seqs=(request("a", [1]), request("b", [2]))))
    assert [s.seq_id for s in state.running] == ["a"] and len(state.waiting) == 1
    state, plan = run(state, aborts=("b", "nobody"))
    assert [s.seq_id for s in state.finished] == ["b"]
    assert state.finished[0].finish_reason is FinishReason.ABORT
    state, plan = run(state, aborts=("a",))
    assert plan.is_empty and not state.has_unfinished
    assert state.pool.num_free == cfg.num_blocks


# --- scheduling ---------------------------------------------------------------------------

def test_a_records_token_array_is_its_token_ids_and_no_copy_keeps_a_stale_one():
    """A new sequence's record holds its validated prompt as a read-only array (admission
    stores and hashes it); a record made from it by ``replace`` builds its own."""
    from nanofn.state.requests import add_seqs

    state = add_seqs(start(config(max_num_seqs=1)), (request("a", [7, 8, 9]),))
    (seq,) = state.waiting
    tokens = seq.token_array()
    assert tokens.tolist() == [7, 8, 9] and tokens.dtype == np.int64
    assert not tokens.flags.writeable
    assert seq.token_array() is tokens  # kept
    longer = replace(seq, token_ids=(7, 8, 9, 4))
    assert longer.token_array().tolist() == [7, 8, 9, 4]
    assert longer == replace(longer)  # the memo takes no part in comparisons


def test_long_prompts_are_prefilled_in_chunks_within_the_budget():
    state, plan = step(start(config(max_num_batched_tokens=16)),
                       Events(new_seqs=(request("a", range(1, 41)),)))
    chunks = [(plan.seqs[0].start_pos, plan.seqs[0].num_tokens, plan.seqs[0].sample)]
    while not plan.seqs[-1].sample:
        state, plan = step(state, Events())
        chunks.append((plan.seqs[0].start_pos, plan.seqs[0].num_tokens, plan.seqs[0].sample))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    cfg = config(enable_chunked_prefill=False, max_num_batched_tokens=128)
    news = (request("a", range(1, 100)), request("b", range(200, 260)))
    state, plan = step(start(cfg), Events(new_seqs=news))
    assert [(s.seq_id, s.num_tokens) for s in plan.seqs] == [("a", 99)]
    state, plan = run(state)
    assert [(s.seq_id, s.num_tokens) for s in plan.seqs] == [("a", 1), ("b", 60)]


def test_a_cached_prefix_is_not_computed_again_but_the_last_token_always_is():
    prompt = list(range(1, 33))  # exactly two blocks
    state, _ = step(start(config()), Events(new_seqs=(request("a", prompt),)))
    state, plan = run(state, new_seqs=(request("b", prompt), request("c", prompt + [7])))
    starts = {s.seq_id: (s.start_pos, s.num_tokens) for s in plan.seqs}
    assert starts["b"] == (16, 16)  # the last block is recomputed to have logits to sample
    assert starts["c"] == (32, 1)
    assert figures(state).prefix_cache_hit_rate == pytest.approx((16 + 32) / (32 * 3 + 1))


def test_prefix_caching_can_be_switched_off():
    prompt = list(range(1, 33))
    state, _ = step(start(config(enable_prefix_caching=False)),
                    Events(new_seqs=(request("a", prompt),)))
    state, plan = run(state, new_seqs=(request("b", prompt),))
    assert [(s.seq_id, s.start_pos) for s in plan.seqs] == [("a", 32), ("b", 0)]
    assert len(state.pool.by_hash) == 0


def test_preemption_takes_the_most_recent_admission_which_resumes_first():
    cfg = config(num_blocks=6, max_num_batched_tokens=64, max_model_len=64,
                 enable_chunked_prefill=False)
    params = replace(GREEDY, max_tokens=30, ignore_eos=True)
    news = tuple(request(r, range(k, k + 31), params) for r, k in (("a", 1), ("b", 100), ("c", 200)))
    state, plan = step(start(cfg), Events(new_seqs=news))
    assert [s.seq_id for s in plan.seqs] == ["a", "b"]
    state, plan = run(state)
    assert [s.seq_id for s in plan.seqs] == ["a", "b", "c"] and state.pool.num_free == 0
    state, plan = run(state)  # a and b need a third block each: c, the newest, gives way
    assert state.preempted == ("c",) and [s.seq_id for s in plan.seqs] == ["a", "b"]
    (victim,) = state.waiting
    assert victim.seq_id == "c" and victim.num_preemptions == 1
    assert victim.output_token_ids == (5,) and not victim.block_table
    assert figures(state).num_preemptions == 1


def test_max_num_seqs_caps_the_running_set():
    news = tuple(request(f"r{i}", [i + 1, i + 2]) for i in range(6))
    state, plan = step(start(config(max_num_seqs=4)), Events(new_seqs=news))
    assert len(plan.seqs) == 4 and len(state.waiting) == 2
    f = figures(state)
    assert (f.num_running, f.num_waiting, f.kv_blocks_used) == (4, 2, 4)


def test_decode_plans_carry_one_token_and_no_history():
    state, _ = step(start(config()), Events(new_seqs=(request("a", range(1, 50)),)))
    state, plan = run(state, sampled_token=8)
    (s,) = plan.seqs
    assert (s.token_ids, s.start_pos, s.sample, plan.histories) == ((8,), 49, True, ())
    assert plan.num_decode_tokens == 1 and plan.num_prefill_tokens == 0
    penalised = replace(GREEDY, repetition_penalty=1.2)
    state, plan = run(state, new_seqs=(request("p", [1, 2], penalised),))
    assert plan.histories == ((1, (1, 2)),)


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_plain_decode_step_leaves_the_ends_of_store_rows_to_the_general_path(pipelined):
    """A sequence of 1,000 prompt tokens sits in store rows 1,024 tokens and 64 blocks wide.
    The plain decode step (and the memo it passes on) must leave the step that would write
    past either end to the general path, which widens the store, and give what ``full_step``
    gives wherever it applies. (Pipelined, the table's end comes a step before the tokens'.)"""
    cfg = config(num_blocks=200, max_num_batched_tokens=2048, max_model_len=2048)
    params = replace(GREEDY, max_tokens=200, ignore_eos=True)
    state, _ = step(start(cfg), Events(new_seqs=(request("a", range(1, 1001), params),)))
    taken = []
    for i in range(60):
        sampled = deliver(state, i % 7 + 1) if len(state.undelivered) > pipelined else None
        events = Events(sampled=sampled)
        shortcut = None if sampled is None else decode_step(
            copy.deepcopy(state), np.asarray(sampled, np.int64), True)
        by_definition = full_step(copy.deepcopy(state), events)
        state, plan = step(state, events)
        assert (state, plan) == by_definition
        if shortcut is not None:
            assert shortcut == by_definition
        taken.append(shortcut is not None)
    assert state.batch.store.width(TOKENS) > 1024 and state.batch.store.width(TABLES) > 64
    assert sum(taken) >= 50 and not all(taken[2:])


# --- traces -------------------------------------------------------------------------------

def record(cfg, rounds):
    """Run a few steps, returning the trace lines and every (state, plan)."""
    state = start(cfg)
    lines, seen = [header_line(state, {"model": "test"})], []
    for i in range(rounds):
        events = Events(sampled=deliver(state, i % 7 + 1),
                        new_seqs=(request(f"r{i}", range(i + 1, i + 20)),) if i < 5 else (),
                        aborts=("r1",) if i == 3 else ())
        state, plan = step(state, events)
        lines.append(step_line(events, plan))
        seen.append((state, plan))
    return lines, seen


def test_a_trace_replays_every_state_and_plan():
    lines, seen = record(config(max_num_seqs=2), 12)
    trace = parse_trace(lines)
    assert trace.meta == {"model": "test"}
    assert list(replay(trace, check=True)) == seen


def test_a_tampered_trace_fails_its_check():
    lines, _ = record(config(), 6)
    row = json.loads(lines[3])
    row["sampled"] = [t + 1 for t in row["sampled"]]
    lines[3] = json.dumps(row)
    # The tokens delivered at step 3 are wrong: step 3's plan schedules them, and differs.
    with pytest.raises(TraceError, match="differs from the recorded one"):
        list(replay(parse_trace(lines), check=True))


@pytest.mark.parametrize("lines, message", [
    ([], "empty"),
    (["not json"], "line 1: not JSON"),
    (['{"format": "other"}'], "not a nanofn-trace header"),
    (['{"format": "nanofn-trace", "version": 99, "config": {}}'], "version 99 is not supported"),
])
def test_unreadable_traces_say_why(lines, message):
    with pytest.raises(TraceError, match=message):
        parse_trace(lines)


def test_a_broken_step_line_names_its_line_number():
    lines, _ = record(config(), 3)
    lines[2] = '{"step": 2}'
    with pytest.raises(TraceError, match="line 3: KeyError"):
        parse_trace(lines)


# --- configuration and parameters ---------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(block_size=8), r"block_size must be in \[16, 256\]"),
    (dict(max_num_batched_tokens=2), "must be >= max_num_seqs"),
    (dict(num_blocks=3), "num_blocks .3. is too few"),
    (dict(enable_chunked_prefill=False), "without chunked prefill"),
])
def test_bad_configurations_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        start(config(**overrides))


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1, "temperature must be >= 0"),
    ("top_p", 0, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k must be -1 or 0"),
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("max_tokens", -1, "max_tokens must be an integer >= 1"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("min_tokens", 20, r"min_tokens must be <= max_tokens \(16\)"),
    ("n", 0, "n must be an integer >= 1"),
    ("presence_penalty", 3, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3, r"frequency_penalty must be in \[-2, 2\]"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
    ("stop", [""], "stop must be a string or a list of non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be non-negative integers"),
    ("seed", 1.5, "seed must be an integer or None"),
    ("temperature", "hot", "temperature must be a number"),
    ("ignore_eos", "yes", "ignore_eos must be a bool"),
    ("temperature", float("nan"), "temperature must be >= 0"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of token ids"),
])
def test_sampling_params_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_round_trip_through_json():
    params = SamplingParams(stop="###", stop_token_ids=[3], seed=4, logprobs=2, top_k=5)
    assert params.stop == ("###",)
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    with pytest.raises(ValueError, match="unknown sampling parameter.*colour"):
        SamplingParams.from_dict({"colour": 1})


def test_the_fast_state_builder_sets_every_field():
    """``evolve`` builds states field by field for speed: a field added to EngineState but not
    handled there must fail here."""
    state, _ = step(start(config()), Events(new_seqs=(request("a", range(1, 20)),)))
    for name in (f.name for f in fields(EngineState)):
        value = object()
        assert getattr(evolve(state, **{name: value}), name) is value
        assert evolve(state, **{name: value}) == replace(state, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword"):
        evolve(state, colour=1)


def test_an_id_with_a_token_in_flight_cannot_be_reused_yet():
    state, _ = step(start(config()), Events(new_seqs=(request("a", [1, 2]),)))
    state, _ = step(state, Events(aborts=("a",)))  # a's token is still in flight
    with pytest.raises(InvalidRequest, match="'a' still has a sampled token in flight"):
        check_new_seq(state, request("a", [3]))
    state, _ = step(state, Events(sampled=(9,)))  # delivered, and dropped: a is gone
    check_new_seq(state, request("a", [3]))
