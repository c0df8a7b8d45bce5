"""The gated delta rule of a Gated DeltaNet layer, plain-torch references.

Each value head keeps a state ``S`` of ``[Dk, Dv]``, a fast-weight memory from keys to values.
For every token, with ``q`` and ``k`` L2-normalised (and ``q`` scaled by ``Dk ** -0.5``):

    S = exp(g) * S                       decay (g <= 0, the log of the forget gate)
    S = S + k (beta * (v - k^T S))       write the part of v that S does not already predict
    o = q^T S                            read

Grouped heads: value head ``h`` reads query/key head ``h // (Hv // Hk)``, as in transformers.
A sequence's state comes from ``ssm_states[slot]`` (``[num_slots, Hv, Dk, Dv]``) where
``has_initial_state``, zeros otherwise, and the state after its last token goes back there, in
place (``ssm_states`` may be a strided view: one layer of a ``RecurrentState``). Everything is
computed in float32. These references go token by token (all sequences at once); a GPU kernel
would take whole chunks of a sequence at a time (flash-linear-attention's chunked form).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanofn.kernels.causal_conv import causal_conv1d_update, read_states
from nanofn.kernels.norm import rms_norm_gated

L2_NORM_EPS = 1e-6  # flash-linear-attention's and transformers'


def delta_rule_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                     dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's per value head decay, in log space, ``g = -exp(A_log) * softplus(a +
    dt_bias)`` (float32), and write strength ``beta = sigmoid(b)`` (in ``b``'s dtype), from the
    ``a`` and ``b`` projections ``[T, Hv]`` (as transformers computes them)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, torch.sigmoid(b)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_lens_host: tuple[int, ...],
    chunks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The delta rule over a flattened batch: sequence ``i``'s tokens are the rows
    ``query_start[i] : query_start[i + 1]`` of ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``,
    ``g, beta [T, Hv]``; its state is slot ``state_slots[i]``. Returns ``[T, Hv, Dv]`` in ``v``'s
    dtype. ``query_lens_host`` are the same lengths on the host: they bound the loop.
    ``chunks``: a chunked kernel's chunk list, where a CUDA graph fixes it
    (``AttentionBatch.linear_chunks``); this reference goes token by token."""
    num_tokens = v.shape[0]
    starts = query_start[:-1].long()
    lens = query_start[1:].long() - starts
    q, k = _normalised_heads(q, k, v.shape[1])
    state = read_states(ssm_states, state_slots, has_initial_state).float()
    out = v.new_empty(num_tokens + 1, *v.shape[1:], dtype=torch.float32)  # + a row for idle ones
    for offset in range(max(query_lens_host, default=0)):
        active = offset < lens
        token = torch.where(active, starts + offset, num_tokens)
        read = token.clamp(max=num_tokens - 1)
        stepped, read_out = _step(state, q[read], k[read], v[read].float(), g[read].float(),
                                  beta[read].float())
        out[token] = read_out
        state = torch.where(active[:, None, None, None], stepped, state)
    ssm_states[state_slots] = state.to(ssm_states.dtype)
    return out[:num_tokens].to(v.dtype)


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """``gated_delta_rule`` of one token a sequence (row ``i`` of ``q, k [B, Hk, Dk]``,
    ``v [B, Hv, Dv]``, ``g, beta [B, Hv]`` in slot ``state_slots[i]``): the decode step, with no
    host-side values."""
    q, k = _normalised_heads(q, k, v.shape[1])
    state = read_states(ssm_states, state_slots, has_initial_state).float()
    state, out = _step(state, q, k, v.float(), g.float(), beta.float())
    ssm_states[state_slots] = state.to(ssm_states.dtype)
    return out.to(v.dtype)


def gated_delta_net_decode(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """A Gated DeltaNet layer's decode step between its input and output projections, each
    sequence's one token: the causal convolution of ``mixed [B, 2 * Hk * Dk + Hv * Dv]``
    (channels ``[q | k | v]``, conv state in ``conv_states``), the gates from ``a, b [B, Hv]``,
    the delta rule (state in ``ssm_states [num_slots, Hv, Dk, Dv]``), and each head's output
    RMS-normed (``norm_weight``, ``eps``) and gated by ``z [B, Hv * Dv]``; returns ``[B, Hv,
    Dv]`` in ``mixed``'s dtype. The four steps as ``causal_conv1d_update``,
    ``delta_rule_gates``, ``gated_delta_rule_update`` and ``norm.rms_norm_gated`` do them
    (``in_steps``)."""
    return in_steps(causal_conv1d_update, delta_rule_gates, gated_delta_rule_update,
                    rms_norm_gated, mixed, a, b, z, conv_weight, a_log, dt_bias, norm_weight, eps,
                    conv_states, ssm_states, state_slots, has_initial_state)


def in_steps(conv_update: Callable[..., torch.Tensor],
             gates: Callable[..., tuple[torch.Tensor, torch.Tensor]],
             update: Callable[..., torch.Tensor], gated_norm: Callable[..., torch.Tensor],
             mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
             conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
             norm_weight: torch.Tensor, eps: float, conv_states: torch.Tensor,
             ssm_states: torch.Tensor, state_slots: torch.Tensor,
             has_initial_state: torch.Tensor) -> torch.Tensor:
    """``gated_delta_net_decode`` by the four functions given: the convolution, the gates, the
    delta rule, the gated norm."""
    num_seqs = mixed.shape[0]
    num_v_heads, dk, dv = ssm_states.shape[1:]
    key_dim = (mixed.shape[1] - num_v_heads * dv) // 2
    q, k, v = conv_update(mixed, conv_weight, conv_states, state_slots,
                          has_initial_state).split([key_dim, key_dim, num_v_heads * dv], dim=-1)
    g, beta = gates(a, b, a_log, dt_bias)
    out = update(q.view(num_seqs, -1, dk), k.view(num_seqs, -1, dk),
                 v.view(num_seqs, num_v_heads, dv), g, beta, ssm_states, state_slots,
                 has_initial_state)
    return gated_norm(out, z.view(num_seqs, num_v_heads, dv), norm_weight, eps)


def _step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each row ``b`` (``state [B, Hv, Dk, Dv]``): the new state and the output."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + torch.einsum("bhk,bhv->bhkv", k, (v - predicted) * beta[..., None])
    return state, torch.einsum("bhkv,bhk->bhv", state, q)


def _normalised_heads(q: torch.Tensor, k: torch.Tensor,
                      num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` in float32, L2-normalised, one per value head; ``q`` scaled."""
    group = num_v_heads // k.shape[1]
    q, k = (_l2_normalised(x.float()).repeat_interleave(group, dim=1) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)
