"""FP8 mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): their experts in FP8,
multiplied weight-only, beside FP8 attention and MLP projections (W8A8), from Qwen's block-wise
and compressed-tensors checkpoints and from ``quantization="fp8"``, on the CPU references."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from test_fp8 import (E4M3_MAX, PROMPTS, QWEN_KEPT, WIDE, greedy_tokens, is_projection,
                      nanofn_greedy_and_params, quantized_as_qwen_does, reference_greedy,
                      set_config, write_fp8_checkpoint)
from test_fp8 import reference_model as fp8_reference_model
from test_moe_model import fuse_experts
from test_parity import nanofn_greedy, random_prompts

from nanofn import LLM, SamplingParams
from nanofn.kernels.fp8 import FP8_DTYPE
from nanofn.model import build_model, load_weights
from nanofn.model.loader import init_dummy_weights

# Experts of two 128-column groups each way: block scales that differ within a matrix, and a
# TP=2 rank's share of down_proj's columns one whole group
MOE_WIDE = dict(WIDE, moe_intermediate_size=256)


def quantized_as_nanofn_does(scheme: str):
    """A forward pre-hook quantizing a projection's input per token and group of 128 columns
    (block schemes) or per token (a row, per-channel schemes), as the W8A8 GEMMs do:
    ``x * (1 / scale)`` rounded to e4m3, ``scale = amax * (1 / 448)``. (A routed model moves
    an expert's choice on the one-code difference that ``x / scale`` makes at a rounding
    boundary, which a dense model's logits absorb.)"""

    def hook(module, args):
        (x,) = args
        group = 128 if scheme in ("qwen-block", "ct-block") else x.shape[-1]
        out = torch.empty_like(x)
        for start in range(0, x.shape[-1], group):
            part = x[..., start:start + group].float()
            scale = (part.abs().amax(-1, keepdim=True) * (1 / E4M3_MAX)).clamp(min=1e-10 / 448)
            codes = (part * (1 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
            out[..., start:start + group] = codes.float() * scale
        return (out,)

    return hook


def reference_model(dequantized_dir, scheme: str):
    """test_fp8's reference, its projections' inputs quantized as nanofn's GEMMs do them."""
    return fp8_reference_model(dequantized_dir, scheme, quantized_as_nanofn_does)


def write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, arch: str, scheme: str, **overrides):
    """The tiny ``arch`` in ``scheme`` as ``LAYOUTS`` quantizes it, its ignore list saying what
    it keeps, and its dequantized twin."""
    fp8_dir, dequantized_dir = tmp_path / "fp8", tmp_path / "dequantized"
    quantizes, ignore = LAYOUTS[arch]
    write_fp8_checkpoint(tiny_checkpoint(arch, **{**MOE_WIDE, **overrides}), fp8_dir,
                         dequantized_dir, scheme, quantizes)
    config = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    config["ignore" if scheme.startswith("ct-") else "modules_to_not_convert"] = ignore
    set_config(fp8_dir, quantization_config=config)
    return fp8_dir, dequantized_dir


def quantized_with_routers(name: str) -> bool:
    """Qwen's own layout (linear attention's in_proj_qkv, in_proj_z and out_proj in FP8 too),
    and the routers as well: a checkpoint may quantize them, which nanofn dequantizes."""
    return quantized_as_qwen_does(name) or name.endswith((".mlp.gate.weight",
                                                          ".shared_expert_gate.weight"))


def quantized_with_grouped_linear_attention(name: str) -> bool:
    """Every projection, Qwen3-Next's linear attention's too (its two grouped input
    projections, which nanofn dequantizes before regrouping their rows)."""
    return is_projection(name) or (name.endswith(".weight") and name.split(".")[-2] in
                                   ("in_proj_qkvz", "in_proj_ba", "out_proj"))


# arch -> (the tensors its FP8 checkpoint quantizes, its ignore list)
LAYOUTS = {
    "qwen3_moe": (is_projection, ["lm_head"]),
    "qwen3_5_moe": (quantized_with_routers, QWEN_KEPT),
    "qwen3_next": (quantized_with_grouped_linear_attention, ["lm_head"]),
}


@pytest.mark.parametrize("arch, scheme, inter", [("qwen3_moe", "qwen-block", 256),
                                                 ("qwen3_moe", "qwen-block", 200),
                                                 ("qwen3_moe", "ct-channel-dynamic", 256),
                                                 ("qwen3_5_moe", "qwen-block", 256),
                                                 ("qwen3_next", "ct-block", 256)])
def test_an_fp8_moe_generates_the_greedy_tokens_of_its_dequantized_weights(
        tiny_checkpoint, tmp_path, arch, scheme, inter):
    """Qwen3-MoE (a dense layer among the sparse ones), Qwen3.5-MoE and Qwen3-Next (linear
    attention, a shared expert): their experts, attention and MLP projections in FP8 (their
    linear attention too, Qwen3.5-MoE's routers too: loaded dequantized, ``LAYOUTS``); nanofn's
    greedy tokens are transformers' on the dequantized weights. (Experts of 200: a short last
    group of 72.)"""
    fp8_dir, dequantized_dir = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, arch, scheme,
                                                        moe_intermediate_size=inter)
    tokens, weights = nanofn_greedy_and_params(fp8_dir)
    assert weights["model.layers.0.mlp.experts.w13"].dtype == FP8_DTYPE
    assert weights["model.layers.0.mlp.experts.w2"].dtype == FP8_DTYPE
    assert weights["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # (the router)
    assert tokens == reference_greedy(reference_model(dequantized_dir, scheme))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_two_ranks_of_an_fp8_moe_give_its_greedy_tokens(tiny_checkpoint, tmp_path,
                                                         expert_parallel):
    """TP=2 (gloo): each rank holds its rows of every expert's gate and up projections and its
    group of 128 columns of their down projections, with their scales (or, expert-parallel,
    half of the experts whole); the tokens are the dequantized model's."""
    fp8_dir, dequantized_dir = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe",
                                                        "qwen-block")
    reference = reference_model(dequantized_dir, "qwen-block")
    got, _ = nanofn_greedy(fp8_dir, PROMPTS, tensor_parallel_size=2,
                           enable_expert_parallel=expert_parallel)
    assert got == [greedy_tokens(reference, prompt, len(got[0])) for prompt in PROMPTS]


def test_an_expert_s_scales_split_off_their_groups_are_refused(tiny_checkpoint, tmp_path):
    """384 columns of down_proj over two ranks: 192 a rank, one block and a half (the dense
    projections split on block boundaries). Expert parallelism, which the error suggests,
    keeps each expert whole and loads."""
    fp8_dir, _ = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe", "qwen-block",
                                          moe_intermediate_size=384)
    config = AutoConfig.from_pretrained(fp8_dir)
    with pytest.raises(ValueError, match=r"expert's intermediate size per rank \(192\) is not a "
                                         r"multiple of the scales' 128 columns; lower tp_size, "
                                         r"or set enable_expert_parallel"):
        build_model(config, dtype="float32", device="cpu", tp_rank=0, tp_size=2)
    model = build_model(config, dtype="float32", device="cpu", tp_rank=1, tp_size=2,
                        expert_parallel=True)
    load_weights(model, fp8_dir)
    assert model.model.layers[0].mlp.experts.w2.shape[2] == 384


