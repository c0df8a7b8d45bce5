"""The README's recipe for one ``nanofn serve`` per GPU (or host) behind SGLang Model Gateway:
the real ``smg`` binary in front of two servers of the tiny model. The gateway finds them
(it reads /health, /v1/models, /version, and their load from /metrics), a streamed chat request
through it reaches the ``openai`` client whole, and requests sharing a long prefix land on one
server (counted by each server's ``nanofn:sequences_finished_total``)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import free_port, metric, start_server

openai = pytest.importorskip("openai")
SMG = shutil.which("smg")
pytestmark = pytest.mark.skipif(SMG is None, reason="needs smg (pip install smg)")

SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, without any "
          "preamble, and never repeat the question back to the user before answering it.")


@pytest.fixture(scope="module")
def servers(tiny_qwen3):
    """Two servers (no API key: the gateway is the public endpoint) and the gateway's url."""
    with ThreadPoolExecutor(2) as pool:  # side by side: each waits for its engine
        started = list(pool.map(lambda _: start_server(tiny_qwen3, api_key=None), range(2)))
    port = free_port()
    gateway = subprocess.Popen(
        [SMG, "launch", "--worker-urls", *(url for _, url in started), "--policy", "cache_aware",
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1",
         "--log-level", "warn"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_workers(gateway, url, 2)
        yield url, [url for _, url in started]
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            gateway.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gateway.kill()
        for process, _ in started:
            process.terminate()
            assert process.wait(timeout=60) == 0, process.stdout.read()


def wait_for_workers(gateway: subprocess.Popen, url: str, count: int) -> None:
    """Until the gateway lists ``count`` healthy workers of the vLLM kind."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if gateway.poll() is not None:
            raise RuntimeError(f"smg exited:\n{gateway.stdout.read()}")
        try:
            workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            workers = []
        if len(workers) == count and all(w["is_healthy"] for w in workers):
            assert {w["runtime_type"] for w in workers} == {"vllm"}
            return
        time.sleep(0.3)
    raise RuntimeError("smg did not register both servers within 60 s")


def test_a_streamed_chat_request_through_the_gateway(servers):
    gateway, _ = servers
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Say hello"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_requests_sharing_a_prefix_land_on_one_server(servers):
    gateway, backends = servers
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    before = [metric(b, "nanofn:sequences_finished_total") for b in backends]
    for question in ("What is 2+2?", "Name a colour.", "Name a river.", "Who wrote Hamlet?",
                     "Name a prime.", "What is the capital of Peru?"):
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    served = [metric(b, "nanofn:sequences_finished_total") - n for b, n in zip(backends, before)]
    assert sorted(served) == [0, 6]
