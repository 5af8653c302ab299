"""Put notebooks in the form the repository stores them: stripped, canonical JSON (for authors).

The ``.ipynb`` file is the one source of a notebook: edit it in JupyterLab (``make lab``), then run

    .venv/bin/python tools/nb_canonical.py notebooks/04_fsdp.ipynb     # or no argument: every notebook

which removes outputs and execution counts, joins each cell's source into one string, gives
a cell without an id a new one, moves speaker notes written as notes cells into the metadata of the
cell they follow (``tools/editions.py convert``: the student's notebook holds no teacher text), and
writes the JSON with indent 1 and a trailing newline, so that a diff shows only what changed.
``tests/test_repo.py`` checks every notebook is in this form.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, this folder is on sys.path, not the repository
    sys.path.insert(0, str(ROOT))


def canonical(nb: dict, said: list | None = None) -> dict:
    """The stored form of a notebook (stripped; sources as one string; every cell with an id; notes in
    metadata). What the notes conversion did is appended to ``said``."""
    from tools import editions

    prefix = None
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        prefix = prefix or (cell.get("id") or "").split("-")[0]
        if not cell.get("id"):
            cell["id"] = f"{prefix or 'cell'}-{uuid.uuid4().hex[:6]}"
    converted = editions.convert(nb)
    if said is not None:
        said += converted
    return nb


def dumps(nb: dict) -> str:
    """The stored text of a notebook already in canonical form."""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def write_notebook(path: Path, nb: dict) -> bool:
    """Write ``nb`` to ``path`` in the canonical form; True if that changed the file."""
    new = dumps(canonical(nb))
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if new != old:
        path.write_text(new, encoding="utf-8")
    return new != old


def write(path: Path) -> bool:
    """Rewrite ``path`` in the canonical form; True if that changed the file."""
    return write_notebook(path, json.loads(path.read_text(encoding="utf-8")))


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path}: {'rewritten' if write(path) else 'already canonical'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
