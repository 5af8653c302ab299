"""Run the course's CUDA paths on this machine's GPUs and write benchmarks/gpu.md and gpu.json.

The exact command, on a Linux machine with at least one CUDA GPU, in a fresh checkout (an empty
``TORCH_INDEX`` makes the set-up install PyPI's CUDA build of torch instead of the CPU build):

    make gpu-check TORCH_INDEX=        # set-up, then: .venv/bin/python tools/gpu_check.py

Options: ``--out DIR`` (default benchmarks/), ``--budget-s`` (default 540: no section or notebook
starts after it, so the check stays under ten minutes), ``--micro-batch`` (sequences per step of
the 1B run, default 8), ``--only a,b`` (run only these sections). Without a CUDA device it exits
with status 2 and one line.

Sections, in order; each is guarded (a failure is written into the report with its error, and
the next section still runs), and the report is rewritten after each one:

- ``device``: the GPU (name, memory, compute capability, count) and torch, CUDA, cuDNN, NCCL versions.
- ``matmul_peak``: the bf16 FLOP/s this GPU reaches on a large matmul, measured here: the
  denominator of every MFU below (the data-sheet value is shown beside it, never used).
- ``fsdp_1b``: a ~1.08B-parameter course model (``ONE_B``), FSDP2 FULL_SHARD on one GPU (world
  size 1, NCCL, started by ``course_utils.launch``), bf16 compute and fp32 reduce, activation
  checkpointing on every block: the wrapping and optimizer of the rehearsal
  (``course_utils.fsdp.shard_model`` / ``make_optimizer``). Measures step time, tokens/s,
  MFU, ``torch.cuda.max_memory_allocated`` in a steady step against ``rehearse.rehearse`` for the
  same model and setting (target: within 10%), and a torch.profiler summary of the top kernels
  (where the time goes, for the 40% MFU target).
- ``train_1gpu``: the course's training entry point (``train.train_worker`` through
  ``course_utils.launch``, as ``bench.run_train`` runs it) with FSDP2 FULL_SHARD on one GPU.
- ``single_process``: each notebook's single-process parts on one GPU, concretely the functions
  its cells call, at world size 1 on ``cuda:0`` (a rank of its own through ``launch`` where the
  notebook launches them): 00 an all-reduce; 01 activation bytes by saved-tensor hooks (cuda
  against CPU); 02-04 ``train`` with single (twice: bit for bit?), ddp, zero3, full_shard; 05 the
  block-overlap timers; 05b the rehearsal against real shards; 06 kill, restart and resume. The
  notebooks have no device knob: with their defaults every launch has 2 or more ranks.
- ``nccl_2rank`` (two or more GPUs only): notebooks 02-04 executed with ``NPROC = 2``, so their
  2-rank runs use NCCL and their asserts (bit-identical weights included) run on GPUs.
- ``notebooks``: every notebook executed headless with its defaults (papermill): launches with no
  more ranks than GPUs use NCCL and one GPU per rank, the rest gloo on CPU (``dist.pick_backend``).
  The report counts, per notebook, the launches on each backend.

MFU counts model FLOPs only: ``tools.bench.train_flops``, 6Ψ per token plus 12·L·s·h per
token for attention (PaLM's accounting, causal masking not discounted); the recomputation of
activation checkpointing is not counted, so it shows as lost MFU. The 1B timing run joins with
``dist.init(deterministic=False)`` (the fast kernels); every other run keeps the deterministic
settings ``dist.init`` applies on CUDA, which the bit-for-bit checks need.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the workers import this module as tools.gpu_check
    sys.path.insert(0, str(ROOT))

NO_CUDA = "no CUDA device: run make gpu-check on a machine with a GPU"
#: The ~1B model of the MFU run: GPT-2's architecture at 20 blocks of width 2048 (Ψ = 1,076,899,840).
ONE_B = dict(vocab=32000, seq=2048, layers=20, width=2048, heads=16, mlp_ratio=4, tie_weights=True)
#: The MFU the issue aims for, and how close the rehearsal's peak should come to the measured one.
MFU_TARGET, PEAK_TOLERANCE = 0.40, 0.10
SECTIONS = ("device", "matmul_peak", "fsdp_1b", "train_1gpu", "single_process", "nccl_2rank", "notebooks")
#: Rough seconds a section needs; a section is skipped when the budget left is smaller.
NEEDS_S = {"fsdp_1b": 150, "train_1gpu": 60, "single_process": 120, "nccl_2rank": 120, "notebooks": 60}


# ---------------------------------------------------------------------------------------------
# Pure parts (tested on CPU: tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------------


def step_flops(shape: dict, tokens: int) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens of the course model ``shape``:
    ``bench.train_flops`` (6Ψ + 12·L·s·h per token) with Ψ counted on the meta device."""
    from course_utils.models import GPTConfig, param_count
    from tools.bench import train_flops

    psi = param_count(GPTConfig(**shape))
    return train_flops(psi, shape["layers"], shape["width"], shape["seq"], tokens)


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the measured bf16 peak."""
    return flops_per_step / step_s / peak_flops


def kernel_category(name: str) -> str:
    """Which kind of work a CUDA kernel does, from its name (for "where the time goes")."""
    low = name.lower()
    for category, marks in (
        ("communication", ("nccl",)),
        ("attention", ("flash", "fmha", "attention", "sdpa")),
        ("matmul", ("gemm", "cutlass", "nvjet", "sm90", "sm100", "matmul", "cublas")),
        ("optimizer", ("adam",)),
    ):
        if any(m in low for m in marks):
            return category
    return "elementwise and other"


def summarise_kernels(kernels: list[dict], wall_us: float, top: int = 12) -> dict:
    """Top kernels and time per category from ``[{"name", "us", "calls"}]`` over ``wall_us`` of steps."""
    total = sum(k["us"] for k in kernels) or 1.0
    by_cat: dict = {}
    for k in kernels:
        cat = kernel_category(k["name"])
        by_cat[cat] = by_cat.get(cat, 0.0) + k["us"]
    rows = sorted(kernels, key=lambda k: -k["us"])[:top]
    return {
        "kernel_us": total,
        "wall_us": wall_us,
        "busy_fraction": total / wall_us if wall_us else None,
        "by_category": {c: {"us": us, "share": us / total} for c, us in sorted(by_cat.items(), key=lambda x: -x[1])},
        "top": [{**k, "share": k["us"] / total, "category": kernel_category(k["name"])} for k in rows],
    }


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _error_lines(sec: dict) -> list[str]:
    return [f"**Failed**: `{sec['error']}`", "", "```", sec.get("traceback", "").rstrip(), "```", ""]


def _device_md(sec: dict) -> list[str]:
    return [
        f"{sec['count']} x {sec['name']}, {sec['memory_bytes'] / 2**30:.1f} GiB, compute capability "
        f"{sec['capability']}; torch {sec['torch']}, CUDA {sec['cuda']}, cuDNN {sec['cudnn']}, NCCL {sec['nccl']}.",
        "",
    ]


def _peak_md(sec: dict) -> list[str]:
    sheet = sec.get("data_sheet_flops")
    return [
        f"bf16 matmul {sec['n']} x {sec['n']} x {sec['n']}: **{sec['flops'] / 1e12:.0f} TFLOP/s** measured "
        f"(best of {sec['trials']} timings of {sec['iters']} matmuls)"
        + (f"; data sheet {sheet / 1e12:.0f} TFLOP/s (not used)" if sheet else "")
        + ".",
        "",
    ]


def _fsdp_md(sec: dict) -> list[str]:
    mem, t = sec["memory"], sec["timing"]
    lines = [
        f"Ψ = {sec['psi']:,} ({sec['shape']['layers']} blocks, width {sec['shape']['width']}, seq "
        f"{sec['shape']['seq']}), {sec['micro_batch']} sequences per step ({sec['tokens']:,} tokens), FSDP2 "
        "FULL_SHARD on 1 GPU, bf16 compute / fp32 reduce, activation checkpointing, fused AdamW.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| step time (median of {t['steps']}) | {t['step_s'] * 1e3:.1f} ms |",
        f"| tokens per second | {t['tokens_per_s']:,.0f} |",
        f"| model FLOPs per step (6Ψ + 12·L·s·h per token) | {sec['flops_per_step']:.3e} |",
        f"| MFU against the measured peak | **{_fmt(sec.get('mfu'), '.1%')}** (target {MFU_TARGET:.0%}) |",
        f"| max_memory_allocated (steady step) | {mem['measured'] / 1e9:.2f} GB |",
        f"| rehearsal's predicted peak | {_fmt(mem.get('predicted') and mem['predicted'] / 1e9, '.2f')} GB |",
        f"| measured / predicted | **{_fmt(mem.get('ratio'), '.3f')}** (target within {PEAK_TOLERANCE:.0%}) |",
        "",
    ]
    return lines + _mfu_verdict(sec) + _profile_md(sec.get("profile"))


def _mfu_verdict(sec: dict) -> list[str]:
    """One sentence on the MFU target; below it, where the profile says the time went."""
    value, prof = sec.get("mfu"), sec.get("profile") or {}
    if value is None:
        return ["No MFU: the matmul peak was not measured.", ""]
    if value >= MFU_TARGET:
        return [f"MFU {value:.1%} meets the {MFU_TARGET:.0%} target.", ""]
    cats = list(prof.get("by_category", {}).items())
    top = f"; the largest share of kernel time is {cats[0][0]} ({cats[0][1]['share']:.0%})" if cats else ""
    idle = prof.get("busy_fraction")
    idle_text = f"; the GPU ran no kernel for {max(0.0, 1 - idle):.0%} of the profiled wall time" if idle else ""
    return [
        f"MFU {value:.1%} is below the {MFU_TARGET:.0%} target. Activation checkpointing recomputes each "
        f"block's forward (about a third more FLOPs than the model FLOPs counted){top}{idle_text}.",
        "",
    ]


def _profile_md(prof: dict | None) -> list[str]:
    if not prof:
        return []
    lines = [
        f"Where the time goes (torch.profiler over {prof['steps']} steps): GPU kernels busy "
        f"{_fmt(prof.get('busy_fraction'), '.0%')} of the wall time.",
        "",
        "| category | share of kernel time |",
        "|---|---|",
    ]
    lines += [f"| {c} | {v['share']:.1%} |" for c, v in prof["by_category"].items()]
    lines += ["", "| kernel | calls | ms | share |", "|---|---|---|---|"]
    lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['us'] / 1e3:.1f} | {k['share']:.1%} |" for k in prof["top"]]
    return lines + [""]


def _train_md(sec: dict) -> list[str]:
    return [
        f"`{sec['strategy']}` on {sec['world_size']} GPU, backend {sec['backend']}, Ψ = {sec['psi']:,}, "
        f"{sec['steps']} steps, batch {sec['batch']} x {sec['seq']} tokens, bf16 mixed precision: step "
        f"{sec['step_time_s'] * 1e3:.1f} ms, losses {sec['losses'][0]:.4f} -> {sec['losses'][-1]:.4f}, "
        f"max_memory_allocated {_fmt(sec.get('max_memory_allocated') and sec['max_memory_allocated'] / 1e9, '.2f')} GB.",
        "",
    ]


def _notebooks_md(sec: dict) -> list[str]:
    lines = ["| notebook | result | seconds | launches on NCCL | launches on gloo |", "|---|---|---|---|---|"]
    for r in sec["rows"]:
        result = "passed" if not r.get("error") else f"FAILED: `{r['error']}`"
        lines.append(f"| {r['notebook']} | {result} | {r['wall_s']:.1f} | {r['nccl']} | {r['gloo']} |")
    return lines + ([f"Not run (time budget): {', '.join(sec['skipped'])}."] if sec.get("skipped") else []) + [""]


def _single_md(sec: dict) -> list[str]:
    lines = ["| notebook | what | result | seconds |", "|---|---|---|---|"]
    for r in sec["rows"]:
        result = (
            f"FAILED: `{r['error']}`" if "error" in r else ("" if r.get("ok") else "**check this:** ") + r["result"]
        )
        lines.append(f"| {r['notebook']} | {r['what']} | {result} | {r['seconds']:.1f} |")
    return lines + [""]


RENDER = {
    "device": _device_md,
    "matmul_peak": _peak_md,
    "fsdp_1b": _fsdp_md,
    "train_1gpu": _train_md,
    "single_process": _single_md,
    "nccl_2rank": _notebooks_md,
    "notebooks": _notebooks_md,
}
TITLES = {
    "device": "Device",
    "matmul_peak": "bf16 peak, measured",
    "fsdp_1b": "1B model, FSDP2 + activation checkpointing",
    "train_1gpu": "The training entry point on one GPU",
    "single_process": "Each notebook's single-process parts on one GPU",
    "nccl_2rank": "Notebooks 02-04 on 2 ranks (NCCL)",
    "notebooks": "Every notebook on this host",
}


def report_markdown(results: dict) -> str:
    """benchmarks/gpu.md from the results dict: one section per check, failures with their error."""
    meta = results.get("meta", {})
    finished = f"finished {meta['finished']}, {meta['total_s']:.0f} s in all" if "finished" in meta else "still running"
    lines = [
        "# The course on a GPU",
        "",
        f"Written by `make gpu-check` (`tools/gpu_check.py`), started {meta.get('started', '?')}, {finished}; "
        "every number below comes from `gpu.json`, measured in that run.",
        "",
    ]
    for name in SECTIONS:
        sec = results.get(name)
        if sec is None:
            continue
        lines += [f"## {TITLES[name]}", ""]
        if "error" in sec:
            lines += _error_lines(sec)
        elif "not_run" in sec:
            lines += [f"Not run: {sec['not_run']}.", ""]
        else:
            lines += RENDER[name](sec)
    return "\n".join(lines).rstrip() + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    """Write ``gpu.json`` (every number) and ``gpu.md`` (the same, readable) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str) + "\n")
    (out_dir / "gpu.md").write_text(report_markdown(results))


