"""Clean runs on a CPU: no triton and no leak reports at exit, the CPU thread count, and a
`nanofn bench` sized for a CPU that shows a floor only for a device whose rates it knows."""

from __future__ import annotations

import gc
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanofn import LLM
from nanofn.cli import main
from nanofn.engine.options import EngineOptions
from nanofn.runner.model_runner import cpu_threads

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
        "print('triton loaded' if 'triton' in sys.modules else 'no triton', code)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "no triton 0"


def test_an_engine_left_open_gives_the_objects_it_froze_back_at_exit(tiny_qwen3):
    """The engine freezes what is alive when it starts (gc.freeze). Frozen objects escape even
    the collection at interpreter exit: with triton 3.9 imported, nanobind then reported
    hundreds of leaked objects. An object in a cycle stands in for theirs here."""
    result = run_python(
        "class Witness:\n"
        "    def __del__(self): print('witness collected', flush=True)\n"
        "witness = Witness(); witness.cycle = witness\n"
        "from nanofn import LLM\n"
        f"llm = LLM({str(tiny_qwen3)!r}, num_kv_blocks=8, max_model_len=64)\n"
        "llm.generate(['Hello'], use_tqdm=False)\n"
        "print('exiting', flush=True)\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["exiting", "witness", "collected"]
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
    def config(cpu_threads_option):
        return SimpleNamespace(cpu_threads=cpu_threads_option)

    assert cpu_threads(SimpleNamespace(hidden_size=1024), config(None)) is None
    assert cpu_threads(SimpleNamespace(hidden_size=64), config(None)) == 1
    assert cpu_threads(SimpleNamespace(hidden_size=4096), config(3)) == 3


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_a_bad_cpu_threads_value_is_an_error_naming_it(value):
    with pytest.raises(ValueError, match=f"cpu_threads must be a positive integer or None, "
                                         f"got {value!r}"):
        EngineOptions(model="m", cpu_threads=value)
