"""CUDA graphs for decode steps: one graph per batch size, replayed with the step's inputs
copied into static buffers. A decode step of a small model is hundreds of short kernels; a
graph launches them all at once, so the GPU never waits on Python."""

from __future__ import annotations

import torch

from nanofn.model.batch import AttentionBatch


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Captured decode forward passes for every batch size of ``graph_batch_sizes``; a batch
    is padded up to the next captured size (padding rows write nowhere and attend to nothing)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks_per_seq: int, hidden_size: int):
        device = kv_cache.device
        self.sizes = graph_batch_sizes(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=kv_cache.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for size in reversed(self.sizes):  # the largest first: the others reuse its memory
            graph = torch.cuda.CUDAGraph()
            run = self._forward_for(model, kv_cache, size)
            run()  # warm up (Triton compiles, allocator settles) outside the capture
            with torch.cuda.graph(graph, pool):
                run()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _forward_for(self, model, kv_cache: torch.Tensor, size: int):
        batch = AttentionBatch(
            slot_mapping=self.slots[:size],
            query_start=self.query_start[:size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_host=(1,) * size,
            seq_lens_host=(1,) * size,  # not read by decode attention
            decode_only=True,
        )

        def run() -> None:
            self.hidden[:size] = model(self.input_ids[:size], self.positions[:size], batch, kv_cache)
        return run

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """The decode step's hidden states ``[B, hidden]``, by replaying the smallest graph
        that holds ``B`` sequences."""
        b = batch.num_seqs
        size = next(s for s in self.sizes if s >= b)
        width = batch.block_tables.shape[1]
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slots[:b] = batch.slot_mapping
        self.slots[b:size] = -1
        self.seq_lens[:b] = batch.seq_lens
        self.seq_lens[b:size] = 0
        self.block_tables[:b, :width] = batch.block_tables
        self.graphs[size].replay()
        return self.hidden[:b]
