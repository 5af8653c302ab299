"""The throughput planner's search and its answer in words (notebook 05).

Given a model, a cluster and a global batch (sequences of the model's length), search

    implementation x recomputation policy x micro-batch x gradient accumulation x nodes used x HSDP shard
    size x offload

and recommend the configuration with the most tokens per second per GPU that fits. Within ``TIE`` of the
best it is a tie among the ways to do the same work (no more recomputation than the fastest, and no offload
unless it offloads), broken by more nodes (more tokens per second in all), then more headroom. The runner-up is
the best configuration of another implementation, with why it lost. When fewer nodes than offered win, the
answer says what all of them would give, and what torchft's DiLoCo would (``torchft/local_sgd.py``).
"""

from __future__ import annotations

from dataclasses import asdict

from ..validate import check_values
from .activations import POLICIES
from .implementations import BY_KEY, IMPLS, Impl
from .shapes import GB, MFU_SOURCE, GPUCluster, Shape
from .throughput import Config, evaluate

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
#: Throughputs within this fraction of the best are a tie: the time model prices every FLOP at one assumed
#: fraction of peak and every byte at one bandwidth, so it does not rank plans that differ by less.
TIE = 0.05


def hsdp_shards(n: int, gpus_per_node: int) -> list[int]:
    """Shard group sizes of a 2-D mesh on n GPUs: proper divisors that tile nodes (a node, or within one)."""
    return [d for d in range(2, n) if n % d == 0 and (d % gpus_per_node == 0 or gpus_per_node % d == 0)]


def _shards(impl: Impl, n: int, gpus_per_node: int) -> list[int]:
    if impl.layout == "hybrid":
        return hsdp_shards(n, gpus_per_node)
    return [impl.shard(n, 0)]


