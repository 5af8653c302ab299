"""The throughput planner against the rehearsal, term by term, before and after calibration (notebooks 05, 05b).

Terms, as the tracker sorts bytes at its peak: **activations** (``Activation``, ``Temp``, ``Inputs``,
``Buffer``) and **states and buffers** (everything else: shards, optimizer state, gradients, gathered
parameters, communication buffers); and the **peak** itself.

- *before*: the course's first planner (``predictions.predict``: the paper's 12·h·s·b·L rule for
  activations, no logits or loss; buffers: DDP's two buckets where the weights are whole, a gathered block twice
  and its gradient where they are sharded); it knows only "none" and "full".
- *after*: the throughput planner (``plan.throughput.memory``) for the same setting with the rehearsal's
  CPU kernels, its terms taken at the planner's moment: its larger phase in the half of the step where the
  rehearsal peaked (the forward and the loss's backward while no gradient shard exists, else the backward). Its
  three fitted constants (the loss's 8V bytes per token, a block's backward working set, what a selective block
  rebuilds) were fitted on these rehearsals; everything else is counted.
- *cuda*: the same with CUDA's kernels, at the same moment: CPU kernels are not CUDA kernels. The difference
  is the artefact of rehearsing on a CPU (RMSNorm's composite path keeps fp32 copies a fused CUDA kernel does not).

No tensor, no process: it reads ``Rehearsal`` objects and computes.
"""

from __future__ import annotations

from ..plan.implementations import IMPLS
from ..plan.shapes import GPUS, GPUCluster, Shape
from ..plan.throughput import Config, memory
from ..strategies import FULL_SHARD, get_fsdp
from .predictions import CALIBRATED_TOL, agreement, predict
from .run import Rehearsal, short_label, short_size

ACTIVATION_CATEGORIES = ("Activation", "Temp", "Inputs", "Buffer")
TERMS = ("activations", "states and buffers", "peak")
_FORWARD = ("end of forward", "backward of the loss")
_BACKWARD = ("first block's backward", "late backward")
_AT = {"peak": "at moment"}  # the CPU kernels' share of the peak: at the planner's moment (``planner_terms``)
#: The settings the three constants were fitted on (preset, policy): 05b's own rehearsals, Llama 2 7B and Llama 3
#: 70B at both recomputation extremes and under the selective policy, and Llama 3 8B (the loss) under every policy.
#: Any other row is held out (``tests/test_rehearse.py``: Llama 2 13B with full recomputation, GPT-2 XL).
FITTED_ON = {(m, p) for m in ("6.7B", "70B") for p in ("none", "full", "selective")}


def fitted_on(r: Rehearsal) -> bool:
    """Whether the fit saw this rehearsal's setting (``FITTED_ON``; Llama 3 8B under any policy)."""
    name = short_size(r.psi)
    return name == "8B" or (name, r.recompute) in FITTED_ON


def measured_terms(r: Rehearsal) -> dict:
    """The rehearsal's peak in the planner's three terms, bytes per rank."""
    act = sum(r.peak.get(c, 0) for c in ACTIVATION_CATEGORIES)
    return {"activations": act, "states and buffers": r.peak_bytes - act, "peak": r.peak_bytes}


def _impl_for(r: Rehearsal):
    return _impl_of(r.strategy)


def _impl_of(strategy: str):
    row = get_fsdp(strategy)
    return next((i for i in IMPLS if i.course is row and not i.offload), None)


def _memory(c, nproc: int, strategy: str, node_size: int, micro_batch: int, recompute: str, kernels: str) -> dict:
    """``plan.throughput.memory`` for one setting at ``c``'s shape, no allocator reserve, no CUDA context."""
    impl = _impl_of(strategy)
    s = Shape("", c.arch, c.layers, c.width, c.heads, c.n_kv_heads, c.hidden, c.vocab, c.seq, c.tie_weights)
    cluster = GPUCluster(GPUS["H100-80GB"], gpus_per_node=nproc, context_bytes=0.0, allocator_reserve=0.0)
    config = Config(impl.key, recompute, micro_batch, 1, 1, impl.shard(nproc, node_size), kernels)
    return memory(s, impl, config, cluster)


