"""Building a model from a Hugging Face config and filling it from safetensors files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from nanofn.kernels import TORCH_KERNELS, KernelBackend
from nanofn.kernels.fp8 import FP8_DTYPE, Fp8Weight, dequantize_groups, quantize_groups
from nanofn.model.config import (check_activation, check_context_fits_window, num_linear_layers,
                                 text_config)
from nanofn.model.decoder import CausalLM, decoder_options
from nanofn.model.hybrid import HybridCausalLM
from nanofn.model.quantization import Fp8Scheme, fp8_scheme

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}

# Hugging Face projections that nanofn fuses: checkpoint module name -> (fused name, shard id).
FUSED_PROJECTIONS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Qwen3.5's linear attention: in_proj_qkv holds three outputs (the heads of q, k and v)
    "in_proj_qkv": ("in_proj", (0, 1, 2)),
    "in_proj_z": ("in_proj", 3),
    "in_proj_b": ("in_proj", 4),
    "in_proj_a": ("in_proj", 5),
}
# Qwen3-Next's linear attention: two tensors that hold Qwen3.5's four, their rows grouped by key
# head (``hybrid.InProjection``): checkpoint module name -> (shard id, the tensors it stands for).
GROUPED_PROJECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "in_proj_qkvz": ("qkvz", ("in_proj_qkv", "in_proj_z")),
    "in_proj_ba": ("ba", ("in_proj_b", "in_proj_a")),
}
# An MoE layer's experts, stacked into ``w13`` ([gate | up]) and ``w2`` (``moe.StackedExperts``):
# per-expert tensors (``experts.<index>.gate_proj.weight``; an FP8 checkpoint's scales beside
# them, into ``w13_scale`` and ``w2_scale``) or transformers' fused ones (``experts.gate_up_proj``,
# ``experts.down_proj``, which fill a parameter whole).
EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?:(?P<index>\d+)\."
                           r"(?P<projection>gate_proj|up_proj|down_proj)\."
                           r"(?P<leaf>weight|weight_scale_inv|weight_scale)"
                           r"|(?P<fused>gate_up_proj|down_proj))")
EXPERT_PROJECTIONS: dict[str, tuple[str, int | None]] = {  # -> (parameter, part of w13)
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
    "gate_up_proj": ("w13", None),
}
# A vision-language checkpoint's language model (Qwen3.5's) is under this prefix, not "model.".
LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."  # skipped: the text API has no image input
MTP_PREFIX = "mtp."  # multi-token prediction: set aside for speculative decoding


def resolve_dtype(hf_config: Any, dtype: str | torch.dtype = "auto") -> torch.dtype:
    """The parameter dtype: ``"auto"`` takes the config's ``dtype`` (or ``torch_dtype``), else float32."""
    if dtype == "auto":
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")


def build_model(
    hf_config: Any,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    max_model_len: int | None = None,
    kernels: KernelBackend = TORCH_KERNELS,
    quantization: str | None = None,
    expert_parallel: bool = False,
) -> CausalLM:
    """An uninitialised model holding this rank's shard; fill it with ``load_weights``. A config
    with linear-attention layers gives a ``HybridCausalLM``, whose ``forward`` takes state slots.

    ``max_model_len``, the longest context the caller will run, sizes the rotary table (default:
    the config's ``max_position_embeddings``) and is checked against a sliding window.
    ``kernels`` are the kernels every layer calls (projections, attention, norms, rotary, activation).
    An FP8 checkpoint (its ``quantization_config``), or ``quantization="fp8"``, gives FP8
    attention and MLP projections (``quantization.py``); the embeddings, norms and LM head keep
    ``dtype``. ``expert_parallel``: an MoE model's ranks hold whole experts (``moe.py``).
    """
    options = dataclasses.replace(decoder_options(hf_config), expert_parallel=expert_parallel)
    check_activation(hf_config)
    check_context_fits_window(hf_config, max_model_len)
    max_positions = max_model_len or text_config(hf_config).max_position_embeddings
    model_class = HybridCausalLM if num_linear_layers(hf_config) else CausalLM
    scheme = fp8_scheme(hf_config, quantization)
    if scheme is not None:
        check_fp8_supported(scheme, options)
        options = dataclasses.replace(options, fp8=scheme)
    with torch.device(device), _default_dtype(resolve_dtype(hf_config, dtype)):
        model = model_class(hf_config, options, kernels, max_positions, tp_rank, tp_size)
    if scheme is not None:
        check_ignored_modules(model, scheme)
    model.fp8_scheme = scheme  # (``load_weights`` dequantizes what the model holds unquantized)
    return model.eval()


