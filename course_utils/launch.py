"""Start N worker processes from a notebook cell, the way torchrun does (introduced in notebook 00).

``launch(fn, nproc=4)`` runs the module-level function ``fn`` on ``nproc`` local processes
through torch's own elastic launcher (``elastic_launch`` + ``LaunchConfig``, the engine behind
``torchrun``) and returns ``{rank: return value}``.

How it keeps a notebook safe:

- The elastic agent runs in a child process in its own session. The kernel's signal handlers
  are never touched, and on any failure, timeout or interrupt the whole process group (agent
  and workers) is ended: nothing is left behind.
- Workers get ``COURSE_TIMEOUT_S``: a collective that waits longer raises, so a rank that never
  arrives becomes an error. The kernel also stops waiting at ``timeout_s`` plus a grace period.
- A worker that raises surfaces as one ``WorkerFailed`` naming the rank, with its traceback
  (from torch's ``@record`` error files).
- Rendezvous is ``localhost:0``: a free port every run; nothing listens beyond this machine.

The same worker runs outside the notebook with plain torchrun; ``result.command`` shows how::

    torchrun --nproc-per-node 4 -m course_utils.worker course_utils.examples:all_reduce_demo
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .dist import check_mesh_shape, pick_backend
from .errors import CourseInputError

#: Extra seconds (at most) the kernel waits beyond ``timeout_s`` for the workers' own timeout errors.
GRACE_S = 20.0


def _grace(timeout_s: float) -> float:
    return min(GRACE_S, max(2.0, float(timeout_s)))


class LaunchError(RuntimeError):
    """A launch did not return results (notebook 00)."""


class WorkerFailed(LaunchError):
    """A worker raised or died; ``.rank`` names it and the message holds its traceback."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


class LaunchTimeout(LaunchError):
    """The run outlived its timeout (a hang: usually a collective waiting for a missing rank)."""


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


def _target_of(fn) -> str:
    """``module:qualname`` of a function the worker processes can import, or a clear error."""
    if isinstance(fn, str):
        target = fn
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        name = getattr(fn, "__name__", repr(fn))
        if qualname == "<lambda>" or "<lambda>" in qualname:
            raise CourseInputError(
                "launch needs a function the worker processes can import, not a lambda; "
                "define it with def in a module (a .py file) and import it in the notebook")
        if module in (None, "__main__") or "<locals>" in qualname:
            raise CourseInputError(
                f"launch cannot start {name!r}: it is defined in the notebook (or inside another "
                "function), and new processes cannot import it; put it in a module (a .py file), "
                "import it, and launch that")
        target = f"{module}:{qualname}"
    module, _, qualname = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise CourseInputError(f"launch cannot import {target!r} ({exc}); check the module and name") from None
    if not callable(obj):
        raise CourseInputError(f"{target!r} is not callable")
    return target


def torchrun_command(target: str, nproc: int, args=(), kwargs=None, *, max_restarts: int = 0,
                     nnodes: int | None = None, rdzv_endpoint: str | None = None) -> str:
    """The torchrun line that runs the same worker outside the notebook (notebook 00).

    With ``nnodes`` and ``rdzv_endpoint`` it is the line to type on every node of a
    multi-node job (same line everywhere; the c10d rendezvous assigns ranks).
    """
    parts = ["torchrun"]
    if nnodes:
        parts += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", rdzv_endpoint or "HOST:PORT"]
    else:
        parts += ["--standalone"]
    parts += ["--nproc-per-node", str(nproc)]
    if max_restarts:
        parts += ["--max-restarts", str(max_restarts)]
    parts += ["-m", "course_utils.worker", target]
    try:
        if args:
            parts += ["--args", json.dumps(list(args))]
        if kwargs:
            parts += ["--kwargs", json.dumps(kwargs)]
    except TypeError:
        parts += ["#", "(arguments are not JSON; pass them from your own script)"]
    return " ".join(shlex.quote(p) if not p.startswith("#") else p for p in parts)


class _Progress:
    """One status line per run, updated in place: in a notebook a display handle, else stderr."""

    def __init__(self, folder: Path, nproc: int, enabled: bool):
        self.folder, self.nproc, self.enabled = folder, nproc, enabled
        self.handle, self.last = None, ""

    def line(self, elapsed: float) -> str:
        parts = []
        for r in range(self.nproc):
            try:
                p = json.loads((self.folder / f"rank{r}.json").read_text())
                extra = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in p.items() if k not in ("rank", "step", "total", "pid"))
                parts.append(f"rank {r}: {p['step']}/{p['total']}" + (f" {extra}" if extra else ""))
            except (OSError, ValueError, KeyError):
                parts.append(f"rank {r}: starting")
        return f"[{elapsed:5.1f}s] " + " | ".join(parts)

    def quiet_s(self) -> float | None:
        """Seconds since any rank last reported progress; None if none ever did."""
        times = [f.stat().st_mtime for f in self.folder.glob("rank*.json")]
        return max(0.0, time.time() - max(times)) if times else None

    def update(self, elapsed: float, final: bool = False) -> None:
        if not self.enabled or (elapsed < 2.0 and not final):
            return
        text = self.line(elapsed)
        if text == self.last:
            return
        self.last = text
        if "ipykernel" in sys.modules:
            from IPython.display import display
            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        elif final and sys.stderr.isatty():
            print(text, file=sys.stderr)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a recycled id owned by someone else
        return False


