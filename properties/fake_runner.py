"""A fake runner for the pure core: a paged "KV cache" of (token, position) pairs and a model
whose next token is a pure function of the token prefix it reads back from that cache.

Because the model sees only what the plan's block tables let it read, any mistake in block
tables, slots, prefix-cache hits or recomputation after preemption changes the outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from nanofn.state import PENDING_TOKEN, BatchPlan, EngineState, SampleOutput
from nanofn.state.batch import SLOT

EOS = 0


def next_token(prefix: Sequence[int], vocab_size: int, banned: Sequence[int] = ()) -> int:
    """The fake model: deterministic in the prefix, EOS about once in ``vocab_size`` tokens.
    A banned token gives way to the next candidate, as the sampler's masked argmax does."""
    key = ",".join(map(str, prefix))
    for attempt in range(vocab_size):
        token = xxhash.xxh64_intdigest(f"{key}#{attempt}".encode()) % vocab_size
        if token not in banned:
            return token
    raise AssertionError(f"every token is banned: {banned}")


class Sampled:
    """A launched plan's tokens: the fake runner computes them at once."""

    def __init__(self, token_ids: tuple[int, ...]):
        self.output = SampleOutput(list(token_ids), [None] * len(token_ids))

    def wait(self) -> SampleOutput:
        return self.output

    def done(self) -> bool:
        return True


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 40):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.tables: dict[int, list[int]] = {}  # per slot, kept by appends as the real runner
        self.last_sampled: dict[int, int] = {}  # the previous plan's tokens by slot

    def slot(self, block_table: Sequence[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def launch(self, plan: BatchPlan) -> Sampled:
        """Write every scheduled token, then read each sampling sequence's whole context back
        and sample the next token of each, in plan order (the runner's contract), never one
        the plan bans. Block tables are kept per slot from the plan's new entries alone: a
        sequence that starts running starts its slot's table afresh."""
        for start in plan.started:
            self.tables[start.slot] = []
        slots = plan.slots.tolist()
        for i, column, block in plan.block_entries.tolist():
            table = self.tables[slots[i]]
            assert column == len(table), f"slot {slots[i]}: entry {column} after {len(table)}"
            table.append(block)
        entries = plan.entries()
        for s in entries:
            table = self.tables[s.slot]
            assert PENDING_TOKEN not in s.token_ids[:-1], "a pending token before the last"
            for i, token in enumerate(s.token_ids):
                if token == PENDING_TOKEN:
                    token = self.last_sampled[s.slot]
                position = s.start_pos + i
                self.slots[self.slot(table, position)] = (token, position)
        sampled = tuple(next_token(self.read(self.tables[s.slot], s.context_len),
                                   self.vocab_size, s.banned_token_ids)
                        for s in entries if s.sample)
        self.last_sampled = dict(zip((s.slot for s in entries if s.sample), sampled))
        return Sampled(sampled)

    def read(self, block_table: Sequence[int], length: int) -> list[int]:
        tokens = []
        for position in range(length):
            entry = self.slots[self.slot(block_table, position)]
            assert entry is not None and entry[1] == position, (
                f"position {position} reads {entry} from block table {list(block_table)}")
            tokens.append(entry[0])
        return tokens

    def check_cache_contents(self, state: EngineState) -> None:
        """Every block the prefix cache lists holds exactly the tokens it claims."""
        bs = self.block_size
        for block, entry in state.pool.cached_blocks():
            stored = [self.slots[block * bs + k] for k in range(bs)]
            assert [t for t, _ in stored] == list(entry.token_ids), f"cached block {block} lies"


def stop_string_hit(output: Sequence[int]) -> bool:
    """A content-defined "stop string" for tests: two equal tokens in a row. It depends only on
    the output, so it fires at the same token whatever the scheduling."""
    return len(output) >= 2 and output[-1] == output[-2]


def check_running_contexts(runner: FakeRunner, state: EngineState) -> None:
    """Each running sequence's block table is the one the runner keeps for its slot, and its
    computed, known tokens are in the cache where that table says."""
    slots = state.batch.col(SLOT).tolist()
    for seq, slot in zip(state.running, slots):
        if seq.block_table:
            assert runner.tables[slot] == list(seq.block_table), f"{seq.seq_id}'s table"
        known = min(seq.num_computed, seq.num_tokens)
        read = runner.read(seq.block_table, known)
        assert read == list(seq.token_ids[:known]), f"{seq.seq_id} reads {read}"
