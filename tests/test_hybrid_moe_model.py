"""The hybrid mixture-of-experts models (Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet and gated
attention layers, with routed experts and a gated shared expert) against transformers on tiny
checkpoints: greedy tokens through the whole engine, whatever the cache, chunking, prefix hits
and tensor parallelism; Qwen3.5-MoE's vision-language checkpoint's language model; the
checkpoint layouts of the experts; the random-weight shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from test_hybrid_model import HybridRun
from test_model import assert_logits_close, greedy_reference, random_prompt
from test_moe_model import assert_loads_alike, edited_copy, fuse_experts, load
from test_parity import nanofn_greedy, random_prompts, transformers_greedy

from nanofn.cli.bench import ModelDims
from nanofn.model import build_model, load_weights
from nanofn.model.moe import SharedExpertMoeBlock
from nanofn.model.tiny import (PRESETS, _qwen3_5_weight_shapes, _qwen3_next_weight_shapes,
                               make_random_checkpoint)

# Tiny arch -> which of its 4 layers (3 linear-attention, then full attention) have experts:
# Qwen3.5-MoE's every one, Qwen3-Next's all but its mlp_only_layers (1 in the tiny config).
SPARSE_LAYERS = {"qwen3_5_moe": [True] * 4, "qwen3_next": [True, False, True, True]}


@pytest.fixture(scope="module", params=SPARSE_LAYERS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def hybrid_moe(tiny_checkpoint, arch):
    return tiny_checkpoint(arch)


@pytest.fixture(scope="module")
def shared_prefix_case(hybrid_moe):
    """Prompts behind one 40-token prefix (two and a half blocks), and their expected tokens."""
    prompts = random_prompts([3, 9, 20, 1], seed=21, shared_prefix=random_prompts([40], seed=22)[0])
    return prompts, transformers_greedy(hybrid_moe, prompts)


# --- the model against transformers -----------------------------------------------------------


def test_layers_have_experts_and_a_shared_expert_as_transformers_builds_them(hybrid_moe, arch):
    reference = AutoModelForCausalLM.from_pretrained(hybrid_moe, dtype=torch.float32)
    model, _ = load(hybrid_moe)
    expected = [hasattr(layer.mlp, "shared_expert") for layer in reference.model.layers]
    assert expected == SPARSE_LAYERS[arch]
    assert [isinstance(layer.mlp, SharedExpertMoeBlock) for layer in model.model.layers] == expected
    assert [layer.is_linear for layer in model.model.layers] == [True, True, True, False]
    # Qwen3.5-MoE's router always renormalises; Qwen3-Next's config says so (norm_topk_prob)
    assert all(layer.mlp.gate.renormalize for layer in model.model.layers[2:])


def test_a_batch_of_different_lengths_matches_transformers(hybrid_moe):
    prompts = random_prompts([5, 17, 40, 63], seed=23)
    expected = transformers_greedy(hybrid_moe, prompts)
    got, figures = nanofn_greedy(hybrid_moe, prompts)
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(prompts), "degenerate model: outputs alike"
    assert figures.state_slots_total > 0


def preempted(figures) -> bool:
    return figures.num_preemptions > 0


# Engine settings -> what they must have made happen. A small cache: 5 blocks hold one sequence
# of 80 tokens, 3 state slots one working state and two saved ones, so sequences give way and
# resume. Tiny budgets: prompts computed in chunks, the later ones from the shared prefix's
# blocks and saved state. Two ranks (gloo on the CPU): the linear-attention heads, every
# expert's and the shared expert's intermediate dimension split (expert parallel: half the
# experts whole a rank, the shared expert split).
SMALL_CACHE = dict(num_kv_blocks=5, max_model_len=80, num_state_slots=3)
ENGINE_CASES = {
    "preempted": (SMALL_CACHE, preempted),
    "chunked-prefix-hits": (dict(max_num_batched_tokens=16, max_num_seqs=2),
                            lambda figures: figures.prefix_cache_hit_rate > 0),
    "two-ranks-preempted": ({**SMALL_CACHE, "tensor_parallel_size": 2}, preempted),
    "two-expert-parallel-ranks-preempted": (
        {**SMALL_CACHE, "tensor_parallel_size": 2, "enable_expert_parallel": True}, preempted),
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_shared_prefixes_match_transformers_whatever_the_engine_settings(
        hybrid_moe, shared_prefix_case, case):
    prompts, expected = shared_prefix_case
    options, happened = ENGINE_CASES[case]
    got, figures = nanofn_greedy(hybrid_moe, prompts, **options)
    assert got == expected
    assert happened(figures)


def test_the_vision_language_checkpoint_generates_as_transformers(tiny_checkpoint):
    """Qwen3_5MoeForConditionalGeneration's names (``model.language_model.*``): the language
    model loads, the vision tower is skipped, the multi-token-prediction weights set aside."""
    model_dir = tiny_checkpoint("qwen3_5_moe-vl")
    prompts = random_prompts([7, 30], seed=24)
    got, _ = nanofn_greedy(model_dir, prompts)
    assert got == transformers_greedy(model_dir, prompts)
    model, _ = load(model_dir)
    assert not any("visual" in name for name, _ in model.named_parameters())
    assert sorted(model.mtp_weights) == ["mtp.fc.weight", "mtp.norm.weight"]


def test_tiny_checkpoint_linear_attention_heads_remember_past_tokens(hybrid_moe):
    """Their decays are near 1 (``tiny._tune_linear_attention``; in Qwen3-Next's grouped
    ``in_proj_ba``, the rows of ``a``): a state mislaid between steps must show."""
    reference = AutoModelForCausalLM.from_pretrained(hybrid_moe, dtype=torch.float32)
    decays = []

    def record(net, args, kwargs):
        hidden = kwargs["hidden_states"]
        if hasattr(net, "in_proj_a"):
            a = net.in_proj_a(hidden)
        else:
            grouped = (net.in_proj_qkvz(hidden), net.in_proj_ba(hidden))
            a = net.fix_query_key_value_ordering(*grouped)[5]
        decays.append(torch.exp(-net.A_log.exp() * F.softplus(a + net.dt_bias)).flatten())

    nets = [layer.linear_attn for layer in reference.model.layers if hasattr(layer, "linear_attn")]
    hooks = [net.register_forward_pre_hook(record, with_kwargs=True) for net in nets]
    with torch.inference_mode():
        reference(torch.tensor([random_prompt(20, seed=28)]))
    for hook in hooks:
        hook.remove()
    assert len(decays) == 3 and torch.cat(decays).min() > 0.8


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_of_a_sparse_layer_add_up_to_one(hybrid_moe, monkeypatch, expert_parallel):
    """Each rank holds half of every expert (expert parallel: half the experts) and of the
    shared expert, and the whole gate: the ranks' partial outputs (one all-reduce's summands)
    add up to one rank's."""
    reductions = []
    monkeypatch.setattr(torch.distributed, "all_reduce", reductions.append)  # summed by hand
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(25))
    outputs = []
    for tp_rank, tp_size in [(0, 1), (0, 2), (1, 2)]:
        model, _ = load(hybrid_moe, tp_rank, tp_size, expert_parallel)
        with torch.inference_mode():
            outputs.append(model.model.layers[2].mlp(hidden))
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0], atol=1e-5, rtol=1e-5)
    assert len(reductions) == 2  # one a rank