def run_section(name: str, fn, results: dict, out_dir: Path) -> dict:
    """Run one section; on any exception record its error and traceback instead. Rewrites the report."""
    t0 = time.perf_counter()
    try:
        sec = fn()
    except Exception as exc:  # a failing section is reported, and the check goes on
        sec = {
            "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}",
            "traceback": "".join(traceback.format_exc().splitlines(keepends=True)[-25:]),
        }
    sec["seconds"] = time.perf_counter() - t0
    results[name] = sec
    write_report(results, out_dir)
    print(f"==> {name}: {'FAILED ' + sec['error'] if 'error' in sec else 'done'} ({sec['seconds']:.0f} s)", flush=True)
    return sec


# ---------------------------------------------------------------------------------------------
# Sections (need CUDA)
# ---------------------------------------------------------------------------------------------


def device_section() -> dict:
    """The GPU and the versions of everything between the course and it."""
    import torch

    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version()
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
    }


def matmul_peak_section(n: int = 8192, iters: int = 50, trials: int = 3) -> dict:
    """bf16 FLOP/s of an n x n x n matmul (2n³ FLOPs), timed with CUDA events, best of ``trials``."""
    import torch

    from tools.bench import bf16_peak

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(5):  # warm-up: cuBLAS picks its kernel, clocks ramp up
        a @ b
    best = 0.0
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
        end.synchronize()
        best = max(best, 2.0 * n**3 * iters / (start.elapsed_time(end) / 1e3))
    return {
        "n": n,
        "iters": iters,
        "trials": trials,
        "flops": best,
        "data_sheet_flops": bf16_peak(torch.cuda.get_device_name(0)),
    }


