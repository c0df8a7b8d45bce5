"""Cost of the pure core per sequence per decode step (no GPU, no model).

Usage: python benchmarks/scheduler.py [--num-seqs 256] [--steps 200]
Admits N requests with 512-token prompts, lets every prefill finish, then times decode
steps (apply the sampled tokens, finish checks, scheduling, plan building) and prints
microseconds per sequence per step. Yardstick: nano-vllm's mutable scheduler costs about
0.9 us per sequence per decode step on the development machine.
"""
import argparse
import time

from nanofn.state import Events, NewRequest, SamplingParams, SchedulerConfig, initial_state, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    a = ap.parse_args()
    config = SchedulerConfig(num_blocks=a.num_seqs * (a.prompt_len + a.steps + 64) // 16 + 64,
                             max_num_seqs=a.num_seqs, max_model_len=4096)
    params = SamplingParams(max_tokens=a.steps + 10, ignore_eos=True)
    news = tuple(NewRequest(f"r{i}", tuple((i * 7919 + j) % 30000 for j in range(a.prompt_len)),
                            params) for i in range(a.num_seqs))
    state, plan = step(initial_state(config), Events(new_requests=news))
    while plan.num_prefill_tokens:
        state, plan = step(state, Events(sampled=(1,) * len(state.awaiting[0])))
    t0 = time.perf_counter()
    for k in range(a.steps):
        state, plan = step(state, Events(sampled=(k % 1000 + 2,) * len(state.awaiting[0])))
    dt = time.perf_counter() - t0
    assert len(plan.seqs) == a.num_seqs
    print(f"{a.num_seqs} seqs, {a.steps} decode steps: {dt / a.steps * 1e3:.3f} ms/step, "
          f"{dt / a.steps / a.num_seqs * 1e6:.2f} us per seq per step")


if __name__ == "__main__":
    main()
