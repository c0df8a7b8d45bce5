"""Sampling in Triton: the draw of plain rows fused into one pass, and the noise of filtered rows.

Both draw from one deterministic stream per row. Token ``t`` of a row keyed by ``seed`` takes its
noise from Philox4x32-10 (Triton's ``tl.randint4x``) keyed by ``seed`` at counter ``t % quarter``,
``quarter = ceil(vocab_size / 4)``: of the four 32-bit words one call returns, word
``t // quarter`` is token ``t``'s. One Philox call thus serves four tokens, and a token's noise
depends on (seed, t, vocab size) alone: not on the batch, the grid or the path that draws it.

A word ``w`` becomes Exp(1) noise ``E = -ln(1 - v)`` with ``v = (w + 1/2) / 2**32``, to about
1e-6 relative at both ends. Small ``E`` is what lets an unlikely token win the race: a plain
``-ln(u)`` of a 24-bit uniform would make tokens less likely than about 1e-8 of the favourite's
probability impossible to draw. On the GPU the logarithms are the hardware's approximate base-2
ones (``lg2.approx``, within 2**-22 absolute), which the rest of the computation is arranged
around; Triton's interpreter has none and takes the exact ones.

- ``exponential_noise`` writes ``E`` for every token of the given rows; the torch path (penalties,
  min_p, top_k, top_p) draws ``argmax(probs / E)``, the exponential race.
- ``sample_plain`` draws rows that have only a temperature in one pass over the logits:
  ``argmax(logits / T - ln E)``, the Gumbel-max form of the same race (``-ln E`` is Gumbel noise),
  so the same ``E`` picks the same token as the torch path up to float rounding, with no softmax.
  It runs in base 2, where the logarithms are cheapest: ``logits * log2(e) / T - log2(E / ln 2)``
  differs from the natural-log value by a factor and a constant only. Rows of temperature 0 take
  the plain argmax, with no noise.

Argmaxes rank like ``torch.argmax``: NaN above everything, ties to the lower index.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from nanofn.kernels.device import num_sms

BLOCK_COUNTERS = 1024  # Philox counters per tile, so 4 * 1024 tokens
NUM_WARPS = 8  # with BLOCK_COUNTERS, 4 counters per thread: one 16-byte load per quarter
PROGRAMS_PER_SM = 4  # sample_plain splits rows into at most this many programs per SM: one wave

_LOG2_E = tl.constexpr(1.4426950408889634)
_LN_2 = tl.constexpr(0.6931471805599453)
_TWO_POW_MINUS_32 = tl.constexpr(2.3283064365386963e-10)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """``log2(x)``: the hardware's approximation with ``FAST_LOG``, else the exact one."""
    if FAST_LOG:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _exponential_in_base_2(word, FAST_LOG: tl.constexpr):
    """Exp(1) noise over ln 2, ``-log2(1 - v)``, from a uint32 word (see the module docstring).

    Both halves of the words read ``x = min(v, 1 - v)`` as one float, from the word or its
    complement, so that ``x`` keeps float32's relative precision however small. The upper half
    (``1 - v = x``) is ``-log2(x)``. The lower half (``v = x``) is ``-log2(1 - x)``, where
    ``1 - x`` rounds away ``x``'s low bits: below 1/8 it is the series
    ``(x + x**2/2 + ... + x**7/7) / ln 2`` instead (the rest is below 1e-7 of it).
    """
    upper = word >= 0x80000000
    x = (tl.where(upper, word ^ 0xFFFFFFFF, word).to(tl.float32) + 0.5) * _TWO_POW_MINUS_32
    series = x * (1.0 + x * (1.0 / 2 + x * (1.0 / 3 + x * (1.0 / 4 + x * (
        1.0 / 5 + x * (1.0 / 6 + x * (1.0 / 7))))))) * _LOG2_E
    logarithm = -_log2(tl.where(upper, x, 1.0 - x), FAST_LOG)
    return tl.where(upper | (x >= 0.125), logarithm, series)


@triton.jit
def _noise(seed, counters, FAST_LOG: tl.constexpr):
    """Four base-2 exponentials per counter from one Philox4x32-10 call keyed by ``seed``."""
    w0, w1, w2, w3 = tl.randint4x(seed, counters)
    return (_exponential_in_base_2(w0, FAST_LOG), _exponential_in_base_2(w1, FAST_LOG),
            _exponential_in_base_2(w2, FAST_LOG), _exponential_in_base_2(w3, FAST_LOG))


@triton.jit
def _argmax_combine(value_a, token_a, value_b, token_b):
    """The better of two (value, token) pairs as ``torch.argmax`` ranks them: NaN above
    everything, then the larger value, then the lower token."""
    a_nan = value_a != value_a
    b_nan = value_b != value_b
    same = (value_a == value_b) | (a_nan & b_nan)
    a_wins = (value_a > value_b) | (a_nan & (b_nan == 0)) | (same & (token_a < token_b))
    return tl.where(a_wins, value_a, value_b), tl.where(a_wins, token_a, token_b)


