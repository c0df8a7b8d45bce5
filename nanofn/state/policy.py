"""When a sequence stops, and what it may not sample: the one definition of each boundary.

Every module that needs one of these decisions (the step, the scheduler, the shell's stop-string
check, beam search) calls these functions; none decides on its own. The comparisons work on
plain integers and, element by element, on the columns of the running batch. Counts of output
tokens include the newest token, the one whose fate is being decided.
"""

from __future__ import annotations

import numpy as np

from nanofn.state.params import SamplingParams


def may_stop(num_output_tokens, min_tokens):
    """Whether a sequence whose newest token is its ``num_output_tokens``-th output token may
    stop on it (by a stop token, an end-of-sequence token or a stop string): only once it has
    more than ``min_tokens`` tokens."""
    return num_output_tokens > min_tokens


def may_stop_next(num_output_tokens_before, min_tokens):
    """Whether the token sampled after ``num_output_tokens_before`` output tokens may stop the
    sequence."""
    return may_stop(num_output_tokens_before + 1, min_tokens)


def finishing(ends, num_tokens, num_prompt_tokens, min_tokens, limit):
    """``(stops, finishes)``: whether a sequence of ``num_tokens`` tokens whose newest one
    ``ends`` it (a stop token, or its stop string) stops on it, and whether it finishes at all
    (stopping, or by length). Element by element over columns too."""
    stops = ends & may_stop(num_tokens - num_prompt_tokens, min_tokens)
    return stops, stops | at_length_limit(num_tokens, limit)


def length_limit(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The number of tokens (prompt and output) at which a sequence stops by length."""
    if params.max_tokens is None:
        return max_model_len
    return min(num_prompt_tokens + params.max_tokens, max_model_len)


def at_length_limit(num_tokens, limit):
    """Whether a sequence of ``num_tokens`` tokens may have no more (``limit`` from
    ``length_limit``)."""
    return num_tokens >= limit


def tokens_to_length_limit(num_tokens, limit):
    """How many tokens a sequence of ``num_tokens`` tokens takes before ``at_length_limit``
    holds: it holds after ``k`` more exactly when ``k >=`` this."""
    return limit - num_tokens


def stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end the sequence: its ``stop_token_ids`` and, unless it ignores them,
    the model's end-of-sequence ids."""
    return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + eos_token_ids


def stops_on(token: int, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether ``token`` is one that ends the sequence (``min_tokens`` aside)."""
    return bool(ends_on(np.int64(token), not params.ignore_eos, eos_token_ids,
                        params.stop_token_ids))


def ends_on(tokens: np.ndarray, watch_eos, eos_token_ids: tuple[int, ...],
            stop_token_ids: tuple[int, ...] = ()) -> np.ndarray:
    """Element by element: whether each token ends its sequence, being one of
    ``stop_token_ids`` or, where ``watch_eos`` (not ``ignore_eos``), an end-of-sequence id."""
    eos = _isin(tokens, eos_token_ids)
    if watch_eos is not True:
        eos &= np.asarray(watch_eos, bool)
    return _isin(tokens, stop_token_ids) | eos if stop_token_ids else eos


def _isin(values: np.ndarray, ids: tuple[int, ...]) -> np.ndarray:
    """``np.isin`` for a few ids, without its sort (a comparison per id)."""
    if not ids:
        return np.zeros(np.shape(values), bool)
    found = values == ids[0]
    for token in ids[1:]:
        found |= values == token
    return found


def banned_token_ids(params: SamplingParams, num_output_tokens_before: int,
                     eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids the next token may not be: the stopping ones while stopping is not allowed
    yet, so that ``min_tokens`` holds whatever the model prefers. None for a constrained
    output: its grammar decides where it may end (a ban could leave its mask no token); it
    still does not stop before ``min_tokens``."""
    if (may_stop_next(num_output_tokens_before, params.min_tokens)
            or params.structured_outputs is not None):
        return ()
    return stop_token_ids(params, eos_token_ids)


def bad_word_bans(bad_words_token_ids: tuple[tuple[int, ...], ...],
                  output_token_ids: list[int]) -> tuple[int, ...]:
    """The token ids that would complete a bad word now, as vLLM decides: a word's last token
    when the output so far ends with the rest of the word (always, for a one-token word)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            if word[-1] not in banned:
                banned.append(word[-1])
    return tuple(banned)
