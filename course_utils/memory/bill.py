"""The 16-byte bill and the three ZeRO stages, as formulas (introduced in notebook 01).

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

Each row is a row of the strategy record (``strategies.ZERO_TABLE``): what it shards is the row's
``shards_at_rest``, read here, never its name. This room is the arithmetic: the formulas above,
activations by the paper's rule, the fused buffer, the paper's headline sums. No processes, no torch;
functions accept numpy arrays for ``nd`` so a chart can evaluate a whole curve at once. Its
neighbours: ``memory.chart`` (what notebook 01's chart and bars show), ``memory.cli`` (the command
line), ``memory.measure`` (the same bill counted on real tensors).

Units: everything is bytes inside; GB (10^9, the paper's unit) and GiB (2^30) only appear
when formatting, always labelled (see ``course_utils.units``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import CourseInputError
from ..strategies import DDP, GRADS, OPTIM, PARAMS, ZERO2, ZERO_TABLE, Strategy, get
from ..units import GB

#: The four rows of the paper's memory table, in order of how much they shard.
STAGES = tuple(s.name for s in ZERO_TABLE)

#: How the paper and the field name each row.
STAGE_NAMES = {s.name: s.paper for s in ZERO_TABLE}

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


def _row(stage: str | Strategy) -> Strategy:
    """The row of ``stage`` (a name of ``STAGES``, or any row of the record); one sentence otherwise."""
    if isinstance(stage, Strategy):
        return stage
    if stage not in STAGES:
        raise CourseInputError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    return get(stage)


def per_parameter(stage: str | Strategy, *, k: float = ADAM_MIXED_K, weight_bytes=WEIGHT_BYTES, grad_bytes=GRAD_BYTES):
    """``(whole, split)``: the bytes per parameter a row keeps whole on every GPU and the bytes it splits
    over Nd, from what it shards (``shards_at_rest``); the parts it offloads are on neither (notebook 01).

    Plain DP: (2 + 2 + K, 0); stage 1: (2 + 2, K); stage 2: (2, 2 + K); stage 3: (0, 2 + 2 + K).
    """
    row = _row(stage)
    whole = split = 0.0
    for part, b in ((PARAMS, weight_bytes), (GRADS, grad_bytes), (OPTIM, k)):
        if part in row.offload:
            continue
        if part in row.shards_at_rest:
            split += b
        else:
            whole += b
    return whole, split


def formula_text(stage: str | Strategy) -> str:
    """A row's bill as the paper writes it, from what it shards: "2·Ψ + (2 + K)·Ψ/Nd" for stage 2 (notebook 01)."""
    row = _row(stage)
    symbol = {PARAMS: "2", GRADS: "2", OPTIM: "K"}

    def term(parts):
        terms = [symbol[p] for p in (PARAMS, GRADS, OPTIM) if p in parts and p not in row.offload]
        return terms[0] if len(terms) == 1 else f"({' + '.join(terms)})"

    whole = [p for p in (PARAMS, GRADS, OPTIM) if p not in row.shards_at_rest]
    split = [p for p in (PARAMS, GRADS, OPTIM) if p in row.shards_at_rest]
    text = [f"{term(whole)}·Ψ"] if whole else []
    return " + ".join(text + ([f"{term(split)}·Ψ/Nd"] if split else []))


