"""``nanofn serve`` as a subprocess on 127.0.0.1, driven with the real ``openai`` client (and
httpx where the client hides the HTTP): completions and chat, streamed and not, n > 1, stop
strings, logprobs, usage, errors, disconnects, and a bounded load with cancellations; scoring
(echo with logprobs, max_tokens=0) and lm-eval's local-completions model against the server."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import (API_KEY, HEADERS, engine_pid_of, first_event, metric, needs_proc,
                            serving, start_server, wait_until_idle)

openai = pytest.importorskip("openai")

@pytest.fixture(scope="module")
def server(tiny_qwen3):
    with serving(tiny_qwen3) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def test_models_health_version_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200
    assert "version" in httpx.get(f"{server}/version").json()
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello there"


def test_chat_template_kwargs_reach_the_template_and_metrics_count(server, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    plain = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()["tokens"]
    no_thinking = httpx.post(f"{server}/tokenize", json={
        "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert no_thinking["tokens"][:len(plain)] == plain and no_thinking["count"] > len(plain)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                         extra_body={"chat_template_kwargs":
                                                     {"enable_thinking": False}})
    assert out.usage.prompt_tokens == no_thinking["count"]
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc"):
        metric(server, name)
    assert metric(server, "vllm:prefix_cache_queries_total") >= no_thinking["count"]


def test_a_completion_with_usage_and_a_seed(client):
    a = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                  temperature=0.8, seed=3)
    b = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                  temperature=0.8, seed=3)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 12 and a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + 12


def test_streamed_text_equals_the_whole_text(client):
    kwargs = dict(model="tiny", prompt="The cat", max_tokens=20, temperature=0.7, seed=11)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 20
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                          temperature=0.7, seed=5)
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15,
                                              temperature=0.7, seed=5, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"


def test_stream_interval_sends_the_same_text_in_fewer_chunks(tiny_qwen3, client):
    """``serve --stream-interval 5``: 20 tokens come in chunks of the first token, then every
    5 and the finish (5), not ~20 (a server streaming each token sends one a step, fewer only
    where its client falls behind), and add up to the same text."""
    kwargs = dict(model="tiny", prompt="The cat", max_tokens=20, temperature=0.7, seed=11,
                  stream=True)
    each = [c.choices[0].text for c in client.completions.create(**kwargs) if c.choices]
    with serving(tiny_qwen3, "--stream-interval", "5") as url:
        fewer = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        chunks = [c.choices[0].text for c in fewer.completions.create(**kwargs) if c.choices]
    assert "".join(chunks) == "".join(each)
    assert len(chunks) <= 5 and len(each) > 10


def test_a_streamed_n_gives_each_choice_its_whole_text(client):
    kwargs = dict(model="tiny", prompt="Twice", max_tokens=12, n=2, temperature=1.0, seed=9)
    whole = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == whole


def test_n_token_prompts_echo_and_several_prompts(client):
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=5, n=3, seed=1,
                                    temperature=1.0)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    several = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=4,
                                        temperature=0)
    assert sorted(c.index for c in several.choices) == [0, 1]
    echoed = client.completions.create(model="tiny", prompt="Echo me", max_tokens=3, echo=True,
                                       temperature=0)
    assert echoed.choices[0].text.startswith("Echo me")
    tokens = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"),
                        json={"prompt": "Echo me"}).json()["tokens"]
    echoed_ids = client.completions.create(model="tiny", prompt=tokens, max_tokens=3, echo=True,
                                           temperature=0)
    assert echoed_ids.choices[0].text == echoed.choices[0].text


def test_a_stop_string_ends_the_text_before_it(client):
    whole = client.completions.create(model="tiny", prompt="abc", max_tokens=40,
                                      temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=40, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    """A completion's top_logprobs hold the sampled token and the k best (k + 1 entries at
    most, as in vLLM); chat's hold exactly the k best, the sampled token being the entry."""
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, logprobs=2,
                                    temperature=1.5, seed=4)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 2 <= len(top) <= 3
        assert len(top) == 2 or value < min(v for t, v in top.items() if t != token)
    sampled_only = client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                             logprobs=0, temperature=1.5, seed=4)
    sampled_only = sampled_only.choices[0].logprobs
    assert sampled_only.token_logprobs == lp.token_logprobs
    assert sampled_only.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "x"}],
                                          max_tokens=6, logprobs=True, top_logprobs=2,
                                          temperature=1.5, seed=4)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 2 for t in content)
    for t in content:
        best = [top.logprob for top in t.top_logprobs]
        assert best == sorted(best, reverse=True) and t.logprob <= best[0]
        listed = any((top.token, top.logprob) == (t.token, t.logprob) for top in t.top_logprobs)
        assert listed == (t.logprob >= best[1])


