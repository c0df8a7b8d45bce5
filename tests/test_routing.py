"""The data-parallel routing policy (``nanofn.server.routing``): prompts sharing a first block
go to one replica, prompts that differ spread over all, a much busier replica is passed over,
and a dead one is never chosen and moves only its own prompts."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nanofn.server.routing import RoutingPolicy, choose_replica, prefix_key

POLICY = RoutingPolicy(block_size=16, imbalance_factor=2.0, imbalance_slack=4)
IDLE = [0, 0, 0, 0]
ALL_LIVE = [True] * 4


def prompt(seed: int, length: int = 40) -> list[int]:
    return random.Random(seed).choices(range(1000), k=length)


def test_prompts_sharing_their_first_block_go_to_one_replica():
    shared = prompt(0, 16)
    for seed in range(20):
        choices = {choose_replica(shared + prompt(seed + 100, 10 + seed), IDLE, ALL_LIVE, POLICY)
                   for seed in range(seed, seed + 5)}
        assert len(choices) == 1


def test_only_the_first_block_counts():
    a, b = prompt(1), prompt(2)
    assert prefix_key(a, 16) == prefix_key(a[:16] + b[16:], 16)
    assert prefix_key(a, 16) != prefix_key(b[:1] + a[1:], 16)
    assert prefix_key(a[:5], 16) == prefix_key(a[:5], 16) != prefix_key(a[:6], 16)


def test_different_prompts_spread_over_every_replica():
    counts = Counter(choose_replica(prompt(seed), IDLE, ALL_LIVE, POLICY) for seed in range(400))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 50  # 100 each on average


def test_a_much_busier_preferred_replica_is_passed_over_for_the_least_busy():
    p = prompt(3)
    preferred = choose_replica(p, IDLE, ALL_LIVE, POLICY)
    loads = [6] * 4
    loads[preferred] = 2 * 6 + 4  # at the limit: still preferred
    assert choose_replica(p, loads, ALL_LIVE, POLICY) == preferred
    loads[preferred] += 1
    least = (preferred + 1) % 4
    loads[least] = 5
    assert choose_replica(p, loads, ALL_LIVE, POLICY) == least


def test_a_dead_replica_is_never_chosen_and_moves_only_its_prompts():
    prompts = [prompt(seed) for seed in range(200)]
    before = [choose_replica(p, IDLE, ALL_LIVE, POLICY) for p in prompts]
    live = [True, False, True, True]
    after = [choose_replica(p, IDLE, live, POLICY) for p in prompts]
    assert 1 not in after
    assert all(b == a for b, a in zip(before, after) if b != 1)
    # a dead replica's load does not count as the least
    assert choose_replica(prompts[0], [9, 0, 9, 9], [True, False, True, True], POLICY) != 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no live replica"):
        choose_replica(prompt(0), [0, 0], [False, False], POLICY)
    with pytest.raises(ValueError, match="2 loads for 3 replicas"):
        choose_replica(prompt(0), [0, 0], [True] * 3, POLICY)
    with pytest.raises(ValueError, match="imbalance_factor"):
        RoutingPolicy(imbalance_factor=0.5)


def test_a_prompt_routes_by_its_token_ids_only():
    from nanofn.server.data_parallel import _token_ids

    assert _token_ids({"prompt": "x", "prompt_token_ids": [1, 2]}) == [1, 2]
    assert _token_ids([3, 4]) == [3, 4]
    with pytest.raises(TypeError, match="chosen by a prompt's token ids"):
        _token_ids("a string")
