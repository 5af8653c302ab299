"""The planner's command line: ``python -m course_utils plan`` (notebook 05).

A thin shell over ``plan.search.search``: the throughput search the notebook shows, as a table within 100
columns (``--wide`` for every term) or JSON (``--json``). ``format_plan`` prints the memory-and-overlap plan
of ``plan.choose.plan`` (notebook 05's first sections).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import replace

from ..errors import CourseInputError
from ..strategies import get
from ..units import GB, fmt_count, parse_bytes
from .activations import POLICIES
from .choose import Plan, StrategyPlan
from .network import network_class
from .offload import OFFLOAD_SHORT
from .report import format_search
from .search import MICRO_BATCHES, search
from .shapes import GPU, GPUS, GPUCluster, shape_for

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
    """Arguments of ``python -m course_utils plan`` (notebook 05): the throughput planner's search."""
    m = parser.add_argument_group("model")
    m.add_argument(
        "--params", help="a preset (1.56B, 6.7B, 8B, 13B, 70B: notebook 05b's models) or Ψ, e.g. 30B (a GPT-2 shape)"
    )
    m.add_argument("--layers", type=int, help="L: transformer blocks (a GPT-2-style shape)")
    m.add_argument("--width", type=int, help="h: hidden size")
    m.add_argument("--heads", type=int, help="attention heads (default width/128)")
    m.add_argument("--vocab", type=int, help="vocabulary (a shape without a preset: default 32000)")
    m.add_argument("--seq", type=int, help="s: sequence length (default: the preset's; else 2048)")
    b = parser.add_argument_group("what to search")
    b.add_argument("--batch", type=int, default=256, help="global batch, sequences of length s (default 256)")
    b.add_argument("--micro-batch", type=int, help="b: fix the micro-batch per GPU (default: search 1 to 32)")
    b.add_argument("--recompute", choices=POLICIES, help="fix the recomputation policy (default: search all)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--gpu", choices=list(GPUS), default="H100-80GB", help="the GPU (default H100-80GB)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    c.add_argument("--nodes", type=int, default=1, help="nodes offered; fewer may be the answer (default 1)")
    c.add_argument("--inter-bw", default="400GB/s", help="per-node network, e.g. 10Gb/s (default 400GB/s = 3.2Tb/s)")
    c.add_argument("--intra-bw", help="achievable NVLink bandwidth per GPU (default: the GPU's)")
    c.add_argument("--gpu-mem", help="memory per GPU (default: the GPU's, as nvidia-smi reports it)")
    c.add_argument("--tflops", type=float, help="dense 16-bit peak TFLOP/s per GPU (default: the GPU's data sheet)")
    c.add_argument("--mfu", type=float, help="achievable fraction of the peak (default 0.4)")
    c.add_argument("--host-mem", default="2000GB", help="CPU memory per node, for offload (default 2000GB)")
    c.add_argument("--reserve", type=float, default=0.10, help="the allocator's reserve, a fraction of the peak")
    parser.add_argument("--json", action="store_true", help="print one JSON object, every term")
    parser.add_argument("--wide", action="store_true", help="every term of the step in the table (over 100 columns)")


def _gpu_from_args(args) -> GPU:
    g = GPUS[args.gpu]
    if args.gpu_mem is not None:
        g = replace(g, mem=parse_bytes(args.gpu_mem, name="--gpu-mem"))
    if args.intra_bw is not None:
        g = replace(g, nvlink_bw=parse_bandwidth(args.intra_bw, name="--intra-bw"))
    if args.tflops is not None:
        g = replace(g, peak_flops=args.tflops * 1e12)
    return g


def search_from_args(args) -> tuple[dict, str]:
    """The search the command line asks for, and which shape it assumed ("" for a preset)."""
    if args.params is None and not (args.layers and args.width):
        raise CourseInputError("give --params (a preset such as 8B, or a size such as 30B), or --layers and --width")
    shape, assumed = shape_for(
        args.params, layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq
    )
    cluster = GPUCluster(
        _gpu_from_args(args),
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        inter_bw=parse_bandwidth(args.inter_bw, name="--inter-bw"),
        host_mem=parse_bytes(args.host_mem, name="--host-mem"),
        allocator_reserve=args.reserve,
    )
    policies = (args.recompute,) if args.recompute else POLICIES
    micro = (args.micro_batch,) if args.micro_batch else MICRO_BATCHES
    return search(shape, cluster, args.batch, mfu=args.mfu, policies=policies, micro_batches=micro), assumed


def _label(sp: StrategyPlan) -> str:
    row = get(sp.strategy)
    if sp.shard_size:  # a row sharding inside a group of nodes the planner chose
        return f"HSDP, shard groups of {sp.shard_size}"
    return row.title.split(" (")[0]


WIDTH = 100


def format_plan(p: Plan, offload: bool = True) -> str:
    """The plan as a text table within 100 columns (notebook 05); ``offload=False`` leaves out the offload table."""
    m, c = p.model, p.cluster
    shape = f"{m.name}: " if m.name else ""
    head = [
        f"Model: {shape}Ψ = {fmt_count(m.params)} ({m.layers} layers, width {m.width}, {m.heads} heads, vocab "
        f"{m.vocab}); b = {m.micro_batch}, s = {m.seq}, checkpointing {'on' if m.checkpointing else 'off'}; K = {p.k:g}",
        f"Cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs x {c.gpu_mem / GB:.1f} GB (tensors up to "
        f"{c.usable / GB:.1f} GB), Nm = {c.mp}, Nd = {c.nd}; NVLink {c.intra_bw / 1e9:g} GB/s per GPU, network "
        f"{c.inter_bw / 1e9:g} GB/s per node ({network_class(c.inter_bw)}), {c.flops / 1e12:.4g} TFLOP/s per GPU",
    ]
    lines = [w for text in head for w in textwrap.wrap(text, WIDTH)]
    lines += [
        "",
        "Memory per GPU, GB (10^9 bytes): the filter",
        f"{'strategy':<30} {'states':>7} {'activ.':>7} {'buffers':>7} {'total':>7} {'headroom':>8}  fits",
    ]
    for sp in p.strategies.values():
        lines.append(
            f"{_label(sp):<30} {sp.model_states / GB:>7.1f} {sp.activations / GB:>7.1f} {sp.buffers / GB:>7.2f} "
            f"{sp.total / GB:>7.1f} {sp.headroom / GB:>8.1f}  {'yes' if sp.fits else 'no'}"
        )
    lines += [
        "",
        "Per block (stage 3 family): compute against the all-gather of its parameters",
        f"{'strategy':<30} {'fwd ms':>7} {'gather ms':>9} {'bwd ms':>7} {'gath+RS ms':>10}  hides?  link",
    ]
    for sp in p.strategies.values():
        b = sp.block
        if b:
            lines.append(
                f"{_label(sp):<30} {b['fwd_compute_s'] * 1e3:>7.3g} {b['gather_s'] * 1e3:>9.3g} "
                f"{b['bwd_compute_s'] * 1e3:>7.3g} {(b['gather_s'] + b['reduce_scatter_s']) * 1e3:>10.3g}  "
                f"{'yes' if b['hides_fwd'] and b['hides_bwd'] else 'no':<6}  {b['link']}"
            )
    lines += [
        "",
        "Step: communication per GPU and estimated time",
        f"{'strategy':<30} {'comm GB':>8} {'PCIe GB':>8} {'compute s':>10} {'exposed s':>10} {'step s':>8}",
    ]
    for sp in p.strategies.values():
        lines.append(
            f"{_label(sp):<30} {sp.step_comm_bytes / GB:>8.2f} {sp.pcie_bytes / GB:>8.2f} "
            f"{sp.compute_s:>10.3g} {sp.exposed_comm_s:>10.3g} {sp.step_s:>8.3g}"
        )
    if offload:
        lines += [
            "",
            "Offload, each library's: per GPU, and per step",
            f"{'offload':<27} {'GPU GB':>6} {'host GB':>7} {'NVMe GB':>7} {'PCIe GB':>7} {'PCIe s':>6} "
            f"{'CPU Adam s':>10} {'NVMe s':>6} {'step s':>6}  fits",
        ]
    for name, o in p.offload.items() if offload else ():
        lines.append(
            f"{OFFLOAD_SHORT.get(name, name):<27} {o['gpu_bytes'] / GB:>6.1f} {o['host_bytes'] / GB:>7.1f} "
            f"{o['nvme_bytes'] / GB:>7.1f} {o['pcie_bytes'] / GB:>7.2f} {o['pcie_s']:>6.3g} "
            f"{o['cpu_step_s']:>10.3g} {o['nvme_s']:>6.3g} {o['step_s']:>6.3g}  {'yes' if o['fits'] else 'no'}"
        )
    r = p.recommendation
    said = [f"At this micro-batch: {r['strategy']}. {r['reason']}", f"In PyTorch: {r['pytorch'].rstrip('.')}."]
    if r.get("practice"):
        said.append(f"Practice: {r['practice']}")
    lines.append("")
    lines += [w for text in said for w in textwrap.wrap(text, WIDTH)]
    return "\n".join(lines)


def plan_command(args) -> int:
    """Print the throughput plan for a model on a cluster (notebook 05)."""
    result, assumed = search_from_args(args)
    if args.json:
        print(json.dumps({**result, "assumed_shape": assumed}, default=float))
    else:
        print(format_search(result, wide=args.wide, assumed=assumed))
    return 0
