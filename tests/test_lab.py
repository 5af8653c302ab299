"""`make lab` (tools/lab.py): one URL with a free port and a token, printed once when the server answers;
no language-server noise; the news prompt off in the course's own settings folder; stopped cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

from conftest import ROOT, sigint_as_in_a_terminal

URL = re.compile(r"http://127\.0\.0\.1:(\d+)/lab\?token=([0-9a-f]{48})\b")


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_lab_prints_one_url_that_opens_and_stops_cleanly(tmp_path):
    state = tmp_path / "lab"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "lab.py"), "--state", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )
    lines, found = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if URL.search(line):
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert found.wait(120), f"no URL printed within 120 s: {''.join(lines)[-2000:]}"
        before = "".join(lines)
        match = URL.search(before)
        port, token = int(match.group(1)), match.group(2)
        status, page = _get(match.group(0))  # the printed URL opens the lab (localhost only)
        assert status == 200 and "JupyterLab" in page
        # the token is required: without it the API refuses
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=10)
            raise AssertionError("the lab answered without its token")
        except urllib.error.HTTPError as err:
            assert err.code == 403
        # the news prompt is off in the settings the lab serves, and those live in the course's folder
        status, body = _get(
            f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}"
        )
        assert json.loads(body)["settings"]["fetchNews"] == "false"
        assert (
            state / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        ).is_file()
        # served from notebooks/
        status, body = _get(f"http://127.0.0.1:{port}/api/contents?token={token}")
        assert "01_memory_bill.ipynb" in {item["name"] for item in json.loads(body)["content"]}
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a teacher stops it
        try:
            code = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        reader.join(10)
    output = "".join(lines)
    assert code == 0, output[-2000:]
    assert len(re.findall(r"https?://", output)) == 1, f"the URL is printed once, nothing else is: {output}"
    assert "Skipped non-installed server" not in output and "To access the server" not in output
    with socket.socket() as s:  # nothing listens on the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    # no process of that lab is left: none carries its token in its environment (the server and its kernels did)
    left = []
    for proc_dir in os.listdir("/proc"):
        try:
            if (
                proc_dir.isdigit()
                and f"JUPYTER_TOKEN={token}".encode() in open(f"/proc/{proc_dir}/environ", "rb").read()
            ):
                left.append(int(proc_dir))
        except OSError:
            continue
    assert not left, f"processes of the lab still running: {left}"
