"""course_utils.checkpoint and the recovery half of train (notebook 06).

Every claim is checked against a run that never failed: a run that loses a rank and resumes
must end with the same weights bit for bit (same world size), or the same losses within
fp32 reduction-order noise (a different world size). Launches are shared through
module-scoped fixtures; the cheap rules (what counts as complete, pruning, validation) run
in this process.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from course_utils import checkpoint as ck
from course_utils import checksums, failures, recovery
from course_utils import dist as cdist
from course_utils.errors import CourseInputError
from course_utils.instrument import weights_sha256
from course_utils.labs import lab06
from course_utils.launch import WorkerFailed
from course_utils.train import TrainConfig, train, train_worker

STEPS, EVERY = 6, 2
#: fp32 loss agreement across world sizes: reduction order changes, nothing else. 16 ulps
#: relative (16 · 2^-23 ≈ 1.9e-6) leaves a wide margin over the few ulps 2- and 4-rank runs differ by.
RTOL_WORLD_CHANGE = 16 * 2.0**-23


def run(tmp_path_factory, name, **overrides):
    d = tmp_path_factory.mktemp(name)
    return train(**{"nproc": 2, "steps": STEPS, "checkpoint_dir": str(d), "checkpoint_every": EVERY, **overrides}), d


@pytest.fixture(scope="module")
def reference():
    """The runs that never failed, one per strategy (no checkpoint folder at all)."""
    return {s: train(strategy=s, nproc=2, steps=STEPS) for s in ("ddp", "zero3")}


@pytest.fixture(scope="module")
def full_shard_ref(tmp_path_factory):
    """full_shard on 2 ranks, never failed; it keeps every checkpoint for the world-size tests."""
    return run(tmp_path_factory, "fs-ref", strategy="full_shard", keep_checkpoints=STEPS // EVERY)


# ---------------------------------------------------------------- bit-identical resume


@pytest.mark.parametrize(
    "strategy, fail_at, resumed, redone",
    [
        ("ddp", "1:3,0:4", [2, 4], 1),  # two kill steps in one run: mid-interval, then right at a checkpoint
        ("zero3", "0:5", [4], 1),
    ],
)
def test_resume_after_a_lost_rank_is_bit_identical(tmp_path_factory, reference, strategy, fail_at, resumed, redone):
    report, d = run(tmp_path_factory, strategy, strategy=strategy, fail_at=fail_at, max_restarts=2)
    ref = reference[strategy]
    assert report["weights_sha256"] == ref["weights_sha256"]
    assert report["losses"] == ref["losses"]
    assert report["restarts"] == len(fail_at.split(","))
    assert report["resumed_from"] == resumed and report["steps_redone"] == redone
    # every failure cost a restart; time spent redoing steps exactly where steps were redone
    for lost, n in zip(report["time_lost"], report["redone_per_restart"]):
        assert lost["redone"] == n and lost["restart_s"] > 0 and (lost["redo_s"] > 0) == (n > 0)
    rows = recovery.attempt_logs(d, report["run_id"])
    first = [r for r in rows if r["attempt"] == 0]
    rank, step = failures.parse_failures(fail_at)[0]
    assert [r["ending"] for r in first if r["rank"] == rank] == [recovery.ENDINGS["died"]]
    # nobody finished the step the dead rank never sent its gradients for
    assert all(r["last_step_done"] == step - 1 for r in first)
    assert all(r["ending"] != recovery.ENDINGS["finished"] for r in first)
    last = [r for r in rows if r["attempt"] == report["restarts"]]
    assert len(last) == 2 and all(r["ending"] == recovery.ENDINGS["finished"] for r in last)
    assert weights_sha256(ck.load_weights(d)) == ref["weights_sha256"]  # readable without any process group
    if strategy == "zero3":
        assert ck.read_commit(d, STEPS)["format"] == "zero-flat"


def test_full_shard_resume_is_bit_identical(tmp_path_factory, full_shard_ref):
    ref, _ = full_shard_ref
    report, _ = run(tmp_path_factory, "fs-fail", strategy="full_shard", fail_at="1:3", max_restarts=1)
    assert report["weights_sha256"] == ref["weights_sha256"] and report["losses"] == ref["losses"]
    assert report["resumed_from"] == [2] and report["steps_redone"] == 1


def test_failure_during_a_save_falls_back_to_the_checkpoint_before(tmp_path_factory, reference):
    report, d = run(tmp_path_factory, "save-fail", strategy="ddp", fail_during_save="1:4", max_restarts=1)
    assert report["weights_sha256"] == reference["ddp"]["weights_sha256"]
    assert report["resumed_from"] == [2] and report["steps_redone"] == 2
    torn = report["attempts"][1]["incomplete_seen"]  # what the restarted attempt found on disk
    assert len(torn) == 1 and torn[0]["step"] == 4 and torn[0]["name"].endswith(".partial")
    assert not torn[0]["has_metadata"] and not torn[0]["has_commit"]
    assert any(f.endswith(".distcp") for f in torn[0]["files"]), "the dead save had written data"
    assert ck.scan(d)["incomplete"] == [], "the stale partial folder is pruned after the next save"


# ---------------------------------------------------------------- world size changes


def test_world_size_change_reshards_and_training_continues(tmp_path_factory, full_shard_ref):
    """2 ranks' checkpoint resumed on 4, and that 4-rank run's own checkpoint resumed on 2 (both directions,
    the second from a checkpoint the first wrote)."""
    ref, ref_dir = full_shard_ref
    on4, on2 = tmp_path_factory.mktemp("resume-2-4"), tmp_path_factory.mktemp("resume-4-2")
    ck.copy_checkpoint(ref_dir, 2, on4)
    by4 = train(strategy="full_shard", nproc=4, steps=4, checkpoint_dir=str(on4), checkpoint_every=EVERY)
    assert ck.read_commit(on4, 4)["world_size"] == 4
    ck.copy_checkpoint(on4, 4, on2)
    by2 = train(strategy="full_shard", nproc=2, steps=STEPS, checkpoint_dir=str(on2), checkpoint_every=EVERY)
    for report, start, world, steps in ((by4, 2, 4, 4), (by2, 4, 2, STEPS)):
        assert report["resumed_from"] == [start] and report["world_size"] == world
        assert report["attempts"][0]["complete_seen"] == [start]
        # the loaded weights hashed to the value recorded at save time (checked in load); after that
        # only the reduction order differs from the run that never changed size
        assert report["losses"][:2] == ref["losses"][:2]  # the history saved with the checkpoint
        got, want = torch.tensor(report["losses"]), torch.tensor(ref["losses"][:steps])
        assert len(got) == steps and torch.allclose(got, want, rtol=RTOL_WORLD_CHANGE, atol=0)
    assert by2["losses"][:4] == by4["losses"]  # the 4-rank history travelled with its checkpoint


# ---------------------------------------------------------------- restarts exhausted


def test_exhausted_restarts_name_the_rank_and_leave_a_loadable_checkpoint(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("exhausted")
    cfg = dict(strategy="ddp", nproc=2, steps=STEPS, checkpoint_dir=str(d), checkpoint_every=EVERY)
    with pytest.raises(WorkerFailed) as err:
        train(**cfg, fail_at="1:3,0:5", max_restarts=1)  # two failures, one restart allowed
    assert err.value.rank == 0  # the second failure: rank 0, on attempt 1
    assert "rank 0" in str(err.value) and "died without a Python error" in str(err.value)
    assert ck.scan(d)["complete"] == [2, 4]
    assert weights_sha256(ck.load_weights(d)) == ck.read_commit(d, 4)["weights_sha256"]
    finished = train(**cfg)  # the same command again, nothing failing: it resumes and finishes
    assert finished["resumed_from"] == [4]
    assert finished["weights_sha256"] == reference["ddp"]["weights_sha256"]


# ---------------------------------------------------------------- in this process (world of 1)


def test_resume_extends_a_finished_run_bit_identically(tmp_path):
    base = dict(strategy="single", nproc=1, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2)
    short = train_worker(asdict(TrainConfig(steps=4, **base)))
    assert short["resumed_from"] == [] and ck.scan(tmp_path / "a")["complete"] == [2, 4]
    longer = train_worker(asdict(TrainConfig(steps=6, **base)))
    straight = train_worker(asdict(TrainConfig(steps=6, strategy="single")))
    assert longer["resumed_from"] == [4] and longer["steps_redone"] == 0
    assert longer["weights_sha256"] == straight["weights_sha256"] and longer["losses"] == straight["losses"]


def _fake_step(root: Path, step: int, *, metadata=True, commit_step=None) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    if metadata:
        (path / ".metadata").write_bytes(b"m")
    if commit_step is not None:
        (path / "commit.json").write_text(json.dumps({"step": commit_step}))
    return path


def test_only_committed_folders_count(tmp_path):
    _fake_step(tmp_path, 2, commit_step=2)
    _fake_step(tmp_path, 4, metadata=True)  # DCP finished, never committed
    _fake_step(tmp_path, 6, metadata=False, commit_step=6)  # a marker without DCP's index
    _fake_step(tmp_path, 8, commit_step=7)  # a marker for another step
    (tmp_path / ".step-10-abc.partial").mkdir()
    (tmp_path / "_launch").mkdir()
    state = ck.scan(tmp_path)
    assert state["complete"] == [2] and ck.latest_complete(tmp_path) == 2
    assert sorted(r["name"] for r in state["incomplete"]) == [".step-10-abc.partial", "step-4", "step-6", "step-8"]


def test_prune_keeps_the_newest_complete_and_drops_partials(tmp_path):
    for s in (2, 4, 6):
        _fake_step(tmp_path, s, commit_step=s)
    (tmp_path / ".step-8-x.partial").mkdir()
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(removed) == [".step-8-x.partial", "step-2"]
    assert ck.scan(tmp_path) == {"complete": [4, 6], "incomplete": []}


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"keep_checkpoints": 1}, "keep_checkpoints must be a whole number from 2 to"),
        ({"checkpoint_every": 2, "checkpoint_dir": None}, "needs --checkpoint-dir"),
        ({"fail_during_save": "1:3"}, "not a checkpoint step"),
        ({"fail_at": "2:1"}, "rank must be in 0..1"),
        ({"fail_at": "one:two"}, "takes RANK:STEP"),
    ],
)
def test_bad_recovery_settings_say_what_to_do(tmp_path, overrides, words):
    cfg = dict(strategy="ddp", nproc=2, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(CourseInputError, match=words):
        TrainConfig(**{**cfg, **overrides}).validate()


def test_failure_plan_is_one_item_per_attempt():
    assert failures.parse_failures("1:3, 0:5") == [(1, 3), (0, 5)]
    assert failures.planned_failure("1:3,0:5", rank=1, attempt=0) == 3
    assert failures.planned_failure("1:3,0:5", rank=1, attempt=1) is None
    assert failures.planned_failure("1:3,0:5", rank=0, attempt=1) == 5
    assert failures.planned_failure("1:3", rank=1, attempt=1) is None  # first attempt only
    assert failures.planned_failure(None, rank=0, attempt=0) is None


def test_resuming_with_other_settings_is_refused(tmp_path):
    base = dict(strategy="single", nproc=1, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    train_worker(asdict(TrainConfig(**base)))
    try:
        with pytest.raises(CourseInputError, match="belongs to another run"):
            train_worker(asdict(TrainConfig(**{**base, "steps": 4, "lr": 1e-3})))
    finally:
        cdist.shutdown()  # the failed worker left its (world of 1) process group behind
    assert ck.is_complete(tmp_path / "step-2")


# ---------------------------------------------------------------- verified resume (checksums, fallback)


def _flip_middle_of(step_path: Path, key_part: str, file_name: str) -> str:
    """Flip 4 bytes in the middle of the first stored entry whose name contains ``key_part``."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(step_path)).read_metadata()
    for index, info in meta.storage_data.items():
        if key_part in index.fqn and info.relative_path == file_name:
            middle = info.offset + info.length // 2
            with open(step_path / file_name, "r+b") as fh:
                fh.seek(middle)
                data = fh.read(4)
                fh.seek(middle)
                fh.write(bytes(b ^ 0xFF for b in data))
            return index.fqn
    raise AssertionError(f"no {key_part} in {file_name}")


