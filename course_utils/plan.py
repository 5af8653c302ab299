"""Choosing a data-parallel strategy: memory, overlap and networks (introduced in notebook 05).

The decision rule of the course (the lesson on the stages, and the ZeRO paper's §5 and §7):

1. Compute what each strategy needs per GPU: model states (``memory.model_state_bytes``),
   activations (the paper's 12·h·b·s·L rule; sharding never touches them) and buffers
   (communication buckets, or the gathered block of stage 3).
2. Pick the lowest-numbered stage that fits with headroom: plain DP, then stage 1, then 2.
3. Stage 3 (or HSDP: stage 3 inside a node, replicas across nodes) only when nothing lower
   fits; its extra all-gathers (3Ψ instead of 2Ψ per step) are free only when they hide
   behind each block's compute.
4. Offload (optimizer state in host memory) turns an impossible run into a slow one: slow because
   the CPU runs the optimizer step, not because of PCIe. Each library offloads something else
   (``offload_modes``: DeepSpeed's ZeRO-Offload and ZeRO-3 ``offload_optimizer``, FSDP2's
   ``CPUOffloadPolicy``, ZeRO-Infinity's NVMe).
5. If even that does not fit, the limit is not the model states: activations, or a single
   layer that must be gathered whole on one GPU. No data-parallel strategy helps then.

Symbols: Ψ parameters, K optimizer bytes per parameter, Nd data-parallel degree, Nm
model-parallel degree; h width, L layers, s sequence length, b micro-batch per GPU.

Everything here is arithmetic on the inputs: it starts no process (the run that measures this
host's rates, ``labs.lab05.block_overlap_worker``, lives with notebook 05's experiments).

A time model is a model: per-GPU FLOP/s you can actually reach, ring collectives whose speed
is that of the slowest link they cross, overlap as "hidden if shorter than the compute beside
it". Good enough to see which side of a crossover a run sits on, not to predict seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, field

from . import memory
from .errors import CourseInputError
from .units import GB, fmt_count, parse_bytes, parse_count
from .validate import check_values

#: Strategies the planner weighs, in the order it prefers them when they fit.
STRATEGIES = ("ddp", "zero1", "zero2", "hsdp", "zero3", "zero2_offload", "zero3_offload")
#: Strategy names as the field says them (PyTorch FSDP's names in brackets).
STRATEGY_NAMES = {
    "ddp": "plain DP (DDP, NO_SHARD)",
    "zero1": "stage 1 (P_os)",
    "zero2": "stage 2 (P_os+g, SHARD_GRAD_OP)",
    "zero3": "stage 3 (P_os+g+p, FULL_SHARD)",
    "hsdp": "HSDP (HYBRID_SHARD: stage 3 per shard group)",
    "zero2_offload": "stage 2 + optimizer offload (ZeRO-Offload)",
    "zero3_offload": "stage 3 + optimizer offload (DeepSpeed ZeRO-3)",
}
#: The recommendation when nothing fits.
NOTHING_FITS = (
    "no data-parallel strategy fits: activations / a single FSDP unit are the limit; use activation "
    "checkpointing, a smaller micro-batch, context (sequence) parallelism for long sequences, smaller "
    "FSDP units, tensor or pipeline parallelism"
)

#: PyTorch DDP's default gradient bucket (bucket_cap_mb = 25); two are alive while one is reduced.
BUCKET_BYTES = 25 * 10**6
#: Head dimension used when heads are not given (width / 128 heads, as in GPT-3 and Llama).
HEAD_DIM = 128
#: Widths synthesized from Ψ alone are multiples of this (two heads), like published models' widths.
WIDTH_STEP = 2 * HEAD_DIM


# ---------------------------------------------------------------------------------------------
# Inputs: the model and the cluster
# ---------------------------------------------------------------------------------------------


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise CourseInputError(message)


def _whole(name: str, value, minimum: int = 1) -> int:
    _need(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be a whole number >= {minimum}, got {value!r}",
    )
    return value


@dataclass(frozen=True)
class ModelSpec:
    """The transformer being planned (notebook 05).

    ``params`` is Ψ; ``layers`` (L), ``width`` (h), ``heads`` and ``vocab`` give the shape that
    sets activations and the size of one block; ``seq`` (s) and ``micro_batch`` (b, per
    data-parallel replica) the work in flight; ``checkpointing`` activation checkpointing.
    """

    params: float
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    checkpointing: bool

    @property
    def block_params(self) -> float:
        """One transformer block: attention 4h² + 4h, MLP 8h² + 5h, two norms 4h: 12h² + 13h."""
        return shape_block_params(self.width)

    @property
    def embedding_params(self) -> float:
        return float(self.vocab * self.width)

    @property
    def largest_unit_params(self) -> float:
        """The largest unit stage 3 gathers at once: one block, or the token embedding if bigger."""
        return max(self.block_params, self.embedding_params)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch, b·s."""
        return self.micro_batch * self.seq


def shape_block_params(width: int) -> float:
    """Parameters of one GPT block of width h: 12h² + 13h (notebook 05)."""
    return 12.0 * width * width + 13.0 * width


def shape_params(layers: int, width: int, vocab: int) -> float:
    """Ψ of a GPT of L blocks of width h with a vocabulary of V tokens (tied head):
    L(12h² + 13h) + V·h + 2h (notebook 05)."""
    return layers * shape_block_params(width) + vocab * width + 2.0 * width


