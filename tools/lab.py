"""`make lab`: JupyterLab on the student's own copies of the notebooks, and one line that says where to open it.

    python tools/lab.py [--fresh NN [--yes]] [--work DIR] [--state DIR]
    python tools/lab.py --course                   (authors: the course's notebooks/ themselves)

- the lab opens ``my-notebooks/``, the student's copies (ignored by git): each notebook of ``notebooks/``
  is copied there the first time, and a copy is never overwritten without asking. Whatever a student
  runs, saves or autosaves, and JupyterLab's ``.ipynb_checkpoints``, stays in that folder, so
  ``notebooks/`` (what ``git pull`` updates and ``make test`` executes) is never touched; the kernels
  start there too, so a file a cell writes by a relative path lands there;
- ``--fresh 03`` (``make lab FRESH=03``) replaces the copy of one notebook with a fresh one from
  ``notebooks/``, after asking (``--yes`` does not ask); the old copy is kept in ``my-notebooks/old/``.
  When the course's notebook changed since a copy was made (after a ``git pull``), the lab says so
  and keeps the copy;
- a free port of 127.0.0.1 (asked from the system, never a fixed one) and a token generated here, passed
  to the server through ``JUPYTER_TOKEN`` (not on its command line, where other users' ``ps`` would see it);
- the server logs warnings only: no banner with another URL, no list of language servers that are not
  installed; this script prints the URL to open, once, when the server answers;
- the course's lab settings live in ``build/lab/`` (``JUPYTERLAB_SETTINGS_DIR``, ``JUPYTERLAB_WORKSPACES_DIR``),
  never in the user's home: the news prompt, whose pop-up covered the first outputs, is switched off
  there (``fetchNews: "false"``) and so is the check for JupyterLab updates;
- Ctrl-C (or SIGTERM) stops the server and its kernels, with nothing left running.

tests/test_lab.py starts it on a free port, fetches the printed URL and stops it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The student's copies: ignored by git (.gitignore), outside what make test executes.
WORK = ROOT / "my-notebooks"
#: Inside WORK: which course notebook each copy was made from, and the copies replaced by --fresh.
RECORD, OLD = ".course-copies.json", "old"
#: The lab's settings for the course: written on every start, so an edit here is what every student gets.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


# ---------------------------------------------------------------------------------------------
# The student's copies
# ---------------------------------------------------------------------------------------------


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(work: Path) -> dict:
    try:
        return json.loads((work / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def _write_record(work: Path, record: dict) -> None:
    (work / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def prepare_copies(course: Path, work: Path) -> list[str]:
    """Copy every notebook of ``course`` that ``work`` does not hold yet; never touch an existing copy.

    Returns one line per notebook the student should know about: the copies made now, and the
    copies whose course notebook changed since they were made (kept; ``--fresh`` replaces one).
    """
    work.mkdir(parents=True, exist_ok=True)
    record, said, made = _record(work), [], []
    for source in sorted(course.glob("*.ipynb")):
        copy, digest = work / source.name, _digest(source)
        if not copy.exists():
            shutil.copyfile(source, copy)
            record[source.name] = digest
            made.append(source.stem)
        elif record.get(source.name) not in (None, digest):
            said.append(
                f"notebooks/{source.name} changed since your copy was made: `make lab FRESH={source.stem.split('_')[0]}` "
                f"gives you a fresh copy (yours is kept in {work.name}/{OLD}/)"
            )
    if made:
        said.insert(0, f"new copies in {work.name}/: {', '.join(made)}")
    _write_record(work, record)
    return said


def find_notebook(course: Path, name: str) -> Path:
    """The course notebook ``name`` names: "03", "03_zero_stages" or "03_zero_stages.ipynb"."""
    stem = name.removesuffix(".ipynb")
    paths = sorted(course.glob("*.ipynb"))
    found = [p for p in paths if p.stem == stem] or [p for p in paths if p.stem.split("_")[0] == stem]
    if len(found) != 1:
        raise SystemExit(
            f"no course notebook named {name!r}: choose one of {', '.join(p.stem.split('_')[0] for p in paths)}"
        )
    return found[0]


def fresh_copy(course: Path, work: Path, name: str, *, yes: bool = False, ask=input) -> str:
    """Replace the student's copy of one notebook with a fresh one from ``course``; the old copy moves to
    ``work/old/NAME-YYYYmmdd-HHMMSS.ipynb``. Asks first (``ask``) unless ``yes`` or the copy is already
    the course's; without a terminal to ask on, refuses (SystemExit) and says to add --yes."""
    source = find_notebook(course, name)
    copy = work / source.name
    work.mkdir(parents=True, exist_ok=True)
    record = _record(work)
    kept = None
    if copy.exists() and copy.read_bytes() != source.read_bytes():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(copy.stat().st_mtime))
        kept = work / OLD / f"{source.stem}-{stamp}.ipynb"
        if not yes:
            if not sys.stdin.isatty():
                raise SystemExit(
                    f"{work.name}/{source.name} holds your work: to replace it with a fresh copy, "
                    f"run `python tools/lab.py --fresh {name} --yes` (yours is kept in {work.name}/{OLD}/)"
                )
            answer = ask(
                f"Replace your {work.name}/{source.name} with a fresh copy of notebooks/{source.name}? "
                f"Yours is kept as {kept.relative_to(work.parent)} [y/N] "
            )
            if answer.strip().lower() not in ("y", "yes"):
                return f"kept your {work.name}/{source.name}"
        kept.parent.mkdir(exist_ok=True)
        shutil.move(copy, kept)
    shutil.copyfile(source, copy)
    record[source.name] = _digest(source)
    _write_record(work, record)
    return f"fresh copy of {source.name} in {work.name}/" + (
        f" (yours is kept as {kept.relative_to(work.parent)})" if kept else ""
    )


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the system picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_settings(state: Path) -> Path:
    """Write the course's lab settings under ``state``/settings, keeping any other setting a user saved there."""
    settings = state / "settings"
    for name, values in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            current = json.loads(path.read_text())
        except (OSError, ValueError):
            current = {}
        path.write_text(json.dumps({**current, **values}, indent=2) + "\n")
    return settings


