"""Decode projections of 8-256 rows: cuBLAS against a plain Triton GEMM (``tl.dot``, every row
in one tile so that each weight element is read once, split-K through float32 atomics, and the
transposed product for few rows) over a sweep of its configurations (H100, bf16).

Qwen3-0.6B's four projections (qkv 4096 x 1024, o 1024 x 2048, gate-up 6144 x 1024, down
1024 x 3072). Each timing replays a CUDA graph of calls that take their weight from copies
whose bytes exceed the L2 cache, as the layers of a model do. Stage one sweeps tile shapes and
split counts at 4 warps and 4 stages; stage two re-times the best three of each case with
other warp and stage counts. Prints, per projection and row count, cuBLAS (``F.linear``, and
``x @ w_t`` on a transposed copy), the best Triton configuration, and the bandwidth.

On the H100 (2026-11-23) cuBLAS was 6.5-8.5 us a projection at 256 rows and 5.6-7.1 us at 8, a
few microseconds over the bytes at any row count; the best Triton configuration was 1.5-4 us
slower at 128-256 rows and within 0.8 us either way at 8-64 (RESULTS.md). ``--tiled`` sweeps
tiles of 64-128 rows and split-K into float32 partial sums left for the consumer to add up
(no atomics, no zeroing, not timed): on 2026-11-24 it beat cuBLAS on the two projections with
N = 1,024 (o and down: by 0.8-2.5 us a projection at 64-256 rows) and lost on the two wide
ones (qkv and gate-up: by up to 1 us at 256 rows). Kept to measure again before writing a GEMM
for these shapes.

Usage: python benchmarks/experiments/gemm_sweep.py [--rows 256,128,64,32,8] [--budget-s 400]
       [--tiled] [--shapes qwen3-0.6b|qwen3-8b-rank-of-2]

``--shapes qwen3-8b-rank-of-2``: one TP=2 rank's projections of Qwen3-8B, where a Triton GEMM
would have to match cuBLAS before its epilogue could store each tile into the other rank's
peer buffer (the summands then read locally by the norm: the thirty-first session's note).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (N, K) of each projection: Qwen3-0.6B's, and one rank's of Qwen3-8B at TP=2 (16 of 32 heads,
# 4 of 8 KV heads, 6,144 of 12,288 MLP columns), whose cuBLAS products scale worst from TP=1
SHAPES_BY_MODEL = {
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072)},
    "qwen3-8b-rank-of-2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (12288, 4096),
                           "down": (4096, 6144)},
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288)},
}
SHAPES = SHAPES_BY_MODEL["qwen3-0.6b"]
L2_BYTES = 128 << 20  # rotate over weights of at least this many bytes


class GemmConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    swap: bool
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 0  # rows per tile; 0: every row in one tile
    partials: bool = False  # split-K writes float32 partial sums [split, rows, n], no atomics


@triton.jit
def _gemm_kernel(
    x_ptr, weight_ptr, out_ptr, rows, n, stride_x, stride_weight, stride_out, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SWAP: tl.constexpr, PARTIALS: tl.constexpr,
):
    """Program (output tile, K range, row tile): ``out[rows, tile] (+)= x[rows, range] @
    weight[tile, range].T``; with ``PARTIALS`` K range ``s`` stores its sums at ``out[s]``."""
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    columns = tl.arange(0, BLOCK_K)
    first = tl.program_id(1) * k_per_split
    x_tile = x_ptr + m[:, None] * stride_x + first + columns[None, :]
    weight_tile = weight_ptr + outputs[:, None].to(tl.int64) * stride_weight + first + columns[None, :]
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(x_tile, mask=m[:, None] < rows, other=0.0)
        w = tl.load(weight_tile, mask=outputs[:, None] < n, other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        x_tile += BLOCK_K
        weight_tile += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    out = out_ptr + m[:, None] * stride_out + outputs[None, :]
    mask = (m[:, None] < rows) & (outputs[None, :] < n)
    if PARTIALS:
        tl.store(out + tl.program_id(1) * rows * stride_out, acc, mask=mask)
    elif SPLIT:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M, K]`` (at most 256 rows, contiguous) and ``weight [N, K]``;
    ``K`` a multiple of ``config.block_k * config.split_k``."""
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= 256 and x.stride(-1) == weight.stride(-1) == 1, "rows must be contiguous"
    assert k % (config.block_k * config.split_k) == 0, (k, config)
    split = config.split_k > 1
    block_m = config.block_m or max(16, triton.next_power_of_2(rows))
    if config.partials:
        out = torch.empty(config.split_k, rows, n, dtype=torch.float32, device=x.device)
    elif split:
        out = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k, triton.cdiv(rows, block_m))
    _gemm_kernel[grid](
        x, weight, out, rows, n, x.stride(0), weight.stride(0), out.stride(-2),
        k // config.split_k, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=split, SWAP=config.swap,
        PARTIALS=config.partials, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if config.partials:  # the consumer kernel would add them up (not timed)
        return out
    return out.to(x.dtype) if split else out


def time_us(call, copies: int) -> float:
    """Device time of ``call(i)`` per call, from a graph of calls over ``copies`` weights."""
    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(2 * copies):
            call(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (20 * copies)


def sweep(configs: list, run, check, copies: int, deadline: float, label: str) -> dict:
    """Microseconds of ``run(i, config)`` (weight copy ``i``) for each config whose first output
    passes ``check`` (infinite where it fails or does not launch), then for the best three's
    variants of 4 or 8 warps and 3 to 5 stages; configs left when ``deadline`` passes go
    untimed."""
    timed: dict = {}

    def try_config(config) -> None:
        if config in timed or time.time() > deadline:
            return
        try:
            check(run(0, config))
            timed[config] = time_us(lambda i: run(i, config), copies)
        except Exception as error:  # out of shared memory, say
            timed[config] = float("inf")
            print(f"  {label} {config}: {type(error).__name__}: {str(error)[:80]}")

    for config in configs:
        try_config(config)
    for config in sorted(timed, key=timed.get)[:3]:
        for warps, stages in itertools.product((4, 8), (3, 4, 5)):
            try_config(config._replace(num_warps=warps, num_stages=stages))
    return timed


def stage_one(rows: int, k: int, tiled: bool) -> list[GemmConfig]:
    if tiled:  # tiles of rows, split-K into float32 partials that the consumer would sum
        return [GemmConfig(bn, bk, split, False, 8 if bm * bn >= 128 * 128 else 4, 4, bm,
                           split > 1)
                for bm, bn, bk, split in itertools.product((64, 128), (64, 128), (64, 128),
                                                           (1, 2, 4, 8))
                if k % (bk * split) == 0 and bm <= max(64, rows)]
    swaps = (False, True) if rows <= 64 else (False,)
    return [GemmConfig(bn, bk, split, swap)
            for bn, bk, split, swap in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), swaps)
            if k % (bk * split) == 0]


