"""The OpenAI-compatible HTTP API over an ``AsyncLLM``: completions, chat completions and
responses (streamed as server-sent events or not), models, health, version, tokenize,
detokenize and Prometheus metrics under vLLM's names.

One request cannot jam the others: bodies, prompts and sequences are bounded (``ServerLimits``),
prompts are tokenized in this process off its event loop (``PromptMaker``), and a client that
leaves aborts its engine requests at once. Every error has OpenAI's JSON shape, unknown routes
and unexpected failures included; a stream that fails ends with an error event."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from nanofn import __version__
from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM, EngineDead
from nanofn.server.chat_output import ChatOptions, ChatOutput
from nanofn.server.limits import ServerLimits
from nanofn.server.metrics import Metrics
from nanofn.server.prompts import OFF_LOOP_BYTES, PromptMaker
from nanofn.server.requests import (APIError, completion_prompts, param_of, sampling_params,
                                    stream_options)
from nanofn.server.responses_api import (ResponseShape, chat_body, response_events,
                                         responses_params)
from nanofn.server.shapes import Shape, sse
from nanofn.server.tools import request_tools, tool_choice
from nanofn.state import InvalidRequest, SamplingParams

VERSION = __version__  # pyproject.toml's, for /version
log = logging.getLogger("nanofn")
T = TypeVar("T")


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              chat_options: ChatOptions | None = None,
              limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The app; ``app.state.shutdown.begin()`` starts SIGTERM's grace period."""
    app = FastAPI(title="nanofn", version=VERSION)
    install_error_handlers(app)
    chat_options = chat_options or ChatOptions()
    metrics = Metrics(llm)
    prompts = PromptMaker(llm.tokenizer, llm.max_model_len, limits, chat_options)
    shutdown = app.state.shutdown = Shutdown(llm, limits.shutdown_timeout)

    def authorize(request: Request) -> None:
        """With ``api_key``, the /v1/ routes need ``Authorization: Bearer KEY``."""
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           "authentication_error", code="invalid_api_key")

    async def read(request: Request) -> tuple[dict, bool]:
        """The body, and whether to make its prompts off the event loop (a big one)."""
        body = await _read_body(request, limits.max_request_body_bytes)
        return _parse_json(body), len(body) > OFF_LOOP_BYTES

    def start(engine_prompts: list, params: SamplingParams) -> _Call:
        shutdown.check()
        return _Call(llm, metrics, engine_prompts, params)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()),
                "owned_by": "nanofn", "max_model_len": llm.max_model_len}

    @app.get("/health")
    async def health() -> Response:
        """200 while an engine serves: with data parallelism and a replica down, the body
        names it (the others serve on, so a gateway should keep sending); 503 once none
        does."""
        if llm.failure is not None:
            return APIError(503, f"the engine stopped: {llm.failure!r}", "server_error").response()
        down = {i: repr(v.failure) for i, v in enumerate(llm.views()) if v.failure is not None}
        if down:
            return JSONResponse({"status": "degraded", "replicas_down": down})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        authorize(request)
        _check_model({"model": model_id}, model_name)
        return model_card()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body, off_loop = await read(request)
        if "messages" in body:
            tokens = (await prompts.chat(body, None, off_loop,
                                         request_tools(body)))["prompt_token_ids"]
        elif isinstance(body.get("prompt"), str):
            tokens = await prompts.text(body["prompt"], body.get("add_special_tokens", True),
                                        off_loop)
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body, _ = await read(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise APIError(400, "tokens must be a list of token ids", param="tokens")
        try:
            return {"prompt": llm.tokenizer.decode(tokens)}
        except OverflowError:
            raise APIError(400, f"tokens must be token ids; {max(tokens)} is too large",
                           param="tokens") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body, off_loop = await read(request)
        _check_model(body, model_name)
        given = completion_prompts(body)
        params = sampling_params(body, chat=False, defaults=llm.generation_defaults)
        engine_prompts = await prompts.completion(given, params, off_loop)
        return await _answer_chunks(request, body, start(engine_prompts, params), Shape(
            f"cmpl-{secrets.token_hex(12)}", int(time.time()), model_name, False, params, body,
            llm.tokenizer.decode))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body, off_loop = await read(request)
        _check_model(body, model_name)
        tools = request_tools(body)
        choice = tool_choice(body, tools, chat_options.auto_tool_parser)
        params = sampling_params(body, chat=True, defaults=llm.generation_defaults,
                                 tool_constraint=choice.constraint)
        prompt = await prompts.chat(body, params, off_loop, tools)
        output = ChatOutput.for_request(body, prompt["prompt"], params, chat_options, choice)
        return await _answer_chunks(request, body, start([prompt], params), Shape(
            f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), model_name, True, params,
            body, llm.tokenizer.decode, output))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        authorize(request)
        body, off_loop = await read(request)
        _check_model(body, model_name)
        conversation = chat_body(body)
        params = responses_params(body, llm.generation_defaults)
        prompt = await prompts.chat(conversation, params, off_loop, param="input")
        shape = ResponseShape(int(time.time()), model_name, body, params)
        call = start([prompt], params)
        return await _answer(
            request, call, bool(body.get("stream", False)), lambda finals: shape.whole(finals[0]),
            lambda firsts: _ended(call, response_events(shape, firsts[0], call.streams[0]),
                                  lambda error: [shape.error_event(error)]))

    return app


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's JSON shape: the API's own, a refused or failed engine request,
    unknown routes and wrong methods, and any other exception (a 500; the server's log gets
    its traceback)."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            api_error = APIError(404, f"there is no route {where}", "NotFoundError")
        elif error.status_code == 405:
            api_error = APIError(405, f"{request.url.path} does not take {request.method}; it "
                                      f"takes {(error.headers or {}).get('Allow')}",
                                 "MethodNotAllowedError")
        else:
            api_error = APIError(error.status_code, f"{where}: {error.detail}",
                                 "BadRequestError" if error.status_code < 500 else "server_error")
        response = api_error.response()
        response.headers.update(error.headers or {})
        return response

    async def api_error(_: Request, error: Exception) -> JSONResponse:
        return _api_error(error).response()

    for kind in (APIError, InvalidRequest, EngineDead, Exception):
        app.add_exception_handler(kind, api_error)


