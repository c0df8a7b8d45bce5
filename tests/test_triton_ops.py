"""The Triton norm, rotary and activation kernels against the torch references, on CPU through
Triton's interpreter (float32 and float16), and a model run with ``TRITON_KERNELS`` against one
with ``TORCH_KERNELS``. The GPU tests in ``tests/gpu`` cover bf16."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from transformers import AutoConfig

import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import (TORCH_KERNELS, build_cos_sin_cache, rms_norm, rotate_and_store_kv,
                            silu_and_mul)
from nanofn.kernels.all_reduce import FLAG_SLOTS
from nanofn.kernels.partial_sums import RankSums
from nanofn.kernels.triton_ops import TRITON_KERNELS
from nanofn.model import AttentionBatch, build_model, load_weights, model_shape

DTYPES = [torch.float32, torch.float16]
# The kernels round where the references round: they differ only by the order of a sum and rsqrt.
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=2e-3)}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1000])
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_rms_norm_matches_reference(interpreter, dtype, hidden, add_residual):
    generator = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden + 8, generator=generator) * 3).to(dtype)[:, :hidden]  # strided rows
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    residual = torch.randn(37, hidden, generator=generator).to(dtype) if add_residual else None

    out = interpreter(triton_ops.rms_norm, x, weight, 1e-6, residual)

    expected = rms_norm(x, weight, 1e-6, residual)
    if add_residual:
        (out, summed), (expected, expected_summed) = out, expected
        assert torch.equal(summed, expected_summed)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_rms_norm_keeps_leading_dimensions(interpreter):
    generator = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 2, 3, 64, generator=generator)
    weight = torch.rand(64, generator=generator)

    out, summed = interpreter(triton_ops.rms_norm, x, weight, 1e-5, residual)

    expected, expected_summed = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_summed)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def rank_sums(first, second, own_epoch, epochs=None):
    """Rank 0's ``RankSums`` of two summands, as if rank 1 had reached ``own_epoch`` before and
    after reading (its flags in ours) and had not yet seen ours."""
    flags = torch.full((2 * FLAG_SLOTS,), own_epoch, dtype=torch.int32)
    epochs = torch.zeros(FLAG_SLOTS, dtype=torch.int32) if epochs is None else epochs
    return RankSums((first, second), flags, torch.zeros_like(flags), epochs,
                    functools.partial(torch.add, first, second))


def rank_sums_norm_and_flags(x, weight, eps, residual):
    """``triton_ops.rms_norm`` of ``RankSums`` ``x``, and the flags and epochs it left."""
    return triton_ops.rms_norm(x, weight, eps, residual), x.peer_flags, x.epochs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_the_norm_adds_up_two_ranks_summands(interpreter, dtype, add_residual):
    """The norm of two ranks' summands (``RankSums``), added in the kernel as the all-reduce
    adds them; each program tells the other rank the epoch it reached, before and after
    reading, and counts it. On CPU ``triton_ops.rank_sums_programs`` is 8: 37 rows are 5 a
    program, but for the last three."""
    generator = torch.Generator().manual_seed(3)
    first, second = (torch.randn(2, 37, 96, generator=generator) * 3).to(dtype)
    weight = (torch.rand(96, generator=generator) + 0.5).to(dtype)
    residual = torch.randn(37, 96, generator=generator).to(dtype) if add_residual else None
    expected = rms_norm(first + second, weight, 1e-6, residual)
    epochs = None
    for epoch in (1, 2):
        out, told, epochs = interpreter(rank_sums_norm_and_flags,
                                        rank_sums(first, second, epoch, epochs), weight, 1e-6,
                                        residual)
        if add_residual:
            (out, summed), (expected_out, expected_summed) = out, expected
            assert torch.equal(summed, expected_summed)
        else:
            expected_out = expected
        torch.testing.assert_close(out, expected_out, **TOLERANCES[dtype])
        programs = triton_ops.rank_sums_programs(torch.device("cpu"))
        reached = torch.zeros(FLAG_SLOTS, dtype=torch.int32)
        reached[:programs] = epoch
        assert torch.equal(epochs, reached)
        assert torch.equal(told, torch.cat([reached, reached]))


def test_a_norm_without_the_kernel_adds_up_rank_sums_by_the_all_reduce():
    """The torch reference (and any reader that cannot add the summands itself) takes
    ``RankSums.total()``: the all-reduce."""
    generator = torch.Generator().manual_seed(4)
    first, second, residual = torch.randn(3, 5, 64, generator=generator)
    weight = torch.rand(64, generator=generator)

    out, summed = rms_norm(rank_sums(first, second, 1), weight, 1e-6, residual)

    expected, expected_summed = rms_norm(first + second, weight, 1e-6, residual)
    assert torch.equal(summed, expected_summed) and torch.equal(out, expected)


def rotate_store_and_return(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, **norm):
    q_out = triton_ops.rotate_and_store_kv(q, k, v, positions, cache, k_cache, v_cache,
                                           slot_mapping, **norm)
    return q_out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim", [(4, 2, 16), (3, 1, 32), (16, 8, 128)], ids=["16", "32", "128"]
)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-and-rotary"])
@pytest.mark.parametrize("rotary_part", [1, 4], ids=["whole-head", "quarter-head"])
def test_rotate_and_store_kv_matches_reference(interpreter, dtype, num_heads, num_kv_heads,
                                               head_dim, qk_norm, rotary_part):
    """Rotated queries returned; rotated keys and the values in their cache slots, padding
    tokens (slot -1) written nowhere; the rest of the cache untouched. A quarter-head table
    turns the heads' first quarter alone (Qwen3.5's partial rotary)."""
    generator = torch.Generator().manual_seed(head_dim)
    num_tokens, max_positions, block_size = 19, 2048, 16
    cache = build_cos_sin_cache(head_dim // rotary_part, max_positions, 500000.0, LLAMA3_SCALING)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator)
    # q, k and v are views into the fused projection, as the model passes them.
    qkv = (torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator) * 3).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    cache_shape = (3, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(cache_shape, generator=generator).to(dtype) for _ in range(2))
    slot_mapping = torch.randperm(3 * block_size, generator=generator)[:num_tokens]
    slot_mapping[[0, 7, 18]] = -1
    norm = {}
    if qk_norm:
        q_norm_weight, k_norm_weight = (torch.rand(2, head_dim, generator=generator) + 0.5).to(dtype)
        norm = dict(q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=1e-5)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_expected = rotate_and_store_kv(q, k, v, positions, cache, expected_k, expected_v,
                                     slot_mapping, **norm)

    q_out, k_cache, v_cache = interpreter(rotate_store_and_return, q, k, v, positions, cache,
                                          k_cache, v_cache, slot_mapping, **norm)

    assert q_out.dtype == dtype and q_out.is_contiguous()
    torch.testing.assert_close(q_out, q_expected, **TOLERANCES[dtype])
    torch.testing.assert_close(k_cache, expected_k, **TOLERANCES[dtype])
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("batch, table_keys, fused", [
    (1, 4096, False), (2, 4096, True), (32, 4096, True), (33, 4096, False), (82, 4096, False),
    (33, 256, True), (82, 256, True), (83, 256, False), (256, 4096, False)])
def test_rotary_decode_attention_is_one_kernel_for_a_few_sequences_or_one_wave_of_whole_ones(
        monkeypatch, batch, table_keys, fused):
    """The fused kernel takes a few sequences' split contexts (here up to 32 over 8 kv heads
    and 132 SMs) but one sequence's, where rotating in every partition costs more than the
    rotary kernel. Of many sequences it takes only whole contexts up to one wave of programs
    (5 an SM: 82 sequences; whole where a 256-key table leaves nothing to split), above which
    every wave would rotate before reading the cache; one wave of contexts split in two
    (a decode graph's 4,096-key table) takes the rotary kernel first, as more waves do."""
    import nanofn.kernels.triton_attention as triton_attention

    calls = []
    monkeypatch.setattr(triton_attention, "rotary_decode_attention",
                        lambda *args, **kwargs: calls.append("fused"))
    monkeypatch.setattr(triton_ops, "rotate_and_store_kv",
                        lambda q, *args: calls.append("rotary") or q)
    monkeypatch.setattr(triton_attention, "decode_attention",
                        lambda *args, **kwargs: calls.append("attention"))
    heads, kv_heads, head_dim, block_size = 16, 8, 128, 16
    q = torch.empty(batch, heads, head_dim)
    k = v = torch.empty(batch, kv_heads, head_dim)
    cache = torch.empty(8, block_size, kv_heads, head_dim)
    tables = torch.zeros(batch, table_keys // block_size, dtype=torch.int32)
    lengths = torch.ones(batch, dtype=torch.int32)
    positions = slots = torch.zeros(batch, dtype=torch.int64)

    triton_ops.rotary_decode_attention(q, k, v, positions, torch.empty(4096, head_dim), cache,
                                       cache, slots, lengths, tables, 0.1)

    assert calls == (["fused"] if fused else ["rotary", "attention"])


def test_rotate_and_store_kv_requires_a_power_of_two_head_dim():
    q, k, cache = torch.zeros(2, 4, 48), torch.zeros(2, 2, 48), torch.zeros(1, 16, 2, 48)
    with pytest.raises(AssertionError, match="head_dim 48 is not a power of two"):
        triton_ops.rotate_and_store_kv(q, k, k, torch.zeros(2, dtype=torch.int64),
                                       torch.zeros(8, 48), cache, cache, torch.zeros(2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 64), (1, 96), (2, 3, 1500)], ids=str)
def test_silu_and_mul_matches_reference(interpreter, dtype, shape):
    *leading, size = shape  # 1500 spans two column blocks, the second one partly
    x = (torch.randn(*leading, 2 * size, generator=torch.Generator().manual_seed(size)) * 3).to(dtype)

    out = interpreter(triton_ops.silu_and_mul, x)

    assert out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul(x), **TOLERANCES[dtype])


