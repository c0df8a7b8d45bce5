"""Example-based tests of the core's second resource: a hybrid model's recurrent-state slots
(``nanofn/state/state_pool.py`` and the scheduler's policy across blocks and states). The
properties/ suite checks their invariants on random runs."""

from __future__ import annotations

import io

import pytest

from nanofn.state import (Events, NewSeq, SamplingParams, SchedulerConfig, header_line,
                          initial_state, parse_trace, replay, step, step_line)
from nanofn.state.batch import SAVE_AT, STATE
from nanofn.state.state_pool import StateChanges, new_state_pool

BS = 16
SHARED = tuple(range(1, 4 * BS + 1))  # four full blocks
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def config(**overrides) -> SchedulerConfig:
    base = dict(block_size=BS, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                enable_prefix_caching=True, enable_chunked_prefill=True, eos_token_ids=(0,),
                vocab_size=None)
    return SchedulerConfig(**{**base, **overrides})


def start(num_state_slots=6, num_blocks=64, **overrides):
    return initial_state(config(**overrides), num_blocks, num_state_slots)


def run(state, *new: NewSeq, **events):
    sampled = (7,) * len(state.undelivered[0]) if state.undelivered else None
    return step(state, Events(sampled=sampled, new_seqs=new, **events))


def request(rid: str, prompt) -> NewSeq:
    return NewSeq(rid, tuple(prompt), PARAMS)


def working_slots(state) -> dict[str, int]:
    return {seq.seq_id: seq.state_slot for seq in state.running}


def check_accounting(state) -> None:
    """free + working + saved = all slots, each slot in exactly one place."""
    states = state.states
    working = [s for s in working_slots(state).values()]
    saved = [entry.slot for _, entry in states.saved.items()]
    every = sorted(list(states.free) + working + saved)
    assert every == list(range(states.num_slots)), (states.free, working, saved)


def test_a_running_sequence_holds_one_slot_and_gives_it_back_when_it_finishes():
    state, plan = run(start(), request("a", range(1, 11)))  # shorter than a block: no save
    assert [s.state_slot for s in plan.started] == [0] and plan.state_saves == ()
    assert working_slots(state) == {"a": 0}
    check_accounting(state)
    while state.has_unfinished:
        state, plan = run(state)
        check_accounting(state)
    assert state.states.num_free == 6 and state.states.num_working == 0


def test_a_prompt_is_cut_at_its_last_full_block_to_save_its_state_there():
    prompt = SHARED + (100, 101, 102)
    state, plan = run(start(), request("a", prompt))
    assert plan.entries()[0].num_tokens == len(SHARED)  # 64 of 67: the chunk ends at the save
    assert plan.state_saves == ((0, 1),)  # after the step, a's state goes to slot 1
    assert state.states.num_saved == 1
    state, plan = run(state)
    assert (plan.entries()[0].start_pos, plan.entries()[0].num_tokens) == (64, 3)
    assert plan.state_saves == ()
    check_accounting(state)


def test_a_shared_prefix_starts_from_the_saved_state_and_its_blocks():
    state, _ = run(start(), request("a", SHARED + (100, 101, 102)))
    state, plan = run(state, request("b", SHARED + (200,) * 20))
    b = next(e for e in plan.entries() if e.seq_id == "b")
    assert b.start_pos == len(SHARED)  # four blocks from the prefix cache
    (b_start,) = plan.started
    saved_slot = next(entry.slot for _, entry in state.states.saved_by_age()
                      if entry.num_tokens == len(SHARED))
    assert plan.state_restores == ((saved_slot, b_start.state_slot),)
    assert b.start_pos + b.num_tokens == 80  # then up to its own last full block, saved
    assert [slot for i, slot in plan.state_saves if plan.seq_ids[i] == "b"]
    assert state.counters.num_cached_tokens == len(SHARED)
    check_accounting(state)


