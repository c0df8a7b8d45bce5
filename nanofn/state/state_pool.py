"""The recurrent-state slots of a hybrid model: the core's second resource, beside KV blocks.

A hybrid model (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside full attention) keeps, per
sequence, a fixed-size recurrent state for all its linear layers, which cannot be paged by
tokens. The runner holds ``num_slots`` such states; each slot is

* **free**;
* **working**: the state of one running sequence (the batch's ``STATE`` column names it),
  which every step that computes the sequence updates in place;
* or **saved**: a copy of some sequence's state after a prefix of whole blocks, kept as a
  prefix-cache entry under the chained hash of the prefix's last block, confirmed against the
  prefix's tokens on every hit, and evicted least recently used first.

free + working + saved = all slots, and no slot is two of them (the property suite checks it).

A saved state becomes usable from the step after the one whose plan saves it: the runner
copies saved states into working slots before a step's work and saves working states after
it, so a sequence admitted in the step that saves a prefix cannot start from it (the
scheduler registers a step's saves after its admissions), and a save's slot is not taken
again in the step that writes it.

Every change of a step goes through a ``StateChanges`` and becomes a new ``StatePool`` at the
end; a pool is never written once built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nanofn.state.pdict import PDict


class SavedState(NamedTuple):
    """A saved slot's prefix-cache entry: the state after the ``num_tokens`` tokens whose bytes
    (``hashing.token_bytes``) are ``token_bytes``."""

    slot: int
    num_tokens: int
    token_bytes: bytes
    saved_at: int  # the step whose plan saves it: usable from the next step on
    last_used: int  # the step that saved it or last started a sequence from it


@dataclass(frozen=True, slots=True)
class StatePool:
    num_slots: int
    free: tuple[int, ...]  # the last is taken first
    saved: PDict  # block hash -> SavedState

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_saved(self) -> int:
        return len(self.saved)

    @property
    def num_working(self) -> int:
        return self.num_slots - self.num_free - self.num_saved

    def saved_by_age(self) -> list[tuple[int, SavedState]]:
        """``(block hash, entry)`` of every saved state, first evicted first."""
        return sorted(self.saved.items(), key=lambda item: _age(item[1]))


def new_state_pool(num_slots: int) -> StatePool:
    return StatePool(num_slots, tuple(range(num_slots - 1, -1, -1)), PDict())


def _age(entry: SavedState) -> tuple[int, int]:
    return entry.last_used, entry.slot


class StateChanges:
    """The changes one step (number ``step``) makes to a state pool, frozen by ``build``."""

    def __init__(self, pool: StatePool, step: int):
        self._pool = pool
        self._step = step
        self._free = list(pool.free)
        self._saved: dict[int, SavedState] | None = None  # a copy, once changed

    @property
    def _entries(self) -> dict[int, SavedState] | PDict:
        return self._pool.saved if self._saved is None else self._saved

    def _writable(self) -> dict[int, SavedState]:
        if self._saved is None:
            self._saved = dict(self._pool.saved.items())
        return self._saved

    def can_take(self, keep: int | None = None) -> bool:
        """Whether ``take(keep)`` would find a slot."""
        return bool(self._free) or self._victim(keep) is not None

    def take(self, keep: int | None = None) -> int | None:
        """A slot for a working or saved state: a free one, else the slot of the least recently
        used saved state (not one saved in this step, whose slot the step writes, nor the entry
        of block hash ``keep``); None if there is neither."""
        if self._free:
            return self._free.pop()
        victim = self._victim(keep)
        if victim is None:
            return None
        return self._writable().pop(victim).slot

    def _victim(self, keep: int | None) -> int | None:
        evictable = [(entry, key) for key, entry in self._entries.items()
                     if entry.saved_at < self._step and key != keep]
        return min(evictable, key=lambda pair: _age(pair[0]))[1] if evictable else None

    def release(self, slots: Iterable[int]) -> None:
        """Working states whose sequences left the batch: their slots are free."""
        self._free.extend(slots)

    def find(self, hashes: Sequence[int], data: bytes, limit: int,
             block_size: int) -> tuple[int, SavedState | None]:
        """The longest prefix of at most ``limit`` blocks of a sequence (its block ``hashes`` and
        ``token_bytes`` ``data``) with a usable saved state: ``(blocks, entry)``, or
        ``(0, None)``. An entry counts only if the prefix's tokens equal its own."""
        entries = self._entries
        candidates = hashes[:limit]
        present = (set(candidates) - entries.absent(candidates) if isinstance(entries, PDict)
                   else entries.keys() & set(candidates))
        width = 4 * block_size
        for blocks in range(limit, 0, -1):
            key = hashes[blocks - 1]
            if key not in present:
                continue
            entry = entries[key]
            if entry.token_bytes == data[:blocks * width]:
                return blocks, entry
        return 0, None

    def adopt(self, block_hash: int) -> int:
        """The slot of the saved state of ``block_hash``, taken whole as a sequence's working
        state (when no other slot is left): the sequence starts from it with no copy."""
        return self._writable().pop(block_hash).slot

    def holds(self, block_hash: int) -> bool:
        """Whether a state is saved (or being saved in this step) under ``block_hash``."""
        return block_hash in self._entries

    def restore(self, block_hash: int) -> None:
        """A sequence starts from the entry of ``block_hash``: it becomes the most recent."""
        entries = self._writable()
        entries[block_hash] = entries[block_hash]._replace(last_used=self._step)

    def save(self, block_hash: int, num_tokens: int, token_bytes: bytes) -> int | None:
        """A slot to save a working state into, under ``block_hash`` (the prefix's last block's),
        or None if the state is not saved: one is saved (or being saved) there already, or no
        slot can be had."""
        if self.holds(block_hash):
            return None
        slot = self.take()
        if slot is not None:
            self._writable()[block_hash] = SavedState(slot, num_tokens, token_bytes, self._step,
                                                      self._step)
        return slot

    def forget(self, slots: Iterable[int]) -> None:
        """Drop the saved states of these slots (a failed launch may have written them): their
        slots are free, freed in ascending order (whatever order the saved states are held
        in). Slots that hold no saved state are left as they are."""
        gone = set(slots)
        entries = self._entries
        keys = sorted((key for key, entry in entries.items() if entry.slot in gone),
                      key=lambda key: entries[key].slot)
        if keys:
            writable = self._writable()
            for key in keys:
                self._free.append(writable.pop(key).slot)

    def build(self) -> StatePool:
        free = tuple(self._free)
        if self._saved is None and free == self._pool.free:
            return self._pool
        saved = self._pool.saved
        if self._saved is not None:
            old = dict(saved.items())
            added = {k: v for k, v in self._saved.items() if old.get(k) != v}
            saved = saved.update(added, [k for k in old if k not in self._saved])
        return StatePool(self._pool.num_slots, free, saved)
