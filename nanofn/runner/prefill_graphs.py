"""CUDA graphs for small prefill steps: a few prompts (or chunks) and nothing else.

Eagerly, a prefill step launches ~10 kernels per layer from Python; on the H100's hosts that
is ~0.5 ms per layer, so a 512-token prompt, 2 ms of device work, took 17-39 ms to its first
token. A captured graph launches them at once.

A graph's shapes are fixed when it is captured, so a step is padded up to the next captured
token count (``prefill_graph_tokens``), at most ``PREFILL_GRAPH_SEQS`` sequences:

- token rows past the step's have position -1: no cache slot is written, they belong to no
  sequence and no attention tile reads them (their outputs are garbage nobody reads);
- sequences past the step's have no tokens, no context and the spare slot;
- new block-table entries past the step's go to the spare slot's row;
- prefill attention's work map (``triton_attention.prefill_tile_map``), which the eager path
  builds from host tuples, is an input too, padded with tiles of sequence -1 that return at
  once: a sequence of ``n`` queries has at most ``n / block_q + 1`` tiles, so a graph of ``T``
  tokens needs ``T / block_q + PREFILL_GRAPH_SEQS`` at most (``block_q``, the queries a tile,
  is the graph's: ``triton_attention.prefill_block_q`` of its ``T``).

The host lays all of it into one pinned int32 buffer and copies it once; the graph resolves
pending tokens, writes the table entries, gathers the tables and computes the cache slots, as
``inputs.prepare_inputs`` does eagerly. Logits and sampling stay outside the graph (a step
samples a few rows).
"""

from __future__ import annotations

import numpy as np
import torch

from nanofn.kernels.triton_attention import prefill_block_q, prefill_sms, prefill_tile_map
from nanofn.kernels.triton_linear_attention import FLA_CHUNK, prefill_chunks
from nanofn.model.batch import AttentionBatch, RecurrentState
from nanofn.runner.cuda_graphs import StagedInputs, capture
from nanofn.runner.inputs import SlotTables, cache_slots
from nanofn.state.plan import BatchPlan, empty_plan

PREFILL_GRAPH_SEQS = 8  # sequences a prefill graph holds (more: eager, and large anyway)
PREFILL_GRAPH_MAX_TOKENS = 2048
STAGING_BUFFERS = 2


def prefill_graph_tokens(max_num_batched_tokens: int) -> list[int]:
    """The token counts to capture: powers of two from 16 up to the step's limit."""
    top = min(max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)
    sizes = [16 << k for k in range(12) if 16 << k < top]
    return sizes + [top]


