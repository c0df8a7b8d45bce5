"""Decode attention on an FP8 cache with both products on the FP8 tensor cores, against the
engine's kernel, on the standard workload's own batches (``decode_splits.py``'s).

The engine's decode kernel converts every key and value it reads to fp16 (``F2FP``) and takes
the value tile through shared memory a second time (``_values_in``): at 256 sequences on an
H200 it took 103 us a layer against 61 for the bytes at 4,800 GB/s, where the bf16 kernel
reads at ~95% of a plain read. Here the queries
and the probabilities are quantized to e4m3 instead, and the cache's bytes feed Hopper's
``wgmma`` straight from shared memory, transposed so that the tensor cores' 64-row tiles are
the keys (scores) and the head's dimensions (output), not the group's two query heads padded to
64: ``scores^T = K @ q^T`` (keys x heads) and ``out^T = V^T @ p^T`` (dims x heads). An 8-bit
``wgmma`` reads both operands with the reduced dimension contiguous; for ``V^T`` that is the
keys, so the values are held transposed in each cache block (``[blocks, kv heads, head_dim,
block_size]``), a layout the engine's cache does not have: this measures whether it would pay
before the cache, its writes and prefill change. ``-fp16`` tiles keep the queries and the
probabilities in fp16 and convert the tiles in registers instead (no second trip through
shared memory either, the values being transposed already).

Measured on an H100 (benchmarks/RESULTS.md, 2026-12-07): it does not pay. At 37-256 sequences
every variant was 5-17% (FP8 products) or 21-38% (fp16) slower than the engine's kernel, and
the FP8 products' error 10-28x the engine's. The premise was weaker than it read: there the
engine's kernel took 113 us at 256 sequences, 77% of 3,350 GB/s (86% of a copy's 3,028).

Usage: python benchmarks/experiments/decode_fp8_mma.py [--bandwidth 3350] [--steps 1,300,...]
       [--tiles KEYSxSTAGESxWARPS[rREGISTERS][-fp16],...]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl
import triton.testing

from nanofn.kernels import triton_attention

from decode_splits import (BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, decode_inputs,
                           microseconds, workload_contexts)

# The probabilities (at most 1) times this before rounding to e4m3, so that down to 2^-14 they
# stay normal numbers (3 bits of mantissa) rather than flushing below e4m3's 2^-9
PROBS_SCALE = 256.0
SAMPLE = 32  # sequences whose outputs are compared with float32 attention


@triton.jit
def _kv_tile(k_cache_ptr, vt_cache_ptr, blocks, kv_head, keys_left,
             stride_kblock, stride_kslot, stride_khead, stride_vblock, stride_vhead, stride_vdim,
             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr):
    """The keys ``[BLOCK_N, HEAD_DIM]`` and the values transposed ``[HEAD_DIM, BLOCK_N]`` of
    the tile in cache ``blocks`` (``BLOCK_N // BLOCK_SIZE`` of them), read as whole blocks
    (runs of contiguous bytes the compiler can see); with ``MASKED`` zeros from key
    ``keys_left`` on."""
    tile_blocks = tl.arange(0, BLOCK_N // BLOCK_SIZE)
    slots = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    k_offsets = (blocks[:, None, None] * stride_kblock + slots[None, :, None] * stride_kslot
                 + kv_head * stride_khead + dims[None, None, :])
    vt_offsets = (blocks[None, :, None] * stride_vblock + kv_head * stride_vhead
                  + dims[:, None, None] * stride_vdim + slots[None, None, :])
    if MASKED:
        key_in_range = (tile_blocks[:, None] * BLOCK_SIZE + slots[None, :]) < keys_left
        k8 = tl.load(k_cache_ptr + k_offsets, mask=key_in_range[:, :, None], other=0.0)
        vt8 = tl.load(vt_cache_ptr + vt_offsets, mask=key_in_range[None, :, :], other=0.0)
    else:
        k8 = tl.load(k_cache_ptr + k_offsets)
        vt8 = tl.load(vt_cache_ptr + vt_offsets)
    return tl.reshape(k8, [BLOCK_N, HEAD_DIM]), tl.reshape(vt8, [HEAD_DIM, BLOCK_N])


@triton.jit
def _tile_blocks(table_ptr, first_block, last_block, BLOCK_N: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """The cache blocks of the tile from the sequence's block ``first_block``, none past
    ``last_block`` (the last ones repeated)."""
    blocks = tl.minimum(first_block + tl.arange(0, BLOCK_N // BLOCK_SIZE), last_block)
    return tl.load(table_ptr + blocks).to(tl.int64)


@triton.jit
def _attend_fp8_tile(acc, row_sum, row_max, q, k8, vt8, visible, score_scale,
                     PROBS_SCALE: tl.constexpr, FP8_PRODUCTS: tl.constexpr):
    """One tile's online-softmax update, transposed: ``acc`` is ``out^T`` (dims x heads),
    ``row_max`` and ``row_sum`` are per query head (columns). With ``FP8_PRODUCTS`` ``q`` is
    e4m3 and the probabilities are rounded to e4m3 too; without, the tiles are converted to
    fp16 in registers (the products' first operands) and ``q`` is fp16."""
    if FP8_PRODUCTS:
        scores = tl.dot(k8, tl.trans(q))
    else:
        scores = tl.dot(k8.to(tl.float16), tl.trans(q))
    scores = scores * score_scale  # keys x heads, log2 units
    if visible is not None:
        scores = tl.where(visible[:, None], scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 0))
    correction = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[None, :])
    row_sum = row_sum * correction + tl.sum(probs, 0)
    if FP8_PRODUCTS:
        values = tl.dot(vt8, (probs * PROBS_SCALE).to(tl.float8e4nv))  # (scale: at the end)
    else:
        values = tl.dot(vt8.to(tl.float16), probs.to(tl.float16))
    acc = acc * correction[None, :] + values
    return acc, row_sum, new_max


