"""Interactive views for the notebooks: ipywidgets controls over the same figures ``plots`` draws
(introduced in notebook 01).

Rule of the house: a widget function returns

- in JupyterLab, an ipywidgets box: controls, the chart (an ``Image`` widget holding the PNG
  that ``plots`` draws) and a readout of exact values (an ``HTML`` widget);
- when the notebook runs headless (``is_headless()``: ``COURSE_HEADLESS=1``, set by the
  Makefile and the test runs), a ``plots.StaticFigure`` of the same view, so executed
  notebooks hold the chart as a PNG image and the readout as text.

What a chart shows is computed by a pure function (``memory.memory_chart_view``,
``memory.bill_bars``, ``plan.plan``) that the tests call without a browser; the widgets only
wire controls to it.

Stable hooks for browser tests: every control and readout carries a CSS class
(``course-<view>-<role>``) and a ``description``; see each function's docstring.

Sections: shared helpers; notebook 01; notebook 05. Other notebooks append their own below.
"""

from __future__ import annotations

import html
import os

from . import memory, plots
from .errors import CourseInputError
from .units import GB, fmt_count, fmt_size

# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def is_headless() -> bool:
    """True when the notebook runs without a browser (papermill, nbval, CI): ``COURSE_HEADLESS=1`` (notebook 01)."""
    return os.environ.get("COURSE_HEADLESS", "").strip().lower() in ("1", "true", "yes")


def _ipw():
    import ipywidgets

    return ipywidgets


def _classed(widget, css_class: str):
    widget.add_class(css_class)
    return widget


def _fit_labels(widget):
    """Make a dropdown wide enough for its longest option label and its description.

    ipywidgets draws a Dropdown 300 px wide whatever its labels, which cut "12 bytes: mixed-precision
    Adam" to "12 bytes: mixed-precision A" in JupyterLab. Widths are in ``ch`` (the width of "0"),
    with a tenth more for wider letters and room for the arrow and padding.
    """
    longest = max(len(str(label)) for label in widget._options_labels)
    widget.style.description_width = "initial"
    widget.layout.width = f"{round((longest + len(widget.description)) * 1.1) + 6}ch"
    return widget


def _with(options, value) -> list:
    """``options`` plus ``value`` when it is not one of them, sorted: a control accepts any value a notebook
    passes in (notebook 03 asks for Nd = 25 on a slider whose steps are powers of two)."""
    return sorted(set(options) | {value})


#: Model sizes the model slider steps through (parameters).
MODEL_SIZES = (125e6, 350e6, 1.3e9, 1.5e9, 7e9, 7.5e9, 13e9, 30e9, 70e9, 128e9, 175e9, 530e9, 1e12)
#: K choices: label -> K.
K_CHOICES = {f"{b.k:g} bytes: {b.name}": b.k for key, b in memory.OPTIMIZERS.items() if key != "adam_fp32"}


def _model_options(extra=()):
    sizes = sorted(set(MODEL_SIZES) | {float(x) for x in extra})
    return [(fmt_count(s), float(s)) for s in sizes]


# ---------------------------------------------------------------------------------------------
# Notebook 01: the memory chart and the bill
# ---------------------------------------------------------------------------------------------


def _readout_html(view: dict) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(memory.STAGE_NAMES[s])}</td>"
        f"<td style='text-align:right'>{view['readout'][s]:,.0f} bytes</td>"
        f"<td style='text-align:right'>{fmt_size(view['readout'][s])}</td>"
        f"<td>{'fits' if view['fits'][s] else 'does not fit'}</td></tr>"
        for s in memory.STAGES
    )
    return (
        f"<div><b>Ψ = {fmt_count(view['psi'])}, K = {view['k']:g}, Nd = {view['nd']}, "
        f"GPU {view['gpu_mem'] / GB:g} GB</b><table>{rows}</table></div>"
    )


