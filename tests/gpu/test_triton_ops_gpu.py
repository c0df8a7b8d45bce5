"""The Triton norm, rotary and activation kernels against the torch references on a CUDA GPU,
in bf16 at Qwen3-0.6B's sizes: hidden 1024, intermediate 3072, 16 query heads over 8 kv heads of
128. Both sides round to bf16 at the same points, so they differ by about one bf16 step at most.
``benchmark()`` prints timings, asserting nothing."""

from __future__ import annotations

import pytest
import torch
import triton.testing

import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import apply_rotary, build_cos_sin_cache, rms_norm, silu_and_mul

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nan_filled_allocations")]

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128
MAX_POSITIONS, ROPE_THETA, EPS = 40960, 1000000.0, 1e-6
DTYPE = torch.bfloat16
TOLERANCES = dict(atol=2e-2, rtol=2e-2)  # two bf16 steps at magnitude 1


def randn(*shape, seed, scale=1.0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(DTYPE)


def norm_weight(size, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(size, generator=generator, device="cuda") + 0.5).to(DTYPE)


class RotaryInputs:
    """``num_tokens`` tokens at scattered positions; q and k as views of a fused qkv projection."""

    def __init__(self, num_tokens, seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.cache = build_cos_sin_cache(HEAD_DIM, MAX_POSITIONS, ROPE_THETA, device="cuda")
        self.positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=generator, device="cuda")
        qkv = randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, seed=seed + 1, scale=3.0)
        self.q, self.k = qkv[:, :NUM_HEADS], qkv[:, NUM_HEADS : NUM_HEADS + NUM_KV_HEADS]
        self.norm = dict(
            q_norm_weight=norm_weight(HEAD_DIM, seed + 2), k_norm_weight=norm_weight(HEAD_DIM, seed + 3), norm_eps=EPS
        )

    def args(self):
        return self.q, self.k, self.positions, self.cache


@pytest.mark.parametrize("num_tokens", [1, 256, 4099])
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_rms_norm_matches_reference(num_tokens, add_residual):
    x = randn(num_tokens, HIDDEN, seed=0, scale=3.0)
    weight = norm_weight(HIDDEN, seed=1)
    residual = randn(num_tokens, HIDDEN, seed=2) if add_residual else None

    out = triton_ops.rms_norm(x, weight, EPS, residual)

    expected = rms_norm(x, weight, EPS, residual)
    if add_residual:
        (out, summed), (expected, expected_summed) = out, expected
        assert torch.equal(summed, expected_summed)
    torch.testing.assert_close(out, expected, **TOLERANCES)


@pytest.mark.parametrize("num_tokens", [1, 256, 4099])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-and-rotary"])
def test_apply_rotary_matches_reference(num_tokens, qk_norm):
    inputs = RotaryInputs(num_tokens, seed=3)
    norm = inputs.norm if qk_norm else {}

    q_out, k_out = triton_ops.apply_rotary(*inputs.args(), **norm)

    q_expected, k_expected = apply_rotary(*inputs.args(), **norm)
    torch.testing.assert_close(q_out, q_expected, **TOLERANCES)
    torch.testing.assert_close(k_out, k_expected, **TOLERANCES)


def test_apply_rotary_replays_from_a_cuda_graph():
    inputs = RotaryInputs(64, seed=4)
    triton_ops.apply_rotary(*inputs.args(), **inputs.norm)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = triton_ops.apply_rotary(*inputs.args(), **inputs.norm)

    fresh = RotaryInputs(64, seed=5)
    inputs.positions.copy_(fresh.positions)
    inputs.q.copy_(fresh.q)
    inputs.k.copy_(fresh.k)
    graph.replay()

    q_expected, k_expected = apply_rotary(*fresh.args(), **inputs.norm)
    torch.testing.assert_close(q_out, q_expected, **TOLERANCES)
    torch.testing.assert_close(k_out, k_expected, **TOLERANCES)


@pytest.mark.parametrize("num_tokens", [1, 256, 4099])
def test_silu_and_mul_matches_reference(num_tokens):
    x = randn(num_tokens, 2 * INTERMEDIATE, seed=6, scale=3.0)

    out = triton_ops.silu_and_mul(x)

    torch.testing.assert_close(out, silu_and_mul(x), **TOLERANCES)


def benchmark() -> None:
    """Print median times of the Triton kernels and the torch references, bf16, Qwen3-0.6B's sizes.

    1 and 256 tokens are decode steps, which replay from CUDA graphs: they are timed as graph
    replays, free of launch overhead. 8192 tokens, a prefill chunk, run eagerly and are timed so.
    """
    for num_tokens in (1, 256, 8192):
        graphed = num_tokens <= 256
        x, residual = randn(num_tokens, HIDDEN, seed=7), randn(num_tokens, HIDDEN, seed=8)
        weight = norm_weight(HIDDEN, seed=9)
        norm_bytes = 4 * x.numel() * x.element_size()  # x and residual in, normed and summed out
        _report(f"rms_norm + residual, {num_tokens} x {HIDDEN}", norm_bytes, graphed,
                lambda: triton_ops.rms_norm(x, weight, EPS, residual), lambda: rms_norm(x, weight, EPS, residual))

        inputs = RotaryInputs(num_tokens, seed=10)
        qk_bytes = 2 * (inputs.q.numel() + inputs.k.numel()) * inputs.q.element_size()
        _report(f"qk norm + rotary, {num_tokens} tokens", qk_bytes, graphed,
                lambda: triton_ops.apply_rotary(*inputs.args(), **inputs.norm),
                lambda: apply_rotary(*inputs.args(), **inputs.norm))
        _report(f"rotary, {num_tokens} tokens", qk_bytes, graphed,
                lambda: triton_ops.apply_rotary(*inputs.args()), lambda: apply_rotary(*inputs.args()))

        gate_up = randn(num_tokens, 2 * INTERMEDIATE, seed=11)
        silu_bytes = 3 * gate_up.numel() * gate_up.element_size() // 2
        _report(f"silu_and_mul, {num_tokens} x {INTERMEDIATE}", silu_bytes, graphed,
                lambda: triton_ops.silu_and_mul(gate_up), lambda: silu_and_mul(gate_up))


def _report(name, num_bytes, graphed, triton_call, torch_call) -> None:
    """One line: median microseconds of both, the Triton kernel's memory throughput (``num_bytes``
    read and written), and its speed-up over the reference."""
    bench = triton.testing.do_bench_cudagraph if graphed else triton.testing.do_bench
    triton_ms = bench(triton_call, return_mode="median")
    torch_ms = bench(torch_call, return_mode="median")
    print(f"{name} ({'graph' if graphed else 'eager'}): triton {triton_ms * 1e3:.1f} us "
          f"({num_bytes / (triton_ms / 1e3) / 1e9:.0f} GB/s), torch {torch_ms * 1e3:.1f} us, "
          f"{torch_ms / triton_ms:.1f}x")


if __name__ == "__main__":
    benchmark()