def test_corrupted_optimizer_state_is_set_aside_and_the_resume_falls_back(tmp_path_factory, reference):
    """The reported case: 4 bytes of exp_avg_sq flipped in rank 0's file; the rerun used to exit 0, wrong.

    The file hashes alone refuse it now; with the record rewritten to match (as whoever rewrote the whole
    folder would), the checksums of what was loaded still do, on 2 ranks."""
    d = tmp_path_factory.mktemp("flipped")
    cfg = dict(strategy="ddp", nproc=2, checkpoint_dir=str(d), checkpoint_every=EVERY)
    train(**cfg, steps=4)
    key = _flip_middle_of(d / "step-4", "exp_avg_sq", "__0_0.distcp")
    _rewrite_record(d / "step-4")
    report = train(**cfg, steps=STEPS)
    assert report["resumed_from"] == [2]
    assert report["weights_sha256"] == reference["ddp"]["weights_sha256"]
    [aside] = (d / "_rejected").iterdir()
    assert aside.name.startswith("step-4-") and f"checksum of {key} differs" in (aside / "REJECTED.txt").read_text()
    logs = "".join(p.read_text() for p in (d / "_launch").rglob("stdout.log"))
    assert logs.count("step-4 set aside") == 1  # one line, from rank 0


def _single(tmp_path, steps, **extra):
    return train_worker(
        asdict(TrainConfig(strategy="single", steps=steps, checkpoint_dir=str(tmp_path), checkpoint_every=2, **extra))
    )


