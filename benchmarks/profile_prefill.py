"""Device time of one full prefill step of the standard workload's size, by kernel: 29 prompts
of 560 tokens (16,240 tokens, about what a step of the workload's prefill holds), one new token
each, after a warm-up step of the same shape.

Usage: python benchmarks/profile_prefill.py (MODEL | --random-weights qwen3-0.6b) [--prompts 29]
       [--prompt-len 560] [--no-overlap]
Prints the step's wall time and torch.profiler's kernel table (device time, by kernel).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nanofn import LLM, SamplingParams
from nanofn.cli import random_weights_model

from kernel_switches import launches_in_sequence  # (benchmarks/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--random-weights")
    ap.add_argument("--prompts", type=int, default=29)
    ap.add_argument("--prompt-len", type=int, default=560)
    ap.add_argument("--no-overlap", action="store_true",
                    help="kernels launched one after another (programmatic dependent launch off)")
    args = ap.parse_args()
    if args.no_overlap:
        launches_in_sequence()
    llm = LLM(str(args.model or random_weights_model(args.random_weights)), max_model_len=4096)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(10000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    llm.generate(prompts(), params, use_tqdm=False)  # warm up at this shape
    batch = prompts()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    torch.cuda.synchronize()
    print(f"{args.prompts} x {args.prompt_len} tokens: {(time.perf_counter() - start) * 1e3:.1f} ms "
          f"for the generate (one prefill step)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(), params, use_tqdm=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))


if __name__ == "__main__":
    main()
