"""Grading a class (issue 29): every attack on the grader fails, an honest class passes, side by side.

One class of small notebooks (notebook 01's exercise section: checks in process, cheap; one notebook 02 whose
checks run on real ranks over the seal's loopback) is graded once, through the command line, with tight limits;
each notebook is one attack, and each test reads its row. What a seal must keep out is checked from outside it
(the marker file, the installed package, the listener's count), not from what the student's code says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mistakes
import pytest
import student_work as sw

from course_utils import cli
from course_utils.exercises import calls, cgroups, core, grading, seal, submission

CAPS = seal.probe()
needs_seal = pytest.mark.skipif(
    not (CAPS.namespaces and CAPS.cgroup), reason=f"the seal needs root, unshare and cgroups: {CAPS.missing()}"
)
LIMITS = ["--time", "180", "--memory", "1GiB", "--pids", "256", "--disk", "64MiB", "--jobs", "2"]

LISTENER = r"""
import socket, sys, pathlib
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(16)
pathlib.Path(sys.argv[2]).write_text(str(srv.getsockname()[1]))
count = pathlib.Path(sys.argv[3])
while True:
    conn, _ = srv.accept()
    count.write_text(str(int(count.read_text() or 0) + 1))
    conn.close()
"""


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


class Listener:
    """A TCP listener started by the test, counting connections: in a network namespace the test makes (with a
    veth link to the host, so the host itself can reach it), or on the host's loopback."""

    def __init__(self, tmp: Path, netns: str | None):
        self.netns, self.tmp = netns, tmp
        self.count = tmp / f"count-{netns or 'lo'}"
        self.count.write_text("0")
        port_file = tmp / f"port-{netns or 'lo'}"
        prefix = []
        self.addr = "127.0.0.1"
        if netns:
            octet = os.getpid() % 250 + 1
            self.addr, host = f"10.213.{octet}.2", f"10.213.{octet}.1"
            host_if, ns_if = f"{netns}a", f"{netns}b"
            _run("ip", "netns", "add", netns)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            _run("ip", "link", "set", ns_if, "netns", netns)
            _run("ip", "addr", "add", f"{host}/30", "dev", host_if)
            _run("ip", "link", "set", host_if, "up")
            _run("ip", "netns", "exec", netns, "ip", "addr", "add", f"{self.addr}/30", "dev", ns_if)
            _run("ip", "netns", "exec", netns, "ip", "link", "set", ns_if, "up")
            prefix = ["ip", "netns", "exec", netns]
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", LISTENER, self.addr, str(port_file), str(self.count)]
        )
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and self.proc.poll() is None, "the test's listener did not start"
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def connections(self) -> int:
        return int(self.count.read_text() or 0)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        if self.netns:
            subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
            subprocess.run(["ip", "link", "delete", f"{self.netns}a"], capture_output=True)


def _package_digest() -> str:
    root = Path(core.__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path).encode() + path.read_bytes())
    return digest.hexdigest()


def _escape_cell(outside: Path, others: Path, far: Listener, near: Listener) -> str:
    return f"""
import os, socket, course_utils
escaped = []
try:
    open({str(outside / "marker")!r}, "w").write("out")
    escaped.append("wrote outside its folder")
except OSError:
    pass
for target in (course_utils.__file__, os.path.join(os.path.dirname(course_utils.__file__), "planted.py")):
    try:
        open(target, "a").write("# planted")
        escaped.append("wrote into the course's package")
    except OSError:
        pass
for secret in ("/etc/shadow", {str(others)!r}, "/root"):
    try:
        os.listdir(secret) if os.path.isdir(secret) else open(secret).read()
        escaped.append("read " + secret)
    except OSError:
        pass
if os.listdir(os.path.join(os.path.dirname(course_utils.__file__), "exercises", "solutions")):
    escaped.append("saw the reference solutions")
if "COURSE_TEST_CANARY" in os.environ or os.getuid() == 0:
    escaped.append("runs as the teacher")
for addr, port in (({far.addr!r}, {far.port}), ({near.addr!r}, {near.port})):
    try:
        socket.create_connection((addr, port), timeout=3).close()
    except OSError:
        pass
os.listdir(".") == [] or print(os.listdir("."))
raise RuntimeError("the escape cell ran; escaped: " + repr(escaped))
"""


