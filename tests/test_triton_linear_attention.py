"""The Triton kernels of a Gated DeltaNet layer (``triton_linear_attention.py``) against their
torch references, on CPU through Triton's interpreter (float32 and float16): outputs, and the
states written back in place into their slots of a strided layer view, other slots and layers
untouched; sequences without an initial state start from zeros whatever their slot holds."""

from __future__ import annotations

import pytest
import torch

import nanofn.kernels.triton_linear_attention as triton_linear_attention
from nanofn.kernels.causal_conv import causal_conv1d, causal_conv1d_update, read_states
from nanofn.kernels.delta_rule import (delta_rule_gates, gated_delta_net_decode, gated_delta_rule,
                                      gated_delta_rule_update)
from nanofn.kernels.norm import rms_norm_gated

TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
SLOTS = torch.tensor([3, 0, 5])  # the batch's sequences' slots, out of order
INITIAL = torch.tensor([True, False, True])  # the second starts from zeros


def layer_of(states: torch.Tensor) -> torch.Tensor:
    """Layer 1 of three: a strided view, as the model passes one layer of a RecurrentState."""
    return states[:, 1]


def conv_and_states(function, x, weight, states, *args):
    out = function(x, weight, layer_of(states), *args)
    return out, states


def delta_and_states(function, q, k, v, g, beta, states, *args):
    out = function(q, k, v, g, beta, layer_of(states), *args)
    return out, states


def decode_and_states(fused_from, conv_states, ssm_states, slots, initial, *args):
    """The decode step of ``gated_delta_net_decode`` (``args``: its arguments up to ``eps``) in
    the interpreter's child, fused from ``fused_from`` sequences on; its output and both states
    afterwards."""
    default = triton_linear_attention.FUSED_DECODE_FROM
    triton_linear_attention.FUSED_DECODE_FROM = fused_from
    try:
        out = triton_linear_attention.gated_delta_net_decode(
            *args, layer_of(conv_states), layer_of(ssm_states), slots, initial)
        return out, conv_states, ssm_states
    finally:
        triton_linear_attention.FUSED_DECODE_FROM = default


