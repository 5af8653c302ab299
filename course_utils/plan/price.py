"""What one strategy costs on a cluster: memory per GPU, a block's compute against its gathers, the step's
communication and time, and the limits no sharding removes (notebook 05).

Every function reads the strategy's row of the record (``course_utils.strategies``): what it shards at the
peak of a step, over which group, what it moves to host memory, which collectives it issues over which
mesh dimension. None of them tests a name, so a row the loop cannot run (the offload rows, DeepSpeed's
stages) is priced like any other.
"""

from __future__ import annotations

import math

from ..comm import ring_bytes_sent
from ..memory import bill
from ..strategies import GRADS, OPTIM, PARAMS, ZERO3, Strategy, get
from .implementations import ds_offload_grad_bytes, ds_offload_pcie_step_bytes
from .inputs import Cluster, ModelSpec
from .network import _groups, _hsdp_shard, block_flops, exposed_comm, ring_time
from .throughput import ds_offload_s

#: PyTorch DDP's default gradient bucket (bucket_cap_mb = 25); two are alive while one is reduced.
BUCKET_BYTES = 25 * 10**6
#: The record's parts under the names the planner's tables give them.
PLAN_PART = {PARAMS: "weights", GRADS: "gradients", OPTIM: "optimizer"}


def applicable(strategy: Strategy, cluster: Cluster) -> bool:
    """Whether the planner weighs ``strategy`` on ``cluster``: a row that shards inside a node needs several
    nodes and at least two data-parallel GPUs in each (notebook 05)."""
    if strategy.shard_over == "node":  # needs several nodes, and at least 2 data-parallel GPUs per node
        return (
            cluster.nodes > 1 and cluster.gpus_per_node % cluster.mp == 0 and cluster.gpus_per_node // cluster.mp >= 2
        )
    return True


def hsdp_shard_sizes(cluster: Cluster) -> list[int]:
    """HSDP's possible shard-group sizes, smallest first: one node's data-parallel GPUs times each
    proper divisor of the node count (notebook 05). FSDP2's 2-D mesh takes any shape; a shard group
    of several nodes gathers over the network but needs fewer bytes per GPU."""
    per_node = cluster.gpus_per_node // cluster.mp
    return [per_node * m for m in range(1, cluster.nodes) if cluster.nodes % m == 0]


def memory_breakdown(
    model: ModelSpec,
    cluster: Cluster,
    strategy: str | Strategy,
    *,
    k: float = bill.ADAM_MIXED_K,
    shard_size: int | None = None,
) -> dict:
    """Bytes per GPU a strategy needs, split into weights, gradients, optimizer (the model states),
    activations and buffers, plus what it parks in host memory (notebook 05; notebook 05b compares
    its measured peaks with this).

    Model states follow the paper with Ψ/Nm per GPU, the parts the row shards at the peak of a step
    divided by its shard group (Nd, or ``shard_size`` GPUs, one node's by default, for a row that
    shards inside a node); the parts it offloads go to the host, and with the optimizer
    (DeepSpeed's ``offload_optimizer``, the record's offload rows) the gradient partitions too
    (``implementations.ds_offload_grad_bytes``). Activations: the paper's rule
    divided by Nm (as with ZeRO-R's partitioned activations). Buffers: two 25 MB gradient buckets
    when the weights are whole; when they are sharded, the largest unit gathered in 16-bit twice (the
    current block and the prefetched next one) plus its unsharded 16-bit gradient.
    """
    row = get(strategy)
    p = model.params / cluster.mp
    shard = _hsdp_shard(cluster, shard_size) if row.shard_over == "node" else cluster.nd
    sharded = {PLAN_PART[part] for part in row.shards_at_peak}
    full = {"weights": bill.WEIGHT_BYTES * p, "gradients": bill.GRAD_BYTES * p, "optimizer": k * p}
    held = {part: full[part] / shard if part in sharded else full[part] for part in full}
    host = 0.0
    for part in row.offload:
        host, held[PLAN_PART[part]] = host + held[PLAN_PART[part]], 0.0
    if OPTIM in row.offload:  # DeepSpeed's offload_optimizer: the gradient partitions live on the host too
        stage = 3 if "weights" in sharded else 2
        host, held["gradients"] = host + sum(ds_offload_grad_bytes(stage).values()) * p / shard, 0.0
    activations = (
        bill.activation_bytes(
            model.width, model.micro_batch, model.seq, model.layers, checkpointing=model.checkpointing
        )
        / cluster.mp
    )
    if "weights" in sharded:
        buffers = 3 * bill.WEIGHT_BYTES * model.largest_unit_params / cluster.mp
    else:
        buffers = 2.0 * BUCKET_BYTES
    return {
        **held,
        "activations": activations,
        "buffers": buffers,
        "host_bytes": host,
        "model_states": sum(held.values()),
        "total": sum(held.values()) + activations + buffers,
    }


