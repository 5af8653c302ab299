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


@pytest.fixture
def root() -> Path:
    return ROOT
