"""What each strategy should hold and send: the course's predictions, in one place (notebooks 03, 04; README).

Every run the course makes is held against a number computed here before it starts. Symbols
follow the ZeRO paper: Ψ parameters, Nd ranks one piece of state is split across (the record's
``strategies.shard_group_size``), K optimizer bytes per parameter.

- Bytes held per rank: ``bill_bytes`` (a row's bill, part by part, optionally with the padded shard
  a run really has) and ``strategy_held_bytes`` (the same at rest with the row's Nd for N ranks);
  ``step_counter_bytes`` (Adam's 0-dim step counters, which a run holds and the paper does not count).
  ``memory.model_state_bytes`` is the vectorised total notebook 01 plots; ``tests/test_predict.py``
  checks the two agree.
- Bytes sent per step: ``paper_sent_bytes`` (the paper's ring formulas, ``comm.step_sent``, no
  padding); ``zero_traffic`` and ``fsdp_collectives`` (collective by collective, from the flat
  buffers or units a run builds, in the ring model that ``instrument.CommCounter`` counts with).
- Peaks: ``peak_gathered_bytes`` (the working set of gathered parameters: ZeRO-3 by hand and
  FSDP2's schedules); ``samples_that_fit`` (what the freed memory buys).
- Units: ``planned_units`` (``unit_table`` of the course model before a process starts).
- One run, one strategy: ``fsdp_run`` (notebook 04's prediction), ``expected_bytes`` (the
  benchmark's theory table).
- Checks: ``memory_check``, ``traffic_check`` (a ZeRO report against the formulas, notebook 03)
  and ``comm_matches`` (an FSDP run's collectives against ``fsdp_collectives``, notebook 04).

The door to four rooms: ``predict.held`` (what a rank holds), ``predict.sent`` (what it sends),
``predict.runs`` (one run's prediction, and its report checked against the formulas),
``predict.timeline`` (what a step's memory timeline must show: each category at rest, the peaks the
schedule decides; notebooks 03, 04). The package's
own modules import the rooms.

Pure arithmetic: no ``torch.distributed``, no processes (``tests/test_layers.py`` checks). Every
function reads a strategy's row of the record (what it shards, over which group, which collectives
it issues, its layout), never its name; a name is looked up once, on the way in. The strategy
modules (``zero``, ``fsdp``) hold the mechanism; they report what they built (``strategy_info``)
and these functions say what that should cost.
"""

from __future__ import annotations

from ..models import unit_table
from .held import (
    ADAM_SCRATCH_FP32_COPIES,
    PRECISION_BYTES,
    bill_bytes,
    bill_precision,
    peak_gathered_bytes,
    samples_that_fit,
    step_counter_bytes,
    strategy_held_bytes,
    update_extra_bytes,
)
from .runs import (
    comm_matches,
    expected_bytes,
    fsdp_run,
    memory_check,
    model_tensors,
    peak_check,
    planned_units,
    traffic_check,
)
from .sent import fsdp_collectives, paper_sent_bytes, traffic_in_psi, zero_traffic
from .timeline import (
    backend_clones,
    bucket_and_gradients_states_peak,
    bucket_buffers_peak,
    bucket_reduce_states,
    bucket_reduce_states_peak,
    forward_end_states,
    full_gradients_states_peak,
    kept_all_gather_outputs,
    reduce_at_step_states_peak,
    rest_bytes,
    rest_check,
    unit_reduce_states,
    unit_reduce_states_peak,
)

__all__ = [
    "bucket_buffers_peak",
    "bucket_reduce_states",
    "bucket_reduce_states_peak",
    "forward_end_states",
    "full_gradients_states_peak",
    "kept_all_gather_outputs",
    "backend_clones",
    "reduce_at_step_states_peak",
    "bucket_and_gradients_states_peak",
    "rest_bytes",
    "rest_check",
    "unit_reduce_states",
    "unit_reduce_states_peak",
    "ADAM_SCRATCH_FP32_COPIES",
    "PRECISION_BYTES",
    "bill_bytes",
    "bill_precision",
    "peak_gathered_bytes",
    "samples_that_fit",
    "step_counter_bytes",
    "strategy_held_bytes",
    "update_extra_bytes",
    "comm_matches",
    "expected_bytes",
    "fsdp_run",
    "memory_check",
    "model_tensors",
    "peak_check",
    "planned_units",
    "traffic_check",
    "fsdp_collectives",
    "paper_sent_bytes",
    "traffic_in_psi",
    "zero_traffic",
    "unit_table",
]
