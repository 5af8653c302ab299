"""Interactive views for the notebooks (introduced in notebook 01).

Two kinds:

- **instant views** (the memory chart and the bill of notebook 01, the stage-3 stepper and the measured
  chart of notebook 03): every state their controls offer is computed here, once, from the arithmetic
  modules (``memory``, ``stepper``), and the browser only redraws (``course_utils.instant``): a slider
  answers at once, in JupyterLab, Colab and the exported decks, with no kernel and no network. When the
  notebook runs headless (``is_headless()``: ``COURSE_HEADLESS=1``, set by the Makefile and the test
  runs) the output also holds the opening state as a PNG, drawn by ``plots``.
- **the planner** (notebook 05), an instant view too, over the three controls a planning discussion moves
  (model size, nodes, network: about 640 states of ``plan.plan``); the GPU, the link inside a node, the
  batch and checkpointing are its call's arguments (nine controls together would span millions of states).

What a chart shows is computed by a pure function (``memory.memory_chart_view``, ``memory.bill_bars``,
``stepper.stage3_schedule``, ``plan.plan``) that the tests call without a browser; the views only wire
controls to it.

Stable hooks for browser tests: every control and readout carries a CSS class
(``course-<view>-<role>``) and a label; see each function's docstring.

Sections: shared helpers; notebook 01; notebook 05; notebook 03.
"""

from __future__ import annotations

import os

import numpy as np

from . import memory, plots
from .instant import InstantView
from .strategies import planned
from .units import GB, fmt_count, fmt_sig3, fmt_size
from .widget_parts import (  # noqa: F401
    K_CHOICES,
    MODEL_SIZES,
    _choices,
    _index,
    _model_options,
    _with,
)

# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def is_headless() -> bool:
    """True when the notebook runs without a browser (papermill, nbval, CI): ``COURSE_HEADLESS=1`` (notebook 01)."""
    return os.environ.get("COURSE_HEADLESS", "").strip().lower() in ("1", "true", "yes")


# ---------------------------------------------------------------------------------------------
# Notebook 01: the memory chart and the bill
# ---------------------------------------------------------------------------------------------


def _static(fig) -> dict:
    """The opening state as a PNG, for an instant view shown headless (readers that run no script)."""
    if not is_headless():
        return {}
    still = plots.StaticFigure(fig)
    return {"png": still.png, "size": still.size}


