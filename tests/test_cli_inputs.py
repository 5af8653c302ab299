"""Bad input on the command line: exit status 2, one line on stderr, no traceback, nothing started.

One row per bad input of every subcommand (``python -m course_utils ...``), called in this
process through ``course_utils.cli.main`` (a subprocess would import torch for every row).
``course_utils.launch.launch`` is replaced by a function that fails the test: a refused
input must be refused before any worker starts.
"""

from __future__ import annotations

import json

import pytest

from course_utils import cli, launch

HUGE = "9" * 400
BEYOND_64_BITS = str(2**64)

ROWS = [
    # the command line itself
    ("no-such-command", ["nope"]),
    # memory (notebook 01)
    ("memory-no-params", ["memory"]),
    ("memory-params-text", ["memory", "--params", "lots"]),
    ("memory-params-empty", ["memory", "--params", ""]),
    ("memory-inf-result", ["memory", "--params", "1e305", "--k", "1e10"]),
    ("memory-dp-0", ["memory", "--params", "7B", "--dp", "0"]),
    ("memory-dp-huge", ["memory", "--params", "7B", "--dp", HUGE]),
    ("memory-mp-negative", ["memory", "--params", "7B", "--mp", "-1"]),
    ("memory-k-nan", ["memory", "--params", "7B", "--k", "nan"]),
    ("memory-k-negative", ["memory", "--params", "7B", "--k", "-1"]),
    ("memory-stage", ["memory", "--params", "7B", "--stage", "zero9"]),
    # table (notebook 01)
    ("table-params-1e40", ["table", "--params", "1e40"]),
    ("table-params-empty", ["table", "--params", ""]),
    ("table-dp-text", ["table", "--dp", "1,x"]),
    ("table-dp-0", ["table", "--dp", "0"]),
    ("table-dp-huge", ["table", "--dp", HUGE]),
    ("table-gpu-mem", ["table", "--gpu-mem", "-5GB"]),
    ("table-k-inf", ["table", "--k", "inf"]),
    ("table-mp-0", ["table", "--mp", "0"]),
    # plan (notebook 05)
    ("plan-no-model", ["plan"]),
    ("plan-vocab-400-digits", ["plan", "--layers", "2", "--width", "256", "--vocab", HUGE]),
    ("plan-params-text", ["plan", "--params", "big"]),
    ("plan-layers-0", ["plan", "--layers", "0", "--width", "256"]),
    ("plan-width-0", ["plan", "--layers", "2", "--width", "0"]),
    ("plan-heads", ["plan", "--layers", "2", "--width", "256", "--heads", "3"]),
    ("plan-seq-0", ["plan", "--params", "7B", "--seq", "0"]),
    ("plan-micro-batch-0", ["plan", "--params", "7B", "--micro-batch", "0"]),
    ("plan-k-negative", ["plan", "--params", "7B", "--k", "-1"]),
    ("plan-nodes-0", ["plan", "--params", "7B", "--nodes", "0"]),
    ("plan-gpus-per-node-0", ["plan", "--params", "7B", "--gpus-per-node", "0"]),
    ("plan-mp-0", ["plan", "--params", "7B", "--mp", "0"]),
    ("plan-gpu-mem", ["plan", "--params", "7B", "--gpu-mem", "lots"]),
    ("plan-intra-bw", ["plan", "--params", "7B", "--intra-bw", "fast"]),
    ("plan-inter-bw", ["plan", "--params", "7B", "--inter-bw", "0GB/s"]),
    ("plan-pcie-bw", ["plan", "--params", "7B", "--pcie-bw", "-1GB/s"]),
    ("plan-hbm-bw", ["plan", "--params", "7B", "--hbm-bw", "x"]),
    ("plan-host-mem", ["plan", "--params", "7B", "--host-mem", "x"]),
    ("plan-tflops-nan", ["plan", "--params", "7B", "--tflops", "nan"]),
    ("plan-reserve-1", ["plan", "--params", "7B", "--reserve", "1"]),
    # train (notebooks 02-06)
    ("train-strategy", ["train", "--strategy", "nope"]),
    ("train-nproc-0", ["train", "--nproc", "0"]),
    ("train-single-nproc-2", ["train", "--nproc", "2"]),
    ("train-steps-0", ["train", "--steps", "0"]),
    ("train-steps-23-digits", ["train", "--steps", "99999999999999999999999"]),
    ("train-model", ["train", "--model", "huge"]),
    ("train-batch", ["train", "--strategy", "ddp", "--nproc", "2", "--batch", "3"]),
    ("train-lr-inf", ["train", "--lr", "inf"]),
    ("train-lr-nan", ["train", "--lr", "nan"]),
    ("train-lr-0", ["train", "--lr", "0"]),
    ("train-seed-beyond-64-bits", ["train", "--seed", BEYOND_64_BITS]),
    ("train-seed-negative", ["train", "--seed", "-1"]),
    ("train-precision", ["train", "--precision", "fp8"]),
    ("train-bucket-nan", ["train", "--strategy", "ddp", "--nproc", "2", "--bucket-cap-mb", "nan"]),
    ("train-bucket-negative", ["train", "--strategy", "ddp", "--nproc", "2", "--bucket-cap-mb", "-1"]),
    ("train-node-size-0", ["train", "--strategy", "hybrid_shard", "--nproc", "2", "--node-size", "0"]),
    ("train-option-value", ["train", "--strategy", "full_shard", "--nproc", "2", "--option", "prefetch=maybe"]),
    ("train-option-unknown", ["train", "--strategy", "ddp", "--nproc", "2", "--option", "bogus_knob=1"]),
    ("train-option-unknown-fsdp", ["train", "--strategy", "full_shard", "--nproc", "2", "--option", "bogus_knob=1"]),
    ("train-option-form", ["train", "--option", "prefetch"]),
    ("train-option-no-key", ["train", "--strategy", "full_shard", "--nproc", "2", "--option", "=1"]),
    ("train-backend", ["train", "--backend", "mpi"]),
    ("train-timeout-nan", ["train", "--timeout-s", "nan"]),
    ("train-timeout-inf", ["train", "--timeout-s", "inf"]),
    ("train-timeout-0", ["train", "--timeout-s", "0"]),
    ("train-checkpoint-dir-file", ["train", "--checkpoint-dir", "{file}"]),
    ("train-checkpoint-dir-under-file", ["train", "--checkpoint-dir", "{file}/runs"]),
    ("train-checkpoint-dir-empty", ["train", "--checkpoint-dir", ""]),
    ("train-checkpoint-every-no-dir", ["train", "--checkpoint-every", "2"]),
    ("train-checkpoint-every-negative", ["train", "--checkpoint-dir", "{dir}", "--checkpoint-every", "-1"]),
    ("train-keep-1", ["train", "--checkpoint-dir", "{dir}", "--keep-checkpoints", "1"]),
    ("train-max-restarts-negative", ["train", "--max-restarts", "-1"]),
    ("train-fail-at-form", ["train", "--strategy", "ddp", "--nproc", "2", "--fail-at", "one:two"]),
    ("train-fail-at-rank", ["train", "--strategy", "ddp", "--nproc", "2", "--fail-at", "2:1"]),
    ("train-fail-at-beyond-steps", ["train", "--strategy", "ddp", "--nproc", "2", "--steps", "8", "--fail-at", "1:8"]),
    (
        "train-fail-during-save-step",
        [
            "train",
            "--strategy",
            "ddp",
            "--nproc",
            "2",
            "--steps",
            "6",
            "--checkpoint-dir",
            "{dir}",
            "--checkpoint-every",
            "2",
            "--fail-during-save",
            "1:3",
        ],
    ),
    ("train-save-weights-folder", ["train", "--save-weights", "{dir}"]),
    ("train-save-weights-under-file", ["train", "--save-weights", "{file}/w.pt"]),
    ("train-resume-other-settings", ["train", "--checkpoint-dir", "{ckpt_single}", "--lr", "0.001"]),
    ("train-resume-other-strategy", ["train", "--strategy", "ddp", "--nproc", "2", "--checkpoint-dir", "{ckpt_zero}"]),
    (
        "train-resume-other-buckets",
        ["train", "--strategy", "zero2", "--nproc", "2", "--checkpoint-dir", "{ckpt_zero}", "--bucket-cap-mb", "1"],
    ),
    ("train-resume-all-set-aside", ["train", "--checkpoint-dir", "{ckpt_rejected}"]),
    # rehearse (notebook 05b)
    ("rehearse-params-empty", ["rehearse", "--params", ""]),
    ("rehearse-params-text", ["rehearse", "--params", "huge"]),
    ("rehearse-nproc-0", ["rehearse", "--nproc", "0"]),
    ("rehearse-nproc-5000", ["rehearse", "--nproc", "5000"]),
    ("rehearse-strategy", ["rehearse", "--strategy", "zero9"]),
    ("rehearse-layers-0", ["rehearse", "--layers", "0"]),
    ("rehearse-width-0", ["rehearse", "--width", "0"]),
    ("rehearse-heads", ["rehearse", "--heads", "7"]),
    ("rehearse-vocab-400-digits", ["rehearse", "--vocab", HUGE]),
    ("rehearse-seq-0", ["rehearse", "--seq", "0"]),
    ("rehearse-micro-batch-0", ["rehearse", "--micro-batch", "0"]),
    ("rehearse-node-size", ["rehearse", "--strategy", "hybrid_shard", "--node-size", "3"]),
    ("rehearse-unit", ["rehearse", "--unit", "TB"]),
    ("rehearse-precision", ["rehearse", "--mixed-precision", "fp8"]),
    # ft (notebook 06)
    ("ft-replicas-0", ["ft", "--replicas", "0"]),
    ("ft-steps-0", ["ft", "--steps", "0"]),
    ("ft-kill-form", ["ft", "--kill", "x"]),
    ("ft-kill-beyond-steps", ["ft", "--steps", "4", "--kill", "1:9"]),
    ("ft-lr-inf", ["ft", "--lr", "inf"]),
    ("ft-seed-beyond-64-bits", ["ft", "--seed", BEYOND_64_BITS]),
    ("ft-timeout-nan", ["ft", "--timeout-s", "nan"]),
    ("ft-heartbeat-0", ["ft", "--heartbeat-timeout-ms", "0"]),
    ("ft-restart-after-negative", ["ft", "--restart-after", "-1"]),
    ("ft-model", ["ft", "--model", "huge"]),
    ("ft-batch", ["ft", "--batch", "3"]),
    # exercises (notebooks 01-06)
    ("exercises-grade-missing", ["exercises", "--grade", "{file}.ipynb"]),
    ("exercises-run", ["exercises", "--run", "bogus"]),
    # bench: python -m tools.bench refuses its own bad input (tests/test_bench.py); the CLI hands it over
]


