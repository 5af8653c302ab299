"""Shared test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("COURSE_HEADLESS", "1")


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running process (a zombie, already dead but not reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


_TMP: list = []


def subprocess_tmpdir() -> str:
    """A folder for a plain torchrun's temporary files (``TMPDIR``), removed when this pytest process ends.

    torchrun's agent makes a ``torchelastic_*`` folder in the temporary folder and leaves it there (four
    of them in /tmp after every `make test`, from the tests that run the README's lines as printed). The
    course's own launches already keep theirs in the run's folder.
    """
    if not _TMP:
        import atexit
        import shutil
        import tempfile

        _TMP.append(tempfile.mkdtemp(prefix="course-tests-tmp-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return _TMP[0]


@pytest.fixture
def root() -> Path:
    return ROOT


#: Files whose tests run first. `make test` spreads files over two pytest-xdist workers in this order
#: (`--dist loadfile --no-loadscope-reorder`): the longest files first, so that neither worker is left with
#: one long file at the end (measured with --durations: the grading runs, then the torchrun and cluster runs).
RUN_FIRST = ("test_notebooks.py", "test_grading.py", "test_torchrun_readme.py", "test_cluster.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in RUN_FIRST)  # stable: the rest keep their order


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child the test will Ctrl-C: SIGINT back to its default action.

    A shell starts background jobs (`make test &`, `nohup ... &`) with SIGINT ignored, and children
    inherit that; Python then installs no KeyboardInterrupt handler, so a test's SIGINT would do
    nothing and the test would time out for a reason that has nothing to do with the code.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
