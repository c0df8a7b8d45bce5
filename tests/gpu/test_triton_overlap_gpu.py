"""Overlapped kernel launches (``nanofn/kernels/triton_overlap.py``) on a GPU of SM 9.0 or later:
each kernel still reads the whole result of the kernel ahead of it, in a CUDA graph and in the
engine, where the tokens are those of kernels launched one after another."""

from __future__ import annotations

import functools

import pytest
import torch

import nanofn.kernels.triton_gemv as triton_gemv
from nanofn.kernels import rms_norm, triton_overlap
from test_triton_gemv_gpu import float32_prompts, greedy_batches  # noqa: F401 (a fixture, this folder)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of SM 9.0 or later (programmatic dependent launch)")

HIDDEN, STEPS = 1024, 6


def test_a_graph_of_overlapped_gemvs_reads_each_result_whole():
    """A chain of GEMVs, each reading the one before (a weight loaded before its wait, the
    input after: a norm and a gated projection, then a plain one), replayed from a graph with
    new inputs: the float32 torch chain's results."""
    assert triton_overlap.overlaps(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = HIDDEN**-0.5
    ups = [torch.randn(2 * HIDDEN, HIDDEN, generator=g, device="cuda") * scale for _ in range(STEPS)]
    downs = [torch.randn(HIDDEN, HIDDEN, generator=g, device="cuda") * scale for _ in range(STEPS)]
    x = torch.randn(1, HIDDEN, generator=g, device="cuda")

    norm = torch.ones(HIDDEN, device="cuda")

    def gated_gemv(h, w):
        return triton_gemv.rms_norm_gemv(h, norm, 1e-6, None, w, gated=True)[0]

    def chain(h, up=gated_gemv, down=triton_gemv.gemv):
        for w_up, w_down in zip(ups, downs):
            h = h + down(up(h, w_up), w_down)  # (the sum: a torch kernel between, not overlapped)
        return h

    def reference(h):
        def gated_linear(h, w):
            gate, up = (rms_norm(h, norm, 1e-6) @ w.T).chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up
        return chain(h, gated_linear, lambda h, w: h @ w.T)

    chain(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for seed in range(1, 6):
        x.copy_(torch.randn(1, HIDDEN, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda"))
        graph.replay()
        # float32 sums in another order, six layers deep: up to ~1e-4 apart (H100, 6d73f40);
        # an input read before the kernel ahead wrote it is the last replay's, O(1) apart
        torch.testing.assert_close(out, reference(x), rtol=1e-3, atol=1e-3)


def test_engine_tokens_are_the_same_with_launches_overlapped_and_in_sequence(float32_prompts,  # noqa: F811
                                                                          monkeypatch):
    """Greedy float32 decoding of one, two, four and five sequences (GEMVs, then cuBLAS) and their
    prefills, with every decode kernel launched overlapped (the default here) and with none."""
    overlapped = greedy_batches(*float32_prompts)
    monkeypatch.setattr(triton_overlap, "overlaps", lambda device: False)
    assert greedy_batches(*float32_prompts) == overlapped


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_decode_attention_reads_the_newest_key_the_kernel_ahead_wrote(num_splits):
    """Decode attention reads its first tile of keys before the rotary kernel ahead of it has
    finished, then the newest key and value again: replayed from a graph with a new query, key
    and value each time (the newest key weighs most), the output is the float32 reference's.
    Context lengths put the newest key in a first tile (of the context or of a partition) and
    past it."""
    from nanofn.kernels import apply_rotary
    from nanofn.kernels.attention import decode_attention as reference_attention
    from nanofn.kernels.triton_attention import decode_attention
    from nanofn.kernels.triton_ops import rotate_and_store_kv

    heads, kv_heads, dim = 16, 8, 128
    seq_lens = torch.tensor([300, 100, 64, 1, 129], dtype=torch.int32, device="cuda")
    batch = len(seq_lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache, block_tables, positions, slot_mapping, cos_sin = paged_decode_inputs(
        seq_lens, kv_heads, dim, g)
    q, k, v = (torch.empty(batch, n, dim, device="cuda") for n in (heads, kv_heads, kv_heads))

    def step():
        rotated = rotate_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
        return decode_attention(rotated, k_cache, v_cache, seq_lens, block_tables, dim**-0.5,
                                num_splits=num_splits)

    def fill(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for x, scale in ((q, 1.0), (k, 3.0), (v, 1.0)):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda") * scale)

    fill(1)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(2, 8):
        fill(seed)
        graph.replay()
        rotated_q, _ = apply_rotary(q, k, positions, cos_sin)
        expected = reference_attention(rotated_q, k_cache, v_cache, seq_lens, block_tables,
                                       dim**-0.5)
        # the cache holds this replay's newest key and value (the rotary kernel wrote them); an
        # output computed from the last replay's is O(1) away from it
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)


def paged_decode_inputs(seq_lens, kv_heads, dim, generator, block_size=16, blocks_each=24):
    """Random caches whose shuffled blocks hold the sequences, each sequence's newest position
    and its cache slot, and rotary angles: ``(k_cache, v_cache, block_tables, positions,
    slot_mapping, cos_sin)``."""
    from nanofn.kernels import build_cos_sin_cache

    batch = len(seq_lens)
    k_cache = torch.randn(batch * blocks_each, block_size, kv_heads, dim, generator=generator,
                          device="cuda")
    v_cache = torch.randn(k_cache.shape, generator=generator, device="cuda")
    block_tables = torch.randperm(len(k_cache), generator=generator, device="cuda")
    block_tables = block_tables.view(batch, blocks_each).to(torch.int32)
    positions = (seq_lens - 1).long()
    newest_blocks = block_tables.gather(1, (positions // block_size).view(-1, 1).int()).view(-1)
    slot_mapping = newest_blocks.long() * block_size + positions % block_size
    cos_sin = build_cos_sin_cache(dim, 512, 10000.0, None).cuda()
    return k_cache, v_cache, block_tables, positions, slot_mapping, cos_sin


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_rotary_decode_attention_reads_the_projection_the_kernel_ahead_wrote(num_splits):
    """The projection (a GEMV at 4 rows) then the rotary decode attention, replayed from a graph
    with a new input each time: the output and the newest keys and values in the cache are the
    float32 references' of this replay's projection. The contexts put the newest key first in
    its tile, alone, on a tile's last key and past a tile."""
    from nanofn.kernels import linear
    from nanofn.kernels.rotary import rotary_decode_attention as reference_rotary_decode
    from nanofn.kernels.triton_attention import rotary_decode_attention
    from nanofn.kernels.triton_ops import linear as triton_linear

    heads, kv_heads, dim, hidden = 16, 8, 128, 256
    seq_lens = torch.tensor([129, 1, 64, 300], dtype=torch.int32, device="cuda")
    batch = len(seq_lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache, block_tables, positions, slot_mapping, cos_sin = paged_decode_inputs(
        seq_lens, kv_heads, dim, g)
    weight = torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=g, device="cuda") / hidden**0.5
    norms = [1 + torch.randn(dim, generator=g, device="cuda") / 4 for _ in range(2)]
    x = torch.empty(batch, hidden, device="cuda")
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]

    def step(project, attend, caches):
        q, k, v = (t.view(batch, -1, dim) for t in project(x, weight).split(sizes, dim=-1))
        return attend(q, k, v, positions, cos_sin, *caches, slot_mapping, seq_lens, block_tables,
                      dim**-0.5, None, *norms, 1e-6)

    triton_step = lambda: step(triton_linear, functools.partial(  # noqa: E731
        rotary_decode_attention, num_splits=num_splits), (k_cache, v_cache))
    x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
    triton_step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_step()
    for seed in range(2, 6):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda"))
        caches = (k_cache.clone(), v_cache.clone())
        expected = step(linear, reference_rotary_decode, caches)
        graph.replay()
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
        for ours, theirs in zip((k_cache, v_cache), caches):
            torch.testing.assert_close(ours.flatten(0, 1)[slot_mapping],
                                       theirs.flatten(0, 1)[slot_mapping], rtol=1e-3, atol=1e-3)
