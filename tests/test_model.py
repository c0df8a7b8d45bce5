"""nanofn's decoder against transformers on tiny checkpoints, through a paged KV cache."""

from __future__ import annotations

import itertools
import multiprocessing
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from nanofn.kernels import TORCH_KERNELS
from nanofn.kernels.partial_sums import linear_partial_sums
from nanofn.model import AttentionBatch, build_model, load_weights, model_shape
from nanofn.model.config import rope_settings
from nanofn.model.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

# case id -> (tiny arch, make_tiny_checkpoint arguments)
MODEL_CASES = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("llama3", {}),
    "mistral": ("mistral", {}),
}


class PagedRun:
    """Runs a model step by step over a KV cache whose blocks are handed out in shuffled order.

    Builds the flattened batch and ``AttentionBatch`` the way a runner does.
    """

    def __init__(self, model, hf_config, block_size: int, num_blocks: int = 96, seed: int = 0, tp_size: int = 1):
        generator = torch.Generator().manual_seed(seed)
        shape = model_shape(hf_config, tp_size).kv_cache_shape(num_blocks, block_size)
        self.kv_cache = torch.randn(shape, generator=generator)  # stale garbage, never read
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        self.block_size = block_size
        self.model = model
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Compute the given new tokens of each named sequence; return their logits."""
        input_ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for name, tokens in chunks.items():
            start = self.num_computed.get(name, 0)
            end = self.num_computed[name] = start + len(tokens)
            table = self.block_tables.setdefault(name, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        width = max(map(len, tables))
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots),
            query_start=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
            decode_only=all(n == 1 for n in query_lens),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), batch, self.kv_cache)
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(query_lens)))


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """``get(case)``: ``(transformers model, nanofn model, config)``, loaded once per module."""
    loaded = {}

    def get(case: str):
        if case not in loaded:
            arch, kwargs = MODEL_CASES[case]
            path = tiny_checkpoint(arch, **kwargs)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
            config = AutoConfig.from_pretrained(path)
            model = build_model(config, dtype="float32", device="cpu")
            load_weights(model, path)
            loaded[case] = reference.eval(), model, config
        return loaded[case]

    return get


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy_reference(reference, prompt: list[int], num_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation, and its logits at every position of prompt + continuation."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new_tokens):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens, reference(torch.tensor([tokens])).logits[0]


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_one_prefill_matches_transformers(models, case, block_size):
    reference, model, config = models(case)
    prompt = random_prompt(40, seed=1)
    _, expected = greedy_reference(reference, prompt, 0)

    logits = PagedRun(model, config, block_size).step({"a": prompt})["a"]

    assert_logits_close(logits, expected)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_chunked_prefill_then_decode_matches_transformers(models, case):
    reference, model, config = models(case)
    prompt = random_prompt(40, seed=2)
    tokens, expected = greedy_reference(reference, prompt, 6)
    run = PagedRun(model, config, block_size=4, seed=1)

    chunks = [run.step({"a": prompt[start : start + 7]})["a"] for start in range(0, len(prompt), 7)]
    decoded = [run.step({"a": [token]})["a"] for token in tokens[len(prompt) : -1]]

    logits = torch.cat(chunks + decoded)
    assert_logits_close(logits, expected[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens[len(prompt) :]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_batch_mixing_prefill_and_decode_matches_transformers(models, case):
    reference, model, config = models(case)
    prompts = {"a": random_prompt(40, seed=3), "b": random_prompt(23, seed=4), "c": random_prompt(9, seed=5)}
    references = {name: greedy_reference(reference, prompt, 4) for name, prompt in prompts.items()}
    tokens = {name: ref_tokens for name, (ref_tokens, _) in references.items()}
    run = PagedRun(model, config, block_size=4, seed=2)
    schedule = [  # (sequence, first position, end position) per step
        [("a", 0, 16), ("b", 0, 23)],
        [("a", 16, 40), ("b", 23, 24), ("c", 0, 9)],
        [("a", 40, 41), ("b", 24, 25), ("c", 9, 10)],
        [("c", 10, 11), ("a", 41, 42), ("b", 25, 26)],
    ]
    logits = {name: [] for name in prompts}

    for step in schedule:
        out = run.step({name: tokens[name][start:end] for name, start, end in step})
        for name, chunk_logits in out.items():
            logits[name].append(chunk_logits)

    for name, (_, expected) in references.items():
        computed = torch.cat(logits[name])
        assert_logits_close(computed, expected[: len(computed)])


@pytest.mark.parametrize("case", MODEL_CASES)
def test_tiny_checkpoint_greedy_output_depends_on_the_whole_prompt(models, case):
    reference, _, _ = models(case)
    prompt = random_prompt(20, seed=6)
    changed_first_token = [prompt[0] + 1, *prompt[1:]]

    continuation, _ = greedy_reference(reference, prompt, 12)
    other_continuation, _ = greedy_reference(reference, changed_first_token, 12)

    assert continuation[20:] != other_continuation[20:]
    assert len(set(continuation[20:])) >= 4


def test_rope_settings_reads_transformers_5_and_older_configs():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    new_style = LlamaConfig(max_position_embeddings=2048, rope_parameters={**scaling, "rope_theta": 5e5})
    old_style = SimpleNamespace(rope_theta=5e5, rope_scaling={**scaling, "type": "llama3"})
    plain_old_style = SimpleNamespace(rope_theta=1e6, rope_scaling=None)

    assert rope_settings(new_style) == (5e5, {**scaling, "rope_theta": 5e5})
    assert rope_settings(old_style) == (5e5, {**scaling, "type": "llama3"})
    assert rope_settings(plain_old_style) == (1e6, None)
    assert rope_settings(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4})) == (1e4, None)


@pytest.mark.parametrize(("tp_size", "expected_kv_heads"), [(1, 2), (2, 1), (4, 1)])
def test_model_shape_splits_or_replicates_kv_heads(tiny_qwen3, tp_size, expected_kv_heads):
    shape = model_shape(AutoConfig.from_pretrained(tiny_qwen3), tp_size)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, expected_kv_heads, 16)
    assert shape.kv_cache_shape(10, 16) == (2, 2, 10, 16, expected_kv_heads, 16)
    assert shape.block_bytes(16, torch.bfloat16) == 2 * 2 * expected_kv_heads * 16 * 16 * 2


def test_kv_cache_of_the_wrong_shape_is_refused(models):
    _, model, config = models("qwen3")
    wrong_heads = torch.zeros(model_shape(config, tp_size=2).kv_cache_shape(4, 4))
    run = PagedRun(model, config, block_size=4)
    run.kv_cache = wrong_heads
    with pytest.raises(ValueError, match=r"kv_heads=2, head_dim=16\], got \[2, 2, 4, 4, 1, 16\]"):
        run.step({"a": [1, 2, 3]})


# Tensor parallelism: build every rank of a layer in this process, load the same full weights,
# and check that the ranks' outputs recombine (by concatenation or by a hand-made all-reduce)
# into the single-rank output.


def build_ranks(make_layer, full_tensors: dict[str, list[tuple[torch.Tensor, object]]], tp_size: int = 2):
    """The single-rank layer and the ``tp_size`` ranks of it, all loaded from the same full tensors.

    ``full_tensors`` maps a parameter name to its ``(checkpoint tensor, shard id)`` pieces.
    """
    single = make_layer(tp_rank=0, tp_size=1)
    ranks = [make_layer(tp_rank=rank, tp_size=tp_size) for rank in range(tp_size)]
    for layer in [single, *ranks]:
        for name, pieces in full_tensors.items():
            param = getattr(layer, name)
            for tensor, shard_id in pieces:
                param.weight_loader(param, tensor, shard_id)
    return single, ranks


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_column_parallel_ranks_concatenate_to_the_full_output():
    weight, bias, x = randn(12, 8, seed=20), randn(12, seed=21), randn(5, 8, seed=22)
    single, ranks = build_ranks(
        lambda **tp: ColumnParallelLinear(8, 12, bias=True, **tp),
        {"weight": [(weight, None)], "bias": [(bias, None)]},
    )
    torch.testing.assert_close(torch.cat([rank(x) for rank in ranks], dim=-1), single(x))


def test_merged_column_parallel_ranks_hold_a_slice_of_each_output():
    gate, up, x = randn(6, 8, seed=23), randn(6, 8, seed=24), randn(5, 8, seed=25)
    single, ranks = build_ranks(
        lambda **tp: MergedColumnParallelLinear(8, [6, 6], bias=False, **tp),
        {"weight": [(gate, 0), (up, 1)]},
    )
    gates, ups = zip(*(rank(x).chunk(2, dim=-1) for rank in ranks))  # a rank: [gate slice | up slice]
    torch.testing.assert_close(torch.cat([*gates, *ups], dim=-1), single(x))


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(2, 2), (1, 2), (2, 4)])
def test_qkv_parallel_ranks_split_query_heads_and_split_or_replicate_kv_heads(num_kv_heads, tp_size):
    hidden, head_dim, num_heads = 8, 4, 4
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    pieces = {
        "weight": [(randn(q_rows, hidden, seed=26), "q"), (randn(kv_rows, hidden, seed=27), "k"),
                   (randn(kv_rows, hidden, seed=28), "v")],
        "bias": [(randn(q_rows, seed=29), "q"), (randn(kv_rows, seed=30), "k"), (randn(kv_rows, seed=31), "v")],
    }
    single, ranks = build_ranks(
        lambda **tp: QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True, **tp), pieces, tp_size
    )
    x = randn(5, hidden, seed=32)

    def heads(layer):
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        return [t.unflatten(-1, (-1, head_dim)) for t in (q, k, v)]

    q_all, k_all, v_all = heads(single)
    heads_per_rank, group = num_heads // tp_size, num_heads // num_kv_heads
    for rank in ranks:
        q, k, v = heads(rank)
        query_heads = range(rank.tp_rank * heads_per_rank, (rank.tp_rank + 1) * heads_per_rank)
        kv_heads = sorted({head // group for head in query_heads})  # the kv heads those queries read
        torch.testing.assert_close(q, q_all[:, query_heads])
        torch.testing.assert_close(k, k_all[:, kv_heads])
        torch.testing.assert_close(v, v_all[:, kv_heads])


def test_row_parallel_partial_outputs_sum_to_the_full_output():
    weight, bias, x = randn(8, 12, seed=33), randn(8, seed=34), randn(5, 12, seed=35)
    single, ranks = build_ranks(
        lambda **tp: RowParallelLinear(12, 8, bias=True, **tp),
        {"weight": [(weight, None)], "bias": [(bias, None)]},
    )
    partials = [rank.partial_forward(x_slice) for rank, x_slice in zip(ranks, x.chunk(2, dim=-1))]
    torch.testing.assert_close(sum(partials) + ranks[0].bias, single(x))  # the all-reduce, by hand


def test_vocab_parallel_embedding_partials_sum_to_the_full_lookup():
    weight = randn(11, 8, seed=36)  # 11 tokens: the last rank's range is padded
    token_ids = torch.tensor([0, 5, 6, 10, 3, 10])
    single, ranks = build_ranks(lambda **tp: VocabParallelEmbedding(11, 8, **tp), {"weight": [(weight, None)]})
    torch.testing.assert_close(sum(rank.partial_forward(token_ids) for rank in ranks), single(token_ids))
    torch.testing.assert_close(single(token_ids), weight[token_ids])


def test_lm_head_shard_logits_concatenate_to_the_full_vocabulary():
    weight, hidden = randn(11, 8, seed=37), randn(3, 8, seed=38)
    single, ranks = build_ranks(lambda **tp: ParallelLMHead(11, 8, **tp), {"weight": [(weight, None)]})
    gathered = torch.cat([rank.shard_logits(hidden) for rank in ranks], dim=-1)[:, :11]  # the all-gather
    torch.testing.assert_close(gathered, single(hidden))
    torch.testing.assert_close(single(hidden), hidden @ weight.T)


def test_the_lm_head_projects_through_the_kernel_backends_linear(tiny_qwen3):
    """The LM head is the backend's ``linear`` (the Triton backend's GEMV for a few tokens),
    not a fixed cuBLAS call."""
    calls = []

    def linear(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return TORCH_KERNELS.linear(x, weight, bias)

    config = AutoConfig.from_pretrained(tiny_qwen3)
    model = build_model(config, dtype="float32", device="cpu",
                        kernels=replace(TORCH_KERNELS, linear=linear))
    load_weights(model, tiny_qwen3)
    hidden = randn(2, config.hidden_size, seed=39)
    logits = model.compute_logits(hidden)
    assert calls == [(config.vocab_size, config.hidden_size)]
    torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T)


def test_projections_handed_to_the_norms_as_partial_sums_give_the_same_logits(tiny_checkpoint):
    """A backend may return o_proj's and down_proj's outputs as ``PartialSums`` (the norm after
    each adds them up): every layer's norms, the final norm included, take them, and a model
    with a bias on those projections (Llama's, added after the sum) is asked for none."""
    asked, returned = [], []

    def as_partial_sums(x, weight, *args, partial_sums=False):
        asked.append(partial_sums)
        if not partial_sums:
            return TORCH_KERNELS.linear(x, weight, *args)
        returned.append(linear_partial_sums(x.reshape(-1, x.shape[-1]), weight, splits=2))
        return returned[-1]

    kernels = replace(TORCH_KERNELS, linear=as_partial_sums)
    for arch, kwargs, sums_per_layer in (("qwen3", {}, 2), ("llama", {"attention_bias": True}, 1)):
        path = tiny_checkpoint(arch, **kwargs)
        config = AutoConfig.from_pretrained(path)
        expected = run_steps(_loaded(build_model(config, dtype="float32", device="cpu"), path), config)
        returned.clear()
        model = _loaded(build_model(config, dtype="float32", device="cpu", kernels=kernels), path)
        torch.testing.assert_close(run_steps(model, config), expected, atol=1e-5, rtol=1e-5)
        assert len(returned) == sums_per_layer * config.num_hidden_layers * len(TP_STEPS)
    assert True in asked and False in asked


def _loaded(model, path):
    load_weights(model, path)
    return model


# The whole model at tp_size=2: two forked processes talk through gloo, as GPU ranks do through
# NCCL, and must both produce the single-rank logits.

TP_STEPS = [list(range(3, 33)), list(range(40, 50)), [7], [9]]  # prefill, a chunk, two decodes


def run_steps(model, config, tp_size: int = 1) -> torch.Tensor:
    run = PagedRun(model, config, block_size=4, tp_size=tp_size)
    return torch.cat([run.step({"a": tokens})["a"] for tokens in TP_STEPS])


def run_tensor_parallel_rank(rank: int, tp_size: int, path: Path, work_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work_dir / 'rendezvous'}", rank=rank, world_size=tp_size)
    try:
        config = AutoConfig.from_pretrained(path)
        model = build_model(config, dtype="float32", device="cpu", tp_rank=rank, tp_size=tp_size)
        load_weights(model, path)
        torch.save(run_steps(model, config, tp_size), work_dir / f"logits-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize(
    "checkpoint_kwargs",
    [
        {"arch": "qwen3"},  # 2 kv heads: split
        {"arch": "llama", "num_key_value_heads": 1, "attention_bias": True, "vocab_size": 401},  # replicated, padded
    ],
    ids=["qwen3", "llama-one-kv-head"],
)
def test_two_tensor_parallel_ranks_match_one(tiny_checkpoint, tmp_path, checkpoint_kwargs):
    path = tiny_checkpoint(**checkpoint_kwargs)
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype="float32", device="cpu")
    load_weights(model, path)
    expected = run_steps(model, config)

    # Forked, as torch's DataLoader workers are: the children run single-threaded torch ops and
    # gloo, which starts its threads after the fork. Spawning would re-import torch (~10 s).
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=run_tensor_parallel_rank, args=(r, 2, path, tmp_path)) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=60)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]

    for rank in range(2):
        assert_logits_close(torch.load(tmp_path / f"logits-{rank}.pt"), expected)
