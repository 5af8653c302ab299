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
import math
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .dist import check_mesh_shape, pick_backend, warn
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


def _target_of(fn) -> str | None:
    """``module:qualname`` when the workers can import ``fn`` by name, else None (it travels by value)."""
    if isinstance(fn, str):
        target = fn
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module in (None, "__main__") or "<" in qualname:  # a notebook cell, a lambda, a nested def
            return None
        target = f"{module}:{qualname}"
    module, _, qualname = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        if isinstance(fn, str):
            raise CourseInputError(f"launch cannot import {target!r} ({exc}); check the module and name") from None
        return None
    if not callable(obj):
        raise CourseInputError(f"{target!r} is not callable; pass a function")
    return target


def _payload(fn, args, kwargs) -> tuple[str, bytes, bool]:
    """What the workers run, as bytes: ``(label, payload, by_value)``.

    A function the workers can import (a module-level function of a .py file) travels by name
    and is imported fresh in each worker. Anything else, a function defined in a notebook cell
    above all, travels by value, serialised with cloudpickle together with its arguments. The
    caller's ``sys.path`` goes along, so a module next to the notebook imports in the workers too.
    """
    import cloudpickle

    target = _target_of(fn)
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
) -> str:
    """The torchrun line that runs the same worker outside the notebook (notebook 00).

    With ``nnodes`` and ``rdzv_endpoint`` it is the line to type on every node of a
    multi-node job (same line everywhere; the c10d rendezvous assigns ranks).
    """
    parts = ["torchrun"]
    if nnodes:
        parts += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint or "HOST:PORT"]
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
    """One status line per run, updated in place: in a notebook a display handle, else stderr.

    While the run lasts each rank shows its last reported step (``starting`` before the first);
    at the end each rank shows how it ended: ``done``, ``failed`` or ``killed``.
    """

    def __init__(self, folder: Path, nproc: int, enabled: bool):
        self.folder, self.nproc, self.enabled = folder, nproc, enabled
        self.handle, self.last = None, ""

    def line(self, elapsed: float, final: dict[int, str] | None = None) -> str:
        parts = []
        for r in range(self.nproc):
            try:
                p = json.loads((self.folder / f"rank{r}.json").read_text())
                extra = " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in p.items()
                    if k not in ("rank", "step", "total", "pid")
                )
                state = f"{p['step']}/{p['total']}" + (f" {extra}" if extra else "")
            except (OSError, ValueError, KeyError):
                state = "starting"
            if final is not None:
                state = final.get(r, "killed") + ("" if state == "starting" else f" (at {state})")
            parts.append(f"rank {r}: {state}")
        return f"[{elapsed:5.1f}s] " + " | ".join(parts)

    def quiet_s(self) -> float | None:
        """Seconds since any rank last reported progress; None if none ever did."""
        times = [f.stat().st_mtime for f in self.folder.glob("rank*.json")]
        return max(0.0, time.time() - max(times)) if times else None

    def update(self, elapsed: float, final: dict[int, str] | None = None) -> None:
        if (
            not self.enabled
            or (elapsed < 2.0 and final is None)
            or (final is not None and self.handle is None and "ipykernel" in sys.modules)
        ):
            return  # a run too short to have drawn a line gets no final line either
        text = self.line(elapsed, final)
        if text == self.last:
            return
        self.last = text
        if "ipykernel" in sys.modules:
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        elif final is not None and sys.stderr.isatty():
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
    def ensure_started(cls, env: dict | None = None) -> bool:
        """Start the server if it is not running; True if this call started it (a cold launch)."""
        if cls.proc is not None and cls.proc.poll() is None:
            return False
        cls.proc = subprocess.Popen(
            [sys.executable, "-m", "course_utils._agent", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env or _server_env(),
            start_new_session=True,
        )
        atexit.register(cls.stop)
        return True

    @classmethod
    def start_agent(cls, spec_path: Path, result_path: Path, log_path: Path, env: dict) -> int:
        cls.ensure_started(env)
        try:
            cls.proc.stdin.write(f"{spec_path}\t{result_path}\t{log_path}\n".encode())
            cls.proc.stdin.flush()
            line = cls.proc.stdout.readline()
        except BaseException:
            # Interrupted (or broken) between the request and the answer: the reply would be read by
            # the next launch, off by one for ever. Drop this server; its agent, if it was forked
            # already, ends itself when its parent goes (and finds the cancel file the caller writes).
            cls.kill()
            raise
        if not line:
            cls.proc = None
            raise LaunchError("the launcher's agent server ended unexpectedly; run the cell again")
        return int(line)

    @classmethod
    def kill(cls) -> None:
        if cls.proc is not None:
            try:
                os.killpg(cls.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            cls.proc.wait()
        cls.proc = None

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        cls.proc = None


def _server_env() -> dict:
    """The agent server's environment: the caller's, with this course_utils first on PYTHONPATH.

    (Each agent it forks replaces its environment with the caller's at that launch.)
    """
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def warm_up() -> None:
    """Start the agent server now, in the background (notebook 00).

    The first launch of a kernel otherwise waits for it (torch and FSDP imported once, about 4 s
    on a laptop CPU). A notebook kernel does this when it imports this module, so the server
    starts while the notebook's next cells run; elsewhere (tests, scripts) nothing starts until
    the first launch. Only on Linux, where the server forks the agents.
    """
    if sys.platform.startswith("linux"):
        _AgentServer.ensure_started()


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
        proc = subprocess.Popen(
            [sys.executable, "-m", "course_utils._agent", str(spec_path), str(result_path), str(log_path)],
            env=env,
            stdin=subprocess.DEVNULL,
        )
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


def _cancel_unknown_agent(folder: Path) -> None:
    """An interrupt came before the agent's pid was known: make sure that agent never runs.

    The agent writes ``agent.pid`` and then looks for ``cancel``; so either it sees the cancel
    file and returns, or its pid file is there to be read here and its group is ended.
    """
    (folder / "cancel").touch()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            pid = int((folder / "agent.pid").read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
            continue
        _kill_group(pid, grace_s=0.5)
        return


# ---------------------------------------------------------------- where each rank was

_LIBRARY_DIRS = tuple(
    {
        os.path.dirname(os.__file__),
        os.path.dirname(importlib.__file__),
        str(Path(importlib.import_module("torch").__file__).parent),
    }
)


def _stack_sizes(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in folder.glob("stack-*.txt")}


def _ask_for_stacks(pgid: int, folder: Path, wait_s: float = 0.5) -> dict[str, int]:
    """SIGUSR1 to the run's whole group: every worker and the agent append their Python stacks."""
    before = _stack_sizes(folder)
    try:
        os.killpg(pgid, signal.SIGUSR1)
    except ProcessLookupError:
        return before
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return before


def _last_dump(text: str) -> list[list[tuple[str, int, str]]]:
    """The threads of the last faulthandler dump in ``text``: per thread, frames most recent first."""
    threads, current = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            current = []
            threads.append(current)
        elif line.strip().startswith('File "') and current is not None:
            rest = line.strip()[len('File "') :]
            path, _, tail = rest.partition('", line ')
            number, _, func = tail.partition(" in ")
            try:
                current.append((path, int(number), func.strip()))
            except ValueError:
                pass
    return threads


def _where(frames: list[tuple[str, int, str]]) -> str:
    """Where a worker was: the innermost frame of the course's or the user's code, and what it had called."""
    import linecache

    for i, (path, number, func) in enumerate(frames):
        if (
            path.startswith("<")
            or path.startswith(_LIBRARY_DIRS)
            or ("site-packages" in path and "course_utils" not in path)
        ):
            continue
        if func == "_ask_peers_where_they_are":
            return "raised: its collective timed out (its traceback is above)"
        if path.endswith(os.path.join("course_utils", "_agent.py")):
            continue
        source = linecache.getline(path, number).strip()
        called = [f for _, _, f in frames[:i] if f not in ("wrapper", "_fn", "inner")]
        waiting = f"in {called[-1]}, called from " if called else "in "
        return f"{waiting}{func} ({Path(path).name} line {number}: {source})" if source else f"{waiting}{func}"
    if any(f == "_wrap" for _, _, f in frames[:3]):
        return "returned"
    return _innermost(frames)


def _innermost(frames: list[tuple[str, int, str]], depth: int = 3) -> str:
    """The last few calls of a stack, innermost first: ``poll (api.py 785) < _monitor_workers < _invoke_run``."""
    return " < ".join(f"{f} ({Path(p).name} {n})" if i == 0 else f for i, (p, n, f) in enumerate(frames[:depth]))


def where_ranks_were(folder: Path, nproc: int, since: dict[str, int] | None = None) -> dict:
    """Per rank, where its main thread was at the last stack dump (and the agent's), from the run's folder."""
    out = {}
    for name in [f"rank{r}" for r in range(nproc)] + ["agent"]:
        path = folder / f"stack-{name}.txt"
        if not path.exists():
            out[name] = "no stack (the process had not started, or was stuck outside Python)"
            continue
        with open(path, errors="replace") as fh:
            fh.seek((since or {}).get(path.name, 0))
            threads = _last_dump(fh.read())
        if not threads:
            out[name] = "no stack (the process had not started, or was stuck outside Python)"
            continue
        if name != "agent" and _result_files(folder).get(int(name[4:])) is not None:
            out[name] = "returned its result"
            continue
        main = next(
            (t for t in threads if any(p.endswith("_agent.py") and f in ("run_in_worker", "_child") for p, _, f in t)),
            threads[-1],
        )
        out[name] = _innermost(main, 4) if name == "agent" else _where(main)
    return out


def _result_files(folder: Path) -> dict[int, Path]:
    return {int(f.name[len("result-rank") : -len(".pkl")]): f for f in folder.glob("result-rank*.pkl")}


def _log_launch(target: str, nproc: int, wall_s: float, cold: bool, finished: bool, backend: str) -> None:
    """One JSON line per launch appended to $COURSE_LAUNCH_LOG, when set (``python -m course_utils bench``
    counts a notebook's launches with it, the GPU check which of them ran on NCCL; ``cold``: this
    launch started the agent server)."""
    path = os.environ.get("COURSE_LAUNCH_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "target": target,
                        "nproc": nproc,
                        "wall_s": wall_s,
                        "cold": cold,
                        "finished": finished,
                        "backend": backend,
                    }
                )
                + "\n"
            )


#: Seconds the launcher waits for the agent once every rank has left its result, before it takes the
#: results itself and stops the agent (it normally reports within a monitor interval, 0.1 s).
COLLECT_GRACE_S = 10.0


def _read_results(folder: Path, nproc: int) -> dict[int, object] | None:
    """Every rank's return value, if all ``nproc`` ranks of the same (latest) attempt left one."""
    found = {}
    for rank, path in _result_files(folder).items():
        try:
            with open(path, "rb") as fh:
                found[rank] = pickle.load(fh)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
    if sorted(found) != list(range(nproc)) or len({attempt for attempt, _ in found.values()}) != 1:
        return None
    return {rank: value for rank, (_, value) in found.items()}


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
        fn: the function every rank runs: a module-level function (or "module:function"
            string), imported by name in each worker, or a function defined in a notebook
            cell, sent by value (cloudpickle). Inside it, call ``course_utils.dist.init()``
            (or ``with dist.session() as info:``) to join the group.
        nproc: number of worker processes (ranks) on this machine.
        args, kwargs: passed to ``fn`` on every rank (anything cloudpickle can copy).
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
        run_dir: folder for this run's logs (``run_dir/logs``) and progress files. By default
            a temporary folder, removed after a run that succeeded and kept (its path is in
            the error) after one that did not.
        env: extra environment variables for the workers, on top of the caller's environment
            as it is at this call.
        progress: draw a live per-rank status line for runs longer than ~2 s.
        echo: stream the workers' output into the notebook as it comes.

    Raises:
        CourseInputError: bad arguments (nothing is started).
        WorkerFailed: a worker raised or died (after ``max_restarts`` restarts).
        LaunchTimeout: the run did not finish in time; the message says where each rank was.
        KeyboardInterrupt: the launch was interrupted; every process of the run was stopped first.
    """
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise CourseInputError(f"nproc must be a whole number of processes >= 1, got {nproc!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise CourseInputError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise CourseInputError(f"timeout_s must be a finite number of seconds above 0 (e.g. 120), got {timeout_s!r}")
    backend_name, device_type = pick_backend(nproc, backend)
    if mesh_shape is not None:
        mesh_shape = check_mesh_shape(nproc, mesh_shape)
    label, payload, by_value = _payload(fn, args, kwargs or {})

    own_dir = run_dir is None
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="course-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    progress_dir = Path(tempfile.mkdtemp(prefix="launch-", dir=run_dir))
    spec_path, result_path = progress_dir / "spec.pkl", progress_dir / "result.pkl"
    agent_log = progress_dir / "agent.log"
    log_dir = run_dir / "logs"
    # The workers see the caller's environment as it is now (not as it was when the agent server
    # started), plus what the run needs. Workers must import the same course_utils as the caller.
    environ = _server_env()
    environ.update({k: str(v) for k, v in (env or {}).items()})
    environ.update(
        COURSE_BACKEND=backend_name,
        COURSE_TIMEOUT_S=str(timeout_s),
        COURSE_PROGRESS_DIR=str(progress_dir),
        PYTHONUNBUFFERED="1",
    )
    if mesh_shape is not None:
        environ["COURSE_MESH_SHAPE"] = ",".join(map(str, mesh_shape))
    # fork is milliseconds and safe on CPU; CUDA must not be forked, so GPU runs spawn.
    start_method = "spawn" if device_type == "cuda" or not sys.platform.startswith("linux") else "fork"
    with open(spec_path, "wb") as fh:
        pickle.dump(
            {
                "payload": payload,
                "label": label,
                "nproc": nproc,
                "max_restarts": max_restarts,
                "log_dir": str(log_dir),
                "environ": environ,
                "cwd": os.getcwd(),
                "start_method": start_method,
                "progress_dir": str(progress_dir),
            },
            fh,
        )
    agent_log.touch()

    start = time.monotonic()
    cold = start_method == "fork" and (_AgentServer.proc is None or _AgentServer.proc.poll() is not None)
    status = _Progress(progress_dir, nproc, progress)
    tail: list[str] = []
    pgid, values, collected_by_hand = None, None, None
    try:
        try:
            pgid = _start_agent(spec_path, result_path, agent_log, environ, use_server=start_method == "fork")
        except BaseException:
            _cancel_unknown_agent(progress_dir)
            raise
        # The run's clock starts once its agent exists: a cold agent server (torch imported once,
        # about 5 s, more on a busy machine) must not eat into a short ``timeout_s``.
        started = time.monotonic()
        all_returned_at = None
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
                if all_returned_at is None and len(_result_files(progress_dir)) == nproc:
                    all_returned_at = time.monotonic()
                if all_returned_at is not None and time.monotonic() - all_returned_at > COLLECT_GRACE_S:
                    values = _read_results(progress_dir, nproc)
                    if values is not None:  # every rank returned; the agent did not collect: see COLLECT_GRACE_S
                        since = _ask_for_stacks(pgid, progress_dir)
                        collected_by_hand = where_ranks_were(progress_dir, nproc, since)["agent"]
                        _kill_group(pgid)
                        break
                    all_returned_at = None
                if time.monotonic() - started > timeout_s + _grace(timeout_s):
                    raise _timed_out(pgid, progress_dir, nproc, timeout_s, status, elapsed, log_dir)
                _reap()
                time.sleep(0.05)
    except KeyboardInterrupt:
        if pgid is not None:
            _kill_group(pgid)
        raise KeyboardInterrupt(
            f"launch interrupted: every process of the run ({nproc} workers and their agent) was stopped"
        ) from None
    finally:
        if pgid is not None:  # nothing of this run may outlive it
            deadline = time.monotonic() + 2.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                _reap()
                time.sleep(0.02)
            _kill_group(pgid, grace_s=1.0)
        _reap()
        _log_launch(
            label, nproc, time.monotonic() - start, cold, result_path.exists() or values is not None, backend_name
        )

    outcome = None
    if values is None:
        if not result_path.exists():
            status.update(time.monotonic() - start, final={})
            raise LaunchError(
                f"the launcher's agent ended without a result (logs: {log_dir}); its last output:\n"
                + "\n".join(tail[-30:])
            )
        with open(result_path, "rb") as fh:
            outcome = pickle.load(fh)
        if outcome["ok"]:
            values = _read_results(progress_dir, nproc)
    if values is None:
        outcome = outcome or {}
        rank = outcome.get("rank")
        status.update(
            time.monotonic() - start,
            final={
                r: ("failed" if r == rank else "done" if r in _result_files(progress_dir) else "killed")
                for r in range(nproc)
            },
        )
        head = f"rank {rank} failed" if rank is not None else "the launch failed"
        if outcome.get("exitcode") is not None:
            head += f" (exit code {outcome['exitcode']})"
        if max_restarts:
            head += f" (the group was restarted up to {max_restarts} time(s) first)"
        where = where_ranks_were(progress_dir, nproc)
        seen = {int(r[4:]): w for r, w in where.items() if not w.startswith("no stack") and r != "agent"}
        note = ""
        if seen:  # a collective timed out and its rank asked everyone where they were
            absent = [r for r, w in seen.items() if not w.startswith(("raised", "returned"))]
            note = "\nWhere each rank was when the collective timed out:\n" + "\n".join(
                f"  rank {r}: {w}" for r, w in seen.items()
            )
            if absent:
                head = f"rank {rank} timed out in a collective that rank(s) {', '.join(map(str, absent))} never reached"
        raise WorkerFailed(
            f"{head}; logs: {log_dir}\n{outcome.get('message', 'no result from any rank')}{note}",
            rank=rank,
            exitcode=outcome.get("exitcode"),
        )
    status.update(time.monotonic() - start, final={r: "done" for r in range(nproc)})
    if collected_by_hand is not None:
        warn(
            f"every rank had returned, but torch's elastic agent had not collected the results "
            f"{COLLECT_GRACE_S:g} s later (it was {collected_by_hand}); the launcher read them from the ranks' "
            f"files and stopped the agent. Logs: {log_dir}"
        )
    result = RunResult(sorted(values.items()))
    result.backend, result.device_type, result.nproc = backend_name, device_type, nproc
    result.wall_s, result.log_dir = time.monotonic() - start, str(log_dir)
    result.command = (
        torchrun_command(label, nproc, args, kwargs, max_restarts=max_restarts)
        if not by_value
        else f"# {label} was defined in the notebook: put it in a .py module to run it under torchrun"
    )
    if own_dir and collected_by_hand is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        result.log_dir = None
    return result


def _timed_out(
    pgid: int, folder: Path, nproc: int, timeout_s: float, status: _Progress, elapsed: float, log_dir: Path
) -> LaunchTimeout:
    """Ask every process where it is, stop them all, and say what happened, rank by rank."""
    last, quiet = status.line(elapsed), status.quiet_s()
    since = _ask_for_stacks(pgid, folder)
    where = where_ranks_were(folder, nproc, since)
    _kill_group(pgid)
    ranks = {r: where[f"rank{r}"] for r in range(nproc)}
    status.update(elapsed, final={r: "done" if w == "returned its result" else "killed" for r, w in ranks.items()})
    lines = "\n".join(f"  rank {r}: {w}" for r, w in ranks.items()) + f"\n  agent: {where['agent']}"
    if all(w == "returned its result" for w in ranks.values()):
        why = (
            "Every rank had returned its result, but torch's elastic agent did not collect the results: "
            "this is the launcher's fault, not your code's; run the cell again"
        )
    elif quiet is not None and quiet < timeout_s:
        why = (
            f"The workers were still making progress ({quiet:.0f} s before the end): the run is not hung, only "
            "longer than timeout_s, which also bounds the whole run; pass a larger timeout_s (or fewer steps)"
        )
    else:
        waiting = [r for r, w in ranks.items() if w != "returned its result"]
        why = (
            f"Rank(s) {', '.join(map(str, waiting))} did not finish: look above for the rank that never reached "
            "the collective the others wait in"
        )
    return LaunchTimeout(
        f"the run did not finish within {timeout_s:g} s (+{_grace(timeout_s):g} s grace) and every process was "
        f"stopped. {why}.\nWhere each process was:\n{lines}\nLast progress: {last}; logs: {log_dir}"
    )


#: What the background process runs: import the function by name, call it, pickle what came of it.
_BACKGROUND_MAIN = """
import importlib, pickle, sys
module, _, qualname = sys.argv[1].partition(":")
fn = importlib.import_module(module)
for part in qualname.split("."):
    fn = getattr(fn, part)
args, kwargs = pickle.load(sys.stdin.buffer)
try:
    out = (True, fn(*args, **kwargs))
except Exception as exc:
    out = (False, exc)
with open(sys.argv[2], "wb") as f:
    try:
        pickle.dump(out, f)
    except Exception:
        pickle.dump((False, RuntimeError(repr(out[1]))), f)
"""


class Background:
    """One call of a module-level function in a fresh process, while the caller goes on (notebook 05b).

    ``result(timeout_s)`` waits for it and returns its value (or raises its exception); either way
    the process is gone afterwards. A timeout, an interrupt or the kernel's exit ends the process
    (it runs in its own session, ended as a group), so nothing is left running. Notebook 05b
    rehearses its 70B this way on the machine's second core while the first runs the sections
    before it. Not a distributed launch: no process group, no ranks (``launch`` is for that).
    """

    def __init__(self, fn, *args, **kwargs):
        target = _target_of(fn)
        if target is None:
            raise CourseInputError(
                "Background runs a module-level function of an importable module (it is "
                "imported by name in the new process); move the function into a module"
            )
        self._folder = Path(tempfile.mkdtemp(prefix="course-background-"))
        self._result = self._folder / "result.pkl"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BACKGROUND_MAIN, target, str(self._result)],
            stdin=subprocess.PIPE,
            env=_server_env(),
            start_new_session=True,
        )
        atexit.register(self.cancel)
        self._proc.stdin.write(pickle.dumps((args, kwargs)))
        self._proc.stdin.close()

    def result(self, timeout_s: float = 600.0):
        """The function's return value; waits at most ``timeout_s`` seconds, then ends the process and raises."""
        try:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise LaunchTimeout(
                    f"the background run did not finish in {timeout_s:g} s and was stopped; give "
                    "it a longer timeout_s, or run it in the foreground to see where it is"
                ) from None
            if not self._result.exists():
                raise LaunchError(
                    f"the background process ended (exit code {self._proc.returncode}) without a "
                    "result; run the same call in the foreground to see why"
                )
            ok, value = pickle.loads(self._result.read_bytes())
            if not ok:
                raise value
            return value
        finally:
            self.cancel()

    def cancel(self) -> None:
        """End the process now (nothing if it has finished) and remove its folder."""
        if self._proc.poll() is None:
            _kill_group(self._proc.pid)
            self._proc.wait()
        shutil.rmtree(self._folder, ignore_errors=True)
        atexit.unregister(self.cancel)


if "ipykernel" in sys.modules and os.environ.get("COURSE_WARM_UP", "1") != "0":
    warm_up()  # a notebook's first launch should not wait for torch to import a second time
