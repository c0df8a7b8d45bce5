"""Two GPUs, beyond one engine on one GPU: two "hosts" of one GPU each (a ``nanofn worker`` that
sees only the second GPU) give the tokens of TP=2 on one host and of TP=1; so does a
mixture-of-experts model's expert parallelism; ``serve
--data-parallel-size 2`` puts one replica on each GPU and both answer with one engine's tokens;
the all-reduce through peer memory sums as NCCL does, eagerly and from a CUDA graph, and so
does the norm that adds up two ranks' summands itself.
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
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels.all_reduce import PeerAllReduce, ranks_all_reduce
from nanofn.kernels.partial_sums import RankSums

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


def test_expert_parallel_gives_the_tokens_of_tp2_on_two_gpus(tiny_checkpoint):
    """A mixture-of-experts model with each GPU holding half the experts (float32) decodes as
    with each holding half of every expert, and as one GPU."""
    sparse = tiny_checkpoint("qwen3_moe")
    expert_parallel = tokens(sparse, tensor_parallel_size=2, enable_expert_parallel=True)
    assert expert_parallel == tokens(sparse, tensor_parallel_size=2)
    assert expert_parallel == tokens(sparse)


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


def test_the_norm_adds_up_two_ranks_summands_over_peer_memory(tmp_path):
    """A summand for a norm (``for_norm``) comes back as ``RankSums``; the Triton norm of it
    equals, bit for bit, the norm of NCCL's sum, on both ranks: eagerly at 1, 256 and 1,024
    rows, and replayed from a CUDA graph that holds two of them in a row (a layer's), with
    new contents each time."""
    mp.spawn(_norm_on_rank, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _norm_on_rank(rank: int, store_file: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank, world_size=2)
    hidden, dtype = 4096, torch.bfloat16

    def draw(rows, seed):
        generator = torch.Generator(device).manual_seed(seed)
        return torch.randn(rows, hidden, generator=generator, device=device).to(dtype)

    def expected(x, residual):
        total = x.clone()
        dist.all_reduce(total)
        return triton_ops.rms_norm(total, weight, 1e-6, residual)

    try:
        all_reduce = ranks_all_reduce(device, dtype)
        weight = draw(1, 7)[0].abs() + 0.5
        for rows in (1, 256, 1024):
            x, residual = draw(rows, rank), draw(rows, 9)
            summands = all_reduce(x.clone(), for_norm=True)
            assert isinstance(summands, RankSums)
            out, summed = triton_ops.rms_norm(summands, weight, 1e-6, residual)
            want, want_summed = expected(x, residual)
            assert torch.equal(summed, want_summed) and torch.equal(out, want), rows
        x, residual = draw(64, rank), draw(64, 9)
        static_x = x.clone()

        def layer():
            out, summed = triton_ops.rms_norm(all_reduce(static_x.clone(), for_norm=True),
                                              weight, 1e-6, residual)
            return triton_ops.rms_norm(all_reduce(out * 0.5, for_norm=True), weight, 1e-6,
                                       summed)

        layer()  # (warm up outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = layer()
        for seed in (1, 2, 3):
            static_x.copy_(draw(64, 10 * seed + rank))
            out, summed = expected(static_x, residual)
            want = expected(out * 0.5, summed)
            graph.replay()
            assert all(torch.equal(g, w) for g, w in zip(graphed, want)), seed
    finally:
        dist.destroy_process_group()
        torch.cuda.empty_cache()


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
