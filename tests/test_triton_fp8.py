"""The Triton kernels on an FP8 KV cache (and FP8 projections), against the torch references,
on CPU through Triton's interpreter (float32 and float16: see ``test_triton_attention.py``)."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import nanofn.kernels.attention as reference
import nanofn.kernels.triton_attention as triton_attention
from nanofn.kernels import triton_fp8, triton_gemm, triton_ops
from nanofn.kernels.activation import Unactivated
from nanofn.kernels.partial_sums import PartialSums, added_up
from nanofn.kernels.fp8 import FP8_DTYPE, Fp8Weight, fp8_linear, quantize_groups, quantize_static
from nanofn.kernels.triton_fp8 import GROUP
from nanofn.kernels.triton_gemv import GemvConfig
from nanofn.kernels.rotary import apply_rotary
from nanofn.kernels.rotary import rotary_decode_attention as reference_rotary_decode_attention
from nanofn.kernels.rotary import rotate_and_store_kv as reference_rotate_and_store_kv
from test_triton_attention import (PagedCache, attend_and_return_caches,
                                   hidden_states_of_steps, prefill_attention_on, random_queries,
                                   rotary_decode_inputs)
from test_triton_compiles import (BLOCK, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, compiled_code,
                                  empty, new_tokens)
from triton_interpreter import compiler_process

TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=0)}


def fp8_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, seed):
    """``PagedCache`` with its entries in e4m3 (keys of std 4: some past the normal range's
    top binades, some subnormal)."""
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, seed)
    cache.k_cache = (cache.k_cache * 4).to(FP8_DTYPE)
    cache.v_cache = cache.v_cache.to(FP8_DTYPE)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_decode_attention_reads_an_fp8_cache_as_the_reference(interpreter, dtype, num_splits):
    cache = fp8_paged_cache([1, 17, 100, 130], 16, 2, 32, seed=0)
    q = random_queries(4, 4, 32, dtype, seed=1)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, 0.2)
    scales = dict(k_scale=0.5, v_scale=2.0)
    expected = reference.decode_attention(*args, **scales)
    out = interpreter(triton_attention.decode_attention, *args, num_splits=num_splits, **scales)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_reads_an_fp8_cache_as_the_reference(interpreter, dtype):
    seq_lens, query_lens = [5, 40, 70], [5, 9, 33]
    cache = fp8_paged_cache(seq_lens, 16, 2, 32, seed=2)
    q = random_queries(sum(query_lens), 8, 32, dtype, seed=3)
    query_start = torch.tensor([0, 5, 14, 47], dtype=torch.int32)
    args = (q, cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables,
            tuple(query_lens), tuple(seq_lens), 0.2)
    scales = dict(k_scale=0.25, v_scale=0.5)
    expected = reference.prefill_attention(*args, **scales)
    out = interpreter(triton_attention.prefill_attention, *args, **scales)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def fp8_caches_of(inputs: tuple, value_factor: float) -> list:
    """``rotary_decode_inputs``' arguments (q, k, v, positions, cos_sin, k_cache, v_cache,
    slots, seq_lens, block_tables, scale) with their caches in e4m3 and the values times
    ``value_factor`` (300: some saturate at 448)."""
    inputs = list(inputs)
    inputs[5], inputs[6] = inputs[5].to(FP8_DTYPE), inputs[6].to(FP8_DTYPE)
    inputs[2] = inputs[2] * value_factor
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotate_and_store_kv_writes_an_fp8_cache_as_the_reference(interpreter, dtype):
    args = fp8_caches_of(rotary_decode_inputs([3, 20, 47], 2, dtype, seed=4), 300)[:8]
    expected_caches = [c.clone() for c in args[5:7]]
    expected_q = reference_rotate_and_store_kv(*args[:5], *expected_caches, args[7])
    q, k_cache, v_cache = interpreter(_store_and_return_caches, *args)
    torch.testing.assert_close(q, expected_q, **TOLERANCES[dtype])
    assert v_cache.float().abs().max() == 448  # saturated, not NaN
    for actual, expected in zip((k_cache, v_cache), expected_caches):
        assert_e4m3_close(actual, expected)


def assert_e4m3_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """FP8 cache entries that Triton's interpreter wrote equal the reference's, but where its
    rounding to e4m3 slips as the GPU's conversion does not: a mantissa that rounds up past
    1.75 loses its carry (2.0 becomes 1.0: its ``_convert_float`` ORs the carry into the
    exponent), ties round up, not to even, and subnormals (below 2^-6, in steps of 2^-9) are
    cut, not rounded. Those are a few percent of the entries (a carry: 1 value in 32)."""
    actual, expected = actual.float(), expected.float()
    carry_lost = (actual == expected / 2) & (expected.abs().log2() % 1 == 0)
    one_step = (actual - expected).abs() <= expected.abs() / 8 + 2.0**-9
    assert (carry_lost | one_step).all()
    assert (actual != expected).float().mean() < 0.05


def _store_and_return_caches(*args):
    q = triton_ops.rotate_and_store_kv(*args)
    return q, args[5], args[6]


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_rotary_decode_attention_on_an_fp8_cache_attends_to_what_it_stores(interpreter,
                                                                           num_splits):
    """The fused kernel attends to its token's key and value from registers, rounded to e4m3
    as it stores them: its output is attention over the cache it leaves, and that cache is the
    reference's."""
    args = fp8_caches_of(rotary_decode_inputs([3, 20, 47, 64], 2, torch.float32, seed=5), 1)
    expected_caches = [c.clone() for c in args[5:7]]
    reference_rotary_decode_attention(*args[:5], *expected_caches, *args[7:])
    out, k_cache, v_cache = interpreter(attend_and_return_caches,
                                        triton_attention.rotary_decode_attention, *args,
                                        num_splits=num_splits)
    q, _ = apply_rotary(args[0], args[1], args[3], args[4])
    attended = reference.decode_attention(q, k_cache, v_cache, *args[8:])
    torch.testing.assert_close(out, attended, **TOLERANCES[torch.float32])
    assert_e4m3_close(k_cache, expected_caches[0])
    assert_e4m3_close(v_cache, expected_caches[1])


