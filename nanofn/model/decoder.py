"""One decoder-only transformer covering Qwen3, Qwen3-MoE (its sparse MLP in ``moe.py``),
Qwen2/Qwen2.5, Llama 3.x and Mistral checkpoints, and the attention layers and MLPs of Qwen3.5,
Qwen3.5-MoE and Qwen3-Next (whose other layers are in ``hybrid.py``).

The architectures differ only in the switches of ``DecoderOptions``. Module and parameter names
follow Hugging Face's, except the fused ``qkv_proj`` and ``gate_up_proj`` (see ``loader.py``).
Everything a step needs comes in through ``forward``'s arguments and every kernel but the
embedding lookup and the LM head through the ``KernelBackend`` given at construction: no global
context. A decoder layer runs each norm together with the projection after it (the backend may
fuse the two), and the MLP's activation together with its gate-up projection. The projections
whose output only a norm reads (``o_proj``, ``down_proj``) may hand it over as ``PartialSums``
for the norm to add up (``nanofn/kernels/linear.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanofn.kernels import KernelBackend
from nanofn.kernels.activation import Unactivated
from nanofn.kernels.partial_sums import Unsummed
from nanofn.model.batch import AttentionBatch
from nanofn.model.config import head_dim, num_kv_heads, rope_settings, rotary_dim, text_config
from nanofn.model.layers import RMSNorm, RotaryEmbedding
from nanofn.model.moe import SharedExpertMoeBlock, SparseMoeBlock, is_sparse_layer
from nanofn.model.quantization import Fp8Scheme
from nanofn.model.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class DecoderOptions:
    """Where the supported architectures differ, and how the checkpoint stores projections."""

    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMS norm of each query and key head before the rotary embedding (Qwen3)
    output_gate: bool = False  # attention output times sigmoid(a gate from q_proj) (Qwen3.5)
    # Norms scaling by 1 + w (Qwen3.5): loaded as 1 + w (``parallel.load_zero_centred``)
    zero_centred_norms: bool = False
    # A sparse MLP (router and experts) on the layers ``moe.is_sparse_layer`` picks (Qwen3-MoE),
    # with a shared expert where the config sizes one (Qwen3.5-MoE)
    sparse_moe: bool = False
    # The attention and MLP projections in FP8 (``quantization.py``), else None
    fp8: Fp8Scheme | None = None
    # Under tensor parallelism, whole experts a rank (``moe.StackedExperts``), not a share of
    # every expert
    expert_parallel: bool = False


def _qwen3_options(hf_config: Any) -> DecoderOptions:
    bias = getattr(hf_config, "attention_bias", False)
    return DecoderOptions(qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True)


def _qwen3_moe_options(hf_config: Any) -> DecoderOptions:
    bias = getattr(hf_config, "attention_bias", False)
    return DecoderOptions(qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True,
                          sparse_moe=True)


def _qwen2_options(hf_config: Any) -> DecoderOptions:
    return DecoderOptions(qkv_bias=True, o_proj_bias=False, mlp_bias=False, qk_norm=False)


def _llama_options(hf_config: Any) -> DecoderOptions:
    """Llama and Mistral: Mistral configs carry no bias switches, so they read as False."""
    bias = getattr(hf_config, "attention_bias", False)
    return DecoderOptions(
        qkv_bias=bias, o_proj_bias=bias, mlp_bias=getattr(hf_config, "mlp_bias", False), qk_norm=False
    )


def _qwen3_5_options(hf_config: Any) -> DecoderOptions:
    """Qwen3.5's full-attention layers; its linear-attention layers are ``hybrid.py``'s."""
    bias = getattr(text_config(hf_config), "attention_bias", False)
    return DecoderOptions(qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True,
                          output_gate=True, zero_centred_norms=True)


def _qwen3_5_moe_options(hf_config: Any) -> DecoderOptions:
    """Qwen3.5's, with experts (and a shared expert) on the layers ``moe.is_sparse_layer``
    picks: every one for Qwen3.5-MoE, for Qwen3-Next as its config says."""
    return dataclasses.replace(_qwen3_5_options(hf_config), sparse_moe=True)


# Every architecture nanofn loads; those whose config has linear-attention layers are built as
# hybrid models (``loader.build_model``).
ARCHITECTURES: dict[str, Callable[[Any], DecoderOptions]] = {
    "Qwen3ForCausalLM": _qwen3_options,
    "Qwen3MoeForCausalLM": _qwen3_moe_options,
    "Qwen2ForCausalLM": _qwen2_options,
    "LlamaForCausalLM": _llama_options,
    "MistralForCausalLM": _llama_options,
    "Qwen3_5ForCausalLM": _qwen3_5_options,
    "Qwen3_5ForConditionalGeneration": _qwen3_5_options,  # its language model; vision skipped
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe_options,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe_options,
    "Qwen3NextForCausalLM": _qwen3_5_moe_options,  # the same layers; its own checkpoint names
}


def decoder_options(hf_config: Any) -> DecoderOptions:
    """The options of the config's architecture; a ValueError lists the supported ones."""
    names = getattr(hf_config, "architectures", None) or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name](hf_config)
    raise ValueError(
        f"unsupported architecture {', '.join(names) or '(none given in config)'}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


class Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        kernels: KernelBackend,
        tp_rank: int,
        tp_size: int,
    ):
        super().__init__()
        hf_config = text_config(hf_config)
        dim = head_dim(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            dim,
            hf_config.num_attention_heads,
            num_kv_heads(hf_config),
            bias=options.qkv_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kernels=kernels,
            output_gate=options.output_gate,
            fp8=options.fp8,
        )
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * dim,
            hf_config.hidden_size,
            bias=options.o_proj_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kernels=kernels,
            fp8=options.fp8,
        )
        # Qwen3's per-head norms: weight holders here, applied inside the rotary kernel.
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(dim, hf_config.rms_norm_eps, kernels,
                                                options.zero_centred_norms) for _ in range(2))
        self.output_gate = options.output_gate
        self.rotary = rotary
        self.kernels = kernels
        self.head_dim = dim
        self.scale = dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor | Unsummed:
        """Attention of the tokens whose ``qkv_proj`` output is ``qkv`` (``DecoderLayer`` runs the
        projection, with the norm before it), through ``o_proj``; with the output gate, the
        attention times ``sigmoid(gate)`` first."""
        qkv_proj = self.qkv_proj
        q, k, v = qkv.split([qkv_proj.q_size, qkv_proj.kv_size, qkv_proj.kv_size], dim=-1)
        if self.output_gate:  # per head [query | gate]
            q, gate = q.unflatten(-1, (qkv_proj.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = q.view(-1, qkv_proj.num_heads, self.head_dim)
        k = k.view(-1, qkv_proj.num_kv_heads, self.head_dim)
        v = v.view(-1, qkv_proj.num_kv_heads, self.head_dim)
        if batch.decode_only:
            out = self.rotary.decode_attention(positions, q, k, v, k_cache, v_cache, batch,
                                               self.scale, self.q_norm, self.k_norm)
        else:
            q = self.rotary(positions, q, k, v, k_cache, v_cache, batch.slot_mapping, self.q_norm,
                            self.k_norm)
            out = self.kernels.prefill_attention(
                q,
                k_cache,
                v_cache,
                batch.query_start,
                batch.seq_lens,
                batch.block_tables,
                batch.query_lens_host,
                batch.seq_lens_host,
                self.scale,
                tiles=batch.prefill_tiles,
            )
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(1), for_norm=True)


class MLP(nn.Module):
    """The gated MLP: the config's ``intermediate_size``, or ``intermediate_size`` where given
    (a shared expert's)."""

    def __init__(
        self, hf_config: Any, options: DecoderOptions, kernels: KernelBackend, tp_rank: int,
        tp_size: int, intermediate_size: int | None = None,
    ):
        super().__init__()
        hf_config = text_config(hf_config)
        hidden = hf_config.hidden_size
        intermediate = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=options.mlp_bias, tp_rank=tp_rank, tp_size=tp_size,
            kernels=kernels, fp8=options.fp8,
        )
        self.down_proj = RowParallelLinear(
            intermediate, hidden, bias=options.mlp_bias, tp_rank=tp_rank, tp_size=tp_size, kernels=kernels,
            fp8=options.fp8,
        )

    def forward(self, activated: torch.Tensor | Unactivated) -> torch.Tensor | Unsummed:
        """The MLP's output from its activation ``silu(gate) * up`` (``DecoderLayer`` runs
        ``gate_up_proj`` with the norm before it and the activation after it, or leaves the
        activation ``Unactivated`` for ``down_proj``'s kernel): its down projection."""
        return self.down_proj(activated, for_norm=True)

    def forward_normed(self, hidden: torch.Tensor | Unsummed, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor | Unsummed, torch.Tensor]:
        """``(self(activation), hidden + residual)``: the norm before the MLP fused into
        ``gate_up_proj`` with the activation after it."""
        activated, residual = self.gate_up_proj.forward_normed(hidden, residual, norm.weight,
                                                               norm.eps, gated=True)
        return self(activated), residual


class DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        options: DecoderOptions,
        rotary: RotaryEmbedding,
        kernels: KernelBackend,
        tp_rank: int,
        tp_size: int,
        layer_index: int,
    ):
        super().__init__()
        self.self_attn = Attention(hf_config, options, rotary, kernels, tp_rank, tp_size)
        self.mlp = mlp(hf_config, options, kernels, tp_rank, tp_size, layer_index)
        self.input_layernorm, self.post_attention_layernorm = layer_norms(hf_config, options, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | Unsummed,
        residual: torch.Tensor | None,
        batch: AttentionBatch,
        layer_kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor | Unsummed, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``: the next norm adds them."""
        attention, norm = self.self_attn, self.input_layernorm
        qkv, residual = attention.qkv_proj.forward_normed(hidden, residual, norm.weight, norm.eps)
        hidden = attention(positions, qkv, batch, layer_kv_cache[0], layer_kv_cache[1])
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)


def mlp(hf_config: Any, options: DecoderOptions, kernels: KernelBackend, tp_rank: int,
        tp_size: int, layer_index: int) -> MLP | SparseMoeBlock:
    """The layer's MLP: the sparse one where the architecture has experts on this layer, with a
    shared expert where the config sizes one."""
    if not (options.sparse_moe and is_sparse_layer(hf_config, layer_index)):
        return MLP(hf_config, options, kernels, tp_rank, tp_size)
    shared_size = getattr(text_config(hf_config), "shared_expert_intermediate_size", 0)
    if not shared_size:
        return SparseMoeBlock(hf_config, kernels, tp_rank, tp_size, options.expert_parallel,
                              options.fp8)
    shared_expert = MLP(hf_config, options, kernels, tp_rank, tp_size, shared_size)
    return SharedExpertMoeBlock(hf_config, shared_expert, kernels, tp_rank, tp_size,
                                options.expert_parallel, options.fp8)


def layer_norms(hf_config: Any, options: DecoderOptions,
                kernels: KernelBackend) -> tuple[RMSNorm, RMSNorm]:
    """A decoder layer's input and post-attention norms."""
    config = text_config(hf_config)
    return tuple(RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, options.zero_centred_norms)
                 for _ in range(2))


