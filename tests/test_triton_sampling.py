"""The Triton sampling kernels and the Sampler's Triton path, on CPU through Triton's interpreter.

The noise is checked bit for bit against a numpy Philox4x32-10 (itself checked against Random123's
known answer) and for its distribution; the fused draw against the exponential race over that
noise, against ``torch.argmax`` for greedy rows and for its frequencies. The interpreter runs a
program in tens of milliseconds, so batches stay small. ``tests/gpu`` repeats this at full size.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanofn.kernels.triton_sampling import exponential_noise, sample_plain, sample_plain_by_slot
from nanofn.runner import sampler as sampler_module
from nanofn.runner.sampler import (
    Sampler, SampleRequest, SamplingRows, exponential_race, row_seed,
)
from nanofn.state.params import SamplingParams

VOCAB = 1000
WIDE_VOCAB = 20_000  # five tiles of counters per row: room for several splits


def keys(*seeds: int) -> torch.Tensor:
    """Philox keys as the sampler makes them for seeded rows (at position 0), as int64."""
    unsigned = [row_seed(s, 0) for s in seeds]
    return torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in unsigned])


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------- noise


def philox4x32_10(key: int, counters: np.ndarray) -> list[np.ndarray]:
    """Random123's Philox4x32-10 of the counters ``(c, 0, 0, 0)`` under a 64-bit key: the four
    32-bit words, as uint64 arrays. The 32 x 32-bit products are exact in uint64."""
    mask = np.uint64(0xFFFFFFFF)
    zero = np.zeros_like(counters, dtype=np.uint64)
    c0, c1, c2, c3 = counters.astype(np.uint64), zero, zero, zero
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64((key >> 32) & 0xFFFFFFFF)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        high0, high2 = p0 >> np.uint64(32), p2 >> np.uint64(32)
        c0, c1, c2, c3 = high2 ^ c1 ^ k0, p2 & mask, high0 ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return [c0, c1, c2, c3]


def expected_noise(key: int, vocab: int) -> np.ndarray:
    """The module's definition: token t gets word w = t // quarter at counter t % quarter, as
    ``-ln(1 - v)`` with ``v = (w + 1/2) / 2**32``."""
    quarter = -(-vocab // 4)
    words = philox4x32_10(key & ((1 << 64) - 1), np.arange(quarter))
    tokens = np.arange(vocab)
    chosen = np.stack(words)[tokens // quarter, tokens % quarter]
    return -np.log1p(-(chosen.astype(np.float64) + 0.5) / 2**32)


def test_reference_philox_gives_random123_known_answer():
    words = philox4x32_10(0, np.zeros(1, dtype=np.uint64))
    assert [int(w[0]) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("vocab", [10, 4099])  # 4099: a partial quarter and a partial tile
def test_noise_is_philox_keyed_by_the_row_seed_and_the_token(interpreter, vocab):
    row_keys = torch.cat([torch.tensor([0, -1, 1 << 40]), keys(7)])  # high and low key halves
    noise = interpreter(exponential_noise, row_keys, vocab)
    expected = np.stack([expected_noise(int(k), vocab) for k in row_keys])
    np.testing.assert_allclose(noise.numpy(), expected, rtol=1e-6)


def test_noise_is_exponential_deterministic_and_per_row(interpreter):
    row_keys = keys(1, 2, 3, 4)
    noise = interpreter(exponential_noise, row_keys, 40_000)
    again = interpreter(exponential_noise, row_keys[[2, 0]], 40_000)
    assert torch.equal(again, noise[[2, 0]])
    assert noise.min() > 0 and noise.max() < 23  # -ln(2**-33) = 22.9
    assert noise.mean().item() == pytest.approx(1.0, abs=0.015)
    for x in (0.1, 1.0, 3.0):  # P(E > x) = exp(-x)
        assert (noise > x).float().mean().item() == pytest.approx(math.exp(-x), abs=0.005)
    assert not torch.equal(noise[0], noise[1])


# ----------------------------------------------------------------------------------- fused draw


def test_greedy_rows_take_the_argmax_with_torch_tie_and_nan_rules(interpreter):
    logits = random_logits(8, VOCAB, seed=0)
    logits[1, [10, 600]] = 100.0  # a tie: the lower index
    logits[2, [5, 900]] = float("nan")  # NaN ranks above everything: the first one
    logits[3] = float("-inf")  # nothing finite: token 0
    logits[4, :] = float("-inf")
    logits[4, 777] = -5.0
    logits[5, [300, 301]] = float("inf")
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-6, 0.0])
    tokens = interpreter(sample_plain, logits, temperature, keys(*range(8)))
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens.tolist()[1:6] == [10, 5, 0, 777, 300]


def test_greedy_ties_and_nans_met_by_one_lane_go_to_the_lower_token(interpreter):
    """Tokens 1,024 counters apart in one quarter are one lane's, met one after the other."""
    logits = random_logits(3, WIDE_VOCAB, seed=1)
    logits[0, [7, 7 + 1024, 7 + 2048]] = 100.0
    logits[1, [7, 7 + 1024]] = float("nan")
    logits[2, [7 + 1024, 7 + 3072]] = float("nan")
    logits[2, 7] = float("inf")
    tokens = interpreter(sample_plain, logits, torch.zeros(3), keys(1, 2, 3), num_splits=1)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() == [7, 7, 7 + 1024]