@triton.jit
def _decode_fp8_mma_kernel(
    q_ptr, k_cache_ptr, vt_cache_ptr, out_ptr, seq_lens_ptr, block_tables_ptr, order_ptr,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_kblock, stride_kslot, stride_khead,
    stride_vblock, stride_vhead, stride_vdim, stride_table, qk_scale,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PROBS_SCALE: tl.constexpr, FP8_PRODUCTS: tl.constexpr,
):
    """Program (sequence ``order[row]``, kv head): the group's query heads over the whole
    context, the last tile masked."""
    row, kv_head = tl.program_id(0) // KV_HEADS, tl.program_id(0) % KV_HEADS
    seq = tl.load(order_ptr + row)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + heads)[:, None] * stride_qh
                + dims[None, :], mask=head_mask[:, None], other=0.0).to(tl.float32)
    if FP8_PRODUCTS:
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0), 1e-12) / 448.0  # e4m3 max
        q = (q * (1.0 / q_scale)).to(tl.float8e4nv)
        score_scale = q_scale * qk_scale
    else:
        q = q.to(tl.float16)
        score_scale = qk_scale
    table_ptr = block_tables_ptr + seq * stride_table
    row_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_H], dtype=tl.float32)
    whole_end = seq_len // BLOCK_N * BLOCK_N
    last_block = tl.maximum(seq_len - 1, 0) // BLOCK_SIZE
    # each trip reads the next tile's blocks, so that no load waits for one of its own trip
    # and the pipeliner keeps the next tiles' keys and values in flight (the engine's
    # ``BLOCKS_AHEAD``)
    blocks = _tile_blocks(table_ptr, 0, last_block, BLOCK_N, BLOCK_SIZE)
    for tile_begin in range(0, whole_end, BLOCK_N):
        k8, vt8 = _kv_tile(k_cache_ptr, vt_cache_ptr, blocks, kv_head, BLOCK_N,
                           stride_kblock, stride_kslot, stride_khead, stride_vblock,
                           stride_vhead, stride_vdim, BLOCK_SIZE, HEAD_DIM, BLOCK_N, False)
        blocks = _tile_blocks(table_ptr, (tile_begin + BLOCK_N) // BLOCK_SIZE, last_block,
                              BLOCK_N, BLOCK_SIZE)
        acc, row_sum, row_max = _attend_fp8_tile(acc, row_sum, row_max, q, k8, vt8, None,
                                                 score_scale, PROBS_SCALE, FP8_PRODUCTS)
    if whole_end < seq_len:  # (blocks: this tile's, from the last trip or before the loop)
        k8, vt8 = _kv_tile(k_cache_ptr, vt_cache_ptr, blocks, kv_head, seq_len - whole_end,
                           stride_kblock, stride_kslot, stride_khead, stride_vblock,
                           stride_vhead, stride_vdim, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True)
        in_range = tl.arange(0, BLOCK_N) < seq_len - whole_end
        acc, row_sum, row_max = _attend_fp8_tile(acc, row_sum, row_max, q, k8, vt8, in_range,
                                                 score_scale, PROBS_SCALE, FP8_PRODUCTS)
    if FP8_PRODUCTS:
        row_sum *= PROBS_SCALE
    out = acc / row_sum[None, :]
    tl.store(out_ptr + seq * stride_ob + (kv_head * GROUP + heads)[None, :] * stride_oh
             + dims[:, None], out.to(out_ptr.dtype.element_ty), mask=head_mask[None, :])


