"""``nanofn serve`` against hostile and careless clients: each hostile request gets its status
in OpenAI's error shape while a normal stream in flight beside it runs to its end; clients that
leave abort their requests at once; SIGTERM's grace period ends in errors, not cut
connections. Also the endpoints that real clients call besides completions: /v1/models/{id}
and /v1/responses (through the real openai client)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from server_helpers import (API_KEY, HEADERS, engine_pid_of, first_event, metric, needs_proc,
                            serving, start_server, wait_until_idle)

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 1024
MAX_BODY = 4_000_000
MAX_CHARS_PER_TOKEN = 2000  # prompts up to ~2M characters are tokenized
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256", "--max-num-seqs", "4",
         "--max-n", "8", "--max-request-body-bytes", str(MAX_BODY),
         "--max-chars-per-token", str(MAX_CHARS_PER_TOKEN))
LONG = {"model": "tiny", "prompt": "Go on", "max_tokens": 1000, "ignore_eos": True}
ABORTED = 'nanofn:requests_aborted_total{reason="client_disconnected"}'


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    with serving(tiny_qwen3, *FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@contextmanager
def a_stream_alongside(server: str):
    """A streamed completion in flight while the block runs; afterwards it must run to its
    end, every token of it."""
    body = {**LONG, "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", headers=HEADERS, json=body,
                      timeout=60) as r:
        lines = r.iter_lines()
        first_event(lines)
        yield
        events = [line[6:] for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 48


def post(server: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server}{path}", headers=HEADERS, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    """The response is OpenAI's error JSON with this status (and param); its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error["message"]


def raw_request(server: str, head: str, body: bytes = b"") -> socket.socket:
    """A connection that has sent ``head`` (the request line and headers) and ``body``."""
    host, port = server.split("//")[1].split(":")
    connection = socket.create_connection((host, int(port)), timeout=20)
    connection.sendall(f"{head}\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n\r\n"
                       .encode() + body)
    return connection


