"""The torch reference kernels against direct computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nanofn.kernels import (
    apply_rotary,
    build_cos_sin_cache,
    decode_attention,
    prefill_attention,
    rms_norm,
    silu_and_mul,
    store_kv,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 16
SCALE = HEAD_DIM**-0.5


class PagedContexts:
    """Random keys and values of a few sequences, scattered into a random cache via shuffled blocks."""

    def __init__(self, seq_lens: list[int], block_size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3  # a few blocks stay unused
        shape = (NUM_KV_HEADS, HEAD_DIM)
        self.keys = [torch.randn(n, *shape, generator=generator) for n in seq_lens]
        self.values = [torch.randn(n, *shape, generator=generator) for n in seq_lens]
        self.k_cache = torch.randn(num_blocks, block_size, *shape, generator=generator)
        self.v_cache = torch.randn(num_blocks, block_size, *shape, generator=generator)
        free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        tables = []
        for keys, values in zip(self.keys, self.values):
            table = [free_blocks.pop() for _ in range(-(-len(keys) // block_size))]
            for position in range(len(keys)):
                block, offset = table[position // block_size], position % block_size
                self.k_cache[block, offset] = keys[position]
                self.v_cache[block, offset] = values[position]
            tables.append(table)
        width = max(len(table) for table in tables) + 1  # wider than needed: padding must be ignored
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q [Q, H, D]`` as the last Q positions of ``k, v [L, Hkv, D]``, through SDPA."""
    query_len, seq_len = len(q), len(k)
    group = q.shape[1] // k.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
    mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


def test_store_kv_writes_each_token_to_its_slot_and_skips_negative_slots():
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 4, 10
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 7]] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = k[token]
            expected_v[slot // block_size, slot % block_size] = v[token]

    store_kv(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prefill_attention_matches_dense_causal_attention(block_size):
    # (new tokens, context length): whole prompts, chunks after a cached prefix, a single token
    query_lens, seq_lens = [7, 3, 1, 12, 16, 5], [7, 20, 9, 33, 16, 40]
    contexts = PagedContexts(seq_lens, block_size, seed=1)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    bounds = [0, *torch.tensor(query_lens).cumsum(0).tolist()]

    out = prefill_attention(
        q,
        contexts.k_cache,
        contexts.v_cache,
        torch.tensor(bounds, dtype=torch.int32),
        contexts.seq_lens,
        contexts.block_tables,
        tuple(query_lens),
        tuple(seq_lens),
        SCALE,
    )

    expected = torch.cat([
        dense_causal_attention(q[start:end], keys, values)
        for start, end, keys, values in zip(bounds, bounds[1:], contexts.keys, contexts.values)
    ])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_attention_matches_dense_attention_at_the_last_position(block_size):
    seq_lens = [1, 5, 16, 37, 4]
    contexts = PagedContexts(seq_lens, block_size, seed=3)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))

    out = decode_attention(q, contexts.k_cache, contexts.v_cache, contexts.seq_lens, contexts.block_tables, SCALE)

    expected = torch.cat([
        dense_causal_attention(q[i : i + 1], keys, values)
        for i, (keys, values) in enumerate(zip(contexts.keys, contexts.values))
    ])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_decode_attention_padding_row_with_no_context_stays_finite():
    contexts = PagedContexts([6, 3], block_size=4, seed=5)
    q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    seq_lens = torch.tensor([6, 0], dtype=torch.int32)

    out = decode_attention(q, contexts.k_cache, contexts.v_cache, seq_lens, contexts.block_tables, SCALE)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:1], dense_causal_attention(q[:1], contexts.keys[0], contexts.values[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_returns_the_query_dtype(dtype):
    contexts = PagedContexts([5, 9], block_size=4, seed=7)
    k_cache, v_cache = contexts.k_cache.to(dtype), contexts.v_cache.to(dtype)
    q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(8))

    decoded = decode_attention(q.to(dtype), k_cache, v_cache, contexts.seq_lens, contexts.block_tables, SCALE)
    prefilled = prefill_attention(
        q.to(dtype), k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32), contexts.seq_lens,
        contexts.block_tables, (1, 1), (5, 9), SCALE,
    )

    assert decoded.dtype == prefilled.dtype == dtype
    torch.testing.assert_close(decoded, prefilled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(9)
    hidden = 64
    reference = Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(hidden, generator=generator) + 0.5)
    x = (torch.randn(5, hidden, generator=generator) * 3).to(dtype)
    residual = torch.randn(5, hidden, generator=generator).to(dtype)

    with torch.no_grad():
        assert torch.equal(rms_norm(x, reference.weight, 1e-6), reference(x))
        normed, summed = rms_norm(x, reference.weight, 1e-6, residual)
        assert torch.equal(summed, x + residual)
        assert torch.equal(normed, reference(x + residual))


def test_silu_and_mul_gates_the_second_half_with_the_first():
    generator = torch.Generator().manual_seed(10)
    gate, up = torch.randn(2, 3, 24, generator=generator)
    out = silu_and_mul(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope_scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_SCALING],
    ids=["default", "linear", "llama3"],
)
def test_apply_rotary_matches_transformers(rope_scaling):
    theta, max_positions, num_tokens = 50000.0, 512, 20
    config = LlamaConfig(
        head_dim=HEAD_DIM,
        hidden_size=NUM_HEADS * HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta},
    )
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator)

    cache = build_cos_sin_cache(HEAD_DIM, max_positions, theta, rope_scaling)
    q_rotated, k_rotated = apply_rotary(q, k, positions, cache)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_expected, k_expected = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_rotated, q_expected[0].transpose(0, 1))
    torch.testing.assert_close(k_rotated, k_expected[0].transpose(0, 1))


def test_linear_rope_scaling_stretches_positions():
    default = build_cos_sin_cache(HEAD_DIM, 64, 10000.0)
    linear = build_cos_sin_cache(HEAD_DIM, 256, 10000.0, {"type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear[::4], default)


def test_apply_rotary_keeps_the_input_dtype():
    cache = build_cos_sin_cache(HEAD_DIM, 32, 10000.0)
    q = torch.randn(3, NUM_HEADS, HEAD_DIM).to(torch.bfloat16)
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    q_rotated, k_rotated = apply_rotary(q, k, torch.tensor([0, 5, 31]), cache)
    assert q_rotated.dtype == k_rotated.dtype == torch.bfloat16


def test_unsupported_rope_type_is_named_in_the_error():
    with pytest.raises(ValueError, match="'yarn'.*supported: default, linear, llama3"):
        build_cos_sin_cache(HEAD_DIM, 32, 10000.0, {"rope_type": "yarn", "factor": 2.0})