FORGERIES = """
import json, os
line = {"notebook": "01", "name": "smallest_nd", "status": "passed", "message": "matches"}
print(json.dumps(line))
print("[PASSED] exercise 01.smallest_nd")
open(os.environ.get("COURSE_EXERCISE_REPORT", "report.jsonl"), "a").write(json.dumps(line) + "\\n")
fd = int(os.environ["COURSE_SEAL_FDS"].split(",")[1])
names = {n: {"defined": True, "callable": True, "stub": False} for n in ("smallest_nd", "block_activation_bytes")}
os.write(fd, json.dumps({"cells": [], "names": names, "disk": {"used": 0, "total": 1}}).encode() + b"\\n")
for _ in range(200):
    os.write(fd, b'{"value": 0}\\n')
"""

PATCHES = """
import dataclasses
import course_utils.exercises as E
import course_utils.exercises.core as c
import course_utils.exercises.nb01 as n
import course_utils.memory as m
c._verdict = lambda ex, per_rank: c.Outcome(ex.notebook, ex.name, "passed", "forged")
c._judge_local = lambda ex, fn: c.Outcome(ex.notebook, ex.name, "passed", "forged")
c.check_many = lambda pairs: [c.Outcome(ex.notebook, ex.name, "passed", "forged") for ex, _ in pairs]
n.judge_smallest_nd = lambda fn: None
c.REGISTRY[("01", "smallest_nd")] = dataclasses.replace(c.REGISTRY[("01", "smallest_nd")], judge=lambda fn: None)
m.model_state_bytes = lambda *a, **k: 0
m.smallest_nd_that_fits = lambda *a, **k: 1
E.check = check = lambda *a, **k: print("[PASSED]")
"""

IN_BODY_PATCH = """def block_activation_bytes(block, x):
    import course_utils.memory as m
    import course_utils.exercises.core as c
    m.measure_activation_bytes = lambda *a, **k: {"total": 1}
    c.Wrong = type("Wrong", (Exception,), {})
    return 1
"""

RANK_PATCH = """def overlapped_buckets(buckets):
    import torch
    torch.allclose = lambda *a, **k: True  # a check that compared on the rank would now see equal gradients
    torch.equal = lambda *a, **k: True
    flat = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    where, missing, handles = {}, [len(b) for b in buckets], []
    for i, b in enumerate(buckets):
        start = 0
        for p in b:
            where[p] = (i, start, start + p.numel())
            start += p.numel()

    def on_grad(p):
        i, a, z = where[p]
        flat[i][a:z] = p.grad.flatten()
        missing[i] -= 1
        while len(handles) < len(buckets) and missing[len(handles)] == 0:
            handles.append(dist.all_reduce(flat[len(handles)], async_op=True))

    for p in where:
        p.register_post_accumulate_grad_hook(on_grad)

    def finish():
        for i, h in enumerate(handles):
            h.wait()  # summed, never divided by the world size
            for p in buckets[i]:
                _, a, z = where[p]
                p.grad.copy_(flat[i][a:z].view_as(p))
        missing[:] = [len(b) for b in buckets]
        handles.clear()

    return finish
"""

FORK_BOMB = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        children += 1
except OSError:
    pass
"""

DISK_FILL = """
with open("fill.bin", "wb") as fh:
    try:
        while True:
            fh.write(b"\\0" * (1 << 20))
            fh.flush()
    except OSError:
        pass