# --- scoring: echo with logprobs, max_tokens=0, lm-eval --------------------------------------

SCORED = "The quick brown fox jumps"
REPO = Path(__file__).resolve().parent.parent
LM_EVAL_TASKS = ["nanofn_choice", "nanofn_perplexity", "nanofn_generate"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    """The reference for the server's logprobs: nanofn's own LLM on the same checkpoint."""
    from nanofn import LLM

    with LLM(str(tiny_qwen3), max_model_len=256, num_kv_blocks=64, seed=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def encode(tiny_qwen3):
    """Text to token ids as lm-eval's Hugging Face backend makes them."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_qwen3)
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def prompt_logprobs(llm, token_ids: list[int], k: int = 1) -> list:
    from nanofn import SamplingParams

    (out,) = llm.generate({"prompt_token_ids": token_ids},
                          SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out.prompt_logprobs


def expected_top(entry: dict, token: int, k: int) -> dict:
    """A completion's top_logprobs at a position: the k best and the position's token."""
    return {lp.decoded_token: lp.logprob for t, lp in entry.items() if lp.rank <= k or t == token}


def joined(chunks: list) -> dict:
    """The logprobs of a streamed completion's chunks, end to end."""
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {f: [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in getattr(c.choices[0].logprobs, f)] for f in fields}


def test_echo_with_logprobs_scores_the_prompt_then_the_generated_tokens(client, llm, encode,
                                                                          tiny_qwen3):
    import transformers

    ids = encode(SCORED)
    kwargs = dict(model="tiny", prompt=SCORED, max_tokens=3, logprobs=2, temperature=0)
    (choice,) = client.completions.create(**kwargs, echo=True).choices
    (generated,) = client.completions.create(**kwargs).choices
    lp, n = choice.logprobs, len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = prompt_logprobs(llm, ids, k=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position in range(1, n):
        token, entry = ids[position], expected[position]
        assert lp.tokens[position] == entry[token].decoded_token
        assert lp.token_logprobs[position] == pytest.approx(entry[token].logprob, abs=1e-5)
        assert lp.token_logprobs[position] == pytest.approx(
            reference[position - 1, token].item(), abs=1e-4)
        assert lp.top_logprobs[position] == pytest.approx(expected_top(entry, token, 2),
                                                          abs=1e-5)
    assert any(len(top) == 3 for top in lp.top_logprobs[1:n])  # a prompt token outside the top
    assert "".join(lp.tokens[:n]) == SCORED and choice.text == SCORED + generated.text
    assert lp.tokens[n:] == generated.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(generated.logprobs.token_logprobs, abs=1e-5)
    for echoed, alone in zip(lp.top_logprobs[n:], generated.logprobs.top_logprobs):
        assert echoed == pytest.approx(alone, abs=1e-5)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets and lp.text_offset[n] == len(SCORED)
    assert generated.logprobs.text_offset[0] == 0
    vllm_field = choice.model_extra["prompt_logprobs"]
    assert vllm_field[0] is None and all(
        vllm_field[i][str(ids[i])]["logprob"] == lp.token_logprobs[i] for i in range(1, n))
    streamed = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(SCORED)
    assert len(streamed[0].choices[0].logprobs.tokens) > n  # the prompt's come first
    assert joined(streamed) == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs,
                                "top_logprobs": lp.top_logprobs, "text_offset": lp.text_offset}


def test_max_tokens_0_with_echo_scores_the_prompt_without_generating(server, client, encode):
    ids = encode(SCORED)
    scored = client.completions.create(model="tiny", prompt=SCORED, max_tokens=0, echo=True,
                                       logprobs=1)
    (choice,) = scored.choices
    longer = client.completions.create(model="tiny", prompt=SCORED, max_tokens=2, echo=True,
                                       logprobs=1, temperature=0).choices[0].logprobs
    assert choice.text == SCORED and choice.finish_reason == "length"
    assert choice.logprobs.tokens == longer.tokens[:len(ids)]
    assert choice.logprobs.token_logprobs == pytest.approx(longer.token_logprobs[:len(ids)],
                                                           abs=1e-5)
    assert choice.logprobs.top_logprobs[0] is None
    for alone, generating in zip(choice.logprobs.top_logprobs[1:], longer.top_logprobs[1:]):
        assert alone == pytest.approx(generating, abs=1e-5)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens,
            scored.usage.total_tokens) == (len(ids), 0, len(ids))
    streamed = list(client.completions.create(model="tiny", prompt=SCORED, max_tokens=0,
                                              echo=True, logprobs=1, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == SCORED
    assert joined(streamed)["token_logprobs"] == choice.logprobs.token_logprobs
    assert streamed[-1].usage.completion_tokens == 0
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=0,
                                      echo=True, logprobs=1)
    assert [len(c.logprobs.tokens) for c in batch.choices] == [len(ids), 3]
    assert batch.choices[1].logprobs.token_logprobs == pytest.approx(
        choice.logprobs.token_logprobs[:3], abs=1e-5)
    plain = client.completions.create(model="tiny", prompt=SCORED, max_tokens=0, echo=True)
    assert plain.choices[0].text == SCORED and plain.choices[0].logprobs is None
    for extra in ({}, {"echo": False}):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="tiny", prompt=SCORED, max_tokens=0, **extra)
        assert error.value.body["param"] == "max_tokens" and "echo" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt=SCORED, extra_body={"echo": "yes"})
    assert error.value.body["param"] == "echo"
    wait_until_idle(server)


