"""A serving benchmark: streamed completions against a running ``nanofn serve`` (or any
OpenAI-compatible server) at a fixed concurrency, reporting output throughput and the p50/p99
of the time to first token, of the inter-token latency and of the whole request.

Usage: python benchmarks/serve.py --url http://127.0.0.1:8000 [--model NAME] [--requests 256]
       [--concurrency 64] [--prompt-len 512] [--max-tokens 256] [--api-key KEY]
       [--vocab-size 10000] [--background-prompt-chars N] [--json PATH]

Prompts are random token ids (``--prompt-len`` each) and every request asks for exactly
``--max-tokens`` tokens (``ignore_eos``), so runs compare across servers and models.

``--background-prompt-chars N`` measures the same requests while the server tokenizes huge
prompts: throughout the run, one completion with an N-character text prompt (random words) is
always in flight (the server refuses it once it has counted its tokens, if it cannot fit). With
it, the small requests' latencies should stay near the unloaded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import numpy as np


async def one_request(url: str, headers: dict, body: dict) -> dict:
    """One streamed completion over plain asyncio streams. HTTP/1.0, so the server frames the
    body by closing the connection and each server-sent event is one line; only the usage
    chunk is parsed as JSON. The openai client costs ~0.4 ms of client CPU per chunk, which
    made the client, not the server, the bottleneck at 64 streams."""
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    reader, writer = await _send(url, "POST /v1/completions", {
        **headers, "Content-Type": "application/json", "Content-Length": len(payload)}, payload)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{status.decode().strip()}: {(await reader.read()).decode()[:300]}")
    first, arrivals, tokens = None, [], 0
    async for line in reader:
        if not line.startswith(b"data: {"):
            continue
        now = time.perf_counter()
        if b'"usage": {' in line:
            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        if b'"choices": []' not in line:
            first = now if first is None else first  # a chunk per step with new tokens
            arrivals.append(now)
    writer.close()
    end = time.perf_counter()
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.array([])
    # A chunk may carry several tokens: spread each gap over the tokens it brought.
    per_token = (end - first) / max(tokens - 1, 1) if first is not None else None
    return {"ttft": (first or end) - start, "tokens": tokens, "e2e": end - start,
            "gaps": gaps.tolist(), "per_token": per_token}


async def run(a) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = a.model or await first_model(a.url, headers)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, a.vocab_size) for _ in range(a.prompt_len)]
               for _ in range(a.requests)]

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}

    await one_request(a.url, headers, body(prompts[0][:32], 8))  # warm up
    stop = asyncio.Event()
    background = None
    if a.background_prompt_chars:
        background = asyncio.create_task(big_prompts(a, headers, model, stop))
        await asyncio.sleep(1.0)  # the first one is being tokenized
    gate = asyncio.Semaphore(a.concurrency)

    async def gated(prompt):
        async with gate:
            return await one_request(a.url, headers, body(prompt, a.max_tokens))

    start = time.perf_counter()
    client_cpu = time.process_time()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    elapsed = time.perf_counter() - start
    client_cpu = time.process_time() - client_cpu
    stop.set()
    big = await background if background is not None else []
    ttft = np.array([r["ttft"] for r in results])
    itl = np.array([r["per_token"] for r in results if r["per_token"] is not None])
    e2e = np.array([r["e2e"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    return {"model": model, "requests": a.requests, "concurrency": a.concurrency,
            "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "elapsed_s": elapsed,
            "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "client_cpu_fraction": client_cpu / elapsed,
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
            "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
            "itl_p50_ms": float(np.percentile(itl, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(itl, 99) * 1e3),
            "e2e_p50_ms": float(np.percentile(e2e, 50) * 1e3),
            "e2e_p99_ms": float(np.percentile(e2e, 99) * 1e3),
            "background_prompt_chars": a.background_prompt_chars, "background_requests": big}


async def big_prompts(a, headers: dict, model: str, stop: asyncio.Event) -> list[dict]:
    """Completions with an ``--background-prompt-chars``-character prompt, one after another
    until ``stop``: each one's status line and seconds."""
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9)))
             for _ in range(a.background_prompt_chars // 5)]  # 6.5 characters each, with a space
    payload = json.dumps({"model": model, "max_tokens": 1,
                          "prompt": " ".join(words)[:a.background_prompt_chars]}).encode()
    sent = []
    while not stop.is_set():
        start = time.perf_counter()
        reader, writer = await _send(a.url, "POST /v1/completions", {
            **headers, "Content-Type": "application/json", "Content-Length": len(payload)},
            payload)
        status = (await reader.readline()).decode().strip()
        await reader.read()
        writer.close()
        sent.append({"status": status, "seconds": time.perf_counter() - start})
    return sent


async def _send(url: str, request_line: str, headers: dict, payload: bytes = b""):
    """Open a connection to ``url`` (``http://HOST:PORT``) and send an HTTP/1.0 request; the
    connection's reader and writer."""
    host, port = url.split("//", 1)[1].rstrip("/").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 22)
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "Host": host}.items())
    writer.write(f"{request_line} HTTP/1.0\r\n{head}\r\n".encode() + payload)
    return reader, writer


async def first_model(url: str, headers: dict) -> str:
    reader, writer = await _send(url, "GET /v1/models", headers)
    response = await reader.read()
    writer.close()
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--api-key")
    ap.add_argument("--vocab-size", type=int, default=10_000,
                    help="prompt token ids are drawn below it (the demo model has 400)")
    ap.add_argument("--background-prompt-chars", type=int, default=0, metavar="N",
                    help="keep a completion with an N-character prompt in flight throughout")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    result = asyncio.run(run(a))
    print(f"{result['requests']} requests, {result['concurrency']} at a time, prompts of "
          f"{result['prompt_len']} tokens, {result['max_tokens']} new tokens each: "
          f"{result['elapsed_s']:.2f} s, {result['output_tok_s']:,.0f} output tok/s")
    print(f"client CPU {result['client_cpu_fraction']:.0%} of the run (near 100%: the client is the "
          "bottleneck)")
    print(f"time to first token p50 {result['ttft_p50_ms']:.1f} ms, p99 "
          f"{result['ttft_p99_ms']:.1f} ms; inter-token latency p50 {result['itl_p50_ms']:.2f} "
          f"ms, p99 {result['itl_p99_ms']:.2f} ms; whole request p50 {result['e2e_p50_ms']:.1f} "
          f"ms, p99 {result['e2e_p99_ms']:.1f} ms")
    for big in result["background_requests"]:
        print(f"  meanwhile a {a.background_prompt_chars:,}-character prompt: {big['status']} "
              f"after {big['seconds']:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