def memory_chart_states(models: list, ks: list, nds: list, gpus: list, *, nm=1, nd_max: int = 1024) -> dict:
    """Everything the memory chart shows in every state of its controls, from ``memory`` (notebook 01).

    ``models``, ``ks``, ``gpus``: ``(label, value)`` pairs; ``nds``: the Nd choices (they include the
    chart's axis, ``memory.chart_nds(nd_max)``). Returns the instant view's data: bytes per GPU
    ``[model][k][row][nd]`` (``memory.model_state_bytes``), the same as exact and short text, the
    smallest Nd at which each row fits ``[model][k][gpu][row]`` (``memory.smallest_nd_that_fits``: a row
    fits at Nd exactly when Nd reaches it, which is ``memory_chart_view``'s ``fits``) and the chart's
    title per ``[model][k][gpu]``. A few thousand numbers, computed in tens of milliseconds.
    """
    psis = np.array([v for _, v in models], dtype=float)
    nd_array = np.array(nds, dtype=float)
    values = np.empty((len(models), len(ks), len(memory.STAGES), len(nds)))
    for j, (_, k) in enumerate(ks):
        for r, stage in enumerate(memory.STAGES):
            values[:, j, r, :] = memory.model_state_bytes(psis[:, None], nd_array[None, :], stage, k=k, nm=nm)
    first_fit, titles = [], []
    for psi in psis:
        first_fit.append([])
        titles.append([])
        for _, k in ks:
            fits = [{s: memory.smallest_nd_that_fits(psi, s, g, k=k, nm=nm) for s in memory.STAGES} for _, g in gpus]
            first_fit[-1].append([[f[s] for s in memory.STAGES] for f in fits])
            # memory_chart_view's own title (one definition), from the same first_fit it computes
            titles[-1].append(
                [memory.chart_title(dict(psi=psi, gpu_mem=g, first_fit=f, nm=nm)) for (_, g), f in zip(gpus, fits)]
            )
    axis = set(memory.chart_nds(nd_max).tolist())
    return {
        "models": [label for label, _ in models],
        "ks": [label for label, _ in ks],
        "kShort": [f"{k:g}" for _, k in ks],
        "nmText": f", Nm = {nm}" if nm > 1 else "",  # per GPU of an Nm-way model-parallel group: say so
        "nds": [int(n) for n in nds],
        "axis": [i for i, n in enumerate(nds) if n in axis],
        "gpus": [label for label, _ in gpus],
        "gpuBytes": [float(g) for _, g in gpus],
        "gpuShort": [f"{g / GB:g} GB" for _, g in gpus],
        "gpuLine": [f"one {g / GB:g} GB GPU" for _, g in gpus],
        "bytes": values.tolist(),
        "exact": [[[[f"{v:,.0f}" for v in row] for row in kk] for kk in m] for m in values],
        "sizes": [[[[fmt_size(v) for v in row] for row in kk] for kk in m] for m in values],
        "firstFit": first_fit,
        "titles": titles,
        "stageNames": [memory.STAGE_NAMES[s] for s in memory.STAGES],
        "colors": [plots.STAGE_COLORS[s] for s in memory.STAGES],
        "scale": GB,
        "ylabel": "memory per GPU, GB (10^9 bytes)",
    }


def memory_chart(
    psi: float = 7.5e9, *, k: float = memory.ADAM_MIXED_K, nd: int = 64, gpu_mem: float = 32 * GB, nm: int = 1
):
    """The paper's memory chart, live: Nd on a log axis, memory per GPU, one curve per row (notebook 01).

    An instant view: moving a control redraws in the browser at once. Controls (CSS class, label):
    model size ``course-memory-model`` ("Model Ψ", a slider), presets ``course-memory-presets`` (7.5B,
    128B, 1T), K ``course-memory-k`` ("K"), Nd ``course-memory-nd`` ("Nd", a slider), GPU
    ``course-memory-gpu`` ("GPU"). Readout of exact values at the chosen Nd: ``course-memory-readout``.
    Chart: ``course-memory-chart`` (SVG). Its text is ``memory.memory_chart_view(psi, nd=nd, k=k, ...)``'s
    readout; headless, the same view as a PNG too.
    """
    view = memory.memory_chart_view(psi, nd=nd, k=k, nm=nm, gpu_mem=gpu_mem)
    models = _choices(dict(_model_options()), psi, fmt_count)
    models.sort(key=lambda pair: pair[1])
    ks = _choices(K_CHOICES, k, lambda v: f"{v:g} bytes")
    gpus = _choices(memory.GPU_CHOICES, gpu_mem, lambda v: f"{v / GB:g} GB")
    nds = _with((int(n) for n in memory.chart_nds()), int(nd))
    data = memory_chart_states(models, ks, nds, gpus, nm=nm)
    data.update(
        css="course-memory",
        model=_index(models, psi),
        k=_index(ks, k),
        nd=nds.index(int(nd)),
        gpu=_index(gpus, gpu_mem),
        presets=[[name, _index(models, size)] for name, size in memory.MODEL_PRESETS.items()],
    )
    return InstantView(
        "memory-chart", data, view["readout_text"], **_static_of(lambda: plots.memory_chart_figure(view))
    )


def _static_of(draw) -> dict:
    """``_static(draw())`` when headless, without drawing otherwise (matplotlib costs the kernel time)."""
    return _static(draw()) if is_headless() else {}