def rotary_embedding(hf_config: Any, kernels: KernelBackend, max_positions: int) -> RotaryEmbedding:
    """The rotary table every attention layer shares (of the rotated dims alone, where partial)."""
    rope_theta, rope_scaling = rope_settings(hf_config)
    return RotaryEmbedding(rotary_dim(hf_config), max_positions, rope_theta, rope_scaling, kernels)


class DecoderModel(nn.Module):
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
        hf_config = text_config(hf_config)
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, tp_rank=tp_rank, tp_size=tp_size,
            all_reduce=kernels.all_reduce,
        )
        self.rotary = rotary_embedding(hf_config, kernels, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, options, self.rotary, kernels, tp_rank, tp_size, index)
            for index in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        check_kv_cache(kv_cache, len(self.layers), self.layers[0].self_attn.qkv_proj)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, layer_kv_cache in zip(self.layers, kv_cache):
            hidden, residual = layer(positions, hidden, residual, batch, layer_kv_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def check_kv_cache(kv_cache: torch.Tensor, num_layers: int, qkv_proj: QKVParallelLinear) -> None:
    """A cache sized for another tp_size would be silently misread by the attention kernels."""
    expected = (num_layers, 2, qkv_proj.num_kv_heads, qkv_proj.head_dim)
    found = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[-2:])
    if kv_cache.dim() != 6 or found != expected:
        raise ValueError(
            f"kv_cache must be [num_layers={expected[0]}, 2, num_blocks, block_size, "
            f"kv_heads={expected[2]}, head_dim={expected[3]}], got {list(kv_cache.shape)}"
        )


class CausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` projects the ones to sample."""

    body: type[nn.Module] = DecoderModel  # the model under the LM head

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
        self.model = self.body(hf_config, options, kernels, max_positions, tp_rank, tp_size)
        config = text_config(hf_config)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size,
            project=kernels.linear,
        )
        # The model's own config says (a composite's, not its text part's), as in transformers.
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[T]`` int64; ``kv_cache``: see ``ModelShape.kv_cache_shape``.

        Returns the final hidden states ``[T, hidden_size]``.
        """
        return self.model(input_ids, positions, batch, kv_cache)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``[N, vocab_size]`` logits, the full vocabulary on every rank: float32, or with
        ``upcast=False`` the model's dtype (for a kernel that reads them in float32 itself)."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits
