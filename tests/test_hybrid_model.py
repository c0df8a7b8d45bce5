"""nanofn's Qwen3.5 hybrid model (Gated DeltaNet and gated full attention) against transformers
on tiny checkpoints, through a paged KV cache and state slots; its kernels against transformers'
torch functions."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import nanofn.kernels.triton_attention as triton_attention
from nanofn.cli.bench import ModelDims
from nanofn.kernels import (apply_rotary, build_cos_sin_cache, causal_conv1d,
                            causal_conv1d_update, gated_delta_rule, gated_delta_rule_update,
                            rms_norm_gated)
from nanofn.model import AttentionBatch, RecurrentState, build_model, load_weights, model_shape
from nanofn.model.config import rotary_dim
from nanofn.model.parallel import QKVParallelLinear
from nanofn.model.tiny import PRESETS, make_random_checkpoint
from test_model import assert_logits_close, greedy_reference, random_prompt

# --- the model against transformers -----------------------------------------------------------


class HybridRun:
    """Runs a hybrid model step by step as a runner would: KV blocks handed out in shuffled
    order, each sequence in a state slot of its own, taken in shuffled order. Every slot starts
    as NaN, which a sequence's first step must not read."""

    def __init__(self, model, hf_config, block_size: int = 4, num_blocks: int = 64,
                 num_slots: int = 6, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        shape = model_shape(hf_config)
        self.kv_cache = torch.randn(shape.kv_cache_shape(num_blocks, block_size), generator=generator)
        self.states = RecurrentState(conv=torch.full(shape.recurrent.conv_shape(num_slots), torch.nan),
                                     ssm=torch.full(shape.recurrent.ssm_shape(num_slots), torch.nan))
        self.free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
        self.free_slots = torch.randperm(num_slots, generator=generator).tolist()
        self.block_size = block_size
        self.model = model
        self.block_tables: dict[str, list[int]] = {}
        self.state_slots: dict[str, int] = {}
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
            if name not in self.state_slots:
                self.state_slots[name] = self.free_slots.pop()
            input_ids += tokens
            positions += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]
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
            state_slots=torch.tensor([self.state_slots[name] for name in chunks]),
            has_initial_state=torch.tensor([end > n for end, n in zip(seq_lens, query_lens)]),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), batch,
                                self.kv_cache, self.states)
            logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(query_lens)))


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """``get(arch)``: ``(transformers model, nanofn model, config)``, loaded once per module."""
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            path = tiny_checkpoint(arch)
            auto = AutoModelForImageTextToText if arch == "qwen3_5-vl" else AutoModelForCausalLM
            reference = auto.from_pretrained(path, dtype=torch.float32)
            config = AutoConfig.from_pretrained(path)
            model = build_model(config, dtype="float32", device="cpu")
            load_weights(model, path)
            loaded[arch] = reference.eval(), model, config
        return loaded[arch]

    return get


def test_one_prefill_matches_transformers(models):
    reference, model, config = models("qwen3_5")
    prompt = random_prompt(40, seed=1)
    _, expected = greedy_reference(reference, prompt, 0)

    logits = HybridRun(model, config).step({"a": prompt})["a"]

    assert_logits_close(logits, expected)


