"""course_utils.launch: results per rank, failures, hangs, interrupts, orphans, bad input, and (one launch
watched as it runs, ``listening.watch``) nothing listening beyond loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT, pid_alive, subprocess_tmpdir
from listening import watch

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
    # the traceback starts at the course's own frame: none of the launcher's plumbing (issue 28)
    for plumbing in ("errors/__init__.py", "_agent.py", "course_utils/worker.py", "torch/multiprocessing"):
        assert plumbing not in message, plumbing
    # the logs' folder (a temporary path by default) is said once, at the end
    assert message.count(str(tmp_path)) == 1 and message.rstrip().endswith(f"{tmp_path / 'logs'})")
    assert info.value.log_dir == str(tmp_path / "logs")  # the same folder, for a notebook to point at by name
    assert "To enable traceback see" not in message  # torch's own report stays in the agent's log


def test_hang_in_a_collective_becomes_an_error_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises((WorkerFailed, LaunchTimeout)) as info:
        launch(examples.hang_on_rank, nproc=2, kwargs={"stuck_rank": 1}, timeout_s=3, run_dir=tmp_path, echo=False)
    assert 3 <= time.monotonic() - start < 3 + 3 + 15  # the timeout itself, then grace, start-up and clean-up
    assert "Timed out" in str(info.value) or "did not finish" in str(info.value)
    assert info.value.log_dir == str(tmp_path / "logs")


def test_stuck_workers_are_stopped_and_none_left_behind(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch(
            examples.count_with_progress,
            nproc=2,
            kwargs={"steps": 1000, "delay_s": 0.2},
            timeout_s=2,
            run_dir=tmp_path,
            echo=False,
        )
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


def _files_holding(folder, text: str) -> list:
    """Files under ``folder`` whose bytes contain ``text`` (the caller's environment must be in none)."""
    return [p for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"nproc": 0}, "nproc"),
        ({"nproc": -2}, "nproc"),
        ({"nproc": 2.5}, "nproc"),
        ({"nproc": 2, "backend": "nccl"}, "GPU"),
        ({"nproc": 2, "backend": "mpi"}, "backend"),
        ({"nproc": 2, "mesh_shape": (3,)}, "mesh shape"),
        ({"nproc": 4, "mesh_shape": (3, 2)}, "mesh shape"),
        ({"nproc": 2, "timeout_s": 0}, "timeout"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(tmp_path, kwargs, needle):
    run_dir = tmp_path / "run"
    with pytest.raises(CourseInputError, match=needle):
        launch(examples.all_reduce_demo, run_dir=run_dir, **kwargs)
    assert not run_dir.exists()


def test_functions_defined_in_a_cell_launch_by_value(tmp_path):
    offset = 10

    def local_fn(n):  # a closure: it travels by value, with the variable it reads
        import torch.distributed as tdist

        from course_utils import dist as cdist

        with cdist.session() as info:
            x = torch.full((1,), float(info.rank + offset + n))
            tdist.all_reduce(x)
            return float(x)

    import torch

    main_fn = type(local_fn)(local_fn.__code__, local_fn.__globals__, "cell_fn", None, local_fn.__closure__)
    main_fn.__module__ = "__main__"
    for fn in (local_fn, main_fn):
        result = launch(fn, nproc=2, args=(1,), run_dir=tmp_path / fn.__name__, echo=False)
        assert dict(result) == {0: 23.0, 1: 23.0}  # (0 + 11) + (1 + 11)
        assert result.command.startswith("# ") and "put it in a .py module" in result.command
    assert launch(lambda: 7, nproc=1, echo=False) == {0: 7}
    with pytest.raises(CourseInputError, match="cannot import"):
        launch("course_utils.examples:no_such_function", nproc=1, run_dir=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_function_holding_a_lock_is_refused_in_one_sentence(tmp_path):
    import threading

    lock = threading.Lock()

    def uses_lock():
        with lock:
            return 1

    with pytest.raises(CourseInputError, match="cannot be copied to another process") as info:
        launch(uses_lock, nproc=1, run_dir=tmp_path / "run")
    assert "\n" not in str(info.value) and not (tmp_path / "run").exists()


def test_torchrun_command_for_several_nodes():
    cmd = torchrun_command(
        "course_utils.examples:all_reduce_demo", 8, kwargs={"n": 2}, nnodes=2, rdzv_endpoint="node0:29400"
    )
    assert cmd.startswith("torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --nproc-per-node 8")
    assert """--kwargs '{"n": 2}'""" in cmd
    # a job's own rendezvous id, left to the shell to expand (torchrun's default, "none", is shared by every job)
    assert "--rdzv-id $JOB_ID " in cmd and "--max-restarts" not in cmd
    restarting = torchrun_command(
        "m:f", 8, nnodes=2, rdzv_endpoint="node0:29400", max_restarts=3, rdzv_id="${SLURM_JOB_ID}"
    )
    assert "--nproc-per-node 8 --max-restarts 3 --rdzv-id ${SLURM_JOB_ID} -m course_utils.worker m:f" in restarting
    assert "--rdzv-id" not in torchrun_command("m:f", 2)
    assert """--args '["$JOB_ID"]'""" in torchrun_command("m:f", 2, args=["$JOB_ID"])  # only a whole word is left bare


def test_readme_multi_node_lines_restart_and_name_the_job():
    """The README's multi-node lines are the one notebook 00 prints (00's c23 teaches the defaults end the job)."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.replace("\\\n", " ") for b in text.split("```bash\n")[1:]]
    lines = [" ".join(b.split("```")[0].split()) for b in blocks if "--nnodes" in b.split("```")[0]]
    two_node = torchrun_command(
        "course_utils.examples:all_reduce_demo", 8, nnodes=2, rdzv_endpoint="node0:29400", max_restarts=3
    )
    assert two_node in lines
    assert len(lines) == 2 and all("--max-restarts 3" in line and "--rdzv-id" in line for line in lines)


def test_same_worker_runs_under_plain_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_utils.worker",
            "course_utils.examples:all_reduce_demo",
            "--kwargs",
            '{"n": 2}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": subprocess_tmpdir()},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["result"]["result"] == [3.0, 3.0] for r in results)


# ---------------------------------------------------------------- issue 14: what a launch promises


def _env_value(name):
    import os

    return os.environ.get(name)


def test_each_launch_sees_the_callers_environment_as_it_is_then(monkeypatch):
    monkeypatch.setenv("COURSE_TEST_FOO", "first")
    assert launch(_env_value, nproc=1, args=("COURSE_TEST_FOO",), echo=False) == {0: "first"}
    monkeypatch.setenv("COURSE_TEST_FOO", "second")
    assert launch(_env_value, nproc=2, args=("COURSE_TEST_FOO",), echo=False) == {0: "second", 1: "second"}
    monkeypatch.delenv("COURSE_TEST_FOO")
    assert launch(_env_value, nproc=1, args=("COURSE_TEST_FOO",), echo=False) == {0: None}


def test_the_callers_sys_path_reaches_the_workers(tmp_path, monkeypatch):
    (tmp_path / "student_helpers.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import student_helpers

    def uses_module(x):  # defined here, so by value; it imports the student's module by name
        import student_helpers as sh

        return sh.triple(x)

    assert launch(student_helpers.triple, nproc=1, args=(5,), echo=False) == {0: 15}  # by name
    assert launch(uses_module, nproc=2, args=(2,), echo=False) == {0: 6, 1: 6}


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1, "5"])
def test_timeouts_that_would_never_fire_are_refused(tmp_path, timeout_s):
    with pytest.raises(CourseInputError, match="finite number of seconds"):
        launch(examples.all_reduce_demo, nproc=1, timeout_s=timeout_s, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _returns_a_lock():
    import threading

    return threading.Lock()


def test_an_unpicklable_result_names_the_rank_and_the_cause(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        launch(_returns_a_lock, nproc=2, run_dir=tmp_path, echo=False)
    message = str(info.value)
    assert "cannot be sent back" in message and "_thread.lock" in message
    assert "died without a Python error" not in message


def _exit_on_rank(bad_rank, code):
    import os

    import torch.distributed as tdist

    from course_utils import dist as cdist

    with cdist.session() as info:
        tdist.barrier()
        if info.rank == bad_rank:
            os._exit(code)
        tdist.barrier()
        return info.rank


def test_a_failing_rank_reports_its_own_exit_code(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        launch(_exit_on_rank, nproc=2, args=(1, 3), run_dir=tmp_path, echo=False)
    assert info.value.rank == 1 and info.value.exitcode == 3
    assert "exit code 3" in str(info.value)


def test_a_hang_names_the_rank_that_never_arrived_and_where_it_was(tmp_path):
    with pytest.raises(WorkerFailed) as info:
        launch(examples.hang_on_rank, nproc=2, kwargs={"stuck_rank": 1}, timeout_s=3, run_dir=tmp_path, echo=False)
    message = str(info.value)
    assert "Timed out" in message  # the collective's own error: a timeout, not some other failure
    assert message.startswith("rank 0 timed out in a collective that rank(s) 1 never reached")
    assert "rank 1: in hang_on_rank (examples.py" in message and "time.sleep(seconds)" in message
    assert "rank 0: raised: its collective timed out" in message


def _free_ddp_while_gloo_needs_the_gil() -> bool:
    """A DDP step inside ``cdist.session()``, then return while one of gloo's threads needs the GIL.

    The hang of a rank that returned and never finished, made certain: the function's DDP module
    (whose C++ Reducer holds the group after ``destroy_process_group``) is freed as the function
    returns, while a callback on gloo's worker thread waits to take the GIL back. In the runs it
    was gloo's thread retiring a backward's last all-reduce (``course_utils.dist.shutdown`` says
    why that needs the GIL). Rank 0 returns whether the callback ran on gloo's thread, as it must.
    """
    import os
    import threading
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from course_utils import dist as cdist

    attached = Path(os.environ["COURSE_PROGRESS_DIR"]) / "callback-attached"
    go, ran_on = threading.Event(), []

    def needs_the_gil(fut):
        ran_on.append(threading.get_ident())
        go.wait(60)  # with the GIL released; then, in the destructor's time...
        time.sleep(0.5)
        return fut.value()  # ...this needs it back

    with cdist.session() as info:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
        ddp(torch.ones(2, 4)).sum().backward()
        while info.rank == 1 and not attached.exists():  # rank 1 joins once rank 0's callback is on
            time.sleep(0.01)
        work = dist.all_reduce(torch.ones(1), async_op=True)
        if info.rank == 0:  # the work completes only once its callback has: no wait() here
            work.get_future().then(needs_the_gil)  # pending until rank 1 joins: gloo's thread runs it
            attached.touch()
            while not ran_on:
                time.sleep(0.01)
        else:
            work.wait()
    go.set()
    return info.rank == 1 or ran_on != [threading.get_ident()]


def test_a_rank_that_used_ddp_in_a_session_finishes_after_returning(tmp_path):
    """The group a DDP module still holds is freed with the GIL released (course_utils.dist.shutdown);
    before, rank 0 hung for ever in ProcessGroupGloo's destructor as the function returned."""
    result = launch(
        _free_ddp_while_gloo_needs_the_gil,
        nproc=2,
        backend="gloo",
        timeout_s=20,
        run_dir=tmp_path,
        echo=False,
        progress=False,
    )
    assert dict(result) == {0: True, 1: True}


def _stack_dump(frames: list[tuple[str, int, str]]) -> str:
    """A faulthandler dump as a worker writes it on SIGUSR1: gloo's thread (no Python frame), then the main one."""
    lines = ["Thread 0x00007f1ac52686c0 (most recent call first):", "  <no Python frame>", ""]
    lines.append("Current thread 0x00007f1aeadefb80 (most recent call first):")
    return "\n".join(lines + [f'  File "{path}", line {n} in {func}' for path, n, func in frames]) + "\n"


def test_a_rank_stuck_after_its_function_returned_is_reported_as_such(tmp_path):
    """Rank 1's stack as in the hang of a full test run (2026-12-01): at the call of its function, no deeper
    Python frame. It had returned and was stuck freeing the function's variables: neither 'returned' nor
    a rank that never reached a collective."""
    from pathlib import Path as _Path

    import torch

    from course_utils import _report, worker

    torch_dir, here = _Path(torch.__file__).parent, worker.__file__
    bottom = [
        (here, 140, "run_in_worker"),
        (str(torch_dir / "distributed/elastic/multiprocessing/errors/__init__.py"), 367, "wrapper"),
        (str(torch_dir / "distributed/elastic/multiprocessing/api.py"), 706, "_wrap"),
    ]
    (tmp_path / "result-rank0.pkl").write_bytes(b"")  # rank 0 returned and waits in torch's _wrap
    (tmp_path / "stack-rank0.txt").write_text(_stack_dump(bottom[2:]))
    (tmp_path / "stack-rank1.txt").write_text(_stack_dump([(here, 160, "run_the_function"), *bottom]))
    (tmp_path / "stack-rank2.txt").write_text(
        _stack_dump([(examples.__file__, 52, "hang_on_rank"), (here, 160, "run_the_function"), *bottom])
    )
    ranks = {int(k[4:]): w for k, w in _report.where_ranks_were(tmp_path, 3).items() if k != "agent"}
    assert ranks[0] == "returned its result"
    assert ranks[1].startswith("stuck after its function returned, in native code")
    assert ranks[2].startswith("in hang_on_rank (examples.py line 52")  # still inside its function
    message = str(_report.timeout_error(ranks, "?", None, 30, 30, "", tmp_path))
    assert "Rank(s) 1 returned from the function but never finished" in message
    assert "never reached the collective" not in message


def test_a_timed_out_run_says_where_every_process_was(tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch(
            examples.count_with_progress,
            nproc=2,
            kwargs={"steps": 1000, "delay_s": 0.2},
            timeout_s=2,
            run_dir=tmp_path,
            echo=False,
        )
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank}: in count_with_progress (examples.py" in message
    assert "agent: " in message and str(tmp_path) in message


def _freeze_the_agent_then_return(value):
    """Rank 0 stops its agent (SIGSTOP) before returning: a test double of an agent that never
    collects the workers' results, the stall of issue 14.

    The agent also hosts the store the ranks met through, so rank 0 stops it only once every other
    rank has left the process group (each leaves a file saying so).
    """
    import os
    import signal
    import time
    from pathlib import Path

    from course_utils import dist as cdist

    folder = Path(os.environ["COURSE_PROGRESS_DIR"])
    with cdist.session() as info:
        rank, world = info.rank, info.world_size
    (folder / f"left-{rank}").touch()
    if rank == 0:
        deadline = time.monotonic() + 30
        while not all((folder / f"left-{r}").exists() for r in range(world)) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getppid(), signal.SIGSTOP)
    return value + rank


def test_an_agent_that_never_collects_does_not_stall_the_caller(tmp_path, monkeypatch, capsys):
    from course_utils import launch as launch_module

    monkeypatch.setattr(launch_module, "COLLECT_GRACE_S", 1.0)
    start = time.monotonic()
    result = launch(_freeze_the_agent_then_return, nproc=2, args=(10,), timeout_s=60, run_dir=tmp_path, echo=False)
    assert dict(result) == {0: 10, 1: 11}
    assert time.monotonic() - start < 40  # not the 60 s timeout (+ grace): the caller took the results
    assert "had not collected the results" in capsys.readouterr().err


def test_a_timeout_after_every_rank_returned_blames_the_agent_not_a_collective(tmp_path, monkeypatch):
    from course_utils import launch as launch_module

    monkeypatch.setattr(launch_module, "COLLECT_GRACE_S", 1e9)
    with pytest.raises(LaunchTimeout) as info:
        launch(_freeze_the_agent_then_return, nproc=2, args=(10,), timeout_s=3, run_dir=tmp_path, echo=False)
    message = str(info.value)
    assert "Every rank had returned its result, but torch's elastic agent did not collect" in message
    assert "rank 0: returned its result" in message and "rank 1: returned its result" in message
    assert "collective was probably" not in message


def test_the_final_progress_line_says_how_each_rank_ended(tmp_path):
    from course_utils.launch import _Progress

    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "step": 3, "total": 8, "pid": 1}))
    status = _Progress(tmp_path, 3, enabled=False)
    assert status.line(1.0) == "[  1.0s] rank 0: 3/8 | rank 1: starting | rank 2: starting"
    final = status.line(2.0, final={0: "failed", 1: "done"})
    assert final == "[  2.0s] rank 0: failed (at 3/8) | rank 1: done | rank 2: killed"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """One Python, as a kernel: Ctrl-C while its very first launch waits for the cold agent server, two
    launches after it, then Ctrl-C from outside while a third launch's workers run (sent once both report
    progress). Watched as it runs (``listening.watch``, issue 34) for sockets beyond loopback."""
    folder = tmp_path_factory.mktemp("interrupted")
    first, running = folder / "first", folder / "running"
    secret = f"caller-secret-{os.getpid()}-{time.time_ns()}"
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even under `make test &`
        from course_utils import examples
        from course_utils.launch import launch
        # The interrupt lands while launch() waits for the cold agent server's answer.
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            launch(examples.pid_of_rank, nproc=2, run_dir={str(first)!r}, echo=False)
            print("NOT INTERRUPTED", flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        for n in (2, 3):
            out = launch(examples.all_reduce_demo, nproc=n, kwargs={{"n": 1}}, echo=False)
            print("RESULT", n, sorted(out), [v["result"] for v in out.values()], flush=True)
        try:
            launch(examples.count_with_progress, nproc=2, kwargs={{"steps": 1000, "delay_s": 0.2}},
                   timeout_s=120, run_dir={str(running)!r}, echo=False)
        except KeyboardInterrupt as exc:
            print("INTERRUPTED:", exc, flush=True)
            sys.exit(3)
    """)
    workers = []

    def ctrl_c_once_both_run(proc) -> bool:
        if not workers and len(_progress_pids(running)) == 2:
            workers.extend(_progress_pids(running))
            proc.send_signal(signal.SIGINT)
        return False  # the script ends by itself

    env = {**os.environ, "COURSE_TEST_CALLER_SECRET": secret}
    seen, proc = watch([sys.executable, "-c", script], cwd=ROOT, env=env, until=ctrl_c_once_both_run, timeout_s=180)
    time.sleep(1.0)  # the cancelled agent, if it had been forked, ends itself within 0.25 s
    return dict(proc=proc, seen=seen, workers=workers, first=first, running=running, secret=secret)


def test_an_interrupt_during_the_first_launch_leaves_nothing_and_the_next_launch_right(interrupted):
    out = interrupted["proc"].output
    assert "INTERRUPTED" in out.splitlines() and "NOT INTERRUPTED" not in out, out[-2000:]
    assert "RESULT 2 [0, 1] [[3.0], [3.0]]" in out
    assert "RESULT 3 [0, 1, 2] [[6.0], [6.0], [6.0]]" in out
    assert not _processes_mentioning(str(interrupted["first"])), "a process of the interrupted launch outlived it"
    assert interrupted["seen"] == set(), f"listening beyond loopback: {sorted(interrupted['seen'])}"


def test_interrupt_stops_every_worker(interrupted):
    proc, pids = interrupted["proc"], interrupted["workers"]
    assert len(pids) == 2, "workers never started"
    out = proc.output
    assert proc.returncode == 3 and "every process of the run (2 workers and their agent) was stopped" in out, out[
        -2000:
    ]
    assert not any(pid_alive(p) for p in pids)
    running = interrupted["running"]
    assert _files_holding(running, interrupted["secret"]) == [], "a file of the run holds the caller's environment"


def _processes_mentioning(text):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if text.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return [p for p in found if pid_alive(p)]


def test_a_killed_kernel_takes_its_runs_with_it_even_when_a_worker_ignores_sigterm(tmp_path):
    secret = f"caller-secret-{os.getpid()}-{time.time_ns()}"
    script = textwrap.dedent(f"""
        from course_utils.launch import launch
        from tests_helpers_sigterm import stubborn
        launch(stubborn, nproc=2, run_dir={str(tmp_path / "run")!r}, timeout_s=600, echo=False)
    """)
    (tmp_path / "tests_helpers_sigterm.py").write_text(
        textwrap.dedent("""
        import os, signal, time
        from course_utils import dist as cdist
        def stubborn():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            cdist.report_progress(1, 2)
            time.sleep(600)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "COURSE_TEST_CALLER_SECRET": secret},
    )
    deadline = time.monotonic() + 60
    while len(_progress_pids(tmp_path / "run")) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _progress_pids(tmp_path / "run")
    assert len(pids) == 2, "workers never started"
    proc.kill()  # the kernel dies: nobody is left to stop the run
    proc.wait()
    deadline = time.monotonic() + 10  # the agent's own grace for stubborn workers is 30 s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), "workers outlived their killed kernel"
    left = _processes_mentioning(str(tmp_path / "run"))
    assert not left, [(p, open(f"/proc/{p}/cmdline").read(), open(f"/proc/{p}/stat").read()[:80]) for p in left]
    assert _files_holding(tmp_path / "run", secret) == [], "a file of the killed run holds the caller's environment"


