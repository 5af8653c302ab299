"""The rehearsal's views: tables and charts of what it measured and of what the planner predicted, drawn
from numbers the other rooms computed (notebook 05b). Nothing here computes a prediction.
"""

from __future__ import annotations

import math

from ..plan.inputs import Cluster
from ..strategies import get_fsdp
from ..units import GB, MB, GiB
from .calibration import measured_terms
from .predictions import CALIBRATED_TOL, buffers_booked
from .run import Rehearsal, short_size
from .tracker import CATEGORIES, PART_COLORS, PARTS

# ---------------------------------------------------------------------------------------------
# Views and text
# ---------------------------------------------------------------------------------------------


UNITS = {"GB": GB, "GiB": GiB, "MB": MB}


def _fmt(n: float, unit: str) -> str:
    return f"{n / UNITS[unit]:,.2f}"


def format_report(r: Rehearsal, rows: list[dict], unit: str = "GB", calibrated: dict | None = None) -> str:
    """The text ``python -m course_utils rehearse`` prints: the rehearsal's categories; ``calibrated``, notebook
    05's throughput planner term by term (``calibration.planner_terms``, this CPU's kernels) against it; then
    ``rows``, the first planner's bill item by item (``predictions.compare(r)``) (notebook 05b)."""
    c = r.cfg
    u = _unit_name(unit)
    head = (
        f"dress rehearsal: Ψ = {r.psi:,} ({short_size(r.psi)}; L={c.layers} h={c.width} heads={c.heads} "
        f"vocab={c.vocab} seq={c.seq}), {get_fsdp(r.strategy).fsdp1_name} on {r.nproc} ranks"
        + (f" (nodes of {r.node_size})" if get_fsdp(r.strategy).shard_over == "node" else "")
        + f", micro-batch {r.micro_batch} x {c.seq} tokens, {r.mixed_precision}"
        + (", activation checkpointing" if r.act_ckpt else "")
        + f"; torch {r.torch_version}, FSDPMemTracker on fake tensors, {r.wall_s:.1f} s"
    )
    lines = [head, "", f"peak per rank {_fmt(r.peak_bytes, unit)} {u}; what held it (largest of each in the step):"]
    for cat in CATEGORIES:
        at, most = r.peak.get(cat, 0), r.category_peaks.get(cat, 0)
        if at or most:
            lines.append(f"  {cat:<16} {_fmt(at, unit):>10}   ({_fmt(most, unit)})")
    if calibrated:
        lines += ["", f"notebook 05's planner (calibrated; this CPU's kernels) against the rehearsal, {u}:"]
        measured = measured_terms(r)
        lines.append(f"  {'':<58} {'planner':>10} {'rehearsal':>10}  ratio")
        at = calibrated["moment"]
        for term in ("activations", "states and buffers", "peak"):
            when = f"at the planner's {at}"
            if term == "peak" and calibrated["peak moment"] != at:  # the planner's largest moment is another
                when = (
                    f"at the planner's peak moment, the {calibrated['peak moment']}; at its {at} it says "
                    f"{_fmt(calibrated['at moment'], unit)}, x{measured[term] / calibrated['at moment']:.2f}"
                )
            if term == "peak" and r.peak_at:  # the rehearsal's own moment, as the tracker saw it
                when += f"; the rehearsal peaked in the {r.peak_at}"
            lines.append(
                f"  {term:<58} {_fmt(calibrated[term], unit):>10} {_fmt(measured[term], unit):>10}"
                f"  x{measured[term] / calibrated[term]:.2f}  ({when})"
            )
    lines += [
        "",
        f"the first planner (course_utils.plan.memory_breakdown: memory.py's {r.stage} row with Nd = {r.nd}, the "
        f"paper's activation rule, buffers: {buffers_booked(r.strategy)}), item by item, {u}:",
    ]
    lines.append(f"  {'':<58} {'formula':>10} {'rehearsal':>10}  ratio")
    for row in rows:
        ratio = "" if math.isnan(row["ratio"]) else f"  x{row['ratio']:.2f}"
        lines.append(
            f"  {row['item']:<58} {_fmt(row['formula'], unit):>10} {_fmt(row['rehearsal'], unit):>10}"
            f"{ratio}  ({row['when']})"
        )
        lines.append(f"      {row['why']}")
    return "\n".join(lines)


