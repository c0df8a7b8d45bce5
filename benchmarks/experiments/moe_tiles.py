"""The fused MoE kernels' tiles at the Qwen3-30B-A3B shape (128 experts of 768, top 8, hidden
2,048, bf16; each overridable), each of the two grouped GEMMs on its own, for steps of 1 to
16,384 tokens routed uniformly at random: per token count, every candidate's time, and the
bytes of the experts the step touches per second and the FLOP/s, best first. Each candidate is
checked against the torch reference once before it is timed.

With ``--fp8 block|channel``: the experts in FP8 (e4m3, weight-only: the activations stay in
bf16), quantized as a checkpoint holds them, with a scale per 128x128 block (Qwen3-30B-A3B-FP8)
or per row (``--quantization=fp8``); each candidate's ``block_k`` is cut to a scale group as
``fused_moe`` cuts it (``_fp8_tiles``), and a decode step's candidates include more warps and
thinner column tiles (each weight element is dequantized in registers: more threads a tile).

With ``--pair-blocks``: instead, a whole layer's experts (``fused_moe`` from a CUDA graph) at a
few tokens, each pair its own block against the pairs aligned by expert in one launch.

With ``--check-only``: every candidate checked against the reference, nothing timed; on CPU,
under ``TRITON_INTERPRET=1`` with small ``--experts --hidden --inter`` and ``--dtype float16``
(the interpreter's bf16 ``tl.dot`` is wrong), a smoke test of every candidate's launch.

Usage: python benchmarks/experiments/moe_tiles.py [--tokens 1,8,64,256,1024,8192]
    [--fp8 block|channel] [--pair-blocks]
Smoke (every candidate space): TRITON_INTERPRET=1 python benchmarks/experiments/moe_tiles.py
    --check-only --tokens 1,16,40,1025 --experts 4 --top-k 2 --hidden 256 --inter 256
    --dtype float16 [--fp8 block|channel]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton
import triton.runtime.errors
from triton.testing import do_bench

from nanofn.kernels import moe, triton_moe
from nanofn.kernels.fp8 import Fp8Weight
from nanofn.kernels.triton_moe import (AlignedPairs, GemmTiles, _activations_dtype, _down_kernel,
                                       _fp8_tiles, _gate_up_kernel, _one_group, _weight_args,
                                       align_pairs, exact_codes)
from nanofn.model.quantization import Fp8Scheme

Weights = torch.Tensor | Fp8Weight
Candidate = tuple[int, int, int, int, int]  # block_m, block_n, block_k, warps, stages


def candidates(num_pairs: int, fp8: bool) -> Iterator[Candidate]:
    """Candidates worth timing for a step of ``num_pairs``: a decode step's few pairs want thin
    blocks and many programs (FP8 ones also more warps, and column tiles down to 16), a
    prompt's many pairs the largest tiles that fit."""
    if num_pairs <= 64:
        if fp8:
            space = ((16,), (16, 32, 64, 128), (128, 256), (2, 4, 8), (3, 4))
        else:
            space = ((16,), (32, 64, 128), (128, 256), (2, 4), (3, 4))
    elif num_pairs <= 2048:
        space = ((16, 32, 64), (64, 128), (64, 128), (4,), (3, 4))
    else:
        space = ((64, 128), (128, 256), (64,), (4, 8), (3, 4))
    return itertools.product(*space)