def sweep_arguments(rows: str) -> argparse.ArgumentParser:
    """A sweep script's arguments: the row counts (``rows`` by default), a time budget, a JSON
    file for every timing."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--json")
    return ap


def write_results(args: argparse.Namespace, results: dict, started: float) -> None:
    """Every timing to ``--json`` (if given), and the sweep's duration."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"swept in {time.time() - started:.0f} s")


def main() -> None:
    ap = sweep_arguments("256,128,64,32,8")
    ap.add_argument("--tiled", action="store_true",
                    help="row tiles and split-K into partial sums (the consumer's to add up)")
    ap.add_argument("--shapes", choices=SHAPES_BY_MODEL, default="qwen3-0.6b")
    a = ap.parse_args()
    shapes = SHAPES_BY_MODEL[a.shapes]
    started = time.time()
    results = {}
    print("| projection | rows | weight bytes floor | F.linear | x @ w_t | best Triton | config |")
    print("|---|---|---|---|---|---|---|")
    weights, transposed, copies = {}, {}, {}
    for name, (n, k) in shapes.items():
        copies[name] = max(4, math.ceil(L2_BYTES / (n * k * 2)))
        weights[name] = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
                         for _ in range(copies[name])]
        transposed[name] = [w.t().contiguous() for w in weights[name]]
    for rows in map(int, a.rows.split(",")):  # (the most frequent row counts first)
        for name, (n, k) in shapes.items():
            ws, wts, count = weights[name], transposed[name], copies[name]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            linear = time_us(lambda i: F.linear(x, ws[i]), count)
            nn = time_us(lambda i: x @ wts[i], count)
            reference = F.linear(x, ws[0]).float()
            timed = sweep(stage_one(rows, k, a.tiled), lambda i, c: gemm(x, ws[i], c),
                          lambda out: torch.testing.assert_close(
                              (out.sum(0) if out.dim() == 3 else out).float(), reference,
                              rtol=2e-2, atol=2e-2),
                          count, started + a.budget_s, f"{name} {rows}")
            best = min(timed, key=timed.get) if timed else None
            floor = n * k * 2 / 3.35e6
            cell = f"{timed[best]:.1f} us" if best else "-"
            print(f"| {name} | {rows} | {floor:.1f} us | {linear:.1f} us | {nn:.1f} us | {cell} | "
                  f"{tuple(best) if best else '-'} |", flush=True)
            results[f"{name}/{rows}"] = {
                "linear": linear, "nn": nn, "best": list(best) if best else None,
                "best_us": timed.get(best), "all": {str(tuple(c)): t for c, t in timed.items()}}
    write_results(a, results, started)


if __name__ == "__main__":
    main()
