"""Collectives and compute as time: ring collectives on a cluster's links, a block's FLOPs, overlap
(notebook 05).

The ring factors are ``comm.RING_FACTOR`` (the ones every count and prediction of the course uses);
a ring runs at the speed of its slowest link. A time model is a model: good enough to see which
side of a crossover a run sits on, not to predict seconds.
"""

from __future__ import annotations

from ..comm import RING_FACTOR, ring_bytes_sent
from ..memory.bill import GRAD_BYTES, WEIGHT_BYTES
from ..strategies import get
from .inputs import Cluster, ModelSpec, _need, _whole

# ---------------------------------------------------------------------------------------------
# Collectives and compute, as time
# ---------------------------------------------------------------------------------------------


def ring_time(nbytes: float, n: int, cluster: Cluster, *, spans_nodes: bool, kind: str = "all_gather") -> float:
    """Seconds for a ring collective over ``n`` ranks of a tensor of ``nbytes`` (notebook 05).

    Each rank receives (n − 1)/n of the tensor for an all-gather or a reduce-scatter, twice that
    for an all-reduce (reduce-scatter + all-gather). The ring runs at the speed of its slowest
    link: ``intra_bw`` inside a node; across nodes, the node's ``inter_bw``.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = min(cluster.intra_bw, cluster.inter_bw) if spans_nodes else cluster.intra_bw
    return ring_bytes_sent(kind, nbytes, n) / bw


def _groups(strategy, cluster: Cluster, shard_size: int | None = None) -> dict:
    """``{dim: (ranks in one group, whether a group spans nodes)}`` of a row's mesh on this cluster.

    The Nd data-parallel GPUs (n = one node's, or ``shard_size``) make a mesh of shape (Nd/S, S): a
    "shard" group is S consecutive GPUs (S = Nd, n, or 1 as the row shards over the world, a node,
    or nobody); a "replicate" group takes one GPU of every shard group. A group spans nodes when
    its GPUs are not all in one node's n.
    """
    per_node, nd = cluster.gpus_per_node // cluster.mp, cluster.nd
    s = {"world": nd, "node": _hsdp_shard(cluster, shard_size), "none": 1}[strategy.shard_over]
    if len(strategy.mesh) == 1:  # a 1-D mesh: its one dimension is every data-parallel GPU
        return {strategy.mesh[0]: (nd, nd > per_node)}
    r = nd // s
    return {"shard": (s, s > per_node), "replicate": (r, r > 1 and (r - 1) * s >= per_node)}


def _hsdp_shard(cluster: Cluster, shard_size: int | None) -> int:
    return shard_size or cluster.gpus_per_node // cluster.mp


def network_step(
    strategy, params: float, cluster: Cluster, *, bytes_per_value: float = GRAD_BYTES, root_params: float = 0.0
) -> dict:
    """What one step puts on the links between nodes, in the ring model above (notebook 05).

    Returns ``cross_node_bytes``: ring bytes one GPU sends per step in collectives whose group spans
    nodes (what ``instrument.CommCounter`` measures as ``cross_node_sent_bytes``), and ``network_s``:
    how long those collectives keep the node's link (``inter_bw``) busy, nothing hidden behind
    compute. ``strategy``: a row of the record (or its name); each of its collectives moves P = ``bytes_per_value``
    ·Ψ/Nm (a gradient shard P/n), over its mesh dimension's group (``_groups``). With Nd GPUs, n per
    node:

    - ddp: one all-reduce of P over Nd, 2(Nd−1)/Nd·P; stages 1, 2: a reduce-scatter and an all-gather,
      the same bytes;
    - zero3 (FULL_SHARD): two all-gathers and one reduce-scatter over Nd, 3(Nd−1)/Nd·P;
    - hybrid_shard: gathers and reduce-scatters inside the node (nothing across); across, an
      all-reduce of its P/n shard over the nodes, 2(P/n)(nodes−1)/nodes, and the node's n GPUs run
      those n rings side by side over the same link (hence ``ring_time`` of n·P/n = P, as ``plan``
      times it).

    ``root_params``: parameters of the root unit, which a row that ``keeps_root`` (FSDP2's default) does
    not gather again for the backward: that all-gather moves P less the root's share. 0 (the default)
    prices the root as gathered twice, an upper bound when the model's root is not known.
    """
    strategy = get(strategy)
    p = bytes_per_value * params / cluster.mp
    if cluster.nodes == 1:
        return {"cross_node_bytes": 0.0, "network_s": 0.0}
    groups = _groups(strategy, cluster)
    shard = groups.get("shard", (1, False))[0] if strategy.shard_over != "none" else 1
    cross = seconds = 0.0
    root = bytes_per_value * root_params / cluster.mp
    for c in strategy.collectives:
        n, spans = groups[c.over]
        if spans:
            moved = p / shard if c.of == "grad_shard" else p
            if strategy.keeps_root and c.of == "params" and c.when == "backward":
                moved -= root  # the root stays gathered from its forward to its backward
            cross += RING_FACTOR[c.kind](n) * moved
            # a gradient shard's ring runs beside the node's other n - 1: together they carry all of P
            seconds += ring_time(p, n, cluster, spans_nodes=True, kind=c.kind)
    return {"cross_node_bytes": cross, "network_s": seconds}


def crossover_bandwidth(base_a: float, link_bytes_a: float, base_b: float, link_bytes_b: float) -> float | None:
    """The link bandwidth (bytes/s) at which strategies a and b take equally long per step (notebook 05).

    Each step takes ``base + link_bytes / bandwidth``: ``base`` measured on an unlimited link,
    ``link_bytes`` what the step puts on the busiest link (``network_step``'s ``network_s`` times
    the bandwidth). Below the crossover the one with fewer link bytes is faster. None when the
    lines never cross (one of the two is faster on every link).
    """
    if link_bytes_a == link_bytes_b or base_a == base_b:
        return None
    bandwidth = (link_bytes_b - link_bytes_a) / (base_a - base_b)
    return bandwidth if bandwidth > 0 else None


def block_flops(model: ModelSpec) -> float:
    """Forward FLOPs of one block for one micro-batch: 24·b·s·h² + 4·b·s²·h (notebook 05)."""
    b, s, h = model.micro_batch, model.seq, model.width
    return 24.0 * b * s * h * h + 4.0 * b * s * s * h


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe-style pipeline of p stages and m micro-batches: (p − 1)/(m + p − 1) (notebook 05)."""
    _whole("pipeline stages p", p)
    _whole("micro-batches m", m)
    return (p - 1) / (m + p - 1)


def training_days(reference_minutes: float, work_ratio: float) -> float:
    """Days for a run that does ``work_ratio`` times the work of a reference run of
    ``reference_minutes`` on the same GPUs (the paper's §9: BERT-Large's 67 minutes × 3,000) (notebook 05)."""
    _need(reference_minutes > 0 and work_ratio > 0, "reference minutes and work ratio must be positive")
    return reference_minutes * work_ratio / 60 / 24


#: How the planner labels an inter-node bandwidth (bytes/s per node), slowest first.
NETWORK_CLASSES = (
    (1.25e9, "10 GbE-class (a slow link)"),
    (12.5e9, "100 Gb/s-class Ethernet or InfiniBand"),
    (50e9, "a modest training cluster (4 x 100 Gb/s or 1 x 400 Gb/s per node)"),
    (200e9, "a current training cluster (4 x 400 Gb/s per node)"),
    (float("inf"), "a current training cluster (8 x 400 Gb/s per node or more)"),
)


def network_class(inter_bw: float) -> str:
    """The kind of network a per-node bandwidth in bytes/s describes (notebook 05)."""
    return next(label for limit, label in NETWORK_CLASSES if inter_bw <= limit)


def overlap_curve(model: ModelSpec, cluster: Cluster, tokens) -> dict:
    """Per-block forward compute and all-gather time across tokens per micro-batch (b·s), for the
    overlap chart (notebook 05). The gather does not depend on tokens; compute grows with them.

    Returns ``{"tokens", "compute_s", "gather_intra_s", "gather_network_s", "crossover_intra",
    "crossover_network"}``: the crossovers are the tokens at which compute equals each gather
    (about achievable FLOP/s ÷ bandwidth, independent of the width when s² terms are small).
    """
    import numpy as np

    tokens = np.asarray(tokens, dtype=float)
    h = model.width
    per_token = (24.0 * h * h + 4.0 * model.seq * h) / cluster.mp / cluster.flops
    nbytes = WEIGHT_BYTES * model.block_params / cluster.mp
    intra = ring_time(nbytes, max(2, cluster.gpus_per_node // cluster.mp), cluster, spans_nodes=False)
    network = ring_time(nbytes, max(2, cluster.nd), cluster, spans_nodes=True)
    return {
        "tokens": tokens,
        "compute_s": tokens * per_token,
        "gather_intra_s": intra,
        "gather_network_s": network,
        "crossover_intra": intra / per_token,
        "crossover_network": network / per_token,
    }


def overlap_ratio(
    tokens,
    width: int,
    *,
    flops: float,
    bandwidth: float,
    n: int,
    bytes_per_param: float = 2,
    seq: int = 0,
    latency: float = 0.0,
    compute_overhead: float = 0.0,
):
    """A block's forward compute time divided by the all-gather time of its parameters, for
    ``tokens`` = b·s per micro-batch (notebook 05). Above 1 the gather hides.

    compute = (24h² + 4sh)·tokens / FLOP/s; gather = latency + bytes_per_param·12h²·(n − 1)/n / bandwidth
    (``latency``: a measured line's, e.g. ``host_fit``'s; a GPU's few microseconds are left out;
    ``compute_overhead``: seconds per forward call, ``host_fit``'s, added to the compute).
    With s small next to 6h the width cancels: the crossover sits near
    tokens ≈ FLOP/s · bytes_per_param · (n − 1)/n / (2 · bandwidth), whatever the model's size.
    """
    import numpy as np

    tokens = np.asarray(tokens, dtype=float)
    _need(flops > 0 and bandwidth > 0 and n >= 2 and width >= 1, "flops, bandwidth, width must be positive and n >= 2")
    compute = compute_overhead + (24.0 * width * width + 4.0 * seq * width) * tokens / flops
    _need(latency >= 0 and compute_overhead >= 0, "latency and compute_overhead must be >= 0 seconds")
    gather = latency + bytes_per_param * 12.0 * width * width * (n - 1) / n / bandwidth
    return compute / gather


def exposed_comm(fwd, bwd, gather, reduce_scatter, *, backward_gather=None) -> tuple[float, float]:
    """Seconds of communication a sharded step leaves exposed, ``(forward, backward)``, played out unit by
    unit on FSDP's schedule (notebook 05, section 4; exercise 05.2 asks the student to write it).

    One entry per unit, in forward order: ``fwd[i]`` and ``bwd[i]`` its forward and backward compute,
    ``gather[i]`` its all-gather, ``reduce_scatter[i]`` its gradients' reduce-scatter (seconds). Two
    streams: compute runs one unit at a time; communication runs one collective at a time, in the order
    they were issued (on NCCL "any collectives, even if issued from different streams, contend for the same
    per-device NCCL stream": ``BackwardPrefetch``'s docstring, ``torch/distributed/fsdp/api.py``, torch 2.13).

    - Forward: unit 0's all-gather starts at 0; unit i+1's is issued when unit i starts computing (one
      unit prefetched: at most two gathered at once); a unit computes once its gather and the unit
      before it are done.
    - Backward: the units in reverse order, each gathered again (``backward_gather``, ``gather`` by
      default: FULL_SHARD freed it after its forward; 0 for a unit kept gathered, as SHARD_GRAD_OP keeps
      every unit and FSDP2 its root), prefetched the same way; a unit's reduce-scatter is issued when its
      backward compute ends, queued behind what was issued before. The pass ends when its compute and its
      last reduce-scatter are both done.

    Exposed = the pass's end minus its compute. The first unit's gather always shows (nothing runs before
    it), and so does the last unit's reduce-scatter less what follows it. Both planners price a step's
    gathers and reduce-scatters with this (``implementations._unit_comm``, ``price.step_time``).
    """
    n = len(fwd)
    back = gather if backward_gather is None else backward_gather
    lists = {"bwd": bwd, "gather": gather, "reduce_scatter": reduce_scatter, "backward_gather": back}
    _need(all(len(v) == n for v in lists.values()), "give fwd, bwd, gather, reduce_scatter one entry per unit each")
    forward = _one_pass(list(fwd), list(gather), [0.0] * n)
    backward = _one_pass(list(bwd)[::-1], list(back)[::-1], list(reduce_scatter)[::-1])
    return forward, backward


def _one_pass(compute: list, gathers: list, scatters: list) -> float:
    """One pass of ``exposed_comm`` over units in the order they run: seconds beyond its compute."""
    if not compute:
        return 0.0
    comm = ready = gathers[0]  # the communication stream is free at ``comm``; the next unit's gather ends at ``ready``
    done = 0.0  # the compute stream is free at ``done``
    for i, seconds in enumerate(compute):
        start = max(ready, done)
        if i + 1 < len(compute):  # prefetch: the next unit's gather is issued as this unit starts
            comm = ready = max(comm, start) + gathers[i + 1]
        done = start + seconds
        comm = max(comm, done) + scatters[i]  # this unit's gradients, issued when its compute ends
    return float(max(done, comm) - sum(compute))
