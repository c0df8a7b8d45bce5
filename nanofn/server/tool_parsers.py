"""Tool calls in a chat model's output: the formats of vLLM's ``--tool-call-parser``s (``hermes``,
``qwen3_xml`` / ``qwen3_coder``) and the JSON that ``tool_choice="required"`` or a named function
forces.

Every parser has one method, ``parse(text, final) -> (content, calls)``: the text that is not a
tool call, and the calls, each a ``ToolCallText`` whose ``arguments`` is the JSON text of the
call's arguments. A stream calls it on the whole text so far with ``final=False`` and sends what
grew since its last call: the content and each call's arguments only grow (text that may still
turn out to be a call is held back), and a call is listed once its name is whole. With
``final=True`` (the whole output) only complete, well-formed calls count; if one is malformed,
the whole text is content, as in vLLM.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")
_INTEGER = re.compile(r"-?[0-9]+")
_JSON = json.JSONDecoder()
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


@dataclass(frozen=True)
class ToolCallText:
    name: str
    arguments: str  # JSON text (of an object, once the call is complete)


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]: ...


# --- tool_choice="auto": the model's own format ------------------------------------------------

class HermesToolParser:
    """Qwen3's (and Hermes') calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
    </tool_call>``, one or more after the content. The arguments are their JSON text as the
    model wrote it."""

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]:
        return _parse_blocks(text, final, _hermes_call)


class Qwen3XMLToolParser:
    """Qwen3-Coder's and Qwen3.5's calls: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\n
    VALUE\\n</parameter>\\n...</function>\\n</tool_call>``. Each value becomes the JSON type that
    the tool's schema gives its parameter (a string otherwise); the arguments are the JSON
    object of the values, built as they close."""

    def __init__(self, tools: list[dict]):
        self.properties = {tool["function"]["name"]:
                           (tool["function"].get("parameters") or {}).get("properties") or {}
                           for tool in tools}

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]:
        return _parse_blocks(text, final, self._call)

    def _call(self, body: str, final: bool) -> ToolCallText | None:
        function = _FUNCTION.match(body)
        if function is None:
            return None
        name = function.group(1).strip()
        inner, closed, _ = body[function.end():].partition(_FUNCTION_END)
        if final and not closed:
            return None
        schemas = self.properties.get(name, {})
        members = [f"{json.dumps(key, ensure_ascii=False)}: "
                   f"{json.dumps(_typed(value, schemas.get(key)), ensure_ascii=False)}"
                   for key, value in ((k.strip(), _trim_newlines(v))
                                      for k, v in _PARAMETER.findall(inner))]
        return ToolCallText(name, "{" + ", ".join(members) + ("}" if closed else ""))


# vLLM's parser names -> the parser for a request's tools
TOOL_PARSERS: dict[str, Callable[[list[dict]], ToolParser]] = {
    "hermes": lambda tools: HermesToolParser(), "qwen3_xml": Qwen3XMLToolParser,
    "qwen3_coder": Qwen3XMLToolParser}


# --- forced calls ------------------------------------------------------------------------------

class NamedToolCall:
    """``tool_choice={"type": "function", "function": {"name": NAME}}``: the whole output is
    the arguments (the function's parameters schema constrains it)."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]:
        return "", [ToolCallText(self.name, text)]


class RequiredToolCalls:
    """``tool_choice="required"``: the output is a JSON array of ``{"name": ..., "parameters":
    {...}}`` objects (vLLM's shape, which ``required_calls_schema`` constrains it to); each is
    a call whose arguments are its parameters' JSON text."""

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]:
        if final and not _is_call_list(text):
            return text, []  # cut short (max_tokens): not calls
        start = _skip_space(text, 0)
        if not text.startswith("[", start):
            return "", []
        calls = []
        for item_start, item_end in _items(text, start):
            call = _named_member_call(text[:item_end or len(text)], item_start, "parameters")
            if call is None:
                break
            calls.append(call)
        return "", calls