def _bill_state(psi, nd_, k_, *, activations, unit, gpu_mem):
    """One state of the bill: ``memory.bill_bars`` and the title and text it reads as."""
    bars = memory.bill_bars(psi, nd_, k=k_, activations=activations)
    totals = {s: sum(p["held"] for p in bars[s].values()) for s in bars}
    scale = {"bytes": 1, "GB": GB}[unit]
    text = f"Ψ = {fmt_count(psi)}, Nd = {nd_}, K = {k_:g}: " + " · ".join(
        f"{memory.STAGE_NAMES[s]} {totals[s] / scale:.4g} {unit}" for s in bars
    )
    title = (
        f"One GPU's bill for Ψ = {fmt_count(psi)} on Nd = {nd_}: "
        + ", ".join(f"{totals[s] / scale:.3g}" for s in bars)
        + f" {unit}"
    )
    return bars, totals, scale, text, title


def bill_bars(
    psi: float = 8,
    *,
    nd: int = 4,
    k: float = memory.ADAM_MIXED_K,
    activations: float = 0.0,
    unit: str = "bytes",
    gpu_mem: float | None = None,
):
    """The bill as stacked bars per GPU for each row, dashed where a stage no longer holds a part (notebook 01).

    An instant view. Controls: Nd ``course-bill-nd`` ("Nd", a slider), K ``course-bill-k`` ("K"); readout
    ``course-bill-readout``; chart ``course-bill-chart``. Every state is ``memory.bill_bars(psi, nd, k=k,
    activations=...)``; headless, the opening state as a PNG too.
    """
    ks = _choices(K_CHOICES, k, lambda v: f"{v:g} bytes")
    nds = _with((int(n) for n in memory.chart_nds()), int(nd))
    states = []
    for nd_ in nds:
        states.append([])
        for _, k_ in ks:
            bars, totals, scale, text, title = _bill_state(
                psi, nd_, k_, activations=activations, unit=unit, gpu_mem=gpu_mem
            )
            full = max(sum(p["full"] for p in bars[s].values()) for s in bars) / scale
            states[-1].append(
                {
                    "bars": [
                        {
                            "held": [bars[s][p]["held"] / scale for p in memory.BILL_PARTS],
                            "dropped": [(bars[s][p]["full"] - bars[s][p]["held"]) / scale for p in memory.BILL_PARTS],
                            "label": f"{totals[s] / scale:.3g}",
                        }
                        for s in bars
                    ],
                    "top": max(full, (gpu_mem or 0) / scale) * 1.12,
                    "gpu": None if gpu_mem is None else gpu_mem / scale,
                    "title": title,
                    "text": text,
                }
            )
    bars0 = memory.bill_bars(psi, nd, k=k, activations=activations)
    data = {
        "css": "course-bill",
        "nds": nds,
        "nd": nds.index(int(nd)),
        "ks": [label for label, _ in ks],
        "k": _index(ks, k),
        "states": states,
        "stageNames": [memory.STAGE_NAMES[s] for s in memory.STAGES],
        "stageLines": [memory.STAGE_NAMES[s].replace(" (", "\n(").split("\n") for s in memory.STAGES],
        "parts": list(memory.BILL_PARTS),
        "partColors": [plots.PART_COLORS[p] for p in memory.BILL_PARTS],
        "partShown": [any(bars0[s][p]["full"] > 0 for s in bars0) for p in memory.BILL_PARTS],
        "gpuLine": "" if gpu_mem is None else f"{gpu_mem / GB:g} GB GPU",
        "ylabel": "memory per GPU, " + ("bytes" if unit == "bytes" else "GB (10^9 bytes)"),
    }
    first = states[data["nd"]][data["k"]]
    return InstantView(
        "bill-bars",
        data,
        first["text"],
        **_static_of(lambda: plots.bill_bars_figure(bars0, unit=unit, title=first["title"], gpu_mem=gpu_mem)),
    )


