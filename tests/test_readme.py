"""The README as a newcomer meets it: its two set-up commands are the ones CI runs, word for
word; its Python examples run as written on the demo model; ``nanofn serve`` says where it
listens and answers the README's client code; the trace walkthrough's commands print what it
shows."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

import nanofn
from nanofn.cli import main

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"  # where the README's client code finds `nanofn serve`


def code_blocks(markdown: str) -> list[str]:
    return [block.split("\n", 1)[1].strip() for block in markdown.split("```")[1::2]]


def python_blocks(markdown: str) -> list[str]:
    return [block.split("\n", 1)[1] for block in markdown.split("```")[1::2]
            if block.startswith("python\n")]


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_the_readme_commands_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = code_blocks(section("Two commands"))
    assert "takes about 20 minutes on a 2-core machine" in " ".join(section("Two commands").split())
    assert len(commands) == 2
    demo, tests = commands
    assert "nanofn generate" in demo and "pytest" in tests
    assert demo in ci and tests in ci


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """A home folder whose ``~/.cache/nanofn`` (the README's cache) holds the demo model."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.delenv("NANOFN_CACHE", raising=False)
        nanofn.demo_model()
    return home


@pytest.fixture
def env(home) -> dict[str, str]:
    """The environment of a command run as the README's reader runs it, from the checkout."""
    env = {name: value for name, value in os.environ.items() if name != "NANOFN_CACHE"}
    return {**env, "HOME": str(home), "PYTHONPATH": str(ROOT)}


# --- Python ---------------------------------------------------------------------------------

def test_the_python_examples_run_as_written_on_the_demo_model(env, tmp_path):
    """Every Python block but the server's client, in order in one interpreter (the structured
    output example goes on with the first one's ``llm``)."""
    blocks = [block for block in python_blocks(README) if "OpenAI(" not in block]
    assert len(blocks) >= 2 and "demo_model()" in blocks[0]
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Hello, my name is -> " in done.stdout, done.stdout
    assert "The capital of France is -> " in done.stdout


def test_serve_says_where_it_listens_once_ready_and_answers_the_readmes_client(env, tmp_path):
    """``nanofn serve``, as the README starts it (on a free port): its line comes once it takes
    requests; the README's client code gets a completion; Ctrl-C (SIGINT to the process group,
    as a terminal sends it) stops it cleanly."""
    (client_code,) = [block for block in python_blocks(README) if "OpenAI(" in block]
    assert client_code.count(README_URL) == 1
    server = subprocess.Popen([sys.executable, "-m", "nanofn", "serve", "--port", "0",
                               "--num-kv-blocks", "64"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        line = _line_starting("serving ", server.stderr, timeout=240)
        url = re.fullmatch(r"serving demo-qwen3 at (http://127\.0\.0\.1:\d+)\n", line).group(1)
        assert httpx.get(f"{url}/health").status_code == 200  # no retry: it is ready
        assert httpx.get(f"{url}/version").json() == {"version": nanofn.__version__}
        done = subprocess.run([sys.executable, "-c", client_code.replace(README_URL, url)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    finally:
        os.killpg(server.pid, signal.SIGINT)
        out, err = server.communicate(timeout=120)
    assert server.returncode == 0 and out == "" and "Traceback" not in err, err


def _line_starting(prefix: str, stream, timeout: float) -> str:
    """The first line of ``stream`` that starts with ``prefix``; fails at its end or after
    ``timeout`` seconds."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream] + [lines.put("")],
                     daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no line starting with {prefix!r} in {timeout} s; got:\n{''.join(seen)}")
        if line.startswith(prefix):
            return line
        if not line:
            pytest.fail(f"the stream ended without a line starting with {prefix!r}:\n"
                        f"{''.join(seen)}")
        seen.append(line)


# --- the trace walkthrough ------------------------------------------------------------------

def shell_session(block: str) -> list[tuple[str, list[str]]]:
    """A console block's commands (``$ `` lines and their ``\\`` continuations), each with the
    output lines shown after it."""
    session: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            session.append((line[2:], []))
        elif session[-1][0].endswith("\\") and not session[-1][1]:
            session[-1] = (session[-1][0] + "\n" + line, [])
        else:
            session[-1][1].append(line)
    return session


def nanofn_calls(commands: list[str], cwd: Path) -> list[list[str]]:
    """The argument lists with which ``commands``, run by bash in turn, call ``nanofn``."""
    echo = "import json, sys; print(json.dumps(sys.argv[1:]))"
    function = f"nanofn() {{ '{sys.executable}' -c '{echo}' \"$@\"; }}"
    done = subprocess.run(["bash", "-c", "\n".join([function, *commands])], cwd=cwd,
                          capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


def shown_output(lines: list[str]) -> re.Pattern[str]:
    """A pattern of the output that the README shows: a line ``...`` stands for any lines, and
    ``...`` within a line for any text."""
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(re.escape(line.rstrip()).replace(re.escape("..."), r"[^\n]*") + "\n")
    return re.compile("".join(parts))


def test_shown_output_elides_lines_and_text_only_where_it_says_so():
    pattern = shown_output(["a", "...", "c ... e", "f"])
    assert pattern.fullmatch("a\nb\nb\nc d e\nf\n") and pattern.fullmatch("a\nc  e\nf\n")
    assert not pattern.fullmatch("a\nc d e\nf\ng\n")  # a line more at the end
    assert not pattern.fullmatch("x\na\nc d e\nf\n")  # or at the start
    assert not pattern.fullmatch("a\nc d e\nx\nf\n")  # or between shown lines


def test_the_trace_walkthrough_prints_what_the_readme_shows(home, tmp_path, monkeypatch, capsys):
    """Each command of "Debugging with a trace" runs as shown (on the demo model), and what it
    prints is what the README shows after it; roomy.jsonl comes from the walkthrough's own
    recipe."""
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NANOFN_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    text = section("Debugging with a trace")
    assert ("roomy.jsonl` is the\nsame `generate` command with a cache of 64 blocks "
            "(`--num-kv-blocks 64 --trace roomy.jsonl`)") in text
    assert "`nanofn replay walk.jsonl --check` replays all 55 steps" in text
    session = [step for block in code_blocks(text) if block.startswith("$ ")
               for step in shell_session(block)]
    calls = nanofn_calls([command for command, _ in session], tmp_path)
    shown = [lines for command, lines in session if command.startswith("nanofn ")]
    assert len(calls) == len(shown) >= 6
    for argv, lines in zip(calls, shown):
        code = main(argv)
        out = capsys.readouterr().out.replace(str(home), "~")
        assert code == (1 if argv[0] == "diff" else 0), argv  # the two traces differ
        if lines:
            printed = "".join(line.rstrip() + "\n" for line in out.splitlines())
            assert shown_output(lines).fullmatch(printed), (
                f"`nanofn {' '.join(argv)}` printed:\n{printed}\nthe README shows:\n"
                + "\n".join(lines))
        if argv[0] == "generate" and "walk.jsonl" in argv:
            roomy = list(argv)
            roomy[roomy.index("--num-kv-blocks") + 1] = "64"
            roomy[roomy.index("walk.jsonl")] = "roomy.jsonl"
            assert main(roomy) == 0
            capsys.readouterr()
    assert main(["replay", "walk.jsonl", "--check"]) == 0
    assert capsys.readouterr().out == "trace OK: 55 steps\n"


# --- benchmarks/ ----------------------------------------------------------------------------

def test_the_benchmark_scripts_are_listed_and_every_path_to_one_exists():
    """benchmarks/README.md names every script at the top of benchmarks/, RESULTS.md's
    "Experiments" section every one in experiments/, and each path to a script written in the
    repository's documents, code and tests is where it says."""
    benchmarks = ROOT / "benchmarks"
    scripts = {path.name for path in benchmarks.iterdir() if path.suffix in (".py", ".sh")}
    named = set(re.findall(r"`(\w+\.(?:py|sh))`", (benchmarks / "README.md").read_text()))
    assert named == scripts
    results = (benchmarks / "RESULTS.md").read_text()
    experiments = results.split("\n## Experiments (`benchmarks/experiments/`)\n", 1)[1]
    described = set(re.findall(r"^- `(\w+\.py)`: ", experiments.split("\n## ", 1)[0], re.M))
    assert described == {path.name for path in (benchmarks / "experiments").glob("*.py")}
    documents = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *benchmarks.rglob("*.md"),
                 *benchmarks.rglob("*.sh"), *benchmarks.rglob("*.py"),
                 *(path for folder in ("nanofn", "tests", "properties")
                   for path in (ROOT / folder).rglob("*.py"))]
    for document in documents:
        for path in re.findall(r"benchmarks/[a-z0-9_/]+\.(?:py|sh)", document.read_text()):
            assert (ROOT / path).is_file(), f"{document.relative_to(ROOT)} names {path}"
