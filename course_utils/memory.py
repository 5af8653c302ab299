"""Memory arithmetic: the 16-byte bill and the three ZeRO stages (introduced in notebook 01).

Symbols follow the ZeRO paper (Rajbhandari et al., 2019, arXiv:1910.02054):

- Ψ  (``psi``): number of model parameters.
- K  (``k``):   bytes of optimizer state per parameter. Mixed-precision Adam keeps an fp32
  master copy, fp32 momentum and fp32 variance: K = 4 + 4 + 4 = 12.
- Nd (``nd``):  data-parallel degree (GPUs that share the model state).
- Nm (``nm``):  model-parallel degree; it divides Ψ before data parallelism sees it.

Model-state bytes per GPU (16-bit weights = 2Ψ, 16-bit gradients = 2Ψ, optimizer = KΨ):

=========  ==========================  =====================
row        bytes per GPU               paper's name
=========  ==========================  =====================
ddp        (2 + 2 + K)Ψ                baseline
zero1      (2 + 2)Ψ + KΨ/Nd            P_os
zero2      2Ψ + (2 + K)Ψ/Nd            P_os+g
zero3      (2 + 2 + K)Ψ/Nd             P_os+g+p
=========  ==========================  =====================

The module has three parts:

1. Pure arithmetic (the formulas above, activations by the paper's rule, the fused buffer,
   the paper's Table 1, and what the notebook-01 chart and bars show). No processes, no
   torch.distributed; functions accept numpy arrays for ``nd`` so a chart can evaluate a whole
   curve at once.
2. The command line: ``python -m course_utils memory`` and ``python -m course_utils table``.
3. Measurement on real tensors (``measure_model_state_bytes``, ``measure_activation_bytes``):
   the same bill counted from the bytes a real model and optimizer hold. torch is imported
   only there, so the calculators stay fast to start.

Units: everything is bytes inside; GB (10^9, the paper's unit) and GiB (2^30) only appear
when formatting, always labelled (see ``course_utils.units``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import dataclass

import numpy as np

from .errors import CourseInputError
from .units import GB, GiB, fmt_bytes, fmt_count, fmt_size, parse_bytes
from .validate import check_numbers, finite_result, params_count

#: The four rows of the paper's memory table, in order of how much they shard.
STAGES = ("ddp", "zero1", "zero2", "zero3")

#: How the paper and the field name each row.
STAGE_NAMES = {
    "ddp": "plain DP",
    "zero1": "stage 1 (P_os)",
    "zero2": "stage 2 (P_os+g)",
    "zero3": "stage 3 (P_os+g+p)",
}

#: Bytes per parameter of the 16-bit working weights and of their gradients.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
#: K for mixed-precision Adam: fp32 master weights + fp32 momentum + fp32 variance.
ADAM_MIXED_K = 12


# ---------------------------------------------------------------------------------------------
# 1. Model states: the formulas
# ---------------------------------------------------------------------------------------------


def _check(psi, nd, k, nm):
    if np.any(np.asarray(psi, dtype=float) <= 0):
        raise CourseInputError("params (Ψ) must be positive; pass a count like 7.5e9 or '7.5B'")
    if np.any(np.asarray(nd, dtype=float) < 1):
        raise CourseInputError("dp (Nd) must be at least 1 GPU")
    if np.any(np.asarray(nm, dtype=float) < 1):
        raise CourseInputError("mp (Nm) must be at least 1 GPU")
    if np.any(np.asarray(k, dtype=float) < 0):
        raise CourseInputError("k (optimizer bytes per parameter) cannot be negative")


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise CourseInputError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")


def model_state_bytes(
    psi,
    nd=1,
    stage: str = "ddp",
    *,
    k: float = ADAM_MIXED_K,
    nm=1,
    weight_bytes: float = WEIGHT_BYTES,
    grad_bytes: float = GRAD_BYTES,
):
    """Model-state bytes per GPU for one row of the ZeRO table (notebook 01).

    Args:
        psi: Ψ, the parameter count of the whole model.
        nd: Nd, the data-parallel degree (scalar or numpy array).
        stage: one of ``STAGES``: "ddp", "zero1" (P_os), "zero2" (P_os+g), "zero3" (P_os+g+p).
        k: K, optimizer bytes per parameter (12 for mixed-precision Adam).
        nm: Nm, model-parallel degree; each GPU sees Ψ/Nm parameters.
        weight_bytes, grad_bytes: bytes per working weight and per gradient (2 each in the
            paper's mixed precision; 4 each for plain fp32 training, see ``OPTIMIZERS``).

    Returns:
        Bytes per GPU (float, or an array shaped like ``nd``).
    """
    _check(psi, nd, k, nm)
    p = np.asarray(psi, dtype=float) / np.asarray(nm, dtype=float)
    nd = np.asarray(nd, dtype=float)
    w, g = weight_bytes, grad_bytes
    if stage == "ddp":
        out = (w + g + k) * p + 0 * nd
    elif stage == "zero1":
        out = (w + g) * p + k * p / nd
    elif stage == "zero2":
        out = w * p + (g + k) * p / nd
    elif stage == "zero3":
        out = (w + g + k) * p / nd
    else:
        _check_stage(stage)
    return float(out) if out.ndim == 0 else out


def bytes_per_gpu(psi, nd=1, *, k: float = ADAM_MIXED_K, nm=1) -> dict:
    """All four rows at once: ``{"ddp": ..., "zero1": ..., "zero2": ..., "zero3": ...}`` (notebook 01)."""
    return {stage: model_state_bytes(psi, nd, stage, k=k, nm=nm) for stage in STAGES}


def floor_bytes(psi, stage: str, *, nm=1, k: float = ADAM_MIXED_K) -> float:
    """The bytes per GPU a stage keeps however large Nd grows (notebook 01).

    Stage 1 keeps its 16-bit weights and gradients (4Ψ), stage 2 its 16-bit weights (2Ψ),
    stage 3 nothing: 70B has floors of 280 GB and 140 GB for stages 1 and 2. Plain DP keeps
    all (2 + 2 + K)Ψ.
    """
    per = {"ddp": WEIGHT_BYTES + GRAD_BYTES + k, "zero1": WEIGHT_BYTES + GRAD_BYTES, "zero2": WEIGHT_BYTES, "zero3": 0}
    _check_stage(stage)
    _check(psi, 1, k, nm)
    return float(per[stage] * psi / nm)


def smallest_nd_that_fits(psi, stage: str, gpu_mem: float, *, k: float = ADAM_MIXED_K, nm=1, other_bytes: float = 0.0):
    """The smallest whole Nd at which a stage's model states (plus ``other_bytes``) fit in
    ``gpu_mem`` bytes, or None if no Nd is enough (the stage's floor is too high) (notebook 01).
    """
    _check_stage(stage)
    budget = gpu_mem - other_bytes
    fixed = floor_bytes(psi, stage, nm=nm, k=k)
    if stage == "ddp":
        return 1 if fixed <= budget else None
    sharded = model_state_bytes(psi, 1, stage, k=k, nm=nm) - fixed  # the part that divides by Nd
    if fixed >= budget:
        return None
    return max(1, math.ceil(sharded / (budget - fixed) - 1e-12))


@dataclass(frozen=True)
class OptimizerBill:
    """Bytes per parameter an optimizer setting keeps, and where each byte comes from (notebook 01).

    ``weight_bytes`` and ``grad_bytes`` are the working copies the model computes with; ``k`` (K)
    is the optimizer state, itemised in ``parts``.
    """

    name: str
    weight_bytes: float
    grad_bytes: float
    k: float
    parts: tuple  # ((label, bytes per parameter), ...) summing to k
    note: str

    @property
    def total(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.k


#: K of common optimizers, each with the tensors its bytes come from (notebook 01).
OPTIMIZERS: dict[str, OptimizerBill] = {
    "adam_mixed": OptimizerBill(
        "mixed-precision Adam (the paper's case)",
        2,
        2,
        12,
        (("fp32 master weights", 4), ("fp32 momentum", 4), ("fp32 variance", 4)),
        "ZeRO paper §3.1; bf16 in place of fp16 changes nothing in the count",
    ),
    "adam_fp32": OptimizerBill(
        "plain fp32 Adam",
        4,
        4,
        8,
        (("fp32 momentum", 4), ("fp32 variance", 4)),
        "no master copy needed: the working weights are already fp32; also 16 bytes, split 4 + 4 + 8",
    ),
    "sgd_momentum_mixed": OptimizerBill(
        "mixed-precision SGD with momentum",
        2,
        2,
        8,
        (("fp32 master weights", 4), ("fp32 momentum", 4)),
        "one running average instead of Adam's two",
    ),
    "sgd_mixed": OptimizerBill(
        "mixed-precision plain SGD",
        2,
        2,
        4,
        (("fp32 master weights", 4),),
        "the master copy is the whole optimizer state",
    ),
    "adam_8bit_mixed": OptimizerBill(
        "mixed-precision 8-bit Adam",
        2,
        2,
        6,
        (("fp32 master weights", 4), ("8-bit momentum", 1), ("8-bit variance", 1)),
        "block-wise quantised moments (Dettmers et al., 2022); the per-block scales add a little",
    ),
}


def optimizer_bill(name: str) -> OptimizerBill:
    """The ``OptimizerBill`` for a name in ``OPTIMIZERS`` (notebook 01)."""
    if name not in OPTIMIZERS:
        raise CourseInputError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


# ---------------------------------------------------------------------------------------------
# Residual states: activations and the fused gradient buffer (paper §3.2)
# ---------------------------------------------------------------------------------------------

#: The paper's footnote: a GPT-2-like layer keeps about 12 numbers per hidden unit per token.
ACTIVATION_NUMBERS_PER_TOKEN_PER_WIDTH = 12
#: 16-bit activations: 2 bytes per number.
ACTIVATION_BYTES_PER_NUMBER = 2


def _check_positive(**values):
    for name, value in values.items():
        if np.any(~np.isfinite(np.asarray(value, dtype=float))) or np.any(np.asarray(value, dtype=float) <= 0):
            raise CourseInputError(f"{name} must be a positive number, got {value!r}")


def activation_numbers(h, b, s, layers, *, checkpointing: bool = False):
    """Numbers of activations one GPU keeps for the backward pass, by the paper's rule (notebook 01).

    Without checkpointing: about 12·h·b·s·L (h hidden width, b micro-batch, s sequence length,
    L layers). With activation checkpointing at every layer boundary: the L layer inputs,
    h·b·s·L, plus one layer's full set, 12·h·b·s, rebuilt while that layer's backward runs.
    (The paper quotes "about 8 GB" for GPT-2 1.5B with checkpointing without showing its sum;
    this rule gives 6.3 GB.)  Accepts numpy arrays.
    """
    _check_positive(h=h, b=b, s=s, layers=layers)
    h, b, s, layers = (np.asarray(v, dtype=float) for v in (h, b, s, layers))
    per_layer = ACTIVATION_NUMBERS_PER_TOKEN_PER_WIDTH * h * b * s
    out = (h * b * s * layers + per_layer) if checkpointing else per_layer * layers
    return float(out) if np.ndim(out) == 0 else out


def activation_bytes(
    h, b, s, layers, *, checkpointing: bool = False, bytes_per_number: float = ACTIVATION_BYTES_PER_NUMBER
):
    """Activation bytes per GPU by the paper's rule, in 16-bit unless told (notebook 01).

    GPT-2 1.5B (h = 1600, L = 48) at b = 32, s = 1024: 12·h·b·s·L = 30.2 billion numbers,
    60.4 GB. Sharding model states (any ZeRO stage) leaves this term untouched.
    """
    return activation_numbers(h, b, s, layers, checkpointing=checkpointing) * bytes_per_number


def fused_gradient_buffer_bytes(psi, bytes_per_number: float = 4):
    """One flat fp32 buffer holding every gradient for a fused all-reduce: 4Ψ bytes (notebook 01).

    GPT-2 1.5B: 6 GB. ZeRO-R's constant-size buffers (CB) cap it instead.
    """
    _check_positive(params=psi)
    return float(np.asarray(psi, dtype=float) * bytes_per_number)


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
    view["title"] = _chart_title(view)
    view["readout_text"] = readout_text(view)
    return view


def _chart_title(view: dict) -> str:
    gpu = fmt_bytes(view["gpu_mem"], "GB", 0)
    short = {"ddp": "plain DP", "zero1": "stage 1", "zero2": "stage 2", "zero3": "stage 3"}
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
    return f"{fmt_count(view['psi'])} on one {gpu} GPU: " + ", ".join(parts)


def readout_text(view: dict) -> str:
    """One line of exact values at the chosen Nd, the text the chart's widget shows (notebook 01)."""
    parts = [f"{STAGE_NAMES[s]}: {fmt_size(view['readout'][s])}{' ✓' if view['fits'][s] else ''}" for s in STAGES]
    return (
        f"Ψ = {fmt_count(view['psi'])}, K = {view['k']:g}, Nd = {view['nd']}: "
        + " · ".join(parts)
        + f"  (✓ fits {view['gpu_mem'] / GB:g} GB)"
    )


#: The parts of the bill, bottom to top in the stacked bars.
BILL_PARTS = ("weights", "gradients", "optimizer", "activations")


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
    sharded = {
        "ddp": (),
        "zero1": ("optimizer",),
        "zero2": ("optimizer", "gradients"),
        "zero3": ("optimizer", "gradients", "weights"),
    }
    out = {}
    for stage in STAGES:
        out[stage] = {
            part: {"held": full[part] / nd if part in sharded[stage] else full[part], "full": full[part]}
            for part in BILL_PARTS
        }
    return out


# ---------------------------------------------------------------------------------------------
# 2. Command line: `python -m course_utils memory` and `python -m course_utils table`
# ---------------------------------------------------------------------------------------------


def _positive_int(name: str, value: int) -> int:
    if value < 1:
        raise CourseInputError(f"{name} must be a whole number >= 1, got {value}")
    return value


def memory_arguments(parser) -> None:
    """Arguments of ``python -m course_utils memory`` (notebook 01)."""
    parser.add_argument("--params", required=True, help="Ψ: parameter count, e.g. 7.5e9, 7.5B, 350M, 1T")
    parser.add_argument("--dp", type=int, default=1, help="Nd: data-parallel degree (default 1)")
    parser.add_argument("--mp", type=int, default=1, help="Nm: model-parallel degree (default 1)")
    parser.add_argument(
        "--k",
        type=float,
        default=ADAM_MIXED_K,
        help="K: optimizer bytes per parameter (default 12, mixed-precision Adam)",
    )
    parser.add_argument("--stage", default=None, help="print only this row: ddp, zero1, zero2 or zero3")
    parser.add_argument("--json", action="store_true", help="print one JSON object (values in bytes)")


def memory_command(args) -> int:
    """Print the per-GPU model-state bytes of plain DP and stages 1-3 (notebook 01)."""
    psi = params_count("--params", args.params)
    nd = _positive_int("--dp (Nd)", args.dp)
    nm = _positive_int("--mp (Nm)", args.mp)
    if not math.isfinite(args.k) or args.k < 0:
        raise CourseInputError(f"--k must be a number of bytes >= 0, got {args.k:g}")
    if args.stage is not None and args.stage not in STAGES:
        raise CourseInputError(f"--stage: unknown stage {args.stage!r}; choose one of {', '.join(STAGES)}")
    stages = STAGES if args.stage is None else (args.stage,)
    rows = {s: finite_result("model-state bytes", model_state_bytes(psi, nd, s, k=args.k, nm=nm)) for s in stages}
    if args.json:
        print(json.dumps({"params": psi, "dp": nd, "mp": nm, "k": args.k, "bytes_per_gpu": rows}))
        return 0
    print(f"Model-state bytes per GPU: Ψ = {fmt_count(psi)} parameters, Nd = {nd}, Nm = {nm}, K = {args.k:g}")
    print(f"{'row':<20} {'bytes':>22} {'GB (10^9)':>12} {'GiB (2^30)':>12}")
    for s, v in rows.items():
        print(f"{STAGE_NAMES[s]:<20} {v:>22,.0f} {v / GB:>12.3f} {v / GiB:>12.3f}")
    return 0


def gb_cell(n_bytes: float) -> str:
    """Bytes as GB the way the paper's Table 1 prints them: three significant digits, halves
    rounded up, no exponent (41.25 → "41.3", 2,048 → "2048", 0.1172 → "0.117") (notebook 01)."""
    from decimal import ROUND_HALF_UP, Decimal

    d = Decimal(repr(n_bytes / GB))
    if d == 0:
        return "0"
    digits = max(0, 3 - (d.adjusted() + 1))
    return f"{d.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP):f}"


def table_arguments(parser) -> None:
    """Arguments of ``python -m course_utils table`` (notebook 01)."""
    parser.add_argument(
        "--params", default="7.5B,128B,1T", help="comma-separated model sizes (default: the paper's 7.5B,128B,1T)"
    )
    parser.add_argument(
        "--dp", default="1,4,16,64,256,1024", help="comma-separated Nd values (default: the paper's 1,4,16,64,256,1024)"
    )
    parser.add_argument(
        "--gpu-mem",
        default="32GB",
        help="GPU memory to mark what fits, e.g. 32GB, 80GB, 24GiB (default 32GB, the paper's V100)",
    )
    parser.add_argument("--k", type=float, default=ADAM_MIXED_K, help="K: optimizer bytes per parameter (default 12)")
    parser.add_argument("--mp", type=int, default=1, help="Nm: model-parallel degree (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (values in bytes)")


def table_command(args) -> int:
    """Print the paper's Table 1 grid in GB and mark the cells that fit one GPU (notebook 01)."""
    params = [params_count("--params", p) for p in str(args.params).split(",")]
    try:
        nds = [int(x) for x in str(args.dp).split(",")]
    except ValueError:
        raise CourseInputError(f"--dp: cannot read {args.dp!r}; write whole numbers like 1,4,16,64") from None
    check_numbers(argparse.Namespace(dp=nds))
    for nd in nds:
        _positive_int("--dp (Nd)", nd)
    nm = _positive_int("--mp (Nm)", args.mp)
    if not math.isfinite(args.k) or args.k < 0:
        raise CourseInputError(f"--k must be a number of bytes >= 0, got {args.k:g}")
    gpu_mem = parse_bytes(args.gpu_mem, name="--gpu-mem")
    rows = table1(params, nds, gpu_mem=gpu_mem, k=args.k, nm=nm)
    for row in rows:
        for value in row["bytes_per_gpu"].values():
            finite_result("model-state bytes", value)
    if args.json:
        print(json.dumps({"gpu_mem": gpu_mem, "k": args.k, "mp": nm, "rows": rows}))
        return 0
    print(
        f"Model-state memory per GPU in GB (10^9 bytes), K = {args.k:g}, Nm = {nm}; * = fits a {gpu_mem / GB:g} GB GPU"
    )
    print(f"{'Ψ':>6} {'Nd':>6} " + " ".join(f"{STAGE_NAMES[s].split(' (')[0]:>10}" for s in STAGES))
    for row in rows:
        cells = [f"{gb_cell(row['bytes_per_gpu'][s]):>9}{'*' if row['fits'][s] else ' '}" for s in STAGES]
        print(f"{fmt_count(row['params']):>6} {row['nd']:>6} " + " ".join(cells))
    return 0


# ---------------------------------------------------------------------------------------------
# 3. Measured on real tensors (notebook 01): the bill counted from what torch actually holds
# ---------------------------------------------------------------------------------------------


class MixedPrecisionAdam:
    """Adam as the ZeRO paper counts it: 16-bit working weights and gradients on the model,
    an fp32 master copy, fp32 momentum and fp32 variance in the optimizer (notebook 01).

    K = 4 + 4 + 4 = 12 bytes per parameter, on top of the model's 2 + 2. Construct it on an
    fp32 model: it takes fp32 master copies first, then turns the model's parameters into
    ``dtype`` (bf16 by default; fp16 counts the same). ``step()`` upcasts each 16-bit gradient
    one tensor at a time, updates the master copy exactly as ``torch.optim.Adam`` would, and
    writes the result back into the 16-bit weights.

    ``state`` maps each model parameter to ``{"master", "exp_avg", "exp_avg_sq"}``, shaped
    like ``torch.optim.Optimizer.state`` so ``held_bytes`` counts either the same way.
    """

    def __init__(self, model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, dtype=None):
        import torch

        dtype = torch.bfloat16 if dtype is None else dtype
        self.lr, self.betas, self.eps, self.steps = lr, betas, eps, 0
        self.params = list(model.parameters())  # distinct parameters: a tied weight appears once
        masters = [p.detach().to(torch.float32).clone() for p in self.params]
        for p in self.params:
            p.data = p.data.to(dtype)
        self.state = {
            p: {"master": m, "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
            for p, m in zip(self.params, masters)
        }

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        self.steps += 1
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1 - b1**self.steps, math.sqrt(1 - b2**self.steps)
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                st = self.state[p]
                g = p.grad.to(torch.float32)  # a transient fp32 copy of one tensor's gradient
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(self.eps)
                st["master"].addcdiv_(st["exp_avg"], denom, value=-self.lr / bc1)
                p.copy_(st["master"])


def held_bytes(model, optimizer=None) -> dict:
    """Bytes the real tensors hold, by part of the bill (notebook 01).

    Counts each underlying storage once (a tied weight, or a view, is not counted twice):
    ``weights`` (the model's parameters), ``gradients`` (their ``.grad``), ``optimizer``
    (optimizer-state tensors with one number per parameter, e.g. master copy, momentum,
    variance), ``optimizer_scalars`` (small per-tensor state such as ``torch.optim.Adam``'s
    ``step`` counters) and ``total`` (the first three).
    """
    seen: set = set()

    def nbytes(tensors):
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen and st.nbytes():
                seen.add(key)
                total += st.nbytes()
        return total

    params = list(model.parameters())
    out = {"weights": nbytes(params), "gradients": nbytes([p.grad for p in params if p.grad is not None])}
    per_param, scalars = [], []
    if optimizer is not None:
        import torch

        for p, st in optimizer.state.items():
            for value in st.values():
                if isinstance(value, torch.Tensor):
                    (per_param if value.numel() == p.numel() else scalars).append(value)
    out["optimizer"] = nbytes(per_param)
    out["optimizer_scalars"] = nbytes(scalars)
    out["total"] = out["weights"] + out["gradients"] + out["optimizer"]
    return out


def measure_model_state_bytes(
    model="tiny", optimizer: str = "adam_mixed", *, seed: int = 0, batch: int = 4, dtype=None
) -> dict:
    """Build the course model, run one real training step, and count the bytes it holds (notebook 01).

    ``optimizer``: "adam_mixed" (``MixedPrecisionAdam``: bf16 weights and grads, fp32 master,
    momentum, variance) or "adam_fp32" (``torch.optim.Adam`` on an fp32 model). The gradients
    are counted after the step, before they are cleared, as they are at the step's peak.

    Returns ``held_bytes(...)`` plus ``psi`` (Ψ, from ``models.param_count``), ``optimizer_name``,
    ``per_param`` ({part: bytes / Ψ}) and ``loss``.
    """
    import torch

    from .data import batch_for_rank
    from .models import build_model, get_config, param_count

    cfg = get_config(model)
    net = build_model(cfg, seed=seed)
    if optimizer == "adam_mixed":
        opt = MixedPrecisionAdam(net, dtype=dtype)
    elif optimizer == "adam_fp32":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
    else:
        raise CourseInputError(f"optimizer must be 'adam_mixed' or 'adam_fp32', got {optimizer!r}")
    x, y = batch_for_rank(0, 0, 1, batch=batch, seq=cfg.seq, vocab=cfg.vocab, seed=seed)
    loss = net(x, y)
    loss.backward()
    opt.step()
    out = held_bytes(net, opt)
    psi = param_count(net)
    out["per_param"] = {k: out[k] / psi for k in ("weights", "gradients", "optimizer", "total")}
    out.update(psi=psi, optimizer_name=optimizer, loss=loss.item())
    return out


@contextlib.contextmanager
def checkpointed_blocks(model):
    """Inside this context every transformer block of the course model runs under activation
    checkpointing (``torch.utils.checkpoint``, non-reentrant): a block keeps only its input
    and recomputes the rest during the backward pass (notebook 01).
    """
    from torch.utils.checkpoint import checkpoint

    blocks = list(model.blocks)
    for block in blocks:
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    try:
        yield model
    finally:
        for block in blocks:
            del block.forward  # back to the class's own forward


def measure_activation_bytes(model, idx, targets=None, *, checkpointing: bool = False) -> dict:
    """Bytes autograd saves for the backward pass during one forward, counted on the real tensors
    with ``torch.autograd.graph.saved_tensors_hooks`` (notebook 01).

    Each storage is counted once (views such as q, k, v of one qkv output share a storage);
    parameters are not activations and are left out. Returns ``{"total": bytes, "blocks": bytes
    saved inside the transformer blocks (what the paper's 12·h·b·s·L rule describes),
    "outside": embeddings, final norm, logits and loss, "loss": the loss tensor}``.
    """
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {}
    where = {"inside": 0}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = (st.nbytes(), where["inside"] > 0)
        return t

    def enter(module, args):
        where["inside"] += 1

    def leave(module, args, output):
        where["inside"] -= 1

    handles = [h for b in model.blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    ctx = checkpointed_blocks(model) if checkpointing else contextlib.nullcontext()
    try:
        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, targets) if targets is not None else model(idx)
    finally:
        for h in handles:
            h.remove()
    blocks = sum(n for n, inside in saved.values() if inside)
    total = sum(n for n, _ in saved.values())
    return {"total": total, "blocks": blocks, "outside": total - blocks, "loss": loss}


def compare_activations(cases, *, model="tiny", dtype=None, seed: int = 0) -> list[dict]:
    """Measured activation bytes against the paper's rule for several (b, s, width, layers) (notebook 01).

    ``cases``: iterable of dicts with any of ``batch``, ``seq``, ``width``, ``layers``, ``heads``
    (others from the ``model`` preset). The model runs in ``dtype`` (bf16 by default) so saved
    activations are 16-bit numbers, as the rule assumes. Returns one row per case with the
    measured ``blocks``/``total`` bytes, with and without checkpointing, the rule's bytes
    (``activation_bytes``, both ways) and ``ratio`` = measured blocks / rule.
    """
    import torch

    from .data import batch_for_rank
    from .models import build_model, get_config

    dtype = torch.bfloat16 if dtype is None else dtype
    rows = []
    for case in cases:
        case = dict(case)
        batch = case.pop("batch", 4)
        cfg = get_config(model, **case)
        net = build_model(cfg, seed=seed).to(dtype)
        x, y = batch_for_rank(0, 0, 1, batch=batch, seq=cfg.seq, vocab=cfg.vocab, seed=seed)
        full = measure_activation_bytes(net, x, y)
        ckpt = measure_activation_bytes(net, x, y, checkpointing=True)
        rule = activation_bytes(cfg.width, batch, cfg.seq, cfg.layers)
        rule_ckpt = activation_bytes(cfg.width, batch, cfg.seq, cfg.layers, checkpointing=True)
        rows.append(
            {
                "batch": batch,
                "seq": cfg.seq,
                "width": cfg.width,
                "layers": cfg.layers,
                "heads": cfg.heads,
                "measured_blocks": full["blocks"],
                "measured_total": full["total"],
                "measured_blocks_ckpt": ckpt["blocks"],
                "measured_total_ckpt": ckpt["total"],
                "rule": rule,
                "rule_ckpt": rule_ckpt,
                "ratio": full["blocks"] / rule,
            }
        )
    return rows


def activation_bytes_korthikanti(h, b, s, layers, heads, *, dropout: bool = True, fused_attention: bool = False):
    """Activation bytes a transformer layer keeps in 16-bit, by Korthikanti et al. 2022 (notebook 01).

    "Reducing Activation Recomputation in Large Transformer Models", eq. (1): a layer keeps
    s·b·h·(34 + 5·a·s/h) bytes (a heads). The 34 are, in units of s·b·h bytes: attention 11
    (QKV input 2, Q and K 4, V 2, output-projection input 2, dropout mask 1), MLP 19 (input 2, GELU
    input 8, second linear's input 8, dropout mask 1), two layer-norm inputs 4; the 5·a·s/h term is
    the attention scores, softmax and its dropout mask. ``dropout=False`` drops the three masks;
    ``fused_attention=True`` (PyTorch's ``scaled_dot_product_attention``) the score terms.
    Measured on the course model (bf16, fused attention, no dropout): 32·s·b·h per layer, plus
    0.5-1.2% of per-row statistics (softmax log-sum-exp, norm statistics).
    """
    _check_positive(h=h, b=b, s=s, layers=layers, heads=heads)
    per_layer = 34 * s * b * h - (0 if dropout else 2 * s * b * h)
    if not fused_attention:
        per_layer += (5 if dropout else 4) * heads * s * s * b
    return float(per_layer * layers)


def zero_r_and_headlines(gpu_mem: float = 32 * GB) -> list[dict]:
    """The ZeRO paper's ZeRO-R sums and headline results, recomputed with this module's formulas (notebook 01).

    Each row: ``claim``, ``paper`` (the figure the paper states, or its annotated reading
    works out from the paper's inputs, in the row's ``unit``) and ``ours`` (recomputed here, in the
    same unit). Model states are mixed-precision Adam
    (K = 12); the 100B model is L = 125 blocks of width h = 8,192 at b = 32, s = 1,024 (the
    paper's Table 4), ZeRO-100B is stage 2 with Nm = 16 inside a DGX-2.
    """
    h, b, s, L = 8192, 32, 1024, 125
    inputs = activation_numbers(h, b, s, L, checkpointing=True) - activation_numbers(h, b, s, 1)  # L layer inputs
    message = h * b * s  # one block input: the message of every MP collective
    megatron = 6 * 2 * message  # 6 all-reduces per block (fwd, recompute, bwd), 2× each
    rows = [
        ("plain DP: 1.4B parameters' model states on one GPU", 22.4, model_state_bytes(1.4e9) / GB, "GB"),
        (
            "plain DP: the most parameters whose model states alone fit",
            2.0,
            gpu_mem / model_state_bytes(1) / 1e9,
            "billion",
        ),
        ("7.5B on Nd = 64, stage 1", 31.4, model_state_bytes(7.5e9, 64, "zero1") / GB, "GB"),
        ("13B with no model parallelism, stage 2 on 128 GPUs", 27.4, model_state_bytes(13e9, 128, "zero2") / GB, "GB"),
        ("60B, Nm = 16, stage 2 on 64 GPUs (Nd = 4)", 20.6, model_state_bytes(60e9, 4, "zero2", nm=16) / GB, "GB"),
        ("60B, Nm = 16, stage 2 on 400 GPUs (Nd = 25)", 9.6, model_state_bytes(60e9, 25, "zero2", nm=16) / GB, "GB"),
        ("Pa: 100B model's activation checkpoints, L·b·s·h", 33.6, inputs / 1e9, "billion numbers"),
        ("Pa: the same split over Nm = 16", 2.1, inputs / 16 / 1e9, "billion numbers"),
        ("Pa: its extra all-gather, against Megatron-LM's traffic per block", 8.3, 100 * message / megatron, "%"),
        ("CB: one fused fp32 gradient buffer for 3B parameters", 12.0, fused_gradient_buffer_bytes(3e9) / GB, "GB"),
    ]
    return [{"claim": c, "paper": p, "ours": o, "unit": u} for c, p, o, u in rows]