def block_overlap(model: ModelSpec, cluster: Cluster, strategy: Strategy, shard_size: int | None = None) -> dict | None:
    """One block's compute against the all-gather of its parameters, for a row that shards the weights
    and gathers them block by block; None for the others (notebook 05)."""
    if PARAMS not in strategy.shards_at_peak:
        return None
    n, spans = _groups(strategy, cluster, shard_size)["shard"]
    fwd = block_flops(model) / cluster.mp / cluster.flops
    bwd = (3.0 if model.checkpointing else 2.0) * fwd  # backward is 2x forward; checkpointing recomputes 1x
    nbytes = bill.WEIGHT_BYTES * model.block_params / cluster.mp
    gather = ring_time(nbytes, n, cluster, spans_nodes=spans)
    rs = ring_time(nbytes, n, cluster, spans_nodes=spans, kind="reduce_scatter")
    return {
        "params": model.block_params,
        "gather_bytes": nbytes,
        "fwd_compute_s": fwd,
        "bwd_compute_s": bwd,
        "gather_s": gather,
        "reduce_scatter_s": rs,
        "hides_fwd": gather <= fwd,
        "hides_bwd": gather + rs <= bwd,
        "link": "network" if spans else "NVLink (intra-node)",
    }


def compute_time(model: ModelSpec, cluster: Cluster) -> tuple[float, float]:
    """Seconds of forward and of backward compute per step on one GPU (notebook 05)."""
    fwd_block = block_flops(model) / cluster.mp / cluster.flops
    head = 6.0 * model.tokens * model.vocab * model.width / cluster.mp / cluster.flops
    fwd = model.layers * fwd_block + head / 3
    bwd = model.layers * fwd_block * (3.0 if model.checkpointing else 2.0) + 2 * head / 3
    return fwd, bwd