def fsdp_step_worker(shape: dict, micro_batch: int, steps: int = 10, warmup: int = 3, profile_steps: int = 2) -> dict:
    """Worker for ``launch``: the rehearsal's FSDP2 setting (FULL_SHARD, bf16, activation checkpointing,
    fused AdamW) on real GPUs; step times, the steady-step memory peak, and a kernel profile."""
    import torch

    from course_utils import dist as cdist
    from course_utils import rehearse, strategies
    from course_utils.data import batch_for_rank
    from course_utils.loop import device_mesh
    from course_utils.models import GPTConfig, build_model

    info = cdist.init(deterministic=False)  # a timing run: the fast kernels, no bit-for-bit claim
    try:
        cfg = GPTConfig(**shape)
        model = build_model(cfg, seed=0, device=info.device)
        row = strategies.FULL_SHARD
        mesh = device_mesh(row, info)
        model = row.apply(model, mesh, rehearse.apply_options(row, "bf16", act_ckpt=True, device=info.device))
        opt = rehearse.make_optimizer(model)
        x, y = batch_for_rank(
            0,
            info.rank,
            info.world_size,
            batch=micro_batch * info.world_size,
            seq=cfg.seq,
            vocab=cfg.vocab,
            device=info.device,
        )

        def step():
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(warmup):  # the first step creates Adam's state; the rehearsal tracks a later one
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = _timed_steps(step, steps)
        peak = torch.cuda.max_memory_allocated()
        return {
            "rank": info.rank,
            "step_times_s": times,
            "max_memory_allocated": peak,
            "profile": _profile(step, profile_steps),
        }
    finally:
        cdist.shutdown()


