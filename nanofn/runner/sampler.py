"""Turn one row of logits per sequence into the next token, with vLLM v1's sampling semantics.

The input is columnar: ``SamplingRows`` holds one numpy array per parameter (an entry per row of
logits), plus the token lists of the rows with penalties and the token ids that rows may not
sample. ``SamplingRows.from_requests`` builds it from per-row ``SampleRequest``s, and ``Sampler``
takes either.

Per row, in order: the allowed tokens and the logit bias the request gives, penalties
(repetition, frequency, presence), banned tokens, then temperature, min_p, top_k
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

Everything per row is an array over the batch: which rows are greedy, plain or filtered, and
which steps run, are masks over the columns, and the Triton keys come from ``row_seeds``, a numpy
``row_seed``. Python loops run only over the rows that need one: seeded rows on the torch path (a
generator each), the token lists that penalties count, banned tokens, and the rows asking for
logprobs. The single host synchronisation is the final copy of the results.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from nanofn.state.params import GREEDY_TEMPERATURE, SamplingParams
from nanofn.state.plan import SampleOutput, TokenBitmask, TokenLogprobs

_MASK64 = (1 << 64) - 1
_BASE_KEYS = 1 << 62  # unseeded rows' keys are base + row index: keep the sum within int64
# Greedy rows are those whose float32 temperature is below it. A temperature that is not greedy
# never rounds below it, but a greedy one just under GREEDY_TEMPERATURE may round up onto it:
# ``from_requests`` writes 0 for greedy rows.
_GREEDY_BELOW = np.float32(GREEDY_TEMPERATURE)
# SplitMix64's constants, for numpy's uint64 arithmetic
_SPLITMIX_INCREMENT = np.uint64(0x9E3779B97F4A7C15)
_SPLITMIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
_SPLITMIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_30, _SHIFT_27, _SHIFT_31 = np.uint64(30), np.uint64(27), np.uint64(31)


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row of logits (built anew for every row of
    every step, so a plain slotted class: a third of a frozen one's cost)."""

    params: SamplingParams
    position: int  # absolute position of the token being sampled (= number of tokens before it)
    prompt_token_ids: Sequence[int] | None = None  # required when params.has_penalties
    output_token_ids: Sequence[int] | None = None  # likewise
    banned_token_ids: tuple[int, ...] = ()  # never sampled (the plan says which)


