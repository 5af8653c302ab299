"""Training across several "nodes" of one Linux machine, with torchrun on each (notebooks 05 and 06).

The nodes are network namespaces joined by a rate-limited link (``course_utils.namespaces``); this
module runs jobs on them: ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
--rdzv-endpoint <node 0>:<port>`` inside every namespace (``ip netns exec``), exactly the line one
would type on each machine of a real cluster. torch ignores ``--node-rank`` with the c10d
rendezvous (it assigns node ranks itself, in the order of ``--local-addr``), so that is what orders
the nodes here. ``train_on_cluster`` trains (and can lose a node, notebook 06); ``sweep_on_cluster``
runs every strategy on every link in one job; ``links_vs_planner`` sets the measurements beside the
planner's prediction.

Linux and root only; ``namespaces.missing()`` says in one sentence what this machine lacks, and
nothing a run creates outlives it (``namespaces``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .errors import CourseInputError
from .namespaces import IFACE, Cluster, Node, clean_command, missing, parse_link, require

# ------------------------------------------------------------------ torchrun across the nodes


def torchrun_argv(
    cluster: Cluster,
    node: Node,
    endpoint: str,
    *,
    nproc_per_node: int,
    module_argv: list[str],
    max_restarts: int = 0,
    rdzv_id: str,
) -> list[str]:
    """The torchrun line of one node, as one would type it on that machine (notebook 05)."""
    # node 0 hosts the rendezvous store (torch's guess compares host names, which all namespaces
    # share); a dead node is declared dead after 2 missed 1 s heartbeats (the default waits 15 s)
    conf = f"is_host={int(node.addr == endpoint.rpartition(':')[0])},join_timeout=60,"
    conf += "keep_alive_interval=1,keep_alive_max_attempt=2"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.size)]
    argv += ["--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    argv += ["--rdzv-id", rdzv_id, "--local-addr", node.addr, "--max-restarts", str(max_restarts)]
    return [*argv, "--rdzv-conf", conf, "--monitor-interval", "0.1", *module_argv]


def _node_env(timeout_s: float, progress_dir: str | None) -> dict:
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env = {
        "GLOO_SOCKET_IFNAME": IFACE,  # gloo talks over the node's card, not loopback
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a fresh store per restart (pytorch/pytorch#135712)
        "COURSE_TIMEOUT_S": str(timeout_s),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p),
    }
    if progress_dir:
        env["COURSE_PROGRESS_DIR"] = progress_dir
    return env


def _report_from_logs(cluster: Cluster) -> dict | None:
    """Rank 0's JSON report line, from whichever node's log holds it."""
    for log in sorted(cluster.log_dir.glob("*.log")):
        for line in reversed(log.read_text(errors="replace").splitlines()):
            start = line.find("{")
            if start >= 0 and '"losses"' in line:
                try:
                    return json.loads(line[start:])
                except json.JSONDecodeError:
                    continue
    return None


def _tail(cluster: Cluster, lines: int = 15) -> str:
    parts = []
    for log in sorted(cluster.log_dir.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(text))
    return "\n".join(parts)


def _wait(procs: list[subprocess.Popen], deadline: float, cluster: Cluster, on_tick=None) -> None:
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(
                "the cluster run did not finish in time; every process was stopped. Last output:\n" + _tail(cluster)
            )
        if on_tick:
            on_tick()
        time.sleep(0.02)
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(
            f"torchrun exited with status {bad[0]} on a node; every process was stopped. "
            "Last output:\n" + _tail(cluster)
        )


def _start_job(
    cluster: Cluster, module_argv: list[str], *, nproc_per_node: int, max_restarts: int, env: dict
) -> tuple[list[subprocess.Popen], callable]:
    """Start torchrun on every node; return the processes and ``argv_of(node)`` (for replacements)."""
    head = cluster.nodes[0]
    endpoint = f"{head.addr}:{cluster.free_port(head)}"

    def argv_of(node):
        return torchrun_argv(
            cluster,
            node,
            endpoint,
            nproc_per_node=nproc_per_node,
            module_argv=module_argv,
            max_restarts=max_restarts,
            rdzv_id=cluster.run,
        )

    return [cluster.start(node, argv_of(node), env) for node in cluster.nodes], argv_of


def _steps_done(progress: str) -> int | None:
    done = []
    for f in Path(progress).glob("rank*.json"):
        try:
            done.append(json.loads(f.read_text())["step"])
        except (OSError, ValueError, KeyError):
            pass
    return max(done) if done else None


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
    _check_shape(nodes, nproc_per_node, timeout_s)
    start = time.monotonic()
    with Cluster(nodes, link) as cluster:
        progress = str(cluster.scratch("progress"))
        procs, argv_of = _start_job(
            cluster,
            ["-m", "course_utils.train", *train_flags(cfg), "--json"],
            nproc_per_node=nproc_per_node,
            max_restarts=cfg.max_restarts,
            env=_node_env(cfg.timeout_s, progress),
        )
        lose_when_due, lost = _node_loss(cluster, procs, argv_of, _node_env(cfg.timeout_s, progress), lose_node_after)
        _wait(procs, start + timeout_s, cluster, on_tick=lose_when_due)
        report = _report_from_logs(cluster)
        if report is None:
            raise RuntimeError("the run finished without rank 0's report. Last output:\n" + _tail(cluster))
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
        done = _steps_done(env["COURSE_PROGRESS_DIR"]) or 0
        if after is None or lost or done < after:
            return
        lost.append(done)
        cluster.lose(cluster.nodes[-1])
        procs.pop()
        replacement = cluster.add_node()
        procs.append(cluster.start(replacement, argv_of(replacement), env))

    return tick, lost


def _check_shape(nodes: int, nproc_per_node: int, timeout_s: float) -> None:
    """The cluster's shape and time limit against their stated ranges, before any namespace exists."""
    from .validate import check_values, max_local_ranks

    check_values("cluster", {"nodes": nodes, "nproc_per_node": nproc_per_node, "wall_timeout_s": timeout_s})
    if nodes * nproc_per_node > max_local_ranks():
        raise CourseInputError(
            f"{nodes} nodes x {nproc_per_node} ranks is more than this machine can start ({max_local_ranks()})"
        )


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
    _check_shape(nodes, nproc_per_node, timeout_s)
    start = time.monotonic()
    with Cluster(nodes, parsed[0]) as cluster:
        phases = str(cluster.scratch("phases"))
        args = json.dumps([asdict(cfg), list(strategies), links, phases])
        procs, argv_of = _start_job(
            cluster,
            ["-m", "course_utils.worker", "course_utils.cluster:sweep_worker", "--args", args],
            nproc_per_node=nproc_per_node,
            max_restarts=0,
            env=_node_env(cfg.timeout_s, None),
        )
        shaped = {}

        def serve_links():
            for i, link in enumerate(links):
                if link not in shaped and (Path(phases) / f"want-{i}.json").exists():
                    cluster.set_link(parsed[i])
                    shaped[link] = cluster.describe_link()
                    (Path(phases) / f"done-{i}").touch()

        _wait(procs, start + timeout_s, cluster, on_tick=serve_links)
        result = Path(phases) / "result.json"
        if not result.exists():
            raise RuntimeError("the sweep finished without rank 0's rows. Last output:\n" + _tail(cluster))
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