def check_fp8_supported(scheme: Fp8Scheme, options: Any) -> None:
    """FP8 is read for dense decoders (Qwen3, Qwen2, Llama, Mistral), the hybrid Qwen3.5 (its
    full-attention and MLP projections; its linear attention stays in full precision) and
    mixture-of-experts models (their experts too, weight-only: ``moe.py``), except with static
    activation scales there (the experts take no activation scale)."""
    if options.sparse_moe and scheme.static_input_scale:
        raise ValueError(f"{scheme.description}: static activation scales are not supported "
                         f"for mixture-of-experts models (their experts multiply weight-only); "
                         f"dynamic activations are")


def check_ignored_modules(model: CausalLM, scheme: Fp8Scheme) -> None:
    """The checkpoint's ignore list against what nanofn quantizes, refusing a mismatch by the
    module's name: every attention and MLP projection is FP8 or none is (none of them may be
    ignored). A hybrid model's linear-attention projections stay in full precision whichever
    way the checkpoint holds them (LLM Compressor's recipes for Qwen3.5 ignore them, Qwen's own
    FP8 checkpoints quantize them: those load dequantized, ``_Dequantizer``)."""
    for name, param in model.named_parameters():
        if not name.endswith(".weight") or param.dtype != FP8_DTYPE:
            continue
        for checkpoint_name in _checkpoint_names(name, param):
            module = checkpoint_name.removesuffix(".weight")
            if scheme.is_ignored(module):
                raise ValueError(f"unsupported FP8 checkpoint: it keeps {module} unquantized "
                                 f"(its ignore list), and nanofn quantizes every attention and "
                                 f"MLP projection or none")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


DUMMY_WEIGHT_STD = 0.02  # as make_random_checkpoint's: the logits keep a sane spread


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """vLLM's ``load_format="dummy"``: every weight drawn where it lies, from the config alone,
    no checkpoint read (a 9B model in milliseconds, where writing one takes minutes). Matrices
    are normal with std ``DUMMY_WEIGHT_STD``; vectors are norms that scale by 1 (zero-centred
    ones already folded to ``1 + w``), a linear-attention head's ``dt_bias`` of 1, ``A_log`` and
    biases of 0. The text a model so filled writes is noise: it is for benchmarks.

    Matrices are drawn in the order of the model's parameters, an FP8 projection's in float32
    and quantized as its scheme stores them (its scales filled with it): so a model quantized
    at load holds the quantized weights of the bf16 model of the same seed, and the two can be
    compared (``benchmarks/fp8_agreement.py``)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    fp8_weights = {id(weight.data): (module.fp8, weight) for module in model.modules()
                   if isinstance(getattr(module, "fp8", None), Fp8Scheme)
                   for weight in getattr(module, "matrices", None) or (module.matrix,)}
    scales = {id(weight.scale) for _, weight in fp8_weights.values()}
    for name, param in model.named_parameters():
        if id(param) in fp8_weights:
            _fill_fp8(*fp8_weights[id(param)], generator)
        elif id(param) in scales:
            continue  # (filled with its weight)
        elif param.dim() > 1:
            param.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)
        else:
            param.fill_(0.0 if name.endswith(("A_log", "bias")) else 1.0)


def _fill_fp8(scheme: Fp8Scheme, weight: Fp8Weight, generator: torch.Generator) -> None:
    """An FP8 projection's (or stacked experts') dummy weight: drawn as a matrix of the model's
    dtype is drawn, then quantized matrix by matrix, its scales written."""
    drawn = torch.empty(weight.shape, device=weight.data.device)
    drawn.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)
    if scheme.weight_scales == "channel":  # (every row at once: 30B-A3B's 12,288 matrices)
        q, scales = quantize_groups(drawn, drawn.shape[-1])
        weight.data.copy_(q)
        weight.scale.copy_(scales)
        return
    for matrix, data, scale in zip(drawn.view(-1, *drawn.shape[-2:]),
                                   weight.data.view(-1, *drawn.shape[-2:]),
                                   weight.scale.view(-1, *weight.scale.shape[-2:])):
        q, scales = scheme.quantize(matrix)
        data.copy_(q)
        scale.copy_(scales)


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Copy this rank's shard of every checkpoint tensor in ``model_dir`` into ``model``.

    Reads one ``*.safetensors`` file or the shards listed in ``model.safetensors.index.json``.
    Raises when a model parameter has no tensor, a tensor has no parameter, or shapes differ.
    A vision-language checkpoint's language model loads and its vision tower is skipped; a
    hybrid model's multi-token-prediction tensors go to ``model.mtp_weights``, in host memory.
    """
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters())  # a tied lm_head shares, so omits, its weight
    missing = {name for param_name, param in params.items()
               if not getattr(param, "filled_by_weight", False)  # (FP8 scales made at load)
               for name in _checkpoint_names(param_name, param)}
    scheme = getattr(model, "fp8_scheme", None)
    dequantize = (_Dequantizer(files, scheme) if scheme and not scheme.quantize_at_load
                  else None)
    for path in files:
        with _open_checkpoint(path) as checkpoint:
            for stored_name in checkpoint.keys():
                name = _language_model_name(stored_name)
                if _is_ignored(name, model):
                    continue
                if name.startswith(MTP_PREFIX) and hasattr(model, "mtp_weights"):
                    model.mtp_weights[name] = checkpoint.get_tensor(stored_name)
                    continue
                if dequantize and dequantize.is_companion(name, params):
                    continue
                param_name, shard_id = _parameter_name(name)
                if param_name not in params:
                    raise ValueError(f"unexpected tensor {stored_name!r} in {path}: the model has no such parameter")
                param = params[param_name]
                if _another_ranks_expert(param, shard_id):
                    continue
                try:
                    tensor = checkpoint.get_tensor(stored_name)
                    if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE and dequantize:
                        tensor = dequantize(stored_name, tensor, param.dtype)
                    param.weight_loader(param, tensor, shard_id)
                except ValueError as error:
                    raise ValueError(f"tensor {stored_name!r} in {path}: {error}") from error
                missing.difference_update(_names_filled(name, shard_id, param_name, param))
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks tensors: {', '.join(_described(missing))}")
    _drop_loaders(params.values())


