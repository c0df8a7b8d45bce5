"""A mixture-of-experts model (Qwen3-MoE) on a GPU: bf16 greedy tokens and prompt logprobs
against transformers, CUDA graphs against eager, and the fused Triton experts against the torch
reference at Qwen3-30B-A3B's expert count and routing (bf16 and FP8 experts), eagerly and
replayed from a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from nanofn.kernels import moe, triton_moe
from nanofn.kernels.fp8 import Fp8Weight, quantize_groups
from test_hybrid_gpu import (check_bf16_tokens_and_prompt_logprobs, prompts_for,  # (tests/gpu)
                             relative_error, run)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 1024, 384  # 30B-A3B's routing, smaller experts


@pytest.fixture(scope="module")
def sparse(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def test_bf16_greedy_tokens_and_prompt_logprobs_match_transformers(sparse):
    check_bf16_tokens_and_prompt_logprobs(sparse)


def test_cuda_graphs_give_the_eager_tokens(sparse):
    prompts = prompts_for(5) * 3
    graphs, _ = run(sparse, prompts)
    eager, _ = run(sparse, prompts, enforce_eager=True)
    assert graphs == eager


def experts_and_routing(num_tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda")
           / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / INTER**0.5).bfloat16()
    logits = torch.randn(num_tokens, EXPERTS, generator=g, device="cuda").bfloat16()
    topk_weights, topk_ids = moe.select_experts(logits, TOP_K, renormalize=True)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("num_tokens", [1, 3, 6, 300, 2500])
def test_the_fused_experts_match_the_reference(num_tokens):
    """As close to the float32 computation as the bf16 reference is (it rounds each expert's
    output before adding; the fused kernel adds in float32)."""
    x, w13, w2, topk_weights, topk_ids = experts_and_routing(num_tokens, num_tokens)
    exact = moe.fused_moe(x.float(), w13.float(), w2.float(), topk_weights.float(), topk_ids)
    rounded = moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, exact) <= 2 * relative_error(rounded, exact) + 1e-3


@pytest.mark.parametrize("group_size", [128, None], ids=["block", "channel"])
@pytest.mark.parametrize("num_tokens", [1, 6, 300, 2500])
def test_fp8_experts_match_the_reference(num_tokens, group_size):
    """FP8 experts (block-wise or per-channel scales), weight-only: the Triton kernels against
    the reference on the same codes and scales, as close to its float32 computation as the
    bf16 reference is."""
    x, w13, w2, topk_weights, topk_ids = experts_and_routing(num_tokens, num_tokens + 3)
    fp8 = [Fp8Weight(*quantize_groups(w.float(), group_size or w.shape[-1]),
                     group_size or w.shape[-1]) for w in (w13, w2)]
    dequantized = [w.dequantized(torch.float32) for w in fp8]
    exact = moe.fused_moe(x.float(), *dequantized, topk_weights.float(), topk_ids)
    rounded = moe.fused_moe(x, *fp8, topk_weights, topk_ids)
    got = triton_moe.fused_moe(x, *fp8, topk_weights, topk_ids)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, exact) <= 2 * relative_error(rounded, exact) + 1e-3


@pytest.mark.parametrize("num_tokens", [1, 6, 300, 2500])
def test_two_expert_parallel_halves_add_up_to_all_the_experts(num_tokens):
    """Expert parallelism at two ranks: each half of the experts computes the pairs that chose
    it (the other half's ids -1); the halves' outputs add up to all the experts' output, to
    bf16's rounding (each half rounded once)."""
    x, w13, w2, topk_weights, topk_ids = experts_and_routing(num_tokens, num_tokens + 7)
    half = EXPERTS // 2
    halves = []
    for first in (0, half):
        local = topk_ids - first
        local = local.masked_fill((local < 0) | (local >= half), -1)
        halves.append(triton_moe.fused_moe(x, w13[first:first + half], w2[first:first + half],
                                           topk_weights, local, expert_parallel=True))
    exact = moe.fused_moe(x.float(), w13.float(), w2.float(), topk_weights.float(), topk_ids)
    whole = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert relative_error(halves[0].float() + halves[1].float(), exact) <= (
        2 * relative_error(whole, exact) + 1e-3)


@pytest.mark.parametrize("num_tokens", [2, 24])
def test_the_fused_experts_replay_from_a_cuda_graph(num_tokens):
    """Captured once (nothing read back to the host), replayed with other tokens and routing."""
    x, w13, w2, topk_weights, topk_ids = experts_and_routing(num_tokens, 1)
    triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    new_x, _, _, new_weights, new_ids = experts_and_routing(num_tokens, 2)
    for static, new in ((x, new_x), (topk_weights, new_weights), (topk_ids, new_ids)):
        static.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("num_tokens", [1, 300, 2500])
def test_the_router_kernel_chooses_as_the_reference(num_tokens):
    """The same experts (up to the order of tied probabilities: bf16 logits tie often) with the
    same weights."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, EXPERTS, generator=g, device="cuda").bfloat16()
    weights, ids = triton_moe.select_experts(logits, TOP_K, renormalize=True)
    expected_weights, expected_ids = moe.select_experts(logits, TOP_K, renormalize=True)
    probs = logits.float().softmax(-1)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, expected_ids))
    torch.testing.assert_close(weights, expected_weights)