@pytest.fixture(scope="module")
def compile_for_h100():
    with compiler_process() as run:
        yield run


@pytest.mark.parametrize("batch, splits", [(64, 1), (2, 4)])
def test_attention_kernels_on_an_fp8_cache_compile(compile_for_h100, batch, splits):
    """At Qwen3-0.6B's shapes in bf16 with an e4m3 cache: the rotary KV store, decode (one
    partition and split-K; fused with the rotary store and not), and prefill."""
    caches = (empty(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE),
              empty(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE))
    seq_lens = torch.ones(batch, dtype=torch.int32)
    tables = torch.zeros(batch, 256, dtype=torch.int32)
    q, k, v, positions, cos_sin, slots = new_tokens(batch)
    norms = (empty(HEAD_DIM), empty(HEAD_DIM))
    compile_for_h100(triton_ops.rotate_and_store_kv, q, k, v, positions, cos_sin, *caches, slots,
                     *norms)
    compile_for_h100(triton_attention.decode_attention, empty(batch, HEADS, HEAD_DIM), *caches,
                     seq_lens, tables, HEAD_DIM**-0.5, None, splits, k_scale=0.5, v_scale=2.0)
    compile_for_h100(triton_attention.rotary_decode_attention, q, k, v, positions, cos_sin,
                     *caches, slots, seq_lens, tables, HEAD_DIM**-0.5, None, *norms, 1e-6, splits)
    compile_for_h100(prefill_attention_on, 132, empty(5 * batch, HEADS, HEAD_DIM), *caches,
                     torch.arange(0, 5 * batch + 1, 5, dtype=torch.int32), seq_lens * 5, tables,
                     (5,) * batch, (5,) * batch, HEAD_DIM**-0.5)


def decode_code(*args) -> tuple[int, str]:
    """The decode kernel's registers a thread and SASS, as ``decode_attention(*args)`` compiles it."""
    return compiled_code(triton_attention._decode_kernel, triton_attention.decode_attention, *args)


@pytest.mark.parametrize("batch, splits, max_registers", [(256, 1, 96), (256, 4, 96), (1, 8, 168)])
def test_decode_on_an_fp8_cache_reads_its_tiles_from_shared_memory_in_words(
        compile_for_h100, batch, splits, max_registers):
    """The value tile reaches the product converted to fp16 (``_values_in``): converted after
    shared memory instead, it is read a byte at a time (128 ``LDS.U8`` a 64-key tile), and the
    kernel took 154 registers a thread at one partition (194 split), against 106 (162); many
    sequences' programs are capped at 96, five programs an SM (``DECODE_MAX_REGISTERS``)."""
    caches = (empty(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE),
              empty(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE))
    registers, sass = compile_for_h100(
        decode_code, empty(batch, HEADS, HEAD_DIM), *caches, torch.ones(batch, dtype=torch.int32),
        torch.zeros(batch, 256, dtype=torch.int32), HEAD_DIM**-0.5, None, splits)
    assert "LDS.U8" not in sass
    assert registers <= max_registers


# --- FP8 projections -------------------------------------------------------------------------

