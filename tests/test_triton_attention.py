"""The Triton attention kernels against the torch references, on CPU through Triton's interpreter.

The interpreter computes bf16 ``tl.dot`` wrongly, so these run float32 and float16; the GPU
tests in ``tests/gpu`` cover bf16.
"""

from __future__ import annotations

import dataclasses
import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoConfig

import nanofn.kernels.attention as reference
import nanofn.kernels.triton_attention as triton_attention
from nanofn.kernels import TORCH_KERNELS, build_cos_sin_cache
from nanofn.kernels.rotary import rotary_decode_attention as reference_rotary_decode_attention
from nanofn.model import AttentionBatch, build_model, load_weights, model_shape

TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=0)}


class PagedCache:
    """A random K/V cache whose shuffled blocks hold sequences of the given lengths.

    The block tables are ``extra_blocks`` wider than needed, padded with 0: the padding must be ignored.
    """

    def __init__(self, seq_lens, block_size, num_kv_heads, head_dim, dtype, seed, extra_blocks=1):
        generator = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=generator).to(dtype)
        self.v_cache = torch.randn(shape, generator=generator).to(dtype)
        free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        width = max(blocks_per_seq) + extra_blocks
        tables = [[free_blocks.pop() for _ in range(n)] + [0] * (width - n) for n in blocks_per_seq]
        self.block_tables = torch.tensor(tables, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)


def random_queries(num_tokens, num_heads, head_dim, dtype, seed):
    """``[T, H, D]`` queries as a strided view into a wider projection output, as the model passes them."""
    generator = torch.Generator().manual_seed(seed)
    projection = torch.randn(num_tokens, (num_heads + 3) * head_dim, generator=generator).to(dtype)
    return projection[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_decode_attention_matches_reference(interpreter, dtype, group, block_size, num_splits):
    num_kv_heads, head_dim = 2, 32
    seq_lens = [1, 17, 100, 130]
    # Tables 256 keys wider than needed: with split-K, some partitions lie past every sequence's end.
    extra_blocks = 256 // block_size
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=1, extra_blocks=extra_blocks)
    q = random_queries(len(seq_lens), num_kv_heads * group, head_dim, dtype, seed=2)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)

    out = interpreter(triton_attention.decode_attention, *args, num_splits=num_splits)

    torch.testing.assert_close(out, reference.decode_attention(*args), **TOLERANCES[dtype])


def in_decode_tile(tile, function, *args, **kwargs):
    """``function(*args, **kwargs)`` with ``tile`` (keys, stages, warps) as the decode tile of
    every cache dtype."""
    tiles = dict.fromkeys(triton_attention.DECODE_TILES, tile)
    with mock.patch.dict(triton_attention.DECODE_TILES, tiles):
        return function(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_decode_in_tiles_of_three_stages_matches_reference(interpreter, dtype, group, num_splits):
    """Three stages read the block table a trip ahead (``BLOCKS_AHEAD``), the last trip's
    reads clamped to the context: contexts shorter than a tile, of whole tiles, and past."""
    num_kv_heads, head_dim = 2, 32
    seq_lens = [1, 17, 64, 100, 128, 130, 300]
    cache = PagedCache(seq_lens, 16, num_kv_heads, head_dim, dtype, seed=3, extra_blocks=16)
    q = random_queries(len(seq_lens), num_kv_heads * group, head_dim, dtype, seed=4)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)

    out = interpreter(in_decode_tile, (64, 3, 4), triton_attention.decode_attention, *args,
                      num_splits=num_splits)

    torch.testing.assert_close(out, reference.decode_attention(*args), **TOLERANCES[dtype])


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_decode_attention_taken_in_another_order_writes_each_row_its_own_result(interpreter,
                                                                                num_splits):
    """``order`` changes which program takes which row, never the row a result lands in."""
    head_dim = 32
    seq_lens = [300, 17, 0, 140, 1]
    cache = PagedCache(seq_lens, 16, 2, head_dim, torch.float32, seed=7, extra_blocks=16)
    q = random_queries(len(seq_lens), 4, head_dim, torch.float32, seed=8)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    longest_first = torch.tensor([0, 3, 1, 4, 2], dtype=torch.int32)

    out = interpreter(triton_attention.decode_attention, *args, order=longest_first,
                      num_splits=num_splits)

    expected = reference.decode_attention(*args)
    live = cache.seq_lens > 0
    torch.testing.assert_close(out[live], expected[live], **TOLERANCES[torch.float32])
    assert out[~live].abs().max() == 0  # the padding row: zeros, written by its own program


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_of_a_padding_row_with_no_context_is_finite(interpreter, num_splits):
    head_dim = 16
    cache = PagedCache([0, 40, 0], 16, 2, head_dim, torch.float32, seed=3, extra_blocks=8)
    q = random_queries(3, 4, head_dim, torch.float32, seed=4)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)

    out = interpreter(triton_attention.decode_attention, *args, num_splits=num_splits)

    assert out.isfinite().all()
    torch.testing.assert_close(out[1], reference.decode_attention(*args)[1], **TOLERANCES[torch.float32])


