"""What a kernel boundary costs against a grid-wide barrier inside one persistent kernel: the
number that decides whether a decode layer at one sequence (seven kernels in a dependency
chain, ~4 us each of fixed cost) is worth writing as one kernel with barriers between its
stages. A measurement for issue 9's single request, not a feature.

Times, from CUDA graphs, per step: (a) a chain of empty kernels of one program per SM, each
launched overlapped with the one ahead (``triton_overlap``) or not; (b) one kernel of one
program per SM crossing that many grid barriers (an arrival counter, then a spin until every
program has arrived).

Usage (GPU): python3 benchmarks/experiments/grid_barrier.py [--steps 200]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

from nanofn.kernels import triton_overlap
from nanofn.kernels.device import num_sms
from nanofn.kernels.triton_overlap import wait_for_previous


@triton.jit
def _empty_kernel(OVERLAP: tl.constexpr):
    wait_for_previous(OVERLAP)


@triton.jit
def _barriers_kernel(counter_ptr, rounds):
    """``rounds`` grid barriers: each program arrives (a release), then spins (acquiring)
    until all ``num_programs`` have arrived in this round."""
    for r in range(rounds):
        tl.atomic_add(counter_ptr, 1, sem="release")
        target = (r + 1) * tl.num_programs(0)
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


def graph_us_per_step(run, steps: int) -> float:
    """Median device microseconds a step of ``run`` (``steps`` of them), replayed from a graph."""
    return triton.testing.do_bench_cudagraph(run, return_mode="median") * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    device = torch.device("cuda")
    programs = num_sms(device, elsewhere=132)
    for overlap in (False, True):
        options = triton_overlap.launch_options(device) if overlap else {"OVERLAP": False}

        def chain(options=options):
            for _ in range(a.steps):
                _empty_kernel[(programs,)](**options)

        label = "overlapped" if overlap else "one after another"
        print(f"empty kernels of {programs} programs, {label}: "
              f"{graph_us_per_step(chain, a.steps):.2f} us a kernel")
    counter = torch.zeros(1, dtype=torch.int32, device=device)

    def barriers():
        counter.zero_()
        _barriers_kernel[(programs,)](counter, a.steps)

    print(f"grid barriers in one kernel of {programs} programs: "
          f"{graph_us_per_step(barriers, a.steps):.2f} us a barrier")


if __name__ == "__main__":
    main()
