"""Time a batch of prompts on a CPU with several torch thread counts (the `cpu_threads` option).

Each thread count runs in a fresh process (torch's thread pool is per process), rounds
alternate between the counts so that a change in the machine's load hits them alike, and each
process times several `generate` calls after a warm-up. Prints every time, then the median and
range per thread count. 0 stands for torch's default (one thread per core).

    python benchmarks/experiments/cpu_threads.py           # the demo model, 32 prompts
    python benchmarks/experiments/cpu_threads.py --model PATH --threads 1 4 16 --max-model-len 512
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def time_batches(model: str, threads: int, num_prompts: int, max_tokens: int, repeats: int,
                 max_model_len: int | None) -> list[float]:
    import torch

    from nanofn import LLM, SamplingParams

    options = {"cpu_threads": threads or torch.get_num_threads(), "device": "cpu"}
    if max_model_len:
        options["max_model_len"] = max_model_len
    llm = LLM(model, **options)
    prompts = [f"Prompt number {i}: the capital of France is" for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model folder (default: the built-in demo model)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0],
                   help="thread counts to compare; 0: torch's default (default: 1 2 0)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed batches per process")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one process's thread count
    args = p.parse_args()
    if args.model is None:
        from nanofn import demo_model
        args.model = str(demo_model())
    if args.child is not None:
        times = time_batches(args.model, args.child, args.num_prompts, args.max_tokens,
                             args.repeats, args.max_model_len)
        print(" ".join(f"{t:.4f}" for t in times))
        return
    results: dict[int, list[float]] = {t: [] for t in args.threads}
    child_args = [f"--{name}={getattr(args, name.replace('-', '_'))}"
                  for name in ("model", "repeats", "num-prompts", "max-tokens")]
    if args.max_model_len:
        child_args.append(f"--max-model-len={args.max_model_len}")
    for round_ in range(args.rounds):
        for threads in args.threads:
            out = subprocess.run([sys.executable, __file__, *child_args, f"--child={threads}"],
                                 capture_output=True, text=True, check=True).stdout
            times = [float(t) for t in out.split()]
            results[threads] += times
            print(f"round {round_ + 1}, threads {threads or 'default'}: "
                  + " ".join(f"{t:.3f}" for t in times), flush=True)
    print(f"{args.num_prompts} prompts x {args.max_tokens} new tokens, {args.model}:")
    for threads, times in results.items():
        print(f"  threads {threads or 'default'}: median {statistics.median(times):.3f} s "
              f"(from {min(times):.3f} to {max(times):.3f} s, {len(times)} batches)")


if __name__ == "__main__":
    main()
