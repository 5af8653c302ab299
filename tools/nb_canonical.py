"""Put notebooks in the form the repository stores them: stripped, canonical JSON (for authors).

The ``.ipynb`` file is the one source of a notebook: edit it in JupyterLab (``make lab``), then run

    .venv/bin/python tools/nb_canonical.py notebooks/04_fsdp.ipynb     # or no argument: every notebook

which removes outputs and execution counts, joins each cell's source into one string, gives
a cell without an id a new one, and writes the JSON with indent 1 and a trailing newline, so
that a diff shows only what changed. ``tests/test_repo.py`` checks every notebook is in this form.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def canonical(nb: dict) -> dict:
    """The stored form of a notebook (stripped; sources as one string; every cell with an id)."""
    prefix = None
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        prefix = prefix or (cell.get("id") or "").split("-")[0]
        if not cell.get("id"):
            cell["id"] = f"{prefix or 'cell'}-{uuid.uuid4().hex[:6]}"
    return nb


def write(path: Path) -> bool:
    """Rewrite ``path`` in the canonical form; True if that changed the file."""
    text = path.read_text(encoding="utf-8")
    new = json.dumps(canonical(json.loads(text)), indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path}: {'rewritten' if write(path) else 'already canonical'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
