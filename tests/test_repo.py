"""The repository's own conventions: stripped notebooks, agreeing env files, notebook frame."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _tracked(path) -> bool:
    out = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True)
    return out.returncode == 0


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"
    assert (ROOT / "notebooks" / "00_setup.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_stripped(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], (
                f"{path.name} cell {i} has committed outputs (executed copies belong in build/)"
            )
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_in_the_canonical_format(path):
    # The .ipynb is the source: edited in JupyterLab (or by a script), stored stripped, valid
    # nbformat, and written the one way that keeps a diff reviewable: indent 1, each cell's
    # source one string, a unique id per cell (CONTRIBUTING.md, "Editing a notebook").
    import nbformat

    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    nbformat.validate(nbformat.reads(text, as_version=nbformat.NO_CONVERT))
    assert text == json.dumps(nb, indent=1, ensure_ascii=False) + "\n", (
        f"{path.name} is not in the canonical format: run `.venv/bin/python tools/nb_canonical.py {path.relative_to(ROOT)}`"
    )
    ids = [cell.get("id") for cell in nb["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), f"{path.name}: every cell needs its own id"
    for cell in nb["cells"]:
        assert isinstance(cell["source"], str), f"{path.name} cell {cell.get('id')}: source must be one string"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_frame(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    src = lambda c: "".join(c["source"])  # noqa: E731
    assert "parameters" in code[0].get("metadata", {}).get("tags", []), (
        f"{path.name}: first code cell must be the papermill parameters cell"
    )
    assert "google.colab" in src(code[1]), f"{path.name}: second code cell must be the Colab set-up cell"
    assert "colab.research.google.com" in src(nb["cells"][0]), f"{path.name}: title cell needs the Open in Colab badge"
    assert path.name in src(nb["cells"][0]), f"{path.name}: the Colab badge must point at this notebook"
    assert any("slideshow" in c.get("metadata", {}) for c in nb["cells"]), f"{path.name}: no slide metadata"
    assert any(re.search(r"^\s*assert ", src(c), re.M) for c in code), f"{path.name}: asserts none of its claims"
    assert re.match(r"\d\d[a-z]?_[a-z0-9_]+\.ipynb$", path.name), f"{path.name}: name it NN_topic.ipynb"


def _requirements_from_constraints() -> dict:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _environment_pins() -> dict:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"\s*-\s*([A-Za-z0-9_.\-]+)\s*(==|=)\s*([0-9][^\s#]*)", line)
        if m and m.group(1).lower() != "python":
            pins[m.group(1).lower()] = m.group(3)
    return pins


def _pyproject_packages() -> set:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for req in project["dependencies"] + [r for group in project["optional-dependencies"].values() for r in group]:
        names.add(re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower())
    return names


def test_environment_yml_agrees_with_pyproject_and_constraints():
    pins, env, declared = _requirements_from_constraints(), _environment_pins(), _pyproject_packages()
    missing = declared - set(pins)
    assert not missing, f"packages in pyproject.toml without a pinned version in constraints.txt: {missing}"
    assert set(env) == set(pins), f"environment.yml and constraints.txt list different packages: {set(env) ^ set(pins)}"
    for name, version in pins.items():
        assert env[name] == version, f"{name}: environment.yml has {env[name]}, constraints.txt has {version}"


def test_torch_is_pinned_to_the_cpu_set_up():
    assert _requirements_from_constraints()["torch"] == "2.13.0"
    makefile = (ROOT / "Makefile").read_text()
    assert "download.pytorch.org/whl/cpu" in makefile and "-c constraints.txt" in makefile


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make course" in readme and "make test" in readme


def test_no_fixed_rendezvous_port_in_the_package():
    for py in (ROOT / "course_utils").rglob("*.py"):
        text = py.read_text()
        default = "295" + "00"  # torchrun's default port, spelled so this file does not match itself
        assert not re.search(rf"MASTER_PORT[\"']?\]?\s*=\s*[\"']?\d{{4,5}}|:{default}\b|port\s*=\s*{default}", text), py


def test_cli_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "course_utils", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    for name in ("memory", "table", "plan", "train"):
        assert name in out.stdout


def test_cli_bad_subcommand_is_one_line_and_exit_2():
    out = subprocess.run(
        [sys.executable, "-m", "course_utils", "no-such-command"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_is_valid_python(path):
    import ast

    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            lines = [line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))]
            try:
                ast.parse("\n".join(lines))
            except SyntaxError as exc:
                raise AssertionError(f"{path.name} cell {i}: {exc}") from None


def _measured_seconds(name: str) -> float:
    """The notebook's wall seconds in the newest column of benchmarks/budget.md's notebook table."""
    for line in (ROOT / "benchmarks" / "budget.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == name:
            return float(re.match(r"[\d.]+", cells[-1]).group(0))
    raise AssertionError(f"benchmarks/budget.md has no row for {name}: measure it (make course) and add it")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_header_states_the_measured_time(path):
    """A student plans their hour by the title cell's 'Runs in': it must be the measured time, not a hope."""
    title = "".join(json.loads(path.read_text())["cells"][0]["source"])
    claim = re.search(r"\*Runs in:\* about (\d+) s on a 2-core laptop CPU", title)
    assert claim, f"{path.name}: the title cell must say '*Runs in:* about N s on a 2-core laptop CPU'"
    measured = _measured_seconds(path.stem)
    assert abs(int(claim.group(1)) - measured) <= max(5.0, 0.15 * measured), (path.name, claim.group(1), measured)
