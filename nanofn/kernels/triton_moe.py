"""A mixture-of-experts layer's experts in two Triton launches, with the contract of the torch
reference ``moe.fused_moe``: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)``
where an expert is ``down(silu(gate(x)) * up(x))``, its weights stacked as ``w13 [E, 2I, H]``
(gate rows first, then up) and ``w2 [E, H, I]``.

The step's (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align_pairs``), so every block of ``BLOCK_M`` sorted pairs belongs to
one expert: a grouped GEMM's program multiplies its block's tokens by its expert's weights, and
reads only the experts some token chose (a decode step of a few tokens touches few). The first
launch computes gate and up with SiLU-and-mul fused in; the second the down projection, scaled
by the routing weight; the ``k`` scaled rows of a token are then added up (in float32, where
the reference adds in the model's dtype). Every size is fixed by the token count alone (no
value read back to the host), so the layer fits a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AlignedPairs:
    """A step's (token, expert) pairs sorted by expert, each expert's run padded to whole
    blocks. A pair is ``token * k + j`` (``topk_ids.flatten()``'s index); padding is
    ``num_pairs``; blocks past the last expert's are marked ``-1``."""

    sorted_pairs: torch.Tensor  # [capacity] int32
    block_experts: torch.Tensor  # [capacity // block_m] int32
    block_m: int


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``AlignedPairs`` of ``topk_ids [T, k]``, with a capacity fixed by ``T * k`` (room for
    every expert's padding)."""
    experts = topk_ids.flatten().long()
    num_pairs = experts.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))  # (bincount reads its maximum back on a GPU)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    first_of_expert = counts.cumsum(0) - counts  # in the unpadded sorted order
    rank = torch.arange(num_pairs, device=experts.device) - first_of_expert[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=experts.device)
    sorted_pairs[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=experts.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return AlignedPairs(sorted_pairs, block_experts.to(torch.int32), block_m)


@triton.jit
def _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Block ``program_id(0)``'s sorted pairs, and which of them are pairs (not padding)."""
    pairs = tl.load(sorted_pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs,
                    hidden, inter, x_stride, w_stride_e, w_stride_n, out_stride,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Block ``program_id(0)`` of sorted pairs, intermediate columns ``program_id(1) *
    BLOCK_N ...``: ``silu(x @ gate.T) * (x @ up.T)`` of the block's expert, to the pairs' rows."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, pair_ok = _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M)
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    weights = w13_ptr + expert.to(tl.int64) * w_stride_e
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * x_stride + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b_gate = tl.load(weights + cols[None, :] * w_stride_n + ks[:, None],
                         mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        b_up = tl.load(weights + (cols[None, :] + inter) * w_stride_n + ks[:, None],
                       mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        gate = tl.dot(a, b_gate, gate, input_precision="ieee")
        up = tl.dot(a, b_up, up, input_precision="ieee")
    activated = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * out_stride + cols[None, :],
             activated.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w2_ptr, out_ptr, routing_ptr, sorted_pairs_ptr, block_experts_ptr,
                 num_pairs, hidden, inter, a_stride, w_stride_e, w_stride_n, out_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Block ``program_id(0)`` of sorted pairs, hidden columns ``program_id(1) * BLOCK_N ...``:
    the block's expert's down projection of the pairs' activations, times their routing
    weights, to the pairs' rows."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs, pair_ok = _block_pairs(sorted_pairs_ptr, num_pairs, BLOCK_M)
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    weights = w2_ptr + expert.to(tl.int64) * w_stride_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + rows[:, None] * a_stride + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(weights + cols[None, :] * w_stride_n + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    routing = tl.load(routing_ptr + rows, mask=pair_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             (acc * routing[:, None]).to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """One launch's tiles: ``block_m`` sorted pairs by ``block_n`` output columns, ``block_k``
    of the reduction at a time."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4


def default_tiles(num_pairs: int) -> MoeTiles:
    """Tiles for a step of ``num_pairs`` pairs: the smallest ``tl.dot`` block for the few pairs
    of a decode step (little padding a used expert), larger blocks as pairs grow."""
    if num_pairs <= 64:
        return MoeTiles(16, 64, 128)
    if num_pairs <= 2048:
        return MoeTiles(32, 64, 64)
    return MoeTiles(64, 128, 64, num_warps=8)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              tiles: MoeTiles | None = None) -> torch.Tensor:
    """``moe.fused_moe``: ``hidden_states [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    ``topk_weights`` and ``topk_ids`` ``[T, k]``; returns ``[T, H]`` in the input's dtype."""
    num_tokens, hidden = hidden_states.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if hidden_states.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe reads rows of the inputs and weights with unit stride")
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden)
    tiles = tiles or default_tiles(num_pairs)
    aligned = align_pairs(topk_ids, num_experts, tiles.block_m)
    num_blocks = aligned.block_experts.numel()
    activated = hidden_states.new_empty(num_pairs, inter)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        hidden_states, w13, activated, aligned.sorted_pairs, aligned.block_experts, num_pairs,
        hidden, inter, hidden_states.stride(0), w13.stride(0), w13.stride(1),
        activated.stride(0), TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    scaled = hidden_states.new_empty(num_pairs, hidden)
    routing = topk_weights.flatten().contiguous()
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        activated, w2, scaled, routing, aligned.sorted_pairs, aligned.block_experts, num_pairs,
        hidden, inter, activated.stride(0), w2.stride(0), w2.stride(1), scaled.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps)
    return scaled.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(
        hidden_states.dtype)
