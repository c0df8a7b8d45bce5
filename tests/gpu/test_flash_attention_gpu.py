"""flash-attn-4's paged prefill against the torch reference, and the engine on ``kernel_backend=
"flash"`` against Triton, in bf16. Skipped where flash-attn-4 cannot run (it says why).

Qwen3-0.6B's attention shape: head_dim 128, 16 query heads over 8 kv heads. Run as a script, it
prints Triton and flash-attn-4 side by side at prefill and decode shapes, asserting nothing.
"""

from __future__ import annotations

import time

import pytest
import torch

from nanofn import LLM, SamplingParams
from nanofn.kernels.device import flash_attention_problem

PROBLEM = flash_attention_problem(torch.device("cuda"), torch.bfloat16)
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"flash-attn-4 cannot run: {PROBLEM}")
if PROBLEM is None:
    import nanofn.kernels.flash_attention as flash_attention
    import nanofn.kernels.triton_attention as triton_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
# (query_len, seq_len): whole prompts, chunks after a cached prefix, decodes batched with prefills.
PREFILL_SEQUENCES = [(2048, 2048), (1024, 3072), (1, 1500), (300, 300), (17, 1000), (2000, 2100), (1, 1)]


def inputs(sequences, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, block_size=16, seed=0):
    query_lens, seq_lens = zip(*sequences)
    return flash_attention.random_prefill_inputs(query_lens, seq_lens, num_heads, num_kv_heads,
                                                 HEAD_DIM, block_size, torch.bfloat16,
                                                 torch.device("cuda"), seed)


@pytest.fixture
def flash_calls(monkeypatch):
    """The number of flash-attn-4 launches so far, as a one-item list."""
    calls = [0]
    varlen = flash_attention.flash_attn_varlen_func

    def counted(*args, **kwargs):
        calls[0] += 1
        return varlen(*args, **kwargs)

    monkeypatch.setattr(flash_attention, "flash_attn_varlen_func", counted)
    return calls


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size",
                         [(16, 8, 16), (16, 8, 128), (28, 4, 16)],
                         ids=["group-2", "group-2-block-128", "group-7"])
def test_flash_prefill_matches_reference(num_heads, num_kv_heads, block_size):
    args = inputs(PREFILL_SEQUENCES, num_heads, num_kv_heads, block_size)

    out = flash_attention.flash_prefill_attention(*args)

    assert out.dtype == torch.bfloat16 and out.shape == args[0].shape
    assert flash_attention.relative_error(out, args) < 1e-2


@pytest.mark.usefixtures("nan_filled_allocations")
def test_prefill_attention_takes_flash_for_large_steps_only(flash_calls, monkeypatch):
    """The choice by the step's attention work, at a threshold between these two steps'."""
    monkeypatch.setattr(flash_attention, "MIN_FLASH_WORK", 1 << 22)
    small = inputs([(300, 300), (17, 1000), (1, 20)], seed=1)
    large = inputs(PREFILL_SEQUENCES, seed=2)
    assert flash_attention.causal_work(*small[6:8]) < flash_attention.MIN_FLASH_WORK
    assert flash_attention.causal_work(*large[6:8]) >= flash_attention.MIN_FLASH_WORK

    assert flash_attention.relative_error(flash_attention.prefill_attention(*small), small) < 1e-2
    assert flash_calls == [0]
    assert flash_attention.relative_error(flash_attention.prefill_attention(*large), large) < 1e-2
    assert flash_calls == [1]


