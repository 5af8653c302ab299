"""``python -m course_utils exercises``: list the exercises, run their checks, grade a class (notebooks 01-06).

    python -m course_utils exercises                         # every exercise, one line each
    python -m course_utils exercises --run solutions         # every check on the reference solutions (CI)
    python -m course_utils exercises --grade class/ --out grades/   # a class, sealed: grades.csv, grades.json

Exit status: 0; 1 when ``--run solutions`` has a check that does not pass (``--run stubs``: one that is not
"not done"), or when ``--grade`` could not grade a notebook (it hung, crashed, ran out of memory, filled its
disk, forked without end, or is not a course notebook); 2 for bad input (one line on stderr).
"""

from __future__ import annotations

import json
import sys

from ..errors import CourseInputError
from ..units import parse_bytes
from . import core, grading, seal


def exercises_arguments(parser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--run",
        choices=("solutions", "stubs"),
        help="run every check on the reference solutions (all must pass) or on the untouched stubs "
        "(all must be 'not done')",
    )
    group.add_argument(
        "--grade",
        metavar="NOTEBOOK_OR_FOLDER",
        nargs="+",
        help="grade students' notebooks (files, or folders of .ipynb), each in a seal: no network, a user and a "
        "filesystem of its own, limits on time, memory, processes and disk; writes grades.csv and grades.json",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    limits = seal.Limits()
    g = parser.add_argument_group("grading (--grade)")
    g.add_argument("--out", default="grades", help="folder for grades.csv and grades.json (default: grades)")
    g.add_argument("--notebook", help="which course notebook they are, e.g. 03 (default: read from each notebook)")
    g.add_argument(
        "--names",
        default="file",
        help="where a student's name comes from: 'file' (the file's name, default) or 'metadata:KEY' "
        "(a key of the notebook's metadata, e.g. metadata:course.student)",
    )
    g.add_argument("--jobs", type=int, help="notebooks graded side by side (default: the cores here)")
    g.add_argument(
        "--time", type=float, default=limits.wall_s, help=f"seconds for a whole notebook (default {limits.wall_s:g})"
    )
    g.add_argument("--memory", default="4GiB", help="memory for a whole notebook, all its processes (default 4GiB)")
    g.add_argument("--pids", type=int, default=limits.pids, help=f"processes and threads (default {limits.pids})")
    g.add_argument("--disk", default="1GiB", help="what a notebook may write (default 1GiB)")


def limits_of(args) -> seal.Limits:
    return seal.check_limits(
        seal.Limits(
            wall_s=args.time,
            memory_bytes=int(parse_bytes(args.memory, name="--memory", default_unit="GiB")),
            pids=args.pids,
            disk_bytes=int(parse_bytes(args.disk, name="--disk", default_unit="GiB")),
        )
    )


def grade_command(args) -> int:
    """Grade a class: a line per notebook as it finishes, the tables, the summary."""
    if args.jobs is not None and args.jobs < 1:
        raise CourseInputError(f"--jobs must be 1 or more, got {args.jobs}")
    if args.names != "file" and not args.names.startswith("metadata:"):
        raise CourseInputError(f"--names takes 'file' or 'metadata:KEY', got {args.names!r}")
    limits = limits_of(args)
    files = grading.notebooks_in(args.grade)  # a missing path is refused before the seal is probed (a process)
    caps = seal.probe()
    if not args.json:
        print(f"grading {len(files)} notebook(s); each sealed with at most {limits.describe()}", file=sys.stderr)
        for line in caps.missing():
            print(f"  not available here: {line}", file=sys.stderr)

    def progress(g: grading.NotebookGrade) -> None:
        if not args.json:
            passed = sum(r.outcome == core.PASSED for r in g.rows)
            state = f"{passed}/{len(g.rows)} passed" if g.graded else f"could not be graded: {g.reason}"
            print(f"  {g.student}: {state} ({g.wall_s:.0f} s)", file=sys.stderr)

    grades = grading.grade_class(
        files, limits=limits, jobs=args.jobs, notebook=args.notebook, names=args.names, progress=progress
    )
    csv_path, json_path = grading.write_tables(grades, args.out, limits=limits, caps=caps)
    if args.json:
        print(json_path.read_text())
    else:
        print(grading.summary_text(grades))
        print(f"tables: {csv_path} and {json_path}")
    return 0 if all(g.graded for g in grades) else 1


def exercises_command(args) -> int:
    """``python -m course_utils exercises``: list, run or grade the exercises (notebooks 01-06)."""
    if args.grade:
        return grade_command(args)
    if args.run is None:
        listing = [ex.describe() for ex in core.exercises()]
        if args.json:
            print(json.dumps(listing, indent=1))
        else:
            for row in listing:
                where = f"{row['nproc']} ranks" if row["distributed"] else "in process"
                print(f"{row['notebook']}.{row['name']:<24} {where:<10} {row['checks']}")
        return 0
    outcomes = core.run_all(args.run)
    want = core.PASSED if args.run == "solutions" else core.NOT_DONE
    if args.json:
        print(json.dumps({"run": args.run, "outcomes": [o.to_dict() for o in outcomes]}, indent=1))
    else:
        for o in outcomes:
            print(o)
    return 0 if all(o.status == want for o in outcomes) else 1
