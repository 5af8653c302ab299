"""The rehearsal's command line: ``python -m course_utils rehearse`` (notebook 05b)."""

from __future__ import annotations

import argparse
import json

from ..presets import PRESETS
from ..strategies import FSDP_STRATEGIES
from ..validate import not_empty
from .calibration import planner_terms
from .predictions import compare, predict
from .run import PRECISIONS, model_config, rehearse
from .views import UNITS, format_report

# ---------------------------------------------------------------------------------------------
# Command line: python -m course_utils rehearse
# ---------------------------------------------------------------------------------------------


def rehearse_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m course_utils rehearse`` (notebook 05b)."""
    parser.add_argument(
        "--params",
        default=None,
        help=f"a preset: {', '.join(PRESETS)} (default 6.7B, Llama 2 7B), or a course model (tiny, small, "
        "medium); the shape flags below override its fields",
    )
    for name, what in (
        ("layers", "transformer blocks L"),
        ("width", "hidden size h"),
        ("heads", "attention heads (must divide --width)"),
        ("vocab", "vocabulary"),
        ("seq", "tokens per sequence"),
    ):
        parser.add_argument(f"--{name}", type=int, default=None, help=what)
    parser.add_argument("--nproc", type=int, default=8, help="ranks (GPUs) to rehearse, 1 to 1024 (default 8)")
    parser.add_argument(
        "--strategy", default="full_shard", choices=FSDP_STRATEGIES, help="FSDP strategy (default full_shard)"
    )
    parser.add_argument(
        "--node-size", type=int, default=8, help="ranks per node: hybrid_shard's shard group (default 8)"
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--act-ckpt", action="store_true", help="activation checkpointing on every block")
    parser.add_argument(
        "--recompute", default="none", help="a recomputation policy: none, full, selective or every:K (default none)"
    )
    parser.add_argument(
        "--mixed-precision",
        default="bf16",
        choices=PRECISIONS,
        help="bf16 compute with fp32 reduce and fp32 shards (default), or fp32 throughout",
    )
    parser.add_argument(
        "--unit",
        default="GB",
        choices=tuple(UNITS),
        help="GB = 10^9 bytes (default), GiB = 2^30, MB = 10^6 (for small models)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def rehearse_command(args) -> int:
    """Run one rehearsal from the command line; bad input raises CourseInputError (exit 2) (notebook 05b)."""
    not_empty("--params", args.params)  # '' is a typo, not the 6.7B default
    cfg = model_config(
        args.params or "6.7B", layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq
    )
    r = rehearse(
        cfg,
        args.nproc,
        args.strategy,
        node_size=args.node_size,
        micro_batch=args.micro_batch,
        act_ckpt=args.act_ckpt,
        mixed_precision=args.mixed_precision,
        recompute=args.recompute,
    )
    if args.json:
        out = r.to_dict()
        out["prediction"] = {k: v for k, v in predict(r).items()}
        out["comparison"] = compare(r)
        out["calibrated"] = planner_terms(r, "cpu")
        print(json.dumps(out, default=float))
    else:
        print(format_report(r, compare(r), args.unit, calibrated=planner_terms(r, "cpu")))
    return 0