def usable(gpu_mem: float) -> float:
    """Tensor bytes a rehearsed peak may reach on a GPU of ``gpu_mem`` bytes: the planner's own fits test
    (``plan.Cluster.usable``: the caching allocator's reserve on top of the tensors and the CUDA context left
    out), so that "fits" means the same here and in notebook 05 (notebook 05b)."""
    return Cluster(gpu_mem=gpu_mem).usable


def usable_words(gpu_mem: float) -> str:
    """``usable(gpu_mem)`` and its two terms, from the planner's own record, in words (notebook 05b)."""
    c = Cluster(gpu_mem=gpu_mem)
    return (
        f"one GPU holds {gpu_mem / GB:g} GB, of which a peak of tensors may fill {c.usable / GB:.1f} GB (the "
        f"planner's rule: the caching allocator's {c.reserve:.0%} on top of the tensors and "
        f"{c.context / GiB:g} GiB of CUDA context)"
    )


def bars_view(
    rehearsals: list[Rehearsal], *, gpu_mem: float = 80 * GB, title: str = "", planned: dict | None = None
) -> dict:
    """What the stacked-bar chart draws: one bar per rehearsal, its peak by part (notebook 05b).

    ``planned``: ``{label: bytes}`` of settings not rehearsed, drawn as outlined bars of the
    calibrated planner's peak (``calibration.planned_peak``) beside the rehearsed ones: cheap context for a slow
    model.
    """
    bars = [{"label": r.label, "parts": r.parts("peak"), "peak": r.peak_bytes} for r in rehearsals]
    planned_bars = [{"label": f"{label} (planned)", "peak": float(v)} for label, v in (planned or {}).items()]
    if not title and bars:
        lo = min(bars, key=lambda b: b["peak"])
        fits = sum(b["peak"] <= usable(gpu_mem) for b in bars)
        title = (
            f"{fits} of {len(bars)} rehearsed fit {usable(gpu_mem) / GB:.1f} GB usable; lowest: {lo['label']}, "
            f"{lo['peak'] / GB:.1f} GB"
        )
    return {
        "bars": bars,
        "planned": planned_bars,
        "parts": list(PARTS),
        "colors": PART_COLORS,
        "gpu_mem": gpu_mem,
        "usable": usable(gpu_mem),
        "title": title,
    }


def _unit_name(unit: str) -> str:
    return f"{unit} ({ {'GB': '10^9', 'GiB': '2^30', 'MB': '10^6'}[unit] } bytes)"


def markdown_table(rehearsals: list[Rehearsal], unit: str = "GB", *, gpu_mem: float | None = None) -> str:
    """The peak per rank by part, and where in the step the tracker saw it, one row per rehearsal, as a Markdown
    table (notebook 05b)."""
    heads = ["setting", "N", "Nd"] + list(PARTS) + ["**peak**", "peak in the"] + (["fits?"] if gpu_mem else [])
    heads.append("rehearsal")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rehearsals:
        parts = r.parts("peak")
        cells = [r.label, str(r.nproc), str(r.nd)] + [_fmt(parts[p], unit) for p in PARTS]
        cells += [f"**{_fmt(r.peak_bytes, unit)}**", r.peak_at or "n/a"]  # the tracker's moment: "backward of GPT"
        if gpu_mem:
            cells.append("yes" if r.peak_bytes <= usable(gpu_mem) else "no")
        cells.append(f"{r.wall_s:.1f} s")
        lines.append("| " + " | ".join(cells) + " |")
    psi = {short_size(r.psi) for r in rehearsals}
    return (
        f"Bytes per GPU at the peak of one training step, {_unit_name(unit)}; Ψ = {', '.join(sorted(psi))}"
        + (f"; {usable_words(gpu_mem)}" if gpu_mem else "")
        + "\n\n"
        + "\n".join(lines)
    )


