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

Everything here is pure arithmetic: no processes, no torch.distributed. Functions accept
numpy arrays for ``nd`` so a chart can evaluate a whole curve at once.
"""
from __future__ import annotations

import numpy as np

from .errors import CourseInputError

#: The four rows of the paper's memory table, in order of how much they shard.
STAGES = ("ddp", "zero1", "zero2", "zero3")

#: Bytes per parameter of the 16-bit working weights and of their gradients.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
#: K for mixed-precision Adam: fp32 master weights + fp32 momentum + fp32 variance.
ADAM_MIXED_K = 12


def _check(psi, nd, k, nm):
    if np.any(np.asarray(psi, dtype=float) <= 0):
        raise CourseInputError("params (Ψ) must be positive; pass a count like 7.5e9 or '7.5B'")
    if np.any(np.asarray(nd, dtype=float) < 1):
        raise CourseInputError("dp (Nd) must be at least 1 GPU")
    if np.any(np.asarray(nm, dtype=float) < 1):
        raise CourseInputError("mp (Nm) must be at least 1 GPU")
    if np.any(np.asarray(k, dtype=float) < 0):
        raise CourseInputError("k (optimizer bytes per parameter) cannot be negative")


def model_state_bytes(psi, nd=1, stage: str = "ddp", *, k: float = ADAM_MIXED_K, nm=1):
    """Model-state bytes per GPU for one row of the ZeRO table (notebook 01).

    Args:
        psi: Ψ, the parameter count of the whole model.
        nd: Nd, the data-parallel degree (scalar or numpy array).
        stage: one of ``STAGES``: "ddp", "zero1" (P_os), "zero2" (P_os+g), "zero3" (P_os+g+p).
        k: K, optimizer bytes per parameter (12 for mixed-precision Adam).
        nm: Nm, model-parallel degree; each GPU sees Ψ/Nm parameters.

    Returns:
        Bytes per GPU (float, or an array shaped like ``nd``).
    """
    _check(psi, nd, k, nm)
    p = np.asarray(psi, dtype=float) / np.asarray(nm, dtype=float)
    nd = np.asarray(nd, dtype=float)
    if stage == "ddp":
        out = (WEIGHT_BYTES + GRAD_BYTES + k) * p + 0 * nd
    elif stage == "zero1":
        out = (WEIGHT_BYTES + GRAD_BYTES) * p + k * p / nd
    elif stage == "zero2":
        out = WEIGHT_BYTES * p + (GRAD_BYTES + k) * p / nd
    elif stage == "zero3":
        out = (WEIGHT_BYTES + GRAD_BYTES + k) * p / nd
    else:
        raise CourseInputError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    return float(out) if out.ndim == 0 else out


def bytes_per_gpu(psi, nd=1, *, k: float = ADAM_MIXED_K, nm=1) -> dict:
    """All four rows at once: ``{"ddp": ..., "zero1": ..., "zero2": ..., "zero3": ...}`` (notebook 01)."""
    return {stage: model_state_bytes(psi, nd, stage, k=k, nm=nm) for stage in STAGES}


def floor_bytes(psi, stage: str, *, nm=1) -> float:
    """The bytes per GPU a stage keeps however large Nd grows (notebook 01).

    Stage 1 keeps its 16-bit weights and gradients (4Ψ), stage 2 its 16-bit weights (2Ψ),
    stage 3 nothing: 70B has floors of 280 GB and 140 GB for stages 1 and 2.
    """
    per = {"ddp": WEIGHT_BYTES + GRAD_BYTES + ADAM_MIXED_K, "zero1": WEIGHT_BYTES + GRAD_BYTES,
           "zero2": WEIGHT_BYTES, "zero3": 0}
    if stage not in per:
        raise CourseInputError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    _check(psi, 1, 0, nm)
    return float(per[stage] * psi / nm)
