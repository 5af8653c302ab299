"""course_utils.train: the report's fields, bad input, determinism, and the two command lines.

Both command lines run watched (``listening.watch``, issue 34): ``train`` under ``launch`` listens on loopback
only; the README's single-machine torchrun line leaves only torchrun's own rendezvous stores beyond it
(torch 2.13's ``TCPStore`` takes no bind address; the README says so where it gives the line).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import ROOT, subprocess_tmpdir
from listening import watch

from course_utils import comm, predict
from course_utils.errors import CourseInputError
from course_utils.instrument import weights_sha256
from course_utils.models import build_model, param_count
from course_utils.train import TrainConfig, train, train_worker

PSI = param_count(build_model("tiny"))
#: The README's single-machine torchrun line's arguments, and a bucket cap small enough for several buckets.
README_LINE = next(
    ln
    for ln in (ROOT / "README.md").read_text().splitlines()
    if ln.startswith("torchrun --standalone") and not ln.endswith("\\")
)
BUCKETS = ["--bucket-cap-mb", "0.1"]
ARGS = [*README_LINE.split(" -m course_utils.train ")[1].split(), *BUCKETS]
STEPS = int(ARGS[ARGS.index("--steps") + 1])


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    venv_bin = str(Path(sys.executable).parent)  # `torchrun` as the README says it: the venv's
    return {**env, "PATH": venv_bin + os.pathsep + env.get("PATH", ""), "TMPDIR": subprocess_tmpdir()}


def _run(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())


def _last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _watched(argv, **kwargs) -> tuple[dict, set]:
    """A command's last JSON line, and every socket its processes listened on beyond loopback as it ran."""
    seen, proc = watch(argv, **kwargs)
    assert proc.returncode == 0, proc.output[-3000:]
    return json.loads(next(ln for ln in reversed(proc.output.splitlines()) if ln.startswith("{"))), seen


@pytest.fixture(scope="module")
def cli_report(tmp_path_factory):
    """``python -m course_utils train ... --json`` on 2 ranks (launched by course_utils.launch), watched."""
    path = tmp_path_factory.mktemp("w") / "weights.pt"
    argv = [sys.executable, "-m", "course_utils", "train", "--nproc", "2", *ARGS, "--save-weights", str(path)]
    report, seen = _watched(argv, cwd=ROOT, env=_env())
    return report, torch.load(path), seen


def test_json_report_has_every_field(cli_report):
    report, _, _ = cli_report
    assert report["strategy"] == "ddp_scratch" and report["world_size"] == 2 and report["steps"] == STEPS
    assert report["backend"] in ("gloo", "nccl")
    assert len(report["losses"]) == STEPS and all(math.isfinite(x) for x in report["losses"])
    assert report["losses"][-1] < report["losses"][0]  # the learnable sequences: the loss falls
    assert len(report["weights_sha256"]) == 64 and int(report["weights_sha256"], 16) >= 0
    assert report["step_time_s"] > 0
    assert report["command"].startswith("torchrun --standalone --nproc-per-node 2 -m course_utils.train")


def test_per_rank_bytes_are_the_fp32_adam_bill(cli_report):
    report, _, _ = cli_report
    assert [row["rank"] for row in report["per_rank"]] == [0, 1]
    steps = 4 * predict.model_tensors("tiny")  # Adam's 0-dim step counter, one per tensor
    for row in report["per_rank"]:  # fp32 Adam: 4 (weights) + 4 (gradients) + 8 (m, v) bytes per parameter
        assert (row["params"], row["grads"], row["optim"], row["steps"]) == (4 * PSI, 4 * PSI, 8 * PSI, steps)
        assert row["total"] == 16 * PSI + steps


def test_comm_per_step_counts_one_all_reduce_per_bucket(cli_report):
    report, _, _ = cli_report
    row = report["comm_per_step"]["all_reduce"]
    assert row["calls"] == report["strategy_info"]["buckets"] > 1
    assert row["payload_bytes"] == 4 * PSI  # every fp32 gradient, once per step
    assert row["sent_bytes"] == pytest.approx(4 * comm.all_reduce_sent(PSI, 2))
    assert set(report["comm_per_step"]) == {"all_reduce"}  # nothing else inside the step
    assert report["comm_per_step_by_rank"][1] == report["comm_per_step"]


def test_weights_hash_is_over_the_saved_full_state_dict(cli_report):
    report, weights, _ = cli_report
    assert sorted(weights) == sorted(build_model("tiny").state_dict())
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights_sha256(weights) == report["weights_sha256"]


def test_train_listens_on_loopback_only(cli_report):
    *_, seen = cli_report
    assert seen == set(), f"listening beyond loopback: {sorted(seen)}"


def test_plain_torchrun_runs_the_same_training(cli_report, tmp_path):
    """The README's line as printed (and the bucket cap), from a folder that is not the repository."""
    report, _, _ = cli_report
    under_torchrun, seen = _watched(f"{README_LINE} {' '.join(BUCKETS)}", shell=True, cwd=tmp_path, env=_env())
    # what listens beyond loopback: torchrun's TCPStore servers (no bind address in torch 2.13), in torchrun's
    # own process; the workers' gloo sockets are on loopback
    assert all("torchrun" in command and table == "tcp6" for command, table, _ in seen), sorted(seen)
    assert len(seen) <= 2, sorted(seen)
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