def gate_up(x: torch.Tensor, w13: Weights, w2: Weights, aligned: AlignedPairs, num_pairs: int,
            tiles: GemmTiles) -> torch.Tensor:
    """``_gate_up_kernel`` as ``fused_moe`` launches it, in ``tiles`` (FP8: already cut)."""
    data, scale_args = _weight_args(w13)
    hidden, inter = x.shape[1], data.shape[1] // 2
    out = x.new_empty(num_pairs, inter, dtype=_activations_dtype(x.dtype, w2, aligned.block_m))
    grid = (aligned.block_experts.numel() * triton.cdiv(inter, tiles.block_n),)
    _gate_up_kernel[grid](x, data, out, aligned.sorted_pairs, aligned.block_experts, num_pairs,
                          hidden, inter, x.stride(0), data.stride(0), data.stride(1),
                          out.stride(0), *scale_args, TOP_K=num_pairs // x.shape[0],
                          BLOCK_M=aligned.block_m, BLOCK_N=tiles.block_n,
                          BLOCK_K=tiles.block_k, PAIR_BLOCKS=aligned.pair_blocks,
                          FP8_WEIGHTS=isinstance(w13, Fp8Weight),
                          ONE_GROUP=_one_group(w13, hidden),
                          EXACT_CODES=exact_codes(aligned.block_m), OVERLAP=False,
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def down(activated: torch.Tensor, w2: Weights, routing: torch.Tensor, aligned: AlignedPairs,
         num_pairs: int, tiles: GemmTiles) -> torch.Tensor:
    """``_down_kernel`` as ``fused_moe`` launches it, in ``tiles`` (FP8: already cut); its
    output in the routing weights' dtype, the model's."""
    data, scale_args = _weight_args(w2)
    hidden, inter = data.shape[1], activated.shape[1]
    out = activated.new_empty(num_pairs, hidden, dtype=routing.dtype)
    grid = (aligned.block_experts.numel() * triton.cdiv(hidden, tiles.block_n),)
    _down_kernel[grid](activated, data, out, routing, aligned.sorted_pairs,
                       aligned.block_experts, num_pairs, hidden, inter, activated.stride(0),
                       data.stride(0), data.stride(1), out.stride(0), *scale_args,
                       BLOCK_M=aligned.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                       PAIR_BLOCKS=aligned.pair_blocks, FP8_WEIGHTS=isinstance(w2, Fp8Weight),
                       ONE_GROUP=_one_group(w2, inter), EXACT_CODES=exact_codes(aligned.block_m),
                       OVERLAP=False, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def fp8_experts(weights: torch.Tensor, scales: str) -> Fp8Weight:
    """Stacked ``weights [E, N, K]`` in FP8 as a checkpoint of ``scales`` ("block": 128x128
    blocks, "channel": a row) holds them, quantized expert by expert by ``Fp8Scheme``."""
    scheme = Fp8Scheme(f"{scales} scales", scales)
    codes, row_scales = zip(*(scheme.quantize(expert) for expert in weights))
    return Fp8Weight(torch.stack(codes), torch.stack(row_scales),
                     scheme.group_size(weights.shape[-1]))


def expert_bytes(weights: Weights) -> int:
    """The bytes one expert's matrix takes to read, its scales included."""
    if isinstance(weights, Fp8Weight):
        return weights.data[0].nbytes + weights.scale[0].nbytes
    return weights[0].nbytes


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


def routed(tokens: int, args: argparse.Namespace, g: torch.Generator):
    """Random activations in ``args.dtype`` and uniformly random routing: ``x, weights, ids``."""
    x = torch.randn(tokens, args.hidden, device=g.device, generator=g).to(args.dtype)
    logits = torch.randn(tokens, args.experts, device=g.device, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    return x, weights, ids


def compare_pair_blocks(w13, w2, args, g) -> None:
    for tokens in [1, 2, 4, 8, 12, 16, 24]:
        x, weights, ids = routed(tokens, args, g)
        weights = weights.to(args.dtype)
        aligned = graphed_layer_us(x, w13, w2, weights, ids, 0)
        paired = graphed_layer_us(x, w13, w2, weights, ids, tokens)
        print(f"{tokens:>3} tokens ({ids.unique().numel():>3} experts): aligned {aligned:6.1f} us, "
              f"pair blocks {paired:6.1f} us")


def sweep(tokens: int, w13: Weights, w2: Weights, args: argparse.Namespace,
          g: torch.Generator) -> None:
    """Every candidate of a step of ``tokens`` checked against the reference, and (unless
    ``args.check_only``) each launch's distinct tiles timed, the fastest printed."""
    x, weights, ids = routed(tokens, args, g)
    num_pairs, routing = tokens * args.top_k, weights.flatten().contiguous()
    expected = moe.fused_moe(x, w13, w2, weights, ids)
    seen: set[tuple[str, int, GemmTiles]] = set()  # (launch, block_m, tiles) checked
    timed: dict[str, list[tuple[float, int, GemmTiles]]] = {"gate_up": [], "down": []}
    for block_m, *tile in candidates(num_pairs, isinstance(w13, Fp8Weight)):
        tiles = GemmTiles(*tile)
        gate_up_tiles = _fp8_tiles(tiles, w13, args.hidden)
        down_tiles = _fp8_tiles(tiles, w2, args.inter)
        if {("gate_up", block_m, gate_up_tiles), ("down", block_m, down_tiles)} <= seen:
            continue  # (both cut to tiles already checked)
        aligned = align_pairs(ids, args.experts, block_m)
        try:
            activated = gate_up(x, w13, w2, aligned, num_pairs, gate_up_tiles)
            scaled = down(activated, w2, routing, aligned, num_pairs, down_tiles)
        except triton.runtime.errors.OutOfResources:
            continue  # (its stages do not fit in shared memory)
        got = scaled.view(tokens, args.top_k, args.hidden).sum(1, dtype=torch.float32)
        torch.testing.assert_close(got.to(x.dtype), expected, atol=3e-2, rtol=3e-2)
        launches: dict[str, tuple[GemmTiles, Callable[[], torch.Tensor]]] = {
            "gate_up": (gate_up_tiles, lambda: gate_up(x, w13, w2, aligned, num_pairs,
                                                       gate_up_tiles)),
            "down": (down_tiles, lambda: down(activated, w2, routing, aligned, num_pairs,
                                              down_tiles))}
        for name, (used, launch) in launches.items():
            if (name, block_m, used) not in seen:
                seen.add((name, block_m, used))
                if not args.check_only:
                    timed[name].append((do_bench(launch), block_m, used))
    if args.check_only:
        print(f"{tokens:>6} tokens: {len(seen)} launches' tiles match the reference")
        return
    touched = ids.unique().numel()
    flops = 2 * num_pairs * 2 * args.inter * args.hidden  # gate_up's; down does half
    for name, weights_read, work in (("gate_up", w13, flops), ("down", w2, flops / 2)):
        read = expert_bytes(weights_read) * touched
        for ms, block_m, t in sorted(timed[name], key=lambda result: result[0])[: args.show]:
            print(f"{tokens:>6} tokens ({touched:>3} experts) {name:>7} m{block_m} n{t.block_n} "
                  f"k{t.block_k} w{t.num_warps} s{t.num_stages}: {ms * 1e3:7.1f} us "
                  f"{read / ms / 1e9:5.2f} TB/s {work / ms / 1e9:6.0f} TFLOP/s")
    aligned_ms = do_bench(lambda: align_pairs(ids, args.experts, 16))
    print(f"{tokens:>6} tokens: align_pairs {aligned_ms * 1e3:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,256,1024,8192")
    ap.add_argument("--show", type=int, default=4, help="candidates shown per kernel and size")
    ap.add_argument("--pair-blocks", action="store_true")
    ap.add_argument("--fp8", choices=["block", "channel"],
                    help="FP8 experts: 128x128 block scales or one a row")
    ap.add_argument("--check-only", action="store_true",
                    help="check every candidate against the reference, time nothing")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.check_only and os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("without a GPU only --check-only runs, under TRITON_INTERPRET=1")
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from triton_interpreter import prepare_interpreter_process

        prepare_interpreter_process()  # (numpy 2.4's fix; outputs start as NaN)
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.inter, args.hidden, device=device, generator=g)
    w2 = torch.randn(args.experts, args.hidden, args.inter, device=device, generator=g)
    w13, w2 = (w13 * args.hidden ** -0.5).to(args.dtype), (w2 * args.inter ** -0.5).to(args.dtype)
    if args.fp8:
        w13, w2 = fp8_experts(w13, args.fp8), fp8_experts(w2, args.fp8)
    print(torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter)",
          f"FP8 experts, {args.fp8} scales" if args.fp8 else "")
    if args.pair_blocks:
        compare_pair_blocks(w13, w2, args, g)
        return
    for tokens in map(int, args.tokens.split(",")):
        sweep(tokens, w13, w2, args, g)


if __name__ == "__main__":
    main()