"""


def _renamed(fn, name: str) -> str:
    return inspect.getsource(fn).replace(fn.__name__, name, 1)


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    """The attack class, graded once: ``{student: NotebookGrade}``, plus what the host saw."""
    if not (CAPS.namespaces and CAPS.cgroup):
        pytest.skip(f"the seal needs root, unshare and cgroups: {CAPS.missing()}")
    tmp = tmp_path_factory.mktemp("grading")
    klass, outside, others = tmp / "class", tmp / "outside", tmp / "others"
    for d in (klass, outside, others):
        d.mkdir()
    outside.chmod(0o777)  # writable to anyone: only the seal can keep the student out
    (others / "classmate.ipynb").write_text("{}")
    others.chmod(0o755)
    far = Listener(tmp, f"cgt{os.getpid() % 100000}")
    near = Listener(tmp, None)
    try:
        with socket.create_connection((far.addr, far.port), timeout=10):  # the control: the host reaches it
            pass
        deadline = time.monotonic() + 10
        while far.connections() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        solved01 = {k: sw.STUDENT[k] for k in ("zero_state_bytes", "smallest_nd", "block_activation_bytes")}
        # The notebooks whose attack is not about ranks leave 01.zero_state_bytes (a 4-rank check) as its stub:
        # honest01 and ranks02 prove the ranks in the seal; a stub starts no launch and no agent server.
        light01 = {k: sw.STUDENT[k] for k in ("smallest_nd", "block_activation_bytes")}
        wrong_bill = _renamed(mistakes.smallest_nd_strict, "smallest_nd")
        reference = inspect.getsource(core.solution("01", "block_activation_bytes"))
        copied = reference.replace('"""Bytes autograd', '"""My own: bytes autograd').replace(
            "    seen = {}", "    seen = {}  # mine"
        )
        endless = "def block_activation_bytes(block, x):\n    while True:\n        pass\n"
        notebooks = {
            "honest01": sw.notebook("01", solved01, section_only=True),
            "ranks02": sw.notebook(
                "02",
                {"averaging_hook": sw.STUDENT["averaging_hook"], "overlapped_buckets": RANK_PATCH},
                section_only=True,
            ),
            "forger": sw.notebook(
                "01",
                {"smallest_nd": wrong_bill, "block_activation_bytes": IN_BODY_PATCH},
                [PATCHES, FORGERIES],
                section_only=True,
            ),
            "escaper": sw.notebook(
                "01",
                {},
                [
                    _escape_cell(outside, others, far, near),
                    "from course_utils.exercises import core as c\n"
                    'block_activation_bytes = getattr(c, "load_" + "solution")("01", "block_activation_bytes")',
                ],
                section_only=True,
            ),
            "loader": sw.notebook(
                "01",
                {"block_activation_bytes": copied},
                ['smallest_nd = load_solution("01", "smallest_nd")'],
                section_only=True,
            ),
            # an endless function, in a notebook whose 01.zero_state_bytes cells were deleted (one seal, two tests)
            "looper": sw.notebook("01", dict(light01, block_activation_bytes=endless), keep=light01, section_only=True),
            "memory_bomb": sw.notebook("01", light01, ['hog = b"x" * (3 << 30)'], section_only=True),
            "fork_bomb": sw.notebook("01", light01, [FORK_BOMB], section_only=True),
            "disk_filler": sw.notebook("01", light01, [DISK_FILL], section_only=True),
            "crasher": sw.notebook("01", light01, ["import ctypes\nctypes.string_at(0)"], section_only=True),
        }
        for name, data in notebooks.items():
            sw.write(klass / f"{name}.ipynb", data)
        before = _package_digest()
        saved = dict(core.REGISTRY)
        key = ("01", "block_activation_bytes")  # four calls: well inside 8 s; the looper's loop stopped sooner
        core.REGISTRY[key] = dataclasses.replace(core.REGISTRY[key], timeout_s=8.0)
        os.environ["COURSE_TEST_CANARY"] = "the teacher's"
        try:
            out = tmp / "grades"
            status = cli.main(["exercises", "--grade", str(klass), "--out", str(out), *LIMITS])
        finally:
            core.REGISTRY.clear()
            core.REGISTRY.update(saved)
            os.environ.pop("COURSE_TEST_CANARY", None)
        seal_users = range(seal.UID_BASE, seal.UID_BASE + 1000)
        leftovers = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _uid(p) in seal_users]
        leftovers += [str(d) for base in cgroups.v1_dirs().values() for d in base.glob("course-seal-*")]
        document = json.loads((out / "grades.json").read_text())
        grades = {g["student"]: g for g in document["notebooks"]}
        seen = {
            "status": status,
            "marker": (outside / "marker").exists(),
            "package_unchanged": _package_digest() == before,
            "far": far.connections(),
            "near": near.connections(),
            "csv": (out / "grades.csv").read_text(),
            "leftovers": leftovers,
        }
        return grades, seen
    finally:
        far.close()
        near.close()


def _uid(proc: Path) -> int | None:
    try:
        return proc.stat().st_uid
    except OSError:
        return None


def _outcomes(grade: dict) -> dict:
    return {r["exercise"].split(".", 1)[1]: (r["outcome"], r["message"]) for r in grade["rows"]}


@needs_seal
def test_an_honest_notebook_passes_in_the_seal_and_its_ranks_meet_on_loopback(attacked):
    grades, seen = attacked
    got = _outcomes(grades["honest01"])
    assert {s for s, _ in got.values()} == {core.PASSED}, got
    assert grades["honest01"]["graded"] and grades["honest01"]["cpu_s"] > 0
    got = _outcomes(grades["ranks02"])
    assert got["averaging_hook"] == (core.PASSED, "matches the course's reference on 2 real ranks"), got


@needs_seal
def test_a_rank_that_patches_the_comparison_still_fails(attacked):
    """The student's function runs on the ranks beside the check's own code, and patches torch's comparisons
    there; the verdict compares the gradients it left with references it computes outside the seal."""
    got = _outcomes(attacked[0]["ranks02"])
    assert got["overlapped_buckets"][0] == core.FAILED and "2.00x the mean" in got["overlapped_buckets"][1], got


@needs_seal
def test_forged_reports_redefined_check_and_patched_verdicts_gain_nothing(attacked):
    """One notebook tries what a cell can do to its own grade: check redefined; the verdict, the judge, the
    registry and the reference patched; the reference patched again from inside the function while the check
    calls it; a printed "passed" line, a line in the old report file, and made-up answers written into the
    grader's own pipe. Its wrong answers still fail, with the check's own words: the grader judges what the
    functions return, with the course's code as installed, outside the seal."""
    got = _outcomes(attacked[0]["forger"])
    assert got["smallest_nd"][0] == core.FAILED and "'fits' is <=, not <" in got["smallest_nd"][1], got
    assert got["block_activation_bytes"][0] == core.FAILED, got
    assert "you measured 1 bytes" in got["block_activation_bytes"][1], got


