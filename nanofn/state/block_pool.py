"""The paged KV block pool: reference counts, the prefix cache, and the order of eviction.

A block is *owned* while its reference count is positive (one count per sequence whose block
table holds it) and *free* otherwise. A free block is either plain (nothing worth keeping) or
cached (it still holds a full block of some prefix and can be handed out again on a hit).
Allocation takes plain blocks first, then evicts cached ones, least recently freed first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from pyrsistent import PMap, PVector, plist, pmap, pvector
from pyrsistent.typing import PList

from nanofn.state.hashing import parent_hash_of

_NONE = -1  # end marker of the LRU links


@dataclass(frozen=True, slots=True)
class LruQueue:
    """A persistent insertion-ordered set of ints: push at the back, remove anywhere, pop the
    front, each in a few map updates (a doubly linked list kept in two maps)."""

    prev: PMap = pmap()
    next: PMap = pmap()
    head: int = _NONE
    tail: int = _NONE
    size: int = 0

    def __iter__(self):
        item = self.head
        while item != _NONE:
            yield item
            item = self.next[item]

    def push_back(self, item: int) -> LruQueue:
        next_ = self.next.set(item, _NONE)
        prev = self.prev.set(item, self.tail)
        if self.tail == _NONE:
            return LruQueue(prev, next_, item, item, 1)
        return LruQueue(prev, next_.set(self.tail, item), self.head, item, self.size + 1)

    def remove(self, item: int) -> LruQueue:
        before, after = self.prev[item], self.next[item]
        prev, next_ = self.prev.discard(item), self.next.discard(item)
        if before == _NONE:
            head = after
        else:
            head, next_ = self.head, next_.set(before, after)
        if after == _NONE:
            tail = before
        else:
            tail, prev = self.tail, prev.set(after, before)
        return LruQueue(prev, next_, head, tail, self.size - 1)

    def pop_front(self) -> tuple[int, LruQueue]:
        return self.head, self.remove(self.head)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What a cached block holds, kept so that a hash hit can be confirmed token by token."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockPool:
    ref_counts: PVector  # per block
    plain_free: PList  # a stack of free blocks that hold nothing cached
    num_plain_free: int
    cached_free: LruQueue  # free blocks that still hold a cached prefix, least recent first
    cached: PMap  # block -> CachedBlock, for every block whose content is in the cache
    by_hash: PMap  # block hash -> block

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free(self) -> int:
        return self.num_plain_free + self.cached_free.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free


def new_block_pool(num_blocks: int) -> BlockPool:
    return BlockPool(
        ref_counts=pvector([0] * num_blocks),
        plain_free=plist(range(num_blocks)),
        num_plain_free=num_blocks,
        cached_free=LruQueue(),
        cached=pmap(),
        by_hash=pmap(),
    )


def allocate(pool: BlockPool, count: int) -> tuple[BlockPool, tuple[int, ...]]:
    """Take ``count`` free blocks (the caller checked ``pool.num_free``): plain ones first,
    then the least recently used cached ones, which leave the cache."""
    if count > pool.num_free:
        raise ValueError(f"allocate({count}) with only {pool.num_free} free blocks")
    refs = pool.ref_counts.evolver()
    plain, num_plain = pool.plain_free, pool.num_plain_free
    lru, cached, by_hash = pool.cached_free, pool.cached, pool.by_hash
    blocks = []
    for _ in range(count):
        if num_plain:
            block, plain, num_plain = plain.first, plain.rest, num_plain - 1
        else:
            block, lru = lru.pop_front()
            cached, by_hash = _forget(cached, by_hash, block)
        refs[block] = 1
        blocks.append(block)
    pool = BlockPool(refs.persistent(), plain, num_plain, lru, cached, by_hash)
    return pool, tuple(blocks)


def _forget(cached: PMap, by_hash: PMap, block: int) -> tuple[PMap, PMap]:
    return cached.discard(block), by_hash.discard(cached[block].block_hash)


def release(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """Drop one reference to each block, in the given order; a block whose count reaches zero
    joins the back of the cached LRU queue if it is cached, else the plain free stack. Pass a
    block table reversed so that a sequence's last blocks are evicted first."""
    refs = pool.ref_counts.evolver()
    plain, num_plain, lru = pool.plain_free, pool.num_plain_free, pool.cached_free
    for block in blocks:
        count = refs[block] - 1
        if count < 0:
            raise ValueError(f"block {block} released more often than it was taken")
        refs[block] = count
        if count:
            continue
        if block in pool.cached:
            lru = lru.push_back(block)
        else:
            plain, num_plain = plain.cons(block), num_plain + 1
    return replace(pool, ref_counts=refs.persistent(), plain_free=plain,
                   num_plain_free=num_plain, cached_free=lru)


def find_cached_prefix(pool: BlockPool, block_hashes: Sequence[int],
                       block_tokens: Callable[[int], Sequence[int]], limit: int) -> tuple[int, ...]:
    """The cached blocks holding the longest prefix of a sequence, at most ``limit`` blocks.

    ``block_hashes[i]`` is the chained hash of the sequence's full block ``i`` and
    ``block_tokens(i)`` its tokens. A hash hit counts only if the stored tokens and parent
    hash match too.
    """
    found: list[int] = []
    for i in range(min(limit, len(block_hashes))):
        block = pool.by_hash.get(block_hashes[i])
        if block is None:
            break
        entry = pool.cached[block]
        if (entry.parent_hash != parent_hash_of(block_hashes, i)
                or entry.token_ids != tuple(block_tokens(i))):
            break
        found.append(block)
    return tuple(found)


def take_cached(pool: BlockPool, blocks: Iterable[int]) -> BlockPool:
    """Add a reference to each block found in the cache (free ones leave the LRU queue)."""
    refs = pool.ref_counts.evolver()
    lru = pool.cached_free
    for block in blocks:
        if refs[block] == 0:
            lru = lru.remove(block)
        refs[block] += 1
    return replace(pool, ref_counts=refs.persistent(), cached_free=lru)


def cache_block(pool: BlockPool, block: int, entry: CachedBlock) -> BlockPool:
    """Record that an owned ``block`` holds ``entry``; a no-op when another block already
    holds the same content (two sequences computed it at once)."""
    if entry.block_hash in pool.by_hash:
        return pool
    return replace(pool, cached=pool.cached.set(block, entry),
                   by_hash=pool.by_hash.set(entry.block_hash, block))