def tiles_for(num_tokens: int, block_q: int) -> int:
    """The most tiles of ``block_q`` queries that a graph of ``num_tokens`` token rows holds."""
    return -(-num_tokens // block_q) + PREFILL_GRAPH_SEQS


def chunks_for(num_tokens: int) -> int:
    """The most chunks of the chunked delta rule (a hybrid model's) in a graph of
    ``num_tokens`` token rows."""
    return -(-num_tokens // FLA_CHUNK) + PREFILL_GRAPH_SEQS


class InputLayout:
    """Where each input lives in the flat int32 buffer: token fields ``[3, T]`` (ids,
    positions, sequence index), sequence fields ``[5, S + 1]`` (slot, context length, query
    start, sample row, sampling slot), entry fields ``[3, E]`` (slot, column, block), the
    tile map ``[N, 2]``, long enough for tiles of ``min_block_q`` queries or more, and the
    chunked delta rule's chunks ``[C, 2]`` (a hybrid model's)."""

    def __init__(self, max_tokens: int, max_entries: int, min_block_q: int):
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self.max_tiles = tiles_for(max_tokens, min_block_q)
        self.max_chunks = chunks_for(max_tokens)
        t, s, e = max_tokens, PREFILL_GRAPH_SEQS + 1, max_entries
        self.sizes = (3 * t, 5 * s, 3 * e, 2 * self.max_tiles, 2 * self.max_chunks)
        self.size = sum(self.sizes)
        self._ends = np.cumsum(self.sizes).tolist()

    def views(self, flat):
        """``(tokens, seqs, entries, tiles, chunks)`` views of a flat buffer (numpy or
        torch)."""
        t, s, e = self.max_tokens, PREFILL_GRAPH_SEQS + 1, self.max_entries
        a, b, c, d, _ = self._ends
        return (flat[:a].reshape(3, t), flat[a:b].reshape(5, s), flat[b:c].reshape(3, e),
                flat[c:d].reshape(self.max_tiles, 2), flat[d:].reshape(self.max_chunks, 2))


IDS, POSITIONS, SEQ_INDEX = range(3)
SLOT, SEQ_LEN, QUERY_START, SAMPLE_ROW, SAMPLING_SLOT = range(5)
ENTRY_SLOT, ENTRY_COLUMN, ENTRY_BLOCK = range(3)


def fill_prefill_inputs(flat: np.ndarray, layout: InputLayout, plan: BatchPlan,
                        spare_slot: int, block_q: int) -> None:
    """Lay a plan (at most ``PREFILL_GRAPH_SEQS`` sequences, ``layout.max_tokens`` tokens and
    ``layout.max_entries`` entries) into ``flat``, the rest as padding; the tile map in tiles
    of ``block_q`` queries."""
    tokens, seqs, entries, tiles, chunks = layout.views(flat)
    counts, starts, slots = plan.num_scheduled, plan.start_pos, plan.slots
    n, t, u = len(counts), plan.num_tokens, len(plan.block_entries)
    ends = np.cumsum(counts)
    seq_index = np.repeat(np.arange(n), counts)
    tokens[:, t:] = 0
    tokens[POSITIONS, t:] = -1
    tokens[IDS, :t] = plan.token_ids
    tokens[POSITIONS, :t] = starts[seq_index] + np.arange(t) - (ends - counts)[seq_index]
    tokens[SEQ_INDEX, :t] = seq_index
    seqs[:, n:] = 0
    seqs[SLOT, n:] = spare_slot
    seqs[SLOT, :n] = slots
    seqs[SEQ_LEN, :n] = starts + counts
    seqs[QUERY_START, 0] = 0
    seqs[QUERY_START, 1:n + 1] = ends
    seqs[QUERY_START, n + 1:] = t
    sample_rows = (ends - 1)[plan.sample]
    seqs[SAMPLE_ROW, :len(sample_rows)] = sample_rows
    seqs[SAMPLING_SLOT, :len(sample_rows)] = slots[plan.sample]
    block_entries = plan.block_entries
    entries[:, u:] = 0
    entries[ENTRY_SLOT, u:] = spare_slot
    entries[ENTRY_SLOT, :u] = slots[block_entries[:, 0]]
    entries[ENTRY_COLUMN, :u] = block_entries[:, 1]
    entries[ENTRY_BLOCK, :u] = block_entries[:, 2]
    work = prefill_tile_map(counts.tolist(), (starts + counts).tolist(), block_q)
    tiles[:len(work)] = work
    tiles[len(work):] = (-1, 0)
    chunks[:] = prefill_chunks(counts.tolist(), PREFILL_GRAPH_SEQS, layout.max_chunks)


def graph_prefill_inputs(views, tables: SlotTables, block_size: int, num_tokens: int,
                         num_tiles: int) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
    """The model's inputs from the device buffer's views, for a graph of ``num_tokens`` token
    rows (captured: no host values)."""
    tokens, seqs, entries, tiles, chunks = views
    slots = seqs[SLOT, :PREFILL_GRAPH_SEQS].long()
    seq_index = tokens[SEQ_INDEX, :num_tokens].long()
    valid = tokens[POSITIONS, :num_tokens] >= 0
    positions = tokens[POSITIONS, :num_tokens].long().clamp_min(0)
    ids = tables.resolve_pending(tokens[IDS, :num_tokens].long(), slots[seq_index])
    tables.table[entries[ENTRY_SLOT].long(), entries[ENTRY_COLUMN].long()] = entries[ENTRY_BLOCK]
    block_tables = tables.table[slots]
    states = {}
    if tables.state_slot is not None:  # a hybrid model's
        query_start = seqs[QUERY_START]
        first_positions = seqs[SEQ_LEN, :PREFILL_GRAPH_SEQS] - (query_start[1:] - query_start[:-1])
        states = dict(state_slots=tables.state_slot[slots], has_initial_state=first_positions > 0,
                      linear_chunks=chunks[:chunks_for(num_tokens)].long())
    batch = AttentionBatch(
        slot_mapping=torch.where(valid, cache_slots(block_tables, seq_index, positions,
                                                    block_size), -1),
        query_start=seqs[QUERY_START],
        seq_lens=seqs[SEQ_LEN, :PREFILL_GRAPH_SEQS],
        block_tables=block_tables,
        query_lens_host=(),  # (the tile map stands for them)
        seq_lens_host=(),
        decode_only=False,
        prefill_tiles=tiles[:num_tiles],
        **states,
    )
    return ids, positions, batch


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, tables: SlotTables,
                 max_num_batched_tokens: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 states: RecurrentState | None = None):
        """``dtype``: the model's (the hidden states left for the LM head). ``num_heads``,
        ``num_kv_heads``: this rank's (they set the tile map's tiles). ``states``: a hybrid
        model's (the padding sequences' spare slot has a state slot of its own, and its chunked
        delta rule takes its chunks from the inputs)."""
        device = kv_cache.device
        self.states = states
        self.sizes = prefill_graph_tokens(max_num_batched_tokens)
        self.tables, self.block_size = tables, block_size
        self.spare_slot = tables.table.shape[0] - 1
        self.block_q = {size: prefill_block_q(num_heads, num_kv_heads, size, prefill_sms(device))
                        for size in self.sizes}  # (each graph's attention tiles its own size)
        self.layout = InputLayout(self.sizes[-1], PREFILL_GRAPH_SEQS * tables.table.shape[1],
                                  min(self.block_q.values()))
        self.staged = StagedInputs((self.layout.size,), device, STAGING_BUFFERS)
        self.hidden = torch.zeros(self.sizes[-1], hidden_size, dtype=dtype, device=device)
        padding = self.staged.host[0]
        fill_prefill_inputs(padding.numpy(), self.layout, empty_plan(0), self.spare_slot,
                            self.block_q[self.sizes[-1]])  # all padding: warm-up, capture
        self.staged.buffer.copy_(padding)
        views = self.layout.views(self.staged.buffer)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for size in reversed(self.sizes):  # the largest first: the others reuse its memory
            graph = capture(self._forward_for(model, kv_cache, views, size), pool)
            self.graphs[size], pool = graph, graph.pool()
        self.views = views
        torch.cuda.synchronize(device)

    def _forward_for(self, model, kv_cache: torch.Tensor, views, size: int):
        num_tiles = tiles_for(size, self.block_q[size])

        def run() -> None:
            ids, positions, batch = graph_prefill_inputs(views, self.tables, self.block_size,
                                                         size, num_tiles)
            if self.states is None:
                self.hidden[:size] = model(ids, positions, batch, kv_cache)
            else:
                self.hidden[:size] = model(ids, positions, batch, kv_cache, self.states)
        return run

    def fits(self, plan: BatchPlan) -> bool:
        """Whether a plan can run as a graph: not a decode step (those have their own), at
        most ``PREFILL_GRAPH_SEQS`` sequences, and no more tokens than the largest graph."""
        return (plan.num_tokens != len(plan.seq_ids) and len(plan.seq_ids) <= PREFILL_GRAPH_SEQS
                and plan.num_tokens <= self.sizes[-1]
                and len(plan.block_entries) <= self.layout.max_entries)

    def forward(self, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's hidden states ``[T, hidden]`` (replaying the smallest graph that holds
        ``T`` tokens), the rows to sample and their slots."""
        size = next(size for size in self.sizes if size >= plan.num_tokens)
        with self.staged.filling() as flat:
            fill_prefill_inputs(flat, self.layout, plan, self.spare_slot, self.block_q[size])
        self.graphs[size].replay()
        seqs, s = self.views[1], len(plan.sampling_seq_ids)
        return (self.hidden[:plan.num_tokens], seqs[SAMPLE_ROW, :s].long(),
                seqs[SAMPLING_SLOT, :s].long())

