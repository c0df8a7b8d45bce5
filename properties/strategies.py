"""Hypothesis strategies for configurations and requests, sized so that tiny block pools
make preemption and eviction happen all the time."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from nanofn.state import SamplingParams, SchedulerConfig, blocks_for
from nanofn.state.params import StructuredOutputsParams
from nanofn.state.store import MIN_WIDTH
from properties.fake_runner import EOS

BLOCK_SIZE = 16
MAX_MODEL_LEN = 64  # the usual limit; setups also draw a longer one
# A limit past the store's minimum row width, so that rows of tokens must widen (twice).
LONG_MAX_MODEL_LEN = 2 * MIN_WIDTH + 32
WEAK_HASH = 16  # the distinct block hashes of a setup with a weak hash
# A few shared prefixes, so that prompts hit each other's blocks in the prefix cache. Prompts
# behind the last one fall on either side of the store's minimum row width: their rows widen
# when they are admitted or as they decode.
PREFIXES = (
    (),
    tuple(range(1, 17)),
    tuple(range(1, 41)),
    tuple(range(5, 38)),
    tuple(range(1, 40)) + tuple(range(39, 28, -1)),
)
GRAMMAR = StructuredOutputsParams(regex="[a-z]+")  # to the core, only a sequence that waits


@dataclass(frozen=True)
class CoreSetup:
    """A scheduler configuration, the size of its KV cache, and the block hash: with
    ``weak_hash`` set, block hashes take only that many values (``driver.block_hashing``), so
    that different blocks often share a hash. With ``num_state_slots``, the model is a
    hybrid's, whose sequences need a recurrent-state slot each (the fake device's model then
    reads a state that stands for the whole prefix)."""

    config: SchedulerConfig
    num_blocks: int
    weak_hash: int | None = None
    num_state_slots: int | None = None


def scheduler_config(**overrides) -> SchedulerConfig:
    """The tests' configuration: blocks of 16 tokens, sequences of up to 64, EOS 0."""
    return SchedulerConfig(**{**dict(
        block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, enable_chunked_prefill=True,
        eos_token_ids=(EOS,), vocab_size=None), **overrides})


# A hybrid model's state slots, half the time: as few as one (admissions wait for slots, and
# restores evict the state they start from), or more than the sequences (saved states stay).
STATE_SLOTS = st.one_of(st.none(), st.integers(1, 8))


@st.composite
def setups(draw, caching=st.booleans(), chunking=st.booleans(),
           hybrid=STATE_SLOTS) -> CoreSetup:
    max_model_len = draw(st.sampled_from([MAX_MODEL_LEN, LONG_MAX_MODEL_LEN]))
    chunked = draw(chunking)
    max_num_seqs = draw(st.integers(1, 6))
    low = max_num_seqs if chunked else max_model_len
    budget = draw(st.integers(low, max(low, 80)))
    blocks_per_seq = blocks_for(max_model_len, BLOCK_SIZE)
    prefix_caching = draw(caching)
    config = scheduler_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                              enable_chunked_prefill=chunked)
    weak_hash = draw(st.sampled_from([None, WEAK_HASH])) if prefix_caching else None
    spare_blocks = draw(st.integers(0, 8) | st.integers(0, 2))  # (tight pools preempt more)
    return CoreSetup(config, blocks_per_seq + spare_blocks, weak_hash, draw(hybrid))


@st.composite
def prompts(draw, max_model_len: int) -> tuple[int, ...]:
    prefix = draw(st.sampled_from(PREFIXES))
    tail = draw(st.lists(st.integers(1, 39), min_size=0 if prefix else 1, max_size=20))
    prompt = prefix + tuple(tail)
    return prompt[:max_model_len - 1]


def output_limits(room: int, max_model_len: int):
    """Mostly up to a third of ``max_model_len`` tokens (at least 24: with the longer limit,
    decoding often takes a row of the store past its width); now and then None (up to
    ``max_model_len``)."""
    limits = st.integers(1, min(room, max(24, max_model_len // 3)))
    return st.one_of(limits, limits, st.none())


@st.composite
def sampling_params(draw, prompt_len: int, max_model_len: int,
                    plain: bool | None = None) -> SamplingParams:
    """Plain ones (the plain decode step takes those: nothing to do on the host) if ``plain``,
    else any mix of what the core handles; half and half if ``plain`` is None."""
    limit = draw(output_limits(max_model_len - prompt_len, max_model_len))
    if plain or (plain is None and draw(st.booleans())):
        return SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=draw(st.booleans()))
    # Penalties: the sequence's history goes with every plan, so it is never scheduled with a
    # pending token; nor with a grammar (the shell's matcher masks the next token, which the
    # core never sees).
    return SamplingParams(
        temperature=0.0,
        max_tokens=limit,
        min_tokens=draw(st.integers(0, min(limit or max_model_len - prompt_len, 16))),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(1, 39), max_size=1)),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.0, 1.2])),
        # Bad words need the history too; prompt logprobs keep a request off the prefix cache.
        bad_words_token_ids=draw(st.lists(st.tuples(st.integers(1, 39)) | st.tuples(
            st.integers(1, 39), st.integers(1, 39)), max_size=2)),
        prompt_logprobs=draw(st.sampled_from([None, None, None, 1])),
        structured_outputs=draw(st.sampled_from([None, None, None, GRAMMAR])),
    )


@st.composite
def requests(draw, max_model_len: int = MAX_MODEL_LEN,
             plain: bool | None = None) -> tuple[tuple[int, ...], SamplingParams]:
    prompt = draw(prompts(max_model_len))
    return prompt, draw(sampling_params(len(prompt), max_model_len, plain))


def workloads(max_model_len: int, max_size: int = 10):
    """``(arrival step, prompt, params)`` lists."""
    return st.lists(st.tuples(st.integers(0, 8), requests(max_model_len)), min_size=1,
                    max_size=max_size).map(
        lambda items: [(arrival, prompt, params) for arrival, (prompt, params) in items])
