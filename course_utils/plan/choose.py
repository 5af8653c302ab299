"""The plan: every strategy weighed for a model on a cluster, and the one to run, with its reason (notebook 05).

The memory rule (the lesson on the stages, and the ZeRO paper's §5 and §7) is the filter: what fits, with the
allocator's reserve and the CUDA context (the throughput planner's own test, ``Cluster.usable``). Among what
fits, the fastest by estimated step time at this one micro-batch; a tie (``TIE_MARGIN``) goes to the most
headroom, as in the throughput search (``plan.search``), whose answer (policy, micro-batch, accumulation,
nodes) is the course's: this plan's pick is the strategy that search lands on when it fixes those.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import CourseInputError
from ..memory import bill
from ..strategies import PARAMS, RECORD, ZERO3, get, planned
from ..units import GB, fmt_sig3
from .inputs import Cluster, ModelSpec, _need, model_spec
from .network import network_class, overlap_curve
from .offload import offload_modes
from .price import applicable, block_overlap, hsdp_shard_sizes, limits, memory_breakdown, step_time
from .search import TIE

#: The rows the planner weighs by default, in the order it prefers them when they tie (``strategies.planned``).
STRATEGIES = tuple(s.name for s in planned())
#: Every row's name as the planner's tables print it (PyTorch FSDP's names in brackets).
STRATEGY_NAMES = {s.name: s.title for s in RECORD.values()}
#: Tokens per micro-batch (b·s) the overlap chart spans, 64 to a million.
OVERLAP_TOKENS = np.geomspace(64, 1 << 20, 60)
#: The recommendation when nothing fits.
NOTHING_FITS = "no data-parallel strategy fits"
#: What to do, by what is the limit: a GPU's own activations or one gathered unit, or the model states themselves.
REMEDIES = {
    "activations": "the activations are the limit; use {checkpointing}a smaller micro-batch, context (sequence) "
    "parallelism for long sequences, or tensor or pipeline parallelism",
    "layer": "a single FSDP unit is the limit; use smaller FSDP units (one per linear layer) or tensor parallelism",
    "matrix": "a single weight matrix is the limit; use tensor parallelism, which splits it across GPUs",
    "states": "the model states are the limit; use more GPUs, offload to NVMe (ZeRO-Infinity), or tensor or pipeline "
    "parallelism",
}


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
    overlap: dict | None = None  # overlap_curve() over OVERLAP_TOKENS: what the overlap chart draws (not in to_dict)

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


def plan(
    model: ModelSpec | None = None,
    cluster: Cluster | None = None,
    *,
    k: float = bill.ADAM_MIXED_K,
    strategies=None,
    **model_kwargs,
) -> Plan:
    """Weigh every strategy for a model on a cluster and recommend one (notebook 05).

    ``plan(model_spec(7e9), Cluster())`` or ``plan(params=7e9)``. ``strategies``: the rows (or names) to
    weigh, in order of preference; default every row the record marks ``planned``, a row the loop cannot
    run included (``strategies.planned()``). Returns a ``Plan`` whose ``strategies[s]`` holds memory per
    GPU (``memory_breakdown``), fit and headroom, per-block compute against all-gather time, step
    communication and an estimated step time, and whose ``recommendation`` is ``{"strategy": a name
    or "none", "reason": one sentence}``.
    """
    if model is None:
        model = model_spec(**model_kwargs)
    elif model_kwargs:
        raise CourseInputError("give either a ModelSpec or model keyword arguments, not both")
    cluster = cluster or Cluster()
    _need(math.isfinite(k) and k >= 0, f"k must be a number of bytes >= 0, got {k!r}")
    rows = planned() if strategies is None else [get(s) for s in strategies]
    weighed = {}
    for s in rows:
        if not applicable(s, cluster):
            continue
        shard_size = None
        if s.shard_over == "node":  # the smallest shard group that fits: the fewest gathers over the network
            sizes = hsdp_shard_sizes(cluster)
            shard_size = next(
                (n for n in sizes if memory_breakdown(model, cluster, s, k=k, shard_size=n)["total"] <= cluster.usable),
                sizes[0],
            )
        mem = memory_breakdown(model, cluster, s, k=k, shard_size=shard_size)
        block = block_overlap(model, cluster, s, shard_size)
        link, volume, pcie, compute, exposed = step_time(model, cluster, s, k, block, shard_size)
        headroom = cluster.usable - mem["total"]
        why = ""
        if headroom < 0:
            why = f"needs {mem['total'] / GB:.1f} GB of {cluster.usable / GB:.1f} GB usable"
        if s.offload and mem["host_bytes"] * cluster.gpus_per_node > cluster.host_mem:
            why = (why + "; " if why else "") + (
                f"host memory: needs {mem['host_bytes'] * cluster.gpus_per_node / GB:.0f} GB per node "
                f"of {cluster.host_mem / GB:.0f} GB"
            )
        weighed[s.name] = StrategyPlan(
            s.name,
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
    found = limits(model, cluster, k)
    return Plan(
        model,
        cluster,
        k,
        weighed,
        _recommend(model, cluster, k, weighed, found),
        found,
        offload_modes(model, cluster, k=k, plans=weighed),
        overlap_curve(model, cluster, OVERLAP_TOKENS),
    )


#: Step times within this fraction of the fastest count as a tie, and a tie goes to the most headroom (the
#: memory a larger micro-batch or less recomputation can spend), offload only when the fastest offloads: the
#: throughput search's own margin and tie-break.
TIE_MARGIN = TIE


def _recommend(model: ModelSpec, cluster: Cluster, k: float, plans: dict, limits: dict) -> dict:
    """Among the strategies that fit, the fastest by estimated step time; a tie within TIE_MARGIN
    goes to the most headroom (an offload row ties only with an offload row). The reason says what it beat and by how much."""

    def gb(x):
        return f"{x / GB:.1f} GB"

    def name(s):
        return get(s).title.split(" (")[0]

    fit = [s for s in plans if plans[s].fits]
    times = {s: plans[s].step_s for s in fit}
    if fit:
        first = min(fit, key=times.get)
        fastest = times[first]
        # offload buys headroom with work (PCIe, CPU Adam): a tie only when the fastest offloads too
        tied = [s for s in fit if times[s] <= fastest * (1 + TIE_MARGIN) and get(s).offload <= get(first).offload]
        s = max(tied, key=lambda o: plans[o].headroom)  # the most headroom within the margin
        p = plans[s]
        others = sorted((t, o) for o, t in times.items() if o != s)
        runner_up = others[0][1] if others else None
        head = f"{gb(p.total)} of tensors per GPU with {gb(p.headroom)} to spare of {gb(cluster.usable)} usable"
        if runner_up is None:
            unfit = [o for o in plans if o != s and not plans[o].fits]
            floors = ", ".join(f"{name(o)} {gb(plans[o].total)}" for o in unfit[:3])
            beat = f"of this plan's rows (the ZeRO stages, HSDP, their offload) it is the only one that fits ({floors} do not)"
        else:
            t2 = times[runner_up]
            if t2 <= times[s] * (1 + TIE_MARGIN) and plans[runner_up].headroom <= p.headroom:
                beat = (
                    f"{name(runner_up)} is as fast ({fmt_sig3(t2)} s, within {TIE_MARGIN:.0%}), and a tie goes to the "
                    f"most headroom, {gb(p.headroom)} against {gb(plans[runner_up].headroom)}"
                )
            else:
                beat = (
                    f"it beats the runner-up, {name(runner_up)} ({fmt_sig3(t2)} s), by {fmt_sig3(t2 - times[s])} s a step "
                    f"({t2 / times[s] - 1:.0%})"
                )
        reason = f"{name(s)} fits ({head}) at an estimated {fmt_sig3(times[s])} s a step; {beat}."
        if p.block:
            b = p.block
            hidden = b["hides_fwd"] and b["hides_bwd"]
            reason += f" Each block's all-gather ({fmt_sig3(b['gather_s'] * 1e3)} ms over {b['link']}) " + (
                "hides behind its compute."
                if hidden
                else f"does not hide behind its compute ({fmt_sig3(b['fwd_compute_s'] * 1e3)} ms forward)."
            )
        row = get(s)
        if row.offload:
            more = limits["zero3_min_nodes"]
            reason += (
                " Offload makes it fit, paying the CPU's Adam once per optimizer step: slow at one micro-batch a"
                " step, as here; accumulation spreads it over more tokens"
            ) + (
                f". With {more} nodes ({more * cluster.gpus_per_node} GPUs) stage 3 would fit without it."
                if more
                else "."
            )
        practice = ""
        z3 = plans.get(ZERO3.name)
        if (
            PARAMS not in row.shards_at_peak
            and not row.offload
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
        pytorch = row.pytorch
        if p.shard_size:  # a row that shards inside a group of nodes the planner chose
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
            f"one gathered unit (a block: its bf16 weights and gradient, with its activations) needs {gb(limits['single_layer'])}"
            + (
                f", and even one weight matrix (its bf16 weight and gradient, with one layer's activations) needs "
                f"{gb(limits['single_matrix'])}"
                if limits["single_matrix_limit"]
                else f"; wrapped per linear layer the largest unit is one h x 4h matrix: its bf16 weight and gradient, "
                f"with one layer's activations, {gb(limits['single_matrix'])}, which fits"
            )
        )
    if limits["activations_limit"] and model.seq >= 32768:
        causes.append(f"at sequence length {model.seq:,} context (sequence) parallelism is the standard remedy")
    remedies = []
    if limits["activations_limit"]:  # checkpointing named only where it is off
        remedies.append(
            REMEDIES["activations"].format(checkpointing="" if model.checkpointing else "activation checkpointing, ")
        )
    if limits["single_layer_limit"]:
        remedies.append(REMEDIES["matrix" if limits["single_matrix_limit"] else "layer"])
    remedy = "; ".join(remedies) or REMEDIES["states"]
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
        "reason": f"{NOTHING_FITS}: {remedy} ({'; '.join(causes)}{hint}).",
        "pytorch": "none of the data-parallel wrappers: add tensor, pipeline or context (sequence) parallelism",
        "runner_up": None,
        "step_s": {},
        "tie_margin": TIE_MARGIN,
        "practice": "",
    }
