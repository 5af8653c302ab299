"""The launcher's stress test, short form: concurrent callers beside a CPU hog, no stall (issue 14).

`make stress` runs the long form (2 x 300 launches); benchmarks/stress.md has its results.
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_short_stress_run_has_no_stall(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "stress_launch.py"),
            "--launches",
            "4",
            "--callers",
            "2",
            "--hogs",
            "1",
            "--out",
            str(tmp_path),
            "--timeout-s",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["launches"] == 8
    assert summary["stall_timeout"] == 0 and summary["other_error"] == 0, sorted(p.name for p in tmp_path.iterdir())
    assert summary["ok"] + summary["agent_not_collecting"] == 8
    assert proc.returncode == 0
