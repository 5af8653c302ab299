"""The rehearsal's other side: what the planner predicts for the same setting, item by item, and how closely
the two agree (notebook 05b).

The planner's numbers come from ``plan.price.memory_breakdown`` on the strategy's row (what it shards at
the peak of a step, over which group): the rehearsal is held against the same arithmetic notebook 05
plans with.
"""

from __future__ import annotations

import math

from ..memory.bill import GRAD_BYTES, WEIGHT_BYTES, OptimizerBill, model_state_bytes, optimizer_bill
from ..plan.inputs import Cluster, ModelSpec
from ..plan.price import memory_breakdown
from ..presets import GPTConfig
from ..strategies import FULL_SHARD, PARAMS, get_fsdp
from .run import Rehearsal, check_setting, model_config, padded_shard_numel, param_count

# ---------------------------------------------------------------------------------------------
# The formulas' side: what memory.bill and the planner predict for the same setting, item by item
# ---------------------------------------------------------------------------------------------


def optimizer_bill_for(mixed_precision: str) -> OptimizerBill:
    """bf16 -> mixed-precision Adam (2 + 2 + 12); fp32 -> plain fp32 Adam (4 + 4 + 8) (notebook 05b)."""
    return optimizer_bill("adam_mixed" if mixed_precision == "bf16" else "adam_fp32")


#: Numbers per token per unit of width one GPT-2 course block saves for backward (16-bit), counted
#: with saved-tensor hooks on a real block (``tests/test_rehearse.py``); the paper's rule says 12.
BLOCK_SAVED_PER_TOKEN_WIDTH = 16


def predict(r: Rehearsal) -> dict:
    """The planner's bytes per rank for a rehearsal's setting, item by item (notebook 05b).

    See ``predict_setting``; this reads the setting from ``r``.
    """
    ckpt = r.act_ckpt or r.recompute == "full"
    return _predict(r.cfg, r.psi, r.nproc, r.strategy, r.node_size, r.micro_batch, ckpt, r.mixed_precision)


def predict_setting(
    model: str | GPTConfig = "6.7B",
    nproc: int = 8,
    strategy: str = FULL_SHARD.name,
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    act_ckpt: bool = False,
    mixed_precision: str = "bf16",
    recompute: str = "none",
) -> dict:
    """The planner's bytes per rank before any rehearsal: the "predict" of predict-then-run (notebook 05b).

    ``plan.memory_breakdown`` for the same model, GPUs, strategy, micro-batch and checkpointing:
    model states by what the row shards at the peak (``memory.model_state_bytes``, Nd = the shard group),
    activations by the paper's rule (12·h·b·s·L numbers of 2 bytes), buffers (two 25 MB
    buckets, or for stage 3 the gathered block twice plus its 16-bit gradient). The planner
    assumes mixed precision; for fp32 the items are rescaled to 4-byte weights, gradients,
    activations and gathers, and K = 8 (plain fp32 Adam). Returns ``{"weights", "gradients",
    "optimizer", "model_states", "activations", "buffers", "total", "stage", "nd", "psi"}``.
    This first planner knows two recomputation policies: none, and full (``act_ckpt``, or ``recompute="full"``);
    for "selective" and "every:K" it books no recomputation (the throughput planner prices them:
    ``rehearse.calibration``).
    """
    cfg = model_config(model)
    check_setting(nproc, strategy, node_size, micro_batch, mixed_precision)
    ckpt = act_ckpt or recompute == "full"
    return _predict(cfg, param_count(cfg), nproc, strategy, node_size, micro_batch, ckpt, mixed_precision)


