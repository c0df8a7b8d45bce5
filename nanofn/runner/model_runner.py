"""Executes batch plans on one device: the model, its paged KV cache and the sampler."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nanofn.kernels import TORCH_KERNELS, KernelBackend
from nanofn.kernels.all_reduce import ranks_all_reduce
from nanofn.kernels.fp8 import FP8_DTYPE
from nanofn.model import ModelShape, build_model, load_weights, model_shape, resolve_dtype
from nanofn.model.batch import RecurrentState
from nanofn.model.config import text_config
from nanofn.model.loader import init_dummy_weights
from nanofn.model.quantization import fp8_scheme
from nanofn.runner.cuda_graphs import DecodeGraphs
from nanofn.runner.inputs import ModelInputs, SlotTables, prepare_inputs
from nanofn.runner.sampler import (DeviceSample, Sampler, SamplingRows, costliest_rows,
                                  logprob_scores, plain_rows, to_device)
from nanofn.runner.timeline import DeviceTimeline
from nanofn.runner.warm_up import eager_decode_batches, prompt_plan, warm_up_plans
from nanofn.state.config import blocks_for
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, SeqStart, TokenBitmask, TokenLogprobs

log = logging.getLogger("nanofn")

CPU_KV_CACHE_BYTES = 4 << 30  # the default KV cache on a CPU, as vLLM's CPU backend
DECODE_GRAPHS_UP_TO = 512  # sequences: larger decode steps run eagerly


@dataclass(frozen=True)
class RunnerConfig:
    """What a runner needs, derived once from the engine's options (which hold the defaults)."""

    model_dir: Path
    dtype: str  # "auto" (the checkpoint's), "bfloat16", "float16" or "float32"
    device: torch.device
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None  # overrides the memory-based sizing
    num_kv_blocks: int | None  # overrides everything
    seed: int | None
    enforce_eager: bool  # no CUDA graphs
    kernel_backend: str
    tp_size: int
    tp_rank: int = 0
    cpu_threads: int | None = None  # torch's threads on a CPU; None: torch's (and on a GPU)
    num_state_slots: int | None = None  # a hybrid model's recurrent-state slots; None: from memory
    load_format: str = "auto"  # "dummy": random weights from the config (``init_dummy_weights``)
    # Tensor parallelism across hosts (see ``tensor_parallel``): hosts, and where they meet
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    quantization: str | None = None  # "fp8": a bf16 checkpoint's projections quantized at load
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn (e4m3)
    disable_custom_all_reduce: bool = False  # every all-reduce through NCCL (see all_reduce.py)
    expert_parallel: bool = False  # an MoE model's ranks hold whole experts (model/moe.py)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_for(self.max_model_len, self.block_size)