def memory_chart(
    psi: float = 7.5e9, *, k: float = memory.ADAM_MIXED_K, nd: int = 64, gpu_mem: float = 32 * GB, nm: int = 1
):
    """The paper's memory chart, live: Nd on a log axis, memory per GPU, one curve per row (notebook 01).

    Controls (CSS class, description): model size ``course-memory-model`` ("Model Ψ"), presets
    ``course-memory-presets`` (7.5B, 128B, 1T), K ``course-memory-k`` ("K"), Nd
    ``course-memory-nd`` ("Nd"), GPU ``course-memory-gpu`` ("GPU"). Readout of exact values at
    the chosen Nd: ``course-memory-readout`` (an HTML widget). Chart: ``course-memory-chart``.
    Headless: a ``plots.StaticFigure`` of ``memory.memory_chart_view(psi, nd=nd, k=k, ...)``.
    """
    view = memory.memory_chart_view(psi, nd=nd, k=k, nm=nm, gpu_mem=gpu_mem)
    if is_headless():
        return plots.StaticFigure(plots.memory_chart_figure(view), view["readout_text"])
    w = _ipw()
    model = _classed(
        w.SelectionSlider(
            options=_model_options([psi]), value=float(psi), description="Model Ψ", continuous_update=False
        ),
        "course-memory-model",
    )
    presets = _classed(
        w.ToggleButtons(options=list(memory.MODEL_PRESETS), value=None, description="Presets"), "course-memory-presets"
    )
    k_options = dict(K_CHOICES)
    if float(k) not in k_options.values():
        k_options[f"{k:g} bytes"] = float(k)
    k_box = _classed(
        _fit_labels(w.Dropdown(options=list(k_options.items()), value=float(k), description="K")), "course-memory-k"
    )
    nd_box = _classed(
        w.SelectionSlider(
            options=_with((int(n) for n in memory.chart_nds()), int(nd)),
            value=int(nd),
            description="Nd",
            continuous_update=False,
        ),
        "course-memory-nd",
    )
    gpus = dict(memory.GPU_CHOICES)
    if float(gpu_mem) not in gpus.values():
        gpus[f"{gpu_mem / GB:g} GB"] = float(gpu_mem)
    gpu_box = _classed(
        _fit_labels(w.Dropdown(options=list(gpus.items()), value=float(gpu_mem), description="GPU")),
        "course-memory-gpu",
    )
    image = _classed(w.Image(format="png"), "course-memory-chart")
    readout = _classed(w.HTML(), "course-memory-readout")

    def redraw(*_):
        v = memory.memory_chart_view(model.value, nd=nd_box.value, k=k_box.value, nm=nm, gpu_mem=gpu_box.value)
        image.value = plots.png(plots.memory_chart_figure(v))
        readout.value = _readout_html(v)

    def preset(change):
        if change["new"]:
            model.value = memory.MODEL_PRESETS[change["new"]]

    def preset_follows_model(change):
        # a preset stays highlighted only while the slider is on its size (it stayed lit after a move away)
        presets.value = next((name for name, size in memory.MODEL_PRESETS.items() if size == change["new"]), None)

    presets.observe(preset, names="value")
    model.observe(preset_follows_model, names="value")
    preset_follows_model({"new": model.value})
    for control in (model, k_box, nd_box, gpu_box):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([model, presets]), w.HBox([k_box, nd_box, gpu_box]), image, readout])


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

    Controls: Nd ``course-bill-nd`` ("Nd"), K ``course-bill-k`` ("K"); readout ``course-bill-readout``.
    Headless: a ``plots.StaticFigure`` of ``memory.bill_bars(psi, nd, k=k, activations=...)``.
    """

    def draw(nd_, k_):
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
        return plots.bill_bars_figure(bars, unit=unit, title=title, gpu_mem=gpu_mem), text

    if is_headless():
        fig, text = draw(nd, k)
        return plots.StaticFigure(fig, text)
    w = _ipw()
    nd_box = _classed(
        w.SelectionSlider(
            options=_with((int(n) for n in memory.chart_nds()), int(nd)),
            value=int(nd),
            description="Nd",
            continuous_update=False,
        ),
        "course-bill-nd",
    )
    k_box = _classed(
        _fit_labels(
            w.Dropdown(
                options=list(K_CHOICES.items())
                if float(k) in K_CHOICES.values()
                else list(K_CHOICES.items()) + [(f"{k:g} bytes", float(k))],
                value=float(k),
                description="K",
            )
        ),
        "course-bill-k",
    )
    image = _classed(w.Image(format="png"), "course-bill-chart")
    readout = _classed(w.HTML(), "course-bill-readout")

    def redraw(*_):
        fig, text = draw(nd_box.value, k_box.value)
        image.value = plots.png(fig)
        readout.value = html.escape(text)

    for control in (nd_box, k_box):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([nd_box, k_box]), image, readout])


# ---------------------------------------------------------------------------------------------
# Notebook 05: the planner
# ---------------------------------------------------------------------------------------------

#: Links the planner's network slider steps through: label -> bytes/s per node.
NETWORK_CHOICES = {
    "10 GbE (1.25 GB/s)": 1.25e9,
    "25 GbE (3.1 GB/s)": 3.125e9,
    "100 Gb/s (12.5 GB/s)": 12.5e9,
    "200 Gb/s (25 GB/s)": 25e9,
    "4 x 100 Gb/s (50 GB/s)": 50e9,
    "8 x 200 Gb/s (200 GB/s)": 200e9,
    "8 x 400 Gb/s (400 GB/s)": 400e9,
}
#: Intra-node links: label -> bytes/s per GPU.
NVLINK_CHOICES = {
    "PCIe only (25 GB/s)": 25e9,
    "NVLink, V100 (150 GB/s)": 150e9,
    "NVLink, A100 (200 GB/s)": 200e9,
    "NVLink, H100 (360 GB/s)": 360e9,
}


def plan_summary(p) -> str:
    """One line: the recommendation and its reason (notebook 05)."""
    from .plan import STRATEGY_NAMES

    r = p.recommendation
    name = STRATEGY_NAMES.get(r["strategy"], "none")
    return f"{name}: {r['reason']}"


def planner(
    params: float = 7e9,
    *,
    nodes: int = 1,
    gpus_per_node: int = 8,
    gpu_mem: float = 80 * GB,
    inter_bw: float = 50e9,
    intra_bw: float = 200e9,
    micro_batch: int = 1,
    seq: int = 2048,
    checkpointing: bool = True,
    k: float = memory.ADAM_MIXED_K,
):
    """The planner, live: model, cluster and link controls; memory bars and overlap chart; the
    recommendation and its reason in one line (notebook 05).

    Controls (CSS class, description): ``course-plan-model`` ("Model Ψ"), ``course-plan-nodes``
    ("Nodes"), ``course-plan-gpus`` ("GPUs/node"), ``course-plan-gpu-mem`` ("GPU"),
    ``course-plan-network`` ("Network"), ``course-plan-nvlink`` ("NVLink"), ``course-plan-batch``
    ("Micro-batch"), ``course-plan-seq`` ("Sequence"), ``course-plan-checkpointing``. Readout:
    ``course-plan-recommendation`` (HTML). Chart: ``course-plan-chart``.
    Headless: a ``plots.StaticFigure`` of ``plots.plan_figure(plan.plan(...))``.
    """
    from . import plan as planning

    def compute(params_, nodes_, gpus_, mem_, inter_, intra_, b_, s_, ckpt_):
        model = planning.model_spec(params_, micro_batch=b_, seq=s_, checkpointing=ckpt_)
        cluster = planning.Cluster(gpus_per_node=gpus_, nodes=nodes_, gpu_mem=mem_, inter_bw=inter_, intra_bw=intra_)
        return planning.plan(model, cluster, k=k)

    if is_headless():
        p = compute(params, nodes, gpus_per_node, gpu_mem, inter_bw, intra_bw, micro_batch, seq, checkpointing)
        return plots.StaticFigure(plots.plan_figure(p), plan_summary(p))
    w = _ipw()

    def choice(options: dict, value, fmt):
        opts = dict(options)
        if float(value) not in opts.values():
            opts[fmt(value)] = float(value)
        return list(opts.items()), float(value)

    model = _classed(
        w.SelectionSlider(
            options=_model_options([params]), value=float(params), description="Model Ψ", continuous_update=False
        ),
        "course-plan-model",
    )
    nodes_box = _classed(
        w.SelectionSlider(
            options=sorted({1, 2, 4, 8, 16, 32, 64, 128, int(nodes)}),
            value=int(nodes),
            description="Nodes",
            continuous_update=False,
        ),
        "course-plan-nodes",
    )
    gpus_box = _classed(
        _fit_labels(
            w.Dropdown(
                options=sorted({1, 2, 4, 8, 16, int(gpus_per_node)}), value=int(gpus_per_node), description="GPUs/node"
            )
        ),
        "course-plan-gpus",
    )
    opts, val = choice(memory.GPU_CHOICES, gpu_mem, lambda v: f"{v / GB:g} GB")
    mem_box = _classed(_fit_labels(w.Dropdown(options=opts, value=val, description="GPU")), "course-plan-gpu-mem")
    opts, val = choice(NETWORK_CHOICES, inter_bw, lambda v: f"{v / 1e9:g} GB/s")
    # a dropdown, not a slider: a slider's readout is a fixed width and cut "4 x 100 Gb/s (50 GB/s)" short
    net_box = _classed(
        _fit_labels(w.Dropdown(options=sorted(opts, key=lambda o: o[1]), value=val, description="Network")),
        "course-plan-network",
    )
    opts, val = choice(NVLINK_CHOICES, intra_bw, lambda v: f"{v / 1e9:g} GB/s")
    nvl_box = _classed(_fit_labels(w.Dropdown(options=opts, value=val, description="NVLink")), "course-plan-nvlink")
    batch_box = _classed(
        w.SelectionSlider(
            options=sorted({1, 2, 4, 8, 16, 32, int(micro_batch)}),
            value=int(micro_batch),
            description="Micro-batch",
            continuous_update=False,
        ),
        "course-plan-batch",
    )
    seq_box = _classed(
        _fit_labels(
            w.Dropdown(
                options=sorted({1024, 2048, 4096, 8192, 32768, 131072, int(seq)}),
                value=int(seq),
                description="Sequence",
            )
        ),
        "course-plan-seq",
    )
    ckpt_box = _classed(
        w.Checkbox(value=bool(checkpointing), description="activation checkpointing"), "course-plan-checkpointing"
    )
    image = _classed(w.Image(format="png"), "course-plan-chart")
    readout = _classed(w.HTML(), "course-plan-recommendation")
    controls = (model, nodes_box, gpus_box, mem_box, net_box, nvl_box, batch_box, seq_box, ckpt_box)

    def redraw(*_):
        try:
            p = compute(*(c.value for c in controls))
        except CourseInputError as exc:  # a combination that cannot exist: say so in the readout
            readout.value = f"<b>{html.escape(str(exc))}</b>"
            return
        image.value = plots.png(plots.plan_figure(p))
        readout.value = f"<b>{html.escape(plan_summary(p))}</b>"

    for control in controls:
        control.observe(redraw, names="value")
    redraw()
    return w.VBox(
        [
            w.HBox([model, nodes_box, gpus_box]),
            w.HBox([mem_box, net_box, nvl_box]),
            w.HBox([batch_box, seq_box, ckpt_box]),
            readout,
            image,
        ]
    )


# ---------------------------------------------------------------------------------------------
# Notebook 03: the stage-3 schedule step by step; measured bytes on the memory chart
# ---------------------------------------------------------------------------------------------


def _stage3_readout(state) -> str:
    sent = state.sent_total(0)
    rows = "".join(
        f"<tr><td>GPU {g}</td><td>{state.held_psi(g):.3g}Ψ of parameters held</td>"
        f"<td style='text-align:right'>{state.sent_total(g):.4g}Ψ sent</td></tr>"
        for g in range(state.nd)
    )
    return (
        f"<div><b>{html.escape(state.caption)}</b><br>step {state.step}, every GPU has sent {sent:.4g}Ψ "
        f"(plain DP sends {2 * (state.nd - 1) / state.nd:.4g}Ψ per step)<table>{rows}</table></div>"
    )


def zero3_stepper(nd: int = 4):
    """Stage 3 step by step: GPUs × shards, a Step button through forward and backward (notebook 03).

    Controls (CSS class, description): ``course-zero3-step`` ("Step"), ``course-zero3-back``
    ("Back"), ``course-zero3-reset`` ("Reset"); the picture ``course-zero3-chart``; the readout
    of exact values ``course-zero3-readout``. The states come from ``stepper.Stage3Stepper``.
    Headless: a ``plots.StaticFigure`` of two states, one per row: layer 0 gathered in the forward
    pass, and the end (every slice's gradients reduce-scattered, every GPU has sent 3(Nd-1)/Nd·Ψ); its
    text is the last caption. Two, not more: on a 1280 x 720 slide more rows would shrink the labels
    below 14 px (issue 28).
    """
    from .stepper import Stage3Stepper

    machine = Stage3Stepper(nd)
    if is_headless():
        states = machine.states
        frames = [states[1], states[-1]]
        return plots.StaticFigure(plots.zero3_schedule_frames(frames), states[-1].caption)
    w = _ipw()
    step = _classed(w.Button(description="Step", button_style="primary"), "course-zero3-step")
    back = _classed(w.Button(description="Back"), "course-zero3-back")
    reset = _classed(w.Button(description="Reset"), "course-zero3-reset")
    image = _classed(w.Image(format="png"), "course-zero3-chart")
    readout = _classed(w.HTML(), "course-zero3-readout")

    def redraw():
        image.value = plots.png(plots.zero3_schedule_figure(machine.state))
        readout.value = _stage3_readout(machine.state)
        step.disabled, back.disabled = machine.done, machine.index == 0

    step.on_click(lambda _: (machine.step(), redraw()))
    back.on_click(lambda _: (machine.back(), redraw()))
    reset.on_click(lambda _: (machine.reset(), redraw()))
    redraw()
    return w.VBox([w.HBox([step, back, reset]), image, readout])


def measured_memory_chart(
    psi: float, measured: dict, *, nd: int = 2, k: float = memory.ADAM_MIXED_K, nd_max: int = 64, title: str = ""
):
    """The notebook-01 memory chart for a real run's Ψ, with the bytes measured per rank as points (notebook 03).

    ``measured``: ``{row: [(nd, bytes per rank), ...]}`` from real runs. Control: Nd
    ``course-measured-nd`` ("Nd") moves the readout ``course-measured-readout`` (exact bytes of
    each row's formula at that Nd). Headless: a ``plots.StaticFigure`` at ``nd``.
    """

    def text(v):
        return f"Ψ = {v['psi']:,.0f}, K = {v['k']:g}, Nd = {v['nd']}: " + " · ".join(
            f"{memory.STAGE_NAMES[s]} {v['readout'][s]:,.0f} bytes" for s in memory.STAGES
        )

    view = memory.memory_chart_view(psi, nd=nd, k=k, nd_max=nd_max)
    if is_headless():
        return plots.StaticFigure(plots.measured_memory_figure(view, measured, title=title), text(view))
    w = _ipw()
    nd_box = _classed(
        w.SelectionSlider(
            options=_with((int(n) for n in view["nds"]), int(nd)),
            value=int(nd),
            description="Nd",
            continuous_update=False,
        ),
        "course-measured-nd",
    )
    image = _classed(
        w.Image(format="png", value=plots.png(plots.measured_memory_figure(view, measured, title=title))),
        "course-measured-chart",
    )
    readout = _classed(w.HTML(), "course-measured-readout")

    def redraw(*_):
        readout.value = html.escape(text(memory.memory_chart_view(psi, nd=nd_box.value, k=k, nd_max=nd_max)))

    nd_box.observe(redraw, names="value")
    redraw()
    return w.VBox([nd_box, image, readout])
