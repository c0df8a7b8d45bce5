"""Reading OpenAI request bodies: prompts, chat messages and sampling parameters, with errors
that name the field (``APIError``, OpenAI's JSON shape)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from nanofn.engine.chat import render_chat
from nanofn.state import SamplingParams
from nanofn.state.params import STRUCTURED_KINDS

if TYPE_CHECKING:
    from nanofn.server.chat_output import ChatOptions

# Body fields that map to SamplingParams fields of the same name (vLLM's extras included).
SAME_NAME = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
             "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
             "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs",
             "spaces_between_special_tokens")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias, [-100, 100]: larger ones are clamped


class APIError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message,
                                                                       error_type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def completion_prompts(body: dict) -> list:
    """The prompts of a completion request: a string, a list of strings, a list of token ids
    or a list of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a "
                        "list of such lists (not empty)", param="prompt")


def chat_prompt(tokenizer: Any, body: dict, options: ChatOptions,
                tools: list[dict] | None = None) -> dict:
    """The prompt of a chat request through the chat template (``options.chat_template``, else
    the tokenizer's), with the request's ``tools`` (checked by ``tools.request_tools``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    conversation = [_template_message(message, i) for i, message in enumerate(messages)]
    if not isinstance(body.get("chat_template_kwargs") or {}, dict):
        raise APIError(400, "chat_template_kwargs must be an object",
                       param="chat_template_kwargs")
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the model's tokenizer has no chat template", param="messages")
    try:
        return render_chat(tokenizer, conversation,
                           add_generation_prompt=body.get("add_generation_prompt", True),
                           chat_template=options.chat_template, tools=tools,
                           **options.template_kwargs(body))
    except Exception as error:  # the template's own errors (a role it does not know...)
        raise APIError(400, f"the chat template failed: {error}", param="messages") from None


def _template_message(message: Any, i: int) -> dict:
    """A message as chat templates take it: text parts joined, ``content: null`` as "", and an
    assistant's ``tool_calls`` with their JSON ``arguments`` read into objects (Qwen's templates
    iterate them), as vLLM passes them."""
    if not isinstance(message, dict) or "role" not in message:
        raise APIError(400, f"messages[{i}] must be an object with a role", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # text parts
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported",
                           param="messages")
        content = "".join(p.get("text", "") for p in content)
    elif content is not None and not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text "
                            f"parts", param="messages")
    templated = {**message, "content": content or ""}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise APIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        templated["tool_calls"] = [_template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(calls)]
    return templated


def _template_tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{"name": ..., '
                            f'"arguments": ...}}}}', param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise APIError(400, f"{where}.function.arguments is not JSON: {error}",
                           param="messages") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object",
                       param="messages")
    return {**call, "function": {**function, "arguments": arguments}}


def sampling_params(body: dict, chat: bool, defaults: dict[str, Any] | None = None,
                    tool_constraint: dict | None = None) -> SamplingParams:
    """The request's sampling parameters; ``defaults`` (the model's generation config) fill
    the fields the body leaves unset, as in vLLM's server: their ``max_tokens`` caps the one
    asked for (or the 16 of a completion that asks for none). ``tool_constraint``: the output
    constraint of the request's ``tool_choice`` (see ``structured_outputs``)."""
    defaults = dict(defaults or {})
    default_max_tokens = defaults.pop("max_tokens", None)
    fields: dict[str, Any] = {**defaults, **{name: body[name] for name in SAME_NAME
                                             if body.get(name) is not None}}
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    if default_max_tokens is not None and _is_token(max_tokens):
        max_tokens = min(max_tokens, default_max_tokens)
    elif max_tokens is None:
        max_tokens = default_max_tokens
    fields["max_tokens"] = max_tokens
    if not chat:
        fields.update(_echo_fields(body, max_tokens))
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"])
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else stop
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    structured = structured_outputs(body, tool_constraint)
    if structured is not None:
        fields["structured_outputs"] = structured
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as error:
        raise APIError(400, str(error), param=param_of(str(error))) from None


