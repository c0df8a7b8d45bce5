"""Where the time to first token goes on the host: a timeline of one-token generates of
512-token prompts, each part's start (<) and end (>) in microseconds from the generate's
start (medians), and one summary line.

Usage: python benchmarks/ttft_timeline.py (MODEL | --random-weights qwen3-0.6b) [--instant]
(default MODEL: a tiny random checkpoint). ``--instant``: the runner returns tokens at once
(``host_overhead.InstantRunner``), so the figures are the engine's host work alone.

The parts: the engine steps (``estep``; three a generate: admission and launch, a step with
nothing to compute while the device runs, the delivery that finishes the request), the pure
core's step inside each (``core``), the runner's launch, the prefill graph's input fill and its
replay (when the device starts), the LM head, the sampler and the wait for the token. The
critical path is the host work before the replay, the device, and the host work after the wait.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kernel_switches import (add_model_and_switches, load_options,  # (benchmarks/)
                             model_with_switches)
from nanofn import LLM, SamplingParams
from nanofn.model.tiny import make_tiny_checkpoint

PROMPT_LEN, WARMUP, TIMED = 512, 20, 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_and_switches(ap)
    ap.add_argument("--instant", action="store_true", help="no model: tokens come back at once")
    args = ap.parse_args()
    if args.model or args.random_weights:
        llm = LLM(model_with_switches(args), max_model_len=4096, **load_options(args))
    else:
        import tempfile
        llm = LLM(str(make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3")))
    if args.instant:
        from host_overhead import InstantRunner
        llm.engine.loop.runner = InstantRunner(llm.engine.text_config.vocab_size)
    marks: list[tuple[str, float]] = []
    _mark_parts(llm, marks)
    vocab = min(10000, llm.engine.text_config.vocab_size)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    runs = []
    for k in range(WARMUP + TIMED):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        marks.clear()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        end = time.perf_counter()
        if k >= WARMUP:
            runs.append(_named(marks, start) | {"end": (end - start) * 1e6})
    median = {name: statistics.median(r[name] for r in runs if name in r) for name in runs[0]}
    for name in sorted(median, key=median.get):
        print(f"{name:10s} {median[name]:8.0f}")
    core = [(median[f"core<{q}"], median[f"core>{q}"]) for q in ("", "'", "''")]
    device = (f"replay {median['replay<']:.0f}, wait ends {median['wait>']:.0f}, "
              if "replay<" in median else "")
    print(f"first token in {median['end']:.0f} us: core steps "
          f"{' / '.join(f'{b - a:.0f}' for a, b in core)} us; {device}"
          f"the last core step ends at {core[2][1]:.0f}")


def _mark_parts(llm: LLM, marks: list) -> None:
    """Wrap each part so that it notes its start and end in ``marks``."""
    import nanofn.engine.loop as loop

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            marks.append((label + "<", time.perf_counter()))
            try:
                return inner(*args, **kwargs)
            finally:
                marks.append((label + ">", time.perf_counter()))
        setattr(owner, name, timed)

    runner = llm.engine.loop.runner
    wrap(loop, "step", "core")
    wrap(llm.engine, "step", "estep")
    wrap(runner, "launch", "launch")
    if getattr(runner, "prefill_graphs", None) is not None:
        import torch

        from nanofn.runner import prefill_graphs, sampler
        wrap(prefill_graphs, "fill_prefill_inputs", "fill")
        wrap(torch.cuda.CUDAGraph, "replay", "replay")
        wrap(runner.model, "compute_logits", "logits")
        wrap(runner.sampler, "sample", "sample")
        wrap(sampler.DeviceSample, "wait", "wait")


def _named(marks: list[tuple[str, float]], start: float) -> dict[str, float]:
    """The marks by label, a label seen again taking a prime (core<, core<', core<'')."""
    named: dict[str, float] = {}
    for label, t in marks:
        while label in named:
            label += "'"
        named[label] = (t - start) * 1e6
    return named


if __name__ == "__main__":
    main()
