"""Nothing the course starts listens beyond this machine (issue 34).

Every command that starts processes is run with a marker in its environment while /proc is sampled
(``listening.watch``): no process of it may hold a TCP socket listening, or a UDP socket bound, on an
address other than loopback in this machine's own network namespace. Here: ``make lab`` with a kernel.
The other commands are watched during the runs their own tests make anyway (one run, two proofs):
``launch`` in tests/test_launch.py (the interrupted first launch and the two after it), ``train`` and the
README's single-machine torchrun line in tests/test_train.py, ``cluster`` (root) in tests/test_cluster.py
(the short-form HSDP run), and ``ft`` in tests/test_ft.py (the run that heals a group killed in its
all-reduce: every process this test's process started, sampled the same way).

torchrun itself is the one exception the course cannot remove: torch 2.13's ``TCPStore`` takes no bind
address and listens on every interface, so the README's torchrun lines leave torchrun's own rendezvous
stores listening there (the README says so where it gives the lines); tests/test_train.py holds them to
exactly that, and checks that the workers' gloo sockets are on loopback. (``launch`` avoids it by handing
its stores a socket already bound to 127.0.0.1.)
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request

from conftest import ROOT
from listening import watch

PY = sys.executable


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
