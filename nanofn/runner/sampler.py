"""Turn one row of logits per sequence into the next token, with vLLM v1's sampling semantics.

Per row, in order: penalties (repetition, frequency, presence), then temperature, min_p, top_k
and top_p, then a draw. Greedy rows take the argmax of the penalised logits. Logprobs come from
the raw distribution the model gave, before any of these steps.

The draw is the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token picks token
``i`` with probability ``probs[i]``, and needs no cumulative sum. A seeded row's ``q`` depends on
``(seed, position)`` alone, so its tokens do not depend on the rest of the batch.

Two implementations of the same semantics:

- torch (CPU, and CUDA on request): each step a pass over the batch; a seeded row draws its ``q``
  from a generator seeded by ``row_seed(seed, position)``, unseeded rows share the sampler's
  generator.
- Triton (CUDA by default, ``nanofn.kernels.triton_sampling``): every row's ``q`` comes from a
  counter-based generator keyed by the row (``row_seed(seed, position)`` if seeded, else a base
  drawn once per call plus the row index) and the token index. Rows with only a temperature
  ("plain" rows, the common case) are drawn by one fused kernel, in the Gumbel-max form of the
  race; rows with penalties, banned tokens or filters go through the torch steps with that
  same noise. A seeded row's token thus depends on its seed, position, logits and parameters
  only, whichever path the other rows take.

Everything per row is a tensor over the batch; Python loops run only over the rows (to gather
their parameters), seeded rows and the token lists that penalties count. The single host
synchronisation is the final copy of the results.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nanofn.state.params import SamplingParams
from nanofn.state.plan import SampleOutput, TokenLogprobs

_MASK64 = (1 << 64) - 1
_BASE_KEYS = 1 << 62  # unseeded rows' keys are base + row index: keep the sum within int64


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row of logits (built anew for every row of
    every step, so a plain slotted class: a third of a frozen one's cost)."""

    params: SamplingParams
    position: int  # absolute position of the token being sampled (= number of tokens before it)
    prompt_token_ids: Sequence[int] | None = None  # required when params.has_penalties
    output_token_ids: Sequence[int] | None = None  # likewise
    banned_token_ids: tuple[int, ...] = ()  # never sampled (the plan says which)


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


