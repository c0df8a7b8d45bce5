"""Prefill attention alone, in each tile size and as the engine tiles it: one prompt of 512-4,096
tokens, a few, and steps the size of the standard workload's (16k tokens), bf16, Qwen3-0.6B's
heads (16 over 8 kv heads, head_dim 128), block size 16.

Usage: python benchmarks/experiments/prefill_tiles.py
Prints the median device time of each variant (``triton.testing.do_bench``; the kernel launched
from Python, so a few microseconds of launch are in the small shapes' figures): the engine's
choice (``triton_attention.prefill_block_m``), 128-row tiles, 128-row tiles without the register
cap (one program an SM), and 64-row tiles.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import triton.testing

from nanofn.kernels import triton_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
from test_triton_attention_gpu import causal_flops, whole_prompts  # noqa: E402


def shapes() -> dict[str, tuple[int, ...]]:
    rng = random.Random(0)
    workload = []
    while sum(workload) < 16_000:
        workload.append(rng.randint(100, 1024))
    return {"1 x 512": (512,), "1 x 1024": (1024,), "1 x 2048": (2048,), "1 x 4096": (4096,),
            "2 x 1024": (1024,) * 2, "4 x 1024": (1024,) * 4, "8 x 512": (512,) * 8,
            f"{len(workload)} prompts of U(100, 1024)": tuple(workload), "29 x 560": (560,) * 29}


@contextmanager
def tiles(variant: str):
    """Force a tile size through the SM count the choice sees (many: 64 rows; one: 128)."""
    if variant == "engine":
        yield
        return
    sms = 100_000 if variant == "64 rows" else 1
    cap = None if variant == "128 rows, uncapped" else triton_attention.PREFILL_MAX_REGISTERS
    with mock.patch.object(triton_attention, "prefill_sms", lambda device: sms), \
            mock.patch.object(triton_attention, "PREFILL_MAX_REGISTERS", cap):
        yield


def main() -> None:
    variants = ("engine", "128 rows", "128 rows, uncapped", "64 rows")
    print(f"{'shape':>28} " + " ".join(f"{v:>19}" for v in variants) + "   (us; TFLOP/s of the engine's)")
    for round, (name, lens) in enumerate([next(iter(shapes().items())), *shapes().items()]):
        args = whole_prompts(lens, seed=3)
        flops = causal_flops(lens)
        times = []
        for variant in variants:
            with tiles(variant):
                ms = triton.testing.do_bench(lambda: triton_attention.prefill_attention(*args),
                                             return_mode="median")
            times.append(ms * 1e3)
        if round > 0:  # (round 0 compiles every variant and warms the GPU up, unprinted)
            print(f"{name:>28} " + " ".join(f"{t:19.1f}" for t in times)
                  + f"   {flops / times[0] / 1e6:.0f}")


if __name__ == "__main__":
    main()
