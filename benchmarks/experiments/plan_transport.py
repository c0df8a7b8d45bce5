"""What a remote tensor-parallel rank's plan transport costs per step, against a local rank's:
a decode plan of N sequences, pickled once, written every ``--gap-ms`` to a child process that
reads it and answers nothing (as a rank reads the engine's plans), over a pipe (a local rank),
over an authenticated TCP connection on localhost as ``nanofn.runner.remote_ranks`` makes it
(Nagle's algorithm off), and over the same connection with Nagle's algorithm on. No model, no
GPU.

Usage: python benchmarks/experiments/plan_transport.py [--num-seqs 256] [--steps 1000] [--gap-ms 5]

Prints the plan's size, the pickling time, and the median, p99 and largest delay from each
write to its read (the clock is the host's monotonic clock, shared by both processes). On a
real network add the link's latency, once a step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import secrets
import time
from multiprocessing.connection import Client, Listener

import numpy as np

from nanofn.runner.remote_ranks import without_delay
from nanofn.state import Events, NewSeq, SamplingParams, SchedulerConfig, initial_state, step


def decode_plan(num_seqs: int):
    """A plain decode plan of ``num_seqs`` sequences with 512-token prompts, from the core."""
    config = SchedulerConfig(block_size=16, max_num_seqs=num_seqs, max_num_batched_tokens=16384,
                             max_model_len=4096, enable_prefix_caching=True,
                             enable_chunked_prefill=True, eos_token_ids=(0,), vocab_size=None)
    news = tuple(NewSeq(f"r{i}", tuple((i * 7919 + j) % 30000 + 1 for j in range(512)),
                        SamplingParams(max_tokens=2000, ignore_eos=True))
                 for i in range(num_seqs))
    state, plan = step(initial_state(config, num_seqs * 72 + 64), Events(new_seqs=news))
    while plan.num_prefill_tokens:
        state, plan = step(state, Events(sampled=np.ones(len(state.undelivered[0]), int)))
    state, plan = step(state, Events(sampled=np.ones(len(state.undelivered[0]), int)))
    return plan


def read_plans(connection, delays) -> None:
    """The child: read each (time written, plan) until an empty one; send back the delays."""
    arrived = []
    while (message := pickle.loads(connection.recv_bytes())) is not None:
        arrived.append(time.monotonic() - message[0])
    delays.send(arrived)


def read_plans_over_tcp(address, key, delays, nagle: bool) -> None:
    connection = Client(address, authkey=key)
    read_plans(connection if nagle else without_delay(connection), delays)


def delays(connection, plan_bytes: bytes, steps: int, gap_s: float, results) -> np.ndarray:
    """Write ``steps`` plans ``gap_s`` apart; the reader's delays, in us."""
    for _ in range(steps):
        connection.send_bytes(pickle.dumps((time.monotonic(), plan_bytes)))
        time.sleep(gap_s)
    connection.send_bytes(pickle.dumps(None))
    return np.array(results.recv()[steps // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    a = ap.parse_args()
    plan = decode_plan(a.num_seqs)
    start = time.perf_counter()
    for _ in range(100):
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    pickling_us = (time.perf_counter() - start) / 100 * 1e6
    print(f"decode plan of {a.num_seqs} sequences: {len(message):,} bytes pickled, "
          f"{pickling_us:.0f} us to pickle (once a step, for every rank)")
    context = multiprocessing.get_context("spawn")
    gap_s = a.gap_ms / 1e3
    results, sink = context.Pipe(duplex=False)
    ours, theirs = context.Pipe()
    child = context.Process(target=read_plans, args=(theirs, sink))
    child.start()
    report("pipe (a local rank)", delays(ours, message, a.steps, gap_s, results))
    child.join()
    for name, nagle in (("TCP on localhost, as remote_ranks connects (a remote rank)", False),
                        ("TCP on localhost, Nagle's algorithm on", True)):
        key = secrets.token_bytes(32)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            child = context.Process(target=read_plans_over_tcp,
                                    args=(listener.address, key, sink, nagle))
            child.start()
            connection = listener.accept()
            report(name, delays(connection if nagle else without_delay(connection), message,
                                a.steps, gap_s, results))
            child.join()


def report(name: str, micros: np.ndarray) -> None:
    print(f"{name}: write to read median {np.median(micros):.0f} us, p99 "
          f"{np.percentile(micros, 99):.0f} us, largest {micros.max():.0f} us")


if __name__ == "__main__":
    main()
