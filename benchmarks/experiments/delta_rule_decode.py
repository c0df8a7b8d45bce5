"""A Gated DeltaNet layer's decode step at the Qwen3.5-9B shape (16 key and 32 value heads of
128, conv width 3, bf16 states in the slots' layout), between its projections: in one launch
(``gated_delta_net_decode``'s kernel) for each chunk of key rows and warp count, against the
four kernels it replaces (``in_steps``: the conv update, the gates, the delta rule with its
tile in registers, the gated norm), each checked against the torch reference once. The bytes moved
are the delta rule's states read and written (the conv states and inputs add ~1%).

Measured and dropped (RESULTS.md, twenty-second session): the delta rule's programs ordered by
sequence, cache hints, and persistent programs that prefetch their next state, all slower than
the tile held in registers; a chunk of rows in registers, in two passes, is what the fused
kernel keeps.

Usage: python benchmarks/experiments/delta_rule_decode.py [--seqs 16,256] [--layers 24]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

from nanofn.kernels import delta_rule, triton_linear_attention as linear

KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH = 16, 32, 128, 3
CHANNELS = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM


def inputs(num_seqs: int, layers: int):
    """The projection's columns, conv weight and gates' parameters, and both states' slots
    (one layer's strided views, as the runner passes them)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    value_dim = VALUE_HEADS * HEAD_DIM
    projected = torch.randn(num_seqs, CHANNELS + value_dim + 2 * VALUE_HEADS, generator=g,
                            device="cuda").bfloat16()
    mixed, z, a, b = projected.split([CHANNELS, value_dim, VALUE_HEADS, VALUE_HEADS], dim=-1)
    weight = torch.randn(CHANNELS, WIDTH + 1, generator=g, device="cuda").bfloat16() * 0.5
    a_log = torch.randn(VALUE_HEADS, generator=g, device="cuda")
    dt_bias = torch.randn(VALUE_HEADS, generator=g, device="cuda")
    norm_weight = (torch.rand(HEAD_DIM, generator=g, device="cuda") + 0.5).bfloat16()
    conv = torch.randn(num_seqs + 8, layers, CHANNELS, WIDTH, generator=g,
                       device="cuda").bfloat16()[:, layers // 2]
    ssm = (torch.randn(num_seqs + 8, layers, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=g,
                       device="cuda") * 0.1).bfloat16()[:, layers // 2]
    slots = torch.randperm(num_seqs + 8, generator=g, device="cuda")[:num_seqs]
    initial = torch.ones(num_seqs, dtype=torch.bool, device="cuda")
    return (mixed, a, b, z, weight, a_log, dt_bias, norm_weight, 1e-6), conv, ssm, slots, initial


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="256", help="sequence counts, comma-separated")
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    for n in map(int, args.seqs.split(",")):
        compare(n, args.layers)


def compare(n: int, layers: int) -> None:
    """Every candidate at ``n`` sequences."""
    first, conv, ssm, slots, initial = inputs(n, layers)
    saved_conv, saved_ssm = conv.clone(), ssm.clone()
    expected_conv, expected_ssm = conv.clone(), ssm.clone()
    expected = delta_rule.gated_delta_net_decode(*first, expected_conv, expected_ssm, slots,
                                                 initial)
    moved = 2 * n * VALUE_HEADS * HEAD_DIM * HEAD_DIM * 2
    candidates = {"four kernels": lambda: delta_rule.in_steps(
        linear.causal_conv1d_update, linear.delta_rule_gates, linear.gated_delta_rule_update,
        linear.rms_norm_gated, *first, conv, ssm, slots, initial)}
    for chunk in (16, 32, 64, 128):
        for warps in (1, 2, 4, 8):
            candidates[f"one launch, {chunk} rows a chunk, {warps} warps"] = (
                lambda chunk=chunk, warps=warps: one_launch(chunk, warps, first, conv, ssm,
                                                            slots, initial))
    print(f"{n} sequences, one layer, {moved / 1e9:.2f} GB of delta-rule state read and "
          f"written, {torch.cuda.get_device_name()}")
    for name, step in candidates.items():
        conv.copy_(saved_conv)
        ssm.copy_(saved_ssm)
        try:
            out = step()
        except Exception as failure:  # (a tile that does not compile or fit: reported, skipped)
            print(f"{name}: {type(failure).__name__}: {str(failure)[:160]}")
            continue
        error = max((out.float() - expected.float()).abs().max().item(),
                    (ssm.float() - expected_ssm.float()).abs().max().item())
        ms = do_bench(step)
        print(f"{name:<44} {ms * 1e3:8.1f} us {moved / ms / 1e6:8.0f} GB/s (error {error:.1e})")


def one_launch(chunk: int, warps: int, first, conv, ssm, slots, initial) -> torch.Tensor:
    """``gated_delta_net_decode``'s kernel with ``DECODE_TILES`` set to ``(chunk, warps)``."""
    saved, linear.DECODE_TILES = linear.DECODE_TILES, (chunk, warps)
    try:
        return linear.gated_delta_net_decode(*first, conv, ssm, slots, initial)
    finally:
        linear.DECODE_TILES = saved


if __name__ == "__main__":
    main()
