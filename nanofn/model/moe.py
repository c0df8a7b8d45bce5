"""Qwen3-MoE's sparse MLP: a router picks each token's top-k experts, whose gated MLPs run
through the kernels' ``fused_moe``; Qwen3.5-MoE's and Qwen3-Next's add a shared expert
(``SharedExpertMoeBlock``).

The experts are held stacked, ``w13 [E, 2I, H]`` (each expert's ``[gate | up]``) and
``w2 [E, H, I]``, filled from a checkpoint's per-expert tensors (``experts.N.gate_proj``, ...)
one by one or from transformers' fused ones (``experts.gate_up_proj``, ``experts.down_proj``),
see ``loader.py``. Tensor parallelism splits every expert's intermediate dimension ``I`` as the
dense MLP's: a rank holds its share of each gate, up and down projection, and the ranks' outputs
are summed as ``down_proj``'s. With expert parallelism (``enable_expert_parallel``, as vLLM's
option) a rank holds ``E / tp_size`` whole experts instead and computes the (token, expert)
pairs of its experts only; the ranks' outputs are summed alike, by the same all-reduce. Every
rank routes every token alike (the router is replicated).
A shared expert splits as the dense MLP, its gate is replicated, and its partial sums join the
routed experts' in one all-reduce.

In an FP8 model (``quantization.py``) the experts are FP8 too: ``w13`` and ``w2`` in e4m3 with
``w13_scale`` and ``w2_scale``, a float32 multiplier per row and group of K columns as a dense
FP8 projection's (the checkpoint's per-expert ``weight_scale_inv`` or ``weight_scale``), split
with their rows (w13) or their columns' groups (w2). They multiply weight-only
(``kernels/moe.py``). The router and the shared expert's gate stay in the model's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanofn.kernels import KernelBackend, silu_and_mul
from nanofn.kernels.fp8 import FP8_DTYPE, Fp8Weight, quantize_groups
from nanofn.kernels.partial_sums import Unsummed
from nanofn.model.config import text_config
from nanofn.model.layers import RMSNorm
from nanofn.model.parallel import check_shape, divide, load_replicated
from nanofn.model.quantization import Fp8Scheme


def is_sparse_layer(hf_config: Any, layer_index: int) -> bool:
    """Whether the layer's MLP is the sparse one, by transformers' ``Qwen3MoeDecoderLayer``'s
    rule: experts on every ``decoder_sparse_step``-th layer but those of ``mlp_only_layers``.
    Qwen3.5-MoE's config has neither: experts on every layer."""
    config = text_config(hf_config)
    step = getattr(config, "decoder_sparse_step", 1)
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % step == 0)


def renormalizes_top_k(hf_config: Any) -> bool:
    """Whether the chosen experts' weights are divided by their sum: the config's
    ``norm_topk_prob``; Qwen3.5-MoE's has none and always does."""
    return getattr(text_config(hf_config), "norm_topk_prob", True)


class Router(nn.Module):
    """The ``gate`` linear layer (replicated, no bias) and ``select_experts`` after it."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool,
                 kernels: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = load_replicated
        self.top_k, self.renormalize = top_k, renormalize
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k], topk_ids [T, k])``."""
        return self.kernels.select_experts(self.kernels.linear(hidden, self.weight), self.top_k,
                                           self.renormalize)


