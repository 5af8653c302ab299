"""Notebook 03's picture of stage 3, step by step: the GPUs × layers grid and what each GPU has sent (notebook 03)."""

from __future__ import annotations

import numpy as np

from ..strategies import DDP
from .base import PART_COLORS, new_figure

#: One colour per kind of stage-3 traffic (``stepper.TRAFFIC_KINDS``), in the figure and the live stepper.
TRAFFIC_COLORS = {
    "forward all-gather": PART_COLORS["weights"],
    "backward all-gather": "#b392d6",
    "reduce-scatter": PART_COLORS["gradients"],
}


def zero3_schedule_figure(state, *, width: float = 10.0, height: float = 4.2):
    """One state of the stage-3 schedule: the GPUs × layers grid and what each GPU has sent (notebook 03).

    ``state`` is a ``stepper.Stage3State``. Left: row g is GPU g, a column per unit (the layers, then
    the root), cut into Nd vertical slices; GPU g's own slice g of every unit is filled purple, the rest
    of a unit light while it is gathered whole, an orange mark on a slice once its summed gradients have
    arrived, the outlined column the unit being worked on. Right: Ψ units each GPU has sent so
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

    from ..stepper import TRAFFIC_KINDS, column_labels

    nd = state.nd
    labels = column_labels(nd)
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
    grid.set_xticks([s + 0.46 for s in range(layers)], labels, fontsize=8)
    grid.set_yticks([nd - 1 - g + 0.46 for g in range(nd)], [f"GPU {g}" for g in range(nd)], fontsize=8)
    grid.set_aspect("equal")
    grid.tick_params(length=0)
    for spine in grid.spines.values():
        spine.set_visible(False)
    grid.set_title(
        f"step {state.step}: {state.phase}" + (f", {labels[state.layer]}" if state.layer is not None else ""),
        fontsize=10,
    )
    left = np.zeros(nd)
    for kind in TRAFFIC_KINDS:
        values = np.array([state.sent[g][kind] for g in range(nd)])
        bars.barh(range(nd)[::-1], values, left=left, color=TRAFFIC_COLORS[kind], label=kind, height=0.6)
        left += values
    for g in range(nd):
        bars.text(left[g], nd - 1 - g, f" {left[g]:.3g}Ψ", va="center", fontsize=9)
    dp = 2 * (nd - 1) / nd
    bars.axvline(dp, color=DDP.color, ls="--", lw=1.2)
    bars.text(dp, nd - 0.45, f" plain DP: {dp:.3g}Ψ", fontsize=8, color=DDP.color)
    bars.set_xlim(0, 3 * (nd - 1) / nd * 1.25)
    bars.set_ylim(-0.6, nd)
    bars.set_yticks(range(nd)[::-1], [f"GPU {g}" for g in range(nd)], fontsize=8)
    bars.set_xlabel("sent by each GPU so far, in units of Ψ (ring model)")
    if legend:
        bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    bars.set_title("Traffic so far", fontsize=10)


def calls_cell(calls_per_step: float, steps: int) -> str:
    """A count of collectives for a table: per step when every step issues the same number, otherwise
    the total over the run ("86 in 3 steps": DDP's one-off bucket-order broadcasts of its first steps
    fall in no single step, and 28.667 calls per step is not something a run does) (notebook 03)."""
    total = calls_per_step * steps
    if abs(calls_per_step - round(calls_per_step)) < 1e-9:
        return f"{round(calls_per_step)}"
    return f"{round(total)} in {steps} steps"
