"""The OpenAI-compatible HTTP API over an ``AsyncLLM``: completions and chat completions
(streamed as server-sent events or not), models, health, version, tokenize, detokenize and
Prometheus metrics under vLLM's names. Errors have OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from nanofn import __version__
from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM, EngineDead
from nanofn.server.chat_output import ChatOptions, ChatOutput
from nanofn.server.metrics import Metrics
from nanofn.server.requests import (APIError, chat_prompt, completion_prompts, param_of,
                                    sampling_params, stream_options)
from nanofn.server.shapes import Shape, sse
from nanofn.server.tools import request_tools, tool_choice
from nanofn.state import InvalidRequest

VERSION = __version__  # pyproject.toml's, for /version


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              chat_options: ChatOptions | None = None) -> FastAPI:
    app = FastAPI(title="nanofn", version=VERSION)
    chat_options = chat_options or ChatOptions()
    metrics = Metrics(llm)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    def authorize(request: Request) -> None:
        """With ``api_key``, the /v1/ routes need ``Authorization: Bearer KEY``."""
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           "authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        if llm.failure is not None:
            return APIError(503, f"the engine stopped: {llm.failure!r}", "server_error").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "nanofn", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await _body(request)
        if "messages" in body:
            prompt = chat_prompt(llm.tokenizer, body, chat_options, request_tools(body))
            tokens = prompt["prompt_token_ids"]
        elif isinstance(body.get("prompt"), str):
            tokens = llm.tokenizer.encode(body["prompt"],
                                          add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await _body(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise APIError(400, "tokens must be a list of token ids", param="tokens")
        return {"prompt": llm.tokenizer.decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = await _body(request)
        _check_model(body, model_name)
        prompts = completion_prompts(body)
        params = sampling_params(body, chat=False, defaults=llm.generation_defaults)
        return await _respond(llm, metrics, body, model_name, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await _body(request)
        _check_model(body, model_name)
        tools = request_tools(body)
        prompt = chat_prompt(llm.tokenizer, body, chat_options, tools)
        choice = tool_choice(body, tools, chat_options.auto_tool_parser)
        params = sampling_params(body, chat=True, defaults=llm.generation_defaults,
                                 tool_constraint=choice.constraint)
        output = ChatOutput.for_request(body, prompt["prompt"], params, chat_options, choice)
        return await _respond(llm, metrics, body, model_name, [prompt], params, chat=True,
                              chat_output=output)

    return app


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server has "
                            f"{model_name!r}", "NotFoundError", param="model",
                       code="model_not_found")


# --- running requests ------------------------------------------------------------------------

async def _respond(llm: AsyncLLM, metrics: Metrics, body: dict, model_name: str,
                   prompts: list, params, chat: bool,
                   chat_output: ChatOutput | None = None) -> Response:
    prefix = "chatcmpl" if chat else "cmpl"
    response_id = f"{prefix}-{secrets.token_hex(12)}"
    created = int(time.time())
    streams = [_watched(llm, metrics, prompt, params) for prompt in prompts]
    try:
        firsts = [await anext(stream) for stream in streams]  # invalid requests fail here
    except InvalidRequest as error:
        for stream in streams:
            await stream.aclose()
        raise APIError(400, str(error), param=param_of(str(error))) from None
    except EngineDead as error:
        raise APIError(503, str(error), "server_error") from None
    shape = Shape(response_id, created, model_name, chat, params, body, llm.tokenizer.decode,
                  chat_output)
    if body.get("stream", False):
        include_usage = stream_options(body)
        return StreamingResponse(_events(shape, streams, firsts, include_usage),
                                 media_type="text/event-stream")
    finals = []
    try:
        for stream, first in zip(streams, firsts):
            final = first
            async for final in stream:
                pass
            finals.append(final)
    except EngineDead as error:
        raise APIError(503, str(error), "server_error") from None
    return JSONResponse(shape.whole(finals))


async def _watched(llm: AsyncLLM, metrics: Metrics, prompt, params) -> AsyncIterator:
    """A request's outputs, timed for the metrics."""
    start = time.monotonic()
    last = None
    num_tokens = 0
    async for output in llm.generate(prompt, params):
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if tokens > num_tokens:
            if last is None:
                metrics.time_to_first_token.observe(now - start)
            else:
                metrics.inter_token_latency.observe((now - last) / (tokens - num_tokens))
            last, num_tokens = now, tokens
        if output.finished:
            metrics.finished(output, now - start)
        yield output


async def _events(shape: Shape, streams: list, firsts: list,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per request output, ``[DONE]`` last."""
    sent: list[dict] = [{} for _ in streams]  # per prompt, see Shape.delta_choices
    finals: list = [None] * len(streams)
    outputs = _interleaved(streams, firsts)
    try:
        if shape.chat:
            yield sse(shape.chunk(0, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}
                                       for i in range(shape.n)]))
        async for index, output in outputs:
            finals[index] = output
            choices = shape.delta_choices(index, output, sent[index])
            if choices:
                yield sse(shape.chunk(index, choices))
        if include_usage:
            yield sse({**shape.chunk(0, []), "usage": shape.usage(finals)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away, or all is sent: stop the requests
        await outputs.aclose()
        for stream in streams:
            await stream.aclose()


async def _interleaved(streams: list, firsts: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of several prompts' streams as the outputs come. One stream (the
    usual call) is read directly: a task and a queue per output cost a loop turn each."""
    if len(streams) == 1:
        yield 0, firsts[0]
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator, first: RequestOutput) -> None:
        try:
            await merged.put((index, first))
            async for output in stream:
                await merged.put((index, output))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        open_streams = len(streams)
        while open_streams:
            index, output = await merged.get()
            if output is None:
                open_streams -= 1
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