class StackedExperts(nn.Module):
    """This rank's experts, ``w13 [E_local, 2 * I_local, H]`` (``[gate | up]``) and ``w2
    [E_local, H, I_local]``: with tensor parallelism a share of every expert's intermediate
    dimension (``E_local = E``); with expert parallelism (``expert_parallel``) whole experts
    (``I_local = I``), rank ``r`` holding experts ``r * E_local .. (r + 1) * E_local - 1``.
    ``w13.experts`` and ``w2.experts`` name them (the checkpoint's indices; the loader reads
    no other expert's tensors) and ``num_experts`` counts every rank's."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int,
                 tp_size: int, expert_parallel: bool = False, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size  # every rank's
        if expert_parallel:
            local_experts = divide(num_experts, tp_size, "num_experts")
            self.first_expert = tp_rank * local_experts
            self.local_size, self.first = intermediate_size, 0
        else:
            local_experts, self.first_expert = num_experts, 0
            self.local_size = divide(intermediate_size, tp_size, "moe_intermediate_size")
            self.first = tp_rank * self.local_size
        self.fp8 = fp8
        dtype = None if fp8 is None else FP8_DTYPE
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * self.local_size, hidden_size,
                                            dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.load_w13
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden_size, self.local_size,
                                           dtype=dtype), requires_grad=False)
        self.w2.weight_loader = self.load_w2
        stacked = [self.w13, self.w2]
        if fp8 is not None:
            stacked += self._add_scales(fp8, local_experts, hidden_size)
        for param in stacked:
            param.experts = range(self.first_expert, self.first_expert + local_experts)
            param.num_experts = num_experts
        self.matrices = ((self.w13, self.w2) if fp8 is None else
                         (Fp8Weight(self.w13, self.w13_scale, self.w13_group),
                          Fp8Weight(self.w2, self.w2_scale, self.w2_group)))

    def _add_scales(self, fp8: Fp8Scheme, local_experts: int,
                    hidden_size: int) -> list[nn.Parameter]:
        """``w13_scale [E_local, 2 * I_local, G_H]`` and ``w2_scale [E_local, H, G_I_local]``:
        w2's groups of K split with its columns, so a rank's share of them (where ranks split
        them) must hold whole groups."""
        full_inter = self.intermediate_size
        self.w13_group = fp8.group_size(hidden_size)
        self.w2_group = min(fp8.group_size(full_inter), self.local_size)
        if self.local_size != full_inter and self.local_size % self.w2_group:
            raise ValueError(f"{fp8.description}: an expert's intermediate size per rank "
                             f"({self.local_size}) is not a multiple of the scales' "
                             f"{self.w2_group} columns; lower tp_size, or set "
                             f"enable_expert_parallel (each rank holds whole experts)")
        self.w13_scale = nn.Parameter(torch.empty(local_experts, 2 * self.local_size,
                                                  fp8.num_groups(hidden_size),
                                                  dtype=torch.float32), requires_grad=False)
        self.w13_scale.weight_loader = self.load_w13_scale
        self.w2_scale = nn.Parameter(torch.empty(local_experts, hidden_size,
                                                 -(-self.local_size // self.w2_group),
                                                 dtype=torch.float32), requires_grad=False)
        self.w2_scale.weight_loader = self.load_w2_scale
        for scale in (self.w13_scale, self.w2_scale):
            scale.checkpoint_leaf = fp8.scale_name  # (experts.N.gate_proj.weight_scale_inv)
            scale.filled_by_weight = fp8.quantize_at_load
        return [self.w13_scale, self.w2_scale]

    @property
    def expert_parallel(self) -> bool:
        """Whether other ranks hold some of the experts."""
        return len(self.w13.experts) < self.num_experts

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' indices among this rank's: -1 for an expert another rank holds
        (``fused_moe`` leaves those pairs out); all of them without expert parallelism."""
        if not self.expert_parallel:
            return topk_ids
        local = topk_ids - self.first_expert
        return local.masked_fill((local < 0) | (local >= len(self.w13.experts)), -1)

    def load_w13(self, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: tuple[int, int] | None = None) -> None:
        """``shard_id`` ``(expert, 0)``: that expert's ``gate_proj [I, H]``, ``(expert, 1)``:
        its ``up_proj`` (another rank's expert: nothing to copy); None: all experts'
        ``gate_up_proj``, ``[E, 2I, H]`` (transformers 5's layout, assumed where ``H == 2I``
        leaves it ambiguous) or ``[E, H, 2I]``. FP8: see ``_checked_fp8``."""
        hidden = param.shape[2]
        if shard_id is None:
            loaded = _experts_first(loaded, (self.num_experts, 2 * self.intermediate_size, hidden))
            loaded = self._rank_experts(loaded)
        else:
            check_shape(loaded, (self.intermediate_size, hidden))
        if self.fp8 is not None:
            loaded = self._checked_fp8(loaded, self.w13_scale, self._place_w13, shard_id)
        self._place_w13(param, loaded, shard_id)

    def load_w13_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                       shard_id: tuple[int, int] | None = None) -> None:
        """A checkpoint's scales of an expert's ``gate_proj`` or ``up_proj``, as row
        multipliers (``Fp8Scheme.row_scales``)."""
        if shard_id is None:
            raise ValueError("FP8 scales of fused expert tensors are not read (only per-expert "
                             "gate_proj, up_proj and down_proj tensors with their own scales)")
        self._place_w13(param, self.fp8.row_scales(loaded, self.intermediate_size,
                                                   self.w13.shape[2]), shard_id)

    def _place_w13(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard_id: tuple[int, int] | None) -> None:
        """This rank's rows of an expert's gate or up rows (or, ``shard_id`` None, of this
        rank's experts' ``[E_local, 2I, ...]``) into ``param`` (``w13`` or its scales)."""
        if shard_id is None:
            for part in (0, 1):
                self._rank_rows(param, part).copy_(
                    loaded.narrow(1, part * self.intermediate_size + self.first, self.local_size))
            return
        expert, part = shard_id
        if (local := self._local_expert(expert)) is not None:
            self._rank_rows(param[local], part).copy_(
                loaded.narrow(0, self.first, self.local_size))

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor,
                shard_id: int | None = None) -> None:
        """``shard_id`` an expert: its ``down_proj [H, I]``; None: all experts' ``down_proj``,
        ``[E, H, I]`` (transformers 5's, assumed where ``H == I``) or ``[E, I, H]``. FP8: see
        ``_checked_fp8``."""
        hidden = param.shape[1]
        if shard_id is None:
            loaded = _experts_first(loaded, (self.num_experts, hidden, self.intermediate_size))
            loaded = self._rank_experts(loaded)
        else:
            check_shape(loaded, (hidden, self.intermediate_size))
        if self.fp8 is not None:
            loaded = self._checked_fp8(loaded, self.w2_scale, self._place_w2_scale, shard_id)
        if shard_id is None:
            param.data.copy_(loaded.narrow(2, self.first, self.local_size))
        elif (local := self._local_expert(shard_id)) is not None:
            param.data[local].copy_(loaded.narrow(1, self.first, self.local_size))

    def load_w2_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """A checkpoint's scales of an expert's ``down_proj``, as row multipliers."""
        if shard_id is None:
            raise ValueError("FP8 scales of fused expert tensors are not read (only per-expert "
                             "gate_proj, up_proj and down_proj tensors with their own scales)")
        self._place_w2_scale(param, self.fp8.row_scales(loaded, param.shape[1],
                                                        self.intermediate_size), shard_id)

    def _place_w2_scale(self, param: nn.Parameter, scales: torch.Tensor,
                        shard_id: int | None) -> None:
        """This rank's groups of an expert's ``down_proj`` row multipliers ``[H, G_I]`` (or,
        ``shard_id`` None, of this rank's experts' ``[E_local, H, G_I]``): the groups of its
        columns, or a scale a row whole (every rank's)."""
        first, count = ((0, 1) if scales.shape[-1] == 1 else
                        (self.first // self.w2_group, param.shape[-1]))
        if shard_id is None:
            param.data.copy_(scales.narrow(2, first, count))
        elif (local := self._local_expert(shard_id)) is not None:
            param.data[local].copy_(scales.narrow(1, first, count))

    def _checked_fp8(self, loaded: torch.Tensor, scale: nn.Parameter, place_scales: Any,
                     shard_id: Any) -> torch.Tensor:
        """An FP8 model's expert tensor: an FP8 checkpoint's as it is (its scales come as
        tensors of their own); a full-precision one quantized (``quantize_at_load``: one scale a
        row, the per-channel scheme), its scales placed as a checkpoint's would be."""
        if not self.fp8.quantize_at_load:
            if loaded.dtype != FP8_DTYPE:
                raise ValueError(f"expected a float8_e4m3fn expert weight "
                                 f"({self.fp8.description}), found "
                                 f"{str(loaded.dtype).removeprefix('torch.')}")
            return loaded
        q, scales = quantize_groups(loaded.to(scale.device), loaded.shape[-1])
        place_scales(scale, scales, shard_id)
        return q

    def _local_expert(self, expert: int) -> int | None:
        """A checkpoint expert's index among this rank's, None where another rank holds it."""
        _check_expert(expert, self.num_experts)
        local = expert - self.first_expert
        return local if 0 <= local < len(self.w13.experts) else None

    def _rank_experts(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's experts of an all-experts tensor ``[E, ...]``."""
        return loaded.narrow(0, self.first_expert, len(self.w13.experts))

    def _rank_rows(self, weights: torch.Tensor, part: int) -> torch.Tensor:
        """The gate (``part`` 0) or up (1) rows of ``weights [..., 2 * I_local, H]``."""
        return weights.data.narrow(-2, part * self.local_size, self.local_size)


def _experts_first(loaded: torch.Tensor, expected: tuple[int, int, int]) -> torch.Tensor:
    """``loaded`` as ``expected [E, out, in]``: as it is, or transposed from ``[E, in, out]``."""
    if tuple(loaded.shape) == expected:
        return loaded
    check_shape(loaded.transpose(1, 2), expected)
    return loaded.transpose(1, 2)


def _check_expert(expert: int, num_experts: int) -> None:
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert {expert} out of range: the model has {num_experts} experts")


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: ``gate`` (the router) and ``experts``."""

    def __init__(self, hf_config: Any, kernels: KernelBackend, tp_rank: int, tp_size: int,
                 expert_parallel: bool = False, fp8: Fp8Scheme | None = None):
        super().__init__()
        config = text_config(hf_config)
        self.gate = Router(config.num_experts, config.hidden_size, config.num_experts_per_tok,
                           renormalizes_top_k(config), kernels)
        self.experts = StackedExperts(config.num_experts, config.hidden_size,
                                      config.moe_intermediate_size, tp_rank, tp_size,
                                      expert_parallel, fp8)
        self.kernels = kernels
        self.tp_size = tp_size

    def partial_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's summand of the output ``[T, H]`` from the normed ``hidden [T, H]``: with
        expert parallelism its experts' share of every token's (each (token, expert) pair is
        computed by the rank that holds the expert)."""
        topk_weights, topk_ids = self.gate(hidden)
        return self.kernels.fused_moe(hidden, *self.experts.matrices, topk_weights,
                                      self.experts.local_ids(topk_ids),
                                      expert_parallel=self.experts.expert_parallel)

    def forward(self, hidden: torch.Tensor, for_norm: bool = False) -> torch.Tensor | Unsummed:
        """``[T, H]`` from the normed ``hidden [T, H]``, summed over ranks (``for_norm``: its
        only reader a norm, which may take it as ``RankSums``)."""
        out = self.partial_forward(hidden)
        if self.tp_size > 1:
            out = self.kernels.all_reduce(out, for_norm=for_norm)
        return out

    def forward_normed(self, hidden: torch.Tensor | Unsummed, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor | Unsummed, torch.Tensor]:
        """``(self(norm(hidden + residual)), hidden + residual)``, as ``MLP.forward_normed``
        (the next norm reads the first)."""
        normed, residual = norm(hidden, residual)
        return self(normed, for_norm=True), residual


class SharedExpertMoeBlock(SparseMoeBlock):
    """The sparse MLP with a shared expert (Qwen3.5-MoE, Qwen3-Next): every token also goes
    through ``shared_expert``, a gated MLP (``decoder.MLP`` of
    ``shared_expert_intermediate_size``), whose output is scaled by
    ``sigmoid(shared_expert_gate(x))``, one number a token, and added to the routed experts'."""

    def __init__(self, hf_config: Any, shared_expert: nn.Module, kernels: KernelBackend,
                 tp_rank: int, tp_size: int, expert_parallel: bool = False,
                 fp8: Fp8Scheme | None = None):
        super().__init__(hf_config, kernels, tp_rank, tp_size, expert_parallel, fp8)
        self.shared_expert = shared_expert
        self.shared_expert_gate = SharedExpertGate(text_config(hf_config).hidden_size, kernels)

    def partial_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """The routed experts' summand plus the shared expert's: scaling a rank's partial sum
        by the (replicated) gate scales the total alike, so one all-reduce sums both."""
        activated = silu_and_mul(self.shared_expert.gate_up_proj(hidden))
        shared = self.shared_expert.down_proj.partial_forward(activated)
        return super().partial_forward(hidden) + self.shared_expert_gate(hidden) * shared


class SharedExpertGate(nn.Module):
    """``sigmoid(x @ weight.T)``, ``weight [1, H]`` replicated: how much of the shared expert
    each token takes."""

    def __init__(self, hidden_size: int, kernels: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)
        self.weight.weight_loader = load_replicated
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, 1]``."""
        return torch.sigmoid(self.kernels.linear(hidden, self.weight))
