"""The sampler: each filter and penalty against direct computations, then the Sampler end to end."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from nanofn.runner.sampler import (
    Sampler, SampleRequest, SamplingRows, add_logit_bias, apply_min_p, apply_penalties, apply_temperature,
    apply_top_k, apply_top_p, keep_allowed, row_seed, row_seeds, token_counts,
)
from nanofn.state.params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")
PROBS = [0.05, 0.5, 0.15, 0.3]  # deliberately not sorted by vocabulary position


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(logits: torch.Tensor) -> list[list[int]]:
    """Token ids left reachable (finite logit), per row."""
    return [torch.nonzero(row.isfinite()).flatten().tolist() for row in logits]


def request(position: int = 0, prompt=None, output=None, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), position, prompt, output)


def draw(sampler: Sampler, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
    return sampler(logits, requests).token_ids


# ----------------------------------------------------------------------------------- penalties


def test_token_counts_counts_each_row_and_ignores_padding():
    counts = token_counts([[1, 1, 3], [], [0]], vocab_size=4, device=CPU)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    prompt = token_counts([[0, 4]], 5, CPU)
    output = token_counts([[1, 1, 2]], 5, CPU)
    penalised = apply_penalties(logits, prompt, output, repetition=torch.tensor([2.0]),
                                frequency=torch.tensor([0.5]), presence=torch.tensor([0.25]))
    expected = [
        2.0 / 2,  # prompt only: positive logit divided
        -2.0 * 2 - 0.5 * 2 - 0.25,  # output twice: negative logit multiplied, freq, presence
        1.0 / 2 - 0.5 - 0.25,  # output once
        0.5,  # never seen
        -1.0 * 2,  # prompt only: negative logit multiplied
    ]
    assert penalised[0].tolist() == pytest.approx(expected)


def test_penalties_are_per_row():
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    counts = token_counts([[0], [0]], 2, CPU)
    penalised = apply_penalties(logits, counts, counts, repetition=torch.tensor([1.0, 4.0]),
                                frequency=torch.tensor([1.0, 0.0]),
                                presence=torch.tensor([0.0, 0.0]))
    assert penalised.tolist() == [[0.0, 1.0], [0.25, 1.0]]


def test_sampler_greedy_follows_penalised_logits_and_leaves_other_rows_alone():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    penalised = request(prompt=[], output=[0], frequency_penalty=2.0, temperature=0.0)
    plain = request(temperature=0.0, logprobs=0)  # not the fast path, so both rows go together
    assert draw(Sampler(seed=0, device=CPU), logits, [penalised, plain]) == [1, 0]


def test_the_cpu_sampler_does_not_need_triton():
    code = """
import sys, torch
from nanofn.runner.sampler import Sampler, SampleRequest
from nanofn.state.params import SamplingParams
requests = [SampleRequest(SamplingParams(seed=1), 0), SampleRequest(SamplingParams(top_k=2), 0)]
Sampler(seed=0, device="cpu")(torch.zeros(2, 5), requests)
assert "triton" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampler_refuses_penalties_without_token_lists():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler(seed=0, device=CPU)(torch.zeros(1, 3), [request(repetition_penalty=1.5)])


# ------------------------------------------------------------------------------------- filters


def test_temperature_divides_each_row():
    scaled = apply_temperature(torch.tensor([[1.0, -2.0], [1.0, -2.0]]), torch.tensor([0.5, 2.0]))
    assert scaled.tolist() == [[2.0, -4.0], [0.5, -1.0]]


@pytest.mark.parametrize("min_p, expected", [
    (0.0, [0, 1, 2, 3]),
    (0.09, [0, 1, 2, 3]),  # threshold 0.045 keeps 0.05
    (0.11, [1, 2, 3]),  # threshold 0.055 drops 0.05
    (0.35, [1, 3]),  # threshold 0.175 drops 0.15
    (1.0, [1]),
])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, expected):
    assert kept(apply_min_p(log_probs(PROBS), torch.tensor([min_p]))) == [expected]


