"""course_utils.train: the report's fields, bad input, determinism, and the two command lines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from conftest import ROOT

from course_utils import comm
from course_utils.errors import CourseInputError
from course_utils.instrument import weights_sha256
from course_utils.models import build_model, param_count
from course_utils.train import TrainConfig, train, train_worker

PSI = param_count(build_model("tiny"))
ARGS = ["--strategy", "ddp_scratch", "--steps", "3", "--bucket-cap-mb", "0.1", "--json"]


def _run(cmd, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory):
    """``python -m course_utils train ... --json`` on 2 ranks (launched by course_utils.launch)."""
    path = tmp_path_factory.mktemp("w") / "weights.pt"
    proc = _run([sys.executable, "-m", "course_utils", "train", "--nproc", "2", *ARGS, "--save-weights", str(path)])
    return _last_json(proc), torch.load(path)


def test_json_report_has_every_field(cli_report):
    report, _ = cli_report
    assert report["strategy"] == "ddp_scratch" and report["world_size"] == 2 and report["steps"] == 3
    assert report["backend"] in ("gloo", "nccl")
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])
    assert report["losses"][-1] < report["losses"][0]  # the learnable sequences: the loss falls
    assert len(report["weights_sha256"]) == 64 and int(report["weights_sha256"], 16) >= 0
    assert report["step_time_s"] > 0
    assert report["command"].startswith("torchrun --standalone --nproc-per-node 2 -m course_utils.train")


def test_per_rank_bytes_are_the_fp32_adam_bill(cli_report):
    report, _ = cli_report
    assert [row["rank"] for row in report["per_rank"]] == [0, 1]
    for row in report["per_rank"]:  # fp32 Adam: 4 (weights) + 4 (gradients) + 8 (m, v) bytes per parameter
        assert (row["params"], row["grads"], row["optim"], row["total"]) == (4 * PSI, 4 * PSI, 8 * PSI, 16 * PSI)


def test_comm_per_step_counts_one_all_reduce_per_bucket(cli_report):
    report, _ = cli_report
    row = report["comm_per_step"]["all_reduce"]
    assert row["calls"] == report["strategy_info"]["buckets"] > 1
    assert row["payload_bytes"] == 4 * PSI  # every fp32 gradient, once per step
    assert row["sent_bytes"] == pytest.approx(4 * comm.all_reduce_sent(PSI, 2))
    assert set(report["comm_per_step"]) == {"all_reduce"}  # nothing else inside the step
    assert report["comm_per_step_by_rank"][1] == report["comm_per_step"]


def test_weights_hash_is_over_the_saved_full_state_dict(cli_report):
    report, weights = cli_report
    assert sorted(weights) == sorted(build_model("tiny").state_dict())
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights_sha256(weights) == report["weights_sha256"]


def test_plain_torchrun_runs_the_same_training(cli_report):
    report, _ = cli_report
    proc = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_utils.train",
            *ARGS,
        ]
    )
    under_torchrun = _last_json(proc)
    assert under_torchrun["world_size"] == 2
    assert under_torchrun["losses"] == report["losses"]
    assert under_torchrun["weights_sha256"] == report["weights_sha256"]


def test_single_is_deterministic_across_launch_and_a_plain_process(monkeypatch):
    cfg = TrainConfig(strategy="single", steps=2)
    launched = train(cfg)
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    in_process = train_worker(asdict(cfg))  # a world of one, no launcher
    assert launched["weights_sha256"] == in_process["weights_sha256"]
    assert launched["losses"] == in_process["losses"]
    assert launched["comm_per_step"] == {}  # one process: no collective inside the step


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy": "zero9"}, "unknown strategy"),
        ({"strategy": "ddp", "nproc": 0}, "nproc must be a whole number"),
        ({"steps": 0}, "steps must be a whole number"),
        ({"strategy": "ddp", "nproc": 3}, "does not divide by 3"),
        ({"strategy": "single", "nproc": 2}, "one-process reference"),
        ({"model": "huge"}, "unknown model"),
    ],
)
def test_bad_config_says_what_to_do(overrides, message):
    with pytest.raises(CourseInputError, match=message):
        TrainConfig(**overrides).validate()
    with pytest.raises(CourseInputError, match=message):
        train(**overrides)  # nothing is launched


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "course_utils", "train", "--strategy", "zero9"],
        ["-m", "course_utils", "train", "--strategy", "ddp", "--nproc", "3"],
        ["-m", "course_utils.train", "--strategy", "zero9"],
    ],
)
def test_bad_command_line_exits_2_with_one_line(argv):
    proc = _run([sys.executable, *argv], timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "error:" in proc.stderr
