"""Static pictures of the course: matplotlib figures drawn from numbers the arithmetic modules
compute (introduced in notebook 01).

Each ``*_figure`` function takes plain numbers (a "view" dict from ``memory``/``plan``) and
returns a ``matplotlib.figure.Figure``; it computes nothing the chart asserts. ``show(fig)``
puts a figure into a notebook as a PNG image; ``png(fig)`` returns the bytes (the widgets use
them too, so a live widget and a headless run draw exactly the same picture).

pyplot is never used: figures are built on the Agg canvas directly, so nothing here depends
on the notebook's plotting backend or leaves global state behind.

Sections: shared helpers; notebook 01 (memory chart, bill bars, activations); notebook 05
(planner memory bars, overlap chart). Other notebooks append their own sections below.
"""

from __future__ import annotations

import io

import numpy as np

from .units import GB

#: One colour per part of the bill and per row of the ZeRO table, used by every chart.
PART_COLORS = {
    "weights": "#7b5ea7",
    "gradients": "#e8883a",
    "optimizer": "#3a7dc9",
    "activations": "#5aa469",
    "buffers": "#9a9a9a",
}
STAGE_COLORS = {
    "ddp": "#444444",
    "zero1": "#3a7dc9",
    "zero2": "#e8883a",
    "zero3": "#7b5ea7",
    "hsdp": "#2a9d8f",
    "zero2_offload": "#f4a261",
    "zero3_offload": "#b392d6",
}


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def new_figure(width: float = 7.5, height: float = 4.5):
    """A fresh Figure on the Agg canvas (no pyplot state) (notebook 01)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


#: Pixel density of the charts ``show`` displays: drawn at twice the figure's 100 dpi and shown at its
#: size, so they stay sharp on a high-density screen and on a projector (widgets keep 1x).
SHOW_SCALE = 2


def png(fig, scale: float = 1) -> bytes:
    """The figure as PNG bytes, at ``scale`` times its own dpi (notebook 01)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi * scale)
    return buf.getvalue()


class StaticFigure:
    """A rendered chart a notebook displays as a PNG image, with its readout as text (notebook 01).

    What a widget returns when the notebook runs headless (``widgets.is_headless()``), and what
    ``show`` displays: executed notebooks then hold the chart as ``image/png``.
    """

    def __init__(self, fig, text: str = ""):
        self.png = png(fig, SHOW_SCALE)
        width, height = fig.get_size_inches() * fig.dpi
        self.size = {"width": int(round(width)), "height": int(round(height))}  # CSS pixels
        self.text = text

    def _repr_png_(self):
        return self.png, self.size

    def __repr__(self):
        return self.text or "<chart>"


def show(fig, text: str = ""):
    """Display a figure in the notebook as a PNG image (and ``text`` under it) (notebook 01)."""
    from IPython.display import display

    display(StaticFigure(fig, text))


def _bytes_axis(ax, axis: str = "y", unit: str = "GB"):
    """Label an axis that holds bytes, scaled to ``unit`` (GB = 10^9; "bytes" for raw bytes)."""
    label = "bytes" if unit == "bytes" else f"{unit} ({'10^9' if unit == 'GB' else '2^30'} bytes)"
    (ax.set_ylabel if axis == "y" else ax.set_xlabel)(f"memory per GPU, {label}")


def _scale(unit: str) -> float:
    return {"bytes": 1.0, "GB": float(GB), "GiB": float(2**30)}[unit]


# ---------------------------------------------------------------------------------------------
# Notebook 01: the memory chart, the bill as stacked bars, activations measured vs the rule
# ---------------------------------------------------------------------------------------------


def memory_chart_figure(view: dict, *, width: float = 7.5, height: float = 4.5):
    """The paper's memory chart: bytes per GPU against Nd for each row, a line for the GPU (notebook 01).

    ``view`` is ``memory.memory_chart_view(...)``; both axes are logarithmic, memory in GB.
    """
    from .memory import STAGE_NAMES, STAGES

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

    from .memory import BILL_PARTS, STAGE_NAMES

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


# ---------------------------------------------------------------------------------------------
# Notebook 05: the planner's memory bars and overlap chart
# ---------------------------------------------------------------------------------------------


