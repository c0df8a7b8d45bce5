"""Bad set-ups and bad calls get an error naming the file, option, prompt or message, raised
before any costly work; the CLI prints them as one line with exit code 2."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from nanofn import LLM, SamplingParams
from nanofn.cli import main
from nanofn.engine.engine import TOKENIZER_FILES


@pytest.fixture
def model_copy(tiny_qwen3, tmp_path):
    def copy(name: str):
        folder = tmp_path / name
        shutil.copytree(tiny_qwen3, folder)
        return folder
    return copy


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def weights_never_load(monkeypatch):
    import nanofn.runner.model_runner as model_runner

    def refuse(*args):
        raise AssertionError("the weights were loaded before the set-up was checked")
    monkeypatch.setattr(model_runner, "load_weights", refuse)


def test_a_config_that_is_not_json_names_the_file(model_copy, capsys):
    folder = model_copy("bad-config")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(OSError, match="config.json"):
        LLM(str(folder))
    assert main(["generate", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("problem", ["max_model_len", "config.json"])
def test_serve_says_an_error_of_the_engine_process_in_one_line(model_copy, problem):
    """The engine is built in a process of its own: its set-up error still reaches the user
    as the command's one line, before the server listens, not as a traceback or a hang."""
    folder = model_copy("serve")
    flags = ["--max-model-len", "100000000"]
    if problem == "config.json":
        (folder / "config.json").write_text("{not json")
        flags = []
    done = subprocess.run([sys.executable, "-m", "nanofn", "serve", str(folder), "--port", "9",
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("nanofn serve: error: ") and done.stderr.count("\n") == 1
    assert problem in done.stderr, done.stderr


def test_a_truncated_weights_file_names_the_file(model_copy):
    folder = model_copy("truncated")
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"cannot read weights file {weights}"):
        LLM(str(folder))


def test_a_folder_without_a_tokenizer_or_a_missing_tokenizer_folder(model_copy, tiny_qwen3,
                                                                   monkeypatch):
    weights_never_load(monkeypatch)
    folder = model_copy("no-tokenizer")
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "merges.txt",
                 "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="has no tokenizer .*pass tokenizer=FOLDER"):
        LLM(str(folder))
    with pytest.raises(FileNotFoundError, match="tokenizer folder '/nonexistent' does not"):
        LLM(str(tiny_qwen3), tokenizer="/nonexistent")


def test_a_device_or_backend_this_machine_lacks(tiny_qwen3, monkeypatch):
    import torch

    weights_never_load(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees 0 CUDA GPU"):
        LLM(str(tiny_qwen3), device="cuda")
    for backend in ("triton", "flash"):
        with pytest.raises(ValueError, match=f"kernel_backend '{backend}' needs a CUDA device"):
            LLM(str(tiny_qwen3), kernel_backend=backend)


def test_a_kv_cache_too_small_for_one_sequence_is_said_before_loading(tiny_qwen3, monkeypatch):
    weights_never_load(monkeypatch)
    with pytest.raises(ValueError, match="2 blocks of 16 tokens cannot hold one sequence"):
        LLM(str(tiny_qwen3), num_kv_blocks=2, max_model_len=512)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len 512"):
        LLM(str(tiny_qwen3), kv_cache_memory_bytes=1000, max_model_len=512)


@pytest.mark.parametrize("prompts, error, message", [
    (123, TypeError, "prompts must be .* got int"),
    (b"hi", TypeError, "got bytes"),
    (["fine", 4.5], ValueError, "prompt 1: a prompt must be .* got float"),
])
def test_prompts_that_are_not_prompts(llm, prompts, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_given_as_a_dict(llm):
    with pytest.raises(TypeError, match=r"got dict \(SamplingParams\(\*\*d\) makes one"):
        llm.generate("hi", {"max_tokens": 3}, use_tqdm=False)


@pytest.mark.parametrize("messages, error, message", [
    ("hello", TypeError, "messages must be a list of"),
    ([{"content": "hi"}], ValueError, "message 0 has no 'role'"),
    ([[{"role": "user", "content": "a"}], [{"role": "user"}]], ValueError,
     "message 0 of conversation 1 has no 'content'"),
])
def test_chat_messages_that_are_not_messages(llm, messages, error, message):
    with pytest.raises(error, match=message):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_start_that_fails_after_the_weights_loaded_lets_them_go(tiny_qwen3, monkeypatch):
    """The exception's traceback keeps the half-built runner's frame; its weights must not be
    kept with it (on a GPU that held the memory until the process ended)."""
    import gc
    import weakref

    import nanofn.runner.model_runner as model_runner

    built = []
    build_model = model_runner.build_model

    def recording_build_model(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    def failing_blocks(self):
        raise RuntimeError("no memory for the KV cache")

    monkeypatch.setattr(model_runner, "build_model", recording_build_model)
    monkeypatch.setattr(model_runner.ModelRunner, "_decide_cache_sizes", failing_blocks)
    with pytest.raises(RuntimeError, match="no memory for the KV cache") as failure:
        LLM(str(tiny_qwen3), max_model_len=256)
    gc.collect()
    assert failure.value.__traceback__ is not None  # still held, as a caller would
    assert built and built[0]() is None, "the model's weights outlived the failed start"
