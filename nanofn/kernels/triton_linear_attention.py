"""Triton kernels of a Gated DeltaNet layer's recurrent parts, with the signatures and contracts
of the torch references in ``causal_conv.py`` and ``delta_rule.py``: the short causal
convolution (a prompt chunk, and the decode step's update in place), the delta rule's gates,
its decode step in place in the state slots, and the gated output norm; a decode step of many
sequences takes all four in one launch (``gated_delta_net_decode``). A prompt chunk's delta rule is
flash-linear-attention's chunked kernel (``fla_delta_rule``), the states gathered from their
slots and scattered back.

Every kernel reads and writes the states through their strides, so one layer of a
``RecurrentState`` (a strided view) is updated where it lies; a sequence whose
``has_initial_state`` is False starts from zeros, whatever its slot holds.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from nanofn.kernels.delta_rule import L2_NORM_EPS, gated_delta_rule, in_steps


# --- the short convolution ---------------------------------------------------------------------

@triton.jit
def _conv_kernel(x_ptr, weight_ptr, states_ptr, out_ptr, seq_of_token_ptr, starts_ptr,
                 slots_ptr, initial_ptr, num_tokens, channels, part0, part1, x_stride,
                 state_slot_stride, state_channel_stride, state_tap_stride,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``silu(conv(x))`` of the tokens ``program_id(0) * BLOCK_T ...`` in order, for ``BLOCK_C``
    channels, 4 taps: the three inputs before a token ride along in registers (every input is
    read once), taken from the sequence's conv state (or zeros) where a sequence starts. The
    output is ``out_ptr``'s three parts end to end, channels ``[0, part0)``, ``[part0, part0 +
    part1)`` and the rest, each ``[num_tokens, its channels]``."""
    first = tl.program_id(0) * BLOCK_T
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = channels_ < channels
    in_part1, in_part2 = channels_ >= part0, channels_ >= part0 + part1
    part_start = tl.where(in_part2, part0 + part1, tl.where(in_part1, part0, 0))
    part_width = tl.where(in_part2, channels - part0 - part1, tl.where(in_part1, part1, part0))
    out = out_ptr + part_start.to(tl.int64) * num_tokens + channels_ - part_start
    w0 = tl.load(weight_ptr + channels_ * 4 + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + channels_ * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + channels_ * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(weight_ptr + channels_ * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    seq = tl.load(seq_of_token_ptr + first)
    start = tl.load(starts_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(initial_ptr + seq) != 0
    state = states_ptr + slot * state_slot_stride + channels_ * state_channel_stride
    h1 = _input_before(x_ptr, state, first, 3, start, initial, channels_, ok, x_stride,
                       state_tap_stride)
    h2 = _input_before(x_ptr, state, first, 2, start, initial, channels_, ok, x_stride,
                       state_tap_stride)
    h3 = _input_before(x_ptr, state, first, 1, start, initial, channels_, ok, x_stride,
                       state_tap_stride)
    for step in range(BLOCK_T):
        token = first + step
        live = token < num_tokens
        seq = tl.load(seq_of_token_ptr + token, mask=live, other=0)
        fresh = (tl.load(starts_ptr + seq) == token) & (step != 0) & live  # a sequence starts
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        reload = ok & fresh & (tl.load(initial_ptr + seq) != 0)
        state = states_ptr + slot * state_slot_stride + channels_ * state_channel_stride
        h1 = tl.where(fresh, tl.load(state, mask=reload, other=0.0).to(tl.float32), h1)
        h2 = tl.where(fresh, tl.load(state + state_tap_stride, mask=reload,
                                     other=0.0).to(tl.float32), h2)
        h3 = tl.where(fresh, tl.load(state + 2 * state_tap_stride, mask=reload,
                                     other=0.0).to(tl.float32), h3)
        x = tl.load(x_ptr + token * x_stride + channels_, mask=ok & live,
                    other=0.0).to(tl.float32)
        acc = w0 * h1 + w1 * h2 + w2 * h3 + w3 * x
        tl.store(out + token * part_width, (acc / (1.0 + tl.exp(-acc))).to(
            out_ptr.dtype.element_ty), mask=ok & live)
        h1, h2, h3 = h2, h3, x


@triton.jit
def _input_before(x_ptr, state, token, back, start, initial, channels_, ok, x_stride,
                  state_tap_stride):
    """The input ``back`` tokens before ``token`` (float32): a row of ``x`` inside the
    sequence starting at ``start``, else a tap of its conv state (zeros without one)."""
    source = token - back
    inside = source >= start
    from_x = tl.load(x_ptr + source * x_stride + channels_, mask=ok & inside, other=0.0)
    from_state = tl.load(state + (source - start + 3) * state_tap_stride,
                         mask=ok & ~inside & initial, other=0.0)
    return tl.where(inside, from_x.to(tl.float32), from_state.to(tl.float32))


@triton.jit
def _conv_state_kernel(x_ptr, states_ptr, starts_ptr, ends_ptr, slots_ptr, initial_ptr, channels,
                       x_stride, state_slot_stride, state_channel_stride, state_tap_stride,
                       WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr, BLOCK_C: tl.constexpr):
    """A sequence's new conv state: the last ``WIDTH`` of its earlier and new inputs."""
    seq = tl.program_id(0)
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels_ < channels
    start, end = tl.load(starts_ptr + seq), tl.load(ends_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(initial_ptr + seq) != 0
    taps = tl.arange(0, WIDTH_P2)
    tap_ok = taps < WIDTH
    source = end - WIDTH + taps  # as a token row; before ``start``: an old state tap
    inside = source >= start
    from_x = tl.load(x_ptr + source[:, None] * x_stride + channels_[None, :],
                     mask=(tap_ok & inside)[:, None] & channel_ok[None, :], other=0.0)
    base = states_ptr + slot * state_slot_stride + channels_[None, :] * state_channel_stride
    old_tap = WIDTH + source - start
    from_state = tl.load(base + old_tap[:, None] * state_tap_stride,
                         mask=(tap_ok & ~inside)[:, None] & channel_ok[None, :] & initial,
                         other=0.0)
    new = tl.where(inside[:, None], from_x.to(tl.float32), from_state.to(tl.float32))
    tl.debug_barrier()  # every old tap is read before one is written
    tl.store(base + taps[:, None] * state_tap_stride, new.to(states_ptr.dtype.element_ty),
             mask=tap_ok[:, None] & channel_ok[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                  query_start: torch.Tensor, state_slots: torch.Tensor,
                  has_initial_state: torch.Tensor, parts: tuple[int, ...]) -> list[torch.Tensor]:
    """``causal_conv.causal_conv1d``, for a kernel of 4 taps and up to three parts."""
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    if width != 3 or len(parts) > 3 or sum(parts) != channels:
        raise ValueError(f"the prompt's conv kernel takes 4 taps and up to 3 parts of the "
                         f"{channels} channels, got {width + 1} taps and parts {parts}")
    num_seqs = state_slots.shape[0]
    starts, ends = query_start[:-1].contiguous(), query_start[1:].contiguous()
    # (rows past the last sequence's, a graph's padding, count as its: no read out of bounds)
    seq_of_token = torch.searchsorted(ends.long(), torch.arange(num_tokens, device=x.device),
                                      right=True).clamp_(max=num_seqs - 1)
    out = x.new_empty(num_tokens * channels)
    part0, part1 = (*parts, 0, 0)[:2]
    block_t, block_c = 16, 256  # measured: benchmarks/experiments/conv_prefill.py
    _conv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))](
        x, weight, conv_states, out, seq_of_token, starts, state_slots, has_initial_state,
        num_tokens, channels, part0, part1, x.stride(0), *conv_states.stride(), BLOCK_T=block_t,
        BLOCK_C=block_c, num_warps=2)
    _conv_state_kernel[(num_seqs, triton.cdiv(channels, 64))](
        x, conv_states, starts, ends, state_slots, has_initial_state, channels, x.stride(0),
        *conv_states.stride(), WIDTH=width, WIDTH_P2=triton.next_power_of_2(width), BLOCK_C=64)
    return [part.view(num_tokens, size)
            for part, size in zip(out.split([num_tokens * size for size in parts]), parts)]


@triton.jit
def _conv_step(x_row_ptr, weight_ptr, state_ptr, channels, ok, initial, state_channel_stride,
               state_tap_stride, WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr):
    """One new input of a sequence (row ``x_row_ptr``) on ``channels``: the convolution's output
    after SiLU, in float32 but rounded to x's dtype (as a kernel that stores it would), and the
    sequence's conv state (at ``state_ptr``) shifted in place. Every tap is read before any is
    written (a barrier between): threads holding copies of one channel cannot read a tap that
    another has already shifted."""
    taps = tl.arange(0, WIDTH_P2)
    window_ok = ok[:, None] & (taps < WIDTH)[None, :]
    x = tl.load(x_row_ptr + channels, mask=ok, other=0.0)
    window = (state_ptr + channels[:, None] * state_channel_stride
              + taps[None, :] * state_tap_stride)
    held = tl.load(window, mask=window_ok & initial, other=0.0)
    weights = tl.load(weight_ptr + channels[:, None] * (WIDTH + 1) + taps[None, :],
                      mask=window_ok, other=0.0)
    newest = tl.load(weight_ptr + channels * (WIDTH + 1) + WIDTH, mask=ok, other=0.0)
    acc = (tl.sum(held.to(tl.float32) * weights.to(tl.float32), axis=1)
           + x.to(tl.float32) * newest.to(tl.float32))
    tl.debug_barrier()
    # each tap one place down (tap 0 drops out), the new input last
    tl.store(window - state_tap_stride, held, mask=window_ok & (taps >= 1)[None, :])
    tl.store(state_ptr + channels * state_channel_stride + (WIDTH - 1) * state_tap_stride,
             x.to(state_ptr.dtype.element_ty), mask=ok)
    out = acc / (1.0 + tl.exp(-acc))
    return out.to(x_row_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_update_kernel(x_ptr, weight_ptr, states_ptr, out_ptr, slots_ptr, initial_ptr, channels,
                        x_stride, out_stride, state_slot_stride, state_channel_stride,
                        state_tap_stride, WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    """One new input of a sequence: its output, and its conv state shifted in place."""
    seq = tl.program_id(0)
    channels_ = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = channels_ < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(initial_ptr + seq) != 0
    out = _conv_step(x_ptr + seq * x_stride, weight_ptr, states_ptr + slot * state_slot_stride,
                     channels_, ok, initial, state_channel_stride, state_tap_stride, WIDTH,
                     WIDTH_P2)
    tl.store(out_ptr + seq * out_stride + channels_, out.to(out_ptr.dtype.element_ty), mask=ok)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         state_slots: torch.Tensor,
                         has_initial_state: torch.Tensor) -> torch.Tensor:
    """``causal_conv.causal_conv1d_update``."""
    num_seqs, channels = x.shape
    out = torch.empty_like(x)
    block_c = 256  # measured: benchmarks/experiments/conv_prefill.py
    _conv_update_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_states, out, state_slots, has_initial_state, channels,
        x.stride(0), out.stride(0), *conv_states.stride(), WIDTH=weight.shape[1] - 1,
        WIDTH_P2=triton.next_power_of_2(weight.shape[1] - 1), BLOCK_C=block_c, num_warps=8)
    return out


# --- the delta rule's gates and the gated output norm ------------------------------------------

@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, a_stride, b_stride,
                  num_heads, HEADS: tl.constexpr):
    """Token ``program_id(0)``'s decay (log space) and write strength of every value head."""
    token = tl.program_id(0)
    heads = tl.arange(0, HEADS)
    ok = heads < num_heads
    g, beta = _gate_values(
        tl.load(a_ptr + token * a_stride + heads, mask=ok, other=0.0).to(tl.float32),
        tl.load(b_ptr + token * b_stride + heads, mask=ok, other=0.0).to(tl.float32),
        tl.load(a_log_ptr + heads, mask=ok, other=0.0).to(tl.float32),
        tl.load(dt_bias_ptr + heads, mask=ok, other=0.0).to(tl.float32))
    tl.store(g_ptr + token * num_heads + heads, g, mask=ok)
    tl.store(beta_ptr + token * num_heads + heads, beta.to(beta_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_values(a, b, a_log, dt_bias):
    """The decay in log space, ``-exp(a_log) * softplus(a + dt_bias)``, and the write strength
    ``sigmoid(b)``, in float32 from float32."""
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # (torch's threshold)
    return -tl.exp(a_log) * softplus, 1.0 / (1.0 + tl.exp(-b))


def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule.delta_rule_gates``, in one launch."""
    num_tokens, num_heads = a.shape
    g = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, num_heads, dtype=b.dtype, device=b.device)
    if num_tokens:
        _gates_kernel[(num_tokens,)](a, b, a_log, dt_bias, g, beta, a.stride(0), b.stride(0),
                                     num_heads, HEADS=triton.next_power_of_2(num_heads))
    return g, beta


@triton.jit
def _norm_gated_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, x_stride_t, x_stride_h,
                       gate_stride_t, gate_stride_h, num_heads, eps, SIZE: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token ``program_id(0)``, heads ``program_id(1) * BLOCK_H ...``: ``rms_norm(x) * weight``
    rounded to x's dtype, times ``silu(gate)``, each head of ``SIZE`` normalized on its own."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_S)
    ok = (heads < num_heads)[:, None] & (cols < SIZE)[None, :]
    x = tl.load(x_ptr + token * x_stride_t + heads[:, None] * x_stride_h + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + token * gate_stride_t + heads[:, None] * gate_stride_h
                   + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < SIZE, other=0.0).to(tl.float32)
    out = _gated_norm(x, gate, weight, eps, SIZE, x_ptr.dtype.element_ty)
    tl.store(out_ptr + (token * num_heads + heads[:, None]) * SIZE + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_norm(x, gate, weight, eps, SIZE: tl.constexpr, dtype: tl.constexpr):
    """Rows ``x [R, B]`` of ``SIZE`` values (float32, zeros past them), each RMS-normed and
    times ``weight [B]``, rounded to ``dtype`` as ``norm.rms_norm_gated`` rounds, then times
    ``silu(gate)``: float32."""
    inverse = tl.rsqrt(tl.sum(x * x, axis=1) / SIZE + eps)
    normed = (x * inverse[:, None]).to(dtype).to(tl.float32)
    weighted = (normed * weight[None, :]).to(dtype).to(tl.float32)
    return weighted * gate / (1.0 + tl.exp(-gate))


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """``norm.rms_norm_gated`` of ``x`` and ``gate`` ``[T, H, D]`` (a Gated DeltaNet's value
    heads; ``gate`` may be a strided view), up to 4,096 values of a token a program (one head a
    program made a prompt's programs too small to keep the memory busy)."""
    num_tokens, num_heads, size = x.shape
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("the gated norm's kernel reads heads with unit stride")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_s = triton.next_power_of_2(size)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_s))
    if num_tokens:
        _norm_gated_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
            num_heads, eps, SIZE=size, BLOCK_S=block_s, BLOCK_H=block_h,
            num_warps=8 if block_h * block_s > 1024 else 4)
    return out


# --- the delta rule, token by token ----------------------------------------------------------

@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, out_ptr,
                       query_start_ptr, slots_ptr, initial_ptr, q_stride_t, q_stride_h,
                       k_stride_t, k_stride_h, v_stride_t, v_stride_h, gb_stride_t,
                       out_stride_t, out_stride_h, state_slot_stride, state_head_stride,
                       state_k_stride, state_v_stride, eps, scale, GROUP: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                       ONE_TOKEN: tl.constexpr):
    """Sequence ``program_id(0)``'s new tokens, one after another, for value head
    ``program_id(1)`` and values ``program_id(2) * BLOCK_V ...``: its state tile ``[DK,
    BLOCK_V]`` stays in registers from the first token to the last, then goes back to its slot.
    ``ONE_TOKEN``: the decode step, token ``program_id(0)`` (``query_start`` is not read)."""
    seq, head = tl.program_id(0), tl.program_id(1)
    values = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, DK)
    value_ok = values < DV
    key_head = head // GROUP
    if ONE_TOKEN:
        start = seq.to(tl.int64)
        end = start + 1
    else:
        start = tl.load(query_start_ptr + seq).to(tl.int64)
        end = tl.load(query_start_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(initial_ptr + seq) != 0
    tile = (states_ptr + slot * state_slot_stride + head * state_head_stride
            + keys[:, None] * state_k_stride + values[None, :] * state_v_stride)
    state = tl.load(tile, mask=value_ok[None, :] & initial, other=0.0).to(tl.float32)
    for token in range(start, end):
        q = tl.load(q_ptr + token * q_stride_t + key_head * q_stride_h + keys).to(tl.float32)
        k = tl.load(k_ptr + token * k_stride_t + key_head * k_stride_h + keys).to(tl.float32)
        v = tl.load(v_ptr + token * v_stride_t + head * v_stride_h + values, mask=value_ok,
                    other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + token * gb_stride_t + head).to(tl.float32))
        beta = tl.load(beta_ptr + token * gb_stride_t + head).to(tl.float32)
        q = _l2_normalised(q, eps) * scale
        k = _l2_normalised(k, eps)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)
        state += k[:, None] * ((v - predicted) * beta)[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + token * out_stride_t + head * out_stride_h + values,
                 out.to(out_ptr.dtype.element_ty), mask=value_ok)
    tl.store(tile, state.to(states_ptr.dtype.element_ty), mask=value_ok[None, :])


