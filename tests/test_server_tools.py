"""Tool calling and reasoning on ``nanofn serve``'s chat completions, through the real
``openai`` client: a server started with ``--chat-template FILE --reasoning-parser qwen3
--enable-auto-tool-choice --tool-call-parser hermes``, another with ``qwen3_coder``, an inline
template and ``--default-chat-template-kwargs``. The model has random weights: ``required`` and
named calls hold because a constraint forces them; ``auto`` reads a scripted output (a
``structured_outputs`` choice of one text, sent with the tools)."""

from __future__ import annotations

import json

import httpx
import pytest

from nanofn.model.tiny import CHAT_TEMPLATE
from server_helpers import API_KEY, serving, start_server, wait_until_idle

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # no endless random spaces
FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "192", "--max-num-seqs", "8")
HERMES_SCRIPT = ('<think>The user asks about Paris.</think>\n\nLet me look.\n<tool_call>\n'
                 '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
XML_SCRIPT = ("I will check.\n<tool_call>\n<function=forecast>\n<parameter=city>\nParis\n"
              "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nfalse\n"
              "</parameter>\n</function>\n</tool_call>")
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"}}}}}


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{{- 'Custom template.\\n' }}" + CHAT_TEMPLATE)
    with serving(tiny_qwen3, *FLAGS, "--chat-template", str(template), "--reasoning-parser",
                 "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def detokenized(url: str, body: dict) -> str:
    tokens = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]


def whole(client, **kwargs) -> dict:
    choice = client.chat.completions.create(model="tiny", messages=ASK, **kwargs).choices[0]
    message = choice.message
    calls = message.tool_calls or []
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    assert getattr(message, "reasoning", None) == getattr(message, "reasoning_content", None)
    return {"reasoning": getattr(message, "reasoning_content", None), "content": message.content,
            "calls": [(c.function.name, c.function.arguments) for c in calls],
            "finish_reason": choice.finish_reason}


def streamed(client, in_order: bool = True, **kwargs) -> dict:
    """The streamed chunks' deltas added up, checking OpenAI's shapes on the way (a call's
    first delta has its id, type and name) and, ``in_order``, reasoning, then content, then
    calls."""
    reasoning, content, calls, finish, parts = "", "", [], None, []
    for chunk in client.chat.completions.create(model="tiny", messages=ASK, stream=True,
                                                **kwargs):
        delta = chunk.choices[0].delta
        assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        parts += [kind for kind, text in (("reasoning", getattr(delta, "reasoning", None)),
                                          ("content", delta.content)) if text]
        for call in delta.tool_calls or []:
            parts.append("calls")
            if call.index == len(calls):
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                calls.append([call.function.name, ""])
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert not in_order or parts == sorted(parts, key=["reasoning", "content", "calls"].index)
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(c) for c in calls], "finish_reason": finish}


def test_the_chat_template_flag_and_tools_reach_the_template(server, client):
    assert detokenized(server, {"messages": ASK}).startswith("Custom template.\n<|im_start|>user")
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    text = detokenized(server, {"messages": conversation, "tools": TOOLS})
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    count = httpx.post(f"{server}/tokenize", json={"messages": conversation,
                                                   "tools": TOOLS}).json()["count"]
    out = client.chat.completions.create(model="tiny", messages=conversation, tools=TOOLS,
                                         tool_choice="none", max_tokens=1)
    assert out.usage.prompt_tokens == count


