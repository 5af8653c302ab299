"""What each strategy should hold and send: the course's predictions, in one place (notebooks 03, 04; README).

Every run the course makes is held against a number computed here before it starts. Symbols
follow the ZeRO paper: Ψ parameters, Nd ranks one piece of state is split across (the record's
``strategies.shard_group_size``), K optimizer bytes per parameter.

- Bytes held per rank: ``held_bytes`` (one row of the ZeRO table, part by part, optionally with
  the padded shard a run really has) and ``strategy_held_bytes`` (the same for a strategy name:
  its row at rest and its Nd come from the strategy record). ``memory.model_state_bytes`` is the
  vectorised total notebook 01 plots; ``tests/test_predict.py`` checks the two agree.
- Bytes sent per step: ``paper_sent_bytes`` (the paper's ring formulas, ``comm.step_sent``, no
  padding); ``zero_traffic`` and ``fsdp_collectives`` (collective by collective, from the flat
  buffers or units a run builds, in the ring model that ``instrument.CommCounter`` counts with).
- Peaks: ``peak_gathered_bytes`` (the working set of gathered parameters: ZeRO-3 by hand and
  FSDP2's schedules); ``samples_that_fit`` (what the freed memory buys).
- Units: ``planned_units`` (``unit_table`` of the course model before a process starts).
- One run, one strategy: ``fsdp_run`` (notebook 04's prediction), ``expected_bytes`` (the
  benchmark's theory table).
- Checks: ``memory_check``, ``traffic_check`` (a ZeRO report against the formulas, notebook 03)
  and ``comm_matches`` (an FSDP run's collectives against ``fsdp_collectives``, notebook 04).

Pure arithmetic: no ``torch.distributed``, no processes (``tests/test_layers.py`` checks). The
strategy modules (``zero``, ``fsdp``) hold the mechanism; they report what they built
(``strategy_info``) and these functions say what that should cost.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import comm
from .errors import CourseInputError
from .instrument import ring_bytes_sent
from .memory import OPTIMIZERS, model_state_bytes
from .models import get_config, param_count, unit_modules
from .strategies import FSDP_STRATEGIES, STRATEGIES, get, shard_group_size

#: Bytes per element of (working weights, gradients, optimizer state K) in each precision, from
#: ``memory.OPTIMIZERS``: mixed = the paper's bf16/fp16 weights and gradients + fp32 master,
#: momentum, variance (2, 2, 12); fp32 = fp32 weights and gradients + Adam's fp32 momentum and
#: variance, no master copy needed (4, 4, 8).
PRECISION_BYTES = {
    p: (OPTIMIZERS[name].weight_bytes, OPTIMIZERS[name].grad_bytes, OPTIMIZERS[name].k)
    for p, name in (("mixed", "adam_mixed"), ("fp32", "adam_fp32"))
}

#: Which parts each row of the ZeRO table shards (the rest every rank keeps whole).
SHARDED_PARTS = {"ddp": (), "zero1": ("optim",), "zero2": ("optim", "grads"), "zero3": ("optim", "grads", "params")}


def _check_precision(precision: str) -> tuple:
    if precision not in PRECISION_BYTES:
        raise CourseInputError(f"precision must be 'mixed' or 'fp32', got {precision!r}")
    return PRECISION_BYTES[precision]


# ---------------------------------------------------------------------------------------------
# Bytes held per rank
# ---------------------------------------------------------------------------------------------


def held_bytes(stage: str, psi: int, nd: int, *, precision: str = "mixed", shard_numel: int | None = None) -> dict:
    """Bytes of params, grads and optimizer state one rank holds, by the paper's formulas (notebook 03).

    ``stage``: a row of the ZeRO table ("ddp", "zero1", "zero2", "zero3"). With ``shard_numel``
    = S (the elements of this rank's slices, padding included) the sharded parts count S
    elements, which is what the real tensors hold; without it they count Ψ/Nd, which is the
    paper's formula:

    ========  ======================  ======================
    stage     mixed (2, 2, K = 12)    fp32 (4, 4, K = 8)
    ========  ======================  ======================
    zero1     4Ψ + 12Ψ/Nd             8Ψ + 8Ψ/Nd
    zero2     2Ψ + 14Ψ/Nd             4Ψ + 12Ψ/Nd
    zero3     16Ψ/Nd                  16Ψ/Nd
    ========  ======================  ======================

    Returns ``{"params", "grads", "optim", "total"}`` in bytes (floats without ``shard_numel``).
    """
    if stage not in SHARDED_PARTS:
        raise CourseInputError(f"unknown stage {stage!r}; choose one of {', '.join(SHARDED_PARTS)}")
    w, g, k = _check_precision(precision)
    per_rank = psi / nd if shard_numel is None else shard_numel
    row = {}
    for part, b in (("params", w), ("grads", g), ("optim", k)):
        row[part] = b * (per_rank if part in SHARDED_PARTS[stage] else psi)
    row["total"] = row["params"] + row["grads"] + row["optim"]
    return row


def strategy_held_bytes(strategy: str, psi: int, nproc: int, node_size: int = 2, *, precision: str = "fp32") -> dict:
    """Bytes of parameters, gradients and Adam state one rank of ``strategy`` holds at rest (notebook 04).

    ``held_bytes`` of the record's ``zero_row_at_rest`` with Nd = ``strategies.shard_group_size``:
    single, ddp, no_shard: the plain-DP row, 16Ψ; full_shard, hybrid_shard: stage 3, 16Ψ/Nd
    (Nd = N, or n ranks per node); shard_grad_op: stage 3's bytes at rest as well (FSDP2
    reshards after backward), stage 2's extra whole weights appear only during the step
    (``peak_gathered_bytes``). FSDP2 keeps fp32 parameters, gradients and Adam moments whatever
    the compute precision (bf16 is only the gathered working copy): the fp32 bill, 4 + 4 + 8.

    Exact per rank when every parameter's dim 0 divides by Nd; otherwise the ranks' sum is exact
    (FSDP2's local shards exclude the padding).
    """
    nd = shard_group_size(strategy, nproc, node_size)
    return held_bytes(get(strategy).zero_row_at_rest, psi, nd, precision=precision)


# ---------------------------------------------------------------------------------------------
# Bytes sent per step
# ---------------------------------------------------------------------------------------------


def paper_sent_bytes(strategy: str, psi: float, nproc: int, node_size: int = 2, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step by the paper's ring formulas, no padding (README, Benchmarks).

    ``comm.step_sent`` of the record's ``zero_row_at_peak``: 2(N−1)/N·Ψ elements for DDP, stages
    1-2, NO_SHARD and SHARD_GRAD_OP; 3(N−1)/N·Ψ for stage 3 and FULL_SHARD. HYBRID_SHARD: stage 3
    inside a node of n ranks plus an all-reduce of the Ψ/n-element shard across the N/n nodes:
    3(n−1)/n·Ψ + 2(N/n−1)/(N/n)·Ψ/n.
    """
    if strategy == "single" or nproc == 1:
        return 0.0
    if strategy == "hybrid_shard":
        nodes = nproc // node_size
        elements = comm.step_sent("zero3", psi, node_size) if node_size > 1 else 0.0
        if nodes > 1:
            elements += comm.all_reduce_sent(psi / node_size, nodes)
        return elements * bytes_per_element
    if strategy not in STRATEGIES:
        raise CourseInputError(f"no traffic formula for strategy {strategy!r}")
    return comm.step_sent(STRATEGIES[strategy].zero_row_at_peak, psi, nproc) * bytes_per_element


def zero_traffic(stage: str, nd: int, units: list[dict], *, precision: str = "mixed") -> dict:
    """What one rank sends per step, by collective, for a stage built as in ``course_utils.zero`` (notebook 03).

    ``units``: the flat buffers, as in a report's ``strategy_info["units"]`` (each with
    ``padded`` = Nd·S elements and ``trainable``). Returns ``{kind: {"calls", "payload_bytes",
    "sent_bytes"}}``, the same shape as ``CommCounter.summary``, with the same ring model
    (``instrument.ring_bytes_sent``: all-gather and reduce-scatter (Nd-1)/Nd of the payload,
    all-reduce 2(Nd-1)/Nd):

    - zero1, zero2: one reduce-scatter of the gradients and one all-gather of the weights per
      buffer: payload Ψ each, sent (Nd-1)/Nd·Ψ each, 2(Nd-1)/Nd·Ψ elements in all, exactly
      plain data parallelism's all-reduce of the gradients (2(Nd-1)/Nd·Ψ).
    - zero3: two all-gathers (forward, backward) and one reduce-scatter per unit: 3(Nd-1)/Nd·Ψ,
      1.5x. Frozen units are gathered but not reduced.
    - ddp: one all-reduce of Ψ gradients in fp32 (``calls`` counts buckets, unknown here: None).

    Ψ here is the padded size (the sum of ``padded``); ``info["padding"]`` says by how much it
    exceeds the parameter count.
    """
    w, g, _ = _check_precision(precision)
    trainable = sum(u["padded"] for u in units if u.get("trainable", True))
    everything = sum(u["padded"] for u in units)
    n_train = sum(1 for u in units if u.get("trainable", True))
    if stage == "ddp":
        rows = {"all_reduce": (None, trainable * g)}
    elif stage in ("zero1", "zero2"):
        rows = {"all_gather": (n_train, trainable * w), "reduce_scatter": (n_train, trainable * g)}
    elif stage == "zero3":
        rows = {"all_gather": (2 * len(units), 2 * everything * w), "reduce_scatter": (n_train, trainable * g)}
    else:
        raise CourseInputError(f"unknown stage {stage!r}; choose ddp, zero1, zero2 or zero3")
    return {
        kind: {"calls": calls, "payload_bytes": float(payload), "sent_bytes": ring_bytes_sent(kind, payload, nd)}
        for kind, (calls, payload) in sorted(rows.items())
    }


def fsdp_collectives(
    strategy: str, units: list[dict], nproc: int, node_size: int = 2, *, param_bytes: int = 4, grad_bytes: int = 4
) -> dict:
    """Collectives one rank issues per step, predicted from the units: ``{kind: {calls, payload_bytes,
    sent_bytes, group}}``, the shape of ``CommCounter.summary`` plus the group size (notebook 04).

    With U units of ``padded`` elements (``unit_table(model, shard_size)``) summing to Ψ':

    - full_shard: 2U all-gathers of Ψ' (params), U reduce-scatters of Ψ' (grads), group N;
      3(N-1)/N·Ψ' elements sent per rank;
    - shard_grad_op: U all-gathers, U reduce-scatters: 2(N-1)/N·Ψ', as DDP;
    - no_shard: U all-reduces of Ψ' gradients over N ranks: 2(N-1)/N·Ψ';
    - hybrid_shard: full_shard's collectives inside a node (group n), plus U all-reduces of
      the reduce-scattered Ψ'/n elements across the N/n nodes.

    ``param_bytes``: bytes per gathered element (2 under bf16 mixed precision); ``grad_bytes``:
    per reduced element (4: the reduction stays fp32).
    """
    u = len(units)
    psi = sum(r["padded"] for r in units)
    n = node_size if strategy == "hybrid_shard" else nproc
    rows = {}
    if strategy in ("full_shard", "hybrid_shard", "shard_grad_op"):
        gathers = 2 if strategy != "shard_grad_op" else 1
        rows["all_gather"] = (gathers * u, gathers * psi * param_bytes, n)
        rows["reduce_scatter"] = (u, psi * grad_bytes, n)
        if strategy == "hybrid_shard":  # FSDP2 all-reduces over the replicate dimension, even a group of one
            rows["all_reduce"] = (u, psi // n * grad_bytes, nproc // node_size)
    elif strategy == "no_shard":
        rows["all_reduce"] = (u, psi * grad_bytes, nproc)
    else:
        raise CourseInputError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(FSDP_STRATEGIES)}")
    if n == 1:  # nothing to gather or scatter in a group of one
        rows.pop("all_gather", None)
        rows.pop("reduce_scatter", None)
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


# ---------------------------------------------------------------------------------------------
# Peaks during a step
# ---------------------------------------------------------------------------------------------


def peak_gathered_bytes(
    units: list[dict], bytes_per_element: int, strategy: str = "zero3", prefetch: str = "none"
) -> int:
    """The peak of gathered (full-size) parameter bytes a schedule predicts, from the unit sizes (notebooks 03, 04).

    The root unit (embeddings, final norm, the head tied to the token embedding) is gathered
    through the whole forward and again through the whole backward. Strategies that keep every
    unit gathered from its forward to its backward (``reshard_after_forward`` False in the
    record: shard_grad_op, no_shard) hold the whole model at the end of the forward. The others
    hold the root plus the unit computing plus the unit being prefetched, its neighbour in
    execution order (FSDP2 prefetches one unit ahead in backward by default: ``prefetch``
    "default"; "explicit" also in forward; "none", and ZeRO-3 by hand, never): root + the
    largest pair of neighbouring units, or root + the largest unit without prefetching.

    ``units``: unit rows in forward order, the root named "(root)". Hand-built ZeRO-3 gathers
    its padded flat buffers (``padded``); FSDP2's unsharded parameters exclude the padding
    (``numel``).
    """
    record = get(strategy)
    if not record.is_fsdp and strategy != "zero3":
        raise CourseInputError(
            f"{strategy!r} gathers no parameters; choose zero3 or one of {', '.join(FSDP_STRATEGIES)}"
        )
    size = "numel" if record.is_fsdp else "padded"
    root = sum(u[size] for u in units if u["name"] == "(root)")
    others = [u[size] for u in units if u["name"] != "(root)"]
    if record.reshard_after_forward is False or not others:
        working = sum(others)
    elif prefetch == "none" or len(others) == 1:
        working = max(others)
    else:
        working = max(a + b for a, b in zip(others, others[1:]))
    return (root + working) * bytes_per_element


def samples_that_fit(
    psi, nd, stage: str, gpu_mem: float, activation_bytes_per_sample: float, *, k: float = 12, nm: int = 1
) -> int:
    """Samples per GPU whose activations fit beside the model states: why freed memory buys batch (notebook 03).

    ``floor((gpu_mem - model_state_bytes(Ψ, Nd, stage)) / activation bytes per sample)``, 0 when
    the model states alone do not fit. As Nd grows, stages 1-3 free model-state memory, so each
    GPU fits more samples: the global batch Nd·b grows faster than Nd (the paper's §10.3).
    """
    if activation_bytes_per_sample <= 0:
        raise CourseInputError("activation bytes per sample must be positive")
    free = gpu_mem - model_state_bytes(psi, nd, stage, k=k, nm=nm)
    return max(0, int(free // activation_bytes_per_sample))


# ---------------------------------------------------------------------------------------------
# Units: what a run will gather, counted before any process starts
# ---------------------------------------------------------------------------------------------


def unit_table(model: nn.Module, shard_size: int, units: list[nn.Module]) -> list[dict]:
    """Each unit's parameters: ``[{"name", "numel", "padded"}]`` in forward order, the root last (notebook 04).

    ``units``: the unit modules below the root (``models.unit_modules``, the modules
    ``fsdp.shard_model`` wraps). A unit owns the parameters of its subtree that no other unit
    owns (a tied weight counts once). ``padded``: FSDP2 pads dim 0 of every parameter to a
    multiple of the shard size before splitting it, so an all-gather moves ``padded`` elements.
    """
    names = {id(m): n for n, m in model.named_modules()}
    seen, rows = set(), []
    for module in [*units, model]:  # units do not nest; whatever they leave belongs to the root
        numel = padded = 0
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            dim0 = p.shape[0] if p.dim() else 1
            numel += p.numel()
            padded += -(-dim0 // shard_size) * shard_size * (p.numel() // max(dim0, 1))
        rows.append({"name": names[id(module)] or "(root)", "numel": numel, "padded": padded})
    return rows


def _meta_model(model: str) -> nn.Module:
    """The course model's structure, for counting (a CPU build: milliseconds, where the first
    meta-device build costs seconds of lazy imports); the global RNG is left as it was."""
    from .models import GPT

    with torch.random.fork_rng(devices=[]):
        return GPT(get_config(model))


def planned_units(model: str = "tiny", granularity: str = "block", shard_size: int = 1) -> list[dict]:
    """``unit_table`` of the course model before any process starts: what a run will gather (notebook 04)."""
    gpt = _meta_model(model)
    return unit_table(gpt, shard_size, unit_modules(gpt, granularity))


# ---------------------------------------------------------------------------------------------
# One run of one strategy
# ---------------------------------------------------------------------------------------------


def fsdp_run(
    strategy: str,
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
    strategy's shard size), bytes held per rank at rest (``strategy_held_bytes``), collectives
    per step (``fsdp_collectives``; bf16 gathers under mixed precision) and the peak of
    gathered parameter bytes (``peak_gathered_bytes``). For "single" only ``held``.
    """
    held = strategy_held_bytes(strategy, param_count(model), nproc, node_size)
    if strategy == "single":
        return {"units": [], "held": held, "comm": {}, "peak": None}
    units = planned_units(model, wrap, shard_group_size(strategy, nproc, node_size))
    w = 2 if precision == "mixed" else 4
    return {
        "units": units,
        "held": held,
        "comm": fsdp_collectives(strategy, units, nproc, node_size, param_bytes=w, grad_bytes=4),
        "peak": peak_gathered_bytes(units, w, strategy, prefetch),
    }


def expected_bytes(
    strategy: str,
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
    padding the run really has (from ``strategy_info``: ZeRO's ``shard_numel`` and ``units``,
    FSDP's ``units``). Held: ``strategy_held_bytes`` (the fp32 Adam bill, 4 + 4 + 8 bytes/param,
    for single, DDP and FSDP; the run's precision for the ZeRO stages); sent:
    ``paper_sent_bytes``, ``zero_traffic``, ``fsdp_collectives``.
    """
    info = strategy_info or {}
    sent_paper = paper_sent_bytes(strategy, psi, nproc, node_size, 4 if precision == "fp32" else 2)
    if strategy in ("single", "ddp", "ddp_scratch"):
        held = strategy_held_bytes(strategy, psi, nproc, node_size)["total"]
        if strategy != "single":  # DDP all-reduces fp32 gradients whatever the compute precision
            sent_paper = paper_sent_bytes(strategy, psi, nproc, node_size, 4)
        return {
            "held_paper": held,
            "held_exact": held,
            "sent_paper": sent_paper,
            "sent_exact": sent_paper,
            "source": "strategy_held_bytes (fp32 Adam bill), paper_sent_bytes",
        }
    if strategy in ("zero1", "zero2", "zero3"):
        paper = strategy_held_bytes(strategy, psi, nproc, node_size, precision=precision)["total"]
        exact = paper
        if "shard_numel" in info:
            exact = held_bytes(strategy, psi, nproc, precision=precision, shard_numel=info["shard_numel"])["total"]
        sent_exact = sent_paper
        if info.get("units"):
            sent_exact = sum(
                r["sent_bytes"] for r in zero_traffic(strategy, nproc, info["units"], precision=precision).values()
            )
        return {
            "held_paper": paper,
            "held_exact": exact,
            "sent_paper": sent_paper,
            "sent_exact": sent_exact,
            "source": "held_bytes, zero_traffic",
        }
    if strategy not in FSDP_STRATEGIES:
        raise CourseInputError(f"no formula for strategy {strategy!r}")
    held = strategy_held_bytes(strategy, psi, nproc, node_size)["total"]
    sent_exact = sent_paper
    if info.get("units"):
        param_bytes = info.get("compute_bytes_per_element", 4)
        sent_exact = sum(
            r["sent_bytes"]
            for r in fsdp_collectives(
                strategy, info["units"], nproc, node_size, param_bytes=param_bytes, grad_bytes=4
            ).values()
        )
    return {
        "held_paper": held,
        "held_exact": held,
        "sent_paper": sent_paper,
        "sent_exact": sent_exact,
        "source": "strategy_held_bytes, fsdp_collectives",
    }


# ---------------------------------------------------------------------------------------------
# A run's report against the predictions
# ---------------------------------------------------------------------------------------------

#: Adam's scratch while it updates one slice of S fp32 elements: ``exp_avg_sq.sqrt()`` and that divided by the
#: bias correction are alive together (torch 2.13, ``torch.optim.adam._single_tensor_adam``, ``foreach=False``).
ADAM_SCRATCH_FP32_COPIES = 2


def update_extra_bytes(stage: str, units: list[dict], *, precision: str = "mixed") -> dict:
    """The most bytes the update of a step holds above what stage 1 or 2 held when it began (notebook 03).

    The stages' ``step()`` read as a list of the tensors it creates, moment by moment, from the flat
    buffers' sizes (``units``: a report's ``strategy_info["units"]``, each with ``padded`` = Nd·S,
    ``shard_numel`` = S, ``padding``; only trainable ones are updated). g = bytes of a 16-bit or fp32
    gradient element, c = 4 when an fp32 copy of the gradient slice is made for the fp32 master
    (mixed precision), else 0:

    - stage 1 reduces at the step, buffer after buffer: while buffer f is reduce-scattered the rank
      holds the slices already reduced, its output slice (g·S), the contiguous copy of the full
      gradients it sends (g·Nd·S) and the padding zeros appended to it (g·padding).
    - then: the reduced slices (g·ΣS; stage 2 already held them when the update began), their fp32
      copies (c·ΣS), and Adam's scratch for the slice it is updating (``ADAM_SCRATCH_FP32_COPIES`` x 4
      bytes x S, the largest S being the peak).
    - stages 1 and 2 all-gather into the working buffer they already hold: nothing new.

    Returns ``{"reduce_scatter", "update", "extra"}`` (bytes at each moment's peak, and their max),
    and ``"gloo_may_hold"``: g·Nd·S of stage 1's largest buffer, the copy a gloo worker thread may still
    hold for a moment after the collective returned (gloo runs the work on its own thread, which lets go of
    it a moment after the caller has resumed: measured alive right after the call on some runs, freed 50 ms
    later), so a measurement may read up to that much more.
    """
    if stage not in ("zero1", "zero2"):  # stage 3's peak is its gathered units (peak_gathered_bytes)
        raise CourseInputError(f"the update's peak is predicted for zero1 and zero2, not {stage!r}")
    g = _check_precision(precision)[1]
    c = 4 if precision == "mixed" else 0
    flats = [u for u in units if u.get("trainable", True)]
    slices = [u["shard_numel"] for u in flats]
    reduce_scatter, update, lingering = 0, 0, 0
    if stage == "zero1":
        done = 0
        for u in flats:
            reduce_scatter = max(reduce_scatter, done + g * (u["shard_numel"] + u["padded"] + u["padding"]))
            done += g * u["shard_numel"]
        update = done
        lingering = g * max(u["padded"] for u in flats)
    update += c * sum(slices) + ADAM_SCRATCH_FP32_COPIES * 4 * max(slices)
    return {
        "reduce_scatter": reduce_scatter,
        "update": update,
        "extra": max(reduce_scatter, update),
        "gloo_may_hold": lingering,
    }


def peak_check(report: dict) -> dict:
    """A report's measured peak of the update (``HeldAtRest(peak=True)``) against the prediction (notebook 03).

    ``report``: an ``agreement`` row of stage 1 or 2 (``update_peak`` and ``update_extra`` per rank).
    Returns ``{"at_rest"`` (``held_bytes``, the S padded elements), ``"predicted"``
    (``update_extra_bytes``), ``"predicted_peak"`` (at rest + predicted extra),
    ``"measured_peak"``, ``"measured_extra"`` (rank 0's), ``"within"`` (on every rank: extra at least
    the prediction and at most the prediction plus what gloo may still hold, the peak at rest + extra)}``.
    """
    stage, nd, info = report["strategy"], report["world_size"], report["strategy_info"]
    precision = info.get("precision", "fp32")
    at_rest = held_bytes(stage, info["psi"], nd, precision=precision, shard_numel=info["shard_numel"])
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
    """A ZeRO ``train`` report's bytes per rank against ``held_bytes`` (notebook 03).

    Returns ``{"stage", "precision", "nd", "psi", "padding", "measured"`` (each rank's
    ``{"params", "grads", "optim", "total"}``), ``"expected"`` (the same, counting the S
    padded elements each rank really holds), ``"paper"`` (the paper's formula with Ψ/Nd),
    ``"padding_bytes"`` (expected - paper) and ``"equal"`` (every rank holds exactly
    ``expected``, part by part)}``. Plain DP (``ddp``) reports fp32 and needs ``psi``.
    """
    stage, nd = report["strategy"], report["world_size"]
    info = report.get("strategy_info", {})
    psi = info.get("psi", psi)
    precision = info.get("precision", "fp32")
    expected = held_bytes(
        stage,
        psi,
        nd,
        precision=precision,
        shard_numel=info.get("shard_numel", -(-psi // nd) if stage != "ddp" else None),
    )
    paper = held_bytes(stage, psi, nd, precision=precision)
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
        "padding_bytes": expected["total"] - paper["total"],
        "equal": all(m == expected for m in measured),
    }


def traffic_check(report: dict, psi: int | None = None) -> dict:
    """A ZeRO ``train`` report's counted traffic per rank per step against ``zero_traffic`` (notebook 03).

    Returns ``{"stage", "nd", "measured"`` (rank 0's ``comm_per_step``), ``"expected"``,
    ``"psi_units"`` (bytes sent per rank as Ψ elements of the working dtype), ``"formula_psi"``
    (``comm.step_sent``: 2(Nd-1)/Nd or 3(Nd-1)/Nd times the padded Ψ, over Ψ), ``"equal"``
    (every rank's calls, payload and sent bytes are the expected ones; for DDP only the
    all-reduce bytes are compared, its bucket count being DDP's own business)}``. Plain DP
    (``ddp``) needs ``psi``.
    """
    stage, nd = report["strategy"], report["world_size"]
    info = report.get("strategy_info", {})
    psi = info.get("psi", psi)
    precision = info.get("precision", "fp32")
    units = info.get("units") or [{"padded": psi, "trainable": True}]
    expected = zero_traffic(stage, nd, units, precision=precision)
    b = 2 if precision == "mixed" else 4

    def same(rows):
        kinds = set(expected) if stage == "ddp" else set(rows) | set(expected)
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
        "formula_psi": comm.step_sent(stage, padded, nd) / psi,
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


__all__ = [
    "update_extra_bytes",
    "peak_check",
    "ADAM_SCRATCH_FP32_COPIES",
    "PRECISION_BYTES",
    "SHARDED_PARTS",
    "held_bytes",
    "strategy_held_bytes",
    "paper_sent_bytes",
    "zero_traffic",
    "fsdp_collectives",
    "traffic_in_psi",
    "peak_gathered_bytes",
    "samples_that_fit",
    "unit_table",
    "planned_units",
    "fsdp_run",
    "expected_bytes",
    "memory_check",
    "traffic_check",
    "comm_matches",
]