@pytest.mark.parametrize("top_k, expected", [
    (1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (0, [0, 1, 2, 3]), (9, [0, 1, 2, 3]),
])
def test_top_k_keeps_the_k_most_likely(top_k, expected):
    assert kept(apply_top_k(log_probs(PROBS), torch.tensor([top_k]), max(top_k, 1))) == [expected]


def test_top_k_is_per_row():
    logits = torch.cat([log_probs(PROBS)] * 3)
    assert kept(apply_top_k(logits, torch.tensor([1, 0, 2]), 2)) == [[1], [0, 1, 2, 3], [1, 3]]


@pytest.mark.parametrize("top_p, expected", [
    (0.01, [1]),
    (0.45, [1]),  # the top token alone already reaches it
    (0.55, [1, 3]),  # 0.5 is short of it, 0.5 + 0.3 reaches it
    (0.85, [1, 2, 3]),  # 0.8 is short, 0.95 reaches it
    (0.97, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert kept(apply_top_p(log_probs(PROBS), torch.tensor([top_p]))) == [expected]


def test_top_p_is_per_row_and_ignores_already_dropped_tokens():
    logits = torch.cat([log_probs(PROBS), log_probs(PROBS)])
    logits[1, 1] = NEG_INF  # renormalised: 0.1, 0, 0.3, 0.6
    assert kept(apply_top_p(logits, torch.tensor([0.55, 0.55]))) == [[1, 3], [3]]


def test_top_p_ranking_only_the_top_k_candidates_gives_the_same_tokens():
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0))
    top_k = torch.tensor([5, 40, 1, 100, 7, 40, 2, 60])
    top_p = torch.tensor([0.3, 0.9, 0.5, 0.95, 0.99, 0.1, 0.7, 1.0])
    limited = apply_top_k(logits, top_k, 100)
    assert kept(apply_top_p(limited, top_p, candidates=100)) == kept(apply_top_p(limited, top_p))
    assert kept(apply_top_p(limited, top_p)) != kept(limited)


# ----------------------------------------------------------------------------- greedy, logprobs


def test_all_greedy_batch_is_the_argmax_with_first_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    out = Sampler(seed=0, device=CPU)(logits, [request(temperature=0.0)] * 2)
    assert out.token_ids == [1, 3]
    assert out.logprobs == [None, None]


def test_greedy_ties_break_the_same_way_outside_the_fast_path():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert draw(Sampler(seed=0, device=CPU), logits, [request(temperature=0.0, logprobs=2)]) == [1]


def test_logprobs_come_from_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    raw = logits.log_softmax(dim=-1)
    requests = [
        # The penalty makes token 1 the greedy choice; its logprob and rank stay the raw ones.
        request(prompt=[], output=[0], frequency_penalty=2.0, temperature=0.0, logprobs=3),
        request(temperature=0.0),
    ]
    out = Sampler(seed=0, device=CPU)(logits, requests)
    assert out.token_ids == [1, 3]
    first = out.logprobs[0]
    assert (first.token_id, first.rank) == (1, 2)
    assert first.logprob == pytest.approx(raw[0, 1].item(), abs=1e-6)
    assert [t for t, _ in first.top] == [0, 1, 2]
    assert [lp for _, lp in first.top] == pytest.approx(raw[0, [0, 1, 2]].tolist(), abs=1e-6)
    assert out.logprobs[1] is None


def test_logprobs_zero_gives_the_sampled_token_only_and_ranks_count_strictly_better():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]] * 2)
    out = Sampler(seed=0, device=CPU)(logits, [request(top_k=1, logprobs=0),
                                               request(top_p=0.01, logprobs=1)])
    lp = out.logprobs[0]
    # top_k=1 keeps both tied logits; whichever is drawn, nothing is strictly more likely.
    assert lp.token_id in (1, 2) and lp.rank == 1 and lp.top == ()
    assert lp.logprob == pytest.approx(logits.log_softmax(-1)[0, 1].item(), abs=1e-6)
    assert len(out.logprobs[1].top) == 1


