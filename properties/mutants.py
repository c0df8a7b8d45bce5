"""Mutation harness, a developer tool (not a test): plants each bug of ``MUTANTS`` in a copy of
the tree, one at a time, runs the property suite on the copy, and reports which property caught
it, if any. Every mutant here should be caught in every run.

    python -m properties.mutants [--runs N] [--only NAME ...] [--all-tests]

Each mutant is a small textual patch of ``nanofn/state`` or ``nanofn/engine/loop.py``: one
piece of text, found exactly once, replaced by another. The suite runs with its default profile
in a fresh copy, and, through this module as a pytest plugin, without Hypothesis's example
database (no run replays another's failure) and without shrinking (a caught bug needs no
minimal example here); it stops at its first failure unless ``--all-tests``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository's root
    old: str
    new: str
    what: str


MUTANTS = (
    Mutant("failed-launch-not-dirty", "nanofn/engine/loop.py",
           "                self._dirty.extend(plan.block_entries[:, 2].tolist())\n", "",
           "a failed launch's blocks are not marked dirty"),
    Mutant("admits-after-preempting", "nanofn/state/scheduler.py",
           "while (not victims and waiting and budget > 0", "while (waiting and budget > 0",
           "admission in a step that preempted"),
    Mutant("preempted-head-first", "nanofn/state/scheduler.py",
           "pool.release(batch.table(i)[::-1])", "pool.release(batch.table(i))",
           "a preempted sequence's blocks freed head first"),
    Mutant("cached-before-computed", "nanofn/state/filled.py",
           "computed = min(count, num_computed // block_size - first)", "computed = count",
           "a block that a leaving sequence's last token filled enters the prefix cache, "
           "before any launch computes that position"),
    Mutant("no-fill-mark-check", "nanofn/state/store.py",
           "(key is self.owner or bool((self.filled[kind][rows] == lengths).all()))", "True",
           "the store's fill-mark check (a state stepped twice writes over another's view)"),
    Mutant("decode-step-ignores-owner", "nanofn/state/decode.py",
           "\n            or store.owner is not batch.write_key):", "):",
           "the plain decode step appends in place for a batch that does not own the store"),
    Mutant("bulk-release-out-of-order", "nanofn/state/block_pool.py",
           "distinct[freed[np.argsort(last_mention)]]", "distinct[freed]",
           "a bulk release queues the freed blocks by id, not in the order they were freed"),
    Mutant("hash-hits-unconfirmed", "nanofn/state/block_pool.py",
           "    if not found:\n        return found\n    entries =",
           "    return found\n    entries =",
           "prefix-cache hash hits not confirmed against the stored tokens"),
    Mutant("min-tokens-allows-eos", "nanofn/state/policy.py",
           "return stop_token_ids(params, eos_token_ids)", "return params.stop_token_ids",
           "min_tokens bans the stop token ids but not EOS"),
    Mutant("rows-not-widened", "nanofn/state/batch.py",
           "        min_widths[kind] = max(min_widths[kind], int(np.max(lengths + counts)))\n",
           "        pass\n",
           "with_room does not widen the rows it needs, only the extra ones"),
    Mutant("finished-first-block-leaks", "nanofn/state/step.py",
           "pool.release(np.concatenate([batch.table(i)[::-1] for i in rows]))",
           "pool.release(np.concatenate([batch.table(i)[:0:-1] for i in rows]))",
           "a finishing sequence keeps a reference to its first block (a ref-count leak)"),
    # The second resource: a hybrid model's recurrent-state slots (state_pool.py).
    Mutant("finished-state-slot-leaks", "nanofn/state/step.py",
           "        changes.release(batch.cols[rows, STATE].tolist())\n", "",
           "a finishing hybrid sequence keeps its state slot"),
    Mutant("preempted-state-slot-leaks", "nanofn/state/scheduler.py",
           "        states.release([int(batch.cols[i, STATE])])\n", "        pass\n",
           "a preempted hybrid sequence keeps its state slot"),
    Mutant("hits-past-the-saved-state", "nanofn/state/scheduler.py",
           "            hits = hits[:usable]\n", "",
           "a hybrid prefix hit takes the KV blocks past the state it starts from"),
    Mutant("saved-state-unconfirmed", "nanofn/state/state_pool.py",
           "            if entry.token_bytes == data[:blocks * width]:",
           "            if True:",
           "a saved state's hash hit not confirmed against its tokens"),
    Mutant("state-saved-a-block-late", "nanofn/state/scheduler.py",
           "        slot = states.save(int(hashes[point // bs - 1]), point,",
           "        slot = states.save(int(hashes[point // bs - 2]), point,",
           "a saved state filed under the hash of the block before its end"),
    Mutant("failed-launch-states-not-dirty", "nanofn/engine/loop.py",
           "                self._dirty_states.extend(written_state_slots(plan))\n", "",
           "the state slots a failed launch wrote are not marked dirty"),
    Mutant("evicts-a-state-saved-now", "nanofn/state/state_pool.py",
           "if entry.saved_at < self._step and key != keep]",
           "if key != keep]",
           "a save takes the slot of a state saved earlier in the same step"),
    Mutant("adopts-without-the-copy", "nanofn/state/scheduler.py",
           "        state_restores=tuple((a.restored.slot, a.state_slot) for a in admissions\n"
           "                             if a.restored is not None and a.restored.slot != a.state_slot),",
           "        state_restores=(),",
           "a sequence that starts from a saved state is not given it (no restore)"),
)


def pytest_configure(config) -> None:
    """As a pytest plugin (``-p properties.mutants``): no example database, no shrinking."""
    from hypothesis import Phase, settings

    settings.register_profile("mutants", database=None,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
    settings.load_profile("mutants")


def planted(mutant: Mutant, into: Path) -> None:
    """Copy the tree's code and properties into ``into``, with ``mutant`` applied."""
    for part in ("nanofn", "properties"):
        shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    path = into / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: the text to replace is in {mutant.path} "
                         f"{text.count(mutant.old)} times, not once")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_suite(mutant: Mutant, all_tests: bool) -> tuple[list[str], float]:
    """The suite's failures (test and message) on the tree with ``mutant``, and its wall time."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        planted(mutant, Path(tmp))
        command = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rfE",
                   "-p", "no:cacheprovider", "-p", "properties.mutants", "properties"]
        if not all_tests:
            command.insert(-1, "-x")
        env = {**os.environ, "COLUMNS": "240", "NANOFN_HYPOTHESIS": "default"}
        start = time.perf_counter()
        out = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    failures = [line.split(" ", 1)[1] for line in out.stdout.splitlines()
                if re.match(r"(FAILED|ERROR) ", line)]
    if out.returncode not in (0, 1):
        failures = failures or [f"pytest exited with {out.returncode}: {out.stdout[-500:]}"]
    return failures, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the suite per mutant")
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--all-tests", action="store_true",
                        help="run every test, not only up to the first failure")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    table = []
    for mutant in chosen:
        caught_by = []
        for run in range(1, args.runs + 1):
            failures, elapsed = run_suite(mutant, args.all_tests)
            print(f"{mutant.name} run {run}: {'caught' if failures else 'MISSED'} "
                  f"in {elapsed:.0f} s", flush=True)
            for failure in failures:
                print(f"    {failure[:200]}", flush=True)
            caught_by.append(sorted({f.split(" - ")[0].split("::")[-1] for f in failures}))
        caught = sum(1 for tests in caught_by if tests)
        table.append((mutant, caught, sorted({t for tests in caught_by for t in tests})))
    print(f"\n{'mutant':<28} caught  by")
    for mutant, caught, tests in table:
        print(f"{mutant.name:<28} {caught}/{args.runs}     {', '.join(tests) or '-'}\n"
              f"{'':<28} ({mutant.what})")


if __name__ == "__main__":
    main()
