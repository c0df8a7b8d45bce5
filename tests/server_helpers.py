"""Helpers of the server tests: ``nanofn serve`` as a subprocess on a free port, its metrics,
its server-sent events."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# A small engine: 256 tokens a sequence, 64 KV blocks, 16 sequences a step.
SMALL_ENGINE = ("--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, *flags: str, api_key: str | None = API_KEY) -> tuple[subprocess.Popen,
                                                                              str]:
    """``nanofn serve MODEL`` (as "tiny", with ``api_key`` and ``SMALL_ENGINE``) on a free
    port, once its /health answers: (process, url). ``flags`` come last (a flag given twice
    takes its last value)."""
    port = free_port()
    key = ["--api-key", api_key] if api_key is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "nanofn", "serve", str(model), "--port", str(port), *key,
         "--served-model-name", "tiny", *SMALL_ENGINE, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("the server did not start within 120 s")


@contextlib.contextmanager
def serving(model, *flags: str):
    """A server (``start_server``) for the ``with`` block: its url; on leaving, SIGTERM and a
    clean exit (status 0) asserted."""
    process, url = start_server(model, *flags)
    yield url
    process.terminate()
    assert process.wait(timeout=60) == 0, process.stdout.read()


def metric(server: str, name: str) -> float:
    """A metric's value; ``name`` with its labels as /metrics shows them, if it has any."""
    text = httpx.get(f"{server}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(server: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (metric(server, "vllm:num_requests_running") == 0
                and metric(server, "vllm:num_requests_waiting") == 0
                and metric(server, "nanofn:kv_blocks_used") == 0):
            return
        time.sleep(0.2)
    raise AssertionError("requests or KV blocks are still held")


def first_event(lines) -> str:
    return next(line for line in lines if line.startswith("data:"))


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


def spawned_children(parent_pid: int, name: str | None = None) -> list[int]:
    """The processes that multiprocessing spawned from ``parent_pid`` to run a target (not its
    resource tracker); with ``name``, those that go by it (``nanofn-engine``, ``nanofn-api-0``:
    /proc/PID/comm)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{entry.name}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if parent == parent_pid and b"spawn_main" in command and name in (None, comm):
            pids.append(int(entry.name))
    return pids


def engine_pid_of(server_pid: int) -> int:
    """The server's engine process."""
    children = spawned_children(server_pid, "nanofn-engine")
    assert children, f"process {server_pid} has no engine process"
    return children[0]