def markdown_compare(r: Rehearsal, rows: list[dict], unit: str = "GB") -> str:
    """``rows`` (``predictions.compare(r)``) as a Markdown table: item, planner, rehearsal, ratio, when, why (notebook 05b)."""
    lines = [
        f"{r.label}, {r.nproc} ranks, Ψ = {short_size(r.psi)}; bytes per GPU, {_unit_name(unit)}",
        "",
        "| item | first planner | rehearsal | ratio | when | what the formula counts, what FSDP2 holds |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "" if math.isnan(row["ratio"]) else f"{row['ratio']:.3f}"
        lines.append(
            f"| {row['item']} | {_fmt(row['formula'], unit)} | {_fmt(row['rehearsal'], unit)} | {ratio} "
            f"| {row['when']} | {row['why']} |"
        )
    return "\n".join(lines)


def markdown_bridge(rows: list[dict]) -> str:
    """``labs.lab05b.bridge`` rows as a Markdown table: rehearsal bytes against every real rank's (notebook 05b)."""
    lines = [
        "Bytes one rank holds after one optimizer step of the tiny course model: the rehearsal "
        "(tracker, fake tensors) against real gloo ranks (instrument.tensor_bytes on the local shards)",
        "",
        "| ranks | strategy | | parameters | gradients | optimizer state | total | equal on every rank? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = get_fsdp(row["strategy"]).fsdp1_name
        fake = row["rehearsal"]
        lines.append(
            f"| {row['nproc']} | {name} | rehearsal | {fake['params']:,} | {fake['grads']:,} "
            f"| {fake['optim']:,} | {fake['total']:,} | |"
        )
        real = row["real"][0]
        lines.append(
            f"| | | real, rank 0 of {len(row['real'])} | {real['params']:,} | {real['grads']:,} "
            f"| {real['optim']:,} | {real['total']:,} | {'yes' if row['equal'] else '**no**'} |"
        )
    return "\n".join(lines)


def markdown_bridge_peaks(rows: list[dict]) -> str:
    """``labs.lab05b.bridge`` rows' tracked steps as a Markdown table: categories' own peaks and the step's peak,
    the rehearsal against real rank 0, and whether every other category is equal on every rank (notebook 05b)."""
    shown = ("Activation", "Unsharded Param", "Temp")
    lines = [
        "Bytes at the peak of one step of the tiny course model, the same tracked step (FSDPMemTracker) on fake "
        "tensors and on real gloo ranks: rehearsal / real rank 0",
        "",
        "| ranks | strategy | activations | gathered weights | Temp | peak of the step | other categories equal? |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cats = row["category_peaks"]
        cells = [f"{cats[c][0]:,} / {cats[c][1][0]:,}" for c in shown]
        others = all(set(real) == {fake} for c, (fake, real) in cats.items() if c not in shown)
        name = get_fsdp(row["strategy"]).fsdp1_name
        lines.append(
            f"| {row['nproc']} | {name} | {' | '.join(cells)} | {row['peak_bytes'][0]:,} / {row['peak_bytes'][1][0]:,} "
            f"| {'yes' if others else 'no'} |"
        )
    return "\n".join(lines)


def markdown_summary(rows: list[dict], unit: str = "GB") -> str:
    """``rows`` (``predictions.summary_rows``) as a Markdown table, the calibrated planner first (notebook 05b)."""
    lines = [
        f"Peak bytes per GPU, {_unit_name(unit)}: notebook 05's throughput planner (calibrated, this CPU's "
        "kernels) and the first planner (the paper's rule) against the rehearsal; model states after the step "
        "against 16 bytes per parameter of the shard (FSDP2's padding counted)",
        "",
        "| setting | rehearsal | calibrated planner | rehearsal / calibrated | first planner | rehearsal / first "
        "| model states at rest, rehearsal / formula |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cal = "-" if row["calibrated"] is None else _fmt(row["calibrated"], unit)
        ratio = "-" if row["calibrated_ratio"] is None else f"{row['calibrated_ratio']:.3f}"
        claim = "" if row["claimed"] else " (not claimed)"
        lines.append(
            f"| {row['setting']} | {_fmt(row['rehearsal'], unit)} | {cal} | **{ratio}** "
            f"| {_fmt(row['planner'], unit)} | {row['ratio']:.3f}{claim} | {row['model_states']:.5f} |"
        )
    return "\n".join(lines)


def rehearsal_figure(view: dict, *, width: float = 7.5, height: float = 5.0):
    """Stacked bars: one GPU's peak per setting, by part, against the GPU's memory (notebook 05b).

    ``view`` is ``bars_view(...)``; it uses ``plots.new_figure`` like every course chart.
    """
    from matplotlib.patches import Patch

    from ..plots import new_figure

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    bars = view["bars"]
    planned = view.get("planned", [])
    for j, bar in enumerate(planned):
        x = len(bars) + j
        ax.bar(x, bar["peak"] / GB, width=0.6, fill=False, edgecolor="#555555", ls="--", hatch="//", lw=1)
        ax.text(
            x, bar["peak"] / GB, f"{bar['peak'] / GB:.1f} GB", ha="center", va="bottom", fontsize=12, color="#555555"
        )
    for i, bar in enumerate(bars):
        bottom = 0.0
        for part in view["parts"]:
            value = bar["parts"][part] / GB
            if value > 0:
                ax.bar(i, value, bottom=bottom, width=0.6, color=view["colors"][part], edgecolor="white", lw=0.5)
                bottom += value
        ax.text(i, bottom, f"{bar['peak'] / GB:.1f} GB", ha="center", va="bottom", fontsize=12)
    gpu = view["gpu_mem"] / GB
    ax.axhline(gpu, color="#c0392b", ls="--", lw=1.5)
    every = bars + planned
    ax.axhline(view["usable"] / GB, color="#c0392b", ls=":", lw=1.2)  # the planner's fits test (``usable``)
    ax.text(-0.55, gpu, f" one {gpu:g} GB GPU\n dotted: {view['usable'] / GB:.1f} GB usable", color="#c0392b",
            ha="left", va="bottom", fontsize=12)  # fmt: skip
    ax.set_xticks(
        range(len(every)),
        [
            b["label"]
            .replace(" + ", "\n+ ")
            .replace("_GRAD_", "_GRAD\n_")
            .replace("HYBRID_", "HYBRID\n_")
            .replace(" (planned)", "\n(planned)")
            for b in every
        ],
        fontsize=11,
    )
    ax.set_xlim(-0.6, max(len(every), 3) - 0.4)
    ax.set_ylim(0, max([b["peak"] / GB for b in every] + [gpu]) * 1.15)
    ax.set_ylabel("peak memory per GPU, GB (10⁹ bytes)", fontsize=12)
    ax.tick_params(axis="y", labelsize=11)
    used = [p for p in view["parts"] if any(b["parts"][p] > 0 for b in bars)]
    handles = [Patch(color=view["colors"][p], label=p) for p in used]
    if planned:
        handles.append(
            Patch(
                fill=False,
                edgecolor="#555555",
                ls="--",
                hatch="//",
                label="not rehearsed: the calibrated planner's peak\n(this CPU's kernels)",
            )
        )
    fig.legend(handles=handles, fontsize=11, loc="outside lower center", ncols=2)
    ax.set_title(view["title"], fontsize=12)
    return fig


def agreement_figure(rows: list[dict], *, width: float = 7.0, height: float = 4.6):
    """Each planner's peak against the rehearsal's, one point per setting and planner (``rows``:
    ``predictions.summary_rows``), with the calibrated planner's ±CALIBRATED_TOL band (notebook 05b).

    Linear axes in GB from 0 (the settings span a few times, not decades), type large enough to
    read on a 1280 x 720 slide.
    """
    import numpy as np

    from ..plots import new_figure

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    ys = np.array([r["rehearsal"] for r in rows]) / GB
    first = np.array([r["planner"] for r in rows]) / GB
    cal = [(r["calibrated"] / GB, y, r) for r, y in zip(rows, ys) if r["calibrated"] is not None]
    hi = max(first.max(), ys.max(), max((x for x, _, _ in cal), default=0)) * 1.12
    grid = np.array([0, hi])
    ax.plot(grid, grid, color="#555555", lw=1.2, label="rehearsal = planner")
    ax.fill_between(grid, grid * (1 - CALIBRATED_TOL), grid * (1 + CALIBRATED_TOL), color="#3a7dc9", alpha=0.15,
                    label=f"±{CALIBRATED_TOL:.0%}")  # fmt: skip
    ax.scatter(first, ys, color="#e8883a", s=45, alpha=0.7, zorder=3, label="first planner (the paper's rule)")
    ax.scatter([x for x, _, _ in cal], [y for _, y, _ in cal], color="#3a7dc9", zorder=4, s=60,
               label="calibrated planner (notebook 05)")  # fmt: skip
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.tick_params(labelsize=12)
    ax.set_xlabel("planner's peak per GPU, GB", fontsize=13)
    ax.set_ylabel("rehearsal's peak per GPU, GB", fontsize=13)
    inside = sum(r["calibrated_within"] for r in rows)
    ax.set_title(
        f"The calibrated planner is within {CALIBRATED_TOL:.0%} of FSDP2's peak for {inside} of {len(rows)}",
        fontsize=13,
    )
    legend = ax.legend(fontsize=11, loc="lower right")  # below the diagonal: no planner here overestimates by much
    fig.canvas.draw()  # lay the figure out, then keep that layout: the labels are placed in its pixels
    fig.set_layout_engine("none")
    blue = [(x, y, r["short"], "#1f5a9e") for x, y, r in cal]  # text a shade darker than its point, to read on white
    orange = [(x, y, r["short"], "#a8550f") for x, y, r in zip(first, ys, rows)]
    _label_points(ax, blue + orange, avoid=[legend.get_window_extent()])
    return fig


def _label_points(ax, points: list, *, avoid=()) -> None:
    """Label every one of ``points`` (x, y, text, colour) at the first offset, nearest ring first, whose box clears
    every point, every label placed before it, the boxes in ``avoid`` and the axes' frame; a label set off past the
    first ring gets a leader line to its point (notebook 05b). Boxes are in display pixels: lay the figure out first.
    """
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pt = ax.figure.dpi / 72  # pixels per point
    dots = [Bbox.from_bounds(*(ax.transData.transform((x, y)) - 5 * pt), 10 * pt, 10 * pt) for x, y, _, _ in points]
    taken = list(avoid)
    turns = [(1, 0), (-1, 0), (0, 1), (0, -1), (0.7, 0.7), (-0.7, 0.7), (0.7, -0.7), (-0.7, -0.7)]
    for x, y, text, color in points:
        for ring in (8, 24, 44, 66, 90, 120, 150):
            for dx, dy in turns:
                label = ax.annotate(
                    text, (x, y), xytext=(dx * ring, dy * ring), textcoords="offset points", fontsize=11, color=color,
                    ha="left" if dx > 0 else "right" if dx < 0 else "center",
                    va="bottom" if dy > 0 else "top" if dy < 0 else "center",
                    arrowprops=dict(arrowstyle="-", color=color, lw=0.8, shrinkA=1, shrinkB=5) if ring > 8 else None,
                )  # fmt: skip
                label.update_positions(renderer)
                box = Text.get_window_extent(label, renderer).padded(2 * pt)  # the text's box, not its leader line's
                clear = not any(box.overlaps(b) for b in dots + taken)
                if clear and frame.containsx(box.x0) and frame.containsx(box.x1) and frame.containsy(box.y0) \
                        and frame.containsy(box.y1):  # fmt: skip
                    taken.append(box)
                    break
                label.remove()
            else:
                continue
            break
        else:  # nowhere clear: beside the point, as before
            ax.annotate(text, (x, y), xytext=(8, -4), textcoords="offset points", fontsize=11, color=color)
