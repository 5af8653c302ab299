"""Benchmarks: how fast the course runs, and how close its runs come to theory and to torch (README).

``make bench`` (``python -m tools.bench``; from a clone, ``python -m course_utils bench`` runs this
too) measures, in one run, and writes
``benchmarks/results.md`` (tables and a verdict per target), ``benchmarks/results.json`` (every
number) and ``benchmarks/scaling.png``:

- ``launch``: ``course_utils.launch`` running an empty function (``empty_worker``), and one that
  joins the process group (``group_worker``), on 2 and 4 ranks, against a bare
  ``python -c "import torch"``. One launch is one *wave* of N processes started together.
- ``pairs``: hand-built vs torch on the same model, data, world size and steps: ``ddp_scratch`` /
  ``ddp``, ``zero2`` / ``shard_grad_op``, ``zero3`` / ``full_shard``, as step-time ratios from
  interleaved runs (A B A B ...), reported as min / median / max over rounds.
- ``theory``: every strategy in ``strategies.STRATEGIES``: bytes held per rank and bytes sent per step
  against the formulas (the paper's, and the same formula with the padding the run really has).
- ``scaling``: step time and bytes per rank on 1, 2 and 4 ranks for 3 model widths (plotted).
- ``notebooks``: each notebook executed headless with its defaults (papermill), and the whole
  course; the time spent starting processes (kernel, launches) against computing, estimated
  from a launch log (``COURSE_LAUNCH_LOG``, one JSON line per launch, written by ``launch``).
- ``cuda`` (CUDA hosts only, untested on GPU so far): per strategy on a model sized to the GPU,
  step time, tokens/s, model FLOPs utilisation against the bf16 peak, ``max_memory_allocated``
  against ``plan.memory_breakdown``.

The formulas are the package's own (``course_utils.predict.expected_bytes`` picks the one that
matches each strategy); this harness measures and writes tables. Timings live here and never in
pass/fail tests: on a shared 2-core machine they move with the load, which every section records.

The harness is a tool, not part of the installed package: it executes the repository's
``notebooks/`` and writes ``benchmarks/``, which only a clone has (CONTRIBUTING.md, Commands).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from course_utils.errors import CourseInputError
from course_utils.strategies import STRATEGIES
from course_utils.units import spread
from course_utils.validate import check_values, writable_dir

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the workers import this module as tools.bench
    sys.path.insert(0, str(ROOT))
OUT_DIR = ROOT / "benchmarks"
NOTEBOOKS = ROOT / "notebooks"

#: How the harness names itself in usage lines and errors.
PROG = "python -m tools.bench"

SECTIONS = ("launch", "pairs", "theory", "scaling", "notebooks", "cuda")

#: (hand-built, torch) strategies compared on the same run.
PAIRS = (("ddp_scratch", "ddp"), ("zero2", "shard_grad_op"), ("zero3", "full_shard"))

#: The targets of the benchmark issue; checked and reported, never asserted in tests.
TARGETS = {
    "course_s": 300.0,  # the whole course, headless, on 2 CPU cores
    "notebook_s": 90.0,  # any one notebook
    "launch_ratio": 2.0,  # a launch (one process wave) / a bare `python -c "import torch"`
    "hand_vs_torch": 1.5,  # hand-built step time / torch's, median over rounds
    "bytes_rel": 0.01,  # |measured / formula - 1|, padding counted
    "bench_s": 600.0,  # `make bench` itself, every CPU section
}

#: Model of the pairs and theory runs: "small" (Ψ = 867,072): steps of tens of ms on one core,
#: so that a step is compute and collectives rather than timer noise.
PAIRS_MODEL = dict(vocab=512, seq=64, layers=4, width=128, heads=4)
#: Widths of the scaling runs (the "tiny" shape otherwise: 2 blocks, seq 32, vocab 256).
SCALING_WIDTHS = (64, 128, 256)
SCALING_RANKS = (1, 2, 4)
SCALING_STRATEGIES = ("ddp", "zero3")
#: Runs per scaling point on 1 rank, the fastest kept: one rank computes with both cores (2 threads),
#: and while another process holds a core each parallel op waits for the descheduled thread.
SINGLE_RANK_TRIES = 2
#: Also run on 3 ranks in the theory section, where shards do not divide evenly and padding shows.
PADDED_STRATEGIES = ("zero1", "zero2", "zero3", "shard_grad_op", "full_shard")
#: Model of the CUDA runs (Ψ ≈ 160M), bf16 mixed precision, 8 sequences per GPU.
CUDA_MODEL = dict(vocab=8192, seq=1024, layers=12, width=1024, heads=16)

#: Dense bf16 tensor-core peak FLOP/s by GPU name (data sheets; SXM parts). Matched by substring.
#: The first match wins, so a more specific name comes before a shorter one it contains.
BF16_PEAK = (
    ("B200", 2250e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


# ---------------------------------------------------------------------------------------------
# Workers (module level, so that ``launch`` can start them)
# ---------------------------------------------------------------------------------------------


def empty_worker() -> dict:
    """Does nothing but say when it ran: what a launch costs by itself (README, Benchmarks)."""
    now = time.time()
    return {"entered": now, "left": now}


def group_worker() -> dict:
    """Joins the process group and leaves it: a launch plus the rendezvous every real worker does (README)."""
    from course_utils import dist as cdist

    entered = time.time()
    with cdist.session():
        joined = time.time()
    return {"entered": entered, "joined": joined, "left": time.time()}


def bench_train_worker(config: dict, model: dict | None = None, cuda_peak: bool = False, observe: bool = True) -> dict:
    """``train.train_worker`` on a model shape of the benchmark's choosing (README, Benchmarks).

    ``model`` (``GPTConfig`` fields) is registered under ``config["model"]`` in this process
    first, so the run is the course's one training loop on a width the presets do not have.
    With ``cuda_peak`` every rank adds its ``torch.cuda.max_memory_allocated()`` to its result.
    ``observe=False``: a timing run, no counting observer (``train_worker``).
    """
    import torch

    from course_utils import models
    from course_utils.train import train_worker

    if model:
        models.PRESETS[config["model"]] = models.GPTConfig(**model)
    if cuda_peak and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.reset_peak_memory_stats()
    out = train_worker(config, observe)
    if cuda_peak and torch.cuda.is_available():
        out["max_memory_allocated"] = int(torch.cuda.max_memory_allocated())
    return out


# ---------------------------------------------------------------------------------------------
# Pure helpers: statistics, ratios, formulas, verdicts
# ---------------------------------------------------------------------------------------------


def pair_ratios(a_times, b_times) -> dict:
    """Round-by-round ratios A_i / B_i of two interleaved series, and their spread (README, Benchmarks).

    Interleaving (A B A B ...) makes each ratio compare two runs taken moments apart, so a change
    in the machine's load moves both; the spread over rounds says how much is left of it.
    """
    if len(a_times) != len(b_times) or not a_times:
        raise CourseInputError("pair_ratios needs two equally long, non-empty series of step times")
    if any(b <= 0 for b in b_times):
        raise CourseInputError("a step time of zero cannot be a denominator")
    return {"ratios": [a / b for a, b in zip(a_times, b_times)], **spread(a / b for a, b in zip(a_times, b_times))}


def launch_phases(called: float, returned: float, ranks: list[dict]) -> dict:
    """Where one launch's time goes, from each rank's clock readings (same machine, same clock) (README).

    ``to_workers_s``: from the call until the last rank runs the function (agent fork, rendezvous
    of the agent, worker fork, import of the function); ``join_s``: the slowest process-group
    join (0 for a function that joins none); ``after_s``: from the last rank leaving the function
    until the result is back in the caller (worker exit, result file, the caller's 50 ms polling).
    """
    entered = max(r["entered"] for r in ranks)
    joined = max(r.get("joined", r["entered"]) for r in ranks)
    left = max(r["left"] for r in ranks)
    return {"to_workers_s": entered - called, "join_s": joined - entered, "after_s": returned - left}


def linear_cost(points: dict) -> tuple[float, float]:
    """``(a, b)`` of the line cost(N) = a + b·N through measured ``{N: seconds}`` (least squares) (README)."""
    if not points:
        raise CourseInputError("no launch costs measured: run the launch section first")
    xs, ys = list(map(float, points)), list(map(float, points.values()))
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def startup_split(
    wall_s: float, kernel_s: float, launches: list[dict], per_launch: tuple[float, float], cold_extra_s: float
) -> dict:
    """Split a notebook's wall time into starting processes and the rest (README, Benchmarks).

    Starting = the kernel's own start (an empty notebook's wall time, ``kernel_s``) + for each
    launch the cost of a launch that only joins the group on that many ranks (``per_launch`` =
    (a, b): a + b·N) + ``cold_extra_s`` for a launch that also started the agent server. The
    rest of the wall time is computing (in the workers and in the kernel) and waiting (a planned
    timeout is waiting). An estimate: a real launch's start may overlap its own work.
    """
    a, b = per_launch
    starting = kernel_s
    for row in launches:
        starting += max(0.0, a + b * row["nproc"]) + (cold_extra_s if row.get("cold") else 0.0)
    starting = min(starting, wall_s)
    return {
        "wall_s": wall_s,
        "starting_s": starting,
        "computing_s": wall_s - starting,
        "launches": len(launches),
        "launch_wall_s": sum(r["wall_s"] for r in launches),
        "starting_share": starting / wall_s if wall_s > 0 else 0.0,
    }


def measured_bytes(report: dict) -> dict:
    """Bytes held (mean, min and max over ranks) and sent per step (mean over ranks) of a train report (README).
    Held is the bill the formulas count: a rank's bytes less Adam's 0-dim step counters (``steps``)."""
    totals = [row["total"] - row.get("steps", 0) for row in report["per_rank"]]
    by_rank = report.get("comm_per_step_by_rank") or [report.get("comm_per_step", {})]
    sent = [sum(row["sent_bytes"] for row in comm.values()) for comm in by_rank]
    return {
        "held_mean": statistics.fmean(totals),
        "held_min": min(totals),
        "held_max": max(totals),
        "sent_mean": statistics.fmean(sent) if sent else 0.0,
    }


def ratio(measured: float, formula: float) -> float | None:
    """measured / formula; 1.0 when both are zero (nothing to send), None when only the formula is zero."""
    if formula == 0:
        return 1.0 if measured == 0 else None
    return measured / formula


def theory_row(strategy: str, report: dict, psi: int) -> dict:
    """One line of the theory table: measured bytes against ``expected_bytes`` (README, Benchmarks)."""
    from course_utils.predict import expected_bytes  # here: `predict` imports torch, a bad argument need not

    cfg = report.get("config", {})
    exp = expected_bytes(
        strategy,
        psi,
        report["world_size"],
        node_size=cfg.get("node_size", 2),
        precision=cfg.get("precision", "fp32"),
        strategy_info=report.get("strategy_info"),
    )
    got = measured_bytes(report)
    return {
        "strategy": strategy,
        "nproc": report["world_size"],
        "psi": psi,
        **got,
        **exp,
        "held_ratio": ratio(got["held_mean"], exp["held_exact"]),
        "held_ratio_paper": ratio(got["held_mean"], exp["held_paper"]),
        "sent_ratio": ratio(got["sent_mean"], exp["sent_exact"]),
        "sent_ratio_paper": ratio(got["sent_mean"], exp["sent_paper"]),
        "held_padding": exp["held_exact"] - exp["held_paper"],
        "sent_padding": exp["sent_exact"] - exp["sent_paper"],
        "kinds": {k: round(v["calls"], 3) for k, v in report.get("comm_per_step", {}).items()},
    }


def train_flops(psi: float, layers: int, width: int, seq: int, tokens: float) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens: 6Ψ per token plus attention's
    12·L·s·h per token (forward and backward; PaLM's accounting, recomputation not counted) (README)."""
    return (6.0 * psi + 12.0 * layers * seq * width) * tokens


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU from its name (``BF16_PEAK``), or None if unknown (README)."""
    for key, peak in BF16_PEAK:
        if key.lower() in device_name.lower():
            return peak
    return None


def _not_run(results: dict, name: str) -> str:
    err = (results.get(name) or {}).get("error")
    return f"{name} section failed: {err}" if err else f"{name} section not run"


def verdicts(results: dict) -> list[dict]:
    """One row per target: ``{"target", "measured", "limit", "met", "why"}`` (``met`` None: not measured) (README)."""
    out = []
    nb = results.get("notebooks") or {}
    rows = [r for r in nb.get("rows", []) if not r.get("error")]
    failed = [r["notebook"] for r in nb.get("rows", []) if r.get("error")]
    if nb.get("rows"):
        total = nb["course_s"]
        out.append(
            {
                "target": f"whole course under {TARGETS['course_s']:.0f} s on 2 CPU cores",
                "measured": f"{total:.1f} s ({len(nb['rows'])} notebooks)",
                "limit": TARGETS["course_s"],
                "met": None if nb.get("subset") else total < TARGETS["course_s"] and not failed,
                "why": ("only some notebooks were run (--notebooks)" if nb.get("subset") else "")
                or (f"failed: {', '.join(failed)}" if failed else "")
                or (
                    ""
                    if total < TARGETS["course_s"]
                    else f"{total - TARGETS['course_s']:.1f} s over; starting processes is "
                    f"{nb.get('starting_s', 0):.0f} s of it (see the notebooks table)"
                ),
            }
        )
        slowest = max(rows, key=lambda r: r["wall_s"]) if rows else None
        over = [r["notebook"] for r in rows if r["wall_s"] > TARGETS["notebook_s"]]
        out.append(
            {
                "target": f"no notebook over {TARGETS['notebook_s']:.0f} s",
                "measured": f"slowest {slowest['notebook']} {slowest['wall_s']:.0f} s" if slowest else "-",
                "limit": TARGETS["notebook_s"],
                "met": bool(rows) and not over and not failed,
                "why": ", ".join(over) + (" over the limit" if over else ""),
            }
        )
    else:
        out.append(
            {
                "target": "whole course and each notebook",
                "measured": "-",
                "limit": TARGETS["course_s"],
                "met": None,
                "why": _not_run(results, "notebooks"),
            }
        )
    la = results.get("launch") or {}
    if la.get("ratios"):
        worst = max(la["ratios"].values())
        out.append(
            {
                "target": f"launch at most {TARGETS['launch_ratio']:g}x a bare torch import per process wave",
                "measured": ", ".join(f"{k}: {v:.2f}x" for k, v in la["ratios"].items()),
                "limit": TARGETS["launch_ratio"],
                "met": worst <= TARGETS["launch_ratio"],
                "why": "",
            }
        )
    else:
        out.append(
            {
                "target": "launch overhead",
                "measured": "-",
                "limit": TARGETS["launch_ratio"],
                "met": None,
                "why": _not_run(results, "launch"),
            }
        )
    pairs = [p for p in (results.get("pairs") or {}).get("rows", []) if p.get("ratio")]
    if pairs:
        slow = [p for p in pairs if p["ratio"]["median"] > TARGETS["hand_vs_torch"]]
        out.append(
            {
                "target": f"hand-built within {TARGETS['hand_vs_torch']:g}x of torch (median over rounds)",
                "measured": ", ".join(f"{p['hand']}/{p['torch']} {p['ratio']['median']:.2f}x" for p in pairs),
                "limit": TARGETS["hand_vs_torch"],
                "met": not slow,
                "why": "; ".join(f"{p['hand']} is slower: see the pairs table" for p in slow),
            }
        )
    else:
        out.append(
            {
                "target": "hand-built vs torch",
                "measured": "-",
                "limit": TARGETS["hand_vs_torch"],
                "met": None,
                "why": _not_run(results, "pairs"),
            }
        )
    theory = [r for r in (results.get("theory") or {}).get("rows", []) if "held_ratio" in r]
    if theory:
        devs = [
            (r["strategy"], kind, abs(r[kind] - 1))
            for r in theory
            for kind in ("held_ratio", "sent_ratio")
            if r[kind] is not None
        ]
        bad = [f"{s} {k.split('_')[0]} off by {d:.1%}" for s, k, d in devs if d > TARGETS["bytes_rel"]]
        worst = max((d for _, _, d in devs), default=0.0)
        out.append(
            {
                "target": f"measured bytes within {TARGETS['bytes_rel']:.0%} of the formulas (padding counted)",
                "measured": f"largest deviation {worst:.3%} over {len(theory)} strategies",
                "limit": TARGETS["bytes_rel"],
                "met": not bad,
                "why": "; ".join(bad),
            }
        )
    else:
        out.append(
            {
                "target": "bytes vs formulas",
                "measured": "-",
                "limit": TARGETS["bytes_rel"],
                "met": None,
                "why": _not_run(results, "theory"),
            }
        )
    full = (results.get("meta") or {}).get("full_run")
    out.append(
        {
            "target": f"`make bench` under {TARGETS['bench_s'] / 60:.0f} minutes",
            "measured": f"{full['total_s']:.0f} s ({full['finished']})" if full else "-",
            "limit": TARGETS["bench_s"],
            "met": full["total_s"] < TARGETS["bench_s"] if full else None,
            "why": "" if full else "no full run recorded yet",
        }
    )
    return out


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def strategy_available(name: str) -> tuple[bool, str]:
    """``(True, "")`` if the record has the strategy and something here runs it, else ``(False, why)`` (README)."""
    from course_utils.strategies import RECORD

    if name not in RECORD:
        return False, f"{name!r} is not in the strategy record (course_utils.strategies)"
    if not RECORD[name].runnable:
        return False, f"{name!r} is not available here: the record prices it, nothing here runs it"
    return True, ""


def model_name(shape: dict) -> str:
    """The name a benchmark model shape is registered under, e.g. ``bench-L2-h128-a4-s32-v256``."""
    return "bench-L{layers}-h{width}-a{heads}-s{seq}-v{vocab}".format(**shape)


def model_shape(**overrides) -> dict:
    """``GPTConfig`` fields of the tiny model with ``overrides`` (``models.get_config("tiny", ...)``)."""
    from course_utils.models import get_config

    cfg = get_config("tiny", **overrides).to_dict()
    return {k: cfg[k] for k in ("vocab", "seq", "layers", "width", "heads", "mlp_ratio", "tie_weights")}


def psi_of(shape: dict) -> int:
    from course_utils.models import GPTConfig, param_count

    return param_count(GPTConfig(**shape))


def run_train(
    strategy: str,
    nproc: int,
    shape: dict,
    *,
    steps: int,
    batch: int = 8,
    timeout_s: float = 300.0,
    cuda_peak: bool = False,
    observe: bool = True,
    **config,
) -> dict:
    """One ``train_worker`` run of ``strategy`` on ``nproc`` ranks and model ``shape`` (one launch) (README).

    ``observe=False`` for the runs whose step time is the result: timing runs carry no
    counting observer; counting runs (``observe=True``) make no timing claim.

    Returns the train report (rank 0's) plus ``ranks`` (every rank's result) and ``launch_wall_s``;
    on a failure ``{"error": ...}`` instead of raising, so one broken strategy does not stop the bench.
    """
    from course_utils import models
    from course_utils.launch import LaunchError, launch
    from course_utils.loop import TrainConfig

    name = model_name(shape)
    models.PRESETS.setdefault(name, models.GPTConfig(**shape))
    cfg = TrainConfig(
        strategy=strategy, nproc=nproc, steps=steps, model=name, batch=batch, timeout_s=timeout_s, **config
    ).validate()
    try:
        res = launch(
            bench_train_worker,
            nproc=nproc,
            args=(asdict(cfg), shape, cuda_peak, observe),
            backend=cfg.backend,
            timeout_s=timeout_s,
            echo=False,
            progress=False,
        )
    except (LaunchError, CourseInputError) as exc:
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
        why = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        return {"strategy": strategy, "world_size": nproc, "error": why[:400]}
    report = dict(res[0])
    report["ranks"] = [res[r] for r in sorted(res)]
    report["launch_wall_s"] = res.wall_s
    return report


def _say(text: str) -> None:
    print(text, flush=True)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux/macOS
        return []


def launch_section(nprocs=(2, 4), repeats: int = 5) -> dict:
    """Launch overhead: an empty function and a group join on 2 and 4 ranks vs ``python -c "import torch"`` (README).

    The first launch of a process starts the agent server (it imports torch once); it is
    measured separately (``cold_s``) after stopping any server this process already has.
    """
    from course_utils.launch import WorkerFailed, _AgentServer, launch

    imports, failures = [], []
    for _ in range(min(repeats, 3)):  # seconds each: three are enough for a median
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        imports.append(time.perf_counter() - t0)
    _AgentServer.stop()
    t0 = time.perf_counter()
    launch(empty_worker, nproc=nprocs[0], echo=False, progress=False)
    cold = time.perf_counter() - t0
    rows = []
    for n in nprocs:
        for worker in (empty_worker, group_worker):
            walls, phases = [], []
            while len(walls) < repeats:
                t0, c0 = time.perf_counter(), time.time()
                try:
                    res = launch(worker, nproc=n, echo=False, progress=False)
                except WorkerFailed as exc:  # counted and reported; a second one in a row stops the section
                    failures.append(f"{worker.__name__} x{n}: {str(exc).splitlines()[-1][:200]}")
                    if len(failures) > 1 and failures[-2].startswith(f"{worker.__name__} x{n}"):
                        raise
                    continue
                walls.append(time.perf_counter() - t0)
                phases.append(launch_phases(c0, time.time(), list(res.values())))
            rows.append(
                {
                    "nproc": n,
                    "worker": worker.__name__,
                    **spread(walls),
                    "walls": walls,
                    **{k: statistics.median(p[k] for p in phases) for k in phases[0]},
                }
            )
            _say(f"    launch {worker.__name__} on {n} ranks: median {statistics.median(walls):.3f} s")
    torch_import = spread(imports)
    ratios = {f"{r['worker'].split('_')[0]} x{r['nproc']}": r["median"] / torch_import["median"] for r in rows}
    return {
        "torch_import": {**torch_import, "walls": imports},
        "cold_s": cold,
        "cold_extra_s": max(0.0, cold - next(r["median"] for r in rows if r["nproc"] == nprocs[0])),
        "rows": rows,
        "ratios": ratios,
        "failed_launches": failures,
    }


def pairs_section(rounds: int, steps: int, shape: dict, nproc: int = 2, cache: dict | None = None) -> dict:
    """Hand-built vs torch, interleaved A B A B over ``rounds`` rounds, same model, data and world (README)."""
    cache = {} if cache is None else cache
    psi = psi_of(shape)
    runnable, missing = [], {}
    for hand, lib in PAIRS:
        why = [f"{s}: {w}" for s in (hand, lib) for ok, w in [strategy_available(s)] if not ok]
        if why:
            missing[(hand, lib)] = "; ".join(why)
        else:
            runnable.append((hand, lib))
    series = {s: [] for pair in runnable for s in pair}
    reports = {s: [] for pair in runnable for s in pair}
    for i in range(rounds):
        for hand, lib in runnable:
            for s in (hand, lib):
                rep = run_train(s, nproc, shape, steps=steps, observe=False)
                reports[s].append(rep)
                if "error" not in rep:
                    series[s].append(rep["step_time_s"])
        _say(f"    pairs: round {i + 1}/{rounds} done")
    # The timed runs carry no counting observer; one counted run per strategy gives the calls
    # and losses (and serves the theory section).
    counted = {s: run_train(s, nproc, shape, steps=steps) for pair in runnable for s in pair}
    rows = []
    for hand, lib in PAIRS:
        row = {"hand": hand, "torch": lib, "nproc": nproc, "steps": steps, "psi": psi}
        if (hand, lib) in missing:
            rows.append({**row, "error": missing[(hand, lib)]})
            continue
        errors = [r["error"] for s in (hand, lib) for r in [*reports[s], counted[s]] if "error" in r]
        if errors or not series[hand]:
            row["error"] = errors[0] if errors else "no runs"
        else:
            row.update(
                ratio=pair_ratios(series[hand], series[lib]),
                hand_s=spread(series[hand]),
                torch_s=spread(series[lib]),
                hand_calls=_calls(counted[hand]),
                torch_calls=_calls(counted[lib]),
                same_losses=counted[hand]["losses"] == counted[lib]["losses"],
                max_loss_diff=max(abs(a - b) for a, b in zip(counted[hand]["losses"], counted[lib]["losses"])),
            )
            for s in (hand, lib):
                cache[(s, nproc)] = counted[s]
        rows.append(row)
    return {"rounds": rounds, "steps": steps, "model": shape, "psi": psi, "nproc": nproc, "rows": rows}


def _calls(report: dict) -> dict:
    return {k: round(v["calls"], 2) for k, v in report.get("comm_per_step", {}).items()}


def theory_section(steps: int, shape: dict, cache: dict | None = None) -> dict:
    """Every registered strategy: bytes held per rank and sent per step against ``expected_bytes`` (README)."""
    cache = {} if cache is None else cache
    psi = psi_of(shape)
    rows = []
    runs = [(s, 1 if r.single_process else 4 if r.shard_over == "node" else 2) for s, r in STRATEGIES.items()]
    runs += [(s, 3) for s in PADDED_STRATEGIES if s in STRATEGIES]
    for s, n in runs:
        ok, why = strategy_available(s)
        if not ok:
            rows.append({"strategy": s, "nproc": n, "error": why})
            continue
        rep = cache.get((s, n)) or run_train(s, n, shape, steps=steps, batch=6 if n == 3 else 8)
        if "error" in rep:
            rows.append({"strategy": s, "nproc": n, "error": rep["error"]})
            continue
        rows.append(theory_row(s, rep, psi))
        _say(
            f"    theory: {s} on {n} ranks: held x{_f(rows[-1]['held_ratio'], '.4f')}, "
            f"sent x{_f(rows[-1]['sent_ratio'], '.4f')}"
        )
    return {"model": shape, "psi": psi, "steps": steps, "rows": rows}


def scaling_section(steps: int, widths=SCALING_WIDTHS, ranks=SCALING_RANKS, strategies=SCALING_STRATEGIES) -> dict:
    """Step time and bytes per rank for each strategy, width and world size (README, Benchmarks)."""
    rows = []
    for s in strategies:
        ok, why = strategy_available(s)
        if not ok:
            rows.append({"strategy": s, "error": why})
            continue
        for w in widths:
            shape = model_shape(width=w, heads=4)
            psi = psi_of(shape)
            for n in ranks:
                tries = [
                    run_train(s, n, shape, steps=steps, observe=False)
                    for _ in range(SINGLE_RANK_TRIES if n == 1 else 1)
                ]
                good = [r for r in tries if "error" not in r]
                rep = min(good, key=lambda r: r["step_time_s"]) if good else tries[0]
                if "error" in rep:
                    rows.append({"strategy": s, "width": w, "nproc": n, "psi": psi, "error": rep["error"]})
                    continue
                t = theory_row(s, rep, psi)
                rows.append(
                    {
                        "strategy": s,
                        "width": w,
                        "nproc": n,
                        "psi": psi,
                        "step_time_s": rep["step_time_s"],
                        "held_per_rank": t["held_max"],
                        "held_formula": t["held_exact"],
                        "held_ratio": t["held_ratio"],
                        "sent_per_step": t["sent_mean"],
                        "sent_formula": t["sent_exact"],
                    }
                )
        _say(f"    scaling: {s} done")
    return {"steps": steps, "widths": list(widths), "ranks": list(ranks), "strategies": list(strategies), "rows": rows}


def scaling_figure(scaling: dict):
    """Step time and bytes per rank against ranks, one line per strategy and width (benchmarks/scaling.png)."""
    from course_utils.plots import STAGE_COLORS, new_figure

    fig = new_figure(11.0, 4.2)
    ax_t, ax_b = fig.subplots(1, 2)
    styles = ["o-", "s--", "^:", "d-."]
    rows = [r for r in scaling["rows"] if "error" not in r]
    for s in scaling["strategies"]:
        color = STAGE_COLORS.get(s, "#2a9d8f")
        for j, w in enumerate(scaling["widths"]):
            pts = sorted((r["nproc"], r) for r in rows if r["strategy"] == s and r["width"] == w)
            if not pts:
                continue
            xs = [n for n, _ in pts]
            psi = pts[0][1]["psi"]
            ax_t.plot(
                xs,
                [r["step_time_s"] * 1e3 for _, r in pts],
                styles[j % 4],
                color=color,
                label=f"{s}, h={w} (Ψ={psi / 1e6:.2f}M)",
            )
            ax_b.plot(xs, [r["held_per_rank"] / 1e6 for _, r in pts], styles[j % 4], color=color)
            ax_b.plot(xs, [r["held_formula"] / 1e6 for _, r in pts], "x", color="black", markersize=5)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(scaling["ranks"], [str(n) for n in scaling["ranks"]])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("ranks (N)")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_ylabel("step time (ms; median over steps, max over ranks)")
    ax_t.set_title("step time, same global batch (2 CPU cores)")
    ax_b.set_ylabel("model-state bytes per rank (MB = 10^6)")
    ax_b.set_title("bytes held per rank (x: formula)")
    ax_t.legend(fontsize=7, ncol=1)
    return fig


def _kernel_notebook(folder: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch, course_utils.launch, course_utils.train")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "kernel_start.ipynb"
    nbformat.write(nb, path)
    return path


def execute_notebook(path: Path, out_dir: Path, log_path: Path) -> dict:
    """Run one notebook headless with papermill; its wall time and the launches it made (README)."""
    import papermill

    from tools.build_course import written_once_engine  # the build's engine: the notebook written once

    os.environ["COURSE_HEADLESS"] = "1"
    os.environ["COURSE_LAUNCH_LOG"] = str(log_path)
    log_path.unlink(missing_ok=True)
    error = None
    t0 = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(path),
            str(out_dir / path.name),
            cwd=str(path.parent),
            kernel_name="python3",
            progress_bar=False,
            log_output=False,
            engine_name=written_once_engine(),
        )
    except Exception as exc:  # a failing notebook is reported, the others still run
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
    wall = time.perf_counter() - t0
    os.environ.pop("COURSE_LAUNCH_LOG", None)
    launches = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    return {"notebook": path.stem, "wall_s": wall, "error": error, "launch_log": launches}


def notebooks_section(launch: dict | None, names=()) -> dict:
    """Each notebook headless with its defaults, the whole course, and starting vs computing (README)."""
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem == n or p.stem.split("_")[0] == n for n in names)]
    out_dir = ROOT / "build" / "bench" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        kernel = execute_notebook(_kernel_notebook(Path(tmp)), Path(tmp), Path(tmp) / "k.log")
        kernel_s = kernel["wall_s"]
        _say(f"    kernel start + imports (empty notebook): {kernel_s:.1f} s")
        joins = {r["nproc"]: r["median"] for r in (launch or {}).get("rows", []) if r["worker"] == "group_worker"}
        per_launch = linear_cost(joins) if joins else (0.0, 0.0)
        cold_extra = (launch or {}).get("cold_extra_s", 0.0)
        rows = []
        for path in paths:
            run = execute_notebook(path, out_dir, Path(tmp) / f"{path.stem}.log")
            split = startup_split(run["wall_s"], kernel_s, run["launch_log"], per_launch, cold_extra)
            rows.append({**run, **split, "nproc": sorted({r["nproc"] for r in run["launch_log"]})})
            _say(
                f"    {path.name}: {run['wall_s']:.1f} s, {len(run['launch_log'])} launches"
                + (f"  FAILED {run['error']}" if run["error"] else "")
            )
    total = sum(r["wall_s"] for r in rows)
    starting = sum(r["starting_s"] for r in rows)
    return {
        "kernel_s": kernel_s,
        "per_launch_s": list(per_launch),
        "cold_extra_s": cold_extra,
        "rows": rows,
        "course_s": total,
        "starting_s": starting,
        "computing_s": total - starting,
        "launches": sum(r["launches"] for r in rows),
        "estimated_without_launch_section": not joins,
        "subset": bool(names),
    }


def cuda_section(steps: int = 20, strategies=None, peak_flops: float | None = None) -> dict:
    """Per strategy on a GPU-sized model: step time, tokens/s, MFU vs bf16 peak, peak memory vs the planner.

    Untested on a GPU so far (written on a CPU-only machine). bf16 mixed precision, 8 sequences
    of 1024 tokens per GPU, one rank per GPU.
    """
    import torch

    from course_utils import plan as cplan

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this host"}
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    gpu_mem = torch.cuda.get_device_properties(0).total_memory
    peak = peak_flops or bf16_peak(name)
    shape = model_shape(**CUDA_MODEL)
    psi = psi_of(shape)
    batch = 8 * n
    tokens = batch * shape["seq"]
    flops = train_flops(psi, shape["layers"], shape["width"], shape["seq"], tokens)
    rows = []
    for s in strategies or [s for s in STRATEGIES if s != "single"]:
        nproc = 1 if s == "single" else n
        if s == "hybrid_shard" and (n < 4 or n % 2):
            rows.append({"strategy": s, "error": "needs at least 4 GPUs (2 nodes x 2)"})
            continue
        ok, why = strategy_available(s)
        if not ok:
            rows.append({"strategy": s, "error": why})
            continue
        rep = run_train(
            s, nproc, shape, steps=steps, batch=batch, precision="mixed", cuda_peak=True, observe=False, timeout_s=600.0
        )
        if "error" in rep:
            rows.append({"strategy": s, "error": rep["error"]})
            continue
        t = rep["step_time_s"]
        spec = cplan.model_spec(
            psi,
            layers=shape["layers"],
            width=shape["width"],
            heads=shape["heads"],
            vocab=shape["vocab"],
            seq=shape["seq"],
            micro_batch=batch // nproc,
            checkpointing=False,
        )
        cluster = cplan.Cluster(gpus_per_node=nproc, nodes=1, gpu_mem=gpu_mem)
        predicted = cplan.memory_breakdown(spec, cluster, STRATEGIES[s])["total"]  # the row's peak, one node
        measured = max(r.get("max_memory_allocated", 0) for r in rep["ranks"])
        rows.append(
            {
                "strategy": s,
                "nproc": nproc,
                "step_time_s": t,
                "tokens_per_s": tokens / t,
                "mfu": flops / t / (peak * nproc) if peak else None,
                "max_memory_allocated": measured,
                "planner_bytes": predicted,
                "memory_ratio": measured / predicted,
            }
        )
    return {
        "device": name,
        "gpus": n,
        "bf16_peak": peak,
        "model": shape,
        "psi": psi,
        "batch": batch,
        "steps": steps,
        "rows": rows,
        "tested": False,
    }


# ---------------------------------------------------------------------------------------------
# results.md
# ---------------------------------------------------------------------------------------------


def _f(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.3f} MB"


def _section_head(sec: dict) -> str:
    meta = sec.get("_meta", {})
    if not meta:
        return ""
    return (
        f"_Measured {meta.get('at', '?')}, {meta.get('seconds', 0):.0f} s, load average "
        f"{meta.get('load_before', '?')} before / {meta.get('load_after', '?')} after._\n\n"
    )


def results_markdown(results: dict) -> str:
    """``benchmarks/results.md`` from the results dict: targets first, then one table per section (README)."""
    from course_utils.plots import table_markdown

    meta = results.get("meta", {})
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m tools.bench`); every number below comes from "
        "`benchmarks/results.json`, measured in the run described here. Timings on a shared 2-core CPU "
        "machine move with its load (the load average is recorded for each section, and counts the "
        "benchmark's own processes too); the byte counts do not.",
        "",
        f"Machine: {meta.get('cpus', '?')} CPU cores, {meta.get('platform', '?')}, Python "
        f"{meta.get('python', '?')}, torch {meta.get('torch', '?')}. Last run: {meta.get('finished', '?')}, "
        f"sections {', '.join(meta.get('sections', []))}, {meta.get('total_s', 0):.0f} s in all."
        + (
            f" Last full run (what `make bench` runs): {meta['full_run']['finished']}, "
            f"{meta['full_run']['total_s']:.0f} s."
            if meta.get("full_run")
            else ""
        ),
        "",
        "## Targets",
        "",
    ]
    rows = [
        [
            v["target"],
            v["measured"],
            {True: "**met**", False: "**not met**", None: "not measured"}[v["met"]],
            v["why"] or "",
        ]
        for v in verdicts(results)
    ]
    lines += [table_markdown(["target", "measured", "verdict", "note"], rows), ""]
    if results.get("analysis"):
        lines += ["## Analysis", "", results["analysis"].strip(), ""]

    nb = results.get("notebooks")
    if nb and nb.get("rows"):
        lines += [
            "## Notebooks, executed headless with their defaults",
            "",
            _section_head(nb) + f"Kernel start and imports (an empty notebook): {nb['kernel_s']:.1f} s per notebook. "
            f"A launch that joins the group costs about {nb['per_launch_s'][0]:.2f} "
            f"{'+' if nb['per_launch_s'][1] >= 0 else '-'} {abs(nb['per_launch_s'][1]):.2f}·N s; "
            "the first launch in a kernel also starts the agent server "
            f"(+{nb['cold_extra_s']:.2f} s). Starting = kernel + those costs per launch; computing = the "
            "rest (workers and kernel, including any planned timeout).",
            "",
        ]
        body = [
            [
                r["notebook"],
                f"{r['wall_s']:.1f}",
                r["launches"],
                f"{r['launch_wall_s']:.1f}",
                f"{r['starting_s']:.1f}",
                f"{r['computing_s']:.1f}",
                f"{r['starting_share']:.0%}",
                r["error"] or ("over 90 s" if r["wall_s"] > TARGETS["notebook_s"] else "ok"),
            ]
            for r in nb["rows"]
        ]
        body.append(
            [
                "**whole course**",
                f"**{nb['course_s']:.1f}**",
                nb["launches"],
                f"{sum(r['launch_wall_s'] for r in nb['rows']):.1f}",
                f"{nb['starting_s']:.1f}",
                f"{nb['computing_s']:.1f}",
                f"{nb['starting_s'] / nb['course_s']:.0%}",
                "",
            ]
        )
        lines += [
            table_markdown(
                [
                    "notebook",
                    "wall (s)",
                    "launches",
                    "in launches (s)",
                    "starting (s)",
                    "computing (s)",
                    "starting share",
                    "status",
                ],
                body,
            ),
            "",
        ]

    la = results.get("launch")
    if la and la.get("rows"):
        ti = la["torch_import"]
        lines += [
            "## Launch overhead",
            "",
            _section_head(la) + f'`python -c "import torch"`: median {ti["median"]:.3f} s (min {ti["min"]:.3f}, max '
            f"{ti['max']:.3f}, {ti['n']} runs). First launch of a process (starts the agent server, which "
            f"imports torch once): {la['cold_s']:.2f} s. After that, each launch forks an agent from the "
            "pre-warmed server and the agent forks the workers, so no launch imports torch again.",
            "",
        ]
        body = [
            [
                r["worker"],
                r["nproc"],
                f"{r['median']:.3f}",
                f"{r['min']:.3f}",
                f"{r['max']:.3f}",
                f"{r['median'] / ti['median']:.2f}x",
                _f(r.get("to_workers_s")),
                _f(r.get("join_s")),
                _f(r.get("after_s")),
            ]
            for r in la["rows"]
        ]
        lines += [
            table_markdown(
                [
                    "worker",
                    "ranks",
                    "median (s)",
                    "min (s)",
                    "max (s)",
                    "/ torch import",
                    "call to last worker running (s)",
                    "group join (s)",
                    "last return to result (s)",
                ],
                body,
            ),
            "",
        ]

    pa = results.get("pairs")
    if pa and pa.get("rows"):
        lines += [
            "## Hand-built vs torch",
            "",
            _section_head(pa)
            + f"Same model (Ψ = {pa['psi']:,}: {_shape_text(pa['model'])}), data, {pa['nproc']} ranks, "
            f"{pa['steps']} steps per run (step time: median over steps after the first, max over ranks); "
            f"{pa['rounds']} rounds of interleaved runs A B A B. Ratio = hand-built / torch, per round.",
            "",
        ]
        body = []
        for r in pa["rows"]:
            if "error" in r:
                body.append([f"{r['hand']} / {r['torch']}", "-", "-", "-", "-", "-", r["error"]])
                continue
            q = r["ratio"]
            body.append(
                [
                    f"{r['hand']} / {r['torch']}",
                    f"{r['hand_s']['median'] * 1e3:.1f}",
                    f"{r['torch_s']['median'] * 1e3:.1f}",
                    f"**{q['median']:.2f}**",
                    f"{q['min']:.2f} / {q['max']:.2f}",
                    f"{_calls_text(r['hand_calls'])} vs {_calls_text(r['torch_calls'])}",
                    "same losses" if r["same_losses"] else f"max loss diff {r['max_loss_diff']:.1e}",
                ]
            )
        lines += [
            table_markdown(
                ["pair", "hand (ms)", "torch (ms)", "ratio (median)", "min / max", "collectives per step", "agreement"],
                body,
            ),
            "",
        ]

    th = results.get("theory")
    if th and th.get("rows"):
        lines += [
            "## Theory vs measured, every strategy",
            "",
            _section_head(th)
            + f"Ψ = {th['psi']:,} ({_shape_text(th['model'])}), fp32 Adam (4 + 4 + 8 bytes per parameter). "
            "Held: model states per rank (mean over ranks) at the last step; sent: ring bytes one rank sends "
            "per step (mean over ranks). Formula = the paper's formula with the run's padding; "
            "paper = the same without padding.",
            "",
        ]
        body = []
        for r in th["rows"]:
            if "error" in r:
                body.append([r["strategy"], r["nproc"], "-", "-", "-", "-", "-", "-", r["error"]])
                continue
            body.append(
                [
                    r["strategy"],
                    r["nproc"],
                    _mb(r["held_mean"]),
                    _mb(r["held_exact"]),
                    _f(r["held_ratio"], ".4f"),
                    _mb(r["sent_mean"]),
                    _mb(r["sent_exact"]),
                    _f(r["sent_ratio"], ".4f"),
                    f"held {_f(r['held_ratio_paper'], '.4f')}, sent {_f(r['sent_ratio_paper'], '.4f')}; "
                    f"padding {r['held_padding']:.0f} B held, {r['sent_padding']:.0f} B sent",
                ]
            )
        lines += [
            table_markdown(
                [
                    "strategy",
                    "ranks",
                    "held",
                    "formula",
                    "held / formula",
                    "sent / step",
                    "formula",
                    "sent / formula",
                    "vs paper (no padding)",
                ],
                body,
            ),
            "",
        ]

    sc = results.get("scaling")
    if sc and sc.get("rows"):
        lines += [
            "## Scaling",
            "",
            _section_head(sc) + f"Global batch 8 sequences, {sc['steps']} steps per run; widths h = "
            f"{', '.join(map(str, sc['widths']))} (tiny model otherwise). 4 ranks on 2 cores are "
            "oversubscribed: their step times show the cost of sharing cores, not of the algorithm. One rank "
            f"computes with both cores (2 threads) and is the most exposed to other processes: each 1-rank "
            f"point is the faster of {SINGLE_RANK_TRIES} runs. "
            "![scaling](scaling.png)",
            "",
        ]
        body = [
            [
                r["strategy"],
                r.get("width", "-"),
                r.get("nproc", "-"),
                f"{r['psi']:,}" if "psi" in r else "-",
                f"{r['step_time_s'] * 1e3:.1f}" if "step_time_s" in r else "-",
                _mb(r.get("held_per_rank")),
                _f(r.get("held_ratio"), ".4f"),
                _mb(r.get("sent_per_step")),
                r.get("error", ""),
            ]
            for r in sc["rows"]
        ]
        lines += [
            table_markdown(
                [
                    "strategy",
                    "width",
                    "ranks",
                    "Ψ",
                    "step (ms)",
                    "held per rank",
                    "held / formula",
                    "sent / step",
                    "note",
                ],
                body,
            ),
            "",
        ]

    cu = results.get("cuda")
    if cu:
        lines += ["## CUDA", ""]
        if cu.get("skipped"):
            lines += [
                f"Not run: {cu['skipped']}. On a CUDA host the same command reports, per strategy, step time, "
                "tokens/s, MFU against the bf16 peak and `max_memory_allocated` against the planner "
                "(this path has not been run on a GPU yet).",
                "",
            ]
        else:
            lines += [
                _section_head(cu) + f"{cu['gpus']} x {cu['device']} (bf16 peak "
                f"{_f(cu['bf16_peak'] and cu['bf16_peak'] / 1e12, '.0f')} TFLOP/s), Ψ = {cu['psi']:,}, "
                f"batch {cu['batch']} x {cu['model']['seq']} tokens, bf16 mixed precision. "
                "(First GPU run of this code path: check the numbers before quoting them.)",
                "",
            ]
            body = [
                [
                    r["strategy"],
                    f"{r['step_time_s'] * 1e3:.1f}" if "step_time_s" in r else "-",
                    _f(r.get("tokens_per_s"), ",.0f"),
                    _f(r.get("mfu"), ".1%"),
                    _f(r.get("max_memory_allocated") and r["max_memory_allocated"] / 1e9, ".2f"),
                    _f(r.get("planner_bytes") and r["planner_bytes"] / 1e9, ".2f"),
                    _f(r.get("memory_ratio"), ".2f"),
                    r.get("error", ""),
                ]
                for r in cu["rows"]
            ]
            lines += [
                table_markdown(
                    [
                        "strategy",
                        "step (ms)",
                        "tokens/s",
                        "MFU",
                        "max allocated (GB)",
                        "planner (GB)",
                        "measured / planner",
                        "note",
                    ],
                    body,
                ),
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def _shape_text(shape: dict) -> str:
    return f"{shape['layers']} blocks, width {shape['width']}, seq {shape['seq']}, vocab {shape['vocab']}"


def _calls_text(calls: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
    return " ".join(f"{v:g} {short.get(k, k)}" for k, v in calls.items()) or "none"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_sections(text: str | None, cuda_available: bool) -> list[str]:
    """The sections to run, in order, from ``--sections a,b`` (default: all that can run here) (README)."""
    if text is None:
        return [s for s in SECTIONS if s != "cuda" or cuda_available]
    chosen = [s.strip() for s in text.split(",") if s.strip()]  # --sections '' is a typo, not "all of them"
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise CourseInputError(
            f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(SECTIONS)}, separated by commas"
        )
    if "cuda" in chosen and not cuda_available:
        raise CourseInputError("the cuda section needs a CUDA device, and torch sees none here; leave it out")
    return [s for s in SECTIONS if s in chosen]


def check_arguments(args) -> None:
    """Refuse settings that cannot give a meaningful number, with one sentence each (README)."""
    check_values("bench", args, flags=True)  # --rounds, --steps, --repeats: their stated ranges
    known = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    for name in getattr(args, "notebooks", ()) or ():
        if not any(stem == name or stem.split("_")[0] == name for stem in known):
            raise CourseInputError(
                f"--notebooks {name}: no such notebook; give a number or a name from {', '.join(sorted(known))}"
            )
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise CourseInputError(f"--peak-tflops must be a positive number of TFLOP/s, got {args.peak_tflops:g}")
    writable_dir("--out", args.out)


def bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sections",
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all that can run here); "
        "sections not run keep their previous results in results.json",
    )
    parser.add_argument("--rounds", type=int, default=4, help="interleaved A B rounds per hand-built/torch pair")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=4, help="launches per launch-overhead measurement")
    parser.add_argument("--notebooks", nargs="*", default=(), metavar="NN", help="only these notebooks (prefixes)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak per GPU, for MFU (cuda section)")
    parser.add_argument("--out", default=str(OUT_DIR), help="folder for results.md, results.json, scaling.png")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="measure nothing: rewrite results.md from results.json (and analysis.md)",
    )


def bench_command(args) -> int:
    check_arguments(args)
    parse_sections(args.sections, cuda_available=True)  # the names first: a typo costs no torch import (3 CPU s)
    import torch

    sections = parse_sections(args.sections, torch.cuda.is_available())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    try:
        results = json.loads(json_path.read_text()) if json_path.exists() else {}
    except (OSError, ValueError) as exc:
        raise CourseInputError(f"cannot read {json_path} ({exc}); fix or delete it, or give another --out") from None
    if not isinstance(results, dict):
        raise CourseInputError(f"{json_path} is not a results file this harness wrote; give another --out")
    if args.render_only:
        if not results:
            raise CourseInputError(f"no {json_path} to render; run the benchmark first")
        meta = results.get("meta", {})
        analysis = out / "analysis.md"
        results["analysis"] = analysis.read_text() if analysis.exists() else ""
        try:  # a results file of another shape (another version, another tool) is refused, not half-rendered
            text = results_markdown(results)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CourseInputError(
                f"{json_path} is not a results file this harness wrote ({type(exc).__name__}: {exc}); "
                "run the benchmark again, or give the --out of a run of this version"
            ) from None
        json_path.write_text(json.dumps(results, indent=1, sort_keys=True, default=_json_default) + "\n")
        (out / "results.md").write_text(text)
        _say(f"==> rewrote {out / 'results.md'} from results.json (run of {meta.get('finished', '?')})")
        return 0
    started = time.perf_counter()
    _say(f"==> bench: {', '.join(sections)} (load average {_load()})")
    cache: dict = {}
    pairs_shape = model_shape(**PAIRS_MODEL)
    for name in sections:
        _say(f"--> {name}")
        before, t0 = _load(), time.perf_counter()
        try:
            if name == "launch":
                sec = launch_section(repeats=args.repeats)
            elif name == "pairs":
                sec = pairs_section(args.rounds, args.steps, pairs_shape, cache=cache)
            elif name == "theory":
                sec = theory_section(args.steps, pairs_shape, cache=cache)
            elif name == "scaling":
                sec = scaling_section(args.steps)
                scaling_figure(sec).savefig(out / "scaling.png", dpi=110)
            elif name == "notebooks":
                sec = notebooks_section(results.get("launch"), args.notebooks)
            else:
                sec = cuda_section(steps=max(args.steps, 10), peak_flops=args.peak_tflops and args.peak_tflops * 1e12)
        except Exception as exc:  # one broken section is reported; the others still run
            lines = [x for x in str(exc).strip().splitlines() if x.strip()] or [""]
            sec = {
                "error": f"{type(exc).__name__}: {lines[0][:200]}"
                + (f" ... {lines[-1][:200]}" if len(lines) > 1 else "")
            }
            _say(f"    {name} FAILED: {sec['error']}")
        sec["_meta"] = {
            "at": time.strftime("%Y-%m-%d %H:%M"),
            "seconds": time.perf_counter() - t0,
            "load_before": before,
            "load_after": _load(),
        }
        results[name] = sec
        _say(f"    {name}: {sec['_meta']['seconds']:.0f} s")
        done = sections[: sections.index(name) + 1]
        write_results(results, out, done, time.perf_counter() - started, complete=done == sections)
    for v in verdicts(results):
        _say(
            f"    {'met' if v['met'] else 'NOT met' if v['met'] is False else 'not measured'}: {v['target']}"
            f" ({v['measured']})"
        )
    _say(f"==> wrote {out / 'results.md'} and results.json in {time.perf_counter() - started:.0f} s")
    return 0


def write_results(results: dict, out: Path, sections: list, total_s: float, complete: bool = True) -> None:
    """Write results.json and results.md (after every section, so an interrupted run keeps what it measured)."""
    import torch

    full = (results.get("meta") or {}).get("full_run")
    if complete and set(sections) >= set(SECTIONS) - {"cuda"}:  # what `make bench` runs: its total time
        full = {"finished": time.strftime("%Y-%m-%d %H:%M"), "total_s": total_s, "load_after": _load()}
    results["meta"] = {
        "finished": time.strftime("%Y-%m-%d %H:%M") + ("" if complete else " (interrupted)"),
        "total_s": total_s,
        "sections": sections,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(terse=True),
        "full_run": full,
    }
    analysis = out / "analysis.md"  # written by hand after looking at a run; shown under the targets
    results["analysis"] = analysis.read_text() if analysis.exists() else ""
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=_json_default) + "\n")
    (out / "results.md").write_text(results_markdown(results))


def _json_default(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.bench [--sections ...]``: bad arguments exit 2 with one line on stderr, as the CLI does."""
    from course_utils.cli import _Parser
    from course_utils.validate import check_numbers

    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_numbers(args)  # nan, inf, 400 digits: refused before anything runs
        return bench_command(args)
    except CourseInputError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from tools import bench as _named  # the workers import tools.bench by name, not this __main__

    sys.exit(_named.main())