def logits_of_prefill_and_decode(checkpoint, kernels, prompts, block_size=16):
    """The logits of a prefill of ``prompts`` and of one decode step of each, through ``kernels``."""
    config = AutoConfig.from_pretrained(checkpoint)
    model = build_model(config, dtype="float32", device="cpu", kernels=kernels)
    load_weights(model, checkpoint)
    kv_cache = torch.zeros(model_shape(config).kv_cache_shape(num_blocks=8, block_size=block_size))
    tables = [[5, 2, 7], [0, 3, 6]]  # shuffled blocks
    prompt_lens = [len(prompt) for prompt in prompts]
    steps = [(prompts, [0, 0]), ([[3], [4]], prompt_lens)]  # (new tokens, first position) per sequence
    logits = []
    for chunks, starts in steps:
        query_lens = [len(chunk) for chunk in chunks]
        positions = [p for start, n in zip(starts, query_lens) for p in range(start, start + n)]
        owners = [seq for seq, n in enumerate(query_lens) for _ in range(n)]
        slots = [tables[seq][p // block_size] * block_size + p % block_size
                 for seq, p in zip(owners, positions)]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots),
            query_start=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            decode_only=all(n == 1 for n in query_lens),
        )
        input_ids = torch.tensor([token for chunk in chunks for token in chunk])
        with torch.inference_mode():
            hidden = model(input_ids, torch.tensor(positions), batch, kv_cache)
            logits.append(model.compute_logits(hidden))
    return torch.cat(logits)


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3", "tiny_llama3"])
def test_model_with_triton_kernels_matches_torch_kernels(interpreter, request, checkpoint):
    path = request.getfixturevalue(checkpoint)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (40, 23)]

    logits = interpreter(logits_of_prefill_and_decode, path, TRITON_KERNELS, prompts)

    expected = logits_of_prefill_and_decode(path, TORCH_KERNELS, prompts)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
