"""One run of one strategy, before it starts and after it ran: the prediction of a run and the checks of its
report against the formulas (notebooks 03, 04; README).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..models import get_config, param_count, unit_modules, unit_table
from ..strategies import Strategy, get
from .held import (
    bill_bytes,
    bill_precision,
    peak_gathered_bytes,
    step_counter_bytes,
    strategy_held_bytes,
    update_extra_bytes,
)
from .sent import fsdp_collectives, paper_sent_bytes, traffic_in_psi, zero_traffic

# ---------------------------------------------------------------------------------------------
# Units: what a run will gather, counted before any process starts
# ---------------------------------------------------------------------------------------------


def _meta_model(model: str) -> nn.Module:
    """The course model's structure, for counting (a CPU build: milliseconds, where the first
    meta-device build costs seconds of lazy imports); the global RNG is left as it was."""
    from ..models import GPT

    with torch.random.fork_rng(devices=[]):
        return GPT(get_config(model))


def planned_units(model: str = "tiny", granularity: str = "block", shard_size: int = 1) -> list[dict]:
    """``unit_table`` of the course model before any process starts: what a run will gather (notebook 04)."""
    gpt = _meta_model(model)
    return unit_table(gpt, shard_size, unit_modules(gpt, granularity))


def model_tensors(model: str = "tiny") -> int:
    """Distinct parameter tensors of the course model (the tied head counts once): Adam keeps a step counter
    for each one it steps (``step_counter_bytes``) (notebooks 03, 04)."""
    return len(list(_meta_model(model).parameters()))


def _with_steps(held: dict, steps: int) -> dict:
    """A bill ``{"params", "grads", "optim", "total"}`` with the step counters' bytes as a part of their own,
    the way ``instrument.rank_bytes`` counts a rank."""
    return {**{k: v for k, v in held.items() if k != "total"}, "steps": steps, "total": held["total"] + steps}


# ---------------------------------------------------------------------------------------------
# One run of one strategy
# ---------------------------------------------------------------------------------------------


def fsdp_run(
    strategy: str | Strategy,
    *,
    model: str = "tiny",
    nproc: int,
    node_size: int = 2,
    wrap: str = "block",
    prefetch: str = "default",
    precision: str = "fp32",
) -> dict:
    """Everything the formulas say about one FSDP run before it starts (notebook 04).

    Returns ``{"units", "held", "comm", "peak"}``: the units (``planned_units``, padded for this
    strategy's shard size), bytes held per rank at rest (``strategy_held_bytes``, and Adam's step counter
    for each of the model's tensors, ``step_counter_bytes``), collectives
    per step (``fsdp_collectives``; bf16 gathers under mixed precision) and the peak of
    gathered parameter bytes (``peak_gathered_bytes``). For the one-process reference only ``held``.
    """
    row = get(strategy)
    held = _with_steps(
        strategy_held_bytes(row, param_count(model), nproc, node_size),
        step_counter_bytes(row, tensors=model_tensors(model)),
    )
    if row.single_process:
        return {"units": [], "held": held, "comm": {}, "peak": None}
    units = planned_units(model, wrap, row.shard_group_size(nproc, node_size))
    w = 2 if precision == "mixed" else 4
    return {
        "units": units,
        "held": held,
        "comm": fsdp_collectives(strategy, units, nproc, node_size, param_bytes=w, grad_bytes=4),
        "peak": peak_gathered_bytes(units, w, strategy, prefetch),
    }


def expected_bytes(
    strategy: str | Strategy,
    psi: int,
    nproc: int,
    *,
    node_size: int = 2,
    precision: str = "fp32",
    strategy_info: dict | None = None,
) -> dict:
    """What a run of ``strategy`` should hold per rank and send per step, by the course's formulas (README).

    Returns ``{"held_paper", "held_exact", "sent_paper", "sent_exact", "source"}`` in bytes:
    ``*_paper`` is the paper's formula (Ψ/Nd, no padding); ``*_exact`` the same formula with the
    padding the run really has (from ``strategy_info``: a flat layout's ``shard_numel`` and
    ``units``, FSDP2's ``units``). Held: ``strategy_held_bytes`` in the bill the row keeps
    (``bill_precision``: the fp32 Adam bill, 4 + 4 + 8 bytes/param, for single, DDP and FSDP; the
    run's precision for the hand-built ZeRO stages); sent: ``paper_sent_bytes`` (in the compute
    precision where the row has one), then ``zero_traffic`` or ``fsdp_collectives``.
    """
    row = get(strategy)
    info = strategy_info or {}
    bill = bill_precision(row, precision)
    element = 2 if precision == "mixed" and row.mixed else 4  # DDP all-reduces fp32 gradients whatever
    held = strategy_held_bytes(row, psi, nproc, node_size, precision=bill)["total"]
    sent = paper_sent_bytes(row, psi, nproc, node_size, element)
    out = {"held_paper": held, "held_exact": held, "sent_paper": sent, "sent_exact": sent}
    source = ["strategy_held_bytes", "paper_sent_bytes"]
    if "shard_numel" in info:  # a flat layout: the S padded elements each rank really holds
        nd = row.shard_group_size(nproc, node_size)
        out["held_exact"] = bill_bytes(row, psi, nd, precision=bill, shard_numel=info["shard_numel"])["total"]
        source.append("bill_bytes")
    if info.get("units") and row.layout == "flat":
        rows = zero_traffic(row, nproc, info["units"], precision=bill)
        out["sent_exact"] = sum(r["sent_bytes"] for r in rows.values())
        source.append("zero_traffic")
    elif info.get("units"):
        param_bytes = info.get("compute_bytes_per_element", 4)
        rows = fsdp_collectives(row, info["units"], nproc, node_size, param_bytes=param_bytes, grad_bytes=4)
        out["sent_exact"] = sum(r["sent_bytes"] for r in rows.values())
        source.append("fsdp_collectives")
    out["source"] = ", ".join(source)
    return out


# ---------------------------------------------------------------------------------------------
# A run's report against the predictions
# ---------------------------------------------------------------------------------------------


def peak_check(report: dict) -> dict:
    """A report's measured peak of the update (``HeldAtRest(peak=True)``) against the prediction (notebook 03).

    ``report``: an ``agreement`` row of stage 1 or 2 (``update_peak`` and ``update_extra`` per rank).
    Returns ``{"at_rest"`` (``bill_bytes``, the S padded elements, and the step counters), ``"predicted"``
    (``update_extra_bytes``), ``"predicted_peak"`` (at rest + predicted extra),
    ``"measured_peak"``, ``"measured_extra"`` (rank 0's), ``"within"`` (on every rank: extra at least
    the prediction and at most the prediction plus what gloo may still hold, the peak at rest + extra)}``.
    """
    stage, nd, info = report["strategy"], report["world_size"], report["strategy_info"]
    precision = info.get("precision", "fp32")
    at_rest = _with_steps(
        bill_bytes(stage, info["psi"], nd, precision=precision, shard_numel=info["shard_numel"]),
        step_counter_bytes(stage, info["units"]),
    )
    predicted = update_extra_bytes(stage, info["units"], precision=precision)
    within = all(
        predicted["extra"] <= r["update_extra"] <= predicted["extra"] + predicted["gloo_may_hold"]
        and r["update_peak"] == r["total"] + r["update_extra"]
        for r in report["per_rank"]
    )
    return {
        "stage": stage,
        "precision": precision,
        "nd": nd,
        "at_rest": at_rest["total"],
        "predicted": predicted,
        "predicted_peak": at_rest["total"] + predicted["extra"],
        "measured_peak": report["per_rank"][0]["update_peak"],
        "measured_extra": report["per_rank"][0]["update_extra"],
        "within": within,
    }


def memory_check(report: dict, psi: int | None = None) -> dict:
    """A ZeRO ``train`` report's bytes per rank against ``bill_bytes`` (notebook 03).

    Returns ``{"stage", "precision", "nd", "psi", "padding", "measured"`` (each rank's
    ``{"params", "grads", "optim", "steps", "total"}``), ``"expected"`` (the same, counting the S
    padded elements each rank really holds and Adam's step counters, ``step_counter_bytes``),
    ``"paper"`` (the paper's formula with Ψ/Nd), ``"padding_bytes"`` (expected - paper - steps),
    ``"steps_bytes"`` and ``"equal"`` (every rank holds exactly ``expected``, part by part)}``. A row
    that shards nothing (plain DP) reports fp32 and needs ``psi``; its counters are one per tensor of the
    report's model.
    """
    stage, nd = report["strategy"], report["world_size"]
    info = report.get("strategy_info", {})
    psi = info.get("psi", psi)
    precision = info.get("precision", "fp32")
    shards = bool(get(stage).shards_at_rest)
    steps = step_counter_bytes(
        stage,
        info.get("units"),
        0 if get(stage).layout == "flat" else model_tensors(report["config"]["model"]),
    )
    expected = _with_steps(
        bill_bytes(
            stage,
            psi,
            nd,
            precision=precision,
            shard_numel=info.get("shard_numel", -(-psi // nd) if shards else None),
        ),
        steps,
    )
    paper = bill_bytes(stage, psi, nd, precision=precision)
    measured = [{k: row[k] for k in expected} for row in report["per_rank"]]
    return {
        "stage": stage,
        "precision": precision,
        "nd": nd,
        "psi": psi,
        "padding": info.get("padding", 0),
        "measured": measured,
        "expected": expected,
        "paper": paper,
        "padding_bytes": expected["total"] - paper["total"] - steps,
        "steps_bytes": steps,
        "equal": all(m == expected for m in measured),
    }


def traffic_check(report: dict, psi: int | None = None) -> dict:
    """A ZeRO ``train`` report's counted traffic per rank per step against ``zero_traffic`` (notebook 03).

    Returns ``{"stage", "nd", "measured"`` (rank 0's ``comm_per_step``), ``"expected"``,
    ``"psi_units"`` (bytes sent per rank as Ψ elements of the working dtype), ``"formula_psi"``
    (``comm.step_sent``: 2(Nd-1)/Nd or 3(Nd-1)/Nd times the padded Ψ, over Ψ), ``"equal"``
    (every rank's calls, payload and sent bytes are the expected ones; for DDP only the
    all-reduce bytes are compared, its bucket count being DDP's own business)}``. Plain DP
    needs ``psi``.
    """
    stage, nd = report["strategy"], report["world_size"]
    info = report.get("strategy_info", {})
    psi = info.get("psi", psi)
    precision = info.get("precision", "fp32")
    units = info.get("units") or [{"padded": psi, "trainable": True}]
    expected = zero_traffic(stage, nd, units, precision=precision)
    b = 2 if precision == "mixed" else 4

    def same(rows):
        kinds = set(expected) if get(stage).layout == "whole" else set(rows) | set(expected)
        for kind in kinds:
            got, want = rows.get(kind), expected.get(kind)
            if got is None or want is None:
                return False
            for key in ("calls", "payload_bytes", "sent_bytes"):
                if want[key] is not None and abs(got[key] - want[key]) > 1e-6 * max(1.0, abs(want[key])):
                    return False
        return True

    measured = report["comm_per_step"]
    sent = {k: v for k, v in measured.items() if k in expected}
    padded = sum(u["padded"] for u in units)
    return {
        "stage": stage,
        "nd": nd,
        "measured": measured,
        "expected": expected,
        "psi_units": traffic_in_psi(sent, psi, b),
        "formula_psi": comm.step_sent(get(stage), padded, nd) / psi,
        "equal": all(same(rows) for rows in report["comm_per_step_by_rank"]),
    }


def comm_matches(row: dict, expected: dict) -> bool:
    """True if an FSDP run's collectives are the predicted ones (``fsdp_collectives``): same kinds, calls,
    payload bytes and group sizes, and ring bytes sent equal up to float rounding (notebook 04)."""
    measured = row["comm_per_step"]
    if set(measured) != set(expected):
        return False
    for kind, e in expected.items():
        m = measured[kind]
        if (m["calls"], m["payload_bytes"]) != (e["calls"], e["payload_bytes"]):
            return False
        if abs(m["sent_bytes"] - e["sent_bytes"]) > 1e-9 * max(1.0, e["sent_bytes"]):
            return False
        if "comm_groups" in row and row["comm_groups"].get(kind) != [e["group"]]:
            return False
    return True
