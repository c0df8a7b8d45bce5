"""Structured output (llguidance): the parameters, the core's waiting, the sampler's mask, and
end-to-end runs on a tiny random model whose every output must fit its constraint, with async
and sync scheduling, preemption, prefix caching, n > 1 and unconstrained neighbours."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch

from nanofn import LLM, SamplingParams, StructuredOutputsParams
from nanofn.runner.model_runner import SlotParams
from nanofn.runner.sampler import Sampler, apply_token_bitmask
from nanofn.state import Events, InvalidRequest, NewSeq, SchedulerConfig, initial_state, step
from nanofn.state.plan import PENDING_TOKEN, SeqStart, TokenBitmask

pytest.importorskip("llguidance")

COLORS = ["red", "green", "blue"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": COLORS},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{1,4}/'
PROMPTS = ["Tell me about a person:", "Hello world! How are you today?",
           "The capital of France is", "Numbers: one, two, three"]


def fits_schema(text: str) -> bool:
    """Whether ``text`` is a JSON document that ``SCHEMA`` accepts (checked by hand)."""
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and value["color"] in COLORS
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(isinstance(t, bool) for t in value["tags"]))


def constrained(kind: str, **sampling) -> SamplingParams:
    constraint = {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=LARK),
        "json_object": StructuredOutputsParams(json_object=True),
    }[kind]
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 200, **sampling},
                          structured_outputs=constraint)


def check(kind: str, text: str) -> None:
    if kind in ("json", "json_text"):
        assert fits_schema(text), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(r"(hi|hello) [a-z]{1,4}", text), text
    else:
        assert isinstance(json.loads(text), dict), text


KINDS = ["json", "json_text", "regex", "choice", "grammar", "json_object"]


def check_outputs(outs, kinds) -> None:
    for out, kind in zip(outs, kinds):
        for completion in out.outputs:
            if kind is None:
                assert completion.finish_reason == "length"
                continue
            assert completion.finish_reason == "stop", (kind, completion.text)
            check(kind, completion.text)


# --- parameters --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_the_parameters_round_trip_through_a_trace_dict(kind):
    params = constrained(kind, n=2, seed=3)
    d = json.loads(json.dumps(params.to_dict()))
    assert SamplingParams.from_dict(d) == params
    assert params.structured_outputs.kind == kind.removesuffix("_text")


def test_old_trace_params_load_and_unconstrained_ones_write_no_field():
    d = SamplingParams(max_tokens=3).to_dict()
    assert "structured_outputs" not in d
    assert SamplingParams.from_dict(d).structured_outputs is None


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of .* got regex, choice"),
    ({"json_object": False}, "got none"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
])
def test_bad_constraints_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_a_dict_of_fields_is_accepted_and_unknown_ones_are_named():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="structured_outputs has unknown field.*: regx"):
        SamplingParams(structured_outputs={"regx": "a+"})
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")


# --- the core: a constrained sequence waits for its token ------------------------------------

def test_a_constrained_sequence_is_never_scheduled_with_its_token_pending():
    config = SchedulerConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=128, eos_token_ids=(0,), enable_prefix_caching=True,
                             enable_chunked_prefill=True, vocab_size=None)
    state = initial_state(config, 16)
    free = SamplingParams(temperature=0, max_tokens=8)
    grammar = SamplingParams(temperature=0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    state, plan = step(state, Events(new_seqs=(NewSeq("free", (1, 2, 3), free),
                                               NewSeq("grammar", (1, 2, 3), grammar))))
    assert plan.sampling_seq_ids == ("free", "grammar")
    state, plan = step(state, Events())  # async: plan 1's tokens are not delivered yet
    assert plan.seq_ids == ("free",) and plan.entries()[0].token_ids == (PENDING_TOKEN,)
    state, plan = step(state, Events(sampled=(7, 8)))  # the grammar's token is known now
    assert [(s.seq_id, s.token_ids) for s in plan.entries()] == [("free", (PENDING_TOKEN,)),
                                                                 ("grammar", (8,))]


# --- the mask in the sampler --------------------------------------------------------------

def random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> np.ndarray:
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64)
    return bits.to(torch.int32).numpy()


def allowed_by(bits: np.ndarray, vocab: int) -> np.ndarray:
    """bool [rows, vocab]: the reference reading of a bitmask (little-endian bits)."""
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").astype(bool)
    out = np.zeros((len(bits), vocab), bool)
    width = min(vocab, unpacked.shape[1])
    out[:, :width] = unpacked[:, :width]
    return out


def test_the_bitmask_masks_exactly_the_tokens_it_does_not_allow():
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # 4 words cover 128 ids; then a mask narrower than the logits
    logits = torch.randn(5, vocab, generator=gen)
    for words in (4, 2):
        bits = random_bitmask(3, 32 * words, gen)
        rows = torch.tensor([0, 2, 4])
        masked = apply_token_bitmask(logits, rows, torch.from_numpy(bits))
        expected = logits.clone()
        expected[rows] = torch.where(torch.from_numpy(allowed_by(bits, vocab)), logits[rows],
                                     float("-inf"))
        assert torch.equal(masked, expected)
        assert torch.equal(masked[[1, 3]], logits[[1, 3]])


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (0.8, 5)])
def test_the_sampler_draws_only_allowed_tokens(temperature, top_k):
    gen = torch.Generator().manual_seed(1)
    vocab, rows = 70, 64
    logits = torch.randn(rows, vocab, generator=gen) * 4
    bits = np.zeros((rows // 2, 3), np.int32)
    for k in range(rows // 2):  # a few allowed tokens per constrained row, none the argmax
        allowed = torch.randperm(vocab, generator=gen)[:3].tolist()
        for t in allowed:
            bits[k, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    constrained_rows = np.arange(0, rows, 2)
    params = SamplingParams(temperature=temperature, top_k=top_k, logprobs=2)
    out = Sampler(seed=0, device="cpu")(logits, [_row(params, i) for i in range(rows)],
                                        TokenBitmask(constrained_rows, bits))
    allowed = allowed_by(bits, vocab)
    for k, row in enumerate(constrained_rows.tolist()):
        assert allowed[k, out.token_ids[row]]
        assert out.logprobs[row].rank == 1 or temperature > 0
    free = [out.token_ids[row] for row in range(1, rows, 2)]
    if temperature == 0:
        assert free == logits[1::2].argmax(dim=-1).tolist()


def _row(params, position):
    from nanofn.runner.sampler import SampleRequest
    return SampleRequest(params, position)


def test_a_constrained_row_is_never_sampled_in_a_cuda_graph():
    slots = SlotParams(4)
    plain = SamplingParams(temperature=0.7)
    slots.start((SeqStart(0, "a", plain, 3), SeqStart(1, "b", constrained("regex"), 3)))
    assert slots.plain[0] and not slots.plain[1]


# --- end to end ---------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_output_fits_its_constraint_in_a_mixed_batch(tiny_qwen3, async_scheduling):
    kinds = KINDS + [None, "json"]
    params = [constrained(k) if k else SamplingParams(temperature=1.0, max_tokens=12,
                                                      ignore_eos=True) for k in kinds]
    params[-1] = constrained("json", temperature=0.0, n=3)  # greedy children: the same output
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256,
             async_scheduling=async_scheduling) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.figures().kv_blocks_used == 0
        assert not llm.engine.grammars.matchers  # every matcher freed
    check_outputs(outs, kinds)
    assert len({c.text for c in outs[-1].outputs}) == 1 and len(outs[-1].outputs) == 3


def test_outputs_do_not_depend_on_preemption_caching_or_async_scheduling(tiny_qwen3):
    """Greedy constrained outputs under a pool small enough to preempt, with shared prompts
    in the prefix cache and async scheduling, equal those of a roomy sync run without
    caching: the matchers kept their state through preemption and recomputation."""
    shared = "Once upon a time there was a little engine that served many requests. "
    kinds = [KINDS[i % len(KINDS)] for i in range(12)]
    prompts = [shared * 2 + PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    params = [constrained(k, temperature=0.0, max_tokens=120) for k in kinds]

    def run(**options):
        with LLM(str(tiny_qwen3), max_model_len=256, **options) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return outs, llm.engine.figures()

    roomy, _ = run(num_kv_blocks=256, async_scheduling=False, enable_prefix_caching=False)
    tight, figures = run(num_kv_blocks=16, async_scheduling=True)
    assert figures.num_preemptions > 0 and figures.prefix_cache_hit_rate > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    check_outputs(tight, kinds)


def test_a_sampled_run_with_n_under_preemption_fits(tiny_qwen3):
    kinds = ["json", "regex", "grammar", "choice"] * 2
    params = [constrained(k, n=2, seed=i, max_tokens=150) for i, k in enumerate(kinds)]
    with LLM(str(tiny_qwen3), max_model_len=256, num_kv_blocks=16) as llm:
        outs = llm.generate([PROMPTS[i % 4] * 2 for i in range(len(kinds))], params,
                            use_tqdm=False)
        assert llm.engine.figures().num_preemptions > 0
    check_outputs(outs, kinds)


def test_ignore_eos_still_ends_when_the_grammar_does(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS[:2], [constrained("regex", ignore_eos=True),
                                          constrained("choice", ignore_eos=True)],
                            use_tqdm=False)
    check_outputs(outs, ["regex", "choice"])
    assert outs[0].outputs[0].token_ids[-1] == 0  # the end token closed it


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "invalid json"),
    (StructuredOutputsParams(json="{not json"), "invalid json"),
    (StructuredOutputsParams(regex="a(b"), "invalid regex.*unclosed group"),
    (StructuredOutputsParams(grammar="start: ("), "invalid grammar"),
])
def test_an_invalid_constraint_fails_its_request_only(tiny_qwen3, constraint, message):
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        with pytest.raises(InvalidRequest, match=f"(?s)prompt 1: structured_outputs of request .*{message}"):
            llm.generate(PROMPTS[:2], [constrained("choice"),
                                       SamplingParams(structured_outputs=constraint)],
                         use_tqdm=False)
        engine = llm.engine
        with pytest.raises(InvalidRequest, match=f"(?s)structured_outputs of request 'bad': {message}"):
            engine.add_request("hi", SamplingParams(structured_outputs=constraint), "bad")
        assert not engine.has_unfinished_requests() and not engine.grammars.matchers
        (out,) = llm.generate(PROMPTS[:1], constrained("choice"), use_tqdm=False)
    check_outputs([out], ["choice"])


def test_without_llguidance_the_error_names_the_extra(tiny_qwen3, monkeypatch):
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        monkeypatch.setitem(sys.modules, "llguidance", None)
        with pytest.raises(InvalidRequest, match=r"nanofn\[structured\]"):
            llm.generate(PROMPTS[:1], constrained("regex"), use_tqdm=False)
        monkeypatch.undo()
        (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_a_trace_with_constraints_replays_and_checks(tiny_qwen3, tmp_path):
    from nanofn.state import parse_trace, replay

    path = tmp_path / "run.jsonl"
    kinds = ["json", "regex", "choice"]
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256, trace=str(path)) as llm:
        outs = llm.generate(PROMPTS[:3], [constrained(k) for k in kinds], use_tqdm=False)
    check_outputs(outs, kinds)
    states = [state for state, _ in replay(parse_trace(path.read_text().splitlines()),
                                           check=True)]
    finished = {seq.seq_id: seq for state in states for seq in state.finished}
    assert [finished[o.request_id].params for o in outs] == [constrained(k) for k in kinds]


def test_min_tokens_pads_a_short_constrained_output_with_end_tokens(tiny_qwen3):
    """A grammar that ends before min_tokens: the end token is not banned (the mask allows
    nothing else), the sequence goes on with end tokens and stops once min_tokens allows."""
    from nanofn.state.policy import banned_token_ids

    params = constrained("choice", min_tokens=5, max_tokens=20)
    assert banned_token_ids(params, 0, (0,)) == ()
    assert banned_token_ids(SamplingParams(min_tokens=5), 0, (0,)) == (0,)
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS[:2], [params, constrained("choice", min_tokens=5,
                                                              temperature=0.0)], use_tqdm=False)
    check_outputs(outs, ["choice", "choice"])
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 6 and ids[-1] == 0, ids  # 5 tokens, then the end


def test_the_mask_covers_the_model_vocabulary_and_allows_no_id_past_the_tokenizer(tiny_qwen3):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from nanofn.engine.structured import Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    vocab = json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    assert vocab > len(tokenizer)
    grammars = Grammars(tokenizer, vocab, (tokenizer.eos_token_id,))
    for i, kind in enumerate(["json_object", "regex"]):
        grammars.add(f"s{i}", grammars.compile("r", constrained(kind).structured_outputs))
    plan = SimpleNamespace(sampling_seq_ids=("free", "s1", "s0"))
    mask = grammars.bitmask(plan)
    assert mask.rows.tolist() == [1, 2] and mask.bits.shape == (2, (vocab + 31) // 32)
    allowed = allowed_by(mask.bits, vocab)
    assert allowed.any(axis=1).all() and not allowed[:, len(tokenizer):].any()
    assert allowed[1].nonzero()[0].tolist() == tokenizer.convert_tokens_to_ids(["{"])
    assert grammars.accept("s0", tokenizer.convert_tokens_to_ids("{")) is False
    assert grammars.accept("s0", tokenizer.convert_tokens_to_ids("x")) is True  # not JSON


def test_tensor_parallel_ranks_sample_within_the_mask(tiny_qwen3):
    """Rank 0 alone samples, so the mask goes to it alone; the workers run the same plans."""
    kinds = ["regex", "choice", "json"]
    params = [constrained(k, temperature=0.0) for k in kinds]
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256,
             tensor_parallel_size=2) as llm:
        split = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        whole = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    check_outputs(split, kinds)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in whole]
