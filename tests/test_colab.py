"""The Colab path: badges and set-up cells agree with the package metadata (pyproject.toml), the install
is pinned, and a failed install stops the notebook with one sentence (tools/colab.py). The built wheel, installed
by the set-up cell in a fresh virtual environment, runs the notebooks' first cells, two ranks, and the exercises'
solutions, checks and hints (a Colab runtime or a laptop has the installed package, not a clone)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# The oldest torch pyproject.toml allows: the names torch 2.13 introduced, hidden
# ---------------------------------------------------------------------------------------------

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


def test_renamed_collectives_fall_back_to_the_old_names(monkeypatch):
    import torch.distributed as dist

    from course_utils import compat

    assert compat.all_gather_single is dist.all_gather_single  # torch 2.13: the names that do not warn
    assert compat.reduce_scatter_single is dist.reduce_scatter_single
    assert compat.provide_renamed_collectives() == []  # nothing to add
    for name in NEW_NAMES:  # as on torch < 2.13
        monkeypatch.delattr(dist, name)
    assert compat.all_gather_single is dist.all_gather_into_tensor
    assert compat.reduce_scatter_single is dist.reduce_scatter_tensor
    assert compat.provide_renamed_collectives() == list(NEW_NAMES)
    assert dist.all_gather_single is dist.all_gather_into_tensor and compat.provide_renamed_collectives() == []
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "all_gather_into_tensor")  # as on torch < 1.13: one sentence, the fix in it
    with pytest.raises(Exception, match="install torch >= 1.13"):
        compat.newest_collective("all_gather_single", "all_gather_into_tensor")


HIDE = """
# Loaded by every Python process of the test (PYTHONPATH): torch as it was before 2.13, without its new names.
import torch.distributed as dist
for name in {names!r}:
    delattr(dist, name)
"""

RUN_ON_OLD_NAMES = """
import torch.distributed as dist
from course_utils.exercises import core
from course_utils.launch import launch
from course_utils.exercises.solutions import nb03, nb04

def names_on_this_rank():
    return hasattr(dist, "all_gather_single"), hasattr(dist, "all_gather_into_tensor")

print("names", sorted(launch(names_on_this_rank, nproc=2, progress=False).values()))
pairs = [(core.get("03", "sharded_step"), nb03.sharded_step), (core.get("03", "sharded_optimizer"), nb03.sharded_optimizer),
         (core.get("04", "unshard"), nb04.unshard), (core.get("04", "clip_sharded"), nb04.clip_sharded)]
for outcome in core.check_many(pairs):
    print(outcome)
