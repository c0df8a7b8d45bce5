"""``SeqStore``: the token ids, block tables and block hashes of running sequences, in rows that
only ever grow at their ends, shared by a lineage of states.

A state sees a row through lengths it holds itself (its batch's columns), so it sees a prefix
of each row. The store is the one mutable object of the core, under one rule that keeps every
state's view unchanged forever: a position below a row's fill mark is never written again. An
append at position ``p`` writes in place only if the row is filled to exactly ``p`` (no other
state has seen ``p``); otherwise (a state stepped twice, say in a test or a debugger) it copies
the rows it needs into a new store first. Rows are never reused: a sequence that starts running
takes a fresh row, and when rows run out the running ones move to a new store, whose old one
lives as long as some state still refers to it.

Checking fill marks costs a few array operations per append, so a store also remembers the
*write key* of the one batch that wrote it last (``owner``): that batch's views end exactly at
the fill marks, so it, and any batch derived from it without writing, may append without the
check. Writing hands the store a new key, which only the new batch holds.

This is what lets a decode step append a token to every running sequence with one vectorized
write instead of rebuilding a record per sequence.
"""

from __future__ import annotations

import array

import numpy as np

TOKENS, TABLES, HASHES = 0, 1, 2  # the kinds of rows
MIN_ROWS, MIN_WIDTH = 64, 64


class SeqStore:
    __slots__ = ("arrays", "filled", "num_rows", "owner")

    def __init__(self, rows: int, widths: tuple[int, int, int]):
        self.arrays = (np.zeros((rows, widths[TOKENS]), np.int64),
                       np.zeros((rows, widths[TABLES]), np.int64),
                       np.zeros((rows, widths[HASHES]), np.uint64))
        self.filled = np.zeros((3, rows), np.int64)  # per kind, each row's fill mark
        self.num_rows = 0  # rows handed out
        self.owner: object = None  # the write key of the batch that wrote last

    def claim(self) -> object:
        """A new write key, now the store's owner: give it to the batch just written."""
        self.owner = key = object()
        return key

    @property
    def capacity(self) -> int:
        return self.filled.shape[1]

    def width(self, kind: int) -> int:
        return self.arrays[kind].shape[1]

    def view(self, kind: int, row: int, length: int) -> np.ndarray:
        """The first ``length`` entries of a row, read-only."""
        out = self.arrays[kind][row, :length]
        out.flags.writeable = False
        return out

    def can_append(self, kind: int, rows: np.ndarray, lengths: np.ndarray,
                   counts: np.ndarray | int = 1, key: object = None) -> bool:
        """Whether ``counts`` entries can be written in place at ``lengths`` of ``rows`` (the
        fill marks need no check when ``key`` owns the store)."""
        if not len(rows):
            return True
        return ((key is self.owner or bool((self.filled[kind][rows] == lengths).all()))
                and int((lengths + counts).max()) <= self.arrays[kind].shape[1])

    def append(self, kind: int, rows: np.ndarray, lengths: np.ndarray,
               values: np.ndarray) -> None:
        """Write ``values[i]`` at position ``lengths[i]`` of ``rows[i]`` (``can_append`` holds)."""
        self.arrays[kind][rows, lengths] = values
        self.filled[kind][rows] = lengths + 1

    def extend(self, kind: int, row: int, length: int, values) -> None:
        """Write ``values`` from position ``length`` of ``row`` on (``can_append`` holds)."""
        if isinstance(values, (tuple, list)):  # read by array.array: 4x numpy, for a tuple
            values = np.frombuffer(array.array("q", values), np.int64)
        end = length + len(values)
        self.arrays[kind][row, length:end] = values
        self.filled[kind, row] = end

    def take_rows(self, count: int) -> np.ndarray | None:
        """``count`` fresh rows, or None if the store has too few left."""
        if self.num_rows + count > self.capacity:
            return None
        rows = np.arange(self.num_rows, self.num_rows + count)
        self.num_rows += count
        return rows


def moved(store: SeqStore, rows: np.ndarray, lengths: np.ndarray, extra_rows: int,
          min_widths: tuple[int, int, int]) -> SeqStore:
    """A new store holding copies of ``rows`` (row ``i`` of it is ``rows[i]``), filled to
    ``lengths`` (shape ``[len(rows), 3]``), with room for ``extra_rows`` more and widths of at
    least ``min_widths``."""
    n = len(rows)
    widths = tuple(_round_up(max(store.width(kind), min_widths[kind])) for kind in range(3))
    new = SeqStore(max(MIN_ROWS, 2 * (n + extra_rows)), widths)
    for kind in range(3):
        if n:
            longest = int(lengths[:, kind].max())
            new.arrays[kind][:n, :longest] = store.arrays[kind][rows, :longest]
    new.filled[:, :n] = lengths.T
    new.num_rows = n
    return new


def empty_store() -> SeqStore:
    return SeqStore(MIN_ROWS, (MIN_WIDTH, MIN_WIDTH, MIN_WIDTH))


def _round_up(width: int) -> int:
    """The next power of two, so that widening happens O(log) times."""
    return max(MIN_WIDTH, 1 << (max(width, 1) - 1).bit_length())
