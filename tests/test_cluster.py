"""course_utils.cluster: torchrun across network namespaces joined by a rate-limited link.

Measured against references: cross-node bytes against the planner's formula (and HSDP's against
FULL_SHARD's), the sockets the command's processes listen on against the host's loopback, the node-loss
resume against a run without the loss (bit for bit), refusals against simulated missing pieces, and
teardown against what the host had before.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, pid_alive
from listening import watch

from course_utils import cable, cluster, cluster_jobs, comm, namespaces, plan
from course_utils.cli import main as cli_main
from course_utils.errors import CourseInputError
from course_utils.models import build_model, get_config, param_count, unit_modules, unit_table
from course_utils.train import train


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the cluster needs root (network namespaces and tc)"
    return None


@pytest.fixture
def as_root():
    """Skip where the cluster cannot exist (not Linux, not root), but fail instead under CI (CI runs as root)."""
    reason = _why_not()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the cluster tests, but {reason}")
    if reason:
        pytest.skip(reason)


#: Devices a cluster could leave in the host's namespace if its teardown failed: the kinds it makes (veth
#: cables, a bridge, ifb devices for ingress shaping) and its node and switch names. Other tests running at
#: the same time add devices of their own (the grading test's listener on a dummy link): not this test's.
_CLUSTER_DEVICES = re.compile(r"^(?:veth\w*|br\d+|ifb\d+|n\d+|eth0|course-[\w-]+)(?:@\S+)?$")


def _host_state() -> dict:
    """What the host's own namespace shows of a cluster's kinds of device: link names, their qdiscs, and the
    course's namespaces."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip() for line in links.splitlines()]
    ours = {n.split("@")[0] for n in names if _CLUSTER_DEVICES.match(n)}
    return {
        "links": sorted(n for n in names if _CLUSTER_DEVICES.match(n)),
        "qdiscs": sorted(
            q
            for q in qdiscs.splitlines()
            if re.search(r" dev (\S+) ", q) and re.search(r" dev (\S+) ", q).group(1) in ours
        ),
        "namespaces": sorted(namespaces.course_namespaces()),
    }


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a run's unique rendezvous id)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and pid_alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _assert_nothing_left(before: dict, run_id: str) -> None:
    after = _host_state()
    # no cable and no qdisc on the host, and no namespace of this run (make test runs another file beside
    # this one, whose notebooks may be building a cluster of their own right now: theirs are not ours)
    assert {k: after[k] for k in ("links", "qdiscs")} == {k: before[k] for k in ("links", "qdiscs")}
    assert [ns for ns in after["namespaces"] if ns.startswith(run_id)] == []
    assert _processes_with(run_id) == []


# ------------------------------------------------------------------ refusals (any machine)


