"""The launcher's agent process (private; used by course_utils.launch).

``launch`` runs torch's elastic agent (the engine of torchrun) outside the notebook kernel, in
a session of its own. That keeps the agent's signal handlers out of the kernel, and lets the
kernel end the agent and every worker at once (one process group) on a timeout or on the
notebook's stop button.

Two ways to get such a process:

- ``python -m course_utils._agent RESULT LOG``: one fresh process per launch (any OS); the run's
  spec arrives on its standard input.
- ``python -m course_utils._agent --serve``: on Linux, a small single-threaded server that has
  imported torch once and forks one agent per launch (read a request and the spec's bytes from
  stdin, answer with the agent's pid). Importing torch costs ~2-3 s on a laptop CPU; the fork
  costs milliseconds, which is the difference between a 1 s and a 6 s launch in a classroom.

The spec (what to run, and the caller's environment at that launch) only ever travels through
that pipe: no file of a run holds the caller's environment, however the run ends.

Only torch is imported before the fork; the course's modules are imported after it, so an
edited course module is picked up by the next launch. Every worker runs
``course_utils.worker.run_in_worker``; when the run fails, the agent writes which rank caused it,
how (a Python error from the user's own frame on, ``trim_traceback``; or a signal, ``died``) and
every rank's exit code, for ``course_utils._report`` to say.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import re
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid


#: Every worker's exit code in the last attempt, recorded as torch's process context closes (see below).
_exit_codes: dict[int, int | None] = {}


def _record_exit_codes() -> None:
    """Keep each worker's own exit code: torch reports only the first failure it polls.

    When rank 1 dies with ``os._exit(3)``, rank 0 fails a moment later in a collective; if the
    agent polls after both are gone, torch names rank 0 and its exit code 1. The process context's
    ``_close`` joins every worker, so just after it every exit code is known: record them.
    """
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    original = MultiprocessContext._close

    def _close(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            if self._pc is not None:
                _exit_codes.clear()
                _exit_codes.update({i: p.exitcode for i, p in enumerate(self._pc.processes)})

    MultiprocessContext._close = _close


def run_agent(spec: dict, result_path: str) -> None:
    """Run the elastic agent for one launch and write its outcome to ``result_path``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker import run_in_worker

    os.chdir(spec["cwd"])
    # torch's process starter gives every worker an error file from tempfile (``pytorch-errorfile-*.pickle``) and
    # leaves the file of a worker that failed or was killed behind: in the run's own folder, it goes with the run
    # (and stays beside the logs of a failed one) instead of piling up in /tmp. The workers set it back.
    tempfile.tempdir = spec["progress_dir"]
    # The agent's INFO lines are noise in a notebook; its warnings and errors still show.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    _record_exit_codes()
    from . import _agent_patches as patches  # after the fork, as every course module

    patches.stores_listen_on_loopback()
    patches.rendezvous_without_stack_walks()
    patches.tail_logs_promptly()
    patches.log_file_timer_reaping()  # only with TORCHELASTIC_ENABLE_FILE_TIMER=1
    # gloo (and NCCL's bootstrap) listen on the address of the interface they pick: loopback here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec["nproc"],
        run_id=f"course-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",  # LaunchConfig's default is "etcd"; torchrun's is c10d
        rdzv_endpoint="127.0.0.1:0",  # port 0: the OS picks a free port, every run
        local_addr="127.0.0.1",  # what workers are told to connect to (MASTER_ADDR)
        max_restarts=spec["max_restarts"],  # LaunchConfig's default is 3, torchrun's 0: be explicit
        monitor_interval=0.02,  # how soon the agent sees a worker end (torchrun's default is 0.1 s)
        start_method=spec["start_method"],
        logs_specs=DefaultLogsSpecs(log_dir=spec["log_dir"], tee=Std.ALL),
        log_line_prefix_template="[rank${rank}]:",
    )
    try:
        elastic_launch(config, run_in_worker)(spec["payload"], spec["progress_dir"])
        result = {"ok": True}
    except ChildFailedError as exc:
        result = _failure(exc, spec["log_dir"])
    except BaseException:  # the agent itself failed (rendezvous, pickling, a signal...)
        result = {"ok": False, "rank": None, "message": traceback.format_exc(), "exitcode": None}
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(result, fh)
    os.replace(tmp, result_path)  # the launcher sees a result only when it is whole


