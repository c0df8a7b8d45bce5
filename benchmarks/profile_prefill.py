"""Device time of one full prefill step of the standard workload's size, by kernel: 29 prompts
of 560 tokens (16,240 tokens, about what a step of the workload's prefill holds), one new token
each, after a warm-up step of the same shape.

Usage: python benchmarks/profile_prefill.py (MODEL | --random-weights qwen3-0.6b) [--prompts 29]
       [--prompt-len 560] [--no-overlap] [--gaps]
Prints the step's wall time and torch.profiler's kernel table (device time, by kernel); with
``--gaps``, where the device sat idle inside the step: the largest gaps between kernels, each
with the host calls that ran while it lasted (a synchronizing call shows up there).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from nanofn import LLM, SamplingParams

from kernel_switches import (add_model_and_switches, llm_options, load_options,  # (benchmarks/)
                             model_with_switches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_and_switches(ap)
    ap.add_argument("--prompts", type=int, default=29)
    ap.add_argument("--prompt-len", type=int, default=560)
    ap.add_argument("--gaps", action="store_true", help="list the device's idle gaps in the step")
    args, extra = ap.parse_known_args()  # and LLM options as --key=value
    llm = LLM(model_with_switches(args), max_model_len=4096, **llm_options(extra),
              **load_options(args))
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
    activities = [torch.profiler.ProfilerActivity.CUDA]
    if args.gaps:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts(), params, use_tqdm=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    if args.gaps:
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            prof.export_chrome_trace(trace.name)
            print_device_gaps(json.load(open(trace.name))["traceEvents"])


def print_device_gaps(events: list[dict], shown: int = 15) -> None:
    """The device's idle time between its first and last kernel, and its largest gaps with the
    host's runtime calls and operators that overlapped each (microseconds)."""
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op") and "dur" in e]
    gaps, busy_until = [], device[0]["ts"]
    for event in device:
        if event["ts"] > busy_until:
            gaps.append((event["ts"] - busy_until, busy_until, event["name"]))
        busy_until = max(busy_until, event["ts"] + event["dur"])
    span = busy_until - device[0]["ts"]
    idle = sum(gap for gap, _, _ in gaps)
    print(f"device span {span / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in {len(gaps)} gaps "
          f"({sum(1 for g in gaps if g[0] > 20)} over 20 us)")
    for gap, begin, next_kernel in sorted(gaps, reverse=True)[:shown]:
        during = sorted({e["name"][:40] for e in host
                         if e["ts"] < begin + gap and e["ts"] + e["dur"] > begin})
        print(f"  {gap:8.1f} us before {next_kernel[:40]}: {'; '.join(during)[:200]}")


if __name__ == "__main__":
    main()
