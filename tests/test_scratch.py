"""A temporary folder of the course goes with the process that made it, even a killed one (issue 34)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course_utils import scratch

ROOT = Path(__file__).resolve().parent.parent
MAKE_ONE = "from course_utils import scratch; p = scratch.folder('nb06-'); (p / 'ckpt').write_bytes(b'x'); print(p)"


def _python(code: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, **kw)


def test_a_folder_goes_when_its_process_exits():
    proc = _python(MAKE_ONE)
    path = Path(proc.communicate(timeout=60)[0].strip())
    assert path.parent.name.startswith(scratch.PREFIX) and path.name.startswith("nb06-")
    assert not path.parent.exists(), "the process exited and left its scratch root"


def test_a_killed_process_s_folder_is_swept_by_the_next_and_a_live_one_is_kept():
    proc = _python(MAKE_ONE + "; import sys; sys.stdout.flush(); import time; time.sleep(600)")
    path = Path(proc.stdout.readline().strip())
    mine = scratch.folder("mine-")  # this process's own root: alive, so never swept
    assert path.exists()
    assert scratch.sweep() == [], "a live process's folder was swept"
    proc.kill()  # SIGKILL: no atexit runs
    proc.wait()
    assert path.exists(), "nothing removed it yet (no agent server was running)"
    assert scratch.sweep() == [path.parent.name]
    assert not path.parent.exists() and mine.exists()


def test_a_reused_pid_does_not_keep_a_dead_process_s_folder(tmp_path):
    # pid 1 is alive, but it did not start at this made-up time: the folder is a dead process's
    stale = Path(tempfile.mkdtemp(prefix=f"{scratch.PREFIX}1-12345-", dir=tmp_path))
    gone = tmp_path / f"{scratch.PREFIX}999999999-0-x"  # a pid that cannot exist
    gone.mkdir()
    other = tmp_path / "course-run-keep"
    other.mkdir()
    assert sorted(scratch.sweep(str(tmp_path))) == sorted([stale.name, gone.name])
    assert other.exists()


def test_the_agent_server_removes_a_killed_kernel_s_folders():
    """Jupyter and nbval stop a kernel with SIGKILL: its agent server sees its stdin close and cleans up."""
    code = (
        "from course_utils import scratch, examples\n"
        "from course_utils.launch import launch\n"
        "launch(examples.all_reduce_demo, nproc=2, kwargs={'n': 1}, echo=False)\n"  # the server is running
        + MAKE_ONE
        + "\nimport sys, time; sys.stdout.flush(); time.sleep(600)\n"
    )
    proc = _python(code)
    path = Path(proc.stdout.readline().strip())
    assert path.exists()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while path.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.parent.exists(), "the killed kernel's scratch folder outlived it"
