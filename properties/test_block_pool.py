"""The block pool against a model of it in plain Python: random sequences take prefix-cache hits
and new blocks, cache them, and give them back (many at once, past ``BULK_RELEASE``, as a batch
finishing together does), blocks are forgotten, and steps end; after each step the pool holds
what the model holds, down to the order of the plain free blocks and of eviction."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanofn.state.block_pool import BULK_RELEASE, CachedBlock, PoolChanges, new_block_pool
from properties.profile import coverage_floor, examples, steps

coverage: Counter = Counter()


class ModelPool:
    """The pool as block_pool.py's docstring describes it: reference counts; plain free blocks
    as a stack, the last freed on top, taken first; cached free blocks least recently freed
    first, evicted first; the contents of cached blocks, one block per hash."""

    def __init__(self, num_blocks: int):
        self.refs = [0] * num_blocks
        self.plain = list(range(num_blocks))[::-1]  # the top (taken next) last
        self.lru: list[int] = []
        self.cached: dict[int, CachedBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self.plain) + len(self.lru)

    def allocate(self, count: int) -> list[int]:
        blocks = []
        for _ in range(count):
            if self.plain:
                block = self.plain.pop()
            else:
                block = self.lru.pop(0)
                del self.cached[block]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """One reference less for each block, in order; a block no one holds is freed."""
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block]:
                (self.lru if block in self.cached else self.plain).append(block)

    def take_cached(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self.refs[block]:
                self.lru.remove(block)
            self.refs[block] += 1

    def cache(self, blocks: list[int], entries: list[CachedBlock]) -> None:
        """Record the contents of owned blocks; a hash some block holds already stays there."""
        for block, entry in zip(blocks, entries):
            if all(held.block_hash != entry.block_hash for held in self.cached.values()):
                self.cached[block] = entry

    def forget(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.cached.pop(block, None) is not None and not self.refs[block]:
                self.lru.remove(block)
                self.plain.append(block)


class PoolMachine(RuleBasedStateMachine):
    """Sequences are block tables (hits first, then new blocks); a step's changes go through
    one ``PoolChanges``, built into the next pool when the step ends."""

    @initialize(num_blocks=st.integers(BULK_RELEASE, 3 * BULK_RELEASE))
    def start(self, num_blocks):
        self.pool = new_block_pool(num_blocks)
        self.changes = PoolChanges(self.pool)
        self.model = ModelPool(num_blocks)
        self.tables: list[list[int]] = []

    @rule(data=st.data())
    def start_a_sequence(self, data):
        """A sequence takes a run of cached blocks (its prefix-cache hits) and new ones."""
        cached = sorted(self.model.cached)
        hits = data.draw(st.lists(st.sampled_from(cached), unique=True, max_size=8)
                         if cached else st.just([]))
        free_hits = sum(1 for block in hits if not self.model.refs[block])
        count = data.draw(st.integers(0, min(BULK_RELEASE, self.model.num_free - free_hits)))
        self.changes.take_cached(hits)
        self.model.take_cached(hits)
        self.tables.append(hits + self.allocate(count))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def grow(self, data):
        table = data.draw(st.sampled_from(self.tables))
        table += self.allocate(data.draw(st.integers(1, max(1, min(8, self.model.num_free)))))

    def allocate(self, count: int) -> list[int]:
        count = min(count, self.model.num_free)
        blocks = self.changes.allocate(count)
        assert blocks == self.model.allocate(count), "allocated other blocks"
        return blocks

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def cache(self, data):
        """Some uncached blocks of a sequence fill and join the prefix cache, under hashes few
        enough that some are held already (those stay where they are)."""
        table = data.draw(st.sampled_from(self.tables))
        blocks = [block for block in table if block not in self.model.cached]
        blocks = data.draw(st.lists(st.sampled_from(blocks), unique=True) if blocks
                           else st.just([]))
        entries = [CachedBlock(data.draw(st.integers(0, 40)), 0, block.to_bytes(4, "little"))
                   for block in blocks]
        self.changes.cache_many(blocks, [e.block_hash for e in entries],
                                [e.parent_hash for e in entries], [e.token_bytes for e in entries])
        self.model.cache(blocks, entries)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        """Some sequences finish together: one release of their tables, each from its last
        block to its first (past ``BULK_RELEASE`` blocks, the pool counts them in bulk)."""
        self.release(data.draw(st.lists(st.integers(0, len(self.tables) - 1), unique=True,
                                        min_size=1)))

    @precondition(lambda self: sum(map(len, self.tables)) >= BULK_RELEASE)
    @rule()
    def finish_all(self):
        """Every sequence finishes at once, their blocks past ``BULK_RELEASE``: bulk releases
        in many more examples (drawn subsets alone freed blocks in bulk 19-129 times in 200
        examples, and a CI run fell below the floor of 20)."""
        self.release(range(len(self.tables)))

    def release(self, indexes) -> None:
        blocks = [block for i in sorted(indexes) for block in reversed(self.tables[i])]
        self.changes.release(blocks)
        free = self.model.num_free
        self.model.release(blocks)
        if len(blocks) >= BULK_RELEASE and self.model.num_free > free + 1:
            coverage["bulk releases freeing blocks"] += 1
        self.tables = [table for i, table in enumerate(self.tables) if i not in indexes]

    @rule(data=st.data())
    def forget(self, data):
        blocks = data.draw(st.lists(st.integers(0, self.pool.num_blocks - 1), max_size=6))
        self.changes.forget(blocks)
        self.model.forget(blocks)

    @rule()
    def end_step(self):
        self.pool = self.changes.build()
        self.changes = PoolChanges(self.pool)
        pool, model = self.pool, self.model
        assert list(pool.ref_counts) == model.refs
        assert list(pool.plain_free) == model.plain[::-1], "plain free blocks out of order"
        assert list(pool.cached_free()) == model.lru, "eviction order"
        assert dict(pool.cached_blocks()) == model.cached
        assert dict(pool.by_hash.items()) == {e.block_hash: b for b, e in model.cached.items()}
        assert (pool.num_plain_free, pool.num_cached_free) == (len(model.plain), len(model.lru))

    @invariant()
    def free_blocks_agree(self):
        if hasattr(self, "changes"):
            assert self.changes.num_free == self.model.num_free


PoolMachine.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=steps(50), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_the_pool_does_what_its_model_does():
    coverage.clear()
    PoolMachine.TestCase().runTest()
    print(f"block pool: {dict(coverage)}")
    assert coverage["bulk releases freeing blocks"] >= coverage_floor(20)