# ------------------------------------------------------------------ command line


def cluster_arguments(parser) -> None:
    """``train``'s flags, less ``--nproc`` and ``--node-size`` (the cluster's shape sets them), plus its own (notebook 05)."""
    from .train import train_arguments

    train_arguments(parser, one_machine=False)
    parser.set_defaults(strategy="hybrid_shard")  # the strategy a slow link between nodes is for
    parser.add_argument("--nodes", type=int, default=2, help='namespaces ("machines") on the switch')
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node")
    parser.add_argument(
        "--link",
        default="unlimited",
        help="each node's link: unlimited, 100mbit, 1gbit, or RATE,DELAY (delay needs netem)",
    )
    parser.add_argument("--wall-timeout-s", type=float, default=300.0, help="the whole run, then everything is stopped")
    parser.add_argument(
        "--clean",
        action="store_true",
        help="run nothing: remove the namespaces, processes and folders that killed cluster runs left",
    )


class Terminated(Exception):
    """The command was sent SIGTERM: handled as an interrupt, everything of the run removed first."""


def _terminated(signum, frame):
    raise Terminated()


def cluster_command(args) -> int:
    """``python -m course_utils cluster ...`` (notebook 05). SIGTERM ends it as Ctrl-C does: cleanly."""
    from .train import _config_from_args, print_report

    if args.clean:
        return clean_command()
    parse_link(args.link)  # the input first: refusing it needs nothing from this machine
    args.nproc, args.node_size = args.nodes * args.nproc_per_node, args.nproc_per_node
    cfg = _config_from_args(args)
    require()  # then what the machine lacks, before anything is built
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        report = train_on_cluster(
            cfg, nodes=args.nodes, nproc_per_node=args.nproc_per_node, link=args.link, timeout_s=args.wall_timeout_s
        )
    except (RuntimeError, TimeoutError) as exc:  # a failed run, already torn down: say why, no traceback
        print(f"python -m course_utils cluster: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print(
            "python -m course_utils cluster: stopped by SIGTERM; every process, namespace and folder of the "
            "run was removed",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(report, args.json)
    if not args.json:
        print(
            f"link {report['link']['rate'] or 'unlimited'}, delay {report['link']['delay'] or 'none'}; "
            f"{report['cross_node_bytes_per_step']:.0f} B per step from one rank to other nodes"
        )
    return 0
