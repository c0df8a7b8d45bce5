"""Random-weight Hugging Face checkpoints: tiny ones for tests and the built-in demo model
(``demo_model``), and ones in the shape of a real model (``make_random_checkpoint``) for
benchmarks.

A checkpoint here is a real Hugging Face folder (``config.json``, ``generation_config.json``,
safetensors weights, a byte-level BPE tokenizer with a ChatML chat template) that both
``transformers`` and nanofn load. Tiny weights are drawn with a large ``initializer_range``
(0.5): with the usual 0.02 a tiny model repeats one token whatever the prompt, which would hide
attention and position bugs.

Importing this module does not load torch (the CLI lists ``PRESETS`` in its help); the functions
that write weights import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEMO_MODEL = "demo-qwen3"  # the demo model's folder in the cache, and its name in the API
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 384
EXTRA_MODEL_VOCAB = 16  # the model's vocabulary is larger than the tokenizer's, as in Qwen
CHAT_TEMPLATE = (
    # Qwen's tool use in brief: the tools in a system turn, an assistant's calls as <tool_call>
    # blocks of JSON, tool results as user turns of <tool_response> blocks.
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a function with <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    # Qwen3's switch: chat_template_kwargs={"enable_thinking": False} closes the thinking block.
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still tell one prompt from another.
Once upon a time there was a little engine that served many requests at the same time. It kept
the keys and values of every sequence in blocks of memory, and it shared the blocks of a common
prefix between requests. When memory ran out, it paused the newest request and resumed it later.
The scheduler decided which tokens to compute in each step; the runner computed them on the
device and sampled the next token of every sequence. Hello world! How are you today? I am fine,
thank you. What is the capital of France? Paris is the capital of France. Tell me a story about
a cat, a dog and a bird who lived in a house by the river. They read books, wrote letters and
played music in the evening. Numbers: one, two, three, four, five, six, seven, eight, nine, ten.
"""

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.5,
    rms_norm_eps=1e-6,
)
_HEAD_DIM = dict(head_dim=16)  # Qwen2's config has no head_dim: it is derived (64 / 4)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
# Qwen3.5: three Gated DeltaNet layers to one of (gated) full attention, GQA, a rotary embedding
# on a quarter of each head (the multimodal rotary, whose sections are equal on text).
_QWEN3_5_TEXT = {
    **_COMMON,
    "num_hidden_layers": 4,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",  # as Qwen3.5's checkpoints
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
# Qwen3-MoE: experts on every layer but layer 1, whose MLP is dense; 8 experts of 48, 2 a token.
# (An expert's 2 * 48 rows differ from hidden_size, so that the layouts of a fused experts
# tensor, [E, 2I, H] and [E, H, 2I], tell themselves apart.)
_QWEN3_MOE = {**_COMMON, **_HEAD_DIM, "num_hidden_layers": 4, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 48, "mlp_only_layers": [1],
              "decoder_sparse_step": 1, "norm_topk_prob": True}
# Qwen3.5-MoE: Qwen3.5's layers with experts on every one (no dense MLP, so no
# intermediate_size): 8 experts of 48 (unambiguous fused layouts, as Qwen3-MoE's), 2 a token,
# and a shared expert of 32.
_QWEN3_5_MOE_TEXT = {
    **{name: value for name, value in _QWEN3_5_TEXT.items() if name != "intermediate_size"},
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 32,
}
# Qwen3-Next: the same, but a dense MLP on layer 1 (mlp_only_layers), a plain partial rotary, no
# state dtype in the config, and the linear attention's projections grouped by key head.
_QWEN3_NEXT = {
    **{name: value for name, value in _QWEN3_5_MOE_TEXT.items() if name != "mamba_ssm_dtype"},
    "intermediate_size": 128, "mlp_only_layers": [1], "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}
_TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                    out_hidden_size=64, num_position_embeddings=16)
# arch -> (transformers config class name, config settings); a config with a ``text_config``
# is a vision-language model's, whose language model the other settings describe.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {**_COMMON, **_HEAD_DIM}),
    "qwen3_moe": ("Qwen3MoeConfig", _QWEN3_MOE),
    "qwen2": ("Qwen2Config", dict(_COMMON)),
    "llama": ("LlamaConfig", {**_COMMON, **_HEAD_DIM}),
    "llama3": ("LlamaConfig", {**_COMMON, **_HEAD_DIM, "rope_parameters": _LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {**_COMMON, **_HEAD_DIM, "sliding_window": 4096}),
    "qwen3_5": ("Qwen3_5TextConfig", _QWEN3_5_TEXT),  # saved as Qwen3_5ForCausalLM
    # The same language model in a Qwen3_5ForConditionalGeneration checkpoint: its names
    # (model.language_model.*), a vision tower and multi-token-prediction weights (mtp.*).
    "qwen3_5-vl": ("Qwen3_5Config", {"text_config": _QWEN3_5_TEXT, "vision_config": _TINY_VISION}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", _QWEN3_5_MOE_TEXT),  # as Qwen3_5MoeForCausalLM
    "qwen3_5_moe-vl": ("Qwen3_5MoeConfig", {"text_config": _QWEN3_5_MOE_TEXT,
                                            "vision_config": _TINY_VISION}),
    "qwen3_next": ("Qwen3NextConfig", _QWEN3_NEXT),
}

# What the released Qwen3 models share.
_QWEN3 = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936,
              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)

# Qwen3.5-9B's language model: transformers' Qwen3_5TextConfig defaults, spelled out.
_QWEN3_5_9B_TEXT = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

# Qwen3.5-35B-A3B's language model: transformers' Qwen3_5MoeTextConfig defaults, spelled out.
_QWEN3_5_35B_A3B_TEXT = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

# Shapes of real models, for make_random_checkpoint: Qwen3Config settings, with ``num_experts``
# Qwen3MoeConfig settings, with linear-attention heads Qwen3NextConfig settings, or with a
# ``text_config`` Qwen3_5Config settings (with experts Qwen3_5MoeConfig settings: a
# vision-language config; the checkpoint has no vision weights).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(**_QWEN3, num_hidden_layers=28, hidden_size=1024,
                       intermediate_size=3072, num_attention_heads=16, tie_word_embeddings=True),
    # A larger shape, for tensor parallelism (untied embeddings, as the real model).
    "qwen3-8b": dict(**_QWEN3, num_hidden_layers=36, hidden_size=4096,
                     intermediate_size=12288, num_attention_heads=32, tie_word_embeddings=False),
    # The same architecture in miniature: for tests and quick CPU runs of `nanofn bench`.
    "qwen3-tiny": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # Qwen3-MoE: Qwen3-30B-A3B's shape (128 experts, 8 a token, on every layer) and a small one.
    "qwen3-30b-a3b": dict(
        num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-moe-tiny": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1000000.0,
        rms_norm_eps=1e-6),
    # Qwen3.5 (hybrid: Gated DeltaNet and full attention, 3:1): the 9B's shape and a tiny one.
    "qwen3.5-9b-shape": dict(text_config=_QWEN3_5_9B_TEXT, tie_word_embeddings=False),
    "qwen3.5-tiny": dict(
        text_config=dict(
            num_hidden_layers=4,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            vocab_size=512,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
            rms_norm_eps=1e-6,
        ),
        tie_word_embeddings=True,
    ),
    # Qwen3-Next (Qwen3.5-MoE's layers, the linear attention's projections grouped by key head,
    # experts on every layer): the 80B-A3B's shape and a tiny one.
    "qwen3-next-80b-a3b": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25},
        tie_word_embeddings=False),
    "qwen3-next-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        tie_word_embeddings=True),
    # Qwen3.5-MoE (Qwen3.5's layers, experts and a shared expert on every one): the 35B-A3B's
    # shape and a tiny one.
    "qwen3.5-35b-a3b": dict(text_config=_QWEN3_5_35B_A3B_TEXT, tie_word_embeddings=False),
    "qwen3.5-moe-tiny": dict(
        text_config=dict(
            num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25},
            rms_norm_eps=1e-6),
        tie_word_embeddings=True,
    ),
}
RANDOM_WEIGHT_STD = 0.02


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    num_shards: int = 1,
    dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` (one of ``ARCHS``) into ``path``; return it.

    The same arguments always give the same files. ``num_shards > 1`` splits the weights into
    that many files with a ``model.safetensors.index.json``. For a vision-language arch,
    ``config_overrides`` go to its language model's config.
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of: {', '.join(ARCHS)}")
    path = Path(path)
    tokenizer = _make_tokenizer()
    eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config_class, settings = ARCHS[arch]
    language = {
        **settings.get("text_config", settings),
        "vocab_size": len(tokenizer) + EXTRA_MODEL_VOCAB,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "bos_token_id": None,
        **config_overrides,
    }
    multimodal = "text_config" in settings
    if multimodal:
        config = getattr(transformers, config_class)(
            **{**settings, "text_config": language, "tie_word_embeddings": tie_word_embeddings})
    else:
        config = getattr(transformers, config_class)(**language)
    auto_class = (transformers.AutoModelForImageTextToText if multimodal
                  else transformers.AutoModelForCausalLM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config)
        _perturb_norms_and_biases(model, config.get_text_config().initializer_range)
        _tune_linear_attention(model)
    with _quiet_progress_bars(transformers):
        model.to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if multimodal:
        _add_mtp_weights(path, config.get_text_config(), seed)
    if num_shards > 1:
        _reshard(path, num_shards)
    return path


def make_random_checkpoint(path: str | Path, preset: str = "qwen3-0.6b", *,
                           dtype: str = "bfloat16", seed: int = 0, weights: bool = True) -> Path:
    """Write a checkpoint with the config of ``preset`` (one of ``PRESETS``) and random weights
    into ``path`` (without ``weights``: the config and tokenizer alone, for
    ``load_format="dummy"``); return it. For benchmarks: the text it generates is noise.

    Weights (normal, std 0.02; norms scaling by 1) go straight to safetensors without building
    a transformers model, so that 0.6B parameters take seconds. The tokenizer is the
    tiny one: its vocabulary is smaller than the model's, which token-id prompts do not mind.
    """
    import torch
    import transformers
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _make_tokenizer()
    eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    settings = PRESETS[preset]
    common = dict(initializer_range=RANDOM_WEIGHT_STD, dtype=dtype, eos_token_id=eos_token_id,
                  pad_token_id=eos_token_id, bos_token_id=None)
    hybrid = "text_config" in settings or "linear_num_key_heads" in settings
    if "text_config" in settings:
        family = "Qwen3_5Moe" if "num_experts" in settings["text_config"] else "Qwen3_5"
        config = getattr(transformers, f"{family}Config")(
            **{**settings, "text_config": {**settings["text_config"], **common}},
            architectures=[f"{family}ForConditionalGeneration"], dtype=dtype)
        shapes = _qwen3_5_weight_shapes(config)
    elif hybrid:
        config = transformers.Qwen3NextConfig(**settings, architectures=["Qwen3NextForCausalLM"],
                                              **common)
        shapes = _qwen3_next_weight_shapes(config)
    elif "num_experts" in settings:
        config = transformers.Qwen3MoeConfig(**settings, architectures=["Qwen3MoeForCausalLM"],
                                             **common)
        shapes = _qwen3_weight_shapes(config)
    else:
        config = transformers.Qwen3Config(**settings, architectures=["Qwen3ForCausalLM"], **common)
        shapes = _qwen3_weight_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items() if weights else ():
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        if len(shape) == 1:
            tensors[name] = tensor.fill_(_vector_value(name, zero_centred_norms=hybrid))
        else:
            tensors[name] = tensor.normal_(0.0, RANDOM_WEIGHT_STD, generator=generator)
    if weights:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cache_dir() -> Path:
    """``$NANOFN_CACHE``, else ``~/.cache/nanofn``."""
    return Path(os.environ.get("NANOFN_CACHE") or Path.home() / ".cache" / "nanofn")


def cached_checkpoint(name: str, build: Callable[[Path], object]) -> Path:
    """``<cache>/<name>``, made by ``build(folder)`` on first use.

    It is built in a temporary folder and renamed into place, so a folder under that name is
    always complete, even when a build is interrupted or two processes build at once.
    """
    final = cache_dir() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"nanofn: building {final} (once)", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp's folder is private; the cache is not
    try:
        build(staging)
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():  # else another process got there first: use its folder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def demo_model() -> Path:
    """The folder of the built-in demo model (a tiny Qwen3 with random weights: its text is
    gibberish), built into the cache folder on first use: ``LLM(nanofn.demo_model())``."""
    return cached_checkpoint(DEMO_MODEL, lambda folder: make_tiny_checkpoint(folder, "qwen3"))


def random_weights_model(preset: str) -> Path:
    """The folder of ``preset``'s config and the tiny tokenizer, built on first use: a model to
    run with ``load_format="dummy"``, whose weights are drawn on the device."""
    return cached_checkpoint(f"config-{preset}",
                             lambda folder: make_random_checkpoint(folder, preset, weights=False))


def _qwen3_weight_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen3 or Qwen3-MoE model (vectors are norm
    weights); a Qwen3-MoE checkpoint's experts one by one, as transformers saves them."""
    from nanofn.model.moe import is_sparse_layer

    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        sparse = getattr(c, "num_experts", 0) and is_sparse_layer(c, i)
        shapes.update(_layer_shapes(f"model.layers.{i}.", c, _attention_shapes(c, gated=False),
                                    _sparse_mlp_shapes(c) if sparse else None))
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _qwen3_5_weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen3.5 or Qwen3.5-MoE vision-language
    model's language model (vectors are norm weights, and the linear-attention heads' ``A_log``
    and ``dt_bias``)."""
    return _hybrid_weight_shapes(config.text_config, "model.language_model.",
                                 config.tie_word_embeddings)


def _qwen3_next_weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen3-Next model, its experts one by one."""
    return _hybrid_weight_shapes(config, "model.", config.tie_word_embeddings)


def _hybrid_weight_shapes(c: Any, prefix: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """A hybrid language model's, its names under ``prefix``; experts on the layers that have
    them, a dense MLP on the others."""
    from nanofn.model.moe import is_sparse_layer

    shapes = {prefix + "embed_tokens.weight": (c.vocab_size, c.hidden_size),
              prefix + "norm.weight": (c.hidden_size,)}
    grouped = c.model_type == "qwen3_next"
    for i, layer_type in enumerate(c.layer_types):
        mixer = (_linear_attention_shapes(c, grouped) if layer_type == "linear_attention"
                 else _attention_shapes(c, gated=True))
        sparse = getattr(c, "num_experts", 0) and is_sparse_layer(c, i)
        shapes.update(_layer_shapes(f"{prefix}layers.{i}.", c, mixer,
                                    _sparse_mlp_shapes(c) if sparse else None))
    if not tied:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _layer_shapes(layer: str, c: Any, mixer: dict[str, tuple[int, ...]],
                  mlp: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """A decoder layer's: its norms, its attention (``mixer``, names within the layer), its MLP
    (``mlp``, names within the layer; None: the dense one)."""
    hidden = c.hidden_size
    mlp = mlp or _gated_mlp_shapes("mlp.", hidden, c.intermediate_size)
    return {
        layer + "input_layernorm.weight": (hidden,),
        layer + "post_attention_layernorm.weight": (hidden,),
        **{layer + name: shape for name, shape in mixer.items()},
        **{layer + name: shape for name, shape in mlp.items()},
    }


def _gated_mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden),
            prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def _sparse_mlp_shapes(c: Any) -> dict[str, tuple[int, ...]]:
    """An MoE layer's router and experts, one tensor per expert and projection, and its shared
    expert and that expert's gate where the config sizes one (Qwen3.5-MoE)."""
    hidden = c.hidden_size
    shapes = {"mlp.gate.weight": (c.num_experts, hidden)}
    for expert in range(c.num_experts):
        shapes.update(_gated_mlp_shapes(f"mlp.experts.{expert}.", hidden, c.moe_intermediate_size))
    shared = getattr(c, "shared_expert_intermediate_size", 0)
    if shared:
        shapes.update(_gated_mlp_shapes("mlp.shared_expert.", hidden, shared))
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _attention_shapes(c: Any, gated: bool) -> dict[str, tuple[int, ...]]:
    """``gated`` (Qwen3.5): ``q_proj`` gives each head's output gate too."""
    hidden, head_dim = c.hidden_size, c.head_dim
    q_size, kv_size = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return {
        "self_attn.q_proj.weight": ((2 if gated else 1) * q_size, hidden),
        "self_attn.k_proj.weight": (kv_size, hidden),
        "self_attn.v_proj.weight": (kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, q_size),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
    }


def _linear_attention_shapes(c: Any, grouped: bool = False) -> dict[str, tuple[int, ...]]:
    """``grouped`` (Qwen3-Next): the input projections in two tensors, not four."""
    hidden, v_heads = c.hidden_size, c.linear_num_value_heads
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = v_heads * c.linear_value_head_dim
    projections = ({"in_proj_qkvz": 2 * key_dim + 2 * value_dim, "in_proj_ba": 2 * v_heads}
                   if grouped else {"in_proj_qkv": 2 * key_dim + value_dim, "in_proj_z": value_dim,
                                    "in_proj_b": v_heads, "in_proj_a": v_heads})
    return {
        **{f"linear_attn.{name}.weight": (rows, hidden) for name, rows in projections.items()},
        "linear_attn.conv1d.weight": (2 * key_dim + value_dim, 1, c.linear_conv_kernel_dim),
        "linear_attn.A_log": (v_heads,),
        "linear_attn.dt_bias": (v_heads,),
        "linear_attn.norm.weight": (c.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (hidden, value_dim),
    }


def _vector_value(name: str, zero_centred_norms: bool) -> float:
    """A random checkpoint's constant vectors: norms that scale by 1 (zero-centred ones, Qwen3.5's,
    hold 0 for that; its gated norm is plain), and the linear-attention heads' ``dt_bias`` of 1
    and ``A_log`` of 0 (decays of about exp(-1.3) a token)."""
    if name.endswith(("linear_attn.norm.weight", "dt_bias")):
        return 1.0
    return 0.0 if zero_centred_norms or name.endswith("A_log") else 1.0


@contextlib.contextmanager
def _quiet_progress_bars(transformers) -> Iterator[None]:
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def _perturb_norms_and_biases(model: torch.nn.Module, std: float) -> None:
    """Hugging Face inits norms to one and biases to zero; random values make loading bugs visible."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, std)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)


_ZERO_CENTRED_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
_GATED_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")


def _tune_linear_attention(model: torch.nn.Module) -> None:
    """Qwen3.5's weights where the common draw would mislead: its zero-centred norms (which
    scale by ``1 + w``, initialised to 0) moved back around 0, and decays that keep some memory.

    The decay of a linear-attention head is ``exp(-exp(A_log) * softplus(a + dt_bias))``. With
    transformers' ``A = exp(A_log)`` up to 16 and ``a`` drawn as large as the other projections'
    outputs, most heads would forget everything at every token, leaving a test of the state
    nothing to check: ``A`` is drawn in [0.01, 0.1] and ``in_proj_a`` smaller, for decays of
    about 0.86 to 0.997 a token (the first of 20 tokens still sways the greedy output).
    """
    import torch

    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if kind in _ZERO_CENTRED_NORMS:
                module.weight.sub_(1.0)
            elif kind in _GATED_DELTA_NETS:
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 0.1).log())
                _decay_projection(module).mul_(0.05)


def _decay_projection(net: torch.nn.Module) -> torch.Tensor:
    """The rows of a Gated DeltaNet's input projection that give ``a``: Qwen3.5's ``in_proj_a``,
    or in Qwen3-Next's ``in_proj_ba`` the second half of each key head's group."""
    if hasattr(net, "in_proj_a"):
        return net.in_proj_a.weight
    ba = net.in_proj_ba.weight.view(net.num_k_heads, 2, -1, net.hidden_size)
    return ba[:, 1]


def _add_mtp_weights(path: Path, text_config: Any, seed: int) -> None:
    """Two multi-token-prediction tensors, as Qwen3.5's checkpoints carry (``mtp.*``), which
    neither transformers nor nanofn's forward uses."""
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    hidden = text_config.hidden_size
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    dtype = tensors["model.language_model.embed_tokens.weight"].dtype
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator).to(dtype)
    tensors["mtp.norm.weight"] = torch.randn(hidden, generator=generator).to(dtype)
    save_file(tensors, weights, metadata={"format": "pt"})


def _make_tokenizer():
    """A byte-level BPE tokenizer trained on ``TRAINING_TEXT`` (deterministic, milliseconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _reshard(path: Path, num_shards: int) -> None:
    """Split ``model.safetensors`` into ``num_shards`` files plus the index Hugging Face writes."""
    from safetensors.torch import load_file, save_file

    single = path / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    weight_map, total_size = {}, 0
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        shard_names = names[shard::num_shards]
        save_file({name: tensors[name] for name in shard_names}, path / file_name, metadata={"format": "pt"})
        for name in shard_names:
            weight_map[name] = file_name
            total_size += tensors[name].numel() * tensors[name].element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    single.unlink()
