"""Models: tensor-parallel layers, the decoder architectures, and safetensors loading."""

from nanofn.model.batch import AttentionBatch
from nanofn.model.config import ModelShape, model_shape
from nanofn.model.decoder import ARCHITECTURES, CausalLM
from nanofn.model.loader import build_model, load_weights, resolve_dtype

__all__ = [
    "ARCHITECTURES",
    "AttentionBatch",
    "CausalLM",
    "ModelShape",
    "build_model",
    "load_weights",
    "model_shape",
    "resolve_dtype",
]
