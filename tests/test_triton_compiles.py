"""Every Triton kernel compiles for an H100 (SM 9.0), in bf16, with overlapped launches, as its
host function launches it at the model's shapes (Qwen3-0.6B's): what the interpreter tests
cannot catch, since Triton's interpreter runs a kernel that the compiler rejects."""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from unittest import mock

import pytest
import torch
import triton.knobs

from nanofn.kernels import (triton_attention, triton_decode_inputs, triton_gemm, triton_gemv,
                            triton_moe, triton_ops, triton_sampling)
from nanofn.kernels.all_reduce import FLAG_SLOTS
from nanofn.kernels.fp8 import FP8_DTYPE, Fp8Weight
from nanofn.kernels.partial_sums import RankSums
from test_triton_attention import prefill_attention_on
from triton_interpreter import compiler_process

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, BLOCK = 1024, 16, 8, 128, 3072, 151936, 16
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def compile_for_h100():
    """``run(function, *args)``: ``function`` in a child whose launches compile for SM 9.0."""
    with compiler_process() as run:
        yield run


def empty(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemvs_compile(compile_for_h100, rows):
    """Plain (with and without bias, up to the LM head's width), and after a norm (plain, and
    gated: the activation of gate_up_proj)."""
    x = empty(rows, HIDDEN)
    compile_for_h100(triton_gemv.gemv, x, empty(HEADS * HEAD_DIM * 2, HIDDEN))
    compile_for_h100(triton_gemv.gemv, x, empty(VOCAB, HIDDEN))
    compile_for_h100(triton_gemv.gemv, empty(rows, 4 * HIDDEN), empty(HIDDEN, 4 * HIDDEN), empty(HIDDEN))
    for residual in (None, empty(rows, HIDDEN)):
        for gated in (False, True):
            compile_for_h100(triton_gemv.rms_norm_gemv, x, empty(HIDDEN), 1e-6, residual,
                             empty(2 * INTERMEDIATE, HIDDEN), gated=gated)


@pytest.mark.parametrize("rows", [5, 64, 128])
def test_split_k_gemm_and_its_norm_compile(compile_for_h100, rows):
    """o_proj's and down_proj's partial sums, and the norm adding them up (with and without a
    residual)."""
    for k in (HEADS * HEAD_DIM, INTERMEDIATE):
        sums = compile_for_h100(triton_gemm.partial_sums_gemm, empty(rows, k), empty(HIDDEN, k))
        for residual in (None, empty(rows, HIDDEN)):
            compile_for_h100(triton_ops.rms_norm, sums, empty(HIDDEN), 1e-6, residual)


@pytest.mark.parametrize("rows", [1, 5, 256])
def test_the_norm_of_two_ranks_summands_compiles(compile_for_h100, rows):
    """The norm that adds up two ranks' summands itself (``RankSums``: flags, spin-waits and
    system-scope atomics), with and without a residual."""
    flags = torch.zeros(2 * FLAG_SLOTS, dtype=torch.int32)
    summands = empty(rows, HIDDEN), empty(rows, HIDDEN)
    x = RankSums(summands, flags, flags.clone(), torch.zeros(FLAG_SLOTS, dtype=torch.int32),
                 functools.partial(torch.add, *summands))
    for residual in (None, empty(rows, HIDDEN)):
        compile_for_h100(triton_ops.rms_norm, x, empty(HIDDEN), 1e-6, residual)


@pytest.mark.parametrize("rows", [5, 32, 64])
def test_gemm_after_a_norm_compiles(compile_for_h100, rows):
    """qkv_proj and gate_up_proj on the GEMM with K in one range."""
    for n in ((HEADS + 2 * KV_HEADS) * HEAD_DIM, 2 * INTERMEDIATE):
        compile_for_h100(triton_gemm.gemm, empty(rows, HIDDEN), empty(n, HIDDEN))


@pytest.mark.parametrize("tokens", [1, 300])
def test_row_kernels_compile(compile_for_h100, tokens):
    """RMS norm (with and without residual), SiLU-and-mul, rotary + KV store (with and without
    the per-head norm)."""
    x = empty(tokens, HIDDEN)
    compile_for_h100(triton_ops.rms_norm, x, empty(HIDDEN), 1e-6)
    compile_for_h100(triton_ops.rms_norm, x, empty(HIDDEN), 1e-6, empty(tokens, HIDDEN))
    compile_for_h100(triton_ops.silu_and_mul, empty(tokens, 2 * INTERMEDIATE))
    caches = empty(64, BLOCK, KV_HEADS, HEAD_DIM), empty(64, BLOCK, KV_HEADS, HEAD_DIM)
    q, k, v, positions, cos_sin, slots = new_tokens(tokens)
    for norms in ((), (empty(HEAD_DIM), empty(HEAD_DIM))):
        compile_for_h100(triton_ops.rotate_and_store_kv, q, k, v, positions, cos_sin, *caches, slots, *norms)


def new_tokens(tokens):
    """q, k and v as views of one projection output, positions, the angles, slots."""
    qkv = empty(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    positions = torch.zeros(tokens, dtype=torch.int64)
    slots = torch.zeros(tokens, dtype=torch.int64)
    return q, k, v, positions, empty(4096, HEAD_DIM, dtype=torch.float32), slots


def decode_loop_waits(kv_dtype: torch.dtype, tile: tuple[int, int, int], batch: int,
                      splits: int) -> list[str]:
    """The cp.async waits (``DEPBAR.LE``) of each loop of the decode kernel's SASS, as
    ``decode_attention`` compiles it at ``batch`` sequences in ``splits`` partitions with the
    decode tile ``tile`` (keys, stages, warps) for a cache of ``kv_dtype``."""
    caches = empty(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=kv_dtype), empty(64, BLOCK, KV_HEADS,
                                                                      HEAD_DIM, dtype=kv_dtype)
    with mock.patch.dict(triton_attention.DECODE_TILES, {kv_dtype.itemsize: tile}):
        _, sass = compiled_code(triton_attention._decode_kernel, triton_attention.decode_attention,
                                empty(batch, HEADS, HEAD_DIM), *caches,
                                torch.ones(batch, dtype=torch.int32),
                                torch.zeros(batch, 256, dtype=torch.int32), HEAD_DIM**-0.5,
                                None, splits)
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    address = lambda line: int(re.search(r"/\*([0-9a-f]{4})\*/", line).group(1), 16)  # noqa: E731
    waits = []
    for line in lines:
        back = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if back and int(back.group(1), 16) < address(line):  # a loop: its body's waits
            body = [x for x in lines if int(back.group(1), 16) <= address(x) <= address(line)]
            waits.append(" ".join(re.findall(r"DEPBAR\.LE SB0, 0x\d", " ".join(body))))
    return waits


@pytest.mark.parametrize("kv_dtype", [BF16, FP8_DTYPE], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch, splits", [(256, 1), (4, 8)], ids=["whole", "split"])
def test_decode_tiles_of_three_stages_keep_the_next_tile_in_flight(compile_for_h100, kv_dtype,
                                                                  batch, splits):
    """With three stages the decode kernel's whole-tile loop waits only for its own tile,
    the next one's two copies (keys, values) left in flight (``BLOCKS_AHEAD``: without it the
    pipeliner gives the gathered loads one buffer, and each trip waits for every copy); with
    two it waits for every copy. The masked loop of a partition's last tile is unchanged."""
    def whole_tile_loop_waits(stages):
        return compile_for_h100(decode_loop_waits, kv_dtype, (64, stages, 4), batch, splits)[0]

    assert whole_tile_loop_waits(3) == "DEPBAR.LE SB0, 0x2"
    assert whole_tile_loop_waits(2) == "DEPBAR.LE SB0, 0x0"


@pytest.mark.parametrize("batch, splits, ordered", [(256, 1, True), (1, 8, False), (4, 3, True)])
def test_attention_kernels_compile(compile_for_h100, batch, splits, ordered):
    """Decode (one partition, split-K and its merge, rows in an order or not; with the rotary
    embedding and KV store, with and without the per-head norms) and prefill (both tile
    sizes)."""
    caches = empty(64, BLOCK, KV_HEADS, HEAD_DIM), empty(64, BLOCK, KV_HEADS, HEAD_DIM)
    seq_lens = torch.ones(batch, dtype=torch.int32)
    tables = torch.zeros(batch, 256, dtype=torch.int32)
    order = torch.arange(batch, dtype=torch.int32) if ordered else None
    compile_for_h100(triton_attention.decode_attention, empty(batch, HEADS, HEAD_DIM), *caches,
                     seq_lens, tables, HEAD_DIM**-0.5, order, splits)
    q, k, v, positions, cos_sin, slots = new_tokens(batch)
    for norms in ((None, None), (empty(HEAD_DIM), empty(HEAD_DIM))):
        compile_for_h100(triton_attention.rotary_decode_attention, q, k, v, positions, cos_sin,
                         *caches, slots, seq_lens, tables, HEAD_DIM**-0.5, order, *norms, 1e-6,
                         splits)
    query_lens = (5,) * batch
    for sms in (1, 132):  # 128-row tiles, and the 64-row ones of a step that 132 SMs find small
        compile_for_h100(prefill_attention_on, sms, empty(5 * batch, HEADS, HEAD_DIM), *caches,
                         torch.arange(0, 5 * batch + 1, 5, dtype=torch.int32), seq_lens * 5,
                         tables, query_lens, query_lens, HEAD_DIM**-0.5)


def compiled_code(kernel, function, *args, **kwargs) -> tuple[int, str]:
    """The registers a thread of ``kernel`` uses and its SASS, as ``function(*args, **kwargs)``
    compiles it (the cubin read by the cuobjdump Triton ships)."""
    compiled = []
    compile_launch = kernel.run
    with mock.patch.object(kernel, "run", lambda *a, **k: compiled.append(compile_launch(*a, **k))):
        function(*args, **kwargs)
    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled[0].asm["cubin"])
        cubin.flush()
        usage, sass = (subprocess.run([cuobjdump, flag, cubin.name], capture_output=True,
                                      text=True, check=True).stdout
                       for flag in ("-res-usage", "-sass"))
    return int(re.search(r"REG:(\d+)", usage).group(1)), sass


def prefill_registers(*args) -> int:
    """Registers a thread of the prefill kernel uses, as ``prefill_attention(*args)`` compiles it."""
    return compiled_code(triton_attention._prefill_kernel, triton_attention.prefill_attention,
                         *args)[0]


def test_prefill_attention_fits_two_programs_an_sm(compile_for_h100):
    """At head_dim 128 (8 warps) a prefill thread holds at most 128 registers, so two programs
    share an SM's 65,536: one's softmax runs under the other's matrix products. Uncapped, the
    kernel takes 174 and runs 25-35% slower on the H100."""
    caches = empty(64, BLOCK, KV_HEADS, HEAD_DIM), empty(64, BLOCK, KV_HEADS, HEAD_DIM)
    registers = compile_for_h100(
        prefill_registers, empty(640, HEADS, HEAD_DIM), *caches,
        torch.tensor([0, 640], dtype=torch.int32), torch.tensor([640], dtype=torch.int32),
        torch.zeros(1, 256, dtype=torch.int32), (640,), (640,), HEAD_DIM**-0.5)
    assert registers <= 65_536 // (2 * 8 * 32)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_sampling_kernels_compile(compile_for_h100, dtype):
    rows = 4
    seeds = torch.zeros(rows, dtype=torch.int64)
    compile_for_h100(triton_sampling.sample_plain, empty(rows, VOCAB, dtype=dtype),
                     torch.ones(rows), seeds)
    compile_for_h100(triton_sampling.exponential_noise, seeds, VOCAB)
    slots, fields = torch.zeros(rows, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32)
    compile_for_h100(triton_sampling.sample_plain_by_slot, empty(rows, VOCAB, dtype=dtype), slots,
                     torch.ones(rows + 1), fields[:, 0], 31,
                     torch.zeros(rows + 1, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))


@pytest.mark.parametrize("rows, width", [(1, 256), (256, 2560)])
def test_decode_input_kernels_compile(compile_for_h100, rows, width):
    """A decode graph's input preparation, for a table narrower and wider than one copy step."""
    field = torch.zeros(rows, dtype=torch.int32)
    compile_for_h100(triton_decode_inputs.decode_rows, field, field, field, field, field, field,
                     torch.zeros(rows + 1, width, dtype=torch.int32),
                     torch.zeros(rows + 1, dtype=torch.int64), BLOCK, -1)


@pytest.mark.parametrize("tokens", [1, 300])
def test_hybrid_kernels_compile(compile_for_h100, tokens):
    """Qwen3.5-9B's shapes: the quarter-head rotary of its gated attention (16 heads, 4 KV
    heads of 256), and its linear-attention layers' convolution (8192 channels, 3 taps of
    state) and delta rule's decode step (16 key heads, 32 value heads of 128, float32 states)."""
    from nanofn.kernels import triton_linear_attention as linear

    head_dim, heads, kv_heads = 256, 16, 4
    qkv = empty(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    caches = empty(64, BLOCK, kv_heads, head_dim), empty(64, BLOCK, kv_heads, head_dim)
    positions = slots = torch.zeros(tokens, dtype=torch.int64)
    cos_sin = empty(4096, head_dim // 4, dtype=torch.float32)
    compile_for_h100(triton_ops.rotate_and_store_kv, q, k, v, positions, cos_sin, *caches, slots,
                     empty(head_dim), empty(head_dim))
    channels, seqs = 8192, min(tokens, 4)
    conv_states = empty(8, 24, channels, 3)[:, 1]
    state_slots = torch.zeros(seqs, dtype=torch.int64)
    initial = torch.ones(seqs, dtype=torch.bool)
    query_start = torch.tensor([0, *range(tokens - seqs + 1, tokens + 1)], dtype=torch.int32)
    compile_for_h100(linear.causal_conv1d, empty(tokens, channels), empty(channels, 4),
                     conv_states, query_start, state_slots, initial, (2048, 2048, 4096))
    ssm = empty(8, 24, 32, 128, 128, dtype=torch.float32)[:, 1]
    for decode_seqs in (seqs, linear.FUSED_DECODE_FROM):  # four kernels; one launch
        projected = empty(decode_seqs, channels + 4096 + 64)
        mixed, z, a, b = projected.split([channels, 4096, 32, 32], dim=-1)
        compile_for_h100(linear.gated_delta_net_decode, mixed, a, b, z, empty(channels, 4),
                         empty(32, dtype=torch.float32), empty(32, dtype=torch.float32),
                         empty(128), 1e-6, conv_states, ssm,
                         torch.zeros(decode_seqs, dtype=torch.int64),
                         torch.ones(decode_seqs, dtype=torch.bool))
    mixed = empty(tokens, 2 * 16 * 128 + 32 * 128)
    q, k, v = mixed.split([16 * 128, 16 * 128, 32 * 128], dim=-1)
    compile_for_h100(linear.recurrent_delta_rule, q.view(tokens, 16, 128),
                     k.view(tokens, 16, 128), v.view(tokens, 32, 128),
                     empty(tokens, 32, dtype=torch.float32), empty(tokens, 32), ssm, query_start,
                     state_slots, initial)
    slots_of = torch.zeros(seqs, dtype=torch.int64)
    compile_for_h100(linear.gathered_states, ssm, slots_of, initial, 1)  # around fla's kernel
    compile_for_h100(linear.scatter_states, empty(seqs + 1, 32, 128, 128, dtype=torch.float32),
                     ssm, slots_of)
    ab = empty(tokens, 64)
    compile_for_h100(linear.delta_rule_gates, ab[:, :32], ab[:, 32:],
                     empty(32, dtype=torch.float32), empty(32, dtype=torch.float32))
    z = empty(tokens, 2 * 32 * 128)[:, 32 * 128:].view(tokens, 32, 128)
    compile_for_h100(linear.rms_norm_gated, empty(tokens, 32, 128), z, empty(128), 1e-6)


@pytest.mark.parametrize("tokens", [1, 4, 8, 40, 200, 600, 2000])
def test_moe_kernels_compile(compile_for_h100, tokens):
    """The router's kernel, the pairs' alignment and the experts' two grouped GEMMs at
    Qwen3-30B-A3B's sizes (128 experts of 768, 8 a token), in each tile size ``default_tiles``
    picks."""
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    compile_for_h100(triton_moe.select_experts, empty(tokens, experts), top_k, True)
    topk_ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    compile_for_h100(triton_moe.fused_moe, empty(tokens, hidden),
                     empty(experts, 2 * inter, hidden), empty(experts, hidden, inter),
                     empty(tokens, top_k), topk_ids)


def moe_gemm_code(kernel_name: str, *args) -> tuple[int, str]:
    """The registers a thread of ``triton_moe``'s grouped GEMM ``kernel_name`` uses and its
    SASS, as ``triton_moe.fused_moe(*args)`` compiles it."""
    return compiled_code(getattr(triton_moe, kernel_name), triton_moe.fused_moe, *args)


@pytest.mark.parametrize("tokens", [1, 256], ids=["8-pairs", "2048-pairs"])
def test_moe_gemms_on_fp8_experts_compile_without_spills(compile_for_h100, tokens):
    """Both grouped GEMMs on FP8 experts (weight-only: bf16 activations, 128x128 block-wise
    scales) at Qwen3-30B-A3B's sizes, in the tiles ``default_tiles`` picks for 8 and 2,048
    pairs as ``fused_moe`` cuts them to a scale group (down's 256-column k-steps at 8 pairs to
    128): nothing spills (254 registers at most on Triton 3.6), and the codes multiply in fp16,
    one conversion for every two (no fp16 -> float32 step of a conversion to bf16, as when
    every weight was dequantized to bf16: 1,245 -> 595 instructions a k-step of gate_up at 8
    pairs, 397 -> 226 of down)."""
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    w13 = Fp8Weight(empty(experts, 2 * inter, hidden, dtype=FP8_DTYPE),
                    empty(experts, 2 * inter, hidden // 128, dtype=torch.float32), 128)
    w2 = Fp8Weight(empty(experts, hidden, inter, dtype=FP8_DTYPE),
                   empty(experts, hidden, inter // 128, dtype=torch.float32), 128)
    for kernel in ("_gate_up_kernel", "_down_kernel"):
        _, sass = compile_for_h100(moe_gemm_code, kernel, empty(tokens, hidden), w13, w2,
                                   empty(tokens, top_k),
                                   torch.zeros(tokens, top_k, dtype=torch.int64))
        assert "LDL" not in sass and "STL" not in sass  # no spills
        assert "F2FP.F16.E4M3" in sass and "HADD2.F32" not in sass


def norm_compilations() -> tuple[list[str], float, bool]:
    """In a compiler child: the kernels ``counting_compilations`` counts while ``rms_norm``
    runs in bf16 twice at one size, then in fp16, the seconds they took, and whether Triton's
    hooks are back as they were once the block has ended (a launch after it is not counted)."""
    from nanofn.kernels.compilations import counting_compilations

    with counting_compilations() as found:
        for dtype in (BF16, BF16, torch.float16):
            triton_ops.rms_norm(empty(32, HIDDEN, dtype=dtype), empty(HIDDEN, dtype=dtype), 1e-6)
    triton_ops.rms_norm(empty(32, HIDDEN, dtype=torch.float32), empty(HIDDEN, dtype=torch.float32),
                        1e-6)
    runtime = triton.knobs.runtime
    restored = runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None
    return found.kernels, found.seconds, restored


def test_each_kernel_variant_compiled_in_a_block_is_counted_once():
    """``counting_compilations`` (what ``nanofn bench`` reports of its measured run) counts a
    kernel each time a new variant of it compiles, here a second dtype, and not a launch of a
    variant already compiled; a fresh child, so that no earlier test compiled them."""
    with compiler_process() as run:
        kernels, seconds, restored = run(norm_compilations)
    assert kernels == ["_rms_norm_kernel", "_rms_norm_kernel"]
    assert seconds > 0 and restored
