"""The command line of the memory arithmetic: ``python -m course_utils memory`` and ``table`` (notebook 01).

A thin shell over ``memory.bill`` and ``memory.chart``: the same numbers the notebook shows.
"""

from __future__ import annotations

import argparse
import json
import math

from ..errors import CourseInputError
from ..units import GB, GiB, fmt_count, parse_bytes
from ..validate import check_numbers, finite_result, params_count
from .bill import ADAM_MIXED_K, STAGE_NAMES, STAGES, model_state_bytes
from .chart import table1

# ---------------------------------------------------------------------------------------------
# 2. Command line: `python -m course_utils memory` and `python -m course_utils table`
# ---------------------------------------------------------------------------------------------


def _positive_int(name: str, value: int) -> int:
    if value < 1:
        raise CourseInputError(f"{name} must be a whole number >= 1, got {value}")
    return value


def memory_arguments(parser) -> None:
    """Arguments of ``python -m course_utils memory`` (notebook 01)."""
    parser.add_argument("--params", required=True, help="Ψ: parameter count, e.g. 7.5e9, 7.5B, 350M, 1T")
    parser.add_argument("--dp", type=int, default=1, help="Nd: data-parallel degree (default 1)")
    parser.add_argument("--mp", type=int, default=1, help="Nm: model-parallel degree (default 1)")
    parser.add_argument(
        "--k",
        type=float,
        default=ADAM_MIXED_K,
        help="K: optimizer bytes per parameter (default 12, mixed-precision Adam)",
    )
    parser.add_argument("--stage", default=None, help="print only this row: ddp, zero1, zero2 or zero3")
    parser.add_argument("--json", action="store_true", help="print one JSON object (values in bytes)")


def memory_command(args) -> int:
    """Print the per-GPU model-state bytes of plain DP and stages 1-3 (notebook 01)."""
    psi = params_count("--params", args.params)
    nd = _positive_int("--dp (Nd)", args.dp)
    nm = _positive_int("--mp (Nm)", args.mp)
    if not math.isfinite(args.k) or args.k < 0:
        raise CourseInputError(f"--k must be a number of bytes >= 0, got {args.k:g}")
    if args.stage is not None and args.stage not in STAGES:
        raise CourseInputError(f"--stage: unknown stage {args.stage!r}; choose one of {', '.join(STAGES)}")
    stages = STAGES if args.stage is None else (args.stage,)
    rows = {s: finite_result("model-state bytes", model_state_bytes(psi, nd, s, k=args.k, nm=nm)) for s in stages}
    if args.json:
        print(json.dumps({"params": psi, "dp": nd, "mp": nm, "k": args.k, "bytes_per_gpu": rows}))
        return 0
    print(f"Model-state bytes per GPU: Ψ = {fmt_count(psi)} parameters, Nd = {nd}, Nm = {nm}, K = {args.k:g}")
    print(f"{'row':<20} {'bytes':>22} {'GB (10^9)':>12} {'GiB (2^30)':>12}")
    for s, v in rows.items():
        print(f"{STAGE_NAMES[s]:<20} {v:>22,.0f} {v / GB:>12.3f} {v / GiB:>12.3f}")
    return 0


def gb_cell(n_bytes: float) -> str:
    """Bytes as GB the way the paper's Table 1 prints them: three significant digits, halves
    rounded up, no exponent (41.25 → "41.3", 2,048 → "2048", 0.1172 → "0.117") (notebook 01)."""
    from decimal import ROUND_HALF_UP, Decimal

    d = Decimal(repr(n_bytes / GB))
    if d == 0:
        return "0"
    digits = max(0, 3 - (d.adjusted() + 1))
    return f"{d.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP):f}"


def table_arguments(parser) -> None:
    """Arguments of ``python -m course_utils table`` (notebook 01)."""
    parser.add_argument(
        "--params", default="7.5B,128B,1T", help="comma-separated model sizes (default: the paper's 7.5B,128B,1T)"
    )
    parser.add_argument(
        "--dp", default="1,4,16,64,256,1024", help="comma-separated Nd values (default: the paper's 1,4,16,64,256,1024)"
    )
    parser.add_argument(
        "--gpu-mem",
        default="32GB",
        help="GPU memory to mark what fits, e.g. 32GB, 80GB, 24GiB (default 32GB, the paper's V100)",
    )
    parser.add_argument("--k", type=float, default=ADAM_MIXED_K, help="K: optimizer bytes per parameter (default 12)")
    parser.add_argument("--mp", type=int, default=1, help="Nm: model-parallel degree (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (values in bytes)")


def table_command(args) -> int:
    """Print the paper's Table 1 grid in GB and mark the cells that fit one GPU (notebook 01)."""
    params = [params_count("--params", p) for p in str(args.params).split(",")]
    try:
        nds = [int(x) for x in str(args.dp).split(",")]
    except ValueError:
        raise CourseInputError(f"--dp: cannot read {args.dp!r}; write whole numbers like 1,4,16,64") from None
    check_numbers(argparse.Namespace(dp=nds))
    for nd in nds:
        _positive_int("--dp (Nd)", nd)
    nm = _positive_int("--mp (Nm)", args.mp)
    if not math.isfinite(args.k) or args.k < 0:
        raise CourseInputError(f"--k must be a number of bytes >= 0, got {args.k:g}")
    gpu_mem = parse_bytes(args.gpu_mem, name="--gpu-mem")
    rows = table1(params, nds, gpu_mem=gpu_mem, k=args.k, nm=nm)
    for row in rows:
        for value in row["bytes_per_gpu"].values():
            finite_result("model-state bytes", value)
    if args.json:
        print(json.dumps({"gpu_mem": gpu_mem, "k": args.k, "mp": nm, "rows": rows}))
        return 0
    print(
        f"Model-state memory per GPU in GB (10^9 bytes), K = {args.k:g}, Nm = {nm}; * = fits a {gpu_mem / GB:g} GB GPU"
    )
    print(f"{'Ψ':>6} {'Nd':>6} " + " ".join(f"{STAGE_NAMES[s].split(' (')[0]:>10}" for s in STAGES))
    for row in rows:
        cells = [f"{gb_cell(row['bytes_per_gpu'][s]):>9}{'*' if row['fits'][s] else ' '}" for s in STAGES]
        print(f"{fmt_count(row['params']):>6} {row['nd']:>6} " + " ".join(cells))
    return 0
