"""o_proj and down_proj with the norm after each, 8-256 rows, H100, bf16: cuBLAS's product then
the norm kernel (the engine's path without partial sums) against the split-K GEMM's partial
sums then the norm adding them up (``nanofn/kernels/triton_gemm.py``), over a sweep of the
GEMM's launch configurations and with ``gemm_config``'s choice.

Each timing replays a CUDA graph of calls cycling through copies of the weight whose bytes
exceed the L2 cache, as a model's layers do (``gemm_sweep.time_us``). Stage one sweeps tiles and
split counts at 4 warps and 4 stages; stage two re-times the best three with other warp and
stage counts (``gemm_sweep.sweep``).

Usage: python benchmarks/experiments/decode_gemm.py [--rows 256,192,128,96,64,32,16,8]
       [--budget-s 400] [--json F]
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.nn.functional as F

import nanofn.kernels.triton_gemm as triton_gemm
import nanofn.kernels.triton_ops as triton_ops
from gemm_sweep import L2_BYTES, sweep, sweep_arguments, time_us, write_results  # (its folder)
from nanofn.kernels.triton_gemm import GemmConfig

HIDDEN, EPS = 1024, 1e-6
SHAPES = {"o": (HIDDEN, 2048), "down": (HIDDEN, 3072)}  # (N, K)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def stage_one(rows: int, k: int) -> list[GemmConfig]:
    block_ms = [bm for bm in (16, 32, 64) if bm <= max(16, 1 << (rows - 1).bit_length())]
    return [GemmConfig(bm, bn, bk, split)
            for bm, bn, bk, split in itertools.product(block_ms, (32, 64, 128), (64, 128), (1, 2, 4, 8))
            if k % (bk * split) == 0]


def main() -> None:
    a = sweep_arguments("256,192,128,96,64,32,16,8").parse_args()
    started = time.time()
    results = {}
    print("| projection + norm | rows | cuBLAS + norm | partial sums + norm, gemm_config | "
          "partial sums + norm, best | best config |")
    print("|---|---|---|---|---|---|")
    for rows in map(int, a.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            copies = max(4, math.ceil(L2_BYTES / (n * k * 2)))
            weights = [randn(n, k, scale=k**-0.5) for _ in range(copies)]
            x, residual = randn(rows, k), randn(rows, n)
            scale = (torch.rand(n, device="cuda") + 0.5).to(torch.bfloat16)

            def engine(weight):
                return triton_ops.rms_norm(F.linear(x, weight), scale, EPS, residual)

            def split_k(weight, config):
                sums = triton_gemm.partial_sums_gemm(x, weight, config)
                return triton_ops.rms_norm(sums, scale, EPS, residual)

            baseline = time_us(lambda i: engine(weights[i]), copies)
            reference = engine(weights[0])
            default = triton_gemm.gemm_config(k, rows)
            timed = sweep([default, *stage_one(rows, k)], lambda i, c: split_k(weights[i], c),
                          lambda out: torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2),
                          copies, started + a.budget_s, f"{name} {rows}")
            best = min(timed, key=timed.get)
            print(f"| {name} | {rows} | {baseline:.1f} us | {timed[default]:.1f} us | "
                  f"{timed[best]:.1f} us | {tuple(best)} |", flush=True)
            results[f"{name}/{rows}"] = {
                "engine": baseline, "default": list(default), "default_us": timed[default],
                "best": list(best), "best_us": timed[best],
                "all": {str(tuple(c)): t for c, t in timed.items()}}
    write_results(a, results, started)


if __name__ == "__main__":
    main()