@dataclass(frozen=True, slots=True, eq=False)
class SamplingRows:
    """The sampler's input: one entry per row of logits in each column (numpy arrays, host side).

    A row is greedy when its temperature is below ``GREEDY_TEMPERATURE``. Penalties apply to the
    rows that ``histories`` lists, which must include every row whose penalty columns are not
    neutral (a ``ValueError`` otherwise). ``eq=False``: arrays do not compare to one bool.
    """

    temperature: np.ndarray  # float32 [S]
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int64 [S]; 0 means no limit (a -1 from SamplingParams becomes 0)
    min_p: np.ndarray  # float32 [S]
    seeded: np.ndarray  # bool [S]
    seed: np.ndarray  # uint64 [S]: the row's seed & (2**64 - 1); ignored where not seeded
    position: np.ndarray  # int64 [S]: position of the token being sampled
    logprobs: np.ndarray  # int64 [S]: number of top logprobs wanted, -1 for none
    presence_penalty: np.ndarray  # float32 [S]
    frequency_penalty: np.ndarray  # float32 [S]
    repetition_penalty: np.ndarray  # float32 [S]
    histories: tuple[tuple[int, Sequence[int], Sequence[int]], ...] = ()  # (row, prompt, output)
    banned: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (row, token ids it may not sample)
    allowed: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (row, the only token ids it may sample)
    biases: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()  # (row, (token, bias)s)

    def __post_init__(self) -> None:
        penalised = ((self.presence_penalty != 0) | (self.frequency_penalty != 0)
                     | (self.repetition_penalty != 1))
        penalised[[row for row, _, _ in self.histories]] = False
        if penalised.any():
            raise ValueError(f"rows {np.flatnonzero(penalised).tolist()} have penalties but no "
                             f"token lists in histories")

    @classmethod
    def from_requests(cls, requests: Sequence[SampleRequest]) -> SamplingRows:
        params = [r.params for r in requests]
        return cls(
            temperature=np.array([0.0 if p.greedy else p.temperature for p in params], np.float32),
            top_p=np.array([p.top_p for p in params], np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params], np.int64),
            min_p=np.array([p.min_p for p in params], np.float32),
            seeded=np.array([p.seed is not None for p in params], np.bool_),
            seed=np.array([(p.seed or 0) & _MASK64 for p in params], np.uint64),
            position=np.array([r.position for r in requests], np.int64),
            logprobs=np.array([-1 if p.logprobs is None else p.logprobs for p in params], np.int64),
            presence_penalty=np.array([p.presence_penalty for p in params], np.float32),
            frequency_penalty=np.array([p.frequency_penalty for p in params], np.float32),
            repetition_penalty=np.array([p.repetition_penalty for p in params], np.float32),
            histories=tuple((row, _seen_tokens(r, "prompt_token_ids"),
                             _seen_tokens(r, "output_token_ids"))
                            for row, r in enumerate(requests) if r.params.has_penalties),
            banned=tuple((row, r.banned_token_ids)
                         for row, r in enumerate(requests) if r.banned_token_ids),
            allowed=tuple((row, p.allowed_token_ids) for row, p in enumerate(params)
                          if p.allowed_token_ids is not None),
            biases=tuple((row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias),
        )

    def __len__(self) -> int:
        return len(self.temperature)

    def greedy(self) -> np.ndarray:
        return self.temperature < _GREEDY_BELOW

    def unfiltered(self) -> np.ndarray:
        """Rows that no filter (min_p, top_k, top_p) applies to."""
        return (self.min_p == 0) & (self.top_k <= 0) & (self.top_p >= 1)

    def special(self) -> np.ndarray:
        """Rows with penalties, banned or allowed tokens or a logit bias: only the torch steps
        handle them."""
        special = np.zeros(len(self), np.bool_)
        special[[row for row, _, _ in self.histories]] = True
        special[[row for row, ids in self.banned if ids]] = True
        special[[row for row, _ in self.allowed]] = True
        special[[row for row, _ in self.biases]] = True
        return special

    def select(self, rows: np.ndarray) -> SamplingRows:
        """The given rows, renumbered in their order: row ``rows[i]`` becomes row ``i``."""
        renumbered = np.full(len(self), -1)
        renumbered[rows] = np.arange(len(rows))
        new_row = renumbered.tolist()
        return SamplingRows(
            **{name: getattr(self, name)[rows] for name in _COLUMNS},
            histories=tuple((new_row[row], prompt, output) for row, prompt, output in self.histories
                            if new_row[row] >= 0),
            banned=_renumbered(self.banned, new_row),
            allowed=_renumbered(self.allowed, new_row),
            biases=_renumbered(self.biases, new_row),
        )


def _renumbered(pairs: tuple, new_row: list[int]) -> tuple:
    """``(row, value)`` pairs of the selected rows, with their new row numbers."""
    return tuple((new_row[row], value) for row, value in pairs if new_row[row] >= 0)


_COLUMNS = tuple(f.name for f in fields(SamplingRows)
                 if f.name not in ("histories", "banned", "allowed", "biases"))


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
    flat_index = to_device(flat_index, device)
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


