"""Chained block hashes: equal hashes mean equal token prefixes (up to a 64-bit collision,
which the prefix cache rules out by comparing the stored tokens on every hit)."""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import xxhash

ROOT_HASH = 0  # the parent of a sequence's first block

# Every block hash is ``digest(token_bytes, parent_hash)``, looked up here at each call: the
# property suite swaps in a weak digest to make collisions common and check that hits are
# confirmed against the stored tokens.
digest = xxhash.xxh64_intdigest


def block_hash(parent_hash: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """``xxhash64`` of the token ids (4 little-endian bytes each), seeded with the parent
    hash (seeding chains the blocks at half the cost of hashing the parent's bytes too)."""
    return digest(token_bytes(token_ids), parent_hash)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as hashed: 4 little-endian bytes each. (A tuple of 2,000 ids goes through
    ``array.array`` 4x as fast as through numpy.)"""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<u4", copy=False).tobytes()
    ids = array.array("I", token_ids)
    if not np.little_endian:
        ids.byteswap()
    return ids.tobytes()


def parent_hash_of(hashes: Sequence[int], block_index: int) -> int:
    return int(hashes[block_index - 1]) if block_index > 0 else ROOT_HASH


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The hashes of every full block of ``token_ids``."""
    return tuple(chained_hashes(ROOT_HASH, token_bytes(token_ids), block_size,
                                len(token_ids) // block_size))


def block_hashes_sharing(token_ids: np.ndarray, block_size: int, known_ids: np.ndarray | None,
                         known_hashes: Sequence[int]) -> tuple[int, ...]:
    """``block_hashes(token_ids)``, taking the hashes of the blocks it shares whole with
    ``known_ids`` (whose hashes are ``known_hashes``) from those: requests behind one long
    system prompt hash it once. Both are int64 arrays; equal tokens give equal hashes."""
    shared = 0
    if known_ids is not None:
        n = min(len(token_ids), len(known_ids)) // block_size * block_size
        differ = np.flatnonzero(token_ids[:n] != known_ids[:n])
        shared = int(differ[0] if len(differ) else n) // block_size
    count = len(token_ids) // block_size
    parent = known_hashes[shared - 1] if shared else ROOT_HASH
    data = token_bytes(token_ids[shared * block_size:count * block_size])
    return tuple(known_hashes[:shared]) + tuple(
        chained_hashes(parent, data, block_size, count - shared))


def chained_hashes(parent: int, data: bytes, block_size: int, count: int) -> list[int]:
    """The hashes of the first ``count`` blocks of ``data`` (``token_bytes`` of whole blocks),
    the first chained to ``parent``, each next one to the one before."""
    width, hashes = 4 * block_size, []
    for start in range(0, count * width, width):
        parent = digest(data[start:start + width], parent)
        hashes.append(parent)
    return hashes


def hashes_of_blocks(parents: Sequence[int], datas: Sequence[bytes]) -> list[int]:
    """The hash of each block (its ``token_bytes``) after its own parent."""
    return [digest(data, parent) for data, parent in zip(datas, parents)]
