"""Chat completions beyond sampling: the server's chat settings (``ChatOptions``, from
``nanofn serve``'s flags), and how a generated text becomes OpenAI's assistant message, whole
or streamed as deltas (``ChatOutput``): reasoning split off by the reasoning parser, tool calls
read by the request's tool parser."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanofn.server.reasoning import REASONING_PARSERS, THINK_END, Qwen3ReasoningParser
from nanofn.server.tool_parsers import TOOL_PARSERS, ToolCallText
from nanofn.server.tools import ToolChoice
from nanofn.state import SamplingParams

JINJA_CHARACTERS = "{}\n"


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat settings, under vLLM's flag names: a chat template instead of the
    tokenizer's, template arguments under each request's ``chat_template_kwargs``, and the
    parsers of reasoning and of tool calls (``tool_choice="auto"`` needs
    ``enable_auto_tool_choice``)."""

    chat_template: str | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r} (known: "
                             f"{', '.join(REASONING_PARSERS)})")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} (known: "
                             f"{', '.join(TOOL_PARSERS)})")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @property
    def auto_tool_parser(self) -> str | None:
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def template_kwargs(self, body: dict) -> dict[str, Any]:
        """The request's ``chat_template_kwargs`` over the server's defaults."""
        return {**self.default_chat_template_kwargs, **(body.get("chat_template_kwargs") or {})}


def load_chat_template(value: str) -> str:
    """``--chat-template``: the text of the file it names, or the template itself (escapes such
    as ``\\n`` read as in Python, as vLLM does). A value that names no readable file and has
    none of Jinja's characters is an error: a mistyped path."""
    try:
        return Path(value).read_text()
    except (OSError, ValueError) as error:
        if not any(c in value for c in JINJA_CHARACTERS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot "
                             f"be read: {error}") from None
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


@dataclass
class _Streamed:
    """What a streamed choice has sent: lengths of its reasoning and content, its calls' ids
    and the lengths of their arguments."""

    reasoning: int = 0
    content: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments: list[int] = field(default_factory=list)


class ChatOutput:
    """How one chat request's outputs become assistant messages (``message``) or stream deltas
    (``delta``, one per output of a choice, keeping what each choice has sent)."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None = None,
                 tools: ToolChoice | None = None):
        self.reasoning = reasoning
        self.tools = tools or ToolChoice()
        self._streamed: dict[int, _Streamed] = {}

    @classmethod
    def for_request(cls, body: dict, prompt_text: str, params: SamplingParams,
                    options: ChatOptions, tools: ToolChoice) -> ChatOutput:
        """The ``ChatOutput`` of a chat request. Its output starts inside a thinking block
        unless thinking is off (``enable_thinking=False``, or a prompt that ends by closing
        the block) or a constraint writes it from the first token."""
        reasoning = None
        if options.reasoning_parser is not None:
            thinking = options.template_kwargs(body).get("enable_thinking") is not False
            thinks_first = (thinking and params.structured_outputs is None
                            and not prompt_text.rstrip().endswith(THINK_END))
            reasoning = REASONING_PARSERS[options.reasoning_parser](thinks_first)
        return cls(reasoning, tools)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A choice's whole message and its finish reason."""
        reasoning, content, calls = self._parse(text, final=True)
        if calls or self.reasoning:  # what is left may be nothing: null, as OpenAI's
            content = content or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if calls:
            message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
        return message, self._finish_reason(finish_reason, bool(calls))

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta of choice ``index`` now that its text is ``text`` (all of it when
        ``finish_reason`` is set), and its finish reason."""
        sent = self._streamed.setdefault(index, _Streamed())
        reasoning, content, calls = self._parse(text, final=finish_reason is not None)
        delta: dict[str, Any] = {}
        if len(reasoning) > sent.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning[sent.reasoning:]
            sent.reasoning = len(reasoning)
        if len(content) > sent.content:
            delta["content"] = content[sent.content:]
            sent.content = len(content)
        call_deltas = [d for i, call in enumerate(calls) if (d := self._call_delta(sent, i, call))]
        if call_deltas:
            delta["tool_calls"] = call_deltas
        return delta or {"content": ""}, self._finish_reason(finish_reason, bool(sent.call_ids))

    def _parse(self, text: str, final: bool) -> tuple[str, str, list[ToolCallText]]:
        reasoning, content = self.reasoning.split(text, final) if self.reasoning else ("", text)
        calls: list[ToolCallText] = []
        if self.tools.parser is not None:
            content, calls = self.tools.parser.parse(content, final)
        return reasoning, content, calls if self.tools.parallel else calls[:1]

    @staticmethod
    def _call_delta(sent: _Streamed, index: int, call: ToolCallText) -> dict | None:
        """A call's first delta (its id, type, name and arguments so far), then its arguments'
        new text, if any."""
        if index == len(sent.call_ids):
            sent.call_ids.append(_call_id())
            sent.arguments.append(len(call.arguments))
            return {"index": index, "id": sent.call_ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
        new = call.arguments[sent.arguments[index]:]
        sent.arguments[index] = max(sent.arguments[index], len(call.arguments))
        return {"index": index, "function": {"arguments": new}} if new else None

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's (and OpenAI's): "tool_calls" when calls end the output, except a named
        function's ("stop")."""
        return "tool_calls" if called and reason == "stop" and not self.tools.named else reason


def _call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"
