"""Fault tolerance without a restart: a live TorchFT run beside torchrun's restart (notebook 06).

Under torchrun one dead rank stops the whole group; the group restarts and reloads the last
checkpoint. TorchFT (the ``torchft`` library) splits the job into *replica groups* that each hold a whole
copy of the model. A lighthouse forms a quorum of the live groups before every step; when a group
dies, the others drop the step the failure touched and go on without it, and the restarted group
copies the weights and optimizer state from a live peer ("heals") instead of reading a checkpoint.
With ``diloco=True`` the groups synchronise every H steps instead of every step (torchft's ``DiLoCo``).

From a shell (``make setup`` installs torchft; elsewhere ``pip install course-utils[ft]``)::

    python -m course_utils ft --replicas 2 --steps 12 --kill 1:3 --during-allreduce --json
    python -m course_utils ft --diloco --sync-every 4 --steps 16 --link 20mbit --kill 1:6 --restart-after never

From a notebook::

    from course_utils.ft import ft_run
    report = ft_run(replicas=2, steps=12, kill="1:3", during_allreduce=True)

What runs:

- a job manager: one ``course_utils.launch`` worker (the launcher has imported torch already) that
  forks the lighthouse and one process per replica group; when a group dies it forks a new one, as
  ``torchrun --max-restarts 1`` or a cluster scheduler would restart that group (once per group);
- the lighthouse: torchft's own ``LighthouseServer`` (the server behind the ``torchft_lighthouse``
  command), bound to one address on a free port;
- in each replica group, the course model, its slice of the course data and the course's Adam,
  wrapped in torchft's ``Manager`` and ``Optimizer`` and either its ``DistributedDataParallel``
  (a gradient all-reduce every step) or its ``DiLoCo`` (local steps, an all-reduce of the weights'
  change every H steps), over ``ProcessGroupGloo``. Weights and optimizer state heal over that same
  process group (``PGTransport``, as torchft's ``train_ddp.py`` example does).

Where it runs: with ``link=None`` every process is on this machine and listens on 127.0.0.1 only. With
``link="20mbit"`` and root, group r runs inside node r of a ``course_utils.cluster`` (network namespaces,
a rate-limited cable each), the lighthouse on node 0, and every group counts the bytes that crossed its
node's cable (``ft_nodes.link_bytes``); without root it says why and runs on loopback. How each server
is kept on its one address, torchft's manager server included (torchft takes no bind address for it),
is in ``course_utils.ft_nodes``.

Everything it starts is stopped when it returns, fails, times out or is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, fields
from pathlib import Path

from . import ft_nodes, scratch
from .errors import CourseInputError
from .ft_config import FTConfig
from .ft_jobs import JOIN_TIMEOUT_MS, job_manager

__all__ = ["INSTALL_HINT", "FTConfig", "ft_run", "summarize"]

INSTALL_HINT = "torchft is not installed; `make setup` (or `pip install course-utils[ft]`) installs it"


# ---------------------------------------------------------------- the caller's side


def _events(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _resolve_rounds(rows: list[dict]) -> list[dict]:
    """DiLoCo: a local step is committed when its round's synchronisation is (and not replaced by a heal)."""
    verdict = {
        (r["replica"], r["attempt"], r["round"]): (r["committed"] and not r.get("healed"), r["participants"])
        for r in rows
        if r.get("sync")
    }
    out = []
    for r in rows:
        if "round" in r and "step" in r:
            committed, participants = verdict.get((r["replica"], r["attempt"], r["round"]), (False, 0))
            r = {**r, "committed": committed, "participants": participants}
        out.append(r)
    return out


def _per_step(cfg: FTConfig, tries: list) -> list[dict]:
    """One row per step: committed or not, by which groups, its loss, the bytes across the link (notebook 06)."""
    rows = []
    for step in range(cfg.steps):
        mine = [r for r in tries if r["step"] == step]
        done = [r for r in mine if r["committed"]]
        rows.append(
            {
                "step": step,
                "committed": bool(done),
                "replicas": sorted(r["replica"] for r in done),
                "participants": max((r["participants"] for r in done), default=0),
                "discarded": sum(not r["committed"] for r in mine),
                "loss": statistics.fmean(r["loss"] for r in done) if done else None,
                "link_bytes": max((r["rx"] + r["tx"] for r in done if "rx" in r), default=None),
            }
        )
    return rows


