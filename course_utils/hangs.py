"""A rank that stops making progress: which detector fires, after how long, and what it says (notebook 06).

A crash is noticed at once: the process exits and torchrun's agent sees it. A hang is not. A rank stuck
in a data loader, a deadlock or a kernel that never returns leaves its peers waiting in their next
collective, and nobody is told until a timeout fires. What torch 2.13 and torchft offer, read in their
sources:

- **the process group's timeout** (``init_process_group(timeout=...)``; 30 min by default for gloo,
  ``kProcessGroupDefaultTimeout``, and 10 min for NCCL, ``kProcessGroupNCCLDefaultTimeout``): the ranks
  *waiting* in the collective raise; the hung rank itself is left as it is, until the agent stops the group.
- **torch elastic's file timer** (``TORCHELASTIC_ENABLE_FILE_TIMER=1``; ``local_elastic_agent.py``): the
  agent runs a ``FileTimerServer`` (checked every 0.1 s) and tells the workers its pipe
  (``TORCHELASTIC_TIMER_FILE``); a worker wraps each step in ``timer.expires(after=T)``. When a step
  outlives T, the server SIGKILLs that worker (and any other whose deadline has passed when it checks),
  then SIGKILLs its own process, the agent (``file_based_local_timer.py``: "Terminating the server process
  ... because of expired timers"); a worker still alive gets SIGINT as the agent dies (torch.multiprocessing
  sets ``PR_SET_PDEATHSIG``). No restart by torchrun; the job manager sees the node's torchrun die.
- **torch elastic's health check server** (``TORCHELASTIC_HEALTH_CHECK_PORT``): in torch 2.13 a
  placeholder. ``HealthCheckServer.start()`` only logs "No health check server started" (its docstring:
  "Unsupported functionality for PyTorch"), so nothing listens on the port; the agent still hands it a
  callback returning the file timer's last progress time, for a build that brings its own server
  (``local_elastic_agent.py`` names a C++ ``HealthCheckThriftServer``, not in torch). Nothing to measure.
- **torchft's heartbeat**: the manager server sends it every 100 ms from its own (Rust) threads, so a
  group whose Python is stuck keeps heartbeating and the lighthouse never drops it. With two groups the
  survivor's quorum cannot form without it (the lighthouse requires more than half of the heartbeating
  groups) and the survivor fails when its ``quorum_timeout`` runs out; with three or more, the others go
  on after the lighthouse's join timeout. A dead (or frozen) process stops heartbeating and is dropped
  after the heartbeat timeout, as section 13 of the notebook measures.

``measure`` runs the three that fire here, each on a real run, and reports the time from the stall to
the detection against the configured value (the file timer: its own log line, read from the agent's log);
``time_lost_per_hang`` is the arithmetic for choosing timeouts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from . import scratch
from .errors import CourseInputError
from .instrument import Observer
from .strategies import DDP


def _note(folder: str, name: str, **row) -> None:
    path = Path(folder) / f"{name}.json"
    path.with_suffix(".tmp").write_text(json.dumps({"t": time.time(), **row}))
    path.with_suffix(".tmp").rename(path)


class Stall(Observer):
    """Rank ``rank`` stops making progress before step ``step``: it sleeps, in Python, for ever (notebook 06).

    With ``pg_timeout_s`` every rank first sets its process group's timeout to that value (the group
    starts with a generous one, so that a slow start of one rank is not taken for the hang).
    """

    def __init__(self, rank: int, step: int, my_rank: int, folder: str, pg_timeout_s: float | None = None):
        self.rank, self.step, self.my_rank, self.folder, self.pg_timeout_s = rank, step, my_rank, folder, pg_timeout_s

    def before_forward(self, step: int) -> None:
        if step != self.step:
            return
        if self.pg_timeout_s:
            from datetime import timedelta

            from torch.distributed.distributed_c10d import _set_pg_timeout

            _set_pg_timeout(timedelta(seconds=self.pg_timeout_s))  # what init_process_group(timeout=) sets
        if self.my_rank == self.rank:
            _note(self.folder, "stalled", rank=self.rank, step=step)
            time.sleep(10**6)  # the peers wait in this step's gradient all-reduce


class StepDeadline(Observer):
    """Every step runs under torch elastic's file timer: ``timer.expires(after=seconds)`` (notebook 06).

    Needs the agent's ``FileTimerServer`` (``TORCHELASTIC_ENABLE_FILE_TIMER=1`` in the agent's
    environment); the agent tells the worker where its pipe is (``TORCHELASTIC_TIMER_FILE``).
    """

    def __init__(self, seconds: float):
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        self.seconds, self.scope = seconds, None

    def before_forward(self, step: int) -> None:
        from torch.distributed.elastic import timer

        self.scope = timer.expires(after=self.seconds, scope=f"step {step}")
        self.scope.__enter__()

    def after_step(self, step: int, losses: list) -> None:
        self.scope.__exit__(None, None, None)


def stall_worker(
    config: dict, stall: tuple, folder: str, pg_timeout_s: float | None = None, step_deadline_s: float | None = None
):
    """DDP on every rank; rank ``stall[0]`` stops before step ``stall[1]`` (notebook 06).

    ``pg_timeout_s``: the process group's timeout from that step on (else 60 s); ``step_deadline_s``:
    each step also runs under torch elastic's file timer. A rank whose step raises writes the time and
    the error's first line to ``folder``.
    """
    from . import dist as cdist
    from .loop import TrainConfig, prepare, run_steps

    with cdist.session(timeout_s=60.0) as info:
        cfg = TrainConfig(**{**config, "nproc": info.world_size}).validate()
        _note(folder, f"pid-rank{info.rank}", pid=os.getpid())  # who the file timer's record names
        prepared = prepare(cfg, info)
        observers = [Stall(*stall, info.rank, folder, pg_timeout_s)]
        if step_deadline_s:
            observers.insert(0, StepDeadline(step_deadline_s))
        try:
            run_steps(prepared, cfg, info, range(cfg.steps), observers)
        except Exception as exc:
            _note(folder, f"raised-rank{info.rank}", error=str(exc).strip().splitlines()[0][:300])
            raise


def _without_paths(line: str) -> str:
    """The launcher's first line without its log folder (a temporary path) and an empty "last output"."""
    line = re.sub(r";? ?\(?logs: [^);]*\)?", "", line)
    return re.sub(r";? its last output:$", "", line).strip()


