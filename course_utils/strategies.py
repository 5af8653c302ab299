"""The strategy record: every fact the course knows about a strategy, in one place (notebooks 02-05b).

One ``Strategy`` per name, the way torchtitan keeps one ``ModelSpec`` per model: which function
applies it, what FSDP1 called it, which row of the ZeRO memory table its bytes follow at rest
and at the peak of a step, which row of the planner it is, ``fully_shard``'s
``reshard_after_forward``, and the device mesh it runs on for N ranks in nodes of n. Everything
that needs a strategy fact (the training loop, the predictions, the planner bridge, the
rehearsal, the benchmarks, the notebooks' tables) reads it here, so two copies cannot disagree.

Two facts checked against torch 2.13's source, because older copies of them disagreed:

- NO_SHARD keeps its working copy from forward to backward (``reshard_after_forward=False``):
  FSDP1 reshards after forward only for FULL_SHARD and HYBRID_SHARD
  (``torch.distributed.fsdp._flat_param.RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES``), and torch's
  own FSDP2-based ``replicate`` passes no post-forward mesh (it never reshards).
- The shard group (Nd, what the bytes at rest divide by) is the size of the mesh's "shard"
  dimension: N for FULL_SHARD and the ZeRO stages, n for HYBRID_SHARD, 1 for NO_SHARD (an
  (N, 1) mesh: each rank's shard is the whole tensor) and for DDP.

This module imports nothing from the package but ``errors``: every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CourseInputError


@dataclass(frozen=True)
class Strategy:
    """One strategy's facts (notebooks 02-05b).

    Attributes:
        name: the course's name (``--strategy``).
        notebook: the notebook that introduces it.
        apply: ``"module:function"`` of its ``apply_NAME(model, cfg, info) -> Prepared``; the
            training loop imports it when a run asks for it (``loop.resolve_strategy``).
        mesh: "single" (one process), "replicate" (N,), "shard" (N,), "no_shard" (N, 1) or
            "hybrid" (N/n, n): see ``mesh_shape``.
        zero_row_at_rest: the row of ``memory.STAGES`` whose bytes a rank holds between steps.
        zero_row_at_peak: the row it holds during a step (and whose traffic it sends): only
            SHARD_GRAD_OP differs (FSDP2 reshards after backward, so at rest it is stage 3).
        plan_row: its row in the planner (``plan.STRATEGIES``).
        fsdp1_name: the FSDP1 ``ShardingStrategy`` member, or None for non-FSDP strategies.
        reshard_after_forward: ``fully_shard``'s argument, or None for non-FSDP strategies.
        abbrev: a short label for figure axes.
        checkpoint_state: how a checkpoint holds its state: "torch" (state dicts by parameter
            name, which DCP reshards between strategies) or "zero-flat" (the hand-built ZeRO
            optimizers' flat slices); ``checkpoint_state.state_format`` reads it.
    """

    name: str
    notebook: str
    apply: str
    mesh: str
    zero_row_at_rest: str
    zero_row_at_peak: str
    plan_row: str
    fsdp1_name: str | None = None
    reshard_after_forward: bool | None = None
    abbrev: str = ""
    checkpoint_state: str = "torch"

    @property
    def is_fsdp(self) -> bool:
        """True for the four strategies built on ``fully_shard`` (notebook 04)."""
        return self.fsdp1_name is not None


_ALL = (
    Strategy("single", "02", "course_utils.loop:apply_single", "single", "ddp", "ddp", "ddp"),
    Strategy("ddp", "02", "course_utils.ddp:apply_ddp", "replicate", "ddp", "ddp", "ddp"),
    Strategy("ddp_scratch", "02", "course_utils.ddp:apply_ddp_scratch", "replicate", "ddp", "ddp", "ddp"),
    Strategy(
        "zero1", "03", "course_utils.zero:apply_zero1", "shard", "zero1", "zero1", "zero1", checkpoint_state="zero-flat"
    ),
    Strategy(
        "zero2", "03", "course_utils.zero:apply_zero2", "shard", "zero2", "zero2", "zero2", checkpoint_state="zero-flat"
    ),
    Strategy(
        "zero3", "03", "course_utils.zero:apply_zero3", "shard", "zero3", "zero3", "zero3", checkpoint_state="zero-flat"
    ),
    Strategy(
        "no_shard",
        "04",
        "course_utils.fsdp:apply_no_shard",
        "no_shard",
        "ddp",
        "ddp",
        "ddp",
        fsdp1_name="NO_SHARD",
        reshard_after_forward=False,
        abbrev="NS",
    ),
    Strategy(
        "shard_grad_op",
        "04",
        "course_utils.fsdp:apply_shard_grad_op",
        "shard",
        "zero3",
        "zero2",
        "zero2",
        fsdp1_name="SHARD_GRAD_OP",
        reshard_after_forward=False,
        abbrev="SGO",
    ),
    Strategy(
        "full_shard",
        "04",
        "course_utils.fsdp:apply_full_shard",
        "shard",
        "zero3",
        "zero3",
        "zero3",
        fsdp1_name="FULL_SHARD",
        reshard_after_forward=True,
        abbrev="FS",
    ),
    Strategy(
        "hybrid_shard",
        "04",
        "course_utils.fsdp:apply_hybrid_shard",
        "hybrid",
        "zero3",
        "zero3",
        "hsdp",
        fsdp1_name="HYBRID_SHARD",
        reshard_after_forward=True,
        abbrev="HS",
    ),
)

#: Every strategy ``train`` can run, by name, in the order the course introduces them.
STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}

#: The four FSDP strategies, in the order notebook 04 shows them.
FSDP_STRATEGIES: tuple[str, ...] = ("no_shard", "shard_grad_op", "full_shard", "hybrid_shard")


def get(name: str) -> Strategy:
    """The record of ``name``; ``CourseInputError`` naming the choices otherwise (notebook 02)."""
    if name not in STRATEGIES:
        raise CourseInputError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def get_fsdp(name: str) -> Strategy:
    """The record of an FSDP strategy; ``CourseInputError`` for any other name (notebook 04)."""
    if name not in FSDP_STRATEGIES:
        raise CourseInputError(f"unknown FSDP strategy {name!r}; choose one of {', '.join(FSDP_STRATEGIES)}")
    return STRATEGIES[name]


def mesh_shape(strategy: str, nproc: int, node_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, names)`` of the device mesh a strategy runs on, N = ``nproc`` ranks (notebook 04).

    full_shard, shard_grad_op and the ZeRO stages shard over all N ranks: ``(N,)`` "shard".
    ddp replicates over them: ``(N,)`` "replicate". hybrid_shard shards inside nodes of
    n = ``node_size`` ranks and replicates across the N/n nodes: ``(N/n, n)``. no_shard is the
    2-D mesh with shard size 1: ``(N, 1)``. single: ``(1,)``.
    """
    kind = get(strategy).mesh
    if kind == "single":
        return (1,), ("shard",)
    if kind in ("shard", "replicate"):
        return (nproc,), (kind,)
    if kind == "no_shard":
        return (nproc, 1), ("replicate", "shard")
    if node_size < 1 or nproc % node_size:
        raise CourseInputError(
            f"hybrid_shard needs nproc ({nproc}) divisible by node_size ({node_size}); "
            "e.g. --nproc 4 --node-size 2 (2 nodes x 2 ranks)"
        )
    return (nproc // node_size, node_size), ("replicate", "shard")


def shard_group_size(strategy: str, nproc: int, node_size: int) -> int:
    """Nd: the ranks one piece of state is split across, the "shard" dimension of the mesh (notebook 04).

    What the sharded bytes at rest divide by: N for the ZeRO stages, full_shard and
    shard_grad_op; n = ``node_size`` for hybrid_shard; 1 for single, ddp and no_shard.
    """
    shape, names = mesh_shape(strategy, nproc, node_size)
    return shape[names.index("shard")] if "shard" in names else 1
