"""The build's kernels run over IPC: no TCP port, no 'running over TCP without encryption' warning (issue 14)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_a_notebook_runs_in_an_ipc_kernel_without_the_tcp_warning(tmp_path):
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "a",
                "metadata": {},
                "outputs": [],
                "source": "print('ok')",
            }
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "in.ipynb").write_text(json.dumps(nb))
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import papermill\n"
        "from tools.build_course import IPC_KERNEL_MANAGER as K\n"
        "km = K(kernel_name='python3'); assert km.transport == 'ipc', km.transport\n"
        f"papermill.execute_notebook({str(tmp_path / 'in.ipynb')!r}, {str(tmp_path / 'out.ipynb')!r}, "
        "kernel_name='python3', progress_bar=False, kernel_manager_class=K)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "without encryption" not in proc.stdout + proc.stderr
    out = json.loads((tmp_path / "out.ipynb").read_text())
    assert out["cells"][0]["outputs"][0]["text"] in ("ok\n", ["ok\n"])
