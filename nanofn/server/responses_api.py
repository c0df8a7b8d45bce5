"""OpenAI's Responses API (``POST /v1/responses``) for text, as vLLM serves it: ``input`` (a
string or a list of messages), ``instructions``, ``max_output_tokens``, ``temperature`` and
``top_p``; a whole response, or server-sent events of the Responses API's types."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from nanofn.engine.outputs import RequestOutput
from nanofn.server.requests import APIError, sampling_params
from nanofn.state import SamplingParams

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}  # chat templates know no "developer"


def chat_body(body: dict) -> dict:
    """The chat request a Responses request amounts to: its ``input`` as messages, after
    ``instructions`` as a system message."""
    for field, why in (("previous_response_id", "this server stores no responses"),
                       ("tools", "only text is supported")):
        if body.get(field):
            raise APIError(400, f"{field} is not supported: {why}", param=field)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "instructions must be a string", param="instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        messages += [_message(i, item) for i, item in enumerate(given)]
    else:
        raise APIError(400, "input must be a string or a non-empty list of messages",
                       param="input")
    return {"messages": messages}


def _message(index: int, item: Any) -> dict:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise APIError(400, f"input[{index}] must be a message; only text is supported, got "
                            f"{kind!r}", param="input")
    role = ROLES.get(item.get("role"))
    if role is None:
        raise APIError(400, f"input[{index}].role must be one of {', '.join(ROLES)}, got "
                            f"{item.get('role')!r}", param="input")
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                   and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"input[{index}].content: only text parts ({', '.join(TEXT_PARTS)})"
                                f" are supported", param="input")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise APIError(400, f"input[{index}].content must be a string or a list of text parts",
                       param="input")
    return {"role": role, "content": content}


def responses_params(body: dict, defaults: dict[str, Any] | None) -> SamplingParams:
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (type(max_output_tokens) is not int
                                          or max_output_tokens < 1):
        raise APIError(400, f"max_output_tokens must be an integer >= 1, got "
                            f"{max_output_tokens!r}", param="max_output_tokens")
    fields = {"max_completion_tokens": max_output_tokens, "temperature": body.get("temperature"),
              "top_p": body.get("top_p")}
    return sampling_params(fields, chat=True, defaults=defaults)


class ResponseShape:
    """The Responses API's shapes for one call: the response object, its message, the events."""

    def __init__(self, created_at: int, model: str, body: dict, params: SamplingParams):
        self.id = f"resp_{secrets.token_hex(12)}"
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.created_at, self.model, self.body, self.params = created_at, model, body, params
        self.sequence_number = 0

    def whole(self, final: RequestOutput) -> dict:
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        return {**self.response(status, [self.message(status, completion.text)],
                                usage(final)),
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None}

    def response(self, status: str, output: list, usage: dict | None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "model": self.model, "status": status, "error": None,
                "incomplete_details": None, "instructions": self.body.get("instructions"),
                "max_output_tokens": self.body.get("max_output_tokens"),
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                "output": output, "parallel_tool_calls": False, "tool_choice": "none",
                "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "previous_response_id": None, "store": False, "metadata": {},
                "usage": usage}

    def message(self, status: str, text: str | None) -> dict:
        """The output message; ``text`` None: its content is still to come."""
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [] if text is None else [text_part(text)]}

    def event(self, kind: str, **fields: Any) -> str:
        """A server-sent event of the Responses API: its type named twice, as OpenAI sends it."""
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def error_event(self, error: APIError) -> str:
        return self.event("error", code=error.code or error.type, message=error.message,
                          param=error.param)


async def response_events(shape: ResponseShape, first: RequestOutput,
                          outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    """A response's events, from created to completed, its text in deltas as it comes."""
    at = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    yield shape.event("response.created", response=shape.response("in_progress", [], None))
    yield shape.event("response.in_progress", response=shape.response("in_progress", [], None))
    yield shape.event("response.output_item.added", output_index=0,
                      item=shape.message("in_progress", None))
    yield shape.event("response.content_part.added", part=text_part(""), **at)
    final, sent = first, 0
    while True:
        text = final.outputs[0].text
        if len(text) > sent:
            yield shape.event("response.output_text.delta", delta=text[sent:], logprobs=[], **at)
            sent = len(text)
        if final.finished:
            break
        final = await anext(outputs)
    whole = shape.whole(final)
    yield shape.event("response.output_text.done", text=final.outputs[0].text, logprobs=[], **at)
    yield shape.event("response.content_part.done", part=text_part(final.outputs[0].text), **at)
    yield shape.event("response.output_item.done", output_index=0, item=whole["output"][0])
    yield shape.event("response.completed", response=whole)


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(final: RequestOutput) -> dict:
    prompt = len(final.prompt_token_ids)
    output = len(final.outputs[0].token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens":
                                                             final.num_cached_tokens or 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}
