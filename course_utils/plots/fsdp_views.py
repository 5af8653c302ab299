"""Notebook 04's pictures and tables: each FSDP strategy's bytes held, gathered and sent, measured beside
the prediction (notebook 04)."""

from __future__ import annotations

import numpy as np

from ..strategies import SINGLE
from .base import PART_COLORS, new_figure

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
    mem.set_title("Held at rest (solid) and the most parameters gathered at once in a step (hatched)", fontsize=9)
    mem.set_ylim(
        0, max(max(r["per_rank"][0]["total"], (r.get("peak_unsharded_bytes") or [0])[0] or 0) for r in rows) / mb * 1.1
    )
    handles = [Patch(color=PART_COLORS[p], label=p) for _, p in parts]
    handles.append(
        Patch(
            facecolor="white", edgecolor=PART_COLORS["weights"], hatch="//", label="gathered parameters, most at once"
        )
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
    from ..fsdp import calls_text  # imported when a table is drawn: plots itself stays free of torch

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
    "gathered params at most, B": lambda r: _bytes_cell(r["peak_unsharded_bytes"][0]),
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
    before the run. Per run: the FSDP1 name, rank 0's bytes at rest (measured / ZeRO row and Adam's
    step counters), the most gathered parameter bytes at once (measured / schedule; FSDP2's own buffers
    and the activations come on top: the step's peak is a timeline's), collectives per step (AG all-gather, RS
    reduce-scatter, AR all-reduce), bytes one rank sends per step, the final loss and the
    distance to single. No step time: these are counting runs (``step_time_cell`` says why).
    """
    header = [
        "run",
        "FSDP1 name",
        "held / rank, B",
        "ZeRO row + step counters, B",
        "gathered params at most, B",
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


def bit_identity_table(groups: list[list[str]], *, reference: str = SINGLE.name) -> tuple[list, list]:
    """``(header, rows)``: which runs ended with the same weights, bit for bit (notebook 04).

    ``groups``: ``labs.lab04.bit_identical_groups``. One row per group, lettered in run order.
    """
    return (
        ["weights", "runs that end bit for bit the same"],
        [[f"{chr(65 + i)}{' (reference)' if reference in g else ''}", ", ".join(g)] for i, g in enumerate(groups)],
    )


#: One colour per rank in the layouts picture (notebook 04).
RANK_COLORS = ("#7b5ea7", "#e8883a", "#3a7dc9", "#5aa469", "#c0504d", "#9a9a9a", "#d4a017", "#2a9d8f")


def layouts_figure(view: dict, *, width: float = 12.0, height: float = 4.0):
    """``per_param.layouts``' four layouts of one unit, side by side: every element of every parameter a square
    coloured by the rank that keeps it, a 1-D parameter as one row (notebook 04)."""
    from matplotlib.patches import Patch, Rectangle

    from ..per_param import LAYOUTS

    fig = new_figure(width, height)
    ranks = 1 + max(int(t.max()) for layout in view.values() for t in layout["owner"].values())
    for ax, (key, label) in zip(fig.subplots(1, len(LAYOUTS)), LAYOUTS.items()):
        top, widest = 0, 1
        for name, owner in view[key]["owner"].items():
            grid = owner.reshape(owner.shape[0], -1) if owner.dim() > 1 else owner.reshape(1, -1)
            for (i, j), rank in np.ndenumerate(grid.numpy()):
                ax.add_patch(Rectangle((j, -(top + i)), 0.92, 0.92, facecolor=RANK_COLORS[rank % len(RANK_COLORS)]))
            ax.text(-0.3, -(top + grid.shape[0] / 2) + 0.5, name, ha="right", va="center")
            top, widest = top + grid.shape[0] + 1, max(widest, grid.shape[1])
        ax.set_xlim(-0.2, widest + 0.2)
        ax.set_ylim(-top + 0.8, 1.2)
        ax.set_aspect("equal")
        ax.axis("off")
        what, who = label.split(" (")
        ax.set_title(f"{what}\n({who}: {view[key]['padding']} padding", fontsize=10)
    fig.legend(
        handles=[Patch(color=RANK_COLORS[r % len(RANK_COLORS)], label=f"rank {r}") for r in range(ranks)],
        loc="lower center",
        ncol=ranks,
        frameon=False,
    )
    return fig
