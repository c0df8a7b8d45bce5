"""CUDA graphs for decode steps, fed by one host-to-device copy per step.

A decode step of a small model is hundreds of short kernels; a captured graph launches them all
at once. The graph also holds the step's input preparation: the host lays the plan's columns
(token ids, positions, slots, new block-table entries, sample rows) into one pinned int32
buffer, one copy moves it into the graph's static input buffer, and the replay resolves pending
tokens from the last sampled ones, appends the new block-table entries, gathers the block
tables by slot and computes the cache slots, in two Triton kernels (``triton_decode_inputs``).
So a decode step costs the host a few numpy operations, one copy and one replay, whatever the
batch size.

One graph per batch size of ``graph_batch_sizes``; a batch is padded up to the next captured
size (padding rows write to no cache slot and attend to nothing; padding table entries go to a
spare row of the slot tables).

With ``sample=True`` each size has a second graph that goes on to the tokens: the logits of the
sampling rows, the fused Triton draw (``sample_plain_by_slot``, keyed by a base the host draws
from the sampler's generator, as the eager sampler does, plus the sampling row) with each slot's
temperature from a device table, and the tokens kept by slot for the next step's pending ones.
The runner replays it when every sampling row is plain (no penalties, banned tokens, filters
other than on greedy rows, seed or logprobs), so the common decode step is one replay and one
copy back, with no sampler work on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from nanofn.model.batch import AttentionBatch, RecurrentState
from nanofn.runner.inputs import SlotTables
from nanofn.state.plan import PENDING_TOKEN, BatchPlan

# The fields of the static input buffer, each ``max_batch`` int32s long (the sampling key base
# is in the first entries of the last two, 31 bits in each).
(IDS, POSITIONS, SLOTS, ENTRY_SLOTS, ENTRY_COLUMNS, ENTRY_BLOCKS, SAMPLE_ROWS,
 SAMPLING_SLOTS, DECODE_ORDER, KEY_BASE_LOW, KEY_BASE_HIGH) = range(11)
NUM_FIELDS = 11
KEY_BASE_BITS = 31
STAGING_BUFFERS = 3  # pinned host buffers in turn: one may still be copying while the next fills


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def capture(run: Callable[[], None], pool=None) -> torch.cuda.CUDAGraph:
    """``run`` captured in a graph whose memory comes from ``pool`` (an earlier graph's
    ``pool()``; None: a new pool). Graphs of one pool share its memory, so capture the largest
    first and pass its pool on: the others fit in it."""
    graph = torch.cuda.CUDAGraph()
    run()  # warm up (Triton compiles, allocator settles) outside the capture
    with torch.cuda.graph(graph, pool):
        run()
    return graph


class StagedInputs:
    """A graph's static int32 input buffer on the device (``buffer``) and the pinned host
    buffers it is filled from, taken in turn: the host fills one while the copy from an earlier
    one may still be in flight, and waits only for the copy from the one it takes."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, buffers: int):
        self.buffer = torch.zeros(shape, dtype=torch.int32, device=device)
        self.host = [torch.zeros(shape, dtype=torch.int32).pin_memory() for _ in range(buffers)]
        self.copied = [torch.cuda.Event() for _ in range(buffers)]
        self.turn = 0

    @contextmanager
    def filling(self, columns: int | None = None) -> Iterator[np.ndarray]:
        """The next host buffer (numpy) to fill; when the block ends, its first ``columns``
        along the last axis (all of it by default) are copied to ``buffer``, asynchronously."""
        turn, self.turn = self.turn, (self.turn + 1) % len(self.host)
        self.copied[turn].synchronize()  # the copy from this buffer, len(host) steps ago
        host = self.host[turn]
        yield host.numpy()
        self.buffer[..., :columns].copy_(host[..., :columns], non_blocking=True)
        self.copied[turn].record()


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, tables: SlotTables,
                 max_batch: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 slot_temperature: torch.Tensor | None = None,
                 states: RecurrentState | None = None):
        """``dtype``: the model's (the hidden states the graphs leave for the LM head; an FP8
        KV cache's is not it). ``slot_temperature`` (float32 per slot, 0 for greedy, the spare
        slot last): capture the sampling graphs too. ``states``: a hybrid model's, read and
        written in place by slot (``tables.state_slot``; the padding rows' spare slot has a
        state slot of its own)."""
        self.states = states
        device = kv_cache.device
        self.sizes = graph_batch_sizes(max_batch)
        self.tables = tables
        self.block_size = block_size
        self.spare_slot = tables.table.shape[0] - 1  # padding entries land here
        self.staged = StagedInputs((NUM_FIELDS, max_batch), device, STAGING_BUFFERS)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_temperature = slot_temperature
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampling_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.staged.buffer[POSITIONS] = -1  # all padding, for the warm-up and the capture
        self.staged.buffer[SLOTS] = self.spare_slot
        self.staged.buffer[ENTRY_SLOTS] = self.spare_slot
        self.staged.buffer[SAMPLING_SLOTS] = self.spare_slot
        self.staged.buffer[DECODE_ORDER] = torch.arange(max_batch)
        pool = None
        for size in reversed(self.sizes):  # the largest first: the others reuse its memory
            kinds = [(self.graphs, False)]
            if slot_temperature is not None:
                kinds.insert(0, (self.sampling_graphs, True))
            for graphs, sample in kinds:
                graph = capture(self._forward_for(model, kv_cache, size, sample), pool)
                graphs[size], pool = graph, graph.pool()
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward_for(self, model, kv_cache: torch.Tensor, size: int, sample: bool):
        fields, query_start = self.staged.buffer[:, :size], self.query_start[:size + 1]

        def run() -> None:
            ids, positions, batch = decode_inputs(fields, self.tables, self.block_size,
                                                  query_start)
            if self.states is None:
                hidden = model(ids, positions, batch, kv_cache)
            else:
                hidden = model(ids, positions, batch, kv_cache, self.states)
            if sample:  # (the draw reads them in the graph: no copy out)
                sample_in_graph(model, hidden, fields, self.tables, self.slot_temperature,
                                self.tokens[:size])
            else:
                self.hidden[:size] = hidden
        return run

    def fits(self, plan: BatchPlan) -> bool:
        """Whether a plan can run as a graph: decode only, no more sequences than the largest
        graph, and no more new block-table entries than sequences (a decode step adds at most
        one block per sequence; a sequence that starts running brings a whole table)."""
        n = len(plan.seq_ids)
        return (plan.num_tokens == n and n <= self.max_batch
                and len(plan.block_entries) <= n)

    def forward(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode step's hidden states ``[B, hidden]`` (by replaying the smallest graph that
        holds ``B`` sequences), the rows to sample and their slots."""
        b, s = len(plan.seq_ids), len(plan.sampling_seq_ids)
        self._replay(self.graphs, plan, 0)
        return (self.hidden[:b], self.staged.buffer[SAMPLE_ROWS, :s].long(),
                self.staged.buffer[SAMPLING_SLOTS, :s].long())

    def sample(self, plan: BatchPlan, key_base: int) -> torch.Tensor:
        """The decode step's sampled tokens ``[S]`` (int64, on the device), drawn in the graph
        with keys ``key_base + sampling row``; the slots keep them for the next step."""
        self._replay(self.sampling_graphs, plan, key_base)
        return self.tokens[:len(plan.sampling_seq_ids)]

    def _replay(self, graphs: dict[int, torch.cuda.CUDAGraph], plan: BatchPlan,
                key_base: int) -> None:
        size = next(size for size in self.sizes if size >= len(plan.seq_ids))
        with self.staged.filling(size) as fields:
            fill_fields(fields, plan, size, self.spare_slot)
            fields[KEY_BASE_LOW:, 0] = (key_base & ((1 << KEY_BASE_BITS) - 1),
                                        key_base >> KEY_BASE_BITS)
        graphs[size].replay()


def fill_fields(fields: np.ndarray, plan: BatchPlan, size: int, spare_slot: int) -> None:
    """Lay a decode plan into the graph's input fields (``[NUM_FIELDS, >= size]`` int32), rows
    past the plan's as padding: no cache slot (position -1), table entries to the spare row."""
    b, entries = len(plan.seq_ids), plan.block_entries
    u = len(entries)
    fields[:, b:size] = 0
    fields[POSITIONS, b:size] = -1
    fields[SLOTS, b:size] = spare_slot  # (whose recurrent state, a hybrid model's, is spare)
    fields[IDS, :b] = plan.token_ids
    fields[POSITIONS, :b] = plan.start_pos
    fields[SLOTS, :b] = plan.slots
    fields[ENTRY_SLOTS, :u] = plan.slots[entries[:, 0]]
    fields[ENTRY_COLUMNS, :u] = entries[:, 1]
    fields[ENTRY_BLOCKS, :u] = entries[:, 2]
    fields[ENTRY_SLOTS, u:size] = spare_slot
    fields[ENTRY_COLUMNS:ENTRY_BLOCKS + 1, u:size] = 0
    sample_rows = np.flatnonzero(plan.sample)
    s = len(sample_rows)
    fields[SAMPLE_ROWS, :s] = sample_rows
    fields[SAMPLING_SLOTS, :s] = plan.slots[sample_rows]
    fields[SAMPLE_ROWS, s:size] = 0
    fields[SAMPLING_SLOTS, s:size] = spare_slot
    # longest context first, padding rows (position -1) last: see AttentionBatch.decode_order
    fields[DECODE_ORDER, :size] = np.argsort(fields[POSITIONS, :size], kind="stable")[::-1]


