"""One step's memory, operation by operation: one panel per strategy, the same axes (notebooks 03, 04).

Draws what ``timeline.StepTimeline`` measured (``result()["rows"]``): the bytes live after every
operation of the watched step, stacked by category, model states at the bottom. Pictures never compute.
"""

from __future__ import annotations

from .base import new_figure

#: The timeline's categories, bottom to top, and their colours.
TIMELINE_COLORS = {
    "params": "#1f77b4",
    "gathered": "#17becf",
    "grads": "#ff7f0e",
    "optim": "#2ca02c",
    "comm": "#9467bd",
    "hidden": "#8c564b",
    "activations": "#d62728",
    "data": "#7f7f7f",
    "temp": "#c7c7c7",
}


def timelines_figure(
    timelines: dict, *, title: str = "", width: float = 12.5, row_height: float = 1.2, cols: int = 3, right: float = 1.0
):
    """``timelines``: ``{label: StepTimeline.result()}``. One panel per run, up to ``cols`` columns (three: every
    run fits one 1280 x 720 slide; notebook 04's four runs take one row of four, taller), the same y axis
    (bytes, kB = 10^3), x the operations of the step;
    the step's peak (activations included, ▼) and the model states' peak (parameters, gradients, optimizer state
    and buffers, ◀) marked and their phases named. ``right`` < 1 leaves a right margin (the figure's share kept for
    the panels): the constrained layout does not widen a panel whose centred title is wider than it."""
    from matplotlib.lines import Line2D

    names = list(timelines)
    cols = min(cols, len(names))
    rows = -(-len(names) // cols)
    fig = new_figure(width, row_height * rows + 0.6)
    if right < 1:
        fig.get_layout_engine().set(rect=(0, 0, right, 1))
    top = max(t["peak"]["total"] for t in timelines.values()) / 1e3 * 1.08
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        t = timelines[name]
        index = t["columns"].index
        xs = list(range(len(t["rows"])))
        layers = [[r[index(c)] / 1e3 for r in t["rows"]] for c in TIMELINE_COLORS]
        ax.stackplot(xs, layers, colors=list(TIMELINE_COLORS.values()), labels=list(TIMELINE_COLORS), lw=0)
        peak, states = t["peak"], t["states_peak"]
        for mark, at, height in (("v", peak["index"], peak["total"]), ("<", states["index"], states["states"])):
            x = next((i for i, r in enumerate(t["rows"]) if r[0] == at), 0)
            ax.plot([x], [height / 1e3], mark, color="black", ms=6)
        ax.set_title(
            f"{name}: ▼ {peak['total']:,} B ({peak['where'].split(',')[0]})\n"
            f"◀ model states {states['states']:,} B ({states['where'].split(',')[0]})",
            fontsize=8,
        )
        ax.set_ylim(0, top)
        ax.set_xlabel("operation of the step", fontsize=8)
        ax.set_ylabel("kB live", fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for mark, label in (("v", "step peak, activations included"), ("<", "model states peak")):
        handles.append(Line2D([], [], marker=mark, color="black", ls="", ms=6))
        labels.append(label)
    fig.legend(handles, labels, loc="outside lower center", ncol=-(-len(labels) // 2), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