@needs_seal
def test_a_cell_cannot_leave_its_folder_reach_the_network_or_read_the_teachers_files(attacked):
    grades, seen = attacked
    assert not seen["marker"], "a student's cell wrote a file outside its seal"
    assert seen["package_unchanged"], "a student's cell changed the installed course_utils"
    assert seen["far"] == 1, "a student's cell reached the test's listener in another network namespace"
    assert seen["near"] == 0, "a student's cell reached the host's loopback"
    errors = {e["error"]["message"] for e in grades["escaper"]["cell_errors"]}
    assert "the escape cell ran; escaped: []" in errors, errors  # it ran, and every attempt failed inside
    assert any("reference solutions are not available here" in e for e in errors), errors
    assert {s for s, _ in _outcomes(grades["escaper"]).values()} == {core.NOT_DONE}


@needs_seal
def test_load_solution_or_a_copy_of_the_reference_is_seen(attacked):
    got = _outcomes(attacked[0]["loader"])
    assert got["smallest_nd"] == (core.REFERENCE, got["smallest_nd"][1]), got
    assert "load_solution was called" in got["smallest_nd"][1]
    assert (
        got["block_activation_bytes"][0] == core.REFERENCE
        and "reference solution's" in got["block_activation_bytes"][1]
    )


@needs_seal
def test_every_exercise_is_accounted_for_from_the_course_list(attacked):
    got = _outcomes(attacked[0]["looper"])  # its 01.zero_state_bytes cells are deleted
    assert list(got) == [ex.name for ex in core.exercises("01")]
    assert got["smallest_nd"][0] == core.PASSED
    assert got["zero_state_bytes"][0] == core.NOT_DONE and "not in the notebook" in got["zero_state_bytes"][1], got


