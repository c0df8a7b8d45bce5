"""The Triton norm, rotary (+ KV store) and activation kernels against the torch references on a CUDA GPU,
in bf16 at Qwen3-0.6B's sizes: hidden 1024, intermediate 3072, 16 query heads over 8 kv heads of
128. Both sides round to bf16 at the same points, so they differ by about one bf16 step at most.
``benchmark()`` prints timings, asserting nothing."""

from __future__ import annotations

import pytest
import torch
import triton.testing

import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import build_cos_sin_cache, rms_norm, rotate_and_store_kv, silu_and_mul
from nanofn.kernels.all_reduce import FLAG_SLOTS
from nanofn.kernels.partial_sums import RankSums

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nan_filled_allocations")]

HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 1024, 3072, 16, 8, 128, 16
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
    """``num_tokens`` tokens at scattered positions; q, k and v as views of a fused qkv
    projection; a paged cache with a slot for each token, every seventh token padding (-1)."""

    def __init__(self, num_tokens, seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.cache = build_cos_sin_cache(HEAD_DIM, MAX_POSITIONS, ROPE_THETA, device="cuda")
        self.positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=generator, device="cuda")
        qkv = randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, seed=seed + 1, scale=3.0)
        self.q, self.k, self.v = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        self.norm = dict(
            q_norm_weight=norm_weight(HEAD_DIM, seed + 2), k_norm_weight=norm_weight(HEAD_DIM, seed + 3), norm_eps=EPS
        )
        num_blocks = num_tokens // BLOCK_SIZE + 2
        cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = (randn(*cache_shape, seed=seed + i) for i in (4, 5))
        self.slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator,
                                           device="cuda")[:num_tokens]
        self.slot_mapping[::7] = -1

    def args(self, k_cache=None, v_cache=None):
        """The arguments of ``rotate_and_store_kv`` but the norm's, into the given caches."""
        return (self.q, self.k, self.v, self.positions, self.cache,
                self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache, self.slot_mapping)

    def expected(self, norm):
        """The reference's rotated queries and caches, leaving this one's caches as they are."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        return rotate_and_store_kv(*self.args(k_cache, v_cache), **norm), k_cache, v_cache


def assert_rotated_and_stored(q_out, expected, inputs):
    q_expected, k_expected, v_expected = expected
    torch.testing.assert_close(q_out, q_expected, **TOLERANCES)
    torch.testing.assert_close(inputs.k_cache, k_expected, **TOLERANCES)
    assert torch.equal(inputs.v_cache, v_expected)


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


@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_the_norm_of_two_ranks_summands_waits_for_the_other_rank(num_tokens):
    """Two ranks on one GPU, each on a stream of its own, their summands and flags in plain
    device memory. Rank 1 writes its summand only after a sleep of about a millisecond, so a
    rank 0 that read without waiting would read the round before's. Both ranks' rows equal
    the norm of the sum, round after round (the epochs advancing)."""
    weight, residual = norm_weight(HIDDEN, seed=1), randn(num_tokens, HIDDEN, seed=2)
    summands = [torch.zeros(num_tokens, HIDDEN, dtype=DTYPE, device="cuda") for _ in range(2)]
    flags = [torch.zeros(2 * FLAG_SLOTS, dtype=torch.int32, device="cuda") for _ in range(2)]
    epochs = [torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for round in range(4):
        new = [randn(num_tokens, HIDDEN, seed=10 * round + rank, scale=3.0) for rank in (0, 1)]
        expected, expected_summed = rms_norm(new[0] + new[1], weight, EPS, residual)
        torch.cuda.synchronize()
        outs = {}
        for rank in (1, 0):
            with torch.cuda.stream(streams[rank]):
                if rank == 1:
                    torch.cuda._sleep(2_000_000)
                summands[rank].copy_(new[rank])
                x = RankSums(tuple(summands), flags[rank], flags[1 - rank], epochs[rank],
                             None)
                outs[rank] = triton_ops.rms_norm(x, weight, EPS, residual)
        torch.cuda.synchronize()
        for rank in (0, 1):
            out, summed = outs[rank]
            assert torch.equal(summed, expected_summed), (round, rank)
            torch.testing.assert_close(out, expected, **TOLERANCES)
        assert torch.equal(outs[0][0], outs[1][0])
    programs = min(num_tokens, triton_ops.rank_sums_programs(torch.device("cuda")))
    assert torch.equal(epochs[0], epochs[1]) and epochs[0][:programs].eq(4).all()


@pytest.mark.parametrize("num_tokens", [1, 256, 4099])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-and-rotary"])
def test_rotate_and_store_kv_matches_reference(num_tokens, qk_norm):
    inputs = RotaryInputs(num_tokens, seed=3)
    norm = inputs.norm if qk_norm else {}
    expected = inputs.expected(norm)

    q_out = triton_ops.rotate_and_store_kv(*inputs.args(), **norm)

    assert_rotated_and_stored(q_out, expected, inputs)


def test_rotate_and_store_kv_replays_from_a_cuda_graph():
    inputs = RotaryInputs(64, seed=4)
    triton_ops.rotate_and_store_kv(*inputs.args(), **inputs.norm)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = triton_ops.rotate_and_store_kv(*inputs.args(), **inputs.norm)

    fresh = RotaryInputs(64, seed=5)
    for name in ("positions", "q", "k", "v", "k_cache", "v_cache", "slot_mapping"):
        getattr(inputs, name).copy_(getattr(fresh, name))
    expected = fresh.expected(inputs.norm)
    graph.replay()

    assert_rotated_and_stored(q_out, expected, inputs)


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
        qkv_bytes = 2 * (inputs.q.numel() + 2 * inputs.k.numel()) * inputs.q.element_size()
        _report(f"qk norm + rotary + KV store, {num_tokens} tokens", qkv_bytes, graphed,
                lambda: triton_ops.rotate_and_store_kv(*inputs.args(), **inputs.norm),
                lambda: rotate_and_store_kv(*inputs.args(), **inputs.norm))
        _report(f"rotary + KV store, {num_tokens} tokens", qkv_bytes, graphed,
                lambda: triton_ops.rotate_and_store_kv(*inputs.args()),
                lambda: rotate_and_store_kv(*inputs.args()))

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