def _heal_steps(cfg: FTConfig, heals: list) -> list[int]:
    """The steps whose records carry a heal's copy of the model and Adam across the link (notebook 06).

    Synchronous: the step a group healed to (the heal runs in that step's quorum). DiLoCo: the round
    before it, whole (the heal runs in the synchronisation that ends that round; ``healed_to_step`` is the
    first step after it).
    """
    h = cfg.sync_every
    return sorted(
        {
            s
            for r in heals
            for s in (range(r["healed_to_step"] - h, r["healed_to_step"]) if cfg.diloco else [r["healed_to_step"]])
        }
    )


def _timings(cfg: FTConfig, tries: list, syncs: list, heal_steps: list, kill) -> dict:
    """Median step time, time per step (DiLoCo: a round over H) and TorchFT's own cost per step (notebook 06).

    The medians are over records, one per group and step (DiLoCo: per group and round); ``timed`` counts the
    distinct steps (rounds) they come from.
    """
    # An ordinary step: every group took part, no heal in it, no failure inside it; step 0 warms up.
    ordinary = [
        r
        for r in syncs
        if r["committed"]
        and r["participants"] == cfg.replicas
        and 0 < r["step"]
        and r["step"] not in heal_steps
        and not (kill and r["t0"] <= kill["t"] <= r["t1"])
    ]
    step_time = statistics.median(r["t1"] - r["t0"] for r in ordinary) if ordinary else None
    per_step_time = step_time
    if cfg.diloco:  # a round's H steps, synchronisation included, per step
        starts = {}
        for r in tries:
            starts.setdefault((r["replica"], r["attempt"], r["round"]), r["t0"])
        rounds = [(r["t1"] - starts[(r["replica"], r["attempt"], r["round"])]) / cfg.sync_every for r in ordinary]
        per_step_time = statistics.median(rounds) if rounds else None
    # TorchFT's own cost per step (DiLoCo: per synchronisation): the quorum and the commit vote. The
    # rest (forward, backward, the all-reduce, Adam) is what plain DDP does too.
    overhead = statistics.median(r["quorum_s"] + r["commit_s"] for r in ordinary) if ordinary else None
    timed = len({r["step"] for r in ordinary})  # DiLoCo: a round's synchronising step stands for the round
    return {"step_time_s": step_time, "time_per_step_s": per_step_time, "overhead_s": overhead, "timed": timed}


def _after_the_event(cfg: FTConfig, tries: list, syncs: list, kill, hang, step_time) -> dict:
    """What a kill or a hang cost the survivors: the wait for a quorum without it, the time lost (notebook 06)."""
    event = kill or hang
    after = sorted(
        (r for r in syncs if r["replica"] != event["replica"] and r["t1"] > event["t"]), key=lambda r: r["t1"]
    )
    alone = next((r for r in after if r["committed"] and r["participants"] < cfg.replicas), None)
    window = [r for r in after if alone and r["t1"] <= alone["t1"]]
    # wall-clock time lost: from the failure to the first step committed without the failed group,
    # less the ordinary steps committed in that time
    useful = sum(r["committed"] for r in window) * (step_time or 0.0)
    out = {
        # time the survivors waited for a quorum without the dead group (about the heartbeat timeout)
        "stall_s": sum(r["quorum_s"] for r in window) if alone else None,
        "lost_s": max(0.0, alone["t1"] - event["t"] - useful) if alone else None,
    }
    if kill:
        out["killed"] = {"replica": kill["replica"], "step": kill["kill"], "where": kill["where"]}
        # work of the dead group lost with it: its local steps since its last committed synchronisation
        mine = [r for r in tries if r["replica"] == kill["replica"] and r["attempt"] == 0]
        out["steps_lost_with_it"] = sum(not r["committed"] for r in mine)
    if hang:
        out["hung"] = {"replica": hang["replica"], "step": hang["hang"], "t": hang["t"]}
    return out


def _discarded_by_group(tries: list) -> dict:
    """Steps discarded per group and attempt ("1" the first process of group 1, "1 restarted" its second)."""
    return {
        f"{g}{' restarted' if a else ''}": sum(
            not r["committed"] for r in tries if (r["replica"], r["attempt"]) == (g, a)
        )
        for g, a in sorted({(r["replica"], r["attempt"]) for r in tries})
    }


