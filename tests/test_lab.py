"""`make lab` (tools/lab.py): one URL with a free port and a token, printed once when the server answers;
no language-server noise; the news prompt off in the course's own settings folder; stopped cleanly.
The student works on copies in my-notebooks/: a whole JupyterLab session (its REST API and a kernel)
leaves `git status` clean and notebooks/ as it was; a copy is never overwritten without asking."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest
from conftest import ROOT, sigint_as_in_a_terminal

URL = re.compile(r"http://127\.0\.0\.1:(\d+)/lab\?token=([0-9a-f]{48})\b")


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.fixture(scope="module")
def lab_session(tmp_path_factory):
    """One `make lab` (tools/lab.py) in a copy of what git tracks, as a student and a teacher use it: opened by
    its printed URL, refused without its token, then a whole session (below), then Ctrl-C. Returns what was
    seen; the two tests below assert it (one server start serves both)."""
    tmp = tmp_path_factory.mktemp("lab")
    repo = _tracked_copy(tmp / "course")
    private = tmp / "jupyter"  # the server's runtime and config files: outside the repository
    state, work = private / "lab", repo / "my-notebooks"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "COURSE_"))}
    env.update(
        PYTHONPATH=str(repo),  # the kernel and its ranks import the copy's course_utils, not this checkout's
        JUPYTER_CONFIG_DIR=str(private / "config"),
        JUPYTER_RUNTIME_DIR=str(private / "runtime"),
        JUPYTER_DATA_DIR=str(private / "data"),
    )
    proc = subprocess.Popen(
        [sys.executable, "tools/lab.py", "--state", str(state), "--work", str(work)],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
    seen = {"repo": repo, "work": work, "state": state, "course": sorted((repo / "notebooks").glob("*.ipynb"))}
    try:
        assert found.wait(120), f"no URL printed within 120 s: {''.join(lines)[-2000:]}"
        seen["before"] = "".join(lines)
        match = URL.search(seen["before"])
        seen["port"], seen["token"] = int(match.group(1)), match.group(2)
        seen["page"] = _get(match.group(0))  # the printed URL opens the lab (localhost only)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{seen['port']}/api/contents", timeout=10)
            seen["without_token"] = 200
        except urllib.error.HTTPError as err:
            seen["without_token"] = err.code
        seen["news"] = _get(
            f"http://127.0.0.1:{seen['port']}/lab/api/settings/@jupyterlab/apputils-extension:notification"
            f"?token={seen['token']}"
        )
        seen["served"] = _get(f"http://127.0.0.1:{seen['port']}/api/contents?token={seen['token']}")
        seen["copies"] = {p.name for p in work.glob("*.ipynb")}
        _a_session(f"http://127.0.0.1:{seen['port']}", seen["token"], seen["course"])
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a teacher stops it
        try:
            seen["code"] = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        reader.join(10)
    seen["output"] = "".join(lines)
    with socket.socket() as sock:
        seen["port_open"] = sock.connect_ex(("127.0.0.1", seen["port"])) == 0
    # the processes of that lab still running: those that carry its token in their environment (the server and
    # its kernels did)
    seen["left"] = []
    for proc_dir in os.listdir("/proc"):
        try:
            if (
                proc_dir.isdigit()
                and f"JUPYTER_TOKEN={seen['token']}".encode() in open(f"/proc/{proc_dir}/environ", "rb").read()
            ):
                seen["left"].append(int(proc_dir))
        except OSError:
            continue
    return seen


def test_lab_prints_one_url_that_opens_and_stops_cleanly(lab_session):
    seen = lab_session
    status, page = seen["page"]
    assert status == 200 and "JupyterLab" in page
    assert seen["without_token"] == 403, "the lab answered without its token"
    # the news prompt is off in the settings the lab serves, and those live in the course's folder
    assert json.loads(seen["news"][1])["settings"]["fetchNews"] == "false"
    assert (
        seen["state"] / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    ).is_file()
    # served from the student's copies, made on first use
    served = {item["name"] for item in json.loads(seen["served"][1])["content"]}
    assert "01_memory_bill.ipynb" in served and served == seen["copies"]
    assert {p.name for p in seen["course"]} <= served  # one copy per course notebook
    assert "new copies in my-notebooks/" in seen["before"]
    output = seen["output"]
    assert seen["code"] == 0, output[-2000:]
    assert len(re.findall(r"https?://", output)) == 1, f"the URL is printed once, nothing else is: {output}"
    assert "Skipped non-installed server" not in output and "To access the server" not in output
    assert not seen["port_open"], "something still listens on the lab's port"
    assert not seen["left"], f"processes of the lab still running: {seen['left']}"


# ---------------------------------------------------------------------------------------------
# The student's copies
# ---------------------------------------------------------------------------------------------

sys.path.insert(0, str(ROOT))
from tools import lab  # noqa: E402


def _course(tmp_path):
    course = tmp_path / "notebooks"
    course.mkdir()
    for name in ("01_memory_bill", "05b_dress_rehearsal"):
        (course / f"{name}.ipynb").write_text(json.dumps({"cells": [], "name": name}) + "\n")
    return course, tmp_path / "my-notebooks"


def test_copies_are_made_once_and_never_overwritten(tmp_path):
    course, work = _course(tmp_path)
    said = lab.prepare_copies(course, work)
    assert said == ["new copies in my-notebooks/: 01_memory_bill, 05b_dress_rehearsal"]
    mine = work / "01_memory_bill.ipynb"
    mine.write_text('{"cells": ["my work"]}')
    assert lab.prepare_copies(course, work) == [] and mine.read_text() == '{"cells": ["my work"]}'
    # the course moves on (a git pull): the copy stays the student's, and the lab says how to get the new one
    (course / "01_memory_bill.ipynb").write_text('{"cells": ["new lesson"]}')
    said = lab.prepare_copies(course, work)
    assert said == [
        "notebooks/01_memory_bill.ipynb changed since your copy was made: `make lab FRESH=01` gives you a "
        "fresh copy (yours is kept in my-notebooks/old/)"
    ]
    assert mine.read_text() == '{"cells": ["my work"]}'


def test_a_fresh_copy_asks_and_keeps_the_old_one(tmp_path, monkeypatch):
    course, work = _course(tmp_path)
    lab.prepare_copies(course, work)
    mine = work / "05b_dress_rehearsal.ipynb"
    mine.write_text('{"cells": ["my work"]}')
    # no terminal to ask on: refused, with the flag that says yes
    with pytest.raises(SystemExit, match=r"--fresh 05b --yes"):
        lab.fresh_copy(course, work, "05b")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    questions = []
    said = lab.fresh_copy(course, work, "05b", ask=lambda q: questions.append(q) or "n")
    assert said == "kept your my-notebooks/05b_dress_rehearsal.ipynb" and mine.read_text() == '{"cells": ["my work"]}'
    assert "Replace your my-notebooks/05b_dress_rehearsal.ipynb" in questions[0]
    said = lab.fresh_copy(course, work, "05b_dress_rehearsal", ask=lambda q: "y")
    assert mine.read_bytes() == (course / "05b_dress_rehearsal.ipynb").read_bytes()
    kept = list((work / "old").glob("05b_dress_rehearsal-*.ipynb"))
    assert len(kept) == 1 and kept[0].read_text() == '{"cells": ["my work"]}' and "yours is kept as" in said
    # an untouched copy is simply replaced: nothing to ask, nothing to keep
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert lab.fresh_copy(course, work, "01") == "fresh copy of 01_memory_bill.ipynb in my-notebooks/"
    with pytest.raises(SystemExit, match="no course notebook named '07'"):
        lab.fresh_copy(course, work, "07")


def _tracked_copy(dest):
    """This checkout's files as they are now (tracked and not ignored; edits included) in a git repository
    of their own, so a test can run `make lab`'s tool in it and read `git status`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=course", "-c", "user.email=course@localhost", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the course"]):
        subprocess.run(git + args, cwd=dest, check=True, capture_output=True)
    return dest