def test_static_activation_scales_are_refused_for_moe_models(tiny_checkpoint, tmp_path):
    fp8_dir, _ = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe",
                                          "ct-tensor-static")
    with pytest.raises(ValueError, match="static activation scales are not supported for "
                                         "mixture-of-experts models"):
        build_model(AutoConfig.from_pretrained(fp8_dir), dtype="float32", device="cpu")


def test_a_full_precision_expert_where_fp8_is_expected_is_refused(tiny_checkpoint, tmp_path):
    fp8_dir, dequantized_dir = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe",
                                                        "qwen-block")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors[name] = load_file(dequantized_dir / "model.safetensors")[name]
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    model = build_model(AutoConfig.from_pretrained(fp8_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=f"tensor '{name}'.*expected a float8_e4m3fn expert "
                                         f"weight .*found float32"):
        load_weights(model, fp8_dir)


def test_a_checkpoint_lacking_an_expert_s_scales_names_them(tiny_checkpoint, tmp_path):
    fp8_dir, _ = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe", "qwen-block")
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["model.layers.3.mlp.experts.6.up_proj.weight_scale_inv"]
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    model = build_model(AutoConfig.from_pretrained(fp8_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"lacks tensors: model\.layers\.3\.mlp\.experts\.6\."
                                         r"up_proj\.weight_scale_inv$"):
        load_weights(model, fp8_dir)


def logits_of(path, prompt: list[int], **build_kwargs) -> torch.Tensor:
    with LLM(str(path), num_kv_blocks=32, max_model_len=64, **build_kwargs) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([next(iter(entry.values())).logprob
                         for entry in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_quantization_fp8_of_an_moe_quantizes_its_experts_row_by_row(tiny_checkpoint, tmp_path,
                                                                    fused):
    """At load, per-expert tensors or transformers' fused ones become FP8 experts with one
    scale a row (each the row's largest magnitude over 448); the prompt's logprobs stay near
    the full-precision model's (within the dense models' bound: a routed model's tokens move
    more, as an expert's choice flips)."""
    path = tiny_checkpoint("qwen3_moe", **MOE_WIDE)
    if fused:
        tensors = load_file(path / "model.safetensors")
        fuse_experts(tensors, transposed=False)  # (transformers 5 holds them so)
        path = tmp_path / "fused"
        shutil.copytree(tiny_checkpoint("qwen3_moe", **MOE_WIDE), path)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype="float32", device="cpu", quantization="fp8")
    load_weights(model, path)
    experts = model.model.layers[2].mlp.experts
    original = load_file(tiny_checkpoint("qwen3_moe", **MOE_WIDE) / "model.safetensors")
    down = original["model.layers.2.mlp.experts.3.down_proj.weight"]
    assert experts.w2.dtype == FP8_DTYPE and experts.w2_scale.shape == (8, 256, 1)
    torch.testing.assert_close(experts.w2_scale[3, :, 0], down.abs().amax(1) / 448)
    up = original["model.layers.2.mlp.experts.3.up_proj.weight"]
    torch.testing.assert_close(experts.w13_scale[3, 256:, 0], up.abs().amax(1) / 448)
    dequantized = experts.w2[3].float() * experts.w2_scale[3]
    assert (dequantized - down).norm() / down.norm() < 0.05
    prompt = PROMPTS[0] * 2
    quantized, full = logits_of(path, prompt, quantization="fp8"), logits_of(path, prompt)
    assert ((quantized - full).abs().max() / full.abs().max()).item() < 0.3  # (test_fp8's bound)


def test_dummy_fp8_experts_are_those_of_the_model_in_full_precision(tiny_checkpoint):
    """Same seed, with and without ``quantization="fp8"``: each expert the full-precision
    one to e4m3's precision (an unrelated draw is ~140% away), the router equal."""
    config = AutoConfig.from_pretrained(tiny_checkpoint("qwen3_moe", **MOE_WIDE))
    models = {}
    for quantization in (None, "fp8"):
        model = build_model(config, dtype="float32", device="cpu", quantization=quantization)
        init_dummy_weights(model, seed=5)
        models[quantization] = model
    full, fp8 = (models[q].model.layers[0].mlp for q in (None, "fp8"))
    for name, group in (("w13", 256), ("w2", 256)):
        weight = getattr(fp8.experts, name)
        scale = getattr(fp8.experts, f"{name}_scale")
        assert weight.dtype == FP8_DTYPE
        dequantized = weight.float() * scale.repeat_interleave(group, dim=-1)
        plain = getattr(full.experts, name)
        assert (dequantized - plain).norm() / plain.norm() < 0.05, name
    assert torch.equal(fp8.gate.weight, full.gate.weight)


def test_bench_says_the_experts_take_full_precision_activations(tiny_checkpoint):
    from nanofn.cli.bench import bench_data_types
    from nanofn.engine.options import EngineOptions

    config = AutoConfig.from_pretrained(tiny_checkpoint("qwen3_moe"))
    types = bench_data_types(config, EngineOptions(model="m", quantization="fp8"),
                             torch.bfloat16)
    assert types["weights"] == "fp8_e4m3"
    assert types["activations"].endswith("bfloat16 into the routed experts (FP8 weight-only)")


@pytest.mark.parametrize("options, happened", [
    (dict(num_kv_blocks=5, max_model_len=80), lambda figures: figures.num_preemptions > 0),
    (dict(max_num_batched_tokens=16, max_num_seqs=2),
     lambda figures: figures.prefix_cache_hit_rate > 0)], ids=["preempted", "chunked-prefix-hits"])
def test_an_fp8_moe_keeps_its_greedy_tokens_in_a_small_cache_and_chunks(
        tiny_checkpoint, tmp_path, options, happened):
    """The FP8 Qwen3-MoE behind one 40-token prefix: in a cache so small that sequences give
    way (5 blocks), and in 16-token chunks that hit the prefix cache, its greedy tokens stay
    transformers' on the dequantized weights."""
    fp8_dir, dequantized_dir = write_moe_fp8_checkpoint(tiny_checkpoint, tmp_path, "qwen3_moe",
                                                        "qwen-block")
    reference = reference_model(dequantized_dir, "qwen-block")
    prompts = random_prompts([3, 9, 20, 1], seed=21, shared_prefix=random_prompts([40], seed=22)[0])
    got, figures = nanofn_greedy(fp8_dir, prompts, **options)
    assert got == [greedy_tokens(reference, prompt, len(got[0])) for prompt in prompts]
    assert happened(figures)


def test_the_fp8_moe_floor_reads_its_experts_at_one_byte():
    """One request on the Qwen3-30B-A3B shape: FP8 saves a byte a step for each weight the
    step reads, the chosen experts' included (the LM head stays bf16)."""
    from nanofn.cli.bench import DEFAULT_BANDWIDTH_GBPS, ModelDims, floor
    from nanofn.model.tiny import PRESETS

    dims = ModelDims.from_config(PRESETS["qwen3-30b-a3b"])
    bf16, fp8 = (floor(dims, [512], [513], projection_bytes=b).decode_s for b in (None, 1))
    saved_a_step = (bf16 - fp8) / 512
    fp8_weights = dims.shared_body_params + dims.experts_read(1)
    assert dims.experts_read(1) > dims.shared_body_params  # (the experts are most of it)
    assert saved_a_step == pytest.approx(fp8_weights / (DEFAULT_BANDWIDTH_GBPS * 1e9))
