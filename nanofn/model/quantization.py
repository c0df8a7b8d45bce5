"""FP8 checkpoints: which layouts nanofn reads, and how their scales become a layer's.

Three sources of FP8 projections:

- Qwen's (and DeepSeek's) block-wise checkpoints: ``quantization_config = {quant_method: "fp8",
  fmt: "e4m3", activation_scheme: "dynamic", weight_block_size: [128, 128]}``; each linear
  layer's ``weight`` in float8_e4m3fn with ``weight_scale_inv [ceil(N/128), ceil(K/128)]``,
  float32, the multiplier of each 128x128 block (despite its name).
- compressed-tensors (LLM Compressor's ``FP8_DYNAMIC``, ``FP8``, ``FP8_BLOCK``):
  ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``, one config group of
  8-bit float ``weights`` with strategy ``channel`` (``weight_scale [N, 1]``), ``tensor``
  (``[1]``) or ``block`` (as Qwen's, named ``weight_scale``), and ``input_activations``
  dynamic per token or group, or static per tensor (``input_scale [1]``).
- ``quantization="fp8"`` on a bf16 checkpoint: each projection quantized as it loads, per
  output channel, with dynamic per-token activations (the compressed-tensors ``FP8_DYNAMIC``
  scheme): its GEMM applies both scales once, after the K loop (block-wise scales must be
  applied per 128 columns of K inside it), and a row's own scale keeps its range (vLLM's
  default at load, one scale per tensor, lets the largest row set every row's).

Whatever the source, a layer holds ``scale [N, G]`` float32: one multiplier per output row and
group of K columns (``Fp8Weight``, ``nanofn/kernels/fp8.py``): a block-wise checkpoint's block
scales repeated over the block's rows, a per-tensor scale over every row of its tensor. So the
parts of a fused projection (``qkv_proj``, ``gate_up_proj``) keep their own scales row by row,
and tensor parallelism splits scales with the same code as the weight's rows (``parallel.py``);
a row-parallel layer's groups of K split with its columns. This costs 4 bytes per row and
group (3 % of the FP8 weight at groups of 128) where the checkpoint stores one per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanofn.kernels.fp8 import quantize_groups

BLOCK_SIZE = (128, 128)  # the one weight_block_size the kernels are written for
QUANTIZATIONS = (None, "fp8")  # the ``quantization`` option's values


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 projections are stored, and how their activations are quantized."""

    description: str  # in words, for messages and ``nanofn bench``
    weight_scales: str  # the checkpoint's: "block" (128x128), "channel" or "tensor"
    scale_name: str = "weight_scale"  # the scale tensors' name: weight_scale(_inv)
    static_input_scale: bool = False  # an ``input_scale`` per layer; else dynamic per group
    quantize_at_load: bool = False  # the checkpoint is bf16: quantized as it loads
    ignore: tuple[str, ...] = ()  # modules the checkpoint keeps unquantized

    def group_size(self, in_features: int) -> int:
        """Columns of K per weight scale and per dynamic activation scale."""
        return BLOCK_SIZE[1] if self.weight_scales == "block" else in_features

    def num_groups(self, in_features: int) -> int:
        return -(-in_features // self.group_size(in_features))

    def row_scales(self, loaded: torch.Tensor, rows: int, in_features: int) -> torch.Tensor:
        """A checkpoint's scale tensor for a weight of ``rows x in_features`` as ``[rows, G]``
        float32 multipliers (see the module's docstring)."""
        if self.weight_scales == "block":
            expected = (-(-rows // BLOCK_SIZE[0]), self.num_groups(in_features))
        else:
            expected = (rows, 1) if self.weight_scales == "channel" else (1,)
        flat = tuple(loaded.shape) in ((), (rows,))  # a per-tensor scalar, per-channel [N]
        if tuple(loaded.shape) != expected and not (flat and loaded.numel() == expected[0]):
            raise ValueError(f"{self.scale_name} of a {rows} x {in_features} weight "
                             f"({self.description}): expected shape {expected}, found "
                             f"{tuple(loaded.shape)}")
        scales = loaded.float().reshape(-1, expected[-1] if loaded.dim() else 1)
        if self.weight_scales == "block":
            return scales.repeat_interleave(BLOCK_SIZE[0], dim=0)[:rows]
        return scales.expand(rows, 1)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A full-precision weight as ``(FP8 weight, [rows, G] scales)``, at load: per output
        channel (``quantize_at_load``), else in the checkpoint's granularity (dummy weights)."""
        rows, in_features = weight.shape
        if self.weight_scales == "channel":
            return quantize_groups(weight, in_features)
        if self.weight_scales == "tensor":
            q, scale = quantize_groups(weight.reshape(1, -1), weight.numel())
            return q.view(rows, in_features), scale.expand(rows, 1)
        return _quantize_blocks(weight)

    def is_ignored(self, module_name: str) -> bool:
        """Whether the checkpoint's ``ignore`` list names this module (a name, or ``re:`` and
        a regular expression, as compressed-tensors writes them)."""
        return any(re.fullmatch(pattern[3:], module_name) if pattern.startswith("re:")
                   else pattern == module_name for pattern in self.ignore)


def _quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization (128x128), its scales repeated over each block's rows."""
    rows, in_features = weight.shape
    (block_n, block_k), block_rows = BLOCK_SIZE, -(-rows // BLOCK_SIZE[0])
    block_cols = -(-in_features // block_k)
    padded = F.pad(weight.float(), (0, block_cols * block_k - in_features,
                                    0, block_rows * block_n - rows))
    tiles = padded.view(block_rows, block_n, block_cols, block_k).transpose(1, 2)
    q, scale = quantize_groups(tiles.flatten(2), block_n * block_k)  # a group per block
    q = q.view(tiles.shape).transpose(1, 2).reshape(padded.shape)[:rows, :in_features]
    return q.contiguous(), scale[..., 0].repeat_interleave(block_n, dim=0)[:rows]


def fp8_scheme(hf_config: Any, quantization: str | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint (its ``quantization_config``) or of ``quantization="fp8"``
    on an unquantized one; None for neither. A format nanofn does not read raises, naming it."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; supported: fp8 (or none)")
    if config:
        if quantization is not None:
            method = config.get("quant_method")
            raise ValueError(f"quantization={quantization!r} asks to quantize a bf16 checkpoint "
                             f"at load, but this checkpoint is already quantized ({method})")
        return _checkpoint_scheme(config)
    if quantization == "fp8":
        return Fp8Scheme("fp8 per-channel weights quantized at load, dynamic per-token "
                         "activations", "channel", quantize_at_load=True)
    return None


def _checkpoint_scheme(config: dict[str, Any]) -> Fp8Scheme:
    method = config.get("quant_method")
    if method == "fp8":
        return _block_fp8_scheme(config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    raise ValueError(f"unsupported quantized checkpoint: quant_method {method!r}; nanofn reads "
                     f"FP8 checkpoints: quant_method 'fp8' (block-wise) and "
                     f"'compressed-tensors' (FP8)")


def _block_fp8_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """Qwen's (DeepSeek's) format: block-wise weights, dynamic activations."""
    problems = []
    if config.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {config.get('fmt')!r} (only e4m3)")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {config.get('activation_scheme')!r} (only dynamic)")
    block = config.get("weight_block_size")
    if block is None:
        problems.append("no weight_block_size (per-tensor fp8 checkpoints are not read)")
    elif tuple(block) != BLOCK_SIZE:
        problems.append(f"weight_block_size {list(block)} (only {list(BLOCK_SIZE)})")
    if problems:
        raise ValueError(f"unsupported fp8 checkpoint: {'; '.join(problems)}")
    ignore = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return Fp8Scheme("fp8 block-wise 128x128 weights, dynamic per-token-group activations",
                     "block", scale_name="weight_scale_inv", ignore=tuple(ignore))


def _compressed_tensors_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """One config group of FP8 weights and activations, in the ``float-quantized`` format."""
    groups = list((config.get("config_groups") or {}).values())
    if config.get("format") not in ("float-quantized", None):
        raise ValueError(f"unsupported compressed-tensors checkpoint: format "
                         f"{config.get('format')!r} (only float-quantized, FP8)")
    if len(groups) != 1:
        raise ValueError(f"unsupported compressed-tensors checkpoint: {len(groups)} config "
                         f"groups (only one, FP8 for every Linear)")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if config.get("kv_cache_scheme"):
        raise ValueError("unsupported compressed-tensors checkpoint: a kv_cache_scheme "
                         "(calibrated KV cache scales); use kv_cache_dtype='fp8' instead")
    strategy = weights.get("strategy")
    block = weights.get("block_structure")
    problems = _float8_problems("weights", weights)
    if strategy not in ("channel", "tensor", "block"):
        problems.append(f"weights strategy {strategy!r} (only channel, tensor, block)")
    if strategy == "block" and tuple(block or ()) != BLOCK_SIZE:
        problems.append(f"weights block_structure {block} (only {list(BLOCK_SIZE)})")
    problems += _float8_problems("input_activations", inputs)
    dynamic = inputs.get("dynamic")
    activation = inputs.get("strategy")
    if dynamic and not (activation == "token" or (activation == "group"
                                                  and inputs.get("group_size") == BLOCK_SIZE[1]
                                                  and strategy == "block")):
        problems.append(f"dynamic input_activations of strategy {activation!r} (only token, "
                        f"or group of 128 with block weights)")
    if not dynamic and activation != "tensor":
        problems.append(f"static input_activations of strategy {activation!r} (only tensor)")
    if problems:
        raise ValueError(f"unsupported compressed-tensors checkpoint: {'; '.join(problems)}")
    static = not dynamic
    return Fp8Scheme(f"compressed-tensors fp8 {strategy} weights, "
                     + ("static per-tensor activations" if static else
                        f"dynamic per-{activation} activations"),
                     strategy, static_input_scale=static, ignore=tuple(config.get("ignore") or ()))


def _float8_problems(what: str, args: dict[str, Any]) -> list[str]:
    if not args:
        return [f"no {what} (only W8A8: FP8 weights and activations)"]
    if args.get("num_bits") != 8 or args.get("type") != "float":
        return [f"{what} of {args.get('num_bits')}-bit {args.get('type')} (only 8-bit float)"]
    if args.get("symmetric") is False:
        return [f"asymmetric {what} (only symmetric)"]
    return []
