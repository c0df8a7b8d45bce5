"""vLLM API parity: a vLLM offline script runs unchanged, and each of the names it uses keeps
vLLM's meaning (SamplingParams' further fields, the outputs' stop_reason, metrics,
num_cached_tokens and prompt_logprobs, generation_config defaults, chat options, the server's
request fields)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanofn import LLM, BeamSearchParams, SamplingParams
from nanofn.runner import model_runner
from nanofn.server.requests import APIError, sampling_params
from nanofn.state import parse_trace, replay
from nanofn.state.policy import bad_word_bans

GENERATION_CONFIG = dict(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1,
                         max_new_tokens=12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def with_generation_config(folder: Path, **settings) -> Path:
    """Add sampling settings to a checkpoint's generation_config.json (its EOS id stays)."""
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return folder


@pytest.fixture(scope="module")
def qwen3_with_defaults(tiny_checkpoint_factory) -> Path:
    return with_generation_config(tiny_checkpoint_factory("qwen3"), **GENERATION_CONFIG)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=128, max_model_len=256, seed=0) as llm:
        yield llm


def test_a_vllm_offline_script_runs_unchanged(qwen3_with_defaults):
    script = Path(__file__).parent / "vllm_offline_script.py"
    done = subprocess.run([sys.executable, str(script), str(qwen3_with_defaults)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vLLM script ran" in done.stdout


# --- SamplingParams ---------------------------------------------------------------------------

def test_new_fields_round_trip_through_json_and_old_dicts_still_load():
    params = SamplingParams(logit_bias={7: 2.5, 3: -1}, allowed_token_ids=[1, 2, 3],
                            bad_words=["no"], bad_words_token_ids=[[4, 5]], prompt_logprobs=2,
                            truncate_prompt_tokens=-1, detokenize=False,
                            spaces_between_special_tokens=False)
    assert params.logit_bias == ((3, -1), (7, 2.5))  # token order, hashable
    assert SamplingParams.from_dict(json.loads(json.dumps(params.to_dict()))) == params
    string_keys = SamplingParams.from_dict({"logit_bias": {"7": 2.5, "3": -1}})
    assert string_keys.logit_bias == params.logit_bias
    old = {k: v for k, v in SamplingParams().to_dict().items() if k in (
        "n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "skip_special_tokens")}
    assert SamplingParams.from_dict(old) == SamplingParams()
    hash(params)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={"x": 1.0}), "logit_bias must map token ids"),
    (dict(logit_bias={1: math.inf}), "logit_bias must map token ids .* finite"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must map token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words must be a list of non-blank strings"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be an integer in \[0, 20\]"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be -1, an integer >= 1"),
    (dict(detokenize="no"), "detokenize must be a bool"),
    (dict(detokenize=False, stop=["x"]), "stop strings need detokenize=True"),
])
def test_bad_new_fields_name_the_field_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(llm):
    vocab = llm.engine.text_config.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 1.0}),
                   SamplingParams(allowed_token_ids=[1, vocab + 5])):
        with pytest.raises(ValueError, match=rf"not in the vocabulary \[0, {vocab}\)"):
            llm.generate("Hello", params, use_tqdm=False)
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_beam_search_params_take_a_temperature():
    assert BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.7).temperature == 0.7
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=-1)


# --- bad words --------------------------------------------------------------------------------

def test_a_bad_word_bans_its_last_token_only_after_the_rest_of_it():
    words = ((5,), (1, 2, 3), (8, 9))
    assert bad_word_bans(words, []) == (5,)
    assert bad_word_bans(words, [7, 1, 2]) == (5, 3)
    assert bad_word_bans(words, [1, 2, 8]) == (5, 9)
    assert bad_word_bans(words, [2, 1]) == (5,)


def test_bad_words_are_never_completed_and_the_rest_is_unchanged(llm):
    (plain,) = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    tokens = plain.outputs[0].token_ids
    word = (tokens[3], tokens[4])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                            bad_words_token_ids=[word])
    (out,) = llm.generate("The quick brown fox", params, use_tqdm=False)
    got = out.outputs[0].token_ids
    assert got[:4] == tokens[:4] and got[4] != tokens[4]
    assert all((a, b) != word for a, b in zip(got, got[1:]))


def test_bad_words_are_tokenized_alone_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()
    prepared = llm.engine._with_bad_word_ids(SamplingParams(bad_words=["fox"]))
    assert set(prepared.bad_words_token_ids) == {tuple(tokenizer.encode("fox")),
                                                 tuple(tokenizer.encode(" fox"))}


# --- prompt logprobs --------------------------------------------------------------------------

