"""Paged-KV-cache attention as Triton kernels, with the signatures of ``nanofn.kernels.attention``.

Layouts and semantics are those of the torch references in ``nanofn.kernels.attention``. (The
keys and values reach the cache through ``triton_ops.rotate_and_store_kv``, with the rotary
embedding, or, in ``rotary_decode_attention``, through the decode kernel itself, which then
rotates the queries too.)

- ``decode_attention``: one program per (kv head, sequence), whose tile rows are the query heads
  of that kv head's GQA group, so each K/V tile is read once per group. The kv heads vary
  fastest along the grid's one axis (no 65,535 cap): a sequence's heads start side by side and
  read the rows of each cache block at about the same time (1-2% faster at 48-256 sequences
  than the sequences first, on the H100). Contexts split into partitions ("flash decoding"):
  a few sequences' until the GPU is busy, many sequences' in two while their whole contexts
  would take a few waves of programs (``decode_num_splits``). The host picks the most
  partitions a sequence may take; each row's programs, side by side along the grid, size them
  from the row's own length, which only the device knows (so a short context in a wide block
  table, as in a CUDA graph, is still spread over them). An optional ``order`` maps rows to
  sequences: the decode graphs pass the longest context first, so that no long sequence is
  left running alone at the end of the kernel. The last
  partition of a (sequence, kv head) to finish merges their partial results, counting
  arrivals in a counter per pair (past ``ARRIVAL_COUNTERS`` pairs, one partition a sequence).
- ``prefill_attention``: flash attention, one program per (query tile, kv head), the kv heads
  fastest along the grid's one axis. A tile's rows are ``BLOCK_M // group`` queries times the
  group's heads, again reading K/V once per group: 128 rows, at two programs an SM, or 64 for
  a step too small to fill the GPU with those (``prefill_block_m``).

An FP8 cache (float8_e4m3fn) is read into float16 tile by tile (exact: e4m3 values are fp16
values; one conversion instruction per two elements, where bf16 takes three), the queries and
the probabilities multiplied in float16 too (``product_dtype``; queries past fp16's 65,504 would
overflow, far beyond a normed or projected head's values; a value tile goes through shared
memory already in fp16, ``_values_in``), and written saturating at +-448
(``to_cache_dtype``). The kernels store and read at scale 1; ``decode_attention`` and
``prefill_attention`` take other scales of a cache written with them by folding ``k_scale``
into the score scale and ``v_scale`` into the output.

Key tiles are gathered row by row through the block table, so a tile may span several cache
blocks. Softmax runs in float32 and in base 2: scores are pre-multiplied by log2(e). Grids
depend only on shapes and host tuples, never on device values: no host sync, and decode can be
captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from nanofn.kernels import triton_overlap
from nanofn.kernels.device import H100_SMS, num_sms
from nanofn.kernels.triton_overlap import wait_for_previous

LOG2_E = 1.4426950408889634
# A decode program's (keys a tile, tiles in flight, warps), by the cache's bytes an element:
# fewer buffers, more programs per SM (benchmarks/experiments/decode_splits.py --tiles; on an
# FP8 cache 128-key tiles won from 100 sequences down and lost at 256: the same tile so far)
DECODE_TILES = {2: (64, 2, 4), 4: (64, 2, 4), 1: (64, 2, 4)}
PREFILL_ROWS = 128  # rows per prefill tile, (queries of one sequence) x (heads of one group)...
PREFILL_SMALL_ROWS = 64  # ...or these, for steps too small to fill the GPU (``prefill_block_m``)
PREFILL_BLOCK_N = 64  # keys per prefill tile
# Registers a prefill thread of a 128-row tile may use at head_dim 128 (8 warps): two programs
# an SM, so that one's softmax runs under the other's matrix products (174 uncapped: one
# program an SM, 25-35% slower on the H100; a few bytes spill).
PREFILL_MAX_REGISTERS = 128
MIN_PARTITION_KEYS = 256  # block-table keys per split-K partition, at least (caps the count)
PROGRAMS_PER_SM = 2  # a few sequences' contexts split until the grid has this many programs an SM
# Decode programs of many sequences an SM holds at once (``DECODE_MAX_REGISTERS``)...
RESIDENT_DECODE_PROGRAMS_PER_SM = 5
# ...and the partitions each of many sequences takes while their whole contexts would be at
# most ``FEW_WAVES_PROGRAMS_PER_SM`` programs an SM: 1.6 such waves, 33-132 sequences of 8 kv
# heads on 132 SMs. On an FP8 cache on the H100 the decode steps of 33-128 sequences took 3%
# less time than whole contexts with the rotary embedding fused, in two partitions up to one
# wave (82 sequences); up to 1.6 waves, 1.2% less again (1.456 -> 1.439 s in the workload).
FEW_WAVES_SPLITS = 2
FEW_WAVES_PROGRAMS_PER_SM = 8
# Registers a thread of a decode program of many sequences may use: five programs an SM. (A
# whole context on an FP8 cache took 106 uncapped, four an SM; on an H200 capping it took
# 112 -> 103 us a layer at 256 sequences, 80 -> 68 at 37, the FP8 workload -3%.) Capped, the
# split kernels' SASS (compiled on the CPU) reloads a spilled register or two a loop trip.
DECODE_MAX_REGISTERS = 96
# (sequence, kv head) pairs whose split decode merges its partitions itself (64K: far more
# than a decode batch that splits its contexts; past it, whole contexts)
ARRIVAL_COUNTERS = 1 << 16
# An FP8 value tile converts to fp16 in an asm block (``_values_in``), but in Triton's
# interpreter, which runs no asm, plainly (the same values: the conversion is exact)
CONVERT_IN_ASM = tl.constexpr(not triton.knobs.runtime.interpret)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def product_dtype(q, cache_ptr):
    """The queries in the dtype of the matrix products with the cache's keys and values: their
    own, or float16 for an FP8 cache under 16-bit queries (e4m3 values convert to fp16 in one
    instruction per pair, to bf16 in three more per element). Float32 queries stay float32."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = q.to(tl.float16)
    return q