def response_of(connection: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on ``connection`` (read until it closes)."""
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
    connection.close()
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def wait_for(server: str, name: str, value: float, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} is not {value} after {seconds} s"
        time.sleep(0.02)


# --- limits ----------------------------------------------------------------------------------

def test_n_beyond_max_n_is_refused(server):
    with a_stream_alongside(server):
        message = assert_error(post(server, "/v1/completions", json={
            "model": "tiny", "prompt": "Hi", "n": 1_000_000}), 400, "n")
        assert "--max-n" in message
        assert_error(post(server, "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 9}), 400, "n")
        assert_error(post(server, "/v1/completions", json={
            "model": "tiny", "prompt": ["a", "b", "c", "d", "e"], "n": 2}), 400, "prompt")
        assert post(server, "/v1/completions", json={
            "model": "tiny", "prompt": "Hi", "n": 8, "max_tokens": 2}).status_code == 200


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    with a_stream_alongside(server):
        # Content-Length says too much: refused before a byte of the body is sent.
        declared = raw_request(server, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                       f"Content-Length: {100 * MAX_BODY}")
        status, body = response_of(declared)
        assert status == 413 and "--max-request-body-bytes" in body["error"]["message"]
        # A chunked body: refused as soon as it passes the limit (by a byte).
        chunks = [b"x" * (MAX_BODY // 2), b"x" * (MAX_BODY // 2), b"x"]
        chunked = raw_request(server, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                      "Transfer-Encoding: chunked",
                              b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks))
        status, body = response_of(chunked)
        assert status == 413 and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing_it(server):
    """Its refusal counts characters, not tokens: it was never tokenized."""
    too_long = "x" * (MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN + 1)
    with a_stream_alongside(server):
        message = assert_error(post(server, "/v1/completions", json={
            "model": "tiny", "prompt": too_long}), 400, "prompt")
        assert "characters" in message and "--max-chars-per-token" in message
        message = assert_error(post(server, "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": too_long}]}), 400,
            "messages")
        assert "characters" in message


def test_tokenizing_a_big_prompt_does_not_hold_up_small_requests(server):
    """A small request sent while a 2 MB prompt is being tokenized is answered before the big
    one (refused once its tokens are counted: more than max_model_len)."""
    answered: list[tuple[str, httpx.Response]] = []

    def send(name: str, body: dict) -> None:
        answered.append((name, post(server, "/v1/completions", json=body)))

    big = threading.Thread(target=send, args=("big", {"model": "tiny",
                                                      "prompt": "word " * 400_000}))
    big.start()
    time.sleep(0.2)  # its tokenizing (over a second with this tokenizer) has begun
    send("small", {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    big.join()
    assert [name for name, _ in answered] == ["small", "big"]
    assert answered[0][1].status_code == 200
    assert "tokens, more than max_model_len" in assert_error(answered[1][1], 400, "prompt")


def test_the_server_tokenizes_as_the_tokenizer_does(server, tiny_qwen3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    for text in ("Hello there", "<|im_start|>user\nHi<|im_end|>", " spaces  and\ttabs\n"):
        for special in (True, False):
            tokens = post(server, "/tokenize", json={"prompt": text,
                                                     "add_special_tokens": special}).json()
            assert tokens["tokens"] == tokenizer.encode(text, add_special_tokens=special)
        usage = post(server, "/v1/completions", json={"model": "tiny", "prompt": text,
                                                      "max_tokens": 1}).json()["usage"]
        assert usage["prompt_tokens"] == len(tokenizer.encode(text))
    assert "surrogate" in assert_error(post(server, "/v1/completions", content=b'{"prompt": '
                                            b'"a\\ud800b"}'), 400, "prompt")


def test_serve_shows_its_limits_and_refuses_a_bad_one_in_one_line(capsys):
    from nanofn.cli import main

    assert main(["serve", "--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--max-n N", 128), ("--max-request-body-bytes BYTES", 33554432),
                          ("--max-chars-per-token N", 32), ("--shutdown-timeout SECONDS", 30.0)):
        assert f"(default: {default}" in flat.rsplit(flag, 1)[1].split(" --")[0]
    # (a model that is not there: had the limit passed, serving it would fail on that)
    assert main(["serve", "/no/such/model", "--max-n", "0"]) == 2
    assert capsys.readouterr().err == "nanofn serve: error: max_n must be >= 1, got 0\n"
    assert main(["serve", "/no/such/model", "--shutdown-timeout", "-1"]) == 2
    assert "shutdown_timeout must be >= 0" in capsys.readouterr().err


# --- malformed requests ----------------------------------------------------------------------

def test_json_nested_too_deep_is_400(server):
    with a_stream_alongside(server):
        deep = b"[" * 100_000 + b"]" * 100_000
        assert "nested" in assert_error(post(server, "/v1/completions", content=deep), 400)
        deep_object = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        assert_error(post(server, "/v1/chat/completions", content=deep_object), 400)


def test_unknown_routes_and_wrong_methods_are_errors_in_openai_shape(server, client):
    with a_stream_alongside(server):
        assert "POST /v1/nowhere" in assert_error(post(server, "/v1/nowhere", json={}), 404)
        wrong = httpx.delete(f"{server}/v1/completions", headers=HEADERS)
        assert "DELETE" in assert_error(wrong, 405) and wrong.headers["allow"] == "POST"
        assert_error(httpx.post(f"{server}/v1/models", headers=HEADERS), 405)
        with pytest.raises(openai.NotFoundError):
            client.get("/nowhere", cast_to=object)


def test_an_unexpected_exception_is_a_500_in_openai_shape():
    from fastapi import FastAPI, HTTPException
    from fastapi.testclient import TestClient

    from nanofn.server.app import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/broken")
    async def broken():
        raise KeyError("a bug")

    @app.get("/refusing")
    async def refusing():
        raise HTTPException(409, "in a conflict")

    test_client = TestClient(app, raise_server_exceptions=False)
    response = test_client.get("/broken")
    assert "KeyError" in assert_error(response, 500)
    assert response.json()["error"]["type"] == "server_error"
    assert "in a conflict" in assert_error(test_client.get("/refusing"), 409)


# --- clients that leave ----------------------------------------------------------------------

def test_clients_gone_before_their_answer_abort_their_requests_at_once(server):
    """Four non-streamed requests fill the engine; a streamed one waits for room, its response
    not yet begun. Each client that closes its connection aborts its request within a second."""
    aborted = metric(server, ABORTED)
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}")
    running = [raw_request(server, head, body) for _ in range(4)]
    wait_for(server, "vllm:num_requests_running", 4, 30)
    stream = json.dumps({**LONG, "stream": True}).encode()
    waiting = raw_request(server, head.replace(str(len(body)), str(len(stream))), stream)
    wait_for(server, "vllm:num_requests_waiting", 1, 30)
    waiting.close()
    wait_for(server, "vllm:num_requests_waiting", 0, 1)
    assert metric(server, "vllm:num_requests_running") == 4
    for connection in running:
        connection.close()
    wait_for(server, "vllm:num_requests_running", 0, 1)
    wait_for(server, ABORTED, aborted + 5, 1)
    wait_until_idle(server)


def test_clients_gone_mid_stream_abort_their_requests_at_once(server):
    """Two streams of n=2 run; their clients leave: four sequences aborted, two requests."""
    aborted = metric(server, ABORTED)
    abort_finishes = metric(server, 'vllm:request_success_total{finished_reason="abort"}')
    with ExitStack() as streams:
        lines = [streams.enter_context(httpx.stream(
            "POST", f"{server}/v1/completions", headers=HEADERS, timeout=60,
            json={**LONG, "n": 2, "stream": True})).iter_lines() for _ in range(2)]
        for stream_lines in lines:  # (a line iterator let go closes its connection)
            first_event(stream_lines)
        wait_for(server, "vllm:num_requests_running", 4, 30)
    wait_for(server, "vllm:num_requests_running", 0, 1)
    wait_for(server, ABORTED, aborted + 2, 1)
    assert metric(server, 'vllm:request_success_total{finished_reason="abort"}') == \
        abort_finishes + 4
    wait_until_idle(server)


# --- endpoints -------------------------------------------------------------------------------

def test_a_model_by_its_id(server, client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    for other in ("gpt-4o", "org/tiny"):
        with pytest.raises(openai.NotFoundError) as error:
            client.models.retrieve(other)
        assert error.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server}/v1/models/tiny").status_code == 401  # the API key


def test_responses_match_chat_completions(server, client):
    """A response is the chat completion of its instructions and input, streamed or not."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          temperature=0)
    response = client.responses.create(model="tiny", instructions="Be brief.",
                                       input="Say something", max_output_tokens=12,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")
    parts = client.responses.create(
        model="tiny", max_output_tokens=12, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Say "},
                            {"type": "input_text", "text": "something"}]}])
    assert parts.output_text == response.output_text

    events = list(client.responses.create(model="tiny", instructions="Be brief.",
                                          input="Say something", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type.endswith(".delta"))
    assert deltas == events[-4].text == response.output_text
    assert events[-1].response.output_text == response.output_text
    assert events[-1].response.usage.output_tokens == response.usage.output_tokens


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
])
def test_a_bad_responses_request_is_400(server, body, param):
    assert_error(post(server, "/v1/responses", json={"model": "tiny", **body}), 400, param)


