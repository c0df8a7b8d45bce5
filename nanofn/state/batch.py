"""``RunningBatch``: the running sequences as columns, in admission order.

One row per running sequence in a read-only int64 matrix (``cols``, columns named below), the
sequences' specs and ids as tuples, and their tokens, block tables and block hashes in a
``SeqStore``. A decode step updates the columns with a handful of vectorized operations; work
per sequence happens only where something does (a block fills or is needed, a sequence starts,
finishes, is preempted, or needs its history).

A *stint* is a sequence's time in the batch, from admission to finish or preemption: its
``SERIAL`` is unique and increasing (so a plan's tokens find their rows by binary search, and
tokens of stints that ended are recognised), its ``SLOT`` is the small index the runner keeps
its per-sequence state under (reused once the stint ends), its ``ROW`` is its store row.
A hybrid model's sequence also holds a recurrent-state slot (``STATE``, see ``state_pool.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import NamedTuple

import numpy as np

from nanofn.state.records import Seq, SeqSpec, SeqStatus
from nanofn.state.store import HASHES, TABLES, TOKENS, SeqStore, empty_store, moved

# The columns of ``RunningBatch.cols``.
(SERIAL, SLOT, ROW,  # identity
 NUM_TOKENS, NUM_COMPUTED, NUM_PENDING, NUM_BLOCKS, NUM_HASHED,  # progress
 NUM_PROMPT, LENGTH_LIMIT, IGNORE_EOS, MIN_TOKENS, HAS_STOP_IDS, WAITS_FOR_TOKEN,  # policy inputs
 NUM_PREEMPTIONS, NUM_CACHED,
 STATE, SAVE_AT) = range(18)  # WAITS_FOR_TOKEN: SamplingParams.waits_for_token
# (The plain decode step, decode.py, reads the last three policy inputs as one slice, and adds
# one to the tokens and the computed ones as one slice.) A hybrid model's sequence works in the
# recurrent-state slot ``STATE`` (-1 for other models) and, while its prompt is computed, saves
# that state for the prefix cache once ``SAVE_AT`` tokens are computed (0: no save ahead).
NUM_COLS = 18
FILL_COLS = [NUM_TOKENS, NUM_BLOCKS, NUM_HASHED]  # a row's view of the store, per kind


class PlainRun(NamedTuple):
    """What the plain decode step (``decode.py``) found true of a batch's columns, passed on to
    the batches its next plain steps make (whose columns differ only by a token more each):
    every row decodes one token with nothing to do on the host, and for the batch's next
    ``steps_left`` deliveries no row reaches its length limit or the end of its store rows.
    ``ignores_eos``: every row ignores end-of-sequence tokens; ``all_pending``: every row
    computes a pending token."""

    steps_left: int
    ignores_eos: bool
    all_pending: bool


@dataclass(frozen=True, slots=True, eq=False)
class RunningBatch:
    cols: np.ndarray  # [n, NUM_COLS] int64, read-only
    specs: tuple[SeqSpec, ...]
    ids: tuple[str, ...]
    store: SeqStore
    write_key: object  # appends skip the fill-mark check while the store's owner is this key
    # A memo of the plain decode step's checks, set only by that step (None: not known).
    plain_run: PlainRun | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def col(self, name: int) -> np.ndarray:
        return self.cols[:, name]

    def tokens(self, i: int) -> np.ndarray:
        """Sequence ``i``'s known tokens (read-only)."""
        return self.store.view(TOKENS, int(self.cols[i, ROW]), int(self.cols[i, NUM_TOKENS]))

    def table(self, i: int) -> np.ndarray:
        return self.store.view(TABLES, int(self.cols[i, ROW]), int(self.cols[i, NUM_BLOCKS]))

    def hashes(self, i: int) -> np.ndarray:
        return self.store.view(HASHES, int(self.cols[i, ROW]), int(self.cols[i, NUM_HASHED]))

    def seq(self, i: int) -> Seq:
        """Sequence ``i`` as a record (for inspection; the hot path reads the columns)."""
        c = self.cols[i]
        return Seq(spec=self.specs[i], token_ids=tuple(self.tokens(i).tolist()),
                   block_hashes=tuple(self.hashes(i).tolist()),
                   block_table=tuple(self.table(i).tolist()), num_computed=int(c[NUM_COMPUTED]),
                   num_pending=int(c[NUM_PENDING]), status=SeqStatus.RUNNING,
                   num_preemptions=int(c[NUM_PREEMPTIONS]), num_cached_tokens=int(c[NUM_CACHED]),
                   state_slot=int(c[STATE]))

    def seqs(self) -> tuple[Seq, ...]:
        return tuple(self.seq(i) for i in range(len(self)))

    def index(self, seq_id: str) -> int | None:
        try:
            return self.ids.index(seq_id)
        except ValueError:
            return None

    def __eq__(self, other: object) -> bool:
        """Equal when every sequence is: the same columns (store rows aside) and contents."""
        if not isinstance(other, RunningBatch) or self.ids != other.ids or \
                self.specs != other.specs:
            return False
        keep = [c for c in range(NUM_COLS) if c != ROW]
        return (np.array_equal(self.cols[:, keep], other.cols[:, keep])
                and self.seqs() == other.seqs())

    def __hash__(self) -> int:
        return hash(self.ids)


