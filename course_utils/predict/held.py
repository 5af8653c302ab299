"""What a rank holds: a strategy's bill at rest, the peak of gathered parameters, the update's peak (notebooks 03, 04).

Read from each strategy's row of the record (what it shards, over which group, its layout, how it
reshards), never from its name.
"""

from __future__ import annotations

from ..errors import CourseInputError
from ..memory.bill import OPTIMIZERS, model_state_bytes
from ..strategies import GRADS, OPTIM, PARAMS, RECORD, ZERO3, Strategy, get

#: Bytes per element of (working weights, gradients, optimizer state K) in each precision, from
#: ``memory.OPTIMIZERS``: mixed = the paper's bf16/fp16 weights and gradients + fp32 master,
#: momentum, variance (2, 2, 12); fp32 = fp32 weights and gradients + Adam's fp32 momentum and
#: variance, no master copy needed (4, 4, 8).
PRECISION_BYTES = {
    p: (OPTIMIZERS[name].weight_bytes, OPTIMIZERS[name].grad_bytes, OPTIMIZERS[name].k)
    for p, name in (("mixed", "adam_mixed"), ("fp32", "adam_fp32"))
}


def _check_precision(precision: str) -> tuple:
    if precision not in PRECISION_BYTES:
        raise CourseInputError(f"precision must be 'mixed' or 'fp32', got {precision!r}")
    return PRECISION_BYTES[precision]


def bill_precision(strategy: Strategy, precision: str) -> str:
    """The bill a run of ``strategy`` in ``precision`` keeps: "mixed" (2 + 2 + 12) only where the row's
    mixed precision is the paper's (the hand-built stages); FSDP2 keeps fp32 shards, gradients and moments
    whatever the compute precision, DDP trains in fp32: "fp32" (4 + 4 + 8) (notebook 03)."""
    _check_precision(precision)
    return "mixed" if precision == "mixed" and strategy.mixed == "paper" else "fp32"


# ---------------------------------------------------------------------------------------------
# Bytes held per rank
# ---------------------------------------------------------------------------------------------


def bill_bytes(
    strategy: str | Strategy, psi: int, nd: int, *, precision: str = "mixed", shard_numel: int | None = None
) -> dict:
    """Bytes of params, grads and optimizer state one rank holds at rest, by the paper's formulas (notebook 03).

    ``strategy``: a row of the record (or its name); what it shards is its ``shards_at_rest``. With
    ``shard_numel`` = S (the elements of this rank's slices, padding included) the sharded parts
    count S elements, which is what the real tensors hold; without it they count Ψ/Nd, which is
    the paper's formula:

    ========  ======================  ======================
    stage     mixed (2, 2, K = 12)    fp32 (4, 4, K = 8)
    ========  ======================  ======================
    zero1     4Ψ + 12Ψ/Nd             8Ψ + 8Ψ/Nd
    zero2     2Ψ + 14Ψ/Nd             4Ψ + 12Ψ/Nd
    zero3     16Ψ/Nd                  16Ψ/Nd
    ========  ======================  ======================

    Returns ``{"params", "grads", "optim", "total"}`` in bytes (floats without ``shard_numel``).
    """
    sharded = get(strategy).shards_at_rest
    w, g, k = _check_precision(precision)
    per_rank = psi / nd if shard_numel is None else shard_numel
    row = {}
    for part, b in ((PARAMS, w), (GRADS, g), (OPTIM, k)):
        row[part] = b * (per_rank if part in sharded else psi)
    row["total"] = row["params"] + row["grads"] + row["optim"]
    return row


def step_counter_bytes(strategy: str | Strategy, units: list[dict] | None = None, tensors: int = 0) -> int:
    """Bytes of the optimizer's 0-dim step counters one rank holds at rest: Adam keeps one 4-byte counter per
    tensor it steps, which no formula of the paper counts (notebooks 03, 04, 05b).

    A flat layout (the hand-built stages) steps one flat buffer per trainable unit of ``units``; every other
    row steps each of the model's ``tensors`` parameter tensors (FSDP2 a DTensor each, DDP the tensor itself).
    """
    row = get(strategy)
    if row.layout == "flat":
        return 4 * sum(1 for u in units or () if u.get("trainable", True))
    return 4 * tensors


def strategy_held_bytes(
    strategy: str | Strategy, psi: int, nproc: int, node_size: int = 2, *, precision: str = "fp32"
) -> dict:
    """Bytes of parameters, gradients and Adam state one rank of ``strategy`` holds at rest (notebook 04).

    ``bill_bytes`` of the row with Nd = its shard group for N = ``nproc`` ranks in nodes of
    ``node_size``, in the bill it keeps (``bill_precision``): single, ddp, no_shard: the plain-DP
    row, 16Ψ; full_shard, hybrid_shard: stage 3, 16Ψ/Nd (Nd = N, or n ranks per node);
    shard_grad_op: stage 3's bytes at rest as well (FSDP2 reshards after backward), stage 2's extra
    whole weights appear only during the step (``peak_gathered_bytes``). FSDP2 keeps fp32
    parameters, gradients and Adam moments whatever the compute precision (bf16 is only the
    gathered working copy): the fp32 bill, 4 + 4 + 8.

    Exact per rank when every parameter's dim 0 divides by Nd; otherwise the ranks' sum is exact
    (FSDP2's local shards exclude the padding).
    """
    row = get(strategy)
    nd = row.shard_group_size(nproc, node_size)
    return bill_bytes(row, psi, nd, precision=bill_precision(row, precision))


# ---------------------------------------------------------------------------------------------
# Peaks during a step
# ---------------------------------------------------------------------------------------------


def peak_gathered_bytes(
    units: list[dict], bytes_per_element: int, strategy: str | Strategy = ZERO3, prefetch: str = "none"
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

    ``units``: unit rows in forward order, the root named "(root)". A flat layout (ZeRO-3 by
    hand) gathers its padded buffers (``padded``); FSDP2's unsharded parameters exclude the padding
    (``numel``).
    """
    row = get(strategy)
    if not row.gathers_units:
        gathering = ", ".join(s.name for s in RECORD.values() if s.gathers_units and s.runnable)
        raise CourseInputError(f"{row.name!r} gathers no parameters; choose one of {gathering}")
    size = "numel" if row.layout == "per_parameter" else "padded"
    root = sum(u[size] for u in units if u["name"] == "(root)")
    others = [u[size] for u in units if u["name"] != "(root)"]
    if row.reshard_after_forward is False or not others:
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
# A run's report against the predictions
# ---------------------------------------------------------------------------------------------

#: Adam's scratch while it updates one slice of S fp32 elements: ``exp_avg_sq.sqrt()`` and that divided by the
#: bias correction are alive together (torch 2.13, ``torch.optim.adam._single_tensor_adam``, ``foreach=False``).
ADAM_SCRATCH_FP32_COPIES = 2


def update_extra_bytes(stage: str | Strategy, units: list[dict], *, precision: str = "mixed") -> dict:
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
    row = get(stage)
    if row.layout != "flat" or row.gathers_units:  # stage 3's peak is its gathered units (peak_gathered_bytes)
        raise CourseInputError(f"the update's peak is predicted for the hand-built stages 1 and 2, not {row.name!r}")
    g = _check_precision(precision)[1]
    c = 4 if precision == "mixed" else 0
    flats = [u for u in units if u.get("trainable", True)]
    slices = [u["shard_numel"] for u in flats]
    reduce_scatter, update, lingering = 0, 0, 0
    if row.sends(GRADS)[0].when == "step":  # stage 1 reduces at the step, not during the backward
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