@triton.jit
def _gated_delta_net_decode_kernel(
        x_ptr, a_ptr, b_ptr, z_ptr, conv_weight_ptr, a_log_ptr, dt_bias_ptr, norm_weight_ptr,
        conv_states_ptr, ssm_states_ptr, qk_ptr, out_ptr, slots_ptr, initial_ptr, x_stride,
        a_stride, b_stride, z_stride, out_stride_t, out_stride_h, conv_slot_stride,
        conv_channel_stride, conv_tap_stride, state_slot_stride, state_head_stride,
        state_k_stride, state_v_stride, key_dim, eps, norm_eps, scale, GROUP: tl.constexpr,
        DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_K: tl.constexpr,
        WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr):
    """``gated_delta_net_decode`` for key head ``program_id(0)`` of sequence ``program_id(1)``
    and the ``GROUP`` value heads that read it: the convolution of their channels (the key
    head's q and k once, each value head's v), the gates, the delta rule in two passes over
    each state's rows, ``CHUNK_K`` at a time, and the gated norm of each head's output. The
    first pass adds up what the state predicts of ``v``, the second (reading the rows again,
    from L2) decays and updates them, writes them back and adds up the output. Holding a chunk
    rather than the whole state in registers lets an SM keep more programs' reads in flight
    (benchmarks/experiments/delta_rule_decode.py). The normalised q and k go through
    ``qk_ptr``'s rows, which the passes read a chunk at a time."""
    key_head, seq = tl.program_id(0), tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    initial = tl.load(initial_ptr + seq) != 0
    x_row = x_ptr + seq * x_stride
    conv_state = conv_states_ptr + slot * conv_slot_stride
    keys = tl.arange(0, DK)
    every_key = keys < DK
    q = _conv_step(x_row, conv_weight_ptr, conv_state, key_head * DK + keys, every_key, initial,
                   conv_channel_stride, conv_tap_stride, WIDTH, WIDTH_P2)
    k = _conv_step(x_row, conv_weight_ptr, conv_state, key_dim + key_head * DK + keys, every_key,
                   initial, conv_channel_stride, conv_tap_stride, WIDTH, WIDTH_P2)
    qk_row = qk_ptr + (seq * tl.num_programs(0) + key_head) * (2 * DK)
    tl.store(qk_row + keys, _l2_normalised(q, eps) * scale)
    tl.store(qk_row + DK + keys, _l2_normalised(k, eps))
    tl.debug_barrier()  # (the passes read q and k in other threads' chunks)
    values = tl.arange(0, BLOCK_V)
    value_ok = values < DV
    norm_weight = tl.load(norm_weight_ptr + values, mask=value_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    for member in tl.static_range(GROUP):
        head = key_head * GROUP + member
        v = _conv_step(x_row, conv_weight_ptr, conv_state, 2 * key_dim + head * DV + values,
                       value_ok, initial, conv_channel_stride, conv_tap_stride, WIDTH, WIDTH_P2)
        g, beta = _gate_values(tl.load(a_ptr + seq * a_stride + head).to(tl.float32),
                               tl.load(b_ptr + seq * b_stride + head).to(tl.float32),
                               tl.load(a_log_ptr + head).to(tl.float32),
                               tl.load(dt_bias_ptr + head).to(tl.float32))
        decay = tl.exp(g)
        beta = beta.to(b_ptr.dtype.element_ty).to(tl.float32)  # (as a kernel storing it rounds)
        rows = ssm_states_ptr + slot * state_slot_stride + head * state_head_stride
        predicted = tl.zeros([BLOCK_V], dtype=tl.float32)
        for first in range(0, DK, CHUNK_K):
            chunk, state, chunk_keys = _state_rows(rows, first, values, value_ok, initial,
                                                   state_k_stride, state_v_stride, CHUNK_K)
            predicted += tl.sum(state * tl.load(qk_row + DK + chunk_keys)[:, None], axis=0)
        written = (v - predicted * decay) * beta
        out = tl.zeros([BLOCK_V], dtype=tl.float32)
        for first in range(0, DK, CHUNK_K):
            chunk, state, chunk_keys = _state_rows(rows, first, values, value_ok, initial,
                                                   state_k_stride, state_v_stride, CHUNK_K)
            state = state * decay + tl.load(qk_row + DK + chunk_keys)[:, None] * written[None, :]
            out += tl.sum(state * tl.load(qk_row + chunk_keys)[:, None], axis=0)
            tl.store(chunk, state.to(ssm_states_ptr.dtype.element_ty), mask=value_ok[None, :])
        gate = tl.load(z_ptr + seq * z_stride + head * DV + values, mask=value_ok, other=0.0)
        gated = _gated_norm(out.to(dtype).to(tl.float32)[None, :], gate.to(tl.float32)[None, :],
                            norm_weight, norm_eps, DV, dtype)
        tl.store(out_ptr + seq * out_stride_t + head * out_stride_h + values[None, :],
                 gated.to(dtype), mask=value_ok[None, :])


@triton.jit
def _l2_normalised(x, eps):
    """A query's or key's head ``x`` (float32) over its L2 norm, as ``delta_rule`` does."""
    return x * tl.rsqrt(tl.sum(x * x) + eps)


@triton.jit
def _state_rows(rows_ptr, first, values, value_ok, initial, state_k_stride, state_v_stride,
                CHUNK_K: tl.constexpr):
    """Rows ``first ...`` of a state (``values`` of each): their pointers, their values in
    float32 (zeros for a sequence without an initial state), and their key indices."""
    keys = first + tl.arange(0, CHUNK_K)
    chunk = rows_ptr + keys[:, None] * state_k_stride + values[None, :] * state_v_stride
    state = tl.load(chunk, mask=value_ok[None, :] & initial, other=0.0).to(tl.float32)
    return chunk, state, keys


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_states: torch.Tensor, query_start: torch.Tensor,
                         state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                         query_lens_host: tuple[int, ...] = (),
                         chunks: torch.Tensor | None = None) -> torch.Tensor:
    """``delta_rule.gated_delta_rule``, each sequence's tokens one after another in one
    program per (sequence, value head, value block): one launch, in place in the slots."""
    return _delta_rule(q, k, v, g, beta, ssm_states, query_start, state_slots,
                       has_initial_state)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, ssm_states: torch.Tensor, query_start: torch.Tensor | None,
                state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """``_delta_rule_kernel``'s launch; without ``query_start``, one token a sequence. Tiles of
    32 values: a prompt's or a few sequences' step has few programs to spare (a decode step of
    many sequences goes through ``gated_delta_net_decode``'s kernel)."""
    num_tokens, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the delta rule's kernel reads rows of q, k and v with unit stride")
    g, beta = g.contiguous(), beta.contiguous()
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=v.dtype, device=v.device)
    one_token = query_start is None
    block_v = min(32, triton.next_power_of_2(dv))
    _delta_rule_kernel[(len(state_slots), num_v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, ssm_states, out, state_slots if one_token else query_start,
        state_slots, has_initial_state, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
        *ssm_states.stride(), L2_NORM_EPS, dk ** -0.5, GROUP=num_v_heads // q.shape[1], DK=dk,
        DV=dv, BLOCK_V=block_v, ONE_TOKEN=one_token)
    return out


def gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, ssm_states: torch.Tensor,
                            state_slots: torch.Tensor,
                            has_initial_state: torch.Tensor) -> torch.Tensor:
    """``delta_rule.gated_delta_rule_update``: the decode step, each sequence's one token."""
    return _delta_rule(q, k, v, g, beta, ssm_states, None, state_slots, has_initial_state)