def test_logprobs_of_tokens_a_grammar_masks_are_finite(client):
    """Tokens an output constraint rules out have logprob -inf, which JSON cannot hold: as in
    vLLM they read -9999.0 (whole responses and streamed chunks alike)."""
    pytest.importorskip("llguidance")
    constraint = {"guided_choice": ["left", "right"]}
    out = client.completions.create(model="tiny", prompt="Pick:", max_tokens=3, logprobs=5,
                                    extra_body=constraint)
    assert -9999.0 in out.choices[0].logprobs.top_logprobs[0].values()
    chunks = list(client.completions.create(model="tiny", prompt="Pick:", max_tokens=3,
                                            logprobs=5, extra_body=constraint, stream=True))
    assert -9999.0 in joined(chunks)["top_logprobs"][0].values()
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "Pick"}],
                                          max_tokens=3, logprobs=True, top_logprobs=5,
                                          extra_body=constraint)
    assert -9999.0 in [t.logprob for t in chat.choices[0].logprobs.content[0].top_logprobs]


def test_lm_eval_scores_through_the_server(server, llm, encode, tiny_qwen3, monkeypatch):
    """lm-eval's ``local-completions`` model on the tasks in tests/lm_eval_tasks: its
    loglikelihoods (and is_greedy), rolling loglikelihoods and generations are those of LLM."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from nanofn import SamplingParams

    monkeypatch.chdir(REPO)  # the task files name their data file from the repository root
    model_args = dict(model="tiny", base_url=f"{server}/v1/completions", tokenizer=str(tiny_qwen3),
                      tokenizer_backend="huggingface", max_length=256, max_retries=1,
                      header={"Authorization": f"Bearer {API_KEY}"})
    tasks = TaskManager(include_path=str(REPO / "tests" / "lm_eval_tasks"),
                        include_defaults=False)
    evaluated = lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                        tasks=LM_EVAL_TASKS, task_manager=tasks,
                                        log_samples=True)
    samples, results = evaluated["samples"], evaluated["results"]
    correct = []
    for sample in samples["nanofn_choice"]:
        scores = []
        for (context, continuation), [(loglikelihood, is_greedy)] in zip(sample["arguments"],
                                                                         sample["resps"]):
            context_ids = encode(context)
            tokens = context_ids + encode(context + continuation)[len(context_ids):]
            entries = prompt_logprobs(llm, tokens)[len(context_ids):]
            targets = tokens[len(context_ids):]
            assert loglikelihood == pytest.approx(
                sum(e[t].logprob for t, e in zip(targets, entries)), abs=1e-4)
            assert is_greedy == all(e[t].rank == 1 for t, e in zip(targets, entries))
            scores.append(loglikelihood)
        correct.append(scores.index(max(scores)) == sample["target"])
    assert results["nanofn_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    tokenizer = llm.get_tokenizer()  # lm-eval's prefix token: BOS, or else EOS
    prefix = [tokenizer.eos_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id]
    total, num_bytes = 0.0, 0
    for sample in samples["nanofn_perplexity"]:
        [(text,)], [[loglikelihood]] = sample["arguments"], sample["resps"]
        tokens = prefix + encode(text)
        entries = prompt_logprobs(llm, tokens)[1:]
        assert loglikelihood == pytest.approx(
            sum(e[t].logprob for t, e in zip(tokens[1:], entries)), abs=1e-3)
        total, num_bytes = total + loglikelihood, num_bytes + len(text.encode())
    assert results["nanofn_perplexity"]["byte_perplexity,none"] == pytest.approx(
        math.exp(-total / num_bytes))
    for sample in samples["nanofn_generate"]:
        [(context, options)], [[text]] = sample["arguments"], sample["resps"]
        params = SamplingParams(temperature=0, max_tokens=options["max_gen_toks"],
                                stop=[*options["until"], "<|endoftext|>"])
        (out,) = llm.generate({"prompt_token_ids": encode(context)}, params, use_tqdm=False)
        assert text == out.outputs[0].text


def test_vllm_request_fields_and_stop_reason(server, client):
    def detokenize(tokens: list[int]) -> str:
        return httpx.post(f"{server}/detokenize", json={"tokens": tokens}).json()["prompt"]

    biased = client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                       temperature=0, logit_bias={"57": 1000},
                                       extra_body={"ignore_eos": True})
    assert biased.choices[0].text == detokenize([57] * 4)  # clamped to 100: still the argmax
    allowed = client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                        extra_body={"allowed_token_ids": [57, 58],
                                                    "ignore_eos": True, "seed": 3})
    assert set(allowed.choices[0].text) <= set(detokenize([57]) + detokenize([58]))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = httpx.post(f"{server}/v1/completions", headers=headers, json={
        "model": "tiny", "prompt": "Hello world again", "max_tokens": 3, "temperature": 0,
        "prompt_logprobs": 1, "truncate_prompt_tokens": 2, "repetition_penalty": 1.3,
        "stop_token_ids": [57], "logit_bias": {"57": 100}}).json()
    (choice,) = body["choices"]
    assert body["usage"]["prompt_tokens"] == 2
    first, second = choice["prompt_logprobs"]
    assert first is None and 1 <= len(second) <= 2
    assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in second.values())
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 57
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="Hi",
                                  extra_body={"bad_words": ["", "x"]})
    assert error.value.body["param"] == "bad_words"


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"prompt": "word " * 300}, None),  # longer than max_model_len 256
])
def test_bad_parameters_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(**{"model": "tiny", "prompt": "Hi", **kwargs})
    body = error.value.body
    assert set(body) >= {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param and param in body["message"]
    else:
        assert "max_model_len" in body["message"]


def test_auth_unknown_model_and_malformed_json(server, client):
    no_key = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    response = httpx.post(f"{server}/v1/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    wait_until_idle(server)


def test_a_bounded_load_with_cancellations(server):
    """200 requests, 32 at a time (twice the server's max_num_seqs), a fifth cancelled
    mid-stream: every other one completes, and afterwards nothing runs and every KV block is
    free."""
    async def one(client, i: int, cancel: bool) -> str | None:
        stream = await client.completions.create(model="tiny", prompt=f"Request {i}",
                                                 max_tokens=30, stream=True,
                                                 extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if cancel and text:
                await stream.close()
                return None
        return finish

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        gate = asyncio.Semaphore(32)
        rng = random.Random(0)
        cancels = [rng.random() < 0.2 for _ in range(200)]

        async def gated(i):
            async with gate:
                return await one(client, i, cancels[i])
        results = await asyncio.gather(*(gated(i) for i in range(200)))
        await client.close()
        return list(zip(cancels, results))

    results = asyncio.run(run())
    assert all(finish == "length" for cancelled, finish in results if not cancelled)
    assert sum(cancelled for cancelled, _ in results) >= 25
    wait_until_idle(server)


def test_a_token_without_text_still_gets_a_chunk():
    """As in vLLM, each step that brings tokens is streamed even when they decode to no text yet
    (ids the tokenizer does not know, a held-back partial character): clients time tokens by
    chunks, and logprobs travel with them."""
    from nanofn.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from nanofn.server.shapes import Shape
    from nanofn.state import SamplingParams

    shape = Shape("cmpl-1", 0, "m", chat=False, params=SamplingParams(logprobs=0), body={},
                   decode=str)
    sent: dict = {}

    def output(text: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
        logprobs = [{t: Logprob(-1.0, 1, str(t))} for t in tokens]
        completion = CompletionOutput(0, text, tokens, -1.0 * len(tokens), logprobs, finish)
        return RequestOutput("1", None, [1, 2], [completion], finish is not None)

    first = shape.delta_choices(0, output("a", [5]), sent)
    silent = shape.delta_choices(0, output("a", [5, 400]), sent)
    same = shape.delta_choices(0, output("a", [5, 400]), sent)
    last = shape.delta_choices(0, output("ab", [5, 400, 6], "length"), sent)
    assert [c["text"] for c in first + silent + last] == ["a", "", "b"]
    assert [c["logprobs"]["tokens"] for c in first + silent + last] == [["5"], ["400"], ["6"]]
    assert same == []
    assert last[0]["finish_reason"] == "length"
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                                  "score": {"type": "integer", "minimum": 0,
                                                            "maximum": 9}},
                 "required": ["answer", "score"], "additionalProperties": False}


def test_structured_output_through_response_format_and_vllm_fields(client):
    pytest.importorskip("llguidance")
    messages = [{"role": "user", "content": "Answer in JSON"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, n=2, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    for choice in chat.choices:
        value = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(value) == {"answer", "score"}
        assert value["answer"] in ("yes", "no") and value["score"] in range(10)
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=200,
                                              seed=2, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=30, seed=3,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    streamed = client.completions.create(model="tiny", prompt="Pick:", max_tokens=30, stream=True,
                                         extra_body={"guided_choice": ["left", "right"]})
    assert "".join(c.choices[0].text for c in streamed if c.choices) in ("left", "right")


@pytest.mark.parametrize("extra, param, words", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "unknown field"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex",
     "one output constraint"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
     "exactly one of json"),
])
def test_a_bad_output_constraint_is_400(server, client, extra, param, words):
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=5, extra_body=extra)
    assert error.value.body["param"] == param and words in error.value.body["message"]
    wait_until_idle(server)


def test_a_slow_consumer_skips_to_the_newest_output(tiny_qwen3):
    """AsyncLLM keeps only each request's newest output: a caller slower than the engine gets
    fewer outputs than steps, never a backlog, and its last output is the whole result (the
    same tokens and text as a caller that takes every step)."""
    from nanofn.server.async_engine import AsyncLLM
    from nanofn.state import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 42, 9]}
    llm = AsyncLLM(str(tiny_qwen3), max_model_len=256, num_kv_blocks=64)

    async def consume(pause: float) -> list:
        seen = []
        async for output in llm.generate(prompt, params):
            seen.append(output)
            await asyncio.sleep(pause)
        return seen

    try:
        fast = asyncio.run(consume(0.0))
        slow = asyncio.run(consume(0.05))
    finally:
        llm.close()
    assert len(fast[-1].outputs[0].token_ids) == 40
    assert len(slow) < len(fast)  # outputs were merged, not queued
    assert [len(o.outputs[0].token_ids) for o in slow] == sorted(
        {len(o.outputs[0].token_ids) for o in slow})  # each one newer than the last
    assert slow[-1].finished
    assert slow[-1].outputs[0].token_ids == fast[-1].outputs[0].token_ids
    assert slow[-1].outputs[0].text == fast[-1].outputs[0].text


# --- the engine's own process -------------------------------------------------------------------

LONG_STREAM = {"model": "tiny", "prompt": "Go on", "max_tokens": 240, "stream": True,
               "ignore_eos": True}
def is_gone(pid: int) -> bool:
    """No such process, or only its exit status is left (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_gone(pid: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not is_gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.1)


def test_a_bad_request_gets_its_400_while_another_streams_on(server):
    """The engine process refuses the prompt that leaves no room for max_tokens: the refusal
    reaches its caller only, and the stream goes on to the end."""
    with httpx.stream("POST", f"{server}/v1/completions", headers=HEADERS, timeout=30,
                      json={**LONG_STREAM, "stream_options": {"include_usage": True}}) as r:
        lines = r.iter_lines()
        first_event(lines)
        bad = httpx.post(f"{server}/v1/completions", headers=HEADERS,
                         json={"model": "tiny", "prompt": "word " * 40, "max_tokens": 250})
        assert bad.status_code == 400 and "max_model_len" in bad.json()["error"]["message"]
        events = [line[6:] for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 240
    wait_until_idle(server)


def test_async_llm_runs_the_engine_in_a_process_that_close_stops(tiny_qwen3):
    from nanofn.server.async_engine import AsyncLLM, EngineDead
    from nanofn.state import SamplingParams

    llm = AsyncLLM(str(tiny_qwen3), max_model_len=256, num_kv_blocks=64)
    pid = llm.engine_pid
    try:
        assert pid != os.getpid() and not is_gone(pid)
        assert llm.max_model_len == 256 and llm.tokenizer.decode(llm.tokenizer.encode("Hi")) == "Hi"
    finally:
        llm.close()
    assert is_gone(pid) and llm.failure is None

    async def after_close():
        async for _ in llm.generate("Hi", SamplingParams(max_tokens=2)):
            pass
    with pytest.raises(EngineDead, match="closed"):
        asyncio.run(after_close())


def test_async_llm_fails_requests_quickly_once_its_engine_process_is_killed(tiny_qwen3):
    from nanofn.server.async_engine import AsyncLLM, EngineDead
    from nanofn.state import SamplingParams

    llm = AsyncLLM(str(tiny_qwen3), max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def killed_in_flight() -> float:
        outputs = llm.generate("Go on", params)
        await anext(outputs)
        os.kill(llm.engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDead, match="exit code -9"):
            async for _ in outputs:
                pass
        return time.monotonic() - killed

    try:
        assert asyncio.run(asyncio.wait_for(killed_in_flight(), 10)) < 5
        assert llm.failure is not None
        with pytest.raises(EngineDead, match="exit code -9"):
            asyncio.run(anext(llm.generate("Later", params)))
    finally:
        llm.close()


@needs_proc
def test_a_dead_engine_process_makes_requests_fail_with_503(tiny_qwen3):
    """In flight, a stream ends with an error event and a whole response is a 503; later
    requests and /health are 503 at once; SIGTERM still stops the server cleanly."""
    process, url = start_server(tiny_qwen3)
    engine = engine_pid_of(process.pid)
    assert engine != process.pid
    whole: list = []
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG_STREAM, headers=HEADERS,
                      timeout=30) as r:
        lines = r.iter_lines()
        first_event(lines)
        os.kill(engine, signal.SIGSTOP)  # the stream is in flight, frozen
        waiting = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{url}/v1/completions", headers=HEADERS, timeout=30,
            json={**LONG_STREAM, "stream": False})))
        waiting.start()
        time.sleep(0.5)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        events = [line[6:] for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"  # after an error event
    assert "engine" in json.loads(events[-2])["error"]["message"]
    waiting.join(timeout=30)
    assert whole[0].status_code == 503
    assert time.monotonic() - killed < 5
    later = httpx.post(f"{url}/v1/completions", headers=HEADERS,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert later.status_code == 503 and "engine" in later.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 503
    process.terminate()
    assert process.wait(timeout=30) == 0


@needs_proc
def test_sigterm_stops_the_engine_process_with_the_server(tiny_qwen3):
    process, url = start_server(tiny_qwen3)
    engine = engine_pid_of(process.pid)
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG_STREAM, headers=HEADERS,
                      timeout=30) as r:
        first_event(r.iter_lines())
        process.terminate()
    assert process.wait(timeout=60) == 0, process.stdout.read()
    assert is_gone(engine)


@needs_proc
def test_the_engine_process_stops_when_the_server_dies(tiny_qwen3):
    process, _ = start_server(tiny_qwen3)
    engine = engine_pid_of(process.pid)
    process.kill()
    process.wait()
    wait_until_gone(engine)