def _committed_after_heal(cfg: FTConfig, syncs: list, heal: dict) -> dict:
    """The steps each group committed from the first heal on, with the healed group in the quorum."""
    return {
        str(g): sum(r["committed"] and r["step"] >= heal["healed_to_step"] for r in syncs if r["replica"] == g)
        * (cfg.sync_every if cfg.diloco else 1)
        for g in range(cfg.replicas)
    }


def _held_s(syncs: list, heals: list) -> float | None:
    """Synchronous: how long the survivors' quorum at the step the restarted group healed to waited for it
    (the last ``FTConfig.after_heal`` steps wait for a group being restarted; notebook 06)."""
    held = [
        r["quorum_s"]
        for h in heals[:1]
        for r in syncs
        if r["step"] == h["healed_to_step"] and r["replica"] != h["replica"]
    ]
    return max(held, default=None)


def summarize(cfg: FTConfig, run_dir: Path, wall_s: float, started: dict) -> dict:
    """The report of one run, from the groups' event logs (notebook 06)."""
    rows = _events(run_dir)
    if cfg.diloco:
        rows = _resolve_rounds(rows)
    tries = [r for r in rows if "committed" in r and "step" in r and not r.get("final")]
    finals = {r["replica"]: r for r in rows if r.get("final")}  # a dead attempt writes no final row
    kill = next((r for r in rows if "kill" in r), None)
    hang = next((r for r in rows if "hang" in r), None)
    heals = [r for r in rows if "healed_to_step" in r]
    per_step = _per_step(cfg, tries)
    syncs = [r for r in tries if r.get("sync", not cfg.diloco)]
    heal_steps = _heal_steps(cfg, heals)
    timings = _timings(cfg, tries, syncs, heal_steps, kill)
    by_group = lambda key: {str(r): finals[r][key] for r in sorted(finals)}  # noqa: E731
    report = {
        "replicas": cfg.replicas,
        "steps": cfg.steps,
        "kill": cfg.kill,
        "hang": cfg.hang,
        "during_allreduce": cfg.during_allreduce,
        "restart_after": cfg.restart_after,
        "after_heal": cfg.after_heal,
        "diloco": cfg.diloco,
        "sync_every": cfg.sync_every if cfg.diloco else 1,
        "heartbeat_timeout_ms": cfg.heartbeat_timeout_ms,
        "join_timeout_ms": JOIN_TIMEOUT_MS,
        "per_step": per_step,
        "steps_discarded": sum(not r["committed"] for r in tries),
        "discarded_steps": sorted({r["step"] for r in tries if not r["committed"]}),
        "discarded_by_group": _discarded_by_group(tries),
        **timings,
        "stall_s": None,
        "lost_s": None,
        "heal_s": heals[0]["heal_s"] if heals else None,
        "healed_to_step": heals[0]["healed_to_step"] if heals else None,
        "heal_steps": heal_steps,
        "steps_while_away": sum(0 < row["participants"] < cfg.replicas for row in per_step),
        "weights_sha256": by_group("weights_sha256"),
        "adam_sha256": by_group("adam_sha256"),
        "adam_steps": by_group("adam_steps"),
        "held_out_loss": by_group("held_out_loss"),
        "final_steps": by_group("step"),
        "listening": sorted(
            {tuple(a) for f in finals.values() for a in f["listening"]} | set(map(tuple, started["listening"]))
        ),
        "wall_s": wall_s,
        "run_dir": str(run_dir),
        **{k: v for k, v in started.items() if k != "listening"},
    }
    report["weights_equal"] = len(finals) == cfg.replicas and len(set(report["weights_sha256"].values())) == 1
    report["adam_equal"] = len(finals) == cfg.replicas and len(set(report["adam_sha256"].values())) == 1
    report["committed_after_heal"] = _committed_after_heal(cfg, syncs, heals[0]) if heals else {}
    report["held_s"] = None if cfg.diloco else _held_s(syncs, heals)
    link = [row["link_bytes"] for row in per_step if row["link_bytes"] is not None and row["participants"] > 1]
    report["link_bytes"] = sum(link) if link else None  # node 0's cable, both ways, steps with 2+ groups
    if kill or hang:
        report.update(_after_the_event(cfg, tries, syncs, kill, hang, report["step_time_s"]))
    return report


