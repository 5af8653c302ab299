"""Choosing a data-parallel strategy: memory, overlap and networks (introduced in notebook 05).

The decision rule of the course (the lesson on the stages, and the ZeRO paper's §5 and §7):

1. Compute what each strategy needs per GPU: model states (``memory.model_state_bytes``),
   activations (the paper's 12·h·b·s·L rule; sharding never touches them) and buffers
   (communication buckets, or the gathered block of stage 3).
2. Pick the lowest-numbered stage that fits with headroom: plain DP, then stage 1, then 2.
3. Stage 3 (or HSDP: stage 3 inside a node, replicas across nodes) only when nothing lower
   fits; its extra all-gathers (3Ψ instead of 2Ψ per step) are free only when they hide
   behind each block's compute.
4. Offload (optimizer state in host memory) makes an impossible run fit. Its price is the CPU's
   optimizer step, not PCIe, paid once per optimizer step: heavy at one micro-batch a step, spread
   thin by gradient accumulation. Each library offloads something else
   (``offload_modes``: DeepSpeed's ZeRO-Offload and ZeRO-3 ``offload_optimizer``, FSDP2's
   ``CPUOffloadPolicy``, ZeRO-Infinity's NVMe).
5. If even that does not fit, the limit is not the model states: activations, or a single
   layer that must be gathered whole on one GPU. No data-parallel strategy helps then.

Symbols: Ψ parameters, K optimizer bytes per parameter, Nd data-parallel degree, Nm
model-parallel degree; h width, L layers, s sequence length, b micro-batch per GPU.

Everything here is arithmetic on the inputs: it starts no process (the run that measures this
host's rates, ``labs.lab05.block_overlap_worker``, lives with notebook 05's experiments). Every
strategy is a row of the record (``course_utils.strategies``): the planner prices what a row shards,
offloads and sends, never its name, so it weighs rows the training loop cannot run.

The throughput planner (the question a person planning a run asks): ``plan.shapes`` (a preset's shape, the GPUs),
``plan.activations`` (what a block keeps per architecture and recomputation policy, with the logits and the loss),
``plan.implementations`` (DDP, ZeroRedundancyOptimizer, ``fully_shard`` and DeepSpeed's stages, each priced as it
holds and sends; ``plan.deepspeed3`` replays stage 3's gathers and releases module by module), ``plan.throughput``
(one configuration's peak and step time, term by term), ``plan.search`` (implementation x policy x micro-batch x
accumulation x nodes x HSDP shard x offload: the most tokens per second per GPU that fits) and ``plan.report``
(the table within 100 columns).

The memory-and-overlap plan of the first sections, and the door to its rooms:
``plan.inputs`` (the model and the cluster), ``plan.network`` (collectives
and compute as time), ``plan.price`` (one strategy's memory, overlap and step time), ``plan.offload``
(each library's offload), ``plan.choose`` (the plan and its recommendation), ``plan.cli`` (``python
-m course_utils plan``) and ``plan.hostfit`` (this host's rates, fitted). The package's own modules
import the rooms.

A time model is a model: per-GPU FLOP/s you can actually reach, ring collectives whose speed
is that of the slowest link they cross, overlap as "hidden if shorter than the compute beside
it". Good enough to see which side of a crossover a run sits on, not to predict seconds.
"""

from __future__ import annotations

from .activations import POLICIES, activation_terms, block_saved_bytes, block_selective_bytes, head_bytes
from .choose import NOTHING_FITS, OVERLAP_TOKENS, STRATEGIES, STRATEGY_NAMES, TIE_MARGIN, Plan, StrategyPlan, plan
from .cli import format_plan, parse_bandwidth, plan_arguments, plan_command, search_from_args
from .hostfit import (
    bucket_cap_closed_form,
    bucket_cap_model,
    bucket_step_time,
    fit_latency_bandwidth,
    gpu_bucket_caps,
    host_fit,
    line_s,
    tensor_backward_caps,
)
from .implementations import BY_KEY, IMPLS, Impl
from .inputs import DEFAULT_GPU, HEAD_DIM, WIDTH_STEP, Cluster, ModelSpec, model_spec, shape_block_params, shape_params
from .network import (
    NETWORK_CLASSES,
    block_flops,
    bubble_fraction,
    crossover_bandwidth,
    exposed_comm,
    network_class,
    network_step,
    overlap_curve,
    overlap_ratio,
    ring_time,
    training_days,
)
from .offload import OFFLOAD_MODES, OFFLOAD_NAMES, offload_modes
from .price import (
    BUCKET_BYTES,
    applicable,
    block_overlap,
    compute_time,
    hsdp_shard_sizes,
    limits,
    memory_breakdown,
    step_time,
)
from .report import format_search
from .search import MICRO_BATCHES, TIE, hsdp_shards, search, typed
from .shapes import GPU, GPUS, MFU_SOURCE, GPUCluster, Shape, shape_for, shape_of_config, shape_of_preset
from .throughput import Config, evaluate

__all__ = [
    "POLICIES",
    "activation_terms",
    "block_saved_bytes",
    "block_selective_bytes",
    "head_bytes",
    "search_from_args",
    "BY_KEY",
    "IMPLS",
    "Impl",
    "format_search",
    "MICRO_BATCHES",
    "TIE",
    "hsdp_shards",
    "search",
    "typed",
    "GPUS",
    "MFU_SOURCE",
    "GPU",
    "GPUCluster",
    "Shape",
    "shape_for",
    "shape_of_config",
    "shape_of_preset",
    "Config",
    "evaluate",
    "DEFAULT_GPU",
    "HEAD_DIM",
    "WIDTH_STEP",
    "Cluster",
    "ModelSpec",
    "model_spec",
    "shape_block_params",
    "shape_params",
    "NETWORK_CLASSES",
    "block_flops",
    "bubble_fraction",
    "crossover_bandwidth",
    "exposed_comm",
    "network_class",
    "network_step",
    "overlap_curve",
    "overlap_ratio",
    "ring_time",
    "training_days",
    "BUCKET_BYTES",
    "applicable",
    "block_overlap",
    "compute_time",
    "hsdp_shard_sizes",
    "limits",
    "memory_breakdown",
    "step_time",
    "OFFLOAD_MODES",
    "OFFLOAD_NAMES",
    "offload_modes",
    "NOTHING_FITS",
    "OVERLAP_TOKENS",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "TIE_MARGIN",
    "Plan",
    "StrategyPlan",
    "plan",
    "format_plan",
    "parse_bandwidth",
    "plan_arguments",
    "plan_command",
    "fit_latency_bandwidth",
    "host_fit",
    "line_s",
    "bucket_step_time",
    "bucket_cap_model",
    "tensor_backward_caps",
    "bucket_cap_closed_form",
    "gpu_bucket_caps",
]
