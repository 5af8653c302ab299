"""ZeRO stages 1, 2 and 3 built by hand from torch.distributed collectives (introduced in notebook 03).

Symbols follow the ZeRO paper (Rajbhandari et al., 2019): Ψ parameters, Nd data-parallel
ranks, K optimizer bytes per parameter. Every stage rests on one idea, ``FlatParams``: some
parameters laid end to end in one flat buffer, padded with zeros to Nd·S elements, so that
rank r owns the contiguous slice [r·S, (r+1)·S). Padding is the only thing that is not a
parameter; every function here counts it.

- Stage 1, P_os (``ShardedOptimizer``): wraps any element-wise ``torch.optim`` optimizer.
  Gradients are reduce-scattered so each rank gets the average of its own slice (the first
  half of an all-reduce: nobody needs the other slices' sums), the inner optimizer updates that
  slice with state for that slice only, and an all-gather shares the new weights.
- Stage 2, P_os+g (``GradShardedOptimizer``): the same, but the flat buffers are gradient
  buckets, reduce-scattered from a backward hook as soon as the backward has produced all of a
  bucket's gradients; the full gradients are then dropped, so a rank keeps only its slice.
- Stage 3, P_os+g+p (``Zero3Module`` + ``Zero3Optimizer``): each unit (a transformer block,
  and the root for everything else) keeps only its slice at rest; the unit is all-gathered just
  before its forward and freed after, gathered again just before its backward, and its gradients
  are reduce-scattered to their owners as soon as the unit's backward is done.

Mixed precision is the paper's: pass ``compute_dtype=torch.bfloat16`` and the working weights
and gradients are 16-bit (and so is every collective) while the optimizer keeps fp32 master
weights (and Adam its fp32 momentum and variance) for the rank's slice only.

The rooms: ``zero.flat`` (the flat layout and its padding, ``FlatParams``), ``zero.stages`` (stages 1
and 2: a sharded optimizer), ``zero.stage3`` (stage 3: a module sharded at rest). The record's rows
``zero1``, ``zero2``, ``zero3`` (``course_utils.strategies``) plug them into the training loop
(``python -m course_utils train --strategy zero1|zero2|zero3``). The paper's formulas with the
exact padding and (N-1)/N factors that the notebook asserts the real runs against
(``bill_bytes``, ``zero_traffic``, ``memory_check``, ``traffic_check``, ...) are
``course_utils.predict``.
"""

from __future__ import annotations

from .flat import FlatParams, all_gather_single, newest_collective, padded_numel, reduce_scatter_single, shard_bounds
from .stage3 import GatheredBytes, Unit, Zero3Module, Zero3Optimizer, assign_units
from .stages import GradShardedOptimizer, ShardedOptimizer, gradient_buckets

__all__ = [
    "newest_collective",
    "all_gather_single",
    "reduce_scatter_single",
    "padded_numel",
    "shard_bounds",
    "FlatParams",
    "gradient_buckets",
    "ShardedOptimizer",
    "GradShardedOptimizer",
    "GatheredBytes",
    "Unit",
    "assign_units",
    "Zero3Module",
    "Zero3Optimizer",
]