def _api_error(error: Exception) -> APIError:
    """``error`` as the API reports it."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequest):  # the engine refused the request
        return APIError(400, str(error), param=param_of(str(error)))
    if isinstance(error, EngineDead):
        return APIError(503, str(error), "server_error")
    return APIError(500, f"internal server error: {type(error).__name__}: {error}",
                    "server_error")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) once it is known to be longer than ``limit``: by its
    Content-Length before any of it is read, else (a chunked body) as soon as the bytes read
    pass the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,} bytes", limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(f"more than {limit:,} bytes", limit)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected before sending the whole body") from None
    return bytes(body)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {size}; this server takes at most {limit:,} "
                         f"(--max-request-body-bytes)", "RequestEntityTooLargeError")


def _parse_json(body: bytes) -> dict:
    """The body as a JSON object; anything else (nesting too deep for the parser included)
    is a 400."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not JSON: {error}") from None
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server has "
                            f"{model_name!r}", "NotFoundError", param="model",
                       code="model_not_found")


# --- shutting down ---------------------------------------------------------------------------

class ShuttingDown(APIError):
    """A request still running when the shutdown's grace period ran out."""


class Shutdown:
    """SIGTERM's grace period (``--shutdown-timeout``): the requests in flight get ``timeout``
    seconds to finish; then each one still running ends with a 503 (a stream, with an error
    event and ``[DONE]``), and a request that would start after it is one."""

    def __init__(self, llm: AsyncLLM, timeout: float):
        self.llm, self.timeout = llm, timeout
        self.over = False

    def begin(self) -> None:
        """Start the grace period (on the server's event loop)."""
        asyncio.get_running_loop().call_later(self.timeout, self._end)

    def check(self) -> None:
        if self.over:
            raise self.error()

    def error(self) -> ShuttingDown:
        return ShuttingDown(503, f"the server is shutting down, and the {self.timeout:g} s "
                                 f"its requests had to finish (--shutdown-timeout) are over",
                            "server_error", code="shutdown")

    def _end(self) -> None:
        self.over = True
        self.llm.abort_all(self.error)


# --- running requests ------------------------------------------------------------------------