# ---------------------------------------------------------------------------------------------
# Notebook 05: the planner
# ---------------------------------------------------------------------------------------------

#: Links the planner's network control offers: label -> bytes/s per node.
NETWORK_CHOICES = {
    "10 GbE (1.25 GB/s)": 1.25e9,
    "25 GbE (3.1 GB/s)": 3.125e9,
    "100 Gb/s (12.5 GB/s)": 12.5e9,
    "200 Gb/s (25 GB/s)": 25e9,
    "4 x 100 Gb/s (50 GB/s)": 50e9,
    "8 x 200 Gb/s (200 GB/s)": 200e9,
    "8 x 400 Gb/s (400 GB/s)": 400e9,
}


def plan_summary(p) -> str:
    """One line: the recommendation and its reason (notebook 05)."""
    from .plan import STRATEGY_NAMES

    r = p.recommendation
    name = STRATEGY_NAMES.get(r["strategy"], "none")
    return f"{name}: {r['reason']}"


#: The nodes the planner's slider offers.
PLAN_NODES = (1, 2, 4, 8, 16, 32, 64)


def planner_states(models: list, nodes: list, networks: list, compute) -> list:
    """What the planner shows in every state of its three controls, ``[model][nodes][network]``, from
    ``compute(params, nodes, inter_bw) -> plan.plan(...)`` (notebook 05): each strategy's bytes per GPU by part
    (GB, ``None`` where it does not apply), whether it fits, its estimated step, the recommendation and its
    reason, the chart's title. About 640 plans, 0.9 ms each."""
    names = [row.name for row in planned()]
    out = []
    for _, psi in models:
        out.append([])
        for n in nodes:
            out[-1].append([])
            for _, bw in networks:
                p = compute(psi, n, bw)
                rows = [p.strategies.get(name) for name in names]
                choice = p.recommendation["strategy"]
                out[-1][-1].append({
                    "bars": [None if r is None else [round(getattr(r, part) / GB, 3) for part in PLAN_PARTS] for r in rows],
                    "fits": [bool(r and r.fits) for r in rows],
                    "step": ["" if r is None else f"{fmt_sig3(r.step_s)} s" for r in rows],
                    "choice": names.index(choice) if choice in names else -1,
                    "text": plan_summary(p),
                })  # fmt: skip
    return out


#: The parts of a GPU's bytes the planner's bars stack (``plan.StrategyPlan`` fields).
PLAN_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers")


