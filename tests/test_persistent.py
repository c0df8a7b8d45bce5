"""The core's persistent structures: ``PDict`` and the append-only ``SeqStore`` behind the
running batch. Every old version must stay as it was, whatever is done to later ones."""

from __future__ import annotations

import copy
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from nanofn.state import Events, NewSeq, SamplingParams, SchedulerConfig, initial_state, step
from nanofn.state.pdict import PDict

operations = st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers()), max_size=200)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_a_pdict_behaves_as_a_dict_and_keeps_every_version(ops):
    model: dict = {}
    versions = [(PDict(), {})]
    for is_set, key, value in ops:
        pd = versions[-1][0]
        if is_set:
            model[key] = value
            pd = pd.set(key, value)
        else:
            model.pop(key, None)
            pd = pd.discard(key)
        versions.append((pd, dict(model)))
    for pd, expected in versions:
        assert dict(pd.items()) == expected and len(pd) == len(expected)
        assert all(pd.get(k) == v and k in pd for k, v in expected.items())
        assert all(k not in pd for k in range(31) if k not in expected)
        assert pd.absent(range(31)) == {k for k in range(31) if k not in expected}
    pd = versions[-1][0]
    assert copy.deepcopy(pd) == pd and pickle.loads(pickle.dumps(pd)) == pd


def test_a_key_both_removed_and_added_is_replaced():
    pd = PDict({1: "a", 2: "b"}).update_known({1: "c", 3: "d"}, [1, 2])
    assert dict(pd.items()) == {1: "c", 3: "d"} and len(pd) == 2


CONFIG = SchedulerConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=128, enable_prefix_caching=True,
                         enable_chunked_prefill=True, eos_token_ids=(0,), vocab_size=None)
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def running_state():
    news = tuple(NewSeq(f"s{i}", tuple(range(1 + i, 20 + i)), PARAMS) for i in range(3))
    state, _ = step(initial_state(CONFIG, 32), Events(new_seqs=news))
    return step(state, Events(sampled=(5, 6, 7)))[0]


def test_two_steps_from_one_state_do_not_see_each_other():
    """Appending to a row another state already appended to copies the rows first (the store
    is shared, its written positions never change)."""
    state = running_state()
    snapshot = copy.deepcopy(state)
    a, _ = step(state, Events(sampled=(10, 11, 12)))
    b, _ = step(state, Events(sampled=(20, 21, 22)))
    a_again, _ = step(state, Events(sampled=(10, 11, 12)))
    assert [s.token_ids[-1] for s in a.running] == [10, 11, 12]
    assert [s.token_ids[-1] for s in b.running] == [20, 21, 22]
    assert a == a_again and state == snapshot
    assert a.batch.store is state.batch.store and b.batch.store is not state.batch.store


def test_the_running_batch_is_read_only():
    state = running_state()
    for array in (state.batch.cols, state.batch.tokens(0), state.batch.table(0)):
        assert not array.flags.writeable
