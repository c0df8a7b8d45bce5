"""FP8 (e4m3) weights, activations and KV cache entries: the plain-torch references.

A projection stored in FP8 is an ``Fp8Weight``: the ``[N, K]`` float8_e4m3fn matrix and its
float32 dequantization multipliers ``scale [N, G]``, one per row and group of ``group_size``
columns (a 128x128 block-wise checkpoint's scales repeated over each block's rows, a per-channel
one's with ``G = 1``; see ``nanofn/model/quantization.py``). The GPU multiplies it W8A8: the
activations are quantized too, per token and group of ``group_size`` columns (dynamic), or with
one static per-tensor ``input_scale``. ``fp8_linear`` computes exactly that product in higher
precision, the activations quantized and dequantized as the GPU would quantize them, so the CPU
reference has the GPU's rounding errors, not fewer.

A KV cache in FP8 holds ``value / scale`` rounded to e4m3 (``quantize_kv``); attention reads
``entry * scale`` (``dequantize_kv``). The scale is one float per cache (per tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# The smallest scale a group of zeros gets, so that dividing by it stays finite (vLLM's too).
MIN_SCALE = 1e-10 / FP8_MAX


@dataclass(frozen=True)
class Fp8Weight:
    """A projection's FP8 weight, as the kernels' ``linear`` takes it in place of a tensor."""

    data: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N, G] float32: row n's columns [g * group_size, (g + 1) * group_size)
    group_size: int  # columns per scale, and per dynamic activation scale
    input_scale: torch.Tensor | None = None  # static per-tensor activation scale; None: dynamic

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight the FP8 one stands for."""
        return dequantize_groups(self.data, self.scale, self.group_size).to(dtype)


def quantize_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` in float8_e4m3fn with a scale per row and group of ``group_size`` columns
    (the last group may be short): ``(q, scale [..., ceil(K / group_size)])``, float32 scales
    such that ``q * scale`` is ``x``. Each group's largest magnitude maps to 448."""
    width = x.shape[-1]
    groups = -(-width // group_size)
    padded = F.pad(x.float(), (0, groups * group_size - width))
    grouped = padded.unflatten(-1, (groups, group_size))
    # amax times the float32 reciprocal of 448, a product Triton's kernels compute exactly so
    # (a division by a Python number is already that product in torch on a GPU; an exact
    # division there would differ from it by an ulp now and then)
    scale = (grouped.abs().amax(-1) * (1 / FP8_MAX)).clamp(min=MIN_SCALE)
    q = (grouped * reciprocal(scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2)[..., :width], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q * scale`` in float32, each scale over its group of ``group_size`` columns."""
    return q.float() * scale.repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]


def quantize_static(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (saturating at +-448): a static per-tensor scale's."""
    return (x.float() * reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def reciprocal(scale: torch.Tensor | float) -> torch.Tensor:
    """``1 / scale`` in float32, IEEE's division. Values are quantized as ``x * (1 / scale)``,
    a product an element and one division a scale, as the GPU kernels do (and vLLM's);
    ``x / scale`` may differ from it by an ulp, and then, at a rounding boundary, by a code."""
    return 1 / torch.as_tensor(scale, dtype=torch.float32)


def quantized_activations(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``x`` as the W8A8 GEMM sees it, in float32: quantized to e4m3 per token and group of
    ``weight.group_size`` columns, or with the static ``weight.input_scale``, then dequantized."""
    if weight.input_scale is not None:
        return quantize_static(x, weight.input_scale).float() * weight.input_scale
    q, scale = quantize_groups(x, weight.group_size)
    return dequantize_groups(q, scale, weight.group_size)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product ``quant(x) @ dequant(weight).T (+ bias)`` in ``x``'s dtype, from float32
    (``x [..., K]``)."""
    product = F.linear(quantized_activations(x, weight), weight.dequantized(torch.float32),
                       None if bias is None else bias.float())
    return product.to(x.dtype)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A key or value as an FP8 cache stores it."""
    return quantize_static(x, scale)


def dequantize_kv(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries in float32: ``entry * scale`` for an FP8 cache, the entries themselves
    otherwise."""
    return cache.float() * scale if cache.dtype == FP8_DTYPE else cache.float()