def _planned(r: Rehearsal, kernels: str = "cpu", cfg=None) -> dict:
    """``plan.throughput.memory`` for the rehearsal's setting (at ``cfg``'s shape if given)."""
    return _memory(cfg or r.cfg, r.nproc, r.strategy, r.node_size, r.micro_batch, r.recompute, kernels)


def planned_peak(cfg, nproc: int, strategy: str, *, node_size: int = 8, micro_batch: int = 1, recompute: str = "none"):
    """The calibrated planner's peak per rank (this CPU's kernels, as ``planner_terms``) for a setting not rehearsed:
    the outlined bars of notebook 05b's chart. ``cfg``: a ``GPTConfig`` (``model_config``)."""
    return _memory(cfg, nproc, strategy, node_size, micro_batch, recompute, "cpu")["tensors_peak"]


def planner_terms(r: Rehearsal, kernels: str = "cpu", at: str | None = None) -> dict | None:
    """The throughput planner's terms for the rehearsal's setting (no allocator reserve, no CUDA context),
    at the planner's moment (or its phase ``at``): of the planner's two phases in the half of the step where the
    rehearsal peaked (the forward and the loss's backward if no gradient shard existed yet, else the backward), the
    larger. The moment is the planner's, not measured (the tracker's is ``Rehearsal.peak_at``). None for a strategy
    the planner prices as another implementation. ``"at moment"``: the planner's total at that moment, where its ``"peak"`` is its
    largest over the step, at ``"peak moment"``."""
    if _impl_for(r) is None or r.mixed_precision != "bf16":
        return None
    m = _planned(r, kernels)
    moments = _FORWARD if r.peak.get("Sharded Grad", 0) == 0 else _BACKWARD
    at = at or max(moments, key=lambda k: m["phases"][k]["total"])
    p = m["phases"][at]
    return {"activations": p["activations"], "states and buffers": p["states"] + p["unsharded"],
            "peak": m["tensors_peak"], "moment": at, "at moment": p["total"],
            "peak moment": m["peak_phase"]}  # fmt: skip


def planner_moments(r: Rehearsal, kernels: str = "cpu") -> dict:
    """The throughput planner's total at each of its four moments of the step for the rehearsal's setting
    (``{"end of forward": bytes, ...}``), ``"one block kept"``: the activations it books per block kept to the
    backward (the mean over the blocks: under "every:K" kept and rebuilt ones), and ``"block in backward"``: what it
    books for the last block, whose backward runs at its first block's backward, that block's activations (kept,
    plus what its policy rebuilds of it) and its backward working set (notebook 05b: FSDP2 frees them before it
    builds the reduce-scatter input the planner prices beside them)."""
    m = _planned(r, kernels)
    act, kept = m["activations"], m["activations"]["blocks kept"] / r.cfg.layers
    return {
        **{k: p["total"] for k, p in m["phases"].items()},
        "one block kept": kept,
        "block in backward": act["last block kept"] + act["last block rebuilt"] + act["block backward working set"],
    }


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
        m, b, a = measured_terms(r), before_terms(r), planner_terms(r, "cpu")
        cu = a and planner_terms(r, "cuda", at=a["moment"])  # CUDA's kernels at the same moment of the step
        for term in TERMS:
            rows.append({
                "label": r.label,
                "setting": f"{short_size(r.psi)} on {r.nproc}: {r.label}",
                "policy": r.recompute,
                "in_sample": fitted_on(r),
                "term": term,
                "measured": m[term],
                "before": b and b[term],
                "before_error": b and b[term] / m[term] - 1,
                "after": a and a[term],
                "after_error": a and a[term] / m[term] - 1,
                "cuda": cu and cu[term],
                "cpu_artefact": (a and cu) and a[_AT.get(term, term)] - cu[_AT.get(term, term)],
                "moment": a and a["moment"],
                "peak_moment": a and a["peak moment"],
                "block_share": a and planner_moments(r, "cpu")["block in backward"] / r.peak_bytes,
                "nproc": r.nproc,
                "micro_batch": r.micro_batch,
            })  # fmt: skip
    return rows


