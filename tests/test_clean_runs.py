"""Clean runs on a CPU: no triton and no leak reports at exit, the CPU thread count, and a
`nanofn bench` sized for a CPU that shows a floor only for a device whose rates it knows."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from nanofn import LLM
from nanofn.cli import main

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
