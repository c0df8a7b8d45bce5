"""The running sequences' block tables, kept on the device and updated by appends.

Sending every table every step costs a few milliseconds of Python at a few hundred sequences;
a decode step adds a block to about one sequence in ``block_size``. The plan's ``released``
ids say when a sequence's table may have been rebuilt (after preemption) or is gone.
"""

from __future__ import annotations

import torch

from nanofn.state.plan import BatchPlan


class DeviceBlockTables:
    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.table = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._rows: dict[str, tuple[int, int]] = {}  # seq id -> (row, blocks uploaded)
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def assign(self, plan: BatchPlan) -> tuple[list[int], list[int]]:
        """Assign rows for this plan's sequences. Returns their rows (in plan order) and the
        new entries as a flat list ``[row..., column..., block...]`` for ``apply``."""
        for seq_id in plan.released:
            entry = self._rows.pop(seq_id, None)
            if entry is not None:
                self._free_rows.append(entry[0])
        rows: list[int] = []
        new_rows: list[int] = []
        new_cols: list[int] = []
        new_blocks: list[int] = []
        for s in plan.seqs:
            row, uploaded = self._rows.get(s.seq_id) or (self._free_rows.pop(), 0)
            table = s.block_table
            if len(table) > uploaded:
                new_rows.extend([row] * (len(table) - uploaded))
                new_cols.extend(range(uploaded, len(table)))
                new_blocks.extend(table[uploaded:])
                self._rows[s.seq_id] = (row, len(table))
            rows.append(row)
        return rows, new_rows + new_cols + new_blocks

    def apply(self, updates: torch.Tensor) -> None:
        """Write the entries ``assign`` listed (already on the device)."""
        if updates.numel():
            rows, cols, blocks = updates.view(3, -1)
            self.table[rows, cols] = blocks.to(torch.int32)