def step_time(
    model: ModelSpec,
    cluster: Cluster,
    strategy: Strategy,
    k: float,
    block: dict | None,
    shard_size: int | None = None,
):
    """``(link, network bytes per GPU, PCIe bytes per GPU, compute s, exposed communication s)`` (notebook 05).

    Each of the row's collectives moves 16-bit weights or gradients (Ψ/Nm, or a gradient shard) over its
    mesh dimension's group, at the speed of the slowest link that group crosses. A row that gathers block
    by block exposes what its blocks' compute cannot hide on FSDP's schedule (``block_overlap``'s times played
    out by ``network.exposed_comm``, exercise 05.2's reference); the others reduce gradients behind the backward
    pass and gather weights behind the next forward pass. An all-reduce of gradient shards across replicas
    (HSDP) overlaps the backward. Offload adds its PCIe traffic and the CPU's optimizer step, unhidden.
    """
    p = model.params / cluster.mp
    grad_bytes = bill.GRAD_BYTES * p
    fwd_all, bwd_all = compute_time(model, cluster)
    compute = fwd_all + bwd_all
    groups = _groups(strategy, cluster, shard_size)
    shard = groups.get("shard", (1, False))[0] if strategy.shard_over != "none" else 1
    link = "network" if cluster.nodes > 1 else "NVLink (intra-node)"
    if cluster.nd == 1 and strategy.shard_over != "node":
        link = "none (one replica)"
    volume, exposed, hidden = 0.0, 0.0, {PARAMS: 0.0, GRADS: 0.0}
    for c in strategy.collectives:
        n, spans = groups[c.over]
        payload = {PARAMS: bill.WEIGHT_BYTES * p, GRADS: grad_bytes, "grad_shard": grad_bytes / shard}[c.of]
        volume += ring_bytes_sent(c.kind, payload, n)
        if c.of == "grad_shard":  # the node's shards go side by side over its link: all of the gradient
            exposed += max(0.0, ring_time(payload * shard, n, cluster, spans_nodes=True, kind=c.kind) - bwd_all)
            link = f"{block['link']} for gathers, network for the gradient all-reduce"
        elif block is None:
            hidden[c.of] += ring_time(payload, n, cluster, spans_nodes=spans, kind=c.kind)
    if block is None:  # gradients reduce behind the backward, weights gather behind the next forward
        exposed += max(0.0, hidden[GRADS] - bwd_all) + max(0.0, hidden[PARAMS] - fwd_all)
    else:  # block by block, on FSDP's schedule (exercise 05.2)
        layers = model.layers
        forward, backward = exposed_comm(
            [block["fwd_compute_s"]] * layers,
            [block["bwd_compute_s"]] * layers,
            [block["gather_s"]] * layers,
            [block["reduce_scatter_s"]] * layers,
        )
        exposed += forward + backward
        link = link if strategy.shard_over == "node" else block["link"]
    pcie = 0.0
    if strategy.offload:
        # DeepSpeed's offload_optimizer at one micro-batch a step, priced as the search prices it (ds_offload_s):
        # the gradient copies beside the backward, the weights' copy back and the CPU's Adam waited for
        stage = 3 if strategy.gathers_units else 2
        pcie = ds_offload_pcie_step_bytes(stage) * p / cluster.nd
        exposed += ds_offload_s(stage, p / cluster.nd, 1, bwd_all, cluster.pcie_bw, cluster, k)
    return link, volume, pcie, compute, exposed


def limits(model: ModelSpec, cluster: Cluster, k: float) -> dict:
    """The two things no sharding removes, and the GPUs stage 3 would need (notebook 05)."""
    acts = (
        bill.activation_bytes(
            model.width, model.micro_batch, model.seq, model.layers, checkpointing=model.checkpointing
        )
        / cluster.mp
    )
    acts_ckpt = (
        bill.activation_bytes(model.width, model.micro_batch, model.seq, model.layers, checkpointing=True) / cluster.mp
    )
    unit = memory_breakdown(model, cluster, ZERO3, k=k)["buffers"]
    layer_acts = bill.activation_bytes(model.width, model.micro_batch, model.seq, 1) / cluster.mp
    # one layer at its moment of execution: its gathered weights and gradient, and its activations
    single_layer = 2 * bill.WEIGHT_BYTES * model.largest_unit_params / cluster.mp + layer_acts
    # wrapped per linear layer, FSDP's largest unit is one matrix: the MLP's h x 4h
    single_matrix = 2 * bill.WEIGHT_BYTES * 4.0 * model.width**2 / cluster.mp + layer_acts
    room = cluster.usable - acts - unit
    per_replica = (bill.WEIGHT_BYTES + bill.GRAD_BYTES + k) * model.params / cluster.mp
    min_nd = math.ceil(per_replica / room) if room > 0 else None
    min_gpus = None if min_nd is None else min_nd * cluster.mp
    return {
        "activations": acts,
        "activations_if_checkpointed": acts_ckpt,
        "single_layer": single_layer,
        "activations_limit": acts + 2.0 * BUCKET_BYTES > cluster.usable,
        "single_layer_limit": single_layer > cluster.usable,
        "single_matrix": single_matrix,
        "single_matrix_limit": single_matrix > cluster.usable,
        "zero3_min_gpus": min_gpus,
        "zero3_min_nodes": None if min_gpus is None else math.ceil(min_gpus / cluster.gpus_per_node),
    }