def _failure(exc, log_dir: str) -> dict:
    """The outcome of a failed run: the rank that caused it, its exit code, and what happened in words.

    torch's own report (``ChildFailedError.format_msg``: error-file paths, a link) stays in this agent's
    log; the message holds the cause's traceback from its own frame on (``trim_traceback``).
    """
    rank, first = exc.get_first_failure()
    result = {"ok": False, "rank": rank, "exitcode": first.exitcode, "message": f"rank {rank} failed"}
    if os.path.isfile(first.error_file) or first.exitcode == -signal.SIGTERM:
        result.update(root_cause(log_dir) or {})
    else:  # no traceback at all: it died on its own (os._exit, a signal, a crash), so it is the cause
        result["message"], result["silent"] = died(rank, first.exitcode), True
    if result["rank"] in _exit_codes:  # the failing rank's own exit code, not the first one polled
        result["exitcode"] = _exit_codes[result["rank"]]
    if result.get("silent"):  # now that its own exit code is known, say how it died
        result["message"] = died(result["rank"], result["exitcode"]) + result.get("after", "")
    result["exit_codes"] = dict(_exit_codes)
    return result


#: What ended a worker that left no Python error, by signal.
_SIGNAL_CAUSES = {
    "SIGINT": "an interrupt sent to that process alone (kill -INT, or Ctrl-C in a terminal it shares; "
    "interrupt the launch instead)",
    "SIGKILL": "killed outright (kill -9, or the kernel's out-of-memory killer)",
    "SIGSEGV": "a crash in native code",
    "SIGABRT": "an abort in native code",
    "SIGBUS": "a crash in native code (bus error)",
}


def died(rank: int, exitcode: int | None) -> str:
    """One sentence for a rank that ended without a Python error: by which signal, or its exit code."""
    if isinstance(exitcode, int) and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = _SIGNAL_CAUSES.get(name, "a signal from outside the run")
        return f"rank {rank} was ended by {name}, {why}: no Python error; the agent stopped the other ranks."
    return (
        f"rank {rank} died without a Python error (exit code {exitcode}): no traceback, like a lost GPU "
        "or os._exit; the agent stopped the other ranks."
    )


#: Frames of the machinery between a worker's process and the function it runs: torch's elastic
#: wrappers (``record`` in ``errors/__init__.py``) and this module. A traceback shown to a user starts
#: below them, at the user's or the course's own frame; the full one stays in the logs.
_PLUMBING = (
    os.sep + os.path.join("torch", "distributed", "elastic") + os.sep,
    os.sep + os.path.join("torch", "multiprocessing") + os.sep,
    os.sep + os.path.join("course_utils", "_agent.py"),
    os.sep + os.path.join("course_utils", "worker.py"),
)


