"""Memory: the 16-byte bill and the three ZeRO stages (introduced in notebook 01).

The door to four rooms, so that ``from course_utils import memory; memory.model_state_bytes(...)``
reads as it always did:

- ``memory.bill``: the formulas (the paper's table, floors, activations, the headline sums), read
  from the strategy record; no torch, no processes;
- ``memory.chart``: what notebook 01's chart and bars show, as plain numbers;
- ``memory.cli``: ``python -m course_utils memory`` and ``python -m course_utils table``;
- ``memory.measure``: the same bill counted on real tensors (one step of the course's loop).

The package's own modules import the rooms, never this door.
"""

from __future__ import annotations

from .bill import (
    ACTIVATION_BYTES_PER_NUMBER,
    ACTIVATION_NUMBERS_PER_TOKEN_PER_WIDTH,
    ADAM_MIXED_K,
    GRAD_BYTES,
    OPTIMIZERS,
    STAGE_NAMES,
    STAGES,
    WEIGHT_BYTES,
    OptimizerBill,
    activation_bytes,
    activation_bytes_korthikanti,
    activation_numbers,
    bytes_per_gpu,
    floor_bytes,
    formula_text,
    fused_gradient_buffer_bytes,
    model_state_bytes,
    optimizer_bill,
    paper_agrees,
    per_parameter,
    smallest_nd_that_fits,
    whole_tensor_partition,
    zero_r_and_headlines,
)
from .chart import (
    BILL_PARTS,
    GPU_CHOICES,
    MODEL_PRESETS,
    TABLE1_ND,
    TABLE1_PARAMS,
    activation_view,
    bill_bars,
    chart_nds,
    chart_title,
    gpt2_bill_view,
    memory_chart_view,
    readout_text,
    table1,
)
from .cli import gb_cell, memory_arguments, memory_command, table_arguments, table_command
from .measure import (
    MixedPrecisionAdam,
    checkpointed_blocks,
    compare_activations,
    measure_activation_bytes,
    measure_model_state_bytes,
    measured_bill,
)

__all__ = [
    "ACTIVATION_BYTES_PER_NUMBER",
    "ACTIVATION_NUMBERS_PER_TOKEN_PER_WIDTH",
    "ADAM_MIXED_K",
    "GRAD_BYTES",
    "OPTIMIZERS",
    "STAGE_NAMES",
    "STAGES",
    "WEIGHT_BYTES",
    "OptimizerBill",
    "activation_bytes",
    "activation_bytes_korthikanti",
    "activation_numbers",
    "bytes_per_gpu",
    "floor_bytes",
    "formula_text",
    "fused_gradient_buffer_bytes",
    "model_state_bytes",
    "optimizer_bill",
    "per_parameter",
    "smallest_nd_that_fits",
    "paper_agrees",
    "whole_tensor_partition",
    "zero_r_and_headlines",
    "BILL_PARTS",
    "GPU_CHOICES",
    "MODEL_PRESETS",
    "TABLE1_ND",
    "TABLE1_PARAMS",
    "activation_view",
    "bill_bars",
    "gpt2_bill_view",
    "chart_nds",
    "chart_title",
    "memory_chart_view",
    "readout_text",
    "table1",
    "gb_cell",
    "memory_arguments",
    "memory_command",
    "table_arguments",
    "table_command",
    "MixedPrecisionAdam",
    "checkpointed_blocks",
    "compare_activations",
    "measure_activation_bytes",
    "measure_model_state_bytes",
    "measured_bill",
]
