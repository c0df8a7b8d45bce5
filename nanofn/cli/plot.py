"""``nanofn replay TRACE --plot PNG``: a run at a glance, one column per step.

Three panels share the step axis: sequences running and waiting; KV blocks owned, cached
(free, but holding a prefix a later request can hit) and free; tokens scheduled, prefill and
decode; and, for a hybrid model, a fourth: its recurrent-state slots, working, saved (prefix
cache entries) and free. Preemptions are red lines across every panel, prefix-cache hits green
triangles over the token panel, labelled with the tokens they saved. Drawn with matplotlib's object API
(no pyplot, so no global figure state), rendered by the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from nanofn.state import RunSeries

FORMATS = ("png", "svg", "pdf")  # chosen by the file's suffix
PREEMPTION_COLOR = "#d62728"
HIT_COLOR = "#2ca02c"
MAX_LABELLED_HITS = 12  # beyond this many, hits are marked without their token counts


def plot_run(series: RunSeries, path: str | Path, title: str) -> None:
    """Draw ``series`` into ``path``; its suffix picks the format (.png, .svg, .pdf)."""
    hybrid = series.num_state_slots > 0
    figure = Figure(figsize=(10, 9.5 if hybrid else 7.5), dpi=100, layout="constrained")
    panels = figure.subplots(4 if hybrid else 3, 1, sharex=True)
    seqs, blocks, tokens = panels[:3]
    steps = series.steps
    _draw_seqs(seqs, series)
    _draw_blocks(blocks, series)
    _draw_tokens(tokens, series)
    if hybrid:
        _draw_states(panels[3], series)
    preempted_at = [s for s, n in zip(steps, series.preemptions) if n]
    for axes in panels:
        for i, step in enumerate(preempted_at):
            axes.axvline(step, color=PREEMPTION_COLOR, linewidth=1, alpha=0.8, zorder=4,
                         label="preemption" if i == 0 and axes is seqs else None)
        axes.grid(axis="y", alpha=0.3)
        axes.margins(x=0.01)
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    panels[-1].set_xlabel("step")
    slots = f", {series.num_state_slots} state slots" if hybrid else ""
    figure.suptitle(f"{title}: {len(steps)} steps, {series.num_blocks} KV blocks{slots}, "
                    f"{sum(series.preemptions)} preempted, {sum(series.cached_tokens)} prompt "
                    f"tokens from the prefix cache", fontsize=10)
    figure.savefig(path)


def _draw_seqs(axes, series: RunSeries) -> None:
    axes.step(series.steps, series.running, where="mid", label="running", color="#1f77b4")
    axes.step(series.steps, series.waiting, where="mid", label="waiting", color="#ff7f0e")
    axes.set_ylabel("sequences")
    axes.set_ylim(bottom=0)


def _draw_blocks(axes, series: RunSeries) -> None:
    axes.stackplot(series.steps, series.blocks_used, series.blocks_cached, series.blocks_free,
                   labels=["owned", "cached\n(free, reusable)", "free"], step="mid",
                   colors=["#1f77b4", "#98df8a", "#e8e8e8"])
    axes.set_ylabel("KV blocks")
    axes.set_ylim(0, series.num_blocks)


def _draw_states(axes, series: RunSeries) -> None:
    axes.stackplot(series.steps, series.states_working, series.states_saved, series.states_free,
                   labels=["working", "saved\n(prefix cache)", "free"], step="mid",
                   colors=["#17becf", "#bcbd22", "#e8e8e8"])
    axes.set_ylabel("state slots")
    axes.set_ylim(0, series.num_state_slots)


def _draw_tokens(axes, series: RunSeries) -> None:
    steps = series.steps
    axes.bar(steps, series.prefill_tokens, width=1.0, label="prefill", color="#9467bd")
    axes.bar(steps, series.decode_tokens, width=1.0, bottom=series.prefill_tokens,
             label="decode", color="#8c564b")
    hits = [(s, n, p + d) for s, n, p, d in zip(steps, series.cached_tokens,
                                               series.prefill_tokens, series.decode_tokens) if n]
    if hits:
        top = max(p + d for p, d in zip(series.prefill_tokens, series.decode_tokens))
        axes.set_ylim(0, top * 1.25)
        axes.scatter([s for s, _, _ in hits], [height + top * 0.06 for _, _, height in hits],
                     marker="v", color=HIT_COLOR, label="prefix-cache hit", zorder=3)
        if len(hits) <= MAX_LABELLED_HITS:
            for step, cached, height in hits:
                axes.annotate(f"{cached} cached", (step, height + top * 0.06),
                              xytext=(0, 6), textcoords="offset points", ha="center",
                              fontsize=7, color=HIT_COLOR)
    axes.set_ylabel("tokens scheduled")