def test_a_state_saved_in_a_step_is_not_usable_in_that_step():
    """Both arrive together: the second finds the first's blocks cached (at admission) but no
    state yet, so it computes the prefix itself; it saves where its blocks ran past its states,
    and a third prompt, later, starts from there."""
    state, plan = run(start(), request("a", SHARED + (100,)), request("b", SHARED + (200,)))
    assert [(e.seq_id, e.start_pos, e.num_tokens) for e in plan.entries()] == [
        ("a", 0, 64), ("b", 0, 64)]
    assert plan.state_restores == ()
    # a saves at its last full block; b's blocks reach that prefix, whose state is being
    # saved: b does not save it twice.
    assert len(plan.state_saves) == 1 and state.states.num_saved == 1
    check_accounting(state)
    state, plan = run(state, request("c", SHARED + (300,) * 3))
    c = next(e for e in plan.entries() if e.seq_id == "c")
    assert c.start_pos == 64 and len(plan.state_restores) == 1


def test_where_cached_blocks_outrun_the_saved_states_the_prompt_saves_its_state():
    """b's blocks are cached for five blocks (a's prompt), but a saved its state only at its
    own last full block (six): b takes no state, recomputes from the start, and saves at the
    end of the five blocks it shares, the prefix common to both."""
    a = tuple(range(1, 6 * BS + 1)) + (999,)
    b = a[:5 * BS] + (500,) * 20
    state, _ = run(start(), request("a", a))
    state, _ = run(state)
    state, plan = run(state, request("b", b))
    entry = next(e for e in plan.entries() if e.seq_id == "b")
    assert (entry.start_pos, entry.num_tokens) == (0, 5 * BS)
    assert [plan.seq_ids[i] for i, _ in plan.state_saves] == ["b"]
    assert state.states.num_saved == 2
    state, plan = run(state, request("c", a[:5 * BS] + (600,) * 3))
    c = next(e for e in plan.entries() if e.seq_id == "c")
    assert c.start_pos == 5 * BS and len(plan.state_restores) == 1


def test_without_a_free_slot_the_least_recently_used_saved_state_is_evicted():
    state = start(num_state_slots=2)
    state, plan = run(state, request("a", tuple(range(1, 2 * BS + 2))))  # saves at 32
    assert [slot for _, slot in plan.state_saves] == [1]
    while state.has_unfinished:
        state, _ = run(state)
    state, _ = run(state, request("b", range(500, 505)))  # works in the free slot, 0
    assert state.states.num_free == 0 and state.states.num_saved == 1
    state, plan = run(state, request("c", range(600, 605)))
    assert [s.state_slot for s in plan.started] == [1]  # a's saved state made room
    assert state.states.num_saved == 0
    check_accounting(state)


def test_the_least_recently_used_saved_state_goes_first():
    changes = StateChanges(new_state_pool(3), step=1)
    for key in (1, 2, 3):
        changes.save(block_hash=key, num_tokens=BS, token_bytes=bytes(4 * BS))
    later = StateChanges(changes.build(), step=2)
    later.restore(1)  # 1 is used again: 2 is now the oldest
    assert later.take() == 1  # slots 0, 1, 2 hold keys 1, 2, 3
    assert later.take() == 2
    assert later.take() == 0


def test_forgotten_saved_states_free_their_slots_in_ascending_order():
    """Whatever order the saved states were made in: here slot 1's before slot 0's."""
    tokens = bytes(4 * BS)
    changes = StateChanges(new_state_pool(2), step=1)
    assert [changes.save(block_hash=key, num_tokens=BS, token_bytes=tokens)
            for key in (1, 2)] == [0, 1]
    adopting = StateChanges(changes.build(), step=2)
    assert adopting.adopt(1) == 0
    adopting.release([0])
    saving = StateChanges(adopting.build(), step=3)
    assert saving.save(block_hash=3, num_tokens=BS, token_bytes=tokens) == 0
    forgetting = StateChanges(saving.build(), step=4)
    forgetting.forget([1, 0])
    assert forgetting.take() == 1  # the last freed is taken first
    assert forgetting.take() == 0


