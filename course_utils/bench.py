"""``python -m course_utils bench``: the benchmarks, which run from a clone of the repository (README, Benchmarks).

The harness (``tools/bench.py``, ``make bench``) executes the repository's ``notebooks/``, times
them and writes ``benchmarks/``: folders a clone has and an installed package does not, so the
harness lives with the tools and the package never imports it. This subcommand stays for the
command line people already use: in a checkout (the editable install ``make setup`` makes) it
runs ``python -m tools.bench`` in the repository with the same arguments and returns its exit
status; from a package installed without the repository it exits 2 with one sentence saying where
to run it. What the benchmarks compare against is the package's: ``predict.expected_bytes``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .errors import CourseInputError


def repository_root() -> Path | None:
    """The clone this package was installed from (editable install), or None: where ``tools/bench.py`` and
    ``notebooks/`` are (README, Benchmarks)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tools" / "bench.py").is_file() and (root / "notebooks").is_dir() else None


def bench_arguments(parser: argparse.ArgumentParser) -> None:
    # Every argument (even --help) belongs to the harness: no option is parsed here.
    parser.prefix_chars = "+"
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the harness's arguments: python -m tools.bench --help")


def bench_command(args) -> int:
    root = repository_root()
    if root is None:
        raise CourseInputError(
            "the benchmarks execute the course's notebooks, which this installed package does "
            "not have: run `make bench` in a clone of the course's repository"
        )
    return subprocess.call([sys.executable, "-m", "tools.bench", *args.args], cwd=root)


__all__ = ["repository_root", "bench_arguments", "bench_command"]
