"""A yardstick for ``scheduler.py``: the mutable-object scheduler design of nano-vllm (one
mutable ``Sequence`` per request with a token list and a block table, a block manager with
reference counts, a free deque and a hash -> block dict, running and waiting deques, every
decode step a Python loop over the running sequences), written here for this benchmark.

It does what the pure core does per decode step: append each sampled token and check EOS and
``max_tokens``, give a sequence a block when it crosses a block boundary, hash a block when it
fills (prefix caching), free the blocks of finished sequences, admit waiting ones (in the same
step, as the pure core does; nano-vllm itself runs a prefill-only step when some wait). Measured in
the same run as the pure core, on the same workload, it calibrates the machine.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash


def _hash(parent: int, tokens: list[int]) -> int:
    h = xxhash.xxh64()
    h.update(parent.to_bytes(8, "little"))
    h.update(np.array(tokens).tobytes())
    return h.intdigest()


class Sequence:
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "max_tokens", "block_table",
                 "num_computed", "finished")

    def __init__(self, seq_id: str, prompt: list[int], max_tokens: int):
        self.seq_id = seq_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.block_table: list[int] = []
        self.num_computed = 0
        self.finished = False

    def __len__(self) -> int:
        return len(self.token_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hash = [-1] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free = deque(range(num_blocks))

    def _take(self) -> int:
        block = self.free.popleft()
        old = self.block_hash[block]
        if old != -1 and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_hash[block] = -1
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence) -> None:
        bs, parent = self.block_size, 0
        for i in range(-(-len(seq) // bs)):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            full = len(tokens) == bs
            h = _hash(parent, tokens) if full else -1
            block = self.hash_to_block.get(h, -1) if full else -1
            if block != -1 and self.ref_counts[block] > 0:
                self.ref_counts[block] += 1
            else:
                block = self._take()
                if full:
                    self.block_hash[block] = h
                    self.hash_to_block[h] = block
            seq.block_table.append(block)
            parent = h

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        """Give ``seq`` a block for its newest token if it starts one; hash the block it fills."""
        bs = self.block_size
        if len(seq) % bs == 1:
            seq.block_table.append(self._take())
        elif len(seq) % bs == 0:
            block = seq.block_table[-1]
            parent = self.block_hash[seq.block_table[-2]] if len(seq.block_table) > 1 else 0
            h = _hash(parent, seq.token_ids[-bs:])
            self.block_hash[block] = h
            self.hash_to_block[h] = block

    def deallocate(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        seq.block_table.clear()


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, eos: int):
        self.blocks = BlockManager(num_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.eos = eos
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Sequence]:
        """The running sequences' decode, then the admission of waiting ones in the same step
        (nano-vllm runs a prefill-only step when some wait; mixed steps do the same work as the
        pure core's)."""
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        done = []
        for seq, token in zip(seqs, token_ids):
            seq.token_ids.append(token)
            if token == self.eos or len(seq) - seq.num_prompt_tokens == seq.max_tokens:
                seq.finished = True
                self.blocks.deallocate(seq)
                self.running.remove(seq)
                done.append(seq)
        return done
