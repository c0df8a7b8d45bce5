"""Decode attention on the standard workload's own batches: device time per layer against the
time its K/V bytes need, for each split count, and for the count the heuristic picks (in the
batch's order, and longest context first as the engine's decode graphs take it).

The batches are those of the standard workload's decode steps (the draws of
``../shared/tools/roofline.py``, all requests running together): at step ``s`` every request
with ``s < max_tokens`` runs with ``prompt + s`` keys. Qwen3-0.6B's heads (16 query, 8 kv,
head_dim 128), bf16, 16-token blocks, block tables 4,096 keys wide as in the engine's graphs.
Each call is replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``).

With ``--longest-first`` the fixed split counts take the rows longest context first too.
With ``--tiles 64x2x4,128x2x4,...`` the columns are decode tiles instead (keys a tile, tiles in
flight, warps; ``triton_attention.DECODE_TILES``), each at the heuristic's split count,
longest context first; a tile ending in ``rN`` (``32x3x2r128``) caps an FP8 cache's
many sequences' programs at N registers a thread instead of ``DECODE_MAX_REGISTERS``.
``--kv-dtype fp8`` keeps the cache in e4m3 (its floor at 1 byte). With ``--fused-rotary``
every call is the kernel the engine takes at 2-32 sequences instead
(``rotary_decode_attention``: Qwen3's head norms, the rotary embedding and the newest key's
store, each partition rotating its queries again).

Usage: python benchmarks/experiments/decode_splits.py [--bandwidth 3028] [--steps 50,300,...]
       [--longest-first] [--kv-dtype bf16|fp8] [--tiles BxSxW,...] [--fused-rotary]
"""

from __future__ import annotations

import argparse
import random

import torch
import triton.testing

from nanofn.kernels import build_cos_sin_cache, triton_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_KEYS = 16, 8, 128, 16, 4096
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8)


def workload_contexts(step: int, num_requests: int = 256) -> list[int]:
    """The context lengths of the standard workload's decode step ``step``."""
    random.seed(0)
    prompts = [len([random.randint(0, 10000) for _ in range(random.randint(100, 1024))])
               for _ in range(num_requests)]
    outputs = [random.randint(100, 1024) for _ in range(num_requests)]
    return [p + step for p, o in zip(prompts, outputs) if step < o]


