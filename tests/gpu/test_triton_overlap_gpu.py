"""Overlapped kernel launches (``nanofn/kernels/triton_overlap.py``) on a GPU of SM 9.0 or later:
each kernel still reads the whole result of the kernel ahead of it, in a CUDA graph and in the
engine, where the tokens are those of kernels launched one after another."""

from __future__ import annotations

import pytest
import torch

import nanofn.kernels.triton_gemv as triton_gemv
from nanofn.kernels import triton_overlap
from test_triton_gemv_gpu import float32_prompts, greedy_batches  # noqa: F401 (a fixture, this folder)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of SM 9.0 or later (programmatic dependent launch)")

HIDDEN, STEPS = 1024, 6


def test_a_graph_of_overlapped_gemvs_reads_each_result_whole():
    """A chain of GEMVs, each reading the one before (a weight loaded before its wait, the
    input after), replayed from a graph with new inputs: the float32 torch chain's results."""
    assert triton_overlap.overlaps(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = HIDDEN**-0.5
    ups = [torch.randn(2 * HIDDEN, HIDDEN, generator=g, device="cuda") * scale for _ in range(STEPS)]
    downs = [torch.randn(HIDDEN, HIDDEN, generator=g, device="cuda") * scale for _ in range(STEPS)]
    x = torch.randn(1, HIDDEN, generator=g, device="cuda")

    def chain(h, up=triton_gemv.gemv, down=triton_gemv.silu_and_mul_gemv):
        for w_up, w_down in zip(ups, downs):
            h = h + down(up(h, w_up), w_down)  # (the sum: a torch kernel between, not overlapped)
        return h

    def reference(h):
        def silu_and_mul_linear(gate_up, w):
            gate, up = gate_up.chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate) * up) @ w.T
        return chain(h, lambda h, w: h @ w.T, silu_and_mul_linear)

    chain(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for seed in range(1, 6):
        x.copy_(torch.randn(1, HIDDEN, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda"))
        graph.replay()
        # float32 sums in another order, six layers deep: up to ~1e-4 apart (H100, 6d73f40);
        # an input read before the kernel ahead wrote it is the last replay's, O(1) apart
        torch.testing.assert_close(out, reference(x), rtol=1e-3, atol=1e-3)


def test_engine_tokens_are_the_same_with_launches_overlapped_and_in_sequence(float32_prompts,  # noqa: F811
                                                                          monkeypatch):
    """Greedy float32 decoding of one, two, four and five sequences (GEMVs, then cuBLAS) and their
    prefills, with every decode kernel launched overlapped (the default here) and with none."""
    overlapped = greedy_batches(*float32_prompts)
    monkeypatch.setattr(triton_overlap, "overlaps", lambda device: False)
    assert greedy_batches(*float32_prompts) == overlapped
