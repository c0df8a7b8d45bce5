"""A prompt chunk's gated delta rule at Qwen3.5-9B's shapes (16 key heads, 32 value heads of
128, bf16 states): flash-linear-attention's chunked kernel against nanofn's token-by-token
Triton kernel, each layout's device time (CUDA events, median of 20) and host time per call;
and whether the chunked kernel runs captured in a CUDA graph when its chunk list is given,
padded to a fixed length with chunks of an empty sequence (as a prefill graph would pad it).

Usage: python benchmarks/experiments/delta_rule_prefill.py (needs fla-core; a CUDA GPU)
"""

from __future__ import annotations

import statistics
import time

import torch

from nanofn.kernels import delta_rule
from nanofn.kernels import triton_linear_attention as linear

K_HEADS, V_HEADS, DIM = 16, 32, 128
LAYOUTS = {"1 x 512": [512], "1 x 2048": [2048], "8 x 64": [64] * 8, "20 x 800": [800] * 20}


def inputs(lengths: list[int]):
    t = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(t)
    q, k = (torch.randn(t, K_HEADS, DIM, generator=g, device="cuda").bfloat16() for _ in range(2))
    v = torch.randn(t, V_HEADS, DIM, generator=g, device="cuda").bfloat16()
    gate = -torch.rand(t, V_HEADS, generator=g, device="cuda") * 0.3
    beta = torch.rand(t, V_HEADS, generator=g, device="cuda").bfloat16()
    states = torch.zeros(len(lengths) + 1, 24, V_HEADS, DIM, DIM, device="cuda",
                         dtype=torch.bfloat16)[:, 3]
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                               dtype=torch.int32, device="cuda")
    slots = torch.arange(len(lengths), device="cuda")
    initial = torch.zeros(len(lengths), dtype=torch.bool, device="cuda")
    return (q, k, v, gate, beta, states, query_start, slots, initial, tuple(lengths))


def timed(function, args) -> tuple[float, float]:
    """(device ms, host ms) per call, medians of 20 after 3 warm-ups."""
    for _ in range(3):
        function(*args)
    device, host = [], []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        function(*args)
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(host)


def chunked_in_a_graph(lengths: list[int], padded_seqs: int = 8, chunk: int = 64) -> float:
    """The relative error of flash-linear-attention's kernel replayed from a CUDA graph (its
    chunk list given, padded with chunks of an empty sequence) against the reference."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, gate, beta, states, query_start, slots, initial, lens = inputs(lengths)
    n = len(lengths)
    ends = query_start.long().tolist()
    padded_start = torch.tensor(ends + [ends[-1]] * (padded_seqs - n), device="cuda")
    chunks = [(s, c) for s, length in enumerate(lengths) for c in range(-(-length // chunk))]
    num_chunks = sum(lengths) // chunk + padded_seqs
    chunks += [(padded_seqs - 1, 0)] * (num_chunks - len(chunks))  # an empty sequence's
    chunk_indices = torch.tensor(chunks, device="cuda")
    initial_states = torch.zeros(padded_seqs, V_HEADS, DIM, DIM, device="cuda")
    out = torch.empty_like(v)

    def run():
        o, final = chunk_gated_delta_rule(
            q[None], k[None], v[None], gate[None], beta[None], initial_state=initial_states,
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=padded_start,
            chunk_indices=chunk_indices)
        out.copy_(o[0])

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = delta_rule.gated_delta_rule(q, k, v, gate, beta, states.clone(), query_start,
                                           slots, initial, lens)
    return float((out.float() - expected.float()).norm() / expected.float().norm())


def main() -> None:
    print("| layout | fla chunked: device ms, host ms | token by token: device ms, host ms |")
    print("|---|---|---|")
    for name, lengths in LAYOUTS.items():
        args = inputs(lengths)
        fla = timed(linear.fla_delta_rule, args)
        recurrent = timed(linear.recurrent_delta_rule, args)
        print(f"| {name} | {fla[0]:.3f}, {fla[1]:.3f} | {recurrent[0]:.3f}, {recurrent[1]:.3f} |")
    for lengths in ([512], [300, 100, 5]):
        try:
            error = chunked_in_a_graph(lengths)
            print(f"chunked kernel in a CUDA graph, {lengths}: relative error {error:.2e}")
        except Exception as error:  # what stops it, for the record
            print(f"chunked kernel in a CUDA graph, {lengths}: failed: {error!r:.300}")


if __name__ == "__main__":
    main()
