"""A decode step's projections with the small kernels around them, 8-256 rows, H100, bf16:
- ``o`` and ``down``, with the norm after each: cuBLAS's product then the norm kernel (the
  engine's path without partial sums) against the split-K GEMM's partial sums then the norm
  adding them up (``nanofn/kernels/triton_gemm.py``);
- ``gate_up``, with the norm before it and the activation after it: the norm kernel, cuBLAS
  (or, up to ``WHOLE_MAX_ROWS``, the GEMM with K in one range) and the activation kernel,
  against the norm kernel and ``gated_gemm`` (the activation in the GEMM);
over a sweep of the Triton GEMM's launch configurations and with its config function's choice.

Each timing replays a CUDA graph of calls cycling through copies of the weight whose bytes
exceed the L2 cache, as a model's layers do (``gemm_sweep.time_us``). Stage one sweeps tiles and
split counts at 4 warps and 4 stages; stage two re-times the best three with other warp and
stage counts (``gemm_sweep.sweep``).

Usage: python benchmarks/decode_gemm.py [--rows 256,192,128,96,64,32,16,8] [--budget-s 400]
[--json F] [--cases o,down,gate_up]
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.nn.functional as F

import nanofn.kernels.triton_gemm as triton_gemm
import nanofn.kernels.triton_ops as triton_ops
from gemm_sweep import L2_BYTES, sweep, sweep_arguments, time_us, write_results  # (benchmarks/)
from nanofn.kernels.triton_gemm import GemmConfig

HIDDEN, EPS = 1024, 1e-6
SHAPES = {"o": (HIDDEN, 2048), "down": (HIDDEN, 3072), "gate_up": (6144, HIDDEN)}  # (N, K)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


def stage_one(rows: int, k: int, gated: bool) -> list[GemmConfig]:
    block_ms = [bm for bm in (16, 32, 64) if bm <= max(16, 1 << (rows - 1).bit_length())]
    block_ns, splits = ((16, 32, 64), (1,)) if gated else ((32, 64, 128), (1, 2, 4, 8))
    return [GemmConfig(bm, bn, bk, split)
            for bm, bn, bk, split in itertools.product(block_ms, block_ns, (64, 128), splits)
            if k % (bk * split) == 0]


def calls(name: str, rows: int, k: int, n: int):
    """``(the engine's path without the Triton GEMM: call(weight), the Triton path:
    call(weight, config), its config function)`` of one case."""
    scale = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
    if name == "gate_up":
        x, residual = randn(rows, k), randn(rows, k)

        def engine(weight):
            normed, _ = triton_ops.rms_norm(x, scale, EPS, residual)
            whole = triton_gemm.whole_gemm_config(k, rows)
            out = triton_gemm.gemm(normed, weight, whole) if whole else F.linear(normed, weight)
            return triton_ops.silu_and_mul(out)

        def gated(weight, config):
            normed, _ = triton_ops.rms_norm(x, scale, EPS, residual)
            return triton_gemm.gated_gemm(normed, weight, config)

        return engine, gated, triton_gemm.gated_gemm_config
    x, residual = randn(rows, k), randn(rows, n)

    def engine(weight):
        return triton_ops.rms_norm(F.linear(x, weight), scale, EPS, residual)

    def split_k(weight, config):
        sums = triton_gemm.partial_sums_gemm(x, weight, config)
        return triton_ops.rms_norm(sums, scale, EPS, residual)

    return engine, split_k, triton_gemm.gemm_config


def main() -> None:
    ap = sweep_arguments("256,192,128,96,64,32,16,8")
    ap.add_argument("--cases", default=",".join(SHAPES))
    a = ap.parse_args()
    started = time.time()
    results = {}
    print("| case | rows | engine without it | Triton GEMM, default config | "
          "Triton GEMM, best | best config |")
    print("|---|---|---|---|---|---|")
    for rows in map(int, a.rows.split(",")):
        for name in a.cases.split(","):
            n, k = SHAPES[name]
            copies = max(4, math.ceil(L2_BYTES / (n * k * 2)))
            weights = [randn(n, k, scale=k**-0.5) for _ in range(copies)]
            engine, triton_path, choose = calls(name, rows, k, n)
            baseline = time_us(lambda i: engine(weights[i]), copies)
            reference = engine(weights[0])
            default = choose(k, rows) or stage_one(rows, k, name == "gate_up")[0]
            timed = sweep([default, *stage_one(rows, k, name == "gate_up")],
                          lambda i, c: triton_path(weights[i], c),
                          lambda out: torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2),
                          copies, started + a.budget_s, f"{name} {rows}")
            best = min(timed, key=timed.get)
            print(f"| {name} | {rows} | {baseline:.1f} us | {timed[default]:.1f} us "
                  f"{tuple(default)} | {timed[best]:.1f} us | {tuple(best)} |", flush=True)
            results[f"{name}/{rows}"] = {
                "engine": baseline, "default": list(default), "default_us": timed[default],
                "best": list(best), "best_us": timed[best],
                "all": {str(tuple(c)): t for c, t in timed.items()}}
    write_results(a, results, started)


if __name__ == "__main__":
    main()
