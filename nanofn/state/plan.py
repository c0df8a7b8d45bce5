"""The batch plan, the plain picklable data a runner needs to execute one step, and the
runner's answer: the tokens it sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash
from pyrsistent import PVector

from nanofn.state.params import SamplingParams

PENDING_TOKEN = -1  # a token the previous plan sampled, not known to the scheduler yet


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute the KV of ``token_ids`` at positions
    ``start_pos, start_pos + 1, ...`` into the blocks of ``block_table``; if ``sample``, the
    last of them is the sequence's last token and the next token is sampled from its logits.

    The last of ``token_ids`` may be ``PENDING_TOKEN``: the token this sequence sampled in
    the previous plan, which the runner still holds and the scheduler has not seen yet.

    ``block_table`` is the sequence's persistent vector itself (no copy). ``history`` is all
    of the sequence's tokens, given only when sampling needs them (penalties); such a
    sequence is never scheduled with a pending token. ``banned_token_ids`` are the ids the
    sampled token may not be (the core's policy, e.g. ``min_tokens``): the runner applies it
    without reasoning about it."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: PVector
    sample: bool
    params: SamplingParams
    num_prompt_tokens: int
    history: PVector | None = None
    banned_token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """A single token past the prompt: a decode step (or, rarely, the last token a resumed
        sequence recomputes)."""
        return len(self.token_ids) == 1 and self.start_pos >= self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """What one step computes. ``released`` names the sequences that stopped running
    (finished, aborted or preempted) since the last plan that had work: a runner may drop what
    it keeps for them. Between two releases a sequence's block table only grows, so a runner
    may keep a copy and append."""

    step: int
    seqs: tuple[ScheduledSeq, ...]
    released: tuple[str, ...] = ()
    # Derived from ``seqs`` once, when the plan is made (several readers need them each step).
    sampling_seq_ids: tuple[str, ...] = field(init=False)
    num_tokens: int = field(init=False)
    num_decode_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        sampling, num_tokens, num_decode = [], 0, 0
        for s in self.seqs:
            if s.sample:
                sampling.append(s.seq_id)
            num_tokens += len(s.token_ids)
            num_decode += s.is_decode
        object.__setattr__(self, "sampling_seq_ids", tuple(sampling))
        object.__setattr__(self, "num_tokens", num_tokens)
        object.__setattr__(self, "num_decode_tokens", num_decode)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


def plan_digest(plan: BatchPlan) -> str:
    """A short fingerprint of everything in a plan that decides what the runner computes."""
    h = xxhash.xxh64()
    h.update(f"{plan.step}|{plan.released}|".encode())
    for s in plan.seqs:
        h.update(f"{s.seq_id}|{s.start_pos}|{int(s.sample)}|{s.token_ids}|{list(s.block_table)}|"
                 f"{s.banned_token_ids}|".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely under the raw distribution; ties share the better rank
    top: tuple[tuple[int, float], ...]  # params.logprobs most likely (token, logprob), best first


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """What a runner sampled for one plan: a token per sampling sequence, in plan order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None