def _timed_steps(step, steps: int) -> list[float]:
    """Seconds per step from CUDA events; one host synchronisation at the end, none per step."""
    import torch

    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]


def _profile(step, steps: int) -> dict:
    """torch.profiler over ``steps`` steps: every CUDA kernel's total time, and the wall time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    kernels = [
        {"name": e.key, "us": e.self_device_time_total, "calls": e.count}
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    return {"steps": steps, **summarise_kernels(kernels, wall_us)}


def fsdp_1b_section(peak_flops: float | None, micro_batch: int) -> dict:
    """The ~1B run (one launch, world size 1, NCCL) against the rehearsal of the same setting."""
    from course_utils import rehearse
    from course_utils.launch import launch
    from course_utils.models import GPTConfig

    run = launch(
        "tools.gpu_check:fsdp_step_worker",
        nproc=1,
        backend="nccl",
        args=(ONE_B, micro_batch),
        timeout_s=400.0,
        echo=False,
        progress=False,
    )[0]
    predicted = rehearse.rehearse(
        GPTConfig(**ONE_B),
        nproc=1,
        strategy="full_shard",
        micro_batch=micro_batch,
        act_ckpt=True,
        mixed_precision="bf16",
    ).peak_bytes
    tokens = micro_batch * ONE_B["seq"]
    step_s = statistics.median(run["step_times_s"])
    flops = step_flops(ONE_B, tokens)
    measured = run["max_memory_allocated"]
    return {
        "shape": ONE_B,
        "psi": rehearse.param_count(GPTConfig(**ONE_B)),
        "micro_batch": micro_batch,
        "tokens": tokens,
        "flops_per_step": flops,
        "peak_flops": peak_flops,
        "mfu": mfu(flops, step_s, peak_flops) if peak_flops else None,
        "timing": {
            "steps": len(run["step_times_s"]),
            "step_s": step_s,
            "step_times_s": run["step_times_s"],
            "tokens_per_s": tokens / step_s,
        },
        "memory": {
            "measured": measured,
            "predicted": predicted,
            "ratio": measured / predicted,
            "within_target": abs(measured / predicted - 1) <= PEAK_TOLERANCE,
        },
        "profile": run["profile"],
    }


def train_1gpu_section() -> dict:
    """FSDP2 FULL_SHARD through the course's training entry point on one GPU (NCCL, world size 1)."""
    from tools import bench

    shape = bench.model_shape(**bench.CUDA_MODEL)
    rep = bench.run_train(
        "full_shard", 1, shape, steps=10, batch=8, precision="mixed", cuda_peak=True, backend="nccl", timeout_s=300.0
    )
    if "error" in rep:
        raise RuntimeError(rep["error"])
    return {
        "strategy": rep["strategy"],
        "world_size": rep["world_size"],
        "backend": rep["backend"],
        "psi": bench.psi_of(shape),
        "steps": rep["steps"],
        "batch": 8,
        "seq": shape["seq"],
        "losses": rep["losses"],
        "step_time_s": rep["step_time_s"],
        "max_memory_allocated": rep.get("max_memory_allocated"),
    }


