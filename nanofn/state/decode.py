"""The common step as a shortcut: every running sequence takes its delivered token and is
scheduled for one more, and nothing else happens.

``step`` tries ``decode_step`` first. It applies when nobody waits, arrives, is aborted or hits a
stop string, the delivered tokens are the whole batch's in batch order, no sequence finishes,
needs its tokens on the host (stop token ids, ``min_tokens``, penalties, bad words, a grammar)
or has more than one token to compute, and the free blocks cover the sequences that cross into
a new block. Then it gives exactly the state and plan that ``full_step`` gives (a property
checks it on every step where it applies) in a few dozen array operations over the batch's
columns and no Python work per sequence. Otherwise it returns None and the general path
decides. The stopping and readiness rules are ``policy.py``'s.

Most of the checks hold from one plain step to the next by construction, so the step that
makes them passes their verdict on in the new batch (``PlainRun``: the deliveries it covers,
a property checks it against the checks on every state that carries it), and the common
allocation, plain free blocks with nothing freed, skips the pool's builder. With both, 256
sequences take 0.27-0.28 µs each a step on the development machine
(``benchmarks/scheduler.py --pipelined``).
"""

from __future__ import annotations

import functools

import numpy as np

from nanofn.state.batch import (IGNORE_EOS, LENGTH_LIMIT, MIN_TOKENS, NUM_BLOCKS, NUM_COMPUTED,
                                NUM_PENDING, NUM_PROMPT, NUM_TOKENS, ROW, SERIAL, SLOT,
                                WAITS_FOR_TOKEN, PlainRun, RunningBatch, frozen, thawed)
from nanofn.state.block_pool import PoolChanges, take_plain_blocks
from nanofn.state.engine_state import EngineState, InFlight, evolve
from nanofn.state.plan import PENDING_TOKEN, BatchPlan
from nanofn.state.policy import ends_on, tokens_to_length_limit
from nanofn.state.scheduler import NO_ENTRIES, cache_computed_blocks, entry_rows
from nanofn.state.store import TABLES, TOKENS, SeqStore


def decode_step(state: EngineState, sampled: np.ndarray,
                delivers_only: bool) -> tuple[EngineState, BatchPlan] | None:
    """``full_step(state, Events(sampled=sampled))`` when that is a plain decode step, else
    None. ``sampled`` passed the delivery check; ``delivers_only``: the events hold nothing
    else."""
    batch, c = state.batch, state.config
    n, store = len(batch), batch.store
    if (not delivers_only or state.waiting or not n or n > c.max_num_batched_tokens
            or store.owner is not batch.write_key):  # (else appends must check fill marks)
        return None
    cols = batch.cols
    if state.undelivered[0].serials_bytes != cols[:, SERIAL].tobytes():
        return None  # other stints' tokens
    run = batch.plain_run or find_plain_run(batch, c.block_size)
    if run is None:
        return None
    if not run.ignores_eos:
        ends = ends_on(sampled, True, c.eos_token_ids)
        if np.count_nonzero(ends) and np.count_nonzero(ends & (cols[:, IGNORE_EOS] == 0)):
            return None
    # (``blocks_for(computed + 1) > NUM_BLOCKS``, in two operations instead of five; the
    # tables have room for the new blocks: see ``find_plain_run``)
    grown = np.flatnonzero(cols[:, NUM_COMPUTED] >= cols[:, NUM_BLOCKS] * c.block_size)
    if len(grown) > state.pool.num_free:
        return None
    return _decode(state, sampled, run, grown)


