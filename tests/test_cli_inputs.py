"""Bad input, on the command line and to the Python API: refused in one line, before anything starts.

The adversarial pass of issue 34 tried 238 bad inputs; this is that table, kept. Three parts:

- ``ROWS``: bad input of every subcommand (``python -m course_utils ...``), called in this process
  through ``course_utils.cli.main`` (a subprocess would import torch for every row), the issue's
  hangs, tracebacks and wrong successes among them;
- ``RANGE_ROWS``: generated from ``validate.RANGES``, the stated range of every number every
  subcommand takes: a value below it, above it, and of the wrong kind, each refused naming its flag;
- ``API_ROWS``: the same layer behind the functions (``launch``, ``train``, ``ft_run``, the cluster).

Every row must exit 2 (or raise ``CourseInputError``) with one line and no traceback, without
starting a process (``subprocess.Popen`` and ``os.fork`` fail the test) and without hanging (an
alarm fails a row after ``HANG_S``). The few inputs that can only be judged by running (a run longer
than its timeout) are ``MUST_LAUNCH``: they launch, and end in one message without a traceback.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

from course_utils import cli, launch, validate
from course_utils.errors import CourseInputError

sys.path.insert(0, str(ROOT))
from tools import bench  # noqa: E402

#: A refusal takes milliseconds; a row still running after this long is a hang.
HANG_S = 20

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
    ("plan-nodes-0", ["plan", "--params", "7B", "--nodes", "0"]),
    ("plan-gpus-per-node-0", ["plan", "--params", "7B", "--gpus-per-node", "0"]),
    ("plan-gpu-mem", ["plan", "--params", "7B", "--gpu-mem", "lots"]),
    ("plan-intra-bw", ["plan", "--params", "7B", "--intra-bw", "fast"]),
    ("plan-inter-bw", ["plan", "--params", "7B", "--inter-bw", "0GB/s"]),
    ("plan-host-mem", ["plan", "--params", "7B", "--host-mem", "x"]),
    ("plan-tflops-nan", ["plan", "--params", "7B", "--tflops", "nan"]),
    ("plan-reserve-1", ["plan", "--params", "7B", "--reserve", "1"]),
    ("plan-micro-batch-0", ["plan", "--params", "7B", "--micro-batch", "0"]),
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
    # issue 34's pass: hangs
    ("plan-nodes-14-digits", ["plan", "--params", "70B", "--nodes", "99999999999999"]),
    ("ft-timeout-1e300", ["ft", "--timeout-s", "1e300"]),
    # issue 34's pass: accepted, then a traceback from the workers
    ("train-seed-15-digits", ["train", "--seed", "100000000000000"]),
    ("train-timeout-1e300", ["train", "--timeout-s", "1e300"]),
    ("train-bucket-1e300", ["train", "--strategy", "ddp", "--nproc", "2", "--bucket-cap-mb", "1e300"]),
    ("train-batch-2-40", ["train", "--batch", "1099511627776"]),
    ("ft-seed-15-digits", ["ft", "--seed", "100000000000000"]),
    # issue 34's pass: wrong successes
    ("train-nproc-million", ["train", "--strategy", "ddp", "--nproc", "1000000", "--batch", "1000000"]),
    ("cluster-9-nodes-of-1000", ["cluster", "--nodes", "9", "--nproc-per-node", "1000"]),
    ("ft-replicas-1000", ["ft", "--replicas", "1000", "--batch", "1000"]),
    ("memory-params-half", ["memory", "--params", "0.5"]),
    ("memory-params-7.5", ["memory", "--params", "7.5"]),
    ("table-params-0.001", ["table", "--params", "0.001"]),
    ("plan-params-7.5", ["plan", "--params", "7.5"]),
    ("cluster-wall-timeout-0", ["cluster", "--wall-timeout-s", "0"]),
    ("cluster-link-0mbit", ["cluster", "--link", "0mbit"]),
    ("cluster-link-0.0gbit", ["cluster", "--link", "0.0gbit"]),
    # issue 34's pass: not one line
    ("memory-k-1e308", ["memory", "--params", "7.5B", "--k", "1e308"]),
    ("table-k-1e308", ["table", "--k", "1e308"]),
    # more of the same kinds
    ("train-timeout-week-plus", ["train", "--timeout-s", "604801"]),
    ("train-seed-2-32", ["train", "--seed", str(2**32)]),
    ("train-keep-huge", ["train", "--checkpoint-dir", "{dir}", "--keep-checkpoints", "1000000"]),
    ("train-max-restarts-huge", ["train", "--max-restarts", "1000000"]),
    ("train-node-size-huge", ["train", "--strategy", "hybrid_shard", "--nproc", "2", "--node-size", "1000000"]),
    ("plan-gpus-per-node-huge", ["plan", "--params", "7B", "--gpus-per-node", "100000"]),
    ("plan-layers-huge", ["plan", "--layers", "10000000", "--width", "256"]),
    ("plan-reserve-negative", ["plan", "--params", "7B", "--reserve", "-0.1"]),
    ("plan-tflops-0", ["plan", "--params", "7B", "--tflops", "0"]),
    ("memory-dp-huge-range", ["memory", "--params", "7B", "--dp", "100000000"]),
    ("table-dp-huge-range", ["table", "--dp", "1,100000000"]),
    ("table-dp-negative", ["table", "--dp", "-4"]),
    ("ft-heartbeat-huge", ["ft", "--heartbeat-timeout-ms", "100000000"]),
    ("ft-steps-huge", ["ft", "--steps", "10000000"]),
    ("ft-restart-after-huge", ["ft", "--restart-after", "10000000"]),
    ("rehearse-nproc-1025", ["rehearse", "--nproc", "1025"]),
    ("cluster-nodes-1", ["cluster", "--nodes", "1"]),
    ("cluster-nodes-10", ["cluster", "--nodes", "10"]),
    ("cluster-nproc-per-node-0", ["cluster", "--nproc-per-node", "0"]),
    ("cluster-link-text", ["cluster", "--link", "fast"]),
    ("cluster-timeout-1e300", ["cluster", "--timeout-s", "1e300"]),
    ("cluster-steps-0", ["cluster", "--steps", "0"]),
    ("cluster-strategy", ["cluster", "--strategy", "nope"]),
]

#: ``python -m tools.bench`` (``python -m course_utils bench`` hands its arguments over to it).
BENCH_ROWS = [
    ("bench-repeats-11-digits", ["--sections", "launch", "--repeats", "99999999999", "--out", "{dir}"]),
    ("bench-sections-empty", ["--sections", "", "--out", "{dir}"]),
    ("bench-notebooks-99", ["--sections", "notebooks", "--notebooks", "99", "--out", "{dir}"]),
    ("bench-render-other-shape", ["--render-only", "--out", "{other_shape}"]),
    ("bench-render-a-list", ["--render-only", "--out", "{a_list}"]),
    ("bench-rounds-huge", ["--rounds", "1000000", "--out", "{dir}"]),
    ("bench-steps-huge", ["--steps", "1000000", "--out", "{dir}"]),
]

#: Inputs that can only be judged by running: they launch, and end in one message, no traceback.
MUST_LAUNCH = [
    (
        "train-longer-than-its-timeout",
        ["train", "--steps", "100000000", "--timeout-s", "3"],
        "did not finish within 3 s",
    ),
]


def _range_rows() -> list:
    """Per subcommand and per number it takes, from its stated range: below, above, the wrong kind."""
    base = {
        "memory": ["memory", "--params", "7B"],
        "table": ["table"],
        "plan": ["plan", "--params", "7B"],
        "train": ["train"],
        "cluster": ["cluster"],
        "ft": ["ft"],
        "rehearse": ["rehearse"],
    }
    rows = []
    for command, argv in base.items():
        for name, rule in validate.RANGES[command].items():
            flag = validate.flag(name)
            # what the machine can start changes with its free memory: above it is above the ceiling
            high = validate.MAX_LOCAL_RANKS if callable(rule.high) else rule.high
            low = rule.low - (0 if rule.above_low else (1 if rule.whole else 0.5))
            values = {"below": low}
            if math.isfinite(high):
                values["above"] = high + 1 if rule.whole else high * 2
            values["kind"] = "2.5" if rule.whole else "lots"
            for what, value in values.items():
                text = str(int(value)) if isinstance(value, float) and rule.whole and what != "kind" else str(value)
                rows.append((f"{command}-{name}-{what}", [*argv, flag, text], flag))
    return rows


RANGE_ROWS = _range_rows()


def _commit(folder, **marker):
    """A complete step-2 whose commit record says what the real one would (file hashes included)."""
    from course_utils.checkpoint_files import file_record

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
        "files": file_record(step),
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
    (tmp_path / "other-shape").mkdir()
    (tmp_path / "other-shape" / "results.json").write_text(json.dumps({"meta": 3, "launch": [1, 2]}))
    (tmp_path / "a-list").mkdir()
    (tmp_path / "a-list" / "results.json").write_text("[1, 2, 3]")
    return {
        "other_shape": str(tmp_path / "other-shape"),
        "a_list": str(tmp_path / "a-list"),
        "file": str(tmp_path / "a-file"),
        "dir": str(tmp_path / "empty"),
        "corrupt": str(tmp_path / "corrupt"),
        "ckpt_single": str(_commit(tmp_path / "ck-single", strategy="single", format="torch")),
        "ckpt_zero": str(_commit(tmp_path / "ck-zero", strategy="zero2", format="zero-flat")),
        "ckpt_rejected": str(tmp_path / "ck-rejected"),
    }


def _refuse(*args, **kwargs):
    pytest.fail("a process was started for input that should have been refused")


@pytest.fixture
def nothing_starts(monkeypatch, no_process):
    """A refused command line launches no worker (and starts no process: ``no_process``)."""
    monkeypatch.setattr(launch, "launch", _refuse)


@pytest.fixture
def no_process(monkeypatch):
    """No process of any kind is started, and nothing takes longer than ``HANG_S``."""
    refuse = _refuse
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)

    def hung(signum, frame):
        pytest.fail(f"no refusal within {HANG_S} s: a hang")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _one_line_exit_2(run, capsys, must_name=None) -> None:
    try:
        status = run()
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert status == 2, (status, out.err[-2000:])
    assert len(lines) == 1 and lines[0].strip(), out.err[-2000:]
    assert "Traceback" not in out.err + out.out
    if must_name:
        assert must_name in lines[0], lines[0]


@pytest.mark.parametrize("name, argv", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_exits_2_with_one_line(name, argv, paths, nothing_starts, capsys):
    _one_line_exit_2(lambda: cli.main([a.format(**paths) for a in argv]), capsys)


@pytest.mark.parametrize("name, argv, flag", RANGE_ROWS, ids=[r[0] for r in RANGE_ROWS])
def test_every_number_is_held_to_its_stated_range(name, argv, flag, nothing_starts, capsys):
    _one_line_exit_2(lambda: cli.main(argv), capsys, must_name=None if name.endswith("-kind") else flag)


@pytest.mark.parametrize("name, argv", BENCH_ROWS, ids=[r[0] for r in BENCH_ROWS])
def test_bench_refuses_in_one_line(name, argv, paths, nothing_starts, capsys):
    _one_line_exit_2(lambda: bench.main([a.format(**paths) for a in argv]), capsys)


def _worker(x):
    return x


API_ROWS = [
    ("launch-colon", lambda p: launch.launch(":", nproc=2), "module:function"),
    ("launch-none", lambda p: launch.launch(None, nproc=2), "runs a function"),
    ("launch-run-dir-a-file", lambda p: launch.launch(_worker, nproc=2, run_dir="/etc/passwd"), "a file"),
    ("launch-env-equals", lambda p: launch.launch(_worker, nproc=2, env={"A=B": "1"}), "environment variable"),
    ("launch-env-empty-name", lambda p: launch.launch(_worker, nproc=2, env={"": "1"}), "environment variable"),
    ("launch-env-nul", lambda p: launch.launch(_worker, nproc=2, env={"A": "x\0y"}), "NUL"),
    ("launch-env-not-a-dict", lambda p: launch.launch(_worker, nproc=2, env=["A=1"]), "dict"),
    ("launch-nproc-million", lambda p: launch.launch(_worker, nproc=10**6), "nproc"),
    ("launch-nproc-text", lambda p: launch.launch(_worker, nproc="2"), "nproc"),
    ("launch-timeout-1e300", lambda p: launch.launch(_worker, nproc=1, timeout_s=1e300), "timeout_s"),
    ("launch-max-restarts-huge", lambda p: launch.launch(_worker, nproc=1, max_restarts=10**6), "max_restarts"),
    ("launch-args-not-a-tuple", lambda p: launch.launch(_worker, nproc=1, args=5), "args"),
    ("launch-kwargs-not-a-dict", lambda p: launch.launch(_worker, nproc=1, kwargs=[1]), "kwargs"),
    ("launch-not-callable", lambda p: launch.launch(42, nproc=1), "runs a function"),
    ("launch-unknown-module", lambda p: launch.launch("no_such_module:f", nproc=1), "cannot import"),
    ("train-lr-text", lambda p: _train(lr="0.1"), "lr"),
    ("train-steps-text", lambda p: _train(steps="4"), "steps"),
    ("train-seed-float", lambda p: _train(seed=1.5), "seed"),
    ("train-nproc-million", lambda p: _train(strategy="ddp", nproc=10**6, batch=10**6), "nproc"),
    ("train-timeout-1e300", lambda p: _train(timeout_s=1e300), "timeout_s"),
    ("train-bucket-1e300", lambda p: _train(strategy="ddp", nproc=2, bucket_cap_mb=1e300), "bucket_cap_mb"),
    ("train-batch-2-40", lambda p: _train(batch=2**40), "batch"),
    ("train-node-size-text", lambda p: _train(node_size="2"), "node_size"),
    ("ft-timeout-1e300", lambda p: _ft(timeout_s=1e300), "timeout_s"),
    ("ft-replicas-1000", lambda p: _ft(replicas=1000, batch=1000), "replicas"),
    ("ft-seed-huge", lambda p: _ft(seed=10**14), "seed"),
    ("cluster-timeout-0", lambda p: _cluster(timeout_s=0), "wall_timeout_s"),
    ("cluster-link-0mbit", lambda p: _cluster(link="0mbit"), "--link"),
    ("cluster-too-many-ranks", lambda p: _cluster(nodes=9, nproc_per_node=1000), "nproc"),
    ("plan-cluster-nodes-huge", lambda p: _plan_cluster(nodes=99999999999999), "nodes"),
]


def _train(**overrides):
    from course_utils.train import train

    return train(**overrides)


def _ft(**overrides):
    from course_utils.ft import ft_run

    return ft_run(**overrides)


def _cluster(**kwargs):
    from course_utils.cluster import train_on_cluster

    return train_on_cluster(strategy="ddp", **kwargs)


def _plan_cluster(**kwargs):
    from course_utils.plan import Cluster

    return Cluster(**kwargs)


@pytest.mark.parametrize("name, call, words", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_the_python_api_refuses_in_one_line_before_anything_starts(name, call, words, paths, no_process):
    with pytest.raises(CourseInputError) as err:
        call(paths)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_table_is_the_size_of_the_pass():
    """The adversarial pass tried 238 inputs; every one of its kinds is kept here, and more."""
    assert len(ROWS) + len(RANGE_ROWS) + len(BENCH_ROWS) + len(API_ROWS) + len(MUST_LAUNCH) >= 238


@pytest.mark.parametrize("name, argv, words", MUST_LAUNCH, ids=[r[0] for r in MUST_LAUNCH])
def test_a_run_that_fails_says_so_without_a_traceback(name, argv, words, capsys):
    status = cli.main(argv)
    out = capsys.readouterr()
    assert status == 1 and words in out.err.splitlines()[0], out.err[-2000:]
    assert "Traceback" not in out.err + out.out


def test_a_rank_of_a_multi_node_job_is_not_held_to_this_machine_s_ranks(monkeypatch):
    """Under torchrun on several nodes a rank's world size counts every node's ranks: the machine's own
    limit holds where processes are started (the CLI, launch, train), not inside a rank that runs."""
    from course_utils.train import TrainConfig

    many = validate.MAX_LOCAL_RANKS * 2
    with pytest.raises(CourseInputError, match="nproc"):
        TrainConfig(strategy="ddp", nproc=many, batch=many).validate()
    monkeypatch.setenv("RANK", "3")
    TrainConfig(strategy="ddp", nproc=many, batch=many).validate()