class ModelRunner:
    def __init__(self, hf_config: Any, config: RunnerConfig):
        try:
            self._build(hf_config, config)
        except BaseException:
            # The exception's traceback holds this half-built runner (its frame's ``self``)
            # for as long as the caller keeps the exception: let go of the weights, the KV
            # cache and the graphs now, so that a failed start does not hold the GPU.
            self.close()
            raise

    def close(self) -> None:
        """Let go of the weights, the KV cache and the graphs (the runner is unusable after),
        and give the memory back to the device."""
        self.__dict__.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _build(self, hf_config: Any, config: RunnerConfig) -> None:
        self.config = config
        self.device = config.device
        if self.device.index is not None:  # streams, events, graphs and Triton use the current one
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = resolve_dtype(hf_config, config.dtype)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.shape = model_shape(hf_config, config.tp_size)
        text = text_config(hf_config)  # a vision-language config's language model, else the same
        self.kernels = choose_kernels(config, self.dtype, self.shape,
                                      text.num_attention_heads // config.tp_size,
                                      fp8_weights=fp8_scheme(hf_config, config.quantization)
                                      is not None)
        if config.tp_size > 1:  # (a collective: every rank builds its runner in step)
            # peer memory maps one host's GPUs only
            custom = config.nnodes == 1 and not config.disable_custom_all_reduce
            self.kernels = replace(self.kernels, all_reduce=ranks_all_reduce(
                config.device, self.dtype, custom))
        self.model = build_model(hf_config, dtype=self.dtype, device=config.device,
                                 tp_rank=config.tp_rank, tp_size=config.tp_size,
                                 max_model_len=config.max_model_len, kernels=self.kernels,
                                 quantization=config.quantization,
                                 expert_parallel=config.expert_parallel)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed or 0)
        else:
            load_weights(self.model, config.model_dir)
        self.sampler = Sampler(config.seed, config.device)
        self.num_blocks, self.num_state_slots = self._decide_cache_sizes()
        if config.tp_size > 1:  # every rank must hold the same blocks: take the smallest
            agreed = torch.tensor([self.num_blocks, self.num_state_slots or 0],
                                  device=config.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            self.num_blocks = int(agreed[0].item())
            self.num_state_slots = int(agreed[1].item()) or None
        self.kv_cache = torch.zeros(self.shape.kv_cache_shape(self.num_blocks, config.block_size),
                                    dtype=self.kv_dtype, device=config.device)
        hybrid = self.shape.recurrent is not None
        # (a hybrid model's states have one slot more, the spare runner slot's: a decode
        # graph's padding rows update it, and nothing reads it)
        self.states = (RecurrentState.zeros(self.shape.recurrent, self.num_state_slots + 1,
                                            self.dtype, config.device) if hybrid else None)
        self.slot_tables = SlotTables(config.max_num_seqs, config.max_blocks_per_seq, self.device,
                                      hybrid)
        if hybrid:
            self.slot_tables.state_slot[-1] = self.num_state_slots
        self.slot_params = SlotParams(config.max_num_seqs)
        self._state_slot_of = np.full(config.max_num_seqs, -1, np.int64)  # by runner slot
        self._sampling_slots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.timeline: DeviceTimeline | None = None  # set, on CUDA, to measure the busy time
        self._work_start = None  # the timeline's mark where the launched step's work begins
        self.graphs = self.prefill_graphs = None
        # The torch reference attention gathers whole block tables: captured at the graphs'
        # full width it would need more memory than the KV cache leaves. Graphs are for Triton.
        # Plain sampling in the graphs too, where one rank samples with Triton.
        self.slot_temperature = None
        if self.device.type == "cuda" and self.kernels is not TORCH_KERNELS:
            self.warm_up()  # (before the graphs: their captures must not compile)
        largest_graph = self._largest_decode_graph()
        if (self.device.type == "cuda" and largest_graph is not None
                and self.kernels is not TORCH_KERNELS):
            if config.tp_size == 1 and self.sampler.use_triton:
                self.slot_temperature = torch.zeros(config.max_num_seqs + 1, device=self.device)
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.slot_tables,
                                       largest_graph, config.block_size,
                                       text.hidden_size, self.dtype, self.slot_temperature,
                                       self.states)
        if self.graphs is not None:
            from nanofn.runner.prefill_graphs import PrefillGraphs  # (imports Triton)

            attention = next(layer.self_attn for layer in self.model.model.layers
                             if hasattr(layer, "self_attn"))  # (a hybrid's first is linear)
            qkv_proj = attention.qkv_proj  # this rank's heads
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv_cache, self.slot_tables, config.max_num_batched_tokens,
                config.block_size, text.hidden_size, self.dtype, qkv_proj.num_heads,
                qkv_proj.num_kv_heads, self.states)

    def new_timeline(self) -> DeviceTimeline:
        """A timeline of this runner's device, for ``timeline``."""
        return DeviceTimeline(self.device)

    @torch.inference_mode()
    def launch(self, plan: BatchPlan, token_bitmask: TokenBitmask | None = None) -> DeviceSample:
        """Queue a (non-empty) plan's work on the device and sample for the sequences that ask
        for it, in plan order, within ``token_bitmask`` (structured output) if given. The
        tokens stay on the device for the next plan's ``PENDING_TOKEN``s; ``wait()`` on the
        result brings them to the host."""
        self._work_start = self.timeline.mark() if self.timeline is not None else None
        self.slot_params.start(plan.started)  # first: the choice of sampler reads them
        sampling_slots = plan.slots[plan.sample]
        if token_bitmask is None and self._samples_in_graph(plan, sampling_slots):
            self._start(plan.started)
            greedy = not self.slot_params.floats[sampling_slots, SlotParams.TEMPERATURE].any()
            key_base = 0 if greedy else self.sampler.key_base()  # as the eager sampler draws
            self._states_before(plan)
            sample = DeviceSample.start(self.graphs.sample(plan, key_base),
                                        len(plan.sampling_seq_ids))
            self._states_after(plan)
        else:
            logits, scores = self.forward(plan)
            sample = self.sampler.sample(logits, self.slot_params.rows(plan), token_bitmask)
            self.keep_sampled_tokens(plan, sample.token_ids)
            if scores is not None:
                sample.prompt_logprobs = prompt_logprobs(scores, plan)
        if self._work_start is not None:
            self.timeline.add(self._work_start, _step_kind(plan))
        return sample

    def _states_before(self, plan: BatchPlan) -> None:
        """A hybrid model's state work before a plan's (every rank): the starting sequences'
        state slots, and the saved states they start from copied in."""
        if plan.started and self.states is not None:
            self._start_states(plan.started)
        if plan.state_restores:
            self._copy_states(plan.state_restores)

    def _states_after(self, plan: BatchPlan) -> None:
        """A hybrid model's state work after a plan's: its saves."""
        if plan.state_saves:
            self._copy_states(self._saved_states(plan))

    def _start_states(self, started: tuple[SeqStart, ...]) -> None:
        """The starting sequences' state slots, by runner slot, on the host (for the saves)
        and on the device (every path reads them there, graphs too)."""
        slots = np.array([s.slot for s in started], np.int64)
        states = np.array([s.state_slot for s in started], np.int64)
        if not ((states >= 0) & (states < self.num_state_slots)).all():
            # (-1 would read and write the padding's spare state; past the states, any memory)
            given = {s.seq_id: s.state_slot for s in started}
            raise ValueError(f"a hybrid model's starting sequences need state slots in [0, "
                             f"{self.num_state_slots}), got {given}")
        self._state_slot_of[slots] = states
        self.slot_tables.state_slot[to_device(slots, self.device)] = to_device(states,
                                                                             self.device)

    def _copy_states(self, pairs: tuple[tuple[int, int], ...] | list) -> None:
        """Copy recurrent states between slots: whole states, ``(from, to)`` pairs (the plan's
        restores before its work, its saves after it; stream order keeps them apart)."""
        sources, targets = (to_device(np.array(side, np.int64), self.device)
                            for side in zip(*pairs))
        for part in (self.states.conv, self.states.ssm):
            part[targets] = part[sources]

    def _saved_states(self, plan: BatchPlan) -> list[tuple[int, int]]:
        """The plan's saves as ``(working slot, saved slot)`` pairs."""
        working = self._state_slot_of
        return [(working[int(plan.slots[i])], slot) for i, slot in plan.state_saves]

    def _samples_in_graph(self, plan: BatchPlan, sampling_slots: np.ndarray) -> bool:
        """Whether a decode graph can sample this plan: every sampling row plain (see
        ``DecodeGraphs``)."""
        return (self.slot_temperature is not None and not plan.banned and not plan.histories
                and not plan.prompt_logprobs and self.graphs.fits(plan)
                and bool(self.slot_params.plain[sampling_slots].all()))

    def _start(self, started: tuple[SeqStart, ...]) -> None:
        """The starting sequences' temperatures to the device, for the sampling graphs (their
        parameters on the host are recorded at the launch's start)."""
        if started and self.slot_temperature is not None:
            slots = np.array([s.slot for s in started], np.int64)
            temperatures = self.slot_params.floats[slots, SlotParams.TEMPERATURE]
            self.slot_temperature[to_device(slots, self.device)] = to_device(temperatures,
                                                                             self.device)

    def keep_sampled_tokens(self, plan: BatchPlan, tokens: torch.Tensor | None = None) -> None:
        """Keep the plan's sampled tokens by slot, for the next plan's ``PENDING_TOKEN``s; with
        several ranks, rank 0's tokens (``tokens``) reach the others (``None``) by broadcast."""
        if self.config.tp_size > 1 and plan.sampling_seq_ids:
            if tokens is None:
                tokens = torch.empty(len(plan.sampling_seq_ids), dtype=torch.int64,
                                     device=self.device)
            dist.broadcast(tokens, src=0)
        if tokens is not None:
            self.slot_tables.keep_sampled(self._sampling_slots, tokens)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The logits of the sampling sequences, ``[S, vocab]`` float32, and the scores of the
        positions ``plan.prompt_logprobs`` asks about, if any (every rank runs this; rank 0
        samples)."""
        self._states_before(plan)
        if self.graphs is not None and self.graphs.fits(plan):
            hidden, sample_rows, self._sampling_slots = self.graphs.forward(plan)
        elif self.prefill_graphs is not None and self.prefill_graphs.fits(plan):
            hidden, sample_rows, self._sampling_slots = self.prefill_graphs.forward(plan)
        else:
            inputs = prepare_inputs(plan, self.config.block_size, self.slot_tables, self.device)
            if self.timeline is not None:  # (an idle device waited for the inputs' layout: the
                self._work_start = self.timeline.mark()  # step's work starts with its layers)
            self._sampling_slots, sample_rows = inputs.sampling_slots, inputs.sample_rows
            hidden = self._run_model(inputs, self.kv_cache, self.states)
        self._states_after(plan)
        # The starting sequences' temperatures, once the model's work is queued: only the
        # sampling graphs read them, so the device need not wait for their copies to start.
        self._start(plan.started)
        scores = None
        if plan.prompt_logprobs:
            rows = to_device(prompt_logprob_rows(plan), self.device)
            scores = score_prompt_rows(self.model, hidden[rows], plan)
        if len(plan.sampling_seq_ids) < plan.num_tokens:
            hidden = hidden[sample_rows]
        return self.model.compute_logits(hidden), scores

    def _run_model(self, inputs: ModelInputs, kv_cache: torch.Tensor,
                   states: RecurrentState | None) -> torch.Tensor:
        if states is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.batch, kv_cache)
        return self.model(inputs.input_ids, inputs.positions, inputs.batch, kv_cache, states)

    def _decide_cache_sizes(self) -> tuple[int, int | None]:
        """The KV blocks and, for a hybrid model, the recurrent-state slots: given, or from
        one memory budget (``cache_sizes``)."""
        c = self.config
        block_bytes = self.shape.block_bytes(c.block_size, self.kv_dtype)
        state_bytes = self.shape.state_bytes(self.dtype)
        if c.num_kv_blocks is not None:
            budget = None
        elif c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif self.device.type != "cuda":
            budget = CPU_KV_CACHE_BYTES
        else:
            budget = self._profile_cuda_budget()
        return cache_sizes(c, budget, block_bytes, state_bytes)

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        """Bytes left for the caches in ``gpu_memory_utilization`` of the GPU once the weights
        and the activations of the largest step (measured by running one) have their share."""
        c = self.config
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free  # weights, CUDA context, other processes
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_bytes = self._run_largest_step()
        activations = torch.cuda.max_memory_allocated(self.device) - base - scratch_bytes
        torch.cuda.empty_cache()
        budget = int(total * c.gpu_memory_utilization - used_elsewhere - activations)
        log.info("caches: %.2f GiB; activations %.2f GiB", budget / 2**30, activations / 2**30)
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {used_elsewhere / 2**30:.1f} GiB in use "
                f"before the cache, {activations / 2**30:.1f} GiB of activations, "
                f"gpu_memory_utilization {c.gpu_memory_utilization}; raise it or lower "
                f"max_num_batched_tokens")
        return budget

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every kernel variant that serving's eager steps can meet, by taking them
        (``warm_up``): in scratch block tables over the real KV cache (and state slot 0), which
        hold nothing yet, sampled by a sampler of its own (the engine's keeps its stream)."""
        c = self.config
        started = time.perf_counter()
        plans = warm_up_plans(self._largest_step_tokens(), c.max_num_seqs, c.max_model_len,
                              c.block_size, self.num_blocks,
                              eager_decode_batches(c.max_num_seqs, self._largest_decode_graph()))
        tables = SlotTables(c.max_num_seqs, c.max_blocks_per_seq, self.device,
                            self.states is not None)
        sampler = Sampler(0, self.device, self.sampler.use_triton)
        for plan in plans:
            logits = self.eager_logits(plan, tables, self.kv_cache, self.states)
            for rows in (plain_rows(len(logits)), costliest_rows(len(logits))):
                sampler.sample(logits, rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # (as after the profile step: the graphs' pools come next)
        log.info("warm-up: %d steps in %.1f s", len(plans), time.perf_counter() - started)

    def eager_logits(self, plan: BatchPlan, tables: SlotTables, kv_cache: torch.Tensor,
                     states: RecurrentState | None) -> torch.Tensor:
        """A plan's forward pass outside the graphs, in ``tables`` over ``kv_cache``, and the
        logits of its sampling rows (the profile step's and the warm-up's)."""
        inputs = prepare_inputs(plan, self.config.block_size, tables, self.device)
        hidden = self._run_model(inputs, kv_cache, states)
        return self.model.compute_logits(hidden[inputs.sample_rows])

    def _largest_decode_graph(self) -> int | None:
        """Sequences of the largest decode graph (larger decode steps run eagerly), or None
        under ``enforce_eager``, where every decode step does."""
        c = self.config
        return None if c.enforce_eager else min(c.max_num_seqs, DECODE_GRAPHS_UP_TO)

    def _largest_step_tokens(self) -> int:
        """The most tokens a step takes: ``max_num_batched_tokens``, or as many as
        ``max_num_seqs`` sequences of ``max_model_len`` hold if fewer."""
        c = self.config
        return min(c.max_num_batched_tokens, min(c.max_num_seqs, c.max_num_batched_tokens)
                   * c.max_model_len)

    def _run_largest_step(self) -> int:
        """One forward pass of ``max_num_batched_tokens`` prompt tokens spread over
        ``max_num_seqs`` sequences (none longer than ``max_model_len``), plus the logits of every
        sequence and the sampler's costliest draw from them. Returns the bytes of the scratch KV
        cache it used."""
        c = self.config
        num_seqs = min(c.max_num_seqs, c.max_num_batched_tokens)
        tokens = self._largest_step_tokens()
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        blocks_per_seq = blocks_for(max(lens), c.block_size)
        scratch = torch.zeros(self.shape.kv_cache_shape(num_seqs * blocks_per_seq, c.block_size),
                              dtype=self.kv_dtype, device=self.device)
        hybrid = self.shape.recurrent is not None
        # (every sequence starts from zeros in one scratch slot: their states are not kept)
        states = (RecurrentState.zeros(self.shape.recurrent, 1, self.dtype, self.device)
                  if hybrid else None)
        tables = SlotTables(num_seqs, blocks_per_seq, self.device, hybrid)
        logits = self.eager_logits(prompt_plan(lens, c.block_size, num_seqs * blocks_per_seq),
                                   tables, scratch, states)
        # (a sampler of its own: the engine's keeps its random stream)
        Sampler(0, self.device).sample(logits, costliest_rows(len(logits))).wait()
        torch.cuda.synchronize(self.device)
        state_bytes = 0 if states is None else sum(
            part.numel() * part.element_size() for part in (states.conv, states.ssm))
        return scratch.numel() * scratch.element_size() + state_bytes


STATE_SHARE = 0.5  # at most this share of the cache budget goes to recurrent states


def cache_sizes(config: RunnerConfig, budget: int | None, block_bytes: int,
                state_bytes: int) -> tuple[int, int | None]:
    """``(KV blocks, state slots)`` in ``budget`` bytes (None: ``num_kv_blocks`` is given).

    A hybrid model (``state_bytes`` > 0) needs a state slot per running sequence and more for
    the saved states of the prefix cache: ``num_state_slots`` if given, else twice
    ``max_num_seqs``, within ``STATE_SHARE`` of the budget (a 9B Qwen3.5's state is ~50 MB:
    512 of them would take half an H100). The blocks take the rest. Other models: all
    blocks, no slots. On a CPU, blocks past what ``max_num_seqs`` full sequences can use are
    not made."""
    slots = None
    if state_bytes:
        slots = config.num_state_slots
        if slots is None:
            within = 2 * config.max_num_seqs if budget is None else int(
                budget * STATE_SHARE // state_bytes)
            slots = max(1, min(2 * config.max_num_seqs, within))
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, slots
    blocks = (budget - (slots + 1 if slots else 0) * state_bytes) // block_bytes  # (+ the spare)
    if config.device.type != "cuda" and config.kv_cache_memory_bytes is None:
        blocks = min(blocks, config.max_num_seqs * config.max_blocks_per_seq)
    return max(int(blocks), 0), slots


def check_kv_cache_size(hf_config: Any, config: RunnerConfig) -> None:
    """A KV cache given by size that cannot hold one sequence of ``max_model_len``: said now,
    before the weights load (a cache sized from GPU memory is checked once it is measured)."""
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        shape = model_shape(hf_config, config.tp_size)
        dtype = resolve_dtype(hf_config, config.dtype)
        blocks, _ = cache_sizes(config, config.kv_cache_memory_bytes,
                                shape.block_bytes(config.block_size,
                                                  kv_cache_dtype(config.kv_cache_dtype, dtype)),
                                shape.state_bytes(dtype))
    else:
        return
    if blocks < config.max_blocks_per_seq:
        raise ValueError(f"a KV cache of {blocks} blocks of {config.block_size} tokens cannot "
                         f"hold one sequence of max_model_len {config.max_model_len} (it needs "
                         f"{config.max_blocks_per_seq}); give it more or lower max_model_len")


def prompt_logprob_rows(plan: BatchPlan) -> np.ndarray:
    """The token rows (in the plan's flat token order) whose logits ``plan.prompt_logprobs``
    asks about: each entry's first ``len(targets)`` scheduled positions."""
    first_row = np.cumsum(plan.num_scheduled) - plan.num_scheduled
    return np.concatenate([first_row[i] + np.arange(len(targets))
                           for i, _, targets in plan.prompt_logprobs]).astype(np.int64)


# Positions of a prompt whose logits are made at a time for their logprobs: a step's 16,384
# prompt positions at once took 10 GB of float32 logits (and as much again for their
# log-softmax) past what start-up had reserved, and ran out of memory
PROMPT_ROWS_AT_ONCE = 256


def score_prompt_rows(model: torch.nn.Module, hidden: torch.Tensor,
                      plan: BatchPlan) -> tuple[torch.Tensor, ...]:
    """``sampler.logprob_scores`` of the targets ``plan.prompt_logprobs`` names, from the hidden
    states of ``prompt_logprob_rows(plan)``, whose logits are made ``PROMPT_ROWS_AT_ONCE`` at a
    time (on every rank: the LM head gathers its vocabulary across them)."""
    targets = torch.tensor([t for _, _, ids in plan.prompt_logprobs for t in ids],
                           device=hidden.device)
    return logprob_scores(lambda start, stop: model.compute_logits(hidden[start:stop]), targets,
                          max(k for _, k, _ in plan.prompt_logprobs), PROMPT_ROWS_AT_ONCE)


def prompt_logprobs(scores: tuple[torch.Tensor, ...], plan: BatchPlan) -> tuple:
    """``SampleOutput.prompt_logprobs`` from ``score_prompt_rows``'s scores: per target, its
    logprob and rank and the entry's top k (a wait for the copy: only plans with prompt
    logprobs pay it)."""
    chosen, ranks, top_ids, top_values = (column.tolist() for column in scores)
    entries, row = [], 0
    for i, k, ids in plan.prompt_logprobs:
        position = int(plan.start_pos[i]) + 1
        per_token = []
        for j, token in enumerate(ids):
            r = row + j
            top_pairs = tuple(zip(top_ids[r][:k], top_values[r][:k])) if k else ()
            per_token.append(TokenLogprobs(token, chosen[r], ranks[r], top_pairs))
        entries.append((plan.seq_ids[i], position, tuple(per_token)))
        row += len(ids)
    return tuple(entries)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's (``auto``), or float8_e4m3fn (``fp8``)."""
    return FP8_DTYPE if name == "fp8" else model_dtype


def choose_kernels(config: RunnerConfig, dtype: torch.dtype, shape: ModelShape,
                   num_heads: int, fp8_weights: bool = False) -> KernelBackend:
    """The model's kernels (projections, attention, norms, rotary, activation), chosen once per engine.

    ``auto``: on CUDA, flash-attn-4's prefill with the Triton kernels (``flash``) where it
    imports and passes its self-check at this model's shape (``num_heads``: this rank's) and
    the KV cache is not FP8 (flash-attn-4 does not read one), else Triton; elsewhere the torch
    references. Asking for ``flash`` where it cannot run raises, saying why; so do FP8 weights
    (``fp8_weights``) or an FP8 KV cache on a GPU whose Triton kernels cannot compute in FP8.
    """
    name = config.kernel_backend
    if name == "auto":
        name = "flash" if config.device.type == "cuda" else "torch"
    if name != "torch" and (fp8_weights or config.kv_cache_dtype == "fp8"):
        from nanofn.kernels.device import fp8_problem

        problem = fp8_problem(config.device)
        if problem is not None:
            what = "FP8 weights" if fp8_weights else "an FP8 KV cache"
            raise RuntimeError(f"{what} on {config.device}: {problem}")
    if name == "flash" and config.kv_cache_dtype == "fp8":
        if config.kernel_backend == "flash":
            raise RuntimeError("kernel_backend 'flash' (flash-attn-4) cannot read an FP8 KV "
                               "cache; use 'triton' or 'auto'")
        name = "triton"  # (Triton's prefill reads it)
    if name == "flash":
        from nanofn.kernels.device import flash_attention_problem

        problem = flash_attention_problem(config.device, dtype)
        if problem is None:
            from nanofn.kernels import flash_attention

            problem = flash_attention.self_check(config.device, dtype, num_heads,
                                                 shape.num_kv_heads, shape.head_dim,
                                                 config.block_size)
            if problem is None:
                return flash_attention.FLASH_KERNELS
        if config.kernel_backend == "flash":
            raise RuntimeError(f"kernel_backend 'flash' (flash-attn-4) cannot run here: {problem}")
        log.info("prefill attention on Triton: flash-attn-4 cannot run here: %s", problem)
        name = "triton"
    if name == "triton":
        from nanofn.kernels.triton_ops import TRITON_KERNELS
        return TRITON_KERNELS
    return TORCH_KERNELS


def _step_kind(plan: BatchPlan) -> str:
    """A label for a step: prefill (any chunk of several tokens), or decode by batch size."""
    n = len(plan.seq_ids)
    if plan.num_tokens > n:
        return "prefill"
    bucket = next(b for b in (1, 8, 32, 128, 1 << 30) if n <= b)
    return f"decode <= {bucket}" if bucket < 1 << 30 else "decode > 128"


class SlotParams:
    """Per slot, on the host: the sampling parameters of the sequence holding it, set by the
    plan that starts it; each step gathers the sampling rows' with a few array operations."""

    # columns of ``floats`` and ``ints``
    TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
    TOP_K, LOGPROBS, SEEDED = range(3)

    def __init__(self, max_seqs: int):
        self.floats = np.zeros((max_seqs, 6), np.float32)
        self.ints = np.zeros((max_seqs, 3), np.int64)
        self.seeds = np.zeros(max_seqs, np.uint64)
        self.num_prompt = np.zeros(max_seqs, np.int64)
        self.plain = np.zeros(max_seqs, np.bool_)  # a CUDA graph can sample it (see DecodeGraphs)
        self.shaping: dict[int, SamplingParams] = {}  # slots with a logit bias or allowed tokens

    def start(self, starts: tuple[SeqStart, ...]) -> None:
        for s in starts:
            p = s.params
            self.floats[s.slot] = (0.0 if p.greedy else p.temperature, p.top_p, p.min_p,
                                   p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            self.ints[s.slot] = (max(p.top_k, 0), -1 if p.logprobs is None else p.logprobs,
                                 p.seed is not None)
            self.seeds[s.slot] = (p.seed or 0) & 0xFFFF_FFFF_FFFF_FFFF
            self.num_prompt[s.slot] = s.num_prompt_tokens
            self.plain[s.slot] = (p.seed is None and p.logprobs is None and not p.has_penalties
                                  and not p.shapes_logits and p.structured_outputs is None
                                  and (p.greedy or (p.min_p == 0 and p.top_k <= 0
                                                    and p.top_p >= 1)))
            if p.shapes_logits:
                self.shaping[s.slot] = p
            else:
                self.shaping.pop(s.slot, None)

    def rows(self, plan: BatchPlan) -> SamplingRows:
        """The sampler's input for the plan's sampling sequences, in plan order."""
        slots = plan.slots[plan.sample]
        floats, ints = self.floats[slots], self.ints[slots]
        row_of = np.cumsum(plan.sample) - 1  # plan index -> sampling row
        histories = []
        for i, tokens in plan.histories:
            num_prompt = int(self.num_prompt[plan.slots[i]])
            histories.append((int(row_of[i]), tokens[:num_prompt], tokens[num_prompt:]))
        return SamplingRows(
            temperature=floats[:, self.TEMPERATURE], top_p=floats[:, self.TOP_P],
            top_k=ints[:, self.TOP_K], min_p=floats[:, self.MIN_P],
            seeded=ints[:, self.SEEDED].astype(bool), seed=self.seeds[slots],
            position=plan.context_lens[plan.sample], logprobs=ints[:, self.LOGPROBS],
            presence_penalty=floats[:, self.PRESENCE],
            frequency_penalty=floats[:, self.FREQUENCY],
            repetition_penalty=floats[:, self.REPETITION],
            histories=tuple(histories),
            banned=tuple((int(row_of[i]), ids) for i, ids in plan.banned),
            **self._shaping_rows(slots),
        )

    def _shaping_rows(self, slots: np.ndarray) -> dict[str, tuple]:
        """The ``allowed`` and ``biases`` of the rows whose requests shape their logits."""
        if not self.shaping:
            return {}
        params = [(row, p) for row, slot in enumerate(slots.tolist())
                  if (p := self.shaping.get(slot)) is not None]
        return {"allowed": tuple((row, p.allowed_token_ids) for row, p in params
                                 if p.allowed_token_ids is not None),
                "biases": tuple((row, p.logit_bias) for row, p in params if p.logit_bias)}
