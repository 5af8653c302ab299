"""What a row of the strategy record says: the ``Strategy`` and ``Collective`` types, and the registry that
finds a row by name (notebooks 02-05b).

torchtitan's pattern: the spec type and its registry in a small module, the rows elsewhere
(``course_utils.strategies``, beside the apply functions of ``course_utils.apply`` they hold). This module
imports nothing from the package but ``errors``; every layer above the mechanism reads it through
``strategies``, which re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import CourseInputError

#: The three parts of the model states, in the paper's order of sharding: ZeRO's stage k shards the last k.
PARAMS, GRADS, OPTIM = "params", "grads", "optim"
PARTS = (PARAMS, GRADS, OPTIM)
NOTHING, ALL = frozenset(), frozenset(PARTS)


@dataclass(frozen=True)
class Collective:
    """One collective a strategy issues in every training step (notebooks 02-04).

    Attributes:
        kind: "all_reduce", "all_gather", "reduce_scatter" or "broadcast".
        of: what it moves: "params" (the working weights), "grads" (the full gradients) or
            "grad_shard" (a gradient already reduce-scattered over the "shard" dimension).
        over: the mesh dimension whose group it runs in: "shard" or "replicate".
        when: "forward", "backward" or "step" (after the backward, in the optimizer's step).
        per: what it is issued once for: "unit", "bucket" (a group of gradients), "buffer" (a flat
            buffer of the hand-built stages) or "parameter".
        dtype: "compute" (the working precision: bf16 under mixed precision) or "fp32" (always).
    """

    kind: str
    of: str
    over: str
    when: str
    per: str
    dtype: str = "compute"


@dataclass(frozen=True)
class Strategy:
    """One strategy's facts and behaviour (notebooks 02-05b).

    Attributes:
        name: the course's name (``--strategy``, a report's ``strategy``).
        notebook: the notebook that introduces it.
        title: how the planner and the tables name it ("stage 1 (P_os)"); ``paper``: its row of the ZeRO
            paper's memory table ("plain DP", "stage 1 (P_os)"...), or "" for an implementation of a row.
        shards_at_rest: the parts each rank holds only a 1/Nd shard of between steps.
        shards_at_peak: the same while a step runs (SHARD_GRAD_OP gathers the parameters for the step).
        shard_over: the shard group: "world" (Nd = N), "node" (Nd = n ranks of a node) or "none" (Nd = 1).
        mesh: the names of its device mesh's dimensions: ("shard",), ("replicate",),
            ("replicate", "shard"), or () for one process.
        collectives: what every step sends (``Collective``), in the order a step issues them.
        gathers_units: it gathers the parameters one unit at a time (ZeRO-3, FSDP), so a step's peak
            holds whole units (``predict.peak_gathered_bytes``).
        reshard_after_forward: ``fully_shard``'s argument: True frees a unit after its forward and gathers
            it again for its backward, False keeps it, an integer k reshards to groups of k ranks; None
            for strategies that gather no units.
        keeps_root: the root unit stays gathered from its forward to its backward, so the backward does
            not all-gather it again: 2U - 1 all-gathers per step, not 2U (``fully_shard``'s default for
            the root, ``reshard_after_forward=None``, ``_fsdp_state.py`` in torch 2.13; FSDP1 the same).
        offload: the parts kept in host memory (the optimizer step then runs on the CPU).
        layout: "flat" (units laid end to end and padded to a multiple of Nd: the hand-built ZeRO, FSDP1,
            DeepSpeed), "per_parameter" (each parameter's dim 0 split: FSDP2) or "whole" (not sharded).
        mixed: what ``precision="mixed"`` does: "paper" (16-bit working weights and gradients, fp32 master
            copy: the paper's 2 + 2 + 12), "gathered" (bf16 gathered working copy; fp32 shards and
            gradients: FSDP2's 4 + 4 + 8), or None (the run stays fp32).
        apply: ``apply(model, mesh, options) -> model`` (``course_utils.apply``), or None: the planner
            and the predictions price the row, the training loop cannot run it.
        optimizer: ``optimizer(model, factory, mesh, options)``: wraps the loop's optimizer factory when
            the strategy shards the optimizer state itself (the hand-built stages,
            ``ZeroRedundancyOptimizer``); None: the loop's optimizer over ``model.parameters()``.
        describe: ``describe(model, mesh, options) -> dict``: what a report says about a model torch's own
            API built (the course's own mechanism objects say it themselves: ``describe()``).
        observe: ``observe(model, report) -> [observers]``: the counting observers that watch it.
        knobs: ``((name, choices), ...)`` the run may set in ``TrainConfig.options`` (first = default).
        fsdp1: its ``torch.distributed.fsdp.ShardingStrategy`` member, or None.
        pytorch, deepspeed: what a user types to get it from PyTorch and from DeepSpeed.
        state: how the course checkpoints it: "torch" (``get_state_dict``) or "zero-flat" (flat slices).
        planned: the planner weighs it (``plan.plan``) unless told which rows to weigh.
        builds_on_meta: the loop may build the model on the meta device and initialise it after
            ``apply`` (FSDP2: no rank ever holds the whole model).
        abbrev, color: a short label and a colour for charts.
    """

    name: str
    notebook: str
    title: str
    shards_at_rest: frozenset = NOTHING
    shards_at_peak: frozenset = NOTHING
    shard_over: str = "none"
    mesh: tuple = ("replicate",)
    collectives: tuple = ()
    gathers_units: bool = False
    reshard_after_forward: bool | int | None = None
    keeps_root: bool = False
    offload: frozenset = NOTHING
    layout: str = "whole"
    mixed: str | None = None
    apply: Callable | None = None
    optimizer: Callable | None = None
    describe: Callable | None = None
    observe: Callable | None = None
    knobs: tuple = ()
    fsdp1: str | None = None
    pytorch: str = ""
    deepspeed: str = ""
    paper: str = ""
    state: str = "torch"
    planned: bool = False
    builds_on_meta: bool = False
    abbrev: str = ""
    color: str = "#444444"

    @property
    def runnable(self) -> bool:
        """The training loop can run it (it has an apply function) (notebook 02)."""
        return self.apply is not None

    @property
    def single_process(self) -> bool:
        """One process, no mesh: the reference every run is held against (notebook 02)."""
        return not self.mesh

    @property
    def fsdp1_name(self) -> str | None:
        """FSDP1's name for it (``ShardingStrategy``), or None (notebook 04)."""
        return self.fsdp1

    def mesh_shape(self, nproc: int, node_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(shape, names)`` of its device mesh for N = ``nproc`` ranks in nodes of n = ``node_size`` (notebook 04).

        "world" shards over all N ranks, "node" inside nodes of n (replicating across the N/n nodes),
        "none" over nobody: a 1-D mesh is ``(N,)``; a 2-D one is ``(N/n, n)``, or ``(N, 1)`` when
        nothing is sharded (NO_SHARD). One process: ``(1,)``.
        """
        if self.single_process:
            return (1,), ("shard",)
        if len(self.mesh) == 1:
            return (nproc,), self.mesh
        shard = {"world": nproc, "node": node_size, "none": 1}[self.shard_over]
        if shard < 1 or nproc % shard:
            raise CourseInputError(
                f"{self.name} needs nproc ({nproc}) divisible by node_size ({node_size}); "
                "e.g. --nproc 4 --node-size 2 (2 nodes x 2 ranks)"
            )
        return (nproc // shard, shard), self.mesh

    def group_size(self, dim: str, nproc: int, node_size: int) -> int:
        """Ranks in one group of mesh dimension ``dim`` ("shard" or "replicate"); 1 if the mesh has none (notebook 04)."""
        shape, names = self.mesh_shape(nproc, node_size)
        return shape[names.index(dim)] if dim in names else 1

    def shard_group_size(self, nproc: int, node_size: int) -> int:
        """Nd: the ranks one piece of state is split across, the "shard" dimension of the mesh (notebook 04).

        What the sharded bytes at rest divide by: N for the ZeRO stages, full_shard and
        shard_grad_op; n = ``node_size`` for hybrid_shard; 1 for single, ddp and no_shard.
        """
        return self.group_size("shard", nproc, node_size) if self.shard_over != "none" else 1

    def zero_row(self, at: str = "rest") -> Strategy:
        """The row of the ZeRO paper's memory table that shards what this one shards (notebook 03).

        ``at``: "rest" (between steps) or "peak" (while a step runs).
        """
        parts = self.shards_at_rest if at == "rest" else self.shards_at_peak
        return next(s for s in zero_table() if s.shards_at_rest == parts)

    @property
    def zero_row_at_rest(self) -> str:
        """The name of ``zero_row("rest")`` (notebook 04)."""
        return self.zero_row("rest").name

    @property
    def zero_row_at_peak(self) -> str:
        """The name of ``zero_row("peak")`` (notebook 04)."""
        return self.zero_row("peak").name

    def sends(self, of: str) -> tuple:
        """Its collectives that move ``of`` ("params", "grads", "grad_shard") (notebook 03)."""
        return tuple(c for c in self.collectives if c.of == of)

    @property
    def sort_key(self) -> tuple:
        """Less sharding first: no offload before offload, fewer parts sharded, a node before the world.

        The planner's order of preference, in which a tie goes to the simpler strategy (notebook 05).
        """
        return (len(self.offload), len(self.shards_at_peak), {"none": 0, "node": 1, "world": 2}[self.shard_over])


#: Every row of the record, by name, in the order the course introduces them (priced-only rows included).
RECORD: dict[str, Strategy] = {}
#: Every strategy ``train`` can run, by name (the rows with an apply function), in the same order.
STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Add a row to the record (notebook 02): the loop can then run it by name, the planner weighs it.

    Registering the same row again changes nothing; another row under a name already taken is refused.
    """
    known = RECORD.get(strategy.name)
    if known is not None and known != strategy:
        raise CourseInputError(f"a strategy named {strategy.name!r} is already registered; pick another name")
    for c in strategy.collectives:
        if c.over not in strategy.mesh:
            raise CourseInputError(
                f"{strategy.name}: a collective over {c.over!r}, which its mesh {strategy.mesh} lacks"
            )
    RECORD[strategy.name] = strategy
    if strategy.runnable:
        STRATEGIES[strategy.name] = strategy
    return strategy


def get(strategy: str | Strategy) -> Strategy:
    """The row of ``strategy`` (a name or a row); ``CourseInputError`` naming the choices otherwise (notebook 02)."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in RECORD:
        raise CourseInputError(f"unknown strategy {strategy!r}; choose one of {', '.join(RECORD)}")
    return RECORD[strategy]


def runnable(strategy: str | Strategy) -> Strategy:
    """The row of a strategy the training loop can run; ``CourseInputError`` for one it cannot (notebook 02)."""
    s = get(strategy)
    if not s.runnable:
        here = ", ".join(STRATEGIES)
        raise CourseInputError(
            f"{s.name} is priced by the planner but has no implementation here to train with; choose one of {here}"
        )
    return s


def get_fsdp(strategy: str | Strategy) -> Strategy:
    """The row of an FSDP strategy; ``CourseInputError`` for any other (notebook 04)."""
    s = get(strategy) if isinstance(strategy, Strategy) or strategy in RECORD else None
    if s is None or not s.fsdp1:
        raise CourseInputError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(fsdp_strategies())}")
    return s


def planned() -> tuple[Strategy, ...]:
    """The rows the planner weighs, in its order of preference (``Strategy.sort_key``) (notebook 05)."""
    return tuple(sorted((s for s in RECORD.values() if s.planned), key=lambda s: s.sort_key))


def mesh_shape(strategy: str | Strategy, nproc: int, node_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``Strategy.mesh_shape`` of a strategy given by name or row (notebook 04)."""
    return get(strategy).mesh_shape(nproc, node_size)


def shard_group_size(strategy: str | Strategy, nproc: int, node_size: int) -> int:
    """``Strategy.shard_group_size`` of a strategy given by name or row (notebook 04)."""
    return get(strategy).shard_group_size(nproc, node_size)


def zero_table() -> tuple[Strategy, ...]:
    """The ZeRO paper's memory table: the rows with a ``paper`` label, in order of how much they shard (notebook 01)."""
    return tuple(sorted((s for s in RECORD.values() if s.paper), key=lambda s: len(s.shards_at_rest)))


def fsdp_strategies() -> tuple[str, ...]:
    """The names of the rows FSDP1 has a name for, in the record's order (notebook 04)."""
    return tuple(s.name for s in RECORD.values() if s.fsdp1)
