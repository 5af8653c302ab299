"""Fault tolerance without a restart: a live TorchFT run beside torchrun's restart (notebook 06).

Under torchrun one dead rank stops the whole group; the group restarts and reloads the last
checkpoint. TorchFT (the ``torchft`` library) splits the job into *replica groups* that each hold a whole
copy of the model. A lighthouse forms a quorum of the live groups before every step; when a group
dies, the others drop the step the failure touched and go on without it, and the restarted group
copies the weights and optimizer state from a live peer ("heals") instead of reading a checkpoint.

From a shell (``make setup`` installs torchft; elsewhere ``pip install course-utils[ft]``)::

    python -m course_utils ft --replicas 2 --steps 16 --kill 1:3 --json
    python -m course_utils ft --replicas 2 --steps 16 --kill 1:3 --during-allreduce --json

From a notebook::

    from course_utils.ft import ft_run
    report = ft_run(replicas=2, steps=16, kill="1:3", during_allreduce=True)

What runs:

- the lighthouse, torchft's own (``LighthouseServer``, the server behind the ``torchft_lighthouse``
  command), in the calling process, bound to 127.0.0.1 on a free port;
- a job manager: one ``course_utils.launch`` worker (the launcher has imported torch already) that
  forks one process per replica group; when a group dies it forks a new one, as
  ``torchrun --max-restarts 1`` or a cluster scheduler would restart that group (once per group);
- in each replica group, the course model, its slice of the course data and the course's Adam,
  wrapped in torchft's ``Manager``, ``DistributedDataParallel`` and ``Optimizer`` over
  ``ProcessGroupGloo``. Weights and optimizer state heal over that same process group
  (``PGTransport``, as torchft's ``train_ddp.py`` example does).

Everything it starts (lighthouse, job manager, replicas) is stopped when it returns, fails, times
out or is interrupted. torchft's own servers (each group's manager, its store) listen on every
interface of this machine: torchft 2026.10.26 takes no bind address for them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

from .errors import CourseInputError
from .validate import check_values

INSTALL_HINT = "torchft is not installed; `make setup` (or `pip install course-utils[ft]`) installs it"


@dataclass
class FTConfig:
    """One TorchFT run: R replica groups of one process each, K steps, one planned failure (notebook 06)."""

    replicas: int = 2  # replica groups (R); each holds the whole model
    steps: int = 16  # committed steps every group ends at (K)
    kill: str | None = None  # "REPLICA:STEP": that group dies at that step (first attempt only)
    during_allreduce: bool = False  # die inside the step's gradient all-reduce, not between steps
    # The job manager restarts the dead group once the survivors have committed this many steps
    # without it, so the run shows both phases on any machine. A real job manager restarts as soon as
    # it can, and a restart (new process, imports, joining) takes seconds to minutes.
    restart_after: int = 2
    model: str = "tiny"
    batch: int = 8  # global batch per step, split across the R groups
    lr: float = 3e-3
    seed: int = 0
    # How long the lighthouse waits for a silent group's heartbeat before it forms a quorum without
    # it (torchft's default is 5000 ms). 1000 ms keeps a notebook run short and is still 10 of the
    # managers' 100 ms heartbeats: a busy CPU does not miss that many.
    heartbeat_timeout_ms: int = 1000
    timeout_s: float = 60.0  # the whole run; everything is stopped after it

    def validate(self) -> FTConfig:
        from .failures import parse_failures

        check_values("ft", self)  # types and stated ranges (course_utils.validate)

        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 2:
            raise CourseInputError(
                f"--replicas must be a whole number >= 2 (one group to lose, one to survive), got {self.replicas!r}"
            )
        if isinstance(self.batch, int) and self.batch >= 1 and self.batch % self.replicas:
            raise CourseInputError(
                f"--batch {self.batch} does not split across {self.replicas} replica groups; "
                f"pick a multiple of {self.replicas}"
            )
        self.train_config()  # steps, lr, model: the checks train.py makes
        kills = parse_failures(self.kill, "--kill")
        if len(kills) > 1:
            raise CourseInputError(f"--kill takes one REPLICA:STEP, got {self.kill!r}")
        for replica, step in kills:
            if not 0 <= replica < self.replicas or not 0 <= step < self.steps:
                raise CourseInputError(
                    f"--kill {self.kill}: REPLICA must be in 0..{self.replicas - 1} and STEP in "
                    f"0..{self.steps - 1} (a step the run reaches)"
                )
        if self.during_allreduce and not kills:
            raise CourseInputError("--during-allreduce needs --kill REPLICA:STEP (which group dies, and when)")
        if not isinstance(self.restart_after, int) or isinstance(self.restart_after, bool) or self.restart_after < 0:
            raise CourseInputError(f"--restart-after must be a whole number of steps >= 0, got {self.restart_after!r}")
        if not isinstance(self.heartbeat_timeout_ms, int) or self.heartbeat_timeout_ms < 200:
            raise CourseInputError(
                f"heartbeat_timeout_ms must be a whole number >= 200, got {self.heartbeat_timeout_ms!r}"
            )
        if not self.timeout_s or self.timeout_s <= 0:
            raise CourseInputError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        return self

    def train_config(self):
        """The same run as ``train.TrainConfig`` sees it: R ranks of plain DDP (notebook 06)."""
        from .train import TrainConfig

        return TrainConfig(
            strategy="ddp",
            nproc=self.replicas,
            steps=self.steps,
            model=self.model,
            batch=self.batch,
            lr=self.lr,
            seed=self.seed,
        ).validate()

    def kill_at(self) -> tuple[int, int] | None:
        """``(replica, step)`` of the planned failure, or None (notebook 06)."""
        from .failures import parse_failures

        kills = parse_failures(self.kill, "--kill")
        return kills[0] if kills else None


# ---------------------------------------------------------------- one replica group (a forked process)


def replica_main(cfg: FTConfig, replica: int, attempt: int, lighthouse: str, run_dir: Path) -> None:
    """One replica group's training with torchft, through the course's one loop (notebook 06).

    The loop is ``loop.run_steps`` with torchft's three pieces in it: before each step the
    optimizer wrapper's ``zero_grad`` asks the lighthouse for a quorum (and heals this group from
    a live peer when it is behind), DDP's gradient all-reduce runs over the quorum's process
    group, and the wrapper's ``step`` applies the update only if every group's all-reduce worked
    (``should_commit``). The step numbers are the manager's (``quorum_steps``): a discarded step
    is tried again, and a group that healed jumps to the step its peer is at.
    """
    from datetime import timedelta

    import torch
    import torchft
    from torchft.checkpointing.pg_transport import PGTransport

    from .failures import die_hard
    from .instrument import Observer, weights_sha256
    from .loop import Prepared, make_optimizer, module_held, run_steps
    from .models import build_model, get_config

    # R processes on a few cores: split the cores, as course_utils.dist.init does for torchrun's workers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.replicas))
    mcfg = get_config(cfg.model)
    model = build_model(mcfg, seed=cfg.seed)  # every group starts from the same weights (init_sync off)
    inner = make_optimizer(model.parameters(), cfg.train_config())
    # One process per group, so the group's own store is local to it.
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=10))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    healed = []
    recv = transport.recv_checkpoint

    def timed_recv(*args, **kwargs):  # heal_s: the copy from the live peer, timed where it happens
        t0 = time.perf_counter()
        state = recv(*args, **kwargs)
        healed.append(time.perf_counter() - t0)
        return state

    transport.recv_checkpoint = timed_recv
    manager = torchft.Manager(
        pg=pg,
        min_replica_size=1,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        # Synchronous quorum: a group that heals loads the peer's state before its forward pass and
        # takes a full part in that same step (torchft's default overlaps the quorum with forward).
        use_async_quorum=False,
        init_sync=False,
        checkpoint_transport=transport,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=cfg.timeout_s),
        connect_timeout=timedelta(seconds=10),
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.Optimizer(manager, inner)

    votes = []
    should_commit = manager.should_commit

    def timed_commit(*args, **kwargs):  # the commit vote, the other half of TorchFT's cost per step
        t0 = time.perf_counter()
        decision = should_commit(*args, **kwargs)
        votes.append(time.perf_counter() - t0)
        return decision

    manager.should_commit = timed_commit  # the optimizer wrapper's step() calls manager.should_commit
    kill = cfg.kill_at() if attempt == 0 else None
    events = open(run_dir / f"events-{replica}-{attempt}.jsonl", "w")

    def record(**row):
        events.write(json.dumps({"replica": replica, "attempt": attempt, **row}) + "\n")
        events.flush()

    if kill and kill[0] == replica and cfg.during_allreduce:
        allreduce = manager.allreduce

        def die_in_allreduce(tensor, *args, **kwargs):  # DDP's comm hook calls manager.allreduce
            if manager.current_step() == kill[1]:  # the peers' all-reduce of this step waits for our part
                record(kill=kill[1], where="allreduce", t=time.time())
                die_hard(f"replica {replica} inside the gradient all-reduce of step {kill[1]}")
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = die_in_allreduce

    # Start together: every group is heartbeating before any asks for the first quorum.
    (run_dir / f"ready-{replica}").touch()
    while attempt == 0 and not all((run_dir / f"ready-{r}").exists() for r in range(cfg.replicas)):
        time.sleep(0.01)

    clock = {}

    def quorum_steps():
        """The step numbers as the manager hands them out: a step starts with its quorum, before the batch."""
        while manager.current_step() < cfg.steps:
            if kill and kill[0] == replica and not cfg.during_allreduce and manager.current_step() == kill[1]:
                record(kill=kill[1], where="between", t=time.time())
                die_hard(f"replica {replica} between steps, before step {kill[1]}")
            clock["t0"] = time.time()
            optimizer.zero_grad()  # the quorum for this step; heals this group here if it is behind
            clock["quorum"] = time.time()
            step = manager.current_step()
            if healed:
                record(healed_to_step=step, heal_s=healed.pop(), t=clock["quorum"])
            if step >= cfg.steps:  # healed from a peer that had already finished
                return
            yield step

    class Committed(Observer):  # what the manager decided about each step, as the loop runs it
        def after_forward(self, step, loss):
            self.loss = loss

        def after_update(self, step):
            record(
                step=step,
                committed=manager.current_step() > step,
                participants=manager.num_participants(),
                t0=clock["t0"],
                quorum_s=clock["quorum"] - clock["t0"],
                commit_s=votes.pop(),
                t1=time.time(),
                loss=float(self.loss),
            )

    # The loop's optimizer: torchft's step (applied only if should_commit() says every group's all-reduce
    # worked); its zero_grad only clears gradients, the quorum being quorum_steps' first act of a step.
    update = SimpleNamespace(step=optimizer.step, zero_grad=inner.zero_grad)
    prepared = Prepared(
        model=ddp, optimizer=update, full_state_dict=model.state_dict, held=lambda: module_held(model, inner)
    )
    info = SimpleNamespace(rank=replica, world_size=cfg.replicas, device=torch.device("cpu"))
    run_steps(prepared, cfg.train_config(), info, quorum_steps(), [Committed()])

    # A group that finished keeps answering quorums (no steps) until every group has finished, so a
    # restarted group that arrives late can still heal from it.
    (run_dir / f"done-{replica}").touch()
    while time.sleep(0.05) or not all((run_dir / f"done-{r}").exists() for r in range(cfg.replicas)):
        optimizer.zero_grad()
    record(
        final=True,
        step=manager.current_step(),
        weights_sha256=weights_sha256(model.state_dict()),
        t=time.time(),
        pid=os.getpid(),
    )
    events.close()
    manager.shutdown(wait=False)


# ---------------------------------------------------------------- the job manager (a child process)


def _fork_replica(cfg: FTConfig, replica: int, attempt: int, lighthouse: str, run_dir: Path) -> int:
    """Fork one replica group's process; its output goes to its own log file."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's SIGTERM to the group ends it at once
        fd = os.open(run_dir / f"replica-{replica}-{attempt}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        replica_main(cfg, replica, attempt, lighthouse, run_dir)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _committed_without(run_dir: Path, cfg: FTConfig, replica: int) -> int:
    """Steps the other groups have committed with fewer than all R groups in the quorum."""
    steps = set()
    for path in run_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("committed") and row["replica"] != replica and row["participants"] < cfg.replicas:
                steps.add(row["step"])
    return len(steps)


def job_manager(config: dict, lighthouse: str, run_dir: str) -> dict:
    """Start every replica group, restart a group that dies (once), wait for all (notebook 06).

    Runs as one ``launch`` worker, forked from the launcher's agent server with torch already
    imported, and forks the groups itself: starting or restarting a group costs a fork, not a
    fresh Python and torch import. A dead group is restarted once the survivors have committed
    ``restart_after`` steps without it (or have all finished). Every pid goes to ``pids.txt``.
    """
    import torch._dynamo  # noqa: F401  (building any torch optimizer imports it: once, before the forks)
    import torchft  # noqa: F401
    from torchft.checkpointing.pg_transport import PGTransport  # noqa: F401

    cfg, run_dir = FTConfig(**config), Path(run_dir)
    pids = open(run_dir / "pids.txt", "a")

    def start(replica: int, attempt: int) -> int:
        pid = _fork_replica(cfg, replica, attempt, lighthouse, run_dir)
        pids.write(f"{pid}\n")
        pids.flush()
        return pid

    pids.write(f"{os.getpid()}\n")
    running = {start(r, 0): (r, 0) for r in range(cfg.replicas)}
    jobs, dead = {"exits": [], "restarts": []}, []
    while running or dead:
        pid, status = os.waitpid(-1, os.WNOHANG) if running else (0, 0)
        if pid in running:
            replica, attempt = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            jobs["exits"].append({"replica": replica, "attempt": attempt, "code": code, "pid": pid, "t": time.time()})
            if code != 0 and attempt > 0:
                raise RuntimeError(
                    f"replica {replica} failed again after its restart (exit code {code}); "
                    f"its log: {run_dir / f'replica-{replica}-{attempt}.log'}"
                )
            if code != 0:  # the job manager's answer to a dead group: start it again
                dead.append(replica)
        for replica in list(dead):
            others_done = all((run_dir / f"done-{r}").exists() for r in range(cfg.replicas) if r != replica)
            if others_done or _committed_without(run_dir, cfg, replica) >= cfg.restart_after:
                running[start(replica, 1)] = (replica, 1)
                jobs["restarts"].append({"replica": replica, "t": time.time()})
                dead.remove(replica)
        time.sleep(0.02)
    return jobs


# ---------------------------------------------------------------- the caller's side


def _events(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def summarize(cfg: FTConfig, run_dir: Path, wall_s: float, started: dict) -> dict:
    """The report of one run, from the groups' event logs (notebook 06)."""
    rows = _events(run_dir)
    tries = [r for r in rows if "committed" in r]
    finals = {r["replica"]: r for r in rows if r.get("final")}  # a dead attempt writes no final row
    kill = next((r for r in rows if "kill" in r), None)
    per_step = []
    for step in range(cfg.steps):
        mine = [r for r in tries if r["step"] == step]
        done = [r for r in mine if r["committed"]]
        per_step.append(
            {
                "step": step,
                "committed": bool(done),
                "replicas": sorted(r["replica"] for r in done),
                "participants": max((r["participants"] for r in done), default=0),
                "discarded": sum(not r["committed"] for r in mine),
            }
        )
    # An ordinary step: every group took part, none healed, no kill inside it; step 0 warms up.
    heal_steps = {r["healed_to_step"] for r in rows if "healed_to_step" in r}
    ordinary = [
        r
        for r in tries
        if r["committed"]
        and r["participants"] == cfg.replicas
        and 0 < r["step"]
        and r["step"] not in heal_steps
        and not (kill and r["t0"] <= kill["t"] <= r["t1"])
    ]
    step_time = statistics.median(r["t1"] - r["t0"] for r in ordinary) if ordinary else None
    # TorchFT's own cost per step: the quorum and the commit vote. The rest of a step (forward,
    # backward, the gradient all-reduce, Adam) is what plain DDP does too.
    overhead = statistics.median(r["quorum_s"] + r["commit_s"] for r in ordinary) if ordinary else None
    heals = [r for r in rows if "healed_to_step" in r]
    report = {
        "replicas": cfg.replicas,
        "steps": cfg.steps,
        "kill": cfg.kill,
        "during_allreduce": cfg.during_allreduce,
        "heartbeat_timeout_ms": cfg.heartbeat_timeout_ms,
        "per_step": per_step,
        "steps_discarded": sum(not r["committed"] for r in tries),
        "discarded_steps": sorted({r["step"] for r in tries if not r["committed"]}),
        "step_time_s": step_time,
        "overhead_s": overhead,
        "stall_s": None,
        "lost_s": None,
        "heal_s": heals[0]["heal_s"] if heals else None,
        "healed_to_step": heals[0]["healed_to_step"] if heals else None,
        "steps_while_away": sum(0 < row["participants"] < cfg.replicas for row in per_step),
        "weights_sha256": {str(r): finals[r]["weights_sha256"] for r in sorted(finals)},
        "final_steps": {str(r): finals[r]["step"] for r in sorted(finals)},
        "wall_s": wall_s,
        "run_dir": str(run_dir),
        **started,
    }
    report["weights_equal"] = len(finals) == cfg.replicas and len(set(report["weights_sha256"].values())) == 1
    if kill:
        after = sorted(
            (r for r in tries if r["replica"] != kill["replica"] and r["t1"] > kill["t"]), key=lambda r: r["t1"]
        )
        alone = next((r for r in after if r["committed"] and r["participants"] < cfg.replicas), None)
        window = [r for r in after if alone and r["t1"] <= alone["t1"]]
        # time the survivors waited for a quorum without the dead group (about the heartbeat timeout)
        report["stall_s"] = sum(r["quorum_s"] for r in window) if alone else None
        # wall-clock time lost: from the kill to the first step committed without the dead group,
        # less the ordinary steps committed in that time
        useful = sum(r["committed"] for r in window) * (step_time or 0.0)
        report["lost_s"] = max(0.0, alone["t1"] - kill["t"] - useful) if alone else None
        report["killed"] = {"replica": kill["replica"], "step": kill["kill"], "where": kill["where"]}
    return report


def ft_run(cfg: FTConfig | None = None, *, run_dir=None, **overrides) -> dict:
    """Train R replica groups under TorchFT, lose one, restart and heal it; return the report (notebook 06).

    Report: ``per_step`` (for each step: committed, which groups committed it, the quorum's
    number of groups, tries discarded), ``steps_discarded`` (step tries thrown away) and
    ``discarded_steps`` (which steps), ``stall_s`` (time the survivors waited for a quorum without
    the dead group: about the lighthouse's heartbeat timeout), ``lost_s`` (wall clock from the kill
    to the survivors' first step without the dead group, less the useful steps in between),
    ``heal_s`` (the restarted group copying the model and Adam state from a live peer) and
    ``healed_to_step``, ``steps_while_away``, ``step_time_s`` (median step with every group in) and
    ``overhead_s`` (its median quorum plus commit vote: what TorchFT adds to a plain DDP step),
    ``weights_sha256`` per group and ``weights_equal``, ``pids`` (every process started) and
    ``lighthouse`` (its address). ``run_dir`` keeps each group's log and event file.

    Raises:
        CourseInputError: bad input, or torchft missing (nothing is started).
        LaunchTimeout: the run outlived ``timeout_s`` (everything was stopped).
        WorkerFailed: a group failed other than as planned.
    """
    from .launch import launch

    cfg = FTConfig(**{**asdict(cfg or FTConfig()), **overrides}).validate()
    if importlib.util.find_spec("torchft") is None:
        raise CourseInputError(INSTALL_HINT)
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="course-ft-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    rust_log = os.environ.get("RUST_LOG")
    os.environ["RUST_LOG"] = rust_log or "warn"  # torchft's Rust side logs every quorum at INFO; read at import
    try:
        from torchft._torchft import LighthouseServer
    finally:
        if rust_log is None:
            del os.environ["RUST_LOG"]
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=5000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
    )
    try:
        # it advertises the machine's host name; it is bound to 127.0.0.1
        address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
        env = {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        if os.path.exists("/sys/class/net/lo"):  # gloo's sockets on the loopback interface
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        jobs = launch(
            job_manager,
            nproc=1,
            args=(asdict(cfg), address, str(run_dir)),
            timeout_s=cfg.timeout_s,
            run_dir=run_dir,
            env=env,
            progress=False,
            echo=False,
        )[0]
    finally:  # launch has stopped every process it started (job manager and groups) by now
        lighthouse.shutdown()
    pids = [int(line) for line in (run_dir / "pids.txt").read_text().split()]
    return summarize(cfg, run_dir, time.monotonic() - start, {"lighthouse": address, "pids": pids, **jobs})


# ---------------------------------------------------------------- command line


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
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--batch", type=int, default=d.batch, help="global batch (all groups together)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--restart-after",
        type=int,
        default=d.restart_after,
        metavar="N",
        help="restart the dead group once the survivors have committed N steps without it",
    )
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms)
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")


def ft_command(args) -> int:
    report = ft_run(FTConfig(**{f.name: getattr(args, f.name) for f in fields(FTConfig)}))
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    for row in report["per_step"]:
        print(
            f"step {row['step']:3d}: committed by {row['replicas']} ({row['participants']} in the quorum)"
            + (f", {row['discarded']} try discarded" if row["discarded"] else "")
        )
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f} ms"  # noqa: E731
    print(
        f"steps discarded {report['steps_discarded']}, survivors waited {ms(report['stall_s'])}, heal "
        f"{ms(report['heal_s'])}; a step {ms(report['step_time_s'])}, of which quorum + commit vote "
        f"{ms(report['overhead_s'])} (CPU/gloo timings); final weights equal: {report['weights_equal']}"
    )
    return 0