def _plan_memory_axes(ax, p) -> None:
    from matplotlib.patches import Patch

    from .plan import STRATEGY_NAMES

    c = p.cluster
    names = list(p.strategies)
    cap = 2.5 * c.gpu_mem / GB
    for i, s in enumerate(names):
        sp = p.strategies[s]
        bottom = 0.0
        for _part, value, color in (
            ("model states", sp.model_states, PART_COLORS["optimizer"]),
            ("activations", sp.activations, PART_COLORS["activations"]),
            ("buffers", sp.buffers, PART_COLORS["buffers"]),
        ):
            v = value / GB
            shown = max(0.0, min(v, cap - bottom))
            ax.bar(
                i,
                shown,
                bottom=bottom,
                color=color,
                alpha=1.0 if sp.fits else 0.35,
                edgecolor="black" if s == p.recommendation["strategy"] else "white",
                lw=1.5 if s == p.recommendation["strategy"] else 0.5,
            )
            bottom += shown
        label = f"{sp.total / GB:.0f}" if sp.total / GB >= 10 else f"{sp.total / GB:.1f}"
        clipped = sp.total / GB > cap
        ax.text(i, min(sp.total / GB, cap), label + (" ↑" if clipped else ""), ha="center", va="bottom", fontsize=8)
    ax.axhline(c.gpu_mem / GB, color="#c0392b", ls="--", lw=1.2)
    ax.axhline(c.usable / GB, color="#c0392b", ls=":", lw=1)
    ax.set_ylim(0, cap * 1.08)
    short = [
        STRATEGY_NAMES[s].split(" (")[0].replace(" + optimizer offload", "\n+ offload").replace("stage ", "stage\u00a0")
        for s in names
    ]
    ax.set_xticks(range(len(names)), short, fontsize=8, rotation=0)
    ax.set_ylabel("memory per GPU, GB (10^9 bytes)")
    ax.legend(
        handles=[
            Patch(color=PART_COLORS["optimizer"], label="model states"),
            Patch(color=PART_COLORS["activations"], label="activations"),
            Patch(color=PART_COLORS["buffers"], label="buffers"),
            Patch(fill=False, edgecolor="#c0392b", ls="--", label=f"{c.gpu_mem / GB:g} GB GPU (dotted: usable)"),
        ],
        fontsize=7,
        loc="upper right",
    )
    ax.set_title("Memory per GPU (faded: does not fit; outlined: chosen)", fontsize=9)


