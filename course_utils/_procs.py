"""The processes of a launch: the agent that runs it, and ending all of them at once (private; notebook 00).

Each launch's elastic agent runs in a session of its own, so the agent and every worker it starts
form one process group that ``kill_group`` ends at once. On Linux the agents are forked from a
small server that imported torch once (``course_utils._agent --serve``); elsewhere each is a fresh
``python -m course_utils._agent``. Either way the run's spec (what to run, the caller's environment)
reaches the agent through a pipe, never a file.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ._agent import BYE, request
from ._report import LaunchError
from .scratch import group_alive


def server_env() -> dict:
    """The agent's environment: the caller's, with this course_utils first on PYTHONPATH.

    (Each agent forked by the server replaces its environment with the caller's at that launch.)
    """
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def kill_group(pgid: int, grace_s: float = 3.0) -> None:
    """End an agent and all its workers: SIGTERM to the group, then SIGKILL after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(pgid):
            reap()
            time.sleep(0.02)
        if not group_alive(pgid):
            return


class AgentServer:
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
            env=env or server_env(),
            start_new_session=True,
        )
        atexit.register(cls.stop)
        return True

    @classmethod
    def start_agent(cls, spec_bytes: bytes, result_path: Path, log_path: Path, env: dict) -> int:
        cls.ensure_started(env)
        try:
            cls.proc.stdin.write(request(spec_bytes, str(result_path), str(log_path)))
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
            try:
                cls.proc.stdin.write(BYE)  # a normal exit: this process's atexit removes its own scratch
                cls.proc.stdin.flush()
            except OSError:
                pass
            cls.proc.stdin.close()
            try:
                cls.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
        cls.proc = None


def warm_up() -> None:
    """Start the agent server now, in the background (notebook 00).

    The first launch of a kernel otherwise waits for it (torch and FSDP imported once, about 4 s
    on a laptop CPU). A notebook kernel does this when it imports ``course_utils.launch``, so the
    server starts while the notebook's next cells run; elsewhere (tests, scripts) nothing starts
    until the first launch. Only on Linux, where the server forks the agents.
    """
    if sys.platform.startswith("linux"):
        AgentServer.ensure_started()


_popen_agents: list[subprocess.Popen] = []


def reap() -> None:
    for p in list(_popen_agents):
        if p.poll() is not None:
            _popen_agents.remove(p)


def start_agent(spec_bytes: bytes, result_path: Path, log_path: Path, env: dict, use_server: bool) -> int:
    """Start one launch's agent in its own session; return its pid (= its process group id)."""
    if use_server:
        pid = AgentServer.start_agent(spec_bytes, result_path, log_path, env)
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "course_utils._agent", str(result_path), str(log_path)],
            env=env,
            stdin=subprocess.PIPE,
        )
        _popen_agents.append(proc)
        proc.stdin.write(spec_bytes)
        proc.stdin.close()
        pid = proc.pid
    # The agent calls setsid() first thing; wait until it leads its own process group.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                break
        except ProcessLookupError:
            break
        reap()
        time.sleep(0.005)
    return pid


def cancel_unknown_agent(folder: Path) -> None:
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
        kill_group(pid, grace_s=0.5)
        return


# A notebook's first launch should not wait for the server to import torch: in a kernel it starts as soon
# as the launcher is imported, before ``launch`` imports torch itself (``.dist``), so the two imports run
# on two cores at once.
if "ipykernel" in sys.modules and os.environ.get("COURSE_WARM_UP", "1") != "0":
    warm_up()