def test_draw_is_the_exponential_race_over_the_same_noise(interpreter):
    logits = random_logits(8, VOCAB, seed=1)
    temperature = torch.tensor([0.2, 0.5, 0.6, 0.8, 1.0, 1.0, 1.5, 4.0])
    row_keys = keys(*range(100, 108))
    tokens = interpreter(sample_plain, logits, temperature, row_keys)
    noise = interpreter(exponential_noise, row_keys, VOCAB)
    race = exponential_race((logits / temperature[:, None]).softmax(dim=-1), noise)
    assert tokens.tolist() == race.tolist()
    assert len(set(tokens.tolist())) > 1


def test_tokens_do_not_depend_on_the_split(interpreter):
    logits = random_logits(4, WIDE_VOCAB, seed=2)
    logits[0, [3, 17_000]] = 50.0  # a greedy tie across splits
    logits[1, [19_000, 12_000]] = float("nan")  # in different splits; the first NaN wins
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0])
    row_keys = keys(5, 6, 7, 8)
    by_split = [interpreter(sample_plain, logits, temperature, row_keys, num_splits=n).tolist()
                for n in (1, 2, 5)]
    assert by_split[0] == by_split[1] == by_split[2]
    assert by_split[0][:2] == [3, 12_000]


def sample_by_slot_and_return(logits, slots, slot_temperature, key_base, kept):
    """``sample_plain_by_slot``'s tokens and what it kept (from the interpreter's child)."""
    tokens = torch.full((len(logits),), -7, dtype=torch.int64)
    sample_plain_by_slot(logits, slots, slot_temperature, key_base, 31, kept, tokens)
    return tokens, kept


def test_the_graphs_draw_by_slot_is_the_plain_draw_of_the_slots_temperatures_and_keys(interpreter):
    """Rows at their slots' temperatures (one greedy), keyed by a 62-bit base plus the row
    (given as its low and high 31 bits, a field apart as in the graphs' input buffer): the
    tokens of ``sample_plain``, also kept at each row's slot and nowhere else."""
    logits = random_logits(5, VOCAB, seed=4)
    slots = torch.tensor([3, 0, 6, 2, 5], dtype=torch.int32)
    slot_temperature = torch.tensor([0.7, 9.0, 1.3, 0.0, 9.0, 0.4, 2.0, 9.0])
    base = (12345 << 31) | 678
    fields = torch.zeros(2, 4, dtype=torch.int32)
    fields[:, 0] = torch.tensor([base & ((1 << 31) - 1), base >> 31])
    kept = torch.full((8,), -1, dtype=torch.int64)

    tokens, kept = interpreter(sample_by_slot_and_return, logits, slots, slot_temperature,
                               fields[:, 0], kept)

    row_keys = base + torch.arange(5)
    expected = interpreter(sample_plain, logits, slot_temperature[slots.long()], row_keys)
    assert tokens.tolist() == expected.tolist()
    assert kept[slots.long()].tolist() == expected.tolist()
    assert kept[[1, 4, 7]].tolist() == [-1, -1, -1]
    assert len(set(tokens.tolist())) > 1


def test_sixteen_bit_logits_draw_the_tokens_of_their_float32_copy(interpreter):
    """The decode graphs pass the LM head's bfloat16 logits straight to the draw."""
    logits = random_logits(6, VOCAB, seed=4).to(torch.bfloat16)
    temperature = torch.tensor([0.0, 0.3, 0.6, 1.0, 1.0, 2.0])
    row_keys = keys(*range(20, 26))
    tokens = interpreter(sample_plain, logits, temperature, row_keys)
    assert tokens.tolist() == interpreter(sample_plain, logits.float(), temperature,
                                          row_keys).tolist()
    assert len(set(tokens.tolist())) > 1