def ban_tokens(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """``logits`` with each row's banned tokens at -inf (the same tensor if there are none)."""
    rows = [i for i, r in enumerate(requests) for _ in r.banned_token_ids]
    if not rows:
        return logits
    columns = [t for r in requests for t in r.banned_token_ids]
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
    """Samples one token per row of logits; see the module docstring for the semantics.

    ``use_triton``: draw with the Triton kernels (default: on CUDA). The CPU engine never imports
    Triton.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str | None = None,
                 use_triton: bool | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        # Unseeded rows: the torch path draws their noise from it; the Triton path draws one base
        # key per call from it, on the host, which needs no synchronisation.
        self.generator = torch.Generator("cpu" if self.use_triton else self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(self.device)  # re-seeded for each seeded row

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> SampleOutput:
        """Sample from ``logits`` (float32 ``[len(requests), vocab]``), one token per request."""
        return self.sample(logits, requests).wait()

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> DeviceSample:
        """As ``__call__``, but the tokens stay on the device (the next step may read them
        there) while their copy to the host proceeds in the background."""
        if all(_plain_greedy(r) for r in requests):
            return DeviceSample.start(logits.argmax(dim=-1), len(requests))
        if self.use_triton:
            token_ids = self._draw_with_triton(logits, requests)
        else:
            def noise(rows: list[int]) -> torch.Tensor:
                return self._torch_noise([requests[i] for i in rows], logits.shape[-1])

            token_ids = self._draw(logits, requests, noise)
        return self._output(logits, token_ids, requests)

    def _draw_with_triton(self, logits: torch.Tensor,
                          requests: Sequence[SampleRequest]) -> torch.Tensor:
        """Every row through the fused kernel (cheaper than gathering the plain ones), then the
        other rows through the torch steps, with the same noise, over the fused kernel's tokens."""
        from nanofn.kernels.triton_sampling import exponential_noise, sample_plain

        base = int(torch.randint(_BASE_KEYS, (), generator=self.generator))
        keys = _to_device(array("q", (base + i if r.params.seed is None
                                      else _as_int64(row_seed(r.params.seed, r.position))
                                      for i, r in enumerate(requests))), torch.int64, self.device)
        temperatures = array("f", (0.0 if r.params.greedy else r.params.temperature
                                   for r in requests))  # the kernel's greedy rows are T = 0
        token_ids = sample_plain(logits, _to_device(temperatures, torch.float32, self.device), keys)
        others = [i for i, r in enumerate(requests) if not _plain(r)]
        if others:
            rows = self._rows(others)
            other_keys = keys[rows]

            def noise(sub_rows: list[int]) -> torch.Tensor:
                return exponential_noise(other_keys[self._rows(sub_rows)], logits.shape[-1])

            token_ids[rows] = self._draw(logits[rows], [requests[i] for i in others], noise)
        return token_ids

    def _draw(self, logits: torch.Tensor, requests: Sequence[SampleRequest],
              noise: Callable[[list[int]], torch.Tensor]) -> torch.Tensor:
        """The torch steps: penalties and banned tokens, then the argmax for greedy rows, the
        filters and the exponential race for the others. ``noise(rows)`` gives Exp(1) noise
        ``[len(rows), vocab]`` for those rows of ``requests``."""
        penalised = ban_tokens(self._penalised(logits, requests), requests)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if len(random_rows) == len(requests):
            return self._sample(penalised, requests, noise(random_rows))
        token_ids = penalised.argmax(dim=-1)
        if random_rows:
            rows = self._rows(random_rows)
            token_ids[rows] = self._sample(penalised[rows], [requests[i] for i in random_rows],
                                           noise(random_rows))
        return token_ids

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

    def _sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest],
                noise: torch.Tensor) -> torch.Tensor:
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
        return exponential_race(logits.softmax(dim=-1), noise)

    def _torch_noise(self, requests: Sequence[SampleRequest], vocab_size: int) -> torch.Tensor:
        """Exp(1) noise ``[len(requests), vocab_size]``; a seeded row's depends on (seed, position)
        only."""
        noise = torch.empty(len(requests), vocab_size, device=self.device)
        if any(r.params.seed is None for r in requests):
            noise.exponential_(generator=self.generator)
        for row, request in enumerate(requests):
            if request.params.seed is not None:
                self._row_generator.manual_seed(row_seed(request.params.seed, request.position))
                # A fresh tensor, so the stream cannot depend on where the row sits in memory.
                row_noise = torch.empty(vocab_size, device=self.device)
                noise[row] = row_noise.exponential_(generator=self._row_generator)
        return noise

    def _output(self, logits: torch.Tensor, token_ids: torch.Tensor,
                requests: Sequence[SampleRequest]) -> DeviceSample:
        """The tokens, plus the logprobs asked for (from the raw logits)."""
        logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not logprob_rows:
            return DeviceSample.start(token_ids, len(requests))
        rows = self._rows(logprob_rows)
        raw = logits[rows].log_softmax(dim=-1)
        chosen = raw.gather(-1, token_ids[rows][:, None])
        ranks = (raw > chosen).sum(dim=-1) + 1
        num_top = max(requests[i].params.logprobs for i in logprob_rows)
        top = raw.topk(num_top, dim=-1)
        wanted = {i: requests[i].params.logprobs for i in logprob_rows}
        return DeviceSample.start(token_ids, len(requests), wanted,
                                  (chosen, ranks, top.indices, top.values))

    def _rows(self, indices: list[int]) -> torch.Tensor:
        return _to_device(indices, torch.long, self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return _to_device(values, torch.float32, self.device)


def _plain_greedy(request: SampleRequest) -> bool:
    p = request.params
    return p.greedy and not p.has_penalties and p.logprobs is None and not request.banned_token_ids


def _plain(request: SampleRequest) -> bool:
    """Whether the fused kernel alone draws the row: no penalties, no banned tokens, and no
    filters unless the row is greedy (filters never change the argmax)."""
    p = request.params
    unfiltered = p.min_p == 0 and p.top_k <= 0 and p.top_p >= 1
    return (unfiltered or p.greedy) and not (p.has_penalties or request.banned_token_ids)


def _as_int64(key: int) -> int:
    """A 64-bit unsigned key as the int64 of the same bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _seen_tokens(request: SampleRequest, field: str) -> Sequence[int]:
    tokens = getattr(request, field)
    if tokens is None:
        raise ValueError(f"a request with penalties needs {field}")
    return tokens


def _to_device(values: list | array | torch.Tensor, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device``, copied without waiting for it (pinned on CUDA).

    A non-empty ``array`` of ``dtype``'s type code converts several times faster than a list.
    """
    if isinstance(values, array):
        host = torch.frombuffer(values, dtype=dtype)
    else:
        host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class DeviceSample:
    """Sampled tokens (and logprobs) on the device, with their copy to the host under way;
    ``wait`` waits for the copy. Everything travels as one float64 tensor, which holds token
    ids, ranks and float32 logprobs exactly."""

    token_ids: torch.Tensor  # [S] int64, on the device
    num_rows: int
    logprob_rows: dict[int, int]  # row -> number of top logprobs asked for
    host: torch.Tensor  # the flat copy: tokens, then per logprob row: chosen, rank, top ids, top values
    copied: torch.cuda.Event | None

    @classmethod
    def start(cls, token_ids: torch.Tensor, num_rows: int, logprob_rows: dict[int, int] | None = None,
              logprob_parts: tuple[torch.Tensor, ...] = ()) -> DeviceSample:
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in (token_ids, *logprob_parts)])
        if flat.device.type != "cuda":
            return cls(token_ids, num_rows, logprob_rows or {}, flat, None)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(token_ids, num_rows, logprob_rows or {}, host, copied)

    def wait(self) -> SampleOutput:
        if self.copied is not None:
            self.copied.synchronize()
        values = self.host.tolist()
        n = self.num_rows
        tokens = [int(t) for t in values[:n]]
        logprobs: list[TokenLogprobs | None] = [None] * n
        if self.logprob_rows:
            k, num_top = len(self.logprob_rows), max(self.logprob_rows.values())
            chosen, ranks = values[n:n + k], values[n + k:n + 2 * k]
            top_ids = values[n + 2 * k:n + 2 * k + k * num_top]
            top_values = values[n + 2 * k + k * num_top:]
            for j, (row, wanted) in enumerate(self.logprob_rows.items()):
                first = j * num_top
                logprobs[row] = TokenLogprobs(
                    token_id=tokens[row], logprob=chosen[j], rank=int(ranks[j]),
                    top=tuple((int(top_ids[first + m]), top_values[first + m])
                              for m in range(wanted)))
        return SampleOutput(tokens, logprobs)
