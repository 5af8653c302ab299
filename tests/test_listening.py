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


def test_the_sampler_sees_a_listener_while_another_descriptor_closes(monkeypatch):
    """A descriptor that closes between /proc's listing and its reading costs that descriptor, not the
    process: a listener on every interface is still seen (it used to hide the whole process that sample)."""
    import os
    import socket

    import listening

    real_readlink = os.readlink
    with socket.socket() as listener, open(os.devnull) as closing:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        gone = f"/proc/{os.getpid()}/fd/{closing.fileno()}"

        def readlink(path, *args, **kwargs):
            if str(path) == gone:
                raise FileNotFoundError(path)  # as if it closed after os.listdir listed it
            return real_readlink(path, *args, **kwargs)

        monkeypatch.setattr(listening.os, "readlink", readlink)
        seen = listening.sockets_beyond_loopback([os.getpid()])
        port = listener.getsockname()[1]
    assert any(table == "tcp" and address.endswith(f":{port}") for _, table, address in seen), seen