def test_a_save_never_takes_the_slot_another_save_writes_in_the_same_step():
    changes = StateChanges(new_state_pool(1), step=1)
    assert changes.save(block_hash=1, num_tokens=BS, token_bytes=bytes(4 * BS)) == 0
    assert changes.save(block_hash=2, num_tokens=BS, token_bytes=bytes(4 * BS)) is None
    assert changes.take() is None  # nor does an admission
    later = StateChanges(changes.build(), step=2)
    assert later.save(block_hash=2, num_tokens=BS, token_bytes=bytes(4 * BS)) == 0


def test_a_sequence_waits_for_a_state_slot_as_for_a_block():
    state = start(num_state_slots=2, enable_prefix_caching=False)
    state, plan = run(state, *(request(r, range(1, 10)) for r in "abc"))
    assert [s.seq_id for s in plan.started] == ["a", "b"]
    assert [seq.seq_id for seq in state.waiting] == ["c"]
    while "c" not in working_slots(state):
        state, _ = run(state)
        check_accounting(state)
    assert state.counters.num_preemptions == 0


def test_preemption_gives_the_state_slot_back():
    state = start(num_state_slots=4, num_blocks=10, max_model_len=128,
                  enable_prefix_caching=False)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    state, _ = step(state, Events(new_seqs=tuple(NewSeq(r, tuple(range(1, 60)), long)
                                                 for r in "ab")))
    preempted = False
    while state.has_unfinished:
        state, _ = run(state)
        check_accounting(state)
        preempted |= bool(state.preempted)
        for seq in state.waiting:
            assert seq.state_slot == -1
    assert preempted


def test_a_restore_from_the_only_slot_left_works_in_it_with_no_copy():
    changes = StateChanges(new_state_pool(1), step=1)
    slot = changes.save(block_hash=11, num_tokens=16, token_bytes=b"x" * 64)
    pool = changes.build()
    later = StateChanges(pool, step=2)
    assert later.take(keep=11) is None and later.can_take()
    later.restore(11)
    assert later.adopt(11) == slot
    assert later.build().num_saved == 0


def test_hits_are_confirmed_against_the_tokens():
    changes = StateChanges(new_state_pool(2), step=1)
    changes.save(block_hash=42, num_tokens=BS, token_bytes=bytes(4 * BS))
    later = StateChanges(changes.build(), step=2)
    assert later.find([42], bytes(4 * BS), 1, BS)[0] == 1
    assert later.find([42], b"\x01" * (4 * BS), 1, BS) == (0, None)  # same hash, other tokens


def test_dirty_state_slots_leave_the_prefix_cache():
    state, _ = run(start(), request("a", SHARED + (1,)))
    (entry,) = [e for _, e in state.states.saved.items()]
    state, _ = run(state, dirty_states=(entry.slot,))
    assert state.states.num_saved == 0
    check_accounting(state)


def test_the_columns_say_where_states_are_saved():
    state, _ = run(start(), request("a", SHARED + tuple(range(100, 100 + BS + 3))))
    cols = state.batch.cols[0]
    assert cols[STATE] >= 0
    assert cols[SAVE_AT] == 0  # its one save point (80 = the last full block) is done...
    # ...in the first chunk, since the shared prefix is not cached: nothing to divide at


def test_a_hybrid_trace_replays_with_its_state_slots():
    buffer = io.StringIO()
    state = start(num_state_slots=5)
    buffer.write(header_line(state) + "\n")
    arrivals = {0: [request("a", SHARED + (1, 2))], 2: [request("b", SHARED + (3,))]}
    for i in range(8):
        events = Events(sampled=(7,) * len(state.undelivered[0]) if state.undelivered else None,
                        new_seqs=tuple(arrivals.get(i, ())))
        state, plan = step(state, events)
        buffer.write(step_line(events, plan) + "\n")
    trace = parse_trace(buffer.getvalue().splitlines())
    assert trace.num_state_slots == 5
    replayed = list(replay(trace, check=True))
    assert replayed[-1][0].states == state.states


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_the_number_of_state_slots_is_checked(bad):
    with pytest.raises(ValueError, match="num_state_slots"):
        initial_state(config(), 64, bad)
