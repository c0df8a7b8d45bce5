"""Chained block hashes: equal hashes mean equal token prefixes (up to a 64-bit collision,
which the prefix cache rules out by comparing the stored tokens on every hit)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

ROOT_HASH = 0  # the parent of a sequence's first block


def block_hash(parent_hash: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """``xxhash64`` of the parent hash (8 bytes) then the token ids (4 bytes each), both
    little-endian."""
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + token_bytes(token_ids))


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as hashed: 4 little-endian bytes each."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def hash_blocks(parent_hashes: np.ndarray, blocks: np.ndarray) -> tuple[list[int], np.ndarray]:
    """``block_hash`` of many blocks at once (``blocks``: ``[k, block_size]`` token ids, each
    chained to its ``parent_hashes[k]``); also returns the blocks' bytes ``[k, 4 * block_size]``."""
    tokens = np.ascontiguousarray(blocks, dtype="<u4").view(np.uint8).reshape(len(blocks), -1)
    data = np.concatenate([parent_hashes.astype("<u8").view(np.uint8).reshape(-1, 8), tokens],
                          axis=1)
    return [xxhash.xxh64_intdigest(row) for row in data], tokens


def parent_hash_of(hashes: Sequence[int], block_index: int) -> int:
    return int(hashes[block_index - 1]) if block_index > 0 else ROOT_HASH


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The hashes of every full block of ``token_ids``."""
    data, width = token_bytes(token_ids), 4 * block_size
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = xxhash.xxh64_intdigest(parent.to_bytes(8, "little")
                                        + data[i * width:(i + 1) * width])
        hashes.append(parent)
    return tuple(hashes)
