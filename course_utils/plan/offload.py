"""Each library's offload under its own name: what stays on the GPU, what the host (and NVMe) hold, what
crosses PCIe per step, and where the optimizer step runs (notebook 05).

DeepSpeed's ZeRO-Offload and ZeRO-3 ``offload_optimizer`` are the record's offload rows, priced by
``plan.price`` like any other; FSDP2's ``CPUOffloadPolicy`` and ZeRO-Infinity are priced here from
stage 3's row (the next wave may make them rows of their own).
"""

from __future__ import annotations

from ..memory import bill
from ..strategies import ZERO2, ZERO2_OFFLOAD, ZERO3, ZERO3_OFFLOAD
from ..units import GB
from .implementations import ds_offload_pcie_step_bytes
from .inputs import Cluster, ModelSpec
from .price import block_overlap, memory_breakdown, step_time
from .throughput import cpu_adam_s, fsdp2_cpu_offload_s

#: The four ways to park model states off the GPU, each under the name its library gives it.
#: DeepSpeed's own two are the record's offload rows (``zero3_offload`` under its row's name).
OFFLOAD_MODES = ("zero_offload", ZERO3_OFFLOAD.name, "fsdp2_cpu_offload", "zero_infinity")
OFFLOAD_NAMES = {
    "zero_offload": "DeepSpeed ZeRO-Offload (stage 2, offload_optimizer to CPU)",
    ZERO3_OFFLOAD.name: "DeepSpeed ZeRO-3, offload_optimizer to CPU",
    "fsdp2_cpu_offload": "FSDP2 fully_shard(offload_policy=CPUOffloadPolicy())",
    "zero_infinity": "DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer on NVMe)",
}
#: The same, short enough for a table within 100 columns (``plan.format_plan``).
OFFLOAD_SHORT = {
    "zero_offload": "ZeRO-Offload (DS stage 2)",
    ZERO3_OFFLOAD.name: "ZeRO-3 + offload_optimizer",
    "fsdp2_cpu_offload": "FSDP2 CPUOffloadPolicy",
    "zero_infinity": "ZeRO-Infinity (NVMe)",
}


def offload_modes(
    model: ModelSpec, cluster: Cluster, *, k: float = bill.ADAM_MIXED_K, plans: dict | None = None
) -> dict:
    """Each library's offload, per GPU: what stays on the GPU, what the host (and NVMe) hold, what
    crosses PCIe (and the NVMe link) per step, and where the optimizer step runs (notebook 05).

    ``plans``: the planner's ``StrategyPlan`` rows, if already computed (``plan()`` passes them).
    With p = Ψ/Nm parameters per model-parallel rank and Nd replicas:

    - ``zero_offload``, DeepSpeed's ZeRO-Offload: the record's ``zero2_offload`` row. 16-bit
      weights stay whole on every GPU, gradients are reduced, the K·p/Nd optimizer bytes live on
      the host; per step (one micro-batch) the fp32 gradient partition goes down and the updated
      16-bit weights come back: 6p/Nd over PCIe (``implementations.ds_offload_pcie_bytes``, which
      also says what accumulation adds). DeepSpeed's vectorised CPU Adam runs the step.
    - ``zero3_offload``, DeepSpeed ZeRO-3 with ``offload_optimizer``: the planner's row of that
      name; its bf16 gradient partitions live on the host too, so the reduced partition also goes
      down and back up (to accumulate on the GPU): 10p/Nd over PCIe, the same CPU Adam.
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
    parameter against 6 to 12 over PCIe, through a link (``host_bw``) only a few times faster. It is paid
    once per optimizer step: gradient accumulation spreads it over more tokens (the search's term).
    ``step_s`` adds PCIe, CPU (and NVMe) time to the GPU-resident strategy's step (stage 2's or
    stage 3's) as the search prices it, at one micro-batch a step: DeepSpeed's rows with
    ``throughput.ds_offload_s`` (the gradient copies beside the backward; the weights' copy back and the CPU's
    Adam waited for), FSDP2's with ``throughput.fsdp2_cpu_offload_s`` (its copies in behind the step's compute,
    the first micro-batch's copies out behind its backward); ZeRO-Infinity's none hidden (an upper bound;
    ``pcie_s`` is what could hide behind the backward).
    Each row: ``{"name", "base", "gpu_bytes", "host_bytes", "nvme_bytes", "pcie_bytes",
    "nvme_step_bytes", "optimizer_step", "pcie_s", "cpu_step_s", "nvme_s", "step_s", "fits", "why_not"}``.
    """
    plans = plans or {}
    p = model.params / cluster.mp
    nd, g = cluster.nd, cluster.gpus_per_node

    def row_of(strategy):
        if strategy.name in plans:
            sp = plans[strategy.name]
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
        block = block_overlap(model, cluster, strategy)
        _, _, _, compute, exposed = step_time(model, cluster, strategy, k, block)
        return {
            "total": mem["total"],
            "step_s": compute + exposed,
            "compute_s": compute,
            "exposed_comm_s": exposed,
            "host_bytes": mem["host_bytes"],
            "buffers": mem["buffers"],
            "activations": mem["activations"],
        }

    cpu_s = cpu_adam_s(p / nd, g, cluster.host_bw, k)
    z3 = row_of(ZERO3)
    z3_no_cpu = z3["step_s"]  # stage 3 on the GPUs: the step the offloads of stage 3's layout add to
    rows = {}
    deepspeed = {"zero_offload": (ZERO2_OFFLOAD, ZERO2), ZERO3_OFFLOAD.name: (ZERO3_OFFLOAD, ZERO3)}
    for name, (offloaded, on_gpu_row) in deepspeed.items():
        base = row_of(offloaded)
        pcie = ds_offload_pcie_step_bytes(3 if offloaded.gathers_units else 2) * p / nd  # one micro-batch a step
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
            "base": on_gpu_row.name,
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
        # the search's own term (one micro-batch a step here): the copies in hide behind the step's compute
        "step_s": z3_no_cpu + fsdp2_cpu_offload_s(p / nd, 1, z3["compute_s"], cluster.pcie_bw, cluster.host_bw, g, k=k),
        "optimizer_step": "CPU: torch.optim on the CPU parameter shards (FSDP2 only moves the tensors)",
        "base": ZERO3.name,
    }
    pcie = (2 * bill.WEIGHT_BYTES + bill.GRAD_BYTES) * p / nd
    nvme_step = (2 * bill.WEIGHT_BYTES + 2 * k + bill.WEIGHT_BYTES) * p / nd
    nvme_s = nvme_step * g / cluster.nvme_bw
    rows["zero_infinity"] = {
        "gpu_bytes": on_gpu,
        "host_bytes": 0.0,
        "nvme_bytes": (bill.WEIGHT_BYTES + k) * p / nd,
        "pcie_bytes": pcie,
        "nvme_step_bytes": nvme_step,
        "pcie_s": pcie / cluster.pcie_bw,
        "cpu_step_s": cpu_s,
        "nvme_s": nvme_s,
        "step_s": z3_no_cpu + pcie / cluster.pcie_bw + cpu_s + nvme_s,
        "optimizer_step": "CPU: DeepSpeed's CPU Adam, its state streamed from NVMe and back",
        "base": ZERO3.name,
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