def _kill_group(pgid: int, grace_s: float = 3.0) -> None:
    """End an agent and all its workers: SIGTERM to the group, then SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(pgid):
            _reap()
            time.sleep(0.02)
        if not _group_alive(pgid):
            return


class _AgentServer:
    """The forking agent server of ``course_utils._agent`` (Linux), started on first use."""

    proc: subprocess.Popen | None = None

    @classmethod
    def start_agent(cls, spec_path: Path, result_path: Path, log_path: Path, env: dict) -> int:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, "-m", "course_utils._agent", "--serve"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                        start_new_session=True)
            atexit.register(cls.stop)
        cls.proc.stdin.write(f"{spec_path}\t{result_path}\t{log_path}\n".encode())
        cls.proc.stdin.flush()
        line = cls.proc.stdout.readline()
        if not line:
            cls.proc = None
            raise LaunchError("the launcher's agent server ended unexpectedly; run the cell again")
        return int(line)

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        cls.proc = None


_popen_agents: list[subprocess.Popen] = []


def _reap() -> None:
    for p in list(_popen_agents):
        if p.poll() is not None:
            _popen_agents.remove(p)


def _start_agent(spec_path: Path, result_path: Path, log_path: Path, env: dict, use_server: bool) -> int:
    """Start one launch's agent in its own session; return its pid (= its process group id)."""
    if use_server:
        pid = _AgentServer.start_agent(spec_path, result_path, log_path, env)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "course_utils._agent", str(spec_path),
                                 str(result_path), str(log_path)], env=env, stdin=subprocess.DEVNULL)
        _popen_agents.append(proc)
        pid = proc.pid
    # The agent calls setsid() first thing; wait until it leads its own process group.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                break
        except ProcessLookupError:
            break
        _reap()
        time.sleep(0.005)
    return pid


def _log_launch(target: str, nproc: int, wall_s: float, cold: bool, finished: bool, backend: str) -> None:
    """One JSON line per launch appended to $COURSE_LAUNCH_LOG, when set (``python -m course_utils bench``
    counts a notebook's launches with it, the GPU check which of them ran on NCCL; ``cold``: this
    launch started the agent server)."""
    path = os.environ.get("COURSE_LAUNCH_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"target": target, "nproc": nproc, "wall_s": wall_s, "cold": cold,
                                 "finished": finished, "backend": backend}) + "\n")


