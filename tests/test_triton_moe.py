"""The Triton mixture-of-experts kernels (``triton_moe.py``) on CPU through Triton's
interpreter: the router's choice against the torch reference, the pairs' alignment by expert
(one launch against torch ops, over several programs), and the experts' output against a plain
per-token computation, for a decode step of one token, batches where some experts get no
token, sizes that are not multiples of the tiles, and float16; and with FP8 experts (weight-only,
block-wise and per-channel scales) against the torch reference given the same codes and scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanofn.kernels import moe, triton_moe
from nanofn.kernels.fp8 import Fp8Weight, quantize_groups

TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def experts_one_token_at_a_time(x, w13, w2, topk_weights, topk_ids):
    """``sum_j weight_j * down(silu(gate(x)) * up(x))`` of each token, in float32."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].float(), topk_ids[t].tolist()):
            gate_up = w13[expert].float() @ x[t].float()
            activated = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weight * (w2[expert].float() @ activated)
    return out


def routed(num_tokens, num_experts, top_k, hidden, inter, dtype, seed, skip_experts=()):
    """Random inputs and weights; ``skip_experts`` are chosen by no token."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5).to(dtype)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip_experts])
    scores = torch.rand(num_tokens, len(allowed), generator=generator)
    topk_ids = allowed[scores.topk(top_k, dim=-1).indices]
    topk_weights = torch.rand(num_tokens, top_k, generator=generator).to(dtype)
    return x, w13, w2, topk_weights, topk_ids


def test_a_row_of_nan_logits_still_names_distinct_experts_in_range(interpreter):
    """A CUDA graph's padding row may hold NaN: its experts must be real ones (an id past them
    would misplace real pairs in the alignment); real rows choose as the reference."""
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    logits[2, 7] = float("nan")
    weights, ids = interpreter(triton_moe.select_experts, logits, 8, True)
    for row in (1, 2):
        assert ((ids[row] >= 0) & (ids[row] < 60)).all() and ids[row].unique().numel() == 8
    expected_weights, expected_ids = moe.select_experts(logits[[0, 3]], 8, True)
    assert torch.equal(ids[[0, 3]], expected_ids)
    torch.testing.assert_close(weights[[0, 3]], expected_weights)


def aligned_both_ways(topk_ids, num_experts, block_m):
    """The alignment's one launch (in the interpreter's child) and its torch ops."""
    return (triton_moe.aligned_in_one_launch(topk_ids, num_experts, block_m),
            triton_moe.sorted_by_expert(topk_ids, num_experts, block_m))


def test_pairs_are_aligned_in_whole_blocks_of_one_expert(interpreter):
    topk_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 5], [3, 0]])  # 5 x 2 pairs, 6 experts
    for aligned in interpreter(aligned_both_ways, topk_ids, 6, 4):
        flat = topk_ids.flatten()
        pairs = aligned.sorted_pairs.view(-1, 4)
        real = pairs < flat.numel()
        assert sorted(pairs[real].tolist()) == list(range(flat.numel()))  # each pair once
        for block, expert in zip(pairs, aligned.block_experts.tolist()):
            if expert < 0:
                assert (block == flat.numel()).all()  # past the last expert: padding only
            else:
                assert block[0] < flat.numel()  # no block of padding alone
                assert (flat[block[block < flat.numel()].long()] == expert).all()
        # experts 0 (3 pairs), 1 (1), 3 (5 -> 2 blocks), 5 (1): 5 blocks; 2 and 4 take none
        assert aligned.block_experts.tolist()[:5] == [0, 1, 3, 3, 5]
        assert (aligned.block_experts[5:] == -1).all()


@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m",
                         [(1, 128, 8, 16), (90, 60, 8, 16), (700, 6, 2, 64), (600, 128, 8, 128)],
                         ids=["decode-one-token", "three-programs", "few-experts-many-pairs",
                              "a-mixed-step"])
def test_one_launch_aligns_the_pairs_as_the_torch_ops_do(interpreter, num_tokens, num_experts,
                                                         top_k, block_m):
    """Identical layouts (pairs in order within an expert), over programs of 256 pairs each."""
    generator = torch.Generator().manual_seed(num_tokens)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    scores[:, 1] = -1  # an expert no token chooses
    topk_ids = scores.topk(top_k, dim=-1).indices
    one_launch, torch_ops = interpreter(aligned_both_ways, topk_ids, num_experts, block_m)
    assert torch.equal(one_launch.block_experts, torch_ops.block_experts)
    assert torch.equal(one_launch.sorted_pairs, torch_ops.sorted_pairs)


@pytest.mark.parametrize("num_tokens", [90, 700])
def test_pairs_of_another_ranks_experts_are_left_out_of_the_alignment(interpreter, num_tokens):
    """Expert parallelism: ids of -1 name experts another rank holds; both ways place every
    other pair once, in the same layout, and none of those."""
    generator = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.rand(num_tokens, 16, generator=generator).topk(4, dim=-1).indices
    local_ids = topk_ids.masked_fill(topk_ids >= 8, -1)  # rank 0 of two holds experts 0-7
    one_launch, torch_ops = interpreter(aligned_both_ways, local_ids, 8, 16)
    assert torch.equal(one_launch.block_experts, torch_ops.block_experts)
    assert torch.equal(one_launch.sorted_pairs, torch_ops.sorted_pairs)
    placed = one_launch.sorted_pairs[one_launch.sorted_pairs < local_ids.numel()]
    assert sorted(placed.tolist()) == torch.nonzero(local_ids.flatten() >= 0).flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_experts, top_k, renormalize",
                         [(128, 8, True), (60, 6, False), (6, 1, True)])
def test_router_kernel_chooses_as_the_reference(interpreter, dtype, num_experts, top_k,
                                                renormalize):
    generator = torch.Generator().manual_seed(num_experts)
    logits = (3 * torch.randn(9, num_experts + 3, generator=generator)).to(dtype)[:, :num_experts]
    weights, ids = interpreter(triton_moe.select_experts, logits, top_k, renormalize)
    expected_weights, expected_ids = moe.select_experts(logits, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    assert weights.dtype == dtype
    torch.testing.assert_close(weights, expected_weights, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, skip", [(1, ()), (3, ()), (7, (2, 5)), (40, ())],
                         ids=["decode-one-token", "pair-blocks-shared-experts", "unused-experts",
                              "many-tokens"])
def test_fused_moe_matches_the_experts_token_by_token(interpreter, dtype, num_tokens, skip):
    x, w13, w2, topk_weights, topk_ids = routed(num_tokens, num_experts=8, top_k=3, hidden=40,
                                                inter=24, dtype=dtype, seed=num_tokens,
                                                skip_experts=skip)
    if num_tokens == 3:  # each pair its own block, and an expert two tokens chose
        assert num_tokens <= triton_moe.PAIR_BLOCKS_UP_TO
        assert topk_ids.flatten().unique().numel() < topk_ids.numel()
    several = triton_moe.GemmTiles(block_n=16, block_k=16)  # several tiles a matrix
    tiles = triton_moe.MoeTiles(block_m=16, gate_up=several, down=several)
    out = interpreter(triton_moe.fused_moe, x, w13, w2, topk_weights, topk_ids, tiles=tiles)
    expected = experts_one_token_at_a_time(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("num_tokens", [3, 40], ids=["pair-blocks", "sorted-pairs"])
def test_two_expert_parallel_ranks_add_up_to_all_the_experts(interpreter, num_tokens):
    """Each rank holds four of the eight experts and computes the pairs that chose them (the
    other rank's ids are -1): each rank's output is the reference's of its pairs, and the two
    add up to every expert's."""
    x, w13, w2, topk_weights, topk_ids = routed(num_tokens, num_experts=8, top_k=3, hidden=40,
                                                inter=24, dtype=torch.float32, seed=num_tokens)
    several = triton_moe.GemmTiles(block_n=16, block_k=16)
    tiles = triton_moe.MoeTiles(block_m=16, gate_up=several, down=several)
    outs = []
    for first in (0, 4):
        local_ids = topk_ids - first
        local_ids = local_ids.masked_fill((local_ids < 0) | (local_ids >= 4), -1)
        assert (local_ids == -1).any() and (local_ids >= 0).any()
        out = interpreter(triton_moe.fused_moe, x, w13[first:first + 4], w2[first:first + 4],
                          topk_weights, local_ids, True, tiles)
        expected = moe.fused_moe(x, w13[first:first + 4], w2[first:first + 4], topk_weights,
                                 local_ids)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
        outs.append(out)
    torch.testing.assert_close(outs[0] + outs[1],
                               experts_one_token_at_a_time(x, w13, w2, topk_weights, topk_ids),
                               **TOLERANCES[torch.float32])


def test_fused_moe_with_its_default_tiles_and_no_tokens(interpreter):
    """A few tokens and more (other tiles)."""
    for num_tokens in (5, 40):
        x, w13, w2, topk_weights, topk_ids = routed(num_tokens, num_experts=4, top_k=2, hidden=32,
                                                    inter=16, dtype=torch.float32, seed=9)
        out = interpreter(triton_moe.fused_moe, x, w13, w2, topk_weights, topk_ids)
        expected = experts_one_token_at_a_time(x, w13, w2, topk_weights, topk_ids)
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    empty = interpreter(triton_moe.fused_moe, x[:0], w13, w2, topk_weights[:0], topk_ids[:0])
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("num_pairs", [8, 64, 512, 2048, 8192, 100_000])
@pytest.mark.parametrize("element_size", [2, 4])
def test_default_tiles_fit_in_shared_memory(num_pairs, element_size):
    """Every stage of both launches within an H100's 227 KB a block, float32 included (a tiny
    float32 model's prompt once asked for 272 KB)."""
    tiles = triton_moe.default_tiles(num_pairs, element_size)
    for gemm, weight_tiles in ((tiles.gate_up, 2), (tiles.down, 1)):
        stage = (tiles.block_m + weight_tiles * gemm.block_n) * gemm.block_k * element_size
        assert gemm.num_stages * stage <= 227 * 1024
        assert gemm.num_stages >= 2 or stage * 2 > 227 * 1024


def fp8_experts(weights, group_size, seed):
    """``weights [E, N, K]`` in FP8 with a scale per row and group of ``group_size`` columns,
    each group first multiplied by its own power of two from 1/4 to 4, so that the scales
    differ widely and a scale misapplied shows."""
    generator = torch.Generator().manual_seed(seed)
    num_groups = -(-weights.shape[-1] // group_size)
    factors = 2.0 ** torch.randint(-2, 3, (*weights.shape[:-1], num_groups), generator=generator)
    spread = weights.float() * factors.repeat_interleave(group_size, -1)[..., :weights.shape[-1]]
    return Fp8Weight(*quantize_groups(spread, group_size), group_size)


# hidden, inter, the scales' groups (0: per channel, a group of all K) and the tiles' block_k
FP8_EXPERTS = {
    "block-wise": (256, 256, 128, 64),  # two k-steps a group
    "block-wise-rows-past-blocks": (256, 160, 128, 256),  # 320 and 256 rows; block_k cut to 128
    "per-channel": (40, 24, 0, 16),  # K not a multiple of block_k
}


def fp8_routed(kind, num_tokens, dtype, seed, skip_experts=(), block_m=16):
    """``routed``'s inputs with FP8 experts of ``FP8_EXPERTS[kind]``, and tiles for them of
    ``block_m`` rows."""
    hidden, inter, group_size, block_k = FP8_EXPERTS[kind]
    x, w13, w2, topk_weights, topk_ids = routed(num_tokens, num_experts=6, top_k=2,
                                                hidden=hidden, inter=inter, dtype=dtype,
                                                seed=seed, skip_experts=skip_experts)
    w13 = fp8_experts(w13, group_size or hidden, seed)
    w2 = fp8_experts(w2, group_size or inter, seed + 1)
    gemm = triton_moe.GemmTiles(block_n=64, block_k=block_k)
    return x, w13, w2, topk_weights, topk_ids, triton_moe.MoeTiles(block_m, gemm, gemm)


@pytest.mark.parametrize("kind", list(FP8_EXPERTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, skip", [(1, ()), (12, (1, 4))],
                         ids=["decode-one-token", "unused-experts"])
@pytest.mark.parametrize("block_m", [16, 64], ids=["exact-codes", "dequantized"])
def test_fused_moe_with_fp8_experts_matches_the_reference(interpreter, kind, dtype, num_tokens,
                                                          skip, block_m):
    """Weight-only, the reference's results: a decode step's tiles multiply the codes and scale
    the products, a prompt's dequantize each tile to the activations' dtype as the reference
    does (12 tokens: sorted pairs, two experts without any)."""
    assert triton_moe.exact_codes(block_m) == (block_m == 16)
    x, w13, w2, topk_weights, topk_ids, tiles = fp8_routed(kind, num_tokens, dtype, seed=7,
                                                           skip_experts=skip, block_m=block_m)
    out = interpreter(triton_moe.fused_moe, x, w13, w2, topk_weights, topk_ids, tiles=tiles)
    expected = moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("kind", list(FP8_EXPERTS))
@pytest.mark.parametrize("past_fp16", ["inputs", "gated-activations"])
def test_fp8_experts_under_bf16_past_fp16s_range_match_the_reference(interpreter, kind,
                                                                     past_fp16):
    """bf16 activations multiply FP8 codes in fp16, divided by 256 first
    (``triton_moe.in_fp16``): inputs, or gated activations between the two launches, far past
    fp16's 65,504 give the reference's results (multiplied in fp16 as they are, they would be
    infinite)."""
    hidden, inter, group_size, block_k = FP8_EXPERTS[kind]
    x, w13, w2, topk_weights, topk_ids = routed(12, num_experts=6, top_k=2, hidden=hidden,
                                                inter=inter, dtype=torch.float32, seed=9)
    scale_x, scale_w13 = (3e5, 1 / 3e5) if past_fp16 == "inputs" else (1.0, 150.0)
    x = (x * scale_x).to(torch.bfloat16)
    w13 = fp8_experts(w13 * scale_w13, group_size or hidden, 9)
    w2 = fp8_experts(w2 / 1e3, group_size or inter, 10)
    gemm = triton_moe.GemmTiles(block_n=64, block_k=block_k)
    out = interpreter(triton_moe.fused_moe, x, w13, w2, topk_weights.to(torch.bfloat16),
                      topk_ids, tiles=triton_moe.MoeTiles(16, gemm, gemm))
    expected = moe.fused_moe(x, w13, w2, topk_weights.to(torch.bfloat16), topk_ids)
    gate, up = (x.float() @ moe.expert_matrix(w13, 0, torch.float32).T).chunk(2, dim=-1)
    largest = {"inputs": x, "gated-activations": torch.nn.functional.silu(gate) * up}[past_fp16]
    assert largest.abs().max() > 4 * 65504 and expected.isfinite().all()
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2,
                               atol=3e-2 * expected.abs().max().item())


@pytest.mark.parametrize("kind", list(FP8_EXPERTS))
def test_fp8_experts_under_expert_parallelism_match_the_reference(interpreter, kind):
    """Rank 1 of two holds experts 3-5 (their codes and scales): the pairs that chose the
    others (ids of -1) are left out, as the reference leaves them."""
    x, w13, w2, topk_weights, topk_ids, tiles = fp8_routed(kind, 12, torch.float32, seed=8)
    local_ids = (topk_ids - 3).masked_fill(topk_ids < 3, -1)
    assert (local_ids == -1).any() and (local_ids >= 0).any()
    w13, w2 = (Fp8Weight(w.data[3:], w.scale[3:], w.group_size) for w in (w13, w2))
    out = interpreter(triton_moe.fused_moe, x, w13, w2, topk_weights, local_ids, True, tiles)
    expected = moe.fused_moe(x, w13, w2, topk_weights, local_ids)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_fp8_k_steps_lie_within_one_scale_group():
    """``block_k`` divides groups that split K (the largest such up to the tiles'), any one
    does for a group a row, and groups no step of 16 columns fits are refused."""
    tiles = triton_moe.GemmTiles(block_n=64, block_k=256)
    codes = torch.zeros(2, 8, 384, dtype=torch.float8_e4m3fn)
    block_wise = Fp8Weight(codes, torch.ones(2, 8, 3), 128)
    assert triton_moe._fp8_tiles(tiles, block_wise, 384).block_k == 128
    assert triton_moe._fp8_tiles(tiles, Fp8Weight(codes, torch.ones(2, 8, 1), 384),
                                 384).block_k == 256
    assert triton_moe._fp8_tiles(tiles, codes, 384) == tiles
    assert triton_moe._fp8_tiles(tiles, Fp8Weight(codes, torch.ones(2, 8, 8), 48),
                                 384).block_k == 16
    with pytest.raises(ValueError, match="groups of 40 columns"):
        triton_moe._fp8_tiles(tiles, Fp8Weight(codes, torch.ones(2, 8, 10), 40), 384)
