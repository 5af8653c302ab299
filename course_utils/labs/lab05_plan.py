"""Notebook 05's throughput cases: the four questions an expert asked the planner, and stage 1 priced as each
library implements it. Arithmetic only (``course_utils.plan.search``); no process starts.
"""

from __future__ import annotations

from ..plan.implementations import BY_KEY
from ..plan.search import search, tied_with, typed
from ..plan.shapes import GB, GPUS, GPUCluster, shape_of_preset
from ..plan.throughput import Config, evaluate
from ..presets import preset

#: (label, preset, nodes of 8 H100s, network per node in bytes/s, global batch in sequences).
THROUGHPUT_CASES = (
    ("Llama 2 7B, 1 node, 1M tokens", "6.7B", 1, 400e9, 256),
    ("Llama 2 13B, 2 nodes on 10 GbE, 1M tokens", "13B", 2, 10e9 / 8, 256),
    ("Llama 3 70B, 4 nodes, 4M tokens", "70B", 4, 400e9, 512),
    ("Llama 3 70B, 8 nodes, 4M tokens", "70B", 8, 400e9, 512),
    ("Llama 3 70B, 1 node, 4M tokens", "70B", 1, 400e9, 512),
)

#: Stage 1 and its neighbours as implemented, Llama 2 7B on 8 H100s at b = 1, no accumulation.
STAGE1_ROWS = ("pt-ddp", "pt-ddp-zero", "ds-1", "ds-2", "pt-fsdp2-keep", "pt-fsdp2")


def throughput_cases(cases=THROUGHPUT_CASES) -> dict:
    """Each case searched on 8-GPU H100 nodes (notebook 05): {label: the search's result}."""
    out = {}
    for label, name, nodes, inter_bw, batch in cases:
        cluster = GPUCluster(GPUS["H100-80GB"], gpus_per_node=8, nodes=nodes, inter_bw=inter_bw)
        out[label] = search(shape_of_preset(preset(name)), cluster, batch)
    return out


def case_rows(results: dict) -> list[list]:
    """One row per case: the recommendation in the names a user types, and the runner-up with its margin."""
    rows = []
    for label, r in results.items():
        b, ru = r["best"], r["runner_up"]
        c = b["config"]
        rel = ru["time"]["tokens_per_s_per_gpu"] / b["time"]["tokens_per_s_per_gpu"] - 1 if ru else None
        tie = ru is not None and tied_with(b, ru)
        rows.append([
            label,
            f"{typed(b)} [{BY_KEY[b['impl']].course.name}]",
            c["policy"],
            f"{c['micro_batch']} x {c['accum']}",
            c["nodes"],
            f"{b['time']['tokens_per_s_per_gpu']:,.0f}",
            f"{b['memory']['total'] / GB:.1f}",
            f"{typed(ru)}: {rel:+.1%}" + (" (a tie: less headroom)" if tie else "") if ru else "",
        ])  # fmt: skip
    return rows


def stage1_as_implemented(keys=STAGE1_ROWS) -> list[dict]:
    """Llama 2 7B on one node of 8 H100s, b = 1, no accumulation, no recomputation: what each implementation
    holds (model states and the peak) and sends per GPU per step (notebook 05)."""
    s = shape_of_preset(preset("6.7B"))
    cluster = GPUCluster(GPUS["H100-80GB"])
    rows = []
    for key in keys:
        impl = BY_KEY[key]
        r = evaluate(s, cluster, impl, Config(key, "none", 1, 1, 1, impl.shard(8, 8)), GPUS["H100-80GB"].mfu)
        rows.append({
            "typed": impl.typed,
            "course": impl.course.name,
            "states": sum(r["memory"]["states"].values()),
            "peak": r["memory"]["total"],
            "peak_phase": r["memory"]["peak_phase"],
            "fits": r["fits"],
            "headroom": r["memory"]["headroom"],
            "sent": sum(r["time"]["link_bytes_per_gpu"].values()),
        })  # fmt: skip
    return rows
