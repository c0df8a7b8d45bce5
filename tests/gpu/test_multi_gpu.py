"""Two GPUs, beyond one engine on one GPU: two "hosts" of one GPU each (a ``nanofn worker`` that
sees only the second GPU) give the tokens of TP=2 on one host and of TP=1; ``serve
--data-parallel-size 2`` puts one replica on each GPU and both answer with one engine's tokens;
the all-reduce through peer memory sums as NCCL does, eagerly and from a CUDA graph.
Run by ``benchmarks/gpu_run.sh multinode``, ``dp`` and ``tp``."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from server_helpers import HEADERS, free_port, start_server

from nanofn import LLM, SamplingParams
from nanofn.kernels.all_reduce import PeerAllReduce, ranks_all_reduce

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[3 + i, 7, 11, 13, 17 + i] for i in range(12)]
OPTIONS = dict(dtype="float32", gpu_memory_utilization=0.3, max_model_len=512)


def tokens(model_dir, **options) -> list[list[int]]:
    with LLM(str(model_dir), **OPTIONS, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                               use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]


def test_two_hosts_of_one_gpu_give_the_tokens_of_tp2(tiny_qwen3):
    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-m", "nanofn", "worker", "--tensor-parallel-size", "2", "--nnodes",
         "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        spread = tokens(tiny_qwen3, tensor_parallel_size=2, nnodes=2, master_port=port)
        assert host.wait(timeout=60) == 0, host.stdout.read()
    finally:
        host.kill()
    assert spread == tokens(tiny_qwen3, tensor_parallel_size=2)
    assert spread == tokens(tiny_qwen3)


def test_data_parallel_replicas_answer_on_two_gpus(tiny_qwen3):
    process, url = start_server(tiny_qwen3, "--data-parallel-size", "2", "--dtype", "float32",
                                "--gpu-memory-utilization", "0.3")
    try:
        texts = []
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True}
            texts.append(httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS,
                                    timeout=60).json()["choices"][0]["text"])
        metrics = httpx.get(f"{url}/metrics").text
        for replica in (0, 1):  # both served some
            line = next(line for line in metrics.splitlines() if line.startswith(
                f'nanofn:sequences_finished_total{{replica="{replica}"}}'))
            assert float(line.split()[-1]) > 0
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0, process.stdout.read()
    with LLM(str(tiny_qwen3), **OPTIONS) as llm:
        expected = [o.outputs[0].text for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    assert texts == expected


def test_the_peer_all_reduce_sums_as_nccl_does(tmp_path):
    """Messages of 1 element, a decode step's (256 x 4,096) and one past the buffer (NCCL's
    then): each rank's sum equal to NCCL's, bit for bit (two ranks: one addition), eagerly and
    replayed from a CUDA graph with new contents."""
    mp.spawn(_sum_on_rank, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _sum_on_rank(rank: int, store_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        all_reduce = ranks_all_reduce(device, torch.float32)
        assert isinstance(all_reduce, PeerAllReduce)
        for numel in (1, 256 * 4096, all_reduce.buffer.numel() + 1):
            x = torch.randn(numel, generator=torch.Generator(device).manual_seed(rank),
                            device=device)
            expected = x.clone()
            dist.all_reduce(expected)
            assert torch.equal(all_reduce(x.clone()), expected), numel
        x = torch.empty(64, 4096, device=device)
        graph = torch.cuda.CUDAGraph()
        all_reduce(x.normal_())  # (warm up outside the capture)
        with torch.cuda.graph(graph):
            all_reduce(x)
        for seed in (1, 2):
            x.copy_(torch.randn(64, 4096, generator=torch.Generator(device).manual_seed(
                10 * seed + rank), device=device))
            expected = x.clone()
            dist.all_reduce(expected)
            graph.replay()
            assert torch.equal(x, expected), seed
    finally:
        dist.destroy_process_group()