def test_a_few_sequences_partitions_follow_each_ones_own_length(interpreter):
    """A short context in a wide block table (a CUDA graph's tables are max_model_len wide) is
    spread over the partitions, in whole tiles of 64 keys: 130 keys in 4 partitions take
    64 + 64 + 2 (the fourth program exits), 300 keys 128 + 128 + 44; a partition sized from
    the table (816 keys / 4) would leave 130 keys to 1 partition and 300 to 2."""
    head_dim = 16
    cache = PagedCache([130, 300], 16, 2, head_dim, torch.float32, seed=5, extra_blocks=32)
    q = random_queries(2, 2, head_dim, torch.float32, seed=6)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    assert cache.block_tables.shape[1] * 16 >= 512

    _, _, partial_sum = interpreter(triton_attention.decode_partitions, *args, num_splits=4)

    # a row's sum over its partition is at least 2^(-(max - min score)) per key: > 0 iff keys
    holds_keys = (partial_sum > 0).tolist()
    assert holds_keys[0] == [[True, True, True, False]] * 2
    assert holds_keys[1] == [[True, True, True, False]] * 2
    torch.testing.assert_close(
        interpreter(triton_attention.decode_attention, *args, num_splits=4),
        reference.decode_attention(*args), **TOLERANCES[torch.float32])


def as_many_sequences(function, *args, **kwargs):
    """(In the interpreter's child) ``function`` with any batch taken for many sequences: a
    split partition reads no tile before the wait for the kernel ahead."""
    with mock.patch.object(triton_attention, "PROGRAMS_PER_SM", 0):
        return function(*args, **kwargs)


def test_many_sequences_partitions_follow_each_ones_own_length(interpreter):
    """Taken for many sequences, in up to 4 partitions: 100 keys as 64 + 36, 600 as 3 x 192 +
    24, 64 keys as one partition, the padding row as one of no keys (writing zeros); the
    programs past a row's keys exit, leaving the partials as they were. Taken in another
    order, the same partitions."""
    head_dim = 16
    seq_lens = [100, 600, 0, 64]
    cache = PagedCache(seq_lens, 16, 2, head_dim, torch.float32, seed=9, extra_blocks=8)
    q = random_queries(4, 4, head_dim, torch.float32, seed=10)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    longest_first = torch.tensor([1, 0, 3, 2], dtype=torch.int32)

    for order in (None, longest_first):
        _, _, partial_sum = interpreter(as_many_sequences, triton_attention.decode_partitions,
                                        *args, num_splits=4, order=order)
        holds_keys = (partial_sum > 0).all(1).tolist()  # (both heads alike)
        assert holds_keys == [[True, True, False, False], [True] * 4, [False] * 4,
                              [True, False, False, False]]
        out = interpreter(as_many_sequences, triton_attention.decode_attention, *args,
                          num_splits=4, order=order)
        live = cache.seq_lens > 0
        torch.testing.assert_close(out[live], reference.decode_attention(*args)[live],
                                   **TOLERANCES[torch.float32])
        assert out[~live].abs().max() == 0


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, "skewed"])
def test_many_sequences_random_contexts_in_partitions_match_reference(interpreter, num_splits,
                                                                      seed):
    """Random batches of 9 contexts (padding rows among them), and one long context among
    short ones, longest first, taken for many sequences: each row merges its own partitions,
    whichever finishes last."""
    if seed == "skewed":
        seq_lens, seed = [5, 0, 17, 3, 400, 1, 30, 2, 9], 2
    else:
        generator = np.random.default_rng(seed)
        seq_lens = generator.integers(0, 400, size=9).tolist()
        seq_lens[generator.integers(9)] = 0
    head_dim = 16
    cache = PagedCache(seq_lens, 16, 2, head_dim, torch.float16, seed=seed, extra_blocks=4)
    q = random_queries(9, 4, head_dim, torch.float16, seed=seed + 1)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)
    order = torch.argsort(cache.seq_lens, descending=True, stable=True).to(torch.int32)

    out = interpreter(as_many_sequences, triton_attention.decode_attention, *args,
                      num_splits=num_splits, order=order)

    live = cache.seq_lens > 0
    torch.testing.assert_close(out[live], reference.decode_attention(*args)[live],
                               **TOLERANCES[torch.float16])
    assert out[~live].abs().max() == 0