def decode_fp8_mma(q: torch.Tensor, k_cache: torch.Tensor, vt_cache: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                   order: torch.Tensor, tile: tuple[int, int, int] = (64, 3, 4),
                   max_registers: int | None = None, fp8_products: bool = True) -> torch.Tensor:
    """Decode attention of ``q`` ``[batch, heads, head_dim]`` over an e4m3 cache whose keys are
    ``[blocks, block_size, kv heads, head_dim]`` and values ``[blocks, kv heads, head_dim,
    block_size]``; rows in ``order``."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    block_n, stages, warps = tile
    extra = {"maxnreg": max_registers} if max_registers else {}
    _decode_fp8_mma_kernel[(batch * kv_heads,)](
        q, k_cache, vt_cache, out, seq_lens, block_tables, order,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        vt_cache.stride(0), vt_cache.stride(1), vt_cache.stride(2), block_tables.stride(0),
        scale * triton_attention.LOG2_E,
        KV_HEADS=kv_heads, GROUP=num_heads // kv_heads, BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_H=16, BLOCK_N=block_n, PROBS_SCALE=PROBS_SCALE,
        FP8_PRODUCTS=fp8_products,
        num_warps=warps, num_stages=stages, **extra)
    return out


def transposed_values(v_cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, kv heads, head_dim]`` -> ``[blocks, kv heads, head_dim,
    block_size]``, contiguous."""
    return v_cache.permute(0, 2, 3, 1).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=3350.0, help="GB/s, the floor's")
    ap.add_argument("--steps", default="1,150,300,450,600,700,800,900")
    ap.add_argument("--tiles", default="64x3x4,64x3x4r96,64x4x4,64x3x4-fp16,64x3x4r128-fp16",
                    help="KEYSxSTAGESxWARPS[rREGISTERS][-fp16],... (-fp16: products in fp16)")
    args = ap.parse_args()
    device = torch.device("cuda")
    tiles = args.tiles.split(",")
    print("| step | batch | floor | engine | " + " | ".join(tiles)
          + " | max error: engine, " + ", ".join(tiles) + " |")
    print("|---" * (6 + len(tiles)) + "|")
    for step in map(int, args.steps.split(",")):
        contexts = workload_contexts(step)
        inputs = decode_inputs(contexts, device, torch.float8_e4m3fn)
        q, k_cache, v_cache, seq_lens, tables, scale = inputs
        vt_cache = transposed_values(v_cache)
        order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
        floor = sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2 / (args.bandwidth * 1e3)
        cells = [f"{microseconds(inputs, None, order):.1f}"]
        outputs = [triton_attention.decode_attention(*inputs, order=order)]
        for tile in tiles:
            call = functools.partial(decode_fp8_mma, q, k_cache, vt_cache, seq_lens, tables,
                                     scale, order, **tile_options(tile))
            outputs.append(call())
            took = triton.testing.do_bench_cudagraph(call, return_mode="median")
            cells.append(f"{took * 1e3:.1f}")
        reference = reference_attention(q, k_cache, v_cache, seq_lens, tables, scale)
        errors = [(x[:SAMPLE].float() - reference).abs().max().item() for x in outputs]
        print(f"| {step} | {len(contexts)} | {floor:.1f} | " + " | ".join(cells)
              + " | " + ", ".join(f"{e:.4f}" for e in errors) + " |")
        del inputs, vt_cache
        torch.cuda.empty_cache()


def tile_options(tile: str) -> dict:
    """``decode_fp8_mma``'s options from ``KEYSxSTAGESxWARPS[rREGISTERS][-fp16]``."""
    tile, fp16, _ = tile.partition("-fp16")
    sizes, _, registers = tile.partition("r")
    return {"tile": tuple(map(int, sizes.split("x"))), "fp8_products": not fp16,
            "max_registers": int(registers) if registers else None}


def reference_attention(q, k_cache, v_cache, seq_lens, tables, scale) -> torch.Tensor:
    """float32 attention of the first ``SAMPLE`` sequences over their cache blocks."""
    out = torch.zeros((min(SAMPLE, len(seq_lens)),) + q.shape[1:], dtype=torch.float32,
                      device=q.device)
    group = NUM_HEADS // NUM_KV_HEADS
    for seq in range(len(out)):
        n = int(seq_lens[seq])
        blocks = tables[seq, :-(-n // BLOCK_SIZE)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[seq].float(), k) * scale
        out[seq] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


if __name__ == "__main__":
    main()
