"""What notebook 01's memory chart and stacked bars show, as plain numbers (notebook 01).

The chart (``plots.memory_chart_figure``), the bars (``plots.bill_bars_figure``) and their widgets
only draw these views; every number comes from ``memory.bill``'s formulas.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import CourseInputError
from ..strategies import GRADS, OPTIM, PARAMS, ZERO_TABLE
from ..units import GB, fmt_bytes, fmt_count, fmt_size
from .bill import (
    ACTIVATION_BYTES_PER_NUMBER,
    ADAM_MIXED_K,
    GRAD_BYTES,
    STAGE_NAMES,
    STAGES,
    WEIGHT_BYTES,
    _check,
    _check_positive,
    activation_bytes,
    activation_bytes_korthikanti,
    bytes_per_gpu,
    floor_bytes,
    fused_gradient_buffer_bytes,
    model_state_bytes,
    smallest_nd_that_fits,
)

# ---------------------------------------------------------------------------------------------
# The paper's Table 1, the memory chart and the bill (what notebook 01 draws)
# ---------------------------------------------------------------------------------------------

#: The paper's Table 1: models and data-parallel degrees.
TABLE1_PARAMS = (7.5e9, 128e9, 1e12)
TABLE1_ND = (1, 4, 16, 64, 256, 1024)
#: GPUs the chart offers, in bytes (GB = 10^9): V100 32 GB, A100 40 GB, A100/H100 80 GB, H200 141 GB.
GPU_CHOICES = {
    "32 GB (V100)": 32 * GB,
    "40 GB (A100)": 40 * GB,
    "80 GB (A100/H100)": 80 * GB,
    "141 GB (H200)": 141 * GB,
}
#: Model-size presets of the chart: the paper's Table 1 models.
MODEL_PRESETS = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}


def table1(
    params=TABLE1_PARAMS, nds=TABLE1_ND, *, gpu_mem: float = 32 * GB, k: float = ADAM_MIXED_K, nm=1
) -> list[dict]:
    """The paper's Table 1: model-state bytes per GPU for each (Ψ, Nd) and each row (notebook 01).

    Returns one dict per (Ψ, Nd): ``{"params", "nd", "bytes_per_gpu": {stage: bytes},
    "fits": {stage: bool}}``; a cell fits when its bytes are at most ``gpu_mem``.
    """
    rows = []
    for psi in params:
        for nd in nds:
            b = bytes_per_gpu(psi, nd, k=k, nm=nm)
            rows.append(
                {
                    "params": float(psi),
                    "nd": int(nd),
                    "bytes_per_gpu": b,
                    "fits": {s: bool(v <= gpu_mem) for s, v in b.items()},
                }
            )
    return rows


def chart_nds(nd_max: int = 1024) -> np.ndarray:
    """Nd = 1, 2, 4, ..., ``nd_max``: the chart's horizontal axis (notebook 01)."""
    if nd_max < 1:
        raise CourseInputError("nd_max must be at least 1")
    return 2 ** np.arange(0, int(math.log2(nd_max)) + 1)


def memory_chart_view(
    psi, *, nd: int = 64, k: float = ADAM_MIXED_K, nm=1, gpu_mem: float = 32 * GB, nd_max: int = 1024
) -> dict:
    """Everything the notebook-01 memory chart shows, as plain numbers (notebook 01).

    The chart itself (``plots.memory_chart_figure``) and its widget only draw this.

    Returns a dict with ``nds`` (array), ``curves`` ({stage: bytes per GPU at each Nd}),
    ``readout`` ({stage: bytes at the chosen ``nd``}), ``fits`` ({stage: bool at ``nd``}),
    ``floors`` ({stage: bytes as Nd → ∞}), ``first_fit`` ({stage: the smallest whole Nd
    that fits, ``smallest_nd_that_fits``, or None}), the inputs, a ``title`` that states the answer and the ``readout_text``.
    """
    if not (isinstance(nd, (int, np.integer)) and nd >= 1):
        raise CourseInputError(f"nd (Nd) must be a whole number of GPUs >= 1, got {nd!r}")
    _check_positive(gpu_mem=gpu_mem)
    nds = chart_nds(nd_max)
    curves = {s: model_state_bytes(psi, nds, s, k=k, nm=nm) for s in STAGES}
    readout = {s: model_state_bytes(psi, nd, s, k=k, nm=nm) for s in STAGES}
    fits = {s: bool(v <= gpu_mem) for s, v in readout.items()}
    # the smallest whole Nd that fits, not the first point of the doubling axis: one definition everywhere
    first_fit = {s: smallest_nd_that_fits(psi, s, gpu_mem, k=k, nm=nm) for s in STAGES}
    floors = {s: floor_bytes(psi, s, nm=nm, k=k) for s in STAGES}
    view = {
        "psi": float(psi),
        "k": float(k),
        "nm": nm,
        "nd": int(nd),
        "gpu_mem": float(gpu_mem),
        "nds": nds,
        "curves": curves,
        "readout": readout,
        "fits": fits,
        "floors": floors,
        "first_fit": first_fit,
    }
    view["title"] = chart_title(view)
    view["readout_text"] = readout_text(view)
    return view


