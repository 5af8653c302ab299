"""What a rank sends per step: the paper's ring formulas and the collectives a run's units issue (notebooks 03, 04).

Each strategy's collectives are its row's (``strategies.Collective``); the ring factors are
``comm.RING_FACTOR``, the ones ``instrument.CommCounter`` counts real runs with.
"""

from __future__ import annotations

from .. import comm
from ..comm import ring_bytes_sent
from ..strategies import PARAMS, Strategy, get
from .held import _check_precision

# ---------------------------------------------------------------------------------------------
# Bytes sent per step
# ---------------------------------------------------------------------------------------------


def paper_sent_bytes(
    strategy: str | Strategy, psi: float, nproc: int, node_size: int = 2, bytes_per_element: int = 4
) -> float:
    """Bytes one rank sends per step by the paper's ring formulas, no padding (README, Benchmarks).

    ``comm.step_sent`` of the row's collectives: 2(N−1)/N·Ψ elements for DDP, stages 1-2, NO_SHARD
    and SHARD_GRAD_OP; 3(N−1)/N·Ψ for stage 3 and FULL_SHARD. HYBRID_SHARD: stage 3 inside a node of
    n ranks plus an all-reduce of the Ψ/n-element shard across the N/n nodes:
    3(n−1)/n·Ψ + 2(N/n−1)/(N/n)·Ψ/n.
    """
    if nproc == 1:
        return 0.0
    return comm.step_sent(get(strategy), psi, nproc, node_size) * bytes_per_element


def zero_traffic(stage: str | Strategy, nd: int, units: list[dict], *, precision: str = "mixed") -> dict:
    """What one rank sends per step, by collective, for a stage built as in ``course_utils.zero`` (notebook 03).

    ``units``: the flat buffers, as in a report's ``strategy_info["units"]`` (each with
    ``padded`` = Nd·S elements and ``trainable``). Returns ``{kind: {"calls", "payload_bytes",
    "sent_bytes"}}``, the same shape as ``CommCounter.summary``, with the same ring model
    (``comm.ring_bytes_sent``: all-gather and reduce-scatter (Nd-1)/Nd of the payload,
    all-reduce 2(Nd-1)/Nd). Each of the row's collectives moves every buffer's gradients or weights
    (every unit's weights when the row gathers unit by unit, frozen ones included), in the compute
    precision or in fp32 as the row says:

    - zero1, zero2: one reduce-scatter of the gradients and one all-gather of the weights per
      buffer: payload Ψ each, sent (Nd-1)/Nd·Ψ each, 2(Nd-1)/Nd·Ψ elements in all, exactly
      plain data parallelism's all-reduce of the gradients (2(Nd-1)/Nd·Ψ).
    - zero3: two all-gathers (forward, backward) and one reduce-scatter per unit: 3(Nd-1)/Nd·Ψ,
      1.5x. Frozen units are gathered but not reduced.
    - ddp: one all-reduce of Ψ gradients in fp32 (``calls`` counts buckets, unknown here: None).

    Ψ here is the padded size (the sum of ``padded``); ``info["padding"]`` says by how much it
    exceeds the parameter count.
    """
    row = get(stage)
    w, g, _ = _check_precision(precision)
    trainable = [u for u in units if u.get("trainable", True)]
    rows: dict = {}
    for c in row.collectives:
        moved = units if c.of == PARAMS and row.gathers_units else trainable
        width = 4 if c.dtype == "fp32" else w if c.of == PARAMS else g
        calls, payload = rows.get(c.kind, (0, 0))
        calls = None if row.layout == "whole" else calls + len(moved)  # DDP's buckets are its own business
        rows[c.kind] = (calls, payload + sum(u["padded"] for u in moved) * width)
    return {
        kind: {"calls": calls, "payload_bytes": float(payload), "sent_bytes": ring_bytes_sent(kind, payload, nd)}
        for kind, (calls, payload) in sorted(rows.items())
    }


def fsdp_collectives(
    strategy: str | Strategy,
    units: list[dict],
    nproc: int,
    node_size: int = 2,
    *,
    param_bytes: int = 4,
    grad_bytes: int = 4,
) -> dict:
    """Collectives one rank issues per step, predicted from the units: ``{kind: {calls, payload_bytes,
    sent_bytes, group}}``, the shape of ``CommCounter.summary`` plus the group size (notebook 04).

    Each of the row's collectives is issued once per unit, over its mesh dimension's group. With U
    units of ``padded`` elements (``unit_table(model, shard_size)``) summing to Ψ':

    - full_shard: 2U - 1 all-gathers (every unit in the forward, every unit but the root again in the
      backward: the row ``keeps_root``, FSDP2's default), 2Ψ' - Ψ'_root of params, U reduce-scatters of
      Ψ' (grads), group N; (3Ψ' - Ψ'_root)(N-1)/N elements sent per rank;
    - shard_grad_op: U all-gathers, U reduce-scatters: 2(N-1)/N·Ψ', as DDP;
    - no_shard: U all-reduces of Ψ' gradients over N ranks: 2(N-1)/N·Ψ';
    - hybrid_shard: full_shard's collectives inside a node (group n), plus U all-reduces of
      the reduce-scattered Ψ'/n elements across the N/n nodes.

    FSDP2 gathers and scatters nothing in a shard group of one; it all-reduces over the replicate
    dimension even in a group of one. ``param_bytes``: bytes per gathered element (2 under bf16
    mixed precision); ``grad_bytes``: per reduced element (4: the reduction stays fp32).
    """
    row = get(strategy)
    shard = row.group_size("shard", nproc, node_size)
    rows: dict = {}
    for c in row.collectives:
        group = row.group_size(c.over, nproc, node_size)
        if c.over == "shard" and group == 1:  # nothing to gather or scatter in a group of one
            continue
        regathers = not (row.keeps_root and c.of == PARAMS and c.when == "backward")
        moved = [r for r in units if regathers or r["name"] != "(root)"]  # the kept root: not gathered again
        psi = sum(r["padded"] for r in moved)
        payload = psi * param_bytes if c.of == PARAMS else (psi // shard if c.of == "grad_shard" else psi) * grad_bytes
        calls, total, _ = rows.get(c.kind, (0, 0, group))
        rows[c.kind] = (calls + len(moved), total + payload, group)
    return {
        kind: {
            "calls": float(calls),
            "payload_bytes": float(payload),
            "sent_bytes": ring_bytes_sent(kind, payload, group),
            "group": group,
        }
        for kind, (calls, payload, group) in sorted(rows.items())
    }


def traffic_in_psi(comm_rows: dict, psi: int, bytes_per_element: int) -> float:
    """Total sent bytes of a ``comm_per_step`` row set, in units of Ψ elements (notebook 03)."""
    return sum(row["sent_bytes"] for row in comm_rows.values()) / bytes_per_element / psi