def _commit(folder, **marker):
    """A complete-looking step-2 whose commit marker says what the real one would."""
    step = folder / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"m")
    (step / "__0_0.distcp").write_bytes(b"x")
    base = {
        "step": 2,
        "model": "tiny",
        "seed": 0,
        "batch": 8,
        "lr": 3e-3,
        "precision": "fp32",
        "bucket_cap_mb": 25.0,
        "files": {".metadata": 1, "__0_0.distcp": 1},
        "checksums": {},
    }
    (step / "commit.json").write_text(json.dumps({**base, **marker}))
    return folder


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "results.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "ck-rejected" / "_rejected" / "step-2-20260101-000000-abcd").mkdir(parents=True)
    return {
        "file": str(tmp_path / "a-file"),
        "dir": str(tmp_path / "empty"),
        "corrupt": str(tmp_path / "corrupt"),
        "ckpt_single": str(_commit(tmp_path / "ck-single", strategy="single", format="torch")),
        "ckpt_zero": str(_commit(tmp_path / "ck-zero", strategy="zero2", format="zero-flat")),
        "ckpt_rejected": str(tmp_path / "ck-rejected"),
    }


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("a worker was launched for input that should have been refused")

    monkeypatch.setattr(launch, "launch", refuse)


@pytest.mark.parametrize("name, argv", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_exits_2_with_one_line(name, argv, paths, nothing_starts, capsys):
    argv = [a.format(**paths) for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert status == 2, (status, out.err[-2000:])
    assert len(lines) == 1 and lines[0].strip(), out.err[-2000:]
    assert "Traceback" not in out.err + out.out