@triton.jit
def to_cache_dtype(x, cache_ptr):
    """``x`` in the element type of ``cache_ptr``: for an FP8 cache, clamped to e4m3's +-448
    first (a plain conversion may give NaN past it)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _tile_blocks(block_table_ptr, keys, in_range, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache blocks of positions ``keys``, from the block table (0 out of ``in_range``
    with ``MASKED``)."""
    if MASKED:
        blocks = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=in_range, other=0)
    else:
        blocks = tl.load(block_table_ptr + keys // BLOCK_SIZE)
    return blocks.to(tl.int64)


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, keys, in_range,
    stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The keys and values ``[len(keys), HEAD_DIM]`` at positions ``keys``, gathered row by row
    through the block table, and their offsets in the cache. With ``MASKED``, zeros out of
    ``in_range``; without it every key must be in range (a whole tile): no masks to build."""
    blocks = _tile_blocks(block_table_ptr, keys, in_range, BLOCK_SIZE, MASKED)
    return _load_kv_in(k_cache_ptr, v_cache_ptr, blocks, kv_head, keys, in_range, stride_block,
                       stride_slot, stride_head, BLOCK_SIZE, HEAD_DIM, MASKED)


@triton.jit
def _load_kv_in(
    k_cache_ptr, v_cache_ptr, blocks, kv_head, keys, in_range,
    stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
):
    """``_load_kv_tile`` with the keys' cache ``blocks`` already read."""
    dims = tl.arange(0, HEAD_DIM)
    rows = blocks * stride_block + (keys % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    offsets = rows[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + offsets, mask=in_range[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offsets)
        v = tl.load(v_cache_ptr + offsets)
    return k, v, offsets


@triton.jit
def _attend_tile(acc, row_sum, row_max, q, k, v, visible, qk_scale, MASKED: tl.constexpr):
    """Online-softmax update of ``acc``, ``row_sum``, ``row_max`` with one tile of keys and
    values; with ``MASKED`` row ``r`` sees key ``n`` only where ``visible[r, n]``.

    ``row_max`` is in scaled units; the scale is applied to the row's max and then inside the
    exponent's argument (one fused multiply-add a score), not to every score first. Keys and
    values of an FP8 cache are converted to the queries' dtype (``product_dtype``) here."""
    k = k.to(q.dtype)
    v = _values_in(v, q.dtype)
    if k.dtype == tl.float32:  # a float32 model gets float32 products, not TF32's 10 bits
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
    correction = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores * qk_scale - new_max[:, None])
    row_sum = row_sum * correction + tl.sum(probs, 1)
    if v.dtype == tl.float32:
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
    return acc, row_sum, new_max


@triton.jit
def _values_in(v, dtype: tl.constexpr):
    """A value tile in ``dtype`` for the product with the probabilities. An FP8 tile under
    fp16 products is converted where it was loaded (``cvt.rn.f16x2.e4m3x2``, two values an
    instruction), by an asm block the compiler keeps in place: a plain conversion it moves
    past the tile's trip through shared memory into the product's operand layout, and the
    tile then goes through as bytes, read one at a time (``LDS.U8``: no transposing shared
    load for 8-bit elements). On one H200 (``decode_splits.py --kv-dtype fp8``) decode took
    12-16% less time at 101-256 sequences, 9% more at 37 (a few programs an SM: likely the
    tile's second trip through shared memory, in series); 154 -> 106 registers a thread."""
    if v.dtype == tl.float8e4nv and dtype == tl.float16 and CONVERT_IN_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4)
    return v.to(dtype)


@triton.jit
def _attend_keys(
    acc, row_sum, row_max, q, query_pos,
    k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, key_begin, key_end, qk_scale,
    stride_block, stride_slot, stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    BLOCKS_AHEAD: tl.constexpr = False,
):
    """``_attend_tile`` over keys ``key_begin .. key_end - 1``, ``BLOCK_N`` at a time.

    Without ``MASKED`` every key in the range must be visible to every row: the caller passes
    only whole tiles before the causal diagonal, which then build no masks, for their loads
    either. With it, row ``r`` sees key ``n`` when ``n <= query_pos[r]`` and ``n < key_end``.

    ``BLOCKS_AHEAD`` (whole tiles only): each trip reads the next tile's cache blocks from the
    block table, so that a tile's loads depend on no load of their own trip. Triton's pipeliner
    gives loads whose addresses come from a load of the same trip one buffer, whatever
    ``num_stages``, filled after the trip's products: every tile's latency in series with its
    work. With the blocks a trip ahead and ``num_stages`` of 3 it double-buffers, and the next
    tile's keys and values are in flight while this one is attended to.
    """
    if BLOCKS_AHEAD:
        last_key = tl.maximum(key_end - 1, 0)  # (the trip past the last reads its blocks again)
        blocks = _tile_blocks(block_table_ptr,
                              tl.minimum(key_begin + tl.arange(0, BLOCK_N), last_key), None,
                              BLOCK_SIZE, False)
        for tile_begin in range(key_begin, key_end, BLOCK_N):
            keys = tile_begin + tl.arange(0, BLOCK_N)
            k, v, _ = _load_kv_in(k_cache_ptr, v_cache_ptr, blocks, kv_head, keys, None,
                                  stride_block, stride_slot, stride_head, BLOCK_SIZE, HEAD_DIM,
                                  False)
            blocks = _tile_blocks(block_table_ptr, tl.minimum(keys + BLOCK_N, last_key), None,
                                  BLOCK_SIZE, False)
            acc, row_sum, row_max = _attend_tile(acc, row_sum, row_max, q, k, v, None, qk_scale,
                                                 False)
    else:
        for tile_begin in range(key_begin, key_end, BLOCK_N):
            keys = tile_begin + tl.arange(0, BLOCK_N)
            in_range = keys < key_end
            k, v, _ = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, keys,
                                    in_range, stride_block, stride_slot, stride_head, BLOCK_SIZE,
                                    HEAD_DIM, MASKED)
            visible = (keys[None, :] <= query_pos[:, None]) & in_range[None, :]
            acc, row_sum, row_max = _attend_tile(acc, row_sum, row_max, q, k, v, visible,
                                                 qk_scale, MASKED)
    return acc, row_sum, row_max


