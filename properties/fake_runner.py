"""A fake runner for the pure core, over a fake device that holds what launched plans computed.

The device's KV cache holds, at each position of each block, what a launch computed there: the
fake model's "KV" of that position, a digest of the token there and of the KV of the position
before it, read back through the sequence's block table (so each KV stands for the whole token
prefix, as a transformer's does). Sampling reads the KV of every position of the context and
hashes them into the next token, so the model is a pure function of the token prefix when, and
only when, every position it reads holds what was computed for that prefix.

A position nothing has computed since its block was last handed out as a new block (not a
prefix-cache hit) reads as ``POISON``, which changes every KV and token computed from it: a
block reused after eviction holds nothing the engine may read. So any mistake in block tables,
slots, prefix-cache hits, recomputation after preemption or roll-back of a failed launch
changes what the device holds and what the model samples, and the checks here find it.

A launch can be made to fail after writing part of its plan, as a device error would; the KV
it wrote stays on the device but counts as computed by no one (``failed_launches``).

A hybrid model's recurrent states are the device's second resource (``RecurrentStates``):
each state slot holds the fake state a launch left there, a digest of every token its
sequence computed so far (as a Gated DeltaNet layer's state stands for its whole prefix),
updated in place token by token, copied in (restores) and out (saves) as the plans say. The
fake hybrid model samples from the KV it reads and from its sequence's state, so a state from
the wrong prefix, a restore from the wrong slot or a save of the wrong moment changes what it
samples; a slot nothing computed reads as ``POISON``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from nanofn.state import PENDING_TOKEN, BatchPlan, EngineState, SampleOutput
from nanofn.state.batch import SLOT
from nanofn.state.hashing import block_hashes

EOS = 0
ROOT_KV = 0  # what the position before a sequence's first one "holds"
POISON = 0xBAD_BAD_BAD_BAD  # what reading a position that holds nothing computed gives


def kv_after(previous_kv: int, token: int, position: int) -> int:
    """The fake model's KV of ``token`` at ``position`` after a position holding
    ``previous_kv``."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qq", token, position), previous_kv)


def kv_chain(token_ids: Sequence[int]) -> list[int]:
    """The KV of each position of a sequence of these tokens, all computed correctly."""
    kvs, kv = [], ROOT_KV
    for position, token in enumerate(token_ids):
        kv = kv_after(kv, token, position)
        kvs.append(kv)
    return kvs


def next_token(context_kvs: Sequence[int], vocab_size: int, banned: Sequence[int] = ()) -> int:
    """The fake model's choice after a context whose positions read ``context_kvs``:
    deterministic, EOS about once in ``vocab_size`` tokens. A banned token gives way to the
    next candidate, as the sampler's masked argmax does."""
    seed = xxhash.xxh64_intdigest(np.asarray(context_kvs, np.uint64).tobytes())
    for attempt in range(vocab_size):
        token = xxhash.xxh64_intdigest(attempt.to_bytes(4, "little"), seed) % vocab_size
        if token not in banned:
            return token
    raise AssertionError(f"every token is banned: {banned}")


class Computed(NamedTuple):
    """What a KV position holds: the KV a launch computed for ``token`` at ``position``."""

    kv: int
    token: int
    position: int
    launch: int