def find_plain_run(batch: RunningBatch, block_size: int) -> PlainRun | None:
    """The checks the plain decode step makes on a batch's columns, or None if they fail:
    every row has one token to compute, ready to be scheduled (only its last token pending,
    and not its last by length), no row needs its tokens on the host (stop token ids,
    ``min_tokens``, penalties, bad words, a grammar), every prompt is done, and the store has
    room for the delivered token and for a new block in each table. These hold after a plain
    step if they held before it, except the bounds, which a row comes one token closer to in
    each step: hence ``steps_left``."""
    cols, store = batch.cols, batch.store
    if np.count_nonzero(cols[:, MIN_TOKENS:WAITS_FOR_TOKEN + 1]):
        return None
    num_tokens, computed = cols[:, NUM_TOKENS], cols[:, NUM_COMPUTED]
    pending = cols[:, NUM_PENDING] - 1  # after the delivery
    known_and_pending = num_tokens + cols[:, NUM_PENDING]  # (the same after it)
    if np.count_nonzero((known_and_pending - computed != 1) | (pending > 1)
                        | (computed < cols[:, NUM_PROMPT])):
        return None
    # Deliveries until a row reaches its length limit (``at_length_limit``), fills its store
    # row of tokens, or needs a block past its table's end (a row needs one when its computed
    # tokens fill its blocks, and its blocks cover them: so if its computed tokens fit the
    # table's width, so does the new block).
    to_limit = tokens_to_length_limit(known_and_pending, cols[:, LENGTH_LIMIT])
    steps_left = min(int(to_limit.min()), store.width(TOKENS) - int(num_tokens.max()),
                     store.width(TABLES) * block_size - int(computed.max()))
    if steps_left < 1:
        return None
    return PlainRun(steps_left, bool(cols[:, IGNORE_EOS].all()),
                    np.count_nonzero(pending) == len(cols))


def _decode(state: EngineState, sampled: np.ndarray, run: PlainRun,
            grown: np.ndarray) -> tuple[EngineState, BatchPlan]:
    """The plain decode step ``decode_step`` found (``run``: what it knows of the batch;
    ``grown``: the rows that need a block): append, grow, schedule, plan."""
    batch, c, store = state.batch, state.config, state.batch.store
    cols = thawed(batch.cols)
    store.append(TOKENS, cols[:, ROW], cols[:, NUM_TOKENS], sampled)
    starts = cols[:, NUM_COMPUTED].copy()
    cols[:, NUM_TOKENS:NUM_COMPUTED + 1] += 1  # (the pending count is back where it was)
    pool, entries = state.pool, NO_ENTRIES
    if len(grown) or not run.all_pending:
        taken = take_plain_blocks(pool, len(grown)) if run.all_pending else None
        if taken:
            pool, blocks = taken
        else:
            changes = PoolChanges(pool)
            blocks = changes.allocate(len(grown))
            if not run.all_pending and c.enable_prefix_caching:
                cache_computed_blocks(store, cols, starts, changes, c.block_size)
            pool = changes.build()
        if len(grown):
            entries = _add_blocks(store, cols, grown, blocks)
    n = len(cols)
    plan = BatchPlan(
        step=state.step + 1,
        seq_ids=batch.ids,
        slots=cols[:, SLOT].copy(),
        start_pos=starts,
        num_scheduled=_constant(n, 1, np.int64),
        sample=_constant(n, True, bool),
        # (with nothing pending, the token to compute is the one just delivered)
        token_ids=(_constant(n, PENDING_TOKEN, np.int64) if run.all_pending
                   else np.where(cols[:, NUM_PENDING] > 1, PENDING_TOKEN, sampled)),
        block_entries=entries,
        num_decode_tokens=n,
    )
    in_flight = InFlight(state.undelivered[0].serials_bytes, batch.ids)
    next_run = (PlainRun(run.steps_left - 1, run.ignores_eos, run.all_pending)
                if run.steps_left > 1 else None)
    new_batch = RunningBatch(frozen(cols), batch.specs, batch.ids, store, store.claim(),
                             next_run)
    return evolve(state, step=state.step + 1, finished=(), preempted=(), pool=pool,
                  batch=new_batch, undelivered=state.undelivered[1:] + (in_flight,)), plan


def _add_blocks(store: SeqStore, cols: np.ndarray, grown: np.ndarray,
                new_blocks: list[int]) -> np.ndarray:
    """A new block at the end of each grown row's table; returns the plan's block entries."""
    blocks = np.array(new_blocks, np.int64)
    columns = cols[grown, NUM_BLOCKS]
    store.append(TABLES, cols[grown, ROW], columns, blocks)
    cols[grown, NUM_BLOCKS] = columns + 1
    return entry_rows(grown, columns, blocks)


@functools.lru_cache(maxsize=16)
def _constant(n: int, value: int, dtype: type) -> np.ndarray:
    """``n`` times ``value``, read-only: the plans of steps of one batch size share it."""
    out = np.full(n, value, dtype)
    out.setflags(write=False)
    return out
