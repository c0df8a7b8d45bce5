"""The parity checks on a GPU, in bfloat16: nanofn against transformers, CUDA graphs against
eager, the Triton backend against the torch references. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from nanofn import LLM, SamplingParams
from nanofn.state import ScheduledSeq, SeqStart, plan_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 24
ARCHS = ["qwen3", "qwen2", "llama", "llama3", "mistral"]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts_for(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (7, 33, 70, 150)]


@torch.inference_mode()
def hf_logits(model_dir, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced logits of every position, float32 ``[len(tokens), vocab]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager").cuda()
    return model(torch.tensor([tokens], device="cuda")).logits[0].float()


@torch.inference_mode()
def hf_greedy(model_dir, prompt: list[int], dtype: torch.dtype) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager").cuda()
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(NEW_TOKENS):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@torch.inference_mode()
def nanofn_teacher_forced(llm: LLM, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """nanofn's logits along ``tokens``: the prompt as one prefill, then one decode step per
    token, through the engine's runner and paged cache (blocks 0, 1, 2, ...; a hybrid model's
    recurrent state in slot 0)."""
    runner = llm.engine.runner
    bs = llm.engine.scheduler_config.block_size
    table = tuple(enumerate(range(-(-len(tokens) // bs))))
    state_slot = -1 if runner.states is None else 0
    started = [SeqStart(0, "tf", SamplingParams(temperature=0), prompt_len, state_slot)]
    rows = []
    start, end = 0, prompt_len
    while end <= len(tokens):
        seq = ScheduledSeq("tf", 0, tuple(tokens[start:end]), start, True, table if start == 0 else ())
        logits, _ = runner.forward(plan_of(0, [seq], started if start == 0 else []))
        rows.append(logits[0])
        start, end = end, end + 1
    return torch.stack(rows)


def first_divergence(got: list[int], expected: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_greedy_and_teacher_forced_logits_match_transformers(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    prompts = prompts_for(len(arch))
    with LLM(str(model_dir), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            got = out.outputs[0].token_ids
            expected = hf_greedy(model_dir, prompt, torch.bfloat16)
            tokens = prompt + expected
            exact = hf_logits(model_dir, tokens, torch.float32)[len(prompt) - 1:-1]
            rounded = hf_logits(model_dir, tokens, torch.bfloat16)[len(prompt) - 1:-1]
            ours = nanofn_teacher_forced(llm, tokens, len(prompt))[:-1]
            # bf16 tolerance: nanofn is about as far from the float32 logits as transformers'
            # own bf16 run is.
            noise = (rounded - exact).norm() / exact.norm()
            error = (ours - exact).norm() / exact.norm()
            assert error <= 2 * noise + 1e-3, (arch, float(error), float(noise))
            # Greedy tokens agree until the reference's top two logits are within rounding.
            i = first_divergence(got, expected)
            if i is not None:
                top2 = rounded[i].topk(2).values
                rounding = (rounded[i] - exact[i]).abs().max()
                assert top2[0] - top2[1] <= 4 * rounding, (arch, i, float(top2[0] - top2[1]))


@pytest.fixture(scope="module")
def float32_prompts(tiny_qwen3):
    return tiny_qwen3, prompts_for(5) * 3  # 12 sequences, padded to a graph of 16


def run(model_dir, prompts, **options):
    options = {"dtype": "float32", "gpu_memory_utilization": 0.3, "max_model_len": 512, **options}
    with LLM(str(model_dir), **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def test_cuda_graphs_give_the_eager_tokens(float32_prompts):
    model_dir, prompts = float32_prompts
    assert run(model_dir, prompts) == run(model_dir, prompts, enforce_eager=True)


def test_decode_graphs_sample_as_the_eager_sampler_does(float32_prompts, monkeypatch):
    """Plain rows (temperature only) are drawn inside the decode graphs, the others (logprobs,
    penalties, top_p) by the eager sampler after the graph; with the engine's seed both give
    the tokens an eager run gives, and the graphs did sample."""
    from nanofn.runner.cuda_graphs import DecodeGraphs

    model_dir, prompts = float32_prompts
    kinds = [SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0.8, logprobs=2, max_tokens=NEW_TOKENS, ignore_eos=True)]

    def tokens(params, **options):
        with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                 seed=7, **options) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

    replays = []
    sample = DecodeGraphs.sample
    monkeypatch.setattr(DecodeGraphs, "sample", lambda self, *a: replays.append(1) or sample(self, *a))
    plain = [kinds[i % 2] for i in range(len(prompts))]
    mixed = [kinds[i % 4] for i in range(len(prompts))]
    assert tokens(plain) == tokens(plain, enforce_eager=True)
    assert len(replays) >= NEW_TOKENS - 2
    replays.clear()
    assert tokens(mixed) == tokens(mixed, enforce_eager=True)
    assert not replays  # a row with top_p or logprobs in every step: the eager sampler draws


def test_a_one_token_prompt_is_sampled_by_its_own_parameters_in_a_reused_slot(float32_prompts):
    """A one-token prompt's first step fits a decode graph, and its slot holds the last
    occupant's parameters until the step starts it: a greedy request, then one asking for
    logprobs (and one with a seed) in the slot it left, must come back as in an eager run,
    logprobs of every token included."""
    model_dir, _ = float32_prompts
    base = dict(max_tokens=3, ignore_eos=True)
    requests = [SamplingParams(temperature=0, **base), SamplingParams(temperature=0.8, logprobs=2,
                                                                      **base),
                SamplingParams(temperature=0, **base), SamplingParams(temperature=0.8, seed=3,
                                                                      **base)]

    def one_by_one(**options):
        with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                 seed=7, **options) as llm:
            outs = [llm.generate([{"prompt_token_ids": [5 + i]}], params, use_tqdm=False)[0]
                    for i, params in enumerate(requests)]
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    graphs, eager = one_by_one(), one_by_one(enforce_eager=True)
    assert [tokens for tokens, _ in graphs] == [tokens for tokens, _ in eager]
    logprobs = graphs[1][1]
    assert logprobs is not None and len(logprobs) == 3 and all(len(entry) >= 2 for entry in logprobs)
    assert [sorted(entry) for entry in logprobs] == [sorted(entry) for entry in eager[1][1]]


def test_shaped_logits_bad_words_and_prompt_logprobs_leave_the_graph_sampler(float32_prompts,
                                                                             monkeypatch):
    """Rows with a logit bias, allowed tokens, bad words or prompt logprobs are not plain: the
    eager sampler draws them after the graph, giving the tokens an eager run gives; allowed
    tokens hold, and prompt logprobs match transformers' (float32)."""
    from nanofn.runner.cuda_graphs import DecodeGraphs

    model_dir, prompts = float32_prompts
    base = dict(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True)
    allowed = list(range(3, 60))
    kinds = [SamplingParams(**base, logit_bias={5: 4.0, 9: -3.0}),
             SamplingParams(**base, allowed_token_ids=allowed),
             SamplingParams(**base, bad_words_token_ids=[(7,), (11, 12)]),
             SamplingParams(**base, prompt_logprobs=3)]
    mixed = [kinds[i % len(kinds)] for i in range(len(prompts))]

    def outputs(**options):
        with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                 seed=7, **options) as llm:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], mixed,
                                use_tqdm=False)

    replays = []
    sample = DecodeGraphs.sample
    monkeypatch.setattr(DecodeGraphs, "sample", lambda self, *a: replays.append(1) or sample(self, *a))
    graphs, eager = outputs(), outputs(enforce_eager=True)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    assert not replays
    for params, out in zip(mixed, graphs):
        tokens = out.outputs[0].token_ids
        if params.allowed_token_ids is not None:
            assert set(tokens) <= set(allowed)
        if params.bad_words_token_ids:
            assert 7 not in tokens and (11, 12) not in set(zip(tokens, tokens[1:]))
        if params.prompt_logprobs is not None:
            expected = hf_logits(model_dir, out.prompt_token_ids, torch.float32).log_softmax(-1)
            got = [entry[t].logprob for t, entry in zip(out.prompt_token_ids[1:],
                                                         out.prompt_logprobs[1:])]
            want = expected[:-1].gather(-1, torch.tensor(out.prompt_token_ids[1:],
                                                         device="cuda")[:, None])[:, 0]
            assert got == pytest.approx(want.tolist(), abs=2e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefill_graphs_give_the_eager_tokens_and_logprobs(float32_prompts, monkeypatch,
                                                           kv_cache_dtype):
    """Steps of at most 8 sequences and 2,048 tokens that are not pure decode steps (a few
    prompts; prompt chunks beside decoding sequences) replay a prefill graph, padded to its
    token count; tokens, sampled logprobs and prompt logprobs are the eager run's (the decode
    steps' logprobs come from the decode graphs' hidden states: with an FP8 KV cache those
    stay in the model's dtype, which the cache's is not)."""
    from nanofn.runner.prefill_graphs import PrefillGraphs

    model_dir, prompts = float32_prompts
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    replays = []
    forward = PrefillGraphs.forward
    monkeypatch.setattr(PrefillGraphs, "forward",
                        lambda self, plan: replays.append(plan.num_tokens) or forward(self, plan))

    def outputs(**options):
        with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
                 max_num_seqs=4, max_num_batched_tokens=96, kv_cache_dtype=kv_cache_dtype,
                 **options) as llm:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)

    def logprobs(entries):
        return [[v.logprob for _, v in sorted(e.items())] for e in entries if e is not None]

    graphs, eager = outputs(), outputs(enforce_eager=True)
    assert len(replays) >= 8 and any(n % 16 for n in replays)  # (padded ones too)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    for got, want in zip(graphs, eager):
        for g, w in zip(logprobs(got.outputs[0].logprobs), logprobs(want.outputs[0].logprobs)):
            assert g == pytest.approx(w, abs=1e-4)
        for g, w in zip(logprobs(got.prompt_logprobs), logprobs(want.prompt_logprobs)):
            assert g == pytest.approx(w, abs=1e-4)


