"""Which data-parallel replica serves a request: a pure policy, prefix affinity with a load
fallback.

A replica's prefix cache only helps requests that reach it, so requests that start alike
should reach the same replica. The key of a prompt is the hash of its first block of tokens
(the prefix cache's unit: two prompts that share less than a block share no cached block
anyway). Each key prefers one replica by rendezvous hashing (the live replica with the highest
``hash(key, replica)``): the preference of a key never depends on the others' loads, and a
replica that dies moves only its own keys, each to its own runner-up.

Affinity gives way to balance when the preferred replica is much busier than the least busy
one, its load over ``imbalance_factor`` times the least load plus ``imbalance_slack``
requests: a burst of requests with one shared system prompt must not queue on one replica
while the others idle. The request then goes to the least busy live replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

IMBALANCE_FACTOR = 2.0
IMBALANCE_SLACK = 4  # requests


@dataclass(frozen=True)
class RoutingPolicy:
    """How far affinity bends to load; ``block_size`` tokens make a prompt's key."""

    block_size: int = 16
    imbalance_factor: float = IMBALANCE_FACTOR
    imbalance_slack: int = IMBALANCE_SLACK

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.imbalance_factor < 1:
            raise ValueError(f"imbalance_factor must be at least 1, got {self.imbalance_factor}")
        if self.imbalance_slack < 0:
            raise ValueError(f"imbalance_slack must be at least 0, got {self.imbalance_slack}")


def prefix_key(token_ids: Sequence[int], block_size: int) -> int:
    """The routing key of a prompt: ``xxhash64`` of its first ``block_size`` token ids (all of
    them, for a shorter prompt)."""
    head = list(token_ids[:block_size])
    return xxhash.xxh64_intdigest(b"".join(t.to_bytes(4, "little") for t in head))


def preferred_replica(key: int, live: Sequence[bool]) -> int:
    """The live replica that ``key`` prefers (rendezvous hashing); ``ValueError`` if none
    is live."""
    scores = [(_score(key, replica), replica) for replica, up in enumerate(live) if up]
    if not scores:
        raise ValueError("no live replica to route to")
    return max(scores)[1]


def choose_replica(token_ids: Sequence[int], loads: Sequence[int], live: Sequence[bool],
                   policy: RoutingPolicy = RoutingPolicy()) -> int:
    """The replica for a prompt of ``token_ids``, given each replica's requests in flight
    (``loads``) and whether it is live: the one its first block prefers, unless that one is
    much busier than the least busy live replica (see the module's docstring)."""
    if len(loads) != len(live):
        raise ValueError(f"{len(loads)} loads for {len(live)} replicas")
    preferred = preferred_replica(prefix_key(token_ids, policy.block_size), live)
    least = min((load, replica) for replica, (load, up) in enumerate(zip(loads, live)) if up)
    if loads[preferred] > policy.imbalance_factor * least[0] + policy.imbalance_slack:
        return least[1]
    return preferred


def _score(key: int, replica: int) -> int:
    return xxhash.xxh64_intdigest(key.to_bytes(8, "little"), seed=replica)