def test_a_concentrated_row_always_returns_its_token(interpreter):
    logits = random_logits(12, VOCAB, seed=3, scale=1.0)
    hot = torch.arange(12) * 83
    logits[torch.arange(12), hot] += 80.0  # at T = 2, the other tokens share e**-38 of the mass
    logits[11] = float("-inf")  # the only finite logit
    logits[11, hot[11]] = -3.0
    temperature = torch.tensor([0.5, 1.0, 2.0] * 3 + [5.0, 5.0, 100.0])
    tokens = interpreter(sample_plain, logits, temperature, keys(*range(12)))
    assert tokens.tolist() == hot.tolist()


def test_frequencies_follow_the_softmax_of_the_tempered_logits(interpreter):
    draws, temperature = 300, 0.7
    logits = torch.tensor([1.0, 0.2, -0.5, 0.6])
    tokens = interpreter(sample_plain, logits.repeat(draws, 1), torch.full((draws,), temperature),
                         keys(*range(draws)))
    frequencies = torch.bincount(tokens, minlength=4) / draws
    expected = (logits / temperature).softmax(dim=-1)
    assert frequencies.tolist() == pytest.approx(expected.tolist(), abs=0.08)


# --------------------------------------------------------------------- the Sampler's Triton path


def request(position: int = 0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), position, prompt_token_ids=[1, 2],
                         output_token_ids=[3])


def sample_with_triton(sampler_seed, batches):
    """The token ids of each (logits, requests) batch, drawn by one Triton-path sampler."""
    sampler = Sampler(seed=sampler_seed, device="cpu", use_triton=True)
    return [sampler(logits, requests).token_ids for logits, requests in batches]


def test_seeded_rows_do_not_depend_on_the_batch_or_the_other_rows_paths(interpreter):
    plain = request(position=5, seed=42, temperature=0.8)
    filtered = request(position=9, seed=42, top_k=40, top_p=0.9)
    others = [request(), request(position=5, seed=43), request(temperature=0.0),
              request(top_p=0.5), request(frequency_penalty=0.5, seed=1),
              SampleRequest(SamplingParams(min_p=0.2), 3, banned_token_ids=(1, 2)),
              request(logprobs=2, temperature=0.0)]
    target_logits = random_logits(2, VOCAB, seed=4)
    layouts = [[plain, filtered], others[:3] + [filtered] + others[3:] + [plain],
               [plain] + others[::-1] + [filtered], [filtered, others[4], plain, others[0]]]
    batches = []
    for i, batch in enumerate(layouts):
        logits = random_logits(len(batch), VOCAB, seed=10 + i)
        logits[batch.index(plain)] = target_logits[0]
        logits[batch.index(filtered)] = target_logits[1]
        batches.append((logits, batch))
    drawn = interpreter(sample_with_triton, None, batches)
    plain_tokens = {tokens[batch.index(plain)] for tokens, (_, batch) in zip(drawn, batches)}
    filtered_tokens = {tokens[batch.index(filtered)] for tokens, (_, batch) in zip(drawn, batches)}
    assert len(plain_tokens) == 1 and len(filtered_tokens) == 1


def test_plain_and_filtered_paths_draw_from_the_same_stream(interpreter):
    """Filters that keep every token send a row through the torch steps, with the same noise."""
    logits = random_logits(1, VOCAB, seed=5, scale=1.0).repeat(8, 1)
    positions = range(8)
    plain = [request(position=p, seed=11, temperature=0.9) for p in positions]
    keep_all = [request(position=p, seed=11, temperature=0.9, top_k=VOCAB) for p in positions]
    tiny_min_p = [request(position=p, seed=11, temperature=0.9, min_p=1e-20) for p in positions]
    drawn = interpreter(sample_with_triton, 0,
                        [(logits, plain), (logits, keep_all), (logits, tiny_min_p)])
    assert drawn[0] == drawn[1] == drawn[2]
    assert len(set(drawn[0])) > 4  # the position changes the noise


def test_unseeded_rows_repeat_for_a_fixed_sampler_seed_and_change_between_steps(interpreter):
    steps = [(random_logits(6, VOCAB, seed=6, scale=0.1), [request(), request(top_k=50)] * 3)] * 2
    first, second = interpreter(sample_with_triton, 5, steps)
    assert interpreter(sample_with_triton, 5, steps) == [first, second]
    assert first != second
    assert interpreter(sample_with_triton, 6, steps) != [first, second]