def sample_in_graph(model: torch.nn.Module, hidden: torch.Tensor, fields: torch.Tensor,
                    tables: SlotTables, slot_temperature: torch.Tensor,
                    tokens: torch.Tensor) -> None:
    """The sampling rows' tokens into ``tokens`` (padding rows sample too, into the spare
    slot), kept by slot: the eager runner's logits, ``Sampler``'s fused draw and
    ``keep_sampled``, on the device."""
    from nanofn.kernels.triton_sampling import sample_plain_by_slot

    logits = model.compute_logits(hidden[fields[SAMPLE_ROWS]], upcast=False)  # read as float32
    sample_plain_by_slot(logits, fields[SAMPLING_SLOTS], slot_temperature,
                         fields[KEY_BASE_LOW:, 0], KEY_BASE_BITS, tables.last_tokens, tokens)


def decode_inputs(fields: torch.Tensor, tables: SlotTables, block_size: int,
                  query_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
    """The model's inputs from the input fields, on the device (captured in the graph, two
    Triton kernels: ``triton_decode_inputs``): pending tokens from the slots' last sampled
    ones, the new block-table entries written, the block tables gathered by slot and each
    token's cache slot."""
    from nanofn.kernels.triton_decode_inputs import decode_rows

    rows = decode_rows(fields[IDS], fields[POSITIONS], fields[SLOTS], fields[ENTRY_SLOTS],
                       fields[ENTRY_COLUMNS], fields[ENTRY_BLOCKS], tables.table,
                       tables.last_tokens, block_size, PENDING_TOKEN)
    size = len(rows.ids)
    batch = AttentionBatch(
        slot_mapping=rows.slot_mapping,
        query_start=query_start,
        seq_lens=rows.seq_lens,
        block_tables=rows.block_tables,
        query_lens_host=(1,) * size,
        seq_lens_host=(1,) * size,  # not read by decode attention
        decode_only=True,
        decode_order=fields[DECODE_ORDER],
        **({} if tables.state_slot is None else {
            "state_slots": tables.state_slot[fields[SLOTS].long()],
            "has_initial_state": rows.positions > 0}),
    )
    return rows.ids, rows.positions, batch