FUSED_DECODE_FROM = 16  # sequences in a decode step
DECODE_TILES = (64, 2)  # key rows a chunk, warps: measured, delta_rule_decode.py


def gated_delta_net_decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           z: torch.Tensor, conv_weight: torch.Tensor, a_log: torch.Tensor,
                           dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           conv_states: torch.Tensor, ssm_states: torch.Tensor,
                           state_slots: torch.Tensor,
                           has_initial_state: torch.Tensor) -> torch.Tensor:
    """``delta_rule.gated_delta_net_decode``. From ``FUSED_DECODE_FROM`` sequences in one launch
    (``_gated_delta_net_decode_kernel``, a program per key head and sequence); fewer go
    through the four kernels, whose smaller programs keep the GPU busier (one sequence would
    have one program per key head)."""
    if len(state_slots) < FUSED_DECODE_FROM:
        return in_steps(causal_conv1d_update, delta_rule_gates, gated_delta_rule_update,
                        rms_norm_gated, mixed, a, b, z, conv_weight, a_log, dt_bias, norm_weight,
                        eps, conv_states, ssm_states, state_slots, has_initial_state)
    num_seqs = mixed.shape[0]
    num_v_heads, dk, dv = ssm_states.shape[1:]
    key_dim = (mixed.shape[1] - num_v_heads * dv) // 2
    num_k_heads = key_dim // dk
    if (mixed.stride(1) != 1 or z.stride(1) != 1 or conv_weight.stride(1) != 1
            or dk & (dk - 1)):
        raise ValueError("the fused decode kernel reads rows of the projection, z and the conv "
                         "weight with unit stride, and keys of a power-of-two size")
    out = torch.empty(num_seqs, num_v_heads, dv, dtype=mixed.dtype, device=mixed.device)
    qk = torch.empty(num_seqs, num_k_heads, 2, dk, dtype=torch.float32, device=mixed.device)
    chunk, warps = DECODE_TILES
    width = conv_weight.shape[1] - 1
    _gated_delta_net_decode_kernel[(num_k_heads, num_seqs)](
        mixed, a, b, z, conv_weight, a_log, dt_bias, norm_weight, conv_states, ssm_states, qk,
        out, state_slots, has_initial_state, mixed.stride(0), a.stride(0), b.stride(0),
        z.stride(0), out.stride(0), out.stride(1), *conv_states.stride(), *ssm_states.stride(),
        key_dim, L2_NORM_EPS, eps, dk ** -0.5, GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv,
        BLOCK_V=triton.next_power_of_2(dv), CHUNK_K=min(chunk, dk), WIDTH=width,
        WIDTH_P2=triton.next_power_of_2(width), num_warps=warps)
    return out


