"""nanofn's greedy outputs equal transformers' token for token (float32, CPU), whatever the
batching, caching, chunking and preemption."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from nanofn import LLM, SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ARCHS = ["qwen3", "qwen2", "llama", "llama3", "mistral"]


def random_prompts(lengths, seed=0, shared_prefix=()):
    rng = random.Random(seed)
    return [list(shared_prefix) + [rng.randrange(3, 380) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def transformers_greedy(model_dir, prompts, new_tokens=NEW_TOKENS):
    """Greedy continuation, one full forward pass per token: no cache, no batching, no
    generation-config defaults."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def nanofn_greedy(model_dir, prompts, **options):
    options = {"num_kv_blocks": 64, "max_model_len": 256, **options}
    with LLM(str(model_dir), **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.figures()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_of_different_lengths_matches_transformers(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    prompts = random_prompts([5, 17, 40, 63], seed=len(arch))
    expected = transformers_greedy(model_dir, prompts)
    got, _ = nanofn_greedy(model_dir, prompts)
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(prompts), "degenerate model: outputs alike"


@pytest.fixture(scope="module")
def shared_prefix_case(tiny_qwen3):
    prompts = random_prompts([3, 9, 20, 1], seed=7, shared_prefix=random_prompts([37], seed=8)[0])
    return tiny_qwen3, prompts, transformers_greedy(tiny_qwen3, prompts)


@pytest.mark.parametrize("caching", [True, False])
def test_prompts_sharing_a_prefix_with_and_without_prefix_caching(shared_prefix_case, caching):
    model_dir, prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(model_dir, prompts, enable_prefix_caching=caching)
    assert got == expected
    assert (figures.prefix_cache_hit_rate > 0) == caching


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_pool_so_small_that_sequences_are_preempted(shared_prefix_case, async_scheduling):
    model_dir, prompts, expected = shared_prefix_case
    # 5 blocks of 16 tokens hold one sequence of up to 80 tokens: the others must give way.
    got, figures = nanofn_greedy(model_dir, prompts, num_kv_blocks=5, max_model_len=80,
                                 async_scheduling=async_scheduling)
    assert got == expected
    assert figures.num_preemptions > 0


def test_a_token_budget_so_small_that_prefill_is_chunked(shared_prefix_case):
    model_dir, prompts, expected = shared_prefix_case
    got, _ = nanofn_greedy(model_dir, prompts, max_num_batched_tokens=16, max_num_seqs=2,
                           enable_prefix_caching=False)
    assert got == expected


def test_bfloat16_weights_run_on_cpu_too(tiny_qwen3):
    prompts = random_prompts([10, 30], seed=3)
    got, _ = nanofn_greedy(tiny_qwen3, prompts, dtype="bfloat16")
    assert [len(t) for t in got] == [NEW_TOKENS] * 2


def test_tensor_parallel_ranks_give_the_same_tokens(shared_prefix_case):
    """Two ranks (worker process + this one, gloo on the CPU): each holds half the heads and
    half the vocabulary; with a pool small enough to preempt."""
    model_dir, prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(model_dir, prompts, tensor_parallel_size=2, num_kv_blocks=5,
                                 max_model_len=80)
    assert got == expected
    assert figures.num_preemptions > 0