def planner(
    params: float = 7e9,
    *,
    nodes: int = 1,
    gpus_per_node: int = 8,
    gpu_mem: float | None = None,
    inter_bw: float = 50e9,
    intra_bw: float | None = None,
    micro_batch: int = 1,
    seq: int | None = None,
    checkpointing: bool = True,
    k: float = memory.ADAM_MIXED_K,
):
    """The planner, live: model size, nodes and network in the browser; the memory per GPU of every strategy,
    whether it fits, its step, the recommendation and its reason (notebook 05).

    An instant view (``planner_states``): the three controls redraw at once, in decks too. Controls (CSS class,
    label): ``course-plan-model`` ("Model Ψ", a slider), ``course-plan-nodes`` ("Nodes", a slider),
    ``course-plan-network`` ("Network", a dropdown). The GPU, NVLink, micro-batch, sequence and checkpointing are
    this call's arguments (a line under the chart says which); the GPU's memory and NVLink default to the planners'
    one GPU record (``plan.DEFAULT_GPU``), the sequence to a preset's own (2048 for a size without one).
    Readout: ``course-plan-recommendation`` (the recommendation and its reason, ``plan_summary``) and
    ``course-plan-readout``; chart: ``course-plan-chart``.
    Its text is ``plan_summary`` of the opening state; headless, ``plots.plan_figure`` of it as a PNG too.
    """
    from . import plan as planning
    from .plan import STRATEGY_NAMES

    gpu_mem = planning.DEFAULT_GPU.mem if gpu_mem is None else gpu_mem
    intra_bw = planning.DEFAULT_GPU.nvlink_bw if intra_bw is None else intra_bw
    tokens = f"{seq:,}" if seq else "each model's own sequence (a preset's, else 2,048)"

    def compute(params_, nodes_, inter_):
        model = planning.model_spec(params_, micro_batch=micro_batch, seq=seq, checkpointing=checkpointing)
        cluster = planning.Cluster(
            gpus_per_node=gpus_per_node, nodes=nodes_, gpu_mem=gpu_mem, inter_bw=inter_, intra_bw=intra_bw
        )
        return planning.plan(model, cluster, k=k)

    opening = compute(params, nodes, inter_bw)  # a combination that cannot exist raises here, in one sentence
    models = _choices(dict(_model_options()), params, fmt_count)
    models.sort(key=lambda pair: pair[1])
    node_list = _with(PLAN_NODES, int(nodes))
    networks = sorted(_choices(NETWORK_CHOICES, inter_bw, lambda v: f"{v / 1e9:g} GB/s"), key=lambda o: o[1])
    data = {
        "css": "course-plan",
        "models": [label for label, _ in models],
        "model": _index(models, params),
        "nodes": [str(n) for n in node_list],
        "node": node_list.index(int(nodes)),
        "networks": [label for label, _ in networks],
        "network": _index(networks, inter_bw),
        "ticks": [STRATEGY_NAMES[r.name].split(" (")[0].replace(" + optimizer", "\n+") for r in planned()],
        "names": [STRATEGY_NAMES[r.name] for r in planned()],
        "parts": list(PLAN_PARTS),
        "partColors": [plots.PART_COLORS[part] for part in PLAN_PARTS],
        "usable": opening.cluster.usable / GB,
        "usableLine": f"usable: {opening.cluster.usable / GB:.0f} of {gpu_mem / GB:.0f} GB",
        "fixed": f"{gpus_per_node} GPUs of {gpu_mem / GB:.3g} GB per node, NVLink {intra_bw / 1e9:g} GB/s; micro-batch "
        f"{micro_batch} x {tokens} tokens; activation checkpointing {'on' if checkpointing else 'off'}",
        "ylabel": "GB per GPU (10^9 bytes)",
        "states": planner_states(models, node_list, networks, compute),
    }
    return InstantView("planner", data, plan_summary(opening), **_static_of(lambda: plots.plan_figure(opening)))


# ---------------------------------------------------------------------------------------------
# Notebook 03: the stage-3 schedule step by step; measured bytes on the memory chart
# ---------------------------------------------------------------------------------------------


def _stage3_readout(state) -> str:
    """The exact values of one state of the schedule, as HTML (its caption is the view's title)."""
    sent = state.sent_total(0)
    rows = "".join(
        f"<tr><td>GPU {g}</td><td>{state.held_psi(g):.3g}Ψ of parameters held</td>"
        f"<td class='ci-num'>{state.sent_total(g):.4g}Ψ sent</td></tr>"
        for g in range(state.nd)
    )
    return (
        f"<div>step {state.step}, every GPU has sent {sent:.4g}Ψ "
        f"(plain DP sends {2 * (state.nd - 1) / state.nd:.4g}Ψ per step)<table>{rows}</table></div>"
    )