def test_preemption_and_chunked_prefill_on_the_gpu(float32_prompts):
    model_dir, prompts = float32_prompts
    plain = run(model_dir, prompts, enable_prefix_caching=False)
    # 12 blocks of 16 tokens: one sequence of up to 192 tokens at a time, the others wait.
    assert run(model_dir, prompts, num_kv_blocks=12, max_model_len=192,
               max_num_batched_tokens=64, max_num_seqs=8) == plain


def kv_cache_bytes(model_dir, utilization: float) -> int:
    with LLM(str(model_dir), gpu_memory_utilization=utilization, max_model_len=512) as llm:
        runner = llm.engine.runner
        return runner.num_blocks * runner.shape.block_bytes(runner.config.block_size,
                                                            runner.kv_dtype)


def test_the_kv_cache_is_sized_from_gpu_memory(tiny_qwen3):
    small = kv_cache_bytes(tiny_qwen3, 0.2)
    gc.collect()
    torch.cuda.empty_cache()
    large = kv_cache_bytes(tiny_qwen3, 0.4)
    assert 0 < small < large
    # A fifth more of the GPU's memory, the weights, the activations and whatever else the
    # process holds (earlier tests' leftovers) being the same: a fifth more of it for the cache.
    share = (large - small) / torch.cuda.mem_get_info()[1]
    assert 0.19 < share < 0.21


