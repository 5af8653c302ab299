"""The throughput planner against the rehearsal, term by term, before and after calibration (notebooks 05, 05b).

Terms, as the tracker sorts bytes at its peak: **activations** (``Activation``, ``Temp``, ``Inputs``,
``Buffer``) and **states and buffers** (everything else: shards, optimizer state, gradients, gathered
parameters, communication buffers); and the **peak** itself.

- *before*: the course's first planner (``predictions.predict``: the paper's 12·h·s·b·L rule for
  activations, no logits or loss, DDP's buckets for every strategy); it knows only "none" and "full".
- *after*: the throughput planner (``plan.throughput.memory``) for the same setting with the rehearsal's
  CPU kernels, its terms taken at the moment the rehearsal peaked (in forward while no gradient shard
  exists, else in backward). Its three fitted constants (the loss's 8V bytes per token, a block's backward
  working set, what a selective block rebuilds) were fitted on these rehearsals; everything else is counted.
- *cuda*: the same with CUDA's kernels: CPU kernels are not CUDA kernels. The difference is the artefact
  of rehearsing on a CPU (RMSNorm's composite path keeps fp32 copies a fused CUDA kernel does not).

No tensor, no process: it reads ``Rehearsal`` objects and computes.
"""

from __future__ import annotations

from ..plan.implementations import IMPLS
from ..plan.shapes import GPUS, GPUCluster, Shape
from ..plan.throughput import Config, memory
from ..strategies import get_fsdp
from .predictions import CALIBRATED_TOL, agreement, predict
from .run import Rehearsal, short_label, short_size

ACTIVATION_CATEGORIES = ("Activation", "Temp", "Inputs", "Buffer")
TERMS = ("activations", "states and buffers", "peak")
_FORWARD = ("end of forward", "backward of the loss")
_BACKWARD = ("first block's backward", "late backward")


def measured_terms(r: Rehearsal) -> dict:
    """The rehearsal's peak in the planner's three terms, bytes per rank."""
    act = sum(r.peak.get(c, 0) for c in ACTIVATION_CATEGORIES)
    return {"activations": act, "states and buffers": r.peak_bytes - act, "peak": r.peak_bytes}


def _impl_for(r: Rehearsal):
    row = get_fsdp(r.strategy)
    return next((i for i in IMPLS if i.course is row and not i.offload), None)


def planner_terms(r: Rehearsal, kernels: str = "cpu") -> dict | None:
    """The throughput planner's terms for the rehearsal's setting (no allocator reserve, no CUDA context),
    at the moment the rehearsal peaked; None for a strategy the planner prices as another implementation."""
    impl = _impl_for(r)
    if impl is None or r.mixed_precision != "bf16":
        return None
    c = r.cfg
    s = Shape("", c.arch, c.layers, c.width, c.heads, c.n_kv_heads, c.hidden, c.vocab, c.seq, c.tie_weights)
    cluster = GPUCluster(GPUS["H100-80GB"], gpus_per_node=r.nproc, context_bytes=0.0, allocator_reserve=0.0)
    config = Config(impl.key, r.recompute, r.micro_batch, 1, 1, impl.shard(r.nproc, r.node_size), kernels)
    m = memory(s, impl, config, cluster)
    moments = _FORWARD if r.peak.get("Sharded Grad", 0) == 0 else _BACKWARD
    at = max(moments, key=lambda k: m["phases"][k]["total"])
    p = m["phases"][at]
    return {"activations": p["activations"], "states and buffers": p["states"] + p["unsharded"],
            "peak": m["tensors_peak"], "moment": at}  # fmt: skip


def before_terms(r: Rehearsal) -> dict | None:
    """The first planner's terms (it knew no policy but none and full)."""
    if r.recompute not in ("none", "full"):
        return None
    p = predict(r)
    return {"activations": p["activations"], "states and buffers": p["model_states"] + p["buffers"], "peak": p["total"]}


def calibration_rows(rehearsals) -> list[dict]:
    """One row per rehearsal and term: measured, before, after (CPU kernels), the CUDA estimate, errors."""
    rows = []
    for r in rehearsals:
        m, b, a, cu = measured_terms(r), before_terms(r), planner_terms(r, "cpu"), planner_terms(r, "cuda")
        for term in TERMS:
            rows.append({
                "label": r.label,
                "policy": r.recompute,
                "term": term,
                "measured": m[term],
                "before": b and b[term],
                "before_error": b and b[term] / m[term] - 1,
                "after": a and a[term],
                "after_error": a and a[term] / m[term] - 1,
                "cuda": cu and cu[term],
                "cpu_artefact": (a and cu) and a[term] - cu[term],
                "moment": a and a["moment"],
            })  # fmt: skip
    return rows


def summary_rows(rehearsals: list[Rehearsal]) -> list[dict]:
    """Both planners against the rehearsal, one row per rehearsal: what notebook 05b's summary shows (notebook 05b).

    ``calibrated``: the throughput planner's peak with this CPU's kernels (``calibration.planner_terms``; None
    for a setting it prices as another implementation), ``calibrated_ratio`` rehearsal / it; ``planner`` and
    ``ratio``: the first planner's (the paper's rule, ``predict``)."""
    rows = []
    for r in rehearsals:
        a, p, cal = agreement(r), predict(r), planner_terms(r, "cpu")
        ratio = r.peak_bytes / cal["peak"] if cal else None
        rows.append(
            {
                "setting": f"{short_size(r.psi)} on {r.nproc}: {r.label}",
                "short": short_label(r),
                "calibrated": cal and cal["peak"],
                "calibrated_ratio": ratio,
                "calibrated_within": ratio is not None and abs(ratio - 1) <= CALIBRATED_TOL,
                "planner": p["total"],
                "rehearsal": r.peak_bytes,
                "ratio": a["peak"],
                "model_states": a["model_states"],
                "activation_share": a["activation_share"],
                "claimed": a["peak_claim_applies"],
                "within": a["peak_within_tol"],
            }
        )
    return rows
