"""New sequences: validation and admission to the waiting queue."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pyrsistent import pvector

from nanofn.state.engine_state import EngineState
from nanofn.state.hashing import extend_block_hashes
from nanofn.state.params import SamplingParams
from nanofn.state.records import Seq, SeqSpec


class InvalidRequest(ValueError):
    """A request the engine cannot serve; the message names the problem."""


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A sequence to start: an event of ``step``."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


def check_new_seq(state: EngineState, new: NewSeq) -> None:
    """Raise ``InvalidRequest`` if ``new`` cannot be served; touch nothing."""
    c = state.config
    if not isinstance(new.seq_id, str) or not new.seq_id:
        raise InvalidRequest(f"request_id must be a non-empty string, got {new.seq_id!r}")
    if new.seq_id in state.live_ids:
        raise InvalidRequest(f"request_id {new.seq_id!r} is already in use")
    if any(new.seq_id in ids for ids in state.undelivered):
        raise InvalidRequest(f"request_id {new.seq_id!r} still has a sampled token in flight "
                             f"from an earlier request; it can be used again after a step")
    if not isinstance(new.params, SamplingParams):
        raise InvalidRequest(f"params must be SamplingParams, got {type(new.params).__name__}")
    if new.params.n != 1:
        raise InvalidRequest(
            f"request {new.seq_id!r}: n={new.params.n} reached the core; the engine "
            f"splits n > 1 into n sequences of n=1")
    prompt = new.prompt_token_ids
    if len(prompt) == 0:
        raise InvalidRequest(f"request {new.seq_id!r}: the prompt is empty")
    bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or t < 0
                or (c.vocab_size is not None and t >= c.vocab_size)), None)
    if bad is not None:
        vocab = f" [0, {c.vocab_size})" if c.vocab_size is not None else " >= 0"
        raise InvalidRequest(
            f"request {new.seq_id!r}: prompt token id {bad!r} is not an integer in{vocab}")
    too_big = [t for t in new.params.stop_token_ids if c.vocab_size is not None and t >= c.vocab_size]
    if too_big:
        raise InvalidRequest(f"request {new.seq_id!r}: stop_token_ids {too_big} are not in the "
                             f"vocabulary [0, {c.vocab_size})")
    max_tokens = new.params.max_tokens or 1
    if len(prompt) + max_tokens > c.max_model_len:
        raise InvalidRequest(
            f"request {new.seq_id!r}: prompt of {len(prompt)} tokens plus max_tokens "
            f"{max_tokens} is longer than max_model_len {c.max_model_len}")


def add_seqs(state: EngineState, new_seqs: tuple[NewSeq, ...]) -> EngineState:
    """Append valid sequences to the waiting queue (all or nothing: one invalid sequence
    raises and leaves the state as it was)."""
    if not new_seqs:
        return state
    waiting, live = state.waiting, state.live_ids
    for new in new_seqs:
        check_new_seq(replace(state, live_ids=live), new)
        seq = _new_seq(state, new)
        waiting, live = waiting.append(seq), live.add(new.seq_id)
    return replace(state, waiting=waiting, live_ids=live)


def _new_seq(state: EngineState, new: NewSeq) -> Seq:
    spec = SeqSpec(new.seq_id, tuple(new.prompt_token_ids), new.params, state.step)
    token_ids = pvector(spec.prompt_token_ids)
    c = state.config
    hashes = extend_block_hashes(pvector(), token_ids, c.block_size) \
        if c.enable_prefix_caching else pvector()
    return Seq(spec=spec, token_ids=token_ids, block_hashes=hashes, block_table=pvector())
