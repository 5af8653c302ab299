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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, this folder is on sys.path, not the repository
    sys.path.insert(0, str(ROOT))


# The stored form lives with the notes conversion it includes (``editions``); this is its command line.
from tools.editions import write_notebook  # noqa: E402


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
