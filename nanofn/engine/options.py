"""Engine options, with vLLM's names and defaults: the one home of every default (the core's
and the runner's configs are derived from them, and the command line's help reads them here)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from os import PathLike
from typing import Any

from nanofn.state import SchedulerConfig

KERNEL_BACKENDS = ("auto", "torch", "triton", "flash")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATIONS = (None, "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 is e4m3, as in vLLM
SMALL_HIDDEN_SIZE = 1024  # narrower models run on one CPU thread by default


@dataclass(frozen=True)
class EngineOptions:
    model: str
    tokenizer: str | None = None  # default: the model folder
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int | None = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    block_size: int = 16
    trace: str | None = None  # a path: record this run's trace there
    kv_cache_memory_bytes: int | None = None  # default: from gpu_memory_utilization (GPU), 4 GiB (CPU)
    num_kv_blocks: int | None = None  # an exact KV cache size, for tests and debugging
    # "auto": the checkpoint's safetensors; "dummy": random weights from the config alone
    load_format: str = "auto"
    # A hybrid model's recurrent-state slots (working and saved states), for tests and
    # debugging; default: from the memory left beside the KV cache (see the runner)
    num_state_slots: int | None = None
    device: str = "auto"  # "cuda" when there is a GPU, else "cpu"
    kernel_backend: str = "auto"  # on CUDA "flash" where it runs, else "triton"; on CPU "torch"
    async_scheduling: bool = True  # schedule the next step while the device runs this one
    cpu_threads: int | None = None  # torch's threads on a CPU device; default: cpu_threads_for
    # Sampling defaults: "auto" from the model's generation_config.json, "vllm" none (vLLM's
    # SamplingParams defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Tensor parallelism across hosts: ``nnodes`` hosts of tensor_parallel_size / nnodes ranks
    # each; node 0 runs the engine (and its ranks), the others ``nanofn worker`` only; all
    # meet at master_addr:master_port (node 0's address and a free port there).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # "fp8": quantize a bf16 checkpoint's attention and MLP projections at load (per output
    # channel, dynamic per-token activations); an FP8 checkpoint needs none (its config says)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (e4m3): 1 byte an entry
    # Tensor parallelism's small all-reduces through NCCL too, not through peer memory
    # (``nanofn/kernels/all_reduce.py``), as vLLM's option of the same name
    disable_custom_all_reduce: bool = False
    # A mixture-of-experts model's ranks each hold E / tensor_parallel_size whole experts,
    # instead of a share of every expert (vLLM's option of the same name); dense layers and
    # attention stay split as before
    enable_expert_parallel: bool = False
    # A streamed request is reported by ``Engine.step()`` at its first token, at its finish and
    # else once it has this many new tokens (vLLM's and SGLang's option of the same name):
    # fewer, larger chunks for the server to build, send and stream, at high concurrency
    stream_interval: int = 1

    def __post_init__(self) -> None:
        for problem in _problems(self):
            raise ValueError(problem)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown option(s): {', '.join(unknown)}; nanofn takes: "
                            f"{', '.join(sorted(known - {'model'}))}")
        return cls(model=str(model), **kwargs)

    def scheduler_config(self, max_model_len: int, eos_token_ids: tuple[int, ...],
                         vocab_size: int | None) -> SchedulerConfig:
        """The core's configuration for a model with these facts; raises ``ValueError`` naming
        a limit that cannot work (checked before anything costly is loaded)."""
        return SchedulerConfig(
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            eos_token_ids=eos_token_ids,
            vocab_size=vocab_size,
        )

    def cpu_threads_for(self, hidden_size: int) -> int | None:
        """torch's threads for a model this wide on a CPU: ``cpu_threads`` if given, else one
        for a model narrower than ``SMALL_HIDDEN_SIZE`` (the demo and test models), else None:
        torch's default, a thread per core.

        A small model's matrices are too small to split: more threads only synchronise, and on
        a busy machine with few cores they wait for each other (benchmarks/RESULTS.md: the
        demo's 32-prompt batch on a busy 2-core machine, 0.11-0.14 s with one thread, up to
        3.8 s with torch's two).
        """
        if self.cpu_threads is not None:
            return self.cpu_threads
        return 1 if hidden_size < SMALL_HIDDEN_SIZE else None


def default(name: str) -> Any:
    """The default of an option."""
    return next(f.default for f in fields(EngineOptions) if f.name == name)


def _problems(o: EngineOptions):
    """One message per invalid option; the first one is raised."""
    utilization = o.gpu_memory_utilization
    if not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        yield f"gpu_memory_utilization must be in (0, 1], got {utilization!r}"
    for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                 "stream_interval"):
        value = getattr(o, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            yield f"{name} must be a positive integer, got {value!r}"
    for name in ("max_model_len", "kv_cache_memory_bytes", "num_kv_blocks", "num_state_slots",
                 "cpu_threads"):
        value = getattr(o, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            yield f"{name} must be a positive integer or None, got {value!r}"
    if o.load_format not in LOAD_FORMATS:
        yield f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {o.load_format!r}"
    if o.quantization not in QUANTIZATIONS:
        yield f"quantization must be None or 'fp8', got {o.quantization!r}"
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        yield f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {o.kv_cache_dtype!r}"
    if o.kernel_backend not in KERNEL_BACKENDS:
        yield (f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
               f"got {o.kernel_backend!r}")
    for name in ("enforce_eager", "async_scheduling", "disable_custom_all_reduce",
                 "enable_expert_parallel"):
        if not isinstance(getattr(o, name), bool):
            yield f"{name} must be True or False, got {getattr(o, name)!r}"
    if o.seed is not None and (not isinstance(o.seed, int) or isinstance(o.seed, bool)):
        yield f"seed must be an integer or None, got {o.seed!r}"
    for name in ("dtype", "device"):
        if not isinstance(getattr(o, name), str):
            yield f"{name} must be a string, got {getattr(o, name)!r}"
    if not isinstance(o.generation_config, (str, PathLike)):
        yield (f"generation_config must be 'auto', 'vllm' or a folder, got "
               f"{o.generation_config!r}")
    for name in ("tokenizer", "trace"):
        if getattr(o, name) is not None and not isinstance(getattr(o, name), (str, PathLike)):
            yield f"{name} must be a path or None, got {getattr(o, name)!r}"
    if o.device not in ("auto", "cpu", "cuda") and not o.device.startswith("cuda:"):
        yield f"device must be 'auto', 'cpu' or 'cuda[:N]', got {o.device!r}"
    yield from _cluster_problems(o)


def _cluster_problems(o: EngineOptions):
    """The multi-host options: counts in range, whole ranks per host, a port to meet at."""
    for name in ("nnodes", "node_rank"):
        value = getattr(o, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            yield f"{name} must be a non-negative integer, got {value!r}"
            return
    if o.nnodes < 1:
        yield f"nnodes must be at least 1, got {o.nnodes}"
    elif o.node_rank >= o.nnodes:
        yield f"node_rank must be below nnodes ({o.nnodes}), got {o.node_rank}"
    elif isinstance(o.tensor_parallel_size, int) and o.tensor_parallel_size % o.nnodes:
        yield (f"tensor_parallel_size {o.tensor_parallel_size} does not split over nnodes "
               f"{o.nnodes}: every host runs the same number of ranks")
    if o.master_port is not None and (not isinstance(o.master_port, int)
                                      or not 0 < o.master_port < 65536):
        yield f"master_port must be a TCP port (1 to 65535), got {o.master_port!r}"
    if o.nnodes > 1 and o.master_port is None:
        yield "nnodes > 1 needs master_port: a free port on node 0's master_addr"
    if not isinstance(o.master_addr, str) or not o.master_addr:
        yield f"master_addr must be a host name or address, got {o.master_addr!r}"
