"""Clean runs on a CPU: no triton and no leak reports at exit, the CPU thread count, and a
`nanofn bench` sized for a CPU that shows a floor only for a device whose rates it knows."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import pytest
import torch

from nanofn import LLM
from nanofn.cli import main
from nanofn.cli.bench import (CPU_SIZES, DEFAULT_BANDWIDTH_GBPS, DEFAULT_TFLOPS, STANDARD_SIZES,
                              device_rates)
from nanofn.engine.options import EngineOptions

H100 = "NVIDIA H100 80GB HBM3"
SMALL_ENGINE = ["--num-kv-blocks", "40", "--max-model-len", "128"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --- exit -----------------------------------------------------------------------------------

def test_a_cpu_generate_imports_no_triton(tiny_qwen3):
    result = run_python(
        "import sys; from nanofn.cli import main; "
        f"code = main(['generate', {str(tiny_qwen3)!r}, '--max-tokens', '3']); "
        "print([m for m in ('triton', 'flash_attn') if m in sys.modules], code)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[] 0"


def test_an_engine_left_open_gives_the_objects_it_froze_back_at_exit(tiny_qwen3):
    """The engine freezes what is alive when it starts (gc.freeze). Frozen objects escape even
    the collection at interpreter exit: with triton 3.9 imported, nanobind then reported
    hundreds of leaked objects. An exit handler registered first (so it runs last) finds
    nothing frozen any more. (An object in a cycle held by ``__main__`` cannot stand in for
    theirs: with dill installed, which torch imports, ``__main__`` outlives the collection.)"""
    result = run_python(
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count(), flush=True))\n"
        "from nanofn import LLM\n"
        f"llm = LLM({str(tiny_qwen3)!r}, num_kv_blocks=8, max_model_len=64)\n"
        "llm.generate(['Hello'], use_tqdm=False)\n"
        "print('frozen while running', gc.get_freeze_count() > 0, flush=True)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["frozen while running True", "frozen at exit 0"]
    assert "leaked" not in result.stderr


def test_closing_an_engine_unfreezes_what_it_froze(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), num_kv_blocks=8, max_model_len=64)
    assert gc.get_freeze_count() > 0
    llm.close()
    assert gc.get_freeze_count() == 0
    llm.close()  # closing twice is harmless


# --- CPU threads ----------------------------------------------------------------------------

def test_a_small_model_runs_on_one_cpu_thread_by_default(tiny_qwen3, restore_threads):
    torch.set_num_threads(2)
    with LLM(str(tiny_qwen3), num_kv_blocks=8, max_model_len=64):
        assert torch.get_num_threads() == 1


def test_the_cpu_threads_option_sets_torchs_thread_count(tiny_qwen3, restore_threads):
    torch.set_num_threads(1)
    with LLM(str(tiny_qwen3), num_kv_blocks=8, max_model_len=64, cpu_threads=2):
        assert torch.get_num_threads() == 2


def test_the_cpu_threads_flag_reaches_the_engine(tiny_qwen3, restore_threads, capsys):
    torch.set_num_threads(1)
    code, out, _ = run(capsys, "generate", str(tiny_qwen3), "--max-tokens", "2",
                       "--cpu-threads", "2", *SMALL_ENGINE)
    assert code == 0 and "Prompt 0" in out
    assert torch.get_num_threads() == 2


def test_a_wider_model_keeps_torchs_default_unless_asked():
    assert EngineOptions(model="m").cpu_threads_for(hidden_size=1024) is None
    assert EngineOptions(model="m").cpu_threads_for(hidden_size=64) == 1
    assert EngineOptions(model="m", cpu_threads=3).cpu_threads_for(hidden_size=4096) == 3


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_a_bad_cpu_threads_value_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=f"cpu_threads must be a positive integer or None, "
                                         f"got {value!r}"):
        EngineOptions(model="m", cpu_threads=value)


# --- bench ----------------------------------------------------------------------------------

def test_bench_on_a_cpu_defaults_to_a_small_workload_with_no_floor(tmp_path, monkeypatch,
                                                                   capsys):
    """No model and no sizes: the demo model and the CPU workload (made smaller here, so that
    the test stays quick)."""
    monkeypatch.setenv("NANOFN_CACHE", str(tmp_path))
    monkeypatch.setitem(CPU_SIZES, "num_seqs", 3)
    monkeypatch.setitem(CPU_SIZES, "max_input_len", 30)
    monkeypatch.setitem(CPU_SIZES, "max_output_len", 5)
    report = tmp_path / "bench.json"
    code, out, err = run(capsys, "bench", "--json", str(report))
    assert code == 0, err
    assert ("workload: 3 requests, prompts of U(1, 30) tokens, U(1, 5) output tokens each "
            "(the CPU default)") in out
    assert "demo-qwen3" in out and "on cpu" in out
    assert "no floor: the rates of this device (cpu) are not known" in out
    assert "of the floor" not in out
    figures = json.loads(report.read_text())
    assert figures["num_requests"] == 3 and figures["workload"] == CPU_SIZES
    assert "fraction_of_floor" not in figures and "floor_s" not in figures


def test_bench_on_a_cpu_shows_a_floor_for_rates_given(tiny_qwen3, tmp_path, capsys):
    report = tmp_path / "bench.json"
    code, out, _ = run(capsys, "bench", str(tiny_qwen3), "--num-seqs", "2", "--max-input-len",
                       "20", "--max-output-len", "4", "--bw", "50", "--tflops", "1",
                       "--json", str(report), *SMALL_ENGINE)
    assert code == 0
    assert "workload: 2 requests, prompts of U(1, 20) tokens, U(1, 4) output tokens each\n" in out
    assert "(at 50 GB/s, 1 TFLOP/s)" in out and "of the floor" in out
    figures = json.loads(report.read_text())
    assert figures["bw_gbps"] == 50 and figures["tflops"] == 1
    assert figures["fraction_of_floor"] == pytest.approx(figures["floor_s"]
                                                         / figures["elapsed_s"])


def test_bench_with_one_rate_on_a_cpu_still_shows_no_floor(tiny_qwen3, capsys):
    code, out, _ = run(capsys, "bench", str(tiny_qwen3), "--num-seqs", "1", "--max-input-len",
                       "8", "--max-output-len", "2", "--bw", "50", *SMALL_ENGINE)
    assert code == 0 and "no floor" in out and "of the floor" not in out


def test_the_floor_uses_the_rates_given_else_the_devices_measured_ones():
    assert device_rates(H100, None, None) == (DEFAULT_BANDWIDTH_GBPS, DEFAULT_TFLOPS)
    assert device_rates(H100, 2000.0, None) == (2000.0, DEFAULT_TFLOPS)
    assert device_rates("cpu", None, None) is None
    assert device_rates("NVIDIA B200", None, 900.0) is None
    assert device_rates("NVIDIA B200", 8000.0, 2250.0) == (8000.0, 2250.0)


def test_the_standard_workload_stays_the_default_on_a_gpu():
    from nanofn.cli import _workload_sizes

    none_given = argparse.Namespace(num_seqs=None, max_input_len=None, max_output_len=None,
                                    workload="standard")
    assert _workload_sizes(none_given, H100) == STANDARD_SIZES == {
        "num_seqs": 256, "max_input_len": 1024, "max_output_len": 1024}
    assert _workload_sizes(none_given, "cpu") == CPU_SIZES
    some_given = argparse.Namespace(num_seqs=8, max_input_len=None, max_output_len=None,
                                    workload="standard")
    assert _workload_sizes(some_given, "cpu") == {**CPU_SIZES, "num_seqs": 8}