def fp8_weight(n: int, k: int, kind: str, seed: int) -> Fp8Weight:
    """Block-wise (groups of 128), per-channel or per-tensor with a static activation scale."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * torch.linspace(0.1, 2, n)[:, None]
    if kind == "block":
        q, scale = quantize_groups(w, GROUP)  # (rows' own scales per group: layout as blocks')
        return Fp8Weight(q, scale, GROUP)
    q, scale = quantize_groups(w, k)
    input_scale = torch.tensor(0.02) if kind == "static" else None
    return Fp8Weight(q, scale, k, input_scale)


WEIGHT_KINDS = ["block", "channel", "static"]


# Row widths: one step of the quantization kernel, and several (wider than QUANTIZE_BLOCK: a
# pass for the scale, then one for the codes); groups of 128 columns, a row's, or static
QUANTIZED_WIDTHS = [300, triton_fp8.QUANTIZE_BLOCK + 300]
ACTIVATION_GROUPS = [(128, False), (None, False), (None, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", QUANTIZED_WIDTHS)
@pytest.mark.parametrize("group_size, static", ACTIVATION_GROUPS)
def test_activation_quantization_gives_the_references_codes_and_scales(interpreter, dtype, width,
                                                                       group_size, static):
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1] = 0  # a row of zeros: the smallest scale, codes 0
    x[2, 7] = 30.0  # a largest magnitude in the first step
    input_scale = torch.tensor(0.01) if static else None
    group_size = group_size or width
    q, scales = interpreter(triton_fp8.quantize_activations, x, group_size, input_scale)
    if static:
        expected_q, expected_scales = quantize_static(x, 0.01), torch.full((5, 1), 0.01)
    else:
        expected_q, expected_scales = quantize_groups(x, group_size)
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    assert_e4m3_close(q, expected_q)


def _gated_quantized_both_ways(gate_up, group_size, input_scale):
    """``quantize_activations`` of ``gate_up``'s activation: computed by the quantization
    kernel, and stored by ``silu_and_mul`` first."""
    return (triton_fp8.quantize_activations(gate_up, group_size, input_scale, gated=True),
            triton_fp8.quantize_activations(triton_ops.silu_and_mul(gate_up), group_size,
                                            input_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", QUANTIZED_WIDTHS)
@pytest.mark.parametrize("group_size, static", ACTIVATION_GROUPS)
def test_the_quantization_of_an_activation_gives_the_stored_activations_codes(
        interpreter, dtype, width, group_size, static):
    """``gated``: the kernel reads ``[gate | up]`` (``width`` columns each: a short last group)
    and quantizes ``silu(gate) * up`` as ``silu_and_mul`` rounds it, giving exactly the codes
    and scales of that activation stored and then quantized; rows of different magnitudes, one
    of zeros."""
    generator = torch.Generator().manual_seed(16)
    gate_up = (torch.randn(5, 2 * width, generator=generator)
               * torch.logspace(-2, 1, 5)[:, None] * 3)
    gate_up[1] = 0
    gate_up[2, [7, width + 7]] = 30.0  # a largest activation in the first step
    input_scale = torch.tensor(0.01) if static else None
    (q, scales), (expected_q, expected_scales) = interpreter(
        _gated_quantized_both_ways, gate_up.to(dtype), group_size or width, input_scale)
    assert q.shape == (5, width) and q.dtype == FP8_DTYPE
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    torch.testing.assert_close(q.float(), expected_q.float(), rtol=0, atol=0)


def exactly_quantized_input(rows: int, k: int, group_size: int, static: bool,
                            dtype: torch.dtype) -> torch.Tensor:
    """Activations that quantize without rounding: e4m3 values times a power of two per row
    and group, whose largest magnitude is 448 of them, in its last column (static: times the
    static scale 2^-6).
    Their codes do not depend on how a conversion rounds, which in the interpreter slips
    (``assert_e4m3_close``); the rounding itself is the quantization kernel's test's."""
    generator = torch.Generator().manual_seed(rows)
    codes = (torch.randn(rows, k, generator=generator) * 100).to(FP8_DTYPE).float()
    if static:
        return (codes * 2.0**-6).to(dtype)
    groups = -(-k // group_size)
    group_ends = torch.arange(1, groups + 1).clamp(max=k / group_size) * group_size - 1
    codes[:, group_ends.long()] = 448.0  # each group's last column: a scan must reach it
    exponents = torch.randint(-8, 0, (rows, groups), generator=generator).float()
    return (codes * (2.0**exponents).repeat_interleave(group_size, dim=1)[:, :k]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("rows", [1, 3, 70])  # the GEMV, and the GEMM over two row tiles
def test_fp8_projection_kernels_give_the_reference_product(interpreter, dtype, kind, rows):
    """K = 300 (a short last group) and 200 outputs (a short last tile); with a bias."""
    weight = fp8_weight(200, 300, kind, seed=7)
    if kind == "static":
        weight = Fp8Weight(weight.data, weight.scale, weight.group_size, torch.tensor(2.0**-6))
    x = exactly_quantized_input(rows, 300, weight.group_size, kind == "static", dtype)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(8)).to(dtype)
    out = interpreter(triton_fp8.fp8_linear, x, weight, bias)
    expected = fp8_linear(x, weight, bias)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3  # (the sums' order; float16 output)
    torch.testing.assert_close(out, expected, rtol=tolerance,
                               atol=tolerance * expected.float().abs().max().item())


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_fp8_gemv_over_several_tiles_a_row_gives_the_reference_product(interpreter, kind,
                                                                         rows):
    """Tiles of 128 columns over K = 300: a per-token scale from a first pass over the whole
    row (whose largest magnitude is in its last tile), block-wise groups one a tile, the short
    last tile masked; 40 outputs in programs of 16 (a short last one)."""
    weight = fp8_weight(40, 300, kind, seed=12)
    if kind == "static":
        weight = Fp8Weight(weight.data, weight.scale, weight.group_size, torch.tensor(2.0**-6))
    x = exactly_quantized_input(rows, 300, weight.group_size, kind == "static", torch.float32)
    out = interpreter(triton_fp8.fp8_gemv, x, weight, None, GemvConfig(16, 128, 4))
    expected = fp8_linear(x, weight)
    torch.testing.assert_close(out, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("k, splits", [(512, 4), (384, 1), (300, 1)])
def test_the_split_k_fp8_gemm_leaves_sums_that_add_up_to_the_reference_product(
        interpreter, kind, k, splits):
    """o_proj's and down_proj's GEMM at decode sizes (``fp8_partial_sums_gemm``): 70 rows (two
    row tiles), 200 outputs (a short last tile), K in four ranges of 128 columns, or where K
    does not split into ranges of 128-column steps (384 into four) in one (300: a short last
    step and group); each range's sums are its columns' product, scales applied."""
    weight = fp8_weight(200, k, kind, seed=14)
    if kind == "static":
        weight = Fp8Weight(weight.data, weight.scale, weight.group_size, torch.tensor(2.0**-6))
    x = exactly_quantized_input(70, k, weight.group_size, kind == "static", torch.float32)
    config = triton_gemm.GemmConfig(64, 64, 32, split_k=4)
    partial = interpreter(triton_fp8.fp8_partial_sums_gemm, x, weight, config)
    assert partial.sums.shape == (splits, 70, 200) and partial.sums.dtype == torch.float32
    expected = fp8_linear(x, weight)
    tolerance = dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(partial.total(), expected, **tolerance)
    if splits > 1:  # the first range's sums: its columns' product (x quantizes exactly)
        first = slice(0, k // splits)
        expected_first = x[:, first] @ weight.dequantized()[:, first].T
        torch.testing.assert_close(partial.sums[0], expected_first, **tolerance)


def _fp8_linear_counting_scaled_mm(x, weight):
    """``triton_fp8.fp8_linear(x, weight)`` and how many times it called ``torch._scaled_mm``."""
    calls = []
    scaled_mm = torch._scaled_mm
    with mock.patch.object(torch, "_scaled_mm",
                           lambda *a, **kw: calls.append(1) or scaled_mm(*a, **kw)):
        return triton_fp8.fp8_linear(x, weight), len(calls)


def test_the_rowwise_scaled_gemm_gives_the_reference_product(interpreter):
    """Prompt-sized bf16 products on per-channel weights through ``torch._scaled_mm`` (on the
    CPU here): 300 rows, 64 outputs, per-token activation scales; to bf16's rounding. With a
    bias (or block-wise or static scales) the Triton GEMM takes the product instead."""
    weight = fp8_weight(64, 256, "channel", seed=13)
    x = exactly_quantized_input(300, 256, weight.group_size, False, torch.bfloat16)
    assert triton_fp8.takes_rowwise_scales(x.dtype, weight, None)
    assert not triton_fp8.takes_rowwise_scales(x.dtype, weight, torch.zeros(64))
    assert not triton_fp8.takes_rowwise_scales(x.dtype, fp8_weight(64, 256, "block", seed=13),
                                               None)
    out, calls = interpreter(_fp8_linear_counting_scaled_mm, x, weight)
    assert calls == 1
    expected = fp8_linear(x, weight)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2,
                               atol=1e-3 * expected.float().abs().max().item())


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_fp8_projection_kernels_compile(compile_for_h100, kind):
    """bf16 activations at Qwen3-0.6B's qkv_proj: the quantization kernel, the GEMV at 1 and 8
    rows and the GEMM; o_proj's split-K GEMM, and the same from an activation computed as it
    is quantized."""
    k, n = HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM
    groups = k // 128 if kind == "block" else 1
    weight = Fp8Weight(empty(n, k, dtype=FP8_DTYPE), empty(n, groups, dtype=torch.float32),
                       128 if kind == "block" else k,
                       empty((), dtype=torch.float32) if kind == "static" else None)
    # the GEMV (at 8 rows past ``GEMV_MAX_ROW_BYTES``: called itself), the GEMM's few-row
    # tile at 8 and 64 rows, its small and large tiles
    compile_for_h100(triton_fp8.fp8_gemv, empty(8, k), weight, empty(n))
    for rows in (1, 8, 64, 200, 300):
        compile_for_h100(triton_fp8.fp8_linear, empty(rows, k), weight, empty(n))
    for rows in (9, 64, 256):  # o_proj's split-K GEMM (its 2,048 columns in 4, 4, 2 ranges)
        wide_k = HEADS * HEAD_DIM
        o_proj = Fp8Weight(empty(HIDDEN, wide_k, dtype=FP8_DTYPE),
                           empty(HIDDEN, wide_k // 128 if kind == "block" else 1,
                                 dtype=torch.float32),
                           128 if kind == "block" else wide_k, weight.input_scale)
        compile_for_h100(triton_fp8.fp8_partial_sums_gemm, empty(rows, wide_k), o_proj,
                         triton_gemm.gemm_config(wide_k, rows))
        # down_proj's, activating [gate | up] as it quantizes (2,048 columns of activation)
        compile_for_h100(triton_fp8.fp8_partial_sums_gemm, empty(rows, 2 * wide_k), o_proj,
                         triton_gemm.gemm_config(wide_k, rows), gated=True)
    wide = 12288  # Qwen3-8B's down_proj: three tiles of 4,096 columns a row
    wide_weight = Fp8Weight(empty(n, wide, dtype=FP8_DTYPE),
                            empty(n, wide // 128 if kind == "block" else 1, dtype=torch.float32),
                            128 if kind == "block" else wide, weight.input_scale)
    # the GEMV; the GEMM in its few-row tile (a 50 MB weight) and its small tile, after
    # quantizing a row in steps (per token)
    for rows in (1, 4, 64):
        compile_for_h100(triton_fp8.fp8_linear, empty(rows, wide), wide_weight)
    for rows, residual in ((1, None), (4, empty(4, k))):
        for gated in (False, True):
            compile_for_h100(triton_fp8.fp8_rms_norm_gemv, empty(rows, k), empty(k), 1e-6,
                             residual, weight, gated=gated)
    for rows in (9, 256):  # the norm that quantizes, from a row or from partial sums
        sums = PartialSums(empty(2, rows, k, dtype=torch.float32), torch.bfloat16)
        for x in (empty(rows, k), sums):
            compile_for_h100(triton_ops.rms_norm_quantized, x, empty(k), 1e-6, empty(rows, k),
                             weight)


def gemm_code(rows: int, n: int, k: int) -> tuple[int, str, int]:
    """The W8A8 GEMM's registers a thread, SASS and outputs a tile, as ``fp8_linear`` of
    ``rows`` rows compiles it for a per-channel ``[n, k]`` weight."""
    kernel = triton_fp8._fp8_gemm_kernel
    run, block_n = kernel.run, []
    weight = Fp8Weight(empty(n, k, dtype=FP8_DTYPE), empty(n, 1, dtype=torch.float32), k)
    with mock.patch.object(kernel, "run",
                           lambda *a, **kw: block_n.append(kw["BLOCK_N"]) or run(*a, **kw)):
        registers, sass = compiled_code(kernel, triton_fp8.fp8_linear, empty(rows, k), weight)
    return registers, sass, block_n[0]


@pytest.mark.parametrize("rows", [4, 64])
def test_the_few_row_gemm_tiles_multiply_on_the_fp8_tensor_cores_without_spills(
        compile_for_h100, rows):
    """Qwen3-8B's o_proj (4,096 outputs: 32 a tile, six stages) and gate_up
    (``FEW_ROWS_WIDE_OUTPUTS`` and more: 64 a tile) past the GEMV's bound: FP8 warpgroup
    products (``QGMMA``), nothing spilled."""
    for n, block_n in ((4096, 32), (24576, 64)):
        registers, sass, launched = compile_for_h100(gemm_code, rows, n, 4096)
        assert launched == block_n
        assert "QGMMA" in sass
        assert "LDL" not in sass and "STL" not in sass
        assert registers <= 128


def _gemm_launch_overlaps(rows: int) -> bool:
    """Whether ``fp8_linear`` of ``rows`` rows (block-wise weights: the Triton GEMM at any
    size) launches its GEMM overlapped with the kernel ahead."""
    seen = []
    kernel = triton_fp8._fp8_gemm_kernel
    run = kernel.run
    k = HIDDEN
    weight = Fp8Weight(empty(HEADS * HEAD_DIM, k, dtype=FP8_DTYPE),
                       empty(HEADS * HEAD_DIM, k // 128, dtype=torch.float32), 128)
    with mock.patch.object(kernel, "run",
                           lambda *a, **kw: seen.append(kw["OVERLAP"]) or run(*a, **kw)):
        triton_fp8.fp8_linear(empty(rows, k), weight)
    return seen[0]


def test_the_fp8_gemm_launches_overlapped_at_decode_sizes_only(compile_for_h100):
    """Where it was measured (up to 256 rows); a prompt's launches after the kernel ahead."""
    assert compile_for_h100(_gemm_launch_overlaps, triton_fp8.SMALL_GEMM_MAX_ROWS) is True
    assert compile_for_h100(_gemm_launch_overlaps, triton_fp8.SMALL_GEMM_MAX_ROWS + 1) is False


