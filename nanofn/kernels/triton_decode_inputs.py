"""A decode graph's input preparation as two Triton kernels.

A CUDA graph's decode step starts from one copied buffer of int32 fields (``runner/cuda_graphs``)
and computes the model's inputs on the device. Written as torch operations that was about 25
kernels of 1-3 us each, one after another before the first layer could start: at one sequence
some 40 us of a 0.95 ms step. Here it is two:

- ``_write_entries_kernel``: the plan's new block-table entries into the per-slot tables;
- ``_decode_rows_kernel``, a program per row: the token id (a pending one resolved to its slot's
  last sampled token), the position, the sequence length, the cache slot and the row's block
  table, gathered from its slot's. A padding row (position -1) gets position 0, length 0 and
  cache slot -1.

The second reads what the first writes, so they run in that order (neither launches overlapped).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

TABLE_BLOCK = 1024  # block-table columns a program copies per step


class DecodeRows(NamedTuple):
    ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64, -1 for padding rows
    seq_lens: torch.Tensor  # [B] int32, 0 for padding rows
    block_tables: torch.Tensor  # [B, table width] int32


@triton.jit
def _write_entries_kernel(entry_slots_ptr, entry_columns_ptr, entry_blocks_ptr, table_ptr,
                          stride_table, count, BLOCK: tl.constexpr):
    """One program: ``table[entry_slots[i], entry_columns[i]] = entry_blocks[i]`` for each i."""
    entries = tl.arange(0, BLOCK)
    mask = entries < count
    slots = tl.load(entry_slots_ptr + entries, mask=mask, other=0).to(tl.int64)
    columns = tl.load(entry_columns_ptr + entries, mask=mask, other=0)
    blocks = tl.load(entry_blocks_ptr + entries, mask=mask, other=0)
    tl.store(table_ptr + slots * stride_table + columns, blocks, mask=mask)


@triton.jit
def _decode_rows_kernel(
    token_ids_ptr, positions_ptr, slots_ptr, table_ptr, last_tokens_ptr,
    ids_out_ptr, positions_out_ptr, slot_mapping_ptr, seq_lens_ptr, block_tables_ptr,
    stride_table, stride_block_tables, width, block_size, pending_token,
    BLOCK: tl.constexpr,
):
    """Program ``row``: the model's inputs for one decode row (see the module docstring)."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    position = tl.load(positions_ptr + row).to(tl.int64)
    valid = position >= 0
    position = tl.maximum(position, 0)
    last_token = tl.load(last_tokens_ptr + slot)
    tl.store(ids_out_ptr + row, tl.where(token == pending_token, last_token, token))
    tl.store(positions_out_ptr + row, position)
    tl.store(seq_lens_ptr + row, tl.where(valid, position + 1, 0).to(tl.int32))
    slot_table = table_ptr + slot * stride_table
    block = tl.load(slot_table + position // block_size).to(tl.int64)
    cache_slot = block * block_size + position % block_size
    tl.store(slot_mapping_ptr + row, tl.where(valid, cache_slot, -1))
    for start in range(0, width, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        mask = columns < width
        entries = tl.load(slot_table + columns, mask=mask)
        tl.store(block_tables_ptr + row * stride_block_tables + columns, entries, mask=mask)


def decode_rows(token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                entry_slots: torch.Tensor, entry_columns: torch.Tensor, entry_blocks: torch.Tensor,
                table: torch.Tensor, last_tokens: torch.Tensor, block_size: int,
                pending_token: int) -> DecodeRows:
    """Write the new block-table entries into ``table`` (``[slots, width]`` int32), then lay out
    the rows' inputs. Every argument but ``table`` and ``last_tokens`` (``[slots]`` int64) is an
    int32 field row of ``B`` entries (``entry_*``: ``B`` entries, unused ones aimed at a spare
    slot)."""
    size, width = len(token_ids), table.shape[1]
    assert table.stride(1) == 1 and table.dtype == torch.int32, "int32 tables, rows contiguous"
    device = token_ids.device
    ids = torch.empty(size, dtype=torch.int64, device=device)
    out_positions = torch.empty(size, dtype=torch.int64, device=device)
    slot_mapping = torch.empty(size, dtype=torch.int64, device=device)
    seq_lens = torch.empty(size, dtype=torch.int32, device=device)
    block_tables = torch.empty(size, width, dtype=torch.int32, device=device)
    if size == 0:
        return DecodeRows(ids, out_positions, slot_mapping, seq_lens, block_tables)
    _write_entries_kernel[(1,)](
        entry_slots, entry_columns, entry_blocks, table, table.stride(0), len(entry_slots),
        BLOCK=triton.next_power_of_2(len(entry_slots)),
    )
    _decode_rows_kernel[(size,)](
        token_ids, positions, slots, table, last_tokens,
        ids, out_positions, slot_mapping, seq_lens, block_tables,
        table.stride(0), block_tables.stride(0), width, block_size, pending_token,
        BLOCK=min(TABLE_BLOCK, triton.next_power_of_2(width)), num_warps=1,
    )
    return DecodeRows(ids, out_positions, slot_mapping, seq_lens, block_tables)