def reference_logprobs(folder: Path, token_ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("prefix_cached, rows_at_once", [(False, None), (True, None), (False, 5)],
                         ids=["uncached", "prefix-cached", "logits-five-rows-at-a-time"])
def test_prompt_logprobs_match_transformers_over_chunks_and_ignore_the_cache(
        tiny_qwen3, prefix_cached, rows_at_once, monkeypatch):
    """(``rows_at_once``: a step's positions scored in parts, as a large step's are.)"""
    if rows_at_once:
        monkeypatch.setattr(model_runner, "PROMPT_ROWS_AT_ONCE", rows_at_once)
    prompt = list(range(40, 90))
    with LLM(str(tiny_qwen3), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
             seed=0) as llm:
        if prefix_cached:  # the prompt's blocks are in the cache: it must not read them
            (warm,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
        (out,) = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
        (again,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 0 and again.num_cached_tokens > 0
    reference = reference_logprobs(tiny_qwen3, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry, expected = out.prompt_logprobs[position], reference[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top = expected.topk(3)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= 3)
        assert [t for _, t in ranked][:3] == top.indices.tolist()


def test_prompt_logprobs_with_n_samples_and_without_text(llm):
    params = SamplingParams(n=2, max_tokens=2, prompt_logprobs=0, detokenize=False, seed=1)
    (out,) = llm.generate("Once upon a time", params, use_tqdm=False)
    assert len(out.outputs) == 2 and out.prompt_logprobs[0] is None
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) <= 1 + (entry[token].rank != 1)
        assert all(lp.decoded_token is None for lp in entry.values())


# --- outputs ----------------------------------------------------------------------------------

def test_stop_reason_is_the_stop_token_or_string_and_none_at_eos(llm):
    eos = llm.engine.eos_token_ids[0]
    (out,) = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5,
                                                  logit_bias={eos: 100.0}), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    (out,) = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                  stop_token_ids=[eos], logit_bias={eos: 100.0}),
                          use_tqdm=False)
    assert out.outputs[0].stop_reason == eos


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_minus_one_the_model_length(llm):
    ids = list(range(10, 300))
    (out,) = llm.generate({"prompt_token_ids": ids},
                          SamplingParams(max_tokens=1, truncate_prompt_tokens=5), use_tqdm=False)
    assert out.prompt_token_ids == ids[-5:]
    with pytest.raises(ValueError, match="longer than max_model_len 256"):
        llm.generate({"prompt_token_ids": ids},
                     SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": ids[:100]},
                          SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    assert out.prompt_token_ids == ids[:100]


def test_streamed_outputs_carry_metrics_and_the_cached_count_once_known(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=128) as llm:
        engine = llm.llm_engine
        engine.add_request("Once upon a time there was a little engine", GREEDY, "a")
        seen = []
        while engine.has_unfinished_requests():
            seen += [o for o in engine.step().outputs if o.request_id == "a"]
        assert llm.reset_prefix_cache()
    assert seen[0].metrics.first_token_time is not None and seen[-1].finished
    assert [o.num_cached_tokens for o in seen[:-1]] == [None] * (len(seen) - 1)
    assert seen[-1].num_cached_tokens == 0
    assert seen[-1].metrics.num_generation_tokens == 8


def test_reset_prefix_cache_refuses_while_requests_run_and_the_trace_replays(tiny_qwen3,
                                                                             tmp_path):
    path = tmp_path / "run.jsonl"
    prompt = "Once upon a time there was a little engine that served many requests"
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=128, trace=str(path)) as llm:
        llm.generate(prompt, GREEDY, use_tqdm=False)
        llm.llm_engine.add_request(prompt, GREEDY, "running")
        assert not llm.reset_prefix_cache()  # a request is unfinished
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
        assert list(llm.llm_engine.loop.state.pool.cached_blocks())
        assert llm.reset_prefix_cache()
        assert not list(llm.llm_engine.loop.state.pool.cached_blocks())  # at once, as vLLM's
        shaped = SamplingParams(temperature=0.5, max_tokens=6, seed=3, logit_bias={5: 3.0},
                                allowed_token_ids=[5, 6, 7, 8], bad_words=["fox"],
                                prompt_logprobs=1)
        (out,) = llm.generate(prompt, shaped, use_tqdm=False)
    assert out.num_cached_tokens == 0
    states = [state for state, _ in replay(parse_trace(path.read_text().splitlines()),
                                           check=True)]
    finished = {seq.seq_id: seq for state in states for seq in state.finished}
    assert list(finished[out.request_id].output_token_ids) == out.outputs[0].token_ids


# --- generation_config ------------------------------------------------------------------------