def decode_twice(*args, **kwargs):
    """(In the interpreter's child) two split decode launches of the same inputs, and the sum
    of the arrival counters after them."""
    first = triton_attention.decode_attention(*args, **kwargs)
    second = triton_attention.decode_attention(*args, **kwargs)
    counters = triton_attention.arrival_counters(first.device, 1)
    return first, second, int(counters.abs().sum())


def decode_past_the_counters(*args, **kwargs):
    """(In the interpreter's child) a decode launch asked to split with no arrival counters to
    spare: it takes one partition a sequence."""
    with mock.patch.object(triton_attention, "ARRIVAL_COUNTERS", 0):
        assert triton_attention.arrival_counters(args[0].device, 1) is None
        return triton_attention.decode_attention(*args, **kwargs)


@pytest.mark.parametrize("group", [1, 3])
def test_split_decode_merges_in_its_last_partition_or_takes_one_past_the_counters(interpreter,
                                                                                  group):
    """Each (sequence, kv head)'s last partition to finish merges the partitions and zeroes
    its counter, so the next launch merges alike; past the counters, whole contexts give the
    same rows."""
    head_dim = 32
    seq_lens = [200, 1, 0, 77]
    cache = PagedCache(seq_lens, 16, 2, head_dim, torch.float32, seed=11, extra_blocks=8)
    q = random_queries(len(seq_lens), 2 * group, head_dim, torch.float32, seed=12)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, head_dim**-0.5)

    first, second, counted = interpreter(decode_twice, *args, num_splits=4)
    whole = interpreter(decode_past_the_counters, *args, num_splits=4)

    live = cache.seq_lens > 0
    expected = reference.decode_attention(*args)
    torch.testing.assert_close(first[live], expected[live], **TOLERANCES[torch.float32])
    assert torch.equal(first, second) and counted == 0
    torch.testing.assert_close(whole, first, atol=1e-6, rtol=1e-6)


def attend_and_return_caches(function, *args, **kwargs):
    """``function`` (a rotary decode attention), then its output and the caches it wrote (a
    child's writes do not reach the parent's tensors)."""
    out = function(*args, **kwargs)
    return out, args[5], args[6]


