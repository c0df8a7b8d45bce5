"""Hypothesis strategies for configurations and requests, sized so that tiny block pools
make preemption and eviction happen all the time."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from nanofn.state import SamplingParams, SchedulerConfig, blocks_for
from nanofn.state.params import StructuredOutputsParams
from properties.fake_runner import EOS

BLOCK_SIZE = 16
MAX_MODEL_LEN = 64
# A few shared prefixes, so that prompts hit each other's blocks in the prefix cache.
PREFIXES = (
    (),
    tuple(range(1, 17)),
    tuple(range(1, 41)),
    tuple(range(5, 38)),
)
GRAMMAR = StructuredOutputsParams(regex="[a-z]+")  # to the core, only a sequence that waits


@dataclass(frozen=True)
class CoreSetup:
    """A scheduler configuration and the size of its KV cache."""

    config: SchedulerConfig
    num_blocks: int


def scheduler_config(**overrides) -> SchedulerConfig:
    """The tests' configuration: blocks of 16 tokens, sequences of up to 64, EOS 0."""
    return SchedulerConfig(**{**dict(
        block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, enable_chunked_prefill=True,
        eos_token_ids=(EOS,), vocab_size=None), **overrides})


@st.composite
def setups(draw, caching=st.booleans(), chunking=st.booleans()) -> CoreSetup:
    chunked = draw(chunking)
    max_num_seqs = draw(st.integers(1, 6))
    low = max_num_seqs if chunked else MAX_MODEL_LEN
    budget = draw(st.integers(low, max(low, 80)))
    blocks_per_seq = blocks_for(MAX_MODEL_LEN, BLOCK_SIZE)
    config = scheduler_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              enable_prefix_caching=draw(caching), enable_chunked_prefill=chunked)
    return CoreSetup(config, draw(st.integers(blocks_per_seq, blocks_per_seq + 8)))


@st.composite
def prompts(draw) -> tuple[int, ...]:
    prefix = draw(st.sampled_from(PREFIXES))
    tail = draw(st.lists(st.integers(1, 39), min_size=0 if prefix else 1, max_size=20))
    prompt = prefix + tuple(tail)
    return prompt[:MAX_MODEL_LEN - 1]


@st.composite
def sampling_params(draw, prompt_len: int) -> SamplingParams:
    room = MAX_MODEL_LEN - prompt_len
    # None: run up to max_model_len. Penalties: the sequence's history goes with every plan, so
    # it is never scheduled with a pending token; nor with a grammar (the shell's matcher masks
    # the next token, which the core never sees).
    max_tokens = draw(st.one_of(st.integers(1, min(room, 24)), st.none()))
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(max_tokens or room, 4))),
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
def requests(draw) -> tuple[tuple[int, ...], SamplingParams]:
    prompt = draw(prompts())
    return prompt, draw(sampling_params(len(prompt)))
