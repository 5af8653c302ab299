"""Nothing the course starts listens beyond this machine (issue 34).

Every command that starts processes is run with a marker in its environment while /proc is sampled
(``listening.watch``): no process of it may hold a TCP socket listening, or a UDP socket bound, on an
address other than loopback in this machine's own network namespace. One run each: ``launch``,
``train``, ``cluster`` (root), the README's single-machine torchrun line, ``make lab`` with a kernel,
and ``ft``.

torchrun itself is the one exception the course cannot remove: torch 2.13's ``TCPStore`` takes no bind
address and listens on every interface, so the README's torchrun lines leave torchrun's own rendezvous
stores listening there (the README says so where it gives the lines); the test holds them to exactly
that, and checks that the workers' gloo sockets are on loopback. (``launch`` avoids it by handing its
stores a socket already bound to 127.0.0.1.)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT
from listening import watch

PY = sys.executable


def _env() -> dict:
    venv_bin = str(Path(PY).parent)  # `torchrun` as the README says it: the venv's
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}


def _assert_none(seen: set, proc) -> None:
    assert proc.returncode == 0, proc.output[-3000:]
    assert seen == set(), f"listening beyond loopback: {sorted(seen)}"


def test_launch_listens_on_loopback_only():
    code = (
        "from course_utils import examples; from course_utils.launch import launch; "
        "print(dict(launch(examples.all_reduce_demo, nproc=2, echo=False)))"
    )
    _assert_none(*watch([PY, "-c", code], cwd=ROOT))


def test_train_listens_on_loopback_only():
    _assert_none(
        *watch([PY, "-m", "course_utils", "train", "--strategy", "ddp", "--nproc", "2", "--steps", "2"], cwd=ROOT)
    )


def test_cluster_listens_only_inside_its_namespaces():
    from course_utils.namespaces import missing

    why = missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the cluster, but {why}")
        pytest.skip(why)
    argv = [PY, "-m", "course_utils", "cluster", "--nodes", "2", "--nproc-per-node", "1", "--strategy", "ddp"]
    _assert_none(*watch([*argv, "--steps", "2", "--json"], cwd=ROOT))


def _readme_single_machine_line() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    return next(ln for ln in lines if ln.startswith("torchrun --standalone") and not ln.endswith("\\"))


def test_the_readme_torchrun_line_leaves_only_torchrun_s_own_stores_beyond_loopback(tmp_path):
    seen, proc = watch(_readme_single_machine_line(), shell=True, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.output[-3000:]
    beyond = sorted(seen)
    # what remains: torchrun's TCPStore servers (no bind address in torch 2.13), in torchrun's process
    assert all("torchrun" in command and table == "tcp6" for command, table, _ in beyond), beyond
    assert len(beyond) <= 2, beyond


def test_make_lab_and_its_kernels_listen_on_loopback_only(tmp_path):
    started = {}

    def with_a_kernel(proc) -> bool:
        found = re.search(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)", proc.output_path.read_text(errors="replace"))
        if not found:
            return False
        if "kernel" not in started:  # start a kernel as opening a notebook would, then watch it a while
            base, token = found.groups()
            request = urllib.request.Request(f"{base}/api/kernels?token={token}", data=b"{}", method="POST")
            started["kernel"] = json.loads(urllib.request.urlopen(request, timeout=30).read())["id"]
            started["at"] = time.monotonic()
        return time.monotonic() - started["at"] > 8.0

    seen, proc = watch(
        [PY, "tools/lab.py", "--state", str(tmp_path / "lab")], cwd=ROOT, until=with_a_kernel, timeout_s=180
    )
    assert "kernel" in started, proc.output[-3000:]
    assert seen == set(), f"listening beyond loopback: {sorted(seen)}"


def test_ft_listens_on_loopback_only():
    """torchft's lighthouse, its managers and the replica groups' stores (the ft06 branch binds them)."""
    pytest.importorskip("torchft")
    argv = [PY, "-m", "course_utils", "ft", "--replicas", "2", "--steps", "4", "--json"]
    _assert_none(*watch(argv, cwd=ROOT, timeout_s=240))