def _detection(folder: Path, run: dict, configured_s: float, detector: str, report: str) -> dict:
    stalled = json.loads((folder / "stalled.json").read_text())
    raised = sorted(folder.glob("raised-rank*.json"))
    first = min((json.loads(p.read_text()) for p in raised), key=lambda r: r["t"], default=None)
    return {
        "detector": detector,
        "configured_s": configured_s,
        "detected_after_s": None if first is None else first["t"] - stalled["t"],
        "peer_error": None if first is None else first["error"],
        "report": report,
        **run,
    }


def pg_timeout_hang(timeout_s: float = 2.0, *, nproc: int = 2, stall_step: int = 2, model: str = "tiny") -> dict:
    """Detector 1, the process group's timeout: how long until the waiting rank raises, and what is said (notebook 06).

    Returns ``{"detector", "configured_s", "detected_after_s" (stall to the waiting rank's exception),
    "peer_error" (its first line), "report" (the launcher's error, first lines), "wall_s"}``.
    """
    from .launch import LaunchError, launch
    from .loop import TrainConfig

    folder = scratch.folder("course-hang-")
    config = asdict(TrainConfig(strategy=DDP.name, nproc=nproc, steps=stall_step + 2, model=model))
    t0 = time.monotonic()
    try:
        launch(
            stall_worker,
            nproc=nproc,
            args=(config, (1, stall_step), str(folder), timeout_s),
            run_dir=folder,
            echo=False,
            progress=False,
            timeout_s=120.0,
        )
        report = "(the run finished: nothing hung)"
    except LaunchError as exc:
        lines = str(exc).splitlines()
        report = "\n".join([_without_paths(lines[0])] + [line for line in lines if line.startswith("  rank")])
    try:
        return _detection(folder, {"wall_s": time.monotonic() - t0}, timeout_s, "process group timeout", report)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"


def _timer_record(folder: Path) -> dict:
    """Each worker the file timer reaped, by rank, with the time of its own log line (``_agent_patches``)."""
    pids = {json.loads(p.read_text())["pid"]: int(p.stem[len("pid-rank") :]) for p in folder.glob("pid-rank*.json")}
    log = next(folder.glob("launch-*/agent.log")).read_text(errors="replace")
    found = re.findall(r"^file timer (\d+\.\d+): Reaping worker_pid=\[(\d+)\]", log, re.M)
    return {pids.get(int(pid), -1): float(t) for t, pid in found}


