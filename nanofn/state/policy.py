"""When a sequence stops, and what it may not sample: the one definition of each boundary.

Every module that needs one of these decisions (the scheduler, the step, the shell's stop-string
check, beam search) calls these functions; none decides on its own. Counts of output tokens
include the newest token, the one whose fate is being decided.
"""

from __future__ import annotations

from nanofn.state.params import SamplingParams


def may_stop(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence whose newest token is its ``num_output_tokens``-th output token may
    stop on it (by a stop token, an end-of-sequence token or a stop string): only once it has
    more than ``min_tokens`` tokens."""
    return num_output_tokens > params.min_tokens


def stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids that end the sequence: its ``stop_token_ids`` and, unless it ignores them,
    the model's end-of-sequence ids."""
    return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + eos_token_ids


def stops_on(token: int, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether ``token`` is one that ends the sequence (``min_tokens`` aside)."""
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


def banned_token_ids(params: SamplingParams, num_output_tokens_before: int,
                     eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The token ids the next token may not be: the stopping ones while stopping is not allowed
    yet, so that ``min_tokens`` holds whatever the model prefers."""
    if may_stop(params, num_output_tokens_before + 1):
        return ()
    return stop_token_ids(params, eos_token_ids)


def at_length_limit(params: SamplingParams, num_output_tokens: int, num_tokens: int,
                    max_model_len: int) -> bool:
    """Whether a sequence of this many (output) tokens may have no more."""
    return ((params.max_tokens is not None and num_output_tokens >= params.max_tokens)
            or num_tokens >= max_model_len)