# --- shutdown --------------------------------------------------------------------------------

@needs_proc
def test_sigterm_gives_requests_their_time_then_ends_them_with_errors(tiny_qwen3):
    """--shutdown-timeout 1: a short stream in flight at SIGTERM finishes normally; then the
    engine is frozen, and when the second is over a long stream (of two prompts) ends with an
    error event and [DONE], and a long non-streamed request gets a 503; the server exits 0."""
    process, url = start_server(tiny_qwen3, *FLAGS, "--shutdown-timeout", "1")
    engine = engine_pid_of(process.pid)
    terminated = False
    try:
        whole: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: whole.append(post(url, "/v1/completions",
                                                                    json=LONG)))
        waiting.start()
        wait_for(url, "vllm:num_requests_running", 1, 30)
        with ExitStack() as streams:
            long, short = (streams.enter_context(httpx.stream(
                "POST", f"{url}/v1/completions", headers=HEADERS, timeout=60,
                json={**LONG, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
            )).iter_lines() for prompt, max_tokens in ((["Go on", "Keep going"], 1000),
                                                       ("Go", 20)))
            first_event(long)
            first_event(short)
            process.terminate()
            terminated = True
            short_events = [line[6:] for line in short if line.startswith("data:")]
            os.kill(engine, signal.SIGSTOP)  # the long requests cannot finish now
            long_events = [line[6:] for line in long if line.startswith("data:")]
        waiting.join(timeout=60)
    finally:  # however the test went, the engine goes on and the server stops
        os.kill(engine, signal.SIGCONT)
        if not terminated:
            process.terminate()
        exit_code = process.wait(timeout=60)
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    assert json.loads(long_events[-2])["error"]["code"] == "shutdown"
    assert "--shutdown-timeout" in assert_error(whole[0], 503)
    assert exit_code == 0, process.stdout.read()
