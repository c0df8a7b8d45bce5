"""What one HTTP process costs a streamed chunk, without a GPU: the real app (``build_app``) over
a stand-in engine that gives every request in flight one token every ``--step-ms``, from a
thread as ``AsyncLLM``'s reader does; ``benchmarks/serve.py`` streams against it, and the
server process's CPU time over the run is divided by the chunks it wrote.

Usage: python benchmarks/experiments/http_chunks.py [--loop auto|asyncio|uvloop]
       [--http auto|h11|httptools] [--requests 512] [--concurrency 128] [--tokens 128]
       [--step-ms 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 8130


class SteppingEngine:
    """The parts of ``AsyncLLM`` the app uses; each request gains a token (and " ab" of text)
    every step until its ``max_tokens``."""

    def __init__(self, tokenizer, step_s: float):
        from nanofn.state import Counters, Figures

        self.tokenizer, self.step_s = tokenizer, step_s
        self.max_model_len, self.generation_defaults, self.failure = 4096, {}, None
        self._figures, self._counters = Figures(0, 0, 0, 0, 1, 0.0, 0, 0, 0, 0, 0), Counters(0, 0, 0, 0)
        self.running: dict[str, list] = {}
        self.lock = threading.Lock()
        self.ids = 0

    def figures(self):
        return self._figures

    def counters(self):
        return self._counters

    def views(self):
        from nanofn.server.async_engine import ReplicaView

        return [ReplicaView(self._figures, self._counters, None)]

    async def generate(self, prompt, params, request_id=None):
        from nanofn.server.async_engine import _Stream

        stream = _Stream(asyncio.get_running_loop(), asyncio.Event())
        with self.lock:
            self.ids += 1
            self.running[f"r{self.ids}"] = [stream, prompt["prompt_token_ids"], [], "",
                                            params.max_tokens]
        while True:
            await stream.ready.wait()
            stream.ready.clear()
            output, stream.latest = stream.latest, None
            yield output
            if output.finished:
                return

    def abort(self, request_id):
        with self.lock:
            self.running.pop(request_id, None)

    def abort_all(self, error):
        pass

    def close(self):
        pass

    def step_forever(self, loop: asyncio.AbstractEventLoop) -> None:
        from nanofn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
        from nanofn.server.async_engine import _deliver

        while True:
            time.sleep(self.step_s)
            batch = []
            with self.lock:
                for request_id, state in list(self.running.items()):
                    stream, prompt, tokens, text, most = state
                    state[2], state[3] = tokens + [100 + len(tokens) % 50], text + " ab"
                    finished = len(state[2]) >= most
                    batch.append((stream, RequestOutput(
                        request_id, None, prompt, [CompletionOutput(
                            0, state[3], state[2], None, None, "length" if finished else None)],
                        finished, metrics=RequestMetrics(0.0))))
                    if finished:
                        del self.running[request_id]
            loop.call_soon_threadsafe(_deliver, batch)


def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from nanofn.model.tiny import demo_model
    from nanofn.server.app import build_app
    from nanofn.server.chat_output import ChatOptions
    from nanofn.server.limits import ServerLimits

    engine = SteppingEngine(AutoTokenizer.from_pretrained(demo_model()), args.step_ms / 1e3)
    app = build_app(engine, "tiny", None, ChatOptions(), ServerLimits())

    @app.on_event("startup")
    async def start_stepping() -> None:
        threading.Thread(target=engine.step_forever, args=(asyncio.get_running_loop(),),
                         daemon=True).start()

    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning", loop=args.loop,
                http=args.http)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", default="auto")
    ap.add_argument("--http", default="auto")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args)
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--loop", args.loop,
                               "--http", args.http, "--step-ms", str(args.step_ms)])
    try:
        time.sleep(8)  # imports and the tokenizer
        before = cpu_seconds(server.pid)
        client = Path(__file__).parents[1] / "serve.py"
        report = subprocess.run(
            [sys.executable, str(client), "--url", f"http://127.0.0.1:{PORT}", "--model", "tiny",
             "--requests", str(args.requests), "--concurrency", str(args.concurrency),
             "--prompt-len", "32", "--max-tokens", str(args.tokens), "--vocab-size", "300"],
            capture_output=True, text=True, check=True).stdout
        spent = cpu_seconds(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    print(report.strip())
    print(f"loop {args.loop}, http {args.http}: the server process's CPU {spent:.2f} s, "
          f"{spent / (args.requests * args.tokens) * 1e6:.1f} us a streamed token")


if __name__ == "__main__":
    main()