@pytest.fixture(scope="module")
def single_straight():
    """The single-process reference: 6 steps, never interrupted, no checkpoints."""
    return train_worker(asdict(TrainConfig(strategy="single", steps=6)))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "metadata"])
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, single_straight, damage):
    _single(tmp_path, 4)
    step4 = tmp_path / "step-4"
    if damage == "flip":
        _flip_middle_of(step4, "exp_avg", "__0_0.distcp")
    elif damage == "truncate":
        os.truncate(step4 / "__0_0.distcp", 1000)
    elif damage == "delete":
        (step4 / "__0_0.distcp").unlink()
    else:  # same size, other bytes: caught when DCP reads its index
        with open(step4 / ".metadata", "r+b") as fh:
            fh.write(b"\0" * 16)
    resumed = _single(tmp_path, 6)
    assert resumed["resumed_from"] == [2] and resumed["weights_sha256"] == single_straight["weights_sha256"]
    assert [p.name.split("-2026")[0][:6] for p in (tmp_path / "_rejected").iterdir()] == ["step-4"]
    note = {"flip": "(its SHA-256 differs)", "truncate": "were written", "delete": "is missing", "metadata": "SHA-256"}
    assert note[damage] in _rejection_notes(tmp_path)  # refused from its hashes, before anything was unpickled


