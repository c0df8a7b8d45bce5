"""The kernels of Qwen3.5 (its linear-attention layers, its partial rotary embedding) against
transformers' torch functions."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import nanofn.kernels.triton_attention as triton_attention
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import (apply_rotary, build_cos_sin_cache, causal_conv1d,
                            causal_conv1d_update, gated_delta_rule, gated_delta_rule_update,
                            rms_norm_gated)

# --- the kernels against transformers' torch functions ----------------------------------------

LENS, SLOTS, RESUME = [5, 1, 2, 9], [3, 0, 4, 1], [True, False, True, True]
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 6


def assert_unchanged(actual: torch.Tensor, before: torch.Tensor) -> None:
    torch.testing.assert_close(actual, before, atol=0, rtol=0, equal_nan=True)


def varlen(lens: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``query_start`` and each sequence's token range."""
    bounds = [0, *itertools.accumulate(lens)]
    return torch.tensor(bounds, dtype=torch.int32), list(zip(bounds, bounds[1:]))


def test_causal_conv1d_matches_transformers_from_and_to_state_slots():
    """Sequences shorter than the window included; a fresh sequence's slot holds NaN."""
    generator = torch.Generator().manual_seed(10)
    channels, kernel_size = 6, 4
    x = torch.randn(sum(LENS), channels, generator=generator)
    weight = torch.randn(channels, kernel_size, generator=generator)
    states = torch.randn(5, 2, channels, kernel_size - 1, generator=generator)
    states[0] = torch.nan
    before = states.clone()
    query_start, ranges = varlen(LENS)

    out = causal_conv1d(x, weight, states[:, 1], query_start, torch.tensor(SLOTS),
                        torch.tensor(RESUME))

    for (start, end), slot, resume in zip(ranges, SLOTS, RESUME):
        initial = before[slot, 1] if resume else torch.zeros(channels, kernel_size - 1)
        inputs = torch.cat([initial, x[start:end].T], dim=-1)[None]  # the window's left context
        expected = hf.causal_conv1d_fn(inputs, weight, activation="silu")[0, :, kernel_size - 1 :]
        torch.testing.assert_close(out[start:end], expected.T)
        torch.testing.assert_close(states[slot, 1], inputs[0, :, 1 - kernel_size :])
    assert_unchanged(states[:, 0], before[:, 0])  # another layer's
    assert_unchanged(states[2], before[2])  # a slot of no sequence in the batch


def test_causal_conv1d_update_matches_transformers():
    generator = torch.Generator().manual_seed(11)
    channels, kernel_size = 6, 4
    x = torch.randn(len(SLOTS), channels, generator=generator)
    weight = torch.randn(channels, kernel_size, generator=generator)
    states = torch.randn(5, channels, kernel_size - 1, generator=generator)
    states[0] = torch.nan
    before = states.clone()

    out = causal_conv1d_update(x, weight, states, torch.tensor(SLOTS), torch.tensor(RESUME))

    for i, (slot, resume) in enumerate(zip(SLOTS, RESUME)):
        initial = before[slot] if resume else torch.zeros(channels, kernel_size - 1)
        state = torch.cat([torch.zeros(channels, 1), initial], dim=-1)[None]  # transformers keeps K
        expected = hf.causal_conv1d_update(x[i][None, :, None], state, weight, activation="silu")
        torch.testing.assert_close(out[i], expected[0, :, 0])
        torch.testing.assert_close(states[slot], state[0, :, 1:])


def delta_rule_inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, K_HEADS, K_DIM, generator=generator)
    k = torch.randn(num_tokens, K_HEADS, K_DIM, generator=generator)
    v = torch.randn(num_tokens, V_HEADS, V_DIM, generator=generator)
    g = -2 * torch.rand(num_tokens, V_HEADS, generator=generator)
    beta = torch.rand(num_tokens, V_HEADS, generator=generator)
    states = torch.randn(5, 3, V_HEADS, K_DIM, V_DIM, generator=generator)
    states[0] = torch.nan
    return q, k, v, g, beta, states


def test_gated_delta_rule_matches_transformers_chunked_from_and_to_state_slots():
    q, k, v, g, beta, states = delta_rule_inputs(sum(LENS), seed=12)
    before = states.clone()
    query_start, ranges = varlen(LENS)

    out = gated_delta_rule(q, k, v, g, beta, states[:, 2], query_start, torch.tensor(SLOTS),
                           torch.tensor(RESUME), tuple(LENS))

    for (start, end), slot, resume in zip(ranges, SLOTS, RESUME):
        expected, final = hf.torch_chunk_gated_delta_rule(
            *(t[None, start:end] for t in (q, k, v, g, beta)), chunk_size=4,
            initial_state=before[slot, 2][None] if resume else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[start:end], expected[0])
        torch.testing.assert_close(states[slot, 2], final[0])
    assert_unchanged(states[:, :2], before[:, :2])
    assert_unchanged(states[2], before[2])


def test_gated_delta_rule_update_matches_transformers_recurrent():
    q, k, v, g, beta, states = delta_rule_inputs(len(SLOTS), seed=13)
    states = states[:, 0].clone()
    before = states.clone()

    out = gated_delta_rule_update(q, k, v, g, beta, states, torch.tensor(SLOTS), torch.tensor(RESUME))

    for i, (slot, resume) in enumerate(zip(SLOTS, RESUME)):
        expected, final = hf.torch_recurrent_gated_delta_rule(
            *(t[None, i : i + 1] for t in (q, k, v, g, beta)),
            initial_state=before[slot][None] if resume else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[i], expected[0, 0])
        torch.testing.assert_close(states[slot], final[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_transformers_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(14)
    reference = hf.Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(16, generator=generator) + 0.5)
    x, gate = (torch.randn(2, 5, 4, 16, generator=generator) * 3).to(dtype)

    with torch.no_grad():
        assert torch.equal(rms_norm_gated(x, gate, reference.weight, 1e-6), reference(x, gate))


def test_partial_rotary_matches_transformers_multimodal_rotary_on_text():
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1]})
    generator = torch.Generator().manual_seed(15)
    q, k = torch.randn(2, 20, 4, 32, generator=generator)
    positions = torch.randint(0, 256, (20,), generator=generator)

    cache = build_cos_sin_cache(8, 256, 10000.0)  # a quarter of head_dim 32
    q_rotated, k_rotated = apply_rotary(q, k, positions, cache)

    cos, sin = hf.Qwen3_5TextRotaryEmbedding(config)(q, positions[None])
    q_expected, k_expected = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     cos, sin)
    torch.testing.assert_close(q_rotated, q_expected[0].transpose(0, 1))
    torch.testing.assert_close(k_rotated, k_expected[0].transpose(0, 1))
    assert torch.equal(q_rotated[..., 8:], q[..., 8:])


def test_triton_rotary_kernels_refuse_a_partial_rotary_table():
    """They turn whole heads: given Qwen3.5's quarter-head table they raise, before any launch,
    rather than misread it."""
    q, k, v = torch.zeros(1, 4, 32), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32)
    k_cache = v_cache = torch.zeros(2, 4, 2, 32)
    cache, slots = build_cos_sin_cache(8, 16, 10000.0), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="rotary dim 8 of head_dim 32"):
        triton_ops.rotate_and_store_kv(q, k, v, slots, cache, k_cache, v_cache, slots)
    with pytest.raises(NotImplementedError, match="rotary dim 8 of head_dim 32"):
        triton_attention.rotary_decode_attention(q, k, v, slots, cache, k_cache, v_cache, slots,
                                                 slots + 1, slots[None], 1.0)
