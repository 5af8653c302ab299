"""PyTorch FSDP on real runs: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (introduced in notebook 04).

Notebook 03 built ZeRO's stages by hand. Here the same ideas come from the library people use,
FSDP2's ``fully_shard`` (``torch.distributed.fsdp``): applied to each transformer block, then to
the root; each call makes one *unit* whose parameters become DTensor shards on dim 0 and are
all-gathered together, and whose gradients are reduce-scattered together. The optimizer is built
after sharding, over those shards. The four strategies of the FSDP1 ``ShardingStrategy`` enum are
the same call with different arguments:

==============  ======================  ===============================  ==========================
strategy        reshard_after_forward   device mesh (names)              ZeRO row (Ψ params, Nd)
==============  ======================  ===============================  ==========================
full_shard      True                    (N,)       ("shard",)            stage 3, Nd = N
shard_grad_op   False                   (N,)       ("shard",)            stage 2 (see below)
no_shard        False                   (N, 1)     ("replicate","shard") plain data parallelism
hybrid_shard    True                    (N/n, n)   ("replicate","shard") stage 3, Nd = n per node
==============  ======================  ===============================  ==========================

- FULL_SHARD gathers each unit before its forward, frees it after, gathers it again before its
  backward and reduce-scatters its gradients: two all-gathers and one reduce-scatter per unit and
  step, 3(N-1)/N·Ψ elements sent per rank, the ZeRO paper's 1.5x.
- SHARD_GRAD_OP keeps each unit gathered from its forward to its backward: one all-gather fewer
  (stage 2's traffic), and while a step runs the whole model is unsharded at once. FSDP2 reshards
  after the backward, so *at rest* it holds exactly what FULL_SHARD holds (stage 3's bytes). At the
  peak it holds stage 2's row plus one fp32 parameter shard: the whole model gathered, and beside
  it the shard FSDP2 keeps as the master copy (measured in notebook 04).
- NO_SHARD: FSDP2 has no flag for it. A 2-D mesh whose shard dimension has size 1 *is* NO_SHARD:
  each rank's shard is the whole tensor, nothing is gathered or scattered, and gradients are
  all-reduced over the replicate dimension (one all-reduce per unit). We use it because it is
  the public ``fully_shard`` API, the same function as the other three strategies (same DTensor
  state dicts, optimizer, checkpointing and counters), and it shows the family: NO_SHARD is
  HYBRID_SHARD with one rank per node, FULL_SHARD is HYBRID_SHARD with one node. The
  alternatives are the FSDP1 class (deprecated by the FSDP2 tutorial; shown by ``api="fsdp1"``)
  and ``torch.distributed._composable.replicate`` (a private module path). The price, measured
  by ``UnshardedTracker``: FSDP2 computes on a working copy of each unit even when the shard is
  whole (a local copy, no traffic); DDP (notebook 02) computes on the parameters themselves.
- HYBRID_SHARD: a 2-D mesh, shard inside a "node" of n ranks, replicate across the N/n nodes:
  the all-gathers and reduce-scatters stay inside a node (fast links), and one all-reduce per
  unit of the already reduce-scattered shard crosses nodes.

Strategy knobs (``TrainConfig.options``, ``--option KEY=VALUE`` on the command line):
``api`` ("fsdp2" or "fsdp1": the old ``FullyShardedDataParallel`` class with the same
strategy), ``wrap`` ("block", "model" or "linear": what one unit is), ``prefetch`` ("default",
"explicit" or "none"), ``offload`` (true: ``CPUOffloadPolicy``). ``precision="mixed"`` gives
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

Also here: ``UnshardedTracker`` (peak bytes of gathered parameters, on any device). What the
formulas predict for a run (bytes held, collectives, the peak of gathered bytes) is
``course_utils.predict`` (``predict.fsdp_run``). The notebook's experiments (many runs in one
launch, the state-dict demo) are ``course_utils.labs.lab04``; its tables are views in
``course_utils.plots``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from . import dist as cdist
from .errors import CourseInputError
from .instrument import Observer
from .loop import Prepared, TrainConfig, make_optimizer, module_held
from .models import UNIT_GRANULARITIES, Block, init_weights, unit_modules
from .predict import unit_table
from .strategies import get_fsdp, mesh_shape

#: Accepted values of the strategy knobs in ``TrainConfig.options``; the first is the default.
OPTIONS = {
    "api": ("fsdp2", "fsdp1"),
    "wrap": UNIT_GRANULARITIES,
    "prefetch": ("default", "explicit", "none"),
    "offload": (False, True),
}


def fsdp_options(cfg: TrainConfig) -> dict:
    """The FSDP knobs of a run, defaults filled in, bad values refused (notebook 04)."""
    unknown = sorted(set(cfg.options) - set(OPTIONS))
    if unknown:
        raise CourseInputError(f"unknown FSDP option(s) {', '.join(unknown)}; choose from {', '.join(OPTIONS)}")
    out = {}
    for key, choices in OPTIONS.items():
        value = cfg.options.get(key, choices[0])
        if isinstance(value, str) and choices[0] is False:
            value = {"true": True, "false": False}.get(value.lower(), value)
        if value not in choices:
            raise CourseInputError(f"option {key}={value!r} is not one of {', '.join(map(str, choices))}")
        out[key] = value
    if out["api"] == "fsdp1" and (out["wrap"] == "linear" or out["prefetch"] != "default" or out["offload"]):
        raise CourseInputError(
            "api=fsdp1 is the mapping to older code: use it with wrap=block or wrap=model and "
            "the default prefetch, without offload"
        )
    if out["api"] == "fsdp1" and cfg.strategy == "hybrid_shard" and cfg.node_size == 1:
        # Measured on torch 2.13: FSDP1 then all-reduces over the one-rank shard group only, so the
        # replicas never average their gradients and silently drift apart.
        raise CourseInputError(
            "FSDP1's HYBRID_SHARD with node_size 1 does not average gradients across nodes; "
            "use node_size >= 2, or api=fsdp2 (or no_shard)"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Meshes, units, prefetching, policies
# ---------------------------------------------------------------------------------------------

#: Meshes already built in this process, keyed by (device type, shape, names); each entry keeps
#: the default process group it was built under, so a new session never reuses a stale one.
_MESHES: dict = {}


def fsdp_mesh(info, strategy: str, node_size: int = 2):
    """The ``DeviceMesh`` for ``strategy`` on this run's device type (notebook 04).

    The device type comes from ``info.device``: on a host with CUDA, FSDP2's default mesh would
    be a CUDA mesh even for gloo/CPU workers, so it is always passed explicitly. A mesh is built
    once per process and shape (building one creates process groups; DTensor also caches its
    sharding decisions per mesh, so many runs in one launch share the work).
    """
    shape, names = mesh_shape(strategy, info.world_size, node_size)
    key = (info.device.type, shape, names)
    world, mesh = _MESHES.get(key, (None, None))
    if world is not dist.group.WORLD:
        mesh = cdist.init_mesh(info, shape, names)
        _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


def set_prefetch(units: list, mode: str = "default", depth: int = 1) -> None:
    """Choose how FSDP2 prefetches all-gathers; ``units`` in forward order, the root last (notebook 04).

    "default": FSDP2's own behaviour (in backward, each unit prefetches the one before it).
    "explicit": the torchtitan recipe; in forward each unit (the root first) starts the next
    unit's all-gather right after its own, in backward the previous one's.
    "none": no prefetch at all; FSDP2 has no switch for it, but a unit whose explicit backward
    prefetch list is itself has nothing left to prefetch (public API only).
    """
    root, layers = units[-1], units[:-1]
    if mode == "default":
        return
    if mode == "none":
        for unit in units:
            unit.set_modules_to_backward_prefetch([unit])
        return
    if mode != "explicit":
        raise CourseInputError(f"prefetch must be one of {', '.join(OPTIONS['prefetch'])}, got {mode!r}")
    if layers:
        root.set_modules_to_forward_prefetch(layers[:depth])
        root.set_modules_to_backward_prefetch(layers[-depth:][::-1])
    for i, unit in enumerate(layers):
        unit.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + depth])
        unit.set_modules_to_backward_prefetch(layers[max(0, i - depth) : i][::-1])


def mixed_precision_policy(cfg: TrainConfig):
    """``MixedPrecisionPolicy``: bf16 working parameters, fp32 gradient reduction, or None in fp32 (notebook 04).

    The sharded parameters stay fp32 (they are the master copy the optimizer updates); the
    all-gathered working copy is bf16, so the all-gathers and the gathered bytes halve, while
    the reduce-scatters still carry fp32 gradients.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.precision != "mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload_policy(enabled: bool, device: torch.device):
    """``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer state in host memory) or None (notebook 04).

    Pinned host memory makes the copies to the GPU asynchronous; it needs an accelerator, so on
    a CPU-only host the policy is created unpinned (and has nothing to move: the device *is*
    host memory).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if enabled else None


def shard_model(
    model: nn.Module,
    mesh,
    *,
    reshard_after_forward: bool,
    granularity: str = "block",
    mp_policy=None,
    offload=None,
    prefetch: str = "default",
    act_ckpt: bool = False,
) -> list:
    """Apply ``fully_shard`` bottom-up: each unit module, then the root; return the units, root last (notebook 04).

    The one wrapping function of the course: real runs (``apply_full_shard`` and the other
    FSDP strategies) and the dress rehearsal (notebook 05b) both wrap through it.

    Args:
        model: the course model (same seed on every rank).
        mesh: from ``fsdp_mesh``: 1-D shards over it, 2-D shards over dim 1, replicates over dim 0.
        reshard_after_forward: True frees each unit after its forward (FULL_SHARD), False keeps
            it gathered until its backward (SHARD_GRAD_OP); the record's ``reshard_after_forward``.
        granularity: what a unit is (``unit_modules``).
        mp_policy, offload: ``mixed_precision_policy`` / ``offload_policy`` results, or None.
        prefetch: ``set_prefetch`` mode.
        act_ckpt: recompute each unit's activations in backward (torch's composable
            ``checkpoint``), keeping only each unit's input (notebook 05b).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload or OffloadPolicy(),
    )
    modules = unit_modules(model, granularity)
    if act_ckpt:
        from torch.distributed._composable import checkpoint

        for m in modules:
            checkpoint(m)
    units = [fully_shard(m, **kwargs) for m in modules]
    units.append(fully_shard(model, **kwargs))
    set_prefetch(units, prefetch)
    return units