def single_process_section() -> dict:
    """Each notebook's single-process parts on one GPU: the functions its cells call, at world size 1
    (NCCL, ``cuda:0``) through ``launch`` where the notebook launches them. Every check is guarded."""
    rows = []
    for notebook, what, check in SINGLE_PROCESS_CHECKS:
        t0 = time.perf_counter()
        try:
            rows.append({"notebook": notebook, "what": what, **check()})
        except Exception as exc:  # reported in the table; the next check still runs
            rows.append(
                {"notebook": notebook, "what": what, "error": f"{type(exc).__name__}: {str(exc).strip()[:300]}"}
            )
        rows[-1]["seconds"] = time.perf_counter() - t0
    return {"rows": rows}


def _all_reduce_on_gpu() -> dict:
    from course_utils import examples
    from course_utils.launch import launch

    r = launch(examples.all_reduce_demo, nproc=1, backend="nccl", echo=False, progress=False)[0]
    return {"result": f"{r['backend']} on {r['device']}: {r['result']}", "ok": r["result"] == [1.0] * 4}


def _activations_on_gpu() -> dict:
    """Notebook 01's activation bytes (saved-tensor hooks) on cuda against the same count on CPU."""
    import torch

    from course_utils import memory
    from course_utils.data import batch_for_rank
    from course_utils.models import build_model, get_config

    cfg, out = get_config("small"), {}
    x, y = batch_for_rank(0, 0, 1, batch=4, seq=cfg.seq, vocab=cfg.vocab)
    for device in ("cpu", "cuda"):
        net = build_model(cfg, device=device).to(torch.bfloat16)
        out[device] = memory.measure_activation_bytes(net, x.to(device), y.to(device))["blocks"]
    rule = memory.activation_bytes(cfg.width, 4, cfg.seq, cfg.layers)
    return {
        "result": f"block activations {out['cuda']:,} B on cuda, {out['cpu']:,} B on CPU, rule {rule:,.0f} B",
        "ok": out["cuda"] > 0,
    }


