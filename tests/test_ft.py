"""TorchFT runs (course_utils.ft, notebook 06): survivors keep stepping, a restarted group heals and trains on.

Real runs, shared by the tests: one group dies inside the gradient all-reduce of step 3 and heals with
Adam's state; in another run a group dies between steps and "heals" with the weights only (the mistake
the first run must not make); a DiLoCo run loses a group and heals it at a synchronisation, over the
two-node cluster where this machine can build one. Each group writes its own hashes, so "equal"
compares what two processes computed independently.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
from types import SimpleNamespace

import pytest
from conftest import pid_alive
from listening import watching_this_process

from course_utils import cli, cluster, failures, ft_nodes, namespaces
from course_utils.ft import INSTALL_HINT, ft_run
from course_utils.ft_config import FTConfig
from course_utils.ft_groups import _Replica, _restarting
from course_utils.launch import LaunchTimeout
from course_utils.models import get_config, param_count

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason=INSTALL_HINT)

STEPS, KILL_STEP, AFTER_HEAL = 12, 3, 3
H = 4  # DiLoCo's synchronisation interval in the DiLoCo run
ON_CLUSTER = cluster.missing() is None


@pytest.fixture(scope="module")
def in_allreduce_watched():
    """The run, and every socket its processes listened on beyond loopback, sampled from /proc as it ran."""
    with watching_this_process() as seen:
        run = ft_run(replicas=2, steps=STEPS, kill=f"1:{KILL_STEP}", during_allreduce=True, after_heal=AFTER_HEAL)
    return run, set(seen)


@pytest.fixture(scope="module")
def in_allreduce(in_allreduce_watched):
    return in_allreduce_watched[0]


@pytest.fixture(scope="module")
def weights_only():
    """The mistake: a heal that copies the weights and leaves Adam's moments behind."""
    return ft_run(replicas=2, steps=STEPS, kill=f"0:{KILL_STEP}", heal_optimizer=False, after_heal=AFTER_HEAL)


