"""Qwen3.5's hybrid decoder (also Qwen3.5-MoE's and Qwen3-Next's): Gated DeltaNet (linear
attention) layers among gated full-attention layers, three to one.

A full-attention layer is ``decoder.py``'s ``Attention`` with its Qwen3.5 options (an output
gate from ``q_proj``, a partial rotary embedding, zero-centred q/k norms), over a KV cache that
holds these layers alone. A linear-attention layer keeps per sequence a recurrent state of fixed
size instead, in the runner's state slots (``RecurrentState``): a short causal convolution's
last inputs and the delta rule's ``[Dk, Dv]`` memory per value head. Module and parameter names
follow Hugging Face's but for the fused projections ``qkv_proj``, ``gate_up_proj`` and
``linear_attn.in_proj`` (Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
or Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, see ``loader.py``). Tensor parallelism
splits the key and value heads of the linear layers across ranks, with the channels convolved
with them. The MLP is dense, or experts (``moe.py``) where the architecture has them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanofn.kernels import KernelBackend
from nanofn.kernels.partial_sums import Unsummed
from nanofn.model.batch import AttentionBatch, RecurrentState
from nanofn.model.config import recurrent_shape, text_config
from nanofn.model.decoder import (Attention, CausalLM, DecoderOptions, check_kv_cache,
                                  layer_norms, mlp, rotary_embedding)
from nanofn.model.layers import RMSNorm, RotaryEmbedding
from nanofn.model.parallel import (MergedColumnParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding, check_shape, row_shards_loader)

LINEAR_ATTENTION = "linear_attention"


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule (``nanofn/kernels/delta_rule.py``).

    ``in_proj`` gives per token the convolved channels ``[q | k | v]``, the output gate ``z``
    (one per value channel), and per value head ``b`` (the write strength ``beta =
    sigmoid(b)``) and ``a`` (the decay ``g = -exp(A_log) * softplus(a + dt_bias)``, in log
    space). After the convolution (SiLU) and the delta rule, each head's output is RMS-normed
    and gated by ``silu(z)``, then ``out_proj`` mixes the heads.
    """

    def __init__(self, hf_config: Any, kernels: KernelBackend, tp_rank: int, tp_size: int):
        super().__init__()
        config = text_config(hf_config)
        for heads in (config.linear_num_key_heads, config.linear_num_value_heads):
            if heads % tp_size:
                raise ValueError(f"the linear-attention heads ({heads}) are not divisible by "
                                 f"tp_size ({tp_size})")
        shape = recurrent_shape(config, tp_size)  # this rank's heads
        self.num_k_heads = config.linear_num_key_heads // tp_size
        self.num_v_heads, self.k_head_dim, self.v_head_dim = (shape.num_v_heads, shape.k_head_dim,
                                                              shape.v_head_dim)
        self.conv_dim = shape.conv_dim
        # All ranks' sizes, which the layers and loaders split
        v_heads = config.linear_num_value_heads
        key_dim = config.linear_num_key_heads * shape.k_head_dim
        value_dim = v_heads * shape.v_head_dim
        self.in_proj = InProjection(config, tp_rank, tp_size, kernels)
        self.conv1d = ConvWeight([key_dim, key_dim, value_dim], shape.conv_width + 1, tp_rank,
                                 tp_size)
        heads_loader = row_shards_loader([v_heads], tp_rank, tp_size)
        self.A_log = _parameter(heads_loader, self.num_v_heads)
        self.dt_bias = _parameter(heads_loader, self.num_v_heads)
        self.norm = RMSNorm(self.v_head_dim, config.rms_norm_eps, kernels)  # gated: rms_norm_gated
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, bias=False,
                                          tp_rank=tp_rank, tp_size=tp_size, kernels=kernels)
        self.kernels = kernels

    def forward(
        self,
        projected: torch.Tensor,
        batch: AttentionBatch,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
    ) -> torch.Tensor | Unsummed:
        """The layer's output from ``in_proj``'s (``HybridDecoderLayer`` runs the projection,
        with the norm before it), reading and writing this layer's state slots:
        ``conv_states [num_slots, conv_dim, K - 1]`` and ``ssm_states [num_slots, Hv, Dk, Dv]``."""
        kernels, num_tokens = self.kernels, projected.shape[0]
        key_dim, value_dim = self.num_k_heads * self.k_head_dim, self.num_v_heads * self.v_head_dim
        mixed, z, b, a = projected.split([self.conv_dim, value_dim, self.num_v_heads,
                                          self.num_v_heads], dim=-1)
        slots, resume = batch.state_slots, batch.has_initial_state
        weight = self.conv1d.weight[:, 0]
        parts = [key_dim, key_dim, value_dim]
        if batch.decode_only:
            out = kernels.gated_delta_net_decode(mixed, a, b, z, weight, self.A_log, self.dt_bias,
                                                 self.norm.weight, self.norm.eps, conv_states,
                                                 ssm_states, slots, resume)
            return self.out_proj(out.flatten(1), for_norm=True)
        q, k, v = kernels.causal_conv1d(mixed, weight, conv_states, batch.query_start, slots,
                                        resume, parts)
        q = q.view(num_tokens, self.num_k_heads, self.k_head_dim)
        k = k.view(num_tokens, self.num_k_heads, self.k_head_dim)
        v = v.view(num_tokens, self.num_v_heads, self.v_head_dim)
        g, beta = kernels.delta_rule_gates(a, b, self.A_log, self.dt_bias)
        out = kernels.gated_delta_rule(q, k, v, g, beta, ssm_states, batch.query_start, slots,
                                       resume, batch.query_lens_host, batch.linear_chunks)
        z = z.view(num_tokens, self.num_v_heads, self.v_head_dim)
        out = kernels.rms_norm_gated(out, z, self.norm.weight, self.norm.eps)
        return self.out_proj(out.flatten(1), for_norm=True)