def launch(fn, *, nproc: int, args=(), kwargs=None, backend: str = "auto", timeout_s: float = 120.0,
           max_restarts: int = 0, mesh_shape=None, run_dir=None, env=None,
           progress: bool = True, echo: bool = True) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local worker processes; return ``{rank: value}`` (notebook 00).

    Args:
        fn: a module-level function (or "module:function" string) the workers can import.
            Inside it, call ``course_utils.dist.init()`` to join the group.
        nproc: number of worker processes (ranks) on this machine.
        args, kwargs: passed to ``fn`` on every rank; must be picklable.
        backend: "auto" (NCCL with one GPU per rank if there are enough GPUs, else gloo on
            CPU), "gloo" or "nccl".
        timeout_s: a collective waiting longer than this raises in the worker. It also bounds
            the whole run: the kernel gives up a grace period later (``timeout_s``, at most
            ``GRACE_S``), counted from when the run's agent started, and ends every process of
            the run. Raise it for long runs.
        max_restarts: how many times the elastic agent restarts the whole group after a
            worker failure (torchrun's ``--max-restarts``).
        mesh_shape: optional device-mesh shape; its product must equal ``nproc``. Workers
            read it from ``COURSE_MESH_SHAPE``.
        run_dir: folder for this run's logs (``run_dir/logs``) and progress files; a fresh
            temporary folder by default. Checkpoints go wherever ``fn`` puts them.
        env: extra environment variables for the workers.
        progress: draw a live per-rank status line for runs longer than ~2 s.
        echo: stream the workers' output into the notebook as it comes.

    Raises:
        CourseInputError: bad arguments (nothing is started).
        WorkerFailed: a worker raised or died (after ``max_restarts`` restarts).
        LaunchTimeout: the run did not finish in time.
        KeyboardInterrupt: the launch was interrupted; every worker was stopped first.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise CourseInputError(f"nproc must be a whole number of processes >= 1, got {nproc!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise CourseInputError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if not timeout_s or timeout_s <= 0:
        raise CourseInputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    backend_name, device_type = pick_backend(nproc, backend)
    if mesh_shape is not None:
        mesh_shape = check_mesh_shape(nproc, mesh_shape)
    target = _target_of(fn)
    kwargs = dict(kwargs or {})

    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="course-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    progress_dir = Path(tempfile.mkdtemp(prefix="launch-", dir=run_dir))
    spec_path, result_path = progress_dir / "spec.pkl", progress_dir / "result.pkl"
    agent_log = progress_dir / "agent.log"
    log_dir = run_dir / "logs"
    worker_env = {k: str(v) for k, v in (env or {}).items()}
    worker_env.update(COURSE_BACKEND=backend_name, COURSE_TIMEOUT_S=str(timeout_s),
                      COURSE_PROGRESS_DIR=str(progress_dir), PYTHONUNBUFFERED="1")
    if mesh_shape is not None:
        worker_env["COURSE_MESH_SHAPE"] = ",".join(map(str, mesh_shape))
    # fork is milliseconds and safe on CPU; CUDA must not be forked, so GPU runs spawn.
    start_method = "spawn" if device_type == "cuda" or not sys.platform.startswith("linux") else "fork"
    with open(spec_path, "wb") as fh:
        pickle.dump({"target": target, "args": tuple(args), "kwargs": kwargs, "nproc": nproc,
                     "max_restarts": max_restarts, "log_dir": str(log_dir), "env": worker_env,
                     "cwd": os.getcwd(), "start_method": start_method}, fh)
    agent_log.touch()
    # Workers must import the same course_utils the kernel uses, even from a source checkout.
    base_env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, base_env.get("PYTHONPATH")) if p)

    start = time.monotonic()
    cold = start_method == "fork" and (_AgentServer.proc is None or _AgentServer.proc.poll() is not None)
    status = _Progress(progress_dir, nproc, progress)
    tail: list[str] = []
    pgid = None
    try:
        pgid = _start_agent(spec_path, result_path, agent_log, base_env,
                            use_server=start_method == "fork")
        # The run's clock starts once its agent exists: a cold agent server (torch imported once,
        # about 5 s, more on a busy machine) must not eat into a short ``timeout_s``.
        started = time.monotonic()
        with open(agent_log, "rb") as log:
            buffer = b""
            while True:
                finished = result_path.exists() or not _group_alive(pgid)
                chunk = log.read()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    tail = (tail + [line])[-200:]
                    if echo:
                        print(line, flush=True)
                if finished:
                    break
                elapsed = time.monotonic() - start
                status.update(elapsed)
                if time.monotonic() - started > timeout_s + _grace(timeout_s):
                    last, quiet = status.line(elapsed), status.quiet_s()
                    _kill_group(pgid)
                    if quiet is not None and quiet < timeout_s:
                        why = (f"The workers were still making progress ({quiet:.0f} s before the end): the run is "
                               "not hung, only longer than timeout_s, which also bounds the whole run; pass a "
                               "larger timeout_s (or fewer steps)")
                    else:
                        why = ("A collective was probably waiting for a rank that never arrived (mismatched "
                               "collectives, or a rank stuck or dead)")
                    raise LaunchTimeout(
                        f"the run did not finish within {timeout_s:g} s (+{_grace(timeout_s):g} s grace) and every "
                        f"process was stopped. Last progress: {last}. {why}; logs: {log_dir}")
                _reap()
                time.sleep(0.05)
    except KeyboardInterrupt:
        if pgid is not None:
            _kill_group(pgid)
        raise KeyboardInterrupt(f"launch interrupted: all {nproc} worker processes were stopped") from None
    finally:
        if pgid is not None:  # nothing of this run may outlive it
            deadline = time.monotonic() + 2.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                _reap()
                time.sleep(0.02)
            _kill_group(pgid, grace_s=1.0)
        _reap()
        _log_launch(target, nproc, time.monotonic() - start, cold, result_path.exists(), backend_name)
    status.update(time.monotonic() - start, final=True)

    if not result_path.exists():
        raise LaunchError("the launcher's agent ended without a result; its last output:\n" + "\n".join(tail[-30:]))
    with open(result_path, "rb") as fh:
        outcome = pickle.load(fh)
    if not outcome["ok"]:
        rank = outcome["rank"]
        head = f"rank {rank} failed" if rank is not None else "the launch failed"
        if max_restarts:
            head += f" (the group was restarted up to {max_restarts} time(s) first)"
        raise WorkerFailed(f"{head}; logs: {log_dir}\n{outcome['message']}", rank=rank,
                           exitcode=outcome["exitcode"])
    result = RunResult(sorted(outcome["values"].items()))
    result.backend, result.device_type, result.nproc = backend_name, device_type, nproc
    result.wall_s, result.log_dir = time.monotonic() - start, str(log_dir)
    result.command = torchrun_command(target, nproc, args, kwargs, max_restarts=max_restarts)
    return result