def file_timer_hang(step_deadline_s: float = 2.0, *, nproc: int = 2, stall_step: int = 2, model: str = "tiny") -> dict:
    """Detector 2, torch elastic's file timer: the hung worker killed after its step's deadline (notebook 06).

    The process group's timeout stays 60 s, out of the way. The agent runs with
    ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` and its pipe in this run's folder. ``detected_after_s`` runs
    from the stall to the timer's own first "Reaping worker_pid" line (its server checks every 0.1 s);
    ``reaped`` lists the ranks the timer SIGKILLed (every rank past its step's deadline at that check),
    ``not_reaped`` the others, which the agent's death and then the launcher ended;
    ``run_end_s`` runs from the stall to the run's end, every process gone (the launcher's shutdown
    included); ``ranks_that_raised`` lists ranks that lived to raise an error; ``agent_killed`` says
    whether the timer server also killed the agent (the launcher then finds no result).
    """
    from .launch import LaunchError, launch
    from .loop import TrainConfig

    folder = scratch.folder("course-hang-")
    config = asdict(TrainConfig(strategy=DDP.name, nproc=nproc, steps=stall_step + 2, model=model))
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": str(folder / "timer.pipe")}
    t0 = time.monotonic()
    try:
        launch(
            stall_worker,
            nproc=nproc,
            args=(config, (1, stall_step), str(folder), None, step_deadline_s),
            run_dir=folder,
            env=env,
            echo=False,
            progress=False,
            timeout_s=120.0,
        )
        report = "(the run finished: nothing hung)"
    except LaunchError as exc:
        report = _without_paths(str(exc).splitlines()[0])
    ended = time.time()
    try:
        row = _detection(folder, {"wall_s": time.monotonic() - t0}, step_deadline_s, "torch elastic file timer", report)
        stalled = json.loads((folder / "stalled.json").read_text())
        reaped = _timer_record(folder)
        # its first check past a deadline: the hung rank's, or its waiting peer's (their steps began within ms)
        row["detected_after_s"] = min(reaped.values()) - stalled["t"] if reaped else None
        row["reaped"], row["not_reaped"] = sorted(reaped), sorted(set(range(nproc)) - set(reaped))
        row["run_end_s"] = ended - stalled["t"]
        row["ranks_that_raised"] = sorted(int(p.stem[len("raised-rank") :]) for p in folder.glob("raised-rank*.json"))
        row["agent_killed"] = "without a result" in report
        others = f"; rank(s) {_ranks(row['not_reaped'])} ended with the agent" if row["not_reaped"] else ""
        row["report"] = f"SIGKILLed rank(s) {_ranks(row['reaped'])}, then its agent{others}: {report}"
        return row
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def torchft_hang(quorum_timeout_s: float = 3.0, *, heartbeat_timeout_ms: int = 1000, stall_step: int = 2) -> dict:
    """Detector 3, torchft: a group's Python stops while its heartbeat goes on (notebook 06).

    Two replica groups; group 1 sleeps before step ``stall_step``. Returns which detector fired (the
    survivor's quorum timeout, or the heartbeat timeout if the lighthouse dropped the hung group),
    ``detected_after_s`` (the hang to the survivor's failure, or to its first step alone) and the
    survivor's last log line.
    """
    from .ft import ft_run

    report = ft_run(
        replicas=2,
        steps=stall_step + 2,
        hang=f"1:{stall_step}",
        restart_after=None,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        quorum_timeout_s=quorum_timeout_s,
        timeout_s=max(30.0, 10 * quorum_timeout_s),
    )
    stopped, hung = report["stopped"], report["hung"]
    went_on = report["stall_s"] is not None  # the survivor committed a step without the hung group
    return {
        "detector": "torchft heartbeat" if went_on else "torchft quorum timeout",
        "configured_s": heartbeat_timeout_ms / 1e3 if went_on else quorum_timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_ms / 1e3,
        "quorum_timeout_s": quorum_timeout_s,
        "detected_after_s": report["lost_s"] if went_on else (stopped["t"] - hung["t"] if stopped else None),
        "peer_error": stopped["error"] if stopped else None,
        "report": "the survivor went on without it"
        if went_on
        else f"replica {stopped['replica']} failed (exit code {stopped['code']})"
        if stopped
        else "nothing",
        "wall_s": report["wall_s"],
    }


def measure(pg_timeout_s: float = 2.0, step_deadline_s: float = 2.0, quorum_timeout_s: float = 3.0) -> list[dict]:
    """The three detectors, one run each, one after the other (notebook 06; run it in the background)."""
    rows = [pg_timeout_hang(pg_timeout_s), file_timer_hang(step_deadline_s)]
    try:
        rows.append(torchft_hang(quorum_timeout_s))
    except CourseInputError:  # torchft is not installed: two detectors only
        pass
    return rows


# ---------------------------------------------------------------- choosing the timeouts


def time_lost_per_hang(timeout_s, *, restart_s: float, step_s: float, every: float) -> dict:
    """Seconds a whole job loses to one hang, with timeout T (notebook 06; first-order, like ``lab06.checkpoint_overhead``).

    Every rank waits T for the detector, then the job restarts (R) and redoes half a checkpoint interval
    on average (K·t/2): T + R + K·t/2. Only T depends on the timeout. Works on arrays of T.
    """
    import numpy as np

    t = np.asarray(timeout_s, dtype=float)
    redo = every * step_s / 2
    return {"wait_s": t, "restart_s": restart_s, "redo_s": redo, "lost_s": t + restart_s + redo}