def scores_prompt_only(body: dict) -> bool:
    """Whether a completion only scores its prompt: ``echo`` with ``max_tokens=0``."""
    return body.get("echo") is True and _is_token(body.get("max_tokens")) and \
        body["max_tokens"] == 0


def _echo_fields(body: dict, max_tokens: Any) -> dict[str, Any]:
    """What ``echo`` changes in a completion's sampling parameters. Its ``logprobs`` cover the
    prompt too, so the engine computes ``prompt_logprobs`` (unless the body sets them); with
    ``max_tokens=0`` (scoring, as lm-eval does) the engine samples one token that the response
    leaves out, as in vLLM. Without ``echo``, ``max_tokens=0`` is an error."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise APIError(400, f"echo must be a boolean, got {echo!r}", param="echo")
    if _is_token(max_tokens) and max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens must be >= 1; max_tokens=0 (no tokens generated, the "
                            "prompt scored) needs echo=true", param="max_tokens")
    fields: dict[str, Any] = {}
    if scores_prompt_only(body):
        fields["max_tokens"] = 1
    if echo and body.get("logprobs") is not None and body.get("prompt_logprobs") is None:
        fields["prompt_logprobs"] = body["logprobs"]
    return fields


def param_of(message: str) -> str | None:
    """The field an error names (``max_tokens must be...``), if it starts with one."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (JSON keys, so strings) to biases, clamped to
    [-100, 100]."""
    if not isinstance(bias, dict):
        raise APIError(400, "logit_bias must be an object mapping token ids to numbers",
                       param="logit_bias")
    clamped = {}
    for key, value in bias.items():
        if not str(key).isdigit() or type(value) not in (int, float):
            raise APIError(400, f"logit_bias must map token ids to numbers, got {key!r}: "
                                f"{value!r}", param="logit_bias")
        clamped[int(key)] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
    return clamped
# vLLM's older extras (removed in its 0.12), as fields of ``structured_outputs``
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def structured_outputs(body: dict, tool_constraint: dict | None = None) -> dict | None:
    """The output constraint a request asks for, as ``StructuredOutputsParams`` fields: from
    OpenAI's ``response_format``, vLLM's ``structured_outputs``, its older ``guided_*`` fields,
    or the ``tool_constraint`` that forces a chat's tool calls (one of these at most;
    ``structured_outputs`` may also add only options, such as ``disable_any_whitespace``, to
    another). SamplingParams checks the fields."""
    fields = body.get("structured_outputs")
    if fields is not None and not isinstance(fields, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    fields = dict(fields or {})
    given = ["structured_outputs"] if set(fields) & set(STRUCTURED_KINDS) else []
    constraint = _response_format(body.get("response_format"))
    if constraint is not None:
        given.append("response_format")
        fields.update(constraint)
    for name, field in GUIDED.items():
        if body.get(name) is not None:
            given.append(name)
            fields[field] = body[name]
    if tool_constraint is not None:
        given.append("tool_choice")
        fields.update(tool_constraint)
    if len(given) > 1:
        raise APIError(400, f"give one output constraint, not {' and '.join(given)}",
                       param=given[1])
    return fields or None


def _response_format(response_format: Any) -> dict | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(400, "response_format must be an object whose type is text, json_object or "
                        f"json_schema, got {response_format!r}", param="response_format")


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs", 0)
        if not _is_token(top) or top > 20:
            raise APIError(400, "top_logprobs must be an integer in [0, 20]",
                           param="top_logprobs")
        return top
    logprobs = body.get("logprobs")
    if logprobs is None:
        return None
    if not _is_token(logprobs) or logprobs > 20:
        raise APIError(400, "logprobs must be an integer in [0, 20]", param="logprobs")
    return logprobs


def stream_options(body: dict) -> bool:
    """Whether a streamed response ends with a usage chunk."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    return bool(options.get("include_usage", False))


def _is_token(t: Any) -> bool:
    return type(t) is int and t >= 0
