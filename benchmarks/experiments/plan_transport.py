"""What a remote tensor-parallel rank's plan transport costs per step, against a local rank's:
a decode plan of N sequences, pickled once, written to a child process that reads it and
answers one byte, over a pipe (a local rank) and over an authenticated TCP connection on
localhost (a remote rank, ``nanofn.runner.remote_ranks``). No model, no GPU.

Usage: python benchmarks/experiments/plan_transport.py [--num-seqs 256] [--steps 2000]

Prints the plan's size, the pickling time and the median and p99 round trip of each transport
(the round trip holds one plan write and read and the 1-byte answer; a real step's tokens come
back from rank 0, local, so a remote rank adds about the write and the read). On a real network
add the link's latency, once a step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import secrets
import time
from multiprocessing.connection import Client, Listener

import numpy as np

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


def echo(connection) -> None:
    """The child: read each message, answer one byte, until an empty message."""
    while connection.recv_bytes():
        connection.send_bytes(b"k")


def echo_over_tcp(address, key) -> None:
    echo(Client(address, authkey=key))


def round_trips(connection, message: bytes, steps: int) -> np.ndarray:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        connection.send_bytes(message)
        connection.recv_bytes()
        times.append(time.perf_counter() - start)
    connection.send_bytes(b"")
    return np.array(times[steps // 10:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    a = ap.parse_args()
    plan = decode_plan(a.num_seqs)
    start = time.perf_counter()
    for _ in range(100):
        message = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    pickling_us = (time.perf_counter() - start) / 100 * 1e6
    print(f"decode plan of {a.num_seqs} sequences: {len(message):,} bytes pickled, "
          f"{pickling_us:.0f} us to pickle (once a step, for every rank)")
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=echo, args=(theirs,))
    child.start()
    report("pipe (a local rank)", round_trips(ours, message, a.steps))
    child.join()
    key = secrets.token_bytes(32)
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        child = context.Process(target=echo_over_tcp, args=(listener.address, key))
        child.start()
        report("TCP on localhost (a remote rank)", round_trips(listener.accept(), message,
                                                              a.steps))
        child.join()


def report(name: str, micros: np.ndarray) -> None:
    print(f"{name}: round trip median {np.median(micros):.0f} us, p99 "
          f"{np.percentile(micros, 99):.0f} us")


if __name__ == "__main__":
    main()