def _configs(cl: GPUCluster, batch: int, impls, policies, micro_batches, kernels):
    for nodes in range(1, cl.nodes + 1):
        n = nodes * cl.gpus_per_node
        for impl in impls:
            for shard in _shards(impl, n, cl.gpus_per_node):
                for policy in policies:
                    for b in micro_batches:
                        if batch % (b * n) == 0:
                            yield impl, Config(impl.key, policy, b, batch // (b * n), nodes, shard, kernels)


def _rate(r: dict) -> float:
    return r["time"]["tokens_per_s_per_gpu"]


def _work(r: dict) -> tuple[int, int]:
    """The extra work a row chooses: its recomputation (in ``POLICIES``' order), and whether it offloads."""
    return POLICIES.index(r["config"]["policy"]), int(bool(BY_KEY[r["impl"]].offload))


def _pick(rows: list[dict]) -> dict | None:
    """The fastest; within ``TIE`` of it, the rows that recompute no more than it (and offload only if it
    does) are a tie, broken by more nodes, then more headroom. Headroom bought with extra work is no tie:
    spare memory is worth having to remove work (a larger micro-batch, less recomputation), not to add it."""
    if not rows:
        return None
    top = max(rows, key=_rate)
    most = _work(top)
    tied = [r for r in rows if _rate(r) >= _rate(top) * (1 - TIE) and all(map(int.__le__, _work(r), most))]
    return max(tied, key=lambda r: (r["config"]["nodes"], r["memory"]["headroom"], _rate(r)))


def tied_with(best: dict, other: dict) -> bool:
    """Whether ``other`` lost to ``best`` on the tie-break: within ``TIE`` and with no more headroom (one in
    the band with more headroom lost on nodes, or bought its room with work ``_pick`` does not tie)."""
    return _rate(other) >= _rate(best) * (1 - TIE) and other["memory"]["headroom"] <= best["memory"]["headroom"]


def search(
    s: Shape,
    cl: GPUCluster,
    batch: int,
    *,
    mfu: float | None = None,
    impls=IMPLS,
    policies=POLICIES,
    micro_batches=MICRO_BATCHES,
    kernels: str = "cuda",
) -> dict:
    """Every configuration priced; the best that fits, the runner-up, each implementation's best, and for
    each that never fits its smallest (notebook 05). Returns plain data: ``json.dumps`` gives every term."""
    check_values("plan", {"batch": batch, "mfu": mfu})
    mfu = mfu or cl.gpu.mfu
    rows = [evaluate(s, cl, impl, c, mfu) for impl, c in _configs(cl, batch, impls, policies, micro_batches, kernels)]
    fits = [r for r in rows if r["fits"]]
    best = _pick(fits)
    runner = max((r for r in fits if r["impl"] != best["impl"]), key=_rate, default=None) if best else None
    keys = {r["impl"] for r in rows}
    per_impl = {k: _pick([r for r in fits if r["impl"] == k]) for k in keys}
    per_impl = {k: v for k, v in per_impl.items() if v}
    unfit = {
        k: min((r for r in rows if r["impl"] == k), key=lambda r: r["memory"]["total"]) for k in keys - set(per_impl)
    }
    all_nodes = max((r for r in fits if r["config"]["nodes"] == cl.nodes), key=_rate, default=None)
    note = ""
    if best and all_nodes and best["config"]["nodes"] < cl.nodes:
        note = fewer_nodes_note(cl, best, all_nodes) + " " + local_sgd_note(s, cl, best)
    return {
        "model": asdict(s),
        "params": s.params,
        "cluster": {**asdict(cl), "gpu": asdict(cl.gpu)},
        "batch": batch,
        "mfu": mfu,
        "mfu_source": MFU_SOURCE,
        "evaluated": len(rows),
        "fitting": len(fits),
        "best": best,
        "runner_up": runner,
        "best_per_impl": per_impl,
        "smallest_unfit": unfit,
        "best_all_nodes": all_nodes,
        "fewer_nodes_note": note,
        "why": explain(best, runner) if best else why_nothing(rows),
    }


def typed(r: dict) -> str:
    """What a user types for a row, a 2-D mesh's shape filled in: (replicas, shard)."""
    c = r["config"]
    n = c["nodes"] * r["gpus_per_node"]
    return BY_KEY[r["impl"]].short.format(mesh=f"({n // c['shard']}, {c['shard']})")


def _policy(policy: str) -> str:
    return "no" if policy == "none" else policy


def _said(r: dict) -> str:
    c = r["config"]
    return (
        f"{typed(r)} [{BY_KEY[r['impl']].course.name}], {_policy(c['policy'])} recomputation, micro-batch "
        f"{c['micro_batch']} x {c['accum']} accumulation steps, {c['nodes']} node(s)"
    )


def explain(best: dict, runner: dict | None) -> str:
    """The recommendation in the names a user types, and why the runner-up lost."""
    b, mem = best["time"], best["memory"]
    text = (
        f"{_said(best)}: {b['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU; {mem['total'] / GB:.1f} GB per GPU "
        f"with the allocator's reserve and the CUDA context ({mem['headroom'] / GB:.1f} GB to spare of "
        f"{(mem['total'] + mem['headroom']) / GB:.1f}). Options: {BY_KEY[best['impl']].options}."
    )
    if not runner:
        return text
    r = runner["time"]
    rel = r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"] - 1
    text += f" Runner-up: {_said(runner)}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({rel:+.1%})"
    if tied_with(best, runner):
        spare = runner["memory"]["headroom"] / GB
        return text + f", a tie within {TIE:.0%}; it leaves {spare:.1f} GB to spare against {mem['headroom'] / GB:.1f}."
    n_b = best["config"]["nodes"] * best["gpus_per_node"]
    n_r = runner["config"]["nodes"] * runner["gpus_per_node"]
    # seconds per token per GPU, term by term: where the runner-up spends more
    cost = {
        k: r["terms"][k] * n_r / r["tokens_per_step"] - b["terms"][k] * n_b / b["tokens_per_step"] for k in b["terms"]
    }
    return text + f": it loses most on {max(cost, key=cost.get)}."


def fewer_nodes_note(cl: GPUCluster, best: dict, all_nodes: dict) -> str:
    """What using every node offered would give, against the recommendation on fewer."""
    at, bt = all_nodes["time"], best["time"]
    n_all, n_best = cl.nodes * cl.gpus_per_node, best["config"]["nodes"] * cl.gpus_per_node
    return (
        f"Using all {cl.nodes} nodes: {_said(all_nodes)}: {at['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
        f"{at['tokens_per_s_per_gpu'] * n_all:,.0f} in all, against {bt['tokens_per_s_per_gpu'] * n_best:,.0f} in "
        f"all on {best['config']['nodes']}; its step spends {at['terms']['exposed comm']:.1f} s of "
        f"{at['step_s']:.1f} s on communication not hidden."
    )


def local_sgd_note(s: Shape, cl: GPUCluster, best: dict, sync_every: int = 100) -> str:
    """What torchft's local-SGD methods (``torchft/local_sgd.py``: LocalSGD, DiLoCo) would change: each node
    trains as it does alone and the nodes average every ``sync_every`` steps. A different optimiser."""
    R = cl.nodes
    node_bytes = 2 * (R - 1) / R * 4 * s.params
    sync = node_bytes / cl.inter_bw
    step = best["time"]["step_s"]
    per_gpu = (
        best["time"]["tokens_per_step"] / (step + sync / sync_every) / (best["config"]["nodes"] * cl.gpus_per_node)
    )
    return (
        f"Beyond synchronous data parallelism: torchft's DiLoCo (torchft/local_sgd.py) would let each of the {R} "
        f"nodes train as one does and average every {sync_every} steps ({node_bytes / GB:.0f} GB over each "
        f"node's link, {sync:.0f} s, {sync / sync_every:.2f} s per step): about {per_gpu * R * cl.gpus_per_node:,.0f} "
        "tokens/s in all, if the model converges as well that way (a different optimiser, tuned on its own)."
    )


def why_nothing(rows: list[dict]) -> str:
    if not rows:
        return "no configuration: the global batch does not divide over the GPUs at any micro-batch"
    least = min(rows, key=lambda r: r["memory"]["total"])
    m, c = least["memory"], least["config"]
    act, at = m["activations"], m["phases"][m["peak_phase"]]["activations"]
    # the logits and the loss at that moment: before the blocks' backward, everything but the blocks' kept tensors
    # (the tail's kept inputs and log-probabilities, the loss's temporaries or its gradient of the logits)
    before_blocks = m["peak_phase"] in ("end of forward", "backward of the loss")
    loss = at - act["blocks kept"] if before_blocks else act["tail kept"]
    tiled = (
        "a loss computed in tiles that never holds the whole logits and a tiled MLP (DeepSpeed's ALST: "
        "TiledFusedLogitsLoss, TiledMLP in runtime/sequence_parallel/ulysses_sp.py), or "
        if loss >= at / 4
        else ""
    )
    return (
        f"nothing fits: the smallest is {typed(least)}, {_policy(c['policy'])} recomputation, b={c['micro_batch']}: "
        f"{m['total'] / GB:.1f} GB ({m['peak_phase']}), of which activations {at / GB:.1f} GB, the logits and the "
        f"loss {loss / GB:.1f} GB of them (vocabulary x tokens, fp32). Data parallelism cannot cut a sequence's "
        f"activations: {tiled}tensor, pipeline or context parallelism (not planned here) can."
    )
