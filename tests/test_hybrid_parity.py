"""A hybrid model (Qwen3.5: Gated DeltaNet layers beside gated attention, 3:1) through the whole
engine: greedy outputs equal transformers' token for token (float32, CPU), whatever the
batching, the state slots, prefix caching of blocks and saved states, chunking and preemption."""

from __future__ import annotations

import pytest

from test_parity import nanofn_greedy, random_prompts, transformers_greedy

from nanofn import LLM, SamplingParams
from nanofn.state import ScheduledSeq, SeqStart, plan_of


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def shared_prefix_case(hybrid):
    """Prompts behind one 40-token prefix (two and a half blocks), and their expected tokens."""
    prompts = random_prompts([3, 9, 20, 1, 25], seed=11,
                             shared_prefix=random_prompts([40], seed=12)[0])
    return prompts, transformers_greedy(hybrid, prompts)


def test_a_batch_of_different_lengths_matches_transformers(hybrid):
    prompts = random_prompts([5, 17, 40, 63], seed=5)
    expected = transformers_greedy(hybrid, prompts)
    got, figures = nanofn_greedy(hybrid, prompts)
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(prompts), "degenerate model: outputs alike"
    assert figures.state_slots_total > 0 and figures.state_slots_working == 0


def test_the_vision_language_checkpoint_generates_as_transformers(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_5-vl")
    prompts = random_prompts([7, 30], seed=6)
    got, _ = nanofn_greedy(model_dir, prompts)
    assert got == transformers_greedy(model_dir, prompts)
    with LLM(str(model_dir), num_kv_blocks=16, max_model_len=128) as llm:
        with pytest.raises(ValueError, match="multi_modal_data .* not supported"):
            llm.generate([{"prompt": "Describe it", "multi_modal_data": {"image": object()}}])
        with pytest.raises(ValueError, match="text only"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64,"}}]}])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_cache_so_small_that_sequences_are_preempted(hybrid, shared_prefix_case,
                                                        async_scheduling):
    """5 blocks hold one sequence of 80 tokens, 3 state slots one working state and two saved
    ones: sequences give way, and resume from the prefix cache."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(hybrid, prompts, num_kv_blocks=5, max_model_len=80,
                                 num_state_slots=3, async_scheduling=async_scheduling)
    assert got == expected
    assert figures.num_preemptions > 0


def test_tiny_budgets_chunk_prompts_that_hit_the_cache(hybrid, shared_prefix_case):
    """16 tokens a step: every prompt is computed in chunks, and the later ones start from the
    shared prefix's blocks and the state saved where the prefix ends."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(hybrid, prompts, max_num_batched_tokens=16, max_num_seqs=2)
    assert got == expected
    assert figures.prefix_cache_hit_rate > 0


def test_prompts_one_after_another_start_from_saved_states(hybrid, shared_prefix_case):
    """Each later prompt restores the state saved at the end of the prefix it shares (its
    plan copies it into the sequence's slot) and computes only its own tokens."""
    prompts, expected = shared_prefix_case
    greedy = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    restores = []
    with LLM(str(hybrid), num_kv_blocks=64, max_model_len=256) as llm:
        launch = llm.engine.runner.launch

        def counting_launch(plan, *args):
            restores.extend(plan.state_restores)
            return launch(plan, *args)

        llm.engine.runner.launch = counting_launch
        got = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
               .outputs[0].token_ids for p in prompts]
        cached = llm.engine.state.counters.num_cached_tokens
    assert got == expected
    assert restores and cached >= 32 * (len(prompts) - 1)


def test_two_tensor_parallel_ranks_give_the_same_tokens(hybrid, shared_prefix_case):
    """Two ranks (gloo on the CPU) split the linear-attention heads and their states."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(hybrid, prompts, tensor_parallel_size=2, num_kv_blocks=5,
                                 max_model_len=80, num_state_slots=3)
    assert got == expected
    assert figures.num_preemptions > 0


@pytest.mark.parametrize("state_slot", [-1, 5])
def test_a_plan_that_starts_a_sequence_without_a_state_slot_is_refused(hybrid, state_slot):
    """A hand-made plan (a test's, a replayed trace's) that starts a hybrid model's sequence
    without a state slot, or past the states, is an error naming it: -1 would read and write
    the padding's spare state, a slot past them any memory (on a GPU, an illegal access)."""
    with LLM(str(hybrid), num_kv_blocks=8, max_model_len=64, num_state_slots=5) as llm:
        seq = ScheduledSeq("s", 0, (5, 6, 7), 0, True, ((0, 0),))
        started = [SeqStart(0, "s", SamplingParams(temperature=0), 3, state_slot)]
        with pytest.raises(ValueError, match=rf"state slots in \[0, 5\), got \{{'s': {state_slot}"):
            llm.engine.runner.forward(plan_of(0, [seq], started))
        started = [SeqStart(0, "s", SamplingParams(temperature=0), 3, 4)]
        logits, _ = llm.engine.runner.forward(plan_of(0, [seq], started))
        assert logits.shape[0] == 1 and logits.isfinite().all()
