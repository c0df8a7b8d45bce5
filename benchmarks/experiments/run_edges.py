"""Host time at the two ends of a run, without a device: from ``generate`` to the first launch
(requests taken in, the first plan) and from the last launch to ``generate``'s return
(finishing records, the texts left to decode). A tiny random model stands in, and the runner
answers each plan at once (``host_overhead.InstantRunner``), so every step's host work is on
the critical path, as at a run's ends on a GPU.

Usage: python benchmarks/experiments/run_edges.py [--workload shared-prefix|standard]
       [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for host_overhead
from host_overhead import InstantRunner  # noqa: E402

from nanofn import LLM
from nanofn.cli.bench import shared_prefix_workload, standard_workload
from nanofn.model.tiny import make_tiny_checkpoint


class _TimedRunner:
    def __init__(self, runner: InstantRunner):
        self.runner, self.launches = runner, []

    def launch(self, plan):
        self.launches.append(time.perf_counter())
        return self.runner.launch(plan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="shared-prefix", choices=["shared-prefix", "standard"])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = make_tiny_checkpoint(tempfile.mkdtemp(), "qwen3", max_position_embeddings=4096)
    llm = LLM(str(model), max_model_len=4096, num_kv_blocks=9600, max_num_seqs=256,
              enforce_eager=True)
    vocab = llm.engine.text_config.vocab_size
    make = shared_prefix_workload if args.workload == "shared-prefix" else standard_workload
    workload = make(vocab_size=vocab)
    runner = llm.engine.loop.runner = _TimedRunner(InstantRunner(vocab))
    for _ in range(args.runs):
        runner.launches.clear()
        llm.reset_prefix_cache()
        params = workload.sampling_params()
        start = time.perf_counter()
        llm.generate(workload.prompts, params, use_tqdm=False)
        end = time.perf_counter()
        print(f"{args.workload}: before the first launch {runner.launches[0] - start:.3f} s, "
              f"after the last {end - runner.launches[-1]:.3f} s ({len(runner.launches)} steps, "
              f"{end - start:.3f} s in all)")


if __name__ == "__main__":
    main()
