"""From a batch plan to the tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from array import array

import torch

from nanofn.model.batch import AttentionBatch
from nanofn.runner.block_tables import DeviceBlockTables
from nanofn.state.plan import PENDING_TOKEN, BatchPlan


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    batch: AttentionBatch
    sample_rows: torch.Tensor  # [S] int64: the token rows whose logits are sampled, in plan order


@dataclass(frozen=True)
class PreviousSamples:
    """The tokens the previous plan sampled, still on the device, and the row of each
    sequence's token: a plan's ``PENDING_TOKEN`` is read from here."""

    tokens: torch.Tensor  # [S] int64
    rows: dict[str, int]


def prepare_inputs(plan: BatchPlan, block_size: int, block_tables: DeviceBlockTables,
                   device: torch.device, previous: PreviousSamples | None = None) -> ModelInputs:
    """Lay the plan's tokens end to end and say where each goes in the paged cache.

    Host work is a few flat lists, sent in one copy; the per-token arithmetic (positions,
    cache slots, pending tokens) runs as tensor operations on ``device``.
    """
    seqs = plan.seqs
    if not seqs:
        raise ValueError(f"plan of step {plan.step} is empty: there is nothing to run")
    input_ids, starts, seq_lens, query_lens = array("q"), array("q"), [], []
    query_start, sample_rows, pending_at, pending_from = array("q", [0]), array("q"), [], []
    end = width = 0  # width: the longest block table
    for s in seqs:
        tokens = s.token_ids
        width = max(width, len(s.block_table))
        input_ids.extend(tokens)
        starts.append(s.start_pos)
        end += len(tokens)
        query_start.append(end)
        query_lens.append(len(tokens))
        seq_lens.append(s.start_pos + len(tokens))
        if s.sample:
            sample_rows.append(end - 1)
        if tokens[-1] == PENDING_TOKEN:
            pending_at.append(end - 1)
            pending_from.append(previous.rows[s.seq_id])
    decode_only = end == len(seqs)
    rows, table_updates = block_tables.assign(plan)

    # One host-to-device copy for everything.
    parts = (input_ids, starts, query_start, seq_lens, sample_rows, rows, table_updates,
             pending_at, pending_from)
    packed = array("q")
    for part in parts:
        packed.extend(part)
    host = torch.frombuffer(packed, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    num_seqs = len(seqs)
    (ids, starts_t, query_start_t, seq_lens_t, sample_rows_t, rows_t, updates_t, at_t,
     from_t) = host.to(device, non_blocking=True).split([len(part) for part in parts])
    block_tables.apply(updates_t)
    if pending_at:
        ids[at_t] = previous.tokens[from_t]
    tables = block_tables.table[rows_t, :width]

    if decode_only:
        seq_index = torch.arange(num_seqs, device=device)
        positions = starts_t
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=device),
                                            query_start_t.diff(), output_size=end)
        offsets = torch.arange(end, device=device) - query_start_t[seq_index]
        positions = starts_t[seq_index] + offsets
    bs = block_size
    slots = tables[seq_index, positions // bs].long() * bs + positions % bs

    batch = AttentionBatch(
        slot_mapping=slots,
        query_start=query_start_t.to(torch.int32),
        seq_lens=seq_lens_t.to(torch.int32),
        block_tables=tables,
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
        decode_only=decode_only,
    )
    return ModelInputs(ids, positions, batch, sample_rows_t)
