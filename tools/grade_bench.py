"""How long grading a class takes: N copies of one solved notebook, graded as a teacher would (issue 29).

    python -m tools.grade_bench                    # a class of 6 and a class of 30, notebook 03, into benchmarks/
    python -m tools.grade_bench --sizes 6 --notebook 02 --jobs 2

Each class is graded by the command a teacher types (``python -m course_utils exercises --grade DIR``) in a
child process; its wall time, its CPU seconds (everything it started: the grader, every seal, every rank) and
the load average around it are written to ``benchmarks/grading.json`` and ``benchmarks/grading.md``. The solved
notebook is the course's own notebook with the stubs filled in the way a student would (``tests/student_work``),
so every exercise must come out passed (the run fails otherwise). Needs root (the seal).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import student_work  # noqa: E402

from course_utils.exercises import core  # noqa: E402
from course_utils.exercises.grading import usable_cores  # noqa: E402


def grade(folder: Path, out: Path, jobs: int | None) -> dict:
    """Grade ``folder`` with the command line; wall and CPU seconds of the whole command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    cmd = [sys.executable, "-m", "course_utils", "exercises", "--grade", str(folder), "--out", str(out)]
    cmd += ["--jobs", str(jobs)] if jobs else []
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"grading failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    document = json.loads((out / "grades.json").read_text())
    notebooks = document["notebooks"]
    outcomes = {r["outcome"] for g in notebooks for r in g["rows"]}
    if outcomes != {core.PASSED}:
        raise SystemExit(f"an honest class must pass every exercise, got {outcomes}: see {out / 'grades.json'}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seals = [g["cpu_s"] for g in notebooks if g.get("cpu_s") is not None]
    return {
        "notebooks": len(notebooks),
        "exercises": sum(len(g["rows"]) for g in notebooks),
        "jobs": jobs,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "seal_cpu_s_median": round(statistics.median(seals), 2) if seals else None,
        "grader_cpu_s": round(cpu - sum(seals), 1) if seals else None,
        "notebook_wall_s_median": round(statistics.median(g["wall_s"] for g in notebooks), 1),
        "memory_peak_median_mb": round(statistics.median(g["memory_peak"] or 0 for g in notebooks) / 2**20),
        "load_before": [round(x, 1) for x in load],
        "load_after": [round(x, 1) for x in os.getloadavg()],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[6, 30])
    parser.add_argument("--notebook", default="03")
    parser.add_argument("--jobs", type=int, help="notebooks side by side (default: the grader's, the cores here)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite grading.md from grading.json")
    args = parser.parse_args(argv)
    if args.markdown_only:
        out = Path(args.out)
        (out / "grading.md").write_text(markdown(json.loads((out / "grading.json").read_text())))
        return 0
    missing = [ex.key for ex in core.exercises(args.notebook) if ex.name not in student_work.STUDENT]
    if missing:
        raise SystemExit(f"tests/student_work.py has no student's answer for {', '.join(missing)}: add one to STUDENT")
    answers = {ex.name: student_work.STUDENT[ex.name] for ex in core.exercises(args.notebook)}
    solved = student_work.notebook(args.notebook, answers)
    results = []
    with tempfile.TemporaryDirectory(prefix="grade-bench-") as tmp:
        for n in args.sizes:
            folder, out = Path(tmp) / f"class{n}", Path(tmp) / f"grades{n}"
            folder.mkdir()
            for i in range(n):
                student_work.write(folder / f"student{i:02d}.ipynb", solved)
            row = {"size": n, "notebook": args.notebook, "cores": usable_cores(), **grade(folder, out, args.jobs)}
            print(json.dumps(row), flush=True)
            results.append(row)
    out = Path(args.out)
    machine = f"{os.cpu_count()} CPU cores, {platform.platform()}, Python {platform.python_version()}"
    for row in results:
        row.update(when=time.strftime("%Y-%m-%d %H:%M"), machine=machine)
    try:  # a run of some sizes keeps the rows of the others
        kept = json.loads((out / "grading.json").read_text())["classes"]
    except (OSError, ValueError, KeyError):
        kept = []
    done = {(r["size"], r["notebook"], r["jobs"]) for r in results}
    record = {"classes": [r for r in kept if (r["size"], r["notebook"], r["jobs"]) not in done] + results}
    record["classes"].sort(key=lambda r: (r["notebook"], r["size"]))
    (out / "grading.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "grading.md").write_text(markdown(record))
    return 0


def markdown(record: dict) -> str:
    lines = [
        "# Grading a class",
        "",
        "Written by `python -m tools.grade_bench` from `benchmarks/grading.json`: a class of N copies of one solved "
        "notebook, graded by `python -m course_utils exercises --grade`, each notebook in its own seal (see the "
        "README's teacher section). CPU seconds count everything the command started (the grader, every seal, "
        "every rank); on a shared machine they move less than wall seconds, which the load average qualifies.",
        "",
        "The column *CPU s / cores* is the least wall time those CPU seconds can take on the machine's cores: "
        "what the class would take on the same cores with nothing else running, if the grader kept them all busy.",
        "",
        "| class | notebook | side by side | wall s | CPU s | CPU s / cores | CPU s per seal (median) | grader CPU s | "
        "notebook wall s (median) | memory per seal (median) | load before / after | when |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["classes"]:
        cores = r.get("cores") or 1
        lines.append(
            f"| {r['size']} | {r['notebook']} | {r['jobs'] or 'cores'} | {r['wall_s']} | {r['cpu_s']} | "
            f"{r['cpu_s'] / cores:.0f} | "
            f"{r['seal_cpu_s_median']} | {r['grader_cpu_s']} | {r['notebook_wall_s_median']} | "
            f"{r['memory_peak_median_mb']} MiB | {r['load_before'][0]} / {r['load_after'][0]} | {r['when']} |"
        )
    lines += ["", "Machines: " + "; ".join(sorted({r["machine"] for r in record["classes"]})) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
