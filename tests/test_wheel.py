"""Hints and solutions wherever a notebook runs (issue 28): from the built wheel, in a fresh virtual environment.

A Colab runtime or a student's laptop has the installed package, not a clone: ``load_solution``, which every
"Stuck?" cell suggests, must work from the wheel alone. The wheel is built from a copy of the sources (the
repository's own build/ stays untouched), installed without dependencies into a new virtual environment, which
borrows torch and the rest from this one by a path line (so nothing is downloaded and this checkout's editable
course_utils is not seen).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import ROOT

SCRIPT = r"""
import contextlib, io, sys
import course_utils
from course_utils.exercises import check, core, load_solution, show_hint

assert course_utils.__file__.startswith(sys.prefix), course_utils.__file__  # the wheel, not the clone
for ex in core.exercises():
    assert callable(core.solution(ex.notebook, ex.name)), ex.key
out = io.StringIO()
with contextlib.redirect_stdout(out):
    fn = load_solution("01", "model_state_bill")
assert "def model_state_bill" in out.getvalue()
assert check("01", "model_state_bill", fn).passed
with contextlib.redirect_stdout(out := io.StringIO()):
    show_hint("02", "averaging_hook", 1)
    show_hint("02", "averaging_hook", 9)
lines = out.getvalue().strip().splitlines()
assert lines[0].startswith("Hint 1 of 3") and len(lines) == 2 and "there is no hint 9" in lines[1], lines
print("ok")
"""


def test_solutions_and_hints_work_from_the_wheel(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "course_utils", src / "course_utils", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run = dict(check=True, capture_output=True, text=True)
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)], **run)
    [wheel] = (tmp_path / "dist").glob("course_utils-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], **run)
    fresh = Path(
        subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], **run).stdout.strip()
    )
    (fresh / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch & co., no .pth files of ours
    out = subprocess.run([python, "-c", SCRIPT], cwd=tmp_path, **dict(run, check=False))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
