"""The delta rule's decode step at the Qwen3.5-9B shape (32 value heads, 16 key heads, 128 x 128
bf16 states in the slots' layout): ``_delta_rule_kernel`` for each tile width and warp count,
against an in-place pass over the same bytes (the copy bandwidth), outputs checked against the
kernel as nanofn launches it. Then variants of the same arithmetic (``_variant_kernel``): the
programs ordered with a sequence's whole state read by neighbouring programs (not each program
another sequence's), streaming cache hints, and persistent programs that load their next state
while they compute on the current one.

Usage: python benchmarks/experiments/delta_rule_decode.py [--seqs 256] [--layers 24]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from nanofn.kernels.delta_rule import L2_NORM_EPS
from nanofn.kernels.triton_linear_attention import _delta_rule_kernel, gated_delta_rule_update


@triton.jit
def _item_place(item, num_seqs, HEADS: tl.constexpr, NUM_VB: tl.constexpr,
                SEQ_MAJOR: tl.constexpr):
    """Item ``item``'s (sequence, value head, value block)."""
    if SEQ_MAJOR:  # nanofn's grid: the sequence varies fastest
        return item % num_seqs, (item // num_seqs) % HEADS, item // (num_seqs * HEADS)
    return item // (HEADS * NUM_VB), (item // NUM_VB) % HEADS, item % NUM_VB


@triton.jit
def _item_tile(item, num_seqs, num_items, slots_ptr, initial_ptr, states_ptr, state_slot_stride,
               state_head_stride, state_k_stride, state_v_stride, HEADS: tl.constexpr,
               DK: tl.constexpr, BLOCK_V: tl.constexpr, NUM_VB: tl.constexpr,
               SEQ_MAJOR: tl.constexpr):
    seq, head, vb = _item_place(item, num_seqs, HEADS, NUM_VB, SEQ_MAJOR)
    ok = item < num_items
    slot = tl.load(slots_ptr + seq, mask=ok, other=0).to(tl.int64)
    initial = tl.load(initial_ptr + seq, mask=ok, other=0) != 0
    values = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, DK)
    tile = (states_ptr + slot * state_slot_stride + head * state_head_stride
            + keys[:, None] * state_k_stride + values[None, :] * state_v_stride)
    return tile, initial & ok


