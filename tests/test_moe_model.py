"""Qwen3-MoE (``Qwen3MoeForCausalLM``: experts on some layers, a dense MLP on others) against
transformers on a tiny checkpoint: greedy tokens through the whole engine, whatever the cache,
chunking, prefix hits and tensor parallelism; its router and experts kernels; its checkpoint
layouts; its random-weight shapes."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from test_model import PagedRun, assert_logits_close, greedy_reference, random_prompt
from test_parity import nanofn_greedy, random_prompts, transformers_greedy
from test_weights import edit_checkpoint

from nanofn.kernels import fused_moe, select_experts
from nanofn.model import build_model, load_weights
from nanofn.model.moe import SparseMoeBlock, StackedExperts
from nanofn.model.tiny import PRESETS, _qwen3_weight_shapes, make_random_checkpoint


@pytest.fixture(scope="module")
def moe(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def shared_prefix_case(moe):
    """Prompts behind one 37-token prefix, and their expected tokens."""
    prompts = random_prompts([3, 9, 20, 1], seed=7, shared_prefix=random_prompts([37], seed=8)[0])
    return prompts, transformers_greedy(moe, prompts)


def load(path, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False):
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype="float32", device="cpu", tp_rank=tp_rank, tp_size=tp_size,
                        expert_parallel=expert_parallel)
    load_weights(model, path)
    return model, config


# --- the model against transformers -----------------------------------------------------------


def test_layers_are_sparse_or_dense_as_transformers_builds_them(moe):
    reference = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    model, _ = load(moe)
    expected = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]
    assert expected == [True, False, True, True]  # mlp_only_layers=[1]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == expected


def test_a_batch_of_different_lengths_matches_transformers(moe):
    prompts = random_prompts([5, 17, 40, 63], seed=5)
    expected = transformers_greedy(moe, prompts)
    got, _ = nanofn_greedy(moe, prompts)
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(prompts), "degenerate model: outputs alike"


def test_a_cache_so_small_that_sequences_are_preempted(moe, shared_prefix_case):
    """5 blocks of 16 tokens hold one sequence of up to 80 tokens: the others give way."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(moe, prompts, num_kv_blocks=5, max_model_len=80)
    assert got == expected
    assert figures.num_preemptions > 0


def test_tiny_budgets_chunk_prompts_that_hit_the_prefix_cache(moe, shared_prefix_case):
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(moe, prompts, max_num_batched_tokens=16, max_num_seqs=2)
    assert got == expected
    assert figures.prefix_cache_hit_rate > 0


def test_two_tensor_parallel_ranks_give_the_same_tokens(moe, shared_prefix_case):
    """Two ranks (gloo on the CPU) each hold half of every expert's intermediate dimension."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(moe, prompts, tensor_parallel_size=2, num_kv_blocks=5,
                                 max_model_len=80)
    assert got == expected
    assert figures.num_preemptions > 0


def test_two_expert_parallel_ranks_give_the_same_tokens(moe, shared_prefix_case):
    """Two ranks each hold four of the eight experts whole (``enable_expert_parallel``)."""
    prompts, expected = shared_prefix_case
    got, figures = nanofn_greedy(moe, prompts, tensor_parallel_size=2,
                                 enable_expert_parallel=True, num_kv_blocks=5, max_model_len=80)
    assert got == expected
    assert figures.num_preemptions > 0


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_of_a_sparse_layer_add_up_to_one(moe, monkeypatch, expert_parallel):
    """Each rank's share of every expert, or (expert parallel) half the experts whole: rank 1
    holds experts 4-7, computes only the pairs that chose them, and the two outputs add up."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor: None)  # summed by hand
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    outputs, models = [], []
    for tp_rank, tp_size in [(0, 1), (0, 2), (1, 2)]:
        model, _ = load(moe, tp_rank, tp_size, expert_parallel)
        models.append(model)
        with torch.inference_mode():
            outputs.append(model.model.layers[0].mlp(hidden))
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0], atol=1e-5, rtol=1e-5)
    whole, rank_1 = (m.model.layers[0].mlp.experts for m in (models[0], models[2]))
    if expert_parallel:
        assert list(rank_1.w13.experts) == [4, 5, 6, 7] and rank_1.w13.shape == (4, 96, 64)
        assert torch.equal(rank_1.w13, whole.w13[4:]) and torch.equal(rank_1.w2, whole.w2[4:])
        assert not torch.equal(outputs[1], outputs[0])  # (each rank's pairs alone)
    else:
        assert rank_1.w13.shape == (8, 48, 64)