def _place_runs(cfg: FTConfig):
    """Where the groups run: ``(places, cluster or None, where)``; the cluster is entered by the caller."""
    if cfg.link is None:
        return [ft_nodes.LOOPBACK], None, "loopback"
    from . import cluster

    why_not = cluster.missing()
    if why_not:
        return [ft_nodes.LOOPBACK], None, f"loopback ({why_not})"
    return None, cluster.Cluster(nodes=cfg.replicas, link=cfg.link), f"{cfg.replicas} cluster nodes, {cfg.link}"


def ft_run(cfg: FTConfig | None = None, *, run_dir=None, **overrides) -> dict:
    """Train R replica groups under TorchFT, lose one, restart and heal it; return the report (notebook 06).

    Report: ``per_step`` (for each step: committed, which groups committed it, the quorum's
    number of groups, tries discarded, the mean loss of the groups that committed it, and on a
    cluster the bytes that crossed node 0's cable during it), ``steps_discarded`` (step tries thrown
    away), ``discarded_steps`` and ``discarded_by_group``, ``stall_s`` (time the survivors waited for a quorum without the
    dead group: about the lighthouse's heartbeat timeout), ``lost_s`` (wall clock from the failure
    to the survivors' first step without the dead group, less the useful steps in between),
    ``steps_lost_with_it`` (local steps of the dead group never committed), ``heal_s`` (the restarted
    group copying the model and Adam state from a live peer), ``healed_to_step``, ``heal_steps`` (the steps
    whose records carry the heal's copy: that step; DiLoCo: the round before it), ``committed_after_heal``
    (per group, steps committed from the heal on), ``held_s`` (synchronous: how long the
    survivors' quorum at that step waited for the restarted group, see ``FTConfig.after_heal``), ``steps_while_away``,
    ``step_time_s`` (median step with every group in, the heal's steps aside; DiLoCo: median synchronising step),
    ``time_per_step_s`` (the same; DiLoCo: a round's duration over its H steps, median) and
    ``overhead_s`` (its median quorum plus commit vote), ``timed`` (how many distinct steps, DiLoCo: rounds,
    those medians are over; each has a record per group), ``weights_sha256`` and ``adam_sha256``
    (Adam's moments and step counts) per group with ``weights_equal`` and ``adam_equal``, ``held_out_loss``
    (per group, the final weights' loss on a batch no step trained on),
    ``link_bytes``, ``where`` (loopback or the cluster), ``listening`` (every address a group's
    process listened on at the end), ``pids`` (every process started), ``lighthouse`` (its address),
    ``command`` (the ``python -m course_utils ft`` line of the same run),
    and the job manager's ``exits``, ``restarts`` and ``stopped`` (a failure nobody planned, with a
    ``hang``). ``run_dir`` (each group's log and event file) is kept when you pass it, or when the
    run fails; a temporary one is removed after a run that returned (the report's ``run_dir`` is then None).

    Raises:
        CourseInputError: bad input, or torchft missing (nothing is started).
        LaunchTimeout: the run outlived ``timeout_s`` (everything was stopped).
        WorkerFailed: a group failed other than as planned (without ``hang``).
    """
    from .launch import launch

    cfg = FTConfig(**{**asdict(cfg or FTConfig()), **overrides}).validate()
    if importlib.util.find_spec("torchft") is None:
        raise CourseInputError(INSTALL_HINT)
    own_dir = run_dir is None
    run_dir = Path(run_dir) if run_dir else scratch.folder("course-ft-")
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    env = {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft's Rust side logs every quorum at INFO
    places, nodes, where = _place_runs(cfg)
    with nodes or contextlib.nullcontext():
        if nodes is not None:
            places = ft_nodes.node_places(nodes)
        jobs = launch(
            job_manager,
            nproc=1,
            args=(asdict(cfg), places, str(run_dir)),
            timeout_s=cfg.timeout_s,
            run_dir=run_dir,
            env=env,
            progress=False,
            echo=False,
        )[0]
    pids = [int(line) for line in (run_dir / "pids.txt").read_text().split()]
    lighthouse = (run_dir / "lighthouse").read_text()
    report = summarize(
        cfg, run_dir, time.monotonic() - start, {"lighthouse": lighthouse, "pids": pids, "where": where, **jobs}
    )
    report["command"] = command_line(cfg)
    if own_dir:  # everything is in the report; a failed run keeps its folder (its path is in the error)
        shutil.rmtree(run_dir, ignore_errors=True)
        report["run_dir"] = None
        if report["stopped"]:
            report["stopped"]["log"] = None  # its last line is in the report: "error"
    return report


# ---------------------------------------------------------------- command line


_FIELDS = {f.name for f in fields(FTConfig)}


def _restart_after(text: str) -> int | None:
    return None if text == "never" else int(text)


def ft_arguments(parser: argparse.ArgumentParser) -> None:
    d = FTConfig()
    parser.add_argument("--replicas", type=int, default=d.replicas, help="replica groups (one process each)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--kill", default=None, metavar="REPLICA:STEP", help="that group dies at that step, once")
    parser.add_argument(
        "--during-allreduce",
        action="store_true",
        help="die inside the step's gradient all-reduce instead of between steps",
    )
    parser.add_argument(
        "--hang", default=None, metavar="REPLICA:STEP", help="that group's Python stops for ever before that step"
    )
    parser.add_argument("--diloco", action="store_true", help="synchronise every --sync-every steps (torchft's DiLoCo)")
    parser.add_argument("--sync-every", type=int, default=d.sync_every, metavar="H", help="local steps per round")
    parser.add_argument("--outer-lr", type=float, default=d.outer_lr, help="DiLoCo's outer SGD (Nesterov) rate")
    parser.add_argument(
        "--link",
        default=None,
        help="run each group on a node of a cluster joined by this link (e.g. 20mbit; root), else on loopback",
    )
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--batch", type=int, default=d.batch, help="global batch (all groups together)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--restart-after",
        type=_restart_after,
        default=d.restart_after,
        metavar="N|never",
        help="restart the dead group once the survivors have committed N steps without it",
    )
    parser.add_argument(
        "--after-heal", type=int, default=d.after_heal, metavar="N", help="the last N steps wait for it"
    )
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms)
    parser.add_argument("--quorum-timeout-s", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")


def command_line(cfg: FTConfig) -> str:
    """The ``python -m course_utils ft`` line that runs ``cfg``: each option whose value differs from its default.

    Read off ``ft_arguments``'s own options, so a new option is in the line as soon as the parser has it.
    ``heal_optimizer`` has no option (the copy-the-weights-only heal is a notebook's comparison): False is said.
    """
    parser = argparse.ArgumentParser()
    ft_arguments(parser)
    words = ["python -m course_utils ft"]
    for action in parser._actions:
        value = getattr(cfg, action.dest, None)
        if not action.option_strings or action.dest not in _FIELDS:
            continue
        if value == action.default and action.dest not in ("replicas", "steps"):  # those two always said
            continue
        if action.nargs == 0:  # a flag (store_true)
            words.append(action.option_strings[0])
        else:
            words.append(f"{action.option_strings[0]} {'never' if value is None else value}")
    if not cfg.heal_optimizer:
        words.append("# and heal_optimizer=False (no option: ft_run only)")
    return " ".join(words)


def ft_command(args) -> int:
    report = ft_run(FTConfig(**{f.name: getattr(args, f.name) for f in fields(FTConfig) if hasattr(args, f.name)}))
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    print(f"where: {report['where']}; lighthouse {report['lighthouse']}")
    for row in report["per_step"]:
        print(
            f"step {row['step']:3d}: committed by {row['replicas']} ({row['participants']} in the quorum)"
            + (f", loss {row['loss']:.4f}" if row["loss"] is not None else "")
            + (f", {row['link_bytes']:,} B over node 0's link" if row["link_bytes"] is not None else "")
            + (f", {row['discarded']} try discarded" if row["discarded"] else "")
        )
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"  # noqa: E731
    print(
        f"steps discarded {report['steps_discarded']}, survivors waited {ms(report['stall_s'])}, heal "
        f"{ms(report['heal_s'])}, steps committed after the heal {report['committed_after_heal'] or '-'}; "
        f"a step {ms(report['step_time_s'])}, of which quorum + commit vote {ms(report['overhead_s'])} "
        f"(CPU/gloo timings); wall {report['wall_s']:.1f} s; final weights equal: {report['weights_equal']}, "
        f"Adam state equal: {report['adam_equal']}"
    )
    if report["stopped"]:
        s = report["stopped"]
        print(f"stopped: replica {s['replica']} failed (exit code {s['code']}): {s['error']}")
    return 0