def _strategies_on_gpu() -> dict:
    """Notebooks 02-04's reference and strategies at world size 1 on one GPU: single twice (the
    deterministic settings make it repeat bit for bit), then ddp, zero3, full_shard against it."""
    from course_utils.train import train

    run = dict(nproc=1, steps=4, model="small", backend="nccl")
    shas = {s: train(strategy=s, **run)["weights_sha256"] for s in ("single", "ddp", "zero3", "full_shard")}
    again = train(strategy="single", **run)["weights_sha256"]
    same = [s for s in ("ddp", "zero3", "full_shard") if shas[s] == shas["single"]]
    return {
        "result": f"single repeats bit for bit: {again == shas['single']}; bit-identical to single at world "
        f"size 1: {', '.join(same) or 'none'}",
        "ok": again == shas["single"],
    }


def _overlap_timers_on_gpu() -> dict:
    """Notebook 05's block-overlap worker on one GPU: its timers synchronise the device."""
    from course_utils.labs import lab05
    from course_utils.launch import launch

    rows = launch(
        lab05.block_overlap_worker,
        nproc=1,
        backend="nccl",
        echo=False,
        progress=False,
        kwargs={"widths": (1024, 2048), "tokens": (1024, 8192), "repeats": 3},
    )[0]
    text = "; ".join(f"h={r['width']} {r['tokens']} tokens fwd {r['fwd_s'] * 1e3:.2f} ms" for r in rows)
    return {"result": text, "ok": all(r["fwd_s"] > 0 for r in rows)}


def _bridge_on_gpu() -> dict:
    """Notebook 05b's bridge at world size 1: the rehearsal's bytes against real cuda shards."""
    from course_utils.labs import lab05b

    rows = lab05b.bridge(1, ("full_shard", "shard_grad_op"))
    return {
        "result": ", ".join(f"{r['strategy']} equal: {r['equal']}" for r in rows),
        "ok": all(r["equal"] for r in rows),
    }


def _resume_on_gpu() -> dict:
    """Notebook 06 at world size 1: die at step 3, restart, resume from step 2; bit-identical?"""
    from course_utils.train import train

    run = dict(strategy="ddp", nproc=1, steps=6, model="small", backend="nccl")
    straight = train(**run)
    with tempfile.TemporaryDirectory() as tmp:
        resumed = train(**run, checkpoint_dir=tmp, checkpoint_every=2, max_restarts=1, fail_at="0:3")
    same = resumed["weights_sha256"] == straight["weights_sha256"]
    return {
        "result": f"restarts {resumed['restarts']}, resumed from {resumed['resumed_from']}, bit-identical: {same}",
        "ok": same and resumed["restarts"] == 1,
    }