class KVCache:
    """The device's paged KV cache and the block table of each runner slot (kept by appends
    from the plans' new entries, as the real runner keeps them)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.positions: list[Computed | None] = [None] * (num_blocks * block_size)
        self.tables: dict[int, list[int]] = {}

    def where(self, table: Sequence[int], position: int) -> int:
        bs = self.block_size
        return table[position // bs] * bs + position % bs

    def start(self, slot: int) -> None:
        """A sequence starts in ``slot``: its table starts afresh."""
        self.tables[slot] = []

    def add_entry(self, slot: int, column: int, block: int, new: bool) -> None:
        """Append ``block`` to the slot's table; a ``new`` block (not a prefix-cache hit) holds
        nothing the sequence may read until it computes it."""
        table = self.tables[slot]
        assert column == len(table), f"slot {slot}: entry {column} after {len(table)}"
        table.append(block)
        if new:
            bs = self.block_size
            self.positions[block * bs:(block + 1) * bs] = [None] * bs

    def read(self, table: Sequence[int], position: int) -> int:
        held = self.positions[self.where(table, position)]
        return POISON if held is None else held.kv

    def compute(self, slot: int, position: int, token: int, launch: int) -> None:
        """Compute the KV of ``token`` at ``position`` from the position before it."""
        table = self.tables[slot]
        previous = self.read(table, position - 1) if position else ROOT_KV
        self.positions[self.where(table, position)] = Computed(
            kv_after(previous, token, position), token, position, launch)

    def context(self, slot: int, length: int) -> list[int]:
        """The KV of the first ``length`` positions of the slot's sequence, as attention reads
        them."""
        table = self.tables[slot]
        return [self.read(table, position) for position in range(length)]

    def block(self, block: int) -> list[Computed | None]:
        bs = self.block_size
        return self.positions[block * bs:(block + 1) * bs]


def state_after(previous: int, token: int, position: int) -> int:
    """The fake recurrent state after ``token`` at ``position``, from the state before it."""
    return xxhash.xxh3_64_intdigest(struct.pack("<qqq", token, position, 1), previous)


def state_chain(token_ids: Sequence[int]) -> int:
    """The fake state after these tokens, all computed correctly."""
    state = ROOT_KV
    for position, token in enumerate(token_ids):
        state = state_after(state, token, position)
    return state


class HeldState(NamedTuple):
    """What a state slot holds: a fake state, after the first ``length`` tokens of a
    sequence, that launch ``launch`` left there."""

    state: int
    length: int
    launch: int


class RecurrentStates:
    """The device's recurrent-state slots (a hybrid model's), and the state slot each runner
    slot's sequence works in (from the plan that starts it)."""

    def __init__(self, num_slots: int):
        self.slots: list[HeldState | None] = [None] * num_slots
        self.working: dict[int, int] = {}  # runner slot -> state slot

    def start(self, slot: int, state_slot: int) -> None:
        self.working[slot] = state_slot

    def copy(self, source: int, target: int) -> None:
        self.slots[target] = self.slots[source]

    def compute(self, slot: int, position: int, token: int, launch: int) -> None:
        """Take ``token`` at ``position`` into the slot's state, in place: from zeros at
        position 0, else from what the slot holds, which must be the state after exactly
        ``position`` tokens (anything else poisons it)."""
        state_slot = self.working[slot]
        held = self.slots[state_slot]
        if position == 0:
            before = ROOT_KV
        else:
            before = held.state if held is not None and held.length == position else POISON
        self.slots[state_slot] = HeldState(state_after(before, token, position), position + 1,
                                           launch)

    def read(self, slot: int, length: int) -> int:
        """The state of the slot's sequence after ``length`` tokens, as sampling reads it."""
        held = self.slots[self.working[slot]]
        return held.state if held is not None and held.length == length else POISON


class LaunchFailed(RuntimeError):
    """The fake device failed a launch of ``plan`` after computing part of it; ``new_blocks``
    are the blocks the plan handed out to compute into (its new table entries but prefix-cache
    hits)."""

    def __init__(self, plan: BatchPlan, launch: int, computed: int, new_blocks: set[int]):
        super().__init__(f"launch {launch} failed after {computed} of {plan.num_tokens} "
                         f"positions")
        self.plan = plan
        self.new_blocks = new_blocks


class Sampled:
    """A launched plan's tokens: the fake runner computes them at once."""

    def __init__(self, token_ids: tuple[int, ...]):
        self.output = SampleOutput(list(token_ids), [None] * len(token_ids))

    def wait(self) -> SampleOutput:
        return self.output

    def done(self) -> bool:
        return True


