"""The paged KV block pool: reference counts, the prefix cache, and the order of eviction.

A block is *owned* while its reference count is positive (one count per sequence whose block
table holds it) and *free* otherwise. A free block is either plain (nothing worth keeping) or
cached (it still holds a full block of some prefix and can be handed out again on a hit).
Allocation takes plain blocks first, then evicts cached ones, least recently freed first.

The least-recently-freed order is a queue that only grows at its back and shrinks at its
front: a cached block joins at the back when it is freed, with its position as a stamp; a
block that a prefix hit takes back keeps a stale entry, which eviction skips (its stamp no
longer matches, or the block is owned again). The queue is compacted when most of it is stale
or taken.

Every change of a step goes through a ``PoolChanges`` (a transient builder) and becomes a new
``BlockPool`` at the end; a pool is never written once built.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from pyrsistent import PVector, pvector

from nanofn.state.hashing import ROOT_HASH
from nanofn.state.pdict import PDict

NO_STAMP = -1
BULK_RELEASE = 64  # blocks released at once from which release counts them with arrays


class CachedBlock(NamedTuple):
    """What a cached block holds, kept so that a hash hit can be confirmed token by token:
    its tokens as the bytes that were hashed (``token_bytes``). A named tuple: one is built
    for every block that fills, and a tuple costs a fraction of a frozen dataclass."""

    block_hash: int
    parent_hash: int
    token_bytes: bytes

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(np.frombuffer(self.token_bytes, "<u4").tolist())


class BlockStack:
    """A persistent stack of block ids: a read-only array whose end is the top. Popping shares
    the array (a shorter view); pushing copies it, which only steps that free blocks do."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: np.ndarray):
        blocks.flags.writeable = False
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[int]:
        """Top first: the order they would be allocated in."""
        return iter(self.blocks[::-1].tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockStack) and np.array_equal(self.blocks, other.blocks)

    def __hash__(self) -> int:
        return hash(self.blocks.tobytes())

    def __repr__(self) -> str:
        return f"BlockStack({list(self)})"


@dataclass(frozen=True, slots=True)
class BlockPool:
    ref_counts: PVector  # per block
    plain_free: BlockStack  # free blocks that hold nothing cached
    num_plain_free: int
    lru: PVector  # cached blocks in the order they were freed; entries before lru_head are gone
    lru_head: int
    num_cached_free: int  # valid entries of lru
    lru_stamps: PVector  # per block: the lru position of its latest entry, or NO_STAMP
    cached: PVector  # per block: its CachedBlock, or None
    by_hash: PDict  # block hash -> block, for every cached block

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free(self) -> int:
        return self.num_plain_free + self.num_cached_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def cached_free(self) -> Iterator[int]:
        """The cached free blocks, first to be evicted first."""
        for position in range(self.lru_head, len(self.lru)):
            block = self.lru[position]
            if _valid_entry(self.ref_counts, self.lru_stamps, self.cached, block, position):
                yield block

    def cached_blocks(self) -> Iterator[tuple[int, CachedBlock]]:
        """``(block, entry)`` for every block whose content is in the prefix cache."""
        return ((b, e) for b, e in enumerate(self.cached) if e is not None)


def new_block_pool(num_blocks: int) -> BlockPool:
    return BlockPool(
        ref_counts=pvector([0] * num_blocks),
        plain_free=BlockStack(np.arange(num_blocks - 1, -1, -1, dtype=np.int64)),
        num_plain_free=num_blocks,
        lru=pvector(),
        lru_head=0,
        num_cached_free=0,
        lru_stamps=pvector([NO_STAMP] * num_blocks),
        cached=pvector([None] * num_blocks),
        by_hash=PDict(),
    )


def _valid_entry(refs, stamps, cached, block: int, position: int) -> bool:
    return refs[block] == 0 and stamps[block] == position and cached[block] is not None


def _taken_off(stack: np.ndarray, top: int, count: int) -> list[int]:
    """The ``count`` blocks below ``top`` of a plain free stack, in the order they are taken
    (the top one first)."""
    return stack[top - count:top][::-1].tolist()


def take_plain_blocks(pool: BlockPool, count: int) -> tuple[BlockPool, list[int]] | None:
    """``count`` blocks off the plain free stack and the pool after, or None if it holds fewer:
    what ``PoolChanges``' ``allocate`` and ``build`` give then, without the builder (a decode
    step's new blocks, the common allocation, come this way)."""
    stack = pool.plain_free.blocks
    left = len(stack) - count
    if left < 0:
        return None
    blocks = _taken_off(stack, len(stack), count)
    refs = pool.ref_counts.evolver()
    for block in blocks:
        refs[block] = 1
    return BlockPool(refs.persistent(), BlockStack(stack[:left]), left, pool.lru, pool.lru_head,
                     pool.num_cached_free, pool.lru_stamps, pool.cached, pool.by_hash), blocks


