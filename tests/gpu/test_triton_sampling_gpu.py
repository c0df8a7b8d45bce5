"""The Triton sampling kernels and the Sampler's Triton path on a CUDA GPU, at real sizes: Qwen3's
vocabulary and a decode batch of 256 rows. ``benchmark()`` prints timings, asserting nothing.

Where the fused draw and the torch steps over the same noise compute the same token, float
rounding may still part them on a near tie: those comparisons allow one row in a batch to differ.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
import triton.testing

from nanofn.kernels.triton_sampling import exponential_noise, sample_plain
from nanofn.runner.sampler import (
    Sampler, SampleRequest, apply_temperature, exponential_race, row_seed,
)
from nanofn.state.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB, BATCH = 151_936, 256
DEVICE = "cuda"


def keys(seeds) -> torch.Tensor:
    """Philox keys as the sampler makes them for seeded rows (at position 0)."""
    unsigned = [row_seed(s, 0) for s in seeds]
    signed = [k - (1 << 64) if k >= 1 << 63 else k for k in unsigned]
    return torch.tensor(signed, device=DEVICE)


def random_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator, device=DEVICE) * scale


def request(position: int = 0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), position, prompt_token_ids=[1, 2, 3],
                         output_token_ids=[4, 5])


# ---------------------------------------------------------------------------------------- kernels


def test_noise_is_philox4x32_10_and_exponential():
    known_answer = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]  # Random123, key 0, counter 0
    expected = -torch.tensor([-(w + 0.5) / 2**32 for w in known_answer],
                             dtype=torch.float64).log1p()
    first = exponential_noise(torch.zeros(1, dtype=torch.int64, device=DEVICE), 4)
    torch.testing.assert_close(first[0].double().cpu(), expected, rtol=1e-5, atol=0)

    row_keys = keys(range(64))
    noise = exponential_noise(row_keys, VOCAB)
    assert torch.equal(noise, exponential_noise(row_keys, VOCAB))
    assert torch.equal(noise[[5, 1]], exponential_noise(row_keys[[5, 1]], VOCAB))
    assert noise.min() > 0 and noise.max() < 23
    assert noise.mean().item() == pytest.approx(1.0, abs=2e-3)
    # P(E > x) = exp(-x), and P(E < x) = 1 - exp(-x) ~ x for the smallest values, where an
    # inexact logarithm near u = 1 would show.
    for x in (0.01, 1.0, 5.0):
        assert (noise > x).double().mean().item() == pytest.approx(math.exp(-x), rel=0.02)
    assert (noise < 1e-4).double().mean().item() == pytest.approx(1e-4, rel=0.2)


def test_the_hardware_logarithms_keep_the_noise_within_a_few_ulps_of_its_definition():
    """On the GPU the noise takes ``lg2.approx``; the interpreter tests the exact logarithms."""
    from test_triton_sampling import expected_noise  # (tests/: the numpy Philox4x32-10)

    row_keys = keys(range(8))
    noise = exponential_noise(row_keys, VOCAB).double().cpu().numpy()
    expected = np.stack([expected_noise(int(k), VOCAB) for k in row_keys.tolist()])
    relative = np.abs(noise - expected) / expected
    print(f"largest relative error of the noise: {relative.max():.2e}")
    assert relative.max() < 3e-6


def test_greedy_rows_take_the_argmax_with_torch_tie_and_nan_rules():
    logits = random_logits(BATCH, seed=0)
    logits[1, [10, 150_000]] = 100.0
    logits[2, [5, 90_000]] = float("nan")
    logits[3] = float("-inf")
    logits[4, [37_984, 75_968]] = float("inf")  # the first tokens of quarters 1 and 2
    temperature = torch.zeros(BATCH, device=DEVICE)
    tokens = sample_plain(logits, temperature, keys(range(BATCH)))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[1:5].tolist() == [10, 5, 0, 37_984]


def test_draw_is_the_exponential_race_over_the_same_noise():
    logits = random_logits(BATCH, seed=1)
    temperature = torch.linspace(0.1, 3.0, BATCH, device=DEVICE)
    row_keys = keys(range(1000, 1000 + BATCH))
    tokens = sample_plain(logits, temperature, row_keys)
    race = exponential_race(apply_temperature(logits, temperature).softmax(dim=-1),
                            exponential_noise(row_keys, VOCAB))
    assert (tokens != race).sum().item() <= 1


def test_tokens_do_not_depend_on_the_split():
    logits = random_logits(BATCH, seed=2, scale=1.0)
    temperature = torch.linspace(0.0, 2.0, BATCH, device=DEVICE)
    row_keys = keys(range(BATCH))
    by_default = sample_plain(logits, temperature, row_keys)
    for num_splits in (1, 3, 8, 1000):
        assert torch.equal(sample_plain(logits, temperature, row_keys, num_splits=num_splits),
                           by_default)


def draws(logits_row: torch.Tensor, temperature: float, steps: int) -> torch.Tensor:
    """``steps * BATCH`` fused draws from one row of logits, each with its own key."""
    logits = logits_row.expand(BATCH, VOCAB).contiguous()
    temperatures = torch.full((BATCH,), temperature, device=DEVICE)
    return torch.cat([sample_plain(logits, temperatures, keys(range(s * BATCH, (s + 1) * BATCH)))
                      for s in range(steps)])


def test_frequencies_follow_the_softmax_across_the_whole_vocabulary():
    hot = torch.tensor([0, 5, 37_983, 37_984, 75_000, 113_000, 151_000, VOCAB - 1], device=DEVICE)
    logits = torch.full((VOCAB,), float("-inf"), device=DEVICE)
    logits[hot] = torch.tensor([1.0, 0.0, 0.5, -0.5, 1.5, 0.2, -1.0, 0.8], device=DEVICE)
    tokens = draws(logits, temperature=0.7, steps=100)
    frequencies = torch.bincount(tokens, minlength=VOCAB)[hot] / tokens.numel()
    expected = (logits[hot] / 0.7).softmax(dim=-1)
    torch.testing.assert_close(frequencies, expected, atol=0.015, rtol=0)


def test_rare_tokens_are_drawn_at_their_probability():
    """Noise biased near u = 0 or 1 would favour arbitrary tokens: here 151,935 tokens share
    1e-3 of the mass, so about 10 of 10,240 draws land among them."""
    logits = torch.full((VOCAB,), torch.tensor(1e-3 / (VOCAB - 1)).log().item(), device=DEVICE)
    logits[70_000] = 0.0
    tokens = draws(logits, temperature=1.0, steps=40)
    assert 2 <= (tokens != 70_000).sum().item() <= 25


def test_a_concentrated_row_always_returns_its_token():
    logits = random_logits(BATCH, seed=3, scale=1.0)
    hot = torch.randint(0, VOCAB, (BATCH,), generator=torch.Generator(DEVICE).manual_seed(4),
                        device=DEVICE)
    logits[torch.arange(BATCH, device=DEVICE), hot] += 80.0
    temperature = torch.linspace(0.2, 2.0, BATCH, device=DEVICE)
    assert torch.equal(sample_plain(logits, temperature, keys(range(BATCH))), hot)


# ------------------------------------------------------------------------------------- Sampler


def test_seeded_rows_do_not_depend_on_the_batch_or_the_other_rows_paths():
    plain = request(position=5, seed=42, temperature=0.8)
    filtered = request(position=9, seed=42, top_k=40, top_p=0.9)
    kinds = [dict(), dict(temperature=0.0), dict(top_p=0.5), dict(top_k=20), dict(min_p=0.1),
             dict(frequency_penalty=0.5), dict(repetition_penalty=1.2, seed=3),
             dict(logprobs=2), dict(seed=43)]
    target_logits = random_logits(2, seed=5)
    tokens = set()
    for layout in range(4):
        shuffle = random.Random(layout)
        others = [request(position=p, **shuffle.choice(kinds)) for p in range(BATCH - 2)]
        batch = others + [plain, filtered]
        shuffle.shuffle(batch)
        logits = random_logits(BATCH, seed=10 + layout)
        logits[batch.index(plain)] = target_logits[0]
        logits[batch.index(filtered)] = target_logits[1]
        drawn = Sampler(seed=layout, device=DEVICE)(logits, batch).token_ids
        tokens.add((drawn[batch.index(plain)], drawn[batch.index(filtered)]))
    assert len(tokens) == 1


def test_plain_and_filtered_paths_draw_from_the_same_stream():
    """Filters that keep every token send a row through the torch steps, with the same noise."""
    logits = random_logits(1, seed=6, scale=1.0).expand(64, VOCAB).contiguous()
    sampler = Sampler(seed=0, device=DEVICE)

    def tokens(**params) -> torch.Tensor:
        return torch.tensor(sampler(logits, [request(position=p, seed=11, temperature=0.9, **params)
                                             for p in range(64)]).token_ids)

    plain = tokens()
    assert len(set(plain.tolist())) > 32
    assert (tokens(top_k=VOCAB) != plain).sum().item() <= 1
    assert (tokens(min_p=1e-20) != plain).sum().item() <= 1


def test_filtered_rows_renormalise_over_the_kept_tokens():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3], device=DEVICE)
    logits = torch.full((BATCH, VOCAB), float("-inf"), device=DEVICE)
    logits[:, :4] = probs.log()
    sampler = Sampler(seed=1, device=DEVICE)
    requests = [request(top_k=2)] * BATCH
    tokens = torch.tensor([t for _ in range(40) for t in sampler(logits, requests).token_ids])
    frequencies = torch.bincount(tokens, minlength=4) / tokens.numel()
    assert frequencies.tolist() == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8], abs=0.02)


# ----------------------------------------------------------------------------------- benchmark


def benchmark() -> None:
    """Print median times: a decode step's plain sampling (temperature 0.6) at 256 x 151,936,
    fused against the torch steps, as kernels and through the Sampler (host work and the final
    copy included); the noise kernel; a batch where 32 rows also have top_p."""
    logits = random_logits(BATCH, seed=7)
    temperature = torch.full((BATCH,), 0.6, device=DEVICE)
    row_keys = keys(range(BATCH))
    _report("plain, kernels",
            lambda: sample_plain(logits, temperature, row_keys),
            lambda: exponential_race(apply_temperature(logits, temperature).softmax(dim=-1),
                                     torch.empty_like(logits).exponential_()))
    noise_ms = triton.testing.do_bench(lambda: exponential_noise(row_keys, VOCAB),
                                       return_mode="median")
    print(f"exponential_noise {BATCH} x {VOCAB}: {noise_ms:.3f} ms")
    plain = [request(position=100, temperature=0.6)] * BATCH
    mixed = plain[:BATCH - 32] + [request(position=100, temperature=0.6, top_p=0.9)] * 32
    fused = Sampler(seed=0, device=DEVICE)
    unfused = Sampler(seed=0, device=DEVICE, use_triton=False)
    for name, requests in [("plain, Sampler", plain), ("224 plain + 32 top_p, Sampler", mixed)]:
        _report(name, lambda: fused(logits, requests), lambda: unfused(logits, requests))


def _report(name, triton_call, torch_call) -> None:
    triton_ms = triton.testing.do_bench(triton_call, return_mode="median")
    torch_ms = triton.testing.do_bench(torch_call, return_mode="median")
    print(f"{name}: triton {triton_ms:.3f} ms, torch {torch_ms:.3f} ms, "
          f"{torch_ms / triton_ms:.1f}x")


if __name__ == "__main__":
    benchmark()
