"""The Triton kernels of a Gated DeltaNet layer (``triton_linear_attention.py``) against their
torch references, on CPU through Triton's interpreter (float32 and float16): outputs, and the
states written back in place into their slots of a strided layer view, other slots and layers
untouched; sequences without an initial state start from zeros whatever their slot holds."""

from __future__ import annotations

import pytest
import torch

import nanofn.kernels.triton_linear_attention as triton_linear_attention
from nanofn.kernels.causal_conv import causal_conv1d, causal_conv1d_update
from nanofn.kernels.delta_rule import gated_delta_rule_update

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


def slot_states(shape, dtype, generator):
    """Six slots of three layers; the fresh sequence's slot holds NaN, which must not leak."""
    states = torch.randn(6, 3, *shape, generator=generator).to(dtype)
    states[0] = float("nan")
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_over_a_batch_of_chunks_matches_reference(interpreter, dtype):
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 5, 70]  # one shorter than the window (from its state), one over several tiles
    channels, width = 96, 3
    x = torch.randn(sum(lengths), channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width + 1, generator=generator).to(dtype)
    query_start = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = slot_states((channels, width), dtype, generator)
    expected_states = states.clone()
    expected = causal_conv1d(x, weight, layer_of(expected_states), query_start, SLOTS, INITIAL)

    out, states = interpreter(conv_and_states, triton_linear_attention.causal_conv1d, x, weight,
                              states, query_start, SLOTS, INITIAL)

    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
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
@pytest.mark.parametrize("dv", [16, 48], ids=["one-value-block", "value-blocks"])
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