@pytest.mark.parametrize("head_dim", [16, 64])
def test_generate_on_flash_matches_triton(tiny_checkpoint, head_dim, flash_calls, monkeypatch):
    """Every prefill step on flash-attn-4 (eager, no size threshold), prompts sharing a cached
    prefix and split into chunks: prompt logprobs as Triton's up to bf16 rounding, greedy tokens
    equal until Triton's top two are nearly tied."""
    monkeypatch.setattr(flash_attention, "MIN_FLASH_WORK", 0)
    model_dir = tiny_checkpoint("qwen3", head_dim=head_dim)
    g = torch.Generator().manual_seed(head_dim)
    prefix = torch.randint(3, 380, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 380, (n,), generator=g).tolist() for n in (7, 33, 70, 110)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)

    def generate(kernel_backend):
        with LLM(str(model_dir), dtype="bfloat16", kernel_backend=kernel_backend,
                 enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512,
                 max_num_batched_tokens=96, max_num_seqs=4) as llm:
            llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # caches
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    triton, flash = generate("triton"), generate("flash")

    assert flash_calls[0] >= 4
    for prompt, got, want in zip(prompts, flash, triton):
        prompt_logprobs = [[e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
                           for out in (got, want)]
        ours, theirs = torch.tensor(prompt_logprobs)
        assert (ours - theirs).norm() / theirs.norm() < 2e-2
        tokens, expected = got.outputs[0].token_ids, want.outputs[0].token_ids
        i = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if i is not None:
            top2 = sorted((v.logprob for v in want.outputs[0].logprobs[i].values()), reverse=True)
            assert top2[0] - top2[1] < 0.25, (i, top2)


def device_ms(call, args) -> tuple[float, str]:
    """Median device time of ``call(*args)`` in ms, replayed from a CUDA graph (or timed eagerly
    with CUDA events where it cannot be captured, which the second item says)."""
    import triton.testing

    call(*args)  # compile outside the capture
    try:
        return triton.testing.do_bench_cudagraph(lambda: call(*args), return_mode="median"), ""
    except Exception as error:
        print(f"no CUDA graph ({type(error).__name__}: {error})")
        return triton.testing.do_bench(lambda: call(*args), return_mode="median"), " (eager)"


def decode_benchmark() -> None:
    """Triton's decode kernel and flash-attn-4 (one query per sequence) side by side: device
    time per call and the rate at which it reads the cache."""
    print("| decode | Triton (nanofn) | flash-attn-4 | flash-attn-4, block 128 |")
    print("|---|---|---|---|")
    for count, length in [(256, 600), (64, 2000), (1, 1024), (1, 4000)]:
        cache_bytes = 2 * count * length * NUM_KV_HEADS * HEAD_DIM * 2  # k and v, bf16
        cells = []
        for block_size, call in [(16, triton_attention.decode_attention),
                                 (16, flash_attention.flash_prefill_attention),
                                 (128, flash_attention.flash_prefill_attention)]:
            args = inputs([(1, length)] * count, block_size=block_size)
            if call is triton_attention.decode_attention:
                q, k_cache, v_cache, _, seq_lens, tables, *_, scale = args
                args = (q, k_cache, v_cache, seq_lens, tables, scale)
            ms, how = device_ms(call, args)
            cells.append(f"{ms * 1e3:.1f} us = {cache_bytes / ms / 1e6:,.0f} GB/s{how}")
        print(f"| {count} x {length:,} | {' | '.join(cells)} |")


def benchmark() -> None:
    """Triton and flash-attn-4 prefill side by side, Qwen3-0.6B heads, bf16: device time per
    call replayed from a CUDA graph, and host time per eager call (launch only)."""
    print("| prefill | Triton (nanofn) | flash-attn-4 | flash-attn-4, block 128 | host us/call eager: Triton, flash-attn-4 |")
    print("|---|---|---|---|---|")
    for count, length in [(8, 1024), (4, 4096), (1, 512), (1, 1024), (1, 2048), (2, 2048), (4, 1024)]:
        sequences = [(length, length)] * count
        flops = 4 * flash_attention.causal_work(*zip(*sequences)) * NUM_HEADS * HEAD_DIM
        cells, host = [], []
        for call, block_size in [(triton_attention.prefill_attention, 16),
                                 (flash_attention.flash_prefill_attention, 16),
                                 (flash_attention.flash_prefill_attention, 128)]:
            args = inputs(sequences, block_size=block_size)
            ms, how = device_ms(call, args)
            cells.append(f"{ms * 1e3:.1f} us = {flops / ms / 1e9:.0f} TFLOP/s{how}")
            if block_size == 16:
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(20):
                    call(*args)
                host.append(f"{(time.perf_counter() - start) / 20 * 1e6:.0f}")
                torch.cuda.synchronize()
        print(f"| {count} x {length:,} | {' | '.join(cells)} | {', '.join(host)} |")


if __name__ == "__main__":
    if PROBLEM is not None:
        raise SystemExit(f"flash-attn-4 cannot run: {PROBLEM}")
    benchmark()
    decode_benchmark()
