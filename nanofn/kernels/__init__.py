"""Compute kernels. Each module holds the plain-torch reference that defines a kernel's contract.

A model calls its kernels through one ``KernelBackend``, chosen once per engine: ``TORCH_KERNELS``
(the references, defined here), ``nanofn.kernels.triton_ops.TRITON_KERNELS`` or
``nanofn.kernels.flash_attention.FLASH_KERNELS`` (Triton's with flash-attn-4's prefill). The last
two are imported only where asked for, so that importing this package loads no Triton and no
flash_attn.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanofn.kernels.activation import silu_and_mul
from nanofn.kernels.attention import decode_attention, prefill_attention, store_kv
from nanofn.kernels.causal_conv import causal_conv1d, causal_conv1d_update
from nanofn.kernels.delta_rule import (delta_rule_gates, gated_delta_net_decode, gated_delta_rule,
                                      gated_delta_rule_update)
from nanofn.kernels.linear import linear, rms_norm_linear
from nanofn.kernels.moe import fused_moe, select_experts
from nanofn.kernels.norm import rms_norm, rms_norm_gated
from nanofn.kernels.all_reduce import group_all_reduce
from nanofn.kernels.partial_sums import PartialSums, RankSums
from nanofn.kernels.rotary import (SUPPORTED_ROPE_TYPES, apply_rotary, build_cos_sin_cache,
                                   rotary_decode_attention, rotate_and_store_kv)


@dataclass(frozen=True)
class KernelBackend:
    """Every kernel a model calls besides its embedding lookups (the LM head projects through
    ``linear``).

    Each field has the signature and contract of the torch reference of the same name.
    """

    # rotary embedding (optionally after Qwen3's q/k norm), then the keys and values to the cache
    rotate_and_store_kv: Callable[..., torch.Tensor]
    prefill_attention: Callable[..., torch.Tensor]
    # a decode step's rotary embedding, cache writes and attention together
    rotary_decode_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    # The projections, and one with the norm before it (and maybe the activation after it) fused
    # in (see linear.py)
    linear: Callable[..., torch.Tensor]
    rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # A hybrid model's linear-attention layers (Gated DeltaNet), reading and writing the state
    # slots of a ``RecurrentState``: the causal convolution, the gates and the gated delta rule
    # over a step's sequences, then the gated output norm; all four over one token a sequence
    # (a decode step).
    causal_conv1d: Callable[..., list[torch.Tensor]]
    delta_rule_gates: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gated_delta_rule: Callable[..., torch.Tensor]
    gated_delta_net_decode: Callable[..., torch.Tensor]
    rms_norm_gated: Callable[..., torch.Tensor]
    # A mixture-of-experts layer (Qwen3-MoE): the router's choice of each token's top-k experts
    # from its logits, then each token through its experts' gated MLPs, weighted and summed
    select_experts: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    # A layer's partial outputs summed over the tensor-parallel ranks, in place (the runner
    # sets one for its group: ``all_reduce.ranks_all_reduce``); with ``for_norm=True`` (the
    # output's only reader a norm) it may return ``RankSums`` for the norm to add up instead
    all_reduce: Callable[..., torch.Tensor | RankSums] = group_all_reduce


TORCH_KERNELS = KernelBackend(
    rotate_and_store_kv=rotate_and_store_kv,
    prefill_attention=prefill_attention,
    rotary_decode_attention=rotary_decode_attention,
    rms_norm=rms_norm,
    linear=linear,
    rms_norm_linear=rms_norm_linear,
    causal_conv1d=causal_conv1d,
    delta_rule_gates=delta_rule_gates,
    gated_delta_rule=gated_delta_rule,
    gated_delta_net_decode=gated_delta_net_decode,
    rms_norm_gated=rms_norm_gated,
    select_experts=select_experts,
    fused_moe=fused_moe,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "TORCH_KERNELS",
    "KernelBackend",
    "PartialSums",
    "RankSums",
    "apply_rotary",
    "build_cos_sin_cache",
    "causal_conv1d",
    "causal_conv1d_update",
    "decode_attention",
    "fused_moe",
    "gated_delta_net_decode",
    "gated_delta_rule",
    "gated_delta_rule_update",
    "linear",
    "prefill_attention",
    "rms_norm",
    "rms_norm_gated",
    "rms_norm_linear",
    "rotary_decode_attention",
    "rotate_and_store_kv",
    "select_experts",
    "silu_and_mul",
    "store_kv",
]