def test_chunked_prefill_then_decode_matches_transformers(models):
    """The state goes from chunk to chunk through the slot, chunks shorter than the
    convolution's window included; then the decode path steps it a token at a time."""
    reference, model, config = models("qwen3_5")
    prompt = random_prompt(40, seed=2)
    tokens, expected = greedy_reference(reference, prompt, 6)
    run = HybridRun(model, config, seed=1)
    bounds = [0, 7, 8, 10, 23, 40]

    chunks = [run.step({"a": prompt[start:end]})["a"] for start, end in zip(bounds, bounds[1:])]
    decoded = [run.step({"a": [token]})["a"] for token in tokens[len(prompt) : -1]]

    logits = torch.cat(chunks + decoded)
    assert_logits_close(logits, expected[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens[len(prompt) :]


def test_sequences_of_one_batch_keep_to_their_own_state_slots(models):
    """Prompts of several lengths in one step, with a decode; a one-token prompt starting in a
    decode step (the single-step path from zeros); a sequence left out of a step keeps its
    slot as it was."""
    reference, model, config = models("qwen3_5")
    prompts = {"a": random_prompt(40, seed=3), "b": random_prompt(23, seed=4),
               "c": random_prompt(9, seed=5), "d": random_prompt(1, seed=6)}
    references = {name: greedy_reference(reference, prompt, 3) for name, prompt in prompts.items()}
    tokens = {name: ref_tokens for name, (ref_tokens, _) in references.items()}
    run = HybridRun(model, config, seed=2)
    schedule = [  # (sequence, first position, end position) per step
        [("a", 0, 16), ("b", 0, 23)],
        [("a", 16, 40), ("b", 23, 24), ("c", 0, 9)],
        [("a", 40, 41), ("c", 9, 10), ("d", 0, 1)],
        [("c", 10, 11), ("a", 41, 42), ("d", 1, 2), ("b", 24, 25)],
    ]
    logits = {name: [] for name in prompts}

    for step in schedule:
        out = run.step({name: tokens[name][start:end] for name, start, end in step})
        for name, chunk_logits in out.items():
            logits[name].append(chunk_logits)

    for name, (_, expected) in references.items():
        computed = torch.cat(logits[name])
        assert_logits_close(computed, expected[: len(computed)])


def test_the_vision_language_checkpoint_loads_its_language_model(models, tiny_checkpoint):
    """Qwen3_5ForConditionalGeneration's names: the language model loads, the vision tower is
    skipped, the multi-token-prediction weights are set aside in host memory."""
    reference, model, config = models("qwen3_5-vl")
    prompt = random_prompt(30, seed=7)
    tokens, expected = greedy_reference(reference, prompt, 3)
    run = HybridRun(model, config, seed=3)

    logits = torch.cat([run.step({"a": tokens[:20]})["a"], run.step({"a": tokens[20:31]})["a"],
                        run.step({"a": tokens[31:32]})["a"]])

    assert_logits_close(logits, expected[:32])
    assert not any("visual" in name for name, _ in model.named_parameters())
    hidden = config.text_config.hidden_size
    assert {name: (tuple(t.shape), t.device.type) for name, t in model.mtp_weights.items()} == {
        "mtp.fc.weight": ((hidden, 2 * hidden), "cpu"), "mtp.norm.weight": ((hidden,), "cpu")}
    _, text_only, _ = models("qwen3_5")
    assert text_only.mtp_weights == {}


def test_tiny_checkpoint_greedy_output_depends_on_the_whole_prompt(models):
    reference, _, _ = models("qwen3_5")
    prompt = random_prompt(20, seed=8)
    changed_first_token = [prompt[0] + 1, *prompt[1:]]

    continuation, _ = greedy_reference(reference, prompt, 12)
    other_continuation, _ = greedy_reference(reference, changed_first_token, 12)

    assert continuation[20:] != other_continuation[20:]
    assert len(set(continuation[20:])) >= 4


def test_tiny_checkpoint_linear_attention_heads_remember_past_tokens(models):
    """Their decays (the state's factor a token) are near 1, not near 0 as transformers'
    initialisation draws them at this size: a state mislaid between steps must show."""
    reference, _, _ = models("qwen3_5")
    decays = []

    def record(net, module, args, a):
        decays.append(torch.exp(-net.A_log.exp() * F.softplus(a + net.dt_bias)).flatten())

    nets = [layer.linear_attn for layer in reference.model.layers if hasattr(layer, "linear_attn")]
    hooks = [net.in_proj_a.register_forward_hook(functools.partial(record, net)) for net in nets]
    with torch.inference_mode():
        reference(torch.tensor([random_prompt(20, seed=9)]))
    for hook in hooks:
        hook.remove()
    assert torch.cat(decays).min() > 0.8


def test_states_of_the_wrong_shape_are_refused(models):
    _, model, config = models("qwen3_5")
    run = HybridRun(model, config)
    shape = model_shape(config, tp_size=2).recurrent
    run.states = RecurrentState(conv=torch.zeros(shape.conv_shape(6)), ssm=run.states.ssm)
    with pytest.raises(ValueError, match=r"conv \[num_slots, 3, 128, 3\].*got conv \[6, 3, 64, 3\]"):
        run.step({"a": [1, 2, 3]})


# --- shapes and tensor parallelism ------------------------------------------------------------


def test_model_shape_counts_the_full_attention_layers_and_sizes_the_state_slots(tiny_checkpoint):
    config = AutoConfig.from_pretrained(tiny_checkpoint("qwen3_5"))
    one, two = model_shape(config), model_shape(config, tp_size=2)
    assert (one.num_layers, one.num_kv_heads, one.head_dim) == (1, 2, 32)
    assert one.kv_cache_shape(10, 4) == (1, 2, 10, 4, 2, 32)
    # [q | k | v] channels: 2 k heads of 16 twice and 4 v heads of 16; split in two at tp=2
    assert one.recurrent.conv_shape(5) == (5, 3, 128, 3)
    assert one.recurrent.ssm_shape(5) == (5, 3, 4, 16, 16)
    assert two.recurrent.conv_shape(5) == (5, 3, 64, 3)
    assert two.recurrent.ssm_shape(5) == (5, 3, 2, 16, 16)
    assert one.state_bytes(torch.bfloat16) == 3 * 128 * 3 * 2 + 3 * 4 * 16 * 16 * 4
    states = RecurrentState.zeros(one.recurrent, 5, torch.bfloat16, "cpu")
    assert (states.conv.dtype, states.ssm.dtype) == (torch.bfloat16, torch.float32)
    assert model_shape(AutoConfig.from_pretrained(tiny_checkpoint("qwen3"))).recurrent is None


def test_the_9b_shape_reads_its_text_config():
    config = transformers.Qwen3_5Config(**PRESETS["qwen3.5-9b-shape"])
    shape = model_shape(config, tp_size=2)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (8, 2, 256)
    assert shape.recurrent.conv_shape(1) == (1, 24, (2 * 8 + 16) * 128, 3)
    assert shape.recurrent.ssm_shape(1) == (1, 24, 16, 128, 128)
    assert rotary_dim(config) == 64
    assert model_shape(config).recurrent.ssm_dtype is None  # the model's, as vLLM's "auto"
    config.text_config.mamba_ssm_dtype = "float32"  # as Qwen3.5's checkpoints say
    assert model_shape(config).recurrent.ssm_dtype == torch.float32


def test_the_bench_reads_a_vision_language_config_s_language_model():
    dims = ModelDims.from_config(transformers.Qwen3_5Config(**PRESETS["qwen3.5-9b-shape"]).to_dict())
    assert (dims.num_layers, dims.hidden_size, dims.intermediate_size, dims.vocab_size) == (
        32, 4096, 12288, 248320)
    assert (dims.num_heads, dims.num_kv_heads, dims.head_dim) == (16, 4, 256)
    assert not dims.tie_word_embeddings


def test_a_random_qwen3_5_checkpoint_loads_in_nanofn_and_transformers(tmp_path):
    path = make_random_checkpoint(tmp_path / "random", "qwen3.5-tiny", dtype="float32", seed=1)
    reference, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    config = AutoConfig.from_pretrained(path)
    model = build_model(config, dtype="float32", device="cpu")
    load_weights(model, path)
    prompt = random_prompt(12, seed=10)
    _, expected = greedy_reference(reference.eval(), prompt, 0)
    assert_logits_close(HybridRun(model, config).step({"a": prompt})["a"], expected)


def test_two_ranks_of_a_linear_attention_layer_add_up_to_one(tiny_checkpoint, monkeypatch):
    """Each rank holds half the key and value heads (and their channels of the convolution):
    the ranks' partial outputs sum to one rank's, through a prefill and a decode step."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor: None)  # summed by hand
    path = tiny_checkpoint("qwen3_5")
    config = AutoConfig.from_pretrained(path)
    x = torch.randn(8, config.hidden_size, generator=torch.Generator().manual_seed(9))
    steps = [(x[:6], [0, 4, 6], False), (x[6:], [0, 1, 2], True)]  # (inputs, starts, decode)
    outputs = []
    for tp_rank, tp_size in [(0, 1), (0, 2), (1, 2)]:
        model = build_model(config, dtype="float32", device="cpu", tp_rank=tp_rank, tp_size=tp_size)
        load_weights(model, path)
        net = model.model.layers[0].linear_attn
        states = RecurrentState.zeros(model_shape(config, tp_size).recurrent, 3, torch.float32, "cpu")
        rank_outputs = []
        for inputs, starts, decode in steps:
            batch = AttentionBatch(
                slot_mapping=None, query_start=torch.tensor(starts, dtype=torch.int32),
                seq_lens=None, block_tables=None,
                query_lens_host=tuple(b - a for a, b in zip(starts, starts[1:])), seq_lens_host=(),
                decode_only=decode, state_slots=torch.tensor([2, 0]),
                has_initial_state=torch.tensor([decode, decode]))
            with torch.inference_mode():
                rank_outputs.append(net(net.in_proj(inputs), batch, states.conv[:, 0], states.ssm[:, 0]))
        outputs.append(torch.cat(rank_outputs))
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0], atol=1e-5, rtol=1e-5)


def test_qkv_ranks_split_gated_query_heads_with_their_gates():
    hidden, head_dim, num_heads, num_kv_heads = 8, 4, 4, 2
    weights = {"q": torch.randn(2 * num_heads * head_dim, hidden),
               "k": torch.randn(num_kv_heads * head_dim, hidden),
               "v": torch.randn(num_kv_heads * head_dim, hidden)}
    layers = []
    for tp_rank, tp_size in [(0, 1), (0, 2), (1, 2)]:
        layer = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=False,
                                  tp_rank=tp_rank, tp_size=tp_size, output_gate=True)
        for shard_id, weight in weights.items():
            layer.weight_loader(layer.weight, weight, shard_id)
        layers.append(layer)
    x = torch.randn(3, hidden)
    single, *ranks = (layer(x)[:, : layer.q_size] for layer in layers)
    torch.testing.assert_close(torch.cat(ranks, dim=-1), single)  # [query | gate] head by head


# --- the kernels against transformers' torch functions ----------------------------------------

LENS, SLOTS, RESUME = [5, 1, 2, 9], [3, 0, 4, 1], [True, False, True, True]
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 8, 6


def assert_unchanged(actual: torch.Tensor, before: torch.Tensor) -> None:
    torch.testing.assert_close(actual, before, atol=0, rtol=0, equal_nan=True)


def varlen(lens: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``query_start`` and each sequence's token range."""
    bounds = [0, *itertools.accumulate(lens)]
    return torch.tensor(bounds, dtype=torch.int32), list(zip(bounds, bounds[1:]))


def test_causal_conv1d_matches_transformers_from_and_to_state_slots():
    """Sequences shorter than the window included; a fresh sequence's slot holds NaN; the output
    in three contiguous parts."""
    generator = torch.Generator().manual_seed(10)
    channels, kernel_size = 6, 4
    x = torch.randn(sum(LENS), channels, generator=generator)
    weight = torch.randn(channels, kernel_size, generator=generator)
    states = torch.randn(5, 2, channels, kernel_size - 1, generator=generator)
    states[0] = torch.nan
    before = states.clone()
    query_start, ranges = varlen(LENS)

    parts = causal_conv1d(x, weight, states[:, 1], query_start, torch.tensor(SLOTS),
                          torch.tensor(RESUME), (2, 1, 3))
    assert [part.shape for part in parts] == [(len(x), 2), (len(x), 1), (len(x), 3)]
    assert all(part.is_contiguous() for part in parts)
    out = torch.cat(parts, dim=1)

    for (start, end), slot, resume in zip(ranges, SLOTS, RESUME):
        initial = before[slot, 1] if resume else torch.zeros(channels, kernel_size - 1)
        inputs = torch.cat([initial, x[start:end].T], dim=-1)[None]  # the window's left context
        expected = hf.causal_conv1d_fn(inputs, weight, activation="silu")[0, :, kernel_size - 1 :]
        torch.testing.assert_close(out[start:end], expected.T)
        torch.testing.assert_close(states[slot, 1], inputs[0, :, 1 - kernel_size :])
    assert_unchanged(states[:, 0], before[:, 0])  # another layer's
    assert_unchanged(states[2], before[2])  # a slot of no sequence in the batch


def test_causal_conv1d_update_matches_transformers():
    generator = torch.Generator().manual_seed(11)
    channels, kernel_size = 6, 4
    x = torch.randn(len(SLOTS), channels, generator=generator)
    weight = torch.randn(channels, kernel_size, generator=generator)
    states = torch.randn(5, channels, kernel_size - 1, generator=generator)
    states[0] = torch.nan
    before = states.clone()

    out = causal_conv1d_update(x, weight, states, torch.tensor(SLOTS), torch.tensor(RESUME))

    for i, (slot, resume) in enumerate(zip(SLOTS, RESUME)):
        initial = before[slot] if resume else torch.zeros(channels, kernel_size - 1)
        state = torch.cat([torch.zeros(channels, 1), initial], dim=-1)[None]  # transformers keeps K
        expected = hf.causal_conv1d_update(x[i][None, :, None], state, weight, activation="silu")
        torch.testing.assert_close(out[i], expected[0, :, 0])
        torch.testing.assert_close(states[slot], state[0, :, 1:])


def delta_rule_inputs(num_tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, K_HEADS, K_DIM, generator=generator)
    k = torch.randn(num_tokens, K_HEADS, K_DIM, generator=generator)
    v = torch.randn(num_tokens, V_HEADS, V_DIM, generator=generator)
    g = -2 * torch.rand(num_tokens, V_HEADS, generator=generator)
    beta = torch.rand(num_tokens, V_HEADS, generator=generator)
    states = torch.randn(5, 3, V_HEADS, K_DIM, V_DIM, generator=generator)
    states[0] = torch.nan
    return q, k, v, g, beta, states


def test_gated_delta_rule_matches_transformers_chunked_from_and_to_state_slots():
    q, k, v, g, beta, states = delta_rule_inputs(sum(LENS), seed=12)
    before = states.clone()
    query_start, ranges = varlen(LENS)

    out = gated_delta_rule(q, k, v, g, beta, states[:, 2], query_start, torch.tensor(SLOTS),
                           torch.tensor(RESUME), tuple(LENS))

    for (start, end), slot, resume in zip(ranges, SLOTS, RESUME):
        expected, final = hf.torch_chunk_gated_delta_rule(
            *(t[None, start:end] for t in (q, k, v, g, beta)), chunk_size=4,
            initial_state=before[slot, 2][None] if resume else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[start:end], expected[0])
        torch.testing.assert_close(states[slot, 2], final[0])
    assert_unchanged(states[:, :2], before[:, :2])
    assert_unchanged(states[2], before[2])


def test_gated_delta_rule_update_matches_transformers_recurrent():
    q, k, v, g, beta, states = delta_rule_inputs(len(SLOTS), seed=13)
    states = states[:, 0].clone()
    before = states.clone()

    out = gated_delta_rule_update(q, k, v, g, beta, states, torch.tensor(SLOTS), torch.tensor(RESUME))

    for i, (slot, resume) in enumerate(zip(SLOTS, RESUME)):
        expected, final = hf.torch_recurrent_gated_delta_rule(
            *(t[None, i : i + 1] for t in (q, k, v, g, beta)),
            initial_state=before[slot][None] if resume else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[i], expected[0, 0])
        torch.testing.assert_close(states[slot], final[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_transformers_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(14)
    reference = hf.Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(16, generator=generator) + 0.5)
    x, gate = (torch.randn(2, 5, 4, 16, generator=generator) * 3).to(dtype)

    with torch.no_grad():
        assert torch.equal(rms_norm_gated(x, gate, reference.weight, 1e-6), reference(x, gate))


def test_partial_rotary_matches_transformers_multimodal_rotary_on_text():
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=32, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1]})
    generator = torch.Generator().manual_seed(15)
    q, k = torch.randn(2, 20, 4, 32, generator=generator)
    positions = torch.randint(0, 256, (20,), generator=generator)

    cache = build_cos_sin_cache(8, 256, 10000.0)  # a quarter of head_dim 32
    q_rotated, k_rotated = apply_rotary(q, k, positions, cache)

    cos, sin = hf.Qwen3_5TextRotaryEmbedding(config)(q, positions[None])
    q_expected, k_expected = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     cos, sin)
    torch.testing.assert_close(q_rotated, q_expected[0].transpose(0, 1))
    torch.testing.assert_close(k_rotated, k_expected[0].transpose(0, 1))
    assert torch.equal(q_rotated[..., 8:], q[..., 8:])


def test_the_fused_triton_rotary_decode_kernel_refuses_a_partial_rotary_table():
    """It turns whole heads: given Qwen3.5's quarter-head table it raises, before any launch,
    rather than misread it (the backend's ``rotary_decode_attention`` takes the rotary kernel,
    which turns part of a head, then decode attention)."""
    q, k, v = torch.zeros(1, 4, 32), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32)
    k_cache = v_cache = torch.zeros(2, 4, 2, 32)
    cache, slots = build_cos_sin_cache(8, 16, 10000.0), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="rotary dim 8 of head_dim 32"):
        triton_attention.rotary_decode_attention(q, k, v, slots, cache, k_cache, v_cache, slots,
                                                 slots + 1, slots[None], 1.0)