def _predict(cfg, psi, nproc, strategy, node_size, micro_batch, act_ckpt, mixed_precision) -> dict:
    row = get_fsdp(strategy)
    bill = optimizer_bill_for(mixed_precision)
    stage, nd = row.zero_row("peak"), row.shard_group_size(nproc, node_size)
    spec = ModelSpec(
        params=float(psi),
        layers=cfg.layers,
        width=cfg.width,
        heads=cfg.heads,
        vocab=cfg.vocab,
        seq=cfg.seq,
        micro_batch=micro_batch,
        checkpointing=act_ckpt,
        arch=cfg.arch,
        kv_heads=cfg.n_kv_heads,
        hidden=cfg.hidden,
    )
    if row.shard_over == "node":  # the shard group is a node of node_size GPUs
        cluster = Cluster(gpus_per_node=node_size, nodes=nproc // node_size)
    else:
        cluster = Cluster(gpus_per_node=nproc, nodes=1)
    out = dict(memory_breakdown(spec, cluster, row, k=bill.k))
    if mixed_precision == "fp32":
        scale = bill.weight_bytes / WEIGHT_BYTES
        out["weights"] *= scale
        out["gradients"] *= bill.grad_bytes / GRAD_BYTES
        out["activations"] *= scale
        if PARAMS in row.shards_at_peak:  # the gathered block's buffers are in the working precision
            out["buffers"] *= scale
    out["model_states"] = out["weights"] + out["gradients"] + out["optimizer"]
    check = model_state_bytes(psi, nd, stage, k=bill.k, weight_bytes=bill.weight_bytes, grad_bytes=bill.grad_bytes)
    assert math.isclose(out["model_states"], check, rel_tol=1e-9), (out["model_states"], check)
    out["total"] = out["model_states"] + out["activations"] + out["buffers"]
    out["stage"], out["nd"], out["psi"] = stage.name, nd, int(psi)
    return out


#: Model states: the formula (with FSDP2's padding counted, ``padded_shard_numel``) and the
#: tracker agree to this relative tolerance. The only difference left is Adam's 4-byte step
#: counter per tensor: ~1e-8 of a 6.7B's states, 2.4e-4 of the 867k-parameter "small" model's.
MODEL_STATE_TOL = 1e-3
#: The peak: the planner within this fraction of the tracker, for full-depth models (at least
#: ``PEAK_MIN_LAYERS`` blocks) whose rule-based activations are at most ``PEAK_MAX_ACT_SHARE`` of
#: the planner's total. Why so narrow a claim: the planner's activation rule counts 12 numbers per
#: token per unit of width per block (a GPT-2-era count); a Llama block (SwiGLU's four
#: hidden-size tensors, RMSNorm computed in fp32, rotated copies of q and k) and the loss's fp32
#: log-probabilities hold about 2.5 times that (notebook 05b measures it on Llama 2 7B at 4096 tokens), so an
#: activation term of 10% of the total can be 15% of it. Without checkpointing the activations are
#: a third or more of the total and the planner's peak is far low; the notebook shows by how much
#: (``peak_errors``) instead of claiming a tolerance.
PEAK_TOL = 0.15
#: The calibrated (throughput) planner's peak against the tracker's: notebook 05b's claim for every setting it prices.
CALIBRATED_TOL = 0.05
PEAK_MAX_ACT_SHARE = 0.10
PEAK_MIN_LAYERS = 16

#: The planner's items and the tracker's parts (``PARTS``) they are held against at the peak.
PEAK_ITEMS = {
    "model states": ("fp32 parameter shards", "optimizer state", "gradients", "16-bit weights being computed"),
    "activations": ("activations and temporaries",),
    "buffers": ("communication buffers",),
}


def peak_errors(r: Rehearsal) -> dict:
    """Where the planner's peak is wrong, item by item: planner minus rehearsal at the peak, bytes (notebook 05b).

    ``{"model states", "activations", "buffers", "total"}``; positive means the planner says more
    than FSDP2 holds at the moment of the peak. Model states at the peak are the fp32 parameter
    shards, the optimizer state, the gradients held and the bf16 weights gathered at that moment
    (the planner counts 2Ψ/Nd of 16-bit weights and 2Ψ/Nd of 16-bit gradients whatever the moment).
    The items add up to the total: ``total`` = planner's peak − rehearsal's peak.
    """
    p, parts = predict(r), r.parts("peak")
    planner = {"model states": p["model_states"], "activations": p["activations"], "buffers": p["buffers"]}
    out = {item: planner[item] - sum(parts[x] for x in members) for item, members in PEAK_ITEMS.items()}
    out["total"] = p["total"] - r.peak_bytes
    return out


def agreement(r: Rehearsal) -> dict:
    """How closely the formulas match the rehearsal, as numbers a notebook can assert (notebook 05b).

    Model states are held against the formula with FSDP2's padding counted (``padded_shard_numel``:
    each tensor's dim 0 rounded up to a multiple of Nd), so the ratios are 1 up to Adam's step
    counters for any world size:

    - ``"optimizer"``: optimizer state held after the step over K·(padded Ψ/Nd); with bf16 the
      fp32 parameter shard is counted here, as the paper's master copy;
    - ``"gradients"``: gradients at the end of backward over 2·(padded Ψ/Nd), the formula's
      16-bit gradients (2.0 with bf16: FSDP2 keeps them in fp32) or over 4·(...) with fp32;
    - ``"model_states"``: everything held after the step over 16·(padded Ψ/Nd);
    - ``"planner_model_states"``: the same bytes over the planner's model-states row (16Ψ/Nd, no padding);
    - ``"padding"``: how much FSDP2's padding adds to Ψ/Nd (0 when every dim 0 divides by Nd);
    - ``"peak"``: the rehearsal's peak over the planner's total (``predict``); ``"activation_share"``:
      the planner's activations over its total; ``"peak_claim_applies"`` (``PEAK_TOL`` is claimed
      for this setting) and ``"peak_within_tol"``.
    """
    bill = optimizer_bill_for(r.mixed_precision)
    shard = padded_shard_numel(r.cfg, r.nd)
    a, b = r.after_step, r.after_backward
    mixed = r.mixed_precision == "bf16"
    p = predict(r)
    out = {
        "optimizer": ((a["Sharded Param"] if mixed else 0) + a["OptState"]) / (bill.k * shard),
        "gradients": (b["Sharded Grad"] + b["Unsharded Grad"]) / ((GRAD_BYTES if mixed else bill.grad_bytes) * shard),
        "model_states": (a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]) / (bill.total * shard),
        "planner_model_states": (a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]) / p["model_states"],
        "padding": shard * r.nd / r.psi - 1,
        "peak": r.peak_bytes / p["total"],
        "activation_share": p["activations"] / p["total"],
    }
    out["peak_claim_applies"] = r.cfg.layers >= PEAK_MIN_LAYERS and out["activation_share"] <= PEAK_MAX_ACT_SHARE
    out["peak_within_tol"] = abs(out["peak"] - 1) <= PEAK_TOL
    return out


