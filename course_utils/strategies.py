"""The strategy record: every fact the course knows about a strategy, in one row (notebooks 02-05b).

One ``Strategy`` per strategy, the way torchtitan keeps one spec per model. A row says what the strategy
shards between steps and at the peak of a step (parameters, gradients, optimizer state), over which group
(Nd: all ranks, one node, or nobody), what it gathers per unit and when it reshards (``fully_shard``'s
``reshard_after_forward``, an integer included), which collectives it issues in every step, of what and
over which mesh dimension (``Collective``), what it moves to host memory, its apply function and its
optimizer wrapper (callables), its FSDP1 name, and what a user types for it in PyTorch and DeepSpeed.
The training loop, the predictions, the memory bill, the planner, the rehearsal, the checkpointer and
the views read these fields; none of them tests a strategy's name. Names exist for people: the command
line's ``--strategy``, a notebook's parameters, the keys of a report.

Adding a strategy is one row plus one apply function, registered where they are written
(``register``); ``tests/test_strategies.py`` adds one from a test module and finds it in the planner,
the predictions and a training run. A row may have no apply function: the planner and the predictions
price rows the loop cannot run here (the offload rows below; DeepSpeed's own stages next).

The types (``Strategy``, ``Collective``) and the registry are ``course_utils.strategy_spec``, re-exported
here: torchtitan's spec type in a small module. Why the rows live here, beside their apply functions
(``course_utils.apply``), and not in the mechanism modules as torchtitan registers its specs beside its
models: the arithmetic (``memory``, ``predict``, ``plan``) reads the rows, and ``python -m course_utils
memory`` and ``plan`` must start in a fraction of a second. The mechanism modules import torch (3-4 s of
CPU here); ``apply`` imports the mechanism only when a function is called. Measured (CPU seconds, mean of
6 runs): ``memory`` 0.34 s before this record held callables, 0.36 s after; ``plan`` 0.35 s before,
0.39 s after. The layering that follows, held by ``tests/test_layers.py`` (imports inside functions
counted): no string import paths (a row holds the function itself); no upward import and no
cycle (mechanism, then ``apply``, then this record, then the arithmetic); the arithmetic modules start
no process and import no ``torch.distributed``.

Two facts checked against torch 2.13's source, because older copies of them disagreed:

- NO_SHARD keeps its working copy from forward to backward (``reshard_after_forward=False``):
  FSDP1 reshards after forward only for FULL_SHARD and HYBRID_SHARD
  (``torch.distributed.fsdp._flat_param.RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES``), and torch's
  own FSDP2-based ``replicate`` passes no post-forward mesh (it never reshards).
- The shard group (Nd, what the bytes at rest divide by) is the size of the mesh's "shard"
  dimension: N for FULL_SHARD and the ZeRO stages, n for HYBRID_SHARD, 1 for NO_SHARD (an
  (N, 1) mesh: each rank's shard is the whole tensor) and for DDP.
"""

from __future__ import annotations

from . import apply as ap
from .strategy_spec import (  # noqa: F401 (the record's types and registry, read through this module)
    ALL,
    GRADS,
    NOTHING,
    OPTIM,
    PARAMS,
    PARTS,
    RECORD,
    STRATEGIES,
    Collective,
    Strategy,
    get,
    get_fsdp,
    mesh_shape,
    planned,
    register,
    runnable,
    shard_group_size,
    zero_table,
)


def _ag(over: str = "shard", when: str = "forward", per: str = "unit") -> Collective:
    return Collective("all_gather", "params", over, when, per)


def _rs(over: str = "shard", when: str = "backward", per: str = "unit", dtype: str = "compute") -> Collective:
    return Collective("reduce_scatter", "grads", over, when, per, dtype)


_FSDP_KNOBS = (
    ("api", ap.FSDP_APIS),
    ("wrap", ap.WRAPS),
    ("prefetch", ap.PREFETCH),
    ("offload", (False, True)),
)
_FSDP = dict(
    gathers_units=True,
    keeps_root=True,
    layout="per_parameter",
    mixed="gathered",
    apply=ap.apply_fsdp,
    describe=ap.describe_fsdp,
    observe=ap.watch_fsdp,
    knobs=_FSDP_KNOBS,
    builds_on_meta=True,
)
_FULL_SHARD_PYTORCH = "fully_shard(block) on every block, then fully_shard(model) (FSDP1: FULL_SHARD)"
_STAGE3_SENDS = (_ag(), _ag(when="backward"), _rs(dtype="fp32"))