def test_penalties_suppression_and_greedy_rows_on_the_triton_path(interpreter):
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 4)
    requests = [  # the penalty takes token 0 (seen once in the output) from 3 to 1
        SampleRequest(SamplingParams(temperature=0.0, frequency_penalty=2.0), 0, [], [0]),
        SampleRequest(SamplingParams(temperature=0.0), 0, banned_token_ids=(0,)),
        SampleRequest(SamplingParams(temperature=5.0), 0, banned_token_ids=(0, 1, 3)),
        SampleRequest(SamplingParams(temperature=0.0, top_k=2, logprobs=1), 0),
    ]
    assert interpreter(sample_with_triton, 0, [(logits, requests)]) == [[1, 1, 2, 0]]


def sample_both_ways(sampler_seed, batches):
    """Per (logits, requests) batch, the outputs of two Triton-path samplers of the same seed:
    one given the request list, one given ``SamplingRows.from_requests`` of it."""
    by_requests = Sampler(seed=sampler_seed, device="cpu", use_triton=True)
    by_rows = Sampler(seed=sampler_seed, device="cpu", use_triton=True)
    return [(by_requests(logits, requests),
             by_rows.sample(logits, SamplingRows.from_requests(requests)).wait())
            for logits, requests in batches]


def test_sampling_rows_give_what_the_request_list_gives_on_the_triton_path(interpreter):
    mixed = [
        request(temperature=0.0), request(), request(position=5, seed=42, temperature=0.7),
        request(top_k=40), request(position=2, top_p=0.9, seed=-1),
        request(min_p=0.1, temperature=0.5), request(frequency_penalty=0.5, seed=1),
        request(repetition_penalty=1.3, temperature=0.0),
        SampleRequest(SamplingParams(min_p=0.2), 3, banned_token_ids=(1, 2)),
        SampleRequest(SamplingParams(temperature=0.0), 3, banned_token_ids=(0,)),
        request(logprobs=2, temperature=0.0),
        request(position=7, logprobs=3, top_k=5, seed=2**64 - 1),
    ]
    plain = [request(), request(position=4, temperature=0.5, seed=3),
             request(temperature=1e-6, logprobs=1)]
    batches = [(random_logits(len(mixed), VOCAB, seed=20), mixed),
               (random_logits(len(plain), VOCAB, seed=21), plain),
               (random_logits(len(mixed), VOCAB, seed=22, scale=0.3), mixed)]
    for by_requests, by_rows in interpreter(sample_both_ways, 3, batches):
        assert by_rows.token_ids.tolist() == by_requests.token_ids
        assert (by_rows.logprobs or [None] * len(by_requests.token_ids)) == by_requests.logprobs


def sample_both_ways_in_parts(rows_at_once, sampler_seed, batches):
    """``sample_both_ways`` with the torch steps taking ``rows_at_once`` rows at a time."""
    sampler_module.ROWS_AT_ONCE = rows_at_once
    return sample_both_ways(sampler_seed, batches)


def test_rows_taken_in_parts_draw_what_they_draw_all_at_once(interpreter):
    """The torch steps (and the logprobs) take ``ROWS_AT_ONCE`` rows at a time, which bounds
    the sampler's memory; each row's token and logprobs stay what one pass over all gives."""
    mixed = [request(top_k=40), request(temperature=0.0), request(position=2, top_p=0.9, seed=5),
             request(min_p=0.1, temperature=0.5, logprobs=2), request(frequency_penalty=0.5),
             SampleRequest(SamplingParams(min_p=0.2, logprobs=1), 3, banned_token_ids=(1, 2)),
             request(logprobs=2, temperature=0.0), request(position=7, logprobs=3, top_k=5),
             request(repetition_penalty=1.3, top_p=0.8)]
    batches = [(random_logits(len(mixed), VOCAB, seed=30, scale=0.3), mixed)]
    (whole,) = interpreter(sample_both_ways_in_parts, len(mixed), 7, batches)
    (parts,) = interpreter(sample_both_ways_in_parts, 2, 7, batches)
    assert parts[0].token_ids == whole[0].token_ids
    assert parts[0].logprobs == whole[0].logprobs
    assert parts[1].token_ids.tolist() == whole[1].token_ids.tolist()
