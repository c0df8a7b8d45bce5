"""Paged-KV-cache attention, plain-torch references.

Cache layout: ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
a token's slot is ``block * block_size + offset``. Sequence ``i`` owns the blocks listed in
``block_tables[i]`` (padded with 0 past its last block). Grouped-query attention: query head
``h`` reads kv head ``h // (num_heads // num_kv_heads)``, as in Hugging Face's ``repeat_kv``.

These functions are the yardstick the Triton kernels are tested against: they favour being
obviously right over being fast, and compute scores and softmax in float32.

An FP8 cache (float8_e4m3fn, ``kv_cache_dtype="fp8"``) holds ``key / k_scale`` and ``value /
v_scale`` (``fp8.quantize_kv``): one scale per tensor, 1 unless calibrated scales are given,
as vLLM's default. The writes quantize and attention dequantizes, in float32.
"""

from __future__ import annotations

import torch

from nanofn.kernels.fp8 import FP8_DTYPE, dequantize_kv, quantize_kv


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t`` of ``k``/``v`` (``[T, Hkv, D]``) to slot ``slot_mapping[t]``, in place
    (an FP8 cache: quantized with ``k_scale`` and ``v_scale``).

    Negative slots (padding tokens) are skipped.
    """
    num_kv_heads, head_dim = k.shape[1:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        entries = quantize_kv(x[keep], scale) if cache.dtype == FP8_DTYPE else x[keep].to(cache.dtype)
        cache.view(-1, num_kv_heads, head_dim)[slots] = entries


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence's paged cache, as ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens_host: tuple[int, ...],
    seq_lens_host: tuple[int, ...],
    scale: float,
    tiles: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for a flattened batch of query chunks; returns ``[T, H, D]``.

    Sequence ``i``'s queries are the last ``query_lens_host[i]`` positions of its context of
    ``seq_lens_host[i]`` tokens, all of which (its new tokens included) are already in the cache.
    ``query_start`` and ``seq_lens`` are the device copies the kernels read; this reference walks
    the host tuples instead, so it never waits on the device. ``tiles``: the Triton kernel's
    work map, which a CUDA graph fixes in advance (``triton_attention.prefill_tile_map``);
    the reference has no use for it.
    """
    out = torch.empty_like(q)
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens_host, seq_lens_host)):
        end = start + query_len
        k = dequantize_kv(gather_context(k_cache, block_tables[i], seq_len), k_scale)
        v = dequantize_kv(gather_context(v_cache, block_tables[i], seq_len), v_scale)
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_positions = torch.arange(seq_len, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
        out[start:end] = _attend(q[start:end], k, v, visible, scale)
        start = end
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one query per sequence (``q`` is ``[B, H, D]``) at its last position.

    Gathers every sequence's blocks up to the table width and masks keys past ``seq_lens``.
    A padding row with ``seq_len == 0`` yields finite garbage rather than NaN. ``order`` is a
    permutation of the rows, the order in which a GPU kernel may take them up: it has no
    effect on the result, and none here.
    """
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = dequantize_kv(k_cache[block_tables.long()].flatten(1, 2), k_scale)  # [B, L, Hkv, D]
    v = dequantize_kv(v_cache[block_tables.long()].flatten(1, 2), v_scale)
    queries = q.float().view(batch_size, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", queries, k) * scale
    key_positions = torch.arange(k.shape[1], device=q.device)
    visible = key_positions[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(torch.float32).min)
    out = torch.einsum("bkgl,blkd->bkgd", scores.softmax(dim=-1), v)
    return out.reshape(batch_size, num_heads, head_dim).to(q.dtype)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked softmax attention of ``q [Q, H, D]`` over ``k, v [K, Hkv, D]`` in float32."""
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    queries = q.float().view(query_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("qkgd,lkd->kgql", queries, k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("kgql,lkd->qkgd", scores.softmax(dim=-1), v.float())
    return out.reshape(query_len, num_heads, head_dim).to(q.dtype)