class PoolChanges:
    """The changes one step makes to a pool, collected, then frozen by ``build``. Operations
    are the pool's own: allocate, release, take back cached blocks, cache a block."""

    def __init__(self, pool: BlockPool):
        self._pool = pool
        # Read through the pool's vectors until the first change (most decode steps make
        # none), then through evolvers.
        self._refs = pool.ref_counts
        self._stamps = pool.lru_stamps
        self._cached = pool.cached
        self._lru = pool.lru
        self._plain = pool.plain_free.blocks  # the stack below ``_pushed``, to ``_plain_top``
        self._plain_top = len(self._plain)
        self._pushed: list[int] = []  # plain blocks freed in this step, last on top
        self._head = pool.lru_head
        self._num_cached_free = pool.num_cached_free
        self._new_hashes: dict[int, int] = {}
        self._gone_hashes: set[int] = set()
        self._changed = False

    @property
    def num_free(self) -> int:
        return self._num_plain + self._num_cached_free

    @property
    def _num_plain(self) -> int:
        return self._plain_top + len(self._pushed)

    def num_unowned(self, blocks: Iterable[int]) -> int:
        """How many of these blocks no sequence owns (cached and free)."""
        refs = self._refs
        return sum(1 for block in blocks if refs[block] == 0)

    def cached_run(self, hashes: Iterable[int]) -> list[int]:
        """The blocks holding ``hashes``, in order, up to the first hash no block holds: a
        hash cached in this step, else in the pool unless this step evicted it."""
        new, gone, get = self._new_hashes, self._gone_hashes, self._pool.by_hash.get
        blocks = []
        for block_hash in hashes:
            block = new.get(block_hash)
            if block is None:
                if block_hash in gone:
                    break
                block = get(block_hash)
                if block is None:
                    break
            blocks.append(block)
        return blocks

    def entry(self, block: int) -> CachedBlock | None:
        return self._cached[block]

    def _change(self) -> None:
        if not self._changed:
            self._changed = True
            self._refs = self._refs.evolver()
            self._stamps = self._stamps.evolver()
            self._cached = self._cached.evolver()
            self._lru = self._lru.evolver()

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (the caller checked ``num_free``): plain ones first, then
        the least recently freed cached ones, which leave the cache."""
        if count > self.num_free:
            raise ValueError(f"allocate({count}) with only {self.num_free} free blocks")
        if not count:
            return []
        self._change()
        refs, pushed = self._refs, self._pushed
        blocks = [pushed.pop() for _ in range(min(count, len(pushed)))]
        taken = min(count - len(blocks), self._plain_top)
        if taken:
            blocks += _taken_off(self._plain, self._plain_top, taken)
            self._plain_top -= taken
        for block in blocks:
            refs[block] = 1
        lru, stamps, cached = self._lru, self._stamps, self._cached
        while len(blocks) < count:
            position = self._head
            block = lru[position]
            self._head += 1
            if not _valid_entry(refs, stamps, cached, block, position):
                continue
            self._num_cached_free -= 1
            self._forget(block)
            refs[block] = 1
            blocks.append(block)
        return blocks

    def _forget(self, block: int) -> None:
        entry = self._cached[block]
        self._cached[block] = None
        self._stamps[block] = NO_STAMP
        if self._new_hashes.get(entry.block_hash) == block:
            del self._new_hashes[entry.block_hash]
        else:
            self._gone_hashes.add(entry.block_hash)

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop these blocks' contents from the prefix cache (a free one becomes plain): their
        device contents are not known any more."""
        for block in blocks:
            if self._cached[block] is None:
                continue
            self._change()
            if self._refs[block] == 0:  # its queue entry goes stale
                self._num_cached_free -= 1
                self._pushed.append(block)
            self._forget(block)

    def release(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Drop one reference to each block, in the given order; a block whose count reaches
        zero joins the back of the eviction queue if it is cached, else the plain free stack.
        Pass a block table reversed so that a sequence's last blocks are evicted first.
        Many blocks at once (a batch finishing together, sharing a prefix) are counted with
        array operations: each distinct block's count is set once, and the blocks freed join
        their queues in the order of their last mention, where one by one they would reach 0."""
        blocks = np.asarray(blocks, np.int64)
        self._change()
        if len(blocks) < BULK_RELEASE:
            self._release_each(blocks.tolist())
            return
        refs = self._refs
        distinct, first_from_end, counts = np.unique(blocks[::-1], return_index=True,
                                                     return_counts=True)
        blocks_distinct = distinct.tolist()
        left = np.array([refs[block] for block in blocks_distinct]) - counts
        if left.min() < 0:
            raise ValueError(f"block {blocks_distinct[int(left.argmin())]} released more often "
                             f"than it was taken")
        for block, count in zip(blocks_distinct, left.tolist()):
            refs[block] = count
        freed = np.flatnonzero(left == 0)
        last_mention = len(blocks) - 1 - first_from_end[freed]
        for block in distinct[freed[np.argsort(last_mention)]].tolist():
            self._free(block)

    def _release_each(self, blocks: list[int]) -> None:
        refs = self._refs
        for block in blocks:
            count = refs[block] - 1
            if count < 0:
                raise ValueError(f"block {block} released more often than it was taken")
            refs[block] = count
            if not count:
                self._free(block)

    def _free(self, block: int) -> None:
        """An unowned block to its queue: the eviction queue if cached, else the plain stack."""
        if self._cached[block] is not None:
            self._stamps[block] = len(self._lru)
            self._lru.append(block)
            self._num_cached_free += 1
        else:
            self._pushed.append(block)

    def take_cached(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block found in the cache (a free one leaves the queue: its
        entry goes stale)."""
        self._change()
        refs = self._refs
        for block in blocks:
            if refs[block] == 0:
                self._num_cached_free -= 1
            refs[block] += 1

    def cache(self, block: int, entry: CachedBlock) -> None:
        """Record that an owned ``block`` holds ``entry``; a no-op when another block already
        holds the same content (two sequences computed it at once)."""
        self.cache_many([block], [entry.block_hash], [entry.parent_hash], [entry.token_bytes])

    def cache_many(self, blocks: Sequence[int], hashes: Sequence[int], parents: Sequence[int],
                   token_bytes: Sequence[bytes]) -> None:
        """``cache`` for many owned blocks at once (block ``k`` holds ``hashes[k]``...)."""
        absent = self._absent(hashes)
        if not absent:
            return
        self._change()
        cached, new_hashes = self._cached, self._new_hashes
        for block, h, parent, data in zip(blocks, hashes, parents, token_bytes):
            if h in absent:
                absent.discard(h)  # two of them may hold one content: the first caches it
                cached[block] = CachedBlock(h, parent, data)
                new_hashes[h] = block

    def _absent(self, hashes: Iterable[int]) -> set[int]:
        """The hashes that no block holds now."""
        candidates = [h for h in hashes if h not in self._new_hashes]
        return self._pool.by_hash.absent(candidates) | self._gone_hashes.intersection(candidates)

    def build(self) -> BlockPool:
        if not self._changed:
            return self._pool
        lru, head, stamps = self._lru.persistent(), self._head, self._stamps
        if head > 1024 and head > len(lru) // 2:  # compact: keep the entries still valid
            refs, cached = self._refs, self._cached
            kept = [b for p, b in enumerate(lru[head:], start=head)
                    if _valid_entry(refs, stamps, cached, b, p)]
            for position, block in enumerate(kept):
                stamps[block] = position
            lru, head = pvector(kept), 0
        return BlockPool(
            ref_counts=self._refs.persistent(),
            plain_free=BlockStack(np.concatenate([self._plain[:self._plain_top], self._pushed])
                                  if self._pushed else self._plain[:self._plain_top]),
            num_plain_free=self._num_plain,
            lru=lru,
            lru_head=head,
            num_cached_free=self._num_cached_free,
            lru_stamps=stamps.persistent(),
            cached=self._cached.persistent(),
            by_hash=self._pool.by_hash.update_known(self._new_hashes, self._gone_hashes),
        )


class KnownPrefix(NamedTuple):
    """A sequence whose prefix-cache hits were found earlier in this step: its block hashes,
    its tokens (``token_bytes``) and the blocks it hit, which it owns since (so they are
    still cached)."""

    block_hashes: Sequence[int]
    data: bytes
    blocks: list[int]


def find_cached_prefix(pool: PoolChanges, block_hashes: Sequence[int], data: bytes,
                       limit: int, known: KnownPrefix | None = None) -> list[int]:
    """The cached blocks holding the longest prefix of a sequence, at most ``limit`` blocks.

    ``block_hashes[i]`` is the chained hash of the sequence's full block ``i`` and ``data``
    its tokens (``token_bytes``). A hash hit counts only if the stored tokens and parent hash
    match too: the hits are checked all at once (one comparison of bytes, one of lists), block
    by block only past a mismatch, which takes a 64-bit hash collision. A prefix shared whole
    with ``known`` (requests behind one long system prompt) takes its blocks after one
    comparison of hashes and one of tokens, with no walk.
    """
    found: list[int] = []
    if known is not None and known.blocks:
        shared = min(len(known.blocks), limit)
        width = len(pool.entry(known.blocks[0]).token_bytes)
        if (tuple(block_hashes[:shared]) == tuple(known.block_hashes[:shared])
                and data[:shared * width] == known.data[:shared * width]):
            found = known.blocks[:shared]
    return found + _verified(pool, pool.cached_run(block_hashes[len(found):limit]),
                             block_hashes, data, len(found))


def _verified(pool: PoolChanges, found: list[int], block_hashes: Sequence[int], data: bytes,
              first: int) -> list[int]:
    """The hash hits ``found`` for blocks ``first``, ``first + 1``.. of a sequence, up to the
    first whose stored tokens or parent hash differ from the sequence's."""
    if not found:
        return found
    entries = [pool.entry(block) for block in found]
    width = len(entries[0].token_bytes)
    parents = [ROOT_HASH if first == 0 else block_hashes[first - 1],
               *block_hashes[first:first + len(found) - 1]]
    if (b"".join(e.token_bytes for e in entries) == data[first * width:(first + len(found)) * width]
            and [e.parent_hash for e in entries] == parents):
        return found
    for i, entry in enumerate(entries):
        start = (first + i) * width
        if entry.parent_hash != parents[i] or entry.token_bytes != data[start:start + width]:
            return found[:i]
    return found
