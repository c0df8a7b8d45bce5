"""The delta rule's decode step at the Qwen3.5-9B shape (32 value heads, 16 key heads, 128 x 128
bf16 states in the slots' layout): ``_delta_rule_kernel`` for each tile width and warp count,
against an in-place pass over the same bytes (the copy bandwidth), outputs checked against the
kernel as nanofn launches it; then ``_delta_rule_decode_kernel`` (two passes over the state's
rows, a chunk of them in registers rather than the whole tile) for each tile width, chunk and
warp count. (Measured and dropped, RESULTS.md, twenty-second session: programs ordered by
sequence, cache hints, persistent programs prefetching their next state.)

Usage: python benchmarks/experiments/delta_rule_decode.py [--seqs 256] [--layers 24]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

from nanofn.kernels.delta_rule import L2_NORM_EPS
from nanofn.kernels.triton_linear_attention import (_delta_rule_decode_kernel, _delta_rule_kernel,
                                                    gated_delta_rule_update)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    n, heads, key_heads, dk, dv = args.seqs, 32, 16, 128, 128
    torch.manual_seed(0)
    dev = "cuda"
    slots_all = torch.randn(n + 8, args.layers, heads, dk, dv, device=dev, dtype=torch.bfloat16)
    states = slots_all[:, args.layers // 2]  # one layer's strided view, as the runner passes it
    slots = torch.randperm(n + 8, device=dev)[:n].int()
    initial = torch.ones(n, dtype=torch.bool, device=dev)
    q = torch.randn(n, key_heads, dk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, key_heads, dk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, heads, dv, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(n, heads, device=dev) * 0.1
    beta = torch.rand(n, heads, device=dev, dtype=torch.bfloat16)
    moved = 2 * n * heads * dk * dv * 2  # bytes read and written

    saved = states.clone()
    expected = gated_delta_rule_update(q, k, v, g, beta, states, slots, initial)
    expected_states = states.clone()
    rows = []
    ms = do_bench(lambda: states.mul_(1.0))
    whole = 2 * states.numel() * 2
    rows.append(("in-place pass over the layer (all slots)", ms, whole / ms / 1e6))
    for block_v in (32, 64, 128):
        for warps in (2, 4, 8):
            if block_v * dk // (32 * warps) > 256 or block_v * dk // (32 * warps) < 4:
                continue
            out = torch.empty_like(v)

            def launch():
                _delta_rule_kernel[(n, heads, triton.cdiv(dv, block_v))](
                    q, k, v, g, beta, states, out, slots, slots, initial, q.stride(0),
                    q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    g.stride(0), out.stride(0), out.stride(1), *states.stride(), L2_NORM_EPS,
                    dk ** -0.5, GROUP=heads // key_heads, DK=dk, DV=dv, BLOCK_V=block_v,
                    ONE_TOKEN=True, num_warps=warps)

            states.copy_(saved)
            launch()
            error = max((out.float() - expected.float()).abs().max().item(),
                        (states.float() - expected_states.float()).abs().max().item())
            ms = do_bench(launch)
            rows.append((f"BLOCK_V {block_v:>3}, {warps:>2} warps (error {error:.1e})", ms,
                         moved / ms / 1e6))
    for block_v, chunk_k, warps in itertools.product((32, 64, 128), (16, 32, 64), (1, 2, 4)):
        out = torch.empty_like(v)

        def launch():
            _delta_rule_decode_kernel[(heads, n, dv // block_v)](
                q, k, v, g, beta, states, out, slots, initial, q.stride(0), q.stride(1),
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0),
                out.stride(1), *states.stride(), L2_NORM_EPS, dk ** -0.5,
                GROUP=heads // key_heads, DK=dk, DV=dv, BLOCK_V=block_v, CHUNK_K=chunk_k,
                num_warps=warps)

        states.copy_(saved)
        launch()
        error = max((out.float() - expected.float()).abs().max().item(),
                    (states.float() - expected_states.float()).abs().max().item())
        ms = do_bench(launch)
        rows.append((f"two passes V{block_v} K{chunk_k} w{warps} (error {error:.1e})", ms,
                     moved / ms / 1e6))
    print(f"{n} sequences, one layer, {moved / 1e9:.2f} GB read and written, "
          f"{torch.cuda.get_device_name()}")
    for name, ms, rate in rows:
        print(f"{name:<48} {ms * 1e3:8.1f} us {rate:8.0f} GB/s")


if __name__ == "__main__":
    main()
