"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, read as vLLM reads
them: which parser finds the calls in the output, and the output constraint that forces them
(``required`` or a named function, through the structured-output machinery)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanofn.server.requests import APIError
from nanofn.server.tool_parsers import (TOOL_PARSERS, NamedToolCall, RequiredToolCalls,
                                        ToolParser, required_calls_schema)

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    parser: ToolParser | None = None  # None: the output is not read for calls
    constraint: dict | None = None  # structured_outputs fields that force the calls
    named: bool = False  # a named function (its finish_reason stays "stop", as OpenAI's)
    parallel: bool = True  # False: only the first call is returned


def request_tools(body: dict) -> list[dict] | None:
    """The request's ``tools``, checked: each ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}``."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of functions", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": '
                                f'{{"name": ...}}}}', param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string",
                           param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        if not isinstance(function.get("description", ""), str):
            raise APIError(400, f"tools[{i}].function.description must be a string",
                           param="tools")
    return tools


def tool_choice(body: dict, tools: list[dict] | None, auto_parser: str | None) -> ToolChoice:
    """What the request's ``tool_choice`` asks for (``auto`` when it has tools and names none,
    as vLLM). ``auto_parser``: the server's ``--tool-call-parser`` if it enables automatic tool
    choice (``auto`` needs it)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice(parallel=parallel)
    if tools is None:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                "--tool-call-parser to be set", param="tool_choice")
        return ToolChoice(TOOL_PARSERS[auto_parser](tools), parallel=parallel)
    if choice == "required":
        if not tools:  # nothing to call: as "none", as OpenAI
            return ToolChoice(parallel=parallel)
        return ToolChoice(RequiredToolCalls(),
                          {"json": required_calls_schema(tools, parallel)}, parallel=parallel)
    name = _named_function(choice)
    for tool in tools:
        if tool["function"]["name"] == name:
            schema = tool["function"].get("parameters") or NO_PARAMETERS
            return ToolChoice(NamedToolCall(name), {"json": schema}, named=True,
                              parallel=parallel)
    raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                   param="tool_choice")


def _named_function(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                            f'"function", "function": {{"name": ...}}}}, got {choice!r}',
                       param="tool_choice")
    return name