def buffers_booked(strategy: str) -> str:
    """The first planner's buffers for a strategy, in words (``plan.price.memory_breakdown``): the compare table's
    buffers row and the command line's header say it here (notebook 05b)."""
    if PARAMS in get_fsdp(strategy).shards_at_peak:
        return "a gathered block twice and its 16-bit gradient"
    return "two 25 MB gradient buckets"


def compare(r: Rehearsal) -> list[dict]:
    """The planner against the rehearsal, one row per item of the bill, with why they differ (notebook 05b).

    Each row: ``{"item", "formula", "rehearsal", "ratio", "when", "why"}`` (bytes per rank);
    ``ratio`` is rehearsal / formula.
    """
    spec = get_fsdp(r.strategy)
    p = predict(r)
    bill = optimizer_bill_for(r.mixed_precision)
    a, b, top = r.after_step, r.after_backward, r.category_peaks
    nd = f"/{r.nd}" if r.nd > 1 else ""
    mixed = r.mixed_precision == "bf16"
    rows = []

    def row(item, formula, rehearsal, when, why):
        rows.append(
            {
                "item": item,
                "formula": float(formula),
                "rehearsal": float(rehearsal),
                "ratio": (rehearsal / formula) if formula else float("nan"),
                "when": when,
                "why": why,
            }
        )

    if mixed:
        row(
            f"optimizer state, K = {bill.k:g}",
            p["optimizer"],
            a["Sharded Param"] + a["OptState"],
            "after the step",
            f"the paper's 12 bytes are an fp32 master copy, momentum and variance. FSDP2's fp32 parameter shard IS "
            f"the master copy (Sharded Param, 4Ψ{nd}); AdamW's exp_avg and exp_avg_sq are OptState (8Ψ{nd}). Only "
            "extra: padding of each tensor to a multiple of Nd rows, and Adam's 4-byte step counter per tensor",
        )
        row(
            "gradients",
            p["gradients"],
            b["Sharded Grad"] + b["Unsharded Grad"],
            "end of backward",
            "the paper counts 16-bit gradients (2 bytes). FSDP2 reduce-scatters in fp32 (reduce_dtype) and keeps "
            "each gradient shard in the parameter's dtype, fp32: 4 bytes, twice the formula"
            + (f"; {r.strategy} keeps all of them on every rank" if not spec.shards_at_rest else ""),
        )
        if PARAMS in spec.shards_at_peak:
            why = (
                "the paper keeps a sharded 16-bit copy (2Ψ/Nd). FSDP2 keeps none at rest: it casts a block's "
                "fp32 shards to bf16 as it gathers them, computes, and frees the block; the most it holds is the "
                "root unit (embeddings, final norm, head: gathered for the whole step) and the one block computing. "
                "The block prefetched behind it is still the all-gather's output, a buffer"
            )
        elif spec.shards_at_rest != spec.shards_at_peak:  # gathered for the step: SHARD_GRAD_OP
            why = (
                "stage 2 keeps the 16-bit weights whole (2Ψ). FSDP2's SHARD_GRAD_OP keeps each block's bf16 copy "
                "gathered from its forward until its backward: at the start of backward that is all of them"
            )
        else:
            why = "every rank computes with the whole bf16 working copy"
        row("16-bit working weights", p["weights"], top["Unsharded Param"], "largest in the step", why)
    else:
        row(
            "fp32 weights",
            p["weights"],
            a["Sharded Param"],
            "after the step",
            "plain fp32 training: the parameter shard is both the working weights and what Adam updates",
        )
        row(
            "gradients (fp32)",
            p["gradients"],
            b["Sharded Grad"] + b["Unsharded Grad"],
            "end of backward",
            "fp32 gradient shards, as the formula counts them",
        )
        row(
            f"optimizer state, K = {bill.k:g}",
            p["optimizer"],
            a["OptState"],
            "after the step",
            "AdamW's exp_avg and exp_avg_sq, plus a 4-byte step counter per tensor",
        )
    at_rest = a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]
    if mixed and PARAMS in spec.shards_at_peak:
        why = (
            "2 + 2 + 12 bytes per parameter in the paper, 4 + 4 + 8 in FSDP2 (fp32 shard, fp32 gradient, "
            "momentum and variance): the same 16 bytes when everything is sharded"
        )
    elif spec.shards_at_rest != spec.shards_at_peak:
        why = (
            "the formula's 2Ψ of 16-bit weights is held only between forward and backward (row above); at rest "
            "FSDP2 holds 16 bytes per parameter, all sharded"
        )
    else:
        why = "16 bytes per parameter, as the formula counts them, held whole on every rank"
    row("model states at rest", p["model_states"], at_rest, "after the step", why)
    row(
        "buffers",
        p["buffers"],
        top["All Gather"] + top["Reduce Scatter"] + top["Unsharded Grad"],
        "largest in the step",
        "not in the 16-byte bill (ZeRO-R's constant buffers). The planner allows "
        + buffers_booked(r.strategy)
        + "; FSDP2 holds an all-gather output, a reduce-scatter input (fp32) and a block's unsharded gradient",
    )
    row(
        "activations",
        p["activations"],
        r.peak["Activation"] + r.peak["Temp"] + r.peak["Inputs"],
        "at the peak",
        f"the paper's rule is about 12 numbers per token per unit of width per layer, 16-bit; {kept_beyond_rule(r.cfg)}. "
        "Per rank; sharding never touches them"
        + ("; with checkpointing, one input per block plus one block rebuilt at a time" if r.act_ckpt else ""),
    )
    row(
        "peak per rank",
        p["total"],
        r.peak_bytes,
        "at the peak",
        "the planner's total (model states + activations + buffers) against the tracker's peak",
    )
    return rows


def kept_beyond_rule(cfg: GPTConfig) -> str:
    """What the course model's block and loss keep that the paper's 12-numbers rule does not count, in words (notebook
    05b prints it beside its activations and in section 7's table: one wording)."""
    if cfg.arch == "gpt2":
        kept = (
            f"this GPT-2 block keeps {BLOCK_SAVED_PER_TOKEN_WIDTH} (LayerNorm inputs 2h, the qkv input h, q k v "
            "3h, the attention output h, the MLP input h, 4h before and 4h after GELU)"
        )
    else:
        kept = (
            "this Llama block keeps more: SwiGLU's gate, SiLU output, up and product "
            f"({4 * cfg.hidden / cfg.width:.1f}h of them), RMSNorm's fp32 input and fp32 normalised product (before the "
            "weight), rotated copies of q and k"
        )
    return f"{kept}; the loss keeps log_softmax's fp32 log-probabilities over the {cfg.vocab:,}-token vocabulary"