def test_an_expert_parallel_rank_reads_only_its_own_experts_tensors(moe, tmp_path):
    """Expert 0's gate_proj made the wrong shape: rank 1 of two (experts 4-7) loads without
    reading it; rank 0 refuses it, as one rank of tensor parallelism does. An index past
    every expert is still refused by every rank."""
    bad = "model.layers.0.mlp.experts.0.gate_proj.weight"
    path = edited_copy(moe, tmp_path / "bad", lambda t: t.update({bad: t[bad][:, :8].clone()}))
    load(path, 1, 2, expert_parallel=True)
    for tp_rank, expert_parallel in ((0, True), (1, False)):
        with pytest.raises(ValueError, match=f"tensor '{bad}'"):
            load(path, tp_rank, 2, expert_parallel)
    extra = "model.layers.0.mlp.experts.8.gate_proj.weight"
    up = "model.layers.0.mlp.experts.3.up_proj.weight"
    past = edited_copy(moe, tmp_path / "past", lambda t: t.update({extra: t[up].clone()}))
    with pytest.raises(ValueError, match="expert 8 out of range"):
        load(past, 1, 2, expert_parallel=True)


def test_expert_parallelism_needs_experts_that_split_evenly():
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by tp_size \(3\)"):
        StackedExperts(8, 64, 48, tp_rank=0, tp_size=3, expert_parallel=True)


# --- the router and the experts -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_router_matches_transformers_bit_for_bit(renormalize, dtype):
    config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                                         norm_topk_prob=renormalize)
    generator = torch.Generator().manual_seed(2)
    router = Qwen3MoeTopKRouter(config).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=generator))
        hidden = torch.randn(50, 16, generator=generator).to(dtype)
        _, expected_weights, expected_ids = router(hidden)
        weights, ids = select_experts(F.linear(hidden, router.weight), 3, renormalize)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights, expected_weights) and weights.dtype == dtype
    sums = weights.float().sum(-1)
    assert bool((sums - 1).abs().max() < 1e-2) == renormalize


def naive_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert."""
    out = torch.zeros_like(hidden)
    for t, (weights, ids) in enumerate(zip(topk_weights, topk_ids)):
        for weight, expert in zip(weights, ids.tolist()):
            gate, up = (w13[expert] @ hidden[t]).chunk(2)
            out[t] += weight * (w2[expert] @ (F.silu(gate) * up))
    return out


def test_fused_moe_matches_a_loop_over_tokens_and_their_experts():
    """Experts with several tokens, one, and none (expert 5), in any slot order."""
    generator = torch.Generator().manual_seed(3)
    num_experts, hidden_size, intermediate = 6, 8, 5
    hidden = torch.randn(7, hidden_size, generator=generator)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator)
    w2 = torch.randn(num_experts, hidden_size, intermediate, generator=generator)
    topk_ids = torch.tensor([[0, 1], [1, 0], [2, 4], [4, 3], [0, 2], [3, 1], [1, 4]])
    topk_weights = torch.rand(7, 2, generator=generator)

    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)

    torch.testing.assert_close(out, naive_moe(hidden, w13, w2, topk_weights, topk_ids))


# --- loading -------------------------------------------------------------------------------------


def edited_copy(source, target, edit):
    """A copy of the checkpoint ``source`` at ``target``, its tensors edited by ``edit``."""
    shutil.copytree(source, target)
    edit_checkpoint(target, edit)
    return target


def fuse_experts(tensors, transposed: bool) -> None:
    """Each sparse layer's experts in two tensors, as transformers holds them
    (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), or ``transposed``."""
    for layer in range(4):
        experts = f"model.layers.{layer}.mlp.experts"
        num_experts = sum(n.startswith(experts) and n.endswith("gate_proj.weight") for n in tensors)
        if not num_experts:
            continue
        gate_up, down = [], []
        for expert in range(num_experts):
            names = [f"{experts}.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")]
            gate, up, down_proj = (tensors.pop(name) for name in names)
            gate_up.append(torch.cat([gate, up]))
            down.append(down_proj)
        fused = {f"{experts}.gate_up_proj": torch.stack(gate_up),
                 f"{experts}.down_proj": torch.stack(down)}
        tensors.update({name: t.transpose(1, 2).contiguous() if transposed else t
                        for name, t in fused.items()})


def test_the_fused_layout_is_the_one_transformers_holds_in_memory(moe):
    reference = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).state_dict()
    tensors = load_file(moe / "model.safetensors")
    fuse_experts(tensors, transposed=False)
    fused = [name for name in tensors if ".experts." in name]
    assert len(fused) == 2 * 3
    for name in fused:
        assert torch.equal(tensors[name], reference[name]), name


def assert_loads_alike(path, other) -> None:
    """The checkpoints at ``path`` and ``other`` fill every parameter alike, whole, a rank's
    share or (expert parallel) a rank's experts."""
    for tp_rank, tp_size, expert_parallel in [(0, 1, False), (1, 2, False), (1, 2, True)]:
        expected, _ = load(path, tp_rank, tp_size, expert_parallel)
        model, _ = load(other, tp_rank, tp_size, expert_parallel)
        for (name, param), (_, expected_param) in zip(model.named_parameters(),
                                                      expected.named_parameters()):
            assert torch.equal(param, expected_param), name


