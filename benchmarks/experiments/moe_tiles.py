"""The fused MoE kernels' tiles at the Qwen3-30B-A3B shape (128 experts of 768, top 8, hidden
2,048, bf16), each of the two grouped GEMMs on its own, for steps of 1 to 16,384 tokens routed
uniformly at random: per token count, every candidate's time, and the bytes of the experts the
step touches per second and the FLOP/s, best first. Each candidate is checked against the
torch reference once before it is timed.

With ``--pair-blocks``: instead, a whole layer's experts (``fused_moe`` from a CUDA graph) at a
few tokens, each pair its own block against the pairs aligned by expert in one launch.

Usage: python benchmarks/experiments/moe_tiles.py [--tokens 1,8,64,256,1024,8192] [--pair-blocks]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.runtime.errors
from triton.testing import do_bench

from nanofn.kernels import moe, triton_moe
from nanofn.kernels.triton_moe import _down_kernel, _gate_up_kernel, align_pairs

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def candidates(num_pairs: int):
    """(block_m, block_n, block_k, warps, stages) worth timing for a step of ``num_pairs``: a
    decode step's few pairs want thin blocks and many programs, a prompt's many pairs the
    largest tiles that fit."""
    if num_pairs <= 64:
        space = ((16,), (32, 64, 128), (128, 256), (2, 4), (3, 4))
    elif num_pairs <= 2048:
        space = ((16, 32, 64), (64, 128), (64, 128), (4,), (3, 4))
    else:
        space = ((64, 128), (128, 256), (64,), (4, 8), (3, 4))
    return itertools.product(*space)


def gate_up(x, w13, aligned, num_pairs, tile):
    block_m, block_n, block_k, warps, stages = tile
    out = x.new_empty(num_pairs, INTER)
    grid = (aligned.block_experts.numel() * triton.cdiv(INTER, block_n),)
    _gate_up_kernel[grid](x, w13, out, aligned.sorted_pairs, aligned.block_experts, num_pairs,
                          HIDDEN, INTER, x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
                          TOP_K=TOP_K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                          PAIR_BLOCKS=aligned.pair_blocks, OVERLAP=False,
                          num_warps=warps, num_stages=stages)
    return out


def down(activated, w2, routing, aligned, num_pairs, tile):
    block_m, block_n, block_k, warps, stages = tile
    out = activated.new_empty(num_pairs, HIDDEN)
    grid = (aligned.block_experts.numel() * triton.cdiv(HIDDEN, block_n),)
    _down_kernel[grid](activated, w2, out, routing, aligned.sorted_pairs, aligned.block_experts,
                       num_pairs, HIDDEN, INTER, activated.stride(0), w2.stride(0), w2.stride(1),
                       out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       PAIR_BLOCKS=aligned.pair_blocks, OVERLAP=False,
                       num_warps=warps, num_stages=stages)
    return out


def graphed_layer_us(x, w13, w2, weights, ids, pair_blocks_up_to: int) -> float:
    """A layer's ``fused_moe`` replayed from a CUDA graph, with ``PAIR_BLOCKS_UP_TO`` set."""
    saved = triton_moe.PAIR_BLOCKS_UP_TO
    triton_moe.PAIR_BLOCKS_UP_TO = pair_blocks_up_to
    try:
        expected = moe.fused_moe(x, w13, w2, weights, ids)
        torch.testing.assert_close(triton_moe.fused_moe(x, w13, w2, weights, ids), expected,
                                   atol=3e-2, rtol=3e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_moe.fused_moe(x, w13, w2, weights, ids)
        return do_bench(graph.replay) * 1e3
    finally:
        triton_moe.PAIR_BLOCKS_UP_TO = saved


def compare_pair_blocks(w13, w2, tokens_list, g) -> None:
    for tokens in tokens_list:
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
        weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
        weights = weights.to(torch.bfloat16)
        aligned = graphed_layer_us(x, w13, w2, weights, ids, 0)
        paired = graphed_layer_us(x, w13, w2, weights, ids, tokens)
        print(f"{tokens:>3} tokens ({ids.unique().numel():>3} experts): aligned {aligned:6.1f} us, "
              f"pair blocks {paired:6.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,8192")
    ap.add_argument("--show", type=int, default=4, help="candidates shown per kernel and size")
    ap.add_argument("--pair-blocks", action="store_true")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g).to(torch.bfloat16)
    w13 *= HIDDEN ** -0.5
    w2 *= INTER ** -0.5
    print(torch.cuda.get_device_name())
    if args.pair_blocks:
        compare_pair_blocks(w13, w2, [1, 2, 4, 8, 12, 16, 24], g)
        return
    for tokens in map(int, args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
        weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
        num_pairs = tokens * TOP_K
        touched = ids.unique().numel()
        expert_bytes = 2 * (2 * INTER * HIDDEN, HIDDEN * INTER)[0] * touched
        flops = 2 * num_pairs * 2 * INTER * HIDDEN
        expected = moe.fused_moe(x, w13, w2, weights, ids)
        results = {"gate_up": [], "down": []}
        for tile in candidates(num_pairs):
            aligned = align_pairs(ids, EXPERTS, tile[0])
            try:
                activated = gate_up(x, w13, aligned, num_pairs, tile)
            except triton.runtime.errors.OutOfResources:
                continue  # (its stages do not fit in shared memory)
            try:
                scaled = down(activated, w2, weights.flatten().contiguous(), aligned, num_pairs,
                              tile)
            except triton.runtime.errors.OutOfResources:
                continue
            got = scaled.view(tokens, TOP_K, HIDDEN).sum(1, dtype=torch.float32).to(x.dtype)
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
            results["gate_up"].append(
                (do_bench(lambda: gate_up(x, w13, aligned, num_pairs, tile)), tile))
            routing = weights.flatten().contiguous()
            results["down"].append(
                (do_bench(lambda: down(activated, w2, routing, aligned, num_pairs, tile)), tile))
        for name, timed in results.items():
            scale = 1 if name == "gate_up" else 0.5  # down reads half the bytes, does half
            for ms, tile in sorted(timed)[: args.show]:
                print(f"{tokens:>6} tokens ({touched:>3} experts) {name:>7} "
                      f"m{tile[0]} n{tile[1]} k{tile[2]} w{tile[3]} s{tile[4]}: "
                      f"{ms * 1e3:7.1f} us {scale * expert_bytes / ms / 1e9:5.2f} TB/s "
                      f"{scale * flops / ms / 1e9:6.0f} TFLOP/s")
        aligned_ms = do_bench(lambda: align_pairs(ids, EXPERTS, 16))
        print(f"{tokens:>6} tokens: align_pairs {aligned_ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
