"""A hybrid model (Qwen3.5) on a GPU: bf16 greedy tokens and prompt logprobs against
transformers, CUDA graphs against eager, the linear-attention kernels against their torch
references at Qwen3.5-9B's shapes (flash-linear-attention's chunked delta rule among them),
and preemption with the prefix cache. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import transformers

from nanofn import LLM, SamplingParams
from nanofn.kernels import causal_conv, delta_rule, triton_linear_attention as linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5")


def prompts_for(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (7, 33, 70, 150)]


@torch.inference_mode()
def hf_greedy_and_logprobs(model_dir, prompt: list[int]):
    """transformers' bf16 greedy continuation, the float32 and bf16 logprobs of the whole
    sequence's tokens (teacher-forced), and the full log-softmax rows in both dtypes."""
    models = {dtype: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
              .cuda() for dtype in (torch.bfloat16, torch.float32)}
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(NEW_TOKENS):
        ids = torch.cat([ids, models[torch.bfloat16](ids).logits[:, -1].argmax(-1, keepdim=True)],
                        dim=1)
    targets = ids[0, 1:]
    logprobs = {dtype: model(ids).logits[0, :-1].float().log_softmax(-1) for dtype, model
                in models.items()}
    chosen = {dtype: lp.gather(-1, targets[:, None])[:, 0] for dtype, lp in logprobs.items()}
    return ids[0, len(prompt):].tolist(), chosen, logprobs


def test_bf16_greedy_tokens_and_prompt_logprobs_match_transformers(hybrid):
    check_bf16_tokens_and_prompt_logprobs(hybrid)


