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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanofn.kernels import KernelBackend, silu_and_mul
from nanofn.kernels.partial_sums import Unsummed
from nanofn.model.config import text_config
from nanofn.model.layers import RMSNorm
from nanofn.model.parallel import check_shape, divide, load_replicated


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
                 tp_size: int, expert_parallel: bool = False):
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
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * self.local_size, hidden_size),
                                requires_grad=False)
        self.w13.weight_loader = self.load_w13
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden_size, self.local_size),
                               requires_grad=False)
        self.w2.weight_loader = self.load_w2
        for param in (self.w13, self.w2):
            param.experts = range(self.first_expert, self.first_expert + local_experts)
            param.num_experts = num_experts

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
        leaves it ambiguous) or ``[E, H, 2I]``."""
        hidden = param.shape[2]
        full = 2 * self.intermediate_size
        if shard_id is None:
            loaded = self._rank_experts(_experts_first(loaded, (self.num_experts, full, hidden)))
            for part in (0, 1):
                self._rank_rows(param, part).copy_(
                    loaded.narrow(1, part * self.intermediate_size + self.first, self.local_size))
            return
        expert, part = shard_id
        check_shape(loaded, (self.intermediate_size, hidden))
        if (local := self._local_expert(expert)) is not None:
            self._rank_rows(param[local], part).copy_(
                loaded.narrow(0, self.first, self.local_size))

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor,
                shard_id: int | None = None) -> None:
        """``shard_id`` an expert: its ``down_proj [H, I]``; None: all experts' ``down_proj``,
        ``[E, H, I]`` (transformers 5's, assumed where ``H == I``) or ``[E, I, H]``."""
        hidden = param.shape[1]
        if shard_id is None:
            loaded = _experts_first(loaded, (self.num_experts, hidden, self.intermediate_size))
            param.data.copy_(self._rank_experts(loaded).narrow(2, self.first, self.local_size))
            return
        check_shape(loaded, (hidden, self.intermediate_size))
        if (local := self._local_expert(shard_id)) is not None:
            param.data[local].copy_(loaded.narrow(1, self.first, self.local_size))

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
                 expert_parallel: bool = False):
        super().__init__()
        config = text_config(hf_config)
        self.gate = Router(config.num_experts, config.hidden_size, config.num_experts_per_tok,
                           renormalizes_top_k(config), kernels)
        self.experts = StackedExperts(config.num_experts, config.hidden_size,
                                      config.moe_intermediate_size, tp_rank, tp_size,
                                      expert_parallel)
        self.kernels = kernels
        self.tp_size = tp_size

    def partial_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's summand of the output ``[T, H]`` from the normed ``hidden [T, H]``: with
        expert parallelism its experts' share of every token's (each (token, expert) pair is
        computed by the rank that holds the expert)."""
        topk_weights, topk_ids = self.gate(hidden)
        return self.kernels.fused_moe(hidden, self.experts.w13, self.experts.w2, topk_weights,
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
                 tp_rank: int, tp_size: int, expert_parallel: bool = False):
        super().__init__(hf_config, kernels, tp_rank, tp_size, expert_parallel)
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