def slot_states(shape, dtype, generator):
    """Six slots of three layers; the fresh sequence's slot holds NaN, which must not leak."""
    states = torch.randn(6, 3, *shape, generator=generator).to(dtype)
    states[0] = float("nan")
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_over_a_batch_of_chunks_matches_reference(interpreter, dtype):
    """``x`` a strided view (the projection's first columns, as the model passes it); the output
    in three parts of uneven widths (``q``, ``k``, ``v``), each contiguous."""
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 5, 70]  # one shorter than the window (from its state), one over several tiles
    channels, width, parts = 96, 3, (24, 16, 56)
    x = torch.randn(sum(lengths), channels + 5, generator=generator).to(dtype)[:, :channels]
    weight = torch.randn(channels, width + 1, generator=generator).to(dtype)
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = slot_states((channels, width), dtype, generator)
    expected_states = states.clone()
    expected = causal_conv1d(x, weight, layer_of(expected_states), query_start, SLOTS, INITIAL,
                             parts)

    out, states = interpreter(conv_and_states, triton_linear_attention.causal_conv1d, x, weight,
                              states, query_start, SLOTS, INITIAL, parts)

    assert [part.shape[1] for part in out] == list(parts)
    assert all(part.is_contiguous() for part in out)
    torch.testing.assert_close(torch.cat(out, dim=1), torch.cat(expected, dim=1),
                               **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, equal_nan=True, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_update_matches_reference(interpreter, dtype):
    generator = torch.Generator().manual_seed(2)
    channels, width = 200, 3  # two channel blocks, the second partly
    x = torch.randn(3, channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width + 1, generator=generator).to(dtype)
    states = slot_states((channels, width), dtype, generator)
    expected_states = states.clone()
    expected = causal_conv1d_update(x, weight, layer_of(expected_states), SLOTS, INITIAL)

    out, states = interpreter(conv_and_states, triton_linear_attention.causal_conv1d_update, x,
                              weight, states, SLOTS, INITIAL)

    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, equal_nan=True, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dv", [16, 48, 100], ids=["one-value-block", "value-blocks", "wide"])
def test_gated_delta_rule_update_matches_reference(interpreter, dtype, dv):
    """Grouped heads (4 value heads read 2 key heads); float32 states, as Qwen3.5's."""
    generator = torch.Generator().manual_seed(dv)
    hk, hv, dk = 2, 4, 16
    q, k = (torch.randn(3, hk, dk, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(3, hv, dv, generator=generator).to(dtype)
    g = -torch.rand(3, hv, generator=generator)
    beta = torch.rand(3, hv, generator=generator)
    states = slot_states((hv, dk, dv), torch.float32, generator)
    expected_states = states.clone()
    expected = gated_delta_rule_update(q, k, v, g, beta, layer_of(expected_states), SLOTS,
                                       INITIAL)

    out, states = interpreter(delta_and_states, triton_linear_attention.gated_delta_rule_update,
                              q, k, v, g, beta, states, SLOTS, INITIAL)

    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dv", [64, 100], ids=["power-of-two", "masked-values"])
@pytest.mark.parametrize("fused_from", [1, 16], ids=["one-launch", "four-kernels"])
def test_the_decode_step_of_a_layer_matches_reference(interpreter, dtype, dv, fused_from):
    """The convolution, the gates, the delta rule and the gated norm of a decode step, from the
    projection's strided columns (``mixed``, ``z``, ``a``, ``b``, as the model splits them): in
    one launch (a program per key head and sequence, its 2 value heads in turn, the state's 128
    key rows in two chunks) and as four kernels. Both states written back in their slots; the
    fresh sequence's slot holds NaN, which must not leak."""
    generator = torch.Generator().manual_seed(dv)
    hk, hv, dk, width = 2, 4, 128, 3
    channels = 2 * hk * dk + hv * dv
    projected = torch.randn(3, channels + hv * dv + 2 * hv + 7, generator=generator).to(dtype)
    mixed, z, a, b = projected[:, :-7].split([channels, hv * dv, hv, hv], dim=-1)
    weight = torch.randn(channels, width + 1, generator=generator).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=generator), torch.randn(hv, generator=generator)
    norm_weight = (torch.rand(dv, generator=generator) + 0.5).to(dtype)
    args = (mixed, a, b, z, weight, a_log, dt_bias, norm_weight, 1e-6)
    conv_states = slot_states((channels, width), dtype, generator)
    ssm_states = slot_states((hv, dk, dv), torch.float32, generator) * 0.1
    expected_conv, expected_ssm = conv_states.clone(), ssm_states.clone()
    expected = gated_delta_net_decode(*args, layer_of(expected_conv), layer_of(expected_ssm),
                                      SLOTS, INITIAL)

    out, conv_states, ssm_states = interpreter(decode_and_states, fused_from, conv_states,
                                               ssm_states, SLOTS, INITIAL, *args)

    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(conv_states, expected_conv, equal_nan=True)
    torch.testing.assert_close(ssm_states, expected_ssm, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_recurrent_delta_rule_over_a_batch_of_chunks_matches_reference(interpreter, dtype):
    """Prompt chunks of 1, 5 and 20 tokens, each sequence's state carried token to token."""
    generator = torch.Generator().manual_seed(3)
    lengths, hk, hv, dk, dv = [1, 5, 20], 2, 4, 16, 48
    t = sum(lengths)
    q, k = (torch.randn(t, hk, dk, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=generator).to(dtype)
    g = -torch.rand(t, hv, generator=generator)
    beta = torch.rand(t, hv, generator=generator)
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = slot_states((hv, dk, dv), torch.float32, generator)
    expected_states = states.clone()
    expected = gated_delta_rule(q, k, v, g, beta, layer_of(expected_states), query_start, SLOTS,
                                INITIAL, tuple(lengths))

    out, states = interpreter(delta_and_states, triton_linear_attention.recurrent_delta_rule,
                              q, k, v, g, beta, states, query_start, SLOTS, INITIAL)

    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    torch.testing.assert_close(states, expected_states, equal_nan=True, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_gates_and_the_gated_norm_match_their_references(interpreter, dtype):
    """The gates from strided views of the projection (``a`` and ``b`` for 6 value heads, as
    the model splits them), large ``a`` included (softplus's linear side); the gated norm of
    heads of 32 with a strided gate, and of heads too long for one program to hold them all."""
    generator = torch.Generator().manual_seed(4)
    projected = (torch.randn(9, 40, generator=generator) * 4).to(dtype)
    projected[0, 28] = 30.0
    a, b = projected[:, 28:34], projected[:, 34:40]
    a_log, dt_bias = torch.randn(6, generator=generator), torch.randn(6, generator=generator)
    g, beta = interpreter(triton_linear_attention.delta_rule_gates, a, b, a_log, dt_bias)
    expected_g, expected_beta = delta_rule_gates(a, b, a_log, dt_bias)
    torch.testing.assert_close(g, expected_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, expected_beta, **TOLERANCES[dtype])

    x = torch.randn(9, 3, 32, generator=generator).to(dtype)
    gate = torch.randn(9, 100, generator=generator).to(dtype)[:, 4:100].view(9, 3, 32)
    weight = (torch.rand(32, generator=generator) + 0.5).to(dtype)
    out = interpreter(triton_linear_attention.rms_norm_gated, x, gate, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_gated(x, gate, weight, 1e-6), **TOLERANCES[dtype])
    x = torch.randn(2, 3, 2048, generator=generator).to(dtype)  # two programs a token, 2 + 1 heads
    gate, weight = torch.randn(2, 3, 2048, generator=generator).to(dtype), weight.repeat(64)
    out = interpreter(triton_linear_attention.rms_norm_gated, x, gate, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_gated(x, gate, weight, 1e-6), **TOLERANCES[dtype])


def gather_then_scatter(states, slots, initial, final):
    """``gathered_states`` (with a zero row after the sequences) of one layer, then
    ``scatter_states`` of ``final`` into it: the gathered rows and the states afterwards."""
    gathered = triton_linear_attention.gathered_states(layer_of(states), slots, initial,
                                                       zero_rows=1)
    triton_linear_attention.scatter_states(final, layer_of(states), slots)
    return gathered, states


def test_states_gathered_for_a_chunked_kernel_and_scattered_back(interpreter):
    """float32 rows, zeros for the fresh sequence (its slot holds NaN) and the extra row; the
    final states back in their slots in the states' dtype (float16 here: the interpreter
    rounds to bf16 otherwise than a GPU), other slots and layers untouched. A state of 4 x 32
    x 40 values takes two programs of ``STATE_BLOCK``."""
    generator = torch.Generator().manual_seed(5)
    states = slot_states((4, 32, 40), torch.float16, generator)
    final = torch.randn(3, 4, 32, 40, generator=generator)
    expected_states = states.clone()
    expected = torch.cat([read_states(layer_of(expected_states), SLOTS, INITIAL).float(),
                          torch.zeros(1, 4, 32, 40)])
    layer_of(expected_states)[SLOTS] = final.to(torch.float16)

    gathered, states = interpreter(gather_then_scatter, states, SLOTS, INITIAL, final)

    assert gathered.dtype == torch.float32
    assert torch.equal(gathered, expected)
    assert torch.equal(states.isnan(), expected_states.isnan())
    assert torch.equal(states.nan_to_num(), expected_states.nan_to_num())
