"""Trace tools: ``replay(path)``, ``nanofn diff``, ``replay --step N --check`` and
``replay --plot``, on runs recorded with a tiny model."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from nanofn.cli import main
from nanofn.state import (TraceError, diff_traces, parse_trace, plan_digest, read_trace, replay,
                          run_series)

ROOT = Path(__file__).parent.parent
# Three prompts that outgrow 6 KV blocks together (the run preempts), not 64.
PROMPTS = ["Once upon a time there was a little engine",
           "The quick brown fox jumps over the lazy dog.",
           "Tell me a story about a cat, a dog and a bird"]
SHARED = "You are a helpful assistant. Answer briefly and precisely, in one sentence. "
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Who wrote Hamlet?",
             "What is two plus two?", "Name a colour.", "Where is Peru?"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what recording a trace printed
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def record(tiny_qwen3, tmp_path_factory):
    """``record(name, *flags, prompts=PROMPTS)``: the trace of a greedy ``generate`` run of 30
    tokens per prompt (a later flag overrides an earlier one), recorded once per module."""
    folder = tmp_path_factory.mktemp("traces")
    recorded: dict[str, Path] = {}

    def make(name: str, *flags: str, prompts: list[str] = PROMPTS) -> Path:
        if name not in recorded:
            path = folder / f"{name}.jsonl"
            argv = ["generate", str(tiny_qwen3), "--max-model-len", "64", "--max-tokens", "30",
                    "--ignore-eos", "--temperature", "0", "--trace", str(path), *flags]
            for prompt in prompts:
                argv += ["--prompt", prompt]
            assert main(argv) == 0
            recorded[name] = path
        return recorded[name]

    return make


@pytest.fixture
def roomy(record):
    return record("roomy", "--num-kv-blocks", "64")


@pytest.fixture
def crowded(record):
    return record("crowded", "--num-kv-blocks", "6")


@pytest.fixture
def busy(record):
    """Six prompts sharing a prefix of several blocks, four at a time, in a cache of 12
    blocks: prefix-cache hits and preemptions."""
    return record("busy", "--num-kv-blocks", "12", "--max-num-seqs", "4", "--max-model-len",
                  "128", prompts=[SHARED + q for q in QUESTIONS])


def edited(path: Path, tmp_path: Path, index: int, edit) -> Path:
    """A copy of the trace at ``path`` with its line ``index`` (0: the header) edited."""
    lines = path.read_text().splitlines()
    lines[index] = json.dumps(edit(json.loads(lines[index])))
    copy = tmp_path / f"edited-{path.name}"
    copy.write_text("\n".join(lines) + "\n")
    return copy


def first_step(path: Path, condition) -> int:
    return next(plan.step for state, plan in replay(path) if condition(state, plan))


# --- replay(path) ---------------------------------------------------------------------------

def test_replay_takes_a_path_as_text_or_a_path_object_or_a_parsed_trace(roomy):
    with open(roomy) as f:
        parsed = [plan_digest(plan) for _, plan in replay(parse_trace(f), check=True)]
    assert len(parsed) == len(roomy.read_text().splitlines()) - 1
    assert [plan_digest(plan) for _, plan in replay(str(roomy), check=True)] == parsed
    assert [plan_digest(plan) for _, plan in replay(roomy)] == parsed


def test_replay_of_a_bad_path_fails_at_the_call_naming_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError):
        replay(tmp_path / "missing.jsonl")  # at the call, not at the first step
    (tmp_path / "not-a-trace.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(TraceError, match="not a nanofn-trace header"):
        replay(str(tmp_path / "not-a-trace.jsonl"))
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="binary.jsonl is not a text file"):
        read_trace(tmp_path / "binary.jsonl")
    with pytest.raises(TypeError, match="a Trace or the path of a trace file, not int"):
        replay(42)


# --- diff -----------------------------------------------------------------------------------

def test_two_recordings_of_the_same_run_are_identical(record, roomy, capsys):
    again = record("roomy-again", "--num-kv-blocks", "64")
    code, out, _ = run(capsys, "diff", str(roomy), str(again))
    steps = len(roomy.read_text().splitlines()) - 1
    assert code == 0
    assert out.splitlines()[2] == (f"identical: the same settings and the same {steps} steps "
                                   f"(plans and delivered tokens)")


def test_diff_finds_a_changed_sampled_token_at_its_step(roomy, tmp_path, capsys):
    lines = roomy.read_text().splitlines()
    index = [i for i, line in enumerate(lines[1:], 1) if json.loads(line).get("sampled")][10]
    row = json.loads(lines[index])
    old = row["sampled"][1]
    new = (old + 1) % 50
    changed = edited(roomy, tmp_path, index, lambda r: {**r, "sampled": [
        r["sampled"][0], new, *r["sampled"][2:]]})
    code, out, _ = run(capsys, "diff", str(roomy), str(changed))
    assert code == 1
    assert "settings differ" not in out
    assert f"first difference at step {row['step']} (line {index + 1} of A" in out
    delivered = out.split("  delivered tokens:\n", 1)[1].splitlines()
    assert len(re.findall(r"^ +\*seq \S+ ", "\n".join(delivered[:3]), re.M)) == 1
    assert re.match(rf" +\*seq \S+ +{old} +{new}$", delivered[0]), delivered[0]


def test_diff_finds_a_changed_block_size_where_the_blocks_first_differ(record, roomy, capsys):
    wide = record("wide", "--num-kv-blocks", "64", "--block-size", "32")
    # The prompts (21 to 26 tokens) fit one block of 32 tokens but take two of 16: the plans
    # part at the first step that gives a sequence of A a second block.
    expected = first_step(roomy, lambda state, plan: (plan.block_entries[:, 1] >= 1).any())
    code, out, _ = run(capsys, "diff", str(roomy), str(wide))
    assert code == 1
    assert "settings differ:\n  block_size: 16 in A, 32 in B\n" in out
    assert f"first difference at step {expected} " in out
    plans = out.split("  plans:\n", 1)[1]
    assert re.search(r"^ +\*seq \S+ .* new blocks \[0:\d+, 1:\d+\] +\S+ tokens .* new blocks "
                     r"\[0:\d+\]$", plans, re.M), plans


def test_diff_finds_the_preemption_of_a_crowded_run(roomy, crowded, capsys):
    expected = first_step(crowded, lambda state, plan: state.preempted)
    victims = next(state.preempted for state, plan in replay(crowded) if plan.step == expected)
    code, out, _ = run(capsys, "diff", str(roomy), str(crowded))
    assert code == 1
    assert "  num_blocks: 64 in A, 6 in B\n" in out
    assert f"first difference at step {expected} " in out
    assert re.search(rf"^  \*preempted +none +{' '.join(victims)}$", out, re.M)
    side_by_side = out.split("side by side", 1)[1]
    assert re.search(rf"^  \*seq {victims[0]} +status +running +waiting$", side_by_side, re.M)
    assert re.search(r"^  \*block pool +blocks +\d+ owned", side_by_side, re.M)


def test_diff_of_a_trace_cut_short_names_the_step_where_one_ends(roomy, tmp_path, capsys):
    lines = roomy.read_text().splitlines()
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(lines[:-3]) + "\n")
    code, out, _ = run(capsys, "diff", str(roomy), str(short))
    assert code == 1
    step = json.loads(lines[-3])["step"]
    assert f"first difference at step {step}: trace B has ended; trace A goes on (line " in out


def test_diff_as_a_function_reports_the_settings_and_the_step(roomy, crowded):
    diff = diff_traces(read_trace(roomy), read_trace(crowded))
    assert diff.header == (("num_blocks", 64, 6),) and not diff.identical
    assert diff.step.a.state.preempted == () and diff.step.b.state.preempted
    assert diff_traces(read_trace(roomy), read_trace(roomy)).identical


def test_diff_of_an_unreadable_or_broken_trace_exits_2(roomy, tmp_path, capsys):
    (tmp_path / "garbage.jsonl").write_text("not json\n")
    for bad in (tmp_path / "missing.jsonl", tmp_path / "garbage.jsonl"):
        code, out, err = run(capsys, "diff", str(roomy), str(bad))
        assert code == 2 and out == ""
        assert err.startswith(f"nanofn diff: error: cannot read trace {bad}: ")
    index = next(i for i, line in enumerate(roomy.read_text().splitlines()[1:], 1)
                 if json.loads(line).get("sampled"))
    refused = edited(roomy, tmp_path, index, lambda r: {**r, "sampled": r["sampled"] + [1]})
    code, _, err = run(capsys, "diff", str(refused), str(roomy))
    assert code == 2 and f"cannot replay trace A, line {index + 1}: " in err
    assert err.count("\n") == 1


# --- replay --step N --check ----------------------------------------------------------------

def test_step_and_check_together_check_the_steps_up_to_n(roomy, tmp_path, capsys):
    code, out, _ = run(capsys, "replay", str(roomy), "--step", "5", "--check")
    assert code == 0
    assert out.startswith("state after step 5 of ") and out.endswith("trace OK up to step 5\n")
    early = edited(roomy, tmp_path, 3, lambda r: {**r, "plan": "0" * 16})
    code, out, err = run(capsys, "replay", str(early), "--step", "5", "--check")
    assert code == 1 and "line 4: step 3 replayed differs" in err and out == ""
    late = edited(roomy, tmp_path, 8, lambda r: {**r, "plan": "0" * 16})
    assert run(capsys, "replay", str(late), "--step", "5", "--check")[0] == 0
    assert run(capsys, "replay", str(late), "--check")[0] == 1


def test_the_listing_shows_the_n_sequences_of_a_request_as_request_colon_index(record, capsys):
    trace = record("two-samples", "--num-kv-blocks", "64", "--n", "2", "--seed", "1",
                   "--temperature", "1", prompts=PROMPTS[:1])
    code, out, _ = run(capsys, "replay", str(trace))
    assert code == 0
    assert re.search(r" 0:0@\d+\+\d+\*", out) and re.search(r" 0:1@\d+\+\d+\*", out)
    code, out, _ = run(capsys, "replay", "--help")
    flat = " ".join(out.split())
    assert "ids REQUEST:INDEX, so 0:1@12+1* is the second sample of request 0" in flat


# --- the series behind the plot -------------------------------------------------------------

def test_run_series_reads_each_step_off_its_state_and_plan(busy):
    pairs = list(replay(busy))
    series = run_series(pairs)
    assert series.steps == tuple(plan.step for _, plan in pairs)
    assert series.num_blocks == 12
    for i, (state, plan) in enumerate(pairs):
        assert series.running[i] == len(state.running)
        assert series.waiting[i] == len(state.waiting)
        assert series.blocks_used[i] == sum(count > 0 for count in state.pool.ref_counts)
        assert series.blocks_cached[i] == len(list(state.pool.cached_free()))
        assert series.blocks_used[i] + series.blocks_cached[i] + series.blocks_free[i] == 12
        assert series.prefill_tokens[i] + series.decode_tokens[i] == int(
            plan.num_scheduled.sum())
        assert series.preemptions[i] == len(state.preempted)
    final = pairs[-1][0].counters
    assert sum(series.preemptions) == final.num_preemptions > 0
    assert sum(series.cached_tokens) == final.num_cached_tokens > 0
    # A hit is counted at the step that admits the sequence, and covers its whole blocks.
    admitted = {}
    for state, plan in pairs:
        for seq in state.running:
            if seq.num_cached_tokens and seq.seq_id not in admitted:
                admitted[seq.seq_id] = plan.step
    hit_steps = {s for s, n in zip(series.steps, series.cached_tokens) if n}
    assert set(admitted.values()) <= hit_steps
    assert all(n % 16 == 0 for n in series.cached_tokens)


def test_run_series_of_no_steps_is_empty():
    series = run_series([])
    assert series.steps == () and series.running == () and series.cached_tokens == ()


# --- replay --plot --------------------------------------------------------------------------

def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_draws_a_png_of_the_run(busy, tmp_path, capsys):
    picture = tmp_path / "busy.png"
    code, out, _ = run(capsys, "replay", str(busy), "--plot", str(picture), "--check")
    steps = len(busy.read_text().splitlines()) - 1
    assert code == 0 and out == f"wrote {picture}: {steps} steps, trace OK\n"
    assert png_size(picture) == (1000, 750)
    svg = tmp_path / "busy.svg"
    assert run(capsys, "replay", str(busy), "--plot", str(svg))[0] == 0
    text = svg.read_text()
    for label in ("running", "waiting", "preemption", "owned", "free", "prefill", "decode",
                  "prefix-cache hit", f"{steps} steps, 12 KV blocks"):
        assert label in text, label


def test_plot_refuses_an_unknown_format_an_unwritable_path_or_an_empty_trace(busy, tmp_path,
                                                                            capsys):
    code, _, err = run(capsys, "replay", str(busy), "--plot", str(tmp_path / "run.bmp"))
    assert code == 2 and "the file's suffix chooses the format, one of .png, .svg, .pdf" in err
    code, _, err = run(capsys, "replay", str(busy), "--plot", str(tmp_path / "no" / "run.png"))
    assert code == 2 and err.startswith("nanofn replay: error: cannot write ")
    header_only = tmp_path / "header-only.jsonl"
    header_only.write_text(busy.read_text().splitlines()[0] + "\n")
    code, _, err = run(capsys, "replay", str(header_only), "--plot", str(tmp_path / "run.png"))
    assert code == 2 and "has no steps to draw" in err


def test_plot_without_matplotlib_names_the_extra(busy, tmp_path, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "nanofn.cli.plot", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    code, _, err = run(capsys, "replay", str(busy), "--plot", str(tmp_path / "run.png"))
    assert code == 2 and "--plot needs matplotlib" in err
    assert "pip install 'nanofn[plot]'" in err and not (tmp_path / "run.png").exists()


def test_the_readme_shows_the_picture_of_a_run():
    readme = (ROOT / "README.md").read_text()
    picture = ROOT / "docs" / "run.png"
    assert "![" in readme and "(docs/run.png)" in readme
    assert "nanofn replay run.jsonl --plot run.png" in readme
    assert png_size(picture)[0] >= 800 and picture.stat().st_size < 150_000


def test_diff_help_names_its_exit_codes(capsys):
    code, out, _ = run(capsys, "diff", "--help")
    flat = " ".join(out.split())
    assert code == 0 and "A B" in flat
    assert "Exit code 0 when the traces are identical, 1 when they differ, 2 when" in flat


def test_diff_and_replay_import_neither_torch_nor_matplotlib(roomy):
    code = ("import contextlib, io, sys; from nanofn.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    codes = main(['diff', {str(roomy)!r}, {str(roomy)!r}]), "
            f"main(['replay', {str(roomy)!r}, '--check'])\n"
            "print(codes, 'torch' in sys.modules, 'matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=ROOT)
    assert result.stdout.strip() == "(0, 0) False False"


# --- a hybrid model's traces: the state slots ------------------------------------------------

@pytest.fixture(scope="module")
def hybrid_trace(tiny_checkpoint, tmp_path_factory):
    """``trace(name, *flags)``: a greedy run of the tiny Qwen3.5 on prompts behind one shared
    prefix, one after another (the later ones start from the state saved where it ends)."""
    folder = tmp_path_factory.mktemp("hybrid-traces")
    model = tiny_checkpoint("qwen3_5")

    def make(name: str, *flags: str) -> Path:
        path = folder / f"{name}.jsonl"
        if not path.exists():
            argv = ["generate", str(model), "--max-model-len", "128", "--max-tokens", "8",
                    "--ignore-eos", "--temperature", "0", "--max-num-seqs", "2",
                    "--trace", str(path), *flags]
            for question in QUESTIONS[:4]:
                argv += ["--prompt", SHARED + question]
            assert main(argv) == 0
        return path

    return make


def test_a_hybrid_trace_shows_its_state_slots_step_by_step(hybrid_trace, capsys):
    path = hybrid_trace("slots", "--num-state-slots", "6")
    code, out, _ = run(capsys, "replay", str(path), "--check")
    assert code == 0 and "trace OK" in out
    code, out, _ = run(capsys, "replay", str(path))
    lines = out.splitlines()
    restoring = next(line for line in lines if "restore " in line)
    saving = next(line for line in lines if " save " in line or "| save" in line)
    step = int(re.match(r"step (\d+):", restoring).group(1))
    code, out, _ = run(capsys, "replay", str(path), "--step", str(step))
    assert code == 0
    assert re.search(r"state slots: 6 slots, \d+ working, \d+ saved, \d+ free", out)
    assert "saved (slot:tokens), first evicted first: [" in out
    assert "recurrent states: restore " in out and ", state slot " in out
    assert re.search(r"save \S+@\d+->\d+", saving)


def test_a_hybrid_trace_diffs_and_plots_its_state_slots(hybrid_trace, tmp_path, capsys):
    six, three = hybrid_trace("six", "--num-state-slots", "6"), hybrid_trace(
        "three", "--num-state-slots", "3")
    code, out, _ = run(capsys, "diff", str(six), str(three))
    assert code == 1
    assert re.search(r"num_state_slots: 6 in A, 3 in B", out)
    assert "state slots" in out
    series = run_series(replay(read_trace(six)))
    assert series.num_state_slots == 6
    assert all(w + s + f == 6 for w, s, f in zip(series.states_working, series.states_saved,
                                                  series.states_free))
    assert max(series.states_saved) > 0
    picture = tmp_path / "run.png"
    code, out, _ = run(capsys, "replay", str(six), "--plot", str(picture))
    assert code == 0 and picture.stat().st_size > 0