def test_the_triton_backend_multiplies_fp8_weights_with_these_kernels(interpreter):
    """``TRITON_KERNELS``' projections take an ``Fp8Weight`` to the GEMV and the GEMM (asked
    for partial sums, the split-K GEMM, past the GEMV's rows), and after a norm, at a few rows, to the fused kernel, else to the norm kernel, then them."""
    weight = fp8_weight(64, 256, "block", seed=9)
    for rows in (2, 20):
        x = exactly_quantized_input(rows, 256, GROUP, False, torch.float32)
        expected = fp8_linear(x, weight)
        torch.testing.assert_close(interpreter(triton_ops.linear, x, weight), expected,
                                   rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        partial = interpreter(functools.partial(triton_ops.linear, partial_sums=True), x, weight)
        if rows > triton_fp8.GEMV_MAX_ROWS:  # asked for partial sums: the split-K GEMM's
            assert isinstance(partial, PartialSums) and len(partial.sums) == 2
            partial = partial.total()
        torch.testing.assert_close(partial, expected, rtol=1e-5,
                                   atol=1e-5 * expected.abs().max().item())
    residual = torch.randn(20, 256, generator=torch.Generator().manual_seed(1))
    norm_weight = torch.rand(256, generator=torch.Generator().manual_seed(1)) + 0.5
    (out, summed), (normed, expected_summed) = interpreter(
        _norm_linear_and_parts, x, norm_weight, residual, weight)
    torch.testing.assert_close(summed, expected_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, interpreter(triton_fp8.fp8_linear, normed, weight),
                               rtol=0, atol=0)


def _mlp_both_ways(x, norm_weight, residual, gate_up, down):
    """An FP8 MLP's down projection (as partial sums) of ``rms_norm_linear(..., gated=True)``'s
    first result, and of ``silu_and_mul`` of the plain projection."""
    activated, _ = triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, gate_up, gated=True)
    product, _ = triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, gate_up)
    return (activated, added_up(triton_ops.linear(activated, down, partial_sums=True)),
            added_up(triton_ops.linear(triton_ops.silu_and_mul(product), down, partial_sums=True)))


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("rows", [3, 6, 20])
def test_an_fp8_mlp_activates_in_the_down_projections_quantization(interpreter, kind, rows):
    """Past the fused GEMV's rows, gated ``rms_norm_linear`` leaves its product
    ``Unactivated`` and ``linear`` on an FP8 weight activates it in the kernel that quantizes
    it (the GEMM's rows) or with ``silu_and_mul`` (the GEMV's): the down projection is the
    same, bit for bit, as of the activation stored first. (3 rows: the fused GEMV activates.)"""
    generator = torch.Generator().manual_seed(17)
    gate_up, down = fp8_weight(256, 256, kind, seed=18), fp8_weight(64, 128, kind, seed=19)
    if kind == "static":
        down = Fp8Weight(down.data, down.scale, down.group_size, torch.tensor(2.0**-6))
    x, residual = (torch.randn(rows, 256, generator=generator) for _ in range(2))
    norm_weight = torch.rand(256, generator=generator) + 0.5
    activated, out, expected = interpreter(_mlp_both_ways, x, norm_weight, residual, gate_up,
                                           down)
    assert isinstance(activated, Unactivated) == (rows > triton_fp8.NORM_GEMV_MAX_ROWS)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)



