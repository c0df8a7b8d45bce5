"""The standard offline-throughput workload, its measurement, and its physical floor.

The workload is nano-vllm's ``bench.py``: seeded with 0, 256 requests of U(100, 1024) random
token ids in [0, 10000], each with ``max_tokens`` U(100, 1024), ``ignore_eos``, temperature 0.6;
all prompts are drawn first, then all output lengths. The floor is the roofline of
the workplace's ``shared/tools/roofline.py`` (outside this repository) as a function of the model's shape: prefill
FLOPs at the matmul rate, plus, for every decode step with all requests running together,
the larger of its FLOPs at the matmul rate and its bytes (every weight once, the K/V of every
running token once) at the memory bandwidth.
"""

from __future__ import annotations

import importlib.util
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from nanofn.state import SamplingParams

DEFAULT_BANDWIDTH_GBPS = 3028.0  # H100 80GB HBM3, measured device-to-device copy
DEFAULT_TFLOPS = 813.0  # H100 80GB HBM3, measured bf16 8192^3 matmul
# device name (as torch.cuda.get_device_name gives it) -> measured (GB/s, TFLOP/s)
KNOWN_DEVICE_RATES = {"NVIDIA H100 80GB HBM3": (DEFAULT_BANDWIDTH_GBPS, DEFAULT_TFLOPS),
                      "NVIDIA H200": (4300.0, 788.0)}  # (the workplace's copy and matmul)
# The workload's sizes: the standard one, and the default on a CPU, which runs it with the demo
# model in seconds (the standard one would take hours there).
STANDARD_SIZES = {"num_seqs": 256, "max_input_len": 1024, "max_output_len": 1024}
CPU_SIZES = {"num_seqs": 64, "max_input_len": 256, "max_output_len": 128}
# The shared-prefix workload (issue 9): every request is one long shared prefix plus its own
# tokens, as with a long system prompt; what it measures is the prefix cache.
SHARED_PREFIX_SIZES = {"num_seqs": 256, "shared_len": 2048, "own_len": 100, "max_tokens": 128}
CPU_SHARED_PREFIX_SIZES = {"num_seqs": 32, "shared_len": 256, "own_len": 32, "max_tokens": 16}
MAX_TOKEN_ID = 10000
WARMUP_PROMPTS = 16  # the workload's first prompts, each with 16 new tokens


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def sampling_params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
                for n in self.max_tokens]


