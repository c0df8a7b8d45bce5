"""What sending a plan to the tensor-parallel workers costs rank 0 per step: pickling a decode
plan of N sequences once, then one pipe send per worker (and the worker's unpickling).

Usage: python benchmarks/plan_broadcast.py [--num-seqs 256] [--workers 1 7]
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import time

import numpy as np

from nanofn.state import Events, NewSeq, SamplingParams, SchedulerConfig, initial_state, step

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


def _reader(connection) -> None:
    while connection.recv_bytes() != b"stop":
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 7])
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
          f"{pickling * 1e6:.0f} us, unpickle (on each worker) {unpickling * 1e6:.0f} us")
    context = multiprocessing.get_context("spawn")
    for count in a.workers:
        pipes = [context.Pipe() for _ in range(count)]
        workers = [context.Process(target=_reader, args=(theirs,)) for _, theirs in pipes]
        for worker in workers:
            worker.start()
        start = time.perf_counter()
        for _ in range(REPEATS):
            for ours, _ in pipes:
                ours.send_bytes(data)
        sending = (time.perf_counter() - start) / REPEATS
        for ours, _ in pipes:
            ours.send_bytes(b"stop")
        for worker in workers:
            worker.join()
        print(f"TP={count + 1}: rank 0 spends {(pickling + sending) * 1e6:.0f} us per step "
              f"(sends {sending * 1e6:.0f} us)")


if __name__ == "__main__":
    main()