def command(port: int, notebooks: Path) -> list[str]:
    """The server's command line: loopback only, this port or none, warnings only."""
    args = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        f"--ServerApp.root_dir={notebooks}",
        "--ServerApp.log_level=WARN",
        "--LabApp.log_level=WARN",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    return args + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's process group (the server and its kernels), politely first."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--state",
        type=Path,
        default=ROOT / "build" / "lab",
        help="the course lab's settings and workspaces (default build/lab/)",
    )
    parser.add_argument(
        "--work", type=Path, default=WORK, help="the student's copies, the folder the lab opens (default my-notebooks/)"
    )
    parser.add_argument(
        "--fresh", action="append", default=[], metavar="NN", help="replace your copy of notebook NN with a fresh one"
    )
    parser.add_argument("--yes", action="store_true", help="with --fresh: do not ask (your copy is still kept)")
    parser.add_argument(
        "--course", action="store_true", help="authors: open the course's notebooks/ itself (what git tracks)"
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the server to answer")
    args = parser.parse_args(argv)

    course = ROOT / "notebooks"
    if args.course:
        served, where = course, "the course's notebooks/ (tracked by git: you are editing the course)"
    else:
        served = args.work.resolve()
        for name in args.fresh:
            print(f"==> {fresh_copy(course, served, name, yes=args.yes)}", flush=True)
        for line in prepare_copies(course, served):
            print(f"==> {line}", flush=True)
        where = f"your copies in {served.name}/ (notebooks/ stays the course's)"

    port, token = free_port(), secrets.token_hex(24)
    env = dict(
        os.environ,
        JUPYTER_TOKEN=token,
        JUPYTERLAB_SETTINGS_DIR=str(write_settings(args.state)),
        JUPYTERLAB_WORKSPACES_DIR=str(args.state / "workspaces"),
    )
    env.pop("COURSE_HEADLESS", None)  # the lab is where the widgets are live
    # its own session: Ctrl-C reaches this script, which stops the server (JupyterLab's own Ctrl-C handler
    # would print its URL again and ask whether to shut down)
    proc = subprocess.Popen(command(port, served), env=env, start_new_session=True, cwd=served)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it the way Ctrl-C does
    url = f"http://127.0.0.1:{port}/lab?token={token}"
    try:
        deadline = time.monotonic() + args.timeout
        while not _answers(f"http://127.0.0.1:{port}/api/status?token={token}"):
            if proc.poll() is not None:
                print(
                    f"JupyterLab exited with status {proc.returncode} before answering (its messages are above)",
                    file=sys.stderr,
                )
                return 1
            if time.monotonic() > deadline:
                print(
                    f"JupyterLab did not answer on port {port} within {args.timeout:.0f} s; stopping it",
                    file=sys.stderr,
                )
                stop(proc)
                return 1
            time.sleep(0.25)
        print(f"==> JupyterLab on {where}: open {url}\n    (localhost only; Ctrl-C stops it)", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("\n==> stopping JupyterLab", flush=True)
        stop(proc)
        return 0


if __name__ == "__main__":
    sys.exit(main())
