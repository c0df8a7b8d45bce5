"""The OpenAI-compatible HTTP API over an ``AsyncLLM``: completions and chat completions
(streamed as server-sent events or not), models, health, version, tokenize, detokenize and
Prometheus metrics under vLLM's names. Errors have OpenAI's JSON shape."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily

from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM, EngineDead
from nanofn.server.requests import (APIError, chat_prompt, completion_prompts, param_of,
                                    sampling_params, stream_options)
from nanofn.state import InvalidRequest, SamplingParams

VERSION = "0.1.0"


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="nanofn", version=VERSION)
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
            prompt = chat_prompt(llm.tokenizer, body)
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
        prompt = chat_prompt(llm.tokenizer, body)
        params = sampling_params(body, chat=True, defaults=llm.generation_defaults)
        return await _respond(llm, metrics, body, model_name, [prompt], params, chat=True)

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
                   prompts: list, params, chat: bool) -> Response:
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
    shape = _Shape(response_id, created, model_name, chat, params, body, llm.tokenizer.decode)
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


async def _events(shape: _Shape, streams: list, firsts: list,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per request output, ``[DONE]`` last."""
    sent: list[dict] = [{} for _ in streams]  # per prompt, see _Shape.delta_choices
    finals: list = [None] * len(streams)
    outputs = _interleaved(streams, firsts)
    try:
        if shape.chat:
            yield _sse(shape.chunk(0, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}
                                       for i in range(shape.n)]))
        async for index, output in outputs:
            finals[index] = output
            choices = shape.delta_choices(index, output, sent[index])
            if choices:
                yield _sse(shape.chunk(index, choices))
        if include_usage:
            yield _sse({**shape.chunk(0, []), "usage": shape.usage(finals)})
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


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Shape:
    """OpenAI's response shapes for one call."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 params: SamplingParams, body: dict, decode: Callable[[list[int]], str]):
        self.id, self.created, self.model, self.chat = response_id, created, model, chat
        self.n = params.n
        self.echo = bool(body.get("echo", False)) and not chat
        self.decode = decode
        self.num_top = params.logprobs or 0  # the request's logprobs / top_logprobs

    def prompt_text(self, output: RequestOutput) -> str:
        """What ``echo`` puts first: the prompt as given, or its tokens decoded."""
        return output.prompt if output.prompt is not None else self.decode(
            output.prompt_token_ids)

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def whole(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                text = self.prompt_text(final) + c.text if self.echo else c.text
                choice: dict[str, Any] = {"index": self.choice_index(p, c.index),
                                          "logprobs": self._logprobs(c, 0),
                                          "finish_reason": _finish_reason(c.finish_reason),
                                          "stop_reason": c.stop_reason}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                    choice["prompt_logprobs"] = _prompt_logprobs(final)
                choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(finals)}

    def chunk(self, prompt_index: int, choices: list) -> dict:
        return {"id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    def delta_choices(self, prompt_index: int, output: RequestOutput, sent: dict) -> list:
        """The choices of a streamed chunk: each completion's text since the last chunk
        (``sent``: per completion, the text and tokens sent and whether it is done)."""
        choices = []
        for c in output.outputs:
            text_sent, tokens_sent, done = sent.get(c.index, (0, 0, False))
            if done:
                continue
            text = c.text[text_sent:]
            if self.echo and c.index not in sent:
                text = self.prompt_text(output) + text
            if not text and len(c.token_ids) == tokens_sent and c.finish_reason is None:
                continue  # nothing new; a token with no text yet (held back) still gets a chunk
            sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
            choice: dict[str, Any] = {"index": self.choice_index(prompt_index, c.index),
                                      "logprobs": self._logprobs(c, tokens_sent),
                                      "finish_reason": _finish_reason(c.finish_reason)}
            if self.chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return choices

    def usage(self, finals: list) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
        completion = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _logprobs(self, c, start: int) -> dict | None:
        if c.logprobs is None:  # not asked for
            return None
        entries = list(zip(c.token_ids[start:], c.logprobs[start:]))
        if self.chat:
            return {"content": [{
                "token": top[token].decoded_token, "logprob": top[token].logprob,
                "bytes": list((top[token].decoded_token or "").encode()),
                "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                  "bytes": list((lp.decoded_token or "").encode())}
                                 for lp in self._top(top)]}
                for token, top in entries]}
        return {"tokens": [top[token].decoded_token for token, top in entries],
                "token_logprobs": [top[token].logprob for token, top in entries],
                "top_logprobs": [{lp.decoded_token: lp.logprob for lp in self._top(top)}
                                 for _, top in entries],
                "text_offset": []}

    def _top(self, entry: dict) -> list:
        """The ``num_top`` most likely tokens of a position's entry (which also holds the
        sampled token, whatever its rank), best first."""
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        return [lp for lp in ranked if lp.rank <= self.num_top][:self.num_top]


def _prompt_logprobs(output: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt position (None for the
    first), token id -> its logprob, rank and text."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                          "decoded_token": lp.decoded_token} for token, lp in entry.items()}
            for entry in output.prompt_logprobs]


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason == "abort" else reason


# --- metrics -----------------------------------------------------------------------------------

class Metrics:
    """Prometheus metrics under vLLM's names, in a registry of this app's own."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests running", registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)",
                              registry=registry)
        self.kv_blocks_used = Gauge("nanofn:kv_blocks_used", "KV blocks owned by requests",
                                    registry=registry)
        self.hit_rate = Gauge("nanofn:prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache, since the start",
                              registry=registry)
        registry.register(_CoreCounters(llm))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Generated tokens of finished requests",
                                         registry=registry)
        self.requests = Counter("vllm:request_success", "Finished requests", ["finished_reason"],
                                registry=registry)
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                             "Time to the first token", registry=registry)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Time between tokens", registry=registry)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds",
                                     "Time from arrival to the last token", registry=registry)

    def finished(self, output: RequestOutput, seconds: float) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        for c in output.outputs:
            self.requests.labels(finished_reason=c.finish_reason or "abort").inc()
        self.e2e_latency.observe(seconds)

    def render(self) -> bytes:
        figures = self.llm.figures()
        self.running.set(figures.num_running)
        self.waiting.set(figures.num_waiting)
        self.kv_usage.set(figures.kv_cache_usage)
        self.kv_blocks_used.set(figures.kv_blocks_used)
        self.hit_rate.set(figures.prefix_cache_hit_rate)
        return generate_latest(self.registry)


class _CoreCounters:
    """The core's own running totals, read from its latest (immutable) state at each scrape:
    preemptions, and prefix-cache queries and hits in tokens, as vLLM counts them."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def collect(self):
        counters = self.llm.counters()
        for name, documentation, value in (
                ("vllm:num_preemptions", "Preemptions since the start",
                 counters.num_preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 counters.num_admitted_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 counters.num_cached_tokens)):
            yield CounterMetricFamily(name, documentation, value=value)
