"""The Triton attention kernels against the torch references on a CUDA GPU, in bf16 at real sizes.

Qwen3-0.6B's attention shape: head_dim 128, 16 query heads over 8 kv heads, block size 16. The
references run in float32 on upcast copies of the inputs; errors are measured as
``|out - ref| / |ref|`` over the whole output. ``benchmark()`` prints timings, asserting nothing.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton.testing

import nanofn.kernels.attention as reference
import nanofn.kernels.triton_attention as triton_attention

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nan_filled_allocations")]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
SCALE = HEAD_DIM**-0.5
DTYPE = torch.bfloat16


class PagedCache:
    """A random bf16 K/V cache whose shuffled blocks hold sequences of the given lengths."""

    def __init__(self, seq_lens, num_kv_heads=NUM_KV_HEADS, seed=0, extra_blocks=1):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 8
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=generator, device="cuda").to(DTYPE)
        self.v_cache = torch.randn(shape, generator=generator, device="cuda").to(DTYPE)
        free_blocks = torch.randperm(num_blocks, generator=generator, device="cuda").tolist()
        width = max(blocks_per_seq) + extra_blocks
        tables = [[free_blocks.pop() for _ in range(n)] + [0] * (width - n) for n in blocks_per_seq]
        self.block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def random_queries(num_tokens, num_heads=NUM_HEADS, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(num_tokens, num_heads, HEAD_DIM, generator=generator, device="cuda").to(DTYPE)


def random_lengths(count, low, high, seed):
    return torch.randint(low, high + 1, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def upcast(*tensors):
    return [t.float() if t.is_floating_point() else t for t in tensors]


def assert_relative_error_below(out, expected, tolerance=1e-2):
    assert out.dtype == DTYPE and out.shape == expected.shape
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error < tolerance, f"relative error {error:.2e}"


DECODE_BATCHES = {
    "batch-64": random_lengths(64, 1, 2048, seed=3),
    "long-contexts": [32768, 5001, 1, 0],  # a padding row with no context too
}


@pytest.mark.parametrize("batch", DECODE_BATCHES)
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["heuristic", "one-partition", "split-k-8"])
def test_decode_attention_matches_reference(batch, num_splits):
    seq_lens = DECODE_BATCHES[batch]
    cache = PagedCache(seq_lens, seed=4)
    q = random_queries(len(seq_lens), seed=5)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables)

    out = triton_attention.decode_attention(*args, SCALE, num_splits=num_splits)

    assert out.isfinite().all()
    context_rows = [i for i, n in enumerate(seq_lens) if n > 0]
    expected = reference.decode_attention(*upcast(*args), SCALE)
    assert_relative_error_below(out[context_rows], expected[context_rows])


@pytest.mark.parametrize("tile", [(64, 3, 4), (32, 3, 4)], ids=["64x3x4", "32x3x4"])
@pytest.mark.parametrize("kv_dtype", [DTYPE, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 8], ids=["one-partition", "split-k-8"])
def test_decode_attention_in_tiles_of_three_stages_matches_reference(tile, kv_dtype, num_splits,
                                                                     monkeypatch):
    """Tiles of three stages read the block table a trip ahead (``BLOCKS_AHEAD``): on the
    reference's cache entries (FP8 ones too), contexts shorter than a tile, of whole tiles and
    past them, a padding row among them."""
    seq_lens = [*random_lengths(40, 1, 2048, seed=21), 64, 96, 0]
    cache = PagedCache(seq_lens, seed=22)
    k_cache, v_cache = cache.k_cache.to(kv_dtype), cache.v_cache.to(kv_dtype)
    q = random_queries(len(seq_lens), seed=23)
    args = (q, k_cache, v_cache, cache.seq_lens, cache.block_tables)
    monkeypatch.setitem(triton_attention.DECODE_TILES, k_cache.element_size(), tile)

    out = triton_attention.decode_attention(*args, SCALE, num_splits=num_splits)

    context_rows = [i for i, n in enumerate(seq_lens) if n > 0]
    expected = reference.decode_attention(*upcast(q, k_cache.float(), v_cache.float(),
                                                  *args[3:]), SCALE)
    assert_relative_error_below(out[context_rows], expected[context_rows])


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_attention_replays_from_a_cuda_graph(num_splits):
    seq_lens = random_lengths(32, 2, 1024, seed=6)  # still >= 1 after the decrement below
    cache = PagedCache(seq_lens, seed=7)
    q = random_queries(len(seq_lens), seed=8)
    args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, SCALE)
    triton_attention.decode_attention(*args, num_splits=num_splits)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.decode_attention(*args, num_splits=num_splits)

    q.copy_(random_queries(len(seq_lens), seed=9))
    cache.seq_lens.sub_(1)
    graph.replay()

    assert_relative_error_below(out, reference.decode_attention(*upcast(*args[:-1]), SCALE))


@pytest.mark.parametrize("batch", DECODE_BATCHES)
@pytest.mark.parametrize("num_splits", [None, 1, 8], ids=["heuristic", "one-partition", "split-k-8"])
def test_rotary_decode_attention_matches_reference(batch, num_splits):
    """Qwen3's per-head norms, the rotary embedding, the KV store and attention in one kernel
    against the float32 references of the three; the cache slots written as the reference's."""
    from nanofn.kernels import build_cos_sin_cache
    from nanofn.kernels.rotary import rotary_decode_attention as reference_rotary_decode

    seq_lens = DECODE_BATCHES[batch]
    cache = PagedCache(seq_lens, seed=10)
    rows = len(seq_lens)
    generator = torch.Generator(device="cuda").manual_seed(11)
    sizes = [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM]
    qkv = torch.randn(rows, sum(sizes), generator=generator, device="cuda").to(DTYPE)
    q, k, v = (t.view(rows, -1, HEAD_DIM) for t in qkv.split(sizes, dim=-1))
    positions = (cache.seq_lens - 1).clamp(min=0).long()
    newest_blocks = cache.block_tables.gather(1, (positions // BLOCK_SIZE).view(-1, 1).int())
    slots = newest_blocks.view(-1).long() * BLOCK_SIZE + positions % BLOCK_SIZE
    slots = torch.where(cache.seq_lens > 0, slots, -1)
    cos_sin = build_cos_sin_cache(HEAD_DIM, 32768, 1e6, device="cuda")
    norms = [(1 + torch.randn(HEAD_DIM, generator=generator, device="cuda") / 4).to(DTYPE)
             for _ in range(2)]
    caches = [cache.k_cache.float(), cache.v_cache.float()]

    out = triton_attention.rotary_decode_attention(
        q, k, v, positions, cos_sin, cache.k_cache, cache.v_cache, slots, cache.seq_lens,
        cache.block_tables, SCALE, None, *norms, 1e-6, num_splits=num_splits)

    expected = reference_rotary_decode(*upcast(q, k, v), positions, cos_sin, *caches, slots,
                                       cache.seq_lens, cache.block_tables, SCALE, None,
                                       *upcast(*norms), 1e-6)
    assert out.isfinite().all()
    context_rows = [i for i, n in enumerate(seq_lens) if n > 0]
    assert_relative_error_below(out[context_rows], expected[context_rows])
    written = slots[slots >= 0]
    for ours, theirs in zip((cache.k_cache, cache.v_cache), caches):
        flat_ours, flat_theirs = ours.flatten(0, 1)[written], theirs.flatten(0, 1)[written]
        assert_relative_error_below(flat_ours, flat_theirs)


# (query_len, seq_len): whole prompts, chunks after a cached prefix, decodes batched with prefills.
PREFILL_SEQUENCES = [(2048, 2048), (1024, 3072), (1, 1500), (300, 300), (17, 1000), (2000, 2100), (1, 1)]


@pytest.mark.parametrize("num_heads, num_kv_heads", [(16, 8), (28, 4)], ids=["group-2", "group-7"])
@pytest.mark.parametrize("small_tiles", [False, True])
def test_prefill_attention_matches_reference(num_heads, num_kv_heads, small_tiles, monkeypatch):
    """This step takes 128-row tiles; ``small_tiles`` has it tiled as a small step's, as if
    the GPU had so many SMs that it found the step small (64 rows)."""
    query_lens, seq_lens = zip(*PREFILL_SEQUENCES)
    if small_tiles:
        monkeypatch.setattr(triton_attention, "prefill_sms", lambda device: 100_000)
    cache = PagedCache(seq_lens, num_kv_heads, seed=10)
    q = random_queries(sum(query_lens), num_heads, seed=11)
    query_start = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda")
    args = (q, cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables)
    rows = triton_attention.prefill_block_m(num_heads, num_kv_heads, len(q),
                                            triton_attention.prefill_sms(q.device))
    assert rows == (64 if small_tiles else 128)

    out = triton_attention.prefill_attention(*args, query_lens, seq_lens, SCALE)

    expected = reference.prefill_attention(*upcast(*args), query_lens, seq_lens, SCALE)
    assert_relative_error_below(out, expected)


SMALL_HEAD_DIM = 16


def small_cache(num_blocks, num_kv_heads, seed):
    """A random K/V cache of head_dim 16 and a random permutation of its blocks."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, SMALL_HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator, device="cuda").to(DTYPE)
    v_cache = torch.randn(shape, generator=generator, device="cuda").to(DTYPE)
    blocks = torch.randperm(num_blocks, generator=generator, device="cuda").to(torch.int32)
    return k_cache, v_cache, blocks


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_attention_of_more_sequences_than_a_grid_axis_holds(num_splits):
    """70,000 rows of one block each: CUDA caps a grid's second and third axes at 65,535."""
    num_seqs = 70_000
    k_cache, v_cache, blocks = small_cache(num_seqs, num_kv_heads=2, seed=16)
    seq_lens = torch.randint(1, BLOCK_SIZE + 1, (num_seqs,), device="cuda", dtype=torch.int32)
    q = torch.randn(num_seqs, 4, SMALL_HEAD_DIM, device="cuda").to(DTYPE)
    order = torch.arange(num_seqs - 1, -1, -1, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, seq_lens, blocks[:, None])

    out = triton_attention.decode_attention(*args, 1.0, order=order, num_splits=num_splits)

    assert_relative_error_below(out, reference.decode_attention(*upcast(*args), 1.0))


def test_prefill_attention_of_more_tiles_than_a_grid_axis_holds():
    """4,100 prompts of 256 tokens in tiles of 16 queries (8 heads a kv head): 65,600 tiles."""
    num_seqs, query_len, num_heads = 4_100, 256, 8
    num_tokens = num_seqs * query_len
    sms = triton_attention.prefill_sms(torch.device("cuda"))
    block_q = triton_attention.prefill_block_q(num_heads, 1, num_tokens, sms)
    assert num_tokens // block_q > 65_535
    k_cache, v_cache, blocks = small_cache(num_seqs * query_len // BLOCK_SIZE, 1, seed=17)
    query_lens = seq_lens = (query_len,) * num_seqs
    q = torch.randn(num_seqs * query_len, num_heads, SMALL_HEAD_DIM, device="cuda").to(DTYPE)
    query_start = torch.arange(0, len(q) + 1, query_len, dtype=torch.int32, device="cuda")
    args = (q, k_cache, v_cache, query_start, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            blocks.view(num_seqs, query_len // BLOCK_SIZE))

    out = triton_attention.prefill_attention(*args, query_lens, seq_lens, 1.0)

    expected = reference.prefill_attention(*upcast(*args), query_lens, seq_lens, 1.0)
    assert_relative_error_below(out, expected)


def benchmark() -> None:
    """Print median times of the Triton kernels and the torch references, bf16, Qwen3-0.6B shape."""
    seq_lens = [1024] * 256
    cache = PagedCache(seq_lens, seed=12, extra_blocks=0)
    q = random_queries(len(seq_lens), seed=13)
    decode_args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, SCALE)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    _report("decode 256 x 1024", kv_bytes / 1e9, "GB/s",
            lambda: triton_attention.decode_attention(*decode_args),
            lambda: reference.decode_attention(*decode_args))

    seq_lens = [16384] * 4
    cache = PagedCache(seq_lens, seed=14, extra_blocks=0)
    q = random_queries(len(seq_lens), seed=15)
    decode_args = (q, cache.k_cache, cache.v_cache, cache.seq_lens, cache.block_tables, SCALE)
    kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    _report("decode 4 x 16384 (split-K)", kv_bytes / 1e9, "GB/s",
            lambda: triton_attention.decode_attention(*decode_args),
            lambda: reference.decode_attention(*decode_args))

    # One request, as in a decode graph: its table is max_model_len (4,096 keys) wide. Timed
    # in a CUDA graph, as the engine runs it (launch costs aside); the issue asks <= 4 us.
    for context in (600, 1024):
        cache = PagedCache([context], seed=18, extra_blocks=4096 // BLOCK_SIZE - -(-context // BLOCK_SIZE))
        decode_args = (random_queries(1, seed=19), cache.k_cache, cache.v_cache, cache.seq_lens,
                       cache.block_tables, SCALE)
        graph_ms = triton.testing.do_bench_cudagraph(
            lambda: triton_attention.decode_attention(*decode_args), return_mode="median")
        print(f"decode 1 x {context} in a 4096-key table (graph): triton {graph_ms * 1e3:.1f} us")

    prompt_lens = (1024,) * 8
    prefill_args = whole_prompts(prompt_lens, seed=16)
    _report("prefill 8 x 1024", causal_flops(prompt_lens) / 1e12, "TFLOP/s",
            lambda: triton_attention.prefill_attention(*prefill_args),
            lambda: reference.prefill_attention(*prefill_args))


def whole_prompts(prompt_lens, seed):
    """``prefill_attention``'s arguments for whole prompts of these lengths (nothing cached
    before them), their keys and values in a random cache."""
    cache = PagedCache(prompt_lens, seed=seed, extra_blocks=0)
    q = random_queries(sum(prompt_lens), seed=seed + 1)
    query_start = torch.tensor([0, *itertools.accumulate(prompt_lens)], dtype=torch.int32,
                               device="cuda")
    return (q, cache.k_cache, cache.v_cache, query_start, cache.seq_lens, cache.block_tables,
            tuple(prompt_lens), tuple(prompt_lens), SCALE)


def causal_flops(prompt_lens) -> int:
    """Floating-point operations of causal attention over whole prompts (Qwen3-0.6B's heads)."""
    return sum(4 * n * (n + 1) // 2 * NUM_HEADS * HEAD_DIM for n in prompt_lens)


def _report(name, work, unit, triton_call, torch_call) -> None:
    """One line: median milliseconds of both, the Triton kernel's rate (``work`` per second in
    ``unit``), and its speed-up over the reference."""
    triton_ms = triton.testing.do_bench(triton_call, return_mode="median")
    torch_ms = triton.testing.do_bench(torch_call, return_mode="median")
    print(f"{name}: triton {triton_ms:.3f} ms ({work / (triton_ms / 1e3):.0f} {unit}), "
          f"torch {torch_ms:.3f} ms, {torch_ms / triton_ms:.1f}x")


if __name__ == "__main__":
    benchmark()
