"""Where a decode step's time goes: cProfile of the host side and torch.profiler of the GPU.

Usage: python benchmarks/profile_decode.py (MODEL | --random-weights qwen3-0.6b) [--batch N]
Runs N requests of 512-token prompts (``--prompt-len``) into steady decode, then profiles 50
engine steps.

``--one-rank-of T`` profiles one tensor-parallel rank's share of the model (attention heads,
KV heads, MLP width and vocabulary divided by T) on one GPU: a rank's kernels as a TP=T step
runs them, without the all-reduces, so that a TP=T step's time less this one's is what the
sums over the ranks (and the ranks waiting for each other) cost.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from nanofn import LLM, SamplingParams
from nanofn.engine.collector import fewer_gc_pauses

from kernel_switches import (add_model_and_switches, llm_options, load_options,  # (benchmarks/)
                             model_with_switches)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_and_switches(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--one-rank-of", type=int, metavar="T",
                    help="the model cut to one tensor-parallel rank's share of T (see above)")
    ap.add_argument("--host-only", action="store_true",
                    help="skip the device profile; list the host's functions by own time")
    ap.add_argument("--timeline", action="store_true",
                    help="also each kernel's share of the device's critical path (see below)")
    args, extra = ap.parse_known_args()  # and LLM options as --key=value
    model = model_with_switches(args)
    if args.one_rank_of:
        model = one_rank_share(model, args.one_rank_of)
    llm = LLM(model, max_model_len=4096, **llm_options(extra),
              **load_options(args))
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=1000, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(10000) for _ in range(args.prompt_len)], params,
                           stream=False)
    with fewer_gc_pauses():  # as LLM.generate runs its steps
        _profile(engine, args)


def one_rank_share(model: str, tp_size: int) -> str:
    """A copy of ``model``'s folder (config and tokenizer; run with dummy weights) whose config
    has what one rank of ``tp_size`` holds of the split dimensions."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix=f"one-rank-of-{tp_size}-"))
    for f in Path(model).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)  # (a vision-language config's language model)
    text.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    for key in SPLIT_ACROSS_RANKS:
        if key in text:
            text[key] = -(-text[key] // tp_size)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# What tensor parallelism splits (the experts' widths, and a hybrid's linear-attention heads
# too), so a rank holds its share of each (at least one: KV heads fewer than the ranks are
# replicated)
SPLIT_ACROSS_RANKS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                      "moe_intermediate_size", "shared_expert_intermediate_size",
                      "linear_num_key_heads", "linear_num_value_heads", "vocab_size")


def _profile(engine, args) -> None:
    for _ in range(20):  # prefill and warm up
        engine.step(only_finished=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step(only_finished=True)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"batch {args.batch}: {per_step * 1e3:.2f} ms per decode step")
    phases = _time_phases(engine, args.steps)
    print("  " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in phases.items()))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step(only_finished=True)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime" if args.host_only else "cumulative").print_stats(25)
    if args.host_only:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step(only_finished=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    if args.timeline:
        _print_critical_path(prof, steps=10)


def _print_critical_path(prof, steps: int) -> None:
    """Per kernel (name and grid), how much later the device's last finished kernel ends
    because of it: kernels in launch order, each adds ``max(0, its end - the latest end
    before it)``. With overlapped launches a kernel's own duration includes its wait for the
    kernel ahead; this increment does not, so it is the kernel's share of the step."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    share = critical_path_shares(events)
    print(f"{'kernel (grid)':<60} {'calls/step':>10} {'us/call':>8} {'critical us/step':>17}")
    for key, (calls, duration, increment) in sorted(share.items(), key=lambda kv: -kv[1][2]):
        print(f"{key:<60} {calls / steps:>10.1f} {duration / calls:>8.2f} {increment / steps:>17.1f}")
    print(f"critical path {sum(v[2] for v in share.values()) / steps:.1f} us a step")


def critical_path_shares(events: list[dict]) -> dict[str, list[float]]:
    """``{name and grid: [calls, total duration, total increment]}`` of a chrome trace's kernels
    (microseconds). Idle time between kernels is nobody's increment."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    latest_end = 0.0
    share: dict[str, list[float]] = {}
    for event in kernels:
        end = event["ts"] + event["dur"]
        key = f"{event['name'][:40]} {tuple(event.get('args', {}).get('grid', ()))}"
        totals = share.setdefault(key, [0, 0.0, 0.0])
        totals[0] += 1
        totals[1] += event["dur"]
        totals[2] += max(0.0, end - max(latest_end, event["ts"]))
        latest_end = max(latest_end, end)
    return share


def _time_phases(engine, steps: int) -> dict[str, float]:
    """Wall time per step of each phase, by wrapping the functions that make it up. 'launch' is
    host work (inputs, kernel launches, sampler); 'wait for tokens' is the device time the host
    could not hide."""
    import nanofn.engine.loop as loop_module
    loop = engine.loop
    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    originals = (loop_module.step, loop.runner, loop._wait_for_tokens, engine._take_delivery)
    loop_module.step = timed("core step", loop_module.step)
    loop.runner = _TimedRunner(loop.runner, timed("launch", loop.runner.launch))
    loop._wait_for_tokens = timed("wait for tokens", loop._wait_for_tokens)
    engine._take_delivery = timed("detokenize", lambda d: tuple(originals[3](d)))
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(only_finished=True)
    totals["whole step"] = time.perf_counter() - start
    loop_module.step, loop.runner, loop._wait_for_tokens, engine._take_delivery = originals
    return {name: seconds / steps * 1e3 for name, seconds in totals.items()}


class _TimedRunner:
    def __init__(self, runner, launch):
        self.runner, self.launch = runner, launch


if __name__ == "__main__":
    main()
