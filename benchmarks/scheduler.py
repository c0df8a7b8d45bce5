"""Cost of the pure core per sequence per decode step (no GPU, no model), side by side with a
mutable scheduler on the same workload in the same run.

Usage: python benchmarks/scheduler.py [--num-seqs 256] [--steps 200] [--pipelined] [--churn]
       [--phases]

Steady (default): N requests with 512-token prompts; every prefill finishes, then decode steps
are timed (deliver the sampled tokens, finish checks, scheduling, plan building). Prefills take
8 steps of 32, so the sequences cross block boundaries in 8 groups.
``--churn``: about 10 % of the sequences have something happen each step: prompts of
512 + i % 16 tokens spread the block crossings evenly (1 in 16 each step), and every request
asks for 10 to 41 tokens, so about 4 % finish each step and as many new ones (64-token prompts)
arrive and are admitted.
The new requests are built before the clock starts (``NewSeq`` with its validated
``SamplingParams`` for the core, ``Sequence`` for the yardstick): that is the front end's work,
done on the caller's thread; taking them in (``step``'s checks, hashing, queueing) is timed.
``--pipelined`` delivers tokens one plan late, as the engine's async scheduling does. The
garbage collector is set as ``LLM.generate`` sets it. Prints microseconds per sequence per step
(median and best of the timed steps) for the core and for ``mutable_scheduler.py``, nano-vllm's
design written for this benchmark. ``--phases`` also prints the core's mean time per step in
each of its phases (wrapped one by one, so the sum exceeds the step a little).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import random
import time
from collections.abc import Iterator

import numpy as np

from mutable_scheduler import Scheduler, Sequence
from nanofn.state import Events, NewSeq, SamplingParams, SchedulerConfig, initial_state, step

EOS = 0


class Workload:
    """The requests: the first ``num_seqs`` at once, then, with churn, one new request for
    each that finishes."""

    def __init__(self, num_seqs: int, churn: bool):
        self.rng = random.Random(0)
        self.churn = churn
        self.count = 0
        self.first = [self.request(512 + (i % 16 if churn else 0)) for i in range(num_seqs)]

    def request(self, prompt_len: int) -> tuple[str, list[int], int]:
        i = self.count
        self.count += 1
        max_tokens = self.rng.randint(10, 41) if self.churn else 2000
        return f"r{i}", [(i * 7919 + j) % 30000 + 1 for j in range(prompt_len)], max_tokens

    def arrivals(self, num_finished: int) -> list[tuple[str, list[int], int]]:
        return [self.request(64) for _ in range(num_finished)] if self.churn else []


def time_core(a, timed_steps: int, phases: dict[str, float] | None = None) -> list[float]:
    """Step times after the warm-up; with ``phases``, the time of each phase of the core adds up
    there over the same steps (``timed_phases``)."""
    workload = Workload(a.num_seqs, a.churn)
    config = SchedulerConfig(block_size=16, max_num_seqs=a.num_seqs, max_num_batched_tokens=16384,
                             max_model_len=4096, enable_prefix_caching=True,
                             enable_chunked_prefill=True, eos_token_ids=(EOS,), vocab_size=None)
    lag = 1 if a.pipelined else 0

    def new_seqs(requests):
        return tuple(NewSeq(rid, tuple(prompt), SamplingParams(max_tokens=m, ignore_eos=True))
                     for rid, prompt, m in requests)

    state = initial_state(config, a.num_seqs * 72 + 64)
    state, plan = step(state, Events(new_seqs=new_seqs(workload.first)))
    while plan.num_prefill_tokens > (64 * a.num_seqs if a.churn else 0):  # warm up
        state, plan = _core_step(state, lag, [])
    times = []
    with timed_phases(phases) if phases is not None else contextlib.nullcontext():
        for k in range(timed_steps + 20):
            news = new_seqs(workload.arrivals(len(state.finished)))
            start = time.perf_counter()
            state, plan = _core_step(state, lag, news, k % 1000 + 2)
            times.append(time.perf_counter() - start)
    return times[20:]


# The core's phases (module, function): the plain decode step's shortcut (its checks too, where
# it does not apply), a step's three parts, then the parts of ``schedule``.
PHASES = (("step", "decode_step"), ("step", "apply_sampled"), ("step", "finish_rows"),
          ("step", "add_seqs"),
          ("step", "schedule"), ("scheduler", "admit"), ("scheduler", "hash_pending_blocks"),
          ("scheduler", "_append_admitted"), ("scheduler", "_write_new_blocks"),
          ("scheduler", "_plan"))


@contextlib.contextmanager
def timed_phases(totals: dict[str, float]) -> Iterator[None]:
    """Wrap each of ``PHASES`` so that its time adds up in ``totals`` (seconds), then unwrap."""
    originals = []
    for module_name, name in PHASES:
        module = importlib.import_module(f"nanofn.state.{module_name}")
        function = getattr(module, name)

        @functools.wraps(function)
        def wrapper(*args, _function=function, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.perf_counter() - start

        originals.append((module, name, function))
        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for module, name, function in originals:
            setattr(module, name, function)


def _core_step(state, lag, news, token=1):
    sampled = (np.full(len(state.undelivered[0]), token) if len(state.undelivered) > lag
               else None)
    return step(state, Events(sampled=sampled, new_seqs=tuple(news)))


def time_mutable(a, timed_steps: int) -> list[float]:
    workload = Workload(a.num_seqs, a.churn)
    scheduler = Scheduler(a.num_seqs * 72 + 64, 16, a.num_seqs, EOS)
    for rid, prompt, m in workload.first:
        scheduler.add(Sequence(rid, prompt, m))
    scheduled = scheduler.schedule()
    finished: list = []
    times = []
    for k in range(timed_steps + 20):
        arrivals = [Sequence(rid, prompt, m) for rid, prompt, m in workload.arrivals(len(finished))]
        start = time.perf_counter()
        for seq in arrivals:
            scheduler.add(seq)
        finished = scheduler.postprocess(scheduled, [k % 1000 + 2] * len(scheduled))
        scheduled = scheduler.schedule()
        times.append(time.perf_counter() - start)
    return times[20:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--churn", action="store_true")
    ap.add_argument("--phases", action="store_true", help="the core's time by phase")
    a = ap.parse_args()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])  # as LLM.generate does
    mode = ("churn" if a.churn else "steady") + (", pipelined" if a.pipelined else "")
    for name, timer in (("nanofn core", time_core), ("mutable yardstick", time_mutable)):
        times = sorted(timer(a, a.steps))
        median, best = times[len(times) // 2], times[0]
        print(f"{name:>18}: {a.num_seqs} seqs, {a.steps} decode steps ({mode}): "
              f"{median * 1e3:.3f} ms/step; {median / a.num_seqs * 1e6:.2f} us per seq per step "
              f"(best {best / a.num_seqs * 1e6:.2f})")
    if a.phases:
        totals: dict[str, float] = {}
        steps = len(time_core(a, a.steps, totals)) + 20
        print("core phases, mean us per step: " + ", ".join(
            f"{name} {seconds / steps * 1e6:.0f}" for name, seconds in totals.items()))


if __name__ == "__main__":
    main()