def frozen(cols: np.ndarray) -> np.ndarray:
    """``cols`` read-only, in column-major order (one copy if it is not)."""
    cols = np.asfortranarray(cols)
    cols.setflags(write=False)
    return cols


def thawed(cols: np.ndarray) -> np.ndarray:
    """A writable copy of a batch's columns, column-major: a column, or a run of adjacent
    columns, is then one contiguous block, which makes an operation on it several times
    cheaper than on the strided column of a row-major matrix."""
    return cols.copy(order="F")


def empty_batch() -> RunningBatch:
    store = empty_store()
    return RunningBatch(frozen(np.zeros((0, NUM_COLS), np.int64)), (), (), store, store.claim())


def select(batch: RunningBatch, keep: np.ndarray) -> RunningBatch:
    """The batch without the rows where ``keep`` is False (order kept)."""
    if keep.all():
        return batch
    kept = keep.tolist()
    return RunningBatch(frozen(batch.cols[keep]), tuple(compress(batch.specs, kept)),
                        tuple(compress(batch.ids, kept)), batch.store, batch.write_key)


def fill_marks(cols: np.ndarray) -> np.ndarray:
    """``[n, 3]``: how far each row's tokens, table and hashes go."""
    return cols[:, FILL_COLS]


def with_room(store: SeqStore, cols: np.ndarray, kind: int, rows: np.ndarray | slice,
              counts: np.ndarray | int = 1, extra_rows: int = 0,
              extra_widths: tuple[int, int, int] = (0, 0, 0),
              key: object = None) -> tuple[SeqStore, np.ndarray]:
    """A store where ``rows`` (batch rows, of the writable ``cols``) can take ``counts`` more
    entries of ``kind`` in place: ``store`` itself, or, if a row has been written past this
    batch's view (another state's append) or is full, a new store holding the batch's rows
    (``cols``' ``ROW`` column then points into it). It also has ``extra_rows`` fresh rows at
    least ``extra_widths`` wide. ``key``: the write key of the batch ``cols`` comes from."""
    lengths = cols[rows, FILL_COLS[kind]]
    if (store.can_append(kind, cols[rows, ROW], lengths, counts, key)
            and store.num_rows + extra_rows <= store.capacity
            and all(store.width(k) >= extra_widths[k] for k in range(3))):
        return store, cols
    min_widths = list(extra_widths)
    if len(lengths):
        min_widths[kind] = max(min_widths[kind], int(np.max(lengths + counts)))
    new = moved(store, cols[:, ROW], fill_marks(cols), extra_rows, tuple(min_widths))
    cols[:, ROW] = np.arange(len(cols))
    return new, cols