# --- a prompt chunk's delta rule: flash-linear-attention's chunked kernel ----------------------

def chunked_delta_rule() -> Callable[..., torch.Tensor]:
    """A prompt chunk's delta rule: flash-linear-attention's where it is installed (fla-core,
    ``pip install "nanofn[hybrid]"``), else the torch reference (token by token: slow)."""
    return fla_delta_rule if importlib.util.find_spec("fla") is not None else gated_delta_rule


FLA_CHUNK = 64  # the tokens of a chunk of flash-linear-attention's kernel


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, ssm_states: torch.Tensor, query_start: torch.Tensor,
                   state_slots: torch.Tensor, has_initial_state: torch.Tensor,
                   query_lens_host: tuple[int, ...],
                   chunks: torch.Tensor | None = None) -> torch.Tensor:
    """``delta_rule.gated_delta_rule`` through flash-linear-attention's chunked kernel (varlen,
    with initial and final states): the sequences' states are gathered from their slots (zeros
    where there is none) and the final ones written back.

    Eagerly the kernel lists the chunks on the host, from the lengths; a CUDA graph gives them
    (``chunks``, see ``prefill_chunks``), padded with chunks of one more sequence, empty, after
    the batch's, where every program of the kernel returns at once."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if chunks is None:
        ends = list(itertools.accumulate(query_lens_host, initial=0))  # (no wait for the device)
        cu_seqlens, options = query_start.long(), {"cu_seqlens_cpu": torch.tensor(ends)}
    else:
        cu_seqlens = torch.cat([query_start, query_start[-1:]]).long()  # + the empty sequence
        options = {"chunk_indices": chunks}
    initial = gathered_states(ssm_states, state_slots, has_initial_state,
                              zero_rows=0 if chunks is None else 1)
    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens, chunk_size=FLA_CHUNK, **options)
    scatter_states(final, ssm_states, state_slots)
    return out[0].to(v.dtype)


STATE_BLOCK = 4096  # values of a state a program moves


@triton.jit
def _gather_states_kernel(states_ptr, out_ptr, slots_ptr, initial_ptr, num_seqs, size,
                          state_slot_stride, BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``gathered_states``, values ``program_id(1) * BLOCK ...``."""
    row = tl.program_id(0)
    values = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = values < size
    live = row < num_seqs
    slot = tl.load(slots_ptr + row, mask=live, other=0).to(tl.int64)
    initial = tl.load(initial_ptr + row, mask=live, other=0) != 0
    held = tl.load(states_ptr + slot * state_slot_stride + values, mask=ok & live & initial,
                   other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * size + values, held.to(tl.float32), mask=ok)


