"""From a batch plan to the tensors of one forward pass, with no Python loop over sequences.

The runner keeps, per slot (``BatchPlan.slots``), its block table on the device, updated by the
plan's new entries, and the token it sampled last, which the plan's ``PENDING_TOKEN``s stand
for. The plan's columns are laid out with a few numpy operations into one host buffer, copied
to the device at once; positions, cache slots and pending tokens are computed there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanofn.model.batch import AttentionBatch
from nanofn.state.config import blocks_for
from nanofn.state.plan import PENDING_TOKEN, BatchPlan


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    batch: AttentionBatch
    sample_rows: torch.Tensor  # [S] int64: the token rows whose logits are sampled, in plan order
    sampling_slots: torch.Tensor  # [S] int64: their slots


class SlotTables:
    """Per slot, on the device: the block table, the token sampled last and, for a hybrid
    model, the recurrent-state slot (``state_slot``) its sequence works in. Each has a spare
    last slot, where writes that must go somewhere harmless go (CUDA graphs' padding)."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 hybrid: bool = False):
        self.table = torch.zeros(max_seqs + 1, max_blocks_per_seq, dtype=torch.int32,
                                 device=device)
        self.last_tokens = torch.zeros(max_seqs + 1, dtype=torch.int64, device=device)
        self.state_slot = (torch.zeros(max_seqs + 1, dtype=torch.int64, device=device)
                           if hybrid else None)

    def keep_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        if len(slots):
            self.last_tokens[slots] = tokens

    def resolve_pending(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``ids`` with each ``PENDING_TOKEN`` replaced by the token its slot sampled last."""
        return torch.where(ids == PENDING_TOKEN, self.last_tokens[slots], ids)


def cache_slots(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Each token's slot in the paged cache, from its sequence's block table (row ``rows[i]``
    of ``block_tables`` for token ``i``) and its position."""
    blocks = block_tables[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size


def prepare_inputs(plan: BatchPlan, block_size: int, tables: SlotTables,
                   device: torch.device) -> ModelInputs:
    """Lay the plan's tokens end to end and say where each goes in the paged cache."""
    if plan.is_empty:
        raise ValueError(f"plan of step {plan.step} is empty: there is nothing to run")
    counts, starts, slots = plan.num_scheduled, plan.start_pos, plan.slots
    num_seqs, num_tokens = len(counts), plan.num_tokens
    ends = np.cumsum(counts)
    seq_lens = starts + counts
    entries = plan.block_entries
    width = blocks_for(int(seq_lens.max()), block_size)
    decode_only = num_tokens == num_seqs
    pending = bool((plan.token_ids == PENDING_TOKEN).any())

    # One host-to-device copy for everything.
    parts = (plan.token_ids, starts, counts, ends, seq_lens, (ends - 1)[plan.sample], slots,
             slots[plan.sample], slots[entries[:, 0]], entries[:, 1], entries[:, 2])
    host = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        host = host.pin_memory()
    (ids, starts_t, counts_t, ends_t, seq_lens_t, sample_rows, slots_t, sampling_slots,
     entry_slots, entry_columns, entry_blocks) = host.to(device, non_blocking=True).split(
        [len(part) for part in parts])
    if len(entry_slots):
        tables.table[entry_slots, entry_columns] = entry_blocks.to(torch.int32)
    if decode_only:
        seq_index = torch.arange(num_seqs, device=device)
        positions = starts_t
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts_t,
                                            output_size=num_tokens)
        offsets = torch.arange(num_tokens, device=device) - (ends_t - counts_t)[seq_index]
        positions = starts_t[seq_index] + offsets
    if pending:
        ids = tables.resolve_pending(ids, slots_t[seq_index])
    block_tables = tables.table[slots_t, :width]
    batch = AttentionBatch(
        slot_mapping=cache_slots(block_tables, seq_index, positions, block_size),
        query_start=torch.cat([ends_t.new_zeros(1), ends_t]).to(torch.int32),
        seq_lens=seq_lens_t.to(torch.int32),
        block_tables=block_tables,
        query_lens_host=tuple(counts.tolist()),
        seq_lens_host=tuple(seq_lens.tolist()),
        decode_only=decode_only,
        **({} if tables.state_slot is None else {
            "state_slots": tables.state_slot[slots_t], "has_initial_state": starts_t > 0}),
    )
    return ModelInputs(ids, positions, batch, sample_rows, sampling_slots)
