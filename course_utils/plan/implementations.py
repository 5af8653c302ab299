"""What the throughput planner prices: concrete implementations, each as it holds and sends (notebook 05).

A ZeRO stage is a row of the paper; what a person runs is an implementation, and each holds and sends
something else (read in the libraries' source; torch 2.13, DeepSpeed 0.19):

- ``DistributedDataParallel`` under ``torch.autocast``: fp32 weights, fp32 gradients (one copy with
  ``gradient_as_bucket_view=True``; the default ``False`` keeps the buckets as a second), Adam's 8 bytes, and
  autocast's bf16 casts of the weights, saved by autograd from forward to backward (2Ψ; autocast's own cache is
  cleared when its region exits). The buckets
  are allocated when DDP is constructed (the reducer's ``initialize_buckets``) and live as long as the module:
  ``zero_grad(set_to_none=True)`` drops the ``.grad`` views, not the 4Ψ of buckets under them.
- DDP + ``ZeroRedundancyOptimizer``: the same, Adam sharded; its ``step()`` all-reduces nothing more but
  broadcasts every rank's updated shard (``_sync_params``, ``zero_redundancy_optimizer.py``): 1.5x DDP's bytes.
- ``fully_shard`` (FSDP2) with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 shards of
  weights, gradients and Adam (16Ψ/S), bf16 units gathered one or two at a time, an fp32 reduce-scatter input
  per block; on a 2-D mesh (HSDP) ``set_requires_all_reduce(False)`` skips the cross-replica all-reduce on
  accumulation micro-batches, at the price of an fp32 shard-sized partial sum kept across them.
- DeepSpeed ZeRO stages (bf16): 2Ψ of bf16 weights plus 18Ψ/N of partitions (fp32 master, Adam, fp32 and bf16
  gradient partitions; ``estimate_zero2_model_states_mem_needs``), its reduce buckets (``reduce_bucket_size``
  5e8 elements), stage 1 keeping whole bf16 gradients across accumulation micro-steps, and without
  ``overlap_comm`` until the backward's end (its hooks reduce nothing then: ``reduce_gradients`` runs after it).
  The gradients and buckets exist from the backward to the step (``_deepspeed_fresh``), not at the end of the
  forward; the fp32 gradient partition (and stage 1's bf16 one) after it (``_ds_after_backward``). Stage 3
  allocates one reduce bucket per communication dtype at set-up; it has no units: what it holds gathered, and
  its gradients in flight, are replayed submodule by submodule (``deepspeed3.replay``).
  Stage 3 holds 16Ψ/N, not its estimator's 18Ψ/N: its fp32 gradient partition exists only inside ``step()``,
  one sub-group at a time. Stages 1 and 2 all-reduce each gradient bucket (``use_multi_rank_bucket_allreduce``,
  True by default), not the paper's reduce-scatter, and then all-gather the bf16 parameters: 3(N-1)/N of 2Ψ
  per step, as notebook 03 counts. With ``offload_optimizer`` the master, Adam and every gradient partition
  live on the host (``ds_offload_grad_bytes``); the GPU keeps the bf16 weights (stage 3: their partitions) and the buckets.

A row carries its behaviour (``states``, ``buffers``, ``comm``) as callables, and its course row (a
``Strategy`` of the record) for the course's name; the planner branches on no name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from .. import strategies as rec
from ..strategy_spec import Strategy
from .deepspeed3 import DS_PREFETCH, DS_REDUCE_BUCKET, MOMENTS, replay
from .network import exposed_comm
from .shapes import Shape

DDP_BUCKET = 25 * 2**20  # bytes: bucket_cap_mb=25
#: SHARD_GRAD_OP's buffer from the last block's forward to the end of the root's (the loss included)
LAST_GATHER = "the last block's all-gather output, bf16 (to the forward's end)"


@dataclass(frozen=True)
class Impl:
    """One implementation a person can run, priced as it holds and sends.

    ``course``: the record's row it implements (the course's name); ``typed``: what a user types;
    ``short``: the same in at most 40 characters (``{mesh}`` filled in for a 2-D mesh); ``stage``: what it
    shards (0 nothing, 1 optimizer, 2 and gradients, 3 and parameters); ``layout``: over whom one state is
    sharded ("replicated", "world", or "hybrid": a shard group inside a 2-D mesh); ``offload``: "",
    "optimizer" (DeepSpeed's ``offload_optimizer``) or "all" (FSDP2's ``CPUOffloadPolicy``);
    ``states(s, impl, n, shard, accum)``, ``buffers(s, impl)``: bytes per GPU by term; ``comm(...)``:
    exposed seconds and bytes per link; ``fresh_grads(s, impl, n, shard, accum)``: the part of the states the
    backward creates, absent at the end of the forward (gradients freed after each step; not DDP's buckets, which
    outlive every step);
    ``holds_head_grad``: the head's bf16 gradient waits for the root unit (reduced last); ``hook_made(s, impl,
    accum)``: the part of ``fresh_grads`` the backward's first gradient hook allocates (DeepSpeed's buckets);
    ``after_backward(s, impl, n, accum)``: the part made only after the backward (DeepSpeed's partitions); ``step_copy``: bytes
    per updated parameter written besides Adam's (DeepSpeed's bf16 copy); ``reduce_bytes``: bytes per gradient
    element reduced; ``overlap_comm``: the reduction runs on a side stream, behind the backward (DeepSpeed's
    flag; PyTorch's collectives always do); ``unsharded(s, policy)``: the gathered parameters and gradients in
    flight at each moment of the step where no unit formula holds (DeepSpeed stage 3, ``deepspeed3.replay``)."""

    key: str
    course: Strategy
    typed: str
    short: str
    stage: int
    layout: str
    states: Callable
    buffers: Callable
    comm: Callable
    fresh_grads: Callable
    options: str = ""
    reshard_after_forward: bool = True
    offload: str = ""
    holds_head_grad: bool = False
    hook_made: Callable | None = None
    after_backward: Callable | None = None
    step_copy: int = 0
    reduce_bytes: int = 4
    overlap_comm: bool = True
    unsharded: Callable | None = None

    def shard(self, n: int, shard: int) -> int:
        """The GPUs one state is sharded over."""
        return {"replicated": 1, "world": n, "hybrid": shard}[self.layout]

    def optimizer_share(self, n: int, shard: int) -> int:
        """The GPUs Adam's state is split over (the optimizer step updates Ψ over this)."""
        return 1 if self.stage == 0 else (n if self.layout == "replicated" else self.shard(n, shard))


# --------------------------------------------------------------------------------------------- states


def _replicated_states(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> dict:
    P = s.params
    return {
        "fp32 parameters": 4 * P,
        "fp32 gradient buckets (.grad views into them)": 4 * P,
        "Adam moments" + (" (1/N)" if impl.stage else ""): 8 * P / impl.optimizer_share(n, shard),
        "autocast bf16 weight copies (fwd->bwd)": 2 * P,
    }


def _fsdp2_states(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> dict:
    P, S = s.params, impl.shard(n, shard)
    out = {"fp32 parameter shards": 4 * P / S, "Adam moments": 8 * P / S, "fp32 gradient shards": 4 * P / S}
    if impl.offload:
        out = {"(host) fp32 parameter shards": 0.0, "(host) Adam": 0.0, "(host) gradient shards": 0.0}
    if impl.layout == "hybrid" and accum > 1:
        out["HSDP partial reduce (fp32, kept across micro-batches)"] = 4 * P / S
    if not impl.reshard_after_forward:
        out["bf16 parameters held fwd->bwd (all units)"] = 2 * (P - s.root_params)
    return out


def ds_offload_grad_bytes(stage: int) -> dict:
    """Bytes per parameter of a rank's partition that DeepSpeed's ``offload_optimizer`` keeps on the host for
    the gradients (DeepSpeed 0.19; both planners; 05's recount checks it tensor by tensor): the fp32 gradient
    CPU Adam reads (stage 2 ``single_partition_of_fp32_groups[i].grad`` on ``self.device``, the CPU,
    ``stage_1_and_2.py``; stage 3 ``fp32_partitioned_groups_flat[i].grad``, ``stage3.py``) and, stage 3 only,
    the bf16 partitions each reduce-scatter's output is copied into (``grad_partitions_flat_buffer``, also on
    ``self.device``; DeepSpeed's estimator leaves them out). No gradient stays on the GPU but the buckets."""
    return {"fp32 gradient partition": 4, **({"bf16 gradient partitions": 2} if stage == 3 else {})}


def ds_offload_pcie_bytes(stage: int, accum: int) -> tuple[tuple[float, ...], float]:
    """Bytes per element of a GPU's partition that DeepSpeed's ``offload_optimizer`` moves over PCIe (DeepSpeed
    0.19, bf16, whose gradients accumulate in bf16 under ZeRO; both planners): for each micro-batch, as its
    gradients are reduced (non-blocking, beside that micro-batch's backward), and once a step at the boundary.

    - Stage 3 (``partition_grads``, ``stage3.py``): the bf16 gradient partitions live on the host
      (``grad_partitions_flat_buffer``); the first micro-batch copies its partition down and back up (to
      accumulate on the GPU), each later one brings the sum up, adds there ("adding directly to cpu is very
      slow") and sends it down: 4 bytes every micro-batch.
    - Stages 1-2 (``copy_grads_in_partition``, ``stage_1_and_2.py``): only with accumulation
      (``async_accumulate_grad_in_cpu_via_gpu``, per parameter that overlaps the partition): the first
      micro-batch sends its gradient down (2), each later one brings the sum up, adds and sends it down (4).
    - The boundary micro-batch, both: the fp32 gradient down for CPU Adam (4, non-blocking into pinned memory,
      beside that backward: ``_offload_grad_partition_at_boundary``, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``);
      after CPU Adam the updated bf16 weights back up (2, a blocking ``copy_`` the step waits for).

    Returns (bytes per micro-batch, in order, the last with the fp32 gradient; bytes per step, after Adam)."""
    if stage == 3:
        micro = (4.0,) * accum
    else:
        micro = (0.0,) if accum == 1 else (2.0,) + (4.0,) * (accum - 1)
    return micro[:-1] + (micro[-1] + 4.0,), 2.0


def ds_offload_pcie_step_bytes(stage: int, accum: int = 1) -> float:
    """All of ``ds_offload_pcie_bytes`` in a step, bytes per element of the partition (both planners' tables)."""
    micro, per_step = ds_offload_pcie_bytes(stage, accum)
    return sum(micro) + per_step


def host_bytes_per_param(impl: Impl, k: float = 12.0) -> float:
    """Bytes per parameter of a GPU's shard an offload row keeps on the host (both planners): FSDP2's
    ``CPUOffloadPolicy`` the fp32 parameter and gradient shards and Adam's state (4 + 4 + K - 4); DeepSpeed's
    ``offload_optimizer`` the fp32 master and Adam's state (K) and the gradient partitions."""
    if impl.offload == "all":
        return 4 + k
    return k + sum(ds_offload_grad_bytes(impl.stage).values()) if impl.offload else 0.0


def _deepspeed_states(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> dict:
    P = s.params
    # offload_optimizer: the fp32 master, Adam and every gradient partition on the host (ds_offload_grad_bytes)
    host = {f"(host) {t}": 0.0 for t in ("fp32 master + Adam", *ds_offload_grad_bytes(impl.stage))}
    if impl.stage == 3:
        # the bf16 gradient partitions (grad_partitions_flat_buffer) are allocated once and held; the fp32 one is
        # made inside step(), one sub-group at a time (_prepare_fp32_grad_for_sub_group, _release_sub_group)
        out = {"bf16 parameter partitions + fp32 master + Adam + bf16 gradient partitions": 16 * P / n}
        if impl.offload:
            out = {"bf16 parameter partitions": 2 * P / n, **host}
        return {
            **out,
            # one reduce buffer per communication dtype, allocated at set-up (stage3.py); overlap_comm only picks
            # the stream it is reduced on
            "reduce bucket (one per comm dtype), bf16": 2 * min(DS_REDUCE_BUCKET, P),
            "prefetch bucket, bf16": 2 * min(DS_PREFETCH, P),
        }
    out = {"bf16 parameters": 2 * P}
    out.update(host if impl.offload else {"fp32 master + Adam + fp32/bf16 gradient partitions": 18 * P / n})
    out["IPG reduce bucket(s), bf16"] = _ds_ipg_buckets(s, impl)
    if _ds_keeps_whole_grads(impl, accum):
        out["whole bf16 gradients (reduced after the backward)"] = 2 * P
    return out


def _ds_ipg_buckets(s: Shape, impl: Impl) -> float:
    """Stages 1-2's bf16 reduce bucket, two with ``overlap_comm`` (``setup_buckets``, ``stage_1_and_2.py``)."""
    return 2 * min(DS_REDUCE_BUCKET, s.params) * (2 if impl.overlap_comm else 1)


def _ds_backward_buckets(s: Shape, impl: Impl, accum: int) -> float:
    """Stages 1-2's buckets as the backward holds them: every backward (stage 2's epilogue frees them each
    micro-step; without accumulation both), or stage 1's once per step (kept to the boundary, not re-made)."""
    return _ds_ipg_buckets(s, impl) * (accum == 1 or impl.stage == 2)


def _ds_keeps_whole_grads(impl: Impl, accum: int) -> bool:
    """DeepSpeed stage 1 reduces at the accumulation boundary only, and there in its hooks only with
    ``overlap_comm`` (``process_gradients``, ``stage_1_and_2.py``); without it the engine's ``reduce_gradients``
    reduces every whole bf16 gradient after the backward, so they all exist at its end."""
    return impl.stage == 1 and (accum > 1 or not impl.overlap_comm)


def _sharded_fresh(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> float:
    """FSDP2's fp32 gradient shards, made by the backward and freed by the step (none across micro-batches
    with accumulation; none on the GPU with ``CPUOffloadPolicy``, whose states are all on the host)."""
    return 4 * s.params / shard if accum == 1 and not impl.offload else 0.0


def _no_fresh(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> float:
    """DDP's gradient buckets are allocated at construction and outlive every step (``.grad`` are views into
    them)."""
    return 0.0


def _deepspeed_fresh(s: Shape, impl: Impl, n: int, shard: int, accum: int) -> float:
    """What of DeepSpeed's states the backward makes and the step frees, absent at the end of the forward
    (DeepSpeed 0.19, ``stage_1_and_2.py``). Stages 1-2: the IPG buckets are allocated in the backward's first
    gradient hook (``setup_buckets`` from ``process_gradients``) and freed in its epilogue
    (``_release_ipg_buffers``), the gradient partitions in it (stage 2's bf16 one) or after it
    (``_ds_after_backward``).
    With accumulation the epilogue runs each micro-step only in stage 2 (``allreduce_gradients``,
    ``engine.py``): its buckets go and its bf16 partition stays (``all_grad_tensors``); stage 1's buckets stay
    to the boundary, its partitions do not exist yet. Without accumulation stage 1's whole bf16 gradients exist
    from the backward to the reduction. Stage 3's states are all held."""
    if impl.stage == 3:
        return 0.0
    P = s.params
    partitions = 0.0 if impl.offload else (4 if accum > 1 and impl.stage == 2 else 6) * P / n
    whole = 2 * P if accum == 1 and _ds_keeps_whole_grads(impl, 1) else 0.0
    return partitions + _ds_backward_buckets(s, impl, accum) + whole


def _ds_after_backward(s: Shape, impl: Impl, n: int, accum: int) -> float:
    """Stages 1-2's gradient partitions the backward does not hold: ``step()`` makes the fp32 one
    (``single_partition_of_fp32_groups[i].grad``) and frees both; stage 1's bf16 one is made by the
    backward's epilogue (``get_flat_partition``, at the boundary), stage 2's by its hooks' reduction
    (``copy_grads_in_partition``), kept across micro-steps with accumulation. On the host with offload."""
    if impl.stage == 3 or impl.offload:
        return 0.0
    return (4 if impl.stage == 2 else 6) * s.params / n


def _ds_hook_buckets(s: Shape, impl: Impl, accum: int) -> float:
    """What the backward's first gradient hooks have made by the first block's backward: stages 1-2's buckets
    (``setup_buckets``, from the head's gradient on), every backward or stage 1's once a step (kept to the
    boundary); and stage 1 without ``overlap_comm`` (one micro-batch), whose hooks only set the bucket up
    (``process_gradients``), the head's and that block's whole bf16 gradients, kept to the reduction."""
    buckets = _ds_backward_buckets(s, impl, accum)
    whole = 2 * (s.head_params + s.block_params) if accum == 1 and _ds_keeps_whole_grads(impl, 1) else 0.0
    return buckets + whole


# --------------------------------------------------------------------------------------------- buffers


def _no_buffers(s: Shape, impl: Impl) -> dict:
    return {}


def _fsdp2_buffers(s: Shape, impl: Impl) -> dict:
    out = {"root bf16 parameters (not resharded after forward)": 2 * s.root_params}
    if impl.reshard_after_forward:
        out["two gathered blocks, bf16"] = 2 * 2 * s.block_params
    else:  # kept gathered, but the last block's all-gather output lives on: only the root's post_forward frees it
        out[LAST_GATHER] = 2 * s.block_params  # (_fsdp_state.py's _post_forward; each earlier one at the next copy-out)
    out["a block's bf16 gradient"] = 2 * s.block_params
    out["a block's reduce-scatter input, fp32"] = 4 * s.block_params
    return out


def _deepspeed3_unsharded(s: Shape, policy: str) -> dict:
    """Stage 3's gathered bf16 parameters and gradients in flight at each of the planner's moments, as its
    coordinator gathers and releases them submodule by submodule (``deepspeed3.replay``): at the forward's end
    the head (its backward comes next) and what ``stage3_max_reuse_distance`` keeps of the last blocks, not the
    embeddings; in the backward one submodule and its gradient, or the block a policy rebuilt whole."""
    r = replay(s, policy)
    return {k: r[k] for k in MOMENTS}


# --------------------------------------------------------------------------------------------- traffic


def _allreduce_comm(s: Shape, impl: Impl, c, t) -> tuple[float, dict]:
    """DDP: fp32 gradients all-reduced in 25 MB buckets during the last micro-batch's backward (``no_sync``
    on the others); ZeroRedundancyOptimizer then broadcasts every shard after the step (exposed)."""
    link = t.link(t.n, c.nodes > 1)
    if not link:
        return 0.0, {}
    bw, lat = link
    P, n = s.params, t.n
    ar_bytes = 2 * (n - 1) / n * 4 * P
    ar = ar_bytes / bw + lat * math.ceil(4 * P / DDP_BUCKET)
    exposed = max(0.0, ar - t.backward_window(False) - 2 * t.head) + DDP_BUCKET * 2 * (n - 1) / n / bw
    sent = ar_bytes
    if impl.stage:
        bc_bytes = (n - 1) / n * 4 * P
        exposed += bc_bytes / bw + lat * n
        sent += bc_bytes
    return exposed, {t.wire(c.nodes > 1): sent}


def _unit_comm(s: Shape, impl: Impl, c, t) -> tuple[float, dict]:
    """Parameters gathered per unit (bf16) and gradients reduce-scattered per unit (FSDP2 in fp32, DeepSpeed
    in bf16), played out unit by unit on FSDP's schedule (``network.exposed_comm``): the next unit's gather
    hides behind this unit's compute, a unit's reduce-scatter behind the next units' backward. The units, in
    forward order: the root (the embeddings' compute, nothing to hide its gather; kept gathered for the
    backward, its reduce-scatter last), the blocks, the head (the root's parameters, so nothing to gather:
    its backward hides the last block's gather, which the root's pre-backward prefetches: FSDP2's
    ``FSDPParamGroup._backward_prefetch`` unshards the group whose forward ended just before). On a 2-D
    mesh the cross-replica all-reduce runs once per step, per unit, on the other link, overlapping the rest
    of the backward."""
    S = c.shard
    spans = S > t.gpus_per_node
    link = t.link(S, spans)
    exposed, sent = 0.0, {}
    P, Pb, Pr, L = s.params, s.block_params, s.root_params, s.layers
    if link:
        bw, lat = link
        gathers = 2 if (impl.stage == 3 and impl.reshard_after_forward) else 1
        ag = 2 * Pb * (S - 1) / S / bw + lat
        rs = impl.reduce_bytes * Pb * (S - 1) / S / bw + lat
        root_ag = 2 * Pr * (S - 1) / S / bw + lat
        root_rs = impl.reduce_bytes * Pr * (S - 1) / S / bw + lat
        regather = ag if gathers == 2 else 0.0
        forward, backward = _unit_schedule(L, t.f_blk, t.block_backwards, t.head, root_ag, ag, rs, root_rs, regather)
        exposed = c.accum * (forward + backward)
        sent[t.wire(spans)] = c.accum * (gathers * 2 + impl.reduce_bytes) * P * (S - 1) / S
    if impl.layout == "hybrid" and t.n > S:
        R = t.n // S
        crosses = c.nodes > 1
        node_bw = t.cluster.inter_bw if crosses else t.cluster.gpu.nvlink_bw * t.gpus_per_node
        lat = t.cluster.inter_latency if crosses else t.cluster.intra_latency
        # every GPU of a node all-reduces its fp32 shard with its replicas at once, over the node's cards
        ar = 2 * (R - 1) / R * 4 * P / S * t.gpus_per_node / node_bw + lat * (L + 1)
        exposed += max(0.0, ar - t.backward_window(True)) + ar / (L + 1)
        key = t.wire(crosses)
        sent[key] = sent.get(key, 0.0) + 2 * (R - 1) / R * 4 * P / S
    return exposed, sent


@functools.lru_cache(maxsize=4096)
def _unit_schedule(L, f_blk, block_backwards, head, root_ag, ag, rs, root_rs, regather) -> tuple[float, float]:
    """``exposed_comm`` over the units ``_unit_comm`` describes (cached: the search prices the same micro-batch
    under many accumulation counts and node choices). ``block_backwards``: each block's backward, in forward
    order (a block the policy rebuilds runs its forward again first)."""
    return exposed_comm(
        [0.0] + [f_blk] * L + [head],
        [0.0] + list(block_backwards) + [2 * head],
        [root_ag] + [ag] * L + [0.0],
        [root_rs] + [rs] * L + [0.0],
        backward_gather=[0.0] + [regather] * L + [0.0],
    )


def _bucket_comm(s: Shape, impl: Impl, c, t) -> tuple[float, dict]:
    """DeepSpeed stages 1 and 2: bf16 gradients all-reduced in buckets (stage 2 every micro-step, stage 1 at
    the accumulation boundary), the updated bf16 parameters all-gathered after the step (exposed). An
    all-reduce, not the paper's reduce-scatter: ``average_tensor`` (``stage_1_and_2.py``) files every gradient
    slice under one "allreduce" bucket while ``use_multi_rank_bucket_allreduce`` is True (DeepSpeed 0.19's
    default), so each rank sends 2(N-1)/N of the bucket and keeps its own partition of the sum; with that
    flag off it issues one ``reduce`` per destination rank instead. The reduction hides behind the backward
    only with ``overlap_comm`` (a side stream; stage 1-2's default is off: the hooks reduce on the compute
    stream), and never its last bucket."""
    link = t.link(t.n, c.nodes > 1)
    if not link:
        return 0.0, {}
    bw, lat = link
    P, n = s.params, t.n
    ar_bytes = 2 * (n - 1) / n * 2 * P
    ar = ar_bytes / bw + lat * math.ceil(P / DS_REDUCE_BUCKET)
    last = 2 * (n - 1) / n * 2 * min(DS_REDUCE_BUCKET, P) / bw
    ag_bytes = (n - 1) / n * 2 * P
    ag = ag_bytes / bw + lat
    reduces = c.accum if impl.stage == 2 else 1
    hidden = t.backward_window(False) if impl.overlap_comm else 0.0
    exposed = reduces * (max(0.0, ar - hidden) + last * impl.overlap_comm) + ag
    return exposed, {t.wire(c.nodes > 1): reduces * ar_bytes + ag_bytes}


# --------------------------------------------------------------------------------------------- the rows

_REPLICATED = dict(layout="replicated", states=_replicated_states, buffers=_no_buffers, comm=_allreduce_comm)
_REPLICATED["fresh_grads"] = _no_fresh
_FSDP2 = dict(states=_fsdp2_states, buffers=_fsdp2_buffers, comm=_unit_comm, fresh_grads=_sharded_fresh)
_FSDP2.update(holds_head_grad=True, options="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
_DS = dict(layout="world", states=_deepspeed_states, fresh_grads=_deepspeed_fresh, step_copy=2, reduce_bytes=2)
_DS12 = dict(_DS, buffers=_no_buffers, comm=_bucket_comm, hook_made=_ds_hook_buckets, after_backward=_ds_after_backward)
_DS3 = dict(_DS, buffers=_no_buffers, comm=_unit_comm, unsharded=_deepspeed3_unsharded)
_CPU_ADAM = "DeepSpeedCPUAdam on the host"

IMPLS: tuple[Impl, ...] = (
    Impl("pt-ddp", rec.DDP, "DistributedDataParallel + torch.autocast(bfloat16)", "DistributedDataParallel", 0,
         options="gradient_as_bucket_view=True (the default False keeps a second fp32 gradient copy: +4 bytes/param)",
         **_REPLICATED),
    Impl("pt-ddp-zero", rec.TORCH_ZERO1, "DDP + ZeroRedundancyOptimizer(AdamW) + torch.autocast(bfloat16)",
         "DDP + ZeroRedundancyOptimizer", 1,
         options="gradient_as_bucket_view=True; every shard broadcast after each step", **_REPLICATED),
    Impl("pt-fsdp2-keep", rec.SHARD_GRAD_OP, "fully_shard(reshard_after_forward=False)",
         "fully_shard(reshard_after_forward=False)", 2, "world", reshard_after_forward=False, **_FSDP2),
    Impl("pt-fsdp2", rec.FULL_SHARD, "fully_shard(reshard_after_forward=True)",
         "fully_shard(reshard_after_forward=True)", 3, "world", **_FSDP2),
    Impl("pt-fsdp2-2d", rec.HYBRID_SHARD, "fully_shard(mesh=init_device_mesh(..., (replicate, shard)))",
         "fully_shard on a 2-D mesh {mesh}", 3, "hybrid",
         **dict(_FSDP2, options=_FSDP2["options"] + "; set_requires_all_reduce(False) on accumulation steps")),
    Impl("pt-fsdp2-cpu", rec.FULL_SHARD, "fully_shard(offload_policy=CPUOffloadPolicy())",
         "fully_shard + CPUOffloadPolicy()", 3, "world", offload="all",
         **dict(_FSDP2, options="parameters, gradients and Adam on the host; torch.optim on the CPU")),
    Impl("ds-1", rec.ZERO1, 'DeepSpeed "zero_optimization": {"stage": 1}', "DeepSpeed ZeRO stage 1", 1,
         options='bf16; reduce_bucket_size 5e8, "overlap_comm": false (the defaults)', overlap_comm=False, **_DS12),
    Impl("ds-2", rec.ZERO2, 'DeepSpeed "zero_optimization": {"stage": 2}', "DeepSpeed ZeRO stage 2", 2,
         options='bf16; "overlap_comm": true; reduce_bucket_size 5e8', **_DS12),
    Impl("ds-3", rec.ZERO3, 'DeepSpeed "zero_optimization": {"stage": 3}', "DeepSpeed ZeRO stage 3", 3,
         options="bf16; overlap_comm true (the stage-3 default); prefetch 5e7, reduce bucket 5e8", **_DS3),
    Impl("ds-2-offload", rec.ZERO2_OFFLOAD, 'DeepSpeed stage 2 + "offload_optimizer": {"device": "cpu"}',
         "DeepSpeed stage 2 + offload_optimizer", 2, offload="optimizer", options=_CPU_ADAM + '; "overlap_comm": true',
         **_DS12),
    Impl("ds-3-offload", rec.ZERO3_OFFLOAD, 'DeepSpeed stage 3 + "offload_optimizer": {"device": "cpu"}',
         "DeepSpeed stage 3 + offload_optimizer", 3, offload="optimizer", options=_CPU_ADAM, **_DS3),
)  # fmt: skip

#: The rows by key.
BY_KEY = {i.key: i for i in IMPLS}
