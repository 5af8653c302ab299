"""The planner's command line: ``python -m course_utils plan`` (notebook 05).

A thin shell over ``plan.choose.plan``: the same plan the notebook shows, as a text table or JSON.
"""

from __future__ import annotations

import argparse
import math
import re

from ..errors import CourseInputError
from ..memory import bill
from ..strategies import get
from ..units import GB, fmt_count, parse_bytes, parse_count
from .choose import Plan, StrategyPlan, plan
from .inputs import Cluster, ModelSpec, _need, model_spec
from .network import network_class

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
    m.add_argument("--k", type=float, default=bill.ADAM_MIXED_K, help="K: optimizer bytes per parameter (default 12)")
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
    row = get(sp.strategy)
    if sp.shard_size:  # a row sharding inside a group of nodes the planner chose
        return f"{row.title.split(' (')[0]} ({row.fsdp1}, shard groups of {sp.shard_size})"
    return row.title


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