def test_three_collectives_in_a_world_of_one(monkeypatch):
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = examples.three_collectives(8)  # one rank: it owns the whole vector, and every sum is its own
    assert out["broadcast"] == [1.0] * 8
    assert out["all_gather"] == [float(i) for i in range(8)]
    assert out["reduce_scatter"] == [float(i + 1) for i in range(8)]  # rank 0's own (0 + 1)(i + 1), nothing added


def test_a_world_of_one_frees_the_group_it_left_only_when_the_next_one_starts(monkeypatch):
    """In a notebook's own process the group a session left is kept (a DDP module the cell made may still
    hold it: course_utils.dist.shutdown) and freed when the next session starts, before its new group."""
    import torch.distributed as dist

    from course_utils import dist as cdist

    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with cdist.session(backend="gloo"):
        first = dist.group.WORLD
    assert not dist.is_initialized() and cdist._left_groups == [first]
    with cdist.session(backend="gloo"):
        assert cdist._left_groups == [] and dist.group.WORLD is not first
    cdist.release_left_groups()


def test_background_returns_raises_and_stops_on_timeout():
    """launch.Background (notebook 05b): the value comes back, an exception is raised here, and a run past
    its timeout is ended, not left running."""
    import math as _math
    import time as _time

    from course_utils.launch import Background, LaunchTimeout

    assert Background(_math.factorial, 5).result(timeout_s=60) == 120
    with pytest.raises(ValueError):
        Background(_math.factorial, -1).result(timeout_s=60)
    job = Background(_time.sleep, 60)
    with pytest.raises(LaunchTimeout):
        job.result(timeout_s=1)
    assert job._proc.poll() is not None  # the process is gone