@triton.jit
def _variant_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, out_ptr, slots_ptr,
                    initial_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t,
                    v_stride_h, gb_stride_t, out_stride_t, out_stride_h, state_slot_stride,
                    state_head_stride, state_k_stride, state_v_stride, eps, scale, num_seqs,
                    num_items, GROUP: tl.constexpr, HEADS: tl.constexpr, DK: tl.constexpr,
                    DV: tl.constexpr, BLOCK_V: tl.constexpr, SEQ_MAJOR: tl.constexpr,
                    HINTS: tl.constexpr, PREFETCH: tl.constexpr):
    """``_delta_rule_kernel``'s decode step over items (sequence, head, value block), a program
    taking items ``program_id(0)``, then every ``num_programs(0)``-th."""
    NUM_VB: tl.constexpr = DV // BLOCK_V
    keys = tl.arange(0, DK)
    step = tl.num_programs(0)
    first = tl.program_id(0)
    tile, live = _item_tile(first, num_seqs, num_items, slots_ptr, initial_ptr, states_ptr,
                            state_slot_stride, state_head_stride, state_k_stride, state_v_stride,
                            HEADS, DK, BLOCK_V, NUM_VB, SEQ_MAJOR)
    if HINTS:
        upcoming = tl.load(tile, mask=live, other=0.0, eviction_policy="evict_first")
    else:
        upcoming = tl.load(tile, mask=live, other=0.0)
    for item in range(first, num_items, step):
        seq, head, vb = _item_place(item, num_seqs, HEADS, NUM_VB, SEQ_MAJOR)
        tile, live = _item_tile(item, num_seqs, num_items, slots_ptr, initial_ptr, states_ptr,
                                state_slot_stride, state_head_stride, state_k_stride,
                                state_v_stride, HEADS, DK, BLOCK_V, NUM_VB, SEQ_MAJOR)
        if PREFETCH:
            state = upcoming.to(tl.float32)
            next_tile, next_live = _item_tile(
                item + step, num_seqs, num_items, slots_ptr, initial_ptr, states_ptr,
                state_slot_stride, state_head_stride, state_k_stride, state_v_stride, HEADS, DK,
                BLOCK_V, NUM_VB, SEQ_MAJOR)
            if HINTS:
                upcoming = tl.load(next_tile, mask=next_live, other=0.0,
                                   eviction_policy="evict_first")
            else:
                upcoming = tl.load(next_tile, mask=next_live, other=0.0)
        else:
            if item == first:
                state = upcoming.to(tl.float32)
            else:
                state = tl.load(tile, mask=live, other=0.0).to(tl.float32)
        values = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        key_head = head // GROUP
        q = tl.load(q_ptr + seq * q_stride_t + key_head * q_stride_h + keys).to(tl.float32)
        k = tl.load(k_ptr + seq * k_stride_t + key_head * k_stride_h + keys).to(tl.float32)
        v = tl.load(v_ptr + seq * v_stride_t + head * v_stride_h + values).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + seq * gb_stride_t + head).to(tl.float32))
        beta = tl.load(beta_ptr + seq * gb_stride_t + head).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + eps)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)
        state += k[:, None] * ((v - predicted) * beta)[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + values,
                 out.to(out_ptr.dtype.element_ty))
        if HINTS:
            tl.store(tile, state.to(states_ptr.dtype.element_ty), cache_modifier=".cs")
        else:
            tl.store(tile, state.to(states_ptr.dtype.element_ty))


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
    for block_v in (16, 32, 64, 128):
        for warps in (1, 2, 4, 8, 16):
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
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for block_v, warps in ((64, 4), (64, 2), (128, 4), (128, 8), (32, 2), (32, 4)):
        num_items = n * heads * (dv // block_v)
        for seq_major, hints, programs_per_sm, prefetch in (
                (True, False, 0, False), (False, False, 0, False), (False, True, 0, False),
                (False, False, 4, False), (False, False, 4, True), (False, False, 8, True),
                (False, True, 4, True), (False, False, 2, True), (False, False, 16, True)):
            grid = min(num_items, sms * programs_per_sm) if programs_per_sm else num_items
            out = torch.empty_like(v)

            def launch():
                _variant_kernel[(grid,)](
                    q, k, v, g, beta, states, out, slots, initial, q.stride(0), q.stride(1),
                    k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
                    out.stride(0), out.stride(1), *states.stride(), L2_NORM_EPS, dk ** -0.5, n,
                    num_items, GROUP=heads // key_heads, HEADS=heads, DK=dk, DV=dv,
                    BLOCK_V=block_v, SEQ_MAJOR=seq_major, HINTS=hints, PREFETCH=prefetch,
                    num_warps=warps)

            states.copy_(saved)
            try:
                launch()
            except Exception as failure:  # (a variant that does not compile: reported, skipped)
                print(f"V{block_v} w{warps} {seq_major} {hints} {programs_per_sm} {prefetch}: "
                      f"{type(failure).__name__}: {str(failure)[:200]}")
                continue
            error = max((out.float() - expected.float()).abs().max().item(),
                        (states.float() - expected_states.float()).abs().max().item())
            ms = do_bench(launch)
            name = (f"V{block_v} w{warps} {'seq-major' if seq_major else 'item-major'}"
                    f"{' hints' if hints else ''}"
                    f"{f' {programs_per_sm}/SM' if programs_per_sm else ''}"
                    f"{' prefetch' if prefetch else ''} (error {error:.1e})")
            rows.append((name, ms, moved / ms / 1e6))
    print(f"{n} sequences, one layer, {moved / 1e9:.2f} GB read and written, "
          f"{torch.cuda.get_device_name()}")
    for name, ms, rate in rows:
        print(f"{name:<48} {ms * 1e3:8.1f} us {rate:8.0f} GB/s")


if __name__ == "__main__":
    main()
