"""Mixture-of-experts kernels, plain-torch references: the top-k router and the experts' gated
MLPs (``fused_moe``, whose contract ``triton_moe.fused_moe`` keeps on a GPU).

Experts in FP8 come as ``Fp8Weight`` (``data [E, N, K]`` e4m3, ``scale [E, N, G]``) and multiply
weight-only: each weight dequantized and rounded to the activations' dtype, the activations as
they are. A decode step's experts are bound by their weights' bytes, which FP8 halves either
way; W8A8 would only pay on prompts (the FP8 tensor cores), and would round every activation of
every expert to e4m3."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanofn.kernels.activation import silu_and_mul
from nanofn.kernels.fp8 import Fp8Weight, dequantize_groups


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k], topk_ids [T, k])`` from ``router_logits [T, E]``, as transformers'
    Qwen3-MoE router computes them: softmax in float32, the ``top_k`` largest probabilities
    (largest first), divided by their sum where ``renormalize`` (``norm_topk_prob``), then cast
    to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def expert_matrix(weights: torch.Tensor | Fp8Weight, expert: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s matrix of stacked ``weights``; of FP8 ones, dequantized to ``dtype``."""
    if isinstance(weights, Fp8Weight):
        return dequantize_groups(weights.data[expert], weights.scale[expert],
                                 weights.group_size).to(dtype)
    return weights[expert]


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_parallel: bool = False) -> torch.Tensor:
    """``[T, H]``: each token's chosen experts' gated MLPs, weighted and summed.

    ``hidden [T, H]``; ``w13 [E, 2I, H]``, each expert's ``[gate | up]`` projection;
    ``w2 [E, H, I]``, its down projection; ``topk_weights``, ``topk_ids`` ``[T, k]``. Expert
    ``e``'s output for token ``t`` is ``w2[e] @ (silu(gate) * up)``; each is multiplied by its
    weight in the model's dtype and added up in ascending expert order, as transformers does.
    Under tensor parallelism ``I`` is a rank's share and the result its partial sum; under
    expert parallelism (``expert_parallel``) the ``E`` experts are the rank's, an id of -1
    names an expert another rank holds, whose pair adds nothing here, and the result is again
    the rank's partial sum. (The references always skip -1; the flag is for the GPU kernels.)
    FP8 experts (``Fp8Weight``) multiply weight-only (see the module's docstring).

    Only the experts that have tokens are computed, each over its tokens at once.
    """
    out = torch.zeros_like(hidden)
    num_experts = w13.shape[0]
    flat_ids = topk_ids.flatten()
    flat_ids = flat_ids.masked_fill(flat_ids < 0, num_experts)  # other ranks': sorted last
    order = flat_ids.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    tokens = order // topk_ids.shape[1]
    weights = topk_weights.flatten()[order]
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows, end = tokens[start : start + count], start + count
        activated = silu_and_mul(F.linear(hidden[rows], expert_matrix(w13, expert, hidden.dtype)))
        expert_out = (F.linear(activated, expert_matrix(w2, expert, hidden.dtype))
                      * weights[start:end, None])
        out.index_add_(0, rows, expert_out.to(out.dtype))
        start = end
    return out
