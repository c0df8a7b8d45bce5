"""The runner's warm-up meets every kernel variant that serving's eager steps can
(``nanofn/runner/warm_up.py``): after it, random steps (prompts, chunks of prompts and decodes
mixed, of any size; where decode steps run eagerly, any batch at any context) and random
sampling launch no Triton kernel in a variant the warm-up did not. Launches are recorded, not
compiled or run (``variant_recorder_process``), at real models' shapes cut to a few layers."""

from __future__ import annotations

import random

import pytest
import torch

from nanofn.model.tiny import random_weights_model
from nanofn.runner.warm_up import warm_up_token_counts
from nanofn.state.config import blocks_for
from nanofn.state.params import SamplingParams
from nanofn.state.plan import BatchPlan, ScheduledSeq, SeqStart, plan_of
from triton_interpreter import recorded_variants, variant_recorder_process

MAX_TOKENS, MAX_SEQS, MAX_LEN, BLOCK, NUM_BLOCKS = 8192, 256, 4096, 16, 4096


def test_the_token_counts_straddle_every_power_of_two():
    assert warm_up_token_counts(100) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100]
    assert warm_up_token_counts(64) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]


@pytest.fixture(scope="module")
def recorder():
    with variant_recorder_process() as run:
        yield run


def small_runner(preset: str, layers: int, **options):
    """A CPU runner of ``preset``'s shape cut to ``layers`` layers, on the Triton kernels, with
    its weights left as allocated (no launch reads them) and Triton's sampler."""
    from transformers import AutoConfig

    from nanofn.kernels import device
    from nanofn.runner import model_runner
    from nanofn.runner.model_runner import ModelRunner, RunnerConfig

    device.fp8_problem = lambda _: None  # (the recorder compiles for an H100)
    model_runner.init_dummy_weights = lambda model, seed: None
    hf_config = AutoConfig.from_pretrained(random_weights_model(preset))
    text = getattr(hf_config, "text_config", hf_config)
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    config = RunnerConfig(
        model_dir=random_weights_model(preset), dtype="auto", device=torch.device("cpu"),
        block_size=BLOCK, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
        max_model_len=MAX_LEN, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
        num_kv_blocks=NUM_BLOCKS, seed=0, kernel_backend="triton", tp_size=1,
        load_format="dummy", **options)
    runner = ModelRunner(hf_config, config)
    runner.sampler.use_triton = True
    return runner


def random_step(rng: random.Random, decode_only: bool) -> BatchPlan:
    """Decodes at random contexts and (unless ``decode_only``) prompts starting or going on,
    up to the step's limits, in slots from 0; each sequence brings its whole block table."""
    num_decodes = rng.choice([1, rng.randint(1, MAX_SEQS)]) if decode_only else rng.choice(
        [0, rng.randint(1, 16), rng.randint(1, MAX_SEQS - 8)])
    budget = MAX_TOKENS - num_decodes
    chunks = []
    for _ in range(0 if decode_only else rng.randint(1, 8)):
        if budget < 2:
            break
        n = rng.randint(2, min(budget, rng.choice([16, 600, MAX_LEN])))
        start = rng.choice([0, rng.randint(1, MAX_LEN - n)]) if n < MAX_LEN else 0
        chunks.append((start, n))
        budget -= n
    parts = chunks + [(rng.randint(1, MAX_LEN - 1), 1) for _ in range(num_decodes)]
    seqs, started = [], []
    for slot, (start, n) in enumerate(parts):
        blocks = tuple((col, rng.randrange(NUM_BLOCKS))
                       for col in range(blocks_for(start + n, BLOCK)))
        seqs.append(ScheduledSeq(f"s{slot}", slot, (7,) * n, start, True, blocks))
        if n > 1 and start == 0:
            started.append(SeqStart(slot, f"s{slot}", SamplingParams(), n, state_slot=0))
    return plan_of(0, seqs, started)


def random_rows(rng: random.Random, num_rows: int):
    from nanofn.runner.sampler import SampleRequest, SamplingRows

    choices = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
               SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
               SamplingParams(temperature=0.7, min_p=0.05, logprobs=5),
               SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    return SamplingRows.from_requests([SampleRequest(rng.choice(choices), 3, [1, 2], [3])
                                       for _ in range(num_rows)])


def new_variants_after_warm_up(preset: str, layers: int, steps: int, seed: int,
                               **options) -> tuple[int, list[str]]:
    """In the recorder child: the variants the warm-up met, and the kernels of those that
    ``steps`` random eager steps met after it (decode-only steps too where they run eagerly)."""
    from nanofn.runner.sampler import Sampler

    runner = small_runner(preset, layers, **options)
    runner.warm_up()
    warmed = recorded_variants()
    rng = random.Random(seed)
    tables = runner.slot_tables
    sampler = Sampler(0, runner.device, use_triton=True)
    for _ in range(steps):
        eager_decode = options.get("enforce_eager", False) and rng.random() < 0.3
        plan = random_step(rng, decode_only=eager_decode)
        with torch.inference_mode():
            logits = runner.eager_logits(plan, tables, runner.kv_cache, runner.states)
            sampler.sample(logits.nan_to_num_(), random_rows(rng, len(logits)))
    return len(warmed), sorted(name for name, _ in recorded_variants() - warmed)


@pytest.mark.parametrize("preset, options", [
    ("qwen3-0.6b", {"enforce_eager": False}),
    ("qwen3-0.6b", {"enforce_eager": True, "quantization": "fp8", "kv_cache_dtype": "fp8"}),
    ("qwen3-30b-a3b", {"enforce_eager": False}),
    ("qwen3-30b-a3b", {"enforce_eager": False, "quantization": "fp8"}),
], ids=["dense", "fp8-eager", "moe", "fp8-moe"])
def test_random_steps_after_the_warm_up_meet_no_new_kernel_variant(recorder, preset, options):
    warmed, new = recorder(new_variants_after_warm_up, preset, 2, 40, 0, **options)
    assert warmed > 5
    assert new == []


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_a_runner_that_warmed_up_samples_what_a_fresh_one_does(tiny_checkpoint, arch):
    """The warm-up's steps run on every model family (here on the CPU's torch kernels, eager
    decode steps included) and leave nothing behind: the KV blocks and the state slot they
    wrote hold what no sequence reads, and the engine's sampler keeps its random stream."""
    from nanofn import LLM, SamplingParams as Params

    options = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, seed=0,
                   enforce_eager=True)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 40)), [9] * 20]
    params = Params(max_tokens=12, temperature=0.8, ignore_eos=True)
    path = tiny_checkpoint(arch)
    fresh = [out.outputs[0].token_ids for out in LLM(path, **options).generate(prompts, params)]
    warmed_llm = LLM(path, **options)
    warmed_llm.engine.runner.warm_up()
    warmed = [out.outputs[0].token_ids for out in warmed_llm.generate(prompts, params)]
    assert warmed == fresh