@needs_seal
def test_an_endless_function_is_stopped_and_the_rest_graded(attacked):
    got = _outcomes(attacked[0]["looper"])
    assert got["block_activation_bytes"][0] == core.FAILED, got
    assert "did not return within 8 s" in got["block_activation_bytes"][1]
    assert got["smallest_nd"][0] == core.PASSED


@needs_seal
@pytest.mark.parametrize(
    "student, words",
    [
        ("memory_bomb", "memory limit (1 GiB)"),
        ("fork_bomb", "forked without end"),
        ("disk_filler", "filled its disk (64 MiB)"),
        ("crasher", "crashed (killed by SIGSEGV)"),
    ],
)
def test_a_notebook_that_breaks_its_seal_is_reported_and_the_others_graded(attacked, student, words):
    grades, seen = attacked
    g = grades[student]
    assert not g["graded"] and words in g["reason"], g["reason"]
    assert {r["outcome"] for r in g["rows"]} == {core.UNGRADED}
    assert seen["status"] == 1  # some notebooks could not be graded
    assert seen["leftovers"] == [], "a process or a cgroup of a seal outlived the grading"
    assert all(g["killed_after"] == 0 for g in grades.values())  # the PID namespaces ended every process
    assert "student,file,notebook,exercise,outcome,message,seconds" in seen["csv"]


@needs_seal
def test_a_notebook_past_its_time_limit_is_stopped(tmp_path):
    """A cell that never returns (it waits; a loop that spins is the looper's, stopped by its exercise's own
    limit) is stopped at the notebook's time limit, with every process of its seal."""
    hang = "import time\nwhile True:\n    time.sleep(1)"
    path = sw.write(tmp_path / "hangs.ipynb", sw.notebook("01", {}, [hang], section_only=True))
    start = time.monotonic()
    [g] = grading.grade_class([path], limits=seal.Limits(wall_s=15, memory_bytes=1 << 30, pids=256))
    assert time.monotonic() - start < 60
    assert not g.graded and "time limit (15 s" in g.reason
    assert [r.outcome for r in g.rows] == [core.UNGRADED] * len(core.exercises("01"))


@needs_seal
def test_an_honest_class_is_graded_side_by_side(tmp_path, capsys):
    """Three notebooks on two jobs: two graded at once, and two that name the same student kept apart (a class of
    30 is measured by tools/grade_bench, not here). Their 01.zero_state_bytes is left as its stub: what is about
    grading side by side needs no ranks, and honest01 of the attack class passes it on 4 ranks in the seal."""
    solved = {k: sw.STUDENT[k] for k in ("smallest_nd", "block_activation_bytes")}
    for i in range(3):
        data = sw.notebook("01", solved, section_only=True)
        data["metadata"]["course"] = {"student": f"Student {i % 2}"}  # copy0 and copy2 name the same student
        sw.write(tmp_path / f"copy{i}.ipynb", data)
    out = tmp_path / "grades"
    args = [
        "exercises",
        "--grade",
        str(tmp_path),
        "--out",
        str(out),
        "--jobs",
        "2",
        "--names",
        "metadata:course.student",
    ]
    assert cli.main(args) == 0
    table = capsys.readouterr().out
    assert "Student 0 (copy0.ipynb)" in table and "Student 0 (copy2.ipynb)" in table and "Student 1" in table
    document = json.loads((out / "grades.json").read_text())
    rows = [r for g in document["notebooks"] for r in g["rows"]]
    assert len(rows) == 3 * len(core.exercises("01"))
    outcomes = {(r["exercise"], r["outcome"]) for r in rows}
    assert outcomes == {("01.zero_state_bytes", core.NOT_DONE)} | {(f"01.{k}", core.PASSED) for k in solved}, outcomes
    spans = sorted((g["started_at"], g["ended_at"]) for g in document["notebooks"])
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), "no two notebooks were graded at the same time"