def test_the_gemv_takes_one_row_of_any_weight_and_a_few_rows_of_a_small_one():
    """One row: the GEMV, whatever the weight. 2-8 rows: the GEMV while rows times the
    weight's bytes are at most ``GEMV_MAX_ROW_BYTES`` (12 MiB: Qwen3-0.6B's down, 3 MiB, up to
    4 rows; its gate_up, 6 MiB, at 2), the GEMM past it (Qwen3-8B's qkv, 24 MiB, from 2
    rows). More rows: the GEMM."""
    def weight(n, k):
        return Fp8Weight(torch.empty(n, k, dtype=FP8_DTYPE, device="meta"),
                         torch.empty(n, 1, device="meta"), k)

    down, gate_up, large = weight(1024, 3072), weight(6144, 1024), weight(6144, 4096)
    assert [rows for rows in range(10) if triton_fp8.takes_gemv(rows, down)] == [0, 1, 2, 3, 4]
    assert [rows for rows in range(10) if triton_fp8.takes_gemv(rows, gate_up)] == [0, 1, 2]
    assert [rows for rows in range(10) if triton_fp8.takes_gemv(rows, large)] == [0, 1]
    assert not triton_fp8.takes_gemv(2, down, 1)


def _layer_projections_and_kernels(max_row_bytes, x, norm_weight, residual, qkv, gate_up,
                                   down):
    """With ``GEMV_MAX_ROW_BYTES`` at ``max_row_bytes``: a layer's FP8 projections on the
    Triton backend (qkv after the norm; gate_up after it, gated, then down as partial sums),
    their outputs (down's added up) and the kernels each launched: "gemv", "gemm",
    "norm-quantize" and "quantize" (or "quantize-gated", activating as it quantizes)."""
    launched = []

    def recording(name, function):
        def record(*args, **kwargs):
            gated = name == "quantize" and (args[3] if len(args) > 3 else kwargs.get("gated"))
            launched[-1].append(name + ("-gated" if gated else ""))
            return function(*args, **kwargs)
        return record

    patches = [mock.patch.object(triton_fp8, "GEMV_MAX_ROW_BYTES", max_row_bytes)]
    for module, attribute, name in ((triton_fp8, "_launch_gemv", "gemv"),
                                    (triton_fp8, "_launch_gemm", "gemm"),
                                    (triton_fp8, "quantize_activations", "quantize"),
                                    (triton_ops, "rms_norm_quantized", "norm-quantize")):
        patches.append(mock.patch.object(module, attribute,
                                         recording(name, getattr(module, attribute))))
    for patch in patches:
        patch.start()
    try:
        launched.append([])
        q, _ = triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, qkv)
        launched.append([])
        activated, _ = triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, gate_up,
                                                  gated=True)
        launched.append([])
        out = added_up(triton_ops.linear(activated, down, partial_sums=True))
    finally:
        for patch in patches:
            patch.stop()
    return (q, out), launched


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
def test_a_few_rows_of_a_large_fp8_weight_take_the_gemm_and_give_the_gemvs_product(
        interpreter, kind):
    """At 3 rows, a layer's projections whose rows times bytes pass ``GEMV_MAX_ROW_BYTES`` (set
    to 0) take the norm that quantizes, the quantization kernel (down's activating as it
    quantizes) and the GEMM, where small ones take the fused GEMVs; the products are the
    same up to the sums' order. One row takes the GEMVs either way."""
    generator = torch.Generator().manual_seed(21)
    qkv, gate_up, down = (fp8_weight(96, 256, kind, seed=22), fp8_weight(256, 256, kind, seed=23),
                          fp8_weight(64, 128, kind, seed=24))
    for rows in (3, 1):
        x, residual = (torch.randn(rows, 256, generator=generator) for _ in range(2))
        norm_weight = torch.rand(256, generator=generator) + 0.5
        layer = (x, norm_weight, residual, qkv, gate_up, down)
        small, small_kernels = interpreter(_layer_projections_and_kernels, 1 << 30, *layer)
        large, large_kernels = interpreter(_layer_projections_and_kernels, 0, *layer)
        assert small_kernels == [["gemv"], ["gemv"], ["gemv"]]
        if rows == 1:
            assert large_kernels == small_kernels
        else:
            assert large_kernels == [["norm-quantize", "gemm"], ["norm-quantize", "gemm"],
                                     ["quantize-gated", "gemm"]]
        for got, expected in zip(large, small):
            torch.testing.assert_close(got, expected, rtol=1e-5,
                                       atol=1e-5 * expected.abs().max().item())

