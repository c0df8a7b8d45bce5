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

from kernel_switches import add_model_and_switches, model_with_switches  # (benchmarks/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_and_switches(ap)
    ap.add_argument("--prompts", type=int, default=29)
    ap.add_argument("--prompt-len", type=int, default=560)
    args = ap.parse_args()
    llm = LLM(model_with_switches(args), max_model_len=4096)
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
