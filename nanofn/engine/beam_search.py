"""Beam search on top of the engine: every round asks for one token and the top logprobs of
each live beam; the prefix cache keeps the shared prefixes of the beams from being recomputed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanofn.engine.outputs import RequestOutput
from nanofn.state import SamplingParams
from nanofn.state.params import MAX_LOGPROBS
from nanofn.state.policy import stops_on


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # the score is cumulative logprob / length ** length_penalty
    # Each step's sampling temperature, as vLLM's; beams are ranked by the model's raw logprobs,
    # which it does not change.
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if (not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool)
                or not 1 <= 2 * self.beam_width <= MAX_LOGPROBS):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], "
                             f"got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")


@dataclass(frozen=True)
class BeamSearchSequence:
    token_ids: tuple[int, ...]  # generated tokens
    cumulative_logprob: float
    finish_reason: str  # "stop" (end of sequence) or "length"
    text: str = ""

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's beam score: the length counts the prompt and leaves out a final EOS."""
        length = prompt_len + len(self.token_ids) - (self.finish_reason == "stop")
        return self.cumulative_logprob / max(length, 1) ** length_penalty


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


Complete = Callable[[list[dict], list[SamplingParams]], list[RequestOutput]]


def beam_search(complete: Complete, prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                eos_token_ids: tuple[int, ...], max_model_len: int,
                decode: Callable[[Sequence[int]], str]) -> list[BeamSearchOutput]:
    """``complete`` runs a batch of token-id prompts through the engine (one token each)."""
    step_params = SamplingParams(temperature=params.temperature, max_tokens=1, ignore_eos=True,
                                 logprobs=2 * params.beam_width)
    stop_params = SamplingParams(ignore_eos=params.ignore_eos)  # what ends a beam
    live = [[BeamSearchSequence((), 0.0, "length")] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        asks = []
        for i, beams in enumerate(live):
            for beam in beams:
                if len(prompts[i]) + len(beam.token_ids) < max_model_len:
                    asks.append((i, beam))
                else:  # no room for another token: the beam is complete
                    done[i].append(beam)
        live = [[] for _ in prompts]
        if not asks:
            break
        outputs = complete([{"prompt_token_ids": list(prompts[i]) + list(beam.token_ids)}
                            for i, beam in asks], [step_params] * len(asks))
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(asks, outputs):
            (top,) = out.outputs[0].logprobs
            for token, lp in top.items():
                candidates[i].append(BeamSearchSequence(
                    beam.token_ids + (token,), beam.cumulative_logprob + lp.logprob, "length"))
        for i, found in enumerate(candidates):
            best = sorted(found, key=lambda b: b.cumulative_logprob, reverse=True)
            for beam in best[:params.beam_width]:
                if stops_on(beam.token_ids[-1], stop_params, eos_token_ids):
                    done[i].append(BeamSearchSequence(beam.token_ids, beam.cumulative_logprob, "stop"))
                else:
                    live[i].append(beam)
    results = []
    for i, prompt in enumerate(prompts):
        ranked = sorted(done[i] + live[i], reverse=True,
                        key=lambda b: b.score(len(prompt), params.length_penalty))
        results.append(BeamSearchOutput([
            BeamSearchSequence(b.token_ids, b.cumulative_logprob, b.finish_reason, decode(b.token_ids))
            for b in ranked[:params.beam_width]]))
    return results
