"""Hashing the blocks that decoding fills, lazily.

A running sequence's block hashes (for the prefix cache) are taken when they are needed, not
when decoding fills the block: before the prefix cache is searched (a step that admits), and
when the sequence leaves the batch (finished or preempted) and gives its blocks back. So a
decode step that fills blocks does no hashing; the hashes, and the prefix cache at every
lookup and release, are what hashing at fill time would give. ``NUM_HASHED`` counts a row's
hashed blocks; full blocks past it are pending.
"""

from __future__ import annotations

import numpy as np

from nanofn.state.batch import (NUM_CACHED, NUM_COMPUTED, NUM_HASHED, NUM_PENDING,
                                NUM_PREEMPTIONS, NUM_TOKENS, ROW, RunningBatch, with_room)
from nanofn.state.block_pool import PoolChanges
from nanofn.state.hashing import ROOT_HASH, chained_hashes, hashes_of_blocks, token_bytes
from nanofn.state.records import FinishReason, Seq, SeqStatus
from nanofn.state.store import HASHES, TABLES, TOKENS, SeqStore


def hash_pending_blocks(store: SeqStore, cols: np.ndarray, pool: PoolChanges, block_size: int,
                        key: object) -> tuple[SeqStore, np.ndarray]:
    """Hash every row's pending full blocks into the store (``cols`` is writable; ``key``
    the write key of the batch it comes from), and cache the computed ones. Rows with one
    pending block (decoding fills one block at a time) are read and written with array
    operations, one hash call each; the others block by block."""
    pending = cols[:, NUM_TOKENS] // block_size - cols[:, NUM_HASHED]
    rows = np.flatnonzero(pending > 0)
    if not len(rows):
        return store, cols
    store, cols = with_room(store, cols, HASHES, rows, pending[rows], key=key)
    single = rows[pending[rows] == 1]
    if len(single):
        _hash_one_block_each(store, cols[single], pool, block_size)
    for i in rows[pending[rows] > 1].tolist():
        row, first = int(cols[i, ROW]), int(cols[i, NUM_HASHED])
        hashes = _hash_and_cache(store, row, first, int(pending[i]),
                                 int(cols[i, NUM_COMPUTED]), pool, block_size)
        store.extend(HASHES, row, first, np.array(hashes, np.uint64))
    cols[rows, NUM_HASHED] += pending[rows]
    return store, cols


def _hash_one_block_each(store: SeqStore, cols: np.ndarray, pool: PoolChanges,
                         block_size: int) -> None:
    """``hash_pending_blocks`` for rows (``cols``, a copy) with exactly one pending block."""
    rows, first = cols[:, ROW], cols[:, NUM_HASHED]
    tokens = store.arrays[TOKENS][rows[:, None], first[:, None] * block_size
                                  + np.arange(block_size)]
    parents = np.where(first > 0, store.arrays[HASHES][rows, np.maximum(first - 1, 0)],
                       np.uint64(ROOT_HASH)).tolist()
    datas = [row.tobytes() for row in np.ascontiguousarray(tokens, dtype="<u4")]
    hashes = hashes_of_blocks(parents, datas)
    store.append(HASHES, rows, first, np.array(hashes, np.uint64))
    computed = np.flatnonzero(cols[:, NUM_COMPUTED] // block_size > first).tolist()
    if computed:
        blocks = store.arrays[TABLES][rows, first]
        pool.cache_many([int(blocks[k]) for k in computed], [hashes[k] for k in computed],
                        [parents[k] for k in computed], [datas[k] for k in computed])


def leaving_record(batch: RunningBatch, i: int, pool: PoolChanges, block_size: int,
                   prefix_caching: bool, status: SeqStatus,
                   finish_reason: FinishReason | None = None) -> Seq:
    """Row ``i`` as the record it leaves the batch as, with all its block hashes (its pending
    blocks hashed, and the computed ones cached, before it gives its blocks back) and no
    blocks: finished, or waiting (preempted: it recomputes from the start)."""
    cols = batch.cols[i]
    row, first = int(cols[ROW]), int(cols[NUM_HASHED])
    hashes = batch.hashes(i).tolist()
    count = int(cols[NUM_TOKENS]) // block_size - first
    if prefix_caching and count > 0:
        hashes += _hash_and_cache(batch.store, row, first, count, int(cols[NUM_COMPUTED]), pool,
                                  block_size)
    preempted = status is SeqStatus.WAITING
    spec, tokens = batch.specs[i], batch.tokens(i)
    prompt = spec.prompt_token_ids  # (the row's first tokens: only the rest is converted)
    seq = Seq(spec=spec, token_ids=prompt + tuple(tokens[len(prompt):].tolist()),
              block_hashes=tuple(hashes), num_computed=0 if preempted else int(cols[NUM_COMPUTED]),
              num_pending=int(cols[NUM_PENDING]), status=status, finish_reason=finish_reason,
              num_preemptions=int(cols[NUM_PREEMPTIONS]) + preempted,
              num_cached_tokens=int(cols[NUM_CACHED]))
    if preempted:  # it is admitted again from its tokens as an array (a copy: rows are reused)
        seq.remember_token_array(tokens.copy())
    return seq


def _hash_and_cache(store: SeqStore, row: int, first: int, count: int, num_computed: int,
                    pool: PoolChanges, block_size: int) -> list[int]:
    """The chained hashes of blocks ``first .. first + count - 1`` of a store row; the ones
    whose KV is computed go into the prefix cache."""
    width = 4 * block_size
    data = token_bytes(store.arrays[TOKENS][row, first * block_size:(first + count) * block_size])
    parent = int(store.arrays[HASHES][row, first - 1]) if first else ROOT_HASH
    hashes = chained_hashes(parent, data, block_size, count)
    computed = min(count, num_computed // block_size - first)
    if computed > 0:
        blocks = store.arrays[TABLES][row, first:first + computed].tolist()
        pool.cache_many(blocks, hashes[:computed], [parent, *hashes[:computed - 1]],
                        [data[k * width:(k + 1) * width] for k in range(computed)])
    return hashes
