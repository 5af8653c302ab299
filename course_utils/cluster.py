"""Training across several "nodes" of one Linux machine, with torchrun on each (notebooks 05 and 06).

The nodes are network namespaces joined by a rate-limited link (``course_utils.namespaces``); this
module runs jobs on them: ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint <node 0>:<port>`` inside every namespace (``ip netns exec``), exactly the line one
would type on each machine of a real cluster. torch ignores ``--node-rank`` with the c10d
rendezvous (it assigns node ranks itself, in the order of ``--local-addr``), so that is what orders
the nodes here. ``train_on_cluster`` trains (and can lose a node, notebook 06); ``sweep_on_cluster``
runs every strategy on every link in one job; ``links_vs_planner`` sets the measurements beside the
planner's prediction. The plumbing under them (each node's torchrun line, starting the job, waiting for
it, reading its report) is ``cluster_jobs``; the command line, ``cluster_cli``.

Linux and root only; ``namespaces.missing()`` says in one sentence what this machine lacks, and
nothing a run creates outlives it (``namespaces``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from .cluster_jobs import check_shape, node_env, report_from_logs, start_job, steps_done, tail, wait
from .errors import CourseInputError
from .namespaces import Cluster, missing, parse_link


def train_on_cluster(
    cfg=None,
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    link="unlimited",
    timeout_s: float = 120.0,
    lose_node_after: int | None = None,
    **overrides,
) -> dict:
    """Train with ``course_utils.train`` under torchrun on ``nodes`` namespaces; return its report (notebook 05).

    The report is ``train``'s (losses, ``weights_sha256``, bytes held, traffic, ``step_time_s``,
    ``cross_node_bytes_per_step``) plus ``link`` (what ``tc`` really set), ``nodes``,
    ``nproc_per_node``, ``wall_s`` and ``commands`` (each node's torchrun line).

    ``lose_node_after=S`` (notebook 06): as soon as a rank reports step S done (its checkpoint, if
    S is a checkpoint step, is then complete), every process of the last node is killed at once and
    its cable unplugged, as when a machine dies. The survivors' agents go back to the rendezvous
    and wait; a replacement node is plugged in and started with the very same torchrun line (what
    a job manager does), and the group restarts from the newest complete checkpoint. Needs
    ``checkpoint_dir`` and ``max_restarts >= 1``. The report adds ``lost_after_step``.
    """
    from .train import TrainConfig, train_flags

    cfg = TrainConfig(**{**asdict(cfg or TrainConfig()), **overrides})
    cfg.nproc, cfg.node_size = nodes * nproc_per_node, nproc_per_node
    cfg.validate()
    if lose_node_after is not None and not (cfg.checkpoint_dir and cfg.max_restarts >= 1):
        raise CourseInputError(
            "losing a node needs checkpoint_dir and max_restarts >= 1 (the survivors restart "
            "from the newest complete checkpoint)"
        )
    check_shape(nodes, nproc_per_node, timeout_s)
    start = time.monotonic()
    with Cluster(nodes, link) as cluster:
        progress = str(cluster.scratch("progress"))
        procs, argv_of = start_job(
            cluster,
            ["-m", "course_utils.train", *train_flags(cfg), "--json"],
            nproc_per_node=nproc_per_node,
            max_restarts=cfg.max_restarts,
            env=node_env(cfg.timeout_s, progress),
        )
        lose_when_due, lost = _node_loss(cluster, procs, argv_of, node_env(cfg.timeout_s, progress), lose_node_after)
        wait(procs, start + timeout_s, cluster, on_tick=lose_when_due)
        report = report_from_logs(cluster)
        if report is None:
            raise RuntimeError("the run finished without rank 0's report. Last output:\n" + tail(cluster))
        report.update(
            link=cluster.describe_link(),
            nodes=nodes,
            nproc_per_node=nproc_per_node,
            wall_s=time.monotonic() - start,
            commands=[" ".join(["torchrun", *argv_of(n)[3:]]) for n in cluster.nodes],
        )
        if lose_node_after is not None:
            report["lost_after_step"] = lost[0] if lost else None
    return report


def _node_loss(cluster: Cluster, procs: list, argv_of, env: dict, after: int | None):
    """``(tick, lost)``: once a rank reported step ``after`` done, ``tick`` kills the last node and plugs a
    replacement in, started with the very same torchrun line; ``lost`` then holds the step it happened at."""
    lost = []

    def tick():
        done = steps_done(env["COURSE_PROGRESS_DIR"]) or 0
        if after is None or lost or done < after:
            return
        lost.append(done)
        cluster.lose(cluster.nodes[-1])
        procs.pop()
        replacement = cluster.add_node()
        procs.append(cluster.start(replacement, argv_of(replacement), env))

    return tick, lost


#: What ``sweep_worker`` keeps of each run's report.
SWEEP_FIELDS = (
    "strategy",
    "world_size",
    "step_time_s",
    "cross_node_bytes_per_step",
    "comm_per_step",
    "weights_sha256",
    "losses",
    "timeline",
)


def sweep_worker(config: dict, strategies: list, links: list, phase_dir: str | None = None) -> list | None:
    """Train every strategy on every link in ONE process group; rank 0 returns the rows (notebook 05).

    One job instead of one per run: starting a job (processes, torch import, rendezvous) costs
    seconds, each run here well under one. Before each link, rank 0 asks the controller for it
    (``phase_dir/want-<i>.json``) and waits for ``done-<i>``; with no ``phase_dir`` (one host,
    under ``launch``) the links are only labels. The same worker runs under ``launch`` and torchrun.
    """
    import torch.distributed as dist

    from . import dist as cdist
    from .cable import CableBytes
    from .train import TrainConfig, run_training

    rows = []
    with cdist.session() as info:
        for i, link in enumerate(links):
            if phase_dir and info.rank == 0:
                want, done = Path(phase_dir) / f"want-{i}.json", Path(phase_dir) / f"done-{i}"
                want.write_text(json.dumps({"link": link}))
                deadline = time.monotonic() + 60
                while not done.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the controller never set link {link!r}")
                    time.sleep(0.01)
            dist.barrier()
            for strategy in strategies:
                cfg = TrainConfig(**{**config, "strategy": strategy})
                cable = CableBytes(0, cfg.steps - 1, info.local_rank)
                report = run_training(cfg, info, extra=[cable], clock=True)
                if info.rank == 0:
                    nodes = [seen[0] for seen in report["observed"] if seen[0] is not None]  # one per node: its card
                    rows.append({"link": link, **{k: report[k] for k in SWEEP_FIELDS}, "cable_bytes": nodes})
    if phase_dir and info.rank == 0:  # results by file: one rank's long line could interleave with others'
        tmp = Path(phase_dir) / "result.json.tmp"
        tmp.write_text(json.dumps(rows))
        tmp.rename(Path(phase_dir) / "result.json")
    return rows if info.rank == 0 else None


def sweep_on_cluster(
    strategies, links, *, nodes: int = 2, nproc_per_node: int = 2, timeout_s: float = 120.0, **config
) -> dict:
    """Every strategy on every link, one torchrun job across ``nodes`` namespaces (notebook 05).

    The controller reshapes the cables between links (``Cluster.set_link``) while the job waits.
    Returns ``{"rows": [...], "links": {link: what tc set}, "wall_s", "commands"}``; each row holds
    ``link`` and ``SWEEP_FIELDS`` of one ``train`` report.
    """
    from .train import TrainConfig

    cfg = TrainConfig(**config)
    cfg.nproc, cfg.node_size = nodes * nproc_per_node, nproc_per_node
    for s in strategies:
        TrainConfig(**{**asdict(cfg), "strategy": s}).validate()
    parsed = [parse_link(x) for x in links]
    links = [p.describe() for p in parsed]
    check_shape(nodes, nproc_per_node, timeout_s)
    start = time.monotonic()
    with Cluster(nodes, parsed[0]) as cluster:
        phases = str(cluster.scratch("phases"))
        args = json.dumps([asdict(cfg), list(strategies), links, phases])
        procs, argv_of = start_job(
            cluster,
            ["-m", "course_utils.worker", "course_utils.cluster:sweep_worker", "--args", args],
            nproc_per_node=nproc_per_node,
            max_restarts=0,
            env=node_env(cfg.timeout_s, None),
        )
        shaped = {}

        def serve_links():
            for i, link in enumerate(links):
                if link not in shaped and (Path(phases) / f"want-{i}.json").exists():
                    cluster.set_link(parsed[i])
                    shaped[link] = cluster.describe_link()
                    (Path(phases) / f"done-{i}").touch()

        wait(procs, start + timeout_s, cluster, on_tick=serve_links)
        result = Path(phases) / "result.json"
        if not result.exists():
            raise RuntimeError("the sweep finished without rank 0's rows. Last output:\n" + tail(cluster))
        return {
            "rows": json.loads(result.read_text()),
            "links": shaped,
            "wall_s": time.monotonic() - start,
            "commands": [" ".join(["torchrun", *argv_of(n)[3:]]) for n in cluster.nodes],
        }


def links_vs_planner(
    strategies,
    links=("unlimited", "1gbit", "100mbit"),
    *,
    nodes: int = 2,
    nproc_per_node: int = 2,
    timeout_s: float = 120.0,
    **config,
) -> dict:
    """Each strategy on each link, measured, beside the planner's prediction for that link (notebook 05).

    Where the cluster can be built, ``sweep_on_cluster``. Where it cannot (``missing()`` says why),
    the same worker on one host under ``launch``, link "loopback": the same mesh, the cross-node
    bytes counted the same way (ranks in "nodes" of ``nproc_per_node``), no step time over a link.

    Each row gains ``planned_cross_node_bytes`` and ``link_bytes`` (``plan.network_step``, fp32 values),
    ``card_bytes_per_step`` (each node's card, read by ``cable.CableBytes``; empty on one host) beside
    ``predicted_card_bytes`` (``comm.node_card_bytes`` of the counted collectives), and ``planned_step_time_s``: the
    step measured on the unlimited link plus the planner's seconds on this link. ``crossover[other]``: ``bandwidth``
    (bytes/s) where HSDP (the record's strategy that shards inside a node) and ``other`` take equally long
    (``plan.crossover_bandwidth``; None: never) and ``hsdp_faster``: "below" or "above" it, "always" or "never";
    ``text``: that in words.
    """
    from .models import build_model, param_count, unit_modules, unit_table
    from .train import TrainConfig

    cfg = TrainConfig(**config, nproc=nodes * nproc_per_node, node_size=nproc_per_node)
    if cfg.precision != "fp32":
        raise CourseInputError("links_vs_planner compares fp32 runs with the planner; use precision='fp32'")
    why_not = missing()
    if why_not is None:
        out = sweep_on_cluster(
            strategies, links, nodes=nodes, nproc_per_node=nproc_per_node, timeout_s=timeout_s, **config
        )
    else:
        from .launch import launch

        rows = launch(
            sweep_worker,
            nproc=cfg.nproc,
            args=(asdict(cfg), list(strategies), ["loopback"]),
            timeout_s=timeout_s,
            echo=False,
            progress=False,
        )[0]
        out = {"rows": rows, "links": {}, "commands": []}
    model = build_model(cfg.model)
    psi = param_count(model)
    root = next(u["numel"] for u in unit_table(model, 1, unit_modules(model)) if u["name"] == "(root)")
    base = _add_planned(out["rows"], psi, nodes, nproc_per_node, root)
    for r in out["rows"]:  # each node card's own counter per step (none on one host), and what gloo should send
        r["card_bytes_per_step"] = [b / cfg.steps for b in r.get("cable_bytes") or []]
        r["predicted_card_bytes"] = sum(k["node_card_bytes"] for k in r["comm_per_step"].values())
    return {**out, "why_not": why_not, "psi": psi, "crossover": _crossover(base, out["rows"])}


def _add_planned(rows: list[dict], psi: int, nodes: int, nproc_per_node: int, root: int = 0) -> dict:
    """Each row's planned bytes and step time (``plan.network_step``, the model's root unit kept gathered where
    the row says so); returns the unlimited link's step times."""
    from . import plan
    from .strategies import get as strategy

    base = {r["strategy"]: r["step_time_s"] for r in rows if r["link"] == "unlimited"}
    for r in rows:
        rate = None if r["link"] == "loopback" else parse_link(r["link"]).bytes_per_s
        machines = plan.Cluster(gpus_per_node=nproc_per_node, nodes=nodes, inter_bw=rate or 1e12)
        net = plan.network_step(strategy(r["strategy"]), psi, machines, bytes_per_value=4, root_params=root)
        r["planned_cross_node_bytes"] = net["cross_node_bytes"]
        r["link_bytes"] = net["network_s"] * machines.inter_bw  # what the busiest cable carries per step
        r["planned_step_time_s"] = (
            None if r["strategy"] not in base else base[r["strategy"]] + (net["network_s"] if rate else 0.0)
        )
    return base


def _crossover(base: dict, rows: list[dict]) -> dict:
    """Where HSDP (the record's strategy that shards inside a node) and each other strategy take equally long
    (notebook 05): the measured base steps plus gloo's card bytes (``predicted_card_bytes``, not the ring
    model's: gloo sends a reduce-scatter as an all-reduce) at the link's rate."""
    from . import plan
    from .strategies import get as strategy

    hybrid = next((name for name in base if strategy(name).shard_over == "node"), None)  # shards inside a node
    if hybrid is None:
        return {}
    link_bytes = {r["strategy"]: r["predicted_card_bytes"] for r in rows}
    crossover = {}
    for other in base:
        if other == hybrid:
            continue
        h, o = (base[hybrid], link_bytes[hybrid]), (base[other], link_bytes[other])
        bandwidth = plan.crossover_bandwidth(*h, *o)
        if bandwidth:
            wins = "below" if h[1] < o[1] else "above"
        else:
            wins = "always" if h[0] <= o[0] and h[1] <= o[1] else "never"
        text = (
            f"HSDP is faster than {other} {wins} {bandwidth * 8 / 1e6:,.0f} Mbit/s"
            if wins in ("below", "above")
            else f"HSDP is {'faster than' if wins == 'always' else 'never faster than'} {other} on every link"
        )
        crossover[other] = {"bandwidth": bandwidth, "hsdp_faster": wins, "text": text}
    return crossover