def model_state_bytes(
    psi,
    nd=1,
    stage: str | Strategy = DDP,
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
        stage: one of ``STAGES``: "ddp", "zero1" (P_os), "zero2" (P_os+g), "zero3" (P_os+g+p), or a
            row of the record (its ``shards_at_rest``).
        k: K, optimizer bytes per parameter (12 for mixed-precision Adam).
        nm: Nm, model-parallel degree; each GPU sees Ψ/Nm parameters.
        weight_bytes, grad_bytes: bytes per working weight and per gradient (2 each in the
            paper's mixed precision; 4 each for plain fp32 training, see ``OPTIMIZERS``).

    Returns:
        Bytes per GPU (float, or an array shaped like ``nd``): ``whole``·Ψ/Nm + ``split``·Ψ/Nm/Nd
        (``per_parameter``).
    """
    whole, split = per_parameter(stage, k=k, weight_bytes=weight_bytes, grad_bytes=grad_bytes)
    _check(psi, nd, k, nm)
    p = np.asarray(psi, dtype=float) / np.asarray(nm, dtype=float)
    nd = np.asarray(nd, dtype=float)
    out = whole * p + split * p / nd
    return float(out) if out.ndim == 0 else out


def bytes_per_gpu(psi, nd=1, *, k: float = ADAM_MIXED_K, nm=1) -> dict:
    """All four rows at once: ``{"ddp": ..., "zero1": ..., "zero2": ..., "zero3": ...}`` (notebook 01)."""
    return {stage: model_state_bytes(psi, nd, stage, k=k, nm=nm) for stage in STAGES}


def floor_bytes(psi, stage: str | Strategy, *, nm=1, k: float = ADAM_MIXED_K) -> float:
    """The bytes per GPU a stage keeps however large Nd grows (notebook 01).

    Stage 1 keeps its 16-bit weights and gradients (4Ψ), stage 2 its 16-bit weights (2Ψ),
    stage 3 nothing: 70B has floors of 280 GB and 140 GB for stages 1 and 2. Plain DP keeps
    all (2 + 2 + K)Ψ.
    """
    whole, _ = per_parameter(stage, k=k)
    _check(psi, 1, k, nm)
    return float(whole * psi / nm)


def smallest_nd_that_fits(
    psi, stage: str | Strategy, gpu_mem: float, *, k: float = ADAM_MIXED_K, nm=1, other_bytes: float = 0.0
):
    """The smallest whole Nd at which a stage's model states (plus ``other_bytes``) fit in
    ``gpu_mem`` bytes, or None if no Nd is enough (the stage's floor is too high) (notebook 01).
    """
    budget = gpu_mem - other_bytes
    fixed = floor_bytes(psi, stage, nm=nm, k=k)
    if not per_parameter(stage, k=k)[1]:  # nothing divides by Nd
        return 1 if fixed <= budget else None
    sharded = model_state_bytes(psi, 1, stage, k=k, nm=nm) - fixed  # the part that divides by Nd
    if fixed >= budget:
        return None
    return max(1, math.ceil(sharded / (budget - fixed) - 1e-12))


def whole_tensor_partition(numels, nd: int) -> list[list[int]]:
    """How ZeroRedundancyOptimizer (torch's ZeRO stage 1) hands whole tensors to ``nd`` ranks (notebook 01).

    torch never splits a tensor: ``_partition_parameters`` (torch/distributed/optim/
    zero_redundancy_optimizer.py) sorts the tensors largest first and gives each to the rank holding the
    fewest elements so far (the lowest rank on a tie). So a rank's share is a sum of whole tensors and
    misses Ψ/Nd by up to one tensor. ``numels``: each parameter tensor's element count, in the order
    ``model.parameters()`` gives them. Returns each rank's tensors' element counts, in the order
    it received them (a rank's optimizer state is 8 bytes per element with AdamW).
    """
    if not (isinstance(nd, int) and nd >= 1):
        raise CourseInputError(f"nd (Nd) must be a whole number of ranks >= 1, got {nd!r}")
    ranks: list[list[int]] = [[] for _ in range(nd)]
    held = [0] * nd
    for n in sorted((int(n) for n in numels), reverse=True):  # a stable sort, as torch's sorted(...)
        rank = held.index(min(held))
        ranks[rank].append(n)
        held[rank] += n
    return ranks


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
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # the planner's scalars: no array
            ok = math.isfinite(value) and value > 0
        else:
            v = np.asarray(value, dtype=float)
            ok = bool(np.all(np.isfinite(v)) and np.all(v > 0))
        if not ok:
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
    """The ZeRO paper's ZeRO-R sums and headline results beside this module's formulas (notebook 01).

    Only what the paper states: a figure it never prints is not a row (notebook 01 prints such sums
    beside the table, as the course's own arithmetic). Each row: ``claim``; ``words``, what the paper
    itself says (its words, with the section); ``stated``, the paper's number in ``unit``;
    ``relation``, how the paper's words bind the recomputed value: ``"about"`` (within 5%),
    ``"below"`` (ours must be under the stated figure: "less than 10%", "fits a 32 GB GPU") or
    ``"above"`` (the paper's limit includes more than model states, so model states alone must allow
    more); ``ours``, recomputed here in the same unit; ``note``, what the comparison reveals. Use
    ``paper_agrees(row)`` to hold a row against the paper; ``unit_reinterpreted`` marks a row that
    agrees only if the paper's "GB" is read as billions of numbers (hold those out of a check).
    Model states are mixed-precision Adam (K = 12); the 100B model is L = 125 blocks of width
    h = 8,192 at b = 32, s = 1,024 (the paper's Table 4), ZeRO-100B is stage 2 with Nm = 16 inside a DGX-2.
    """
    h, b, s, L = 8192, 32, 1024, 125
    inputs = activation_numbers(h, b, s, L, checkpointing=True) - activation_numbers(h, b, s, 1)  # L layer inputs
    message = h * b * s  # one block input: the message of every MP collective
    megatron = 6 * 2 * message  # 6 all-reduces per block (fwd, recompute, bwd), 2x each
    two_bytes = ACTIVATION_BYTES_PER_NUMBER
    reinterpreted = "billion numbers (the paper says GB: unit reinterpreted)"  # agrees only under this reading
    rows = [
        (
            "plain DP: the largest model on a 32 GB GPU",
            '"runs out of memory for models with more than 1.4B parameters" (§1)',
            1.4,
            "above",
            gpu_mem / model_state_bytes(1) / 1e9,
            "billion parameters",
            "model states alone stop at 2B; the paper's 1.4B leaves room for activations and buffers",
        ),
        (
            "13B, no model parallelism, stage 2 on 128 GPUs",
            '"up to 13B parameters" with no model changes, on 32 GB V100s (§10.4)',
            gpu_mem / GB,
            "below",
            model_state_bytes(13e9, 128, ZERO2) / GB,
            "GB",
            "the paper states that it fits, not how much it holds",
        ),
        (
            "Pa: the 100B model's activation checkpoints",
            '"about 33 GB" (§6.1)',
            33.0,
            "about",
            inputs / 1e9,
            reinterpreted,
            f"33.6 billion numbers; at {two_bytes} bytes each that is {two_bytes * inputs / 1e9:.1f} GB, "
            "twice the paper's figure",
        ),
        (
            "Pa: the same, split over Nm = 16",
            '"about 2 GB" (§6.1)',
            2.0,
            "about",
            inputs / 16 / 1e9,
            reinterpreted,
            f"{two_bytes * inputs / 16 / 1e9:.1f} GB at {two_bytes} bytes a number",
        ),
        (
            "Pa: its extra all-gather against Megatron-LM's traffic per block",
            '"less than 10%" (§8)',
            10.0,
            "below",
            100 * message / megatron,
            "%",
            f"one block input gathered per block, against Megatron-LM's {megatron // message} "
            "(6 all-reduces per block, each moving twice its message)",
        ),
        (
            "CB: one fused fp32 gradient buffer for 3B parameters",
            '"12 GB" (§6.2)',
            12.0,
            "about",
            fused_gradient_buffer_bytes(3e9) / GB,
            "GB",
            "4 bytes for each of the 3B gradients: the buffer grows with Ψ, a constant-size one does not",
        ),
    ]
    keys = ("claim", "words", "stated", "relation", "ours", "unit", "note")
    return [dict(zip(keys, row), unit_reinterpreted=row[5] == reinterpreted) for row in rows]


def paper_agrees(row: dict) -> bool:
    """Whether a row of ``zero_r_and_headlines`` agrees with what the paper states (notebook 01)."""
    stated, ours = row["stated"], row["ours"]
    if row["relation"] == "about":
        return abs(ours - stated) <= 0.05 * stated
    if row["relation"] == "below":
        return ours < stated
    return ours > stated
