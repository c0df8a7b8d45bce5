"""Sampling parameters: what a user asks of one request, validated once, never changed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (argmax), as in vLLM
MAX_LOGPROBS = 20
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's output, with vLLM's field names and defaults.

    Invalid values raise ``ValueError`` naming the field and the allowed range.
    ``stop``, ``stop_token_ids``, ``allowed_token_ids`` and ``bad_words`` are stored as tuples,
    ``logit_bias`` as ``(token id, bias)`` pairs in token order (so the record stays hashable
    and JSON keeps its ids); ``top_k`` of -1 or 0 means no limit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's further fields (issue 12), appended so that older traces still load.
    prompt_logprobs: int | None = None  # per prompt position: its token's logprob + the top k
    logit_bias: tuple[tuple[int, float], ...] | None = None  # {token id: bias} given, pairs kept
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these
    bad_words: tuple[str, ...] = ()  # words whose token sequences may not be completed
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max_model_len)
    detokenize: bool = True  # False: token ids only, no text
    spaces_between_special_tokens: bool = True  # decode option of slow tokenizers only
    # The token sequences of ``bad_words`` (the engine fills it in from the tokenizer, as
    # vLLM's ``update_from_tokenizer``); recorded in traces so that replays ban the same tokens.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop_token_ids = self.stop_token_ids or ()
        if not isinstance(stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_token_ids))
        _normalize_vllm_extras(self)
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               _structured_from_dict(self.structured_outputs))
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """Whether choosing the next token needs the sequence's tokens so far (penalties count
        them, bad words match their end)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    @property
    def waits_for_token(self) -> bool:
        """Whether sampling needs the previous token on the host (its history, or a grammar's
        mask that depends on it), so the sequence is never scheduled with it pending."""
        return self.needs_history or self.structured_outputs is not None

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before it draws (a logit bias
        or a set of allowed tokens): such a row is never sampled inside a CUDA graph."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists, ``logit_bias`` a list of pairs, since JSON
        keys are strings); ``from_dict`` inverts it."""
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        for name in ("logit_bias", "allowed_token_ids", "bad_words_token_ids"):
            value = getattr(self, name)
            d[name] = None if value is None else [list(v) if isinstance(v, tuple) else v
                                                  for v in value]
        d["bad_words"] = list(self.bad_words)
        if self.structured_outputs is None:
            del d["structured_outputs"]  # traces without it read as before
        else:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)


def _normalize_vllm_extras(p: SamplingParams) -> None:
    """Store the list- and dict-valued vLLM fields as tuples (the record stays hashable):
    ``logit_bias`` as ``(token id, bias)`` pairs in token order; a dict with string keys (JSON)
    is read too. Values of the wrong kind are left for ``_problems`` to name."""
    bias = p.logit_bias
    if isinstance(bias, dict):
        try:
            bias = tuple(sorted((int(k) if isinstance(k, str) else k, v) for k, v in bias.items()))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {p.logit_bias!r}") \
                from None
    elif isinstance(bias, (list, tuple)):
        bias = tuple(tuple(pair) if isinstance(pair, (list, tuple)) else pair for pair in bias)
    object.__setattr__(p, "logit_bias", bias)
    if isinstance(p.allowed_token_ids, list):
        object.__setattr__(p, "allowed_token_ids", tuple(p.allowed_token_ids))
    bad_words = (p.bad_words,) if isinstance(p.bad_words, str) else p.bad_words
    if isinstance(bad_words, list):
        bad_words = tuple(bad_words)
    object.__setattr__(p, "bad_words", () if bad_words is None else bad_words)
    if isinstance(p.bad_words_token_ids, (list, tuple)):
        object.__setattr__(p, "bad_words_token_ids", tuple(
            tuple(ids) if isinstance(ids, (list, tuple)) else ids for ids in p.bad_words_token_ids))


def _is_token_id(x: object) -> bool:
    return _is_int(x) and x >= 0


def _extra_problems(p: SamplingParams):
    """Yield one message per invalid vLLM extra field."""
    if p.prompt_logprobs is not None and (not _is_int(p.prompt_logprobs)
                                          or not 0 <= p.prompt_logprobs <= MAX_LOGPROBS):
        yield (f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got "
               f"{p.prompt_logprobs!r}")
    bias = p.logit_bias
    if bias is not None and not (isinstance(bias, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_token_id(pair[0])
            and _is_number(pair[1]) and -_INF < pair[1] < _INF for pair in bias)):
        yield f"logit_bias must map token ids (integers >= 0) to finite numbers, got {bias!r}"
    allowed = p.allowed_token_ids
    if allowed is not None and (not isinstance(allowed, tuple) or not allowed
                                or not all(_is_token_id(t) for t in allowed)):
        yield (f"allowed_token_ids must be a non-empty list of token ids (integers >= 0) or "
               f"None, got {allowed!r}")
    if not isinstance(p.bad_words, tuple) or not all(isinstance(w, str) and w.strip()
                                                      for w in p.bad_words):
        yield f"bad_words must be a list of non-blank strings, got {p.bad_words!r}"
    if not all(isinstance(ids, tuple) and ids and all(_is_token_id(t) for t in ids)
               for ids in p.bad_words_token_ids):
        yield (f"bad_words_token_ids must be a list of non-empty token id lists, got "
               f"{p.bad_words_token_ids!r}")
    if p.detokenize is False and p.stop:
        yield "stop strings need detokenize=True (give stop_token_ids instead)"
    k = p.truncate_prompt_tokens
    if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
        yield f"truncate_prompt_tokens must be -1, an integer >= 1 or None, got {k!r}"
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the output, with vLLM's names: exactly one of ``json`` (a JSON schema, as
    a dict or a string), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (Lark, or GBNF as llama.cpp writes it) or ``json_object=True`` (any JSON
    object). ``disable_any_whitespace``: JSON without whitespace between its tokens (otherwise
    any amount is allowed there, as in vLLM). The engine compiles the constraint with
    llguidance (``pip install nanofn[structured]``); a schema or pattern that does not compile
    is an error when the request is added."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}"
                             f", got {', '.join(kinds) if kinds else 'none'}")
        for problem in _structured_problems(self):
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """The constraint that is set (and the options that are not their defaults), JSON-ready;
        ``StructuredOutputsParams(**d)`` inverts it."""
        value = getattr(self, self.kind)
        d: dict[str, Any] = {self.kind: list(value) if self.kind == "choice" else value}
        if self.disable_any_whitespace:
            d["disable_any_whitespace"] = True
        return d


def _structured_from_dict(d: dict[str, Any]) -> StructuredOutputsParams:
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s): {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")
    return StructuredOutputsParams(**d)


def _structured_problems(s: StructuredOutputsParams):
    if s.json is not None and not isinstance(s.json, (str, dict)):
        yield f"structured_outputs.json must be a JSON schema (a dict or a string), got {s.json!r}"
    for name in ("regex", "grammar"):
        value = getattr(s, name)
        if value is not None and not (isinstance(value, str) and value):
            yield f"structured_outputs.{name} must be a non-empty string, got {value!r}"
    if s.choice is not None and not (isinstance(s.choice, tuple) and s.choice
                                     and all(isinstance(c, str) and c for c in s.choice)):
        yield f"structured_outputs.choice must be a non-empty list of non-empty strings, got " \
              f"{s.choice!r}"
    for name in ("json_object", "disable_any_whitespace"):
        if not isinstance(getattr(s, name), (bool, type(None))):
            yield f"structured_outputs.{name} must be a bool, got {getattr(s, name)!r}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _problems(p: SamplingParams):
    """Yield one message per invalid field (the first one is raised)."""
    if not _is_int(p.n) or p.n < 1:
        yield f"n must be an integer >= 1, got {p.n!r}"
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not _is_number(getattr(p, name)):
            yield f"{name} must be a number, got {getattr(p, name)!r}"
    if not p.temperature >= 0:  # (NaN fails too)
        yield f"temperature must be >= 0, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        yield f"top_p must be in (0, 1], got {p.top_p}"
    if not _is_int(p.top_k) or p.top_k < -1:
        yield f"top_k must be -1 or 0 (no limit) or an integer >= 1, got {p.top_k!r}"
    if not 0 <= p.min_p <= 1:
        yield f"min_p must be in [0, 1], got {p.min_p}"
    if p.seed is not None and not _is_int(p.seed):
        yield f"seed must be an integer or None, got {p.seed!r}"
    if p.max_tokens is not None and (not _is_int(p.max_tokens) or p.max_tokens < 1):
        yield f"max_tokens must be an integer >= 1 or None, got {p.max_tokens!r}"
    if not _is_int(p.min_tokens) or p.min_tokens < 0:
        yield f"min_tokens must be an integer >= 0, got {p.min_tokens!r}"
    elif p.max_tokens is not None and _is_int(p.max_tokens) and p.min_tokens > p.max_tokens:
        yield f"min_tokens must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}"
    if not all(isinstance(s, str) and s for s in p.stop):
        yield f"stop must be a string or a list of non-empty strings, got {p.stop!r}"
    if not all(_is_int(t) and t >= 0 for t in p.stop_token_ids):
        yield f"stop_token_ids must be non-negative integers, got {p.stop_token_ids!r}"
    if not -2 <= p.presence_penalty <= 2:
        yield f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"
    if not -2 <= p.frequency_penalty <= 2:
        yield f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"
    if not p.repetition_penalty > 0:
        yield f"repetition_penalty must be > 0, got {p.repetition_penalty}"
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
        yield f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {p.logprobs!r}"
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                 "spaces_between_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            yield f"{name} must be a bool, got {getattr(p, name)!r}"
    yield from _extra_problems(p)
    if p.structured_outputs is not None and not isinstance(p.structured_outputs,
                                                           StructuredOutputsParams):
        yield (f"structured_outputs must be StructuredOutputsParams (or a dict of its fields), "
               f"got {type(p.structured_outputs).__name__}")
