"""course_utils.launch: results per rank, failures, hangs, interrupts, orphans, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, pid_alive

from course_utils import examples
from course_utils.errors import CourseInputError
from course_utils.launch import LaunchTimeout, WorkerFailed, launch, torchrun_command


def _progress_pids(run_dir):
    pids = []
    for f in run_dir.glob("launch-*/rank*.json"):
        pids.append(json.loads(f.read_text())["pid"])
    return pids


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_launch_returns_one_result_per_rank(nproc):
    result = launch(examples.all_reduce_demo, nproc=nproc, kwargs={"n": 3}, echo=False)
    assert sorted(result) == list(range(nproc))
    total = nproc * (nproc + 1) / 2
    for rank, value in result.items():
        assert value["rank"] == rank and value["world_size"] == nproc
        assert value["result"] == [total] * 3
    assert result.backend == "gloo" and result.device_type == "cpu"
    assert result.command.startswith(f"torchrun --standalone --nproc-per-node {nproc} -m course_utils.worker")
    assert "course_utils.examples:all_reduce_demo" in result.command
    assert not any(pid_alive(v["pid"]) for v in result.values()), "workers outlived the run"


def test_launch_leaves_kernel_signal_handlers_alone():
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    before = [signal.getsignal(s) for s in sigs]
    launch(examples.all_reduce_demo, nproc=2, echo=False)
    assert [signal.getsignal(s) for s in sigs] == before


def test_failing_rank_is_named_with_its_traceback(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        launch(examples.fail_on_rank, nproc=2, kwargs={"bad_rank": 1}, run_dir=tmp_path, echo=False)
    assert info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message and "fails on purpose" in message
    assert "Traceback" in message and "examples.py" in message


def test_hang_in_a_collective_becomes_an_error_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises((WorkerFailed, LaunchTimeout)) as info:
        launch(examples.hang_on_rank, nproc=2, kwargs={"stuck_rank": 1}, timeout_s=3, run_dir=tmp_path, echo=False)
    assert time.monotonic() - start < 3 + 3 + 15  # timeout, grace, start-up and clean-up
    assert "Timed out" in str(info.value) or "did not finish" in str(info.value)


def test_stuck_workers_are_stopped_and_none_left_behind(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch(examples.count_with_progress, nproc=2, kwargs={"steps": 1000, "delay_s": 0.2},
               timeout_s=2, run_dir=tmp_path, echo=False)
    assert "rank 0:" in str(info.value)  # last progress per rank is reported
    assert "still making progress" in str(info.value)  # slow, not hung: the message says to raise timeout_s
    pids = _progress_pids(tmp_path)
    assert len(pids) == 2
    time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids), "a worker outlived its launch"


def test_failure_leaves_no_orphans(tmp_path):
    with pytest.raises(WorkerFailed):
        launch(examples.fail_after_progress, nproc=2, run_dir=tmp_path, echo=False)
    pids = _progress_pids(tmp_path)
    assert len(pids) == 2
    time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids)


def test_interrupt_stops_every_worker(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from course_utils import examples
        from course_utils.launch import launch
        try:
            launch(examples.count_with_progress, nproc=2, kwargs={{"steps": 1000, "delay_s": 0.2}},
                   timeout_s=120, run_dir={str(tmp_path)!r}, echo=False)
        except KeyboardInterrupt as exc:
            print("INTERRUPTED:", exc, flush=True)
            sys.exit(3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(_progress_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _progress_pids(tmp_path)
    assert len(pids) == 2, "workers never started"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3 and "all 2 worker processes were stopped" in out
    time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("kwargs, needle", [
    ({"nproc": 0}, "nproc"),
    ({"nproc": -2}, "nproc"),
    ({"nproc": 2.5}, "nproc"),
    ({"nproc": 2, "backend": "nccl"}, "GPU"),
    ({"nproc": 2, "backend": "mpi"}, "backend"),
    ({"nproc": 2, "mesh_shape": (3,)}, "mesh shape"),
    ({"nproc": 4, "mesh_shape": (3, 2)}, "mesh shape"),
    ({"nproc": 2, "timeout_s": 0}, "timeout"),
])
def test_bad_input_is_refused_before_anything_starts(tmp_path, kwargs, needle):
    run_dir = tmp_path / "run"
    with pytest.raises(CourseInputError, match=needle):
        launch(examples.all_reduce_demo, run_dir=run_dir, **kwargs)
    assert not run_dir.exists()


def test_functions_workers_cannot_import_are_refused(tmp_path):
    def local_fn():
        return 1
    with pytest.raises(CourseInputError, match="lambda"):
        launch(lambda: 1, nproc=1, run_dir=tmp_path / "a")
    with pytest.raises(CourseInputError, match="put it in a module"):
        launch(local_fn, nproc=1, run_dir=tmp_path / "b")
    main_fn = type(local_fn)(local_fn.__code__, {})
    main_fn.__module__ = "__main__"
    with pytest.raises(CourseInputError, match="put it in a module"):
        launch(main_fn, nproc=1, run_dir=tmp_path / "c")
    with pytest.raises(CourseInputError, match="cannot import"):
        launch("course_utils.examples:no_such_function", nproc=1, run_dir=tmp_path / "d")
    assert not any((tmp_path / x).exists() for x in "abcd")


def test_torchrun_command_for_several_nodes():
    cmd = torchrun_command("course_utils.examples:all_reduce_demo", 8, kwargs={"n": 2}, nnodes=2,
                           rdzv_endpoint="node0:29400")
    assert cmd.startswith("torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --nproc-per-node 8")
    assert """--kwargs '{"n": 2}'""" in cmd


def test_same_worker_runs_under_plain_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "course_utils.worker",
                          "course_utils.examples:all_reduce_demo", "--kwargs", '{"n": 2}'],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["result"]["result"] == [3.0, 3.0] for r in results)