def required_calls_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema that ``tool_choice="required"`` constrains the output to: one or more
    calls of the tools (one without ``parallel``), each ``{"name": NAME, "parameters":
    ARGUMENTS}`` (the tools' ``$defs`` gathered at the top, where their references point)."""
    defs: dict[str, Any] = {}
    shapes = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        defs.update(parameters.pop("$defs", {}))
        shapes.append({"type": "object",
                       "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                      "parameters": parameters},
                       "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": shapes}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# --- <tool_call> blocks ------------------------------------------------------------------------

def _parse_blocks(text: str, final: bool, read_call) -> tuple[str, list[ToolCallText]]:
    """Content, then ``<tool_call>`` blocks (the last may be unclosed), each read by
    ``read_call(body, final)`` (None: not a call, or not one yet)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return (text if final else text[:safe_end(text, TOOL_CALL_START)]), []
    calls = []
    for piece in text[start + len(TOOL_CALL_START):].split(TOOL_CALL_START):
        call = read_call(piece.partition(TOOL_CALL_END)[0], final)
        if call is None:
            if final:
                return text, []  # a malformed call: all of it is content, as in vLLM
            break
        calls.append(call)
    return text[:start], calls


def _hermes_call(body: str, final: bool) -> ToolCallText | None:
    if final:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments"), dict)):
            return None
    return _named_member_call(body, _skip_space(body, 0), "arguments")


def _named_member_call(text: str, start: int, arguments_key: str) -> ToolCallText | None:
    """The call of the JSON object at ``text[start]`` once its ``name`` is whole: its
    ``arguments_key`` member's text so far."""
    if not text.startswith("{", start):
        return None
    name, arguments = None, ""
    for key, value_start, value_end in _members(text, start):
        if key == "name" and value_end is not None:
            name = _loads(text[value_start:value_end])
        elif key == arguments_key:
            arguments = text[value_start:value_end]
    return ToolCallText(name, arguments) if isinstance(name, str) else None


def safe_end(text: str, marker: str) -> int:
    """Where the part of ``text`` that cannot be the start of ``marker`` ends: before a suffix
    that is a proper prefix of it (a stream holds that back until the next text decides)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def _is_call_list(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str)
        and isinstance(v.get("parameters"), dict) for v in value)


# --- Qwen3-XML values --------------------------------------------------------------------------

def _trim_newlines(value: str) -> str:
    """A parameter's value without the newline after its opening tag and before its closing one."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """A Qwen3-XML parameter value as the JSON type its schema says, as vLLM's parser reads it
    (``null`` is None whatever the type); a value that does not read as that type, or a
    parameter the schema does not know, stays a string."""
    text = value.strip()
    if text.lower() == "null":
        return None
    if not isinstance(schema, dict):
        return value
    kinds = schema.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "integer" in kinds and _INTEGER.fullmatch(text):
        return int(text)
    if "number" in kinds and (number := _number(text)) is not None:
        return number
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds & {"object", "array", None} and (read := _loads(text)) is not None:
        return read  # an object, an array, or a value of a type the schema leaves open
    return value


def _number(text: str) -> int | float | None:
    if _INTEGER.fullmatch(text):
        return int(text)
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _loads(text: str) -> Any:
    """The JSON value of ``text``, or None if it is not JSON (NaN and Infinity are not)."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError:
        return None


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


# --- JSON text as it streams -------------------------------------------------------------------

def _skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value that begins at ``text[start]`` ends, or None if the text ends first
    (a number at its end may go on) or it is not JSON (the caller reads no further)."""
    try:
        _, end = _JSON.raw_decode(text, start)
    except ValueError:
        return None
    return None if end == len(text) and text[start] not in '{["' else end


def _members(text: str, start: int) -> Iterator[tuple[str, int, int | None]]:
    """The members of the JSON object at ``text[start]`` so far: (key, where its value starts,
    where it ends or None if it is not whole yet)."""
    i = _skip_space(text, start + 1)
    while text.startswith('"', i):
        key_end = _value_end(text, i)
        if key_end is None:
            return
        colon = _skip_space(text, key_end)
        value_start = _skip_space(text, colon + 1)
        if not text.startswith(":", colon) or value_start >= len(text):
            return
        value_end = _value_end(text, value_start)
        yield _loads(text[i:key_end]), value_start, value_end
        if value_end is None:
            return
        i = _skip_space(text, value_end)
        if not text.startswith(",", i):
            return
        i = _skip_space(text, i + 1)


def _items(text: str, start: int) -> Iterator[tuple[int, int | None]]:
    """The items of the JSON array at ``text[start]`` so far: (start, end or None)."""
    i = _skip_space(text, start + 1)
    while i < len(text) and text[i] not in "],":
        end = _value_end(text, i)
        yield i, end
        if end is None:
            return
        i = _skip_space(text, end)
        if not text.startswith(",", i):
            return
        i = _skip_space(text, i + 1)
