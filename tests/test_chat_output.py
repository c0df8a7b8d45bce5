"""Chat outputs as assistant messages, without a server: the tool-call parsers (hermes, Qwen3
XML, the forced ``required`` and named calls) and Qwen3's reasoning parser on whole texts, and
the same texts streamed a character (or a few) at a time, whose deltas must add up to the whole
message; ``tool_choice``'s reading; the demo template's tool turns; ``--chat-template``."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from nanofn.server.chat_output import ChatOptions, ChatOutput, load_chat_template
from nanofn.server.reasoning import Qwen3ReasoningParser
from nanofn.server.requests import APIError
from nanofn.server.tool_parsers import (HermesToolParser, NamedToolCall, Qwen3XMLToolParser,
                                        RequiredToolCalls)
from nanofn.server.tools import ToolChoice, request_tools, tool_choice

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}, "ratio": {"type": "number"},
        "code": {"type": "string"}, "note": {"type": ["string", "null"]}, "when": {},
        "count": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]

HERMES_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Pa\\"ris}", "hours": [1, {"x": [2]}]}}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {}}\n</tool_call>')
XML_CALLS = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
             "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
             "<parameter=code>\n007\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
             "<parameter=extra>\n12\n</parameter>\n<parameter=when>\nNaN\n</parameter>\n"
             "<parameter=count>\n2.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
             "<function=get_time>\n</function>\n</tool_call>")
XML_ARGUMENTS = {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2], "ratio": 0.5,
                 "code": "007", "note": None, "extra": "12", "when": "NaN", "count": "2.5"}


def hermes(reasoning: Qwen3ReasoningParser | None = None) -> ChatOutput:
    return ChatOutput(reasoning, ToolChoice(HermesToolParser()))


def xml(reasoning: Qwen3ReasoningParser | None = None) -> ChatOutput:
    return ChatOutput(reasoning, ToolChoice(Qwen3XMLToolParser(TOOLS)))


def streamed(output: ChatOutput, text: str, step: int = 1, reason: str = "stop") -> dict:
    """The message that ``output``'s deltas add up to when ``text`` streams ``step``
    characters at a time (the last delta carries the finish reason)."""
    message: dict = {"reasoning": "", "content": "", "tool_calls": []}
    ends = list(range(0, len(text), step)) + [len(text)]
    for end in ends:
        finish = reason if end == ends[-1] else None
        delta, message["finish_reason"] = output.delta(0, text[:end], finish)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        message["reasoning"] += delta.get("reasoning", "")
        message["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if call["index"] == len(calls):  # a call's first delta names it
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": ""})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return message


def whole(output: ChatOutput, text: str, reason: str = "stop") -> dict:
    message, finish = output.message(text, reason)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in message.get("tool_calls", []))
    return {"reasoning": message.get("reasoning") or "", "content": message["content"] or "",
            "tool_calls": calls, "finish_reason": finish}


def both(make: Callable[[], ChatOutput], text: str, reason: str = "stop") -> dict:
    """The whole message of ``text``, checked against the same text streamed a character at a
    time and 7 at a time (coalesced outputs)."""
    message = whole(make(), text, reason)
    assert streamed(make(), text, 1, reason) == message
    assert streamed(make(), text, 7, reason) == message
    return message


def test_hermes_calls_after_content():
    message = both(hermes, HERMES_CALLS)
    assert message["content"] == "Let me check.\n" and message["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": 'Pa"ris}', "hours": [1, {"x": [2]}]}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    "Plain text, a < b and <tool",
])
def test_hermes_falls_back_to_content(text):
    assert whole(hermes(), text, "length") == {"reasoning": "", "content": text,
                                               "tool_calls": [], "finish_reason": "length"}
    # a stream gets the text too (it may have named a call by then, as vLLM's would)
    assert streamed(hermes(), text, 1, "length")["content"] == text


def test_hermes_takes_an_unclosed_last_call_with_whole_json():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
    assert both(hermes, text)["tool_calls"] == [{"name": "get_time",
                                                 "arguments": '{"zone": "UTC"}'}]


def test_qwen3_xml_values_take_their_schema_types():
    message = both(xml, XML_CALLS)
    assert message["content"] == "Sure.\n" and message["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", XML_ARGUMENTS), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "<tool_call>\n<get_weather>\n</tool_call>",
])
def test_qwen3_xml_without_a_whole_function_is_content(text):
    assert whole(xml(), text)["content"] == text and whole(xml(), text)["tool_calls"] == []


def test_forced_calls():
    named = ChatOutput(tools=ToolChoice(NamedToolCall("get_weather"), named=True))
    message = both(lambda: ChatOutput(tools=named.tools), '{"city": "Paris"}')
    assert message == {"reasoning": "", "content": "", "finish_reason": "stop",  # as OpenAI
                       "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]}
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", ' \
               '"parameters": {}}]'
    message = both(lambda: ChatOutput(tools=ToolChoice(RequiredToolCalls())), required)
    assert message["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                     {"name": "get_time", "arguments": "{}"}]
    assert message["finish_reason"] == "tool_calls" and message["content"] == ""
    cut = required[:30]  # max_tokens ran out: no call is whole
    assert whole(ChatOutput(tools=ToolChoice(RequiredToolCalls())), cut, "length") == {
        "reasoning": "", "content": cut, "tool_calls": [], "finish_reason": "length"}
    first = both(lambda: ChatOutput(tools=ToolChoice(RequiredToolCalls(), parallel=False)),
                 required)
    assert [c["name"] for c in first["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("text", ["<think>\nThe user wants Paris.\n</think>\n\nIt is sunny.",
                                  "\nThe user wants Paris.\n</think>\n\nIt is sunny."])
def test_reasoning_with_or_without_the_opening_tag(text):
    message = both(lambda: ChatOutput(Qwen3ReasoningParser(thinks_first=True)), text)
    assert message == {"reasoning": "\nThe user wants Paris.\n", "content": "\n\nIt is sunny.",
                       "tool_calls": [], "finish_reason": "stop"}
    explicit = both(lambda: ChatOutput(Qwen3ReasoningParser(thinks_first=False)), text)
    assert explicit == message if text.startswith("<think>") else explicit["content"] == text


def test_reasoning_without_its_end():
    """As vLLM's qwen3 parser: an output cut short while thinking is all reasoning; one that
    does not start inside a thinking block is all content."""
    text = "Hmm, </thi the user < wants"
    thinking = both(lambda: ChatOutput(Qwen3ReasoningParser(thinks_first=True)), text, "length")
    assert thinking == {"reasoning": text, "content": "", "tool_calls": [],
                        "finish_reason": "length"}
    plain = both(lambda: ChatOutput(Qwen3ReasoningParser(thinks_first=False)), text, "length")
    assert plain["content"] == text and plain["reasoning"] == ""
    message, _ = ChatOutput(Qwen3ReasoningParser(True)).message(text, "length")
    assert message["content"] is None and message["reasoning_content"] == text


def test_tool_calls_are_read_after_the_reasoning():
    text = "<think>I need the weather.</think>\n\n" + HERMES_CALLS
    message = both(lambda: hermes(Qwen3ReasoningParser(thinks_first=False)), text)
    assert message["reasoning"] == "I need the weather."
    assert message["content"] == "\n\nLet me check.\n" and len(message["tool_calls"]) == 2
    inside = "<think>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"
    assert both(lambda: hermes(Qwen3ReasoningParser(True)), inside)["tool_calls"] == []


def test_a_qwen35_call_inside_the_thinking_block_ends_the_reasoning():
    text = ("Weather, so <tool_call> is the way.\n<tool_call>\n<function=get_time>\n"
            "</function>\n</tool_call>")
    message = both(lambda: xml(Qwen3ReasoningParser(thinks_first=True)), text)
    assert message["reasoning"] == "Weather, so <tool_call> is the way.\n"
    assert message["tool_calls"] == [{"name": "get_time", "arguments": "{}"}]


def test_messages_without_parsers_are_as_before():
    message, finish = ChatOutput().message("", "length")
    assert message == {"role": "assistant", "content": ""} and finish == "length"
    assert ChatOutput().delta(0, "abc", None) == ({"content": "abc"}, None)


def test_tool_choice():
    assert tool_choice({}, None, None) == ToolChoice()
    assert tool_choice({"tool_choice": "required"}, [], None) == ToolChoice()  # as OpenAI
    auto = tool_choice({}, TOOLS, "qwen3_xml")
    assert isinstance(auto.parser, Qwen3XMLToolParser) and auto.constraint is None
    named = tool_choice({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
                         "parallel_tool_calls": False}, TOOLS, None)
    assert named.named and not named.parallel
    assert named.constraint == {"json": {"type": "object", "properties": {}}}
    required = tool_choice({"tool_choice": "required"}, TOOLS, None).constraint["json"]
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [s["properties"]["name"] for s in required["items"]["anyOf"]] == [
        {"type": "string", "enum": ["get_weather"]}, {"type": "string", "enum": ["get_time"]}]
    single = tool_choice({"tool_choice": "required", "parallel_tool_calls": False}, TOOLS, None)
    assert single.constraint["json"]["maxItems"] == 1


def test_required_gathers_the_tools_definitions():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}}}}}
    schema = tool_choice({"tool_choice": "required"}, [tool], None).constraint["json"]
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in tool["function"]["parameters"]  # the request's own tools stay as given


@pytest.mark.parametrize("body, tools, words", [
    ({}, TOOLS, "--enable-auto-tool-choice and --tool-call-parser"),
    ({"tool_choice": "auto"}, None, "needs tools"),
    ({"tool_choice": "sometimes"}, TOOLS, "tool_choice must be"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, TOOLS, "'nope'"),
    ({"tool_choice": {"type": "function"}}, TOOLS, "tool_choice must be"),
    ({"tool_choice": "none", "parallel_tool_calls": "no"}, TOOLS, "parallel_tool_calls"),
])
def test_bad_tool_choices(body, tools, words):
    with pytest.raises(APIError) as error:
        tool_choice(body, tools, None)
    assert error.value.status == 400 and words in error.value.message


@pytest.mark.parametrize("tools, words", [
    ({"get_weather": {}}, "tools must be a list"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[1].function.parameters"),
    ([{"type": "code_interpreter"}], "tools[0] must be"),
])
def test_bad_tools(tools, words):
    with pytest.raises(APIError) as error:
        request_tools({"tools": tools})
    assert error.value.param == "tools" and words in error.value.message


def test_the_demo_template_renders_tools_calls_and_results():
    from nanofn.model.tiny import _make_tokenizer

    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    text = _make_tokenizer().apply_chat_template(messages, tools=[TIME], tokenize=False,
                                                 add_generation_prompt=True)
    assert text == (
        '<|im_start|>system\n# Tools\n\n<tools>\n{"type": "function", "function": {"name": '
        '"get_time"}}\n</tools>\n\nCall a function with <tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}\n")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}\n"
    assert load_chat_template("{{ 'a' }}\\n{{ 'é' }}") == "{{ 'a' }}\n{{ 'é' }}"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_chat_options_check_their_parsers():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ChatOptions(tool_call_parser="mistral")
    assert ChatOptions(tool_call_parser="hermes").auto_tool_parser is None
    options = ChatOptions(default_chat_template_kwargs={"enable_thinking": False, "a": 1})
    assert options.template_kwargs({"chat_template_kwargs": {"enable_thinking": True}}) == {
        "enable_thinking": True, "a": 1}


def test_a_stream_sends_reasoning_content_names_and_arguments_as_they_come():
    output = hermes(Qwen3ReasoningParser(thinks_first=True))
    text = "Thinking</think>" + HERMES_CALLS
    upto = text.index("ris}")
    deltas = [output.delta(0, text[:end], None)[0] for end in range(upto + 1)]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Thinking"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check.\n"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and len(calls) > 5
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Pa\\"'
    output = xml()
    upto = XML_CALLS.index("<parameter=metric>")
    deltas = [output.delta(0, XML_CALLS[:end], None)[0] for end in range(upto + 1)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris", "days": 3'


@pytest.mark.parametrize("body, prompt, constrained, thinks_first", [
    ({}, "<|im_start|>assistant\n", False, True),
    ({}, "<|im_start|>assistant\n<think>\n", False, True),
    ({}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),  # the template's off
    ({"chat_template_kwargs": {"enable_thinking": False}}, "assistant\n", False, False),
    ({}, "<|im_start|>assistant\n", True, False),  # a grammar writes the output from its start
])
def test_where_a_request_output_starts(body, prompt, constrained, thinks_first):
    from nanofn.state import SamplingParams

    params = SamplingParams(structured_outputs={"regex": "a"} if constrained else None)
    output = ChatOutput.for_request(body, prompt, params, ChatOptions(reasoning_parser="qwen3"),
                                    ToolChoice())
    assert output.reasoning.thinks_first is thinks_first
    plain = ChatOutput.for_request(body, prompt, params, ChatOptions(), ToolChoice())
    assert plain.reasoning is None
