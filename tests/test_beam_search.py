"""Beam search over a fake engine whose next-token distribution is known exactly."""

from __future__ import annotations

import math

import pytest

from nanofn.engine.beam_search import BeamSearchParams, beam_search
from nanofn.engine.outputs import CompletionOutput, Logprob, RequestOutput

EOS = 0


def fake_complete(table):
    """An engine whose logprobs for the next token depend on the last token only."""
    def complete(batch, params):
        outputs = []
        for prompt in batch:
            ids = prompt["prompt_token_ids"]
            top = dict(sorted(table[ids[-1]].items(), key=lambda kv: -kv[1])[:params[0].logprobs])
            entry = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(top.items(), start=1)}
            outputs.append(RequestOutput("r", None, ids, [CompletionOutput(
                0, "", [next(iter(top))], None, [entry], "length")], True))
        return outputs
    return complete


LOG = math.log
# From any token: 1 (p=.5), 2 (p=.3), EOS (p=.2); after 2: EOS is likely (p=.9).
TABLE = {t: {1: LOG(.5), 2: LOG(.3), EOS: LOG(.2)} for t in (EOS, 1, 3, 4, 5)}
TABLE[2] = {EOS: LOG(.9), 1: LOG(.05), 2: LOG(.05)}


def run(prompts, params, max_model_len=100):
    return beam_search(fake_complete(TABLE), prompts, params, (EOS,), max_model_len,
                       lambda ids: " ".join(map(str, ids)))


def test_the_best_beams_by_cumulative_logprob_and_eos_ends_a_beam():
    (result,) = run([[3]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    best = result.sequences[0]
    assert best.token_ids == (2, EOS) and best.finish_reason == "stop"
    assert math.isclose(best.cumulative_logprob, LOG(.3) + LOG(.9))
    # EOS never made the top two at step 1; the runner-up keeps the likeliest tokens.
    assert result.sequences[1].token_ids == (1, 1, 1)
    (ignored,) = run([[3]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert all(len(b.token_ids) == 3 for b in ignored.sequences)


def test_a_prompt_that_runs_out_of_room_keeps_its_beams_while_others_go_on():
    results = run([[3] * 5, [4] * 8], BeamSearchParams(beam_width=2, max_tokens=4,
                                                        ignore_eos=True), max_model_len=10)
    assert [len(r.sequences) for r in results] == [2, 2]
    assert {len(b.token_ids) for b in results[0].sequences} == {4}
    assert {len(b.token_ids) for b in results[1].sequences} == {2}  # 8 + 2 = max_model_len
    assert results[1].sequences[0].text == "2 0"  # p = .3 * .9 beats .5 * .5


def test_length_penalty_favours_longer_beams():
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    (plain,) = run([[3]], params)
    (long,) = run([[3]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=3.0))
    assert len(long.sequences[0].token_ids) >= len(plain.sequences[0].token_ids)


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=True, max_tokens=2), "beam_width must be an integer"),
    (dict(beam_width=2, max_tokens=2, length_penalty="x"), "length_penalty must be a number"),
    (dict(beam_width=2, max_tokens=2, ignore_eos=1), "ignore_eos must be a bool"),
])
def test_bad_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)