# ------------------------------------------------------------------------------ random sampling


def frequencies(tokens: list[int], vocab_size: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab_size)
    return (counts / len(tokens)).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sets_the_sampling_frequencies(temperature):
    base = torch.tensor([0.0, 1.0, 2.0, 0.5])
    n = 20_000
    tokens = draw(Sampler(seed=1, device=CPU), base.repeat(n, 1),
                  [request(temperature=temperature)] * n)
    expected = (base / temperature).softmax(-1).tolist()
    assert frequencies(tokens, 4) == pytest.approx(expected, abs=0.015)


def test_filters_leave_only_their_tokens_reachable():
    n = 2_000
    logits = log_probs(PROBS).repeat(n, 1)
    filters = [dict(top_k=2), dict(top_p=0.55), dict(min_p=0.35), dict(top_k=3, top_p=0.6)]
    for params in filters:
        seeded = [request(position=i, seed=7, **params) for i in range(n // 2)]
        unseeded = [request(**params)] * (n // 2)
        tokens = draw(Sampler(seed=2, device=CPU), logits, seeded + unseeded)
        assert set(tokens) == {1, 3}, params


def test_filtered_sampling_renormalises_over_the_kept_tokens():
    n = 20_000
    logits = log_probs(PROBS).repeat(n, 1)
    tokens = draw(Sampler(seed=3, device=CPU), logits, [request(top_k=2)] * n)
    assert frequencies(tokens, 4) == pytest.approx([0, 0.5 / 0.8, 0, 0.3 / 0.8], abs=0.015)


# ----------------------------------------------------------------------------------- seeding


VOCAB = 1000


def flat_logits(rows: int) -> torch.Tensor:
    return torch.zeros(rows, VOCAB)


def test_seeded_draw_is_independent_of_batch_composition_and_order():
    target = request(position=5, seed=42)
    alone = draw(Sampler(seed=0, device=CPU), flat_logits(1), [target])
    others = [request(), request(position=5, seed=43), request(temperature=0.0),
              request(position=2, seed=42, top_k=10), request(top_p=0.5)]
    for sampler_seed, batch in [(1, others[:2] + [target] + others[2:]),
                                (2, [target] + others[::-1]),
                                (None, others[3:] + [target])]:
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(9))
        logits[batch.index(target)] = 0.0
        assert draw(Sampler(seed=sampler_seed, device=CPU), logits, batch)[batch.index(target)] \
            == alone[0]


def test_seeded_draw_is_stable_across_steps_of_the_same_sampler():
    sampler = Sampler(seed=0, device=CPU)
    first = draw(sampler, flat_logits(1), [request(position=3, seed=11)])
    draw(sampler, flat_logits(2), [request(), request(position=3, seed=12)])
    assert draw(sampler, flat_logits(1), [request(position=3, seed=11)]) == first


def test_different_seeds_or_positions_draw_different_tokens():
    sampler = Sampler(seed=0, device=CPU)
    by_seed = draw(sampler, flat_logits(20), [request(position=4, seed=s) for s in range(20)])
    by_position = draw(sampler, flat_logits(20), [request(position=p, seed=4) for p in range(20)])
    assert len(set(by_seed)) > 15
    assert len(set(by_position)) > 15


def test_row_seed_separates_nearby_pairs():
    seeds = {row_seed(s, p) for s in range(-3, 30) for p in range(30)}
    assert len(seeds) == 33 * 30
    assert all(0 <= s < 2**64 for s in seeds)


def test_row_seeds_is_row_seed_bit_for_bit():
    rng = random.Random(0)
    edges = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**63, -12345, 2**64 + 7, -(2**70) - 3]
    seeds = edges * 4 + [rng.getrandbits(64) for _ in range(500)] + [-rng.getrandbits(70)] * 50
    positions = ([0] * 10 + [1] * 10 + [2**62] * 10 + [2**63 - 1] * 10
                 + [rng.randrange(2**40) for _ in range(550)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warnings either
        vectorized = row_seeds(np.array([s & (2**64 - 1) for s in seeds], np.uint64),
                               np.array(positions, np.int64))
        one = row_seeds(np.uint64(2**64 - 1), 2**63 - 1)  # a scalar pair
    assert vectorized.dtype == np.uint64
    assert vectorized.tolist() == [row_seed(s, p) for s, p in zip(seeds, positions)]
    assert int(one) == row_seed(-1, 2**63 - 1)
    # As int64, the keys of the Triton path: the same 64 bits.
    assert vectorized.view(np.int64).tolist() == [
        k - 2**64 if k >= 2**63 else k for k in vectorized.tolist()]


def test_unseeded_draws_repeat_for_a_fixed_sampler_seed():
    requests = [request()] * 20

    def two_steps(seed: int) -> list[int]:
        sampler = Sampler(seed=seed, device=CPU)
        return draw(sampler, flat_logits(20), requests) + draw(sampler, flat_logits(20), requests)

    assert two_steps(5) == two_steps(5)
    assert two_steps(5) != two_steps(6)
    steps = two_steps(5)
    assert steps[:20] != steps[20:]  # the generator advances between steps


def test_banned_tokens_are_never_drawn_but_keep_their_logprobs():
    logits = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    sampler = Sampler(seed=0, device="cpu")
    requests = [SampleRequest(SamplingParams(temperature=0, logprobs=1), 5, banned_token_ids=(0,)),
                SampleRequest(SamplingParams(temperature=0), 5)]
    out = sampler(logits, requests)
    assert out.token_ids == [1, 0]
    assert out.logprobs[0].top[0][0] == 0  # logprobs describe the model, not the ban
    hot = [SampleRequest(SamplingParams(temperature=5.0), 5, banned_token_ids=(0, 2))] * 2
    assert set(sampler(logits, hot).token_ids) == {1}


# ------------------------------------------------------------------------- columnar input


def mixed_requests(vocab_size: int) -> list[SampleRequest]:
    """One row of every kind: greedy, temperature only, filters, seeded, penalties, banned
    tokens, logprobs, and mixtures of them."""
    def seen(n: int) -> list[int]:
        return [(7 * i + n) % vocab_size for i in range(n)]

    kinds = [
        dict(temperature=0.0), dict(temperature=1e-6, logprobs=2), dict(), dict(temperature=0.7),
        dict(top_k=5), dict(top_k=-1, top_p=0.8), dict(top_p=0.5, temperature=1.3),
        dict(min_p=0.1), dict(top_k=20, top_p=0.9, min_p=0.05, temperature=0.8),
        dict(seed=42), dict(seed=-1, top_k=10), dict(seed=2**64 + 5, temperature=0.0),
        dict(seed=0, logprobs=3, top_p=0.9),
        dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.3, seed=7),
        dict(temperature=0.0, presence_penalty=1.0, logprobs=1),
        dict(logprobs=0), dict(temperature=0.0, logprobs=4, top_k=3),
    ]
    requests = [SampleRequest(SamplingParams(**kind), 3 + 11 * i, seen(i), seen(i + 2))
                for i, kind in enumerate(kinds)]
    requests += [SampleRequest(SamplingParams(temperature=0.0), 9, banned_token_ids=(0, 5)),
                 SampleRequest(SamplingParams(top_k=4, seed=3), 9, banned_token_ids=(1,)),
                 SampleRequest(SamplingParams(temperature=2.0, frequency_penalty=1.0), 4, [], [2],
                               banned_token_ids=(3, 4))]
    shaping = [dict(logit_bias={3: 5.0, 7: -2.0}),
               dict(temperature=0.0, allowed_token_ids=[2, 9, 11], logprobs=2),
               dict(allowed_token_ids=[1, 4], logit_bias={4: 1.5}, seed=5, repetition_penalty=1.2)]
    requests += [SampleRequest(SamplingParams(**kind), 5 + i, seen(i), seen(i + 1))
                 for i, kind in enumerate(shaping)]
    return requests


def test_allowed_tokens_and_logit_bias_shape_the_logits_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    allowed = keep_allowed(logits, [(0, (0, 1)), (2, (3,))])
    assert allowed[0].tolist() == [0.0, 1.0, -math.inf, -math.inf]
    assert allowed[1].tolist() == logits[1].tolist()  # rows not listed are untouched
    assert allowed[2].tolist() == [-math.inf, -math.inf, -math.inf, 1.0]
    biased = add_logit_bias(logits, [(1, ((3, 10.0), (0, -1.5))), (2, ((2, 0.5),))])
    assert biased.tolist() == [[0.0, 1.0, 2.0, 3.0], [1.5, 2.0, 1.0, 10.0], [1.0, 1.0, 1.5, 1.0]]
    assert keep_allowed(logits, []) is logits and add_logit_bias(logits, []) is logits
    assert logits[0].tolist() == [0.0, 1.0, 2.0, 3.0]  # the input is not changed


def test_greedy_rows_follow_the_allowed_tokens_and_the_bias():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    rows = [request(temperature=0.0, allowed_token_ids=[0, 1]),
            request(temperature=0.0, logit_bias={0: 100.0}),
            request(temperature=0.0, logit_bias={3: -100.0}, allowed_token_ids=[1, 3])]
    assert Sampler(seed=0, device=CPU)(logits, rows).token_ids == [1, 0, 1]


def test_random_rows_never_sample_outside_the_allowed_tokens():
    logits = torch.zeros(64, 30)
    rows = [request(temperature=1.5, top_p=0.95, allowed_token_ids=[4, 17, 29])] * 64
    tokens = Sampler(seed=3, device=CPU)(logits, rows).token_ids
    assert set(tokens) <= {4, 17, 29} and len(set(tokens)) > 1


def engine_style(rows: SamplingRows, requests: list[SampleRequest]) -> SamplingRows:
    """``rows`` as an engine may build them: raw temperatures (not 0 for greedy rows) and
    read-only strided views for columns."""
    columns = {f.name: getattr(rows, f.name) for f in dataclasses.fields(rows)
               if f.name not in ("histories", "banned", "allowed", "biases")}
    columns["temperature"] = np.array([r.params.temperature for r in requests], np.float32)
    views = {}
    for name, column in columns.items():
        views[name] = np.stack([column, column], axis=1)[:, 0]  # every other element of a table
        views[name].flags.writeable = False
    return SamplingRows(**views, histories=rows.histories, banned=rows.banned,
                        allowed=rows.allowed, biases=rows.biases)


def test_sampling_rows_from_requests_fills_each_column():
    requests = [request(temperature=1e-6, top_k=-1, seed=-1, logprobs=2),
                request(position=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, seed=2**64),
                SampleRequest(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.5,
                                             repetition_penalty=1.5), 9, [1, 2], [3],
                              banned_token_ids=(4, 5))]
    rows = SamplingRows.from_requests(requests)
    assert len(rows) == 3
    assert rows.temperature.tolist() == [0.0, 0.5, 1.0]  # greedy rows: 0
    assert rows.temperature.dtype == rows.top_p.dtype == rows.min_p.dtype == np.float32
    assert rows.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert rows.top_k.tolist() == [0, 3, 0] and rows.top_k.dtype == np.int64
    assert rows.min_p.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert rows.seeded.tolist() == [True, True, False]
    assert rows.seed.tolist() == [2**64 - 1, 0, 0] and rows.seed.dtype == np.uint64
    assert rows.position.tolist() == [0, 7, 9]
    assert rows.logprobs.tolist() == [2, -1, -1]
    assert rows.presence_penalty.tolist() == [0.0, 0.0, 0.5]
    assert rows.frequency_penalty.tolist() == [0.0, 0.0, -0.5]
    assert rows.repetition_penalty.tolist() == [1.0, 1.0, 1.5]
    assert rows.histories == ((2, [1, 2], [3]),)
    assert rows.banned == ((2, (4, 5)),)
    assert rows.greedy().tolist() == [True, False, False]
    assert rows.unfiltered().tolist() == [True, False, True]
    assert rows.special().tolist() == [False, False, True]


def test_greedy_rows_are_those_of_greedy_params_despite_float32_rounding():
    temperatures = [0.0, 1e-6, 9.99999999e-6, 1e-5, 1.00000001e-5, 0.5]
    rows = SamplingRows.from_requests([request(temperature=t) for t in temperatures])
    assert rows.greedy().tolist() == [True, True, True, False, False, False]


def test_sampling_rows_select_renumbers_histories_and_banned():
    rows = SamplingRows.from_requests(mixed_requests(50))
    picked = rows.select(np.array([3, 13, 14, 19, 20]))
    assert picked.position.tolist() == rows.position[[3, 13, 14, 19, 20]].tolist()
    assert [row for row, _, _ in picked.histories] == [1, 2, 4]
    assert picked.histories[0][1:] == rows.histories[0][1:]
    assert picked.banned == ((3, (1,)), (4, (3, 4)))
    shaped = rows.select(np.array([0, 22, 23]))
    assert shaped.allowed == ((1, (2, 9, 11)), (2, (1, 4)))
    assert shaped.biases == ((2, ((4, 1.5),)),)


def test_sampling_rows_refuse_penalties_without_token_lists():
    rows = SamplingRows.from_requests([request(), request(temperature=0.0)])
    with pytest.raises(ValueError, match=r"rows \[1\] have penalties"):
        dataclasses.replace(rows, repetition_penalty=np.array([1.0, 1.2], np.float32))


@pytest.mark.filterwarnings("error")  # read-only columns included
@pytest.mark.parametrize("sampler_seed", [0, 1, 2])
@pytest.mark.parametrize("kinds", ["mixed", "random only"])  # random only: whole columns used
def test_sampling_rows_give_what_the_request_list_gives(sampler_seed, kinds):
    vocab_size = 50
    requests = mixed_requests(vocab_size)
    if kinds == "random only":
        requests = [r for r in requests if not r.params.greedy]
    rows = SamplingRows.from_requests(requests)
    by_requests, by_rows, by_views = (Sampler(seed=sampler_seed, device=CPU) for _ in range(3))
    for step in range(3):  # the unseeded rows' generator advances alike
        logits = torch.randn(len(requests), vocab_size,
                             generator=torch.Generator().manual_seed(step)) * 2
        expected = by_requests(logits, requests)
        waited = by_rows.sample(logits, rows).wait()
        assert waited.token_ids.tolist() == expected.token_ids
        assert (waited.logprobs or [None] * len(requests)) == expected.logprobs
        assert by_views(logits, engine_style(rows, requests)) == expected
        assert [lp is not None for lp in expected.logprobs] == [
            r.params.logprobs is not None for r in requests]


def test_greedy_and_empty_batches_of_rows():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.5]])
    rows = SamplingRows.from_requests([request(temperature=0.0), request(temperature=1e-6)])
    assert Sampler(seed=0, device=CPU)(logits, rows) == Sampler(seed=0, device=CPU)(
        logits, [request(temperature=0.0)] * 2)
    empty = SamplingRows.from_requests([])
    assert Sampler(seed=0, device=CPU)(torch.zeros(0, 4), empty).token_ids == []