def model_spec(
    params=None,
    *,
    layers: int | None = None,
    width: int | None = None,
    heads: int | None = None,
    vocab: int = 32000,
    seq: int = 2048,
    micro_batch: int = 1,
    checkpointing: bool = True,
) -> ModelSpec:
    """A ``ModelSpec`` from Ψ alone, from a shape, or from both (they must agree within 25%) (notebook 05).

    From Ψ alone the shape is GPT-like: width h ≈ (128Ψ/12)^(1/3) (so that L ≈ h/128, the aspect
    of GPT-3 and Llama) rounded to a multiple of 256, as published widths are (an even number of
    128-wide heads: 7B gives h = 4096 and 32 heads, 13B 5120 and 40, 175B 12288 and 96), then
    L = (Ψ − V·h) / (12h² + 13h).
    Raises CourseInputError for a model that cannot exist (non-positive sizes, heads that do not
    divide the width, a Ψ too small for its own vocabulary, a Ψ that contradicts the shape).
    """
    vocab = _whole("vocab", vocab)
    seq = _whole("seq", seq)
    micro_batch = _whole("micro-batch", micro_batch)
    if params is not None:
        params = parse_count(params, name="params")
    if layers is not None or width is not None:
        _need(layers is not None and width is not None, "give both layers and width (or neither, and Ψ alone)")
        layers, width = _whole("layers", layers), _whole("width", width)
        implied = shape_params(layers, width, vocab)
        if params is None:
            params = implied
        else:
            _need(
                0.75 <= params / implied <= 1.25,
                f"a model that cannot exist: {layers} layers of width {width} with a {vocab}-token vocabulary "
                f"have {fmt_count(implied)} parameters, not {fmt_count(params)}; drop --params or fix the shape",
            )
    else:
        _need(params is not None, "give the model: params (Ψ), or layers and width")
        width = max(HEAD_DIM, int(round((HEAD_DIM * params / 12.0) ** (1 / 3) / WIDTH_STEP)) * WIDTH_STEP)
        body = params - vocab * width
        _need(
            body >= 0.5 * shape_block_params(width),
            f"a model that cannot exist: {fmt_count(params)} parameters is less than a {vocab}-token vocabulary "
            f"of width {width} needs ({fmt_count(vocab * width)}); give a larger --params or a smaller --vocab",
        )
        layers = max(1, int(round(body / shape_block_params(width))))
    if heads is None:
        heads = max(1, width // HEAD_DIM) if width % HEAD_DIM == 0 else 1
    heads = _whole("heads", heads)
    _need(width % heads == 0, f"a model that cannot exist: width {width} does not divide into {heads} heads")
    return ModelSpec(float(params), layers, width, heads, vocab, seq, micro_batch, bool(checkpointing))


@dataclass(frozen=True)
class Cluster:
    """The machines (notebook 05). Bandwidths in bytes/s, memory in bytes, compute in FLOP/s.

    ``intra_bw``: per GPU inside a node (NVLink-class); ``inter_bw``: per node between nodes
    (all its network cards together); ``pcie_bw``: per GPU to host memory; ``hbm_bw``: a GPU's
    own memory; ``host_bw``: a node's CPU memory bandwidth (the CPU optimizer step of offload);
    ``nvme_bw``: a node's NVMe drives together (ZeRO-Infinity's offload target; one PCIe 4.0 drive reads
    about 7 GB/s, so the default assumes a few striped);
    ``flops``: achievable 16-bit FLOP/s per GPU (well below the data-sheet peak); ``mp``: Nm;
    ``reserve``: the fraction of GPU memory kept free for the allocator, CUDA context and
    fragmentation.
    """

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_mem: float = 80 * GB
    intra_bw: float = 200e9
    inter_bw: float = 50e9
    flops: float = 200e12
    pcie_bw: float = 25e9
    hbm_bw: float = 2e12
    host_mem: float = 1000 * GB
    host_bw: float = 100e9
    mp: int = 1
    reserve: float = 0.10
    nvme_bw: float = 25e9

    def __post_init__(self):
        check_values("plan", self)  # the stated ranges (course_utils.validate): nodes, GPUs per node, Nm
        _whole("gpus-per-node", self.gpus_per_node)
        _whole("nodes", self.nodes)
        _whole("mp (Nm)", self.mp)
        for name in ("gpu_mem", "intra_bw", "inter_bw", "flops", "pcie_bw", "hbm_bw", "host_mem", "host_bw", "nvme_bw"):
            value = getattr(self, name)
            _need(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                f"{name.replace('_', '-')} must be a positive number, got {value!r}",
            )
        _need(0 <= self.reserve < 1, f"reserve must be a fraction in [0, 1), got {self.reserve!r}")
        _need(
            self.gpus % self.mp == 0,
            f"mp (Nm) = {self.mp} must divide the {self.gpus} GPUs into whole data-parallel replicas",
        )

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def nd(self) -> int:
        """Nd: data-parallel replicas, GPUs / Nm."""
        return self.gpus // self.mp

    @property
    def usable(self) -> float:
        """GPU bytes a plan may fill: ``gpu_mem`` less the ``reserve``."""
        return self.gpu_mem * (1 - self.reserve)


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
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
    bw = min(cluster.intra_bw, cluster.inter_bw) if spans_nodes else cluster.intra_bw
    return factor * nbytes * (n - 1) / n / bw


def network_step(strategy: str, params: float, cluster: Cluster, *, bytes_per_value: float = memory.GRAD_BYTES) -> dict:
    """What one step puts on the links between nodes, in the ring model above (notebook 05).

    Returns ``cross_node_bytes``: ring bytes one GPU sends per step in collectives whose group spans
    nodes (what ``instrument.CommCounter`` measures as ``cross_node_sent_bytes``), and ``network_s``:
    how long those collectives keep the node's link (``inter_bw``) busy, nothing hidden behind
    compute. With P = ``bytes_per_value``·Ψ/Nm, Nd GPUs, n per node:

    - ddp: one all-reduce of P over Nd, 2(Nd−1)/Nd·P; stages 1, 2: a reduce-scatter and an all-gather,
      the same bytes;
    - zero3 (FULL_SHARD): two all-gathers and one reduce-scatter over Nd, 3(Nd−1)/Nd·P;
    - hsdp: gathers and reduce-scatters inside the node (nothing across); across, an all-reduce of
      its P/n shard over the nodes, 2(P/n)(nodes−1)/nodes, and the node's n GPUs run those n
      rings side by side over the same link (hence ``ring_time`` of n·P/n = P, as ``plan`` times it).
    """
    _need(strategy in STRATEGIES, f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    p = bytes_per_value * params / cluster.mp
    nd, nodes, n = cluster.nd, cluster.nodes, _hsdp_shard(cluster, None)  # HSDP: one node's GPUs per shard group
    if nodes == 1:
        return {"cross_node_bytes": 0.0, "network_s": 0.0}
    if strategy == "hsdp":
        return {
            "cross_node_bytes": 2 * (p / n) * (nodes - 1) / nodes,
            "network_s": ring_time(p, nd // n, cluster, spans_nodes=True, kind="all_reduce"),
        }
    if strategy in ("zero3", "zero3_offload"):
        return {
            "cross_node_bytes": 3 * p * (nd - 1) / nd,
            "network_s": 2 * ring_time(p, nd, cluster, spans_nodes=True)
            + ring_time(p, nd, cluster, spans_nodes=True, kind="reduce_scatter"),
        }
    return {
        "cross_node_bytes": 2 * p * (nd - 1) / nd,
        "network_s": ring_time(p, nd, cluster, spans_nodes=True, kind="all_reduce"),
    }


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


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass
class StrategyPlan:
    """One strategy's numbers per GPU (notebook 05). Bytes, seconds; ``block`` is None for
    strategies that do not gather parameters block by block."""

    strategy: str
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    host_bytes: float  # bytes this GPU parks in host memory (offload)
    fits: bool
    headroom: float  # usable GPU bytes left (negative: over by that much)
    why_not: str  # empty when it fits
    link: str  # the slowest link its collectives cross
    step_comm_bytes: float  # bytes each GPU receives over the network/NVLink per step
    pcie_bytes: float  # bytes each GPU moves to/from host per step (offload)
    compute_s: float
    exposed_comm_s: float
    step_s: float
    block: dict | None = field(default=None)
    shard_size: int | None = None  # HSDP: GPUs per shard group (the planner picks it)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(model_states=self.model_states, total=self.total)
        return d


@dataclass
class Plan:
    """What ``plan()`` returns (notebook 05): inputs, one ``StrategyPlan`` per strategy, the
    recommendation and its one-sentence reason."""

    model: ModelSpec
    cluster: Cluster
    k: float
    strategies: dict
    recommendation: dict
    limits: dict
    offload: dict = field(default_factory=dict)  # offload_modes(): each library's offload, under its own name

    def to_dict(self) -> dict:
        return {
            "model": asdict(self.model),
            "cluster": {**asdict(self.cluster), "network": network_class(self.cluster.inter_bw)},
            "k": self.k,
            "strategies": {s: p.to_dict() for s, p in self.strategies.items()},
            "recommendation": dict(self.recommendation),
            "limits": dict(self.limits),
            "offload": {name: dict(row) for name, row in self.offload.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _applicable(strategy: str, cluster: Cluster) -> bool:
    if strategy == "hsdp":  # needs several nodes, and at least 2 data-parallel GPUs per node to shard over
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


def _hsdp_shard(cluster: Cluster, shard_size: int | None) -> int:
    return shard_size or cluster.gpus_per_node // cluster.mp


def memory_breakdown(
    model: ModelSpec, cluster: Cluster, strategy: str, *, k: float = memory.ADAM_MIXED_K, shard_size: int | None = None
) -> dict:
    """Bytes per GPU a strategy needs, split into weights, gradients, optimizer (the model states),
    activations and buffers, plus what it parks in host memory (notebook 05; notebook 05b compares
    its measured peaks with this).

    Model states follow the paper with Ψ/Nm per GPU; HSDP shards over ``shard_size`` data-parallel
    GPUs (one node's by default); offload moves the K·Ψ optimizer bytes to the host. Activations: the paper's rule
    divided by Nm (as with ZeRO-R's partitioned activations). Buffers: two 25 MB gradient buckets
    for DP and stages 1-2; for stage 3 and HSDP, the largest unit gathered in 16-bit twice (the
    current block and the prefetched next one) plus its unsharded 16-bit gradient.
    """
    _need(strategy in STRATEGIES, f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    p = model.params / cluster.mp
    nd = cluster.nd
    shard = _hsdp_shard(cluster, shard_size) if strategy == "hsdp" else nd
    sharded = {
        "ddp": (),
        "zero1": ("optimizer",),
        "zero2": ("optimizer", "gradients"),
        "zero3": ("optimizer", "gradients", "weights"),
        "hsdp": ("optimizer", "gradients", "weights"),
        "zero2_offload": ("optimizer", "gradients"),
        "zero3_offload": ("optimizer", "gradients", "weights"),
    }[strategy]
    full = {"weights": memory.WEIGHT_BYTES * p, "gradients": memory.GRAD_BYTES * p, "optimizer": k * p}
    held = {part: full[part] / shard if part in sharded else full[part] for part in full}
    host = 0.0
    if strategy.endswith("_offload"):
        host, held["optimizer"] = held["optimizer"], 0.0
    activations = (
        memory.activation_bytes(
            model.width, model.micro_batch, model.seq, model.layers, checkpointing=model.checkpointing
        )
        / cluster.mp
    )
    if "weights" in sharded:
        buffers = 3 * memory.WEIGHT_BYTES * model.largest_unit_params / cluster.mp
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


def _block_overlap(model: ModelSpec, cluster: Cluster, strategy: str, shard_size: int | None = None) -> dict | None:
    if strategy not in ("zero3", "hsdp", "zero3_offload"):
        return None
    n = _hsdp_shard(cluster, shard_size) if strategy == "hsdp" else cluster.nd
    spans = n > cluster.gpus_per_node // cluster.mp if strategy == "hsdp" else cluster.nodes > 1
    fwd = block_flops(model) / cluster.mp / cluster.flops
    bwd = (3.0 if model.checkpointing else 2.0) * fwd  # backward is 2x forward; checkpointing recomputes 1x
    nbytes = memory.WEIGHT_BYTES * model.block_params / cluster.mp
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


def _time(
    model: ModelSpec, cluster: Cluster, strategy: str, k: float, block: dict | None, shard_size: int | None = None
):
    """(link, network bytes per GPU, PCIe bytes per GPU, compute s, exposed communication s)."""
    p = model.params / cluster.mp
    grad_bytes = memory.GRAD_BYTES * p
    fwd_block = block_flops(model) / cluster.mp / cluster.flops
    head = 6.0 * model.tokens * model.vocab * model.width / cluster.mp / cluster.flops
    fwd_all = model.layers * fwd_block + head / 3
    bwd_all = model.layers * fwd_block * (3.0 if model.checkpointing else 2.0) + 2 * head / 3
    compute = fwd_all + bwd_all
    nd, spans = cluster.nd, cluster.nodes > 1
    link = "network" if spans else "NVLink (intra-node)"
    if nd == 1 and strategy != "hsdp":
        link = "none (one replica)"
    pcie = 0.0
    if strategy == "ddp":
        t = ring_time(grad_bytes, nd, cluster, spans_nodes=spans, kind="all_reduce")
        exposed, volume = max(0.0, t - bwd_all), 2 * grad_bytes * (nd - 1) / nd
    elif strategy in ("zero1", "zero2", "zero2_offload"):
        rs = ring_time(grad_bytes, nd, cluster, spans_nodes=spans, kind="reduce_scatter")
        ag = ring_time(memory.WEIGHT_BYTES * p, nd, cluster, spans_nodes=spans)
        # the reduce-scatter overlaps the backward pass, the weights' all-gather the next forward pass
        exposed, volume = max(0.0, rs - bwd_all) + max(0.0, ag - fwd_all), 2 * grad_bytes * (nd - 1) / nd
    else:  # zero3, hsdp, zero3_offload: gathers block by block
        L = model.layers
        exposed = (
            block["gather_s"]
            + L * max(0.0, block["gather_s"] - block["fwd_compute_s"])
            + L * max(0.0, block["gather_s"] + block["reduce_scatter_s"] - block["bwd_compute_s"])
        )
        n = _hsdp_shard(cluster, shard_size) if strategy == "hsdp" else nd
        volume = 3 * grad_bytes * (n - 1) / n
        link = block["link"]
        if strategy == "hsdp":  # replicas (one per shard group) all-reduce their gradient shards in the backward
            replicas = nd // n
            shard = grad_bytes / n
            ar = ring_time(shard * n, replicas, cluster, spans_nodes=True, kind="all_reduce")
            exposed += max(0.0, ar - bwd_all)
            volume += 2 * shard * (replicas - 1) / replicas
            link = f"{block['link']} for gathers, network for the gradient all-reduce"
    if strategy.endswith("_offload"):
        # 16-bit gradients down to the host, updated 16-bit weights back up, over each GPU's PCIe;
        # the CPU runs Adam over its shard: reads and writes K bytes of state, reads the gradient,
        # writes the weight (K·2 + 4 bytes per parameter), sharing the node's memory bandwidth.
        pcie = (memory.GRAD_BYTES + memory.WEIGHT_BYTES) * p / nd
        cpu = (2 * k + 4) * p / nd * cluster.gpus_per_node / cluster.host_bw
        exposed += pcie / cluster.pcie_bw + cpu
    return link, volume, pcie, compute, exposed


def plan(
    model: ModelSpec | None = None, cluster: Cluster | None = None, *, k: float = memory.ADAM_MIXED_K, **model_kwargs
) -> Plan:
    """Weigh every strategy for a model on a cluster and recommend one (notebook 05).

    ``plan(model_spec(7e9), Cluster())`` or ``plan(params=7e9)``. Returns a ``Plan`` whose
    ``strategies[s]`` holds memory per GPU (``memory_breakdown``), fit and headroom, per-block
    compute against all-gather time, step communication and an estimated step time, and whose
    ``recommendation`` is ``{"strategy": one of STRATEGIES or "none", "reason": one sentence}``.
    """
    if model is None:
        model = model_spec(**model_kwargs)
    elif model_kwargs:
        raise CourseInputError("give either a ModelSpec or model keyword arguments, not both")
    cluster = cluster or Cluster()
    _need(math.isfinite(k) and k >= 0, f"k must be a number of bytes >= 0, got {k!r}")
    strategies = {}
    for s in STRATEGIES:
        if not _applicable(s, cluster):
            continue
        shard_size = None
        if s == "hsdp":  # the smallest shard group that fits: the fewest gathers over the network
            sizes = hsdp_shard_sizes(cluster)
            shard_size = next(
                (n for n in sizes if memory_breakdown(model, cluster, s, k=k, shard_size=n)["total"] <= cluster.usable),
                sizes[0],
            )
        mem = memory_breakdown(model, cluster, s, k=k, shard_size=shard_size)
        block = _block_overlap(model, cluster, s, shard_size)
        link, volume, pcie, compute, exposed = _time(model, cluster, s, k, block, shard_size)
        headroom = cluster.usable - mem["total"]
        why = ""
        if headroom < 0:
            why = f"needs {mem['total'] / GB:.1f} GB of {cluster.usable / GB:.1f} GB usable"
        if s.endswith("_offload") and mem["host_bytes"] * cluster.gpus_per_node > cluster.host_mem:
            why = (why + "; " if why else "") + (
                f"host memory: needs {mem['host_bytes'] * cluster.gpus_per_node / GB:.0f} GB per node "
                f"of {cluster.host_mem / GB:.0f} GB"
            )
        strategies[s] = StrategyPlan(
            s,
            mem["weights"],
            mem["gradients"],
            mem["optimizer"],
            mem["activations"],
            mem["buffers"],
            mem["host_bytes"],
            not why,
            headroom,
            why,
            link,
            volume,
            pcie,
            compute,
            exposed,
            compute + exposed,
            block,
            shard_size,
        )
    limits = _limits(model, cluster, k)
    return Plan(
        model,
        cluster,
        k,
        strategies,
        _recommend(model, cluster, k, strategies, limits),
        limits,
        offload_modes(model, cluster, k=k, plans=strategies),
    )


def _limits(model: ModelSpec, cluster: Cluster, k: float) -> dict:
    """The two things no sharding removes, and the GPUs stage 3 would need (notebook 05)."""
    acts = (
        memory.activation_bytes(
            model.width, model.micro_batch, model.seq, model.layers, checkpointing=model.checkpointing
        )
        / cluster.mp
    )
    acts_ckpt = (
        memory.activation_bytes(model.width, model.micro_batch, model.seq, model.layers, checkpointing=True)
        / cluster.mp
    )
    unit = memory_breakdown(model, cluster, "zero3", k=k)["buffers"]
    layer_acts = memory.activation_bytes(model.width, model.micro_batch, model.seq, 1) / cluster.mp
    # one layer at its moment of execution: its gathered weights and gradient, and its activations
    single_layer = 2 * memory.WEIGHT_BYTES * model.largest_unit_params / cluster.mp + layer_acts
    # wrapped per linear layer, FSDP's largest unit is one matrix: the MLP's h x 4h
    single_matrix = 2 * memory.WEIGHT_BYTES * 4.0 * model.width**2 / cluster.mp + layer_acts
    room = cluster.usable - acts - unit
    per_replica = (memory.WEIGHT_BYTES + memory.GRAD_BYTES + k) * model.params / cluster.mp
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


#: Step times within this fraction of the fastest count as a tie, and a tie goes to the lower stage
#: (less sharding: fewer collectives, simpler to run and to debug).
TIE_MARGIN = 0.05

#: What to run in PyTorch for each strategy (checked against torch 2.13's FSDP2 and ZeRO sources).
PYTORCH = {
    "ddp": "torch.nn.parallel.DistributedDataParallel (FSDP1's NO_SHARD is the same layout)",
    "zero1": (
        "FSDP has no stage 1: DDP + torch.distributed.optim.ZeroRedundancyOptimizer (notebook 03; it "
        "all-reduces full gradients, then broadcasts each owner's updated parameters), or DeepSpeed's "
        "ZeRO stage 1"
    ),
    "zero2": (
        "fully_shard(block, reshard_after_forward=False) on every block and the root (FSDP1: SHARD_GRAD_OP); "
        "FSDP2 keeps the parameters unsharded from forward to backward, stage 2's traffic"
    ),
    "zero3": "fully_shard(block) on every block, then fully_shard(model) (FSDP1: FULL_SHARD)",
    "hsdp": (
        "fully_shard(..., mesh=init_device_mesh('cuda', (replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard'))) (FSDP1: HYBRID_SHARD)"
    ),
    "zero2_offload": (
        "DeepSpeed's ZeRO-Offload (stage 2, optimizer state and Adam on the CPU); FSDP2 has no optimizer-only offload"
    ),
    "zero3_offload": (
        "DeepSpeed's ZeRO-3 with offload_optimizer (optimizer state and Adam on the CPU). FSDP2's "
        "CPUOffloadPolicy is not this: it keeps parameters and gradients on the CPU too and copies "
        "each unit's shard to the GPU for every gather (notebook 04)"
    ),
}

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


def _recommend(model: ModelSpec, cluster: Cluster, k: float, plans: dict, limits: dict) -> dict:
    """Among the strategies that fit, the fastest by estimated step time; a tie within TIE_MARGIN
    goes to the lower stage (the order of STRATEGIES). The reason says what it beat and by how much."""

    def gb(x):
        return f"{x / GB:.1f} GB"

    def name(s):
        return STRATEGY_NAMES[s].split(" (")[0]

    fit = [s for s in STRATEGIES if s in plans and plans[s].fits]
    times = {s: plans[s].step_s for s in fit}
    if fit:
        fastest = min(times.values())
        s = next(s for s in fit if times[s] <= fastest * (1 + TIE_MARGIN))  # the lowest stage within the margin
        p = plans[s]
        others = sorted((t, o) for o, t in times.items() if o != s)
        runner_up = others[0][1] if others else None
        head = f"{gb(p.total)} per GPU with {gb(p.headroom)} to spare"
        if runner_up is None:
            unfit = [o for o in STRATEGIES if o in plans and o != s and not plans[o].fits]
            floors = ", ".join(f"{name(o)} {gb(plans[o].total)}" for o in unfit[:3])
            beat = f"it is the only strategy that fits ({floors} do not)"
        else:
            t2 = times[runner_up]
            if t2 <= times[s] * (1 + TIE_MARGIN):
                beat = (
                    f"{name(runner_up)} is as fast ({t2:.3g} s, within {TIE_MARGIN:.0%}), and a tie goes to the "
                    f"lower stage"
                )
            else:
                beat = (
                    f"it beats the runner-up, {name(runner_up)} ({t2:.3g} s), by {t2 - times[s]:.3g} s a step "
                    f"({t2 / times[s] - 1:.0%})"
                )
        reason = f"{name(s)} fits ({head}) at an estimated {times[s]:.3g} s a step; {beat}."
        if p.block:
            b = p.block
            hidden = b["hides_fwd"] and b["hides_bwd"]
            reason += f" Each block's all-gather ({b['gather_s'] * 1e3:.3g} ms over {b['link']}) " + (
                "hides behind its compute."
                if hidden
                else f"does not hide behind its compute ({b['fwd_compute_s'] * 1e3:.3g} ms forward)."
            )
        if s.endswith("_offload"):
            more = limits["zero3_min_nodes"]
            reason += " Offload turns an impossible run into a slow one" + (
                f"; with {more} nodes ({more * cluster.gpus_per_node} GPUs) stage 3 would fit without "
                "it, the better answer."
                if more
                else "."
            )
        practice = ""
        z3 = plans.get("zero3")
        if (
            s in ("ddp", "zero1", "zero2")
            and z3 is not None
            and z3.fits
            and z3.block
            and z3.block["hides_fwd"]
            and z3.block["hides_bwd"]
        ):
            practice = (
                f"Common practice often runs FULL_SHARD here anyway: its gathers hide, and the "
                f"{gb(z3.headroom - p.headroom)} per GPU it frees buys a larger micro-batch."
            )
        pytorch = PYTORCH[s]
        if s == "hsdp":
            groups = p.shard_size // (cluster.gpus_per_node // cluster.mp)
            reason += (
                f" Its shard groups are {p.shard_size} GPUs ({groups} node{'s' if groups > 1 else ''}), the "
                "smallest that fits: gathers cross the network only if a group spans nodes."
            )
            pytorch = pytorch.replace("(replicas, shard_size)", f"({cluster.nd // p.shard_size}, {p.shard_size})")
        return {
            "strategy": s,
            "reason": reason,
            "pytorch": pytorch,
            "runner_up": runner_up,
            "step_s": dict(times),
            "tie_margin": TIE_MARGIN,
            "practice": practice,
        }
    causes = []
    if limits["activations_limit"]:
        causes.append(f"activations alone need {gb(limits['activations'])} per GPU")
    if limits["single_layer_limit"]:
        causes.append(
            f"one gathered unit (a block) needs {gb(limits['single_layer'])}"
            + (
                f", and even one weight matrix gathered needs {gb(limits['single_matrix'])}: tensor parallelism splits it"
                if limits["single_matrix_limit"]
                else f"; wrapped per linear layer the largest unit is one h x 4h matrix, {gb(limits['single_matrix'])}, "
                "which fits"
            )
        )
    if limits["activations_limit"] and model.seq >= 32768:
        causes.append(f"at sequence length {model.seq:,} context (sequence) parallelism is the standard remedy")
    if not causes:
        more = limits["zero3_min_nodes"]
        causes.append(
            f"on {cluster.gpus} GPUs the model states do not fit even with offload"
            + (f"; stage 3 needs {more} nodes ({more * cluster.gpus_per_node} GPUs)" if more else "")
        )
    hint = ""
    if not model.checkpointing and limits["activations_if_checkpointed"] < limits["activations"]:
        hint = f"; with checkpointing activations would be {gb(limits['activations_if_checkpointed'])}"
    return {
        "strategy": "none",
        "reason": f"{NOTHING_FITS} ({'; '.join(causes)}{hint}).",
        "pytorch": "none of the data-parallel wrappers: add tensor, pipeline or context (sequence) parallelism",
        "runner_up": None,
        "step_s": {},
        "tie_margin": TIE_MARGIN,
        "practice": "",
    }


def offload_arithmetic(psi: float, nd: int, cluster: Cluster | None = None) -> dict:
    """Bytes each GPU moves over PCIe per step when offloading, and the time against the same
    bytes read from its own HBM (notebook 05).

    Optimizer-state offload: 16-bit gradients go down, updated 16-bit weights come back: 4Ψ/Nd
    bytes, once per step (it can overlap the backward pass). Parameter offload adds the 16-bit
    weights fetched for the forward pass and again for the backward pass, 4Ψ/Nd more, on the
    critical path of every layer.
    """
    cluster = cluster or Cluster()
    _need(psi > 0 and nd >= 1, "psi must be positive and nd at least 1")
    rows = {}
    for name, nbytes in (("optimizer_offload", 4.0 * psi / nd), ("parameter_offload", 8.0 * psi / nd)):
        rows[name] = {"bytes": nbytes, "pcie_s": nbytes / cluster.pcie_bw, "hbm_s": nbytes / cluster.hbm_bw}
    rows["hbm_over_pcie"] = cluster.hbm_bw / cluster.pcie_bw
    return rows


#: The four ways to park model states off the GPU, each under the name its library gives it.
OFFLOAD_MODES = ("zero_offload", "zero3_offload", "fsdp2_cpu_offload", "zero_infinity")
OFFLOAD_NAMES = {
    "zero_offload": "DeepSpeed ZeRO-Offload (stage 2, offload_optimizer to CPU)",
    "zero3_offload": "DeepSpeed ZeRO-3, offload_optimizer to CPU",
    "fsdp2_cpu_offload": "FSDP2 fully_shard(offload_policy=CPUOffloadPolicy())",
    "zero_infinity": "DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer on NVMe)",
}


def offload_modes(
    model: ModelSpec, cluster: Cluster, *, k: float = memory.ADAM_MIXED_K, plans: dict | None = None
) -> dict:
    """Each library's offload, per GPU: what stays on the GPU, what the host (and NVMe) hold, what
    crosses PCIe (and the NVMe link) per step, and where the optimizer step runs (notebook 05).

    ``plans``: the planner's ``StrategyPlan`` rows, if already computed (``plan()`` passes them).
    With p = Ψ/Nm parameters per model-parallel rank and Nd replicas:

    - ``zero_offload``, DeepSpeed's ZeRO-Offload: the planner's ``zero2_offload`` row. 16-bit
      weights stay whole on every GPU, gradients are reduce-scattered, the K·p/Nd optimizer bytes
      live on the host; per step the 16-bit gradient shard goes down and the updated 16-bit weights
      come back: 4p/Nd over PCIe. DeepSpeed's vectorised CPU Adam runs the step.
    - ``zero3_offload``, DeepSpeed ZeRO-3 with ``offload_optimizer``: the planner's row of that
      name; the same 4p/Nd over PCIe, the same CPU Adam.
    - ``fsdp2_cpu_offload``, FSDP2's ``CPUOffloadPolicy`` (torch 2.13,
      ``_fully_shard/_fsdp_api.py``): parameters, gradients and optimizer state all on the CPU. The
      sharded parameter is the fp32 master copy (``_fsdp_param.py`` copies the shard to the GPU,
      ``.to(device, non_blocking=True)``, before every all-gather, then casts it to ``param_dtype``),
      so a shard crosses PCIe in fp32 for the forward gather and again for the backward one (8p/Nd),
      and the reduced gradient is cast back to fp32 and copied to the host (``_fsdp_collectives.py``,
      4p/Nd): 12p/Nd a step. The host holds 4 + 4 + (K − 4) = K + 4 bytes per parameter shard;
      the GPU only the gathered units, their gradients and the activations. ``torch.optim`` runs the
      step on the CPU tensors.
    - ``zero_infinity``, DeepSpeed ZeRO-Infinity with parameters and optimizer on NVMe: the GPU as
      FSDP2's; NVMe holds the 16-bit weights and the optimizer state, (2 + K)·p/Nd; per step
      the 16-bit shard comes up twice and the gradient goes down over PCIe (6p/Nd), and NVMe reads
      the weights twice, reads and writes the optimizer state and writes the new weights:
      (2·2 + 2K + 2)·p/Nd, at the node's ``nvme_bw`` shared by its GPUs.

    The CPU step is memory-bound: it reads and writes the K bytes of state, reads the gradient and
    writes the weight, (2K + 4)·p/Nd bytes for each of a node's GPUs through the node's
    ``host_bw``. That, not PCIe, is the cost: with Adam's K = 12, 28 bytes of CPU memory traffic per
    parameter against 4 over PCIe, through a link (``host_bw``) only a few times faster.
    ``step_s`` adds PCIe, CPU (and NVMe) time to the GPU-resident strategy's step (stage 2's or
    stage 3's), none of it hidden: an upper bound; ``pcie_s`` is what could hide behind the backward.
    Each row: ``{"name", "base", "gpu_bytes", "host_bytes", "nvme_bytes", "pcie_bytes",
    "nvme_step_bytes", "optimizer_step", "pcie_s", "cpu_step_s", "nvme_s", "step_s", "fits", "why_not"}``.
    """
    plans = plans or {}
    p = model.params / cluster.mp
    nd, g = cluster.nd, cluster.gpus_per_node

    def row_of(strategy):
        if strategy in plans:
            sp = plans[strategy]
            return {
                "total": sp.total,
                "step_s": sp.step_s,
                "compute_s": sp.compute_s,
                "exposed_comm_s": sp.exposed_comm_s,
                "host_bytes": sp.host_bytes,
                "buffers": sp.buffers,
                "activations": sp.activations,
            }
        mem = memory_breakdown(model, cluster, strategy, k=k)
        block = _block_overlap(model, cluster, strategy)
        _, _, _, compute, exposed = _time(model, cluster, strategy, k, block)
        return {
            "total": mem["total"],
            "step_s": compute + exposed,
            "compute_s": compute,
            "exposed_comm_s": exposed,
            "host_bytes": mem["host_bytes"],
            "buffers": mem["buffers"],
            "activations": mem["activations"],
        }

    cpu_s = (2 * k + 4) * p / nd * g / cluster.host_bw
    z3 = row_of("zero3")
    z3_no_cpu = z3["step_s"]  # stage 3 on the GPUs: the step the offloads of stage 3's layout add to
    rows = {}
    for name in ("zero_offload", "zero3_offload"):
        base = row_of("zero2_offload" if name == "zero_offload" else "zero3_offload")
        pcie = (memory.GRAD_BYTES + memory.WEIGHT_BYTES) * p / nd
        rows[name] = {
            "gpu_bytes": base["total"],
            "host_bytes": base["host_bytes"],
            "nvme_bytes": 0.0,
            "pcie_bytes": pcie,
            "nvme_step_bytes": 0.0,
            "pcie_s": pcie / cluster.pcie_bw,
            "cpu_step_s": cpu_s,
            "nvme_s": 0.0,
            "step_s": base["step_s"],
            "optimizer_step": "CPU: DeepSpeed's vectorised CPU Adam over the host's optimizer shard",
            "base": "zero2" if name == "zero_offload" else "zero3",
        }
    on_gpu = z3["activations"] + z3["buffers"]  # nothing resident: the gathered units and the activations
    pcie = (2 * 4.0 + 4.0) * p / nd
    rows["fsdp2_cpu_offload"] = {
        "gpu_bytes": on_gpu,
        "host_bytes": (4.0 + 4.0 + (k - 4.0)) * p / nd,
        "nvme_bytes": 0.0,
        "pcie_bytes": pcie,
        "nvme_step_bytes": 0.0,
        "pcie_s": pcie / cluster.pcie_bw,
        "cpu_step_s": cpu_s,
        "nvme_s": 0.0,
        "step_s": z3_no_cpu + pcie / cluster.pcie_bw + cpu_s,
        "optimizer_step": "CPU: torch.optim on the CPU parameter shards (FSDP2 only moves the tensors)",
        "base": "zero3",
    }
    pcie = (2 * memory.WEIGHT_BYTES + memory.GRAD_BYTES) * p / nd
    nvme_step = (2 * memory.WEIGHT_BYTES + 2 * k + memory.WEIGHT_BYTES) * p / nd
    nvme_s = nvme_step * g / cluster.nvme_bw
    rows["zero_infinity"] = {
        "gpu_bytes": on_gpu,
        "host_bytes": 0.0,
        "nvme_bytes": (memory.WEIGHT_BYTES + k) * p / nd,
        "pcie_bytes": pcie,
        "nvme_step_bytes": nvme_step,
        "pcie_s": pcie / cluster.pcie_bw,
        "cpu_step_s": cpu_s,
        "nvme_s": nvme_s,
        "step_s": z3_no_cpu + pcie / cluster.pcie_bw + cpu_s + nvme_s,
        "optimizer_step": "CPU: DeepSpeed's CPU Adam, its state streamed from NVMe and back",
        "base": "zero3",
    }
    for name, r in rows.items():
        why = []
        if r["gpu_bytes"] > cluster.usable:
            why.append(f"needs {r['gpu_bytes'] / GB:.1f} GB of {cluster.usable / GB:.1f} GB usable on the GPU")
        if r["host_bytes"] * g > cluster.host_mem:
            why.append(
                f"host memory: needs {r['host_bytes'] * g / GB:.0f} GB per node of {cluster.host_mem / GB:.0f} GB"
            )
        r.update(name=OFFLOAD_NAMES[name], fits=not why, why_not="; ".join(why))
    return {name: rows[name] for name in OFFLOAD_MODES}


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
    nbytes = memory.WEIGHT_BYTES * model.block_params / cluster.mp
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
    tokens, width: int, *, flops: float, bandwidth: float, n: int, bytes_per_param: float = 2, seq: int = 0
):
    """A block's forward compute time divided by the all-gather time of its parameters, for
    ``tokens`` = b·s per micro-batch (notebook 05). Above 1 the gather hides.

    compute = (24h² + 4sh)·tokens / FLOP/s; gather = bytes_per_param·12h²·(n − 1)/n / bandwidth.
    With s small next to 6h the width cancels: the crossover sits near
    tokens ≈ FLOP/s · bytes_per_param · (n − 1)/n / (2 · bandwidth), whatever the model's size.
    """
    import numpy as np

    tokens = np.asarray(tokens, dtype=float)
    _need(flops > 0 and bandwidth > 0 and n >= 2 and width >= 1, "flops, bandwidth, width must be positive and n >= 2")
    compute = (24.0 * width * width + 4.0 * seq * width) * tokens / flops
    gather = bytes_per_param * 12.0 * width * width * (n - 1) / n / bandwidth
    return compute / gather


# ---------------------------------------------------------------------------------------------
# Command line: `python -m course_utils plan`
# ---------------------------------------------------------------------------------------------

_BW_UNITS = {
    "": 1e9,
    "GB/s": 1e9,
    "GBps": 1e9,
    "MB/s": 1e6,
    "TB/s": 1e12,
    "Gb/s": 1e9 / 8,
    "Gbps": 1e9 / 8,
    "Gbit/s": 1e9 / 8,
    "Tb/s": 1e12 / 8,
    "Mb/s": 1e6 / 8,
}


def parse_bandwidth(text, *, name: str = "bandwidth") -> float:
    """Bytes per second from ``200GB/s``, ``400Gb/s`` (bits: b), ``100Gbps``, ``2TB/s`` or a bare
    number in GB/s (notebook 05). Raises CourseInputError naming ``name`` otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text) * 1e9
    else:
        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", str(text))
        if not m or m.group(2) not in _BW_UNITS:
            raise CourseInputError(f"{name}: cannot read {text!r}; write e.g. 200GB/s (bytes) or 400Gb/s (bits)")
        value = float(m.group(1)) * _BW_UNITS[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise CourseInputError(f"{name}: must be a positive bandwidth, got {text!r}")
    return value


def plan_arguments(parser) -> None:
    """Arguments of ``python -m course_utils plan`` (notebook 05)."""
    m = parser.add_argument_group("model")
    m.add_argument("--params", help="Ψ, e.g. 7B, 70B, 1.5e9 (or give --layers and --width)")
    m.add_argument("--layers", type=int, help="L: transformer blocks")
    m.add_argument("--width", type=int, help="h: hidden size")
    m.add_argument("--heads", type=int, help="attention heads (default width/128)")
    m.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    m.add_argument("--seq", type=int, default=2048, help="s: sequence length (default 2048)")
    m.add_argument("--micro-batch", type=int, default=1, help="b: sequences per GPU per micro-batch (default 1)")
    m.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing on (default) or off (--no-checkpointing)",
    )
    m.add_argument("--k", type=float, default=memory.ADAM_MIXED_K, help="K: optimizer bytes per parameter (default 12)")
    c = parser.add_argument_group("cluster")
    d = Cluster()
    c.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node, help="GPUs per node (default 8)")
    c.add_argument("--nodes", type=int, default=d.nodes, help="nodes (default 1)")
    c.add_argument("--gpu-mem", default="80GB", help="memory per GPU (default 80GB; GiB accepted)")
    c.add_argument("--intra-bw", default="200GB/s", help="per-GPU bandwidth inside a node (default 200GB/s)")
    c.add_argument("--inter-bw", default="50GB/s", help="per-node bandwidth between nodes (default 50GB/s = 400Gb/s)")
    c.add_argument("--tflops", type=float, default=d.flops / 1e12, help="achievable TFLOP/s per GPU (default 200)")
    c.add_argument("--pcie-bw", default="25GB/s", help="per-GPU host link (default 25GB/s, PCIe 4.0 x16)")
    c.add_argument("--hbm-bw", default="2TB/s", help="GPU memory bandwidth (default 2TB/s)")
    c.add_argument("--host-mem", default="1000GB", help="CPU memory per node (default 1000GB)")
    c.add_argument(
        "--nvme-bw", default="25GB/s", help="a node's NVMe drives together, for ZeRO-Infinity (default 25GB/s)"
    )
    c.add_argument("--mp", type=int, default=1, help="Nm: model-parallel degree (default 1)")
    c.add_argument("--reserve", type=float, default=d.reserve, help="fraction of GPU memory kept free (default 0.1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _cluster_from_args(args) -> Cluster:
    for name in ("gpus_per_node", "nodes", "mp"):
        value = getattr(args, name)
        _need(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    _need(math.isfinite(args.tflops) and args.tflops > 0, f"--tflops must be positive, got {args.tflops:g}")
    _need(0 <= args.reserve < 1, f"--reserve must be a fraction in [0, 1), got {args.reserve:g}")
    return Cluster(
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        gpu_mem=parse_bytes(args.gpu_mem, name="--gpu-mem"),
        intra_bw=parse_bandwidth(args.intra_bw, name="--intra-bw"),
        inter_bw=parse_bandwidth(args.inter_bw, name="--inter-bw"),
        flops=args.tflops * 1e12,
        pcie_bw=parse_bandwidth(args.pcie_bw, name="--pcie-bw"),
        hbm_bw=parse_bandwidth(args.hbm_bw, name="--hbm-bw"),
        host_mem=parse_bytes(args.host_mem, name="--host-mem"),
        mp=args.mp,
        reserve=args.reserve,
        nvme_bw=parse_bandwidth(getattr(args, "nvme_bw", "25GB/s"), name="--nvme-bw"),
    )


def _model_from_args(args) -> ModelSpec:
    for name in ("layers", "width", "heads", "vocab", "seq", "micro_batch"):
        value = getattr(args, name)
        _need(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    _need(math.isfinite(args.k) and args.k >= 0, f"--k must be a number of bytes >= 0, got {args.k:g}")
    params = parse_count(args.params, name="--params") if args.params is not None else None
    _need(params is not None or (args.layers and args.width), "give --params (e.g. 7B), or --layers and --width")
    return model_spec(
        params,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        micro_batch=args.micro_batch,
        checkpointing=args.checkpointing,
    )


def _label(sp: StrategyPlan) -> str:
    if sp.strategy == "hsdp" and sp.shard_size:
        return f"HSDP (HYBRID_SHARD, shard groups of {sp.shard_size})"
    return STRATEGY_NAMES[sp.strategy]


def format_plan(p: Plan) -> str:
    """The plan as a text table (notebook 05)."""
    m, c = p.model, p.cluster
    lines = [
        f"Model: Ψ = {fmt_count(m.params)} ({m.layers} layers, width {m.width}, {m.heads} heads, vocab {m.vocab}); "
        f"b = {m.micro_batch}, s = {m.seq}, checkpointing {'on' if m.checkpointing else 'off'}; K = {p.k:g}",
        f"Cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs x {c.gpu_mem / GB:g} GB (usable {c.usable / GB:.1f} GB), "
        f"Nm = {c.mp}, Nd = {c.nd}; NVLink {c.intra_bw / 1e9:g} GB/s per GPU, network {c.inter_bw / 1e9:g} GB/s "
        f"per node ({network_class(c.inter_bw)}), {c.flops / 1e12:g} TFLOP/s per GPU",
        "",
        "Memory per GPU, GB (10^9 bytes)",
        f"{'strategy':<46} {'states':>8} {'activ.':>8} {'buffers':>8} {'total':>8} {'headroom':>9}  fits",
    ]
    for sp in p.strategies.values():
        lines.append(
            f"{_label(sp):<46} {sp.model_states / GB:>8.1f} {sp.activations / GB:>8.1f} "
            f"{sp.buffers / GB:>8.2f} {sp.total / GB:>8.1f} {sp.headroom / GB:>9.1f}  "
            f"{'yes' if sp.fits else 'no: ' + sp.why_not}"
        )
    lines += [
        "",
        "Per transformer block (stage 3 family): compute against the all-gather of its parameters",
        f"{'strategy':<46} {'fwd ms':>8} {'gather ms':>10} {'bwd ms':>8} {'gath+RS ms':>11}  hides?  link",
    ]
    for sp in p.strategies.values():
        b = sp.block
        if b:
            lines.append(
                f"{_label(sp):<46} {b['fwd_compute_s'] * 1e3:>8.3g} {b['gather_s'] * 1e3:>10.3g} "
                f"{b['bwd_compute_s'] * 1e3:>8.3g} {(b['gather_s'] + b['reduce_scatter_s']) * 1e3:>11.3g}  "
                f"{'yes' if b['hides_fwd'] and b['hides_bwd'] else 'no':<6}  {b['link']}"
            )
    lines += [
        "",
        "Step: communication per GPU and estimated time",
        f"{'strategy':<46} {'comm GB':>8} {'PCIe GB':>8} {'compute s':>10} {'exposed s':>10} {'step s':>8}",
    ]
    for sp in p.strategies.values():
        lines.append(
            f"{_label(sp):<46} {sp.step_comm_bytes / GB:>8.2f} {sp.pcie_bytes / GB:>8.2f} "
            f"{sp.compute_s:>10.3g} {sp.exposed_comm_s:>10.3g} {sp.step_s:>8.3g}"
        )
    lines += [
        "",
        "Offload, each library's under its own name: per GPU, and per step",
        f"{'offload':<67} {'GPU GB':>7} {'host GB':>8} {'NVMe GB':>8} {'PCIe GB':>8} {'PCIe s':>7} "
        f"{'CPU Adam s':>10} {'NVMe s':>7} {'step s':>7}  fits",
    ]
    for o in p.offload.values():
        lines.append(
            f"{o['name']:<67} {o['gpu_bytes'] / GB:>7.1f} {o['host_bytes'] / GB:>8.1f} "
            f"{o['nvme_bytes'] / GB:>8.1f} {o['pcie_bytes'] / GB:>8.2f} {o['pcie_s']:>7.3g} "
            f"{o['cpu_step_s']:>10.3g} {o['nvme_s']:>7.3g} {o['step_s']:>7.3g}  "
            f"{'yes' if o['fits'] else 'no: ' + o['why_not']}"
        )
    r = p.recommendation
    lines += ["", f"Recommendation: {r['strategy']}", f"Reason: {r['reason']}", f"In PyTorch: {r['pytorch']}"]
    if r.get("practice"):
        lines.append(f"Practice: {r['practice']}")
    return "\n".join(lines)


def plan_command(args) -> int:
    """Print the plan for a model on a cluster (notebook 05)."""
    model = _model_from_args(args)
    cluster = _cluster_from_args(args)
    p = plan(model, cluster, k=args.k)
    print(p.to_json() if args.json else format_plan(p))
    return 0


# ---------------------------------------------------------------------------------------------
# Measured on this host (notebook 05): a block's compute against an all-gather of its parameters
# ---------------------------------------------------------------------------------------------

#: A size is bandwidth-bound when its bytes take at least this many times the latency on the wire (three
#: quarters of its time): nearer the latency, per-call overheads the line does not model show up (a 64 KB
#: gather with bytes/bandwidth just above the latency fell below its measured range here).
BANDWIDTH_DOMINATES = 3.0


def fit_latency_bandwidth(sweep: list) -> dict:
    """Latency and bandwidth of a collective, t = latency + received bytes / bandwidth, fitted from
    ``labs.lab05.block_overlap_worker``'s sweep, and whether the fit explains its points (notebook 05).

    Each size's readings give a median and a range (``instrument.spread``). The fit is least squares in
    relative terms (each point weighs by 1/median², so small sizes count as much as large ones)
    over the sizes where bandwidth dominates: received bytes / bandwidth at least
    ``BANDWIDTH_DOMINATES`` times the latency,
    chosen again after each fit until the choice settles (the three largest sizes if fewer qualify:
    a line through two points would explain them whatever they were).
    A negative latency (noise at the small end) is refitted as zero. ``explains``: every fitted
    size's prediction lies inside that size's measured range.
    Returns ``{"latency_s", "bandwidth", "points": [{"bytes", "received_bytes", "median_s", "min_s",
    "max_s", "n", "predicted_s", "fitted", "within"}], "fitted_bytes", "explains"}``.
    """
    from .instrument import spread

    _need(len(sweep) >= 2, "the fit needs at least two sizes of all-gather readings")
    pts = []
    for r in sorted(sweep, key=lambda r: r["bytes"]):
        n = r["world_size"]
        _need(n >= 2, "a collective over one rank moves nothing: measure with two or more ranks")
        pts.append(
            {
                "bytes": r["bytes"],
                "received_bytes": r["bytes"] * (n - 1) / n,
                **{f"{k}_s" if k != "n" else k: v for k, v in spread(r["readings"]).items()},
            }
        )

    def fit(chosen):
        xs = [p["received_bytes"] for p in chosen]
        ts = [p["median_s"] for p in chosen]
        ws = [1.0 / t**2 for t in ts]
        sw, sx, sxx = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * x * x for w, x in zip(ws, xs))
        st, sxt = sum(w * t for w, t in zip(ws, ts)), sum(w * x * t for w, x, t in zip(ws, xs, ts))
        det = sw * sxx - sx * sx
        a, c = ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det) if det > 0 else (0.0, sxt / sxx)
        if a < 0 or c <= 0:  # noise at the small end: a line through the origin
            a, c = 0.0, sxt / sxx
        return a, c

    least = min(3, len(pts))  # a line through two points explains them whatever they are: fit three or more
    chosen = pts[-least:]
    for _ in range(len(pts)):
        a, c = fit(chosen)
        again = [p for p in pts if p["received_bytes"] * c >= BANDWIDTH_DOMINATES * a]
        again = again if len(again) >= least else pts[-least:]
        if again == chosen:
            break
        chosen = again
    for p in pts:
        p["predicted_s"] = a + c * p["received_bytes"]
        p["fitted"] = p in chosen
        p["within"] = p["min_s"] <= p["predicted_s"] <= p["max_s"]
    return {
        "latency_s": a,
        "bandwidth": 1.0 / c,
        "points": pts,
        "fitted_bytes": [p["bytes"] for p in chosen],
        "explains": all(p["within"] for p in chosen),
    }


def host_fit(rows, gathers: list | None = None) -> dict:
    """Achievable FLOP/s and all-gather bandwidth of this host, fitted from ``labs.lab05.block_overlap_worker``
    rows, so the planner's formulas can be drawn for this machine (notebook 05).

    ``gathers``: the worker's all-gather sweep; with it the bandwidth (and latency) come from
    ``fit_latency_bandwidth`` (``"gather_fit"``), without it from the blocks' own gathers."""
    import statistics

    flops = [(24.0 * r["width"] ** 2 * r["tokens"]) / r["fwd_s"] for r in rows]
    if gathers:
        f = fit_latency_bandwidth(gathers)
        return {
            "flops": statistics.median(flops),
            "gather_bw": f["bandwidth"],
            "gather_latency_s": f["latency_s"],
            "gather_fit": f,
        }
    bws = [
        r["gather_bytes"] * (r["world_size"] - 1) / r["world_size"] / r["gather_s"] for r in rows if r["gather_s"] > 0
    ]
    return {"flops": statistics.median(flops), "gather_bw": statistics.median(bws) if bws else float("nan")}