def test_close_gives_the_gpu_memory_back_while_the_llm_is_still_held(tiny_qwen3):
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_qwen3), gpu_memory_utilization=0.3, max_model_len=512)
    llm.generate(["Hello"], GREEDY, use_tqdm=False)
    in_use = torch.cuda.memory_allocated() - before
    assert in_use > 2**30  # the KV cache: 30% of the GPU less the weights
    llm.close()
    assert torch.cuda.memory_allocated() - before < 64 * 2**20


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("count", [12, 1], ids=["batched", "one-sequence-gemv"])
def test_tensor_parallel_on_two_gpus(float32_prompts, count):
    """One sequence decodes through the Triton GEMVs (their norm and SiLU prologues on each
    rank's shard), twelve through cuBLAS."""
    model_dir, prompts = float32_prompts
    prompts = prompts[:count]
    assert run(model_dir, prompts, tensor_parallel_size=2) == run(model_dir, prompts)


def test_the_device_timeline_measures_the_busy_time_of_a_run(tiny_qwen3):
    from nanofn.cli.bench import measure, standard_workload
    from nanofn.runner.timeline import DeviceTimeline

    with LLM(str(tiny_qwen3), max_model_len=256) as llm:
        workload = standard_workload(16, 64, 32, vocab_size=llm.engine.text_config.vocab_size)
        timeline = DeviceTimeline()
        result = measure(llm, workload, timeline)
    assert timeline.num_intervals >= 32  # one per step with work: prefills, then decodes
    assert 0 < result.device_busy_s <= result.elapsed_s
    assert 0 <= result.device_idle_fraction < 1
    kinds = timeline.by_label()
    assert "prefill" in kinds and any(kind.startswith("decode") for kind in kinds)
    assert kinds["(before the first step)"][2] > 0 and kinds["(after the last step)"][2] > 0
    assert sum(steps for steps, _, _ in kinds.values()) == timeline.num_intervals
    assert sum(busy for _, busy, _ in kinds.values()) == pytest.approx(result.device_busy_s)
    assert sum(idle for _, _, idle in kinds.values()) <= result.elapsed_s - result.device_busy_s


