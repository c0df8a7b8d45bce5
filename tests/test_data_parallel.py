"""``nanofn serve --data-parallel-size 2``: two engine processes behind one endpoint, driven with
the real ``openai`` client. Requests sharing a first block of prompt tokens land on one replica,
others spread over both; /metrics shows each replica under a ``replica`` label and their sum
without it; a replica whose engine is killed fails its own requests with an error naming it,
while the other serves on and /health says which one is down. Also which GPUs each replica
would get."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
from server_helpers import (API_KEY, HEADERS, metric, needs_proc, serving, spawned_children,
                            start_server,
                            wait_until_idle)

from nanofn.engine.options import EngineOptions
from nanofn.server.data_parallel import REPLICA_VARIABLE, replica_devices, replica_environments
from nanofn.server.metrics import ENGINE_METRICS
from nanofn.server.routing import RoutingPolicy, choose_replica

openai = pytest.importorskip("openai")

BLOCK = 16  # the engine's default block size, the routing key's length
SHARED = list(range(100, 100 + BLOCK))  # a first block that several prompts share


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    with serving(tiny_qwen3, "--data-parallel-size", "2") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def replica_metric(server: str, name: str) -> list[float]:
    """``name``'s value for each replica, in replica order."""
    text = httpx.get(f"{server}/metrics").text
    found = dict(re.findall(rf'^{re.escape(name)}{{replica="(\d+)"}} ([0-9.e+-]+)$', text,
                            re.MULTILINE))
    return [float(found[str(r)]) for r in range(len(found))]


def finished_per_replica(server: str) -> list[float]:
    return replica_metric(server, "nanofn:sequences_finished_total")


def preferred(token_ids: list[int]) -> int:
    return choose_replica(token_ids, [0, 0], [True, True], RoutingPolicy(block_size=BLOCK))


def test_the_openai_client_is_answered_streamed_and_whole(client):
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert whole.usage.completion_tokens == 5


def test_prompts_sharing_a_first_block_land_on_one_replica(server, client):
    before = finished_per_replica(server)
    for tail in range(6):
        client.completions.create(model="tiny", prompt=SHARED + [7, tail, 9], max_tokens=2)
    after = finished_per_replica(server)
    target = preferred(SHARED)
    assert after[target] - before[target] == 6
    assert after[1 - target] == before[1 - target]


def test_different_prompts_use_both_replicas(server, client):
    before = finished_per_replica(server)
    for first in range(12):
        client.completions.create(model="tiny", prompt=[first * 7 + 1, 5, 6], max_tokens=2)
    after = finished_per_replica(server)
    assert all(a > b for a, b in zip(after, before))
    assert sum(after) - sum(before) == 12


def test_the_replicas_metrics_add_up_to_the_servers(server, client):
    client.completions.create(model="tiny", prompt=SHARED + [1, 2], max_tokens=3)
    wait_until_idle(server)
    for name, kind, _, _ in ENGINE_METRICS:
        if name == "nanofn:prefix_cache_hit_rate" or name == "vllm:kv_cache_usage_perc":
            continue  # ratios, of the summed counts
        shown = name + ("_total" if kind == "counter" else "")
        assert sum(replica_metric(server, shown)) == metric(server, shown), shown
    hits, queries = (metric(server, f"vllm:prefix_cache_{n}_total") for n in ("hits", "queries"))
    assert metric(server, "nanofn:prefix_cache_hit_rate") == pytest.approx(hits / queries)
    assert replica_metric(server, "nanofn:replica_up") == [1.0, 1.0]


def start_stream(url: str, prompt: list[int]):
    """A long streamed completion, once its first event came: (its response context, its
    remaining lines)."""
    context = httpx.stream("POST", f"{url}/v1/completions", headers=HEADERS, timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 150, "ignore_eos": True,
        "stream": True})
    lines = context.__enter__().iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    return context, lines


@needs_proc
def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(tiny_qwen3):
    """One long stream on each replica; one engine process is killed: its stream ends with an
    error naming its replica, the other stream finishes, and new requests (those that
    preferred the dead replica too) are served."""
    process, url = start_server(tiny_qwen3, "--data-parallel-size", "2")
    try:
        prompts = [next([t, 5, 6] for t in range(1, 1000) if preferred([t, 5, 6]) == replica)
                   for replica in (0, 1)]
        streams = [start_stream(url, prompt) for prompt in prompts]
        pids = spawned_children(process.pid, "nanofn-engine")
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        rests = []
        for context, lines in streams:
            rests.append("\n".join(lines))
            context.__exit__(None, None, None)
        up = replica_metric(url, "nanofn:replica_up")
        assert sorted(up) == [0.0, 1.0]
        dead = up.index(0.0)
        assert f"data-parallel replica {dead} of 2 stopped" in rests[dead]
        assert '"error":' not in rests[1 - dead]
        assert '"finish_reason": "length"' in rests[1 - dead]
        assert all(rest.rstrip().endswith("data: [DONE]") for rest in rests)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200
        assert list(health.json()["replicas_down"]) == [str(dead)]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        for prompt in (*prompts, SHARED):  # the dead replica's own prompts too
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
            assert out.usage.completion_tokens == 3
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stdout.read()


def test_each_replica_gets_its_own_gpus():
    assert replica_devices(0, 1, ["0", "1"]) == ["0"]
    assert replica_devices(1, 1, ["0", "1"]) == ["1"]
    assert replica_devices(1, 2, ["4", "5", "6", "7"]) == ["6", "7"]
    options = EngineOptions(model="m", tensor_parallel_size=2)
    environments = replica_environments(2, options, ["0", "1", "2", "3"])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["0,1", "2,3"]
    assert [e[REPLICA_VARIABLE] for e in environments] == ["0", "1"]
    assert replica_environments(2, options, None) == [{REPLICA_VARIABLE: "0"},
                                                      {REPLICA_VARIABLE: "1"}]


def test_too_few_gpus_or_a_fixed_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="replica 1 needs GPUs 2 to 3 .* 3 are visible"):
        replica_environments(2, EngineOptions(model="m", tensor_parallel_size=2),
                             ["0", "1", "2"])
    with pytest.raises(ValueError, match="device 'cuda:1'.*give device 'cuda'"):
        replica_environments(2, EngineOptions(model="m", device="cuda:1"), ["0", "1"])


def test_replicas_that_cannot_start_are_a_clear_error(tmp_path):
    from nanofn.server.data_parallel import DataParallelLLM

    with pytest.raises(OSError, match="data-parallel replica 0: .*config.json"):
        DataParallelLLM.start(str(tmp_path), 2)
    with pytest.raises(ValueError, match="nnodes > 1 is not supported"):
        DataParallelLLM.start(str(tmp_path), 2, nnodes=2, tensor_parallel_size=2, master_port=1)


def test_a_data_parallel_size_below_one_is_a_usage_error(capsys):
    from nanofn.cli import main

    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be positive, got 0" in capsys.readouterr().err