def rotary_decode_inputs(seq_lens, group, dtype, seed, block_size=16, extra_blocks=16):
    """The arguments of ``rotary_decode_attention`` but the norms: q, k and v as views of one
    projection output, each token at its sequence's newest position, a padding row (``seq_len``
    0) with slot -1. The caches hold random values at the newest slots: never to be read."""
    num_kv_heads, head_dim = 2, 32
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=seed,
                       extra_blocks=extra_blocks)
    num_heads = num_kv_heads * group
    generator = torch.Generator().manual_seed(seed + 1)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    projection = torch.randn(len(seq_lens), sum(sizes), generator=generator).to(dtype)
    q, k, v = (part.view(len(seq_lens), -1, head_dim) for part in projection.split(sizes, dim=-1))
    positions = (cache.seq_lens - 1).clamp(min=0).long()
    slots = [table[p // block_size] * block_size + p % block_size if n > 0 else -1
             for table, p, n in zip(cache.block_tables.tolist(), positions.tolist(), seq_lens)]
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0)
    return (q, k, v, positions, cos_sin, cache.k_cache, cache.v_cache, torch.tensor(slots),
            cache.seq_lens, cache.block_tables, head_dim**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["no-norm", "qk-norm"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_rotary_decode_attention_matches_rotating_storing_then_attending(interpreter, dtype, group,
                                                                         qk_norm, num_splits):
    """Contexts of one key (the newest alone), one past a tile, on a tile's last key, long; a
    padding row; taken longest first."""
    seq_lens = [1, 65, 64, 130, 0, 17]
    args = rotary_decode_inputs(seq_lens, group, dtype, seed=11)
    generator = torch.Generator().manual_seed(12)
    norms = dict(q_norm_weight=(1 + torch.randn(32, generator=generator) / 4).to(dtype),
                 k_norm_weight=(1 + torch.randn(32, generator=generator) / 4).to(dtype),
                 norm_eps=1e-5) if qk_norm else {}
    order = torch.argsort(args[8], descending=True, stable=True).to(torch.int32)

    out, k_cache, v_cache = interpreter(attend_and_return_caches,
                                        triton_attention.rotary_decode_attention, *args,
                                        order=order, num_splits=num_splits, **norms)

    expected = reference_rotary_decode_attention(*args, **norms)  # writes args' caches
    live = args[8] > 0
    torch.testing.assert_close(out[live], expected[live], **TOLERANCES[dtype])
    assert out[~live].abs().max() == 0
    torch.testing.assert_close(k_cache, args[5], **TOLERANCES[dtype])
    torch.testing.assert_close(v_cache, args[6], atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-partition", "split-k"])
def test_rotary_decode_attention_in_tiles_of_three_stages_matches(interpreter, num_splits):
    """As above, with the block table read a trip ahead (a tile of three stages)."""
    seq_lens = [1, 65, 64, 130, 0, 17, 200]
    args = rotary_decode_inputs(seq_lens, 2, torch.float16, seed=13)

    out, k_cache, v_cache = interpreter(in_decode_tile, (64, 3, 4), attend_and_return_caches,
                                        triton_attention.rotary_decode_attention, *args,
                                        num_splits=num_splits)

    expected = reference_rotary_decode_attention(*args)
    live = args[8] > 0
    torch.testing.assert_close(out[live], expected[live], **TOLERANCES[torch.float16])
    torch.testing.assert_close(k_cache, args[5], **TOLERANCES[torch.float16])


@pytest.mark.parametrize("num_splits", [2, 4])
def test_rotary_decode_attention_of_many_sequences_partitions_matches(interpreter, num_splits):
    """Taken for many sequences (no tile read before the wait): the newest key, written and
    attended to from registers by the partition that holds its position, also where that
    partition holds no older key (129 keys in 2 partitions of 128: the newest is the second's
    only one)."""
    seq_lens = [1, 65, 64, 129, 0, 17, 300, 128]
    args = rotary_decode_inputs(seq_lens, 2, torch.float16, seed=15)
    order = torch.argsort(args[8], descending=True, stable=True).to(torch.int32)

    out, k_cache, v_cache = interpreter(as_many_sequences, attend_and_return_caches,
                                        triton_attention.rotary_decode_attention, *args,
                                        order=order, num_splits=num_splits)

    expected = reference_rotary_decode_attention(*args)
    live = args[8] > 0
    torch.testing.assert_close(out[live], expected[live], **TOLERANCES[torch.float16])
    assert out[~live].abs().max() == 0
    torch.testing.assert_close(k_cache, args[5], **TOLERANCES[torch.float16])
    torch.testing.assert_close(v_cache, args[6], atol=0, rtol=0)


def test_rotary_decode_attention_writes_only_each_tokens_own_slot(interpreter):
    """Each token's key and value go to its own slot, and nowhere for a negative slot (the
    padding row's, and here row 2's)."""
    seq_lens = [40, 0, 3]
    args = rotary_decode_inputs(seq_lens, 2, torch.float32, seed=13)
    args[7][2] = -1
    before = args[5].clone(), args[6].clone()

    _, k_cache, v_cache = interpreter(attend_and_return_caches,
                                      triton_attention.rotary_decode_attention, *args, num_splits=3)

    changed = ((k_cache != before[0]) | (v_cache != before[1])).any(-1).any(-1).flatten()
    written = {slot for slot in args[7].tolist() if slot >= 0}
    assert set(changed.nonzero().flatten().tolist()) == written


def test_decode_splits_a_few_sequences_until_the_gpu_is_busy_and_a_few_waves_of_many_in_two():
    num_sms, many = 132, triton_attention.FEW_WAVES_SPLITS
    assert triton_attention.decode_num_splits(1, 8, 32768, num_sms) == 33  # 8 x 33 programs >= 2 per SM
    assert triton_attention.decode_num_splits(4, 8, 1024, num_sms) == 4  # partitions of 256 keys at least
    assert triton_attention.decode_num_splits(4, 8, 200, num_sms) == 1
    assert triton_attention.decode_num_splits(33, 8, 4096, num_sms) == many
    assert triton_attention.decode_num_splits(82, 8, 4096, num_sms) == many  # one wave: 656 <= 660
    assert triton_attention.decode_num_splits(82, 8, 256, num_sms) == 1
    assert triton_attention.decode_num_splits(132, 8, 4096, num_sms) == many  # 1,056 <= 8 x 132
    assert triton_attention.decode_num_splits(133, 8, 4096, num_sms) == 1


def test_the_rotary_embedding_is_fused_where_every_partition_rotating_pays():
    """A few sequences: from two on. Many: whole contexts in one wave (up to 82 sequences of
    8 kv heads on 132 SMs), not split ones, not past the wave."""
    def fused(batch, num_splits):
        q = torch.empty(batch, 16, 128, device="meta")
        return triton_attention.fuses_rotary(q, torch.empty(64, 16, 8, 128, device="meta"),
                                             num_splits)

    assert not fused(1, 16) and fused(2, 16) and fused(32, 2)
    assert fused(33, 1) and fused(82, 1) and not fused(83, 1)
    assert not fused(33, 2) and not fused(82, 2)


# (query_len, seq_len) per sequence: whole prompts over several query and key tiles, chunks
# after a cached prefix, single tokens (decodes batched with prefills), a one-token prompt.
PREFILL_SEQUENCES = [(150, 150), (40, 100), (1, 37), (70, 70), (1, 1), (65, 195)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_attention_matches_reference(interpreter, dtype, group, block_size):
    num_kv_heads, head_dim = 2, 16
    query_lens, seq_lens = zip(*PREFILL_SEQUENCES)
    cache = PagedCache(seq_lens, block_size, num_kv_heads, head_dim, dtype, seed=5)
    q = random_queries(sum(query_lens), num_kv_heads * group, head_dim, dtype, seed=6)
    query_start = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    args = (q, cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables,
            query_lens, seq_lens, head_dim**-0.5)

    out = interpreter(triton_attention.prefill_attention, *args)

    torch.testing.assert_close(out, reference.prefill_attention(*args), **TOLERANCES[dtype])


def prefill_attention_on(sms, *args):
    """``prefill_attention(*args)`` tiled as on a GPU of ``sms`` SMs."""
    with mock.patch.object(triton_attention, "prefill_sms", lambda device: sms):
        return triton_attention.prefill_attention(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_prefill_attention_in_tiles_for_a_small_step_matches_reference(interpreter, dtype, group):
    """The same sequences as a GPU of 132 SMs tiles them: 64-row tiles (a step this small
    would leave its SMs idle in 128-row ones)."""
    num_kv_heads, head_dim = 2, 16
    query_lens, seq_lens = zip(*PREFILL_SEQUENCES)
    assert triton_attention.prefill_block_m(num_kv_heads * group, num_kv_heads, sum(query_lens), 132) == 64
    cache = PagedCache(seq_lens, 16, num_kv_heads, head_dim, dtype, seed=9)
    q = random_queries(sum(query_lens), num_kv_heads * group, head_dim, dtype, seed=10)
    query_start = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    args = (q, cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables,
            query_lens, seq_lens, head_dim**-0.5)

    out = interpreter(prefill_attention_on, 132, *args)

    torch.testing.assert_close(out, reference.prefill_attention(*args), **TOLERANCES[dtype])


def test_prefill_tiles_are_smaller_only_for_steps_that_would_leave_sms_idle():
    """Qwen3-0.6B's heads (16 over 8 kv heads) on 132 SMs: 128-row tiles (64 queries) from
    2,113 tokens on, where they make more than two programs an SM; a group of 8 keeps 16
    queries in a 128-row tile and 8 in a 64-row one."""
    assert triton_attention.prefill_block_m(16, 8, 512, 132) == 64
    assert triton_attention.prefill_block_m(16, 8, 2_112, 132) == 64  # 33 x 8 = 264 programs
    assert triton_attention.prefill_block_m(16, 8, 2_113, 132) == 128
    assert triton_attention.prefill_block_m(16, 8, 16_384, 132) == 128
    assert triton_attention.prefill_block_q(64, 8, 256, 132) == 8
    assert triton_attention.prefill_block_q(64, 8, 16_384, 132) == 16
    assert triton_attention.prefill_block_m(16, 8, 512, 16) == 128  # a GPU of 16 SMs


def test_prefill_attention_with_a_padded_tile_map_as_a_cuda_graph_gives_it(interpreter):
    """A CUDA graph's work map: the step's tiles, then tiles of sequence -1 that do nothing;
    the queries are followed by padding rows that no tile reads."""
    num_kv_heads, head_dim, group = 2, 16, 2
    query_lens, seq_lens = zip(*PREFILL_SEQUENCES)
    cache = PagedCache(seq_lens, 16, num_kv_heads, head_dim, torch.float32, seed=7)
    num_tokens = sum(query_lens)
    q = random_queries(num_tokens + 20, num_kv_heads * group, head_dim, torch.float32, seed=8)
    query_start = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    block_q = triton_attention.prefill_block_q(num_kv_heads * group, num_kv_heads, len(q),
                                               triton_attention.prefill_sms(q.device))
    work = triton_attention.prefill_tile_map(query_lens, seq_lens, block_q)
    tiles = torch.from_numpy(np.concatenate([work, np.tile([[-1, 0]], (9, 1))]).astype(np.int32))
    args = (cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables,
            query_lens, seq_lens, head_dim**-0.5)

    out = interpreter(triton_attention.prefill_attention, q, *args[:5], (), (), args[7],
                      tiles=tiles)

    torch.testing.assert_close(out[:num_tokens], reference.prefill_attention(q[:num_tokens], *args),
                               **TOLERANCES[torch.float32])


# The torch references throughout, but for the attention kernels of the "triton" backend.
BACKENDS = {
    "torch": TORCH_KERNELS,
    "triton": dataclasses.replace(
        TORCH_KERNELS,
        prefill_attention=triton_attention.prefill_attention,
        rotary_decode_attention=triton_attention.rotary_decode_attention,
    ),
}


def hidden_states_of_steps(checkpoint, backend, steps, block_size=16, quantization=None,
                           kv_dtype=torch.float32):
    """A model's hidden states over a few steps, each ``{sequence: (first position, new tokens)}``
    (with ``quantization`` and a KV cache of ``kv_dtype``, as the options of those names)."""
    config = AutoConfig.from_pretrained(checkpoint)
    model = build_model(config, dtype="float32", device="cpu", kernels=BACKENDS[backend],
                        quantization=quantization)
    load_weights(model, checkpoint)
    cache_shape = model_shape(config).kv_cache_shape(num_blocks=12, block_size=block_size)
    kv_cache = torch.randn(cache_shape, generator=torch.Generator().manual_seed(7)).to(kv_dtype)
    tables = {"a": [9, 2, 5], "b": [0, 7, 11], "c": [4, 1, 0]}  # shuffled blocks; c's last is padding
    hidden = []
    for step in steps:
        chunks = step.values()
        input_ids = [token for _, tokens in chunks for token in tokens]
        owners = [name for name, (_, tokens) in step.items() for _ in tokens]
        positions = [p for start, tokens in chunks for p in range(start, start + len(tokens))]
        slots = [tables[name][p // block_size] * block_size + p % block_size
                 for name, p in zip(owners, positions)]
        query_lens = [len(tokens) for _, tokens in chunks]
        seq_lens = [start + len(tokens) for start, tokens in chunks]
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots),
            query_start=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([tables[name] for name in step], dtype=torch.int32),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            decode_only=all(n == 1 for n in query_lens),
        )
        with torch.inference_mode():
            hidden.append(model(torch.tensor(input_ids), torch.tensor(positions), batch, kv_cache))
    return torch.cat(hidden)


def test_model_with_the_triton_backend_matches_the_torch_backend(interpreter, tiny_qwen3):
    tokens = torch.randint(3, 300, (3, 45), generator=torch.Generator().manual_seed(8)).tolist()
    steps = [
        {"a": (0, tokens[0][:40]), "b": (0, tokens[1][:20])},  # prefill
        {"a": (40, tokens[0][40:41]), "b": (20, tokens[1][20:45]), "c": (0, tokens[2][:30])},  # mixed
        {"a": (41, tokens[0][41:42]), "b": (45, tokens[1][:1]), "c": (30, tokens[2][30:31])},  # decode
    ]

    hidden = interpreter(hidden_states_of_steps, tiny_qwen3, "triton", steps)

    expected = hidden_states_of_steps(tiny_qwen3, "torch", steps)
    torch.testing.assert_close(hidden, expected, atol=1e-4, rtol=1e-4)
