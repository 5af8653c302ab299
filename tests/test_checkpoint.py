"""course_utils.checkpoint and the recovery half of train (notebook 06).

Every claim is checked against a run that never failed: a run that loses a rank and resumes
must end with the same weights bit for bit (same world size), or the same losses within
fp32 reduction-order noise (a different world size). Launches are shared through
module-scoped fixtures; the cheap rules (what counts as complete, pruning, validation) run
in this process.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from course_utils import checkpoint as ck
from course_utils import dist as cdist
from course_utils.errors import CourseInputError
from course_utils.instrument import weights_sha256
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

@pytest.mark.parametrize("strategy, fail_at, resumed, redone", [
    ("ddp", "1:3,0:4", [2, 4], 1),  # two kill steps in one run: mid-interval, then right at a checkpoint
    ("zero3", "0:5", [4], 1),
])
def test_resume_after_a_lost_rank_is_bit_identical(tmp_path_factory, reference, strategy, fail_at, resumed, redone):
    report, d = run(tmp_path_factory, strategy, strategy=strategy, fail_at=fail_at, max_restarts=2)
    ref = reference[strategy]
    assert report["weights_sha256"] == ref["weights_sha256"]
    assert report["losses"] == ref["losses"]
    assert report["restarts"] == len(fail_at.split(","))
    assert report["resumed_from"] == resumed and report["steps_redone"] == redone
    rows = ck.attempt_logs(d, report["run_id"])
    first = [r for r in rows if r["attempt"] == 0]
    rank, step = ck.parse_failures(fail_at)[0]
    assert [r["ending"] for r in first if r["rank"] == rank] == [ck.ENDINGS["died"]]
    # nobody finished the step the dead rank never sent its gradients for
    assert all(r["last_step_done"] == step - 1 for r in first)
    assert all(r["ending"] != ck.ENDINGS["finished"] for r in first)
    last = [r for r in rows if r["attempt"] == report["restarts"]]
    assert len(last) == 2 and all(r["ending"] == ck.ENDINGS["finished"] for r in last)
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

@pytest.mark.parametrize("saved_by, resumed_on", [(2, 4), (4, 2)])
def test_world_size_change_reshards_and_training_continues(tmp_path_factory, full_shard_ref, saved_by, resumed_on):
    ref, ref_dir = full_shard_ref
    source = ref_dir
    if saved_by == 4:  # a checkpoint written by 4 ranks: resume the 2-rank one on 4 first
        source = tmp_path_factory.mktemp("by4")
        ck.copy_checkpoint(ref_dir, 2, source)
        train(strategy="full_shard", nproc=4, steps=4, checkpoint_dir=str(source), checkpoint_every=EVERY)
        assert ck.read_commit(source, 4)["world_size"] == 4
    start = 2 if saved_by == 2 else 4
    d = tmp_path_factory.mktemp(f"resume-{saved_by}-{resumed_on}")
    ck.copy_checkpoint(source, start, d)
    report = train(strategy="full_shard", nproc=resumed_on, steps=STEPS, checkpoint_dir=str(d),
                   checkpoint_every=EVERY)
    assert report["resumed_from"] == [start] and report["world_size"] == resumed_on
    assert report["attempts"][0]["complete_seen"] == [start]
    # the loaded weights hashed to the value recorded at save time (checked in load); after that
    # only the reduction order differs from the run that never changed size
    assert report["losses"][:2] == ref["losses"][:2]  # the history saved with the checkpoint
    assert torch.allclose(torch.tensor(report["losses"]), torch.tensor(ref["losses"]), rtol=RTOL_WORLD_CHANGE, atol=0)


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
    _fake_step(tmp_path, 4, metadata=True)               # DCP finished, never committed
    _fake_step(tmp_path, 6, metadata=False, commit_step=6)  # a marker without DCP's index
    _fake_step(tmp_path, 8, commit_step=7)               # a marker for another step
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


@pytest.mark.parametrize("overrides, words", [
    ({"keep_checkpoints": 1}, "keep_checkpoints must be >= 2"),
    ({"checkpoint_every": 2, "checkpoint_dir": None}, "needs --checkpoint-dir"),
    ({"fail_during_save": "1:3"}, "not a checkpoint step"),
    ({"fail_at": "2:1"}, "rank must be in 0..1"),
    ({"fail_at": "one:two"}, "takes RANK:STEP"),
])
def test_bad_recovery_settings_say_what_to_do(tmp_path, overrides, words):
    cfg = dict(strategy="ddp", nproc=2, steps=6, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(CourseInputError, match=words):
        TrainConfig(**{**cfg, **overrides}).validate()


def test_failure_plan_is_one_item_per_attempt():
    assert ck.parse_failures("1:3, 0:5") == [(1, 3), (0, 5)]
    assert ck.planned_failure("1:3,0:5", rank=1, attempt=0) == 3
    assert ck.planned_failure("1:3,0:5", rank=1, attempt=1) is None
    assert ck.planned_failure("1:3,0:5", rank=0, attempt=1) == 5
    assert ck.planned_failure("1:3", rank=1, attempt=1) is None  # first attempt only
    assert ck.planned_failure(None, rank=0, attempt=0) is None


def test_resuming_with_other_settings_is_refused(tmp_path):
    base = dict(strategy="single", nproc=1, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    train_worker(asdict(TrainConfig(**base)))
    try:
        with pytest.raises(CourseInputError, match="belongs to another run"):
            train_worker(asdict(TrainConfig(**{**base, "steps": 4, "lr": 1e-3})))
    finally:
        cdist.shutdown()  # the failed worker left its (world of 1) process group behind
    assert ck.is_complete(tmp_path / "step-2")
