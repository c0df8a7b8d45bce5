"""On a GPU: the CPU thread count is left alone, and `nanofn bench` shows a floor exactly where
it knows the GPU's rates. Skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from nanofn import LLM
from nanofn.cli import main
from nanofn.cli.bench import KNOWN_DEVICE_RATES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_gpu_engine_leaves_the_cpu_thread_count_alone(tiny_qwen3):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with LLM(str(tiny_qwen3), max_model_len=64, num_kv_blocks=16, enforce_eager=True,
                 cpu_threads=1) as llm:
            llm.generate(["Hello"], use_tqdm=False)
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_bench_shows_the_floor_only_on_a_gpu_whose_rates_it_knows(tiny_qwen3, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code = main(["bench", str(tiny_qwen3), "--num-seqs", "4", "--max-input-len", "40",
                 "--max-output-len", "8", "--max-model-len", "64", "--enforce-eager",
                 "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    figures = json.loads(report.read_text())
    assert figures["device"] == torch.cuda.get_device_name()
    assert "workload: 4 requests, prompts of U(1, 40) tokens, U(1, 8) output tokens each\n" in out
    if figures["device"] in KNOWN_DEVICE_RATES:
        bandwidth, tflops = KNOWN_DEVICE_RATES[figures["device"]]
        assert f"(at {bandwidth:g} GB/s, {tflops:g} TFLOP/s)" in out and "of the floor" in out
        assert figures["fraction_of_floor"] == pytest.approx(figures["floor_s"]
                                                             / figures["elapsed_s"])
    else:
        assert "no floor" in out and "fraction_of_floor" not in figures
