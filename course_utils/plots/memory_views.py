"""Notebook 01's pictures of the bill (the memory chart, the stacked bars, the items, activations measured
against the rule) and notebook 03's memory chart with measured points (notebooks 01, 03)."""

from __future__ import annotations

import numpy as np

from ..units import GB
from .base import PART_COLORS, STAGE_COLORS, _bytes_axis, _scale, new_figure

# ---------------------------------------------------------------------------------------------
# Notebook 01: the memory chart, the bill as stacked bars, activations measured vs the rule
# ---------------------------------------------------------------------------------------------


def memory_chart_figure(view: dict, *, width: float = 7.5, height: float = 4.5):
    """The paper's memory chart: bytes per GPU against Nd for each row, a line for the GPU (notebook 01).

    ``view`` is ``memory.memory_chart_view(...)``; both axes are logarithmic, memory in GB.
    """
    from ..memory import STAGE_NAMES, STAGES

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    nds = view["nds"]
    for stage in STAGES:
        ax.plot(nds, view["curves"][stage] / GB, marker="o", ms=3, color=STAGE_COLORS[stage], label=STAGE_NAMES[stage])
        ax.plot([view["nd"]], [view["readout"][stage] / GB], marker="o", ms=8, mfc="none", color=STAGE_COLORS[stage])
    ax.axhline(view["gpu_mem"] / GB, color="#c0392b", ls="--", lw=1.5)
    ax.text(nds[0], view["gpu_mem"] / GB * 1.12, f"one {view['gpu_mem'] / GB:g} GB GPU", color="#c0392b")
    ax.axvline(view["nd"], color="#999999", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(nds, [str(int(n)) for n in nds])
    ax.set_xlabel("Nd, data-parallel GPUs (log scale)")
    _bytes_axis(ax, unit="GB")
    ax.set_title(view["title"], fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    return fig


def bill_bars_figure(
    bars: dict,
    *,
    unit: str = "bytes",
    title: str = "",
    gpu_mem: float | None = None,
    width: float = 7.5,
    height: float = 4.5,
):
    """One GPU's bill per row as stacked bars; the part a stage no longer holds is dashed (notebook 01).

    ``bars`` is ``memory.bill_bars(...)``. What the GPU holds is stacked from zero (filled), so a
    bar is as tall as the bytes it holds and shrinks stage by stage; what sharding dropped is
    stacked above it, dashed, so every bar still reaches the replicated bill. The drawn heights are
    returned in ``fig.course_heights`` (``{stage: (held, dropped)}``) for the notebook to check.
    """
    from matplotlib.patches import Patch

    from ..memory import BILL_PARTS, STAGE_NAMES

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    scale = _scale(unit)
    stages = list(bars)
    heights = {}
    for i, stage in enumerate(stages):
        bottom = 0.0
        for part in BILL_PARTS:  # what one GPU holds, from zero
            held = bars[stage][part]["held"] / scale
            if held > 0:
                ax.bar(i, held, bottom=bottom, color=PART_COLORS[part], width=0.6, edgecolor="white")
                bottom += held
        total = bottom
        for part in BILL_PARTS:  # what sharding dropped, above it
            dropped = (bars[stage][part]["full"] - bars[stage][part]["held"]) / scale
            if dropped > 1e-12 * max(bars[stage][part]["full"] / scale, 1):
                ax.bar(i, dropped, bottom=bottom, width=0.6, fill=False, edgecolor=PART_COLORS[part], ls="--", lw=1.2)
                bottom += dropped
        heights[stage] = (total, bottom - total)
        ax.text(i, total, f"{total:.3g}", ha="center", va="bottom", fontsize=9, fontweight="bold")
    if gpu_mem is not None:
        ax.axhline(gpu_mem / scale, color="#c0392b", ls="--", lw=1.5)
        ax.text(
            len(stages) - 0.5, gpu_mem / scale, f" {gpu_mem / GB:g} GB GPU", color="#c0392b", va="bottom", ha="right"
        )
    ax.set_xticks(range(len(stages)), [STAGE_NAMES.get(s, s).replace(" (", "\n(") for s in stages], fontsize=9)
    _bytes_axis(ax, unit=unit)
    handles = [Patch(color=PART_COLORS[p], label=p) for p in BILL_PARTS if any(bars[s][p]["full"] > 0 for s in stages)]
    handles.append(Patch(fill=False, ls="--", edgecolor="#555555", label="no longer held (sharded away)"))
    fig.legend(handles=handles, fontsize=8, loc="outside right upper")
    ax.set_title(title or "Each stage drops one more part of the bill", fontsize=10)
    fig.course_heights = heights
    return fig


def bill_items_figure(items: dict, *, gpu_mem: float, title: str = "", width: float = 7.5, height: float = 3.5):
    """Items of a training bill as horizontal bars in GB against one GPU's memory (notebook 01).

    ``items``: ``{label: bytes}`` in the order to draw, top to bottom.
    """
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    labels = list(items)[::-1]
    values = [items[k] / GB for k in labels]
    ax.barh(labels, values, color="#3a7dc9")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f} GB", va="center", fontsize=9)
    ax.axvline(gpu_mem / GB, color="#c0392b", ls="--", lw=1.5)
    ax.text(gpu_mem / GB, -0.45, f" one {gpu_mem / GB:g} GB GPU", color="#c0392b", fontsize=9, va="center")
    ax.set_xlabel("GB (10^9 bytes)")
    ax.set_xlim(0, max(values + [gpu_mem / GB]) * 1.25)
    # over the whole figure, not the axes: the long bar labels push the axes right, and a title centred
    # on them ran off the image's right edge (issue 23: deck 01's clipped chart title)
    fig.suptitle(title, fontsize=10)
    return fig


def activations_figure(rows: list, *, width: float = 7.5, height: float = 4.0):
    """Measured activation bytes of the transformer blocks against the paper's 12·h·b·s·L rule,
    with and without activation checkpointing (notebook 01). ``rows``: ``memory.compare_activations``."""
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    rule = np.array([r["rule"] for r in rows])
    ax.scatter(
        rule,
        [r["measured_blocks"] for r in rows],
        color=PART_COLORS["activations"],
        label="measured, every activation kept",
        zorder=3,
    )
    ax.scatter(
        rule,
        [r["measured_blocks_ckpt"] for r in rows],
        color="#555555",
        marker="s",
        label="measured, activation checkpointing",
        zorder=3,
    )
    lo, hi = min(rule.min(), min(r["measured_blocks_ckpt"] for r in rows)) / 2, rule.max() * 3
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="#c0392b", ls="--", lw=1, label="the rule: 12·h·b·s·L numbers × 2 bytes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("the paper's rule, bytes")
    ax.set_ylabel("saved for backward, bytes (measured)")
    mean = float(np.mean([r["ratio"] for r in rows]))
    ax.set_title(
        f"The rule is right to within a constant ({mean:.2f}×) here; checkpointing keeps one input per block",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig


def measured_memory_figure(view: dict, measured: dict, *, title: str = "", width: float = 7.5, height: float = 4.5):
    """The notebook-01 memory chart for a real run's Ψ, in bytes, with measured bytes per rank as points (notebook 03).

    ``view`` is ``memory.memory_chart_view(psi, nd=...)`` (the paper's mixed-precision curves);
    ``measured`` maps a row ("ddp", "zero1", ...) to ``[(nd, bytes per rank), ...]`` counted on
    real tensors. A point on its curve is a run that holds exactly what the formula says.
    """
    from ..memory import STAGE_NAMES, STAGES

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    nds = view["nds"]
    for stage in STAGES:
        ax.plot(nds, view["curves"][stage], color=STAGE_COLORS[stage], lw=1.5, label=f"{STAGE_NAMES[stage]}, formula")
        points = measured.get(stage, [])
        if points:
            ax.scatter(
                [p[0] for p in points],
                [p[1] for p in points],
                s=90,
                marker="o",
                facecolor="none",
                edgecolor=STAGE_COLORS[stage],
                linewidth=2,
                zorder=3,
            )
    ax.scatter(
        [],
        [],
        s=90,
        marker="o",
        facecolor="none",
        edgecolor="#555555",
        linewidth=2,
        label="measured on a real run (real tensors)",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(nds, [str(int(n)) for n in nds])
    ax.set_xlabel("Nd, data-parallel ranks (log scale)")
    ax.set_ylabel("model-state bytes per rank (log scale)")
    ax.set_title(title or "Measured bytes per rank sit on the paper's curves", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", alpha=0.3)
    return fig
