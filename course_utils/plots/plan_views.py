"""Notebook 05's pictures: the planner's memory bars and overlap chart, the crossover of compute and gathers
(notebook 05). They draw a ``plan.Plan`` and the curves it carries; nothing here computes."""

from __future__ import annotations

from ..strategies import HYBRID_SHARD, RECORD, get
from ..units import GB
from .base import PART_COLORS, new_figure

# ---------------------------------------------------------------------------------------------
# Notebook 05: the planner's memory bars and overlap chart
# ---------------------------------------------------------------------------------------------


def _plan_memory_axes(ax, p) -> None:
    from matplotlib.patches import Patch

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
        get(s).title.split(" (")[0].replace(" + optimizer offload", "\n+ offload").replace("stage ", "stage\u00a0")
        for s in names
    ]
    ax.set_xticks(range(len(names)), short, fontsize=8, rotation=0)
    ax.set_ylabel("memory per GPU, GB (10^9 bytes)")
    ax.legend(
        handles=[
            Patch(color=PART_COLORS["optimizer"], label="model states"),
            Patch(color=PART_COLORS["activations"], label="activations"),
            Patch(color=PART_COLORS["buffers"], label="buffers"),
            Patch(fill=False, edgecolor="#c0392b", ls="--", label=f"{c.gpu_mem / GB:.1f} GB GPU (dotted: usable)"),
        ],
        fontsize=7,
        loc="upper right",
    )
    ax.set_title("Memory per GPU (faded: does not fit; outlined: chosen)", fontsize=9)


def _plan_overlap_axes(ax, p) -> None:
    m, c, curve = p.model, p.cluster, p.overlap  # the plan computed its overlap curve: this only draws it
    ax.plot(curve["tokens"], curve["compute_s"] * 1e3, color=PART_COLORS["activations"], label="block forward compute")
    ax.axhline(
        curve["gather_intra_s"] * 1e3,
        color=HYBRID_SHARD.color,
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
    fig = new_figure(width, height)
    left, right = fig.subplots(1, 2, width_ratios=[1.25, 1])
    _plan_memory_axes(left, p)
    _plan_overlap_axes(right, p)
    choice = p.recommendation["strategy"]
    fig.suptitle(f"Recommendation: {get(choice).title if choice in RECORD else 'none fits'}", fontsize=11)
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
    ax.axhline(1.0, color="black", lw=1, label="ratio 1: gathers hide above it")  # named in the legend, off the data
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per micro-batch per GPU (b·s), log scale")
    ax.set_ylabel("block forward compute ÷ all-gather time")
    ax.set_title("The crossover is a number of tokens: about FLOP/s ÷ bandwidth", fontsize=10)
    low = min(min(y) for _, y in lines.values())
    ax.set_ylim(bottom=low / 300)  # room below the lines, for the legend: it covers no data
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.grid(True, which="major", alpha=0.3)
    return fig


def backward_timeline_figure(runs: dict, *, width: float = 10.0, height: float = 3.6):
    """One clocked backward per run, unit by unit (notebook 05): each block's backward compute on its own row, the
    collectives that cross the nodes on the row below, milliseconds from the backward's start. ``runs``:
    ``{title: labs.lab05.backward_overlap(...)}``; the numbers in each title are that dict's."""
    fig = new_figure(width, height)
    axes = fig.subplots(1, len(runs), sharey=True, sharex=True)
    for ax, (title, o) in zip(list(axes) if len(runs) > 1 else [axes], runs.items()):
        n = len(o["compute"])
        for i, (s, e) in enumerate(o["compute"]):
            ax.barh(i, (e - s) * 1e3, left=s * 1e3, color=PART_COLORS["activations"], height=0.6)
        for s, e in o["cross"]:
            ax.barh(-1, (e - s) * 1e3, left=s * 1e3, color="#c0392b", height=0.6, edgecolor="white")
        ax.set_yticks([-1, *range(n)], ["cross-node\ncollectives", *(f"block {i}" for i in range(n))], fontsize=8)
        ax.set_xlim(left=0)
        ax.set_title(
            f"{title}\nacross the nodes {o['cross_s'] * 1e3:.0f} ms, of it during compute {o['hidden_s'] * 1e3:.0f} ms",
            fontsize=9,
        )
    fig.supxlabel("ms from the start of the backward (the gaps: collectives inside a node, the root unit)", fontsize=8)
    return fig