def test_background_times_its_cold_start(tmp_path, monkeypatch):
    """``cold_start_s`` (notebook 06's cold restart) spans the new process's imports: a module that takes
    0.5 s to import shows at least that, and a module already imported elsewhere does not make it warm."""
    module = "import math, time\n\ntime.sleep(0.5)\n\n\ndef factorial(n):\n    return math.factorial(n)\n"
    (tmp_path / "slow_to_import.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import slow_to_import

    from course_utils.launch import Background

    job = Background(slow_to_import.factorial, 4)
    cold = job.cold_start_s(timeout_s=60)
    assert job.result(timeout_s=60) == 24
    assert 0.5 <= cold < 30, cold


# ---------------------------------------------------------------- issue 34: a worker that vanishes says why, at once


def _raises_keyboard_interrupt_on(bad_rank):
    import torch.distributed as tdist

    from course_utils import dist as cdist

    with cdist.session() as info:
        tdist.barrier()
        if info.rank == bad_rank:
            raise KeyboardInterrupt
        tdist.barrier()  # the other rank waits here for a peer that will never come
        return info.rank


def test_a_keyboard_interrupt_in_a_worker_is_reported_at_once_as_an_error(tmp_path):
    """torch's worker wrapper swallows KeyboardInterrupt (the process exits 0 with no result): the run used to
    wait for its whole timeout and then blame a hang; it is one WorkerFailed naming the rank and the line."""
    with pytest.raises(WorkerFailed) as info:
        launch(_raises_keyboard_interrupt_on, nproc=2, args=(1,), timeout_s=60, run_dir=tmp_path, echo=False)
    message = str(info.value)
    assert info.value.rank == 1 and "raised KeyboardInterrupt" in message
    assert "raise KeyboardInterrupt" in message and "test_launch.py" in message  # the line that raised


def _waits_on_rank(slow_rank):
    import time as _time

    import torch.distributed as tdist

    from course_utils import dist as cdist

    with cdist.session() as info:
        tdist.barrier()
        cdist.report_progress(1, 2)
        if info.rank == slow_rank:
            _time.sleep(600)
        tdist.barrier()
        return info.rank


def test_sigint_to_one_worker_is_reported_at_once_with_where_it_was(tmp_path):
    """Used to wait ~38 s and blame "a lost GPU"; the rank is named, with the signal and the line it was on."""
    import threading

    def interrupt_rank_1():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = {
                json.loads(f.read_text())["rank"]: json.loads(f.read_text())["pid"]
                for f in tmp_path.glob("launch-*/rank*.json")
            }
            if 1 in pids:
                time.sleep(0.5)  # inside its sleep
                os.kill(pids[1], signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_rank_1, daemon=True).start()
    with pytest.raises(WorkerFailed) as info:
        launch(_waits_on_rank, nproc=2, args=(1,), timeout_s=60, run_dir=tmp_path, echo=False)
    message = str(info.value)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGINT
    assert "rank 1 was ended by SIGINT" in message and "lost GPU" not in message
    assert "rank 1 was in _waits_on_rank (test_launch.py" in message and "_time.sleep(600)" in message


def test_the_status_line_is_cleared_when_a_notebook_run_ends(tmp_path, monkeypatch):
    """A progress line is not an answer: in a notebook its output is emptied when the run ends (issue 28), to an
    empty bundle: an empty "text/plain" would stay in the saved notebook and be drawn as a blank box (issue 30)."""
    from course_utils.launch import _Progress

    class Handle:
        def __init__(self):
            self.shown = []

        def update(self, data, raw=True):
            self.shown.append(data)

    monkeypatch.setitem(sys.modules, "ipykernel", object())
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "step": 3, "total": 8, "pid": 1}))
    status = _Progress(tmp_path, 1, enabled=True)
    status.handle = Handle()
    status.update(5.0)
    status.update(6.0, final={0: "done"})
    assert status.handle.shown[0]["text/plain"].startswith("[  5.0s] rank 0: 3/8") and status.handle.shown[-1] == {}


