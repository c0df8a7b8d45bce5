"""Chained block hashes: equal hashes mean equal token prefixes (up to a 64-bit collision,
which the prefix cache rules out by comparing the stored tokens on every hit)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash
from pyrsistent import PVector

ROOT_HASH = 0  # the parent of a sequence's first block


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """``xxhash64(parent_hash, token ids)``."""
    data = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return xxhash.xxh64_intdigest(data)


def parent_hash_of(hashes: PVector, block_index: int) -> int:
    return hashes[block_index - 1] if block_index > 0 else ROOT_HASH


def extend_block_hashes(hashes: PVector, token_ids: PVector, block_size: int) -> PVector:
    """The hashes of every full block of ``token_ids``, computing only the ones not yet known."""
    num_full = len(token_ids) // block_size
    if len(hashes) >= num_full:
        return hashes
    new = hashes.evolver()
    for i in range(len(hashes), num_full):
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        new.append(block_hash(parent_hash_of(new, i), tokens))
    return new.persistent()