def test_required_tool_calls(client):
    kwargs = dict(tools=TOOLS, tool_choice="required", max_tokens=300, seed=4, extra_body=COMPACT)
    message = whole(client, **kwargs)
    assert message["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["reasoning"] is None  # constrained from the first token: no thinking block
    assert message["calls"]
    for name, arguments in message["calls"]:
        assert name in ("get_weather", "get_time")
        assert json.loads(arguments) in ([{"city": "Paris"}, {"city": "Lyon"}]
                                         if name == "get_weather" else [{}])
    assert streamed(client, **kwargs) == message


def test_a_named_tool_call(client):
    kwargs = dict(tools=TOOLS, max_tokens=300, seed=5, extra_body=COMPACT,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = whole(client, **kwargs)
    assert message["finish_reason"] == "stop"  # as OpenAI's for a named function
    assert message["content"] is None and len(message["calls"]) == 1
    name, arguments = message["calls"][0]
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Lyon")
    assert streamed(client, **kwargs) == message


def test_auto_tool_calls_after_reasoning_on_a_scripted_output(client):
    kwargs = dict(tools=TOOLS, max_tokens=300, extra_body={"guided_choice": [HERMES_SCRIPT]})
    message = whole(client, **kwargs)  # tool_choice "auto": the default with tools
    assert message == {"reasoning": "The user asks about Paris.", "content": "\n\nLet me look.\n",
                       "calls": [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
                       "finish_reason": "tool_calls"}
    assert streamed(client, **kwargs) == message
    single = whole(client, parallel_tool_calls=False, **kwargs)
    assert single["calls"] == message["calls"][:1]


def test_a_malformed_call_stays_content(client):
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    kwargs = dict(tools=TOOLS, max_tokens=300, extra_body={"guided_choice": [script]})
    message = whole(client, **kwargs)
    assert message == {"reasoning": None, "content": script, "calls": [], "finish_reason": "stop"}
    # the stream may have named the call before its JSON went wrong, as vLLM's would
    assert streamed(client, in_order=False, **kwargs)["content"] == script


def test_reasoning_of_an_unconstrained_output(server, client):
    """Thinking (the default): the output starts inside the thinking block, and without
    ``</think>`` all of it is reasoning, as in vLLM. Without thinking (the template closes the
    block in the prompt), all of it is content. Either way the text is the model's own, as a
    completion of the same prompt tokens and seed shows."""
    for template_kwargs, field in (({}, "reasoning"), ({"enable_thinking": False}, "content")):
        prompt = httpx.post(f"{server}/tokenize", json={
            "messages": ASK, "chat_template_kwargs": template_kwargs}).json()["tokens"]
        sampling = dict(max_tokens=24, temperature=1.0, seed=9)
        text = client.completions.create(model="tiny", prompt=prompt, **sampling).choices[0].text
        kwargs = dict(extra_body={"chat_template_kwargs": template_kwargs}, **sampling)
        message = whole(client, **kwargs)
        assert message[field] == text and message["finish_reason"] == "length"
        assert message["content" if field == "reasoning" else "reasoning"] is None
        assert streamed(client, **kwargs) == message


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": {"get_weather": {}}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "one output constraint"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": "{"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not JSON"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param, words):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 5, **extra}
    response = httpx.post(f"{server}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"]
    assert error["type"] == "BadRequestError"
    wait_until_idle(server)


def test_qwen3_coder_calls_with_an_inline_template_and_default_kwargs(tiny_qwen3):
    process, url = start_server(tiny_qwen3, *FLAGS, "--chat-template", CHAT_TEMPLATE,
                                "--default-chat-template-kwargs", '{"enable_thinking": false}',
                                "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")
    try:
        assert detokenized(url, {"messages": ASK}).endswith("<think>\n\n</think>\n\n")
        assert detokenized(url, {"messages": ASK, "chat_template_kwargs": {
            "enable_thinking": True}}).endswith("<|im_start|>assistant\n")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        kwargs = dict(tools=[FORECAST], tool_choice="auto", max_tokens=300,
                      extra_body={"structured_outputs": {"choice": [XML_SCRIPT]}})
        message = whole(client, **kwargs)
        assert message == {"reasoning": None, "content": "I will check.\n",
                           "calls": [("forecast", '{"city": "Paris", "days": 3, "hourly": false}')],
                           "finish_reason": "tool_calls"}
        assert streamed(client, **kwargs) == message
    finally:
        process.terminate()
    assert process.wait(timeout=60) == 0, process.stdout.read()
