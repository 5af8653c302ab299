"""`make lab`: JupyterLab on the notebooks, and one line that says where to open it.

    python tools/lab.py [--state DIR]

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
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The lab's settings for the course: written on every start, so an edit here is what every student gets.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


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
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks", help="the folder the lab opens")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the server to answer")
    args = parser.parse_args(argv)

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
    proc = subprocess.Popen(command(port, args.notebooks.resolve()), env=env, start_new_session=True)
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
        print(f"==> JupyterLab on the notebooks: open {url}\n    (localhost only; Ctrl-C stops it)", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        print("\n==> stopping JupyterLab", flush=True)
        stop(proc)
        return 0


if __name__ == "__main__":
    sys.exit(main())