# --- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True], ids=["E-2I-H", "E-H-2I"])
def test_fused_expert_tensors_load_as_the_per_expert_ones(hybrid_moe, tmp_path, transposed):
    """transformers saves the experts one by one (``experts.N.gate_proj.weight``); its fused
    tensors, in either layout, fill the same stacked parameters, whole or a rank's share."""
    assert_loads_alike(hybrid_moe, edited_copy(hybrid_moe, tmp_path / "fused",
                                               lambda t: fuse_experts(t, transposed)))


def test_a_missing_shared_expert_gate_is_refused(hybrid_moe, tmp_path):
    name = "model.layers.2.mlp.shared_expert_gate.weight"
    path = edited_copy(hybrid_moe, tmp_path / "no-gate", lambda t: t.pop(name))
    model = build_model(AutoConfig.from_pretrained(path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=f"lacks tensors: {name}"):
        load_weights(model, path)


def test_a_missing_grouped_projection_is_named_beside_the_tensors_it_holds(tiny_checkpoint,
                                                                          tmp_path):
    layer = "model.layers.0.linear_attn."
    source = tiny_checkpoint("qwen3_next")
    path = edited_copy(source, tmp_path / "no-ba", lambda t: t.pop(layer + "in_proj_ba.weight"))
    model = build_model(AutoConfig.from_pretrained(path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=(
            rf"lacks tensors: {layer}in_proj_a.weight \(or {layer}in_proj_ba.weight\), "
            rf"{layer}in_proj_b.weight \(or {layer}in_proj_ba.weight\)$")):
        load_weights(model, path)


# --- random-weight shapes ----------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["qwen3.5-moe-tiny", "qwen3-next-tiny"])
def test_a_random_checkpoint_loads_in_nanofn_and_transformers(tmp_path, preset):
    path = make_random_checkpoint(tmp_path / "random", preset, dtype="float32", seed=1)
    reference, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    model, config = load(path)
    prompt = random_prompt(12, seed=27)
    _, expected = greedy_reference(reference.eval(), prompt, 0)
    assert_logits_close(HybridRun(model, config).step({"a": prompt})["a"], expected)


def test_the_35b_a3b_shape_has_the_model_card_s_parameter_counts():
    """35B parameters (34.7B without the vision tower and the multi-token prediction), 3B
    active: 8 of each layer's 256 experts, and the shared expert."""
    config = transformers.Qwen3_5MoeConfig(**PRESETS["qwen3.5-35b-a3b"])
    shapes = _qwen3_5_weight_shapes(config)
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    active = total - 40 * (256 - 8) * 3 * 512 * 2048
    assert round(total / 1e9, 1) == 34.7
    assert 3.4e9 < active < 3.5e9
    dims = ModelDims.from_config(config.to_dict())
    assert (dims.num_moe_layers, dims.num_linear_layers, dims.shared_expert_intermediate_size) == (
        40, 30, 512)
    assert abs(dims.num_params - total) / total < 1e-4
    assert abs(dims.active_params - active) / active < 1e-3


def test_the_80b_a3b_shape_has_the_model_card_s_parameter_counts():
    """80B parameters (79.7B without the multi-token prediction), 3B active (3.9B with the
    embeddings): 10 of each layer's 512 experts, and the shared expert."""
    config = transformers.Qwen3NextConfig(**PRESETS["qwen3-next-80b-a3b"])
    shapes = _qwen3_next_weight_shapes(config)
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    active = total - 48 * (512 - 10) * 3 * 512 * 2048
    embeddings = 2 * 151936 * 2048  # untied
    assert round(total / 1e9, 1) == 79.7
    assert 3.2e9 < active - embeddings < 3.3e9
    dims = ModelDims.from_config(config.to_dict())
    assert (dims.num_moe_layers, dims.num_linear_layers, dims.shared_expert_intermediate_size) == (
        48, 36, 512)
    assert abs(dims.num_params - total) / total < 1e-4
    assert abs(dims.active_params - active) / active < 1e-3
    assert sum(name.endswith("in_proj_qkvz.weight") for name in shapes) == 36
