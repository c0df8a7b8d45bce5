"""Checkpoint loading, its error messages, dtype resolution, and the tiny checkpoints themselves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from nanofn.model import build_model, load_weights, resolve_dtype
from nanofn.model.tiny import EOS_TOKEN, make_tiny_checkpoint


def load(path, **build_kwargs):
    model = build_model(AutoConfig.from_pretrained(path), dtype="float32", device="cpu", **build_kwargs)
    load_weights(model, path)
    return model


def edit_checkpoint(path, edit) -> None:
    """Apply ``edit(tensors)`` to the single ``model.safetensors`` file of ``path``."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_sharded_and_single_file_checkpoints_load_the_same_model(tiny_checkpoint_factory):
    single = tiny_checkpoint_factory("qwen2", seed=3)
    sharded = tiny_checkpoint_factory("qwen2", seed=3, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (sharded / "model.safetensors").exists()

    single_state, sharded_state = load(single).state_dict(), load(sharded).state_dict()

    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_tied_embeddings_share_one_tensor(tiny_qwen3):
    model = load(tiny_qwen3)
    checkpoint = load_file(tiny_qwen3 / "model.safetensors")
    assert "lm_head.weight" not in checkpoint
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, checkpoint["model.embed_tokens.weight"])


def test_tied_checkpoint_may_also_store_lm_head(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3")
    edit_checkpoint(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_embeddings_load_their_own_lm_head(tiny_checkpoint):
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    model = load(path)
    checkpoint = load_file(path / "model.safetensors")
    assert torch.equal(model.lm_head.weight, checkpoint["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_rotary_inv_freq_buffers_in_a_checkpoint_are_ignored(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    edit_checkpoint(path, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.rand(8)))
    load(path)


def test_missing_folder_is_named(tiny_qwen3, tmp_path):
    model = build_model(AutoConfig.from_pretrained(tiny_qwen3), dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match=f"model folder not found: {tmp_path}/no-such-model"):
        load_weights(model, tmp_path / "no-such-model")


def test_folder_without_safetensors_is_named(tiny_qwen3, tmp_path):
    model = build_model(AutoConfig.from_pretrained(tiny_qwen3), dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors files in {tmp_path}"):
        load_weights(model, tmp_path)


def test_index_naming_a_missing_shard_is_reported(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3", num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load(path)


def test_missing_tensor_is_named(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3")
    edit_checkpoint(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=f"checkpoint {path} lacks tensors: model.layers.1.self_attn.k_proj.weight"):
        load(path)


def test_untied_model_needs_lm_head(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama", tie_word_embeddings=False)
    edit_checkpoint(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lacks tensors: lm_head.weight"):
        load(path)


def test_unexpected_tensor_is_named_with_its_file(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3")
    edit_checkpoint(path, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.rand(3)))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.extra.weight' in .*model.safetensors"):
        load(path)


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected_shape"),
    [
        ("model.norm.weight", (65,), (64,)),
        ("model.layers.0.self_attn.v_proj.weight", (32, 60), (32, 64)),
        ("model.layers.1.mlp.down_proj.weight", (64, 120), (64, 128)),
    ],
)
def test_shape_mismatch_names_tensor_file_and_both_shapes(tiny_checkpoint_factory, name, bad_shape, expected_shape):
    path = tiny_checkpoint_factory("qwen3")
    edit_checkpoint(path, lambda t: t.__setitem__(name, torch.rand(bad_shape)))
    message = f"tensor '{name}' in .*model.safetensors: expected shape {expected_shape}, found {bad_shape}"
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load(path)


def test_unknown_architecture_lists_the_supported_ones(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
                                         "Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM"):
        build_model(config, dtype="float32", device="cpu")


def test_unsupported_activation_is_named(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="'gelu'.*supported: silu"):
        build_model(config, dtype="float32", device="cpu")


def test_context_longer_than_a_sliding_window_is_refused(tiny_mistral, tiny_qwen2):
    mistral = AutoConfig.from_pretrained(tiny_mistral)
    with pytest.raises(ValueError, match="max_model_len 4097 exceeds the model's sliding window of 4096"):
        build_model(mistral, dtype="float32", device="cpu", max_model_len=4097)
    build_model(mistral, dtype="float32", device="cpu", max_model_len=4096)

    qwen2 = AutoConfig.from_pretrained(tiny_qwen2)
    qwen2.sliding_window = 128  # carried, but no layer uses it (use_sliding_window is false)
    build_model(qwen2, dtype="float32", device="cpu", max_model_len=1024)


def test_resolve_dtype_accepts_names_torch_dtypes_and_auto(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    assert resolve_dtype(config) == torch.float32
    assert resolve_dtype(config, "half") == resolve_dtype(config, torch.float16) == torch.float16
    assert resolve_dtype(config, "bfloat16") == torch.bfloat16
    assert resolve_dtype(config, "float") == torch.float32
    config.dtype = "bfloat16"
    assert resolve_dtype(config, "auto") == torch.bfloat16
    config.dtype = None
    assert resolve_dtype(config, "auto") == torch.float32


@pytest.mark.parametrize("bad", ["int8", torch.float64, "fp8"])
def test_bad_dtype_lists_the_choices(tiny_qwen3, bad):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    with pytest.raises(ValueError, match="choose one of: auto, float16, half, bfloat16, float32, float"):
        resolve_dtype(config, bad)


def test_bfloat16_checkpoint_builds_a_bfloat16_model_and_keeps_the_default_dtype(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("qwen3", dtype="bfloat16")
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype="auto", device="cpu")
    load_weights(model, path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos_sin_cache.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32


def test_tiny_checkpoint_is_deterministic(tmp_path):
    first = make_tiny_checkpoint(tmp_path / "first", "llama3", seed=7)
    second = make_tiny_checkpoint(tmp_path / "second", "llama3", seed=7)
    other_seed = make_tiny_checkpoint(tmp_path / "other", "llama3", seed=8)
    for name in ["config.json", "tokenizer.json", "model.safetensors"]:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()


def test_tiny_checkpoint_tokenizer_loads_with_eos_and_chat_template(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    generation_config = json.loads((tiny_qwen3 / "generation_config.json").read_text())
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert tokenizer.eos_token_id == config["eos_token_id"] == generation_config["eos_token_id"] == eos
    assert len(tokenizer) < config["vocab_size"]
    text = "Hello world! Tell me a story."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
