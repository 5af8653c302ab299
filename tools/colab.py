"""The Colab path of every notebook, generated from the package metadata (for teachers and authors).

    python tools/colab.py sync     rewrite every notebook's badge and set-up cell from pyproject.toml
    python tools/colab.py check    exit 1, naming each notebook, when a badge or set-up cell disagrees

The repository URL lives in one place, pyproject.toml's ``[project.urls] Repository``; the release the
notebooks open and install is ``[tool.course.colab] ref`` beside it (a tag or a commit, never a branch:
a badge opened next year must install the course_utils its notebook was written against). From those two:

- the title cell's badge opens ``https://colab.research.google.com/github/OWNER/REPO/blob/REF/notebooks/NN.ipynb``;
- the set-up cell (the second code cell) installs ``course-utils @ git+URL@REF`` on Colab only: course_utils
  alone, since Colab already has torch, matplotlib and ipywidgets (plus the extras a notebook names in its
  metadata's ``course.colab_extras``: notebook 06 needs ``ft`` for torchft). If the install fails (the repository or
  the ref is not published, no network) the cell stops the notebook with one sentence saying what to do,
  instead of a traceback followed by an ImportError in every later cell.

`sync` touches only the badge link in the title cell and the whole set-up cell; tests/test_colab.py
runs `check`. Publishing the course is described in the README ("Colab").
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PYPROJECT = ROOT / "pyproject.toml"

BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
_BADGE = re.compile(r"\[!\[Open In Colab\]\(" + re.escape(BADGE_IMAGE) + r"\)\]\((?P<url>[^)\s]+)\)")
_GITHUB = re.compile(r"https://github\.com/(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+?)(?:\.git)?/?$")
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*$")
#: Refs that move: a badge must open what its notebook was written against.
_BRANCHES = {"main", "master", "HEAD", "dev", "develop"}

SETUP = """\
# Set-up: on Colab, install course_utils from the course's repository at this notebook's release (Colab's own
# torch, matplotlib and ipywidgets are kept). Elsewhere this does nothing: `make` has installed it into .venv.
# Written by `python tools/colab.py sync` from pyproject.toml (the repository URL and the release): edit those.
import sys

if "google.colab" in sys.modules:
    import subprocess

    COURSE_PACKAGE = "course-utils{extras} @ git+{url}@{ref}"
    if subprocess.run([sys.executable, "-m", "pip", "install", "-q", COURSE_PACKAGE]).returncode != 0:
        raise SystemExit(
            f"Could not install {{COURSE_PACKAGE}} (pip says why above): if that repository or release "
            "is not published yet, run the course locally with `make lab`, or ask your teacher for the "
            "published Colab link."
        )"""


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(path.read_text())


def metadata(pyproject: Path = PYPROJECT) -> dict:
    """{"url", "owner", "repo", "ref"} from pyproject.toml; SystemExit with the fix when one is missing or wrong."""
    data = _toml(pyproject)
    url = data.get("project", {}).get("urls", {}).get("Repository", "")
    ref = str(data.get("tool", {}).get("course", {}).get("colab", {}).get("ref", ""))
    m = _GITHUB.match(url)
    if not m:
        raise SystemExit(
            f"{pyproject.name}: [project.urls] Repository = {url!r} is not a GitHub repository URL "
            "(https://github.com/OWNER/REPO), which Colab needs to open the notebooks"
        )
    if not _REF.match(ref) or ref in _BRANCHES:
        raise SystemExit(
            f"{pyproject.name}: [tool.course.colab] ref = {ref!r} must be a release tag or a commit "
            "(a branch moves, so a badge would open notebooks that no longer match their course_utils)"
        )
    return {"url": f"https://github.com/{m['owner']}/{m['repo']}", "owner": m["owner"], "repo": m["repo"], "ref": ref}


def badge_url(meta: dict, filename: str) -> str:
    """The Colab link of one notebook at the pinned release."""
    return (
        f"https://colab.research.google.com/github/{meta['owner']}/{meta['repo']}/blob/{meta['ref']}"
        f"/notebooks/{filename}"
    )


def badge(meta: dict, filename: str) -> str:
    """The markdown of one notebook's "Open In Colab" badge."""
    return f"[![Open In Colab]({BADGE_IMAGE})]({badge_url(meta, filename)})"


def setup_source(meta: dict, extras=()) -> str:
    """The set-up cell every notebook runs second (after its parameters). ``extras``: the package extras a
    notebook needs beyond course_utils (its metadata's ``course.colab_extras``, e.g. ["ft"] for torchft)."""
    return SETUP.format(url=meta["url"], ref=meta["ref"], extras=f"[{','.join(extras)}]" if extras else "")


def _extras(nb) -> list:
    return list(nb.get("metadata", {}).get("course", {}).get("colab_extras", []))


def _code_cells(nb) -> list:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def problems(path: Path, meta: dict) -> list[str]:
    """What disagrees with the metadata in one notebook (empty when its badge and set-up cell agree)."""
    nb = json.loads(path.read_text())
    found = []
    badges = _BADGE.findall(nb["cells"][0]["source"])
    if badges != [badge_url(meta, path.name)]:
        found.append(
            f"{path.name}: the title cell's badge opens {badges or 'nothing'}, not {badge_url(meta, path.name)}"
        )
    code = _code_cells(nb)
    if len(code) < 2 or code[1]["source"] != setup_source(meta, _extras(nb)):
        found.append(f"{path.name}: the second code cell is not the set-up cell for {meta['url']}@{meta['ref']}")
    return found


def sync(path: Path, meta: dict) -> bool:
    """Rewrite one notebook's badge and set-up cell from the metadata; True when the file changed."""
    text = path.read_text()
    nb = json.loads(text)
    title = nb["cells"][0]
    if not _BADGE.search(title["source"]):
        raise SystemExit(
            f"{path.name}: the title cell has no Open In Colab badge to update: "
            "add one (copy the title cell of another notebook)"
        )
    title["source"] = _BADGE.sub(lambda _: badge(meta, path.name), title["source"])
    code = _code_cells(nb)
    if len(code) < 2 or "google.colab" not in code[1]["source"]:
        raise SystemExit(
            f"{path.name}: the second code cell is not a Colab set-up cell: copy the set-up cell of another notebook"
        )
    code[1]["source"] = setup_source(meta, _extras(nb))
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new)
    return new != text


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["sync"], ["check"]):
        print("usage: python tools/colab.py sync|check", file=sys.stderr)
        return 2
    meta = metadata()
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args == ["sync"]:
        changed = [p.name for p in paths if sync(p, meta)]
        print(f"Colab: {meta['url']} at {meta['ref']}; rewrote {', '.join(changed) or 'nothing (all agree)'}")
        return 0
    found = [line for p in paths for line in problems(p, meta)]
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print("run `python tools/colab.py sync` and commit notebooks/", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