def decode_inputs(contexts: list[int], device: torch.device,
                  kv_dtype: torch.dtype = torch.bfloat16) -> tuple:
    """Queries and a paged cache in shuffled blocks holding ``contexts``: the arguments of
    ``decode_attention`` but ``num_splits``."""
    g = torch.Generator(device=device).manual_seed(0)
    blocks = [-(-n // BLOCK_SIZE) for n in contexts]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, generator=g, device=device).to(kv_dtype)
                        for _ in range(2))
    free = torch.randperm(num_blocks, generator=g, device=device)
    tables = torch.zeros(len(contexts), TABLE_KEYS // BLOCK_SIZE, dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = free[start:start + n]
        start += n
    q = torch.randn(len(contexts), NUM_HEADS, HEAD_DIM, generator=g, device=device,
                    dtype=torch.bfloat16)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, seq_lens, tables, HEAD_DIM**-0.5


def newest_tokens(inputs: tuple) -> tuple:
    """What ``rotary_decode_attention`` takes beyond ``decode_inputs``' batch: each sequence's
    newest key and value (not yet rotated), its position and cache slot, the angles, and
    Qwen3's two head norms' weights."""
    seq_lens, tables = inputs[3], inputs[4]
    device = seq_lens.device
    g = torch.Generator(device=device).manual_seed(1)
    k, v = (torch.randn(len(seq_lens), NUM_KV_HEADS, HEAD_DIM, generator=g, device=device,
                        dtype=torch.bfloat16) for _ in range(2))
    positions = (seq_lens - 1).long()
    newest_blocks = tables.gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0]
    slots = newest_blocks.long() * BLOCK_SIZE + positions % BLOCK_SIZE
    cos_sin = build_cos_sin_cache(HEAD_DIM, TABLE_KEYS, 1e6, device=device)
    norm = torch.ones(HEAD_DIM, device=device, dtype=torch.bfloat16)
    return k, v, positions, cos_sin, slots, norm


def microseconds(args: tuple, num_splits: int | None, order: torch.Tensor | None = None,
                 new: tuple | None = None) -> float:
    """A decode call's median time from a CUDA graph; with ``new`` (``newest_tokens``) the
    fused-rotary kernel's."""
    q, k_cache, v_cache, seq_lens, tables, scale = args
    if new is None:
        call = lambda: triton_attention.decode_attention(*args, order=order,  # noqa: E731
                                                         num_splits=num_splits)
    else:
        k, v, positions, cos_sin, slots, norm = new
        call = lambda: triton_attention.rotary_decode_attention(  # noqa: E731
            q, k, v, positions, cos_sin, k_cache, v_cache, slots, seq_lens, tables, scale,
            order, norm, norm, 1e-6, num_splits=num_splits)
    call()  # compile outside the capture
    return triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=3028.0, help="GB/s, the floor's")
    ap.add_argument("--steps", default="1,50,150,300,450,600,700,800,900,950,1000")
    ap.add_argument("--longest-first", action="store_true",
                    help="the fixed split counts too take the rows longest context first")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--tiles", help="decode tiles to compare, as KEYSxSTAGESxWARPS,...")
    ap.add_argument("--fused-rotary", action="store_true",
                    help="time the fused-rotary kernel (rotary_decode_attention) instead")
    args = ap.parse_args()
    device = torch.device("cuda")
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    tiles = args.tiles.split(",") if args.tiles else []
    columns = ([f"tile {t}" for t in tiles] if tiles else
               ["heuristic"] + [f"{n} split{'s' * (n > 1)}" for n in SPLIT_COUNTS])
    print(f"{args.kv_dtype} cache{', fused rotary' if args.fused_rotary else ''}")
    print("| step | batch | keys (max) | floor | heuristic, longest first (as in the engine) | "
          + " | ".join(columns) + " |")
    print("|---" * (5 + len(columns)) + "|")
    for step in map(int, args.steps.split(",")):
        contexts = workload_contexts(step)
        inputs = decode_inputs(contexts, device, kv_dtype)
        floor = (sum(contexts) * NUM_KV_HEADS * HEAD_DIM * 2 * kv_dtype.itemsize
                 / (args.bandwidth * 1e3))
        longest_first = torch.argsort(inputs[3], descending=True, stable=True).to(torch.int32)
        new = newest_tokens(inputs) if args.fused_rotary else None
        cells = [f"{microseconds(inputs, None, longest_first, new):.1f}"]
        if tiles:
            cells += [f"{_with_tile(tile, inputs, longest_first, new):.1f}" for tile in tiles]
        else:
            fixed_order = longest_first if args.longest_first else None
            cells += [f"{microseconds(inputs, None, None, new):.1f}"]
            cells += [f"{microseconds(inputs, n, fixed_order, new):.1f}" for n in SPLIT_COUNTS]
        print(f"| {step} | {len(contexts)} | {sum(contexts):,} ({max(contexts):,}) | {floor:.1f} | "
              + " | ".join(cells) + " |")
        del inputs
        torch.cuda.empty_cache()


def _with_tile(tile: str, inputs: tuple, order: torch.Tensor, new: tuple | None) -> float:
    """``microseconds`` with ``tile`` (``KEYSxSTAGESxWARPS[rREGISTERS]``) as the decode tile,
    whatever ``decode_tile`` picks."""
    sizes, _, registers = tile.partition("r")
    chosen, cap = triton_attention.decode_tile, triton_attention.DECODE_MAX_REGISTERS
    decode_tile = triton_attention.DecodeTile(*map(int, sizes.split("x")))
    triton_attention.decode_tile = lambda *args: decode_tile
    triton_attention.DECODE_MAX_REGISTERS = int(registers) if registers else cap
    try:
        return microseconds(inputs, None, order, new)
    finally:
        triton_attention.decode_tile, triton_attention.DECODE_MAX_REGISTERS = chosen, cap


if __name__ == "__main__":
    main()