class InProjection(MergedColumnParallelLinear):
    """``GatedDeltaNet``'s input projection: outputs ``[q | k | v | z | b | a]``, each split
    across ranks with its heads. Loaded from Qwen3.5's four tensors (shard ids as
    ``MergedColumnParallelLinear``'s) or Qwen3-Next's two (shard ids ``"qkvz"`` and ``"ba"``),
    whose rows are grouped by key head: per key head its query and key, then the ``r =
    Hv / Hk`` value heads that read that key head and their ``z``; per key head its ``r`` ``b``
    then ``r`` ``a``. Ungrouped, every output is its heads end to end, as Qwen3.5's."""

    def __init__(self, config: Any, tp_rank: int, tp_size: int, kernels: KernelBackend):
        self.num_k_heads = config.linear_num_key_heads
        self.k_head_dim, self.v_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        v_heads = config.linear_num_value_heads
        self.group_v_heads = v_heads // self.num_k_heads
        key_dim, value_dim = self.num_k_heads * self.k_head_dim, v_heads * self.v_head_dim
        super().__init__(config.hidden_size,
                         [key_dim, key_dim, value_dim, value_dim, v_heads, v_heads], bias=False,
                         tp_rank=tp_rank, tp_size=tp_size, kernels=kernels)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | tuple[int, ...] | str | None = None) -> None:
        group_dims = {"qkvz": [self.k_head_dim] * 2 + [self.group_v_heads * self.v_head_dim] * 2,
                      "ba": [self.group_v_heads] * 2}
        if shard_id not in group_dims:
            super().weight_loader(param, loaded, shard_id)
            return
        dims = group_dims[shard_id]
        check_shape(loaded, (self.num_k_heads * sum(dims), param.shape[1]))
        groups = loaded.reshape(self.num_k_heads, sum(dims), param.shape[1]).split(dims, dim=1)
        outputs = (0, 1, 2, 3) if shard_id == "qkvz" else (4, 5)
        super().weight_loader(param, torch.cat([part.flatten(0, 1) for part in groups]), outputs)


