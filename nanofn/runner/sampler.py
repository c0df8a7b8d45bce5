"""Turn one row of logits per sequence into the next token, with vLLM v1's sampling semantics.

Per row, in order: penalties (repetition, frequency, presence), then temperature, min_p, top_k
and top_p, then a draw. Greedy rows take the argmax of the penalised logits. Logprobs come from
the raw distribution the model gave, before any of these steps.

The draw is the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token picks token
``i`` with probability ``probs[i]``, and needs no cumulative sum. A seeded row draws its ``q``
from a generator seeded by ``(seed, position)`` alone, so its tokens do not depend on the rest
of the batch; unseeded rows share the sampler's generator.

Everything per row is a tensor over the batch; Python loops run only over seeded rows and over
the token lists that penalties count. The single host synchronisation is the final copy of the
results.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanofn.state.params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SampleRequest:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    position: int  # absolute position of the token being sampled (= number of tokens before it)
    prompt_token_ids: Sequence[int] | None = None  # required when params.has_penalties
    output_token_ids: Sequence[int] | None = None  # likewise
    suppressed_token_ids: tuple[int, ...] = ()  # never sampled (stop tokens before min_tokens)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely under the raw distribution; ties share the better rank
    top: tuple[tuple[int, float], ...]  # params.logprobs most likely (token, logprob), best first


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


# ---------------------------------------------------------------- steps, each over a batch of rows


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: float32 ``[len(token_lists), vocab_size]``."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    flat_ids = array("q")  # the fastest way found from Python ints to a tensor
    for ids in token_lists:
        flat_ids.extend(ids)
    if not flat_ids:
        return counts
    lengths = torch.tensor([len(ids) for ids in token_lists])
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    flat_index = rows * vocab_size + torch.frombuffer(flat_ids, dtype=torch.int64)
    flat_index = _to_device(flat_index, torch.int64, device)
    counts.view(-1).index_add_(0, flat_index, torch.ones(flat_index.shape, device=device))
    return counts


def apply_penalties(logits: torch.Tensor, prompt_counts: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """Penalise tokens already seen; the penalty tensors hold one value per row.

    Repetition (HF semantics) applies to tokens of the prompt or the output: a positive logit is
    divided by the penalty, a negative one multiplied. Frequency and presence apply to output
    tokens only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    seen_in_output = output_counts > 0
    seen = seen_in_output | (prompt_counts > 0)
    repetition = repetition[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * seen_in_output


def suppress_tokens(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """``logits`` with each row's suppressed tokens at -inf (the same tensor if there are none)."""
    rows = [i for i, r in enumerate(requests) for _ in r.suppressed_token_ids]
    if not rows:
        return logits
    columns = [t for r in requests for t in r.suppressed_token_ids]
    logits = logits.clone()
    logits[rows, columns] = float("-inf")
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's highest probability.

    Compared in log space (``p_i / p_max = exp(l_i - l_max)``), which needs no softmax.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p[:, None].log()
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep the tokens whose logit is at least the row's k-th largest (ties with it stay).

    ``top_k`` is per row, 0 meaning no limit; ``max_top_k`` is its maximum, known on the host, so
    only that many logits per row are ranked rather than the whole vocabulary.
    """
    max_top_k = min(max_top_k, logits.shape[-1])
    largest = logits.topk(max_top_k, dim=-1).values
    kth = largest.gather(-1, (top_k.clamp(1, max_top_k) - 1)[:, None])
    kth = kth.masked_fill((top_k <= 0)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor,
                candidates: int | None = None) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``.

    A token stays when the mass of the tokens ranked above it is still below ``top_p``, so the
    most likely token always stays; tokens tied with the last one kept stay too. Rows with
    ``top_p >= 1`` are left alone (a float cumulative sum may not reach exactly 1).

    ``candidates``: when top_k has left at most that many tokens per row, only those are ranked
    (a top-k instead of a sort of the whole vocabulary).
    """
    if candidates is None:
        ranked = logits.sort(dim=-1, descending=True).values
    else:
        ranked = logits.topk(min(candidates, logits.shape[-1]), dim=-1).values
    probs = ranked.softmax(dim=-1)
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)
    threshold = ranked.gather(-1, kept - 1).masked_fill((top_p >= 1)[:, None], float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / noise)`` with ``noise ~ Exp(1)``.

    Noise is clamped away from 0 so that a filtered token (probability 0) never becomes 0/0 = NaN,
    which argmax would pick.
    """
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def row_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, position): nearby pairs get unrelated seeds."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# ---------------------------------------------------------------------------------- the sampler


class Sampler:
    """Samples one token per row of logits; see the module docstring for the semantics."""

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)  # unseeded rows
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(self.device)  # re-seeded for each seeded row

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> SampleOutput:
        """Sample from ``logits`` (float32 ``[len(requests), vocab]``), one token per request."""
        if all(_plain_greedy(r) for r in requests):
            return SampleOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        penalised = suppress_tokens(self._penalised(logits, requests), requests)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if len(random_rows) == len(requests):
            token_ids = self._sample(penalised, requests)
        else:
            token_ids = penalised.argmax(dim=-1)
            if random_rows:
                rows = self._rows(random_rows)
                token_ids[rows] = self._sample(penalised[rows], [requests[i] for i in random_rows])
        return self._output(logits, token_ids, requests)

    def _penalised(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """``logits`` with each row's penalties applied (the same tensor if no row has any)."""
        penalised_rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if not penalised_rows:
            return logits
        penalised_requests = [requests[i] for i in penalised_rows]
        params = [r.params for r in penalised_requests]
        vocab_size = logits.shape[-1]
        rows = self._rows(penalised_rows)
        prompts = [_seen_tokens(r, "prompt_token_ids") for r in penalised_requests]
        outputs = [_seen_tokens(r, "output_token_ids") for r in penalised_requests]
        penalised = apply_penalties(
            logits[rows],
            token_counts(prompts, vocab_size, self.device),
            token_counts(outputs, vocab_size, self.device),
            self._floats([p.repetition_penalty for p in params]),
            self._floats([p.frequency_penalty for p in params]),
            self._floats([p.presence_penalty for p in params]),
        )
        logits = logits.clone()
        logits[rows] = penalised
        return logits

    def _sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """Filter and draw for rows that are not greedy; a step runs only if some row needs it."""
        params = [r.params for r in requests]
        if any(p.temperature != 1.0 for p in params):
            logits = apply_temperature(logits, self._floats([p.temperature for p in params]))
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, self._floats([p.min_p for p in params]))
        top_ks = [max(p.top_k, 0) for p in params]
        if any(top_ks):
            logits = apply_top_k(logits, _to_device(top_ks, torch.long, self.device), max(top_ks))
        if any(p.top_p < 1 for p in params):
            candidates = max(top_ks) if all(top_ks) else None
            logits = apply_top_p(logits, self._floats([p.top_p for p in params]), candidates)
        probs = logits.softmax(dim=-1)
        return exponential_race(probs, self._noise(probs, requests))

    def _noise(self, probs: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """Exp(1) noise like ``probs``; a seeded row's noise depends on (seed, position) only."""
        noise = torch.empty_like(probs)
        if any(r.params.seed is None for r in requests):
            noise.exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.params.seed is not None:
                self._row_generator.manual_seed(row_seed(request.params.seed, request.position))
                # A fresh tensor, so the stream cannot depend on where the row sits in memory.
                row_noise = torch.empty(probs.shape[-1], device=probs.device)
                noise[row] = row_noise.exponential_(generator=self._row_generator)
        return noise

    def _output(self, logits: torch.Tensor, token_ids: torch.Tensor,
                requests: Sequence[SampleRequest]) -> SampleOutput:
        """Copy the tokens (and the logprobs asked for) to the host in one synchronisation."""
        logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not logprob_rows:
            return SampleOutput(token_ids.tolist(), [None] * len(requests))
        rows = self._rows(logprob_rows)
        raw = logits[rows].log_softmax(dim=-1)
        chosen = raw.gather(-1, token_ids[rows][:, None])
        ranks = (raw > chosen).sum(dim=-1) + 1
        num_top = max(requests[i].params.logprobs for i in logprob_rows)
        top = raw.topk(num_top, dim=-1)
        host_tokens, host_chosen, host_ranks, top_ids, top_logprobs = _to_host(
            token_ids, chosen, ranks, top.indices, top.values)
        token_list = [int(t) for t in host_tokens]
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        for j, i in enumerate(logprob_rows):
            start = j * num_top
            wanted = range(start, start + requests[i].params.logprobs)
            logprobs[i] = TokenLogprobs(
                token_id=token_list[i], logprob=host_chosen[j], rank=int(host_ranks[j]),
                top=tuple((int(top_ids[k]), top_logprobs[k]) for k in wanted))
        return SampleOutput(token_list, logprobs)

    def _rows(self, indices: list[int]) -> torch.Tensor:
        return _to_device(indices, torch.long, self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return _to_device(values, torch.float32, self.device)


def _plain_greedy(request: SampleRequest) -> bool:
    p = request.params
    return p.greedy and not p.has_penalties and p.logprobs is None and not request.suppressed_token_ids


def _seen_tokens(request: SampleRequest, field: str) -> Sequence[int]:
    tokens = getattr(request, field)
    if tokens is None:
        raise ValueError(f"a request with penalties needs {field}")
    return tokens


def _to_device(values: list | torch.Tensor, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device``, copied without waiting for it (pinned on CUDA)."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _to_host(*tensors: torch.Tensor) -> list[list[float]]:
    """Copy small tensors to the host with one synchronisation; each comes back as a flat list.

    They travel as float64, which holds token ids, ranks and float32 logprobs exactly.
    """
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    lists, start = [], 0
    for t in tensors:
        lists.append(flat[start:start + t.numel()])
        start += t.numel()
    return lists
