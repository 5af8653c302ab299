"""What a step's memory timeline should show, from a strategy's row and what its mechanism built (notebooks 03, 04).

``timeline.StepTimeline`` measures one step operation by operation; these functions say, before it
runs, what it must find: the bytes at rest by category, and the peak of the model states where the
schedule decides it. They read the row (layout, what is sharded at rest, which collectives run when)
and the units or flat buffers the mechanism reported (``describe()``: ``padded`` elements), never the
strategy's name. fp32 Adam (the timelines' runs): 4 bytes a weight, 4 a gradient, 8 of moments, and
one 4-byte step counter per tensor the optimizer steps.

Exact, to the byte, where no allocator is involved (``timeline``'s docstring says where it is).
"""

from __future__ import annotations

from ..strategies import OPTIM, PARAMS, Strategy, get
from .held import step_counter_bytes

FP32 = 4
TOKEN_BYTES = 8  # int64 token ids


def backend_clones(run: dict) -> bool:
    """Whether a watched run's reduce-scatters cloned their inputs: gloo does (it all-reduces a clone), NCCL does not.
    ``run`` is a row of ``labs.lab03.timelines``, which records the backend it ran on (notebooks 03, 04)."""
    return run.get("backend", "gloo") == "gloo"


def batch_bytes(batch: int, seq: int) -> int:
    """The global batch of tokens each rank makes (inputs and targets are views of one tensor): batch·(seq+1)·8."""
    return batch * (seq + 1) * TOKEN_BYTES


def _owned(row: Strategy, units: list[dict], shard: int) -> int:
    """Elements of weights this rank keeps between steps."""
    padded = sum(u["padded"] for u in units)
    return padded // shard if PARAMS in row.shards_at_rest else padded


def rest_bytes(
    strategy: str | Strategy, units: list[dict], tensors: int, shard: int, *, batch: int, seq: int, losses: int
) -> dict:
    """Bytes a rank holds before a step, by the timeline's categories (notebooks 03, 04).

    ``units``: the flat buffers (the hand-built stages) or units (FSDP2) the mechanism reported, with
    their ``padded`` elements (for a row that shards nothing, one unit of Ψ); ``tensors``: the model's
    parameter tensors; ``shard``: the group one piece of state is split over; ``losses``: the detached
    losses the loop keeps (one 4-byte scalar per step so far).

    - params: the weights this rank keeps (whole, or its 1/shard of every padded buffer or unit);
    - optim: Adam's two moments for what this rank steps (its slice, or every weight) and one step
      counter per tensor it steps (one per flat buffer for the hand-built stages, one per parameter
      tensor otherwise);
    - comm: the all-reduce buckets a bucketed all-reduce keeps between steps (DDP's reducer, with
      ``gradient_as_bucket_view=False``: 4Ψ);
    - activations: the losses kept; data: the batch. Gradients and gathered units: none (the loop
      sets gradients to None, and every unit is resharded after its backward).
    """
    row = get(strategy)
    owned = _owned(row, units, shard)
    stepped = sum(u["padded"] for u in units) // shard if OPTIM in row.shards_at_rest else owned
    counters = step_counter_bytes(row, units, tensors) // FP32
    buckets = any(c.kind == "all_reduce" and c.per == "bucket" and c.of == "grads" for c in row.collectives)
    return {
        "params": FP32 * owned,
        "optim": 2 * FP32 * stepped + FP32 * counters,
        "comm": FP32 * sum(u["padded"] for u in units) if buckets else 0,
        "activations": FP32 * losses,
        "data": batch_bytes(batch, seq),
    }


def forward_end_states(strategy: str | Strategy, units: list[dict], tensors: int, shard: int) -> int:
    """Model states at the end of the forward for a row that keeps every unit gathered until its backward
    (SHARD_GRAD_OP): its shards, Adam's state, every unit gathered, no gradient (notebook 04)."""
    row = get(strategy)
    owned = _owned(row, units, shard)
    stepped = sum(u["padded"] for u in units) // shard if OPTIM in row.shards_at_rest else owned
    counters = step_counter_bytes(row, units, tensors) // FP32
    return FP32 * owned + 2 * FP32 * stepped + FP32 * counters + FP32 * sum(u["padded"] for u in units)