@pytest.mark.parametrize("transposed", [False, True], ids=["E-2I-H", "E-H-2I"])
def test_fused_expert_tensors_load_as_the_per_expert_ones(moe, tmp_path, transposed):
    """transformers saves the experts one by one (``experts.N.gate_proj.weight``); its fused
    tensors, in either layout, fill the same stacked parameters, whole or a rank's share."""
    fused = edited_copy(moe, tmp_path / "fused", lambda t: fuse_experts(t, transposed))
    assert_loads_alike(moe, fused)
    config = AutoConfig.from_pretrained(moe)
    prompt = random_prompt(20, seed=4)
    logits = [PagedRun(m, config, block_size=4).step({"a": prompt})["a"]
              for m in (load(moe)[0], load(fused)[0])]
    assert torch.equal(logits[0], logits[1])


def test_missing_or_unknown_expert_tensors_are_refused(moe, tmp_path):
    config = AutoConfig.from_pretrained(moe)
    up = "model.layers.2.mlp.experts.3.up_proj.weight"
    cases = [
        (lambda t: t.pop(up), f"lacks tensors: {up}"),
        (lambda t: t.update({"model.layers.0.mlp.experts.8.gate_proj.weight": t[up].clone()}),
         "experts.8.gate_proj.weight.*expert 8 out of range: the model has 8 experts"),
        (lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight": t[up].clone()}),
         "unexpected tensor 'model.layers.1.mlp.experts.0.up_proj.weight'"),  # a dense layer
        (lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.bias": t[up][:, 0].clone()}),
         "unexpected tensor 'model.layers.0.mlp.experts.0.up_proj.bias'"),
    ]
    for i, (edit, message) in enumerate(cases):
        path = edited_copy(moe, tmp_path / str(i), edit)
        model = build_model(config, dtype="float32", device="cpu")
        with pytest.raises(ValueError, match=message):
            load_weights(model, path)


# --- random-weight shapes ----------------------------------------------------------------------


def test_a_random_moe_checkpoint_loads_in_nanofn_and_transformers(tmp_path):
    path = make_random_checkpoint(tmp_path / "random", "qwen3-moe-tiny", dtype="float32", seed=1)
    reference, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    model, config = load(path)
    prompt = random_prompt(12, seed=10)
    _, expected = greedy_reference(reference.eval(), prompt, 0)
    assert_logits_close(PagedRun(model, config, block_size=4).step({"a": prompt})["a"], expected)


def test_the_30b_a3b_shape_has_the_model_card_s_parameter_counts():
    """30.5B parameters, 29.9B of them not embeddings, 3.3B active (all but 120 of the 128
    experts of each of the 48 layers)."""
    config = transformers.Qwen3MoeConfig(**PRESETS["qwen3-30b-a3b"])
    shapes = _qwen3_weight_shapes(config)
    total = sum(torch.Size(shape).numel() for shape in shapes.values())
    embeddings = 2 * 151936 * 2048  # untied
    active = total - 48 * (128 - 8) * 3 * 768 * 2048
    assert (round(total / 1e9, 1), round((total - embeddings) / 1e9, 1)) == (30.5, 29.9)
    assert 3.3e9 < active < 3.4e9
    assert len([name for name in shapes if name.endswith("mlp.gate.weight")]) == 48
