"""The per-step tensors every attention layer reads, passed explicitly through ``forward``, and
the recurrent state a hybrid model's linear-attention layers carry from step to step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanofn.model.config import RecurrentShape


@dataclass(frozen=True)
class AttentionBatch:
    """Where each token of a flattened batch sits in the paged KV cache.

    A batch is ``B`` sequences whose new tokens are laid end to end (``T`` tokens in all).
    Sequence ``i`` contributes ``query_lens[i]`` new tokens at positions
    ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; its keys and values for positions
    ``0 .. seq_lens[i] - 1`` live in the cache blocks ``block_tables[i]``.

    Contract with the runner: every layer first writes the K/V of all ``T`` tokens to their
    ``slot_mapping`` slots, then attends over the cache. So a sequence may read a block that
    another sequence of the same batch fills in the same step (a prefix cache hit on a block
    scheduled in this very step).
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset; -1 skips the write
    query_start: torch.Tensor  # [B + 1] int32: cumulative query lengths, starting at 0
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_host: tuple[int, ...]  # the same lengths on the host: no device sync to read them
    seq_lens_host: tuple[int, ...]
    decode_only: bool  # every sequence has exactly one new token
    # Triton's prefill work map when a CUDA graph fixes it in advance (its host tuples then
    # describe the capture, not the step): see ``triton_attention.prefill_tile_map``.
    prefill_tiles: torch.Tensor | None = None
    # Decode rows longest context first ([B] int32, a permutation): the order decode attention
    # takes them up in, a hint that does not change the result.
    decode_order: torch.Tensor | None = None
    # Hybrid models only (see ``RecurrentState``): each sequence's state slot ([B] int64), and
    # whether its linear layers resume from that slot ([B] bool): False for a sequence whose
    # first scheduled position is 0, which starts from zeros whatever the slot holds.
    state_slots: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    # A prefill graph's prompt chunks for the chunked delta rule ([C, 2]: sequence, chunk of
    # 64 tokens; padded with chunks of an empty sequence past the batch's), which the eager
    # path derives from ``query_lens_host``.
    linear_chunks: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


@dataclass(frozen=True)
class RecurrentState:
    """A hybrid model's linear-attention state, in slots the runner hands out: one slot holds one
    sequence's state for every linear layer, contiguous, so a whole state is one slice copy.

    A step reads sequence ``i``'s state from slot ``AttentionBatch.state_slots[i]`` (or zeros,
    where ``has_initial_state[i]`` is False) and writes the state after its last new token back
    to the same slot, in place. Shapes are per rank (``nanofn.model.config.RecurrentShape``).
    """

    conv: torch.Tensor  # [num_slots, num_linear_layers, conv_dim, kernel_size - 1], model dtype
    ssm: torch.Tensor  # [num_slots, num_linear_layers, num_v_heads, k_head_dim, v_head_dim]

    @classmethod
    def zeros(cls, shape: RecurrentShape, num_slots: int, dtype: torch.dtype,
              device: torch.device | str) -> RecurrentState:
        """``num_slots`` zeroed slots of ``shape``, the conv state in ``dtype`` (the model's)."""
        return cls(conv=torch.zeros(shape.conv_shape(num_slots), dtype=dtype, device=device),
                   ssm=torch.zeros(shape.ssm_shape(num_slots), dtype=shape.ssm_dtype or dtype,
                                   device=device))
