"""Notebook 02's pictures: every rank's DDP step against time (each bucket's all-reduce), the bucket-cap sweep
(notebook 02)."""

from __future__ import annotations

from matplotlib.ticker import FuncFormatter, NullFormatter

from .base import PART_COLORS, new_figure


def ddp_timelines_figure(timelines: list, *, title: str = "", width: float = 8.5, one_axis: bool = False):
    """Every rank's DDP step, one panel per rank (notebook 02).

    ``timelines`` is a row's ``"timelines"`` from ``labs.lab02.ddp_measurements``' sweep: one timeline
    per rank, times in ms after that rank's backward began; with ``one_axis`` they have been moved onto
    rank 0's clock (``labs.lab02.on_one_axis``) and the panels share that axis. Two panels to a row (12.5 inches
    wide), so two ranks fit a 1280 x 720 slide with their labels at 14 px (issue 28).
    """
    buckets = len({r["bucket"] for r in timelines[0]["ready"]})
    cols = min(2, len(timelines))
    rows = -(-len(timelines) // cols)
    fig = new_figure(width if cols == 1 else 12.5, 1.2 + rows * (0.6 + 0.3 * (buckets + 1)))
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    for rank, (ax, timeline) in enumerate(zip(axes, timelines)):
        _draw_ddp_timeline(ax, timeline, legend=False, xlabel=rank >= len(timelines) - cols, one_axis=one_axis)
        ax.set_title(f"rank {rank}", fontsize=9, loc="left")
        ax.tick_params(labelleft=rank % cols == 0)  # the same buckets on every rank: named once a row
        ax.tick_params(labelbottom=rank >= len(timelines) - cols)  # times under the last panel of each column
    for ax in axes[len(timelines) :]:
        ax.set_visible(False)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title or "Each bucket's all-reduce starts as soon as its last gradient is ready", fontsize=10)
    return fig


def _draw_ddp_timeline(ax, timeline: dict, *, legend: bool = True, xlabel: bool = True, one_axis: bool = False) -> None:
    buckets = sorted({r["bucket"] for r in timeline["ready"]})
    top = len(buckets)
    began = timeline.get("backward_start_ms", 0.0) if one_axis else 0.0
    forward = timeline["forward_ms"]
    ax.barh(top, began - forward, left=forward, color="#bbbbbb", height=0.6, label="forward")
    ax.barh(
        top,
        timeline["backward_end_ms"] - began,
        left=began,
        color=PART_COLORS["gradients"],
        height=0.6,
        label="backward",
    )
    ends = [r["end_ms"] if r["end_ms"] is not None else timeline["synced_ms"] for r in timeline["all_reduce"]]
    done = max([timeline["backward_end_ms"], *ends])  # the last all-reduce over: the rest is this host's own time
    ax.barh(
        top,
        done - timeline["backward_end_ms"],
        left=timeline["backward_end_ms"],
        color="#dddddd",
        hatch="//",
        edgecolor="#888888",
        height=0.6,
        label="waiting for all-reduces",
    )
    ax.barh(
        top,
        timeline["synced_ms"] - done,
        left=done,
        color="#f4f4f4",
        hatch="..",
        edgecolor="#aaaaaa",
        height=0.6,
        label="until the step starts (wait() returns, mean into .grad)",
    )
    for i, (row, end) in enumerate(zip(timeline["all_reduce"], ends)):
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
        ax.set_xlabel("ms since rank 0's backward began (one clock)" if one_axis else "time since backward began (ms)")
    if legend:
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.3 if xlabel else -0.14), ncol=3, fontsize=8, frameon=False
        )


def bucket_sweep_figure(rows: list, *, title: str = "", width: float = 10.0, height: float = 3.8):
    """All-reduce calls per step and step time against the bucket cap (notebook 02).

    ``rows`` come from ``labs.lab02.ddp_measurements``' sweep: ``cap_mb``, ``buckets``, ``calls_per_step``,
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


def bucket_cost_figure(model: dict, *, title: str = "", width: float = 10.0, height: float = 3.8):
    """The bucket cap's cost model against the measurements (notebook 02).

    ``model`` is ``plan.bucket_cap_model``'s. Left: each isolated all-reduce size, its median and interquartile
    range, and the fitted line t(B) = latency + sent bytes / bandwidth (log-log). Right: each cap's measured
    step (median and interquartile range), the shared-cores price, and the line of the medians against the
    calls (``in_step_s``), fitted on some caps: the held-out ones ringed.
    """
    fit = model["fit"]
    fig = new_figure(width, height)
    left, right = fig.subplots(1, 2)
    pts = fit["points"]
    sizes = [p["bytes"] for p in pts]
    med = [p["median_s"] * 1e3 for p in pts]
    left.errorbar(
        sizes,
        med,
        yerr=[[m - p["q1_s"] * 1e3 for m, p in zip(med, pts)], [p["q3_s"] * 1e3 - m for m, p in zip(med, pts)]],
        fmt="o",
        color="#444444",
        capsize=3,
        label="measured (median, quartiles)",
    )
    left.plot(sizes, [p["predicted_s"] * 1e3 for p in pts], "-", color=PART_COLORS["optimizer"], label="fitted line")
    left.set_xscale("log")
    left.set_yscale("log")
    lo, hi = left.get_ylim()
    left.set_yticks([t for t in (0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100) if lo <= t <= hi], minor=False)
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    left.yaxis.set_minor_formatter(NullFormatter())  # unlabelled minor ticks: a label on each cluttered the axis
    left.set_xlabel("buffer bytes B (sent = 2(N−1)/N·B)")
    left.set_ylabel("time (ms)")
    left.legend(frameon=False, fontsize=8)
    left.set_title(f"One all-reduce: {fit['latency_s'] * 1e3:.2f} ms + sent bytes / {fit['bandwidth'] / 1e9:.2g} GB/s")
    rows = model["rows"]
    caps = [r["cap_mb"] for r in rows]
    m = [r["measured"]["median"] * 1e3 for r in rows]
    right.errorbar(
        caps,
        m,
        yerr=[
            [x - r["measured"]["q1"] * 1e3 for x, r in zip(m, rows)],
            [r["measured"]["q3"] * 1e3 - x for x, r in zip(m, rows)],
        ],
        fmt="o",
        color="#444444",
        capsize=3,
        label="measured step",
    )
    right.plot(
        caps, [r["shared_s"] * 1e3 for r in rows], "s--", color=PART_COLORS["gradients"], label="model: shared cores"
    )
    right.plot(caps, [r["in_step_s"] * 1e3 for r in rows], "d-.", color="#777777", label="line fitted to the steps")
    held = [r for r in rows if r.get("held_out")]
    right.plot([r["cap_mb"] for r in held], [r["in_step_s"] * 1e3 for r in held], "o", mfc="none", ms=11,
               color="#777777", label="held out: priced, not fitted")  # fmt: skip
    right.set_xscale("log")
    right.set_ylim(bottom=0)
    right.set_xlabel("bucket cap (MiB)")
    right.set_ylabel("step time (ms)")
    right.legend(frameon=False, fontsize=8)
    right.set_title("Each cap's step, measured and priced")
    if title:
        fig.suptitle(title)
    return fig