class FakeRunner:
    """Runs plans on the fake device: the KV cache, a hybrid model's recurrent states (with
    ``num_state_slots``), and per slot the token it sampled last (which a later plan's
    ``PENDING_TOKEN`` stands for)."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 40,
                 num_state_slots: int | None = None):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv = KVCache(num_blocks, block_size)
        self.states = None if num_state_slots is None else RecurrentStates(num_state_slots)
        self.last_sampled: dict[int, int] = {}  # the previous plan's tokens by slot
        self.num_launches = 0
        self.failed_launches: set[int] = set()
        # the failures asked for and still to come, by kind: (positions computed first, which
        # launch), in the order asked for
        self._failures: dict[str, tuple[int, Callable[[BatchPlan, set[int]], bool] | None]] = {}

    def fail(self, after: int, only_if: Callable[[BatchPlan, set[int]], bool] | None = None,
             kind: str = "any launch") -> None:
        """Fail the next launch once it has computed ``after`` positions (or all of them, if
        fewer). ``only_if``: only a launch for whose plan and new blocks (not prefix-cache hits)
        this is true. One failure of each ``kind`` waits for its launch; asking again for a
        kind replaces it, while a failure of another kind (say, of any launch) leaves it
        waiting: a rare launch's failure is not lost to a common one's."""
        self._failures.pop(kind, None)
        self._failures[kind] = (after, only_if)

    def launch(self, plan: BatchPlan) -> Sampled:
        """Take the plan's started sequences and new table entries (and a hybrid model's
        state restores), compute every scheduled position in plan order (then the state
        saves), then sample each sampling sequence's next token from its whole context (the
        runner's contract), never one the plan bans; or fail as ``fail`` said, raising
        ``LaunchFailed``."""
        self.num_launches += 1
        entries = plan.entries()
        assert all(PENDING_TOKEN not in s.token_ids[:-1] for s in entries), (
            "a pending token before the last")
        # (slot, column, block, whether new: a block the sequence computes into, not a hit)
        table_entries = [(entries[i].slot, column, block,
                          column * self.block_size >= entries[i].start_pos)
                         for i, column, block in plan.block_entries.tolist()]
        new_blocks = {block for _, _, block, new in table_entries if new}
        fail_after = self._positions_before_failing(plan, new_blocks)
        states = self.states
        for start in plan.started:
            self.kv.start(start.slot)
            if states is not None:
                states.start(start.slot, start.state_slot)
        for slot, column, block, new in table_entries:
            self.kv.add_entry(slot, column, block, new)
        for source, target in plan.state_restores:
            states.copy(source, target)
        positions = [(s.slot, s.start_pos + i, token) for s in entries
                     for i, token in enumerate(s.token_ids)]
        for slot, position, token in positions[:fail_after]:
            if token == PENDING_TOKEN:
                token = self.last_sampled[slot]
            self.kv.compute(slot, position, token, self.num_launches)
            if states is not None:
                states.compute(slot, position, token, self.num_launches)
        if fail_after is not None:
            self.failed_launches.add(self.num_launches)
            raise LaunchFailed(plan, self.num_launches, min(fail_after, len(positions)),
                               new_blocks)
        for i, target in plan.state_saves:
            states.copy(states.working[entries[i].slot], target)
        sampling = [s for s in entries if s.sample]
        sampled = tuple(next_token(self._context(s.slot, s.context_len), self.vocab_size,
                                   s.banned_token_ids) for s in sampling)
        self.last_sampled = {s.slot: token for s, token in zip(sampling, sampled)}
        return Sampled(sampled)

    def _context(self, slot: int, length: int) -> list[int]:
        """What the fake model reads to sample: the KV of every position of the context and,
        for a hybrid model, the sequence's state."""
        context = self.kv.context(slot, length)
        return context if self.states is None else context + [self.states.read(slot, length)]

    def _positions_before_failing(self, plan: BatchPlan, new_blocks: set[int]) -> int | None:
        """How many positions this launch computes before it fails, or None if it does not
        (``fail``)."""
        for kind, (after, only_if) in self._failures.items():
            if only_if is None or only_if(plan, new_blocks):
                del self._failures[kind]
                return after
        return None

    def holds_computed(self, held: Computed | None) -> bool:
        """Whether a position holds KV that a launch which did not fail computed."""
        return held is not None and held.launch not in self.failed_launches