class _Kernel:
    """A kernel of the lab, driven the way JupyterLab drives it: execute requests over the server's websocket."""

    def __init__(self, base: str, token: str, kernel_id: str):
        import websocket

        self.ws = websocket.create_connection(
            f"ws{base[4:]}/api/kernels/{kernel_id}/channels?token={token}", timeout=180
        )
        self.session = secrets.token_hex(8)

    def run(self, code: str) -> list:
        """Execute ``code``; its outputs in nbformat's shape. Fails on an error output."""
        msg_id = secrets.token_hex(8)
        header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "student", "session": self.session}
        self.ws.send(
            json.dumps(
                {
                    "header": {**header, "date": "", "version": "5.3"},
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                }
            )
        )
        outputs = []
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id or msg.get("channel") != "iopub":
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                return outputs
            if kind == "stream":
                outputs.append({"output_type": "stream", "name": content["name"], "text": content["text"]})
            elif kind in ("display_data", "execute_result"):
                out = {"output_type": kind, "data": content["data"], "metadata": content.get("metadata", {})}
                if kind == "execute_result":
                    out["execution_count"] = content["execution_count"]
                outputs.append(out)
            elif kind == "error":
                raise AssertionError(f"the cell raised {content['ename']}: {content['evalue']}\n{code[:300]}")

    def close(self):
        self.ws.close()