@triton.jit
def _argmax(values, tokens):
    """The best (value, token) of a block, ranked as by ``_argmax_combine`` (two plain reductions,
    which Triton's interpreter runs far faster than a reduction with a combine function)."""
    nan = values != values
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    largest = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    candidates = tl.where(any_nan, nan, values == largest)
    token = tl.min(tl.where(candidates, tokens, 2147483647), axis=0)
    return tl.where(any_nan, float("nan"), largest), token


@triton.jit
def _best_of_quarter(row_logits, counters, k, quarter, vocab_size, scale, log2_noise,
                     best_value, best_token):
    """Fold the tokens of quarter ``k`` at ``counters`` into each lane's running best of that
    quarter. A lane meets its tokens of one quarter in increasing order, so a later token wins
    only by a larger value (or as the first NaN): ``_argmax_combine``'s order at a third of
    its cost, which is paid for every token."""
    tokens = counters + k * quarter
    mask = (counters < quarter) & (tokens < vocab_size)
    logits = tl.load(row_logits + tokens, mask=mask, other=float("-inf")).to(tl.float32)
    value = logits * scale - log2_noise
    better = (value > best_value) | ((value != value) & (best_value == best_value))
    return tl.where(better, value, best_value), tl.where(better, tokens, best_token)


@triton.jit
def _sample_plain_kernel(
    logits_ptr, temperature_ptr, seed_ptr, slots_ptr, split_value_ptr, split_token_ptr,
    stride_row, stride_seed, vocab_size, quarter, counters_per_split,
    BLOCK: tl.constexpr, BY_SLOT: tl.constexpr, KEY_BITS: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Program (row, split): the best (value, token) of its range of counters, in all quarters.

    With ``BY_SLOT`` the row's temperature is its slot's (``slots``) and its seed is the key
    base (its low and high ``KEY_BITS``, ``stride_seed`` apart at ``seed_ptr``) plus the row."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if BY_SLOT:
        temperature = tl.load(temperature_ptr + tl.load(slots_ptr + row))
        high = tl.load(seed_ptr + stride_seed).to(tl.int64)
        seed = ((high << KEY_BITS) | tl.load(seed_ptr).to(tl.int64)) + row
    else:
        temperature = tl.load(temperature_ptr + row)
        seed = tl.load(seed_ptr + row * stride_seed)
    greedy = temperature == 0.0
    scale = tl.where(greedy, 1.0, _LOG2_E / temperature)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    # Each lane's best of each quarter. (-inf, token 0) loses to any larger value; for a row
    # of -inf, token 0 is torch's answer too.
    best0 = tl.full([BLOCK], float("-inf"), tl.float32)
    token0 = tl.zeros([BLOCK], tl.int32)
    best1, best2, best3 = best0, best0, best0
    token1, token2, token3 = token0, token0, token0
    first = split * counters_per_split
    for start in range(first, first + counters_per_split, BLOCK):
        counters = start + tl.arange(0, BLOCK)
        if greedy:
            n0 = tl.zeros([BLOCK], tl.float32)
            n1 = n0
            n2 = n0
            n3 = n0
        else:
            e0, e1, e2, e3 = _noise(seed, counters, FAST_LOG)
            n0 = _log2(e0, FAST_LOG)
            n1 = _log2(e1, FAST_LOG)
            n2 = _log2(e2, FAST_LOG)
            n3 = _log2(e3, FAST_LOG)
        best0, token0 = _best_of_quarter(row_logits, counters, 0, quarter, vocab_size, scale,
                                         n0, best0, token0)
        best1, token1 = _best_of_quarter(row_logits, counters, 1, quarter, vocab_size, scale,
                                         n1, best1, token1)
        best2, token2 = _best_of_quarter(row_logits, counters, 2, quarter, vocab_size, scale,
                                         n2, best2, token2)
        best3, token3 = _best_of_quarter(row_logits, counters, 3, quarter, vocab_size, scale,
                                         n3, best3, token3)
    best0, token0 = _argmax_combine(best0, token0, best1, token1)
    best2, token2 = _argmax_combine(best2, token2, best3, token3)
    best0, token0 = _argmax_combine(best0, token0, best2, token2)
    value, token = _argmax(best0, token0)
    tl.store(split_value_ptr + row * tl.num_programs(1) + split, value)
    tl.store(split_token_ptr + row * tl.num_programs(1) + split, token)


@triton.jit(do_not_specialize=["num_splits"])  # one compile for every batch size
def _pick_split_kernel(split_value_ptr, split_token_ptr, token_ptr, slots_ptr, kept_ptr,
                       num_splits, SPLITS: tl.constexpr, KEEP: tl.constexpr):
    """Program per row: the token of its best split; with ``KEEP`` also into ``kept`` at the
    row's slot."""
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS)
    mask = splits < num_splits
    values = tl.load(split_value_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    tokens = tl.load(split_token_ptr + row * num_splits + splits, mask=mask, other=0)
    _, token = _argmax(values, tokens)
    tl.store(token_ptr + row, token.to(tl.int64))
    if KEEP:
        tl.store(kept_ptr + tl.load(slots_ptr + row), token.to(tl.int64))


@triton.jit
def _store_quarter(row_noise, counters, k, quarter, vocab_size, noise_in_base_2):
    tokens = counters + k * quarter
    mask = (counters < quarter) & (tokens < vocab_size)
    tl.store(row_noise + tokens, noise_in_base_2 * _LN_2, mask=mask)


@triton.jit
def _exponential_noise_kernel(seed_ptr, noise_ptr, vocab_size, quarter, BLOCK: tl.constexpr,
                              FAST_LOG: tl.constexpr):
    """Program (row, tile of counters): the noise of those counters' tokens in all four quarters."""
    row = tl.program_id(0)
    counters = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e0, e1, e2, e3 = _noise(tl.load(seed_ptr + row), counters, FAST_LOG)
    row_noise = noise_ptr + row.to(tl.int64) * vocab_size
    _store_quarter(row_noise, counters, 0, quarter, vocab_size, e0)
    _store_quarter(row_noise, counters, 1, quarter, vocab_size, e1)
    _store_quarter(row_noise, counters, 2, quarter, vocab_size, e2)
    _store_quarter(row_noise, counters, 3, quarter, vocab_size, e3)


# ---------------------------------------------------------------------------------------------
# Host functions


def sample_plain(logits: torch.Tensor, temperature: torch.Tensor, row_seeds: torch.Tensor,
                 num_splits: int | None = None) -> torch.Tensor:
    """One token per row: ``argmax(logits / T + Gumbel noise)`` keyed by the row's seed, or the
    plain argmax where ``T`` is 0 (the caller maps its greedy rows to 0).

    ``logits``: ``[B, V]`` float32, or bfloat16/float16 (read as float32: the same tokens as
    their float32 copy), with unit stride along V; ``temperature``: ``[B]`` float32;
    ``row_seeds``: ``[B]`` int64 Philox keys. Returns ``[B]`` int64.

    Each row is split into ``num_splits`` ranges of counters (by default as many as fit
    ``PROGRAMS_PER_SM`` programs per SM, since a batch of 256 rows is only two rows per SM of an
    H100); a second kernel picks each row's best split. The tokens do not depend on the split.
    """
    tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    _sample(logits, temperature, row_seeds, None, None, tokens, num_splits)
    return tokens


def sample_plain_by_slot(logits: torch.Tensor, slots: torch.Tensor,
                         slot_temperature: torch.Tensor, key_base: torch.Tensor, key_bits: int,
                         kept: torch.Tensor, tokens: torch.Tensor) -> None:
    """``sample_plain`` as a decode graph draws: row ``r`` at the temperature of its slot
    (``slot_temperature[slots[r]]``), keyed by ``base + r`` (``key_base``: the base's low and
    high ``key_bits`` bits, int32, any stride), its token written to ``tokens[r]`` and kept at
    ``kept[slots[r]]``. What took ten small torch kernels around the draw is in its two."""
    _sample(logits, slot_temperature, key_base, slots, kept, tokens, None, key_bits)


def _sample(logits, temperature, seeds, slots, kept, tokens, num_splits, key_bits=0) -> None:
    num_rows, vocab_size = logits.shape
    quarter = triton.cdiv(vocab_size, 4)
    num_blocks = triton.cdiv(quarter, BLOCK_COUNTERS)
    if num_splits is None:
        num_splits = PROGRAMS_PER_SM * num_sms(logits.device, elsewhere=1) // num_rows
    blocks_per_split = triton.cdiv(num_blocks, max(1, min(num_splits, num_blocks)))
    num_splits = triton.cdiv(num_blocks, blocks_per_split)
    split_values = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    split_tokens = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    by_slot = slots is not None
    _sample_plain_kernel[(num_rows, num_splits)](
        logits, temperature, seeds, slots if by_slot else seeds, split_values, split_tokens,
        logits.stride(0), seeds.stride(0), vocab_size, quarter, blocks_per_split * BLOCK_COUNTERS,
        BLOCK=BLOCK_COUNTERS, BY_SLOT=by_slot, KEY_BITS=key_bits, FAST_LOG=_fast_log(),
        num_warps=NUM_WARPS,
    )
    _pick_split_kernel[(num_rows,)](
        split_values, split_tokens, tokens, slots if by_slot else tokens,
        kept if by_slot else tokens, num_splits, SPLITS=triton.next_power_of_2(num_blocks),
        KEEP=by_slot,
    )


def _fast_log() -> bool:
    """Whether the kernels take the hardware's logarithms: compiled, not interpreted."""
    return not triton.knobs.runtime.interpret


def exponential_noise(row_seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[len(row_seeds), vocab_size]`` float32, from each row's Philox key: the
    noise ``sample_plain`` uses for a row of the same seed."""
    num_rows = row_seeds.shape[0]
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=row_seeds.device)
    quarter = triton.cdiv(vocab_size, 4)
    _exponential_noise_kernel[(num_rows, triton.cdiv(quarter, BLOCK_COUNTERS))](
        row_seeds, noise, vocab_size, quarter, BLOCK=BLOCK_COUNTERS, FAST_LOG=_fast_log(),
        num_warps=NUM_WARPS,
    )
    return noise