def test_generation_config_auto_vllm_or_a_folder(qwen3_with_defaults, tiny_qwen3):
    with LLM(str(qwen3_with_defaults), max_model_len=128) as llm:
        auto = llm.get_default_sampling_params()
    assert (auto.temperature, auto.top_p, auto.top_k, auto.repetition_penalty,
            auto.max_tokens) == (0.6, 0.95, 20, 1.1, 12)
    with LLM(str(qwen3_with_defaults), max_model_len=128, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(str(tiny_qwen3), max_model_len=128,
             generation_config=str(qwen3_with_defaults)) as llm:
        assert llm.get_default_sampling_params() == auto
    with pytest.raises(FileNotFoundError, match="generation_config .*does not exist"):
        LLM(str(tiny_qwen3), generation_config=str(tiny_qwen3 / "nowhere"))


def test_generate_without_params_samples_with_the_defaults_and_given_params_as_they_are(
        tiny_checkpoint_factory):
    folder = with_generation_config(tiny_checkpoint_factory("qwen3"), temperature=0.0,
                                    repetition_penalty=2.0, max_new_tokens=8)
    prompt = "the cat"  # whose greedy continuation repeats a token
    with LLM(str(folder), max_model_len=128) as llm:
        (default,) = llm.generate(prompt, use_tqdm=False)
        (explicit,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                          repetition_penalty=2.0),
                                   use_tqdm=False)
        (given,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                       ignore_eos=True), use_tqdm=False)
    assert default.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(default.outputs[0].token_ids) <= 8
    tokens = given.outputs[0].token_ids
    assert len(tokens) == 20  # neither the default max_tokens nor its penalty applies
    assert len(set(tokens[:8])) < 8 and tokens[:8] != explicit.outputs[0].token_ids


def test_a_generation_config_value_out_of_range_names_the_file(tiny_checkpoint_factory):
    folder = with_generation_config(tiny_checkpoint_factory("qwen3"), top_p=1.5)
    with pytest.raises(ValueError, match=r"generation_config.json.*top_p must be in \(0, 1\]"):
        LLM(str(folder))


def test_repetition_penalty_matches_transformers_greedy_generate(tiny_qwen3, llm):
    import transformers

    prompt = llm.get_tokenizer().encode("Once upon a time there was")
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                         repetition_penalty=1.8), use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.8, min_new_tokens=12, top_k=None,
                              top_p=None, temperature=None)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == expected


# --- chat -------------------------------------------------------------------------------------

def test_chat_options(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                          {"type": "text", "text": "there"}]}]
    text = [{"role": "user", "content": "Hi there"}]
    (a,) = llm.chat(parts, GREEDY, use_tqdm=False)
    (b,) = llm.chat(text, GREEDY, use_tqdm=False)
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids
    (thinking_off,) = llm.chat(text, GREEDY, use_tqdm=False,
                               chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.prompt == b.prompt + "<think>\n\n</think>\n\n"
    (no_prompt,) = llm.chat(text, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert not no_prompt.prompt.endswith("assistant\n")
    with pytest.raises(ValueError, match="continue_final_message=True needs "
                                         "add_generation_prompt=False"):
        llm.chat(text, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="nanofn reads text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                 GREEDY, use_tqdm=False)


# --- the server's request fields --------------------------------------------------------------

def test_the_server_reads_the_new_fields_and_clamps_the_logit_bias():
    params = sampling_params({"logit_bias": {"5": 250, "9": -3.5}, "allowed_token_ids": [5, 9],
                              "bad_words": ["no"], "prompt_logprobs": 2,
                              "truncate_prompt_tokens": 4, "repetition_penalty": 1.2},
                             chat=False)
    assert params.logit_bias == ((5, 100.0), (9, -3.5))
    assert (params.allowed_token_ids, params.bad_words, params.prompt_logprobs,
            params.truncate_prompt_tokens, params.repetition_penalty) == ((5, 9), ("no",), 2, 4,
                                                                          1.2)
    with pytest.raises(APIError) as error:
        sampling_params({"logit_bias": {"a": 1}}, chat=False)
    assert error.value.param == "logit_bias"
    with pytest.raises(APIError) as error:
        sampling_params({"allowed_token_ids": []}, chat=True)
    assert error.value.param == "allowed_token_ids"


def test_the_server_fills_unset_fields_from_the_generation_config():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 12}
    unset = sampling_params({}, chat=True, defaults=defaults)
    assert (unset.temperature, unset.top_k, unset.max_tokens) == (0.6, 20, 12)
    given = sampling_params({"temperature": 0.0, "max_tokens": 100}, chat=True, defaults=defaults)
    assert (given.temperature, given.top_k, given.max_tokens) == (0.0, 20, 12)  # capped
    completion = sampling_params({}, chat=False, defaults=defaults)
    assert completion.max_tokens == 12
    assert sampling_params({}, chat=False).max_tokens == 16


def test_the_generate_command_samples_with_the_generation_config_where_flags_are_unset(
        tiny_checkpoint_factory, capsys):
    from nanofn.cli import main

    folder = with_generation_config(tiny_checkpoint_factory("qwen3"), temperature=0.0,
                                    max_new_tokens=5)
    assert main(["generate", str(folder), "--prompt", "the cat", "--max-model-len", "64"]) == 0
    defaults = capsys.readouterr().out
    assert "finish: length, 5 tokens" in defaults  # max_new_tokens, not SamplingParams' 16
    assert main(["generate", str(folder), "--prompt", "the cat", "--max-model-len", "64",
                 "--temperature", "0", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == defaults  # greedy, from the file
    assert main(["generate", str(folder), "--prompt", "the cat", "--max-model-len", "64",
                 "--max-tokens", "7"]) == 0
    assert "7 tokens" in capsys.readouterr().out  # a flag wins