def check_bf16_tokens_and_prompt_logprobs(model_dir) -> None:
    """nanofn's bf16 greedy tokens are transformers' but where its best two are within
    rounding, and its prompt logprobs as close to float32's as transformers' bf16 ones.

    "Within rounding": their gap at most 0.1, or at most twice what rounding to bf16 moves it
    by in transformers itself (float32 against bf16 at that position). A mixture of experts
    needs the second: a token whose router scores two experts within rounding takes either, and
    the output moves by far more than a dense layer's rounding."""
    prompts = prompts_for(3)
    with LLM(str(model_dir), dtype="bfloat16", gpu_memory_utilization=0.3,
             max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            expected, chosen, rows = hf_greedy_and_logprobs(model_dir, prompt)
            tokens = prompt + expected
            scored = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(
                max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
            ours = torch.tensor([entry[token].logprob for entry, token
                                 in zip(scored[1:], tokens[1:])], device="cuda")
            exact, rounded = chosen[torch.float32], chosen[torch.bfloat16]
            # nanofn is about as far from the float32 logprobs as transformers' bf16 run is
            noise = (rounded - exact).norm() / exact.norm()
            error = (ours - exact).norm() / exact.norm()
            assert error <= 2 * noise + 1e-3, (float(error), float(noise), len(prompt))
            got = out.outputs[0].token_ids
            i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            if i is not None:  # only where the reference's best two are within rounding
                position = len(prompt) - 1 + i
                best_two = rows[torch.bfloat16][position].topk(2).indices
                gaps = {dtype: float(row[position][best_two[0]] - row[position][best_two[1]])
                        for dtype, row in rows.items()}
                rounding = abs(gaps[torch.bfloat16] - gaps[torch.float32])
                assert gaps[torch.bfloat16] <= max(0.1, 2 * rounding), (i, gaps)


def run(model_dir, prompts, **options):
    options = {"dtype": "float32", "gpu_memory_utilization": 0.3, "max_model_len": 512, **options}
    with LLM(str(model_dir), **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.figures()


def test_cuda_graphs_give_the_eager_tokens(hybrid):
    """12 sequences padded to a graph of 16: the padding rows work in the spare state slot,
    none of theirs."""
    prompts = prompts_for(5) * 3
    graphs, _ = run(hybrid, prompts)
    eager, _ = run(hybrid, prompts, enforce_eager=True)
    assert graphs == eager


def test_preemption_chunks_and_prefix_hits_give_the_roomy_run_s_tokens(hybrid):
    shared = prompts_for(6)[2]
    prompts = [shared + p[:9] for p in prompts_for(7)] * 2
    roomy, _ = run(hybrid, prompts)
    tight, figures = run(hybrid, prompts, num_kv_blocks=16, max_model_len=256,
                         num_state_slots=4, max_num_batched_tokens=64, max_num_seqs=4)
    assert tight == roomy
    assert figures.num_preemptions > 0 and figures.prefix_cache_hit_rate > 0


# --- the kernels at Qwen3.5-9B's shapes, bf16 ------------------------------------------------

K_HEADS, V_HEADS, HEAD_DIM, CHANNELS, WIDTH = 16, 32, 128, 2 * 16 * 128 + 32 * 128, 3
LENGTHS = [1, 37, 300, 64]  # one token, one under a chunk, several chunks, exactly one


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def state_slots(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    states = torch.randn(6, 3, *shape, generator=g, device="cuda").to(dtype)
    states[0] = float("nan")  # the fresh sequence's slot: must not leak
    return states


SLOTS = [3, 0, 5, 1]  # the batch's sequences' slots, out of order
INITIAL = [True, False, True, True]  # the second starts from zeros


def slots_and_initial() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(SLOTS, device="cuda"), torch.tensor(INITIAL, device="cuda")


def query_start() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def test_the_convolution_kernels_match_their_references():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(LENGTHS), CHANNELS, generator=g, device="cuda").bfloat16()
    weight = torch.randn(CHANNELS, WIDTH + 1, generator=g, device="cuda").bfloat16() * 0.5
    states = state_slots((CHANNELS, WIDTH), torch.bfloat16)
    expected_states = states.clone()
    slots, initial = slots_and_initial()
    parts = (CHANNELS // 4, CHANNELS // 4, CHANNELS // 2)
    expected = causal_conv.causal_conv1d(x, weight, expected_states[:, 1], query_start(), slots,
                                         initial, parts)
    got = linear.causal_conv1d(x, weight, states[:, 1], query_start(), slots, initial, parts)
    assert relative_error(torch.cat(got, 1), torch.cat(expected, 1)) < 1e-2
    assert torch.equal(states.isnan(), expected_states.isnan())
    assert relative_error(states.nan_to_num(), expected_states.nan_to_num()) < 1e-2
    step = x[:4]
    expected = causal_conv.causal_conv1d_update(step, weight, expected_states[:, 1], slots, initial)
    got = linear.causal_conv1d_update(step, weight, states[:, 1], slots, initial)
    assert relative_error(got, expected) < 1e-2
    assert relative_error(states.nan_to_num(), expected_states.nan_to_num()) < 1e-2


def delta_inputs(num_tokens: int):
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    q, k = (torch.randn(num_tokens, K_HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
            for _ in range(2))
    v = torch.randn(num_tokens, V_HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    g_ = -torch.rand(num_tokens, V_HEADS, generator=g, device="cuda") * 0.3
    beta = torch.rand(num_tokens, V_HEADS, generator=g, device="cuda").bfloat16()
    return q, k, v, g_, beta


def test_the_delta_rule_kernels_match_their_references():
    """Prompt chunks through flash-linear-attention's chunked kernel, a decode step through
    nanofn's: outputs and the float32 states written back into their slots."""
    states = state_slots((V_HEADS, HEAD_DIM, HEAD_DIM), torch.float32) * 0.1
    expected_states = states.clone()
    slots, initial = slots_and_initial()
    inputs = delta_inputs(sum(LENGTHS))
    expected = delta_rule.gated_delta_rule(*inputs, expected_states[:, 1], query_start(), slots,
                                           initial, tuple(LENGTHS))
    got = linear.fla_delta_rule(*inputs, states[:, 1], query_start(), slots, initial,
                                tuple(LENGTHS))
    assert relative_error(got, expected) < 2e-2
    assert relative_error(states.nan_to_num(), expected_states.nan_to_num()) < 1e-2
    step = delta_inputs(4)
    expected = delta_rule.gated_delta_rule_update(*step, expected_states[:, 1], slots, initial)
    got = linear.gated_delta_rule_update(*step, states[:, 1], slots, initial)
    assert relative_error(got, expected) < 1e-2
    assert relative_error(states.nan_to_num(), expected_states.nan_to_num()) < 1e-2


@pytest.mark.parametrize("num_seqs", [4, linear.FUSED_DECODE_FROM + 3],
                         ids=["four-kernels", "one-launch"])
def test_a_layer_s_decode_step_matches_its_reference(num_seqs):
    """The convolution, the gates, the delta rule and the gated norm of a decode step from the
    projection's strided columns, at Qwen3.5-9B's head sizes: as four kernels for a few
    sequences, in one launch for many; outputs and both states in their slots (a fresh
    sequence's slot holds NaN)."""
    g = torch.Generator(device="cuda").manual_seed(num_seqs)
    channels = 2 * K_HEADS * HEAD_DIM + V_HEADS * HEAD_DIM
    projected = torch.randn(num_seqs, channels + V_HEADS * HEAD_DIM + 2 * V_HEADS + 8,
                            generator=g, device="cuda").bfloat16()
    mixed, z, a, b = projected[:, :-8].split(
        [channels, V_HEADS * HEAD_DIM, V_HEADS, V_HEADS], dim=-1)
    weight = torch.randn(channels, WIDTH + 1, generator=g, device="cuda").bfloat16() * 0.5
    a_log = torch.randn(V_HEADS, generator=g, device="cuda")
    dt_bias = torch.randn(V_HEADS, generator=g, device="cuda")
    norm_weight = (torch.rand(HEAD_DIM, generator=g, device="cuda") + 0.5).bfloat16()
    args = (mixed, a, b, z, weight, a_log, dt_bias, norm_weight, 1e-6)
    # distinct slots (two sequences in one slot would race), the first sequence fresh in slot 0,
    # which holds NaN
    others = torch.randperm(num_seqs + 1, generator=g, device="cuda")[:num_seqs - 1] + 1
    slots = torch.cat([others.new_zeros(1), others])
    initial = torch.rand(num_seqs, generator=g, device="cuda") > 0.2
    initial[0] = False
    conv_states = torch.randn(num_seqs + 2, 3, channels, WIDTH, generator=g,
                              device="cuda").bfloat16()
    ssm_states = torch.randn(num_seqs + 2, 3, V_HEADS, HEAD_DIM, HEAD_DIM, generator=g,
                             device="cuda") * 0.1
    conv_states[0], ssm_states[0] = float("nan"), float("nan")
    expected_conv, expected_ssm = conv_states.clone(), ssm_states.clone()
    expected = delta_rule.gated_delta_net_decode(*args, expected_conv[:, 1], expected_ssm[:, 1],
                                                 slots, initial)
    got = linear.gated_delta_net_decode(*args, conv_states[:, 1], ssm_states[:, 1], slots,
                                        initial)
    assert relative_error(got, expected) < 1e-2
    differ = (conv_states.nan_to_num() != expected_conv.nan_to_num()).nonzero().tolist()
    assert not differ, f"conv state elements (slot, layer, channel, tap) differ: {differ[:8]}"
    assert relative_error(ssm_states.nan_to_num(), expected_ssm.nan_to_num()) < 1e-3