def chart_title(view: dict) -> str:
    """The memory chart's title: the GPU, and the smallest Nd at which each stage fits (notebook 01)."""
    gpu = fmt_bytes(view["gpu_mem"], "GB", 0)
    short = {s: STAGE_NAMES[s].split(" (")[0] for s in STAGES}
    parts = []
    for s in reversed(STAGES):
        nd = view["first_fit"][s]
        parts.append(
            f"{short[s]} never"
            if nd is None
            else f"{short[s]} from Nd = {nd}"
            if not parts
            else f"{short[s]} from {nd}"
        )
    nm = view.get("nm", 1)  # with model parallelism the curves are per GPU of an Nm-way group: say so
    model = f"{fmt_count(view['psi'])}" + (f" split {nm} ways (Nm = {nm})" if nm > 1 else "")
    return f"{model} on one {gpu} GPU: " + ", ".join(parts)


def readout_text(view: dict) -> str:
    """One line of exact values at the chosen Nd, the text the chart's widget shows (notebook 01)."""
    parts = [f"{STAGE_NAMES[s]}: {fmt_size(view['readout'][s])}{' ✓' if view['fits'][s] else ''}" for s in STAGES]
    return (
        f"Ψ = {fmt_count(view['psi'])}"
        + (f", Nm = {view['nm']}" if view.get("nm", 1) > 1 else "")
        + f", K = {view['k']:g}, Nd = {view['nd']}: "
        + " · ".join(parts)
        + f"  (✓ fits {view['gpu_mem'] / GB:g} GB)"
    )


#: The parts of the bill, bottom to top in the stacked bars.
BILL_PARTS = ("weights", "gradients", "optimizer", "activations")
#: The record's parts (``strategies.PARTS``) under the names the bill gives them.
BILL_PART = {PARAMS: "weights", GRADS: "gradients", OPTIM: "optimizer"}


def bill_bars(psi, nd: int = 4, *, k: float = ADAM_MIXED_K, nm=1, activations: float = 0.0) -> dict:
    """What the notebook-01 stacked bars show: per row, each part held and each part dropped (notebook 01).

    Returns ``{stage: {part: {"held": bytes on one GPU, "full": bytes if it were replicated}}}``
    for parts weights (2Ψ), gradients (2Ψ), optimizer (KΨ) and activations (as given: they are
    per GPU and no stage shards them). ``full - held`` is what the chart draws dashed.
    """
    _check(psi, nd, k, nm)
    p = float(psi) / nm
    full = {
        "weights": WEIGHT_BYTES * p,
        "gradients": GRAD_BYTES * p,
        "optimizer": k * p,
        "activations": float(activations),
    }
    sharded = {s.name: {BILL_PART[part] for part in s.shards_at_rest} for s in ZERO_TABLE}
    out = {}
    for stage in STAGES:
        out[stage] = {
            part: {"held": full[part] / nd if part in sharded[stage] else full[part], "full": full[part]}
            for part in BILL_PARTS
        }
    return out