def test_a_notebook_is_read_as_data(tmp_path):
    """Which notebook, whose, which cells run: decided from the file, before anything runs."""
    data = sw.notebook("03", {"sharded_step": sw.STUDENT["sharded_step"]}, ["x = 1"])
    path = sw.write(tmp_path / "anything.ipynb", data)
    sub = submission.read_submission(path)
    assert sub.notebook == "03" and sub.student == "anything"
    cells, imports = submission.student_cells(sub)
    ids = {i + 1: c["id"] for i, c in enumerate(data["cells"])}
    ran = [ids[position] for position, _ in cells]
    assert ran[-1] == data["cells"][-1]["id"] and not ran[-1].startswith("03-")  # the student's own cell runs
    assert all(cid.startswith("03-ex-") for cid in ran[:-1]) and len(ran) > 4  # the lecture does not
    assert "from course_utils.labs import lab03" in imports  # its imports do
    bound = submission.bindings(cells, core.exercises("03"))
    assert bound["sharded_step"].kind == "def"
    assert not submission.same_as_reference(core.get("03", "sharded_step"), bound["sharded_step"])
    (tmp_path / "junk.ipynb").write_text("not json")
    with pytest.raises(submission.NotGradable, match="not a readable notebook"):
        submission.read_submission(tmp_path / "junk.ipynb")
    plain = sw.write(tmp_path / "plain.ipynb", {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
    with pytest.raises(submission.NotGradable, match="not a course notebook"):
        submission.read_submission(plain)


def test_what_comes_out_of_the_seal_is_only_data():
    import torch

    from course_utils.exercises import answers

    value = {"a": (1, 2.5, None), 3: [torch.arange(6).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)], "f": len}
    back = calls.decode(json.loads(json.dumps(answers.encode(value))))
    assert back["a"] == (1, 2.5, None) and torch.equal(back[3][0], value[3][0]) and torch.equal(back[3][1], value[3][1])
    assert isinstance(back["f"], calls.Opaque) and "builtin_function_or_method" in repr(back["f"])
    forged = {"__tensor__": ["float32", [4], "AAAA"]}  # 3 bytes for 4 floats
    assert isinstance(calls.decode(forged), calls.Opaque)
    assert isinstance(calls.decode({"__tensor__": ["object", [1], ""]}), calls.Opaque)


def test_without_root_the_grader_says_what_is_missing():
    caps = seal.Capabilities(root=False, unshare=shutil.which("unshare"), cgroup=None)
    missing = " ".join(caps.missing())
    for words in ("a user of its own", "a network namespace", "a PID namespace", "memory and process limits"):
        assert words in missing


def test_without_namespaces_the_seal_still_grades_in_a_fresh_folder(tmp_path):
    """The seal a user without root gets (forced here): a fresh folder, a scrubbed environment, the limits a
    process can set on another, the wall time; the same judges outside it."""
    solved = {k: sw.STUDENT[k] for k in ("zero_state_bytes", "smallest_nd", "block_activation_bytes")}
    where = "import os\nassert os.getcwd().endswith('work') and 'COURSE_TEST_CANARY' not in os.environ, os.getcwd()"
    path = sw.write(tmp_path / "laptop.ipynb", sw.notebook("01", solved, [where], section_only=True))
    caps = seal.Capabilities(root=False, unshare=None, cgroup=None)
    os.environ["COURSE_TEST_CANARY"] = "the teacher's"
    try:
        g = grading.grade_notebook(path, caps=caps)
    finally:
        os.environ.pop("COURSE_TEST_CANARY", None)
    assert [r.outcome for r in g.rows] == [core.PASSED] * len(core.exercises("01")), g.rows
    assert not g.cell_errors, g.cell_errors