def test_no_checkpoint_verifies_one_error(tmp_path):
    _single(tmp_path, 4)
    for step in (2, 4):
        os.truncate(tmp_path / f"step-{step}" / "__0_0.distcp", 10)
    try:
        with pytest.raises(
            CourseInputError,
            match=r"no checkpoint in .* can be resumed \(step-4: __0_0.distcp has 10 "
            r"bytes.*; step-2: .*fresh --checkpoint-dir",
        ):
            _single(tmp_path, 6)
    finally:
        cdist.shutdown()
    assert ck.scan(tmp_path)["complete"] == [] and len(list((tmp_path / "_rejected").iterdir())) == 2
    try:  # the same command again (or torchrun's restart) must not quietly train from step 0
        with pytest.raises(CourseInputError, match="every one was set aside"):
            _single(tmp_path, 6)
    finally:
        cdist.shutdown()


def test_cli_reports_an_unusable_folder_in_one_line(tmp_path, capsys):
    from course_utils import cli

    _single(tmp_path, 2)
    os.truncate(tmp_path / "step-2" / "__0_0.distcp", 10)
    status = cli.main(["train", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2", "--steps", "4"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.splitlines()) == 1 and "no checkpoint in" in err and "Traceback" not in err


# ---------------------------------------------------------------- resuming under another strategy


def test_torch_state_resumes_across_strategies_and_zero_flat_is_refused_before_launch(tmp_path, monkeypatch):
    """ddp -> full_shard: DCP reshards the same names, and every checksum verifies after loading.
    ddp -> zero2: flat slices cannot be read from per-parameter state; refused with no worker started."""
    d = tmp_path / "ddp"
    train(strategy="ddp", nproc=2, steps=2, checkpoint_dir=str(d), checkpoint_every=2)
    report = train(strategy="full_shard", nproc=2, steps=4, checkpoint_dir=str(d), checkpoint_every=2)
    assert report["resumed_from"] == [2] and not (d / "_rejected").exists()
    assert ck.read_commit(d, 4)["strategy"] == "full_shard"
    from course_utils import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(CourseInputError, match="cannot be loaded by 'zero2' \\(zero-flat state\\)"):
        train(strategy="zero2", nproc=2, steps=6, checkpoint_dir=str(d), checkpoint_every=2)


def test_state_format_matches_what_each_strategy_saves():
    from course_utils.strategies import STRATEGIES

    with cdist.session() as info:
        for name in STRATEGIES:
            if name == "hybrid_shard":  # needs a world of node_size ranks; its state is FSDP2's, as full_shard's
                continue
            prepared = lab06._one_step({"strategy": name, "steps": 1}, info)
            assert ck.state_of(prepared, name).format == ck.state_format(name), name


# ---------------------------------------------------------------- two ranks in this process's forks


def _two_ranks(fn, *args) -> None:
    """Run ``fn(rank, *args)`` on 2 ranks of a gloo group, launched as every course run is.

    (Forking them from this pytest process instead hung once in DDP's first collective: a fork
    of a process whose thread pools already ran is not safe.)
    """
    from course_utils.launch import launch

    launch(_rank_entry, nproc=2, args=(fn, args), backend="gloo", echo=False)


def _rank_entry(fn, args):
    fn(int(os.environ["RANK"]), *args)


def _stale_view_on_rank1(rank, folder, out):
    if rank == 1:  # rank 1's view of a shared folder lags: it has not seen step-4 yet
        real = ck.scan
        ck.scan = lambda root: {**real(root), "complete": [s for s in real(root)["complete"] if s < 4]}
    report = train_worker(
        asdict(TrainConfig(strategy="ddp", nproc=2, steps=STEPS, checkpoint_dir=folder, checkpoint_every=EVERY))
    )
    if rank == 0:
        Path(out).write_text(json.dumps({k: report[k] for k in ("resumed_from", "weights_sha256")}))


def test_rank0_decides_the_resume_for_every_rank(tmp_path, reference):
    d = tmp_path / "shared"
    train(strategy="ddp", nproc=2, steps=4, checkpoint_dir=str(d), checkpoint_every=EVERY)
    _two_ranks(_stale_view_on_rank1, str(d), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out == {"resumed_from": [4], "weights_sha256": reference["ddp"]["weights_sha256"]}


def _gather_both_ways(rank, strategy, out):
    with cdist.session() as info:
        prepared = lab06._one_step({"strategy": strategy, "nproc": 2, "steps": 1}, info)
        on_rank0 = ck.rank0_full_weights(prepared, strategy)
        everywhere = prepared.full_state_dict()  # the strategy's own all-gather, on every rank
        Path(out, f"{strategy}-{rank}.json").write_text(
            json.dumps(
                {
                    "rank0": weights_sha256(on_rank0) if on_rank0 else None,
                    "devices": sorted({v.device.type for v in on_rank0.values()}),
                    "everywhere": weights_sha256(everywhere),
                }
            )
        )


@pytest.mark.parametrize("strategy", ["full_shard", "zero3"])
def test_full_weights_are_gathered_to_rank0_cpu_only(tmp_path, strategy):
    _two_ranks(_gather_both_ways, strategy, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"{strategy}-{r}.json").read_text()) for r in (0, 1))
    assert r0["rank0"] == r0["everywhere"] and r0["devices"] == ["cpu"]
    assert r1["rank0"] is None and r1["everywhere"] == r0["everywhere"]


def test_prune_removes_what_a_killed_prune_left_and_sets_a_broken_step_aside(tmp_path):
    for s in (2, 4, 6):
        _fake_step(tmp_path, s, commit_step=s)
    half = _fake_step(tmp_path, 1, metadata=False)  # a step-N without its index: damage, never deleted
    (tmp_path / ".pruned-step-0-abc").mkdir()  # what a kill during this prune's rmtree leaves
    ck.prune(tmp_path, keep=2)
    assert not half.exists() and not (tmp_path / ".pruned-step-0-abc").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_rejected", "step-4", "step-6"]
    [aside] = (tmp_path / "_rejected").iterdir()
    assert aside.name.startswith("step-1-") and ".metadata is missing" in (aside / "REJECTED.txt").read_text()


def test_a_non_finite_loss_stops_the_run(tmp_path):
    try:
        with pytest.raises(CourseInputError, match=r"the loss of step \d+ is (nan|inf).*lower the learning rate"):
            train_worker(asdict(TrainConfig(strategy="single", steps=6, lr=1e30)))
    finally:
        cdist.shutdown()


def test_checksums_add_up_across_shards_and_see_a_moved_value(monkeypatch):
    x = torch.randn(37, 11)
    whole = int(checksums._positional_sum(x, [0, 0], x.shape))
    halves = checksums._positional_sum(x[:20], [0, 0], x.shape) + checksums._positional_sum(x[20:], [20, 0], x.shape)
    columns = checksums._positional_sum(x[:, :5], [0, 0], x.shape) + checksums._positional_sum(
        x[:, 5:], [0, 5], x.shape
    )
    assert int(halves) == int(columns) == whole
    monkeypatch.setattr(checksums, "_CHUNK", 50)  # a large tensor is hashed in slices of rows: same number
    assert int(checksums._positional_sum(x, [0, 0], x.shape)) == whole
    swapped = x.clone()
    swapped[3, 4], swapped[5, 6] = x[5, 6], x[3, 4]  # the same values, two of them in each other's place
    assert int(checksums._positional_sum(swapped, [0, 0], x.shape)) != whole


# ---------------------------------------------------------------- what a failure costs, what a checkpoint holds


def test_time_lost_is_read_from_the_attempts_records():
    """Restart from the failed step's start to the resume; redo until the new attempt is back where the old one was."""
    attempts = [
        {"start": 0, "reached": 3, "resumed_at": 0.0, "done_at": [1.0, 2.0, 3.0]},  # dies during step 3
        {"start": 2, "reached": 5, "resumed_at": 10.0, "done_at": [10.5, 11.0, 11.5]},  # redoes step 2
        {"start": 4, "reached": 6, "resumed_at": 20.0, "done_at": [20.5, 21.0]},  # nothing to redo
        {"start": 6, "reached": 6, "resumed_at": 30.0, "done_at": []},
    ]
    attempts[3]["start"], attempts[2]["reached"] = 4, 8  # the last attempt never caught up: it failed first
    rows = recovery.time_lost_per_restart(attempts)
    assert rows[0] == {"redone": 1, "restart_s": 7.0, "redo_s": 0.5, "lost_s": 7.5}
    assert rows[1] == {"redone": 1, "restart_s": 20.0 - 11.5, "redo_s": 0.5, "lost_s": 20.5 - 11.5}
    assert rows[2] is None
    assert recovery.time_lost_per_restart(attempts[:1]) == []


def test_young_interval_is_the_minimum_of_the_overhead_curve():
    job = lab06.interval_tradeoff(
        psi=70e9, gpus=2048, write_gb_s=100, mtbf_s=86400, restart_s=600, step_s=2.0, points=4000
    )
    assert job["bytes"] == 12 * 70e9 and job["save_s"] == pytest.approx(8.4)
    assert job["k_best"] == pytest.approx(job["k_young"], rel=2e-3)  # a grid search against the closed form
    ks = job["k"]
    assert (
        lab06.checkpoint_overhead(ks, step_s=2.0, save_s=8.4, mtbf_s=86400, restart_s=600)
        >= lab06.checkpoint_overhead(job["k_young"], step_s=2.0, save_s=8.4, mtbf_s=86400, restart_s=600) - 1e-12
    ).all()
    assert lab06.checkpoint_bytes(1e9, with_16bit_copy=True) == 14e9


def test_async_save_holds_the_state_at_the_call(tmp_path):
    out = lab06.async_save_demo(tmp_path)
    assert out["digest_loaded"] == out["digest_at_call"] != out["digest_after_next_step"]


def test_a_resave_into_the_same_folder_that_dies_loads_a_mixture_silently(tmp_path):
    out = lab06.torn_by_reused_folder(tmp_path / "reused")
    assert out["died"] and out["index_unchanged"]
    assert out["parts"] == {
        "model": {"old": False, "new": True},
        "optim": {"old": True, "new": False},
        "step": {"old": True, "new": False},
    }


def test_checkpoint_breakdown_counts_12_bytes_per_parameter_from_dcp_metadata(full_shard_ref):
    from course_utils.models import get_config, param_count

    _, d = full_shard_ref
    held = lab06.checkpoint_breakdown(d, STEPS)
    cfg = get_config(TrainConfig().model)
    psi = param_count(cfg)
    assert held["moments"] == 8 * psi  # two fp32 moments, no gradients
    assert held["weights"] == 4 * psi + 4 * cfg.vocab * cfg.width  # a state dict names the tied head twice
    assert held["data"] == sum(p.stat().st_size for p in (Path(d) / f"step-{STEPS}").glob("*.distcp"))
    assert held["data"] >= lab06.checkpoint_bytes(psi)


# ---------------------------------------------------------------- a checkpoint is code (issue 34)


class _RunsCode:
    """What a crafted pickle does: name a function and its argument, which unpickling calls."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_record(step_path: Path, **changes) -> None:
    """Rewrite a step's commit record: its file hashes recomputed (as whoever rewrote the whole folder would)."""
    from course_utils.checkpoint_files import file_record

    marker = json.loads((step_path / "commit.json").read_text())
    marker.update(files=file_record(step_path), **changes)
    (step_path / "commit.json").write_text(json.dumps(marker))


def _rejection_notes(root: Path) -> str:
    return "".join(p.read_text() for p in (root / "_rejected").rglob("*REJECTED.txt"))


def test_a_crafted_index_padded_to_its_size_runs_nothing_and_the_resume_falls_back(tmp_path, single_straight):
    """The reported attack: step-4/.metadata replaced by a pickle that calls os.system, padded to the recorded size."""
    import pickle

    _single(tmp_path / "ck", 4)
    ran = tmp_path / "it-ran"
    meta = tmp_path / "ck" / "step-4" / ".metadata"
    evil = pickle.dumps(_RunsCode(ran), protocol=2)
    meta.write_bytes(evil + b"\0" * (meta.stat().st_size - len(evil)))
    resumed = _single(tmp_path / "ck", 6)
    assert not ran.exists(), "the crafted .metadata ran"
    assert resumed["resumed_from"] == [2] and resumed["weights_sha256"] == single_straight["weights_sha256"]
    assert ".metadata is not the file that was saved (its SHA-256 differs)" in _rejection_notes(tmp_path / "ck")


def test_a_crafted_index_with_a_rewritten_record_is_refused_by_the_unpickler(tmp_path):
    """Whoever rewrites the record too passes the hashes; the index is still read without running what it names."""
    import pickle

    _single(tmp_path / "ck", 2)
    ran = tmp_path / "it-ran"
    step2 = tmp_path / "ck" / "step-2"
    (step2 / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    _rewrite_record(step2)
    with pytest.raises(CourseInputError, match=r"asks to run (posix|os)\.system") as err:
        ck.load_weights(tmp_path / "ck")
    assert "\n" not in str(err.value)
    try:
        with pytest.raises(CourseInputError, match=r"no checkpoint in .* can be resumed \(step-2: .*system"):
            _single(tmp_path / "ck", 4)
    finally:
        cdist.shutdown()
    assert not ran.exists(), "the crafted .metadata ran"
    assert "asks to run" in _rejection_notes(tmp_path / "ck")


def test_a_crafted_byte_entry_in_a_shard_runs_nothing(tmp_path):
    """A shard whose pickled entry (an optimizer hyper-parameter) runs code, record rewritten: refused, not run."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    _single(tmp_path / "ck", 2)
    step2, ran = tmp_path / "ck" / "step-2", tmp_path / "it-ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(checkpoint_id=str(step2))  # our own checkpoint, read as DCP reads it
        state["optim"]["param_groups"][0]["lr"] = _RunsCode(ran)
        crafted = tmp_path / "crafted"
        dcp.save(state, checkpoint_id=str(crafted))
    for f in step2.iterdir():
        if f.name != "commit.json":
            f.unlink()
    for f in crafted.iterdir():
        (step2 / f.name).write_bytes(f.read_bytes())
    _rewrite_record(step2)
    try:
        with pytest.raises(CourseInputError, match=r"step-2: .*asks to run (posix|os)\.system"):
            _single(tmp_path / "ck", 4)
    finally:
        cdist.shutdown()
    assert not ran.exists(), "the crafted byte entry ran"


def test_an_edited_loss_history_is_refused(tmp_path, single_straight):
    _single(tmp_path, 4)
    marker = json.loads((tmp_path / "step-4" / "commit.json").read_text())
    marker["losses"][1] -= 0.5  # a prettier curve
    (tmp_path / "step-4" / "commit.json").write_text(json.dumps(marker))
    resumed = _single(tmp_path, 6)
    assert resumed["resumed_from"] == [2] and resumed["losses"] == single_straight["losses"]
    assert "the loss history in its commit.json is not the one saved with the weights" in _rejection_notes(tmp_path)


@pytest.mark.parametrize(
    "damage, words",
    [
        ("commit-invalid", "commit.json cannot be read"),
        ("commit-missing", "commit.json is missing"),
        ("metadata-folder", ".metadata is not a file"),
    ],
)
def test_a_broken_newest_step_is_set_aside_with_a_note_not_pruned(tmp_path, single_straight, damage, words):
    _single(tmp_path, 4)
    step4 = tmp_path / "step-4"
    if damage == "commit-invalid":
        (step4 / "commit.json").write_text("{not json")
    elif damage == "commit-missing":
        (step4 / "commit.json").unlink()
    else:
        (step4 / ".metadata").unlink()
        (step4 / ".metadata").mkdir()
    resumed = _single(tmp_path, 6)
    assert resumed["resumed_from"] == [2] and resumed["weights_sha256"] == single_straight["weights_sha256"]
    [aside] = (tmp_path / "_rejected").iterdir()
    assert aside.name.startswith("step-4-") and words in (aside / "REJECTED.txt").read_text()
    assert sorted(p.name for p in aside.iterdir() if p.name != "REJECTED.txt")  # the evidence is all there


_RESUME_AS_ANOTHER_USER = """
import json, sys
from dataclasses import asdict
from course_utils.train import TrainConfig, train_worker
cfg = TrainConfig(strategy="single", steps=6, checkpoint_dir=sys.argv[1], checkpoint_every=2)
print(json.dumps({k: train_worker(asdict(cfg))[k] for k in ("resumed_from", "weights_sha256")}))
"""


def _without_root_s_read_anything():
    """``preexec_fn``: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that root's
    next program obeys permission bits as any user does (PR_CAPBSET_DROP, prctl(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0):  # 24: PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_one_before_used(tmp_path, single_straight):
    """Resumed by a process that cannot read step-4 (as root, one without the capability to read anything)."""
    import subprocess
    import sys

    from conftest import ROOT

    _single(tmp_path, 4)
    os.chmod(tmp_path / "step-4", 0)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _RESUME_AS_ANOTHER_USER, str(tmp_path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            preexec_fn=_without_root_s_read_anything if os.geteuid() == 0 else None,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        resumed = json.loads(out.stdout.splitlines()[-1])
        assert resumed == {"resumed_from": [2], "weights_sha256": single_straight["weights_sha256"]}
        assert "it cannot be read (Permission denied)" in _rejection_notes(tmp_path)
    finally:
        for p in tmp_path.glob("_rejected-step-4-*"):
            os.chmod(p, 0o755)


def test_a_full_disk_during_a_save_is_named_and_keeps_the_checkpoint_before(tmp_path, single_straight, capsys):
    """ENOSPC on a small tmpfs: one line naming it, step-2 kept whole; once space is freed the run resumes bit-identical."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)]).returncode:
        pytest.skip("this machine cannot mount a tmpfs")
    try:
        _single(disk / "ck", 2)
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - 256 * 1024))  # room for records, not for a checkpoint
        try:
            with pytest.raises(ck.CheckpointWriteFailed) as err:
                _single(disk / "ck", 6)
        finally:
            cdist.shutdown()
        message = str(err.value)
        assert "\n" not in message and "no space left on the device (ENOSPC)" in message
        assert "the complete checkpoint step-2 is kept" in message
        assert ck.scan(disk / "ck") == {"complete": [2], "incomplete": []}  # nothing half-written left
        # a disk that is full before a run: refused in one line before anything starts
        with open(disk / "more", "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
            except OSError:  # ENOSPC: full
                pass
        from course_utils import cli

        assert cli.main(["train", "--checkpoint-dir", str(disk / "other"), "--checkpoint-every", "2"]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "No space left on device" in err and "Traceback" not in err
        (disk / "more").unlink()
        (disk / "filler").unlink()
        resumed = _single(disk / "ck", 6)
        assert resumed["resumed_from"] == [2] and resumed["weights_sha256"] == single_straight["weights_sha256"]
    finally:
        subprocess.run(["umount", str(disk)])
