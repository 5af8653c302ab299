"""The Colab path: badges and set-up cells agree with the package metadata (pyproject.toml), the install
is pinned, and a failed install stops the notebook with one sentence (tools/colab.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT))
from tools import colab  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_badges_and_setup_cells_agree_with_the_metadata():
    meta = colab.metadata()
    found = [line for p in NOTEBOOKS for line in colab.problems(p, meta)]
    assert not found, "; ".join(found) + ": run `python tools/colab.py sync`"
    # the same, read independently of the tool: one URL and one release, as pyproject.toml says
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    url, ref = data["project"]["urls"]["Repository"], data["tool"]["course"]["colab"]["ref"]
    owner_repo = url.removeprefix("https://github.com/")
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        assert f"colab.research.google.com/github/{owner_repo}/blob/{ref}/notebooks/{path.name})" in cells[0]["source"]
        setup = [c for c in cells if c["cell_type"] == "code"][1]["source"]
        extras = json.loads(path.read_text())["metadata"].get("course", {}).get("colab_extras", [])
        package = "course-utils" + (f"[{','.join(extras)}]" if extras else "")  # only the extras it declares
        assert f'"{package} @ git+{url}@{ref}"' in setup, path.name
        assert "check=True" not in setup


def test_check_command_passes_here():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "colab.py"), "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _pyproject(tmp_path, url, ref):
    path = tmp_path / "pyproject.toml"
    path.write_text(
        f'[project]\nname = "x"\n[project.urls]\nRepository = "{url}"\n[tool.course.colab]\nref = "{ref}"\n'
    )
    return path


@pytest.mark.parametrize(
    "url, ref, says",
    [
        ("https://gitlab.com/a/b", "v1", "not a GitHub repository URL"),
        ("https://github.com/a/b", "main", "must be a release tag or a commit"),
        ("https://github.com/a/b", "", "must be a release tag or a commit"),
    ],
)
def test_metadata_refuses_what_colab_cannot_pin(tmp_path, url, ref, says):
    with pytest.raises(SystemExit, match=says):
        colab.metadata(_pyproject(tmp_path, url, ref))


def test_sync_rewrites_a_moved_repository_and_only_the_colab_parts(tmp_path):
    source = ROOT / "notebooks" / "01_memory_bill.ipynb"
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    meta = colab.metadata(_pyproject(tmp_path, "https://github.com/teacher/zero-course.git", "4f2c1ab"))
    assert colab.problems(copy, meta)  # the committed notebook points elsewhere
    assert colab.sync(copy, meta) and not colab.sync(copy, meta)  # the second sync has nothing to do
    assert colab.problems(copy, meta) == []
    before, after = json.loads(source.read_text())["cells"], json.loads(copy.read_text())["cells"]
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    setup_index = [i for i, c in enumerate(before) if c["cell_type"] == "code"][1]
    assert changed == [0, setup_index] and len(before) == len(after)
    assert "github/teacher/zero-course/blob/4f2c1ab/notebooks/01_memory_bill.ipynb" in after[0]["source"]
    assert "git+https://github.com/teacher/zero-course@4f2c1ab" in after[setup_index]["source"]


def _run_setup(monkeypatch, returncode):
    calls = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, returncode)
    )
    exec(compile(colab.setup_source(colab.metadata()), "setup-cell", "exec"), {})
    return calls


def test_setup_cell_on_colab_installs_the_pinned_package(monkeypatch):
    meta = colab.metadata()
    calls = _run_setup(monkeypatch, 0)
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", f"course-utils @ git+{meta['url']}@{meta['ref']}"]]


def test_setup_cell_failure_is_one_sentence_that_says_what_to_do(monkeypatch):
    with pytest.raises(SystemExit) as failed:
        _run_setup(monkeypatch, 1)
    message = str(failed.value)
    assert "\n" not in message and message.count(". ") == 0 and message.endswith(".")
    assert "Could not install course-utils @ git+" in message and "make lab" in message


def test_setup_cell_does_nothing_outside_colab(monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the set-up cell ran pip outside Colab"))
    exec(compile(colab.setup_source(colab.metadata()), "setup-cell", "exec"), {})
