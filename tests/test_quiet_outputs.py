"""tools/quiet_outputs.py: what a student must not read past (a warning, a temporary path, a launcher frame) is
found in a cell's outputs, and the plugin fails the cell nbval just ran (the notebook phase of make test)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import nbformat
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from tools import quiet_outputs as quiet  # noqa: E402

TMP = tempfile.gettempdir()


def _stream(text, name="stderr"):
    return {"output_type": "stream", "name": name, "text": text}


def test_what_counts_as_noise():
    # what an exercise check printed on torch 2.13 before it used the new names: from both ranks
    warning = (
        "[rank0]:/x/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`"
        " instead.\n[rank0]:  return func(*args, **kwargs)\n"
    )
    assert quiet.noise([_stream(warning)]) == [f"warning: {warning.splitlines()[0][:160]}"]
    assert quiet.noise([_stream("[W1201 16:05:56.123456 ProcessGroupGloo.cpp:12] Warning: slow\n")])
    assert quiet.noise([_stream("/x/a.py:3: UserWarning: hm\n  warnings.warn('hm')\n")]) == [
        "warning: /x/a.py:3: UserWarning: hm",
        "warning: warnings.warn('hm')",
    ]
    assert quiet.noise([_stream(f"logs in {TMP}/course-run-b32m289v/logs\n", "stdout")]) == [
        f"temporary path: {TMP}/course-run-b32m289v/logs"
    ]
    # the launcher's closing pointer to the logs, below the answer, is where to look next; the same pointer
    # above anything else is noise again
    # a frame of the course's own code is the course's, wherever the checkout lives (a clone under /tmp too)
    assert quiet.noise([_stream(f'  File "{quiet.COURSE_ROOT}/course_utils/examples.py", line 3, in f\n')]) == []
    pointer = f"(every rank's output and full traceback: {TMP}/course-run-b32m289v/logs)"
    assert quiet.noise([_stream(f"WorkerFailed: rank 1 raised ValueError\n{pointer}\n", "stdout")]) == []
    assert quiet.noise([_stream(f"{pointer}\nthe answer: 42\n", "stdout")]) == [
        f"temporary path: {TMP}/course-run-b32m289v/logs"
    ]
    # a worker's traceback as IPython shows it (colours and all): the plumbing frames are named
    error = {
        "output_type": "error",
        "ename": "ChildFailedError",
        "evalue": "rank 1 failed",
        "traceback": [
            "\x1b[0;31m---------\x1b[0m",
            "File \x1b[0;32m/x/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/"
            "__init__.py:357\x1b[0m, in \x1b[0;36mrecord.<locals>.wrapper\x1b[0;34m(*args, **kwargs)\x1b[0m",
            'File "/x/course_utils/_agent.py", line 120, in call',
            "File \x1b[0;32m/x/my-notebooks/03.py:4\x1b[0m, in \x1b[0;36msharded_step\x1b[0m",
            'File "/x/course_utils/zero.py", line 139, in gather',
        ],
    }
    assert quiet.noise([error]) == [
        "launcher frame: /x/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/"
        "__init__.py",
        "launcher frame: /x/course_utils/_agent.py",
    ]
    # what is not noise: answers, a warning named in prose without its colon, the course's own frames,
    # and the live charts (their script and data)
    from course_utils import widgets

    clean = [
        _stream("[PASSED] exercise 03.sharded_step: matches the course's reference on 2 real ranks\n", "stdout"),
        _stream("torch 2.13 deprecates the old names with a FutureWarning, so the course uses the new ones\n"),
        {"output_type": "display_data", "data": widgets.memory_chart()._repr_mimebundle_()[0]},  # headless
    ]
    assert quiet.noise(clean) == []
    # an empty text output is drawn as a blank box above the answer (the launcher's progress line, cleared);
    # an empty bundle, what the launcher leaves now, draws nothing
    blank = {"output_type": "display_data", "data": {"text/plain": ""}, "metadata": {}}
    assert quiet.noise([blank]) == ["empty display: ['text/plain'] with nothing to read (a cleared progress line?)"]
    assert quiet.noise([{"output_type": "display_data", "data": {}, "metadata": {}}]) == []


def _notebook(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = []
    for i, (source, tags) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source)
        cell["id"] = f"q-{i}"
        cell.metadata["tags"] = tags
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def test_the_plugin_fails_the_cells_that_show_noise(tmp_path):
    """One kernel, four cells run by nbval with the plugin: the warning and the temporary path fail their
    cells; the clean cell and the cell tagged ``shows-noise`` pass. No cell runs twice."""
    path = _notebook(
        tmp_path / "noisy.ipynb",
        [
            ("print('the answer: 42')", []),
            ("import warnings\nwarnings.warn('old name', FutureWarning)", []),
            # a real temporary path, removed before it is printed: the test leaves no folder behind
            ("import os, tempfile\np = tempfile.mkdtemp(prefix='course-run-')\nos.rmdir(p)\nprint(p)", []),
            ("import warnings\nwarnings.warn('what this warning says', UserWarning)", [quiet.ALLOW_TAG]),
        ],
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--nbval-lax",
            "-p",
            "tools.quiet_outputs",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-q",
            "-rf",
            "--rootdir",
            str(tmp_path),
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    failed = sorted(line.split("::")[1].split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED"))
    assert failed == ["Cell 1", "Cell 2"], out[-3000:]
    assert "warning: " in out and "FutureWarning: old name" in out and f"temporary path: {TMP}/course-run-" in out


def test_the_command_reads_executed_notebooks(tmp_path):
    path = _notebook(tmp_path / "executed.ipynb", [("x", []), ("y", [quiet.ALLOW_TAG])])
    nb = json.loads(path.read_text())
    nb["cells"][0]["outputs"] = [_stream(f"{TMP}/course-run-abc/logs\n", "stdout")]
    nb["cells"][1]["outputs"] = [_stream(f"{TMP}/course-run-abc/logs\n", "stdout")]
    path.write_text(json.dumps(nb))
    assert quiet.notebook_noise(path) == [f"cell 0 (q-0): temporary path: {TMP}/course-run-abc/logs"]
    done = subprocess.run(
        [sys.executable, "-m", "tools.quiet_outputs", str(path)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 1 and "executed.ipynb: cell 0 (q-0): temporary path" in done.stdout
