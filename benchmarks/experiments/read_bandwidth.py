"""How fast the H100 reads a paged KV cache, by access pattern, against decode attention itself.

Decode attention at 256 sequences reads ~0.7 GB a layer and takes 1.05x the time of a copy at
the same bytes (RESULTS.md). This measures what reading alone can do, so that the rest of the
gap has a size: a contiguous read, and reads of one kv head's keys through a shuffled block
table, with the cache laid out as the engine's (``[blocks, block_size, kv_heads, head_dim]``:
a head's key is 256 bytes, 2 KB from the next key) or head-major (``[blocks, kv_heads,
block_size, head_dim]``: a head's 16 keys of a block are 4 KB in one piece). Each kernel sums
what it reads (so nothing is optimised away) and runs from a CUDA graph.

Usage: python benchmarks/experiments/read_bandwidth.py [--seqs 256] [--context 680]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

from decode_splits import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS as KV_HEADS, decode_inputs, microseconds


@triton.jit
def _read_contiguous(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Program p sums elements ``[p * BLOCK * STEPS, (p + 1) * BLOCK * STEPS)``."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.float32)
    for step in range(STEPS):
        offsets = base + step * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _read_paged(cache_ptr, tables_ptr, out_ptr, blocks_per_seq, stride_table, stride_block,
                stride_slot, stride_head, TILE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (sequence, kv head): the head's keys of every block in the sequence's table,
    ``TILE`` keys a step (whole blocks), as decode attention walks them."""
    seq, head = tl.program_id(0), tl.program_id(1)
    keys = tl.arange(0, TILE)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([TILE, HEAD_DIM], tl.float32)
    for first in range(0, blocks_per_seq * 16, TILE):
        blocks = tl.load(tables_ptr + seq * stride_table + (first + keys) // 16).to(tl.int64)
        rows = blocks * stride_block + ((first + keys) % 16) * stride_slot + head * stride_head
        acc += tl.load(cache_ptr + rows[:, None] + dims[None, :]).to(tl.float32)
    tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(tl.sum(acc, 1), 0))


def gb_per_s(nbytes: int, call) -> tuple[float, float]:
    call()  # compile outside the capture
    us = triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3
    return us, nbytes / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=680)
    a = ap.parse_args()
    blocks_per_seq = -(-a.context // BLOCK_SIZE)
    # decode_splits' paged inputs: shuffled blocks, tables as wide as the engine's graphs'
    args = decode_inputs([blocks_per_seq * BLOCK_SIZE] * a.seqs, torch.device("cuda"))
    k_cache, v_cache, tables = args[1], args[2], args[4]
    caches = {"engine layout": (k_cache, v_cache),
              "head-major": tuple(c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))}
    nbytes = 2 * k_cache.numel() * k_cache.element_size()  # K and V
    rows = []

    flat = torch.cat([k_cache.view(-1), v_cache.view(-1)])
    out = torch.empty(1 << 20, device="cuda")
    for block, steps in ((4096, 8), (8192, 4), (2048, 16)):
        grid = triton.cdiv(flat.numel(), block * steps)
        rows.append((f"contiguous read, {block} x {steps} a program", *gb_per_s(
            nbytes, lambda: _read_contiguous[(grid,)](flat, out, flat.numel(), block, steps))))
    copy_dst = torch.empty_like(flat)
    rows.append(("torch copy (bytes read)", *gb_per_s(nbytes, lambda: copy_dst.copy_(flat))))
    for name, pair in caches.items():
        head_major = name == "head-major"
        for tile in (64, 128):
            for warps in (4, 8):
                def run():
                    for cache in pair:
                        _read_paged[(a.seqs, KV_HEADS)](
                            cache, tables, out, blocks_per_seq, tables.stride(0),
                            cache.stride(0), cache.stride(2 if head_major else 1),
                            cache.stride(1 if head_major else 2), TILE=tile,
                            HEAD_DIM=HEAD_DIM, num_warps=warps)
                rows.append((f"paged, {name}, {tile}-key tiles, {warps} warps",
                             *gb_per_s(nbytes, run)))
    us = microseconds(args, None)
    rows.append(("decode attention (the engine's kernel)", us, nbytes / us / 1e3))
    print(f"{a.seqs} sequences x {blocks_per_seq * BLOCK_SIZE} keys, K and V: "
          f"{nbytes / 1e6:.0f} MB")
    print("| access | us | GB/s |\n|---|---|---|")
    for name, us, rate in rows:
        print(f"| {name} | {us:.1f} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
