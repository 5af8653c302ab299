"""Dress rehearsal: a real-size FSDP2 step on fake tensors, peak memory per GPU (introduced in notebook 05b).

The formulas of notebook 01 answer "will my 7B fit on 8 GPUs?" on paper. PyTorch can answer
with the library people train with: ``fully_shard`` (FSDP2) applied to the real-size model
under ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no storage), joined to
the ``"fake"`` process group at the target world size (collectives that move nothing), and
watched by ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which sorts every
byte a rank would hold into categories. One optimizer step of a 7B model on 8 ranks takes
seconds on a laptop CPU and allocates nothing real.

FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD are FSDP1's names; in FSDP2 they are a
mesh shape and ``reshard_after_forward``, read from the strategy record (``course_utils.strategies``):

==============  ==========================  =====================  ==========
strategy        mesh                        reshard_after_forward  ZeRO row
==============  ==========================  =====================  ==========
full_shard      (N,)                        True                   zero3
shard_grad_op   (N,)                        False                  zero2 (*)
no_shard        (N, 1) replicate x shard    False                  ddp
hybrid_shard    (N/node, node)              True                   zero3 in a node
==============  ==========================  =====================  ==========

(*) FSDP2 keeps the fp32 parameters sharded at rest even here; what SHARD_GRAD_OP keeps
unsharded, between forward and backward, is the bf16 working copy: the 2Ψ of ZeRO stage 2.

The door to the rooms: ``rehearse.run`` (the rehearsal: one step of the course's loop on fake ranks,
``rehearse``; the published shapes are ``course_utils.presets``), ``rehearse.tracker`` (torch's
``FSDPMemTracker``, feature-detected and made cheaper: same records, half the time, a test holds it
against the stock class), ``rehearse.predictions`` (the planner's side of each setting, and how
closely the two agree), ``rehearse.views`` (tables and charts of numbers the others computed) and
``rehearse.cli`` (``python -m course_utils rehearse``); ``rehearse.recompute`` (the planner's recomputation
policies, applied before ``fully_shard``) and ``rehearse.calibration`` (the throughput planner against the
rehearsal, term by term, before and after calibration, with the CPU kernels' share). The package's own modules import the rooms.

``labs.lab05b.bridge`` holds the rehearsal against a real run: the same wrapping on 2 or 4 gloo ranks of
the tiny course model, bytes counted on the real shards with ``instrument.tensor_bytes``.
"""

from __future__ import annotations

from ..presets import ALIASES, NOT_THEIR_SIZE, PRESETS, GPTConfig, Preset, preset
from .calibration import (
    TERMS,
    calibration_rows,
    measured_terms,
    planned_peak,
    planner_moments,
    planner_terms,
    preset_calibration,
    summary_rows,
)
from .cli import rehearse_arguments, rehearse_command
from .predictions import (
    BLOCK_SAVED_PER_TOKEN_WIDTH,
    CALIBRATED_TOL,
    MODEL_STATE_TOL,
    PEAK_ITEMS,
    PEAK_MAX_ACT_SHARE,
    PEAK_MIN_LAYERS,
    PEAK_TOL,
    agreement,
    compare,
    kept_beyond_rule,
    optimizer_bill_for,
    peak_errors,
    predict,
    predict_setting,
)
from .recompute import check_policy, wrap_blocks
from .run import (
    MAX_NPROC,
    PRECISIONS,
    Rehearsal,
    apply_options,
    check_setting,
    gathered_unit_bytes,
    make_optimizer,
    model_config,
    padded_shard_numel,
    param_count,
    param_tensor_count,
    parse_setting,
    rehearse,
    rehearse_settings,
    short_label,
    short_size,
    start_rehearsals,
)
from .tracker import (
    CATEGORIES,
    PART_COLORS,
    PARTS,
    PINNED_TORCH,
    TrackedStep,
    require_tracker,
    tracker_class,
    tracker_problem,
)
from .views import (
    UNITS,
    agreement_figure,
    bars_view,
    format_report,
    markdown_bridge,
    markdown_bridge_peaks,
    markdown_compare,
    markdown_summary,
    markdown_table,
    rehearsal_figure,
    usable,
    usable_words,
)

__all__ = [
    "TERMS",
    "calibration_rows",
    "preset_calibration",
    "measured_terms",
    "planner_moments",
    "planner_terms",
    "planned_peak",
    "check_policy",
    "wrap_blocks",
    "CATEGORIES",
    "PART_COLORS",
    "PARTS",
    "PINNED_TORCH",
    "TrackedStep",
    "require_tracker",
    "tracker_class",
    "tracker_problem",
    "MAX_NPROC",
    "PRECISIONS",
    "Rehearsal",
    "apply_options",
    "check_setting",
    "gathered_unit_bytes",
    "make_optimizer",
    "model_config",
    "padded_shard_numel",
    "param_count",
    "param_tensor_count",
    "parse_setting",
    "rehearse",
    "rehearse_settings",
    "short_label",
    "short_size",
    "start_rehearsals",
    "BLOCK_SAVED_PER_TOKEN_WIDTH",
    "MODEL_STATE_TOL",
    "PEAK_ITEMS",
    "PEAK_MAX_ACT_SHARE",
    "PEAK_MIN_LAYERS",
    "CALIBRATED_TOL",
    "PEAK_TOL",
    "agreement",
    "compare",
    "kept_beyond_rule",
    "optimizer_bill_for",
    "peak_errors",
    "predict",
    "predict_setting",
    "summary_rows",
    "UNITS",
    "agreement_figure",
    "bars_view",
    "usable",
    "usable_words",
    "format_report",
    "markdown_bridge",
    "markdown_bridge_peaks",
    "markdown_compare",
    "markdown_summary",
    "markdown_table",
    "rehearsal_figure",
    "rehearse_arguments",
    "rehearse_command",
    "ALIASES",
    "NOT_THEIR_SIZE",
    "PRESETS",
    "GPTConfig",
    "Preset",
    "preset",
]