"""


def test_the_course_runs_where_torch_lacks_the_new_names(tmp_path):
    """Every process (this one and each rank) starts with torch.distributed.all_gather_single and
    reduce_scatter_single removed; the solutions, written with those names as the hints teach them, and
    per_param's own collectives (exercise 04.clip_sharded shards with it) still pass on two real ranks."""
    (tmp_path / "sitecustomize.py").write_text(HIDE.format(names=NEW_NAMES))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), COURSE_HEADLESS="1")
    # torch 2.13's old names warn where an older torch's do not: not what this test is about
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    done = subprocess.run(
        [sys.executable, "-c", RUN_ON_OLD_NAMES], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [line for line in done.stdout.splitlines() if " exercise 0" in line]
    assert len(outcomes) == 4 and all(o.startswith("[PASSED]") for o in outcomes), done.stdout + done.stderr[-2000:]
    assert "names [(False, True), (False, True)]" in done.stdout, "the ranks did not start without the new names"


# ---------------------------------------------------------------------------------------------
# The set-up cell in a fresh virtual environment, from the built wheel
# ---------------------------------------------------------------------------------------------

#: What the fresh environment runs: the set-up cell as Colab runs it (google.colab importable), then the first
#: cells of every notebook (parameters, set-up, imports), a live chart and two real ranks, all from the wheel.
ON_COLAB = """
import json, sys, types
sys.modules["google.colab"] = types.ModuleType("google.colab")  # what the set-up cell asks
cells = json.load(open(sys.argv[1]))
exec(compile(cells["setup"], "setup-cell", "exec"), {})
import course_utils
print("installed", course_utils.__file__)
exec(compile(cells["setup_ft"], "setup-cell-06", "exec"), {})  # notebook 06 asks for the ft extra too
for name, sources in cells["heads"].items():
    namespace = {}
    for source in sources:
        exec(compile(source, name, "exec"), namespace)
from course_utils import widgets
bundle = widgets.memory_chart()._repr_mimebundle_()
print("chart", "CourseInstant.mount(" in bundle[0]["text/html"])
from course_utils.examples import three_collectives
from course_utils.launch import launch
print("ranks", json.dumps(launch(three_collectives, nproc=2, progress=False)[1]["reduce_scatter"]))

# Hints and solutions from the wheel alone (issue 28): what every "Stuck?" cell suggests, where there is no clone.
import contextlib, io
from course_utils.exercises import check, core, load_solution, show_hint

for ex in core.exercises():
    assert callable(core.solution(ex.notebook, ex.name)), ex.key
with contextlib.redirect_stdout(out := io.StringIO()):
    fn = load_solution("01", "smallest_nd")
assert "def smallest_nd" in out.getvalue()
assert check("01", "smallest_nd", fn).passed
with contextlib.redirect_stdout(out := io.StringIO()):
    show_hint("02", "averaging_hook", 1)
    show_hint("02", "averaging_hook", 9)
lines = out.getvalue().strip().splitlines()
assert lines[0].startswith("Hint 1 of 3") and len(lines) == 2 and "there is no hint 9" in lines[1], lines
print("solutions and hints from", core.__file__)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The course's wheel, built from this checkout as `pip wheel` builds it (offline: setuptools comes with torch)."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return next(out.glob("course_utils-*.whl"))


def test_the_wheel_holds_the_whole_package(wheel):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "course_utils").rglob("*") if p.suffix in (".py", ".js")}
    assert package - names == set(), "files the notebooks import are missing from the wheel"
    assert "course_utils/instant.js" in names  # package data: the live charts' renderer


def _colab_stack(dest, site):
    """Colab's preinstalled stack (pip, torch, numpy, matplotlib, ipywidgets, ...): this environment's packages
    without course_utils, as links in one folder that a .pth file puts on the fresh environment's path."""
    dest.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("course_utils", "__editable__", "uv")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


def test_setup_cell_installs_the_wheel_in_a_fresh_venv(tmp_path, wheel):
    """The set-up cell run as on Colab, in a fresh virtual environment that has Colab's stack but no
    course_utils: pip installs the built wheel (in place of the published release, which this machine cannot
    reach), and the first cells of every notebook, a live chart, a launch on two ranks, and every exercise's
    reference solution, a check and the hints (issue 28: what a "Stuck?" cell suggests) run from it."""
    import sysconfig

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)  # pip: Colab's
    python = venv / "bin" / "python"
    fresh_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    stack = _colab_stack(tmp_path / "colab-stack", Path(sysconfig.get_paths()["purelib"]))
    (fresh_site / "colab_stack.pth").write_text(f"{stack}\n")

    meta = colab.metadata()
    release = f"git+{meta['url']}@{meta['ref']}"
    cells = {
        "setup": colab.setup_source(meta).replace(release, wheel.as_uri()),
        "setup_ft": colab.setup_source(meta, ["ft"]).replace(release, wheel.as_uri()),
        "heads": {},
    }
    assert cells["setup"] != colab.setup_source(meta)
    for path in NOTEBOOKS:
        code = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        cells["heads"][path.name] = [code[0]["source"], code[2]["source"]]  # parameters, imports (set-up: above)
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    (tmp_path / "on_colab.py").write_text(ON_COLAB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(COURSE_HEADLESS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        [str(python), str(tmp_path / "on_colab.py"), str(tmp_path / "cells.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = done.stdout
    assert f"installed {fresh_site}/course_utils/__init__.py" in out, out[-2000:]
    assert "chart True" in out
    assert "ranks [15.0, 18.0, 21.0, 24.0]" in out, out[-2000:]  # rank 1: 3·(i + 1) at its own places i = 4 … 7
    assert f"solutions and hints from {fresh_site}/course_utils/exercises/core.py" in out, out[-2000:]


def test_setup_cell_stops_in_one_sentence_when_pip_fails(tmp_path):
    """A real pip that cannot install (here: no network and a release that is not there) stops the notebook
    with the cell's one sentence, not a traceback."""
    meta = colab.metadata()
    setup = colab.setup_source(meta).replace(f"git+{meta['url']}@{meta['ref']}", (tmp_path / "none.whl").as_uri())
    script = "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n" + setup
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Could not install course-utils @ file://") and "make lab" in last
    assert "Traceback" not in done.stderr


def test_the_readme_says_what_a_teacher_must_publish_while_the_release_is_not_tagged():
    """The badges point at a release; a repository without that tag says, in one sentence, what to publish
    first (a fresh clone of main, which CI tests, carries no tag). Once the tag exists here, the sentence goes."""
    meta = colab.metadata()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Colab") :].split("\n## ")[0]
    publish = " ".join(section.split("**What a teacher must publish first:**", 1)[-1].split("\n\n")[0].split())
    tagged = subprocess.run(
        ["git", "rev-parse", "-q", "--verify", f"refs/tags/{meta['ref']}"], cwd=ROOT, capture_output=True
    )
    if tagged.returncode == 0:
        assert "What a teacher must publish first" not in section, f"{meta['ref']} is tagged: drop the sentence"
        return
    assert "What a teacher must publish first" in section, "say what a teacher must publish before the badges work"
    assert f"`{meta['url']}`" in publish and f"tag `{meta['ref']}`" in publish and "no tag" in publish, publish
