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


def gpt2_bill_figure(view: dict, *, width: float = 7.5, height: float = 3.6):
    """One training bill per bar, stacked part by part in GB, against one GPU's memory (notebook 01).

    ``view`` is ``memory.gpt2_bill_view(...)``: each bar's segments are the parts of one bill, so
    its end is the bill's total (written beside it); the bars are the alternative ways of keeping
    activations. The drawn ends are returned in ``fig.course_totals`` ({label: GB}) for the notebook.
    """
    import textwrap

    from matplotlib.patches import Patch

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    labels = list(view["bars"])
    ends = {}
    for y, label in enumerate(reversed(labels)):  # the first bar on top
        left = 0.0
        for part, n in view["bars"][label].items():
            ax.barh(y, n / GB, left=left, color=PART_COLORS[part], edgecolor="white", height=0.6)
            left += n / GB
        ends[label] = left
        ax.text(left, y, f" {left:.1f} GB", va="center", fontweight="bold")
    ax.set_yticks(range(len(labels)), [textwrap.fill(label, 32) for label in reversed(labels)])
    gpu = view["gpu_mem"] / GB
    ax.axvline(gpu, color="#c0392b", ls="--", lw=1.5)
    ax.text(gpu, len(labels) - 0.55, f" one {gpu:g} GB GPU", color="#c0392b", va="center")
    ax.set_xlabel("GB (10^9 bytes)")
    ax.set_xlim(0, max([*ends.values(), gpu]) * 1.2)
    ax.set_ylim(-0.5, len(labels) - 0.3)
    parts = list(next(iter(view["bars"].values())))
    names = {
        "weights": "16-bit weights (2Ψ)",
        "gradients": "16-bit gradients (2Ψ)",
        "optimizer": "optimizer state (12Ψ)",
        "buffers": "fused fp32 gradient buffer (4Ψ)",
    }
    fig.legend(
        handles=[Patch(color=PART_COLORS[p], label=names.get(p, p)) for p in parts],
        loc="outside lower center",
        ncols=3,
        fontsize=8,
        frameon=False,
    )
    # over the whole figure, not the axes: the long bar labels push the axes right, and a title centred
    # on them ran off the image's right edge (issue 23: deck 01's clipped chart title)
    fig.suptitle(view["title"], fontsize=10)
    fig.course_totals = {label: ends[label] for label in labels}  # in the view's order
    return fig


def activations_figure(view: dict, *, width: float = 7.5, height: float = 4.0):
    """Activation bytes per h·b·s·L of every measured shape, with the formulas' constants as lines (notebook 01).

    ``view`` is ``memory.activation_view(rows)``: one x position per measured shape (b, s, h), so
    a shape that strayed from the formula would stand out; the right axis reads the same in 16-bit
    numbers, the paper's unit.
    """
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    xs = np.arange(len(view["labels"]))
    styles = [("#555555", ":"), ("#5aa469", "-"), ("#c0392b", "--"), ("#555555", "-.")]
    for (label, value), (color, ls) in zip(view["lines"].items(), styles):
        ax.axhline(value, color=color, ls=ls, lw=1.2, label=label, zorder=1)
    ax.scatter(
        xs, view["full"], color=PART_COLORS["activations"], s=60, zorder=3, label="measured, every activation kept"
    )
    for x, v in zip(xs, view["full"]):
        ax.text(x, v - 1.2, f"{v:.2f}", ha="center", va="top", fontsize=8)
    ax.scatter(xs, view["checkpointed"], color="#555555", marker="s", s=50, zorder=3, label="measured, checkpointing")
    ax.set_xticks(xs, view["labels"], fontsize=8)
    ax.set_xlim(-0.6, len(xs) - 0.4)
    ax.set_ylim(0, max(max(view["full"]), *view["lines"].values()) * 1.12)
    ax.set_ylabel("bytes per h·b·s·L")
    ax.set_xlabel(view["xlabel"])
    numbers = ax.secondary_yaxis("right", functions=(lambda y: y / 2, lambda n: n * 2))
    numbers.set_yticks([0, 4, 8, 12, 16])
    numbers.set_ylabel("16-bit numbers per h·b·s·L")
    ax.set_title(view["title"], fontsize=10)
    ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 0.09))
    ax.grid(True, axis="y", alpha=0.3)
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