def activation_view(rows: list) -> dict:
    """What notebook 01's activation chart shows: bytes per h·b·s·L of every measured shape (notebook 01).

    ``rows`` is ``measure.compare_activations(...)``. Dividing the measured bytes by h·b·s·L takes the
    shape out, so every row should land on one constant; the ``lines`` are the constants the formulas
    give, in bytes per h·b·s·L: the paper's 12 numbers at 2 bytes, Korthikanti et al.'s 32 (fused
    attention, no dropout: the course model) and 34 (with the two dropout masks). ``checkpointed`` is
    one 16-bit block input per layer. Returns ``labels``, ``full`` and ``checkpointed`` (one per row),
    ``lines`` ({label: bytes}), a ``title`` that states what the rows show and the ``xlabel``.
    """
    if not rows:
        raise CourseInputError("activation_view needs at least one measured row (memory.compare_activations)")
    units = [r["width"] * r["batch"] * r["seq"] * r["layers"] for r in rows]
    full = [r["measured_blocks"] / u for r, u in zip(rows, units)]
    ckpt = [r["measured_blocks_ckpt"] / u for r, u in zip(rows, units)]
    paper = activation_bytes(1, 1, 1, 1)  # 12 numbers x 2 bytes, per unit of h·b·s·L
    fused = activation_bytes_korthikanti(1, 1, 1, 1, 1, dropout=False, fused_attention=True)
    masks = activation_bytes_korthikanti(1, 1, 1, 1, 1, dropout=True, fused_attention=True)
    lines = {
        f"Korthikanti et al. with dropout masks: {masks:g}": masks,
        f"Korthikanti et al., fused attention, no dropout: {fused:g}": fused,
        f"the paper: 12 numbers × 2 bytes = {paper:g}": paper,
        f"one 16-bit block input: {ACTIVATION_BYTES_PER_NUMBER:g}": float(ACTIVATION_BYTES_PER_NUMBER),
    }
    title = (
        f"Every shape keeps {min(full):.1f} to {max(full):.1f} bytes per h·b·s·L: Korthikanti et al.'s "
        f"{fused:g}, not the paper's {paper:g}"
    )
    same_l = len({r["layers"] for r in rows}) == 1
    labels = [f"b={r['batch']}\ns={r['seq']}\nh={r['width']}" + ("" if same_l else f"\nL={r['layers']}") for r in rows]
    shape = "measured shape: batch b, sequence s, width h" + (f" (L = {rows[0]['layers']} layers)" if same_l else "")
    return {"labels": labels, "full": full, "checkpointed": ckpt, "lines": lines, "title": title, "xlabel": shape}


def gpt2_bill_view(
    psi: float = 1.5e9,
    *,
    h: int = 1600,
    layers: int = 48,
    heads: int = 25,
    b: int = 32,
    s: int = 1024,
    gpu_mem: float = 32 * GB,
) -> dict:
    """The paper's GPT-2 1.5B bill (§3) as stacked bars, one bar per way of keeping activations (notebook 01).

    Each bar is one whole bill: 16-bit weights (2Ψ), 16-bit gradients (2Ψ), optimizer state
    (12Ψ), activations and the fused fp32 gradient buffer (4Ψ), so its top is the total. The bars
    differ only in the activations: checkpointed, by the paper's rule (the paper's own case); every
    activation kept by the paper's 12·h·b·s·L (a lower bound); and by Korthikanti et al. with fused
    attention and no dropout (what autograd keeps today, notebook 01 measures it). Returns ``bars``
    ({label: {part: bytes}}, parts as ``plots.PART_COLORS`` names them), ``totals``, ``gpu_mem`` and
    a ``title`` that states the answer.
    """
    _check_positive(psi=psi, gpu_mem=gpu_mem)
    states = {"weights": WEIGHT_BYTES * psi, "gradients": GRAD_BYTES * psi, "optimizer": ADAM_MIXED_K * psi}
    buffer = {"buffers": fused_gradient_buffer_bytes(psi)}
    activations = {
        "activation checkpointing (the paper's rule)": activation_bytes(h, b, s, layers, checkpointing=True),
        "every activation kept, the paper's rule (a lower bound)": activation_bytes(h, b, s, layers),
        "every activation kept, Korthikanti et al. (fused attention)": activation_bytes_korthikanti(
            h, b, s, layers, heads, dropout=False, fused_attention=True
        ),
    }
    bars = {label: {**states, "activations": a, **buffer} for label, a in activations.items()}
    totals = {label: sum(parts.values()) for label, parts in bars.items()}
    least, fit = min(totals.values()), sum(t <= gpu_mem for t in totals.values())
    verdict = "no bill fits" if fit == 0 else f"{fit} of {len(totals)} bills fit"
    title = (
        f"GPT-2 {fmt_count(psi)}, b = {b}: {least / GB:.1f} GB even with checkpointing; "
        f"{verdict} one {gpu_mem / GB:g} GB GPU"
    )
    return {"bars": bars, "totals": totals, "gpu_mem": float(gpu_mem), "title": title}