@triton.jit
def head_norm_scaled(x, inv_rms, weight, dtype: tl.constexpr):
    """``weight * x * inv_rms`` (float32 in and out) rounded to ``dtype`` where ``rms_norm``
    rounds: the normed value, then its product with the weight. Qwen3's per-head norm, shared
    by the rotary kernel (``triton_ops``) and the fused decode kernel."""
    return (weight * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _partner_dims(HEAD_DIM: tl.constexpr):
    """Each dimension's partner in the rotation: the same place in the other half."""
    half: tl.constexpr = HEAD_DIM // 2
    return tl.max_contiguous(tl.multiple_of((tl.arange(0, HEAD_DIM) + half) % HEAD_DIM, half), half)


@triton.jit
def _heads_and_partners(heads_ptr, mask, HEAD_DIM: tl.constexpr):
    """The heads at ``heads_ptr`` (``[R]`` pointers to contiguous heads; zeros where not
    ``mask``) as an ``[R, HEAD_DIM]`` tile, and the same tile with each half's elements in the
    other half's place: the loads ``_rotated_heads`` needs, issued together."""
    dims = tl.arange(0, HEAD_DIM)
    x = tl.load(heads_ptr[:, None] + dims[None, :], mask=mask[:, None], other=0.0)
    partner = tl.load(heads_ptr[:, None] + _partner_dims(HEAD_DIM)[None, :], mask=mask[:, None],
                      other=0.0)
    return x, partner


@triton.jit
def _norm_weights(norm_weight_ptr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """A per-head norm's weights ``[1, HEAD_DIM]`` and their partners' (float32; ones without
    ``NORM``)."""
    if NORM:
        dims = tl.arange(0, HEAD_DIM)
        weight = tl.load(norm_weight_ptr + dims).to(tl.float32)[None, :]
        partner_weight = tl.load(norm_weight_ptr + _partner_dims(HEAD_DIM)).to(tl.float32)[None, :]
    else:
        weight = tl.full([1, HEAD_DIM], 1.0, tl.float32)
        partner_weight = weight
    return weight, partner_weight


@triton.jit
def _rotated_heads(x, partner, weight, partner_weight, cos, sin, eps,
                   HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Heads ``x`` and their ``partner`` tile (``_heads_and_partners``), RMS-normalised first
    with ``NORM`` (``_norm_weights``), then rotated by the angles ``cos``, ``sin``
    (``[HEAD_DIM]``, each half's angles repeated), rounded where ``rotate_and_store_kv``
    rounds. Each element is rotated with its partner in the other half."""
    half: tl.constexpr = HEAD_DIM // 2
    dtype = x.dtype
    x = x.to(tl.float32)
    partner = partner.to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = head_norm_scaled(x, inv_rms, weight, dtype)
        partner = head_norm_scaled(partner, inv_rms, partner_weight, dtype)
    first_half = (tl.arange(0, HEAD_DIM) < half)[None, :]
    rotated = tl.where(first_half, x * cos[None, :] - partner * sin[None, :],
                       x * cos[None, :] + partner * sin[None, :])
    return rotated.to(dtype)


# any table width and split count: one compile
@triton.jit(do_not_specialize=["stride_table", "max_splits"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    seq_lens_ptr, block_tables_ptr, order_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_block, stride_slot, stride_head, stride_table,
    qk_scale,
    new_k_ptr, new_v_ptr, positions_ptr, slot_mapping_ptr, cos_sin_ptr, q_norm_weight_ptr,
    k_norm_weight_ptr, stride_kb, stride_kh, stride_vb, stride_vh, stride_cos_sin, norm_eps,
    arrivals_ptr, max_splits,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRELOAD: tl.constexpr,
    HAS_ORDER: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr, PARTIALS: tl.constexpr,
    SPLITS: tl.constexpr, BLOCKS_AHEAD: tl.constexpr, OVERLAP: tl.constexpr,
):
    """Program (partition x kv head): the group's query heads over one context partition.

    The grid's one axis is ``partition * KV_HEADS + kv_head`` (kv heads fastest). Row ``r`` is
    sequence ``order[r]`` with ``HAS_ORDER``, sequence ``r`` otherwise. Without ``SPLIT``
    partition ``r`` is row ``r``'s whole context. With it each row's context is cut into up to
    ``max_splits`` partitions of whole tiles, a row's partitions side by side along the grid
    (``_row_partition``); a program past its row's keys exits at once. A sequence's only
    partition writes the final output; else each writes the
    unnormalised output, row max and row sum of its keys for ``_merge_partitions``, and the
    last of the group's partitions to finish merges them (counted in ``arrivals_ptr``, one
    counter per (sequence, kv head), zero before and after the launch). With ``PARTIALS``
    every partition leaves its results unmerged instead, as ``decode_partitions`` returns
    them.

    With ``ROTATE`` the queries and the newest key and value are the projection's (``q_ptr``,
    ``new_k_ptr``, ``new_v_ptr``): the queries are rotated (after Qwen3's norm with ``NORM``)
    here, and the partition that holds the newest position rotates its key, writes it and the
    value to their cache slot and attends to them from registers; the cache loop stops short
    of the newest key, which no program reads from the cache.

    Everything up to the first tile's keys and values (with ``PRELOAD``) is read before waiting
    for the kernel ahead (``triton_overlap``): at a few sequences a partition is often one tile.
    Without ``ROTATE`` the kernel ahead (``rotate_and_store_kv``) writes the newest key and
    value, read again after the wait; with it, the kernel ahead (the projection) writes nothing
    in the cache, and the angles, the norms' weights and the slot are read before the wait too,
    the projection's heads all together after it.

    ``BLOCKS_AHEAD`` (a tile of three or more stages): the whole tiles' loop reads the block
    table a trip ahead, so that the next tile's keys and values load while this one is attended
    to (``_attend_keys``).
    """
    part, kv_head = tl.program_id(0) // KV_HEADS, tl.program_id(0) % KV_HEADS
    if not SPLIT:
        if HAS_ORDER:
            seq = tl.load(order_ptr + part)
        else:
            seq = part
        seq_len = tl.load(seq_lens_ptr + seq)
        # 0, but left to the device: as a constant, the compiler schedules the loops into 117
        # registers (bf16), where this holds 96, five programs an SM
        split = part // tl.num_programs(0)
        count = 1
        partition_len = tl.cdiv(seq_len, BLOCK_N) * BLOCK_N
    else:
        seq, seq_len, split, count, partition_len = _row_partition(
            part, order_ptr, seq_lens_ptr, max_splits, BLOCK_N, HAS_ORDER)
        if split >= count:
            return
    key_begin = split * partition_len
    newest = seq_len - 1
    cached_end = newest if ROTATE else seq_len  # keys read from the cache end here
    key_end = tl.maximum(tl.minimum(key_begin + partition_len, cached_end), key_begin)
    whole_tiles_end = key_begin + (key_end - key_begin) // BLOCK_N * BLOCK_N
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + newest
    block_table_ptr = block_tables_ptr + seq * stride_table
    rows = tl.arange(0, BLOCK_M)  # the group's query heads, padded to a tile of at least 16 rows
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    # A few sequences' partitions read their first tile before the wait; many sequences' do
    # not: a tile held across the wait costs registers.
    if PRELOAD:
        first_keys = key_begin + tl.arange(0, BLOCK_N)
        first_in_range = first_keys < key_end
        k, v, first_offsets = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, first_keys, first_in_range,
            stride_block, stride_slot, stride_head, BLOCK_SIZE, HEAD_DIM, True)
    if ROTATE:
        position = tl.load(positions_ptr + seq)
        angles = dims % (HEAD_DIM // 2)
        cos = tl.load(cos_sin_ptr + position * stride_cos_sin + angles)
        sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HEAD_DIM // 2 + angles)
        q_weight, q_partner_weight = _norm_weights(q_norm_weight_ptr, HEAD_DIM, NORM)
        k_weight, k_partner_weight = _norm_weights(k_norm_weight_ptr, HEAD_DIM, NORM)
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        holds_newest = (key_begin <= newest) & (newest < key_begin + partition_len)
    wait_for_previous(OVERLAP)

    if PRELOAD and not ROTATE:
        is_newest = (first_keys == newest)[:, None]
        k = tl.where(is_newest, tl.load(k_cache_ptr + first_offsets, mask=is_newest, other=0.0), k)
        v = tl.where(is_newest, tl.load(v_cache_ptr + first_offsets, mask=is_newest, other=0.0), v)
    # A finite starting max keeps empty partitions (and seq_len 0 padding rows) free of NaN.
    row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ROTATE:
        # Every load of the projection's heads first, so that their latencies overlap; only
        # the partition that holds the newest position needs the key and value.
        q, q_partner = _heads_and_partners(q_ptr + seq * stride_qb + heads * stride_qh, row_mask,
                                           HEAD_DIM)
        one_row = tl.arange(0, 1)
        new_k, new_k_partner = _heads_and_partners(
            new_k_ptr + seq * stride_kb + kv_head * stride_kh + one_row,
            (one_row == 0) & holds_newest, HEAD_DIM)
        new_v = tl.load(new_v_ptr + seq * stride_vb + kv_head * stride_vh + dims[None, :],
                        mask=holds_newest, other=0.0)
        q = product_dtype(_rotated_heads(q, q_partner, q_weight, q_partner_weight, cos, sin,
                                         norm_eps, HEAD_DIM, NORM), k_cache_ptr)
        new_k = _rotated_heads(new_k, new_k_partner, k_weight, k_partner_weight, cos, sin,
                               norm_eps, HEAD_DIM, NORM)
        cache_row = ((slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
                     + kv_head * stride_head)
        written = holds_newest & (slot >= 0)
        # as the cache holds them (FP8: rounded), so that attending from registers reads what
        # a later step reads from the cache
        new_k = to_cache_dtype(new_k, k_cache_ptr)
        new_v = to_cache_dtype(new_v, v_cache_ptr)
        tl.store(k_cache_ptr + cache_row + dims[None, :], new_k, mask=written)
        tl.store(v_cache_ptr + cache_row + dims[None, :], new_v, mask=written)
        # The newest key first: its score is the row's max so far, its weight exp2(0) = 1.
        new_score = tl.sum(q.to(tl.float32) * new_k.to(tl.float32), 1) * qk_scale
        row_max = tl.where(holds_newest, new_score, row_max)
        row_sum = tl.where(holds_newest, 1.0, row_sum)
        acc = tl.where(holds_newest, acc + new_v.to(tl.float32), acc)
    else:
        q_offsets = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :]
        q = product_dtype(tl.load(q_ptr + q_offsets, mask=row_mask[:, None], other=0.0),
                          k_cache_ptr)

    if PRELOAD:
        acc, row_sum, row_max = _attend_tile(acc, row_sum, row_max, q, k, v,
                                             first_in_range[None, :], qk_scale, True)
        rest = key_begin + BLOCK_N
    else:
        rest = key_begin
    acc, row_sum, row_max = _attend_keys(
        acc, row_sum, row_max, q, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        rest, whole_tiles_end, qk_scale, stride_block, stride_slot, stride_head,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, BLOCKS_AHEAD,
    )
    acc, row_sum, row_max = _attend_keys(
        acc, row_sum, row_max, q, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        tl.maximum(whole_tiles_end, rest), key_end, qk_scale, stride_block, stride_slot,
        stride_head, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True,
    )

    if PARTIALS:
        _store_partial(acc, row_sum, row_max, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
                       seq, heads, row_mask, max_splits, split, KV_HEADS, GROUP, HEAD_DIM)
    elif count == 1:
        _store_output(acc, row_sum, out_ptr, seq, heads, row_mask, stride_ob, stride_oh, HEAD_DIM)
    else:
        first_partials = _store_partial(acc, row_sum, row_max, partial_out_ptr, partial_max_ptr,
                                        partial_sum_ptr, seq, heads, row_mask, max_splits, split,
                                        KV_HEADS, GROUP, HEAD_DIM)
        # Every thread's stores come before the arrival (released at the GPU's scope); the
        # last to arrive reads the others' after it (acquired), then zeroes the counter.
        tl.debug_barrier()
        arrivals = arrivals_ptr + seq * KV_HEADS + kv_head
        arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
        if arrived == count - 1:
            tl.store(arrivals, 0)
            _merge_partitions(partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr,
                              stride_ob, stride_oh, seq, heads, row_mask, first_partials, count,
                              HEAD_DIM, SPLITS)


@triton.jit
def _row_partition(part, order_ptr, seq_lens_ptr, max_splits, BLOCK_N: tl.constexpr,
                   HAS_ORDER: tl.constexpr):
    """Partition ``part`` of a split launch: ``(seq, seq_len, split, count, partition_len)``,
    the ``split``-th of row ``part // max_splits``'s ``count``, of keys ``split *
    partition_len`` on. A row's context is cut into up to ``max_splits`` partitions of whole
    tiles, the last one shorter; a context of fewer tiles takes fewer (one at least: a padding
    row's, of no keys, writes zeros), and its programs past them (``split >= count``) have
    nothing to do. The length comes from the row's own context, which only the device knows,
    not from the block table's width: a short context in a CUDA graph's wide table is spread
    over the partitions too."""
    row = part // max_splits
    split = part % max_splits
    if HAS_ORDER:
        seq = tl.load(order_ptr + row)
    else:
        seq = row
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_len = tl.cdiv(tl.cdiv(seq_len, max_splits), BLOCK_N) * BLOCK_N
    count = tl.maximum(tl.cdiv(seq_len, tl.maximum(partition_len, 1)), 1)
    return seq, seq_len, split, count, partition_len


@triton.jit
def _store_output(acc, row_sum, out_ptr, seq, heads, row_mask, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr):
    """A sequence's final output rows ``heads``: the sums over all its keys, normalised (zeros
    for no keys)."""
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    out_offsets = seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _store_partial(acc, row_sum, row_max, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
                   seq, heads, row_mask, max_splits, split, KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One partition's unnormalised rows, at ``[seq, head, split]`` of ``[B, H, max_splits]``;
    returns the index of the rows' first partition."""
    first_partials = (seq * KV_HEADS * GROUP + heads) * max_splits
    partial = first_partials + split
    dims = tl.arange(0, HEAD_DIM)
    tl.store(partial_max_ptr + partial, row_max, mask=row_mask)
    tl.store(partial_sum_ptr + partial, row_sum, mask=row_mask)
    tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=row_mask[:, None])
    return first_partials


@triton.jit
def _merge_partitions(partial_out_ptr, partial_max_ptr, partial_sum_ptr, out_ptr, stride_ob,
                      stride_oh, seq, heads, row_mask, first_partials, num_splits,
                      HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """Rows ``heads`` of sequence ``seq``: each partition's result (the row's partitions start
    at ``first_partials``) rescaled to the global max and sum. The partials are read past L1
    (``.cg``): other programs wrote them during this launch."""
    splits = tl.arange(0, SPLITS)
    partials = first_partials[:, None] + splits[None, :]  # [rows, SPLITS]
    mask = row_mask[:, None] & (splits < num_splits)[None, :]
    part_max = tl.load(partial_max_ptr + partials, mask=mask, other=float("-inf"),
                       cache_modifier=".cg")
    part_sum = tl.load(partial_sum_ptr + partials, mask=mask, other=0.0, cache_modifier=".cg")
    weights = tl.exp2(part_max - tl.max(part_max, 1)[:, None])
    weights = tl.where(mask, weights, 0.0)  # (a padding row's max is -inf: no NaN from it)
    total = tl.sum(weights * part_sum, 1)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([first_partials.shape[0], HEAD_DIM], dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # unrolled: the loads are independent
        part_out = tl.load(partial_out_ptr + (first_partials + split)[:, None] * HEAD_DIM
                           + dims[None, :], mask=row_mask[:, None] & (split < num_splits),
                           other=0.0, cache_modifier=".cg")
        weight = tl.sum(tl.where(splits[None, :] == split, weights, 0.0), 1)
        acc += part_out * weight[:, None]
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit(do_not_specialize=["stride_table"])  # any table width: one compile
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr, tiles_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_slot, stride_head, stride_table,
    qk_scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``tile * KV_HEADS + kv_head``: ``BLOCK_Q`` queries of one sequence times the
    group's heads (one grid axis: no cap on the number of tiles).

    ``tiles_ptr`` maps the program to ``(sequence, query tile within the sequence)``; a
    sequence of -1 is padding (a CUDA graph's map is longer than most steps need): no work.
    """
    tile, kv_head = tl.program_id(0) // KV_HEADS, tl.program_id(0) % KV_HEADS
    seq = tl.load(tiles_ptr + 2 * tile)
    if seq < 0:
        return
    q_tile = tl.load(tiles_ptr + 2 * tile + 1)
    query_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_begin
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    queries = q_tile * BLOCK_Q + rows // GROUP  # within the sequence's chunk
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (queries < query_len)
    tokens = query_begin + queries
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = product_dtype(tl.load(q_ptr + q_offsets, mask=row_mask[:, None], other=0.0),
                      k_cache_ptr)

    query_pos = seq_len - query_len + queries
    first_pos = seq_len - query_len + q_tile * BLOCK_Q
    key_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the tile's last query position
    visible_tiles_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # key tiles every query sees whole
    row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_table
    acc, row_sum, row_max = _attend_keys(
        acc, row_sum, row_max, q, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        0, visible_tiles_end, qk_scale, stride_block, stride_slot, stride_head,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, False,
    )
    acc, row_sum, row_max = _attend_keys(
        acc, row_sum, row_max, q, query_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
        visible_tiles_end, key_end, qk_scale, stride_block, stride_slot, stride_head,
        BLOCK_SIZE, HEAD_DIM, BLOCK_N, True,
    )
    out = acc / row_sum[:, None]  # every row sees at least key 0
    out_offsets = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


# ---------------------------------------------------------------------------------------------
# Host side


class NewTokens(NamedTuple):
    """The projection's keys and values of a decode step's tokens and what rotating and storing
    them takes: the arguments of ``rotate_and_store_kv`` but the queries and the caches."""

    k: torch.Tensor  # [B, Hkv, D], contiguous heads (a view of the qkv projection)
    v: torch.Tensor
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]; a negative slot is not written
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    norm_eps: float = 1e-6


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    order: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one query per sequence (``q`` is ``[B, H, D]``) at its last position.

    ``order`` (``[B]`` int32, a permutation of the rows) is the order in which the GPU takes the
    sequences up: longest context first keeps a long one from running alone at the end. It
    does not change the result. ``num_splits`` asks for that many context partitions (split-K;
    no more than the block table has tiles of keys); by default ``decode_num_splits`` picks it.
    A padding row with ``seq_len == 0`` yields zeros. ``k_scale``, ``v_scale``: an FP8 cache's
    scales (see the module's docstring).
    """
    out = _decode(q, k_cache, v_cache, seq_lens, block_tables, scale * k_scale, order,
                  num_splits, None)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    order: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``rotate_and_store_kv`` of a decode step's tokens, then ``decode_attention`` of the
    rotated queries, in one kernel (one fewer a layer, and the queries never written). Every
    program rotates its group's queries after its wait, so with split-K each partition redoes
    it: ``fuses_rotary`` says where this kernel pays.

    Each sequence's newest position (``seq_lens - 1``) must be its token's: the kernel attends
    to the token's own rotated key and value from registers, and reads only the older keys from
    the cache, so no sequence of the batch may read another's newest slot (in a decode step
    none does: a block is shared only once full).
    """
    new = NewTokens(k, v, positions, slot_mapping, cos_sin_cache, q_norm_weight, k_norm_weight,
                    norm_eps)
    check_full_rotary(q.shape[-1], cos_sin_cache)
    check_cache_layout(k_cache, v_cache, k, v, cos_sin_cache)
    assert k.stride(1) == v.stride(1) == q.shape[2], "each token's heads must be contiguous"
    return _decode(q, k_cache, v_cache, seq_lens, block_tables, scale, order, num_splits, new)


def _decode(q, k_cache, v_cache, seq_lens, block_tables, scale, order, num_splits,
            new: NewTokens | None) -> torch.Tensor:
    batch_size, num_heads, head_dim = q.shape
    check_cache_layout(k_cache, v_cache, q)
    out = torch.empty(batch_size, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch_size == 0:
        return out
    num_splits = decode_partition_count(q, k_cache, block_tables, num_splits)
    arrivals = (arrival_counters(q.device, batch_size * k_cache.shape[2]) if num_splits > 1
                else None)
    if arrivals is None:  # one partition a sequence, which writes the output itself
        _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, order, scale, 1, out,
                       (out, out, out), new)
        return out
    partials = _partial_results(q, num_splits, torch.empty)
    _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, order, scale, num_splits, out,
                   partials, new, arrivals)
    return out


def decode_partition_count(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                           num_splits: int | None = None) -> int:
    """The most partitions a sequence of a decode launch of ``q [B, H, D]`` takes:
    ``num_splits`` if given (no more than the block table has tiles of keys), else
    ``decode_num_splits``'."""
    max_context = block_tables.shape[1] * k_cache.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(q.shape[0], k_cache.shape[2], max_context,
                                       _sms(q.device))
    return max(1, min(num_splits, -(-max_context // decode_tile(k_cache).block_n)))


def _sms(device: torch.device) -> int:
    return num_sms(device, elsewhere=H100_SMS)


class DecodeTile(NamedTuple):
    """The decode kernel's launch: keys a tile, pipeline stages, warps a program. With two
    stages a tile's loads wait for the trip before it to finish; with three or more the next
    tile's are in flight during a trip (``_attend_keys``' ``BLOCKS_AHEAD``), in as many more
    buffers of shared memory."""

    block_n: int
    stages: int
    warps: int


def decode_tile(k_cache: torch.Tensor) -> DecodeTile:
    """The decode kernel's tile for a cache of ``k_cache``'s dtype (``DECODE_TILES``)."""
    return DecodeTile(*DECODE_TILES[k_cache.element_size()])


def fuses_rotary(q: torch.Tensor, k_cache: torch.Tensor, num_splits: int) -> bool:
    """Whether ``rotary_decode_attention`` beats the rotary kernel then ``decode_attention``
    for a decode launch of ``q [B, H, D]`` in up to ``num_splits`` partitions a sequence (on
    the H100). Every partition rotates its queries again:

    - a few sequences (``few_decode_sequences``): for more than one. At one sequence it cost
      more than the rotary kernel (0.84 against 0.80 ms a step), at 2-16 it saved 4-6.5% of
      the step;
    - many, whole contexts: where all their programs fit on the GPU at once (one wave of
      ``RESIDENT_DECODE_PROGRAMS_PER_SM`` an SM). In several waves each wave rotates before it
      streams the cache (at 256 sequences the step took 6.98 against 6.83 ms);
    - many, split (``FEW_WAVES_SPLITS``): never. On an FP8 cache on the H100, one wave's
      contexts in two partitions and the rotary kernel took the decode steps of 33-128
      sequences 1.456 s; split (up to 4 partitions of one length for all) with the rotary
      fused, 1.495 s; whole with it fused, 1.500 s."""
    batch_size, num_kv_heads = q.shape[0], k_cache.shape[2]
    sms = _sms(q.device)
    if few_decode_sequences(batch_size, num_kv_heads, sms):
        return batch_size > 1
    return num_splits == 1 and within_one_wave(batch_size, num_kv_heads, sms)


def decode_partitions(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      num_splits: int, order: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a split decode launch's partitions leave for the merge, unmerged (to look at how a
    batch is cut): each partition's unnormalised output ``[B, H, splits, D]``, row max and row
    sum ``[B, H, splits]`` (base 2, float32); zeros where a sequence takes fewer partitions."""
    num_splits = decode_partition_count(q, k_cache, block_tables, num_splits)
    partials = _partial_results(q, num_splits, torch.zeros)
    _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, order, scale, num_splits,
                   partials[0], partials, None, leave_partials=True)
    return partials


def _partial_results(q: torch.Tensor, num_splits: int, allocate) -> tuple[torch.Tensor, ...]:
    batch_size, num_heads, head_dim = q.shape
    shape = (batch_size, num_heads, num_splits)
    return (allocate(*shape, head_dim, dtype=torch.float32, device=q.device),
            allocate(shape, dtype=torch.float32, device=q.device),
            allocate(shape, dtype=torch.float32, device=q.device))


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    return torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)


def arrival_counters(device: torch.device, groups: int) -> torch.Tensor | None:
    """The counters with which a split decode launch of ``groups`` (sequence, kv head) pairs
    merges its partitions itself, or None (the launch then takes one partition a sequence):
    zero between launches (the last arrival of each group resets its counter), one set a
    device, made once, outside a CUDA graph's capture (the runner's warm-up runs before it).
    Decode launches on a device run in stream order, one after another, so they share the
    set."""
    if groups > ARRIVAL_COUNTERS:
        return None
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing() \
            and _arrivals.cache_info().currsize == 0:
        return None
    return _arrivals(device)


def _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, order, scale, num_splits, out,
                   partials, new: NewTokens | None, arrivals: torch.Tensor | None = None,
                   leave_partials: bool = False) -> None:
    """One program per (partition, kv head), in ``decode_tile``'s tiles: on the H100, with the
    kv heads first, 64-key bf16 tiles two deep match or beat 128-key tiles three deep from 4
    to 256 sequences. Up to ``num_splits`` partitions a sequence, sized on the device
    (``_row_partition``), merged in the last of a sequence's to finish (with ``arrivals``,
    which one partition a sequence does not need), or all of them left in ``partials``
    (``leave_partials``)."""
    batch_size, num_heads, num_kv_heads = q.shape[0], q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tile = decode_tile(k_cache)
    few = few_decode_sequences(batch_size, num_kv_heads, _sms(q.device))
    if new is None:  # placeholders, never read
        rotation = (q, q, seq_lens, seq_lens, q, q, q, 0, 0, 0, 0, 0, 0.0)
        norm = False
    else:
        norm = new.q_norm_weight is not None
        rotation = (new.k, new.v, new.positions, new.slot_mapping, new.cos_sin_cache,
                    new.q_norm_weight if norm else q, new.k_norm_weight if norm else q,
                    new.k.stride(0), new.k.stride(1), new.v.stride(0), new.v.stride(1),
                    new.cos_sin_cache.stride(0), new.norm_eps)
    _decode_kernel[(batch_size * num_splits * num_kv_heads,)](
        q, k_cache, v_cache, out, *partials, seq_lens, block_tables,
        seq_lens if order is None else order,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * LOG2_E, *rotation, seq_lens if arrivals is None else arrivals,
        num_splits,
        KV_HEADS=num_kv_heads, GROUP=group, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=q.shape[2],
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tile.block_n, SPLIT=num_splits > 1, PRELOAD=num_splits > 1 and few,
        HAS_ORDER=order is not None, ROTATE=new is not None, NORM=norm, PARTIALS=leave_partials,
        SPLITS=triton.next_power_of_2(num_splits), BLOCKS_AHEAD=tile.stages >= 3,
        num_warps=tile.warps, num_stages=tile.stages,
        maxnreg=_decode_max_registers(few, num_splits, k_cache),
        **triton_overlap.launch_options(q.device),
    )


def _decode_max_registers(few: bool, num_splits: int, k_cache: torch.Tensor) -> int | None:
    """``DECODE_MAX_REGISTERS`` for many sequences' programs: split, or whole contexts of an
    FP8 cache (a bf16 cache's take 96 uncapped; capped, they spill)."""
    if few or (num_splits == 1 and k_cache.element_size() > 1):
        return None
    return DECODE_MAX_REGISTERS


def within_one_wave(batch_size: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode batch's whole-context programs all fit on the GPU at once
    (``RESIDENT_DECODE_PROGRAMS_PER_SM`` an SM)."""
    return batch_size * num_kv_heads <= RESIDENT_DECODE_PROGRAMS_PER_SM * num_sms


def in_few_waves(batch_size: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode batch's whole-context programs are at most
    ``FEW_WAVES_PROGRAMS_PER_SM`` an SM."""
    return batch_size * num_kv_heads <= FEW_WAVES_PROGRAMS_PER_SM * num_sms


def few_decode_sequences(batch_size: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode batch's (sequence, kv head) pairs leave the GPU idle: fewer than
    ``PROGRAMS_PER_SM`` an SM."""
    return batch_size * num_kv_heads < PROGRAMS_PER_SM * num_sms


def decode_num_splits(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """The most partitions a sequence may take, from host-known sizes only.

    A (kv head, sequence) program per SM leaves most of the GPU idle at small batch sizes, so
    a few sequences' contexts split until there are about ``PROGRAMS_PER_SM`` programs per SM.
    Many sequences' whole contexts, in up to a few waves of them (``in_few_waves``), leave the
    long ones running alone at the end: they split in ``FEW_WAVES_SPLITS``.
    Both at most one partition per ``MIN_PARTITION_KEYS`` keys of ``max_context`` (block-table
    width times block size): an upper bound, the true lengths are on the device, where the
    partitions are sized.
    """
    if few_decode_sequences(batch_size, num_kv_heads, num_sms):
        wanted = -(-PROGRAMS_PER_SM * num_sms // (batch_size * num_kv_heads))
    elif in_few_waves(batch_size, num_kv_heads, num_sms):
        wanted = FEW_WAVES_SPLITS
    else:
        wanted = 1
    return max(1, min(wanted, max_context // MIN_PARTITION_KEYS))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens_host: tuple[int, ...],
    seq_lens_host: tuple[int, ...],
    scale: float,
    tiles: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for a flattened batch of query chunks; returns ``[T, H, D]``.

    Sequence ``i``'s queries are the last ``query_lens_host[i]`` positions of its context of
    ``seq_lens_host[i]`` tokens, all of which are already in the cache. ``tiles``: the work
    map (``prefill_tile_map``, padded with ``(-1, 0)`` rows) when a CUDA graph fixes it in
    advance; otherwise it is built from the host tuples. Rows of no tile (padding tokens) are
    left as they were. ``k_scale``, ``v_scale``: an FP8 cache's scales (see the module's
    docstring).
    """
    num_tokens, num_heads, head_dim = q.shape
    check_cache_layout(k_cache, v_cache, q)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_m = prefill_block_m(num_heads, num_kv_heads, num_tokens, prefill_sms(q.device))
    block_q = block_m // group
    large = block_m >= PREFILL_ROWS
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if tiles is None:
        tiles = _prefill_tiles(query_lens_host, seq_lens_host, block_q, q.device)
    if len(tiles) == 0:
        return out
    _prefill_kernel[(len(tiles) * num_kv_heads,)](
        q, k_cache, v_cache, out, query_start, seq_lens, block_tables, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * k_scale * LOG2_E,
        KV_HEADS=num_kv_heads, GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N,
        num_warps=8 if large and head_dim >= 128 else 4, num_stages=3 if large else 2,
        maxnreg=PREFILL_MAX_REGISTERS if large and head_dim == 128 else None,
    )
    return out if v_scale == 1.0 else out.mul_(v_scale)


@functools.lru_cache(maxsize=8)
def _prefill_tiles(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_q: int, device: torch.device
) -> torch.Tensor:
    """``prefill_tile_map`` on the device. Built from the host tuples, so the grid needs no
    device sync. Cached: every layer of a step asks for the same map, so it crosses to the
    device once per step."""
    host = torch.from_numpy(prefill_tile_map(query_lens, seq_lens, block_q))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def prefill_tile_map(query_lens, seq_lens, block_q: int) -> np.ndarray:
    """``[num_tiles, 2]`` int32 rows ``(sequence, query tile)``, the tiles that see the most
    keys first, so that light ones fill the tail of the launch."""
    tiles = [(seq, tile) for seq, n in enumerate(query_lens) for tile in range(-(-n // block_q))]

    def keys_seen(tile: tuple[int, int]) -> int:
        seq, index = tile
        return seq_lens[seq] - query_lens[seq] + min((index + 1) * block_q, query_lens[seq])

    tiles.sort(key=keys_seen, reverse=True)
    return np.array(tiles, dtype=np.int32).reshape(-1, 2)


def prefill_block_m(num_heads: int, num_kv_heads: int, num_tokens: int, sms: int) -> int:
    """Rows of a prefill tile, (queries of one sequence) x (heads of one group), for a step of
    ``num_tokens`` query rows (a CUDA graph's: its padded size): 128, but 64 where tiles of 128
    would make at most two programs an SM (steps of up to ~2,100 tokens at 8 kv heads on 132
    SMs), leaving SMs idle. On the H100 64-row tiles took 6-19% less time than 128-row ones
    for one prompt of 512-2,048 tokens, two of 512-1,024 and four of 512 (up to 256 programs of
    128 rows); 128-row tiles 14-17% less for four prompts of 1,024 and eight of 512 (512)."""
    group = num_heads // num_kv_heads
    large = max(PREFILL_ROWS, triton.next_power_of_2(group))
    small = max(PREFILL_SMALL_ROWS, triton.next_power_of_2(group))
    programs = -(-num_tokens // (large // group)) * num_kv_heads
    return small if programs <= 2 * sms else large


def prefill_block_q(num_heads: int, num_kv_heads: int, num_tokens: int, sms: int) -> int:
    """Queries per prefill tile (``prefill_block_m``'s rows over the group's heads)."""
    return prefill_block_m(num_heads, num_kv_heads, num_tokens, sms) // (num_heads // num_kv_heads)


def prefill_sms(device: torch.device) -> int:
    """The SM count that sizes prefill tiles: the device's, or one under Triton's interpreter
    (on the CPU tests take 128-row tiles but for steps of one or two of them)."""
    return num_sms(device, elsewhere=1)


def check_full_rotary(head_dim: int, cos_sin_cache: torch.Tensor) -> None:
    """The rotary kernels turn whole heads: a partial rotary table (narrower than the head,
    Qwen3.5's) would be misread, so it is refused until they learn it."""
    if cos_sin_cache.shape[-1] != head_dim:
        raise NotImplementedError(
            f"partial rotary embeddings (rotary dim {cos_sin_cache.shape[-1]} of head_dim "
            f"{head_dim}) are not implemented in the Triton kernels; use kernel_backend='torch'")


def check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, *inputs: torch.Tensor) -> None:
    """What the kernels assume: a power-of-two head_dim of at least 16 (``tl.arange``, ``tl.dot``),
    contiguous last dimensions, and one set of strides for both caches."""
    head_dim = k_cache.shape[-1]
    is_power_of_two = (head_dim & (head_dim - 1)) == 0
    assert head_dim >= 16 and is_power_of_two, f"head_dim {head_dim} is not a power of two >= 16"
    assert all(t.stride(-1) == 1 for t in (k_cache, v_cache, *inputs)), "last dimensions must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "the K and V caches must share strides"