class ConvWeight(nn.Module):
    """The depthwise ``conv1d``'s weight, ``[channels on this rank, 1, K]`` as Hugging Face lays
    it out (channels ``[q | k | v]``, each split across ranks with its heads); the kernels
    convolve, with the conv state."""

    def __init__(self, full_sizes: list[int], kernel_size: int, tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = _parameter(row_shards_loader(full_sizes, tp_rank, tp_size),
                                 sum(full_sizes) // tp_size, 1, kernel_size)


def _parameter(weight_loader: Any, *shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = weight_loader
    return param


class HybridDecoderLayer(nn.Module):
    """Full attention (``self_attn``, its cache one layer of the KV cache) or linear attention
    (``linear_attn``, its cache one layer of the state slots), then the MLP (dense, or
    Qwen3.5-MoE's experts)."""

    def __init__(
        self,
        hf_config: Any,
        layer_type: str,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        kernels: KernelBackend,
        tp_rank: int,
        tp_size: int,
        layer_index: int,
    ):
        super().__init__()
        self.is_linear = layer_type == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(hf_config, kernels, tp_rank, tp_size)
        else:
            self.self_attn = Attention(hf_config, options, rotary, kernels, tp_rank, tp_size)
        self.mlp = mlp(hf_config, options, kernels, tp_rank, tp_size, layer_index)
        self.input_layernorm, self.post_attention_layernorm = layer_norms(hf_config, options, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | Unsummed,
        residual: torch.Tensor | None,
        batch: AttentionBatch,
        cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor | Unsummed, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``; ``cache``: a KV-cache layer
        ``[2, ...]``, or a linear layer's ``(conv_states, ssm_states)``."""
        norm = self.input_layernorm
        if self.is_linear:
            projected, residual = self.linear_attn.in_proj.forward_normed(hidden, residual,
                                                                          norm.weight, norm.eps)
            hidden = self.linear_attn(projected, batch, *cache)
        else:
            qkv, residual = self.self_attn.qkv_proj.forward_normed(hidden, residual, norm.weight,
                                                                   norm.eps)
            hidden = self.self_attn(positions, qkv, batch, cache[0], cache[1])
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)


class HybridModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        options: DecoderOptions,
        kernels: KernelBackend,
        max_positions: int,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        config = text_config(hf_config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank=tp_rank, tp_size=tp_size,
                                                   all_reduce=kernels.all_reduce)
        self.rotary = rotary_embedding(config, kernels, max_positions)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, layer_type, options, self.rotary, kernels, tp_rank, tp_size,
                               index)
            for index, layer_type in enumerate(config.layer_types[: config.num_hidden_layers])
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels,
                            options.zero_centred_norms)
        self.attention_layers = [layer for layer in self.layers if not layer.is_linear]
        self.linear_layers = [layer for layer in self.layers if layer.is_linear]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
        states: RecurrentState,
    ) -> torch.Tensor:
        self._check_caches(kv_cache, states, batch)
        attention_caches = iter(kv_cache)
        linear_caches = zip(states.conv.unbind(1), states.ssm.unbind(1))
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            cache = next(linear_caches) if layer.is_linear else next(attention_caches)
            hidden, residual = layer(positions, hidden, residual, batch, cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _check_caches(self, kv_cache: torch.Tensor, states: RecurrentState,
                      batch: AttentionBatch) -> None:
        """Caches sized for another model or tp_size would be silently misread."""
        check_kv_cache(kv_cache, len(self.attention_layers),
                       self.attention_layers[0].self_attn.qkv_proj)
        net = self.linear_layers[0].linear_attn
        conv = (len(self.linear_layers), net.conv_dim, net.conv1d.weight.shape[-1] - 1)
        ssm = (len(self.linear_layers), net.num_v_heads, net.k_head_dim, net.v_head_dim)
        if tuple(states.conv.shape[1:]) != conv or tuple(states.ssm.shape[1:]) != ssm:
            raise ValueError(
                f"the recurrent states must be conv [num_slots, {', '.join(map(str, conv))}] and "
                f"ssm [num_slots, {', '.join(map(str, ssm))}], got conv {list(states.conv.shape)} "
                f"and ssm {list(states.ssm.shape)}")
        if batch.state_slots is None or batch.has_initial_state is None:
            raise ValueError("a hybrid model's batch needs state_slots and has_initial_state")


class HybridCausalLM(CausalLM):
    """``CausalLM`` over a ``HybridModel``, whose ``forward`` takes the state slots too.

    ``mtp_weights``: the checkpoint's multi-token-prediction head (``mtp.*``, unused so far:
    for speculative decoding), name -> tensor, kept in host memory by ``load_weights``."""

    body = HybridModel

    def __init__(
        self,
        hf_config: Any,
        options: DecoderOptions,
        kernels: KernelBackend,
        max_positions: int,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__(hf_config, options, kernels, max_positions, tp_rank, tp_size)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
        states: RecurrentState,
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` int64; ``kv_cache``: the full-attention layers'
        (``ModelShape.kv_cache_shape``); ``states``: every sequence's linear-attention state,
        in the slots ``batch.state_slots`` (read where ``batch.has_initial_state``, then written).

        Returns the final hidden states ``[T, hidden_size]``."""
        return self.model(input_ids, positions, batch, kv_cache, states)
