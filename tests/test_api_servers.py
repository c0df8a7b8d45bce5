"""``nanofn serve --api-server-count N``: N HTTP processes on one port, each a client of the
engines. An engine process serves several clients, each only its own requests' outputs; a
client that leaves (or dies) takes only its own requests with it. The server answers the
``openai`` client, both HTTP processes take connections, /metrics adds up what each process
counted, SIGTERM stops everything cleanly, and an HTTP process that dies stops the server
with its name."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time

import httpx
import pytest
from server_helpers import (API_KEY, HEADERS, free_port, metric, needs_proc,
                            spawned_children, start_server)

from nanofn.engine.options import EngineOptions
from nanofn.server.async_engine import AsyncLLM, start_engine_process, wait_until_ready
from nanofn.server.engine_process import dumps
from nanofn.state import InvalidRequest, SamplingParams

openai = pytest.importorskip("openai")

ENGINE = dict(max_model_len=256, num_kv_blocks=64)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=150, ignore_eos=True)
LONGER = SamplingParams(max_tokens=240, ignore_eos=True)


def two_clients(model) -> tuple:
    """An engine process with two attached clients: (process, [client 0, client 1])."""
    from nanofn.engine.engine import load_tokenizer

    options = EngineOptions.from_kwargs(str(model), **ENGINE)
    process, conns = start_engine_process(options, {}, 2)
    facts = [wait_until_ready(process, conn) for conn in conns]
    tokenizer = load_tokenizer(options)
    clients = [AsyncLLM.attach(conn, fact, tokenizer, process.pid, f"{i}-")
               for i, (conn, fact) in enumerate(zip(conns, facts))]
    return process, clients


async def last(llm: AsyncLLM, prompt, params=GREEDY, request_id=None):
    output = None
    async for output in llm.generate(prompt, params, request_id):
        pass
    return output


def test_two_clients_of_one_engine_each_get_their_own_outputs(tiny_qwen3):
    """Both clients' requests run side by side (their default ids do not collide), each
    client gets exactly its own requests' outputs, and they are the tokens one client alone
    gets; an id in use by the other client is refused to the one that asked."""
    process, clients = two_clients(tiny_qwen3)
    prompts = [[5, 17, 42, 9], [7, 7, 3], [11, 2, 90, 4, 4]]

    async def together():
        runs = [last(clients[i % 2], {"prompt_token_ids": p}) for i, p in enumerate(prompts)]
        return await asyncio.gather(*runs)

    async def one_by_one():
        return [await last(clients[0], {"prompt_token_ids": p}) for p in prompts]

    async def same_id():
        first = clients[0].generate([1, 2, 3], LONG, "shared")
        await anext(first)  # in the engine now
        with pytest.raises(InvalidRequest, match="shared"):
            await last(clients[1], [4, 5, 6], request_id="shared")
        async for output in first:
            pass
        return output

    try:
        both = asyncio.run(together())
        alone = asyncio.run(one_by_one())
        assert asyncio.run(same_id()).finished
    finally:
        for client in clients:
            client.close()
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]
    assert [o.prompt_token_ids for o in both] == prompts
    assert all(len(o.outputs[0].token_ids) == 12 for o in both)
    process.join(timeout=30)
    assert process.exitcode == 0  # it stopped once both clients had left


def test_each_client_is_sent_only_its_own_requests_outputs(tiny_qwen3):
    """On the pipes themselves: every step goes to both clients, each with the outputs of the
    requests it added and no others (an HTTP process unpickles only its share)."""
    options = EngineOptions.from_kwargs(str(tiny_qwen3), **ENGINE)
    process, conns = start_engine_process(options, {}, 2)
    for conn in conns:
        wait_until_ready(process, conn)
    conns[0].send_bytes(dumps(("add", "a", [1, 2, 3], GREEDY)))
    conns[1].send_bytes(dumps(("add", "b", [4, 5, 6], LONG)))
    seen, steps, done = [set(), set()], [0, 0], [False, False]
    while not all(done):
        for index, conn in enumerate(conns):
            kind, deltas, *_ = pickle.loads(conn.recv_bytes())
            assert kind == "step"
            steps[index] += 1
            seen[index].update(delta[0] for delta in deltas)
            done[index] = done[index] or any(delta[5] for delta in deltas)  # finished
    assert seen == [{"a"}, {"b"}]
    assert steps[0] == steps[1] > 12  # both got every step, through b's end
    for conn in conns:
        conn.send_bytes(dumps(("stop",)))
    process.join(timeout=30)
    assert process.exitcode == 0


def test_a_client_that_leaves_takes_only_its_own_requests(tiny_qwen3):
    """Client 0 leaves (its process would have died: its pipe just closes) in the middle of a
    long request, which the engine aborts; client 1's long request goes on to its end, and
    the engine serves it new ones."""
    process, clients = two_clients(tiny_qwen3)

    async def run():
        stays = asyncio.ensure_future(last(clients[1], [3, 1, 4, 1, 5], LONG))
        leaves = clients[0].generate([2, 7, 1, 8], LONGER)
        await anext(leaves)
        clients[0]._conn.close()  # as if its process died: no "stop", the pipe closes
        return await stays, await last(clients[1], [9, 9, 9])

    try:
        stayed, later = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        clients[1].close()
    assert stayed.finished and len(stayed.outputs[0].token_ids) == 150
    assert later.finished and len(later.outputs[0].token_ids) == 12
    # client 0's would have run on past both (240 tokens) had it not been aborted
    assert clients[1].figures().num_running == 0
    process.join(timeout=30)
    assert process.exitcode == 0


@needs_proc
def test_an_engine_whose_clients_all_leave_while_it_builds_stops_building(tiny_qwen3):
    """The server is stopped (SIGTERM, even SIGKILL) while an engine process is still being
    built: its end of every pipe closes. The engine process, its workers with it, ends then,
    rather than build on for no one (minutes on GPUs) until it fails to say it is ready. Here
    the build cannot end by itself: it waits for the ranks of a second host that never
    comes."""
    options = EngineOptions.from_kwargs(str(tiny_qwen3), tensor_parallel_size=2, nnodes=2,
                                        master_addr="127.0.0.1", master_port=free_port(),
                                        **ENGINE)
    process, conns = start_engine_process(options, {}, 2)
    try:
        deadline = time.monotonic() + 60
        while not (workers := spawned_children(process.pid)):  # rank 0: the build is on
            assert time.monotonic() < deadline, "the engine started no worker"
            time.sleep(0.1)
        for conn in conns:
            conn.close()
        process.join(timeout=30)
        assert process.exitcode is not None, "the engine went on building for no client"
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in workers):
            assert time.monotonic() < deadline, "the engine's worker outlived it"
            time.sleep(0.1)
    finally:
        process.kill()
        process.join()


def open_stream(url: str):
    """A long streamed completion, open once its first event came: (its context, its lines)."""
    context = httpx.stream("POST", f"{url}/v1/completions", headers=HEADERS, timeout=60, json={
        "model": "tiny", "prompt": "Go on", "max_tokens": 200, "ignore_eos": True,
        "stream": True})
    lines = context.__enter__().iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    return context, lines


def open_connections(pid: int) -> int:
    """The established TCP connections a process holds (its sockets' inodes, looked up in
    /proc/net/tcp: not its listening socket, nor its pipes' and event loop's socket pairs)."""
    established = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01":  # ESTABLISHED
                    established.add(fields[9])
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since the listing
            continue
        count += link.startswith("socket:[") and link[8:-1] in established
    return count


def loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@needs_proc
def test_the_http_side_runs_on_uvloop_and_httptools(tiny_qwen3):
    """uvicorn takes them when installed (a quarter less CPU a streamed chunk)."""
    process, _ = start_server(tiny_qwen3)
    try:
        libraries = loaded_libraries(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stdout.read()
    assert "/uvloop/" in libraries and "/httptools/" in libraries


@needs_proc
def test_two_http_processes_serve_one_port_and_their_metrics_add_up(tiny_qwen3):
    process, url = start_server(tiny_qwen3, "--api-server-count", "2")
    try:
        engines = spawned_children(process.pid, "nanofn-engine")
        servers = [spawned_children(process.pid, f"nanofn-api-{i}") for i in (0, 1)]
        assert len(engines) == 1 and all(len(s) == 1 for s in servers)
        # connections go to whichever process accepts first: open streams until both hold one
        streams = []
        while len(streams) < 64 and not all(open_connections(s[0]) for s in servers):
            streams.append(open_stream(url))
        assert all(open_connections(s[0]) for s in servers), len(streams)
        assert all("/uvloop/" in loaded_libraries(s[0]) for s in servers)
        for context, lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            context.__exit__(None, None, None)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                          temperature=0)
        chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        served = len(streams) + 2
        for _ in range(6):  # each scrape, whichever process answers it, counts every request
            assert metric(url, 'vllm:request_success_total{finished_reason="length"}') == served
            assert metric(url, "vllm:generation_tokens_total") == 200 * len(streams) + 10
            assert metric(url, "nanofn:sequences_finished_total") == served  # the engine's
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stdout.read()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in engines)


@needs_proc
def test_an_http_process_that_dies_stops_the_server_naming_it(tiny_qwen3):
    process, url = start_server(tiny_qwen3, "--api-server-count", "2")
    engines = spawned_children(process.pid, "nanofn-engine")
    [server] = spawned_children(process.pid, "nanofn-api-1")
    os.kill(server, signal.SIGKILL)
    try:
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
    assert "HTTP process nanofn-api-1 exited (exit code -9)" in process.stdout.read()
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in engines):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.1)


def test_an_api_server_count_below_one_is_a_usage_error(capsys):
    from nanofn.cli import main

    assert main(["serve", "--api-server-count", "0"]) == 2
    assert "--api-server-count must be positive, got 0" in capsys.readouterr().err


class _UnpicklableDecodeError(UnicodeDecodeError):
    """An error that cannot cross a pipe (a lambda in it), of a built-in class that takes five
    arguments."""

    def __init__(self):
        super().__init__("utf-8", b"\xff", 0, 1, "invalid start byte")
        self.hook = lambda: None


@pytest.mark.parametrize("error, kind, words", [
    (ValueError("max_tokens must be at least 1"), ValueError, "max_tokens must be at least 1"),
    (_UnpicklableDecodeError(), RuntimeError,
     "_UnpicklableDecodeError: 'utf-8' codec can't decode byte 0xff"),
])
def test_an_error_crosses_to_the_http_process_as_one_it_can_read(error, kind, words):
    """What the engine process sends back for a refused request or its own failure
    (``portable``): the error itself when it pickles, else one of a built-in class; an error
    whose built-in class takes more than a message raised a TypeError there, which ended the
    engine's serving."""
    from nanofn.server.engine_process import portable

    crossed = pickle.loads(pickle.dumps(portable(error)))
    assert type(crossed) is kind and words in str(crossed)