SINGLE = Strategy(
    "single", "02", "one process (the reference)", mesh=(), apply=ap.apply_as_is, pytorch="a plain training loop"
)
DDP = Strategy(
    "ddp",
    "02",
    "plain DP (DDP, NO_SHARD)",
    collectives=(Collective("all_reduce", "grads", "replicate", "backward", "bucket", "fp32"),),
    apply=ap.apply_ddp,
    describe=ap.describe_ddp,
    pytorch="torch.nn.parallel.DistributedDataParallel (FSDP1's NO_SHARD is the same layout)",
    deepspeed='"zero_optimization": {"stage": 0}',
    paper="plain DP",
    planned=True,
    abbrev="DDP",
    color="#444444",
)
DDP_SCRATCH = Strategy(
    "ddp_scratch",
    "02",
    "DDP built by hand (BucketedDDP)",
    collectives=DDP.collectives,
    apply=ap.apply_bucketed_ddp,
    pytorch=DDP.pytorch,
    abbrev="DDP*",
)
_ZERO = dict(mesh=("shard",), shard_over="world", layout="flat", mixed="paper", state="zero-flat", planned=True)
ZERO1 = Strategy(
    "zero1",
    "03",
    "stage 1 (P_os)",
    shards_at_rest=frozenset({OPTIM}),
    shards_at_peak=frozenset({OPTIM}),
    collectives=(_rs(when="step", per="buffer"), _ag(when="step", per="buffer")),
    apply=ap.apply_as_is,
    optimizer=ap.stage1_optimizer,
    pytorch=(
        "FSDP has no stage 1: DDP + torch.distributed.optim.ZeroRedundancyOptimizer (notebook 03; it "
        "all-reduces full gradients, then broadcasts each owner's updated parameters), or DeepSpeed's "
        "ZeRO stage 1"
    ),
    deepspeed='"zero_optimization": {"stage": 1}',
    paper="stage 1 (P_os)",
    abbrev="Z1",
    color="#3a7dc9",
    **_ZERO,
)
ZERO2 = Strategy(
    "zero2",
    "03",
    "stage 2 (P_os+g, SHARD_GRAD_OP)",
    shards_at_rest=frozenset({OPTIM, GRADS}),
    shards_at_peak=frozenset({OPTIM, GRADS}),
    collectives=(_rs(per="bucket"), _ag(when="step", per="bucket")),
    apply=ap.apply_as_is,
    optimizer=ap.stage2_optimizer,
    pytorch=(
        "fully_shard(block, reshard_after_forward=False) on every block and the root (FSDP1: SHARD_GRAD_OP); "
        "FSDP2 keeps the parameters unsharded from forward to backward, stage 2's traffic"
    ),
    deepspeed='"zero_optimization": {"stage": 2}',
    paper="stage 2 (P_os+g)",
    abbrev="Z2",
    color="#e8883a",
    **_ZERO,
)
ZERO3 = Strategy(
    "zero3",
    "03",
    "stage 3 (P_os+g+p, FULL_SHARD)",
    shards_at_rest=ALL,
    shards_at_peak=ALL,
    collectives=(_ag(), _ag(when="backward"), _rs()),
    gathers_units=True,
    reshard_after_forward=True,
    apply=ap.apply_stage3,
    optimizer=ap.stage3_optimizer,
    pytorch=_FULL_SHARD_PYTORCH,
    deepspeed='"zero_optimization": {"stage": 3}',
    paper="stage 3 (P_os+g+p)",
    abbrev="Z3",
    color="#7b5ea7",
    **_ZERO,
)
TORCH_ZERO1 = Strategy(
    "torch_zero1",
    "03",
    "DDP + ZeroRedundancyOptimizer (torch's stage 1)",
    shards_at_rest=frozenset({OPTIM}),
    shards_at_peak=frozenset({OPTIM}),
    shard_over="world",
    mesh=("shard",),
    collectives=(
        Collective("all_reduce", "grads", "shard", "backward", "bucket", "fp32"),
        Collective("broadcast", "params", "shard", "step", "parameter", "fp32"),
    ),
    apply=ap.apply_ddp,
    optimizer=ap.zero_redundancy_optimizer,
    describe=ap.describe_zero_redundancy,
    pytorch="DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)",
    abbrev="ZRO",
)
NO_SHARD = Strategy(
    "no_shard",
    "04",
    "NO_SHARD (fully_shard over an (N, 1) mesh)",
    mesh=("replicate", "shard"),
    collectives=(Collective("all_reduce", "grads", "replicate", "backward", "unit", "fp32"),),
    reshard_after_forward=False,
    fsdp1="NO_SHARD",
    pytorch="fully_shard(..., mesh=init_device_mesh('cuda', (N, 1), mesh_dim_names=('replicate', 'shard')))",
    abbrev="NS",
    color="#444444",
    **_FSDP,
)
SHARD_GRAD_OP = Strategy(
    "shard_grad_op",
    "04",
    "SHARD_GRAD_OP (fully_shard, reshard_after_forward=False)",
    shards_at_rest=ALL,
    shards_at_peak=frozenset({OPTIM, GRADS}),
    shard_over="world",
    mesh=("shard",),
    collectives=(_ag(), _rs(dtype="fp32")),
    reshard_after_forward=False,
    fsdp1="SHARD_GRAD_OP",
    pytorch=ZERO2.pytorch,
    abbrev="SGO",
    color="#e8883a",
    **_FSDP,
)
FULL_SHARD = Strategy(
    "full_shard",
    "04",
    "FULL_SHARD (fully_shard)",
    shards_at_rest=ALL,
    shards_at_peak=ALL,
    shard_over="world",
    mesh=("shard",),
    collectives=_STAGE3_SENDS,
    reshard_after_forward=True,
    fsdp1="FULL_SHARD",
    pytorch=_FULL_SHARD_PYTORCH,
    deepspeed=ZERO3.deepspeed,
    abbrev="FS",
    color="#7b5ea7",
    **_FSDP,
)
HYBRID_SHARD = Strategy(
    "hybrid_shard",
    "04",
    "HSDP (HYBRID_SHARD: stage 3 per shard group)",
    shards_at_rest=ALL,
    shards_at_peak=ALL,
    shard_over="node",
    mesh=("replicate", "shard"),
    collectives=(*_STAGE3_SENDS, Collective("all_reduce", "grad_shard", "replicate", "backward", "unit", "fp32")),
    reshard_after_forward=True,
    fsdp1="HYBRID_SHARD",
    pytorch=(
        "fully_shard(..., mesh=init_device_mesh('cuda', (replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard'))) (FSDP1: HYBRID_SHARD)"
    ),
    planned=True,
    abbrev="HS",
    color="#2a9d8f",
    **_FSDP,
)
_OFFLOAD = dict(offload=frozenset({OPTIM}), mesh=("shard",), shard_over="world", layout="flat", mixed="paper")
ZERO2_OFFLOAD = Strategy(
    "zero2_offload",
    "05",
    "stage 2 + optimizer offload (ZeRO-Offload)",
    shards_at_rest=ZERO2.shards_at_rest,
    shards_at_peak=ZERO2.shards_at_peak,
    collectives=ZERO2.collectives,
    pytorch="DeepSpeed's ZeRO-Offload (stage 2, optimizer state and Adam on the CPU); FSDP2 has no optimizer-only offload",
    deepspeed='"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}',
    planned=True,
    color="#f4a261",
    **_OFFLOAD,
)
ZERO3_OFFLOAD = Strategy(
    "zero3_offload",
    "05",
    "stage 3 + optimizer offload (DeepSpeed ZeRO-3)",
    shards_at_rest=ALL,
    shards_at_peak=ALL,
    collectives=ZERO3.collectives,
    gathers_units=True,
    reshard_after_forward=True,
    pytorch=(
        "DeepSpeed's ZeRO-3 with offload_optimizer (optimizer state and Adam on the CPU). FSDP2's "
        "CPUOffloadPolicy is not this: it keeps parameters and gradients on the CPU too and copies "
        "each unit's shard to the GPU for every gather (notebook 04)"
    ),
    deepspeed='"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}',
    planned=True,
    color="#b392d6",
    **_OFFLOAD,
)

for _row in (
    SINGLE,
    DDP,
    DDP_SCRATCH,
    ZERO1,
    ZERO2,
    ZERO3,
    TORCH_ZERO1,
    NO_SHARD,
    SHARD_GRAD_OP,
    FULL_SHARD,
    HYBRID_SHARD,
    ZERO2_OFFLOAD,
    ZERO3_OFFLOAD,
):
    register(_row)

#: The ZeRO paper's memory table, its rows in order of how much they shard (notebook 01).
ZERO_TABLE: tuple[Strategy, ...] = zero_table()

#: The four FSDP strategies, in the order notebook 04 shows them.
FSDP_STRATEGIES: tuple[str, ...] = tuple(s.name for s in RECORD.values() if s.fsdp1)