def test_refuses_without_root_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(namespaces, "_is_root", lambda: False)
    assert "needs root" in namespaces.missing()
    with pytest.raises(namespaces.ClusterUnavailable, match="needs root"):
        with namespaces.Cluster():
            pass
    assert cli_main(["cluster", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs root" in err and "Traceback" not in err


def test_refuses_without_tc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(namespaces, "_is_root", lambda: True)
    monkeypatch.setattr(namespaces, "_which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert namespaces.missing() == "the cluster needs the `tc` command, which is not installed (package iproute2)"


def test_refuses_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert namespaces.missing() == "the cluster needs Linux network namespaces, and this is darwin"


def test_refuses_where_namespaces_are_forbidden(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(namespaces, "_is_root", lambda: True)
    monkeypatch.setattr(namespaces, "_which", lambda tool: "/usr/sbin/" + tool)
    monkeypatch.setattr(
        namespaces,
        "_run",
        lambda *a, check=True: subprocess.CompletedProcess(
            a, 1, "", "mount --make-shared /run/netns failed: Operation not permitted"
        ),
    )
    assert namespaces.missing().startswith("this machine forbids new network namespaces")


@pytest.mark.parametrize("text", ["fast", "100mb", "100mbit,soon", "-1gbit"])
def test_bad_link_is_rejected(text):
    with pytest.raises(CourseInputError, match="--link"):
        namespaces.parse_link(text)


def test_link_rates_are_decimal_like_tc():
    assert namespaces.parse_link("100mbit").bytes_per_s == 12.5e6
    assert namespaces.parse_link("1gbit,5ms") == namespaces.Link("1gbit", "5ms")
    assert namespaces.parse_link("unlimited").bytes_per_s is None


@pytest.fixture(scope="module")
def one_host():
    """No root needed: the sweep worker under launch, 4 ranks in 2 pretend nodes of 2, over loopback."""
    from dataclasses import asdict

    from course_utils.launch import launch
    from course_utils.train import TrainConfig

    cfg = TrainConfig(nproc=4, node_size=2, steps=2)
    rows = launch(
        cluster.sweep_worker,
        nproc=4,
        args=(asdict(cfg), ["hybrid_shard", "full_shard"], ["loopback"]),
        echo=False,
        progress=False,
    )[0]
    return {r["strategy"]: r for r in rows}


def _planned(strategy: str) -> float:
    """The planner's cross-node bytes for the tiny model, its root unit known (FULL_SHARD keeps it gathered)."""
    model = build_model("tiny")
    root = next(u["numel"] for u in unit_table(model, 1, unit_modules(model)) if u["name"] == "(root)")
    machines = plan.Cluster(gpus_per_node=2, nodes=2)
    return plan.network_step(strategy, param_count(model), machines, bytes_per_value=4, root_params=root)[
        "cross_node_bytes"
    ]


def test_cross_node_bytes_on_one_host_match_the_planner(one_host):
    got = {s: r["cross_node_bytes_per_step"] for s, r in one_host.items()}
    assert got == {"hybrid_shard": _planned("hybrid_shard"), "full_shard": _planned("full_shard")}
    assert 0 < got["hybrid_shard"] < got["full_shard"]
    # inside a node HSDP gathers; none of that crosses
    gathers = one_host["hybrid_shard"]["comm_per_step"]["all_gather"]
    assert gathers["cross_node_sent_bytes"] == 0 < gathers["sent_bytes"]


def test_the_last_backward_is_clocked_unit_by_unit(one_host):
    """The sweep's counting observer clocks the last backward (notebook 05): every block's compute, in reverse
    order, and HSDP's cross-node all-reduce of each unit's shard, issued after that unit's compute ended and
    completed (gloo's future) before the next unit's began: on CPU FSDP2 waits for each collective."""
    from course_utils.labs import lab05

    t = one_host["hybrid_shard"]["timeline"]
    blocks = t["units"]
    assert len(blocks) == get_config("tiny").layers
    assert all(0 <= a < b <= t["backward_end"] for a, b in blocks)
    assert [a for a, _ in blocks] == sorted((a for a, _ in blocks), reverse=True)  # the backward runs them last-first
    cross = [c for c in t["collectives"] if c["spans_nodes"]]
    assert [c["kind"] for c in cross] == ["all_reduce"] * (len(blocks) + 1)  # one per unit, the root's last
    assert all(c["issued"] < c["done"] for c in cross)
    for (_, ended), c in zip(blocks[::-1], cross):  # block k's all-reduce: after its compute, before block k-1's
        assert c["issued"] >= ended
    seen = lab05.backward_overlap(t)
    assert seen["hidden_s"] == 0 and seen["exposed_s"] == seen["cross_s"] > 0
    assert seen["planned_exposed_s"] <= seen["exposed_s"]  # a second stream could only hide more


def test_crossover_is_where_the_two_step_times_meet():
    bw = plan.crossover_bandwidth(0.5, 1.0e6, 0.3, 3.0e6)  # a: slower alone, fewer bytes on the link
    assert bw is not None and 0.5 + 1.0e6 / bw == pytest.approx(0.3 + 3.0e6 / bw)
    assert 0.5 + 1.0e6 / (bw / 2) < 0.3 + 3.0e6 / (bw / 2)  # below it, fewer bytes wins
    assert plan.crossover_bandwidth(0.3, 1.0e6, 0.5, 3.0e6) is None  # faster alone and fewer bytes: never meet


def test_the_crossover_is_found_for_the_strategy_that_shards_inside_a_node():
    """Notebook 05's crossover line: HSDP is the record's strategy that shards inside a node (its mesh is named
    ("replicate", "shard"), not "hybrid": reading the name once made every crossover silently vanish)."""
    base = {"ddp": 0.10, "full_shard": 0.30, "hybrid_shard": 0.35}
    rows = [
        {"strategy": s, "predicted_card_bytes": b}
        for s, b in (("ddp", 5.2e6), ("full_shard", 7.8e6), ("hybrid_shard", 3.5e6))
    ]
    got = cluster._crossover(base, rows)
    assert set(got) == {"ddp", "full_shard"}
    for other in got:
        bw = got[other]["bandwidth"]
        assert got[other]["hsdp_faster"] == "below" and f"HSDP is faster than {other} below" in got[other]["text"]
        other_bytes = next(r["predicted_card_bytes"] for r in rows if r["strategy"] == other)
        assert base["hybrid_shard"] + 3.5e6 / bw == pytest.approx(base[other] + other_bytes / bw)


def test_a_node_card_carries_one_rank_per_ring_and_gloo_s_reduce_scatter_twice():
    """What crosses a node's card (notebook 05 reads the veth counters against it): 2 nodes of 2 ranks, payload P.
    DDP's all-reduce over the world: one rank per node sends across, 2(N-1)/N P = 1.5 P. HSDP's replica all-reduce
    (groups of 2, one per shard): both ranks of a node send across, 2 x 1.0 P. A reduce-scatter over the world:
    gloo sends an all-reduce's 1.5 P, not the ring's 0.75 P."""
    p = 1000.0
    assert comm.node_card_bytes("all_reduce", p, 4, 4) == pytest.approx(1.5 * p)
    assert comm.node_card_bytes("all_reduce", p, 2, 4) == pytest.approx(2 * 1.0 * p)
    assert comm.node_card_bytes("reduce_scatter", p, 4, 4) == pytest.approx(1.5 * p)
    assert comm.node_card_bytes("all_gather", p, 4, 4) == pytest.approx(0.75 * p)
    assert comm.ring_bytes_sent("reduce_scatter", p, 4) == pytest.approx(0.75 * p)  # the ring model is unchanged


def test_a_card_s_counter_is_read_from_proc_net_dev():
    """``cable.transmitted`` reads this namespace's counters: loopback's grows by at least what was sent over it."""
    import socket

    before = cable.transmitted("lo")
    assert before is not None and cable.transmitted("no-such-card") is None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            peer, _ = server.accept()
            with peer:
                client.sendall(b"x" * 200_000)
                got = 0
                while got < 200_000:
                    got += len(peer.recv(65536))
    assert cable.transmitted("lo") - before >= 200_000


# ------------------------------------------------------------------ teardown (root)


def test_teardown_on_error_interrupt_and_timeout(as_root):
    before = _host_state()
    for failure in (RuntimeError("a node failed"), KeyboardInterrupt()):
        with pytest.raises(type(failure)):
            with namespaces.Cluster(nodes=3, link="100mbit") as c:
                procs = [c.start(node, ["sleep", "60"]) for node in c.nodes]
                # `ip netns exec` enters the namespace a moment after it starts: wait for that, then fail
                deadline = time.monotonic() + 20
                while not all(namespaces.namespace_pids(node.ns) for node in c.nodes) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert all(namespaces.namespace_pids(node.ns) for node in c.nodes)
                raise failure
        assert all(p.poll() is not None for p in procs)  # killed and reaped
        _assert_nothing_left(before, c.run)
    with pytest.raises(TimeoutError):
        with namespaces.Cluster(link="1gbit") as c:
            procs = [c.start(node, ["sleep", "60"]) for node in c.nodes]
            cluster_jobs.wait(procs, time.monotonic() + 0.3, c)
    assert all(p.poll() is not None for p in procs)
    _assert_nothing_left(before, c.run)


def test_links_are_shaped_on_both_ends(as_root):
    with namespaces.Cluster(link="100mbit") as c:
        for node in c.nodes:
            for ns, dev in ((node.ns, namespaces.IFACE), (c.switch, node.port)):
                shown = subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev], capture_output=True, text=True
                ).stdout
                assert "tbf" in shown and "100Mbit" in shown
        c.set_link("unlimited")
        shown = subprocess.run(
            ["ip", "netns", "exec", c.nodes[0].ns, "tc", "qdisc", "show", "dev", namespaces.IFACE],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" not in shown
        # the nodes reach each other over the cable (no ping here: a socket)
        server = c.start(
            c.nodes[1],
            [
                sys.executable,
                "-c",
                f"import socket; s = socket.create_server(('{c.nodes[1].addr}', 0)); "
                "print(s.getsockname()[1], flush=True); s.accept()[0].sendall(b'hello')",
            ],
            name="server",
        )
        log = c.log_dir / "server.log"
        deadline = time.monotonic() + 20
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(log.read_text().split()[0])
        got = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                c.nodes[0].ns,
                sys.executable,
                "-c",
                f"import socket; print(socket.create_connection(('{c.nodes[1].addr}', {port}), 5).recv(5))",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert got.strip() == "b'hello'"
        server.wait(timeout=10)


def test_leftovers_of_a_killed_run_are_removed_by_the_clean_command(as_root, capsys):
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the "killed" earlier run
    orphan = f"{namespaces.PREFIX}{dead.pid}-abcdef-n0"
    mine = f"{namespaces.PREFIX}{os.getpid()}-abcdef-n0"  # a live run's namespace must be left alone
    folder = Path(tempfile.mkdtemp(prefix=f"course-cluster-{dead.pid}-"))  # the killed run's logs
    for ns in (orphan, mine):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", orphan, "sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not namespaces.namespace_pids(orphan) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cli_main(["cluster", "--clean"]) == 0  # the documented clean-up command
        assert capsys.readouterr().out.splitlines() == [f"removed {orphan}", f"removed {folder}"]
        assert sleeper.wait(timeout=10) == -9
        assert orphan not in namespaces.course_namespaces() and mine in namespaces.course_namespaces()
        assert not folder.exists()
    finally:
        subprocess.run(["ip", "netns", "delete", mine])
        subprocess.run(["ip", "netns", "delete", orphan], capture_output=True)


def test_a_cluster_killed_or_terminated_leaves_nothing(as_root):
    """SIGTERM ends the command as Ctrl-C does; after SIGKILL its guardian removes everything at once (issue 34)."""
    import tempfile

    before = _host_state()
    argv = [sys.executable, "-m", "course_utils", "cluster", "--nodes", "2", "--nproc-per-node", "1"]
    argv += ["--strategy", "ddp", "--steps", "100000", "--wall-timeout-s", "600"]
    runs = {
        sig: subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for sig in (signal.SIGTERM, signal.SIGKILL)
    }
    try:
        deadline = time.monotonic() + 120
        for proc in runs.values():  # both nodes of each run exist and something runs in them
            prefix = f"{namespaces.PREFIX}{proc.pid}-"
            while time.monotonic() < deadline:
                nodes = [
                    ns for ns in namespaces.course_namespaces() if ns.startswith(prefix) and "-n" in ns[len(prefix) :]
                ]
                if len(nodes) == 2 and all(namespaces.namespace_pids(ns) for ns in nodes):
                    break
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                time.sleep(0.1)
            else:
                pytest.fail("the cluster never started")
        time.sleep(1.0)  # torchrun and its workers start inside the nodes
        for sig, proc in runs.items():
            proc.send_signal(sig)
        assert runs[signal.SIGTERM].wait(timeout=60) == 128 + signal.SIGTERM
        assert "stopped by SIGTERM" in runs[signal.SIGTERM].stderr.read().decode()
        runs[signal.SIGKILL].wait(timeout=10)
        deadline = time.monotonic() + 30  # the guardian's work after a SIGKILL
        for proc in runs.values():
            prefix = f"{namespaces.PREFIX}{proc.pid}-"
            while time.monotonic() < deadline and (
                [ns for ns in namespaces.course_namespaces() if ns.startswith(prefix)] or _processes_with(prefix)
            ):
                time.sleep(0.2)
            _assert_nothing_left(before, prefix)
            assert list(Path(tempfile.gettempdir()).glob(f"course-cluster-{proc.pid}-*")) == []
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        namespaces.remove_leftovers()


# ------------------------------------------------------------------ real runs (root)


def _cli(*args) -> tuple[dict, set]:
    """``cluster ... --json``'s report, and every socket its processes listened on beyond its namespaces
    (``listening.watch`` samples /proc as it runs: issue 34, nothing listens beyond the machine)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "course_utils", "cluster", *args, "--json"]
    seen, proc = watch(argv, cwd=ROOT, env=env, timeout_s=240)
    assert proc.returncode == 0, proc.output[-3000:]
    return json.loads(next(ln for ln in reversed(proc.output.splitlines()) if ln.startswith("{"))), seen


def test_short_form_hsdp_sends_less_across_nodes(as_root, one_host):
    """The CLI's short form across a real link: the bytes and the training of the one-host run; and, watched as
    it runs, none of its processes listens in the host's namespace beyond loopback (issue 34)."""
    before = _host_state()
    r, seen = _cli(
        "--nodes", "2", "--nproc-per-node", "2", "--link", "100mbit", "--strategy", "hybrid_shard", "--steps", "2"
    )
    # the cluster's stores and gloo listen on the nodes' own private subnet, nothing in the host's namespace
    assert seen == set(), f"listening beyond loopback: {sorted(seen)}"
    _assert_nothing_left(before, r["commands"][0].split("--rdzv-id ")[1].split()[0])
    assert r["world_size"] == 4 and r["link"] == {"rate": "100mbit", "delay": None, "netem": False}
    assert r["step_time_s"] > 0 and len(r["losses"]) == 2 and r["nodes"] == 2 and r["nproc_per_node"] == 2
    # across a real link, the same bytes as counted on one host and as the planner's ring formula
    assert (
        r["cross_node_bytes_per_step"]
        == one_host["hybrid_shard"]["cross_node_bytes_per_step"]
        == _planned("hybrid_shard")
    )
    assert r["cross_node_bytes_per_step"] < one_host["full_shard"]["cross_node_bytes_per_step"]
    assert r["weights_sha256"] == one_host["hybrid_shard"]["weights_sha256"]  # and the same training, bit for bit


def test_a_lost_node_is_replaced_and_the_run_ends_bit_identical(as_root, tmp_path):
    before = _host_state()
    run = dict(strategy="ddp", steps=6)
    reference = train(nproc=2, **run)  # one host, no failure
    lost = cluster.train_on_cluster(
        nodes=2,
        nproc_per_node=1,
        link="100mbit",
        checkpoint_dir=str(tmp_path),
        checkpoint_every=2,
        max_restarts=1,
        lose_node_after=3,
        **run,
    )
    assert lost["lost_after_step"] >= 3 and lost["restarts"] == 1
    second = lost["attempts"][1]
    assert lost["resumed_from"] == [second["complete_seen"][-1]]  # the newest complete checkpoint
    assert second["complete_seen"][-1] <= lost["lost_after_step"]
    assert lost["weights_sha256"] == reference["weights_sha256"]  # bit for bit
    assert lost["losses"] == reference["losses"]
    assert len(lost["commands"]) == 2 and namespaces.SUBNET + ".13" in lost["commands"][1]  # the replacement
    _assert_nothing_left(before, lost["commands"][0].split("--rdzv-id ")[1].split()[0])


def test_link_split_parts_the_step_at_the_clocked_backward():
    """Notebook 05's split of what a slow link added: the backward's cross-node collectives (here against the
    unlimited cable) and the rest of the step; a crossing outside the clocked backward shows as a share below 1."""
    from course_utils.comm import node_card_bytes
    from course_utils.labs import lab05

    def row(step_s, done, card_bytes):
        crossing = {"kind": "all_reduce", "bytes": 1000, "group": 4, "spans_nodes": True, "issued": 0.1, "done": done}
        inside = {**crossing, "spans_nodes": False, "done": 0.12}  # inside a node: not the link's
        timeline = {"units": [[0.0, 0.1]], "collectives": [inside, crossing], "backward_end": done}
        return {
            "step_time_s": step_s,
            "timeline": timeline,
            "world_size": 4,
            "card_bytes_per_step": [card_bytes] * 2,
            "predicted_card_bytes": node_card_bytes("all_reduce", 1000, 4, 4),
        }

    slow, fast = row(1.0, 0.4, 3000.0), row(0.5, 0.15, 3000.0)
    got = lab05.link_split(slow, fast, rate=10_000.0)
    assert got["wire_s"] == pytest.approx(0.3) and got["added_s"] == pytest.approx(0.5)
    assert (got["collectives_s"], got["base_collectives_s"]) == pytest.approx((0.3, 0.05))
    assert got["outside_s"] == pytest.approx(0.25) and got["clocked_share"] == pytest.approx(1.0)
    forward_too = {**slow, "predicted_card_bytes": 4 * slow["predicted_card_bytes"]}  # FULL_SHARD's forward gathers
    assert lab05.link_split(forward_too, fast, rate=10_000.0)["clocked_share"] == pytest.approx(0.25)
