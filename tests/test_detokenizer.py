"""Incremental detokenization: special tokens, stop strings held back and cut, min_tokens."""

from __future__ import annotations

import random
from unittest import mock

import pytest
from transformers import AutoTokenizer

from nanofn.engine.detokenizer import Detokenizer, decode_output
from nanofn.state import SamplingParams
from nanofn.state.policy import may_stop


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def feed(tokenizer, text: str, params: SamplingParams, extra_ids=()) -> Detokenizer:
    detok = Detokenizer(tokenizer, tokenizer.encode("Once upon"), params)
    for n, token in enumerate(tokenizer.encode(text) + list(extra_ids), start=1):
        if detok.add(token, may_stop(n, params.min_tokens)):
            break
    return detok


def test_text_arrives_whole_and_special_tokens_are_skipped_unless_asked(tokenizer):
    text = " a time there was a little engine"
    eos = tokenizer.eos_token_id
    assert feed(tokenizer, text, SamplingParams(), [eos]).text == text
    shown = feed(tokenizer, text, SamplingParams(skip_special_tokens=False), [eos]).text
    assert shown == text + tokenizer.eos_token


def test_a_stop_string_is_held_back_then_cut(tokenizer):
    params = SamplingParams(stop=["little engine"])
    detok = Detokenizer(tokenizer, tokenizer.encode("Once upon"), params)
    seen = []
    for n, token in enumerate(tokenizer.encode(" a time there was a little engine that"), 1):
        stopped = detok.add(token, may_stop(n, params.min_tokens))
        seen.append(detok.visible_text(finished=False))
        if stopped:
            break
    assert stopped and detok.text == " a time there was a "
    assert not any("little" in v for v in seen)  # never shown, even in part, before the cut
    kept = feed(tokenizer, " a time there was a little engine that",
                SamplingParams(stop=["little engine"], include_stop_str_in_output=True))
    assert kept.text == " a time there was a little engine"


def test_no_stop_string_before_min_tokens(tokenizer):
    """The detokenizer looks for stop strings only when the core's policy allows a stop."""
    text = " a time, a time"
    early = feed(tokenizer, text, SamplingParams(stop=["time"]))
    assert early.stopped and early.text == " a "
    late = feed(tokenizer, text, SamplingParams(stop=["time"], min_tokens=4))
    assert late.stopped and late.text == " a time, a "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoding_once_gives_what_token_by_token_decoding_gives(tokenizer, skip_special_tokens):
    """Sequences without stop strings are decoded once, when they finish: the text must be what
    the incremental decoder would have built, characters split across tokens and special
    tokens included."""
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    vocab = len(tokenizer)
    replays = []
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        # Ids past the tokenizer's vocabulary (a model's is often larger) decode to nothing;
        # a run of them after a broken character must not send the text to the replay.
        output += [vocab + rng.randrange(64) for _ in range(rng.choice([0, 0, 12, 30]))]
        incremental = Detokenizer(tokenizer, prompt, params)
        for token in output:
            incremental.add(token, may_stop=False)
        with mock.patch.object(Detokenizer, "add", side_effect=replays.append):
            assert decode_output(tokenizer, prompt, output, params) == incremental.text
    assert not replays  # byte-level: one decode, no token-by-token replay
