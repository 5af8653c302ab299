"""Static pictures of the course: matplotlib figures drawn from numbers the arithmetic modules
compute (introduced in notebook 01).

Each ``*_figure`` function takes plain numbers (a "view" dict from ``memory``/``plan``) and
returns a ``matplotlib.figure.Figure``; it computes nothing the chart asserts. ``show(fig)``
puts a figure into a notebook as a PNG image; ``png(fig)`` returns the bytes (the widgets use
them too, so a live widget and a headless run draw exactly the same picture).

pyplot is never used: figures are built on the Agg canvas directly, so nothing here depends
on the notebook's plotting backend or leaves global state behind.

The door to the rooms, one per kind of picture: ``plots.base`` (figures, PNG, tables, colours),
``plots.memory_views`` (notebooks 01, 03), ``plots.ddp_views`` (02), ``plots.zero_views`` (03),
``plots.fsdp_views`` (04), ``plots.timeline_views`` (03, 04: one step, operation by operation),
``plots.plan_views`` (05), ``plots.recovery_views`` (06). The package's own modules import the rooms.
"""

from __future__ import annotations

from .base import (
    MIN_TEXT_PX,
    PART_COLORS,
    SHOW_SCALE,
    STAGE_COLORS,
    StaticFigure,
    min_text_px,
    new_figure,
    png,
    show,
    show_table,
    table_markdown,
)
from .ddp_views import bucket_cost_figure, bucket_sweep_figure, ddp_timelines_figure
from .fsdp_views import (
    COMM_COLORS,
    FSDP_COLUMNS,
    _bytes_cell,
    bit_identity_table,
    fsdp_side_by_side_figure,
    fsdp_side_by_side_table,
    fsdp_table,
    layouts_figure,
    step_time_cell,
)
from .memory_views import (
    activations_figure,
    bill_bars_figure,
    gpt2_bill_figure,
    measured_memory_figure,
    memory_chart_figure,
)
from .plan_views import backward_timeline_figure, crossover_figure, plan_figure
from .recovery_views import checkpoint_interval_figure, lost_work_figure, sync_vs_diloco_figure
from .timeline_views import TIMELINE_COLORS, timelines_figure
from .zero_views import TRAFFIC_COLORS, calls_cell, zero3_schedule_figure, zero3_schedule_frames

__all__ = [
    "layouts_figure",
    "TIMELINE_COLORS",
    "timelines_figure",
    "calls_cell",
    "MIN_TEXT_PX",
    "min_text_px",
    "TRAFFIC_COLORS",
    "PART_COLORS",
    "SHOW_SCALE",
    "STAGE_COLORS",
    "StaticFigure",
    "new_figure",
    "png",
    "show",
    "show_table",
    "table_markdown",
    "activations_figure",
    "bill_bars_figure",
    "gpt2_bill_figure",
    "measured_memory_figure",
    "memory_chart_figure",
    "bucket_sweep_figure",
    "bucket_cost_figure",
    "ddp_timelines_figure",
    "zero3_schedule_figure",
    "zero3_schedule_frames",
    "COMM_COLORS",
    "FSDP_COLUMNS",
    "_bytes_cell",
    "bit_identity_table",
    "fsdp_side_by_side_figure",
    "fsdp_side_by_side_table",
    "fsdp_table",
    "step_time_cell",
    "backward_timeline_figure",
    "crossover_figure",
    "plan_figure",
    "checkpoint_interval_figure",
    "lost_work_figure",
    "sync_vs_diloco_figure",
]