def _a_session(base: str, token: str, course: list) -> None:
    """What a student does in the lab (see the test below), through its REST API and a kernel."""

    def api(method, path, body=None):
        request = urllib.request.Request(
            f"{base}/api/{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read() or b"null")

    listed = {item["name"] for item in api("GET", "contents")["content"]}
    assert {p.name for p in course} <= listed  # the student's copies, one per course notebook
    session = api(
        "POST", "sessions", {"path": course[1].name, "type": "notebook", "name": "", "kernel": {"name": "python3"}}
    )
    kernel = _Kernel(base, token, session["kernel"]["id"])
    try:
        kernel.run("import os\nopen('my_scratch.txt', 'w').write(os.getcwd())")
        for path in course:
            nb = api("GET", f"contents/{path.name}")["content"]  # opened, as the lab opens it
            for cell in [c for c in nb["cells"] if c["cell_type"] == "code"][:3]:
                cell["outputs"] = kernel.run(cell["source"])
                cell["execution_count"] = 1
            if path.name.startswith("03"):
                exercise = {
                    "cell_type": "code",
                    "id": "my-exercise",
                    "metadata": {},
                    "execution_count": 2,
                    "source": "from course_utils.exercises import check, load_solution\n"
                    "sharded_step = load_solution('03', 'sharded_step', quiet=True)\n"
                    "check('03', 'sharded_step', sharded_step)",
                }
                exercise["outputs"] = kernel.run(exercise["source"])
                shown = "".join(json.dumps(o) for o in exercise["outputs"])
                assert "PASSED" in shown, shown[:500]
                nb["cells"].append(exercise)
            api("PUT", f"contents/{path.name}", {"type": "notebook", "format": "json", "content": nb})
            api("POST", f"contents/{path.name}/checkpoints")
        api("POST", "contents", {"type": "notebook"})  # File > New > Notebook: an Untitled.ipynb
    finally:
        kernel.close()
        api("DELETE", f"sessions/{session['id']}")


def test_a_lab_session_leaves_the_course_untouched(lab_session):
    """A student opens every notebook of their lab, runs it, does an exercise, saves and checkpoints:
    afterwards `git status` is empty and notebooks/ holds exactly what git tracks.

    What proves it without running every cell: every write a lab session makes comes from the server
    (saves, checkpoints, new files: all under its root, the copies' folder) or from a kernel (whose working
    folder is that root; the course's own code writes only to temporary folders). So the session saves
    every notebook with outputs, creates a checkpoint and a new notebook, runs the first cells of every
    notebook (parameters, set-up, imports) in the kernel and a cell that writes a file by a relative path,
    and checks exercise 03.sharded_step on two real ranks, a launch included.
    """
    repo, work = lab_session["repo"], lab_session["work"]
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    assert status.stdout == "", f"the session changed what git tracks:\n{status.stdout}"
    # notebooks/ (what `git pull` updates and make test executes) holds exactly what git tracks: no outputs,
    # no .ipynb_checkpoints, nothing new
    tracked = set(
        subprocess.run(["git", "ls-files", "notebooks"], cwd=repo, capture_output=True, text=True).stdout.split()
    )
    present = {str(p.relative_to(repo)) for p in (repo / "notebooks").rglob("*")}
    assert present == tracked
    # and everything the student did is in their folder
    saved = json.loads((work / "03_zero_stages.ipynb").read_text())
    assert saved["cells"][-1]["id"] == "my-exercise" and "PASSED" in json.dumps(saved["cells"][-1]["outputs"])
    assert (work / ".ipynb_checkpoints" / "03_zero_stages-checkpoint.ipynb").is_file()
    assert (work / "Untitled.ipynb").is_file() and (work / "my_scratch.txt").read_text() == str(work)
