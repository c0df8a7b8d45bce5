"""The eager steps a runner takes at start, so that serving compiles no kernel.

Triton compiles a kernel the first time a process launches it in a new variant: other
constexprs (tiles chosen by a step's size: the experts' tiles by pair count, the GEMVs' rows,
split-K of small GEMMs, decode partitions), or an integer argument that Triton specializes
because it is 1. Decode steps and small prefills replay CUDA graphs, captured at start for
every size they take; but a step that mixes prompts with decodes runs eagerly at any token
count, and the first one of each new variant waited for its compilation: on an H100 the first
Qwen3-30B-A3B standard workload of a fresh machine spent ~2.9 s of its prefill steps compiling
(benchmarks/RESULTS.md, thirty-third session).

So before the graphs are captured the runner takes eager steps of every token count in
``warm_up_token_counts`` (each power of two and the count after it: 1, 2, 3, 4, 5, 8, 9, ...),
and with as many sampled rows (the LM head's and the sampler's launches). Every size-chosen tile
has its thresholds at powers of two, so both sides of each are met.
Where decode steps run eagerly too (no graphs, or more sequences than the largest graph) it
also takes decode steps of the same ladder of batches at powers-of-two contexts (the decode
partitions are chosen from the batch and the block tables' width). The experts' pair and
block counts, which Triton would specialize on divisibility by 16 in combinations no ladder of
sizes meets, are not specialized (``do_not_specialize``). ``tests/test_warm_up.py`` checks that
random steps after the warm-up meet no variant it did not.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanofn.state.config import blocks_for
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, ScheduledSeq, SeqStart, plan_of


def powers_of_two_up_to(most: int, first: int = 1) -> list[int]:
    """``first``, twice it, ... up to ``most``, and ``most`` itself."""
    sizes = []
    size = first
    while size < most:
        sizes.append(size)
        size *= 2
    return sizes + [most]


def warm_up_token_counts(max_num_batched_tokens: int) -> list[int]:
    """Each power of two and the count after it (1, 2, 3, 4, 5, 8, 9, ...), and the limit."""
    counts = set()
    for power in powers_of_two_up_to(max_num_batched_tokens):
        counts |= {power, power + 1}
    return sorted(count for count in counts if count <= max_num_batched_tokens)


def prompt_plan(lens: Sequence[int], block_size: int, num_blocks: int) -> BatchPlan:
    """Whole prompts of ``lens`` tokens, sequence ``i`` in slot ``i`` (and state slot 0), their
    blocks taken in turn from ``num_blocks``."""
    seqs, starts, next_block = [], [], 0
    for i, n in enumerate(lens):
        blocks = tuple((col, (next_block + col) % num_blocks)
                       for col in range(blocks_for(n, block_size)))
        next_block += len(blocks)
        seqs.append(ScheduledSeq(f"warm-up-{i}", i, (0,) * n, 0, True, blocks))
        starts.append(SeqStart(i, f"warm-up-{i}", SamplingParams(), n, state_slot=0))
    return plan_of(0, seqs, starts)


def decode_plan(batch: int, context: int) -> BatchPlan:
    """A decode step of ``batch`` sequences (slots ``0 ...``) at position ``context - 1``;
    their block tables are whatever the warm-up's earlier steps left."""
    seqs = [ScheduledSeq(f"warm-up-{i}", i, (0,), context - 1, True) for i in range(batch)]
    return plan_of(0, seqs)


def warm_up_plans(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  block_size: int, num_blocks: int,
                  eager_decode_batches: Sequence[int] = ()) -> list[BatchPlan]:
    """For each count ``n`` of ``warm_up_token_counts``: ``n`` prompt tokens (in prompts of at
    most ``max_model_len``), and ``n`` prompts of two tokens (``n`` rows for the LM head and
    the sampler) where they fit; then decode steps of each batch of ``eager_decode_batches`` at
    powers-of-two contexts up to ``max_model_len``."""
    plans = []
    for n in warm_up_token_counts(max_num_batched_tokens):
        plans.append(prompt_plan([min(max_model_len, n - start)
                                  for start in range(0, n, max_model_len)], block_size, num_blocks))
        if n <= max_num_seqs and 2 * n <= max_num_batched_tokens:
            plans.append(prompt_plan([2] * n, block_size, num_blocks))
    contexts = powers_of_two_up_to(max_model_len, first=2)
    plans += [decode_plan(batch, context) for batch in eager_decode_batches for context in contexts]
    return plans


def eager_decode_batches(max_num_seqs: int, largest_graph: int | None) -> list[int]:
    """The decode batches (each power of two and the batch after it, and the limit) that run
    eagerly: all of them without graphs (``largest_graph`` None), else those above the
    largest graph's. (An odd batch's positions, laid after its token ids, are not 16-byte
    aligned, which Triton compiles apart.)"""
    smallest = 1 if largest_graph is None else largest_graph + 1
    return [b for b in warm_up_token_counts(max_num_seqs) if b >= smallest]