SINGLE_PROCESS_CHECKS = (
    ("00", "all-reduce through launch, one rank", _all_reduce_on_gpu),
    ("01", "activation bytes, saved-tensor hooks", _activations_on_gpu),
    ("02-04", "train: single, ddp, zero3, full_shard", _strategies_on_gpu),
    ("05", "block compute and all-gather timers", _overlap_timers_on_gpu),
    ("05b", "rehearsal against real shards", _bridge_on_gpu),
    ("06", "kill, restart, resume from a checkpoint", _resume_on_gpu),
)


def notebook_rows(names, parameters: dict, deadline: float) -> dict:
    """Execute notebooks (papermill) while time is left; per notebook its result and launches by backend."""
    import papermill

    out_dir = ROOT / "build" / "gpu-check" / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            if names and path.stem[:2] not in names:
                continue
            if time.monotonic() > deadline:
                skipped.append(path.stem)
                continue
            rows.append(_execute(papermill, path, out_dir, Path(tmp) / f"{path.stem}.log", parameters))
    return {"parameters": parameters, "rows": rows, "skipped": skipped}


def _execute(papermill, path: Path, out_dir: Path, log: Path, parameters: dict) -> dict:
    os.environ.update(COURSE_HEADLESS="1", COURSE_LAUNCH_LOG=str(log))
    t0, error = time.perf_counter(), None
    try:
        papermill.execute_notebook(
            str(path),
            str(out_dir / path.name),
            parameters=parameters,
            cwd=str(path.parent),
            kernel_name="python3",
            progress_bar=False,
            log_output=False,
        )
    except Exception as exc:  # reported in the table; the next notebook still runs
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
    finally:
        os.environ.pop("COURSE_LAUNCH_LOG", None)
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "notebook": path.stem,
        "wall_s": time.perf_counter() - t0,
        "error": error,
        "nccl": sum(r.get("backend") == "nccl" for r in launches),
        "gloo": sum(r.get("backend") == "gloo" for r in launches),
    }


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks", help="folder for gpu.md and gpu.json")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting sections after this long")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per step of the 1B run")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    return parser.parse_args(argv)


def plan_sections(args, gpus: int, deadline: float, results: dict) -> list[tuple[str, object]]:
    """``[(name, zero-argument function)]`` in order, for this machine and these options. The 1B
    section reads the peak the matmul section has put into ``results`` by then."""
    last_start = deadline - 45  # a notebook started later could end past the budget
    table = {
        "device": device_section,
        "matmul_peak": matmul_peak_section,
        "fsdp_1b": lambda: fsdp_1b_section((results.get("matmul_peak") or {}).get("flops"), args.micro_batch),
        "train_1gpu": train_1gpu_section,
        "single_process": single_process_section,
        "nccl_2rank": lambda: notebook_rows(("02", "03", "04"), {"NPROC": 2}, last_start),
        "notebooks": lambda: notebook_rows((), {}, last_start),
    }
    chosen = [s for s in SECTIONS if not args.only or s in args.only.split(",")]
    if gpus < 2 and "nccl_2rank" in chosen:
        results["nccl_2rank"] = {"not_run": f"{gpus} GPU here; the 2-rank NCCL runs need two or more"}
        chosen.remove("nccl_2rank")
    return [(name, table[name]) for name in chosen]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    results = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "budget_s": args.budget_s}}
    for name, fn in plan_sections(args, torch.cuda.device_count(), deadline, results):
        left = deadline - time.monotonic()
        if left < NEEDS_S.get(name, 0):
            results[name] = {"not_run": f"time budget: {left:.0f} s left of {args.budget_s:.0f} s"}
            continue
        run_section(name, fn, results, args.out)
    results["meta"].update(
        finished=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), total_s=time.monotonic() - start
    )
    write_report(results, args.out)
    print(f"==> wrote {args.out / 'gpu.md'} and gpu.json in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