def _moment(m: dict) -> str:
    """Where a ``plan.throughput.memory`` result peaks: "forward" (no gradient shard yet) or "backward"."""
    at = max(m["phases"], key=lambda k: m["phases"][k]["total"])
    return "forward" if at in _FORWARD else "backward"


def _rehearsed_moment(r: Rehearsal) -> str:
    return "forward" if r.peak.get("Sharded Grad", 0) == 0 else "backward"


def preset_calibration(name: str, recompute: str, nproc: int = 8, strategy: str = FULL_SHARD.name, first: int = 3):
    """The planner's terms against the rehearsal for a published preset at its full depth, rehearsed cheaply: at
    three consecutive depths of a few blocks, the same width, heads, feed-forward, vocabulary and sequence
    (notebook 05b).

    A term at d blocks is T(d) = T(d0) + (d - d0) x per-block as long as the step peaks at the same moment (in
    forward, or in backward once gradient shards exist); the moment can change with depth (the backward's peak
    gains a gradient shard per block), so d0 is the first depth from ``first`` at which the planner puts the peak
    where it puts the whole model's, and the three rehearsals must peak there too. ``linear``: the per-block step
    came out the same to the byte between the three depths. The measured term at the preset's L blocks is
    T(d0) + (L - d0) x per-block; the planner's is priced at L blocks directly, at the planner's moment
    (``planner_terms``). Where the three depths peak elsewhere than the whole model (Llama 2 without recomputation peaks in
    forward only from about 30 blocks on), the whole model is rehearsed once instead. Returns one row per term:
    ``{"preset", "policy", "term", "measured", "after", "after_error", "linear", "per_block", "depths", "moment"}``.
    """
    from dataclasses import replace

    from ..presets import preset
    from .run import model_config, rehearse

    full = preset(name).cfg
    probe = rehearse(model_config(name, layers=first), nproc, strategy, recompute=recompute)
    want = _moment(_planned(probe, cfg=full))
    # the first depth the planner puts the peak where it puts the full model's
    start = next(d for d in range(first, full.layers) if _moment(_planned(probe, cfg=replace(full, layers=d))) == want)
    runs = [probe] if start == first else []
    for depth in range(start + len(runs), min(start + 3, full.layers + 1)):
        runs.append(rehearse(model_config(name, layers=depth), nproc, strategy, recompute=recompute))
    if len(runs) < 3 or {_rehearsed_moment(r) for r in runs} != {want}:  # not where the whole model peaks
        runs = [rehearse(full, nproc, strategy, recompute=recompute)]
    seen = [measured_terms(r) for r in runs]
    steps = [{t: b[t] - a[t] for t in TERMS} for a, b in zip(seen, seen[1:])] or [dict.fromkeys(TERMS, 0)]
    d0 = runs[0].cfg.layers
    planned = planner_terms(replace(runs[0], cfg=full))
    rows = []
    for term in TERMS:
        measured = seen[0][term] + (full.layers - d0) * steps[0][term]
        rows.append({
            "preset": name, "policy": recompute, "term": term, "measured": measured,
            "after": planned[term], "after_error": planned[term] / measured - 1,
            "linear": all(s[term] == steps[0][term] for s in steps), "per_block": steps[0][term],
            "depths": tuple(r.cfg.layers for r in runs), "moment": _rehearsed_moment(runs[0]),
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
