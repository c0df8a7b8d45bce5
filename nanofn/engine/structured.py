"""Structured output in the shell: one llguidance matcher per output sequence.

The core knows nothing of grammars: it only never schedules a constrained sequence with its
last token pending (``SamplingParams.waits_for_token``), so that when a plan samples for it,
every token it sampled before has reached the host and advanced its matcher. Per step:

- ``accept`` advances a sequence's matcher by the token just delivered (the engine's
  delivery hook) and says whether the grammar has ended there;
- ``bitmask`` (the ``EngineLoop``'s ``token_masks``, called before each launch) asks each
  constrained sampling row's matcher which tokens may come next, as one int32 bitmask for
  those rows (``TokenBitmask``), which the runner copies to the device once and applies to
  the logits before any other sampling step.

A grammar ends when its matcher has taken an end-of-sequence token; the sequence then finishes
with reason ``stop`` even with ``ignore_eos`` (its text is complete: what follows could only be
more end tokens). A matcher that fails (a token it did not allow, which the mask should make
impossible) finishes its sequence too, with a warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from nanofn.state import BatchPlan, InvalidRequest
from nanofn.state.params import StructuredOutputsParams
from nanofn.state.plan import TokenBitmask

log = logging.getLogger("nanofn")

# Any JSON object, for ``json_object=True`` (and the server's ``{"type": "json_object"}``).
ANY_JSON_OBJECT = {"type": "object"}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as error:
        raise InvalidRequest("structured output needs llguidance: pip install "
                             "'nanofn[structured]'") from error
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked: the matcher does that)."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else ANY_JSON_OBJECT
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(list(params.choice)))
    return llg.grammar_from("grammar", params.grammar)


class Grammars:
    """The live matchers by sequence id, and the tokenizer view llguidance compiles against
    (built on first use: about a second for a large vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_list = list(eos_token_ids)
        self._tokenizer: Any = None
        self._executor: Any = None
        self.matchers: dict[str, Any] = {}

    def compile(self, request_id: str, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for the constraint; ``InvalidRequest`` naming the request and the
        problem if it does not compile."""
        llg = _llguidance()
        if self._tokenizer is None:
            self._tokenizer = llg.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                    eos_token=self._eos_list)
            self._executor = llg.LLExecutor()
        try:
            text = grammar_text(params)
        except ValueError as error:
            raise _invalid(request_id, params, str(error)) from None
        matcher = llg.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise _invalid(request_id, params, matcher.get_error())
        return matcher

    def matchers_for(self, request_id: str, params: StructuredOutputsParams,
                     count: int) -> list[Any]:
        """``count`` matchers of one constraint (one per output sequence), compiled once."""
        first = self.compile(request_id, params)
        return [first] + [first.deep_copy() for _ in range(count - 1)]

    def add(self, seq_id: str, matcher: Any) -> None:
        self.matchers[seq_id] = matcher

    def remove(self, seq_id: str) -> None:
        self.matchers.pop(seq_id, None)

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance the sequence's matcher (if it has one) by ``token``; whether its output
        ends there (the grammar took an end token, or the matcher failed)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        if matcher.is_stopped() and token in self.eos_token_ids:
            return True  # complete (only an end token fits), or padded up to min_tokens
        if not matcher.consume_token(token):
            log.warning("sequence %s: token %d does not fit its grammar (%s); finishing it",
                        seq_id, token, matcher.get_error())
            return True
        return token in self.eos_token_ids and matcher.is_stopped()

    def bitmask(self, plan: BatchPlan) -> TokenBitmask | None:
        """The allowed tokens of the plan's constrained sampling rows, or None if it has none."""
        if not self.matchers:
            return None
        found = [(row, matcher) for row, seq_id in enumerate(plan.sampling_seq_ids)
                 if (matcher := self.matchers.get(seq_id)) is not None]
        if not found:
            return None
        import llguidance.numpy
        bits = np.zeros((len(found), (self.vocab_size + 31) // 32), np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(matcher, k) for k, (_, matcher) in enumerate(found)], bits)
        return TokenBitmask(np.array([row for row, _ in found], np.int64), bits)


def _invalid(request_id: str, params: StructuredOutputsParams, error: str) -> InvalidRequest:
    return InvalidRequest(f"structured_outputs of request {request_id!r}: invalid {params.kind}: "
                          f"{error}")
