"""A prompt's short causal convolution at the Qwen3.5-9B shape (8,192 channels, 4 taps, the
input a strided view of the layer's projection, as the model passes it): nanofn's kernel
(``_conv_kernel``: each program walks its tokens in order, the last three inputs in registers)
in each tile size and warp count, then the decode step's update kernel by channel block. Each
variant's output and new states are checked against the torch reference first. (The kernel it
replaced, a tile of tokens by channels with every tap a masked load, took 536-717 us on an
H200 where this one takes 274: RESULTS.md, 2026-11-27.)

Usage: python benchmarks/experiments/conv_prefill.py [--prompts 29] [--prompt-len 560]
       [--decode-seqs 256]
       TRITON_INTERPRET=1 python benchmarks/experiments/conv_prefill.py --check  (CPU, small)
"""

from __future__ import annotations

import argparse
import os

import torch
import triton

from nanofn.kernels import causal_conv
from nanofn.kernels.triton_linear_attention import (_conv_kernel, _conv_state_kernel,
                                                    _conv_update_kernel)

PARTS = (2048, 2048, 4096)  # q, k, v


def conv(x, weight, states, query_start, slots, initial, block_t, block_c, warps, parts):
    """``causal_conv1d`` in the chosen tiles (the state kernel as nanofn's): its output's parts
    end to end, flat."""
    num_tokens, channels = x.shape
    starts, ends = query_start[:-1].contiguous(), query_start[1:].contiguous()
    seq_of_token = torch.searchsorted(ends.long(), torch.arange(num_tokens, device=x.device),
                                      right=True).clamp_(max=len(slots) - 1)
    out = x.new_empty(num_tokens * channels)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
    _conv_kernel[grid](x, weight, states, out, seq_of_token, starts, slots, initial, num_tokens,
                       channels, parts[0], 0, x.stride(0), *states.stride(), BLOCK_T=block_t,
                       BLOCK_C=block_c, num_warps=warps)
    _conv_state_kernel[(len(slots), triton.cdiv(channels, 64))](
        x, states, starts, ends, slots, initial, channels, x.stride(0), *states.stride(),
        WIDTH=3, WIDTH_P2=4, BLOCK_C=64)
    return out


def update(x, weight, states, slots, initial, block_c, warps):
    out = torch.empty_like(x)
    _conv_update_kernel[(len(slots), triton.cdiv(x.shape[1], block_c))](
        x, weight, states, out, slots, initial, x.shape[1], x.stride(0), out.stride(0),
        *states.stride(), WIDTH=3, BLOCK_C=block_c, num_warps=warps)
    return out


def inputs(lengths, channels, device, dtype):
    """A strided ``x`` (the projection's first ``channels`` columns), weights, states of 4
    layers (layer 1 passed), slots out of order, every other sequence resuming."""
    g = torch.Generator(device="cpu").manual_seed(0)
    num_seqs, tokens = len(lengths), sum(lengths)
    projected = torch.randn(tokens, channels + 320, generator=g).to(device, dtype)
    x = projected[:, :channels]
    weight = torch.randn(channels, 4, generator=g).to(device, dtype)
    states = torch.randn(num_seqs + 3, 4, channels, 3, generator=g).to(device, dtype)
    slots = torch.randperm(num_seqs + 3, generator=g)[:num_seqs].to(device)
    initial = (torch.arange(num_seqs) % 2 == 0).to(device)
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                               dtype=torch.int32, device=device)
    return x, weight, states, query_start, slots, initial


def check(variant, lengths, channels, device, dtype, tolerance):
    """The variant's output and new states against the torch reference."""
    x, weight, states, query_start, slots, initial = inputs(lengths, channels, device, dtype)
    expected_states = states.clone()
    expected = causal_conv.causal_conv1d(x, weight, expected_states[:, 1], query_start, slots,
                                         initial, (channels,))[0]
    out = conv(x, weight, states[:, 1], query_start, slots, initial, *variant, (channels,))
    torch.testing.assert_close(out.view_as(expected), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(states, expected_states, atol=tolerance, rtol=tolerance)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=29)
    ap.add_argument("--prompt-len", type=int, default=560)
    ap.add_argument("--decode-seqs", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="correctness only, small (CPU)")
    args = ap.parse_args()
    if args.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--check runs in Triton's interpreter: TRITON_INTERPRET=1")
        for variant in ((16, 256, 2), (4, 64, 1), (8, 32, 1)):
            check(variant, [1, 2, 5, 13, 3], 96, "cpu", torch.float32, 1e-5)
        print("every variant matches the reference")
        return
    from triton.testing import do_bench

    lengths = [args.prompt_len] * args.prompts
    channels, tokens = 8192, sum(lengths)
    moved = 2 * tokens * channels * 2  # read x, write out (bf16)
    x, weight, states, query_start, slots, initial = inputs(lengths, channels, "cuda",
                                                            torch.bfloat16)
    print(f"{args.prompts} x {args.prompt_len} tokens, {channels} channels: "
          f"{moved / 1e6:.0f} MB read and written, {torch.cuda.get_device_name()}")
    variants = [(t, c, w) for t in (16, 32, 64, 128) for c in (128, 256, 512, 1024)
                for w in (1, 2, 4) if c // (32 * w) >= 1]
    for variant in variants:
        check(variant, [3, 70, 1, 200], channels, "cuda", torch.bfloat16, 2e-2)
        layer = states[:, 1]
        ms = do_bench(lambda: conv(x, weight, layer, query_start, slots, initial, *variant,
                                   PARTS))
        print(f"BLOCK_T {variant[0]:>3} BLOCK_C {variant[1]:>4} {variant[2]} warps "
              f"{ms * 1e3:8.1f} us {moved / ms / 1e6:6.0f} GB/s")
    n = args.decode_seqs
    x = torch.randn(n, channels + 320, device="cuda", dtype=torch.bfloat16)[:, :channels]
    states = torch.randn(n + 3, 24, channels, 3, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(n + 3, device="cuda")[:n]
    initial = torch.ones(n, dtype=torch.bool, device="cuda")
    moved = n * channels * 2 * (2 + 2 * 3)  # x in, out, the state's taps read and written
    for block_c in (128, 256, 512, 1024):
        for warps in (1, 2, 4, 8):
            if block_c // (32 * warps) < 1:
                continue
            ms = do_bench(lambda: update(x, weight, states[:, 5], slots, initial, block_c, warps))
            print(f"update, {n} sequences, BLOCK_C {block_c:>4} {warps} warps "
                  f"{ms * 1e3:8.1f} us {moved / ms / 1e6:6.0f} GB/s")


if __name__ == "__main__":
    main()