def _plan_overlap_axes(ax, p, tokens=None) -> None:
    from .plan import overlap_curve

    m, c = p.model, p.cluster
    tokens = np.geomspace(64, 1 << 20, 60) if tokens is None else tokens
    curve = overlap_curve(m, c, tokens)
    ax.plot(curve["tokens"], curve["compute_s"] * 1e3, color=PART_COLORS["activations"], label="block forward compute")
    ax.axhline(
        curve["gather_intra_s"] * 1e3,
        color=STAGE_COLORS["hsdp"],
        ls="--",
        label=f"all-gather over NVLink ({c.intra_bw / 1e9:g} GB/s)",
    )
    if c.nodes > 1:
        ax.axhline(
            curve["gather_network_s"] * 1e3,
            color="#c0392b",
            ls="--",
            label=f"all-gather over the network ({c.inter_bw / 1e9:g} GB/s per node)",
        )
    now = m.tokens
    ax.axvline(now, color="#777777", ls=":", lw=1)
    ax.text(
        now, 0.02, f" now: b·s = {now:,}", fontsize=8, va="bottom", color="#555555", transform=ax.get_xaxis_transform()
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per micro-batch per GPU (b·s), log scale")
    ax.set_ylabel("time per block, ms (log scale)")
    cross = curve["crossover_network"] if c.nodes > 1 else curve["crossover_intra"]
    where = "network" if c.nodes > 1 else "NVLink"
    ax.set_title(f"Gathers hide once b·s > {cross:,.0f} tokens ({where})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)


def plan_figure(p, *, width: float = 12.0, height: float = 4.6):
    """The planner in one picture: memory per GPU per strategy, and a block's compute against the
    all-gather of its parameters across micro-batch sizes (notebook 05). ``p``: ``plan.plan(...)``."""
    from .plan import STRATEGY_NAMES

    fig = new_figure(width, height)
    left, right = fig.subplots(1, 2, width_ratios=[1.25, 1])
    _plan_memory_axes(left, p)
    _plan_overlap_axes(right, p)
    choice = p.recommendation["strategy"]
    fig.suptitle(f"Recommendation: {STRATEGY_NAMES.get(choice, 'none fits')}", fontsize=11)
    return fig


def crossover_figure(lines: dict, points: dict | None = None, *, width: float = 7.5, height: float = 4.5):
    """Compute time ÷ all-gather time per block against tokens per micro-batch: above 1 the gather
    hides (notebook 05). ``lines``: ``{label: (tokens, ratio)}`` from the planner's formulas;
    ``points``: ``{label: (tokens, ratio)}`` measured on this host."""
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    colors = ["#3a7dc9", "#c0392b", "#2a9d8f", "#7b5ea7", "#e8883a"]
    for (label, (x, y)), color in zip(lines.items(), colors):
        ax.plot(x, y, color=color, label=label)
    for (label, (x, y)), marker in zip((points or {}).items(), "osD^v"):
        ax.scatter(x, y, marker=marker, s=36, zorder=3, label=label)
    ax.axhline(1.0, color="black", lw=1)
    ax.text(min(min(v[0]) for v in lines.values()), 1.15, "gathers hide above this line", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per micro-batch per GPU (b·s), log scale")
    ax.set_ylabel("block forward compute ÷ all-gather time")
    ax.set_title("The crossover is a number of tokens: about FLOP/s ÷ bandwidth", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="major", alpha=0.3)
    return fig


# ---------------------------------------------------------------------------------------------
# Notebook 02: DDP's overlap timeline, the bucket-cap sweep, tables
# ---------------------------------------------------------------------------------------------


def table_markdown(header: list, rows: list) -> str:
    """A Markdown table from a header and rows of already formatted cells (notebook 02)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def show_table(header: list, rows: list) -> None:
    """Display ``table_markdown(header, rows)`` in the notebook (notebook 02)."""
    from IPython.display import Markdown, display

    display(Markdown(table_markdown(header, rows)))


def ddp_timeline_figure(timeline: dict, *, title: str = "", width: float = 8.5, height: float | None = None):
    """One DDP step against time: backward, each gradient's arrival, each bucket's all-reduce (notebook 02).

    ``timeline`` is a row's ``"timeline"`` from ``labs.lab02.bucket_sweep``: times in ms after backward
    began. One row per bucket: dots where its gradients became ready, a bar from the start to
    the end of its all-reduce; the top row is forward, backward and the final wait.
    """
    buckets = sorted({r["bucket"] for r in timeline["ready"]})
    fig = new_figure(width, height or 1.9 + 0.38 * (len(buckets) + 1))
    _draw_ddp_timeline(fig.add_subplot(), timeline)
    fig.axes[0].set_title(title or "Each bucket's all-reduce starts as soon as its last gradient is ready")
    return fig


def ddp_timelines_figure(timelines: list, *, title: str = "", width: float = 8.5):
    """Every rank's DDP step, one panel per rank, each on its own clock (notebook 02).

    ``timelines`` is a row's ``"timelines"`` from ``ddp.bucket_sweep``: one ``ddp_timeline_figure``
    timeline per rank, times in ms after that rank's backward began.
    """
    buckets = len({r["bucket"] for r in timelines[0]["ready"]})
    fig = new_figure(width, 1.2 + len(timelines) * (0.6 + 0.3 * (buckets + 1)))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)[:, 0]
    for rank, (ax, timeline) in enumerate(zip(axes, timelines)):
        _draw_ddp_timeline(ax, timeline, legend=rank == len(timelines) - 1, xlabel=rank == len(timelines) - 1)
        ax.set_title(f"rank {rank}", fontsize=9, loc="left")
    fig.suptitle(title or "Each bucket's all-reduce starts as soon as its last gradient is ready", fontsize=10)
    return fig


def _draw_ddp_timeline(ax, timeline: dict, *, legend: bool = True, xlabel: bool = True) -> None:
    buckets = sorted({r["bucket"] for r in timeline["ready"]})
    top = len(buckets)
    ax.barh(top, -timeline["forward_ms"], left=timeline["forward_ms"], color="#bbbbbb", height=0.6, label="forward")
    ax.barh(top, timeline["backward_end_ms"], left=0, color=PART_COLORS["gradients"], height=0.6, label="backward")
    ax.barh(
        top,
        timeline["synced_ms"] - timeline["backward_end_ms"],
        left=timeline["backward_end_ms"],
        color="#dddddd",
        hatch="//",
        edgecolor="#888888",
        height=0.6,
        label="waiting for all-reduces",
    )
    for i, row in enumerate(timeline["all_reduce"]):
        end = row["end_ms"] if row["end_ms"] is not None else timeline["synced_ms"]
        ax.barh(
            row["bucket"],
            end - row["start_ms"],
            left=row["start_ms"],
            color=PART_COLORS["optimizer"],
            height=0.5,
            label="all-reduce in flight" if i == 0 else None,
        )
    ready = timeline["ready"]
    ax.scatter(
        [r["t_ms"] for r in ready], [r["bucket"] for r in ready], color="black", s=12, zorder=3, label="gradient ready"
    )
    ax.axvline(timeline["backward_end_ms"], color="#444444", lw=0.8, ls=":")
    ax.set_yticks(list(buckets) + [top], [f"bucket {b}" for b in buckets] + ["compute"])
    ax.invert_yaxis()
    if xlabel:
        ax.set_xlabel("time since backward began (ms)")
    if legend:
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.3 if xlabel else -0.14), ncol=5, fontsize=8, frameon=False
        )


def bucket_sweep_figure(rows: list, *, title: str = "", width: float = 10.0, height: float = 3.8):
    """All-reduce calls per step and step time against the bucket cap (notebook 02).

    ``rows`` come from ``labs.lab02.bucket_sweep``: ``cap_mb``, ``buckets``, ``calls_per_step``,
    ``step_time_s``. Log x axis (caps span decades).
    """
    caps = [r["cap_mb"] for r in rows]
    fig = new_figure(width, height)
    left, right = fig.subplots(1, 2)
    left.plot(caps, [r["buckets"] for r in rows], "o-", color="#444444", label="buckets")
    left.plot(
        caps,
        [r["calls_per_step"] for r in rows],
        "x",
        color=PART_COLORS["optimizer"],
        ms=9,
        label="all-reduce calls per step (counted)",
    )
    left.set_xscale("log")
    left.set_xlabel("bucket cap (MiB)")
    left.set_ylabel("count per step")
    left.legend(frameon=False, fontsize=8)
    left.set_title("One all-reduce per bucket")
    right.plot(caps, [r["step_time_s"] * 1e3 for r in rows], "o-", color=PART_COLORS["gradients"])
    right.set_xscale("log")
    right.set_ylim(bottom=0)
    right.set_xlabel("bucket cap (MiB)")
    right.set_ylabel("median step time (ms)")
    right.set_title("Step time (CPU/gloo: not a GPU timing)")
    if title:
        fig.suptitle(title)
    return fig


# ---------------------------------------------------------------------------------------------
# Notebook 03: ZeRO stages measured against the paper; the stage-3 schedule step by step
# ---------------------------------------------------------------------------------------------


def measured_memory_figure(view: dict, measured: dict, *, title: str = "", width: float = 7.5, height: float = 4.5):
    """The notebook-01 memory chart for a real run's Ψ, in bytes, with measured bytes per rank as points (notebook 03).

    ``view`` is ``memory.memory_chart_view(psi, nd=...)`` (the paper's mixed-precision curves);
    ``measured`` maps a row ("ddp", "zero1", ...) to ``[(nd, bytes per rank), ...]`` counted on
    real tensors. A point on its curve is a run that holds exactly what the formula says.
    """
    from .memory import STAGE_NAMES, STAGES

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


def zero3_schedule_figure(state, *, width: float = 10.0, height: float = 4.2):
    """One state of the stage-3 schedule: the GPUs × layers grid and what each GPU has sent (notebook 03).

    ``state`` is a ``stepper.Stage3State``. Left: row g is GPU g, column l is layer l, cut into
    Nd vertical slices; GPU g's own slice g of every layer is filled purple, the rest of a layer
    light while it is gathered whole, an orange mark on a slice once its summed gradients have
    arrived, the outlined column the layer being worked on. Right: Ψ units each GPU has sent so
    far, by kind, against plain DP's 2(Nd-1)/Nd·Ψ.
    """
    fig = new_figure(width, height)
    grid, bars = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    _draw_stage3(grid, bars, state)
    fig.suptitle(state.caption, fontsize=9)
    return fig


def zero3_schedule_frames(states: list, *, width: float = 10.0, row_height: float = 3.0):
    """Several states of the stage-3 schedule, one row each (notebook 03: what a headless run shows)."""
    fig = new_figure(width, row_height * len(states))
    axes = fig.subplots(len(states), 2, gridspec_kw={"width_ratios": [1, 1.3]}, squeeze=False)
    for (grid, bars), state in zip(axes, states):
        _draw_stage3(grid, bars, state, legend=state is states[-1])
        heading = grid.get_title()
        grid.set_title("")
        bars.set_title("")  # the centred "Traffic so far": the caption takes its place
        bars.set_title(heading + ": " + state.caption, fontsize=8, loc="left", wrap=True)
    return fig


def _draw_stage3(grid, bars, state, *, legend: bool = True) -> None:
    from matplotlib.patches import Rectangle

    from .stepper import TRAFFIC_KINDS

    nd = state.nd
    layers = len(state.held[0])
    w = 0.92 / nd  # one slice's width inside a layer's cell
    for g in range(nd):
        for layer in range(layers):
            y = nd - 1 - g
            grid.add_patch(Rectangle((layer, y), 0.92, 0.92, facecolor="#f2f2f2", edgecolor="white"))
            if state.held[g][layer] == "whole":
                grid.add_patch(Rectangle((layer, y), 0.92, 0.92, facecolor="#cdbde6", edgecolor="white"))
            grid.add_patch(Rectangle((layer + g * w, y), w, 0.92, facecolor=PART_COLORS["weights"], edgecolor="white"))
            if state.grads[layer]:
                grid.plot(layer + (g + 0.5) * w, y + 0.46, "o", color=PART_COLORS["gradients"], ms=max(3, 24 / nd))
    if state.layer is not None:
        grid.add_patch(Rectangle((state.layer - 0.04, -0.04), 1.0, nd, fill=False, edgecolor="#222222", lw=2))
    grid.set_xlim(-0.1, layers)
    grid.set_ylim(-0.1, nd)
    grid.set_xticks([s + 0.46 for s in range(layers)], [f"layer {s}" for s in range(layers)], fontsize=8)
    grid.set_yticks([nd - 1 - g + 0.46 for g in range(nd)], [f"GPU {g}" for g in range(nd)], fontsize=8)
    grid.set_aspect("equal")
    grid.tick_params(length=0)
    for spine in grid.spines.values():
        spine.set_visible(False)
    grid.set_title(
        f"step {state.step}: {state.phase}" + (f", layer {state.layer}" if state.layer is not None else ""), fontsize=10
    )
    colors = {
        "forward all-gather": PART_COLORS["weights"],
        "backward all-gather": "#b392d6",
        "reduce-scatter": PART_COLORS["gradients"],
    }
    left = np.zeros(nd)
    for kind in TRAFFIC_KINDS:
        values = np.array([state.sent[g][kind] for g in range(nd)])
        bars.barh(range(nd)[::-1], values, left=left, color=colors[kind], label=kind, height=0.6)
        left += values
    for g in range(nd):
        bars.text(left[g], nd - 1 - g, f" {left[g]:.3g}Ψ", va="center", fontsize=9)
    dp = 2 * (nd - 1) / nd
    bars.axvline(dp, color=STAGE_COLORS["ddp"], ls="--", lw=1.2)
    bars.text(dp, nd - 0.45, f" plain DP: {dp:.3g}Ψ", fontsize=8, color=STAGE_COLORS["ddp"])
    bars.set_xlim(0, 3 * (nd - 1) / nd * 1.25)
    bars.set_ylim(-0.6, nd)
    bars.set_yticks(range(nd)[::-1], [f"GPU {g}" for g in range(nd)], fontsize=8)
    bars.set_xlabel("sent by each GPU so far, in units of Ψ (ring model)")
    if legend:
        bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    bars.set_title("Traffic so far", fontsize=10)


# ---------------------------------------------------------------------------------------------
# Notebook 04: FSDP strategies side by side (bytes held, peak gathered, bytes sent), and its tables
# ---------------------------------------------------------------------------------------------

#: One colour per collective kind (notebook 04).
COMM_COLORS = {"all_gather": "#7b5ea7", "reduce_scatter": "#e8883a", "all_reduce": "#444444"}


def fsdp_side_by_side_figure(rows: list, *, title: str = "", width: float = 12.0, height: float = 5.0):
    """Per-rank memory and traffic of each FSDP strategy, measured on one run each (notebook 04).

    ``rows``: ``labs.lab04.experiments_worker`` rows (label, per_rank, peak_unsharded_bytes,
    comm_per_step). Left: rank 0's bytes at rest (parameters, gradients, optimizer state,
    stacked) and, beside them, the peak bytes of gathered parameters during a step. Right:
    bytes one rank sends per step, by collective. Both in MB (10^6 bytes); the bar labels are
    the exact values.
    """
    from matplotlib.patches import Patch

    mb = 1e6
    fig = new_figure(width, height)
    mem, net = fig.subplots(1, 2)
    labels = [r["label"] for r in rows]
    xs = np.arange(len(rows))
    parts = (("params", "weights"), ("grads", "gradients"), ("optim", "optimizer"))
    for i, row in enumerate(rows):
        held, bottom = row["per_rank"][0], 0.0
        for key, part in parts:
            mem.bar(i - 0.2, held[key] / mb, bottom=bottom, width=0.4, color=PART_COLORS[part], edgecolor="white")
            bottom += held[key] / mb
        mem.text(i - 0.2, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=7)
        peak = (row.get("peak_unsharded_bytes") or [None])[0]
        if peak:
            mem.bar(i + 0.2, peak / mb, width=0.4, color="white", edgecolor=PART_COLORS["weights"], hatch="//")
            mem.text(
                i + 0.2,
                peak / mb,
                f"{peak / mb:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
                color=PART_COLORS["weights"],
            )
    mem.set_xticks(xs, labels, fontsize=8)
    mem.set_ylabel("MB (10^6 bytes) per rank")
    mem.set_title("Held at rest (solid) and gathered at the peak of a step (hatched)", fontsize=9)
    mem.set_ylim(
        0, max(max(r["per_rank"][0]["total"], (r.get("peak_unsharded_bytes") or [0])[0] or 0) for r in rows) / mb * 1.1
    )
    handles = [Patch(color=PART_COLORS[p], label=p) for _, p in parts]
    handles.append(
        Patch(facecolor="white", edgecolor=PART_COLORS["weights"], hatch="//", label="gathered weights, peak")
    )
    mem.legend(handles=handles, fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    kinds = [k for k in COMM_COLORS if any(k in r["comm_per_step"] for r in rows)]
    bottom = np.zeros(len(rows))
    for kind in kinds:
        sent = np.array([r["comm_per_step"].get(kind, {}).get("sent_bytes", 0.0) for r in rows]) / mb
        net.bar(xs, sent, bottom=bottom, color=COMM_COLORS[kind], width=0.6, label=kind.replace("_", "-"))
        bottom += sent
    for i, total in enumerate(bottom):
        if total:
            net.text(i, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
    net.set_xticks(xs, labels, fontsize=8)
    net.set_ylabel("MB (10^6 bytes) sent per rank per step (ring)")
    net.set_title("Traffic per step, by collective", fontsize=9)
    net.set_ylim(0, max(float(bottom.max()), 1e-9) * 1.12)
    if kinds:
        net.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _bytes_cell(n) -> str:
    return "–" if n is None else f"{n:,.0f}"


def _calls(r) -> str:
    from .fsdp import calls_text  # imported when a table is drawn: plots itself stays free of torch

    return calls_text(r["comm_per_step"])


def step_time_cell(row: dict) -> str:
    """A run's time per step in ms, only where the run can resolve it (notebook 04).

    On one GPU per rank (NCCL) the time comes from a bare timing run and means something. On a
    CPU host the ranks share the cores with each other and with gloo's collectives, so nothing
    overlaps and the differences between runs are noise (measured: SHARD_GRAD_OP came out slower
    than FULL_SHARD, and ".item() every step" the fastest prefetch row): the cell says so.
    """
    if row.get("device") != "cuda":
        return "not meaningful (CPU)"
    return f"{row['step_time_s'] * 1e3:.1f}"


def _largest_unit(r) -> int | None:
    units = r["strategy_info"].get("units")
    return max(u["numel"] for u in units) * r["strategy_info"]["compute_bytes_per_element"] if units else None


#: Columns ``fsdp_table`` can show: header -> cell from a ``labs.lab04`` run row (notebook 04).
FSDP_COLUMNS = {
    "units": lambda r: str(len(r["strategy_info"].get("units", [])) or "–"),
    "collectives / step": _calls,
    "largest unit, B": lambda r: _bytes_cell(_largest_unit(r)),
    "peak gathered, B": lambda r: _bytes_cell(r["peak_unsharded_bytes"][0]),
    "held per rank, B": lambda r: _bytes_cell(r["per_rank"][0]["total"]),
    "held where": lambda r: ", ".join(f"{k}: {v:,}" for k, v in r["held_by_device"].items()),
    "all-gather payload, B": lambda r: _bytes_cell(r["comm_per_step"].get("all_gather", {}).get("payload_bytes")),
    "reduce-scatter payload, B": lambda r: _bytes_cell(
        r["comm_per_step"].get("reduce_scatter", {}).get("payload_bytes")
    ),
    "sent / step, B": lambda r: _bytes_cell(sum(v["sent_bytes"] for v in r["comm_per_step"].values())),
    ".item() every step": lambda r: "yes" if r["sync_every_step"] else "no",
    "step time, ms": step_time_cell,
    "final loss": lambda r: f"{r['losses'][-1]:.5f}",
    "‖Δw‖/‖w‖ vs single": lambda r: f"{r['rel_weight_diff']:.1e}" if "rel_weight_diff" in r else "–",
    "GPU max allocated, B": lambda r: _bytes_cell(r["max_memory_allocated"][0]),
}


def fsdp_table(rows: list, columns: list[str]) -> tuple[list, list]:
    """``(header, rows)`` of the named ``FSDP_COLUMNS`` for each run, labelled; for ``show_table`` (notebook 04)."""
    return ["run", *columns], [[r["label"], *(FSDP_COLUMNS[c](r) for c in columns)] for r in rows]


def fsdp_side_by_side_table(rows: list, predictions: dict) -> tuple[list, list]:
    """``(header, rows)`` of notebook 04's strategy table: each run measured, the prediction beside it.

    ``rows``: ``labs.lab04`` run rows; ``predictions``: ``{strategy: predict.fsdp_run(...)}`` made
    before the run. Per run: the FSDP1 name, rank 0's bytes at rest (measured / ZeRO row), the
    peak of gathered bytes (measured / schedule), collectives per step (AG all-gather, RS
    reduce-scatter, AR all-reduce), bytes one rank sends per step, the final loss and the
    distance to single. No step time: these are counting runs (``step_time_cell`` says why).
    """
    header = [
        "run",
        "FSDP1 name",
        "held / rank, B",
        "ZeRO row, B",
        "peak gathered, B",
        "predicted, B",
        "collectives / step",
        "sent / step, B",
        "final loss",
        "‖Δw‖/‖w‖ vs single",
    ]
    out = []
    for r in rows:
        p = predictions[r["strategy"]]
        out.append(
            [
                r["label"],
                r["strategy_info"].get("fsdp1_name", "–"),
                _bytes_cell(r["per_rank"][0]["total"]),
                _bytes_cell(p["held"]["total"]),
                _bytes_cell(r["peak_unsharded_bytes"][0]),
                _bytes_cell(p["peak"]),
                *(
                    FSDP_COLUMNS[c](r)
                    for c in ("collectives / step", "sent / step, B", "final loss", "‖Δw‖/‖w‖ vs single")
                ),
            ]
        )
    return header, out


def bit_identity_table(groups: list[list[str]], *, reference: str = "single") -> tuple[list, list]:
    """``(header, rows)``: which runs ended with the same weights, bit for bit (notebook 04).

    ``groups``: ``labs.lab04.bit_identical_groups``. One row per group, lettered in run order.
    """
    return (
        ["weights", "runs that end bit for bit the same"],
        [[f"{chr(65 + i)}{' (reference)' if reference in g else ''}", ", ".join(g)] for i, g in enumerate(groups)],
    )


# ---------------------------------------------------------------------------------------------
# Notebook 06: work lost to a failure against the checkpoint interval
# ---------------------------------------------------------------------------------------------


def lost_work_figure(rows: list, lost: list | None = None, *, width: float = 10.0, height: float = 4.0):
    """Steps redone after each failure against the checkpoint interval K, and the time it cost (notebook 06).

    ``rows``: ``labs.lab06.lost_work_sweep`` rows. Left: each restart's redone steps (dots, one per
    failure position f mod K), their mean (diamonds), the expected (K − 1)/2 completed steps and
    K/2, which adds the step in flight. Right (when ``lost``, ``labs.lab06.time_lost_by_interval``
    rows, is given): the measured wall-clock time lost per failure, restart and redo stacked.
    """
    fig = new_figure(width if lost else width * 0.7, height)
    axes = fig.subplots(1, 2) if lost else [fig.subplots()]
    ax = axes[0]
    ks = np.array([r["every"] for r in rows], dtype=float)
    for i, r in enumerate(rows):
        ax.scatter(
            [r["every"]] * len(r["redone"]),
            r["redone"],
            color="#9a9a9a",
            s=18,
            zorder=2,
            label="one restart" if i == 0 else None,
        )
    ax.scatter(ks, [r["mean_redone"] for r in rows], marker="D", color="#3a7dc9", s=50, zorder=3, label="measured mean")
    grid = np.linspace(ks.min(), ks.max(), 50)
    ax.plot(grid, (grid - 1) / 2, color="#3a7dc9", lw=1, label="(K − 1)/2 completed steps")
    ax.plot(grid, grid / 2, color="#e8883a", lw=1.5, ls="--", label="K/2: with the step in flight")
    ax.set_xlabel("checkpoint interval K (optimizer steps)")
    ax.set_ylabel("steps redone after a failure")
    ax.set_xticks(ks)
    ax.set_title("Work lost: half an interval, on average")
    ax.legend(loc="upper left", fontsize=8)
    if lost:
        ax = axes[1]
        lk = [r["every"] for r in lost]
        restart = [r["restart_s"] for r in lost]
        redo = [r["redo_s"] for r in lost]
        ax.bar(lk, restart, width=0.5, color="#9a9a9a", label="restart: stop, relaunch, rendezvous, load")
        ax.bar(lk, redo, width=0.5, bottom=restart, color="#3a7dc9", label="redo the completed steps")
        for k, a, b, r in zip(lk, restart, redo, lost):
            ax.text(k, a + b, f"{a + b:.2f} s\n({r['failures']} failures)", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(lk)
        ax.set_xlabel("checkpoint interval K (optimizer steps)")
        ax.set_ylabel("wall-clock seconds lost per failure")
        ax.set_ylim(0, 1.3 * max(a + b for a, b in zip(restart, redo)))
        ax.set_title("Time lost: here the restart dominates")
        ax.legend(loc="lower right", fontsize=8)
    return fig


def checkpoint_interval_figure(jobs: dict, *, width: float = 7.5, height: float = 4.2):
    """Overhead per step against the checkpoint interval, one curve per case, minimum marked (notebook 06).

    ``jobs``: ``{label: labs.lab06.interval_tradeoff(...)}``.
    """
    fig = new_figure(width, height)
    ax = fig.subplots()
    for (label, job), color in zip(jobs.items(), ("#3a7dc9", "#e8883a", "#5aa05a")):
        share = np.asarray(job["overhead_s"]) / job["step_s"] * 100
        ax.plot(job["k"], share, color=color, lw=1.8, label=label)
        best = job["k_young"]
        ax.scatter([best], [job["overhead_at_best"] * 100], color=color, zorder=3)
        ax.annotate(
            f"K = {best:,.0f}: {job['overhead_at_best']:.1%}",
            (best, job["overhead_at_best"] * 100),
            textcoords="offset points",
            xytext=(6, 8),
            fontsize=8,
            color=color,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint interval K (optimizer steps, log scale)")
    ax.set_ylabel("time lost per step (% of a step, log)")
    ax.set_title("Save too often or too rarely, lose time: the best K is Young's")
    ax.legend(fontsize=8)
    return fig


def sync_vs_diloco_figure(runs: dict, *, width: float = 10.0, height: float = 3.8):
    """Loss per step and bytes across the link per step, one colour per run (notebook 06).

    ``runs``: ``{label: course_utils.ft.ft_run report}``, the same steps, data and failure in each.
    Right panel: the bytes counted on node 0's cable during each step (absent on loopback).
    """
    fig = new_figure(width, height)
    loss_ax, link_ax = fig.subplots(1, 2)
    colors = ("#9a9a9a", "#3a7dc9", "#e8883a")
    width_bar = 0.8 / max(1, len(runs))
    for i, ((label, run), color) in enumerate(zip(runs.items(), colors)):
        steps = [row["step"] for row in run["per_step"]]
        loss_ax.plot(steps, [row["loss"] for row in run["per_step"]], color=color, lw=1.8, marker=".", label=label)
        mb = [(row["link_bytes"] or 0) / 1e6 for row in run["per_step"]]
        link_ax.bar(
            np.array(steps) + (i - (len(runs) - 1) / 2) * width_bar, mb, width=width_bar, color=color, label=label
        )
    killed = next((run["killed"]["step"] for run in runs.values() if run.get("killed")), None)
    if killed is not None:
        loss_ax.axvline(killed, color="#c0392b", lw=1, ls=":", label="a group dies")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss (mean of the groups)")
    loss_ax.set_title("Not the same path: the loss is the measurement")
    loss_ax.legend(fontsize=8)
    link_ax.set_xlabel("step")
    link_ax.set_ylabel("MB across node 0's cable (counted)")
    link_ax.set_title("DiLoCo crosses the link once every H steps")
    if not any(row["link_bytes"] for run in runs.values() for row in run["per_step"]):
        link_ax.text(0.5, 0.5, "on loopback: no link to count", ha="center", va="center", transform=link_ax.transAxes)
    link_ax.legend(fontsize=8)
    return fig
