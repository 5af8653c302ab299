"""Start N worker processes from a notebook cell, the way torchrun does (introduced in notebook 00).

``launch(fn, nproc=4)`` runs the module-level function ``fn`` on ``nproc`` local processes
through torch's own elastic launcher (``elastic_launch`` + ``LaunchConfig``, the engine behind
``torchrun``) and returns ``{rank: return value}``.

How it keeps a notebook safe:

- The elastic agent runs in a child process in its own session. The kernel's signal handlers
  are never touched, and on any failure, timeout or interrupt the whole process group (agent
  and workers) is ended: nothing is left behind (``course_utils._procs``).
- Workers get ``COURSE_TIMEOUT_S``: a collective that waits longer raises, so a rank that never
  arrives becomes an error. The kernel also stops waiting at ``timeout_s`` plus a grace period.
- A worker that raises surfaces as one ``WorkerFailed`` naming the rank, with its traceback
  from its own frame on (torch's ``@record`` error files; ``course_utils._report``).
- Rendezvous is ``127.0.0.1:0``: a free port every run; nothing listens beyond this machine.
- What the workers run and the caller's environment reach the agent through a pipe: no file of
  the run holds them.

The same worker runs outside the notebook with plain torchrun; ``result.command`` shows how::

    torchrun --standalone --nproc-per-node 4 -m course_utils.worker course_utils.examples:all_reduce_demo
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import scratch, validate
from ._procs import AgentServer, cancel_unknown_agent, group_alive, kill_group, reap, server_env, start_agent, warm_up
from ._report import (
    LaunchError,
    LaunchTimeout,
    Progress,
    WorkerFailed,
    ask_for_stacks,
    failure_error,
    log_launch,
    read_results,
    result_files,
    timeout_error,
    where_ranks_were,
)
from .background import Background
from .dist import check_mesh_shape, pick_backend, warn
from .errors import CourseInputError
from .worker import target_of

__all__ = [
    "launch",
    "RunResult",
    "LaunchError",
    "WorkerFailed",
    "LaunchTimeout",
    "Background",
    "torchrun_command",
    "warm_up",
]

#: Extra seconds (at most) the kernel waits beyond ``timeout_s`` for the workers' own timeout errors.
GRACE_S = 20.0
#: Seconds the launcher waits for the agent once every rank has left its result, before it takes the
#: results itself and stops the agent (it normally reports within a monitor interval, 0.1 s).
COLLECT_GRACE_S = 10.0
# Kept under their old names for the tools that drive the launcher (tools/bench.py, tools/stress_launch.py).
_AgentServer, _Progress = AgentServer, Progress


def _grace(timeout_s: float) -> float:
    return min(GRACE_S, max(2.0, float(timeout_s)))


class RunResult(dict):
    """``{rank: return value}``, plus how the run was made (notebook 00).

    Attributes: ``backend`` ("gloo" or "nccl"), ``device_type``, ``nproc``, ``wall_s``,
    ``log_dir`` (per-attempt, per-rank logs) and ``command`` (the equivalent torchrun line).
    """

    backend: str
    device_type: str
    nproc: int
    wall_s: float
    log_dir: str
    command: str


def _payload(fn, args, kwargs) -> tuple[str, bytes, bool]:
    """What the workers run, as bytes: ``(label, payload, by_value)``.

    A function the workers can import (a module-level function of a .py file) travels by name
    and is imported fresh in each worker. Anything else, a function defined in a notebook cell
    above all, travels by value, serialised with cloudpickle together with its arguments. The
    caller's ``sys.path`` goes along, so a module next to the notebook imports in the workers too.
    """
    import cloudpickle

    target = target_of(fn)
    name = target or getattr(fn, "__qualname__", repr(fn))
    try:
        blob = cloudpickle.dumps((target or fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise CourseInputError(
            f"launch cannot send {name!r} or its arguments to the worker processes ({exc}): something it "
            "uses cannot be copied to another process (an open file, a lock, a socket, a generator); "
            "create that inside the function instead"
        ) from None
    return name, pickle.dumps((list(sys.path), blob)), target is None


def torchrun_command(
    target: str,
    nproc: int,
    args=(),
    kwargs=None,
    *,
    max_restarts: int = 0,
    nnodes: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "$JOB_ID",
) -> str:
    """The torchrun line that runs the same worker outside the notebook (notebook 00).

    With ``nnodes`` and ``rdzv_endpoint`` it is the line to type on every node of a
    multi-node job (same line everywhere; the c10d rendezvous assigns ranks), with ``rdzv_id``
    naming the job (torchrun's default is ``none``, shared by every job on that endpoint; a
    shell variable such as ``$SLURM_JOB_ID`` is left for the shell to expand). Pass
    ``max_restarts`` too: torchrun's default is 0, so the first failure ends the job (notebook 06).
    """
    parts = ["torchrun"]
    if nnodes:
        parts += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint or "HOST:PORT"]
    else:
        parts += ["--standalone"]
    parts += ["--nproc-per-node", str(nproc)]
    if max_restarts:
        parts += ["--max-restarts", str(max_restarts)]
    if nnodes:
        parts += ["--rdzv-id", rdzv_id]
    parts += ["-m", "course_utils.worker", target]
    try:
        if args:
            parts += ["--args", json.dumps(list(args))]
        if kwargs:
            parts += ["--kwargs", json.dumps(kwargs)]
    except TypeError:
        parts += ["#", "(arguments are not JSON; pass them from your own script)"]
    return " ".join(p if p.startswith("#") or _SHELL_VARIABLE.fullmatch(p) else shlex.quote(p) for p in parts)


#: A shell variable the line leaves for the shell to expand (``$JOB_ID``, ``${SLURM_JOB_ID}``).
_SHELL_VARIABLE = re.compile(r"\$(\w+|\{\w+\})")


# ---------------------------------------------------------------- one run, in parts


@dataclass
class _Run:
    """One launch: its settings and the folders its processes fill."""

    nproc: int
    timeout_s: float
    max_restarts: int
    run_dir: Path
    own_dir: bool
    folder: Path  # progress, stacks, results: what the workers and the agent leave for the launcher
    tail: list = field(default_factory=list)  # the agent log's last lines

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def result_path(self) -> Path:
        return self.folder / "result.pkl"

    @property
    def agent_log(self) -> Path:
        return self.folder / "agent.log"


def _make_run(run_dir, nproc: int, timeout_s: float, max_restarts: int) -> _Run:
    """The run's folders: ``run_dir`` (a temporary one by default) and a fresh ``launch-*`` inside it."""
    own_dir = run_dir is None
    try:
        if not own_dir:
            run_dir = Path(run_dir)
        elif "ipykernel" in sys.modules:  # a failed run's logs go with the kernel, not before (scratch)
            run_dir = scratch.folder("course-run-")
        else:  # from a shell or a script, a failed run's logs stay for its user to read
            run_dir = Path(tempfile.mkdtemp(prefix="course-run-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="launch-", dir=run_dir))
        (folder / "agent.log").touch()
    except OSError as exc:
        where = "a temporary folder" if own_dir else str(run_dir)
        raise LaunchError(
            f"cannot create the run's folder in {where}: {exc.strerror or exc}; free space there or pass another run_dir"
        ) from None
    return _Run(nproc, timeout_s, max_restarts, run_dir, own_dir, folder)


def _environment(env, backend: str, timeout_s: float, folder: Path, mesh_shape) -> dict:
    """The workers' environment: the caller's as it is now (not as it was when the agent server started),
    plus what the run needs. Workers import the same course_utils as the caller."""
    environ = server_env()
    environ.update({k: str(v) for k, v in (env or {}).items()})
    environ.update(
        COURSE_BACKEND=backend, COURSE_TIMEOUT_S=str(timeout_s), COURSE_PROGRESS_DIR=str(folder), PYTHONUNBUFFERED="1"
    )
    if mesh_shape is not None:
        environ["COURSE_MESH_SHAPE"] = ",".join(map(str, mesh_shape))
    return environ


def _spec(run: _Run, label: str, payload: bytes, environ: dict, device_type: str) -> dict:
    """What the agent needs to run the launch (it reaches the agent through a pipe, never a file)."""
    return {
        "payload": payload,
        "label": label,
        "nproc": run.nproc,
        "max_restarts": run.max_restarts,
        "log_dir": str(run.log_dir),
        "environ": environ,
        "cwd": os.getcwd(),
        # fork is milliseconds and safe on CPU; CUDA must not be forked, so GPU runs spawn
        "start_method": "spawn" if device_type == "cuda" or not sys.platform.startswith("linux") else "fork",
        "progress_dir": str(run.folder),
    }


def _start(run: _Run, spec: dict) -> int:
    """Start the run's agent; an interrupt before its pid is known still leaves nothing running."""
    try:
        spec_bytes = pickle.dumps(spec)
        return start_agent(spec_bytes, run.result_path, run.agent_log, spec["environ"], spec["start_method"] == "fork")
    except BaseException:
        cancel_unknown_agent(run.folder)
        raise


def _watch(run: _Run, pgid: int, status: Progress, start: float, echo: bool):
    """Follow the run until its agent reports (or dies); return ``(values, collected_by_hand)``.

    ``values`` is not None only when every rank returned but the agent never collected them
    (``COLLECT_GRACE_S``): the launcher then takes the results itself and stops the agent.
    """
    # The clock of timeout_s starts when every rank has started its function (each opens its stack file
    # first thing): a cold agent server or a loaded machine must not eat into it, and a worker's own
    # collective timeout (the same timeout_s, counted from its collective) must fire before this one.
    # Ranks that never start are bounded from the agent's start.
    started, ranks_started = time.monotonic(), False
    all_returned_at = None
    with open(run.agent_log, "rb") as log:
        buffer = b""
        while True:
            finished = run.result_path.exists() or not group_alive(pgid)
            buffer += log.read()
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                run.tail = (run.tail + [line])[-200:]
                if echo:
                    print(line, flush=True)
            if finished:
                return None, None
            status.update(time.monotonic() - start)
            if not ranks_started and len(list(run.folder.glob("stack-rank*.txt"))) >= run.nproc:
                started, ranks_started = time.monotonic(), True
            if all_returned_at is None and len(result_files(run.folder)) == run.nproc:
                all_returned_at = time.monotonic()
            if all_returned_at is not None and time.monotonic() - all_returned_at > COLLECT_GRACE_S:
                values = read_results(run.folder, run.nproc)
                if values is not None:  # every rank returned; the agent did not collect: see COLLECT_GRACE_S
                    since = ask_for_stacks(pgid, run.folder)
                    agent = where_ranks_were(run.folder, run.nproc, since)["agent"]
                    kill_group(pgid)
                    return values, agent
                all_returned_at = None
            if time.monotonic() - started > run.timeout_s + _grace(run.timeout_s):
                raise _timed_out(run, pgid, status, time.monotonic() - start)
            reap()
            time.sleep(0.05)


def _timed_out(run: _Run, pgid: int, status: Progress, elapsed: float) -> LaunchTimeout:
    """Ask every process where it is, stop them all, and say what happened, rank by rank."""
    last, quiet = status.line(elapsed), status.quiet_s()
    since = ask_for_stacks(pgid, run.folder)
    where = where_ranks_were(run.folder, run.nproc, since)
    kill_group(pgid)
    ranks = {r: where[f"rank{r}"] for r in range(run.nproc)}
    status.update(elapsed, final={r: "done" if w == "returned its result" else "killed" for r, w in ranks.items()})
    return timeout_error(ranks, where["agent"], quiet, run.timeout_s, _grace(run.timeout_s), last, run.log_dir)


def _end(pgid: int | None) -> None:
    """Nothing of a run outlives it: wait briefly for the agent to leave, then end its whole group."""
    if pgid is not None:
        deadline = time.monotonic() + 2.0
        while group_alive(pgid) and time.monotonic() < deadline:
            reap()
            time.sleep(0.02)
        kill_group(pgid, grace_s=1.0)
    reap()


def _values(run: _Run, status: Progress, start: float) -> dict:
    """Every rank's return value once the agent reported; ``WorkerFailed``/``LaunchError`` otherwise."""
    if not run.result_path.exists():
        status.update(time.monotonic() - start, final={})
        raise LaunchError(
            "the launcher's agent ended without a result; its last output:\n"
            + "\n".join(run.tail[-30:])
            + f"\n(every rank's output: {run.log_dir})"
        )
    with open(run.result_path, "rb") as fh:
        outcome = pickle.load(fh)
    values = read_results(run.folder, run.nproc) if outcome["ok"] else None
    if values is not None:
        return values
    done = result_files(run.folder)
    rank = outcome.get("rank")
    status.update(
        time.monotonic() - start,
        final={r: ("failed" if r == rank else "done" if r in done else "killed") for r in range(run.nproc)},
    )
    raise failure_error(outcome, run.folder, run.nproc, run.max_restarts, run.log_dir)


def launch(
    fn,
    *,
    nproc: int,
    args=(),
    kwargs=None,
    backend: str = "auto",
    timeout_s: float = 120.0,
    max_restarts: int = 0,
    mesh_shape=None,
    run_dir=None,
    env=None,
    progress: bool = True,
    echo: bool = True,
) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local worker processes; return ``{rank: value}`` (notebook 00).

    Args:
        fn: what every rank runs: a module-level function (or "module:function"), imported by name in
            each worker, or a function defined in a notebook cell, sent by value (cloudpickle). Inside
            it, ``course_utils.dist.init()`` (or ``with dist.session() as info:``) joins the group.
        nproc: worker processes (ranks) on this machine, at most what it can start
            (``validate.max_local_ranks``).
        args, kwargs: passed to ``fn`` on every rank (anything cloudpickle can copy).
        backend: "auto" (NCCL with one GPU per rank if there are enough GPUs, else gloo on CPU),
            "gloo" or "nccl".
        timeout_s: a collective waiting longer raises in the worker. It also bounds the whole run:
            a grace period later (``timeout_s``, at most ``GRACE_S``), counted from when every rank
            had started, every process of the run is ended. At most a week.
        max_restarts: times the elastic agent restarts the whole group after a worker failure
            (torchrun's ``--max-restarts``).
        mesh_shape: optional device-mesh shape (product ``nproc``); workers read ``COURSE_MESH_SHAPE``.
        run_dir: folder for the run's logs (``run_dir/logs``) and progress files; by default a
            temporary one, removed after a run that succeeded, kept (its path ends the error) after
            one that did not.
        env: extra environment variables for the workers, on top of the caller's environment as it
            is at this call.
        progress: a live per-rank status line for runs longer than ~2 s, cleared when the run ends.
        echo: stream the workers' output into the notebook as it comes.

    Raises:
        CourseInputError: bad arguments (nothing is started).
        WorkerFailed: a worker raised or died (after ``max_restarts`` restarts).
        LaunchTimeout: the run did not finish in time; the message says where each rank was.
        KeyboardInterrupt: the launch was interrupted; every process of the run was stopped first.
    """
    validate.launch_arguments(fn, nproc, args, kwargs, timeout_s, max_restarts, run_dir, env)
    backend_name, device_type = pick_backend(nproc, backend)
    mesh_shape = check_mesh_shape(nproc, mesh_shape) if mesh_shape is not None else None
    label, payload, by_value = _payload(fn, args, kwargs or {})
    run = _make_run(run_dir, nproc, timeout_s, max_restarts)
    spec = _spec(run, label, payload, _environment(env, backend_name, timeout_s, run.folder, mesh_shape), device_type)
    start = time.monotonic()
    values, by_hand = _run(run, spec, Progress(run.folder, nproc, progress), start, echo, backend_name)
    if by_hand is not None:
        warn(
            f"every rank had returned, but torch's elastic agent had not collected the results "
            f"{COLLECT_GRACE_S:g} s later (it was {by_hand}); the launcher read them from the ranks' "
            f"files and stopped the agent. Logs: {run.log_dir}"
        )
    return _result(values, run, backend_name, device_type, start, label, args, kwargs, by_value, keep=by_hand)


def _run(run: _Run, spec: dict, status: Progress, start: float, echo: bool, backend: str):
    """Start the run's agent, follow it to its end, and leave nothing of it running; ``(values, by_hand)``."""
    cold = spec["start_method"] == "fork" and (AgentServer.proc is None or AgentServer.proc.poll() is not None)
    pgid, values, by_hand = None, None, None
    try:
        pgid = _start(run, spec)
        values, by_hand = _watch(run, pgid, status, start, echo)
    except KeyboardInterrupt:
        if pgid is not None:
            kill_group(pgid)
        raise KeyboardInterrupt(
            f"launch interrupted: every process of the run ({run.nproc} workers and their agent) was stopped"
        ) from None
    finally:
        _end(pgid)
        finished = run.result_path.exists() or values is not None
        log_launch(spec["label"], run.nproc, time.monotonic() - start, cold, finished, backend)
    if values is None:
        values = _values(run, status, start)
    status.update(time.monotonic() - start, final={r: "done" for r in range(run.nproc)})
    return values, by_hand


def _result(values, run: _Run, backend, device_type, start, label, args, kwargs, by_value, keep) -> RunResult:
    result = RunResult(sorted(values.items()))
    result.backend, result.device_type, result.nproc = backend, device_type, run.nproc
    result.wall_s, result.log_dir = time.monotonic() - start, str(run.log_dir)
    result.command = (
        torchrun_command(label, run.nproc, args, kwargs, max_restarts=run.max_restarts)
        if not by_value
        else f"# {label} was defined in the notebook: put it in a .py module to run it under torchrun"
    )
    if run.own_dir and keep is None:
        shutil.rmtree(run.run_dir, ignore_errors=True)
        result.log_dir = None
    return result
