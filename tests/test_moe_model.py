"""Qwen3-MoE's kernels: the router against transformers', the experts (``fused_moe``) against a
loop over tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from nanofn.kernels import fused_moe, select_experts


# --- the router and the experts -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_matches_transformers_bit_for_bit(renormalize, dtype):
    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=renormalize)
    generator = torch.Generator().manual_seed(2)
    router = Qwen3MoeTopKRouter(config).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=generator))
        hidden = torch.randn(50, 16, generator=generator).to(dtype)
        _, expected_weights, expected_ids = router(hidden)
        weights, ids = select_experts(F.linear(hidden, router.weight), 3, renormalize)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights) and weights.dtype == dtype
    sums = weights.float().sum(-1)
    assert bool((sums - 1).abs().max() < 1e-2) == renormalize


def naive_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert."""
    out = torch.zeros_like(hidden)
    for t, (weights, ids) in enumerate(zip(topk_weights, topk_ids)):
        for weight, expert in zip(weights, ids.tolist()):
            gate, up = (w13[expert] @ hidden[t]).chunk(2)
            out[t] += weight * (w2[expert] @ (F.silu(gate) * up))
    return out


def test_fused_moe_matches_a_loop_over_tokens_and_their_experts():
    """Experts with several tokens, one, and none (expert 5), in any slot order."""
    generator = torch.Generator().manual_seed(3)
    num_experts, hidden_size, intermediate = 6, 8, 5
    hidden = torch.randn(7, hidden_size, generator=generator)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator)
    w2 = torch.randn(num_experts, hidden_size, intermediate, generator=generator)
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 4], [4, 3], [0, 2], [3, 1], [1, 4]])
    topk_weights = torch.rand(7, 2, generator=generator)

    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)

    torch.testing.assert_close(out, naive_moe(hidden, w13, w2, topk_weights, topk_ids))