def zero3_stepper(nd: int = 4):
    """Stage 3 step by step: GPUs × units (layers, root), Step, Back and Reset through both passes (notebook 03).

    An instant view of every state of ``stepper.stage3_schedule(nd)``. Controls (CSS class, label):
    ``course-zero3-step`` ("Step"), ``course-zero3-back`` ("Back"), ``course-zero3-reset`` ("Reset") and
    a slider over the steps, ``course-zero3-slider``; the picture ``course-zero3-chart``; the readout of
    exact values ``course-zero3-readout``. Headless, the PNG is two states: the root and layer 0 gathered in the
    forward (the most any GPU holds), and the end; more rows would shrink the labels below 14 px (issue 28).
    """
    from .stepper import TRAFFIC_KINDS, column_labels, stage3_schedule

    states = stage3_schedule(nd)
    labels = column_labels(nd)
    dp = 2 * (nd - 1) / nd
    data = {
        "css": "course-zero3",
        "nd": nd,
        "layers": len(states[0].held[0]),
        "labels": labels,
        "dp": dp,
        "dpLabel": f"plain DP: {dp:.3g}Ψ",
        "xmax": 3 * (nd - 1) / nd * 1.25,
        "kinds": list(TRAFFIC_KINDS),
        "kindColors": [plots.TRAFFIC_COLORS[kind] for kind in TRAFFIC_KINDS],
        "colors": {"weights": plots.PART_COLORS["weights"], "gradients": plots.PART_COLORS["gradients"]},
        "states": [
            {
                "step": st.step,
                "heading": f"step {st.step}: {st.phase}" + (f", {labels[st.layer]}" if st.layer is not None else ""),
                "layer": st.layer,
                "whole": [[h == "whole" for h in row] for row in st.held],
                "grads": list(st.grads),
                "sent": [[st.sent[g][kind] for kind in TRAFFIC_KINDS] for g in range(nd)],
                "totals": [f"{st.sent_total(g):.3g}Ψ" for g in range(nd)],
                "caption": st.caption,
                "readout": _stage3_readout(st),
            }
            for st in states
        ],
    }

    def still():
        return plots.zero3_schedule_frames([states[2], states[-1]])

    # its text (what a reader that runs no script reads beside the frames) is where the schedule ends
    return InstantView("zero3-stepper", data, states[-1].caption, **_static_of(still))


def measured_memory_chart(
    psi: float, measured: dict, *, nd: int = 2, k: float = memory.ADAM_MIXED_K, nd_max: int = 64, title: str = ""
):
    """The notebook-01 memory chart for a real run's Ψ, with the bytes measured per rank as points (notebook 03).

    ``measured``: ``{row: [(nd, bytes per rank), ...]}`` from real runs. An instant view: Nd
    ``course-measured-nd`` ("Nd", a slider) moves the marker and the readout ``course-measured-readout``
    (exact bytes of each row's formula at that Nd, ``memory.memory_chart_view``). Chart:
    ``course-measured-chart``. Headless, the chart at ``nd`` as a PNG too.
    """

    def text(v):
        return f"Ψ = {v['psi']:,.0f}, K = {v['k']:g}, Nd = {v['nd']}: " + " · ".join(
            f"{memory.STAGE_NAMES[s]} {v['readout'][s]:,.0f} bytes" for s in memory.STAGES
        )

    view = memory.memory_chart_view(psi, nd=nd, k=k, nd_max=nd_max)
    nds = _with((int(n) for n in view["nds"]), int(nd))
    views = [memory.memory_chart_view(psi, nd=n, k=k, nd_max=nd_max) for n in nds]
    data = {
        "css": "course-measured",
        "nds": nds,
        "nd": nds.index(int(nd)),
        "axis": [int(n) for n in view["nds"]],
        "curves": [[float(b) for b in view["curves"][s]] for s in memory.STAGES],
        "points": [[[int(n), float(b)] for n, b in measured.get(s, [])] for s in memory.STAGES],
        "at": [[float(v["readout"][s]) for s in memory.STAGES] for v in views],
        "texts": [text(v) for v in views],
        "stageNames": [memory.STAGE_NAMES[s] for s in memory.STAGES],
        "colors": [plots.STAGE_COLORS[s] for s in memory.STAGES],
        "title": title or "Measured bytes per rank sit on the paper's curves",
    }
    return InstantView(
        "measured-chart",
        data,
        text(view),
        **_static_of(lambda: plots.measured_memory_figure(view, measured, title=title)),
    )
