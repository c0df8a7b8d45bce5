"""Host time of the engine's step loop without a device: the runner is replaced by one that
returns tokens at once, so the figure is the scheduler, the plan, the shell's bookkeeping and
detokenization per step, at a given number of running sequences.

Usage: python benchmarks/host_overhead.py [MODEL] [--num-seqs 256] [--steps 200]
(default MODEL: a tiny random checkpoint built in a temporary folder).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from nanofn import SamplingParams
from nanofn.engine.engine import Engine
from nanofn.engine.options import EngineOptions
from nanofn.engine.collector import fewer_gc_pauses
from nanofn.state import SampleOutput
from nanofn.model.tiny import make_tiny_checkpoint


class InstantRunner:
    """Samples a random token for every sequence that asks, with no model."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.rng = random.Random(0)

    def launch(self, plan):
        tokens = [self.rng.randrange(self.vocab_size) for _ in plan.sampling_seq_ids]
        return _Done(SampleOutput(tokens, [None] * len(tokens)))


class _Done:
    def __init__(self, output: SampleOutput):
        self.output = output

    def wait(self) -> SampleOutput:
        return self.output

    def done(self) -> bool:
        return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    model = a.model or make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3")
    engine = Engine(EngineOptions(model=str(model), max_model_len=1024,
                                  num_kv_blocks=a.num_seqs * 64, max_num_seqs=a.num_seqs))
    engine.loop.runner = InstantRunner(engine.text_config.vocab_size)
    params = SamplingParams(max_tokens=a.steps + 40, ignore_eos=True)
    rng = random.Random(1)
    for _ in range(a.num_seqs):
        engine.add_request([rng.randrange(300) for _ in range(500)], params, stream=False)
    with fewer_gc_pauses():
        for _ in range(20):  # prefill
            engine.step(only_finished=True)
        times = []
        for _ in range(a.steps):
            start = time.perf_counter()
            engine.step(only_finished=True)
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    print(f"{a.num_seqs} running sequences: host {median * 1e3:.2f} ms per step "
          f"({median / a.num_seqs * 1e6:.1f} us per sequence; best step {times[0] * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
