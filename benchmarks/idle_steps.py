"""Which host work makes the device wait: the standard workload with a timestamp at each
phase of each step, set against the device's step intervals.

Usage: python benchmarks/idle_steps.py [--random-weights qwen3-0.6b] [--max-model-len 4096]

With async scheduling the device runs plan k while the host takes plan k-1's tokens, steps the
core and launches plan k+1; the device idles before plan k+1 when that host work outlasts plan
k. For each launch after which the device waited more than 0.1 ms, the host time since the
previous launch is split into: the previous step's work between its launch and its wait (texts
decoded while the device computes), that wait, the rest of the previous engine step (finishing
requests, outputs), the caller between steps, the loop's delivery handling, the core step, and
the launch; also the garbage collections in that time. Printed per kind of step: launches,
those with idle, the idle, the mean of each phase over the idle launches, and the first few.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

from nanofn import LLM
from nanofn.cli.bench import standard_workload
from nanofn.model.tiny import random_weights_model
from nanofn.runner.sampler import DeviceSample
from nanofn.runner.timeline import DeviceTimeline
import nanofn.engine.loop as loop_module

PHASES = ("previous step after its launch", "wait", "rest of previous step", "between steps",
          "delivery", "core step", "launch", "gc in those")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-weights", default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args()
    llm = LLM(str(random_weights_model(a.random_weights)), max_model_len=a.max_model_len,
              load_format="dummy")
    workload = standard_workload(vocab_size=llm.engine.text_config.vocab_size)
    llm.generate(workload.prompts[:64], workload.sampling_params()[:64], use_tqdm=False)  # warm up

    marks: list[dict[str, float]] = []  # per engine step
    now = time.perf_counter
    engine, runner = llm.engine, llm.engine.runner
    engine_step, core_step, launch, wait = engine.step, loop_module.step, runner.launch, \
        DeviceSample.wait

    def timed_engine_step(*args, **kwargs):
        marks.append({"begin": now()})
        try:
            return engine_step(*args, **kwargs)
        finally:
            marks[-1]["end"] = now()

    def timed_core_step(*args):
        marks[-1]["core begin"] = now()
        try:
            return core_step(*args)
        finally:
            marks[-1]["core end"] = now()

    def timed_launch(plan):
        marks[-1]["launch begin"] = now()
        try:
            return launch(plan)
        finally:
            marks[-1]["launch end"] = now()

    def timed_wait(self):
        marks[-1]["wait begin"] = now()
        try:
            return wait(self)
        finally:
            marks[-1]["waited"] = now()

    collections: list[tuple[float, float]] = []  # (start, end) of each garbage collection

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append((now(), 0.0))
        else:
            collections[-1] = (collections[-1][0], now())

    gc.callbacks.append(on_gc)
    engine.step, runner.launch, DeviceSample.wait = timed_engine_step, timed_launch, timed_wait
    loop_module.step = timed_core_step
    timeline = DeviceTimeline()
    runner.timeline = timeline
    llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
    runner.timeline = None
    gc.callbacks.remove(on_gc)
    report(marks, timeline, collections)


def report(marks: list[dict[str, float]], timeline: DeviceTimeline,
           collections: list[tuple[float, float]]) -> None:
    launches = [m for m in marks if "launch begin" in m]
    intervals = timeline._intervals
    assert len(intervals) == len(launches), (len(intervals), len(launches))
    totals: dict[str, list] = defaultdict(lambda: [0, 0, 0.0] + [0.0] * len(PHASES))
    previous = None  # the engine step before, for its wait and end
    details: list[str] = []
    for k, m in enumerate(marks):
        if "launch begin" not in m:
            previous = m
            continue
        index = launches.index(m)
        label = intervals[index][2]
        entry = totals[label]
        entry[0] += 1
        if index and previous is not None and {"waited", "launch end"} <= previous.keys():
            idle = intervals[index - 1][1].elapsed_time(intervals[index][0]) / 1e3
            if idle > 1e-4:
                entry[1] += 1
                entry[2] += idle
                in_gc = sum(min(end, m["launch end"]) - max(begin, previous["launch end"])
                            for begin, end in collections
                            if end > previous["launch end"] and begin < m["launch end"])
                phases = (previous["wait begin"] - previous["launch end"],
                          previous["waited"] - previous["wait begin"],
                          previous["end"] - previous["waited"], m["begin"] - previous["end"],
                          m["core begin"] - m["begin"], m["core end"] - m["core begin"],
                          m["launch end"] - m["core end"], in_gc)
                if len(details) < 12:
                    details.append(f"  launch {index} ({label}): idle {idle * 1e3:.2f} ms; "
                                   + ", ".join(f"{p * 1e3:.2f}" for p in phases))
                for j, seconds in enumerate(phases):
                    entry[3 + j] += seconds
        previous = m
    print(f"{'kind':>14} {'launches':>8} {'idle ones':>9} {'idle s':>7} | mean ms over the "
          f"idle ones: " + ", ".join(PHASES))
    for label, (count, idle_count, idle, *phases) in sorted(totals.items()):
        means = ", ".join(f"{p / max(idle_count, 1) * 1e3:.2f}" for p in phases)
        print(f"{label:>14} {count:>8} {idle_count:>9} {idle:>7.3f} | {means}")
    print(f"garbage collections in the run: {len(collections)}, "
          f"{sum(e - b for b, e in collections) * 1e3:.1f} ms")
    print("\n".join(details))


if __name__ == "__main__":
    main()
