"""A mixture-of-experts layer in Triton, with the contracts of the torch references in
``moe.py``: the router's choice (``select_experts``: softmax, top-k and renormalisation in one
program a token), then the experts, ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x_t)``
where an expert is ``down(silu(gate(x)) * up(x))``, its weights stacked as ``w13 [E, 2I, H]``
(gate rows first, then up) and ``w2 [E, H, I]``.

The step's (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align_pairs``: one launch for a decode step's pairs), so every block
of ``BLOCK_M`` sorted pairs belongs to one expert: a grouped GEMM's program multiplies its
block's tokens by its expert's weights, and reads only the experts some token chose (a decode
step of a few tokens touches few). The first launch computes gate and up with SiLU-and-mul
fused in; the second the down projection, scaled by the routing weight; the ``k`` scaled rows
of a token are then added up (in float32, where the reference adds in the model's dtype). Every
size is fixed by the token count alone (no value read back to the host), so the layer fits a
CUDA graph; at a decode step's sizes the router's kernel, both GEMMs and the sum launch
overlapped with the kernel ahead (``triton_overlap.py``). (A few tokens as matrix-vector
products, a program per pair and then per token, with no alignment and no separate sum,
measured slower: RESULTS.md, twenty-first session; so did down and the sum in one kernel a
token: twenty-fourth session.)

FP8 experts (``Fp8Weight``) multiply weight-only, the k-steps within one scale group each, so
that a tile takes one scale a row (``_fp8_tiles``). In a decode step's tiles (``exact_codes``)
each k-step multiplies the activations by the weight tile's codes themselves, in fp16 for 16-bit
activations (bf16 ones divided by a power of two into fp16's range: ``in_fp16``), and scales
its float32 product by the rows' scales (with one scale a row, per channel, the sums once); a
prompt's tiles dequantize each tile to the activations' dtype, as the reference does. (Codes
dequantized to bf16 through float32 an element at a time bound a one-token step by the
conversions: RESULTS.md, thirty-first session.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanofn.kernels import triton_overlap
from nanofn.kernels.fp8 import Fp8Weight
from nanofn.kernels.triton_overlap import wait_for_previous


@dataclass(frozen=True)
class AlignedPairs:
    """A step's (token, expert) pairs sorted by expert, each expert's run padded to whole
    blocks. A pair is ``token * k + j`` (``topk_ids.flatten()``'s index); padding is
    ``num_pairs``; blocks past the last expert's are marked ``-1``."""

    sorted_pairs: torch.Tensor | None  # [capacity] int32; None: block b is pair b alone
    block_experts: torch.Tensor  # [capacity // block_m] int32 (or the pairs' experts)
    block_m: int

    @property
    def pair_blocks(self) -> bool:
        """Whether each block holds one pair (``pair_blocks``'s layout, nothing sorted)."""
        return self.sorted_pairs is None


PAIR_BLOCKS_UP_TO = 8  # tokens: a step this small gives each pair its own block, unsorted


# pairs (T * k) that one launch of ``_align_kernel`` places: a decode step's, and a step that
# mixes decodes with a prompt or two, which runs eagerly, where a dozen torch ops a layer kept
# the device waiting for the host; a prompt's many pairs go through the torch ops, whose
# launches hide behind its GEMMs (every program counts all the pairs: the kernel's work grows
# as the square of their number)
ALIGN_IN_ONE_LAUNCH_UP_TO = 16384
OVERLAPPED_UP_TO = 4096  # pairs: a decode step's, whose kernels launch overlapped
ALIGN_CHUNK = 256  # pairs an alignment program places


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``AlignedPairs`` of ``topk_ids [T, k]``, with a capacity fixed by ``T * k`` (room for
    every expert's padding). Up to ``ALIGN_IN_ONE_LAUNCH_UP_TO`` pairs they are placed by one
    kernel (``_align_kernel``), where a dozen torch ops would cost more than its experts'
    GEMMs or keep the device waiting for the host; a prompt's many by those ops
    (``sorted_by_expert``), whose launches hide behind the GEMMs.
    Up to ``PAIR_BLOCKS_UP_TO`` tokens, nothing is sorted (``pair_blocks``)."""
    if topk_ids.shape[0] <= PAIR_BLOCKS_UP_TO:
        return pair_blocks(topk_ids, block_m)
    if topk_ids.numel() > ALIGN_IN_ONE_LAUNCH_UP_TO:
        return sorted_by_expert(topk_ids, num_experts, block_m)
    return aligned_in_one_launch(topk_ids, num_experts, block_m)


def aligned_in_one_launch(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> AlignedPairs:
    """``sorted_by_expert``'s layout from one launch of ``_align_kernel``."""
    num_pairs = topk_ids.numel()
    num_blocks = capacity_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = topk_ids.new_empty(num_blocks * block_m, dtype=torch.int32)
    block_experts = topk_ids.new_empty(num_blocks, dtype=torch.int32)
    _align_kernel[(triton.cdiv(num_pairs, ALIGN_CHUNK),)](
        topk_ids, sorted_pairs, block_experts, num_pairs, num_experts, num_blocks,
        BLOCK_M=block_m, EXPERTS=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK,
        SUB=32, BLOCKS=64)
    return AlignedPairs(sorted_pairs, block_experts, block_m)


def pair_blocks(topk_ids: torch.Tensor, block_m: int) -> AlignedPairs:
    """Each pair its own block, in the pairs' order, its expert read from ``topk_ids`` itself:
    no launch before the GEMMs. An expert chosen by two of the step's tokens is read twice,
    which costs less than sorting up to a few tokens (a layer's alignment took 13.9 us of the
    single request's 50.8, RESULTS.md, twenty-first session)."""
    return AlignedPairs(None, topk_ids.reshape(-1), block_m)


def capacity_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for ``num_pairs`` pairs however they fall: whole blocks of them, plus one
    partly padded block per expert that has any."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def sorted_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """``align_pairs`` in torch ops (a stable sort by expert). Pairs of id -1 (another rank's
    expert) sort last and are written to one slot past the layout, cut off: no value is read
    back to the host."""
    experts = topk_ids.flatten().long()
    experts = experts.masked_fill(experts < 0, num_experts)  # other ranks': a bucket past ours
    num_pairs = experts.numel()
    num_blocks = capacity_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))[:num_experts]  # (bincount reads back its maximum)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    ours = sorted_experts < num_experts
    sorted_experts = sorted_experts.clamp(max=num_experts - 1)
    first_of_expert = counts.cumsum(0) - counts  # in the unpadded sorted order
    rank = torch.arange(num_pairs, device=experts.device) - first_of_expert[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    destination = destination.where(ours, num_blocks * block_m)  # the slot cut off
    sorted_pairs = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int32,
                              device=experts.device)
    sorted_pairs[destination] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=experts.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return AlignedPairs(sorted_pairs[:-1], block_experts.to(torch.int32), block_m)


# (a step's pair and block counts are masks' bounds: specialized on divisibility by 16, every
# other count would compile a second variant in the middle of serving)
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                  SUB: tl.constexpr, BLOCKS: tl.constexpr):
    """``sorted_by_expert``'s result, in place: program ``p`` places pairs ``p * CHUNK ...``
    (but those of id -1, another rank's expert).

    Every program counts all the pairs' experts (so it knows where each expert's run starts)
    and those of the pairs before its own; it then places its pairs in order, ``SUB`` at a
    time, each after the earlier pairs of its expert (a pair's rank among a sub-chunk's is a
    cumulative sum over a one-hot matrix: registers cannot be indexed by a tensor). Program 0
    writes the padding after each expert's pairs; every program, its share of the blocks'
    experts and of the slots past the last expert's run."""
    program = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    before = tl.zeros([EXPERTS], dtype=tl.int32)  # of the pairs before this program's
    for first in range(0, num_pairs, CHUNK):
        pairs = first + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        counted = tl.histogram(ids, EXPERTS, mask=ids >= 0)
        counts += counted
        before += tl.where(first < program * CHUNK, counted, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_ends = tl.cumsum(padded, 0)
    next_slot = run_ends - padded + before
    for sub in range(0, tl.minimum(CHUNK, num_pairs - program * CHUNK), SUB):
        pairs = program * CHUNK + sub + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        ok = ids >= 0  # (-1: another rank's expert, or past the pairs)
        one_hot = ((ids[:, None] == experts[None, :]) & ok[:, None]).to(tl.int32)
        rank = tl.cumsum(one_hot, 0) - one_hot
        slot = tl.sum(one_hot * (next_slot[None, :] + rank), 1)
        tl.store(sorted_pairs_ptr + slot, pairs, mask=ok)
        next_slot += tl.sum(one_hot, 0)
    if program == 0:
        offsets = tl.arange(0, BLOCK_M)
        padding = (run_ends - padded + counts)[:, None] + offsets[None, :]
        tl.store(sorted_pairs_ptr + padding, num_pairs,
                 mask=offsets[None, :] < (padded - counts)[:, None])
    used = tl.sum(padded, 0)
    step = tl.num_programs(0) * BLOCKS
    for first_block in range(program * BLOCKS, num_blocks, step):
        blocks = first_block + tl.arange(0, BLOCKS)
        starts = blocks * BLOCK_M
        past = (run_ends[None, :] <= starts[:, None]) & (experts < num_experts)[None, :]
        expert = tl.sum(past.to(tl.int32), 1)
        tl.store(block_experts_ptr + blocks, tl.where(expert < num_experts, expert, -1),
                 mask=blocks < num_blocks)
        offsets = tl.arange(0, BLOCK_M)
        tl.store(sorted_pairs_ptr + starts[:, None] + offsets[None, :], num_pairs,
                 mask=((blocks < num_blocks) & (starts >= used))[:, None])


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, logits_stride,
                  TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                  EXPERTS: tl.constexpr, OVERLAP: tl.constexpr):
    """Token ``program_id(0)``'s experts, as ``moe.select_experts``: softmax in float32, the
    ``TOP_K`` largest probabilities, largest first (the lower expert first on a tie), divided
    by their sum where ``RENORMALIZE``.

    A NaN probability ranks below every number (torch's top-k ranks it above), so that a row
    of NaN, such as a CUDA graph's padding row whose attention output is left unwritten, still
    names ``TOP_K`` distinct experts in range: an id past the experts would have the alignment
    place the row's pairs over real pairs' slots."""
    wait_for_previous(OVERLAP)
    token = tl.program_id(0)
    experts = tl.arange(0, EXPERTS)
    expert_ok = experts < num_experts
    logits = tl.load(logits_ptr + token * logits_stride + experts, mask=expert_ok,
                     other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    probs = tl.where(probs == probs, probs, -1.0)  # NaN: below every probability
    probs = tl.where(expert_ok, probs, -3.0)  # past the experts: never chosen
    ranks = tl.arange(0, TOP_K_P2)
    chosen_weights = tl.zeros([TOP_K_P2], dtype=tl.float32)
    chosen_ids = tl.zeros([TOP_K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        expert = tl.min(tl.where(probs == best, experts, EXPERTS), 0)
        chosen_weights = tl.where(ranks == j, best, chosen_weights)
        chosen_ids = tl.where(ranks == j, expert, chosen_ids)
        probs = tl.where(experts == expert, -2.0, probs)  # chosen: below NaN's, above none
    if RENORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, 0)
    tl.store(weights_ptr + token * TOP_K + ranks,
             chosen_weights.to(weights_ptr.dtype.element_ty), mask=ranks < TOP_K)
    tl.store(ids_ptr + token * TOP_K + ranks, chosen_ids.to(ids_ptr.dtype.element_ty),
             mask=ranks < TOP_K)


def _overlap(device: torch.device, num_pairs: int) -> dict:
    """``triton_overlap``'s launch options up to a decode step's pairs, where they were
    measured (with the sum in Triton, the single request 276 -> 303 tok/s)."""
    return triton_overlap.launch_options_up_to(device, num_pairs, OVERLAPPED_UP_TO)


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.select_experts`` in one launch (a program a token)."""
    num_tokens, num_experts = router_logits.shape
    weights = router_logits.new_empty(num_tokens, top_k)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
            EXPERTS=triton.next_power_of_2(num_experts),
            **_overlap(router_logits.device, num_tokens * top_k))
    return weights, ids


@triton.jit
def _block(sorted_pairs_ptr, block_experts_ptr, num_pairs, num_col_tiles, BLOCK_M: tl.constexpr,
           PAIR_BLOCKS: tl.constexpr):
    """This program's block and tile of output columns; the block's expert (``-1``: no expert,
    nothing to do), its pairs, and which of them are pairs (not padding). ``PAIR_BLOCKS``: the
    block is pair ``block`` alone (``sorted_pairs_ptr`` is not read).

    Sorted pairs: the column tile varies fastest, so that the programs that run at once share a
    few blocks, whose input rows and expert's weights stay in L2 while every column tile reads
    them (with the block fastest, each column tile read a prompt step's gathered rows from
    memory again: a layer of 16,384 tokens took 3.60 against 2.97 ms on the H100). Pair blocks:
    the block varies fastest (8 tokens: 177 against 210 us)."""
    program = tl.program_id(0)
    if PAIR_BLOCKS:
        num_blocks = tl.num_programs(0) // num_col_tiles
        block, col_tile = program % num_blocks, program // num_blocks
    else:
        block, col_tile = program // num_col_tiles, program % num_col_tiles
    expert = tl.load(block_experts_ptr + block)
    if PAIR_BLOCKS:
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, block, num_pairs)
    else:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return col_tile, expert, pairs, pairs < num_pairs


# bf16 activations multiply FP8 codes in fp16 divided by this (``in_fp16``): up to 2^24 in
# range (clamped past it), exact from 2^-6 up, within 2^-17 below
BF16_IN_FP16 = tl.constexpr(256.0)


# ``in_fp16`` in an asm block where it runs on the GPU, plainly in Triton's interpreter (the
# same values)
IN_FP16_IN_ASM = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def in_fp16(x):
    """``x`` (bf16, or float32 values of the model's bf16) in fp16, divided by ``BF16_IN_FP16``
    (a power of two: exact for bf16 values but the smallest) and clamped where fp16 would
    overflow. A bf16 tile on the GPU: an asm block the compiler keeps where ``x`` was loaded,
    two values at a time (a multiply by 2^-8 in bf16, two shifts into float32, a saturating
    conversion): as plain operations it moved them into the product's operand layout, where
    every warp converts the whole tile again."""
    if x.dtype == tl.bfloat16 and IN_FP16_IN_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 s, lo, hi, m, z; mov.b32 m, 0x3B803B80; mov.b32 z, 0x80008000; "
            "fma.rn.bf16x2 s, $1, m, z; shl.b32 lo, s, 16; and.b32 hi, s, 0xFFFF0000; "
            "cvt.rn.satfinite.f16x2.f32 $0, hi, lo; }",
            "=r,r", [x.to(tl.uint16, bitcast=True)], dtype=tl.float16, is_pure=False, pack=2)
    return tl.clamp(x.to(tl.float32) * (1.0 / BF16_IN_FP16), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _dequantized(codes, scales, col_ok, dtype: tl.constexpr):
    """A weight tile's e4m3 ``codes [BLOCK_K, BLOCK_N]`` times its columns' (the weight's rows')
    scales, from ``scales`` (one k-step lies within one group), rounded to ``dtype``: the
    reference's ``expert_matrix``, element for element."""
    scale = tl.load(scales, mask=col_ok, other=0.0)
    return (codes.to(tl.float32) * scale[None, :]).to(dtype)


@triton.jit
def _product_input(a, FP8_WEIGHTS: tl.constexpr, EXACT_CODES: tl.constexpr):
    """An activation tile as products with exact FP8 codes take it: bf16 ``in_fp16``, others
    as they are (codes convert exactly to fp16 and float32); for other weights, as it is."""
    if FP8_WEIGHTS:
        if EXACT_CODES:
            if a.dtype == tl.bfloat16:
                a = in_fp16(a)
    return a


@triton.jit
def _add_product(acc, a, codes, scales, col_ok, FP8_WEIGHTS: tl.constexpr,
                 ONE_GROUP: tl.constexpr, EXACT_CODES: tl.constexpr, UNSCALE: tl.constexpr):
    """``acc`` plus one k-step's product of activations ``a`` (``_product_input``'s) and a
    weight tile, whose rows' scales for this k-step are at ``scales``. Of FP8 codes: with
    ``EXACT_CODES`` the codes themselves in ``a``'s dtype (one conversion for every two codes
    into fp16; into bf16 only through float32, two more), the product scaled by the scales and
    ``UNSCALE`` (or, with ``ONE_GROUP``, the sums once: ``_times_scales``); else the codes
    dequantized to ``a``'s dtype first, as the reference does."""
    if FP8_WEIGHTS and EXACT_CODES:
        product = tl.dot(a, codes.to(a.dtype), input_precision="ieee")
        if ONE_GROUP:
            return acc + product
        return acc + _times_scales(product, scales, col_ok, UNSCALE)
    if FP8_WEIGHTS:
        codes = _dequantized(codes, scales, col_ok, a.dtype)
    return tl.dot(a, codes, acc, input_precision="ieee")


@triton.jit
def _times_scales(product, scales, col_ok, UNSCALE: tl.constexpr):
    """A product of exact codes (``_add_product``) times their columns' (the weight's rows')
    scales from ``scales`` and ``UNSCALE``."""
    return product * (tl.load(scales, mask=col_ok, other=0.0) * UNSCALE)[None, :]


@triton.jit(do_not_specialize=["num_pairs"])  # (as ``_align_kernel``'s)
def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs,
                    hidden, inter, x_stride, w_stride_e, w_stride_n, out_stride, scale_ptr,
                    scale_stride_e, scale_stride_n, scale_stride_g, group_size,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PAIR_BLOCKS: tl.constexpr, FP8_WEIGHTS: tl.constexpr,
                    ONE_GROUP: tl.constexpr, EXACT_CODES: tl.constexpr, OVERLAP: tl.constexpr):
    """A block of sorted pairs and a tile of intermediate columns (``_block``):
    ``silu(x @ gate.T) * (x @ up.T)`` of the block's expert, to the pairs' rows.
    ``FP8_WEIGHTS``: ``w13`` holds e4m3 codes, scaled by ``scale_ptr``'s groups of
    ``group_size`` columns (``ONE_GROUP``: a group a row), multiplied as ``_add_product`` says;
    else ``scale_ptr`` and its strides are not read. An fp16 ``out_ptr`` under bf16 ``x_ptr``
    takes the activations ``in_fp16`` (for FP8 down weights' exact codes)."""
    unscale: tl.constexpr = (BF16_IN_FP16 if EXACT_CODES and x_ptr.dtype.element_ty == tl.bfloat16
                             else 1.0)
    wait_for_previous(OVERLAP)
    col_tile, expert, pairs, pair_ok = _block(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                              tl.cdiv(inter, BLOCK_N), BLOCK_M, PAIR_BLOCKS)
    if expert < 0:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    weights = w13_ptr + expert.to(tl.int64) * w_stride_e
    scales = scale_ptr + expert.to(tl.int64) * scale_stride_e + cols * scale_stride_n
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
        a = _product_input(a, FP8_WEIGHTS, EXACT_CODES)
        gate_scales = scales + (k0 // group_size) * scale_stride_g
        gate = _add_product(gate, a, b_gate, gate_scales, col_ok, FP8_WEIGHTS, ONE_GROUP,
                            EXACT_CODES, unscale)
        up = _add_product(up, a, b_up, gate_scales + inter * scale_stride_n, col_ok, FP8_WEIGHTS,
                          ONE_GROUP, EXACT_CODES, unscale)
    if FP8_WEIGHTS and EXACT_CODES and ONE_GROUP:
        gate = _times_scales(gate, scales, col_ok, unscale)
        up = _times_scales(up, scales + inter * scale_stride_n, col_ok, unscale)
    activated = gate / (1.0 + tl.exp(-gate)) * up
    if out_ptr.dtype.element_ty == tl.float16 and x_ptr.dtype.element_ty == tl.bfloat16:
        activated = in_fp16(activated)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * out_stride + cols[None, :],
             activated.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(a_ptr, w2_ptr, out_ptr, routing_ptr, sorted_pairs_ptr, block_experts_ptr,
                 num_pairs, hidden, inter, a_stride, w_stride_e, w_stride_n, out_stride,
                 scale_ptr, scale_stride_e, scale_stride_n, scale_stride_g, group_size,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PAIR_BLOCKS: tl.constexpr, FP8_WEIGHTS: tl.constexpr, ONE_GROUP: tl.constexpr,
                 EXACT_CODES: tl.constexpr, OVERLAP: tl.constexpr):
    """A block of sorted pairs and a tile of hidden columns (``_block``):
    the block's expert's down projection of the pairs' activations, times their routing
    weights, to the pairs' rows. ``FP8_WEIGHTS``: as ``_gate_up_kernel``'s; fp16 activations
    under a bf16 ``out_ptr`` are ``in_fp16``'s."""
    unscale: tl.constexpr = (BF16_IN_FP16 if EXACT_CODES and out_ptr.dtype.element_ty == tl.bfloat16
                             else 1.0)
    wait_for_previous(OVERLAP)
    col_tile, expert, pairs, pair_ok = _block(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                              tl.cdiv(hidden, BLOCK_N), BLOCK_M, PAIR_BLOCKS)
    if expert < 0:
        return
    rows = pairs.to(tl.int64)
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    weights = w2_ptr + expert.to(tl.int64) * w_stride_e
    scales = scale_ptr + expert.to(tl.int64) * scale_stride_e + cols * scale_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + rows[:, None] * a_stride + ks[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(weights + cols[None, :] * w_stride_n + ks[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _add_product(acc, _product_input(a, FP8_WEIGHTS, EXACT_CODES), b,
                           scales + (k0 // group_size) * scale_stride_g, col_ok, FP8_WEIGHTS,
                           ONE_GROUP, EXACT_CODES, unscale)
    if FP8_WEIGHTS and EXACT_CODES and ONE_GROUP:
        acc = _times_scales(acc, scales, col_ok, unscale)
    routing = tl.load(routing_ptr + rows, mask=pair_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             (acc * routing[:, None]).to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_pairs_kernel(scaled_ptr, ids_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr, EXPERT_PARALLEL: tl.constexpr, OVERLAP: tl.constexpr):
    """Token ``program_id(0)``'s columns ``program_id(1) * BLOCK ...``: the sum of its ``TOP_K``
    scaled rows (contiguous, ``hidden`` wide), in float32 in order, rounded once;
    ``EXPERT_PARALLEL``: of those whose expert id is not -1 (the others were not computed)."""
    wait_for_previous(OVERLAP)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        ok = col_ok
        if EXPERT_PARALLEL:
            ok = ok & (tl.load(ids_ptr + token * TOP_K + j) >= 0)
        total += tl.load(scaled_ptr + (token * TOP_K + j) * hidden + cols, mask=ok,
                         other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


SUM_BLOCK = 1024  # columns a program of ``_sum_pairs_kernel`` adds up


@dataclass(frozen=True)
class GemmTiles:
    """A grouped GEMM's tiles besides ``block_m``: ``block_n`` output columns, ``block_k`` of
    the reduction at a time."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeTiles:
    """``block_m`` sorted pairs a block (both launches read one alignment), and each launch's
    other tiles."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles


# Measured on an H200 at Qwen3-30B-A3B's sizes (benchmarks/experiments/moe_tiles.py): the
# fastest tiles by pair count, each within a few percent of the best there.
TILES_BY_PAIRS = (
    (16, MoeTiles(16, GemmTiles(64, 128, 2, 4), GemmTiles(64, 256, 4, 3))),  # 1-2 tokens
    (64, MoeTiles(16, GemmTiles(32, 128, 2, 4), GemmTiles(64, 128, 2, 4))),
    (512, MoeTiles(16, GemmTiles(128, 128, 4, 3), GemmTiles(64, 128, 4, 4))),
    (2048, MoeTiles(32, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3))),
    (8192, MoeTiles(128, GemmTiles(128, 64, 8, 4), GemmTiles(128, 64, 8, 3))),
)
PROMPT_TILES = MoeTiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3))


SHARED_MEMORY_FOR_STAGES = 200 * 1024  # bytes, of an H100's 227 KB a block


def default_tiles(num_pairs: int, element_size: int = 2) -> MoeTiles:
    """Tiles for a step of ``num_pairs`` pairs: thin blocks and many programs for the few pairs
    of a decode step (little padding a used expert), larger blocks as pairs grow; with fewer
    pipeline stages where wider elements (float32) would not fit in shared memory."""
    tiles = next((tiles for most, tiles in TILES_BY_PAIRS if num_pairs <= most), PROMPT_TILES)
    return replace(tiles, gate_up=_fitting(tiles.gate_up, tiles.block_m, 2, element_size),
                   down=_fitting(tiles.down, tiles.block_m, 1, element_size))


def _fitting(tiles: GemmTiles, block_m: int, weight_tiles: int, element_size: int) -> GemmTiles:
    """``tiles`` with as many stages as fit: each holds a block of the input and
    ``weight_tiles`` of the weights (gate and up: two)."""
    stage = (block_m + weight_tiles * tiles.block_n) * tiles.block_k * element_size
    return replace(tiles, num_stages=max(1, min(tiles.num_stages,
                                                SHARED_MEMORY_FOR_STAGES // stage)))


def _fp8_tiles(tiles: GemmTiles, weights: torch.Tensor | Fp8Weight, k: int) -> GemmTiles:
    """``tiles`` for a product over ``k`` columns of ``weights``: of FP8 ones whose scales
    change along K, a ``block_k`` (a power of two) that divides their ``group_size``, the
    largest up to the tiles' own, so that a k-step's columns share one scale a row (group
    ``k0 // group_size``); of one group a row (per channel), any ``block_k``."""
    if not isinstance(weights, Fp8Weight) or weights.group_size >= k:
        return tiles
    block_k = math.gcd(tiles.block_k, weights.group_size)
    if block_k < 16:  # (tl.dot's least K)
        raise ValueError(f"FP8 experts' scale groups of {weights.group_size} columns: a k-step "
                         f"of the grouped GEMM takes 16 columns or more of one group")
    return replace(tiles, block_k=block_k)


# Tile rows up to which FP8 codes multiply exact (``_add_product``): a decode step's tiles,
# bound by the codes' conversions (a k-step of gate_up at 8 pairs 1,245 -> 595 instructions,
# of down 397 -> 226). A prompt's larger tiles dequantize the codes, which 128 rows amortise:
# scaling each k-step's product there kept a second pair of accumulators, which spilled.
EXACT_CODES_UP_TO_BLOCK_M = 32


def exact_codes(block_m: int) -> bool:
    """Whether FP8 experts' codes multiply exact in tiles of ``block_m`` rows."""
    return block_m <= EXACT_CODES_UP_TO_BLOCK_M


def _activations_dtype(dtype: torch.dtype, w2: torch.Tensor | Fp8Weight,
                       block_m: int) -> torch.dtype:
    """The gated activations' dtype between the two launches: fp16 (``in_fp16``) for FP8 down
    weights' exact codes under bf16, whose products are fp16's, else the model's."""
    fp16 = isinstance(w2, Fp8Weight) and exact_codes(block_m) and dtype == torch.bfloat16
    return torch.float16 if fp16 else dtype


def _one_group(weights: torch.Tensor | Fp8Weight, k: int) -> bool:
    """Whether FP8 ``weights`` have one scale a row over their ``k`` columns (per channel)."""
    return isinstance(weights, Fp8Weight) and weights.group_size >= k


def _weight_args(weights: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, tuple]:
    """A grouped GEMM's matrices, and its last arguments: their scales, the scales' strides and
    group size; of a plain tensor, dummies the kernel does not read (``FP8_WEIGHTS`` off)."""
    if isinstance(weights, Fp8Weight):
        return weights.data, (weights.scale, *weights.scale.stride(), weights.group_size)
    return weights, (weights, 0, 0, 0, 1)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor | Fp8Weight,
              w2: torch.Tensor | Fp8Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_parallel: bool = False, tiles: MoeTiles | None = None) -> torch.Tensor:
    """``moe.fused_moe``: ``hidden_states [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    ``topk_weights`` and ``topk_ids`` ``[T, k]``; returns ``[T, H]`` in the input's dtype.
    ``expert_parallel``: ids of -1 (another rank's experts) are left out (the alignment always
    leaves them out; with the flag the sum skips their unwritten rows). Either matrix may be an
    ``Fp8Weight`` (weight-only: see the module's docstring), its ``block_k`` then within one
    scale group (``_fp8_tiles``)."""
    num_tokens, hidden = hidden_states.shape
    (w13_data, w13_scales), (w2_data, w2_scales) = _weight_args(w13), _weight_args(w2)
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if hidden_states.stride(1) != 1 or w13_data.stride(2) != 1 or w2_data.stride(2) != 1:
        raise ValueError("fused_moe reads rows of the inputs and weights with unit stride")
    if num_pairs == 0:
        return hidden_states.new_zeros(num_tokens, hidden)
    tiles = tiles or default_tiles(num_pairs, hidden_states.element_size())
    aligned = align_pairs(topk_ids, num_experts, tiles.block_m)
    num_blocks = aligned.block_experts.numel()
    activated = hidden_states.new_empty(num_pairs, inter, dtype=_activations_dtype(
        hidden_states.dtype, w2, tiles.block_m))
    gate_up, down = _fp8_tiles(tiles.gate_up, w13, hidden), _fp8_tiles(tiles.down, w2, inter)
    overlap = _overlap(hidden_states.device, num_pairs)
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, gate_up.block_n),)](
        hidden_states, w13_data, activated, aligned.sorted_pairs, aligned.block_experts,
        num_pairs, hidden, inter, hidden_states.stride(0), w13_data.stride(0),
        w13_data.stride(1), activated.stride(0), *w13_scales, TOP_K=top_k,
        BLOCK_M=tiles.block_m, BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k,
        PAIR_BLOCKS=aligned.pair_blocks, FP8_WEIGHTS=isinstance(w13, Fp8Weight),
        ONE_GROUP=_one_group(w13, hidden), EXACT_CODES=exact_codes(tiles.block_m),
        num_warps=gate_up.num_warps, num_stages=gate_up.num_stages, **overlap)
    scaled = hidden_states.new_empty(num_pairs, hidden)
    routing = topk_weights.flatten().contiguous()
    _down_kernel[(num_blocks * triton.cdiv(hidden, down.block_n),)](
        activated, w2_data, scaled, routing, aligned.sorted_pairs, aligned.block_experts,
        num_pairs, hidden, inter, activated.stride(0), w2_data.stride(0), w2_data.stride(1),
        scaled.stride(0), *w2_scales, BLOCK_M=tiles.block_m, BLOCK_N=down.block_n,
        BLOCK_K=down.block_k, PAIR_BLOCKS=aligned.pair_blocks,
        FP8_WEIGHTS=isinstance(w2, Fp8Weight), ONE_GROUP=_one_group(w2, inter),
        EXACT_CODES=exact_codes(tiles.block_m), num_warps=down.num_warps,
        num_stages=down.num_stages, **overlap)
    out = hidden_states.new_empty(num_tokens, hidden)
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK))](
        scaled, topk_ids, out, hidden, TOP_K=top_k, BLOCK=SUM_BLOCK,
        EXPERT_PARALLEL=expert_parallel, num_warps=4, **overlap)
    return out
