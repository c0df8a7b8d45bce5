"""What tensor parallelism's pipes cost the engine's process per step: pickling a decode plan
of N sequences once, one pipe send per rank (every rank is a worker process), and receiving
rank 0's sampled tokens back; also the round trip of those tokens alone (a one-byte request,
the tokens back), the latency a step adds over running rank 0 in the engine's process.

Usage: python benchmarks/experiments/plan_broadcast.py [--num-seqs 256] [--tp 2 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import time

import numpy as np

from nanofn.state import (Events, NewSeq, SampleOutput, SamplingParams, SchedulerConfig,
                          initial_state, step)

REPEATS = 2000


def decode_plan(num_seqs: int):
    """A pipelined decode step's plan over ``num_seqs`` running sequences."""
    config = SchedulerConfig(block_size=16, max_num_seqs=num_seqs, max_num_batched_tokens=16384,
                             max_model_len=4096, enable_prefix_caching=True,
                             enable_chunked_prefill=True, eos_token_ids=(0,), vocab_size=None)
    state = initial_state(config, num_seqs * 72)
    news = tuple(NewSeq(f"r{i}", tuple(range(1, 513)),
                        SamplingParams(max_tokens=2000, ignore_eos=True)) for i in range(num_seqs))
    state, plan = step(state, Events(new_seqs=news))
    while plan.num_prefill_tokens or plan.is_empty:
        delivered = len(state.undelivered) > 1
        sampled = np.ones(len(state.undelivered[0]), np.int64) if delivered else None
        state, plan = step(state, Events(sampled=sampled))
    return plan


def _rank(connection, rank: int, num_seqs: int) -> None:
    """Reads plans; rank 0 answers each with a decode step's sampled tokens."""
    tokens = SampleOutput(np.arange(num_seqs, dtype=np.int64), None)
    while connection.recv_bytes() != b"stop":
        if rank == 0:
            connection.send(tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    a = ap.parse_args()
    plan = decode_plan(a.num_seqs)
    start = time.perf_counter()
    for _ in range(REPEATS):
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    pickling = (time.perf_counter() - start) / REPEATS
    start = time.perf_counter()
    for _ in range(REPEATS):
        pickle.loads(data)
    unpickling = (time.perf_counter() - start) / REPEATS
    print(f"decode plan of {a.num_seqs} sequences: {len(data):,} bytes; pickle "
          f"{pickling * 1e6:.0f} us, unpickle (on each rank) {unpickling * 1e6:.0f} us")
    context = multiprocessing.get_context("spawn")
    for size in a.tp:
        pipes = [context.Pipe() for _ in range(size)]
        ranks = [context.Process(target=_rank, args=(theirs, r, a.num_seqs))
                 for r, (_, theirs) in enumerate(pipes)]
        for rank in ranks:
            rank.start()
        rank_0 = pipes[0][0]
        sending = receiving = 0.0
        for _ in range(REPEATS):
            start = time.perf_counter()
            for ours, _ in pipes:
                ours.send_bytes(data)
            sending += time.perf_counter() - start
            rank_0.poll(None)  # what the engine's handle does, with a timeout
            start = time.perf_counter()
            rank_0.recv()
            receiving += time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(REPEATS):
            rank_0.send_bytes(b"t")
            rank_0.recv()
        round_trip = (time.perf_counter() - start) / REPEATS
        for ours, _ in pipes:
            ours.send_bytes(b"stop")
        for rank in ranks:
            rank.join()
        sending, receiving = sending / REPEATS, receiving / REPEATS
        print(f"TP={size}: the engine spends {(pickling + sending + receiving) * 1e6:.0f} us per "
              f"step (sends {sending * 1e6:.0f} us to {size} ranks, receives rank 0's tokens in "
              f"{receiving * 1e6:.0f} us); the tokens' round trip takes {round_trip * 1e6:.0f} us")


if __name__ == "__main__":
    main()
