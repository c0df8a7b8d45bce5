"""The four decode projections of every layer in a chain, at 128-256 rows: cuBLAS against a
Triton GEMM launched one after another, overlapped with the kernel ahead (``triton_overlap``),
and overlapped with its weight slice prefetched into L2 before its wait. A measurement for
issue 9's standard workload (where these GEMMs take ~7 us each against ~2.5 us of bytes), not a
feature: it says whether a GEMM of our own, overlapped like the GEMVs, is worth writing.

Each layer: qkv (4096 x 1024), o (1024 x 2048, on the first 2048 qkv outputs), gate_up
(6144 x 1024), down (1024 x 3072, on the first 3072 gate_up outputs), its output the next
layer's input; 28 layers of distinct weights (882 MB, so every weight comes from HBM), replayed
from a CUDA graph. Prints microseconds per layer, the best of a few tile configurations each.

Also cuBLAS with one weight set for every layer (the weights in L2): what prefetching them
would gain at best.

Usage (GPU): python3 benchmarks/experiments/gemm_chain.py [--rows 256,128] [--cublas-only]
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from nanofn.kernels import triton_overlap
from nanofn.kernels.triton_overlap import wait_for_previous

from l2_prefetch import prefetch_to_l2  # (its folder)

LAYERS = 28
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
LINE = 64  # bf16 elements in a 128-byte line


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CONFIGS = [Tiles(128, 64, 64, 4, 3), Tiles(128, 32, 128, 4, 3), Tiles(256, 32, 64, 8, 3),
           Tiles(64, 64, 64, 4, 4), Tiles(128, 64, 128, 8, 3)]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, rows, n, k, stride_x, stride_w, stride_out,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LINES: tl.constexpr, PREFETCH: tl.constexpr, OVERLAP: tl.constexpr):
    """Program (output tile, row tile): ``out = x @ w.T`` over all of K. With ``PREFETCH`` it
    first asks L2 for its whole weight slice (``LINES`` 128-byte lines a row of it), then
    waits for the kernel ahead."""
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(outputs, n - 1)[:, None].to(tl.int64) * stride_w
    if PREFETCH:
        prefetch_to_l2(w_rows + tl.minimum(tl.arange(0, LINES), k // 64 - 1)[None, :] * 64)
    wait_for_previous(OVERLAP)
    columns = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        a = tl.load(x_ptr + m[:, None] * stride_x + start + columns[None, :],
                    mask=m[:, None] < rows, other=0.0)
        w = tl.load(w_rows + start + columns[None, :])
        acc = tl.dot(a, tl.trans(w), acc)
    mask = (m[:, None] < rows) & (outputs[None, :] < n)
    tl.store(out_ptr + m[:, None] * stride_out + outputs[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: Tiles, overlap: bool,
         prefetch: bool) -> torch.Tensor:
    rows, k = x.shape
    n = w.shape[0]
    options = triton_overlap.launch_options(x.device) if overlap else {"OVERLAP": False}
    _gemm_kernel[(triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m))](
        x, w, out, rows, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        LINES=triton.next_power_of_2(k // LINE), PREFETCH=prefetch,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **options)
    return out


def chain(x, weights, outs, project) -> torch.Tensor:
    """Every layer's four projections, each on its predecessor's output."""
    for layer in range(LAYERS):
        qkv, o, gate_up, down = weights[layer]
        q = project(x, qkv, outs[0])
        h = project(q[:, :2048], o, outs[1])
        g = project(h, gate_up, outs[2])
        x = project(g[:, :3072], down, outs[3])
    return x


def time_layer_us(run) -> float:
    """Median device microseconds a layer of ``run`` (all the layers), replayed from a graph."""
    return triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,128")
    ap.add_argument("--cublas-only", action="store_true", help="skip the Triton GEMMs")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [[torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * k**-0.5
                for _, n, k in SHAPES] for _ in range(LAYERS)]
    for rows in map(int, a.rows.split(",")):
        x = torch.randn(rows, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in SHAPES]
        inputs = [torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)
                  for _, _, k in SHAPES]
        cublas = time_layer_us(lambda: chain(x, weights, outs, lambda v, w, out: F.linear(v, w)))
        warm = time_layer_us(lambda: chain(x, [weights[0]] * LAYERS, outs,
                                           lambda v, w, out: F.linear(v, w)))
        print(f"{rows} rows: cuBLAS {cublas:.1f} us a layer (4 projections); {warm:.1f} us with "
              f"every layer's weights the same (in L2)")
        if a.cublas_only:
            continue
        for label, overlap, prefetch in (("Triton", False, False), ("Triton, overlapped", True, False),
                                         ("Triton, overlapped + L2 prefetch", True, True)):
            best = None
            for tiles in CONFIGS:
                try:
                    def project(v, w, out, tiles=tiles):
                        return gemm(v, w, out, tiles, overlap, prefetch)
                    for v, w, out in zip(inputs, weights[0], outs):  # each shape, once
                        torch.testing.assert_close(project(v, w, out).float(),
                                                   F.linear(v, w).float(), rtol=2e-2, atol=2e-2)
                    us = time_layer_us(lambda: chain(x, weights, outs, project))
                except Exception as error:  # out of resources, say
                    print(f"  {label} {tuple(tiles)}: {type(error).__name__}: {str(error)[:80]}")
                    continue
                if best is None or us < best[0]:
                    best = (us, tiles)
            if best:
                print(f"{rows} rows: {label} {best[0]:.1f} us a layer, tiles {tuple(best[1])}")


if __name__ == "__main__":
    main()