def _norm_linear_and_parts(x, norm_weight, residual, weight):
    return (triton_ops.rms_norm_linear(x, norm_weight, 1e-6, residual, weight),
            triton_ops.rms_norm(x, norm_weight, 1e-6, residual))


def _norm_quantized_both_ways(x, norm_weight, residual, weight):
    """``rms_norm_quantized``'s codes, scales and residual sum, and those of the norm kernel
    followed by the quantization kernel."""
    fused = triton_ops.rms_norm_quantized(x, norm_weight, 1e-6, residual, weight)
    if residual is None:
        normed, summed = triton_ops.rms_norm(x, norm_weight, 1e-6), added_up(x)
    else:
        normed, summed = triton_ops.rms_norm(x, norm_weight, 1e-6, residual)
    return fused, (*triton_fp8.quantize_activations(normed, weight.group_size,
                                                    weight.input_scale), summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("source", ["rows", "rows-and-residual", "partial-sums-and-residual"])
def test_the_norm_that_quantizes_gives_the_norms_codes_quantized(interpreter, dtype, kind,
                                                                 source):
    """FP8 ``rms_norm_linear`` past the GEMV's rows: the norm kernel stores e4m3 codes and
    their scales (per token, per group of 128 columns, or static), exactly the codes and
    scales of the normed rows stored and quantized by the quantization kernel; 300 columns (a
    short last group), a norm weight far from 1, rows of different magnitudes; in float16
    the normed rows are rounded to it before they are quantized, as when they are stored."""
    generator = torch.Generator().manual_seed(15)
    weight = fp8_weight(40, 300, kind, seed=15)
    x = torch.randn(6, 300, generator=generator) * torch.logspace(-2, 2, 6)[:, None]
    x[1] = 0  # with no residual there, a row of zeros: the smallest scale, codes 0
    if source == "partial-sums-and-residual":
        x = PartialSums(torch.stack([x, x.roll(1, 1), -0.5 * x]), dtype)
    else:
        x = x.to(dtype)
    residual = None if source == "rows" else torch.randn(6, 300, generator=generator).to(dtype)
    if residual is not None:
        residual[1] = 0
    norm_weight = (torch.rand(300, generator=generator) * 3).to(dtype)
    fused, unfused = interpreter(_norm_quantized_both_ways, x, norm_weight, residual, weight)
    assert fused[0].dtype == FP8_DTYPE and fused[1].shape == unfused[1].shape
    for got, expected in zip(fused, unfused):
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0)