def standard_workload(num_seqs: int = 256, max_input_len: int = 1024,
                      max_output_len: int = 1024, vocab_size: int | None = None) -> Workload:
    """nano-vllm's benchmark requests: the numbers its ``random.seed(0)`` and ``randint`` calls
    give, in its order.

    Lengths are U(100, max), or U(1, max) when max is below 100 (small CPU runs). With a
    ``vocab_size`` of 10000 or less (tiny test models), token ids are taken modulo it.
    """
    rng = random.Random(0)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(_draw_len(rng, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [_draw_len(rng, max_output_len) for _ in range(num_seqs)]
    if vocab_size is not None and vocab_size <= MAX_TOKEN_ID:
        prompts = [[t % vocab_size for t in prompt] for prompt in prompts]
    return Workload(prompts, max_tokens)


def shared_prefix_workload(num_seqs: int = 256, shared_len: int = 2048, own_len: int = 100,
                           max_tokens: int = 128, vocab_size: int | None = None) -> Workload:
    """``num_seqs`` requests of the same ``shared_len`` random tokens followed by ``own_len``
    of their own, ``max_tokens`` new tokens each (seeded; ids as in ``standard_workload``)."""
    rng = random.Random(0)
    shared = [rng.randint(0, MAX_TOKEN_ID) for _ in range(shared_len)]
    prompts = [shared + [rng.randint(0, MAX_TOKEN_ID) for _ in range(own_len)]
               for _ in range(num_seqs)]
    if vocab_size is not None and vocab_size <= MAX_TOKEN_ID:
        prompts = [[t % vocab_size for t in prompt] for prompt in prompts]
    return Workload(prompts, [max_tokens] * num_seqs)


def _draw_len(rng: random.Random, max_len: int) -> int:
    return rng.randint(_min_len(max_len), max_len)


def _min_len(max_len: int) -> int:
    return 100 if max_len >= 100 else 1


def describe_sizes(sizes: Mapping[str, int]) -> str:
    """``standard_workload``'s keyword arguments, in words."""
    def lengths(max_len: int) -> str:
        return f"U({_min_len(max_len)}, {max_len})"

    if "shared_len" in sizes:
        return (f"{sizes['num_seqs']} requests, prompts of {sizes['shared_len']} shared + "
                f"{sizes['own_len']} own tokens, {sizes['max_tokens']} output tokens each")
    return (f"{sizes['num_seqs']} requests, prompts of {lengths(sizes['max_input_len'])} "
            f"tokens, {lengths(sizes['max_output_len'])} output tokens each")


# --- the floor ------------------------------------------------------------------------------

def device_rates(device_name: str, bandwidth_gbps: float | None,
                 tflops: float | None) -> tuple[float, float] | None:
    """The memory bandwidth (GB/s) and matmul rate (TFLOP/s) for the floor: those given, the
    others measured on this device (``KNOWN_DEVICE_RATES``); None when one is neither (a CPU,
    a GPU not measured): a floor from another device's rates would be meaningless."""
    known_bandwidth, known_tflops = KNOWN_DEVICE_RATES.get(device_name, (None, None))
    bandwidth = known_bandwidth if bandwidth_gbps is None else bandwidth_gbps
    tflops = known_tflops if tflops is None else tflops
    return None if bandwidth is None or tflops is None else (bandwidth, tflops)


@dataclass(frozen=True)
class ModelDims:
    """The sizes the floor depends on (attention and MLP matmuls, the LM head, the KV cache;
    for a hybrid model, its linear-attention layers and their recurrent states)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    # A hybrid model's (Qwen3.5): its linear-attention (Gated DeltaNet) layers among
    # ``num_layers``, their heads, and its full attention's output gate (q_proj twice as wide).
    num_linear_layers: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0
    gated_attention: bool = False
    # the delta rule's state: float32 where the config's mamba_ssm_dtype says so (Qwen3.5's
    # checkpoints), else the model's bf16 (as vLLM's "auto")
    state_bytes_per_value: int = 2
    # A mixture-of-experts model's: its MoE layers among ``num_layers`` (the others keep a dense
    # MLP of ``intermediate_size``), the routed experts, and a shared expert where it has one.
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """From a Hugging Face ``config.json`` (as a dict); a vision-language model's from its
        ``text_config``, but for the embeddings' tying, which the model's own config says."""
        tie_word_embeddings = config.get("tie_word_embeddings", False)
        config = config.get("text_config") or config
        heads = config["num_attention_heads"]
        linear = _num_linear_layers(config)
        hybrid = {} if not linear else dict(
            num_linear_layers=linear, linear_key_heads=config["linear_num_key_heads"],
            linear_value_heads=config["linear_num_value_heads"],
            linear_key_dim=config["linear_key_head_dim"],
            linear_value_dim=config["linear_value_head_dim"],
            conv_kernel=config["linear_conv_kernel_dim"], gated_attention=True,
            state_bytes_per_value=4 if config.get("mamba_ssm_dtype") == "float32" else 2)
        moe = _moe_dims(config)
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config.get("intermediate_size") or 0,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            tie_word_embeddings=tie_word_embeddings,
            **hybrid,
            **moe,
        )

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers - self.num_linear_layers

    @property
    def shared_body_params(self) -> int:
        """Matmul weights every token reads in all decoder layers: q/k/v (q with its gate, a
        hybrid model's), o, or a linear-attention layer's projections (q/k/v, the output gate
        z, b, a, out); the gated MLP, or an MoE layer's router and shared expert (with its
        gate). The routed experts are apart (``expert_params``)."""
        h, d = self.hidden_size, self.head_dim
        mlp = 3 * h * self.intermediate_size
        q_heads = self.num_heads * (2 if self.gated_attention else 1)
        attention = h * (q_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        shared_expert = 3 * h * self.shared_expert_intermediate_size
        moe_shared = h * self.num_experts + shared_expert + (h if shared_expert else 0)
        return (self.num_attention_layers * attention + self.linear_attention_params
                + (self.num_layers - self.num_moe_layers) * mlp + self.num_moe_layers * moe_shared)

    @property
    def linear_attention_params(self) -> int:
        """A hybrid model's linear-attention projections (q/k/v, z, b, a, out) in all its
        linear-attention layers: part of ``shared_body_params``, and never FP8 in nanofn."""
        h = self.hidden_size
        key_dim = self.linear_key_heads * self.linear_key_dim
        value_dim = self.linear_value_heads * self.linear_value_dim
        per_layer = h * (2 * key_dim + 2 * value_dim + 2 * self.linear_value_heads) + value_dim * h
        return self.num_linear_layers * per_layer

    @property
    def expert_params(self) -> int:
        """One routed expert's weights (gate, up, down) in one MoE layer."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def body_params(self) -> int:
        """Matmul weights of all decoder layers, every routed expert included."""
        return self.shared_body_params + self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def active_body_params(self) -> int:
        """The decoder layers' weights one token multiplies by: its experts' alone."""
        return (self.shared_body_params
                + self.num_moe_layers * self.experts_per_token * self.expert_params)

    def experts_read(self, num_tokens: int) -> float:
        """Routed experts' weights a step of ``num_tokens`` tokens reads, in all MoE layers:
        each layer's experts that any token chose, expected under uniform routing (each
        expert left out by one token with probability ``1 - k / E``)."""
        if not self.num_moe_layers:
            return 0.0
        untouched = (1 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.num_moe_layers * self.num_experts * (1 - untouched) * self.expert_params

    @property
    def state_bytes(self) -> int:
        """A sequence's recurrent state, every linear layer's (0 for a transformer): the delta
        rule's (``state_bytes_per_value`` each), and the convolution's past inputs (bf16)."""
        per_layer = (self.linear_value_heads * self.linear_key_dim * self.linear_value_dim
                     * self.state_bytes_per_value
                     + (2 * self.linear_key_heads * self.linear_key_dim
                        + self.linear_value_heads * self.linear_value_dim)
                     * (self.conv_kernel - 1) * 2)
        return self.num_linear_layers * per_layer

    @property
    def state_flops_per_token(self) -> int:
        """The delta rule's work for one token: decay, read, write and read again of each
        value head's ``k x v`` state, in every linear layer."""
        return (6 * self.num_linear_layers * self.linear_value_heads * self.linear_key_dim
                * self.linear_value_dim)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Matmul and embedding weights (norms left out); an untied embedding counts apart. It
        is stored but not read whole: a step gathers only its tokens' rows."""
        return self.body_params + self.lm_head_params + self._untied_embedding

    @property
    def active_params(self) -> int:
        """``num_params`` with only the experts one token chooses (all of them for a dense
        model)."""
        return self.active_body_params + self.lm_head_params + self._untied_embedding

    @property
    def _untied_embedding(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size


def _moe_dims(config: Mapping[str, Any]) -> dict[str, int]:
    """A mixture-of-experts config's ``ModelDims`` fields (none for a dense one). Layer ``i``
    is an MoE layer unless listed in ``mlp_only_layers`` or off ``decoder_sparse_step``'s beat,
    as in transformers' Qwen3-MoE; transformers 5 writes the expert count as
    ``num_local_experts``."""
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not num_experts:
        return {}
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    layers = sum(1 for i in range(config["num_hidden_layers"])
                 if i not in dense and (i + 1) % step == 0)
    return dict(num_moe_layers=layers, num_experts=num_experts,
                experts_per_token=config["num_experts_per_tok"],
                moe_intermediate_size=config["moe_intermediate_size"],
                shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0)


def _num_linear_layers(config: Mapping[str, Any]) -> int:
    """A hybrid config's linear-attention layers: as its ``layer_types`` say, or, where it has
    linear-attention heads but no list, transformers' default (every fourth layer full)."""
    if config.get("layer_types"):
        return list(config["layer_types"]).count("linear_attention")
    if "linear_num_value_heads" not in config:
        return 0
    interval = config.get("full_attention_interval", 4)
    return sum(1 for i in range(config["num_hidden_layers"]) if (i + 1) % interval)


@dataclass(frozen=True)
class Floor:
    prefill_s: float
    decode_s: float
    num_output_tokens: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.seconds

    def describe(self) -> str:
        """As ``shared/tools/roofline.py`` prints it."""
        return (f"prefill {format_seconds(self.prefill_s)} + decode "
                f"{format_seconds(self.decode_s)} = {format_seconds(self.seconds)}  ->  "
                f"{self.output_tok_s:,.0f} output tok/s")


def format_seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x:.2g} s"  # tiny CPU models give microseconds


def floor(dims: ModelDims, prompt_lens: Sequence[int], output_lens: Sequence[int], *,
          bandwidth_gbps: float = DEFAULT_BANDWIDTH_GBPS, tflops: float = DEFAULT_TFLOPS,
          bytes_per_param: int = 2, shared_prefix_len: int = 0,
          projection_bytes: int | None = None, kv_bytes: int | None = None) -> Floor:
    """The least time any engine needs for this workload on a device with these rates.

    ``bytes_per_param`` is the size of a weight and of a cached K or V element (2, bf16, in
    ``shared/tools/roofline.py``); ``projection_bytes`` that of the decoder layers' matmul
    weights and ``kv_bytes`` that of a cached element where they differ from it (1 with FP8
    projections or an FP8 KV cache: the LM head and a hybrid model's linear-attention
    projections stay in the model's dtype; the FP8 scales,
    3 % of the weights at most, are left out). The matmul rate is the same: the FP8 tensor
    cores' is twice bf16's, but this floor is a bf16 one made cheaper in bytes alone. The first output token of a request comes from its prefill; each later one from a decode
    step that runs every unfinished request at once. The first ``shared_prefix_len`` tokens of
    every prompt are the same: computed once, and their K/V read once per decode step.

    A hybrid model's full-attention layers alone keep K/V; its linear-attention layers do a
    fixed amount of work per token on a fixed-size state per sequence, which each decode step
    reads and writes once for every running sequence. A mixture-of-experts model's token
    multiplies by its chosen experts alone, and a decode step reads the experts its tokens
    chose (``ModelDims.experts_read``).
    """
    layers, heads, head_dim = dims.num_attention_layers, dims.num_heads, dims.head_dim
    lm_head = dims.lm_head_params
    projection_bytes = bytes_per_param if projection_bytes is None else projection_bytes
    kv_bytes = bytes_per_param if kv_bytes is None else kv_bytes
    full_precision = lm_head + dims.linear_attention_params  # (never FP8 in nanofn)
    shared_weight_bytes = (projection_bytes * (dims.shared_body_params
                                               - dims.linear_attention_params)
                           + bytes_per_param * full_precision)
    kv_bytes_per_token = layers * 2 * dims.num_kv_heads * head_dim * kv_bytes
    # all but attention's and the LM head's
    token_flops = 2 * dims.active_body_params + dims.state_flops_per_token
    bandwidth, peak = bandwidth_gbps * 1e9, tflops * 1e12

    def attention_flops(query_tokens: int, context: int) -> int:  # QK^T and PV
        return 4 * layers * heads * head_dim * context * query_tokens

    def causal_flops(n: int) -> float:  # matmuls and attention of a prompt's first n tokens
        return token_flops * n + 4 * layers * heads * head_dim * n * (n + 1) / 2

    # a prompt's token i attends to i + 1 keys; the LM head runs on its last token only
    shared = shared_prefix_len
    prefill_flops = causal_flops(shared) + sum(causal_flops(n) - causal_flops(shared)
                                               + 2 * lm_head for n in prompt_lens)
    decode_s = 0.0
    for s in range(1, max(output_lens)):  # decode step s makes output token s + 1
        contexts = [n + s for n, o in zip(prompt_lens, output_lens) if s < o]
        if not contexts:
            break
        flops = (len(contexts) * (token_flops + 2 * lm_head)
                 + sum(attention_flops(1, c) for c in contexts))
        weight_bytes = shared_weight_bytes + projection_bytes * dims.experts_read(len(contexts))
        step_bytes = (weight_bytes + kv_bytes_per_token * (sum(contexts)
                                                           - (len(contexts) - 1) * shared)
                      + 2 * dims.state_bytes * len(contexts))
        decode_s += max(flops / peak, step_bytes / bandwidth)
    return Floor(prefill_flops / peak, decode_s, sum(output_lens))


def bench_data_types(hf_config: Any, options: Any, dtype: Any) -> dict[str, Any]:
    """The data types a run computes with (``options``: its ``EngineOptions``), in words: the
    projections' weights, the KV cache's, the activations' (quantized to FP8 with FP8
    projections), and the rest; and ``floor``'s byte sizes for them (``floor_bytes``)."""
    from nanofn.model.config import num_linear_layers
    from nanofn.model.decoder import decoder_options
    from nanofn.model.quantization import fp8_scheme

    scheme = fp8_scheme(hf_config, options.quantization)
    name = str(dtype).removeprefix("torch.")
    kv_cache = "fp8_e4m3" if options.kv_cache_dtype.startswith("fp8") else name
    weights = "fp8_e4m3" if scheme else name
    activations = f"fp8_e4m3 into the projections ({scheme.description})" if scheme else name
    if scheme and decoder_options(hf_config).sparse_moe:
        activations += f", {name} into the routed experts (FP8 weight-only)"
    rest = ("embeddings, norms, LM head and linear attention" if num_linear_layers(hf_config)
            else "embeddings, norms and LM head")
    return {"weights": weights, "kv_cache": kv_cache, "activations": activations,
            "floor_bytes": {"projection_bytes": 1 if scheme else None,
                            "kv_bytes": 1 if kv_cache == "fp8_e4m3" else None},
            "description": (f"projection weights {weights}, KV cache {kv_cache}, activations "
                            f"{activations}; {rest} {name}")}


# --- the measurement ------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    num_preemptions: int
    prefix_cache_hit_rate: float  # of this workload's admissions (the warm-up left out)
    device_busy_s: float | None = None  # with a timeline: the device's busy time in the run
    # Triton kernels compiled during the run, by name (None: not counted, with tensor
    # parallelism), and the seconds that took: the warm-up should have compiled them all
    kernels_compiled: dict[str, int] | None = None
    compile_s: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def device_idle_fraction(self) -> float | None:
        """The share of the run the device spent waiting for the host."""
        if self.device_busy_s is None:
            return None
        return max(0.0, 1 - self.device_busy_s / self.elapsed_s)


def measure(llm: Any, workload: Workload, timeline: Any = None) -> Measurement:
    """Warm up, then time one ``generate`` of the whole workload; with a ``DeviceTimeline``,
    also the device's busy time during it. The warm-up runs prompts of the workload's sizes
    (a step's worth of prefill) and some decoding, so that compilation and first-use
    allocations stay out of the measurement, as engines warm up before serving; the Triton
    kernels compiled inside the measured run even so are counted (one rank)."""
    vocab_size = llm.engine.text_config.vocab_size
    warmup = [[t % vocab_size for t in prompt] for prompt in workload.prompts[:WARMUP_PROMPTS]]
    llm.generate(warmup, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()  # the measured run finds none of the warm-up's prompts cached
    before = llm.engine.state.counters
    llm.engine.runner.timeline = timeline
    params = workload.sampling_params()  # (before the clock, as nano-vllm's bench builds them)
    with _counting_compilations(llm) as compiled:
        start = time.perf_counter()
        if timeline is not None:
            timeline.begin()
        try:
            outputs = llm.generate(workload.prompts, params, use_tqdm=False)
        finally:
            if timeline is not None:
                timeline.end()
            elapsed = time.perf_counter() - start
            llm.engine.runner.timeline = None
    after = llm.engine.state.counters
    admitted = after.num_admitted_tokens - before.num_admitted_tokens
    cached = after.num_cached_tokens - before.num_cached_tokens
    return Measurement(
        num_requests=len(outputs),
        num_prompt_tokens=workload.num_prompt_tokens,
        num_output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed_s=elapsed,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_hit_rate=cached / admitted if admitted else 0.0,
        device_busy_s=timeline.busy_seconds() if timeline is not None else None,
        kernels_compiled=None if compiled is None else dict(Counter(compiled.kernels)),
        compile_s=0.0 if compiled is None else compiled.seconds,
    )


@contextmanager
def _counting_compilations(llm: Any) -> Iterator[Any]:
    """``counting_compilations`` where the kernels run in this process (one rank, Triton
    installed), else ``None``: tensor-parallel ranks compile in processes of their own."""
    if llm.engine.options.tensor_parallel_size > 1 or importlib.util.find_spec("triton") is None:
        yield None
        return
    from nanofn.kernels.compilations import counting_compilations

    with counting_compilations() as compiled:
        yield compiled
