"""How each strategy is applied to a model: ``apply_*(model, mesh, options) -> model`` and the optimizer
wrappers of the strategies that shard the optimizer themselves (notebooks 02-04).

The functions are torchtitan's shape: an apply function takes the model, the device mesh and the
run's options, returns the (wrapped) model, and knows nothing of the training loop. The loop
(``course_utils.loop.prepare``) builds the model, the mesh and the optimizer; a row of the record
(``course_utils.strategies``) holds the apply function and, for a strategy that shards the optimizer
state (the hand-built stages, ``ZeroRedundancyOptimizer``), an optimizer wrapper
``optimizer(model, factory, mesh, options)``: it wraps the loop's optimizer factory, the way
``ZeroRedundancyOptimizer(params, optimizer_class=...)`` wraps an optimizer class.

Each function imports its mechanism (``ddp``, ``zero``, ``fsdp``) when it is called: the record that
holds these functions is read by the arithmetic, which must start without torch (the layering is in
``course_utils.strategies``'s docstring).

A strategy object may offer what the loop asks of it beyond ``forward``, read by ``loop.prepare``:
``finish_gradient_synchronization()`` (called after the backward, before the optimizer steps),
``full_state_dict()`` (on the model, or ``full_state_dict(model)`` on the optimizer: the full fp32
weights, a collective), ``held()`` (on the optimizer: the tensors this rank holds), ``describe()``
(facts for the report) and ``observers()`` (the counting observers it brings). Torch's own wrappers
need none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CourseInputError
from .presets import UNIT_GRANULARITIES

#: FSDP's knobs (``TrainConfig.options``, ``--option KEY=VALUE``): accepted values, the first the default.
FSDP_APIS = ("fsdp2", "fsdp1")
WRAPS = UNIT_GRANULARITIES
PREFETCH = ("default", "explicit", "none")


@dataclass(frozen=True)
class ApplyOptions:
    """What an apply function may need to know about the run (notebook 02).

    Attributes:
        device: this rank's device (``torch.device``).
        precision: "fp32" or "mixed" (what mixed does is the row's ``mixed``).
        bucket_cap_mb: the gradient bucket cap of DDP and the hand-built stage 2 (MiB).
        reshard_after_forward, fsdp1, shard_over: the row's own facts, for the FSDP apply function.
        knobs: the row's knobs, defaults filled in (``{"api", "wrap", "prefetch", "offload"}`` for FSDP).
        act_ckpt: recompute each unit's activations in backward (the dress rehearsal, notebook 05b).
        seed: the weights' seed, for an apply function that must initialise a meta-device model itself.
    """

    device: object = None
    precision: str = "fp32"
    bucket_cap_mb: float = 25.0
    reshard_after_forward: bool | int | None = None
    fsdp1: str | None = None
    shard_over: str = "none"
    knobs: tuple = ()
    act_ckpt: bool = False
    seed: int = 0

    def knob(self, name: str):
        """The value of knob ``name`` (its default if the run left it out)."""
        return dict(self.knobs)[name]

    @property
    def meta(self) -> bool:
        """The model may be built on the meta device and initialised after ``apply`` (FSDP2)."""
        return dict(self.knobs).get("api") == "fsdp2"

    def compute_dtype(self, mixed: str | None):
        """The working dtype for a row whose ``mixed`` is ``mixed``: bf16 under mixed precision, else None."""
        import torch

        return torch.bfloat16 if self.precision == "mixed" and mixed else None


def _and(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_knobs(strategy, options: dict, node_size: int, with_knobs=()) -> tuple:
    """``options`` checked against the row's knobs, defaults filled in: ``((name, value), ...)`` (notebook 04).

    ``with_knobs``: every row that has knobs, to name them when this one has none.
    """
    if not isinstance(options, dict):
        raise CourseInputError(f"options must be a dict of KEY: VALUE, got {options!r}")
    knobs = dict(strategy.knobs)
    if options and not knobs:
        raise CourseInputError(
            f"strategy {strategy.name!r} takes no --option (got {', '.join(options)}); "
            f"the knobs are for {_and(s.name for s in with_knobs)}"
        )
    unknown = sorted(set(options) - set(knobs))
    if unknown:
        raise CourseInputError(f"unknown FSDP option(s) {', '.join(unknown)}; choose from {', '.join(knobs)}")
    out = {}
    for key, choices in knobs.items():
        value = options.get(key, choices[0])
        if isinstance(value, str) and choices[0] is False:
            value = {"true": True, "false": False}.get(value.lower(), value)
        if value not in choices:
            raise CourseInputError(f"option {key}={value!r} is not one of {', '.join(map(str, choices))}")
        out[key] = value
    if out.get("api") == "fsdp1" and (out["wrap"] == "linear" or out["prefetch"] != "default" or out["offload"]):
        raise CourseInputError(
            "api=fsdp1 is the mapping to older code: use it with wrap=block or wrap=model and "
            "the default prefetch, without offload"
        )
    if out.get("api") == "fsdp1" and strategy.shard_over == "node" and node_size == 1:
        # Measured on torch 2.13: FSDP1 then all-reduces over the one-rank shard group only, so the
        # replicas never average their gradients and silently drift apart.
        raise CourseInputError(
            f"FSDP1's {strategy.fsdp1} with node_size 1 does not average gradients across nodes; "
            "use node_size >= 2, or api=fsdp2 (or no_shard)"
        )
    return tuple(out.items())


def options_for(strategy, cfg, device=None, *, with_knobs=()) -> ApplyOptions:
    """The ``ApplyOptions`` of a run (``cfg``, a ``TrainConfig``) of ``strategy`` on ``device`` (notebook 02)."""
    return ApplyOptions(
        device=device,
        precision=cfg.precision,
        bucket_cap_mb=cfg.bucket_cap_mb,
        reshard_after_forward=strategy.reshard_after_forward,
        fsdp1=strategy.fsdp1,
        shard_over=strategy.shard_over,
        knobs=check_knobs(strategy, cfg.options, cfg.node_size, with_knobs),
        seed=cfg.seed,
    )


def _group(mesh, dim: str = "shard"):
    """The process group of mesh dimension ``dim`` (None, every rank, when the run has no mesh)."""
    return None if mesh is None else mesh.get_group(dim)


# ---------------------------------------------------------------------------------------------
# The apply functions
# ---------------------------------------------------------------------------------------------


def apply_as_is(model, mesh, options: ApplyOptions):
    """The model as it is: one process (single), or every rank keeping the whole model while the
    optimizer does the sharding (ZeRO stages 1 and 2, built by hand) (notebooks 02, 03)."""
    return model


def apply_ddp(model, mesh, options: ApplyOptions):
    """Wrap ``model`` in torch's ``DistributedDataParallel`` over the mesh's one dimension (notebook 02).

    ``options.bucket_cap_mb`` caps DDP's gradient buckets (in MiB). Every rank keeps the full model,
    gradients and Adam state: 16Ψ bytes.
    """
    from torch.nn.parallel import DistributedDataParallel

    device = options.device
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if getattr(device, "type", "cpu") == "cuda" else None,
        bucket_cap_mb=options.bucket_cap_mb,
        process_group=_group(mesh, mesh.mesh_dim_names[0]) if mesh is not None else None,
    )


def apply_bucketed_ddp(model, mesh, options: ApplyOptions):
    """Wrap ``model`` in the hand-built ``ddp.BucketedDDP`` (notebook 02).

    Every rank keeps the full model, gradients and Adam state (16Ψ bytes), plus the flat bucket
    buffers (one more gradient-sized copy, 4Ψ in fp32), as torch DDP does by default.
    """
    from .ddp import BucketedDDP

    return BucketedDDP(model, bucket_cap_mb=options.bucket_cap_mb, group=_group(mesh, "replicate"))


def apply_stage3(model, mesh, options: ApplyOptions):
    """ZeRO stage 3 (P_os+g+p) built by hand: ``zero.Zero3Module``, one unit per block (notebook 03).

    The embeddings, the final norm and the head (tied to the token embedding) form the root unit.
    Mixed precision holds 16Ψ/Nd bytes per rank (bf16 working slice and gradients, fp32 master,
    momentum, variance), fp32 16Ψ/Nd too.
    """
    from .zero import Zero3Module

    dtype = options.compute_dtype("paper")
    return Zero3Module(model, units=list(getattr(model, "blocks", [])), compute_dtype=dtype, group=_group(mesh))


def apply_fsdp(model, mesh, options: ApplyOptions):
    """``fully_shard`` on every unit, then the root, with the row's ``reshard_after_forward`` (notebook 04).

    FULL_SHARD (True), SHARD_GRAD_OP (False) and an integer k (reshard to groups of k) on a 1-D mesh;
    NO_SHARD and HYBRID_SHARD on a 2-D ("replicate", "shard") mesh. ``options.knob("api") == "fsdp1"``
    wraps the same strategy in the FSDP1 class instead (``fsdp.apply_fsdp1``). Each rank holds
    16Ψ/Nd bytes at rest (fp32 parameters, gradients, Adam's two moments); per step and unit two
    all-gathers (one when the unit is kept from forward to backward) and one reduce-scatter.
    """
    from . import fsdp

    if options.knob("api") == "fsdp1":
        return fsdp.apply_fsdp1(model, mesh, options)
    fsdp.shard_model(
        model,
        mesh,
        reshard_after_forward=options.reshard_after_forward,
        granularity=options.knob("wrap"),
        mp_policy=fsdp.mixed_precision_policy(options.precision),
        offload=fsdp.offload_policy(options.knob("offload"), options.device),
        prefetch=options.knob("prefetch"),
        act_ckpt=options.act_ckpt,
    )
    return model


# ---------------------------------------------------------------------------------------------
# Optimizer wrappers: a strategy that shards the optimizer state says so here
# ---------------------------------------------------------------------------------------------


def stage1_optimizer(model, factory, mesh, options: ApplyOptions):
    """ZeRO stage 1 (P_os): ``zero.ShardedOptimizer`` around the loop's optimizer (notebook 03).

    Mixed precision gives bf16 working weights and gradients with fp32 master weights
    (4Ψ + 12Ψ/Nd bytes per rank); fp32 gives 8Ψ + 8Ψ/Nd.
    """
    from .zero import ShardedOptimizer

    return ShardedOptimizer(
        model.parameters(), factory, compute_dtype=options.compute_dtype("paper"), group=_group(mesh)
    )


def stage2_optimizer(model, factory, mesh, options: ApplyOptions):
    """ZeRO stage 2 (P_os+g): ``zero.GradShardedOptimizer``, gradient buckets of ``bucket_cap_mb`` (notebook 03).

    Mixed precision holds 2Ψ + 14Ψ/Nd bytes per rank, fp32 4Ψ + 12Ψ/Nd.
    """
    from .zero import GradShardedOptimizer

    return GradShardedOptimizer(
        model.parameters(),
        factory,
        compute_dtype=options.compute_dtype("paper"),
        group=_group(mesh),
        bucket_cap_mb=options.bucket_cap_mb,
    )


def stage3_optimizer(model, factory, mesh, options: ApplyOptions):
    """The optimizer of a ``zero.Zero3Module``: the loop's optimizer over its fp32 master slices (notebook 03)."""
    from .zero import Zero3Optimizer

    return Zero3Optimizer(model, factory)


def zero_redundancy_optimizer(model, factory, mesh, options: ApplyOptions):
    """torch's stage 1: ``ZeroRedundancyOptimizer(params, optimizer_class=factory)`` (notebook 03).

    DDP all-reduces the gradients (2Ψ); each rank then runs the optimizer on the whole parameters
    ``ZeroRedundancyOptimizer`` assigned to it (greedy, by size, so the slices are uneven) and
    broadcasts them (Ψ): 3Ψ in all, where the hand-built ``ShardedOptimizer`` needs 2Ψ. fp32 only:
    the library optimizer has no master weights.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=factory, process_group=_group(mesh))


# ---------------------------------------------------------------------------------------------
# What a report says about a model torch's own API built (DDP, FSDP), and what watches it
# ---------------------------------------------------------------------------------------------


def describe_ddp(model, mesh, options: ApplyOptions) -> dict:
    """torch DDP's report: its bucket cap (notebook 02)."""
    return {"bucket_cap_mb": options.bucket_cap_mb}


def describe_zero_redundancy(model, mesh, options: ApplyOptions) -> dict:
    """torch's stage 1's report: which library it is (notebook 03)."""
    return {"library": "torch.distributed.optim.ZeroRedundancyOptimizer"}


def describe_fsdp(model, mesh, options: ApplyOptions) -> dict:
    """What ``fully_shard`` (or the FSDP1 class) built: the library, the mesh, the row's facts, the knobs,
    and each unit's parameters (``models.unit_table``) (notebook 04)."""
    knobs = dict(options.knobs)
    if knobs["api"] == "fsdp1":
        return {
            "library": "FSDP1 FullyShardedDataParallel",
            "fsdp1_name": options.fsdp1,
            **knobs,
            "flat_shard_numel": [p.numel() for p in model.parameters()],
        }
    from .models import unit_modules, unit_table

    return {
        "library": "FSDP2 fully_shard",
        "fsdp1_name": options.fsdp1,
        "mesh": {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)},
        "reshard_after_forward": options.reshard_after_forward,
        **knobs,
        "compute_bytes_per_element": 2 if options.precision == "mixed" else 4,
        "units": unit_table(model, mesh.shape[-1], unit_modules(model, knobs["wrap"])),
        "peak_unsharded_bytes": 0,
    }


def watch_fsdp(model, report: dict) -> list:
    """FSDP2's counting observer: ``fsdp.UnshardedTracker``, keeping ``report["peak_unsharded_bytes"]`` (notebook 04)."""
    if report.get("api") != "fsdp2":
        return []
    from .fsdp import UnshardedTracker

    tracker = UnshardedTracker(model, report)
    report["tracker_units"] = len(tracker.units)
    return [tracker]


__all__ = [
    "ApplyOptions",
    "options_for",
    "check_knobs",
    "apply_as_is",
    "apply_ddp",
    "apply_bucketed_ddp",
    "apply_stage3",
    "apply_fsdp",
    "stage1_optimizer",
    "stage2_optimizer",
    "stage3_optimizer",
    "zero_redundancy_optimizer",
    "describe_ddp",
    "describe_zero_redundancy",
    "describe_fsdp",
    "watch_fsdp",
]