class _Dequantizer:
    """An FP8 checkpoint's tensors that nanofn holds in full precision (a hybrid's
    linear-attention projections, which Qwen's own Qwen3.5 FP8 checkpoints quantize; a router
    it quantizes): each dequantized with its scales (read from whichever file holds them) and
    rounded to the parameter's dtype as it loads; the scales, and a static activation scale,
    go with it."""

    def __init__(self, files: list[Path], scheme: Fp8Scheme):
        self.scheme = scheme
        self.locations = {}
        for path in files:
            with _open_checkpoint(path) as checkpoint:
                self.locations.update(dict.fromkeys(checkpoint.keys(), path))

    def is_companion(self, name: str, params: dict[str, torch.nn.Parameter]) -> bool:
        """Whether ``name`` is the scale (or activation scale) of a weight loaded dequantized:
        one whose parameter is not FP8."""
        module, _, leaf = name.rpartition(".")
        if leaf not in (self.scheme.scale_name, "input_scale"):
            return False
        param = params.get(_parameter_name(f"{module}.weight")[0])
        return param is not None and param.dtype != FP8_DTYPE

    def __call__(self, stored_name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scale_name = stored_name.removesuffix("weight") + self.scheme.scale_name
        if scale_name not in self.locations:
            raise ValueError(f"an FP8 weight without its scales ({scale_name} is missing)")
        with _open_checkpoint(self.locations[scale_name]) as checkpoint:
            scales = checkpoint.get_tensor(scale_name)
        rows, columns = weight.shape
        row_scales = self.scheme.row_scales(scales, rows, columns)
        return dequantize_groups(weight, row_scales, self.scheme.group_size(columns)).to(dtype)


def _another_ranks_expert(param: torch.nn.Parameter, shard_id: Any) -> bool:
    """Whether a per-expert tensor (``shard_id`` its expert, or ``(expert, part)``) is of an
    expert another expert-parallel rank holds (``StackedExperts``): it is not read. An index
    past every expert is, for the loader to refuse it."""
    experts = getattr(param, "experts", None)
    if experts is None or shard_id is None:
        return False
    expert = shard_id[0] if isinstance(shard_id, tuple) else shard_id
    return expert not in experts and 0 <= expert < param.num_experts


def _described(missing: set[str]) -> list[str]:
    """The missing tensors' names, sorted; one that a Qwen3-Next grouped projection would hold
    names that projection too."""
    described = []
    for name in sorted(missing):
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        grouped = [f"{parent}.{grouped}.{leaf}"
                   for grouped, (_, sources) in GROUPED_PROJECTIONS.items() if module in sources]
        described.append(f"{name} (or {grouped[0]})" if grouped else name)
    return described


def _drop_loaders(params: Iterable[torch.nn.Parameter]) -> None:
    """A parameter's ``weight_loader`` is a bound method of its module, which holds the
    parameter: a reference cycle per layer, which only the cyclic collector frees, and the
    engine's ``gc.freeze()`` puts it out of that collector's reach. Without the loaders, closing
    an engine frees the weights at once."""
    for param in params:
        with contextlib.suppress(AttributeError):
            del param.weight_loader


def _open_checkpoint(path: Path):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(f"cannot read weights file {path} (truncated, or not safetensors): "
                         f"{error}") from error


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, from its index when it has one."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
        for file in files:
            if not file.exists():
                raise FileNotFoundError(f"{index} lists {file.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def _language_model_name(checkpoint_name: str) -> str:
    """A vision-language checkpoint's language-model tensor under the name a text-only one gives
    it (``model.language_model.layers.0...`` -> ``model.layers.0...``)."""
    if checkpoint_name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + checkpoint_name.removeprefix(LANGUAGE_MODEL_PREFIX)
    return checkpoint_name


def _parameter_name(checkpoint_name: str) -> tuple[str, str | int | tuple[int, ...] | None]:
    """Map a Hugging Face tensor name to ``(nanofn parameter name, shard id)``; shard id None:
    the tensor fills the parameter whole."""
    expert = EXPERT_TENSOR.fullmatch(checkpoint_name)
    if expert:
        return _expert_parameter(expert)
    module_path, _, leaf = checkpoint_name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in FUSED_PROJECTIONS:
        fused, shard_id = FUSED_PROJECTIONS[module]
        return f"{parent}.{fused}.{leaf}", shard_id
    if module in GROUPED_PROJECTIONS:
        return f"{parent}.in_proj.{leaf}", GROUPED_PROJECTIONS[module][0]
    return checkpoint_name, None


def _names_filled(checkpoint_name: str, shard_id: Any, param_name: str,
                  param: torch.nn.Parameter) -> list[str]:
    """The tensors of ``_checkpoint_names`` that one checkpoint tensor stood for: itself, those
    a Qwen3-Next grouped projection holds, or all of a parameter it filled whole."""
    if shard_id is None:
        return _checkpoint_names(param_name, param)
    module_path, _, leaf = checkpoint_name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in GROUPED_PROJECTIONS:
        return [f"{parent}.{source}.{leaf}" for source in GROUPED_PROJECTIONS[module][1]]
    return [checkpoint_name]


def _expert_parameter(match: re.Match) -> tuple[str, tuple[int, int] | int | None]:
    """An experts tensor's parameter and shard id (``StackedExperts``' loaders): ``(expert,
    part)`` for a gate or up projection, the expert for a down projection, None for a fused
    tensor of all experts."""
    if match["fused"]:
        return f"{match['experts']}.{EXPERT_PROJECTIONS[match['fused']][0]}", None
    param, part = EXPERT_PROJECTIONS[match["projection"]]
    expert = int(match["index"])
    suffix = "" if match["leaf"] == "weight" else "_scale"
    return f"{match['experts']}.{param}{suffix}", expert if part is None else (expert, part)


def _checkpoint_names(param_name: str, param: torch.nn.Parameter) -> list[str]:
    """The Hugging Face tensors that together fill one nanofn parameter (an MoE layer's
    stacked experts: the per-expert tensors, which one fused tensor may stand for)."""
    module_path, _, leaf = param_name.rpartition(".")
    if module_path.endswith(".mlp.experts") and leaf.removesuffix("_scale") in ("w13", "w2"):
        projections = ("gate_proj", "up_proj") if leaf.startswith("w13") else ("down_proj",)
        tensor = getattr(param, "checkpoint_leaf", "weight")  # (a scale's: weight_scale_inv)
        return [f"{module_path}.{expert}.{projection}.{tensor}"
                for expert in param.experts for projection in projections]
    parent, _, module = module_path.rpartition(".")
    sources = [hf for hf, (fused, _) in FUSED_PROJECTIONS.items() if fused == module]
    return [f"{parent}.{hf}.{leaf}" for hf in sources] or [param_name]


def _is_ignored(checkpoint_name: str, model: CausalLM) -> bool:
    """Rotary ``inv_freq`` buffers, a vision tower, and an ``lm_head`` copy where the model ties
    it to the embedding."""
    if checkpoint_name.endswith("rotary_emb.inv_freq") or checkpoint_name.startswith(VISION_PREFIX):
        return True
    return model.tie_word_embeddings and checkpoint_name == "lm_head.weight"