@pytest.fixture(scope="module")
def diloco():
    """DiLoCo, group 1 killed between steps of round 1, restarted; on two cluster nodes where possible."""
    return ft_run(
        replicas=2,
        steps=4 * H,
        diloco=True,
        sync_every=H,
        kill=f"1:{H + 1}",
        restart_after=1,
        after_heal=2,
        link="100mbit" if ON_CLUSTER else None,
    )


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or IPv4 loopback mapped into IPv6."""
    return address.startswith("127.") or address == "::1" or address.startswith("::ffff:127.")


def test_the_survivor_keeps_stepping(in_allreduce):
    rows = in_allreduce["per_step"]
    assert all(row["committed"] and 0 in row["replicas"] for row in rows)  # survivor 0 committed every step
    alone = [row["step"] for row in rows if row["replicas"] == [0] and row["participants"] == 1]
    # the job manager restarts the dead group only after the survivor committed 2 steps without it
    assert len(alone) >= 2 and min(alone) == KILL_STEP
    assert in_allreduce["steps_while_away"] == len(alone)
    assert in_allreduce["stall_s"] is not None and in_allreduce["lost_s"] is not None


def test_the_healed_group_trains_on_and_ends_equal_to_the_survivor(in_allreduce):
    run = in_allreduce
    assert run["killed"]["replica"] == 1 and run["restarts"] and run["restarts"][0]["replica"] == 1
    assert KILL_STEP < run["healed_to_step"] <= STEPS - AFTER_HEAL and run["heal_s"] is not None
    # both groups committed the steps after the heal together, then ended on the same bits
    after = [row for row in run["per_step"] if row["step"] >= run["healed_to_step"]]
    assert all(row["replicas"] == [0, 1] for row in after)
    assert run["committed_after_heal"] == {"0": len(after), "1": len(after)} and len(after) >= AFTER_HEAL
    assert run["final_steps"] == {"0": STEPS, "1": STEPS}
    assert run["weights_equal"] and len(set(run["weights_sha256"].values())) == 1
    # Adam's moments and step counts, hashed in each process: copied by the heal, then updated alike
    assert run["adam_equal"] and run["adam_steps"] == {"0": [STEPS], "1": [STEPS]}
    # the last AFTER_HEAL steps waited for the restarted group: the survivor's quorum at the heal step held
    assert run["after_heal"] == AFTER_HEAL and run["held_s"] is not None and run["held_s"] >= 0
    # the final weights' loss on a batch no step trained on, computed in each group's own process: equal weights
    losses = list(run["held_out_loss"].values())
    assert len(losses) == 2 and math.isclose(*losses, rel_tol=1e-6) and math.isfinite(losses[0])


def test_a_heal_that_copies_only_the_weights_is_caught(weights_only):
    run = weights_only
    assert run["killed"] == {"replica": 0, "step": KILL_STEP, "where": "between"}
    assert run["steps_discarded"] == 0  # nothing was in flight: nothing to throw away
    assert run["committed_after_heal"]["0"] >= AFTER_HEAL
    # fresh moments after the heal: the same gradients give another update, so the weights part
    assert not run["adam_equal"] and run["adam_steps"]["0"] != [STEPS]
    assert not run["weights_equal"]


def test_a_failure_inside_the_allreduce_discards_that_step_only(in_allreduce):
    assert in_allreduce["killed"]["where"] == "allreduce"
    assert in_allreduce["discarded_steps"] == [KILL_STEP] and in_allreduce["steps_discarded"] == 1


def test_diloco_loses_the_dead_groups_round_and_heals_it_at_a_synchronisation(diloco):
    run = diloco
    assert run["diloco"] and run["sync_every"] == H
    # group 1 died before step H + 1: its step H was never synchronised, and is lost with it
    assert run["killed"] == {"replica": 1, "step": H + 1, "where": "between"} and run["steps_lost_with_it"] == 1
    assert all(row["committed"] and 0 in row["replicas"] for row in run["per_step"])  # the survivor lost nothing
    # the restarted group trained one round alone (replaced by the heal), then synchronised with the survivor
    assert run["healed_to_step"] % H == 0 and run["committed_after_heal"]["1"] >= H
    assert run["weights_equal"] and run["final_steps"] == {"0": 4 * H, "1": 4 * H}
    assert not run["adam_equal"]  # each group keeps its own inner Adam state: DiLoCo averages weights only
    assert run["held_s"] is None  # DiLoCo's groups wait before a round, not inside a step's quorum
    assert math.isclose(*run["held_out_loss"].values(), rel_tol=1e-6)  # its synchronised weights, one loss


def test_a_restarted_diloco_group_never_waits_for_its_own_restart():
    """Two rounds, group 1 killed in the first synchronisation, the last two rounds waiting for a restart: the
    restarted group used to hold for a restart (its own) like the survivor, and both waited until the timeout."""
    run = ft_run(
        replicas=2, steps=2 * H, diloco=True, sync_every=H, kill=f"1:{H - 1}", during_allreduce=True,
        restart_after=1, after_heal=2, timeout_s=60,
    )  # fmt: skip
    # both end at the last step with the same weights (whether the restarted group joined the retried first round
    # or healed from the survivor at the end depends on which reached the lighthouse first: either is torchft's)
    assert run["final_steps"] == {"0": 2 * H, "1": 2 * H} and run["weights_equal"] and len(run["restarts"]) == 1


@pytest.mark.parametrize("during_allreduce", [False, True])
def test_a_killed_diloco_group_is_known_dead_before_the_job_manager_reaps_it(tmp_path, monkeypatch, during_allreduce):
    """The flaky 06-diloco-03: the job manager marked the death only once it had reaped the process; on a busy
    machine the survivor looked before that, ran its last rounds without waiting for the restart and finished, and
    the restarted group trained alone (different final weights, no round of two groups across the link)."""
    cfg = FTConfig(
        steps=8, diloco=True, sync_every=H, kill=f"1:{H - 1}", during_allreduce=during_allreduce, restart_after=1,
        after_heal=2,
    ).validate()  # fmt: skip
    monkeypatch.setattr(failures, "die_hard", lambda reason: (_ for _ in ()).throw(SystemExit(reason)))
    group = _Replica(cfg, 1, 0, ft_nodes.LOOPBACK, "", tmp_path)  # the group that dies; no job manager runs
    group.manager = SimpleNamespace(current_step=lambda: 0, allreduce=lambda tensor: tensor)
    group._die_in_allreduce()
    assert not _restarting(tmp_path, cfg, but=0)
    with pytest.raises(SystemExit, match="replica 1"):
        group.manager.allreduce(None) if during_allreduce else group.before_step(H - 1)
    assert _restarting(tmp_path, cfg, but=0)  # what the survivor reads before its last rounds
    (tmp_path / "asking-1-1").touch()  # the restarted group asks to join: the survivor goes on
    assert not _restarting(tmp_path, cfg, but=0)


@pytest.mark.skipif(not ON_CLUSTER, reason=cluster.missing() or "")
def test_diloco_sends_across_the_link_only_when_it_synchronises(diloco):
    """The bytes counted on node 0's cable (the veth's counters), against what a ring all-reduce must send."""
    psi = param_count(get_config("tiny"))
    allreduce = 2 * 4 * psi  # 2 ranks: each sends and receives the whole fp32 tensor once (rx + tx)
    both = [row for row in diloco["per_step"] if row["participants"] == 2 and row["replicas"] == [0, 1]]
    syncs = [row["link_bytes"] for row in both if row["step"] % H == H - 1]
    local = [row["link_bytes"] for row in both if row["step"] % H != H - 1]
    assert syncs and local
    assert all(allreduce <= b < 1.2 * allreduce for b in syncs)  # payload plus headers and the quorum's messages
    assert all(b < 0.01 * allreduce for b in local)  # heartbeats only


def test_nothing_listens_beyond_its_place(in_allreduce_watched, diloco):
    """Every socket a run listened on (stores, torchft's manager servers, gloo, the lighthouse), as the run saw
    them; and, sampled from outside (issue 34), no process of the run, its job manager and ``launch``'s agent
    included, held a TCP socket listening or a UDP socket bound beyond loopback."""
    in_allreduce, seen = in_allreduce_watched
    assert seen == set(), f"listening beyond loopback: {sorted(seen)}"
    assert len(in_allreduce["listening"]) >= 1 + 3 * 3  # the lighthouse, and three servers per group process
    for address, _ in in_allreduce["listening"]:
        assert is_loopback(address), f"an ft run listened on {address}"
    for address, _ in diloco["listening"]:
        assert is_loopback(address) or address.startswith(namespaces.SUBNET + "."), (
            f"a cluster run listened on {address}"
        )


def _refused(address: str) -> bool:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except OSError:
        return True


def test_nothing_is_left_running(in_allreduce, weights_only, diloco):
    for run in (in_allreduce, weights_only, diloco):
        assert len(run["pids"]) == 1 + 1 + 3  # the job manager, the lighthouse, two groups and one restart
        assert not any(pid_alive(pid) for pid in run["pids"])
        assert run["run_dir"] is None  # its temporary folder (logs, event files) removed: all is in the report
    assert in_allreduce["lighthouse"].startswith("http://127.0.0.1:") and _refused(in_allreduce["lighthouse"])
    assert not [ns for ns in namespaces.course_namespaces() if ns.startswith(f"{namespaces.PREFIX}{os.getpid()}-")]


def test_a_timeout_stops_everything(tmp_path):
    with pytest.raises(LaunchTimeout):
        ft_run(replicas=2, steps=100_000, timeout_s=1.0, run_dir=tmp_path)  # far more steps than 1 s allows
    pids = [int(p) for p in (tmp_path / "pids.txt").read_text().split()]  # the job manager, then each group
    assert pids and not any(pid_alive(pid) for pid in pids)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--replicas", "1"], "--replicas"),
        (["--replicas", "9"], "--replicas"),
        (["--kill", "2:1"], "--kill"),  # no replica 2 of 2
        (["--steps", "6", "--kill", "1:6"], "--kill"),  # step 6 is never reached
        (["--kill", "one"], "--kill"),
        (["--during-allreduce"], "--kill"),  # dies where? needs --kill
        (["--batch", "7"], "--batch"),  # 7 sequences do not split across 2 groups
        (["--restart-after", "-1"], "--restart-after"),
        (["--steps", "0"], "steps"),
        (["--diloco", "--steps", "10", "--sync-every", "4"], "--sync-every"),  # must end on a synchronisation
        (["--diloco", "--sync-every", "0"], "--sync-every"),
        (["--kill", "1:3", "--hang", "0:4"], "--hang"),
        (["--hang", "1"], "--hang"),
        (["--link", "fast"], "--link"),
        (["--outer-lr", "0"], "--outer-lr"),
        (["--quorum-timeout-s", "0"], "--quorum-timeout-s"),
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


def test_bytes_per_step_leave_out_the_heal_that_crossed_the_link_once():
    from course_utils.labs.lab06_ft import link_bytes_per_step

    def report(diloco, heal, rows):
        per_step = [{"step": s, "participants": p, "link_bytes": b} for s, (p, b) in enumerate(rows)]
        return {"diloco": diloco, "sync_every": 2, "healed_to_step": heal, "replicas": 2, "per_step": per_step}

    # synchronous: the heal is in step 3's quorum; step 1 had one group only
    assert link_bytes_per_step(report(False, 3, [(2, 100), (1, 0), (2, 100), (2, 900), (2, 100)])) == 100
    # DiLoCo, H = 2: the heal is in the synchronisation ending at step 3, so the round of steps 2 and 3 is left out
    assert link_bytes_per_step(report(True, 4, [(2, 0), (2, 200), (2, 0), (2, 900), (2, 0), (2, 200)])) == 100
    assert link_bytes_per_step(report(False, None, [(2, None)])) is None  # loopback: nothing counted


@pytest.mark.parametrize(
    "config",
    [
        dict(replicas=2, steps=12, kill="1:3", during_allreduce=True, link="100mbit"),
        dict(replicas=3, steps=16, diloco=True, sync_every=4, kill="1:6", restart_after=None, after_heal=2),
        dict(hang="0:2", quorum_timeout_s=3.0, heartbeat_timeout_ms=500, outer_lr=0.5, timeout_s=30.0),
    ],
)
def test_the_printed_command_line_runs_the_same_configuration(config):
    """The line a notebook prints for a run, parsed by the command's own parser, is that run's FTConfig."""
    import argparse
    import shlex
    from dataclasses import fields

    from course_utils.ft import command_line, ft_arguments
    from course_utils.ft_config import FTConfig

    line = command_line(FTConfig(**config))
    assert line.startswith("python -m course_utils ft --replicas ")
    parser = argparse.ArgumentParser()
    ft_arguments(parser)
    args = parser.parse_args(shlex.split(line)[4:])
    assert FTConfig(**{f.name: getattr(args, f.name) for f in fields(FTConfig) if hasattr(args, f.name)}) == FTConfig(
        **config
    )
