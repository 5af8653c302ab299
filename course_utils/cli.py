"""The command line: ``python -m course_utils {memory, table, plan, train, rehearse, exercises, ft, bench}``.

Each subcommand is a thin shell over the same functions the notebooks call. A module that
owns a subcommand NAME defines ``NAME_arguments(parser)`` and ``NAME_command(args) -> int``;
it is imported only when that subcommand runs, so ``--help`` stays fast.

Bad arguments exit with status 2 and one line on stderr, never a traceback: every number is held to
its stated range (``validate.RANGES``) before the subcommand runs, and a worker that fails on the
user's input (a checkpoint folder that does not verify, a full disk) is reported by its one line. A
run that fails or times out exits 1 with the launcher's message (where each rank was), no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ._report import LaunchError, WorkerFailed
from .errors import CourseInputError
from .validate import check_command

# name -> (module that implements it, one-line help, notebook that introduces it)
COMMANDS: dict[str, tuple[str, str]] = {
    "memory": ("course_utils.memory", "model-state bytes per GPU for DDP and ZeRO stages 1-3 (notebook 01)"),
    "table": ("course_utils.memory", "the ZeRO paper's Table 1 grid in GB, with what fits a GPU (notebook 01)"),
    "train": (
        "course_utils.train",
        "train the course model with one strategy and report losses, bytes, traffic (notebook 02)",
    ),
    "cluster": (
        "course_utils.cluster_cli",
        "train across 2+ network namespaces joined by a rate-limited link (root, Linux; notebook 05)",
    ),
    "plan": ("course_utils.plan", "choose a data-parallel strategy for a model and cluster (notebook 05)"),
    "rehearse": ("course_utils.rehearse", "a real-size FSDP2 run on fake tensors: peak memory per GPU (notebook 05b)"),
    "exercises": (
        "course_utils.exercises.command",
        "list the exercises, run their checks on the solutions or stubs, grade a class, sealed (notebooks 01-06)",
    ),
    "ft": ("course_utils.ft", "TorchFT: lose a replica group, keep training, heal it from a live peer (notebook 06)"),
    "bench": (
        "course_utils.bench",
        "benchmarks: course run time, launch overhead, hand-built vs torch; runs "
        "tools/bench.py in a clone of the repository (README)",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m course_utils", description="The course's calculators and runs, from the command line."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            getattr(mod, f"{name}_arguments")(p)
            p.set_defaults(_run=getattr(mod, f"{name}_command"))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        check_command(args.command, args)  # nan, inf, 400 digits, out of range: refused before anything runs
        return int(args._run(args) or 0)
    except CourseInputError as exc:
        print(f"python -m course_utils {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except WorkerFailed as exc:
        if exc.input_error is None:
            print(f"python -m course_utils {args.command}: {exc}", file=sys.stderr)
            return 1
        print(f"python -m course_utils {args.command}: error: {exc.input_error}", file=sys.stderr)
        return 2
    except LaunchError as exc:  # a run that timed out, or whose agent failed: what it says, not a traceback
        print(f"python -m course_utils {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