def _unfused_norm_gemv(x, norm_weight, residual, weight, bias, gated):
    normed, summed = (triton_ops.rms_norm(x, norm_weight, 1e-6, residual) if residual is not None
                      else (triton_ops.rms_norm(x, norm_weight, 1e-6), x))
    out = triton_fp8.fp8_gemv(normed, weight, bias)
    return (triton_ops.silu_and_mul(out) if gated else out), summed


@pytest.mark.parametrize("kind", WEIGHT_KINDS)
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_the_fused_norm_and_fp8_gemv_is_the_norm_then_the_gemv(interpreter, kind, gated,
                                                                add_residual):
    """One kernel for the norm, the quantization, the product (and the activation): the
    norm kernel, then ``fp8_gemv`` (then ``silu_and_mul``), up to the sums' order, the residual
    stream bit for bit. 3 rows of 256 columns (two groups), 40 outputs (a short last tile)."""
    weight = fp8_weight(80 if gated else 40, 256, kind, seed=10)
    generator = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(3, 256, generator=generator) for _ in range(2))
    norm_weight = torch.rand(256, generator=generator) + 0.5
    bias = torch.randn(len(weight.data), generator=generator)
    residual = residual if add_residual else None
    out, summed = interpreter(triton_fp8.fp8_rms_norm_gemv, x, norm_weight, 1e-6, residual,
                              weight, bias, gated=gated)
    expected, expected_summed = interpreter(_unfused_norm_gemv, x, norm_weight, residual,
                                            weight, bias, gated)
    torch.testing.assert_close(summed, expected_summed, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5,
                               atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("fp8, bound", [(dict(quantization="fp8"), 1e-5),
                                        (dict(kv_dtype=FP8_DTYPE), 1e-2)],
                         ids=["fp8-weights", "fp8-kv-cache"])
def test_a_model_with_fp8_weights_or_kv_cache_on_triton_matches_the_torch_references(
        interpreter, tiny_qwen3, fp8, bound):
    """Prefill, mixed and decode steps (``test_triton_attention``'s) of the tiny qwen3 quantized
    at load, or with an FP8 cache: the Triton kernels' hidden states against the references'.
    FP8 weights to float32's precision (measured 4e-7 of the largest state); an FP8 cache to
    1 %: the interpreter's e4m3 rounding slips (``assert_e4m3_close``) move a few cache
    entries by a step (measured 0.4 %, at two tokens). (Both together: 6 %, each slip then
    moving the activations' codes too, which the tiny model's std-0.5 weights amplify.)"""
    tokens = torch.randint(3, 300, (3, 45), generator=torch.Generator().manual_seed(8)).tolist()
    steps = [
        {"a": (0, tokens[0][:40]), "b": (0, tokens[1][:20])},
        {"a": (40, tokens[0][40:41]), "b": (20, tokens[1][20:45]), "c": (0, tokens[2][:30])},
        {"a": (41, tokens[0][41:42]), "b": (45, tokens[1][:1]), "c": (30, tokens[2][30:31])},
    ]
    hidden = interpreter(hidden_states_of_steps, tiny_qwen3, "triton", steps, **fp8)
    expected = hidden_states_of_steps(tiny_qwen3, "torch", steps, **fp8)
    assert ((hidden - expected).abs().max() / expected.abs().max()).item() < bound