def gathered_states(ssm_states: torch.Tensor, state_slots: torch.Tensor,
                    has_initial_state: torch.Tensor, zero_rows: int = 0) -> torch.Tensor:
    """The sequences' states in float32, ``[B + zero_rows, Hv, Dk, Dv]``: slot ``state_slots[i]``
    where ``has_initial_state[i]``, zeros elsewhere and in the ``zero_rows`` rows after them
    (``causal_conv.read_states`` in float32): one pass, where indexing a layer's strided view
    and converting took several at a fifth of the bandwidth."""
    num_seqs, size = len(state_slots), ssm_states[0].numel()
    if not ssm_states[0].is_contiguous():
        raise ValueError("a slot's state must be contiguous within its layer")
    out = torch.empty(num_seqs + zero_rows, *ssm_states.shape[1:], dtype=torch.float32,
                      device=ssm_states.device)
    _gather_states_kernel[(num_seqs + zero_rows, triton.cdiv(size, STATE_BLOCK))](
        ssm_states, out, state_slots, has_initial_state, num_seqs, size, ssm_states.stride(0),
        BLOCK=STATE_BLOCK)
    return out


@triton.jit
def _scatter_states_kernel(final_ptr, states_ptr, slots_ptr, size, state_slot_stride,
                           BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``scatter_states``, values ``program_id(1) * BLOCK ...``."""
    row = tl.program_id(0)
    values = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = values < size
    slot = tl.load(slots_ptr + row).to(tl.int64)
    final = tl.load(final_ptr + row.to(tl.int64) * size + values, mask=ok)
    tl.store(states_ptr + slot * state_slot_stride + values,
             final.to(states_ptr.dtype.element_ty), mask=ok)


def scatter_states(final: torch.Tensor, ssm_states: torch.Tensor,
                   state_slots: torch.Tensor) -> None:
    """``ssm_states[state_slots] = final[:B]`` in the states' dtype, in one pass."""
    num_seqs, size = len(state_slots), ssm_states[0].numel()
    if not ssm_states[0].is_contiguous() or not final.is_contiguous():
        raise ValueError("a slot's state must be contiguous within its layer, and the final "
                         "states contiguous")
    _scatter_states_kernel[(num_seqs, triton.cdiv(size, STATE_BLOCK))](
        final, ssm_states, state_slots, size, ssm_states.stride(0), BLOCK=STATE_BLOCK)


def prefill_chunks(query_lens: list[int], num_seqs: int, num_chunks: int) -> list[tuple[int, int]]:
    """``fla_delta_rule``'s ``chunks`` for a graph of ``num_seqs`` sequences (the lengths'
    first): each ``(sequence, chunk)``, then ``num_chunks`` in all with chunks of the empty
    sequence ``num_seqs``."""
    listed = [(s, c) for s, length in enumerate(query_lens) for c in range(-(-length // FLA_CHUNK))]
    return listed + [(num_seqs, 0)] * (num_chunks - len(listed))
