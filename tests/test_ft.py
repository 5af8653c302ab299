"""TorchFT runs (course_utils.ft, notebook 06): survivors keep stepping, a restarted group heals bit for bit.

Two real runs, shared by the tests: one group dies inside the gradient all-reduce of step 3, and
(in the other run) the other group dies between steps. Each group writes its own weights hash, so
"equal" compares what two processes computed independently.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
from conftest import pid_alive

from course_utils import cli
from course_utils.ft import INSTALL_HINT, ft_run
from course_utils.launch import LaunchTimeout

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason=INSTALL_HINT)

STEPS, KILL_STEP = 12, 3


@pytest.fixture(scope="module")
def in_allreduce():
    return ft_run(replicas=2, steps=STEPS, kill=f"1:{KILL_STEP}", during_allreduce=True, restart_after=2)


@pytest.fixture(scope="module")
def between_steps():
    return ft_run(replicas=2, steps=STEPS, kill=f"0:{KILL_STEP}", restart_after=2)


def test_the_survivor_keeps_stepping(in_allreduce):
    rows = in_allreduce["per_step"]
    assert all(row["committed"] and 0 in row["replicas"] for row in rows)  # survivor 0 committed every step
    alone = [row["step"] for row in rows if row["replicas"] == [0] and row["participants"] == 1]
    # the job manager restarts the dead group only after the survivor committed 2 steps without it
    assert len(alone) >= 2 and min(alone) == KILL_STEP
    assert in_allreduce["steps_while_away"] == len(alone)
    assert in_allreduce["stall_s"] is not None and in_allreduce["lost_s"] is not None


def test_the_healed_group_ends_with_the_survivors_weights(in_allreduce, between_steps):
    for run, dead in ((in_allreduce, 1), (between_steps, 0)):
        assert run["killed"]["replica"] == dead
        assert run["healed_to_step"] > KILL_STEP and run["heal_s"] is not None  # copied from a live peer
        assert run["final_steps"] == {"0": STEPS, "1": STEPS}
        hashes = run["weights_sha256"]
        assert hashes["0"] == hashes["1"] and run["weights_equal"]


def test_a_failure_inside_the_allreduce_discards_that_step_only(in_allreduce, between_steps):
    assert in_allreduce["killed"]["where"] == "allreduce"
    assert in_allreduce["discarded_steps"] == [KILL_STEP] and in_allreduce["steps_discarded"] == 1
    assert between_steps["killed"]["where"] == "between"
    assert between_steps["steps_discarded"] == 0  # nothing was in flight: nothing to throw away
    assert all(row["committed"] for row in between_steps["per_step"])


def _refused(address: str) -> bool:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


def test_nothing_is_left_running(in_allreduce, between_steps):
    for run in (in_allreduce, between_steps):
        assert len(run["pids"]) == 1 + 3  # the job manager, two groups and one restart
        assert not any(pid_alive(pid) for pid in run["pids"])
        assert run["lighthouse"].startswith("http://127.0.0.1:") and _refused(run["lighthouse"])


def test_a_timeout_stops_everything(tmp_path):
    with pytest.raises(LaunchTimeout):
        ft_run(replicas=2, steps=100_000, timeout_s=1.0, run_dir=tmp_path)  # far more steps than 1 s allows
    pids = [int(p) for p in (tmp_path / "pids.txt").read_text().split()]  # the job manager, then each group
    assert pids and not any(pid_alive(pid) for pid in pids)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--replicas", "1"], "--replicas"),
        (["--kill", "2:1"], "--kill"),  # no replica 2 of 2
        (["--steps", "6", "--kill", "1:6"], "--kill"),  # step 6 is never reached
        (["--kill", "one"], "--kill"),
        (["--during-allreduce"], "--kill"),  # dies where? needs --kill
        (["--batch", "7"], "--batch"),  # 7 sequences do not split across 2 groups
        (["--restart-after", "-1"], "--restart-after"),
        (["--steps", "0"], "steps"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, names, capsys):
    assert cli.main(["ft", *argv]) == 2  # in-process: nothing is started before the input is checked
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and names in err and "Traceback" not in err


def test_missing_torchft_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert cli.main(["ft", "--kill", "1:3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make setup" in err and "course-utils[ft]" in err