def trim_traceback(text: str) -> str:
    """A Python traceback without the launcher's frames (``_PLUMBING``); everything else as it was."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        found = re.match(r'^\s*File "([^"]+)", line \d+', lines[i])
        if not found:
            out.append(lines[i])
            i += 1
            continue
        end = i + 1  # the frame's source line and its markers, up to the next frame or message
        while end < len(lines) and lines[end].startswith("    ") and not re.match(r'^\s*File "', lines[end]):
            end += 1
        if not any(p in found.group(1) for p in _PLUMBING):
            out.extend(lines[i:end])
        i = end
    # a chained section whose every frame was the launcher's: its header alone says nothing
    headed = [ln for j, ln in enumerate(out) if not (ln.startswith("Traceback") and _no_frame_after(out, j))]
    return "\n".join(headed)


def _no_frame_after(lines: list[str], j: int) -> bool:
    return j + 1 >= len(lines) or not lines[j + 1].lstrip().startswith('File "')


#: What ``root_cause`` says of a rank whose error file holds no whole JSON document (``read_error_file``).
CUT_SHORT = "stopped while writing its error file"
#: What a rank reports when the agent stopped it (or it was stopped mid-report), and when it lost a peer.
STOPPED = ("SignalException", CUT_SHORT)
LOST_PEER = ("closed by peer", "Connection reset", "Read error", "remote process")


def read_error_file(path) -> dict:
    """A worker's ``error.json`` as torch wrote it, or ``{}`` when it holds no whole JSON document.

    torch writes the file in place (``error_handler._write_error_file``), so a worker stopped while writing
    it (the agent's SIGTERM to the survivors of a failure) leaves it empty or cut short: seen once in a full
    test run, after the agent began noticing failures within 20 ms. Such a file says nothing about the cause.
    """
    import json

    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def root_cause(log_dir: str) -> dict | None:
    """The rank whose error came first in the last attempt, with its traceback.

    When one rank raises, its peers fail a moment later inside a collective ("connection reset
    by peer"). torch reports whichever failure it polls first; the error file written first
    (by modification time, in nanoseconds) is the one that caused the others.
    """
    import glob

    files = glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "error.json"))
    if not files:
        return None
    last = max(int(f.split(os.sep)[-3].split("_")[1]) for f in files)
    files = [f for f in files if f.split(os.sep)[-3] == f"attempt_{last}"]
    files.sort(key=lambda f: os.stat(f).st_mtime_ns)
    in_attempt = {int(d) for d in os.listdir(os.path.dirname(os.path.dirname(files[0]))) if d.isdigit()}
    ranks = []
    for f in files:
        data = read_error_file(f)
        if not data:  # stopped while writing it: a consequence, like SignalException
            ranks.append((int(f.split(os.sep)[-2]), CUT_SHORT, ""))
            continue
        msg = data.get("message", {})
        if isinstance(msg, dict):
            text = msg.get("message", "")
            stack = msg.get("extraInfo", {}).get("py_callstack", "")
        else:
            text, stack = str(msg), ""
        ranks.append((int(f.split(os.sep)[-2]), text, stack))
    # A rank the agent stopped reports SignalException; a rank that lost a peer reports a broken
    # connection. If every report is one of those, the cause is a rank that left no report at all:
    # it died without a Python error (os._exit, a kill, a crash: like a lost GPU).
    consequences = STOPPED + LOST_PEER
    causes = [r for r in ranks if not any(c in r[1] for c in consequences)]
    silent = sorted(in_attempt - {r for r, _, _ in ranks})
    if not causes and silent:
        stopped = ", ".join(str(r) for r, _, _ in ranks)
        after = f" (attempt {last}: rank(s) {stopped} then lost their peer or were stopped by the agent)"
        return {"rank": silent[0], "message": "", "attempt": last, "silent": True, "after": after}
    ranks = causes + [r for r in ranks if r not in causes]
    rank, text, stack = ranks[0]
    message = f"rank {rank} raised first (attempt {last}): {_no_build_path(text)}\n\n{trim_traceback(stack).strip()}"
    return {"rank": rank, "message": message + _after_it(ranks[1:]), "attempt": last}


def _no_build_path(text: str) -> str:
    """gloo's message without the file torch was built from ([/__w/...cc:78]): the logs keep it."""
    return re.sub(r"\[/[^\]\s]*:\d+\] ", "", text, count=1)


def _after_it(later: list[tuple], shown: int = 4) -> str:
    """The ranks that failed after the first, each with the first line of its own error and what that means.

    Which error a survivor reports is a race: the agent's SIGTERM, or a collective that lost its peer first.
    """
    if not later:
        return ""
    lines = [f"\nrank(s) {', '.join(str(r) for r, _, _ in later)} failed after it:"]
    for r, text, _ in later[:shown]:
        why = (
            "was stopped by the agent"
            if any(c in text for c in STOPPED)
            else "lost a peer"
            if any(c in text for c in LOST_PEER)
            else "raised"
        )
        first = (_no_build_path(text).strip().splitlines() or [""])[0].split(". ")[0]
        lines.append(f"  rank {r} {why}: {first[:110]}")
    if len(later) > shown:
        lines.append(f"  ... and {len(later) - shown} more: every rank's error is in the run's logs")
    return "\n".join(lines)


def _watch_parent(parent: int) -> None:
    """End this run (agent and workers, one process group) at once if the process that started it dies.

    The launcher stops a run itself on a timeout or an interrupt; this covers a killed notebook
    kernel, where nobody is left to do it: without it a worker that ignores SIGTERM keeps the agent
    waiting for its 30 s grace, under init.
    """
    while True:
        time.sleep(0.25)
        if os.getppid() != parent:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def _child(spec_bytes: bytes, result_path: str, log_path: str) -> None:
    """Become one launch's agent: own session, the caller's environment, output to the run's log, then run.

    ``spec_bytes`` (the pickled spec) came through a pipe from the caller and lives only in memory.
    """
    parent = os.getppid()
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    folder = os.path.dirname(result_path)
    with open(os.path.join(folder, "agent.pid"), "w") as fh:  # the launcher's handle if its handshake broke
        fh.write(str(os.getpid()))
    if os.path.exists(os.path.join(folder, "cancel")):  # the caller was interrupted before it knew our pid
        return
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    spec = pickle.loads(spec_bytes)
    # The caller's environment as it is at this launch (the server's is as it was at its start).
    os.environ.clear()
    os.environ.update(spec["environ"])
    from .worker import dump_stacks_on  # after the fork: the course's modules are imported fresh for each run

    dump_stacks_on(os.path.join(folder, "stack-agent.txt"))
    run_agent(spec, result_path)


#: What a caller that exits normally writes last: its own ``atexit`` removes its scratch folders.
BYE = b"bye\n"


def request(spec_bytes: bytes, result_path: str, log_path: str) -> bytes:
    """What the caller writes to the server for one launch: a header line, then the spec's bytes."""
    return f"{result_path}\t{log_path}\t{len(spec_bytes)}\n".encode() + spec_bytes


def _fork_agent(spec_bytes: bytes, result_path: str, log_path: str) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _child(spec_bytes, result_path, log_path)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _kernel_gone(groups: list[int], killed: int | None) -> None:
    """Stop every run; if the kernel was killed (pid ``killed``), have its scratch folders removed."""
    for pid in groups:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if killed is not None:  # a killed kernel runs no atexit
        from .scratch import bury_later  # the course's code, imported only now: nothing is forked after this

        bury_later(killed, groups)


def serve() -> None:
    """Fork one agent per request (``request``); exit (ending them) at stdin EOF."""
    import torch.distributed.launcher.api  # noqa: F401  (the expensive import, done once)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # noqa: F401

    # What every course worker imports next: building any torch.optim optimizer pulls in
    # torch._dynamo (~3 CPU-s per process on a laptop); FSDP, DTensor and DCP are the
    # sharding notebooks'. Importing them here once, before the fork, spares every worker.
    # Only torch's own modules: the course's code is imported after the fork, fresh.
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    # Everything imported so far lives as long as the process: move it out of the collector's
    # reach, so a full gc.collect() in a worker scans only that worker's own objects (~1 ms, not
    # ~0.7 s), and collections do not dirty the pages shared with the forked children.
    gc.freeze()

    # Each agent is watched through a pidfd, so the select wakes the moment one exits and it is reaped
    # at once: a launch ends when its agent's process group is gone, and an unreaped agent (a zombie)
    # still counts as in it. Polling every 0.2 s added 0.1 s to every launch on average (strace).
    children: dict[int, int | None] = {}  # agent pid -> its pidfd (None where Linux lacks pidfd_open)
    kernel = os.getppid()  # whose scratch folders to remove if it was killed (``_bury``)
    said_bye = False  # the kernel is exiting normally (``BYE``), not killed
    buffer = b""
    while True:
        watched = [fd for fd in children.values() if fd is not None]
        ready, _, _ = select.select([0, *watched], [], [], 0.2 if len(watched) == len(children) else 0.02)
        for pid, fd in list(children.items()):  # reap finished agents so none lingers as a zombie
            try:
                done = os.waitpid(pid, os.WNOHANG)[0]
            except ChildProcessError:
                done = True
            if done:
                del children[pid]
                if fd is not None:
                    os.close(fd)
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the kernel went away: take every run of ours with us
            _kernel_gone(list(children), None if said_bye else kernel)
            return
        buffer += chunk
        while b"\n" in buffer:
            header, rest = buffer.split(b"\n", 1)
            if header + b"\n" == BYE:
                said_bye, buffer = True, rest
                continue
            result_path, log_path, size = header.decode().split("\t")
            if len(rest) < int(size):
                break  # the spec's bytes are still coming
            spec_bytes, buffer = rest[: int(size)], rest[int(size) :]
            pid = _fork_agent(spec_bytes, result_path, log_path)
            try:
                children[pid] = os.pidfd_open(pid)
            except (AttributeError, OSError):  # Linux before 5.3
                children[pid] = None
            sys.stdout.write(f"{pid}\n")
            sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    elif len(sys.argv) == 3:  # one agent, its spec on stdin
        _child(sys.stdin.buffer.read(), sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: python -m course_utils._agent (--serve | RESULT LOG < SPEC)")
