"""Tensor parallelism's all-reduce at decode sizes on two GPUs: NCCL against the sum through peer
memory (``nanofn/kernels/all_reduce.py``), each call's device time from a CUDA graph of 72
calls (a decode step of the Qwen3-8B shape holds two a layer, 36 layers; ``gemm_sweep.time_us``),
bf16 messages of ``rows x 4,096`` (the 8B's hidden size). Then what a layer's sum costs with the
norm after it (residual added): the peer all-reduce and the Triton norm kernel, against the norm
kernel that adds up the two ranks' summands itself (``RankSums``), and the norm alone.

Usage: python benchmarks/experiments/all_reduce.py [--rows 1,8,64,256,1024]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gemm_sweep import time_us  # (its folder)
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels.all_reduce import group_all_reduce, ranks_all_reduce

HIDDEN, CALLS_A_STEP = 4096, 72


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,256,1024")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(f"{folder}/store", [int(r) for r in args.rows.split(",")]),
                 nprocs=2, join=True)


def _rank(rank: int, store_file: str, rows: list[int]) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=2)
    peer = ranks_all_reduce(device, torch.bfloat16)
    if rank == 0:
        print(f"| rows | MB | NCCL us | peer memory us | {CALLS_A_STEP} calls saved (us) |")
        print("|---|---|---|---|---|")
    for n in rows:
        x = torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16)
        nccl, ours = (time_us(lambda _: all_reduce(x), CALLS_A_STEP // 2)
                      for all_reduce in (group_all_reduce, peer))
        if rank == 0:
            print(f"| {n} | {x.numel() * 2 / 1e6:.2f} | {nccl:.1f} | {ours:.1f} | "
                  f"{(nccl - ours) * CALLS_A_STEP:.0f} |")
    weight = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    if rank == 0:
        print("\n| rows | peer all-reduce + norm us | norm adding up the summands us | norm alone us |")
        print("|---|---|---|---|")
    for n in rows:
        x, residual = (torch.randn(n, HIDDEN, device=device, dtype=torch.bfloat16) for _ in "xr")
        separate, fused, alone = (time_us(lambda _: triton_ops.rms_norm(
            peer(x, for_norm=for_norm) if for_norm is not None else x, weight, 1e-6, residual),
            CALLS_A_STEP // 2) for for_norm in (False, True, None))
        if rank == 0:
            print(f"| {n} | {separate:.1f} | {fused:.1f} | {alone:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