class _Call:
    """The engine requests of one API request (one per prompt): their output streams, the
    newest output of each, and their end, counted as an abort when it comes early."""

    def __init__(self, llm: AsyncLLM, metrics: Metrics, prompts: list, params: SamplingParams):
        self.metrics, self.n = metrics, params.n
        self.streams = [_watched(llm, metrics, prompt, params) for prompt in prompts]
        self.latest: list[RequestOutput | None] = [None] * len(prompts)

    async def firsts(self) -> list[RequestOutput]:
        """Each request's first output (an invalid request fails here)."""
        for i, stream in enumerate(self.streams):
            self.latest[i] = await anext(stream)
        return list(self.latest)

    async def finals(self) -> list[RequestOutput]:
        for i, stream in enumerate(self.streams):
            async for output in stream:
                self.latest[i] = output
        return list(self.latest)

    def aborted(self, reason: str | None) -> None:
        """Count the call as aborted for ``reason`` (None: it was not)."""
        if reason is not None:
            unfinished = sum(1 for output in self.latest if output is None or not output.finished)
            self.metrics.aborted(reason, unfinished * self.n)

    async def close(self) -> None:
        """Stop the requests not finished."""
        for stream in self.streams:
            await stream.aclose()


class _ClientGone(Exception):
    pass


async def _answer(request: Request, call: _Call, stream: bool,
                  whole: Callable[[list[RequestOutput]], dict],
                  events: Callable[[list[RequestOutput]], AsyncIterator[str]]) -> Response:
    """The API request's response: ``whole`` of its final outputs, or ``events`` streamed from
    its first ones. A client that leaves before the response starts aborts the requests at
    once (a stream's response notices one that leaves later)."""
    streaming, abort_reason = False, None
    try:
        firsts = await _unless_gone(request, call.firsts())
        if stream:
            streaming = True  # the events end the call
            return StreamingResponse(events(firsts), media_type="text/event-stream")
        return JSONResponse(whole(await _unless_gone(request, call.finals())))
    except _ClientGone:
        abort_reason = "client_disconnected"
        return APIError(400, "the client disconnected").response()  # to no one
    except ShuttingDown:
        abort_reason = "shutdown"
        raise
    finally:
        if not streaming:
            call.aborted(abort_reason)
            await call.close()


async def _answer_chunks(request: Request, body: dict, call: _Call, shape: Shape) -> Response:
    """A completion's or chat completion's response: whole, or in chunks ending in ``[DONE]``
    (an error, in an error chunk before it)."""
    streaming = bool(body.get("stream", False))
    include_usage = stream_options(body) if streaming else False
    return await _answer(
        request, call, streaming, shape.whole,
        lambda firsts: _ended(call, _chunks(shape, call, firsts, include_usage),
                              lambda error: [sse(error.body()), "data: [DONE]\n\n"]))


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled
    (the engine requests it waits on are aborted) and ``_ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body is read by then: that is all ``receive``
    has left to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watched(llm: AsyncLLM, metrics: Metrics, prompt, params) -> AsyncIterator:
    """A request's outputs, timed for the metrics."""
    start = time.monotonic()
    last = None
    num_tokens = 0
    async with aclosing(llm.generate(prompt, params)) as outputs:  # closed now, not when collected
        async for output in outputs:
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


async def _ended(call: _Call, events: AsyncIterator[str],
                 error_events: Callable[[APIError], list[str]]) -> AsyncIterator[str]:
    """``events``, then the end of ``call``. An error (the engine stopped, the shutdown's time
    ran out, a bug) ends the stream with ``error_events`` of it; a client that leaves aborts
    the call's requests."""
    abort_reason: str | None = "client_disconnected"  # unless the events end otherwise
    try:
        async for event in events:
            yield event
        abort_reason = None
    except Exception as error:
        abort_reason = "shutdown" if isinstance(error, ShuttingDown) else None
        if not isinstance(error, (APIError, EngineDead)):
            log.exception("a streamed response failed")
        for event in error_events(_api_error(error)):
            yield event
    finally:
        call.aborted(abort_reason)
        await events.aclose()
        await call.close()


async def _chunks(shape: Shape, call: _Call, firsts: list,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per request output, ``[DONE]`` last."""
    sent: list[dict] = [{} for _ in call.streams]  # per prompt, see Shape.delta_choices
    async with aclosing(_interleaved(call.streams, firsts)) as outputs:
        if shape.chat:
            yield sse(shape.chunk(0, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}
                                       for i in range(shape.n)]))
        async for index, output in outputs:
            call.latest[index] = output
            choices = shape.delta_choices(index, output, sent[index])
            if choices:
                yield sse(shape.chunk(index, choices))
    if include_usage:
        yield sse({**shape.chunk(0, []), "usage": shape.usage(call.latest)})
    yield "data: [DONE]\n\n"


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
        except Exception as error:  # raised where the outputs are read
            await merged.put((index, error))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        open_streams = len(streams)
        while open_streams:
            index, output = await merged.get()
            if isinstance(output, Exception):
                raise output
            if output is None:
                open_streams -= 1
            else:
                yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
