"""The short causal convolution of a Gated DeltaNet layer, plain-torch references.

Each channel is convolved on its own (depthwise) with a kernel of ``K`` taps over the current
input and the ``K - 1`` before it, and SiLU follows. Across steps a sequence's earlier inputs
come from its conv state, ``conv_states[slot]`` of ``[num_slots, C, K - 1]`` (oldest first, in
the inputs' dtype): read where ``has_initial_state``, zeros otherwise, and overwritten with the
sequence's last ``K - 1`` inputs. ``conv_states`` may be a strided view (one layer of a
``RecurrentState``); the writes go through it, in place. The convolution is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    parts: tuple[int, ...],
) -> list[torch.Tensor]:
    """``silu(conv(x))`` of a flattened batch: sequence ``i``'s new inputs are the rows
    ``query_start[i] : query_start[i + 1]`` of ``x [T, C]``, its state is slot
    ``state_slots[i]``. ``weight`` is ``[C, K]``. Returns the ``[T, C]`` output in ``x``'s dtype
    split into ``parts`` (their channel counts, e.g. ``q``, ``k`` and ``v``), each contiguous:
    flash-linear-attention's chunked kernel reads its inputs contiguous, and would copy views.

    The inputs are laid out again with each sequence's ``K - 1`` earlier inputs before its new
    ones, so that every token's window is ``K`` consecutive rows, and a sequence's new state is
    the last ``K - 1`` rows of its part (state rows still, for one of fewer than ``K - 1`` tokens).
    """
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    num_seqs = state_slots.shape[0]
    starts, ends = query_start[:-1].long(), query_start[1:].long()
    seq_index = torch.arange(num_seqs, device=x.device)
    taps = torch.arange(width + 1, device=x.device)
    tokens = torch.arange(num_tokens, device=x.device)
    token_rows = tokens + width * (torch.searchsorted(ends, tokens, right=True) + 1)
    state_rows = (starts + width * seq_index)[:, None] + taps[:width]  # [B, K - 1]

    extended = x.new_empty(num_tokens + num_seqs * width, channels)
    extended[token_rows] = x
    initial = read_states(conv_states, state_slots, has_initial_state).to(x.dtype)
    extended[state_rows.flatten()] = initial.transpose(1, 2).flatten(0, 1)
    windows = extended[token_rows[:, None] - width + taps]  # [T, K, C]
    out = (windows.float() * weight.float().T).sum(dim=1)
    conv_states[state_slots] = extended[state_rows + (ends - starts)[:, None]].transpose(1, 2).to(
        conv_states.dtype)
    return [part.contiguous() for part in F.silu(out).to(x.dtype).split(parts, dim=-1)]


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """``causal_conv1d`` of one new input a sequence (``x [B, C]``, sequence ``i`` in slot
    ``state_slots[i]``): the decode step, with no host-side values."""
    initial = read_states(conv_states, state_slots, has_initial_state).to(x.dtype)
    window = torch.cat([initial, x[:, :, None]], dim=-1)  # [B, C, K]
    conv_states[state_slots] = window[:, :, 1:].to(conv_states.dtype)
    out = (window.float() * weight.float()).sum(dim=-1)
    return F.silu(out).to(x.dtype)


def read_states(states: torch.Tensor, state_slots: torch.Tensor,
                    has_initial_state: torch.Tensor) -> torch.Tensor:
    """The states of ``state_slots``, zeros where ``has_initial_state`` is False (whatever the
    slot holds, NaN included)."""
    held = states[state_slots]
    keep = has_initial_state.view(-1, *[1] * (held.dim() - 1))
    return torch.where(keep, held, torch.zeros((), dtype=held.dtype, device=held.device))