# ---------------------------------------------------------------------------------------------
# Peak bytes of gathered parameters
# ---------------------------------------------------------------------------------------------


def _param_groups(unit) -> list:
    """FSDP2's parameter group(s) of one unit: where it records whether the unit is gathered."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older releases: one group per unit
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


class UnshardedTracker(Observer):
    """The largest bytes of gathered (full-size) parameters alive at once during a step (notebook 04).

    This is what FULL_SHARD saves over SHARD_GRAD_OP. On a GPU ``torch.cuda.max_memory_allocated``
    sees it (mixed in with everything else); on CPU there is no allocator peak to read, so this
    counts it directly: before and after every leaf module's forward, and when the gradient of a
    leaf's output arrives in backward (just before that leaf's backward runs), it adds up the
    full-size bytes of every unit that is gathered at that moment, or whose prefetched
    all-gather has landed and waits to be used. ``peak`` is the largest sum seen.

    The gathered state is read from FSDP2's per-unit parameter group (``is_unsharded``, the
    pending all-gather): private attributes, checked against torch 2.13.

    An observer of the training loop: its hooks are on the model from ``start`` to ``stop``
    (a counting run's loop), never in a timing run.

    Args:
        model: a model after ``shard_model``.
        report: a dict to keep ``peak_unsharded_bytes`` up to date in (a strategy's ``info``).
    """

    def __init__(self, model: nn.Module, report: dict | None = None):
        from torch.distributed.fsdp import FSDPModule

        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.peak = 0
        self.samples = 0
        self.report = report if report is not None else {}
        self._bytes: dict[int, int] = {}
        self.model = model
        self.handles = []

    def start(self) -> None:
        for m in self.model.modules():
            if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None:
                self.handles.append(m.register_forward_pre_hook(lambda *_: self.sample()))
                self.handles.append(m.register_forward_hook(self._after_forward))

    def _group_bytes(self, group) -> int:
        if id(group) not in self._bytes:  # the working dtype is settled at FSDP's lazy init
            self._bytes[id(group)] = sum(
                fp._orig_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize for fp in group.fsdp_params
            )
        return self._bytes[id(group)]

    def live_bytes(self) -> int:
        """Bytes of full-size parameters gathered right now, summed over units."""
        total = 0
        for unit in self.units:
            for group in _param_groups(unit):
                if group.is_unsharded or group._all_gather_result is not None:
                    total += self._group_bytes(group)
        return total

    def sample(self) -> None:
        self.samples += 1
        live = self.live_bytes()
        if live > self.peak:
            self.peak = live
            self.report["peak_unsharded_bytes"] = live

    def _after_forward(self, module, args, output) -> None:
        self.sample()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.sample())

    def stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# ---------------------------------------------------------------------------------------------
# The strategies (python -m course_utils train --strategy no_shard|shard_grad_op|full_shard|hybrid_shard)
# ---------------------------------------------------------------------------------------------


def full_state_dict(model: nn.Module) -> dict:
    """Every rank gets the full, unsharded weights keyed like ``build_model().state_dict()`` (notebook 04).

    ``get_model_state_dict(full_state_dict=True)`` all-gathers each DTensor (FSDP2) or unshards
    each flat parameter (FSDP1); the tied ``head.weight`` appears under its own key as in an
    unsharded model, so ``weights_sha256`` compares across strategies.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def full_state_dict_via_dtensor(model: nn.Module) -> dict:
    """The same full state dict assembled by hand: ``DTensor.full_tensor()`` on each sharded value (notebook 04)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def _apply_fsdp(model, cfg: TrainConfig, info, strategy: str) -> Prepared:
    opts = fsdp_options(cfg)
    meta = next(model.parameters()).is_meta
    if opts["api"] == "fsdp1":
        if meta:
            init_weights(model, cfg.seed, info.device)
        return apply_fsdp1(model, cfg, info, strategy)
    mesh = fsdp_mesh(info, strategy, cfg.node_size)
    mp = mixed_precision_policy(cfg)
    spec = get_fsdp(strategy)
    shard_model(
        model,
        mesh,
        reshard_after_forward=spec.reshard_after_forward,
        granularity=opts["wrap"],
        mp_policy=mp,
        offload=offload_policy(opts["offload"], info.device),
        prefetch=opts["prefetch"],
    )
    if meta:  # built on the meta device (loop.prepare): each rank materialises only its shards
        init_weights(model, cfg.seed, "cpu" if opts["offload"] else info.device)
    optimizer = make_optimizer(model.parameters(), cfg)  # after sharding: over this rank's DTensor shards
    report = {
        "library": "FSDP2 fully_shard",
        "fsdp1_name": spec.fsdp1_name,
        "mesh": {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)},
        "reshard_after_forward": spec.reshard_after_forward,
        **opts,
        "compute_bytes_per_element": 2 if mp else 4,
        "units": unit_table(model, mesh.shape[-1], unit_modules(model, opts["wrap"])),
        "peak_unsharded_bytes": 0,
    }
    tracker = UnshardedTracker(model, report)
    report["tracker_units"] = len(tracker.units)
    return Prepared(
        model=model,
        optimizer=optimizer,
        full_state_dict=lambda: full_state_dict(model),
        held=lambda: module_held(model, optimizer),
        info=report,
        observers=[tracker],
    )


def apply_full_shard(model, cfg: TrainConfig, info) -> Prepared:
    """FULL_SHARD (ZeRO stage 3): ``fully_shard(reshard_after_forward=True)`` per block, then the root (notebook 04).

    Args:
        model: the course model, built from the same seed on every rank.
        cfg: the run's ``TrainConfig``; ``cfg.options`` may set ``api``, ``wrap``, ``prefetch``,
            ``offload``; ``precision="mixed"`` uses bf16 working parameters.
        info: this rank's ``DistInfo`` (device, world size).

    Each rank holds 16Ψ/N bytes at rest (fp32 parameters, gradients, Adam's two moments, each
    a 1/N shard); per step and unit: two all-gathers and one reduce-scatter.
    """
    return _apply_fsdp(model, cfg, info, "full_shard")


def apply_shard_grad_op(model, cfg: TrainConfig, info) -> Prepared:
    """SHARD_GRAD_OP (ZeRO stage 2): ``fully_shard(reshard_after_forward=False)`` (notebook 04).

    Args:
        model, cfg, info: as for ``apply_full_shard``.

    One all-gather and one reduce-scatter per unit and step (2(N-1)/N·Ψ sent, as DDP). Units stay
    gathered from forward to backward, so the whole model (4Ψ bytes in fp32) is unsharded at the
    end of the forward; at rest FSDP2 keeps 16Ψ/N, as FULL_SHARD does. Held plus gathered at that
    peak: 4Ψ + 16Ψ/N, stage 2's row (4Ψ + 12Ψ/N) plus the fp32 parameter shard (4Ψ/N).
    """
    return _apply_fsdp(model, cfg, info, "shard_grad_op")


def apply_no_shard(model, cfg: TrainConfig, info) -> Prepared:
    """NO_SHARD (plain data parallelism): ``fully_shard`` over an (N, 1) mesh (notebook 04).

    Args:
        model, cfg, info: as for ``apply_full_shard``.

    Why this API: it is public FSDP2 (the same function, DTensor state dicts and counters as the
    other strategies) and it is exactly HYBRID_SHARD with one rank per node: the shard is the
    whole tensor, so there is nothing to gather or scatter, and each unit's gradients are
    all-reduced over the replicate dimension, 2(N-1)/N·Ψ sent per rank as in DDP. Every rank
    holds 16Ψ bytes. See the module docstring for the alternatives and the working copy FSDP2
    computes on.
    """
    return _apply_fsdp(model, cfg, info, "no_shard")


def apply_hybrid_shard(model, cfg: TrainConfig, info) -> Prepared:
    """HYBRID_SHARD (HSDP): FULL_SHARD inside nodes of ``cfg.node_size`` ranks, replicated across nodes (notebook 04).

    Args:
        model, info: as for ``apply_full_shard``.
        cfg: ``cfg.node_size`` = n ranks per node; N must divide by n (4 CPU processes = 2 nodes
            x 2 ranks). The mesh is ``(N/n, n)`` with names ("replicate", "shard").

    Each rank holds 16Ψ/n bytes. All-gathers and reduce-scatters run inside a node (group of n);
    one all-reduce per unit of the reduce-scattered shard (Ψ/n elements) runs across the N/n nodes.
    """
    return _apply_fsdp(model, cfg, info, "hybrid_shard")


def apply_fsdp1(model, cfg: TrainConfig, info, strategy: str) -> Prepared:
    """The same strategy through the FSDP1 class ``FullyShardedDataParallel(sharding_strategy=...)`` (notebook 04).

    Args:
        model, cfg, info: as for ``apply_full_shard``; ``cfg.options["wrap"]`` "block" uses
            ``ModuleWrapPolicy({Block})`` (one unit per block, like ``shard_model``), "model" none.
        strategy: one of ``strategies.FSDP_STRATEGIES``; HYBRID_SHARD gets the same 2-D mesh as FSDP2.

    FSDP1 flattens each unit's parameters into one ``FlatParameter`` and shards that (padded to a
    multiple of N); the optimizer sees the flat shards. On CPU ``device_id`` is the CPU device.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    opts = fsdp_options(cfg)
    kwargs = {}
    if strategy == "hybrid_shard":
        kwargs["device_mesh"] = fsdp_mesh(info, strategy, cfg.node_size)
    if cfg.precision == "mixed":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = ModuleWrapPolicy({Block}) if opts["wrap"] == "block" else None
    with warnings.catch_warnings():  # FSDP1 announces its own deprecation; the notebook says so in words
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[get_fsdp(strategy).fsdp1_name],
            device_id=info.device,
            auto_wrap_policy=policy,
            **kwargs,
        )
    optimizer = make_optimizer(wrapped.parameters(), cfg)
    report = {
        "library": "FSDP1 FullyShardedDataParallel",
        "fsdp1_name": get_fsdp(strategy).fsdp1_name,
        **opts,
        "flat_shard_numel": [p.numel() for p in wrapped.parameters()],
    }
    return Prepared(
        model=wrapped,
        optimizer=optimizer,
        full_state_dict=lambda: full_state_dict(wrapped),
        held=lambda: module_held(wrapped, optimizer),
        info=report,
    )


def _b(n) -> str:
    return "–" if n is None else f"{n:,.0f}"


def calls_text(comm: dict) -> str:
    """Collectives per step in short: "10 AG + 5 RS" (all-gather, reduce-scatter, all-reduce) (notebook 04)."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    return " + ".join(f"{v['calls']:g} {short.get(k, k)}" for k, v in comm.items()) or "none"


__all__ = [
    "OPTIONS",
    "fsdp_options",
    "fsdp_mesh",
    "set_prefetch",
    "mixed_precision_policy",
    "offload_policy",
    "shard_model",
    "UnshardedTracker",
    "full_state_dict",
    "full_state_dict_via_dtensor",
    "apply_full_shard",
    "apply_shard_grad_op",
    "apply_no_shard",
    "apply_hybrid_shard",
    "apply_fsdp1",
    "calls_text",
]
