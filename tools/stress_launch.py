"""Stress the launcher: many short launches from concurrent callers beside a CPU hog; count stalls.

A "stall" is a launch of a trivial worker that did not come back promptly: a ``LaunchTimeout``,
or a run in which every rank had returned but torch's elastic agent did not collect the results
(the launcher now takes them from the ranks' files, warns, and stops the agent: counted as
``agent_not_collecting``). Issue 14 of the course found one such stall in a CI run of a few hundred
launches; this is how it was hunted and how the fix is checked.

Short form (CI, about a minute)::

    python tools/stress_launch.py --launches 30 --callers 2 --hogs 1

Long form (``make stress``)::

    python tools/stress_launch.py --launches 300 --callers 2 --hogs 1 --json benchmarks/stress.json

On a slow launch (over ``--slow-s``) it dumps the Python stacks of the agents and workers with
py-spy, when installed, into the output folder, so a stall shows where each process waited.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _dump_stacks(root_pid: int, out: Path, tag: str) -> None:
    """py-spy dump of every descendant of ``root_pid`` (the agent server): agents and workers."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return
    todo, seen = _children(root_pid), []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += _children(pid)
    with open(out / f"stall-{tag}.txt", "w") as fh:
        for pid in seen:
            fh.write(f"===== pid {pid}\n")
            fh.flush()
            subprocess.run([str(spy), "dump", "--pid", str(pid)], stdout=fh, stderr=subprocess.STDOUT, timeout=30)


def caller(index: int, launches: int, nproc: int, timeout_s: float, slow_s: float, out: str, queue) -> None:
    """One caller process: ``launches`` launches in a row, as a notebook kernel makes them."""
    from course_utils import examples
    from course_utils.launch import LaunchTimeout, WorkerFailed, _AgentServer, launch

    folder = Path(out)
    counts = {"ok": 0, "stall_timeout": 0, "agent_not_collecting": 0, "other_error": 0}
    walls = []
    for i in range(launches):
        done = threading.Event()

        def watchdog(tag=f"{index}-{i}", done=done):
            if not done.wait(slow_s) and _AgentServer.proc is not None:
                _dump_stacks(_AgentServer.proc.pid, folder, tag)

        threading.Thread(target=watchdog, daemon=True).start()
        start = time.monotonic()
        try:
            with warnings.catch_warnings(record=True):
                import io
                from contextlib import redirect_stderr

                err = io.StringIO()
                with redirect_stderr(err):
                    result = launch(
                        examples.all_reduce_demo,
                        nproc=nproc,
                        kwargs={"n": 2},
                        timeout_s=timeout_s,
                        echo=False,
                        progress=False,
                    )
            assert all(v["result"] == [nproc * (nproc + 1) / 2] * 2 for v in result.values())
            if "had not collected the results" in err.getvalue():
                counts["agent_not_collecting"] += 1
                (folder / f"not-collecting-{index}-{i}.txt").write_text(err.getvalue())
            else:
                counts["ok"] += 1
        except LaunchTimeout as exc:
            counts["stall_timeout"] += 1
            (folder / f"timeout-{index}-{i}.txt").write_text(str(exc))
        except (WorkerFailed, Exception) as exc:  # noqa: BLE001 - counted and kept for reading
            counts["other_error"] += 1
            (folder / f"error-{index}-{i}.txt").write_text(f"{type(exc).__name__}: {exc}")
        finally:
            done.set()
        walls.append(time.monotonic() - start)
    queue.put({"caller": index, **counts, "walls": walls})


def hog(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=300, help="launches per caller")
    parser.add_argument("--callers", type=int, default=2, help="concurrent caller processes (kernels)")
    parser.add_argument("--hogs", type=int, default=1, help="CPU-hog processes beside them")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--slow-s", type=float, default=15.0, help="dump stacks of a launch slower than this")
    parser.add_argument("--out", default="build/stress", help="folder for stack dumps and error texts")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    stop, queue = ctx.Event(), ctx.Queue()
    hogs = [ctx.Process(target=hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    callers = [
        ctx.Process(target=caller, args=(i, args.launches, args.nproc, args.timeout_s, args.slow_s, str(out), queue))
        for i in range(args.callers)
    ]
    start = time.monotonic()
    for p in hogs + callers:
        p.start()
    results = [queue.get() for _ in callers]
    for p in callers:
        p.join()
    stop.set()
    for p in hogs:
        p.join(5)
    walls = sorted(w for r in results for w in r.pop("walls"))
    summary = {
        key: sum(r[key] for r in results) for key in ("ok", "stall_timeout", "agent_not_collecting", "other_error")
    }
    summary.update(
        launches=len(walls),
        callers=args.callers,
        hogs=args.hogs,
        nproc=args.nproc,
        wall_s=round(time.monotonic() - start, 1),
        launch_s_median=round(walls[len(walls) // 2], 2),
        launch_s_max=round(walls[-1], 2),
        load_average=os.getloadavg(),
    )
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["stall_timeout"] == summary["other_error"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