def ban_tokens(logits: torch.Tensor,
               banned: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """``logits`` with the token ids listed for each row at -inf (the same tensor if none are)."""
    rows = [row for row, ids in banned for _ in ids]
    if not rows:
        return logits
    columns = [t for _, ids in banned for t in ids]
    logits = logits.clone()
    logits[rows, columns] = float("-inf")
    return logits


def keep_allowed(logits: torch.Tensor,
                 allowed: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """``logits`` with every token outside each listed row's allowed ids at -inf (the same
    tensor if no row lists any)."""
    if not allowed:
        return logits
    rows = torch.tensor([row for row, _ in allowed], device=logits.device)
    counts = torch.tensor([len(ids) for _, ids in allowed])
    columns = torch.tensor([t for _, ids in allowed for t in ids], device=logits.device)
    inside = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=logits.device)
    inside[torch.repeat_interleave(torch.arange(len(allowed)), counts).to(logits.device),
           columns] = True
    return _keep_only(logits, rows, inside)


def add_logit_bias(logits: torch.Tensor,
                   biases: Sequence[tuple[int, Sequence[tuple[int, float]]]]) -> torch.Tensor:
    """``logits`` plus each listed row's ``(token id, bias)`` pairs (the same tensor if none)."""
    if not biases:
        return logits
    device = logits.device
    rows = torch.tensor([row for row, pairs in biases for _ in pairs], device=device)
    columns = torch.tensor([t for _, pairs in biases for t, _ in pairs], device=device)
    values = torch.tensor([b for _, pairs in biases for _, b in pairs], dtype=logits.dtype,
                          device=device)
    return logits.index_put((rows, columns), values, accumulate=True)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with the tokens each of ``rows`` may not sample at -inf: bit ``t % 32`` of
    ``bitmask[k, t // 32]`` (int32 ``[len(rows), words]``) allows token ``t`` for row
    ``rows[k]``; ids past ``32 * words`` are masked (a model's vocabulary may be larger than
    its tokenizer's)."""
    bit_values = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    bit_values = bit_values.to(torch.int32).to(bitmask.device)  # 1 << 31 wraps to int32's sign
    allowed = ((bitmask[:, :, None] & bit_values) != 0).reshape(len(rows), -1)
    vocab_size = logits.shape[-1]
    if allowed.shape[-1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[-1]))
    return _keep_only(logits, rows, allowed[:, :vocab_size])


def _keep_only(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` with the tokens that ``allowed`` (bool ``[len(rows), vocab]``) does
    not allow for each of ``rows`` at -inf."""
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
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


def row_seeds(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``row_seed`` of each (seed, position) pair, bit for bit: uint64 seeds (already masked to
    64 bits), int64 positions, uint64 results. A negative position counts as its 64-bit two's
    complement, as it does in ``row_seed``, whose masks keep only the low 64 bits."""
    with np.errstate(over="ignore"):  # the wrapping is the point (numpy warns on scalars only)
        mixed = _splitmix64_array(np.asarray(seeds, np.uint64))
        return _splitmix64_array(mixed ^ np.asarray(positions, np.int64).view(np.uint64))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of each element of a uint64 array, whose arithmetic wraps modulo 2**64
    (uint64 constants throughout: a Python int would cost a conversion per operation)."""
    x = x + _SPLITMIX_INCREMENT
    x = (x ^ (x >> _SHIFT_30)) * _SPLITMIX_MULTIPLIER_1
    x = (x ^ (x >> _SHIFT_27)) * _SPLITMIX_MULTIPLIER_2
    return x ^ (x >> _SHIFT_31)


# ---------------------------------------------------------------------------------- the sampler

# Rows that the torch steps (filters, penalties) take at a time on the Triton path, and the
# logprobs on either: each step copies a row's vocabulary-wide float32 logits, several at once,
# which over a step of 512 rows took GBs (reserved from the KV cache at start-up, in
# ``ModelRunner``'s largest step).
ROWS_AT_ONCE = 64


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

    def __call__(self, logits: torch.Tensor, rows: SamplingRows | Sequence[SampleRequest],
                 token_bitmask: TokenBitmask | None = None) -> SampleOutput:
        """Sample from ``logits`` (float32 ``[len(rows), vocab]``), one token per row, as lists
        (``sample`` leaves the tokens on the device and gives an array when waited for)."""
        out = self.sample(logits, rows, token_bitmask).wait()
        logprobs = out.logprobs if out.logprobs is not None else [None] * len(out.token_ids)
        return SampleOutput(out.token_ids.tolist(), logprobs)

    def sample(self, logits: torch.Tensor, rows: SamplingRows | Sequence[SampleRequest],
               token_bitmask: TokenBitmask | None = None) -> DeviceSample:
        """As ``__call__``, but the tokens stay on the device (the next step may read them
        there) while their copy to the host proceeds in the background. ``token_bitmask``
        (structured output) limits some rows to the tokens it allows, before any other step;
        their logprobs are those of the masked logits, as in vLLM."""
        if not isinstance(rows, SamplingRows):
            rows = SamplingRows.from_requests(rows)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, self._ints(token_bitmask.rows),
                                         to_device(token_bitmask.bits, self.device))
        greedy, special = rows.greedy(), rows.special()
        if (greedy & ~special & (rows.logprobs < 0)).all():
            return DeviceSample.start(logits.argmax(dim=-1), len(rows))
        if self.use_triton:
            # The fused kernel alone draws a row with no penalties, no banned tokens and no
            # filters unless the row is greedy (filters never change the argmax).
            plain = ~special & (greedy | rows.unfiltered())
            token_ids = self._draw_with_triton(logits, rows, greedy, plain)
        else:
            def noise(which: np.ndarray) -> torch.Tensor:
                return self._torch_noise(rows, which, logits.shape[-1])

            token_ids = self._draw(logits, rows, noise)
        return self._output(logits, token_ids, rows)

    def key_base(self) -> int:
        """The Triton draw's key of unseeded row 0 in the next call (row ``i``'s is this plus
        ``i``), from the sampler's generator; a draw that samples in a CUDA graph takes it here."""
        return int(torch.randint(_BASE_KEYS, (), generator=self.generator))

    def _draw_with_triton(self, logits: torch.Tensor, rows: SamplingRows, greedy: np.ndarray,
                          plain: np.ndarray) -> torch.Tensor:
        """Every row through the fused kernel (cheaper than gathering the plain ones), then the
        other rows through the torch steps, with the same noise, over the fused kernel's tokens."""
        from nanofn.kernels.triton_sampling import exponential_noise, sample_plain

        keys = self.key_base() + np.arange(len(rows))
        if rows.seeded.any():
            keys = np.where(rows.seeded, row_seeds(rows.seed, rows.position).view(np.int64), keys)
        keys = self._ints(keys)
        temperatures = np.where(greedy, 0, rows.temperature)  # the kernel's greedy rows are T = 0
        token_ids = sample_plain(logits, self._floats(temperatures), keys)
        others = np.flatnonzero(~plain)
        for start in range(0, len(others), ROWS_AT_ONCE):
            part = others[start:start + ROWS_AT_ONCE]
            index = self._ints(part)
            part_keys = keys[index]

            def noise(which: np.ndarray, part_keys: torch.Tensor = part_keys) -> torch.Tensor:
                return exponential_noise(part_keys[self._ints(which)], logits.shape[-1])

            token_ids[index] = self._draw(logits[index], rows.select(part), noise)
        return token_ids

    def _draw(self, logits: torch.Tensor, rows: SamplingRows,
              noise: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
        """The torch steps: allowed tokens, logit bias, penalties and banned tokens, then the
        argmax for greedy rows, the filters and the exponential race for the others.
        ``noise(which)`` gives Exp(1) noise ``[len(which), vocab]`` for those rows."""
        shaped = add_logit_bias(keep_allowed(logits, rows.allowed), rows.biases)
        penalised = ban_tokens(self._penalised(shaped, rows), rows.banned)
        random_rows = np.flatnonzero(~rows.greedy())
        if len(random_rows) == len(rows):
            return self._sample(penalised, rows, noise(random_rows))
        token_ids = penalised.argmax(dim=-1)
        if len(random_rows):
            index = self._ints(random_rows)
            token_ids[index] = self._sample(penalised[index], rows.select(random_rows),
                                            noise(random_rows))
        return token_ids

    def _penalised(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """``logits`` with each row's penalties applied (the same tensor if no row has any)."""
        if not rows.histories:
            return logits
        penalised_rows = np.array([row for row, _, _ in rows.histories], np.int64)
        vocab_size = logits.shape[-1]
        index = self._ints(penalised_rows)
        penalised = apply_penalties(
            logits[index],
            token_counts([prompt for _, prompt, _ in rows.histories], vocab_size, self.device),
            token_counts([output for _, _, output in rows.histories], vocab_size, self.device),
            self._floats(rows.repetition_penalty[penalised_rows]),
            self._floats(rows.frequency_penalty[penalised_rows]),
            self._floats(rows.presence_penalty[penalised_rows]),
        )
        logits = logits.clone()
        logits[index] = penalised
        return logits

    def _sample(self, logits: torch.Tensor, rows: SamplingRows,
                noise: torch.Tensor) -> torch.Tensor:
        """Filter and draw for rows that are not greedy; a step runs only if some row needs it."""
        if (rows.temperature != 1).any():
            logits = apply_temperature(logits, self._floats(rows.temperature))
        if (rows.min_p > 0).any():
            logits = apply_min_p(logits, self._floats(rows.min_p))
        limited = rows.top_k > 0
        if limited.any():
            logits = apply_top_k(logits, self._ints(rows.top_k), int(rows.top_k.max()))
        if (rows.top_p < 1).any():
            candidates = int(rows.top_k.max()) if limited.all() else None
            logits = apply_top_p(logits, self._floats(rows.top_p), candidates)
        return exponential_race(logits.softmax(dim=-1), noise)

    def _torch_noise(self, rows: SamplingRows, which: np.ndarray,
                     vocab_size: int) -> torch.Tensor:
        """Exp(1) noise ``[len(which), vocab_size]`` for those rows; a seeded row's depends on
        (seed, position) only."""
        seeded = np.flatnonzero(rows.seeded[which])  # indices into which
        noise = torch.empty(len(which), vocab_size, device=self.device)
        if len(seeded) < len(which):
            noise.exponential_(generator=self.generator)
        seeds = row_seeds(rows.seed[which[seeded]], rows.position[which[seeded]])
        for row, seed in zip(seeded.tolist(), seeds.tolist()):
            self._row_generator.manual_seed(seed)
            # A fresh tensor, so the stream cannot depend on where the row sits in memory.
            row_noise = torch.empty(vocab_size, device=self.device)
            noise[row] = row_noise.exponential_(generator=self._row_generator)
        return noise

    def _output(self, logits: torch.Tensor, token_ids: torch.Tensor,
                rows: SamplingRows) -> DeviceSample:
        """The tokens, plus the logprobs asked for (from the raw logits)."""
        logprob_rows = np.flatnonzero(rows.logprobs >= 0)
        if not len(logprob_rows):
            return DeviceSample.start(token_ids, len(rows))
        wanted = rows.logprobs[logprob_rows]
        index = self._ints(logprob_rows)
        scores = logprob_scores(lambda start, stop: logits[index[start:stop]], token_ids[index],
                                int(wanted.max()), ROWS_AT_ONCE)
        return DeviceSample.start(token_ids, len(rows), dict(zip(logprob_rows.tolist(),
                                                                 wanted.tolist())), scores)

    def _ints(self, values: np.ndarray) -> torch.Tensor:
        return to_device(np.asarray(values, np.int64), self.device)

    def _floats(self, values: np.ndarray) -> torch.Tensor:
        return to_device(np.asarray(values, np.float32), self.device)


def logprob_scores(logits_of: Callable[[int, int], torch.Tensor], targets: torch.Tensor,
                   top_k: int, rows_at_once: int) -> tuple[torch.Tensor, ...]:
    """``(chosen, ranks, top ids, top values)`` for rows of raw logits and a target token each
    (``targets [N]``): the target's logprob, its rank (1 + the tokens strictly more likely),
    and the row's ``top_k`` best. ``logits_of(start, stop)`` gives rows ``start:stop``, made
    ``rows_at_once`` at a time, so that no vocabulary-wide copy spans more rows."""
    parts = []
    for start in range(0, len(targets), rows_at_once):
        stop = min(start + rows_at_once, len(targets))
        values = logits_of(start, stop).log_softmax(dim=-1)
        chosen = values.gather(-1, targets[start:stop, None])[:, 0]
        top = values.topk(top_k, dim=-1)
        parts.append((chosen, (values > chosen[:, None]).sum(dim=-1) + 1, top.indices,
                      top.values))
    return parts[0] if len(parts) == 1 else tuple(map(torch.cat, zip(*parts)))


def plain_rows(num_rows: int) -> SamplingRows:
    """Rows that only the fused Triton kernel draws (temperature, nothing else)."""
    return SamplingRows.from_requests([SampleRequest(SamplingParams(temperature=1.0), 1)]
                                      * num_rows)


def costliest_rows(num_rows: int) -> SamplingRows:
    """Rows that take every torch step that copies the vocabulary (penalties, temperature,
    min-p, a top-p over the whole vocabulary, logprobs): the sampler's memory at its worst."""
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.01, presence_penalty=0.5,
                            frequency_penalty=0.5, repetition_penalty=1.1, logprobs=20)
    return SamplingRows.from_requests([SampleRequest(params, 1, [0], [1])] * num_rows)


def _seen_tokens(request: SampleRequest, field: str) -> Sequence[int]:
    tokens = getattr(request, field)
    if tokens is None:
        raise ValueError(f"a request with penalties needs {field}")
    return tokens


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device``, copied without waiting for it (pinned on CUDA).

    An array is copied (``torch.tensor``), so the tensor never shares the memory of the caller's
    columns, which may be read-only views.
    """
    host = torch.tensor(values) if isinstance(values, np.ndarray) else values
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class DeviceSample:
    """Sampled tokens (and logprobs) on the device, with their copy to the host under way;
    ``wait`` waits for the copy. With logprobs everything travels as one float64 tensor, which
    holds token ids, ranks and float32 logprobs exactly; without, the int64 tokens alone."""

    token_ids: torch.Tensor  # [S] int64, on the device
    num_rows: int
    logprob_rows: dict[int, int]  # row -> number of top logprobs asked for
    host: torch.Tensor  # the flat copy: tokens, then per logprob row: chosen, rank, top ids, top values
    copied: torch.cuda.Event | None
    prompt_logprobs: tuple = ()  # SampleOutput.prompt_logprobs, on the host already

    @classmethod
    def start(cls, token_ids: torch.Tensor, num_rows: int, logprob_rows: dict[int, int] | None = None,
              logprob_parts: tuple[torch.Tensor, ...] = ()) -> DeviceSample:
        if logprob_parts:
            flat = torch.cat([t.reshape(-1).to(torch.float64)
                              for t in (token_ids, *logprob_parts)])
        else:  # the common case: the tokens alone, as they are
            flat = token_ids
        if flat.device.type != "cuda":
            return cls(token_ids, num_rows, logprob_rows or {}, flat, None)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(token_ids, num_rows, logprob_rows or {}, host, copied)

    def done(self) -> bool:
        return self.copied is None or self.copied.query()

    def wait(self) -> SampleOutput:
        if self.copied is not None:
            self.copied.synchronize()
        n = self.num_rows
        tokens = self.host[:n].numpy().astype(np.int64, copy=False)  # the core takes arrays
        if not self.logprob_rows:
            return SampleOutput(tokens, None, self.prompt_logprobs)
        values = self.host.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        if self.logprob_rows:
            k, num_top = len(self.logprob_rows), max(self.logprob_rows.values())
            chosen, ranks = values[n:n + k], values[n + k:n + 2 * k]
            top_ids = values[n + 2 * k:n + 2 * k + k * num_top]
            top_values = values[n + 2 * k + k * num_top:]
            for j, (row, wanted) in enumerate(self.logprob_rows.items()):
                first = j * num_top
                logprobs[row] = TokenLogprobs(
                    token_id=int(tokens[row]), logprob=chosen[j], rank=int(ranks[j]),
                    top=tuple((int(top_ids[first + m]), top_values[first + m])
                              for m in range(wanted)))
        return SampleOutput(tokens, logprobs, self.prompt_logprobs)