def _temp_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


def test_torch_error_files_stay_in_the_run_folder_and_workers_keep_the_usual_temp_dir(tmp_path):
    """torch's process starter leaves a ``pytorch-errorfile-*.pickle`` for every worker that failed or was killed:
    inside the run's folder they go with it (and beside a failed run's logs), never piling up in /tmp. The
    user's code in a worker still gets the usual temporary folder."""
    import tempfile

    with pytest.raises(WorkerFailed):
        launch(examples.fail_on_rank, nproc=2, kwargs={"bad_rank": 1}, echo=False, run_dir=str(tmp_path / "run"))
    assert len(list((tmp_path / "run").rglob("pytorch-errorfile-*.pickle"))) == 2  # one per worker, in the run
    assert set(launch(_temp_dir, nproc=2, echo=False).values()) == {tempfile.gettempdir()}


def test_the_agents_faster_rendezvous_names_events_and_pauses_as_torch_does(monkeypatch):
    """The agent replaces two helpers of torch's rendezvous (``_agent_patches.rendezvous_without_stack_walks``): the
    event names must stay torch's own (the caller of ``_record``, read with ``inspect.stack()``), and only the
    random skew between nodes is skipped, not the fixed polls between rounds."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from course_utils import _agent_patches

    original_name = dr.get_method_name
    slept = []
    monkeypatch.setattr(dr, "get_method_name", dr.get_method_name)  # restored after the test
    monkeypatch.setattr(dr, "_delay", lambda seconds: slept.append(seconds))
    _agent_patches.rendezvous_without_stack_walks()

    def _record():
        return original_name(), dr.get_method_name()

    def next_rendezvous():
        return _record()

    assert next_rendezvous() == ("next_rendezvous", "next_rendezvous")
    dr._delay(seconds=(0, 0.3))
    dr._delay(seconds=1)
    assert slept == [1]
    assert dr.get_method_name(depth=10_000) == "no_method_name"


def test_the_summary_line_drops_torchs_build_path(tmp_path):
    """gloo's messages open with the file torch was built from: the student's summary drops it, the log keeps it."""
    from course_utils import _agent

    attempt = tmp_path / "logs" / "run1_x" / "attempt_0" / "0"
    attempt.mkdir(parents=True)
    text = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
    (attempt / "error.json").write_text(json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": ""}}}))
    cause = _agent.root_cause(str(tmp_path / "logs"))
    assert cause["message"].startswith("rank 0 raised first (attempt 0): RuntimeError: Timed out"), cause
    assert "__w" not in cause["message"] and text in (attempt / "error.json").read_text()


def test_each_later_rank_is_named_with_its_own_first_line(tmp_path):
    """A survivor's own error is a race (the agent's SIGTERM, or a collective that lost its peer first): the
    summary names each later rank with the first line of the error it really reported, not a guess."""
    from course_utils import _agent

    attempt = tmp_path / "logs" / "run3_x" / "attempt_0"
    reports = {
        1: "RuntimeError: rank 1 fails on purpose",
        0: "SignalException: Process 27006 got signal: 15",
        2: "RuntimeError: [/__w/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:31895. This is typically...",
    }
    for rank, text in reports.items():  # written in this order: rank 1 first
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "error.json").write_text(
            json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": ""}}})
        )
        time.sleep(0.01)
    cause = _agent.root_cause(str(tmp_path / "logs"))
    assert cause["rank"] == 1, cause
    assert cause["message"].endswith(
        "rank(s) 0, 2 failed after it:\n"
        "  rank 0 was stopped by the agent: SignalException: Process 27006 got signal: 15\n"
        "  rank 2 lost a peer: RuntimeError: Connection closed by peer [127.0.0.1]:31895"
    ), cause["message"]


def test_an_error_file_cut_short_is_a_consequence_not_the_cause(tmp_path):
    """torch writes a worker's error.json in place; a survivor stopped by the agent while writing it leaves an
    empty file (seen once in a full test run). The rank with a whole report is still named as the cause, and the
    per-attempt rows of notebook 06 read on."""
    from course_utils import _agent, recovery

    attempt = tmp_path / "_launch" / "logs" / "run7_x" / "attempt_0"
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "stdout.log").write_text("step 2 done\n")
    (attempt / "1" / "error.json").write_text(
        json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": ""}}})
    )
    time.sleep(0.01)
    (attempt / "0" / "error.json").write_text("")  # rank 0, stopped while writing, after rank 1 failed
    cause = _agent.root_cause(str(tmp_path / "_launch" / "logs"))
    assert cause["rank"] == 1 and "ValueError: bad batch" in cause["message"], cause
    assert "rank(s) 0 failed after it" in cause["message"]
    rows = recovery.attempt_logs(tmp_path, "run7")
    assert [(r["rank"], r["last_step_done"], r["ending"]) for r in rows] == [
        (0, 2, recovery.ENDINGS["stopped"]),
        (1, 2, recovery.ENDINGS["raised"]),
    ]


def _abort_on_rank_1():
    import torch.distributed as dist

    from course_utils import dist as cdist

    with cdist.session() as info:
        if info.rank == 1:
            os.abort()  # a native crash: SIGABRT, no Python error (the glibc heap checks end a process this way)
        dist.barrier()


def test_a_native_crash_says_where_the_rank_was(tmp_path):
    """A rank ended by SIGABRT leaves no Python error; faulthandler dumps its stack first, so the error names the
    signal and the frame the rank was in (the run's folder, where the dump lives, may be gone when CI reads it)."""
    with pytest.raises(WorkerFailed) as info:
        launch(_abort_on_rank_1, nproc=2, run_dir=tmp_path, echo=False)
    text = str(info.value)
    assert "SIGABRT" in text and "rank 1 was" in text and "_abort_on_rank_1" in text, text
