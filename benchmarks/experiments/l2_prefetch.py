"""Would the MLP's and o_proj's weights, prefetched into L2 while a layer's attention runs, make
the batch-1 GEMVs faster? A measurement for issue 9's single request, not a feature.

At one sequence the attention phase of a layer (rotary, attention, merge: ~10 us) reads a few
hundred KB, so HBM idles while it runs; the GEMVs after it then read 23 MB (o_proj, gate_up,
down of Qwen3-0.6B) from HBM at 1.5-2 TB/s, latency-bound at these sizes. This times, from a CUDA
graph, one "layer tail" per repetition, each on fresh copies of the weights (so none starts in
L2): a spin of ``--attention-us`` on the main stream standing for the attention phase, then the
three GEMVs, (A) as is, (B) with a side stream prefetching the three weights into L2 from the
start of the spin, (C) with the weights already in L2 (the same copy every time: the bound).

Usage (GPU): python3 benchmarks/experiments/l2_prefetch.py [--attention-us 10]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

from nanofn.kernels import triton_gemv

HIDDEN, INTERMEDIATE = 1024, 3072
LINE_ELEMENTS = 64  # bf16 elements in a 128-byte line
LINES_PER_PROGRAM = 1024


@triton.jit
def prefetch_to_l2(pointers):
    """Ask L2 for the 128-byte line at each of ``pointers`` (a hint: nothing waits for it)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pointers],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(ptr, num_lines, LINE: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for ``LINES`` 128-byte lines of ``ptr`` from this program's first one on."""
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    lines = tl.minimum(lines, num_lines - 1)  # (a repeated last line instead of a mask)
    prefetch_to_l2(ptr + lines.to(tl.int64) * LINE)


def prefetch(weight: torch.Tensor) -> None:
    lines = triton.cdiv(weight.numel(), LINE_ELEMENTS)
    _prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](
        weight, lines, LINE=LINE_ELEMENTS, LINES=LINES_PER_PROGRAM, num_warps=4)


def spin_cycles(us: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that take about ``us`` microseconds (timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # (warm)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return int(us * 1_000_000 / (start.elapsed_time(end) * 1e3))


def time_tails(mode: str, reps: int, attention_us: float) -> float:
    """Median microseconds per layer tail (spin + three GEMVs) over ``reps`` tails a replay."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def weights(n, k):
        copies = 1 if mode == "warm" else reps
        return [torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.03
                for _ in range(copies)]

    o, gate_up, down = weights(HIDDEN, 2048), weights(2 * INTERMEDIATE, HIDDEN), \
        weights(HIDDEN, INTERMEDIATE)
    attn = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    norm = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    cycles = spin_cycles(attention_us)

    def tails():
        for i in range(reps):
            j = 0 if mode == "warm" else i
            if mode == "prefetch":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for w in (o[j], gate_up[j], down[j]):
                        prefetch(w)
            torch.cuda._sleep(cycles)
            hidden = triton_gemv.gemv(attn, o[j])
            activated, _ = triton_gemv.rms_norm_gemv(hidden, norm, 1e-6, None, gate_up[j], gated=True)
            triton_gemv.gemv(activated, down[j])
            if mode == "prefetch":
                torch.cuda.current_stream().wait_stream(side)

    return triton.testing.do_bench_cudagraph(tails, return_mode="median") * 1e3 / reps


def time_prefetch_alone(megabytes: int = 23) -> float:
    w = torch.empty(megabytes << 19, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    times = []
    for _ in range(20):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        prefetch(w)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention-us", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    spin = time_tails("cold", a.reps, 0.0)
    print(f"three GEMVs (o_proj, gate_up, down), weights from HBM, no spin: {spin:.1f} us")
    for mode in ("cold", "prefetch", "warm"):
        print(f"{mode:>8}: spin {a.attention_us:.0f} us + three GEMVs: "
              f"{time_tails(mode, a.reps, a.attention_us):.1f} us per layer tail")
    print(f"prefetching 23 MB alone (a kernel of its own): {time_prefetch_alone():.1f} us")


if __name__ == "__main__":
    main()
