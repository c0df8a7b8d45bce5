"""W8A8 projections of many rows (decode batches and prompts) on the H100: where the time of
``triton_fp8.fp8_gemm`` goes (the activations' quantization kernel, then the GEMM), its tiles
swept, and ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM with a scale per row of each operand) on
the same codes, beside bf16 cuBLAS.

A model's four projections (``--model``, of ``gemm_sweep.SHAPES_BY_MODEL``; Qwen3-0.6B's: qkv
4096 x 1024, o 1024 x 2048, gate-up 6144 x 1024, down 1024 x 3072), weights quantized per
channel as ``quantization="fp8"`` does, activations per token. Each timing replays a CUDA
graph of calls over weight copies whose bytes exceed the L2 cache (``gemm_sweep.time_us``).
Up to ``GEMV_MAX_ROWS`` rows the GEMV's time is shown too, and the engine's column is
``fp8_linear``, which takes the GEMV or the GEMM as ``takes_gemv`` says: at 2-8 rows the
crossover between the two, in rows times the weight's bytes, is ``GEMV_MAX_ROW_BYTES``. For
qkv and gate_up, the projections after a norm, up to ``NORM_GEMV_MAX_ROWS`` rows the GEMV the
engine launches there is the one with the norm fused (and gate_up's activation): its time is
the "norm GEMV" column, against the norm that quantizes and the GEMM (``rms_norm_linear`` off
the GEMV), so that the bound is read for the kernels the engine runs.

Usage: python benchmarks/experiments/fp8_gemm.py [--rows 64,128,256,2048,8192]
       [--model qwen3-0.6b|qwen3-8b|...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gemm_sweep import L2_BYTES, SHAPES_BY_MODEL, time_us  # (its folder)
from nanofn.kernels import triton_fp8, triton_ops
from nanofn.kernels.fp8 import Fp8Weight, quantize_groups
from nanofn.kernels.triton_fp8 import GemmTile

TILES = [GemmTile(64, 128, 128, 8, 3), GemmTile(64, 64, 128, 4, 4), GemmTile(64, 128, 128, 4, 4),
         GemmTile(128, 128, 128, 8, 3), GemmTile(128, 64, 128, 4, 4),
         GemmTile(64, 128, 256, 8, 3), GemmTile(128, 128, 64, 4, 4), GemmTile(128, 256, 128, 8, 3),
         GemmTile(64, 32, 128, 4, 4), GemmTile(64, 32, 128, 4, 6), GemmTile(64, 16, 128, 4, 4)]


def weights(n: int, k: int) -> list[Fp8Weight]:
    """Per-channel FP8 copies of a random ``[n, k]`` weight, enough to exceed the L2 cache."""
    q, scale = quantize_groups(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), k)
    return [Fp8Weight(q.clone(), scale.clone(), k) for _ in range(-(-2 * L2_BYTES // (n * k)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256,2048,8192")
    ap.add_argument("--model", default="qwen3-0.6b", choices=SHAPES_BY_MODEL)
    args = ap.parse_args()
    print(f"{args.model}, us a projection")
    print("| projection | rows | bf16 cuBLAS | quantize | GEMV | fp8_linear (engine) | "
          "quantize + GEMM | its GEMM, best tile | _scaled_mm | quantize + _scaled_mm | "
          "norm GEMV | norm-quantize + GEMM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES_BY_MODEL[args.model].items():
        copies = weights(n, k)
        bf16 = [w.dequantized(torch.bfloat16) for w in copies[:len(copies) // 2 + 1]]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            q, x_scales = triton_fp8.quantize_activations(x, k)
            cublas = time_us(lambda i: F.linear(x, bf16[i]), len(bf16))
            quantize = time_us(lambda i: triton_fp8.quantize_activations(x, k), len(copies))
            gemv = (f"{time_us(lambda i: triton_fp8.fp8_gemv(x, copies[i]), len(copies)):.1f}"
                    if rows <= triton_fp8.GEMV_MAX_ROWS else "-")
            engine = time_us(lambda i: triton_fp8.fp8_linear(x, copies[i]), len(copies))
            gemm = time_us(lambda i: triton_fp8.fp8_gemm(x, copies[i]), len(copies))
            tiles = {}
            for tile in TILES:
                try:
                    tiles[tile] = time_us(lambda i: triton_fp8.quantized_gemm(
                        q, x_scales, copies[i], None, torch.bfloat16, tile), len(copies))
                except Exception as error:  # (out of shared memory, say)
                    print(f"  {tile}: {type(error).__name__}")
            best = min(tiles, key=tiles.get)
            try:  # (cuBLASLt may refuse a few rows)
                scaled_us = time_us(lambda i: _scaled_mm(q, x_scales, copies[i]), len(copies))
                both_us = time_us(lambda i: _scaled_mm(*triton_fp8.quantize_activations(x, k),
                                                       copies[i]), len(copies))
                scaled, both = f"{scaled_us:.1f}", f"{both_us:.1f}"
            except RuntimeError as error:
                scaled = both = f"({type(error).__name__})"
            norm_gemv, norm_gemm = _after_the_norm(name, x, copies, rows)
            print(f"| {name} | {rows} | {cublas:.1f} | {quantize:.1f} | {gemv} | {engine:.1f} | "
                  f"{gemm:.1f} | {tiles[best]:.1f} ({'x'.join(map(str, best))}) | "
                  f"{scaled} | {both} | {norm_gemv} | {norm_gemm} |")


def _after_the_norm(name: str, x: torch.Tensor, copies: list[Fp8Weight],
                    rows: int) -> tuple[str, str]:
    """For qkv and gate_up (gated) at a few rows: the GEMV with the norm (and the residual's
    sum) fused, and the norm that quantizes followed by the GEMM, as ``rms_norm_linear`` runs
    them (gate_up's activation then in down's quantization, not here); "-" elsewhere."""
    if name not in ("qkv", "gate_up") or rows > triton_fp8.NORM_GEMV_MAX_ROWS:
        return "-", "-"
    gated = name == "gate_up"
    norm_weight, residual = torch.rand_like(x[0]) + 0.5, torch.randn_like(x)
    fused = time_us(lambda i: triton_fp8.fp8_rms_norm_gemv(
        x, norm_weight, 1e-6, residual, copies[i], gated=gated), len(copies))

    def norm_then_gemm(i: int) -> torch.Tensor:  # (gated: down's quantization activates)
        q, x_scales, _ = triton_ops.rms_norm_quantized(x, norm_weight, 1e-6, residual, copies[i])
        return triton_fp8.quantized_gemm(q, x_scales, copies[i], None, x.dtype)

    return f"{fused:.1f}", f"{time_us(norm_then_gemm, len(copies)):.1f}"


def _scaled_mm(q: torch.Tensor, x_scales: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """cuBLASLt's FP8 product with a scale per token and per output channel."""
    return torch._scaled_mm(q, weight.data.t(), scale_a=x_scales, scale_b=weight.scale.view(1, -1),
                            out_dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
