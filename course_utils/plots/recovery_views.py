"""Notebook 06's pictures: the work a failure loses against the checkpoint interval, and Young's interval
(notebook 06)."""

from __future__ import annotations

import numpy as np
from matplotlib.patches import Patch

from .base import new_figure

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
            ax.text(
                k,
                a + b,
                f"{a + b:.2f} s\n({r['failures']} failure{'s' if r['failures'] != 1 else ''})",
                ha="center",
                va="bottom",
                fontsize=8,
            )
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
    Right panel: the bytes counted on node 0's cable during each step (absent on loopback); hatched, the
    step whose bytes include the heal's copy (DiLoCo: the round's synchronisation before ``healed_to_step``).
    """
    fig = new_figure(width, height)
    loss_ax, link_ax = fig.subplots(1, 2)
    colors = ("#9a9a9a", "#3a7dc9", "#e8883a")
    width_bar = 0.8 / max(1, len(runs))
    for i, ((label, run), color) in enumerate(zip(runs.items(), colors)):
        steps = [row["step"] for row in run["per_step"]]
        loss_ax.plot(steps, [row["loss"] for row in run["per_step"]], color=color, lw=1.8, marker=".", label=label)
        mb = [(row["link_bytes"] or 0) / 1e6 for row in run["per_step"]]
        bars = link_ax.bar(
            np.array(steps) + (i - (len(runs) - 1) / 2) * width_bar, mb, width=width_bar, color=color, label=label
        )
        if run.get("healed_to_step") is not None:
            heal_step = run["healed_to_step"] - (1 if run.get("diloco") else 0)
            for bar, step in zip(bars, steps):
                if step == heal_step:
                    bar.set(hatch="///", edgecolor="black", linewidth=0.6)
    killed = next((run["killed"]["step"] for run in runs.values() if run.get("killed")), None)
    if killed is not None:
        loss_ax.axvline(killed, color="#c0392b", lw=1, ls=":", label="a group dies")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss (mean of the groups)")
    loss_ax.set_title("Not the same path: the loss is the measurement")
    loss_ax.legend(fontsize=8)
    link_ax.set_xlabel("step")
    link_ax.set_ylabel("MB across node 0's cable (counted)")
    link_ax.set_title("DiLoCo syncs once every H steps (hatched: a heal)")
    if not any(row["link_bytes"] for run in runs.values() for row in run["per_step"]):
        link_ax.text(0.5, 0.5, "on loopback: no link to count", ha="center", va="center", transform=link_ax.transAxes)
    handles, _ = link_ax.get_legend_handles_labels()
    heal = Patch(facecolor="white", hatch="///", edgecolor="black", linewidth=0.6, label="with the heal's copy")
    link_ax.legend(handles=[*handles, heal], fontsize=8)
    return fig
