"""The benchmark harness's pure pieces (tools/bench.py): statistics and ratios, the theory rows (measured
against ``predict.expected_bytes``), the start-up estimate, the verdicts, the results.md writer and
argument checking, and ``python -m course_utils bench`` handing over to it. No timing is asserted:
timings live in ``make bench``.

One real run, in this process (a world of one): the training loop on a width the presets do not
have, whose bytes held must equal the fp32 bill 16Ψ exactly.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from course_utils import bench as bench_command
from course_utils import cli, launch, models, predict, units
from course_utils.errors import CourseInputError

sys.path.insert(0, str(ROOT))
from tools import bench  # noqa: E402

PSI = 1000  # a round Ψ for the formulas


# ---------------------------------------------------------------------------------------------
# Statistics and ratios
# ---------------------------------------------------------------------------------------------


def test_spread_and_interleaved_ratios():
    assert units.spread([3, 1, 2]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    r = bench.pair_ratios([2.0, 3.0, 1.0], [1.0, 2.0, 1.0])  # round by round: 2, 1.5, 1
    assert r["ratios"] == [2.0, 1.5, 1.0]
    assert (r["min"], r["median"], r["max"], r["n"]) == (1.0, 1.5, 2.0, 3)
    with pytest.raises(CourseInputError):
        units.spread([])
    with pytest.raises(CourseInputError):
        bench.pair_ratios([1.0, 2.0], [1.0])
    with pytest.raises(CourseInputError):
        bench.pair_ratios([1.0], [0.0])


def test_linear_launch_cost():
    assert bench.linear_cost({2: 1.0, 4: 2.0}) == pytest.approx((0.0, 0.5))
    assert bench.linear_cost({2: 0.7}) == (0.7, 0.0)
    a, b = bench.linear_cost({1: 1.0, 2: 2.0, 4: 3.0})  # least squares through three points
    assert b == pytest.approx(9 / 14) and a == pytest.approx(2.0 - b * 7 / 3)
    with pytest.raises(CourseInputError):
        bench.linear_cost({})


def test_startup_split():
    launches = [{"nproc": 2, "wall_s": 3.0, "cold": True}, {"nproc": 4, "wall_s": 2.0, "cold": False}]
    out = bench.startup_split(10.0, 2.0, launches, (0.5, 0.25), cold_extra_s=1.0)
    # kernel 2 + (0.5 + 0.5 + 1 cold) + (0.5 + 1.0)
    assert out["starting_s"] == pytest.approx(5.5) and out["computing_s"] == pytest.approx(4.5)
    assert out["launches"] == 2 and out["launch_wall_s"] == 5.0 and out["starting_share"] == pytest.approx(0.55)
    capped = bench.startup_split(3.0, 2.0, launches, (0.5, 0.25), cold_extra_s=1.0)
    assert capped["starting_s"] == 3.0 and capped["computing_s"] == 0.0


def test_theory_row_compares_measured_with_formula():
    nd = 2
    formula = predict.expected_bytes("zero3", PSI, nd)
    report = {
        "world_size": nd,
        "config": {"node_size": 2, "precision": "fp32"},
        "strategy_info": {},
        "per_rank": [{"rank": r, "total": formula["held_paper"]} for r in range(nd)],
        "comm_per_step": {"all_gather": {"calls": 6, "sent_bytes": 2 * PSI * 4 * 0.5}},
        "comm_per_step_by_rank": [{"all_gather": {"calls": 6, "sent_bytes": 1.01 * formula["sent_paper"]}}] * nd,
    }
    row = bench.theory_row("zero3", report, PSI)
    assert row["held_ratio"] == 1.0 and row["sent_ratio"] == pytest.approx(1.01)
    assert row["kinds"] == {"all_gather": 6}
    assert bench.ratio(0.0, 0.0) == 1.0 and bench.ratio(5.0, 0.0) is None


def test_flops_and_peaks():
    assert bench.train_flops(100, layers=2, width=8, seq=4, tokens=10) == (600 + 12 * 2 * 4 * 8) * 10
    assert bench.bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bench.bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert bench.bf16_peak("NVIDIA L40S") == 362e12 and bench.bf16_peak("NVIDIA L4") == 121e12
    assert bench.bf16_peak("NVIDIA GeForce GTX 1080") is None


# ---------------------------------------------------------------------------------------------
# Strategies, shapes, one real run in this process
# ---------------------------------------------------------------------------------------------


def test_missing_strategy_is_reported_not_raised(monkeypatch):
    import dataclasses

    from course_utils import strategies

    assert bench.strategy_available("single") == (True, "")
    ghost = dataclasses.replace(strategies.DDP, name="ghost", apply=None)  # priced by the record, run by nothing
    monkeypatch.setitem(strategies.RECORD, "ghost", ghost)
    ok, why = bench.strategy_available("ghost")
    assert not ok and "not available" in why
    assert bench.strategy_available("zero9")[0] is False


def test_bench_shape_trains_and_holds_the_fp32_bill(monkeypatch):
    from course_utils.train import TrainConfig

    monkeypatch.setattr(models, "PRESETS", dict(models.PRESETS))
    shape = bench.model_shape(width=32, heads=2)
    assert shape["width"] == 32 and shape["layers"] == models.get_config("tiny").layers
    psi = bench.psi_of(shape)
    assert psi == models.param_count(models.get_config("tiny", width=32, heads=2))
    cfg = TrainConfig(strategy="single", nproc=1, steps=2, model=bench.model_name(shape))
    report = bench.bench_train_worker(vars(cfg) | {"options": {}}, shape)
    row = bench.theory_row("single", report, psi)
    assert row["held_mean"] == 16 * psi and row["held_ratio"] == 1.0 and row["sent_mean"] == 0.0


# ---------------------------------------------------------------------------------------------
# Verdicts, results.md, arguments
# ---------------------------------------------------------------------------------------------


def _results(course=(60.0, 95.0), launch_ratio=0.4, pair_median=1.2, dev=0.002):
    rows = [
        {
            "notebook": f"0{i}_x",
            "wall_s": w,
            "error": None,
            "launches": 2,
            "launch_wall_s": 3.0,
            "starting_s": 5.0,
            "computing_s": w - 5.0,
            "starting_share": 5.0 / w,
        }
        for i, w in enumerate(course)
    ]
    nb = {
        "rows": rows,
        "course_s": sum(course),
        "kernel_s": 3.0,
        "per_launch_s": [0.3, 0.1],
        "cold_extra_s": 1.0,
        "starting_s": 10.0,
        "computing_s": sum(course) - 10.0,
        "launches": 4,
    }
    ratio = {
        "min": pair_median - 0.1,
        "median": pair_median,
        "max": pair_median + 0.1,
        "n": 3,
        "ratios": [pair_median] * 3,
    }
    pairs = {
        "rounds": 3,
        "steps": 8,
        "psi": PSI,
        "nproc": 2,
        "model": bench.model_shape(),
        "rows": [
            {
                "hand": "zero3",
                "torch": "full_shard",
                "ratio": ratio,
                "hand_s": ratio,
                "torch_s": ratio,
                "hand_calls": {"all_gather": 6},
                "torch_calls": {"all_gather": 6},
                "same_losses": False,
                "max_loss_diff": 1e-7,
            },
            {"hand": "ddp_scratch", "torch": "ddp", "error": "ddp_scratch: not available (ImportError)"},
        ],
    }
    theory = {
        "psi": PSI,
        "model": bench.model_shape(),
        "steps": 8,
        "rows": [
            {
                "strategy": "zero2",
                "nproc": 2,
                "held_mean": 1.0,
                "held_exact": 1.0,
                "held_paper": 1.0,
                "sent_mean": 1.0,
                "sent_exact": 1.0,
                "held_ratio": 1.0,
                "sent_ratio": 1 + dev,
                "held_ratio_paper": 1.0,
                "sent_ratio_paper": 1 + dev,
                "held_padding": 0,
                "sent_padding": 0,
            },
            {"strategy": "zero1", "nproc": 2, "error": "not available"},
        ],
    }
    launch = {
        "torch_import": {"min": 1.0, "median": 1.0, "max": 1.0, "n": 3},
        "cold_s": 2.0,
        "cold_extra_s": 1.0,
        "rows": [{"worker": "empty_worker", "nproc": 2, "min": 0.4, "median": launch_ratio, "max": 0.5}],
        "ratios": {"empty x2": launch_ratio},
    }
    return {"notebooks": nb, "launch": launch, "pairs": pairs, "theory": theory}


def test_verdicts_per_target():
    fast = {**_results(), "meta": {"full_run": {"total_s": 540.0, "finished": "today"}}}
    assert [v["met"] for v in bench.verdicts(fast)] == [True, False, True, True, True, True]  # one notebook 95 s
    slow = {
        **_results(course=(200.0, 150.0), launch_ratio=2.5, pair_median=1.6, dev=0.02),
        "meta": {"full_run": {"total_s": 700.0, "finished": "today"}},
    }
    slow = bench.verdicts(slow)
    assert [v["met"] for v in slow] == [False, False, False, False, False, False]
    assert "zero2 sent off by 2.0%" in slow[4]["why"] and "zero3" in slow[3]["why"]
    assert [v["met"] for v in bench.verdicts({})] == [None, None, None, None, None]
    subset = _results()
    subset["notebooks"]["subset"] = True  # --notebooks 01: not the whole course
    assert bench.verdicts(subset)[0]["met"] is None and "only some" in bench.verdicts(subset)[0]["why"]


def test_results_markdown_tables_are_well_formed():
    text = bench.results_markdown({**_results(), "cuda": {"skipped": "no CUDA device on this host"}})
    assert "**not met**" in text and "**whole course**" in text and "not available (ImportError)" in text
    assert "no CUDA device" in text
    table = None
    for line in text.splitlines():  # every row of a table has as many cells as its header
        if line.startswith("|"):
            cells = len(re.findall(r"(?<!\\)\|", line)) - 1
            table = cells if table is None else table
            assert cells == table, line
        else:
            table = None


def test_sections_and_arguments(tmp_path):
    assert bench.parse_sections(None, cuda_available=False) == ["launch", "pairs", "theory", "scaling", "notebooks"]
    assert bench.parse_sections(None, cuda_available=True)[-1] == "cuda"
    assert bench.parse_sections("theory, launch", False) == ["launch", "theory"]  # run in the canonical order
    for bad in ("launch,warp", ",", "cuda"):
        with pytest.raises(CourseInputError):
            bench.parse_sections(bad, cuda_available=False)
    ok = argparse.Namespace(rounds=3, steps=8, repeats=5, peak_tflops=None, out=str(tmp_path))
    bench.check_arguments(ok)
    for name, value in (("steps", 2), ("rounds", 0), ("repeats", 1)):
        with pytest.raises(CourseInputError, match=name):
            bench.check_arguments(argparse.Namespace(**{**vars(ok), name: value}))


#: Bad input of the harness (they were rows of test_cli_inputs while it lived in the package).
BAD_ARGUMENTS = [
    ("out-file", ["--render-only", "--out", "{file}"]),
    ("out-corrupt", ["--render-only", "--out", "{corrupt}"]),
    ("out-empty", ["--render-only", "--out", "{dir}"]),
    ("rounds-0", ["--rounds", "0", "--out", "{dir}"]),
    ("steps-1", ["--steps", "1", "--out", "{dir}"]),
    ("repeats-1", ["--repeats", "1", "--out", "{dir}"]),
    ("out-under-file", ["--render-only", "--out", "{file}/bench"]),
    ("sections", ["--sections", "nope", "--out", "{dir}"]),
    ("peak-nan", ["--peak-tflops", "nan", "--out", "{dir}"]),
    ("peak-negative", ["--peak-tflops", "-1", "--out", "{dir}"]),
]


@pytest.mark.parametrize("name, argv", BAD_ARGUMENTS, ids=[r[0] for r in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_one_line(name, argv, tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "results.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    paths = {"file": str(tmp_path / "a-file"), "dir": str(tmp_path / "empty"), "corrupt": str(tmp_path / "corrupt")}
    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("a worker was launched for refused input"))
    try:
        status = bench.main([a.format(**paths) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    out = capsys.readouterr()
    assert status == 2, out.err[-2000:]
    assert len(out.err.splitlines()) == 1 and out.err.strip() and "Traceback" not in out.err + out.out


def test_a_bad_argument_costs_no_torch_import():
    """The harness parses before it imports torch (a one-line error had cost 3.3 CPU s of import)."""
    code = "import sys, tools.bench as b; s = b.main(['--sections', 'nope']); print(s, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr[-2000:]


def test_the_cli_hands_over_to_the_harness_in_a_clone(capfd, tmp_path):
    """``python -m course_utils bench ...`` runs ``python -m tools.bench ...`` in the clone: same arguments
    (options included), the same one-line error and exit status."""
    assert bench_command.repository_root() == ROOT
    assert cli.main(["bench", "--sections", "warp", "--out", str(tmp_path)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown section" in err and not list(tmp_path.iterdir())


def test_an_installed_package_without_the_repository_says_where_to_run(monkeypatch, capsys):
    monkeypatch.setattr(bench_command, "repository_root", lambda: None)
    assert cli.main(["bench", "--sections", "theory"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make bench" in err and "clone" in err


def test_scaling_figure_draws(tmp_path):
    rows = [
        {
            "strategy": s,
            "width": w,
            "nproc": n,
            "psi": 1000 * w,
            "step_time_s": 0.01 * n,
            "held_per_rank": 16e3 * w / (n if s == "zero3" else 1),
            "held_formula": 16e3 * w / (n if s == "zero3" else 1),
        }
        for s in ("ddp", "zero3")
        for w in (64, 128)
        for n in (1, 2, 4)
    ]
    fig = bench.scaling_figure({"strategies": ["ddp", "zero3"], "widths": [64, 128], "ranks": [1, 2, 4], "rows": rows})
    fig.savefig(tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_launch_phases_from_rank_clocks():
    ranks = [{"entered": 10.5, "joined": 10.9, "left": 11.0}, {"entered": 10.6, "joined": 10.9, "left": 11.1}]
    out = bench.launch_phases(10.0, 11.4, ranks)
    assert out == pytest.approx({"to_workers_s": 0.6, "join_s": 0.3, "after_s": 0.3})
    empty = bench.launch_phases(1.0, 2.0, [{"entered": 1.5, "left": 1.5}])
    assert empty["join_s"] == 0.0 and empty["after_s"] == pytest.approx(0.5)


def test_cuda_path_prices_every_strategy_with_the_planner():
    import torch

    from course_utils import plan, strategies

    for row in strategies.STRATEGIES.values():  # the planner prices any row of the record, by its facts
        assert plan.memory_breakdown(plan.model_spec(7e9), plan.Cluster(), row)["total"] > 0
    if not torch.cuda.is_available():
        assert bench.cuda_section() == {"skipped": "no CUDA device on this host"}


def test_a_failed_section_is_named_in_the_verdicts():
    rows = bench.verdicts({"launch": {"error": "WorkerFailed: rank 1 failed"}})
    assert rows[1]["met"] is None and rows[1]["why"] == "launch section failed: WorkerFailed: rank 1 failed"
    assert rows[2]["why"] == "pairs section not run"