def test_structured_output_with_cuda_graphs(float32_prompts, monkeypatch):
    """Constrained rows next to plain ones on CUDA with the decode graphs: every constrained
    output fits its constraint, no graph samples a plan with a constrained row (its mask
    applies in the eager sampler), and the tokens are those of an eager run."""
    pytest.importorskip("llguidance")
    import json
    import re

    from nanofn import StructuredOutputsParams
    from nanofn.runner.cuda_graphs import DecodeGraphs

    model_dir, prompts = float32_prompts
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0,
                                                         "maximum": 99}},
              "required": ["answer", "score"], "additionalProperties": False}
    constraints = [StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                   StructuredOutputsParams(regex="[a-z]{2,6}-[0-9]{2}"),
                   StructuredOutputsParams(choice=["left", "right"])]
    params = [SamplingParams(temperature=0.8, max_tokens=80,
                             structured_outputs=constraints[i % 4]) if i % 4 < 3 else
              SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    constrained_ids = {str(i) for i in range(len(prompts)) if i % 4 < 3}

    def generate(**options):
        with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3,
                 max_model_len=512, seed=7, **options) as llm:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)

    graph_rows = []
    sample = DecodeGraphs.sample
    monkeypatch.setattr(DecodeGraphs, "sample", lambda self, plan, *a: graph_rows.extend(
        plan.sampling_seq_ids) or sample(self, plan, *a))
    outs = generate()
    assert graph_rows and not set(graph_rows) & constrained_ids
    for i, out in enumerate(outs):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        if i % 4 == 0:
            value = json.loads(text)
            assert value["answer"] in ("yes", "no") and value["score"] in range(100)
        elif i % 4 == 1:
            assert re.fullmatch("[a-z]{2,6}-[0-9]{2}", text), text
        elif i % 4 == 2:
            assert text in ("left", "right")
        assert reason == ("length" if i % 4 == 3 else "stop"), (i, text)
    eager = generate(enforce_eager=True)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in eager]
