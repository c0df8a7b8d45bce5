"""Cost of the pure core per sequence per decode step (no GPU, no model).

Usage: python benchmarks/scheduler.py [--num-seqs 256] [--steps 200] [--pipelined]
Admits N requests with 512-token prompts, lets every prefill finish, then times decode
steps (deliver the sampled tokens, finish checks, scheduling, plan building) with the garbage
collector set as ``LLM.generate`` sets it, and prints microseconds per sequence per step
(median and best of the steps). ``--pipelined`` delivers tokens one plan late, as the engine's
async scheduling does. Yardstick: nano-vllm's mutable scheduler costs about 0.9 us per
sequence per decode step on the development machine.
"""
import argparse
import gc
import time

from nanofn.state import Events, NewSeq, SamplingParams, SchedulerConfig, initial_state, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--pipelined", action="store_true")
    a = ap.parse_args()
    config = SchedulerConfig(block_size=16, max_num_seqs=a.num_seqs,
                             max_num_batched_tokens=16384, max_model_len=4096,
                             enable_prefix_caching=True, enable_chunked_prefill=True,
                             eos_token_ids=(0,), vocab_size=None)
    num_blocks = a.num_seqs * (a.prompt_len + a.steps + 64) // 16 + 64
    params = SamplingParams(max_tokens=a.steps + 50, ignore_eos=True)
    news = tuple(NewSeq(f"r{i}", tuple((i * 7919 + j) % 30000 for j in range(a.prompt_len)),
                            params) for i in range(a.num_seqs))
    state, plan = step(initial_state(config, num_blocks), Events(new_seqs=news))
    lag = 1 if a.pipelined else 0

    def deliver(state, token):
        return (token,) * len(state.undelivered[0]) if len(state.undelivered) > lag else None

    while plan.num_prefill_tokens:
        state, plan = step(state, Events(sampled=deliver(state, 1)))
    gc.set_threshold(20_000, *gc.get_threshold()[1:])  # as LLM.generate does
    times = []
    for k in range(a.steps):
        start = time.perf_counter()
        state, plan = step(state, Events(sampled=deliver(state, k % 1000 + 2)))
        times.append(time.perf_counter() - start)
    assert len(plan.seqs) == a.num_seqs
    times.sort()
    per_seq = [t / a.num_seqs * 1e6 for t in (times[len(times) // 2], times[0])]
    print(f"{a.num_seqs} seqs, {a.steps} decode steps{' (pipelined)' if a.pipelined else ''}: "
          f"{times[len(times) // 2] * 1e3:.3f} ms/step; {per_seq[0]:.2f} us per seq per step "
          f"(best {per_seq[1]:.2f})")


if __name__ == "__main__":
    main()
