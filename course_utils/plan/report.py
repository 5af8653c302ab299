"""The throughput planner's answer as text: a table within 100 columns, every column headed (notebook 05).

The first column is what a person types (PyTorch's or DeepSpeed's spelling, a 2-D mesh's shape filled in),
the course's name beside it; ``wide=True`` adds every term of the step time, the bytes per link and the moment
of the peak. Every number is the planner's (``plan.search``).
"""

from __future__ import annotations

import textwrap

from .implementations import BY_KEY
from .search import typed
from .shapes import GB

WIDTH = 100


def _header(result: dict, assumed: str) -> list[str]:
    s, cl = result["model"], result["cluster"]
    tokens = result["batch"] * s["seq"]
    lines = [
        f"{s['name']}: Ψ = {result['params'] / 1e9:.2f}B, {s['layers']} blocks of width {s['width']}; global batch "
        f"{result['batch']} x {s['seq']:,} tokens ({tokens / 1e6:.2f}M)",
        f"{cl['nodes']} node(s) x {cl['gpus_per_node']} {cl['gpu']['name']} ({cl['gpu']['mem'] / GB:.1f} GB), "
        f"network {cl['inter_bw'] * 8 / 1e9:g} Gb/s per node; compute at {result['mfu']:.0%} of "
        f"{cl['gpu']['peak_flops'] / 1e12:g} TFLOP/s",
    ]
    return [line for text in (lines + [assumed]) if text for line in textwrap.wrap(text, WIDTH)]


def format_search(result: dict, *, wide: bool = False, assumed: str = "") -> str:
    """The best configuration of each implementation, fastest first, then those that never fit."""
    head = f"{'what you type':<41} {'course':<13} {'recompute':<9} {'b x acc':>7} {'nodes':>5} {'GB/GPU':>6} {'tok/s/GPU':>9}"
    if wide:
        head += (
            f" {'step s':>7} {'compute':>7} {'recomp':>6} {'comm':>6} {'optim':>6} {'offload':>7} {'net GB':>7}"
            f" {'NVL GB':>7} {'peak at':<22}"
        )
    lines = _header(result, assumed) + ["", head, "-" * len(head)]
    best = result["best"]
    for r in sorted(result["best_per_impl"].values(), key=lambda r: -r["time"]["tokens_per_s_per_gpu"]):
        c, t, m = r["config"], r["time"], r["memory"]
        mark = "*" if best and r["config"] == best["config"] else " "
        row = (
            f"{typed(r):<40}{mark} {BY_KEY[r['impl']].course.name[:13]:<13} {c['policy']:<9} "
            f"{c['micro_batch']:>3}x{c['accum']:<3} {c['nodes']:>5} {m['total'] / GB:>6.1f} "
            f"{t['tokens_per_s_per_gpu']:>9,.0f}"
        )
        if wide:
            tt, lb = t["terms"], t["link_bytes_per_gpu"]
            row += (
                f" {t['step_s']:>7.2f} {tt['compute']:>7.2f} {tt['recompute']:>6.2f} {tt['exposed comm']:>6.2f}"
                f" {tt['optimizer step']:>6.2f} {tt['offload']:>7.2f} {lb['network'] / GB:>7.2f}"
                f" {lb['nvlink'] / GB:>7.2f} {m['peak_phase']:<22}"
            )
        lines.append(row.rstrip())
    for r in sorted(result["smallest_unfit"].values(), key=lambda r: r["memory"]["total"]):
        c = r["config"]
        why = f"does not fit: {r['memory']['total'] / GB:.1f} GB at least ({c['policy']}, b={c['micro_batch']})"
        lines.append(f"{typed(r):<40}  {BY_KEY[r['impl']].course.name[:13]:<13} {why}".rstrip())
    width = len(head) if wide else WIDTH
    lines += textwrap.wrap(
        "Each row is its implementation's pick by the recommendation's own rule (a tie within 5% of its fastest "
        "goes to more nodes, then headroom); the runner-up named below is another implementation's fastest, "
        "which its row may not show.",
        width,
    )
    lines += [""] + textwrap.wrap(("Recommended (*): " if best else "") + result["why"], width)
    if result["fewer_nodes_note"]:
        lines += textwrap.wrap(result["fewer_nodes_note"], width)
    return "\n".join(lines)