def reduce_at_step_states_peak(units: list[dict], psi: int, shard: int, *, backend_clones: bool = True) -> int:
    """Model states at the peak of a step that reduce-scatters whole flat gradients inside the optimizer's
    step (stage 1, notebook 03): the whole flat weights, the whole gradients (unpadded ``.grad``), the
    contiguous copy sent, the averaged slice received, Adam's state for the slice and, on gloo, the clone
    of the input the reduce-scatter makes (``backend_clones``; none on NCCL):
    4·(P + Ψ + P + P + P/N) + 8·P/N + 4 per buffer, P the padded elements."""
    padded = sum(u["padded"] for u in units)
    clone = padded if backend_clones else 0
    return FP32 * (padded + psi + padded + clone + padded // shard) + 2 * FP32 * (padded // shard) + FP32 * len(units)


def full_gradients_states_peak(rest: dict, psi: int) -> int:
    """Model states at the peak of a row that keeps its whole model and every full gradient until the
    optimizer's step (single, DDP): what it holds at rest (weights, Adam's state, DDP's bucket buffers,
    ``rest_bytes``) plus 4Ψ of ``.grad`` (DDP's copied out of its buckets: ``gradient_as_bucket_view`` is off),
    reached in the backward once the last gradient exists and held into the step (notebook 03)."""
    return sum(rest[k] for k in ("params", "optim", "comm")) + FP32 * psi


def bucket_buffers_peak(units: list[dict], shard: int, *, backend_clones: bool = True) -> dict:
    """The most communication-buffer bytes a rank of the hand-built stage 2 holds at once (notebook 03): its
    largest bucket's flat gradients and the averaged slice it receives (``comm``) and, on gloo, the clone of the
    bucket its reduce-scatter makes (``hidden``; none on NCCL). One bucket in flight at a time: the size is set by
    the bucket cap (or the largest tensor), not by Ψ, which is ZeRO-R's constant-size buffer (C_B)."""
    largest = max(u["padded"] for u in units)
    return {"comm": FP32 * (largest + largest // shard), "hidden": FP32 * largest if backend_clones else 0}


def bucket_reduce_states(
    strategy: str | Strategy, units: list[dict], tensors: int, shard: int, *, backend_clones: bool = True
) -> list[dict]:
    """Model states at each bucket's reduce-scatter in the backward of a row that keeps its weights whole and
    reduce-scatters gradient buckets from hooks as they fill (the hand-built stage 2, notebook 03), in the order the
    buckets complete: ``units`` as the mechanism reported them (filled from the last layer, so the backward completes
    them in that order, the tied embedding's last: its gradient is whole only after both of its uses).

    At bucket k's reduce-scatter a rank holds its whole weights and Adam's state for its slices (as at rest,
    ``rest_bytes``); the averaged slices of the buckets reduced before it (``padded``/N each); bucket k's whole
    ``.grad`` (``numel``: dropped only after the call), the flat contiguous copy sent (``padded``) and the slice
    received (``padded``/N), and on gloo the clone of the copy (``backend_clones``). Returns ``[{"unit", "states"}]``;
    the peak is the largest (``bucket_reduce_states_peak``)."""
    row = get(strategy)
    owned = _owned(row, units, shard)
    stepped = sum(u["padded"] for u in units) // shard if OPTIM in row.shards_at_rest else owned
    base = FP32 * owned + 2 * FP32 * stepped + step_counter_bytes(row, units, tensors)
    out, slices = [], 0
    for unit in units:
        sent = unit["padded"] + unit["padded"] // shard + (unit["padded"] if backend_clones else 0)
        out.append({"unit": unit["name"], "states": base + FP32 * (slices + unit["numel"] + sent)})
        slices += unit["padded"] // shard
    return out


def bucket_reduce_states_peak(strategy: str | Strategy, run: dict) -> dict:
    """The largest of ``bucket_reduce_states`` for a watched run (``labs.lab03.timelines``' row): ``{"unit",
    "states"}`` (notebook 03)."""
    row = get(strategy)
    shard = row.shard_group_size(run["world"], 2)
    clones = backend_clones(run)
    units = run["info"]["units"]
    return max(
        bucket_reduce_states(row, units, run["tensors"], shard, backend_clones=clones), key=lambda s: s["states"]
    )


def bucket_and_gradients_states_peak(rest_states: int, psi: int, bucket_elements: int) -> int:
    """Model states at the end of the backward of DeepSpeed's stages 1 and 2 in fp32 with ``overlap_comm`` off
    (notebook 03): what a rank holds at rest, one reduce bucket of ``reduce_bucket_size`` elements (allocated at the
    backward's first gradient, ``setup_buckets`` in ``runtime/zero/stage_1_and_2.py``, 0.19.8) and every gradient
    once more, 4Ψ (stage 1: the whole ``.grad``; stage 2: the flat copy its reduce sends, the ``.grad`` living in the
    bucket). For a model whose gradients fit in one bucket (Ψ <= ``bucket_elements``)."""
    return rest_states + FP32 * bucket_elements + FP32 * psi


def kept_all_gather_outputs(units: list[dict]) -> int:
    """FSDP2's flat all-gather outputs alive at the last block's copy-out in the forward: the previous
    unit's (kept until this copy-out, ``_fsdp_param_group.py`` in torch 2.13) and this one's; the two
    last blocks, each ``padded`` elements gathered whole (notebook 04)."""
    blocks = [u for u in units if u["name"] != "(root)"]
    return FP32 * sum(u["padded"] for u in blocks[-2:])


def rest_check(strategy: str | Strategy, run: dict) -> dict:
    """A watched run (``labs.lab03.timelines``' row) at rest against ``rest_bytes``: ``predicted``,
    ``measured`` (the same categories), ``equal`` (every one, to the byte) (notebooks 03, 04)."""
    row = get(strategy)
    units = run["info"].get("units") or [{"name": "(root)", "padded": run["psi"]}]  # unsharded: Ψ, one piece
    shard = row.shard_group_size(run["world"], 2) if row.shards_at_rest else 1
    predicted = rest_bytes(
        row, units, run["tensors"], shard, batch=run["batch"], seq=run["seq"], losses=run["watch_step"]
    )
    measured = {k: run["timeline"]["rest"][k] for k in predicted}
    return {"predicted": predicted, "measured": measured, "equal": predicted == measured}


def unit_reduce_states(
    strategy: str | Strategy,
    units: list[dict],
    tensors: int,
    shard: int,
    *,
    tail_grads: int,
    prefetch: int = 0,
    backend_clones: bool = True,
) -> list[dict]:
    """Model states at each unit's gradient reduce-scatter in the backward, in backward order (the blocks last to
    first, the root last), for a row that gathers units and reduces each after its backward (notebooks 03, 04).

    At unit k's reduce-scatter a rank holds its shards and Adam's state (as at rest, ``rest_bytes``); the root
    gathered (every row here keeps or re-gathers it for the whole backward); unit k's gradients in the flat
    contiguous copy sent (``padded``) and the slice received (``padded``/N), and on gloo the clone of the copy
    (``backend_clones``); the gradient slices of the units reduced before it; the gradients of the parameters used
    only after the last block (``tail_grads`` elements: the final norm; the tied head's gradient completes with the
    embedding's, at the end), whole since the backward began. Then the layout decides:

    - "flat" (the course's ``Zero3Module``): the unit is gathered in place and freed only after its reduce, and its
      parameters' whole ``.grad`` (``numel``) live until the copy is reduced;
    - "per_parameter" (FSDP2): ``post_backward`` reshards the unit before ``foreach_reduce`` and drops the unsharded
      gradients once copied (``_fsdp_param_group.py`` in torch 2.13); with ``prefetch`` units ahead, the next
      block's all-gather output is already in flight.

    Returns ``[{"unit", "states"}]``; the peak is the largest (``unit_reduce_states_peak``)."""
    row = get(strategy)
    blocks = [u for u in units if u["name"] != "(root)"]
    root = next((u for u in units if u["name"] == "(root)"), {"numel": 0, "padded": 0})
    order = blocks[::-1] + [root]
    owned = _owned(row, units, shard)
    counters = step_counter_bytes(row, units, tensors) // FP32
    base = FP32 * owned + 2 * FP32 * owned + FP32 * counters
    flat = row.layout == "flat"
    out, slices = [], 0
    for i, unit in enumerate(order):
        is_root = unit is root
        gathered = root["padded"] + (unit["padded"] if flat and not is_root else 0)
        whole_grads = unit["numel"] if flat else 0
        tail = 0 if is_root else tail_grads  # the root's whole gradients include the tail
        ahead = sum(u["padded"] for u in order[i + 1 : i + 1 + prefetch] if u is not root)
        sent = unit["padded"] + unit["padded"] // shard + (unit["padded"] if backend_clones else 0)
        elements = gathered + whole_grads + tail + slices + sent + ahead
        out.append({"unit": unit["name"], "states": base + FP32 * elements})
        slices += unit["padded"] // shard
    return out


def unit_reduce_states_peak(strategy: str | Strategy, run: dict) -> dict:
    """The largest of ``unit_reduce_states`` for a watched run (``labs.lab03.timelines``' row): ``{"unit",
    "states"}``, read from the units the mechanism reported (``info["units"]``) and its backward prefetch
    (``info["prefetch"]``: FSDP2's "default" has one unit in flight, the hand-built stage 3 none) (notebooks 03, 04).
    A shard group of one rank (NO_SHARD) runs no reduce-scatter, so no gloo clone: ``foreach_reduce`` calls the
    collective only when ``world_size > 1`` (``_fsdp_collectives.py:618`` in torch 2.13)."""
    row = get(strategy)
    prefetch = {"default": 1, "none": 0}[run["info"].get("prefetch", "none")]
    shard = row.shard_group_size(run["world"], 2)
    steps = unit_reduce_states(
        row,
        run["info"]["units"],
        run["tensors"],
        shard,
        tail_grads=run["tail_grads"],
        prefetch=prefetch,
        backend_clones=shard > 1 and backend_clones(run),
    )
    return max(steps, key=lambda s: s["states"])
