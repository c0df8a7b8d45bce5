"""From a batch plan to the tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain

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


def prepare_inputs(plan: BatchPlan, block_tables: DeviceBlockTables, device: torch.device,
                   previous: PreviousSamples | None = None) -> ModelInputs:
    """Lay the plan's tokens end to end and say where each goes in the paged cache.

    Host work is a few flat lists, sent in one copy; the per-token arithmetic (positions,
    cache slots, pending tokens) runs as tensor operations on ``device``.
    """
    seqs = plan.seqs
    query_lens = tuple(s.num_tokens for s in seqs)
    seq_lens = tuple(s.context_len for s in seqs)
    query_start = [0, *accumulate(query_lens)]
    sample_rows = [end - 1 for end, s in zip(query_start[1:], seqs) if s.sample]
    pending_at = [end - 1 for end, s in zip(query_start[1:], seqs)
                  if s.token_ids[-1] == PENDING_TOKEN]
    pending_from = [previous.rows[s.seq_id] for s in seqs if s.token_ids[-1] == PENDING_TOKEN]
    decode_only = all(n == 1 for n in query_lens)
    input_ids = list(chain.from_iterable(s.token_ids for s in seqs))
    rows, table_updates = block_tables.plan_updates(plan)
    width = max(len(s.block_table) for s in seqs)

    packed = torch.tensor([*input_ids, *(s.start_pos for s in seqs), *query_start, *seq_lens,
                           *sample_rows, *rows, *table_updates, *pending_at, *pending_from],
                          dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory()
    num_tokens, num_seqs = len(input_ids), len(seqs)
    ids, starts, query_start_t, seq_lens_t, sample_rows_t, rows_t, updates_t, at_t, from_t = \
        packed.to(device, non_blocking=True).split(
            [num_tokens, num_seqs, num_seqs + 1, num_seqs, len(sample_rows), num_seqs,
             len(table_updates), len(pending_at), len(pending_from)])
    block_tables.apply(updates_t)
    if pending_at:
        ids[at_t] = previous.tokens[from_t]
    tables = block_tables.table[rows_t, :width]

    if decode_only:
        seq_index = torch.arange(num_seqs, device=device)
        positions = starts
    else:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs, device=device),
                                            query_start_t.diff(), output_size=num_tokens)
        offsets = torch.arange(num_tokens, device=device) - query_start_t[seq_index]
        positions = starts[seq_index] + offsets
    bs = plan.block_size
    slots = tables[seq_index, positions // bs].long() * bs + positions % bs

    batch = AttentionBatch(
        slot_mapping=slots,
        query_start=query_start_t.to(torch.int32),
        seq_lens=seq_lens_t.to(torch.int32),
        block_tables=tables,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        decode_only=decode_only,
    )
    return ModelInputs(ids, positions, batch, sample_rows_t)