def check_running_contexts(runner: FakeRunner, state: EngineState) -> None:
    """Each running sequence's block table is the one the runner keeps for its slot, and each
    of its computed, known positions holds the KV of its own token prefix."""
    slots = state.batch.col(SLOT).tolist()
    for seq, slot in zip(state.running, slots):
        if seq.block_table:
            assert runner.kv.tables[slot] == list(seq.block_table), f"{seq.seq_id}'s table"
        known = min(seq.num_computed, seq.num_tokens)
        expected = kv_chain(seq.token_ids[:known])
        held = runner.kv.context(slot, known)
        if held != expected:
            position = next(p for p, (a, b) in enumerate(zip(held, expected)) if a != b)
            where = runner.kv.where(seq.block_table, position)
            raise AssertionError(f"{seq.seq_id}: position {position} holds "
                                 f"{runner.kv.positions[where]}, not the KV of its prefix")


def check_states(runner: FakeRunner, state: EngineState) -> None:
    """A hybrid model's states: each running sequence's slot holds the state of its computed
    tokens (where they are all known), and each saved state's slot the state of the tokens
    its prefix-cache entry lists, which its key (the hash of their last block) stands for: a
    saved state is used only for a prefix whose tokens equal its own."""
    if state.states is None:
        return
    bs = state.config.block_size
    for seq in state.running:
        computed = seq.num_computed
        if 0 < computed <= seq.num_tokens:
            held = runner.states.slots[seq.state_slot]
            assert held is not None and held.length == computed and held.state == state_chain(
                seq.token_ids[:computed]), f"{seq.seq_id}'s state slot {seq.state_slot}: {held}"
    for key, entry in state.states.saved.items():
        tokens = np.frombuffer(entry.token_bytes, "<u4").tolist()
        assert len(tokens) == entry.num_tokens and entry.num_tokens % bs == 0
        assert block_hashes(tokens, bs)[-1] == key, f"saved state {entry.slot} under another key"
        held = runner.states.slots[entry.slot]
        assert held is not None and (held.state, held.length) == (state_chain(tokens),
                                                                   len(tokens)), (
            f"saved state slot {entry.slot} holds {held}, not the state of its {len(tokens)} "
            f"tokens")


def check_cached_blocks_computed(runner: FakeRunner, state: EngineState) -> None:
    """A block is in the prefix cache only once it is computed: every position of it holds
    KV that a launch which did not fail computed since the block was last handed out new, for
    the tokens the cache lists, at consecutive positions of one block of a sequence, each
    from the one before."""
    bs = runner.block_size
    for block, entry in state.pool.cached_blocks():
        held = runner.kv.block(block)
        assert all(map(runner.holds_computed, held)), (
            f"cached block {block} is not computed: {held}")
        assert [h.token for h in held] == list(entry.token_ids), f"cached block {block} lies"
        first = held[0].position
        assert first % bs == 0 and [h.position for h in held] == list(range(first, first + bs))
        for before, after in zip(held, held[1:]):
            assert after.kv == kv_after(before.kv, after.token, after.position), (
                f"cached block {block}: position {after.position} not computed after "
                f"{before.position}")


def stop_string_hit(output: Sequence[int]) -> bool:
    """A content-defined "stop string" for tests: two equal tokens in a row. It depends only on
    the output, so it fires at the same token whatever the scheduling."""
    return len(output) >= 2 and output[-1] == output[-2]
