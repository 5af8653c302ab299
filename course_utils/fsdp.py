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
- SHARD_GRAD_OP keeps each unit gathered from its forward to its backward: one all-gather fewer,
  and while a step runs the whole model is unsharded at once. FSDP2 reshards after the backward,
  so *at rest* it holds exactly what FULL_SHARD holds; stage 2's replicated 16-bit weights show
  up as the peak of gathered bytes during the step, not as bytes at rest.
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

Also here: ``UnshardedTracker`` (peak bytes of gathered parameters, on any device),
``expected_held_bytes`` / ``expected_collectives`` (what the formulas predict for a run),
``experiments_worker`` / ``run_experiments`` (many runs in one launch, the notebook's tables) and
``state_dict_round_trip`` / ``state_dict_demo`` (DCP sharded checkpoint, full state dict through
DTensor, and FSDP1's ``rank0_only`` pitfall).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from . import dist as cdist
from .data import batch_for_rank
from .errors import CourseInputError
from .instrument import CommCounter, held_bytes, weights_sha256
from .models import Block, build_model, get_config
from .train import Prepared, TrainConfig, make_optimizer, module_held, resolve_strategy

#: The four FSDP strategies of this module, in the order the notebook shows them.
FSDP_STRATEGIES = ("no_shard", "shard_grad_op", "full_shard", "hybrid_shard")

#: The FSDP1 ``ShardingStrategy`` member each strategy corresponds to (notebook 04).
FSDP1_NAMES = {"no_shard": "NO_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "full_shard": "FULL_SHARD",
               "hybrid_shard": "HYBRID_SHARD"}

#: ``fully_shard(reshard_after_forward=...)`` for each strategy (notebook 04).
RESHARD_AFTER_FORWARD = {"no_shard": False, "shard_grad_op": False, "full_shard": True, "hybrid_shard": True}

#: The row of the ZeRO memory table whose bytes each strategy holds (``memory.STAGES``) (notebook 04).
ZERO_ROW = {"single": "ddp", "no_shard": "ddp", "shard_grad_op": "zero2", "full_shard": "zero3",
            "hybrid_shard": "zero3"}

#: Accepted values of the strategy knobs in ``TrainConfig.options``; the first is the default.
OPTIONS = {"api": ("fsdp2", "fsdp1"), "wrap": ("block", "model", "linear"),
           "prefetch": ("default", "explicit", "none"), "offload": (False, True)}


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
        raise CourseInputError("api=fsdp1 is the mapping to older code: use it with wrap=block or wrap=model and "
                               "the default prefetch, without offload")
    if out["api"] == "fsdp1" and cfg.strategy == "hybrid_shard" and cfg.node_size == 1:
        # Measured on torch 2.13: FSDP1 then all-reduces over the one-rank shard group only, so the
        # replicas never average their gradients and silently drift apart.
        raise CourseInputError("FSDP1's HYBRID_SHARD with node_size 1 does not average gradients across nodes; "
                               "use node_size >= 2, or api=fsdp2 (or no_shard)")
    return out


# ---------------------------------------------------------------------------------------------
# Meshes, units, prefetching, policies
# ---------------------------------------------------------------------------------------------

def mesh_shape(strategy: str, nproc: int, node_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, names)`` of the device mesh a strategy shards over (notebook 04).

    full_shard and shard_grad_op shard over all N ranks: ``(N,)``. hybrid_shard shards inside
    nodes of n = ``node_size`` ranks and replicates across the N/n nodes: ``(N/n, n)``.
    no_shard is the 2-D mesh with shard size 1: ``(N, 1)``.
    """
    if strategy in ("full_shard", "shard_grad_op"):
        return (nproc,), ("shard",)
    if strategy == "no_shard":
        return (nproc, 1), ("replicate", "shard")
    if strategy == "hybrid_shard":
        if node_size < 1 or nproc % node_size:
            raise CourseInputError(
                f"hybrid_shard needs nproc ({nproc}) divisible by node_size ({node_size}); "
                "e.g. --nproc 4 --node-size 2 (2 nodes x 2 ranks)")
        return (nproc // node_size, node_size), ("replicate", "shard")
    raise CourseInputError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(FSDP_STRATEGIES)}")


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


def unit_modules(model: nn.Module, granularity: str = "block") -> list[nn.Module]:
    """The submodules that become their own FSDP unit, in forward order; the root is always one more (notebook 04).

    "model": none (one unit, the whole model). "block": each transformer block (the usual
    choice). "linear": each linear layer inside the blocks (the head is tied to the token
    embedding, so it stays with the root, like the LayerNorms).
    """
    if granularity == "model":
        return []
    if granularity == "block":
        return list(model.blocks)
    if granularity == "linear":
        return [m for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear)]
    raise CourseInputError(f"wrap must be one of {', '.join(OPTIONS['wrap'])}, got {granularity!r}")


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
        unit.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + depth])
        unit.set_modules_to_backward_prefetch(layers[max(0, i - depth):i][::-1])


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


def shard_model(model: nn.Module, mesh, *, reshard_after_forward: bool, granularity: str = "block",
                mp_policy=None, offload=None, prefetch: str = "default") -> list:
    """Apply ``fully_shard`` bottom-up: each unit module, then the root; return the units, root last (notebook 04).

    Args:
        model: the course model (same seed on every rank).
        mesh: from ``fsdp_mesh``: 1-D shards over it, 2-D shards over dim 1, replicates over dim 0.
        reshard_after_forward: True frees each unit after its forward (FULL_SHARD), False keeps
            it gathered until its backward (SHARD_GRAD_OP).
        granularity: what a unit is (``unit_modules``).
        mp_policy, offload: ``mixed_precision_policy`` / ``offload_policy`` results, or None.
        prefetch: ``set_prefetch`` mode.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload or OffloadPolicy())
    units = [fully_shard(m, **kwargs) for m in unit_modules(model, granularity)]
    units.append(fully_shard(model, **kwargs))
    set_prefetch(units, prefetch)
    return units


def unit_table(model: nn.Module, shard_size: int = 1, units: list[nn.Module] | None = None) -> list[dict]:
    """Each FSDP unit's parameters: ``[{"name", "numel", "padded"}]`` in forward order, the root last (notebook 04).

    ``units``: the unit modules below the root (default: the ``FSDPModule`` submodules of a
    model after ``shard_model``; pass ``unit_modules(...)`` to plan before sharding). A unit owns
    the parameters of its subtree that no other unit owns (a tied weight counts once). ``padded``:
    FSDP2 pads dim 0 of every parameter to a multiple of the shard size before splitting it, so
    an all-gather moves ``padded`` elements.
    """
    if units is None:
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    names = {id(m): n for n, m in model.named_modules()}
    seen, rows = set(), []
    for module in [*units, model]:  # units do not nest; whatever they leave belongs to the root
        numel = padded = 0
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            dim0 = p.shape[0] if p.dim() else 1
            numel += p.numel()
            padded += -(-dim0 // shard_size) * shard_size * (p.numel() // max(dim0, 1))
        rows.append({"name": names[id(module)] or "(root)", "numel": numel, "padded": padded})
    return rows


def planned_units(model: str = "tiny", granularity: str = "block", shard_size: int = 1) -> list[dict]:
    """``unit_table`` of the course model before any process starts: what a run will gather (notebook 04)."""
    gpt = _meta_model(model)
    return unit_table(gpt, shard_size, unit_modules(gpt, granularity))


def _meta_model(model: str) -> nn.Module:
    """The course model's structure, for counting (a CPU build: milliseconds, where the first
    meta-device build costs seconds of lazy imports); the global RNG is left as it was."""
    from .models import GPT

    with torch.random.fork_rng(devices=[]):
        return GPT(get_config(model))


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


class UnshardedTracker:
    """The largest bytes of gathered (full-size) parameters alive at once during a step (notebook 04).

    This is what FULL_SHARD saves over SHARD_GRAD_OP. On a GPU ``torch.cuda.max_memory_allocated``
    sees it (mixed in with everything else); on CPU there is no allocator peak to read, so this
    counts it directly: before and after every leaf module's forward, and when the gradient of a
    leaf's output arrives in backward (just before that leaf's backward runs), it adds up the
    full-size bytes of every unit that is gathered at that moment, or whose prefetched
    all-gather has landed and waits to be used. ``peak`` is the largest sum seen.

    The gathered state is read from FSDP2's per-unit parameter group (``is_unsharded``, the
    pending all-gather): private attributes, checked against torch 2.13.

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
        self.handles = []
        for m in model.modules():
            if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None:
                self.handles.append(m.register_forward_pre_hook(lambda *_: self.sample()))
                self.handles.append(m.register_forward_hook(self._after_forward))

    def _group_bytes(self, group) -> int:
        if id(group) not in self._bytes:  # the working dtype is settled at FSDP's lazy init
            self._bytes[id(group)] = sum(fp._orig_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
                                         for fp in group.fsdp_params)
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

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def expected_peak_unsharded_bytes(units: list[dict], strategy: str, prefetch: str = "default",
                                  bytes_per_element: int = 4) -> int:
    """The peak of gathered parameter bytes the schedule predicts, from the unit sizes (notebook 04).

    The root unit (embeddings, final norm, head) is gathered through the whole forward and again
    through the whole backward. SHARD_GRAD_OP and NO_SHARD keep every unit gathered from its
    forward to its backward: at the end of the forward the whole model is gathered. FULL_SHARD
    and HYBRID_SHARD hold the root plus the unit computing plus the unit being prefetched, its
    neighbour in execution order (FSDP2 prefetches one unit ahead in backward by default;
    "explicit" also in forward; "none" never): root + the largest pair of neighbouring units, or
    root + the largest unit without prefetching. ``units``: ``unit_table`` rows in forward order.
    """
    root = sum(u["numel"] for u in units if u["name"] == "(root)")
    others = [u["numel"] for u in units if u["name"] != "(root)"]
    if strategy in ("shard_grad_op", "no_shard") or not others:
        working = sum(others)
    elif prefetch == "none" or len(others) == 1:
        working = max(others)
    else:
        working = max(a + b for a, b in zip(others, others[1:]))
    return (root + working) * bytes_per_element


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
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _apply_fsdp(model, cfg: TrainConfig, info, strategy: str) -> Prepared:
    opts = fsdp_options(cfg)
    if opts["api"] == "fsdp1":
        return apply_fsdp1(model, cfg, info, strategy)
    mesh = fsdp_mesh(info, strategy, cfg.node_size)
    mp = mixed_precision_policy(cfg)
    units = shard_model(model, mesh, reshard_after_forward=RESHARD_AFTER_FORWARD[strategy],
                        granularity=opts["wrap"], mp_policy=mp, offload=offload_policy(opts["offload"], info.device),
                        prefetch=opts["prefetch"])
    optimizer = make_optimizer(model.parameters(), cfg)  # after sharding: over this rank's DTensor shards
    report = {"library": "FSDP2 fully_shard", "fsdp1_name": FSDP1_NAMES[strategy],
              "mesh": {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names)},
              "reshard_after_forward": RESHARD_AFTER_FORWARD[strategy], **opts,
              "compute_bytes_per_element": 2 if mp else 4,
              "units": unit_table(model, mesh.shape[-1]), "peak_unsharded_bytes": 0}
    tracker = UnshardedTracker(model, report)
    report["tracker_units"] = len(tracker.units)
    return Prepared(model=model, optimizer=optimizer, full_state_dict=lambda: full_state_dict(model),
                    held=lambda: module_held(model, optimizer), info=report)


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
    end of the forward; at rest FSDP2 keeps 16Ψ/N, as FULL_SHARD does.
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
        strategy: one of ``FSDP1_NAMES``; HYBRID_SHARD gets the same 2-D mesh as FSDP2.

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
        wrapped = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[FSDP1_NAMES[strategy]],
                                           device_id=info.device, auto_wrap_policy=policy, **kwargs)
    optimizer = make_optimizer(wrapped.parameters(), cfg)
    report = {"library": "FSDP1 FullyShardedDataParallel", "fsdp1_name": FSDP1_NAMES[strategy], **opts,
              "flat_shard_numel": [p.numel() for p in wrapped.parameters()]}
    return Prepared(model=wrapped, optimizer=optimizer, full_state_dict=lambda: full_state_dict(wrapped),
                    held=lambda: module_held(wrapped, optimizer), info=report)


# ---------------------------------------------------------------------------------------------
# What the formulas predict for a run
# ---------------------------------------------------------------------------------------------

def zero_nd(strategy: str, nproc: int, node_size: int = 2) -> int:
    """Nd of the ZeRO row a strategy's bytes follow: N, except HSDP shards over a node of n (notebook 04)."""
    return {"single": 1, "hybrid_shard": node_size}.get(strategy, nproc)


def expected_held_bytes(strategy: str, psi: int, nproc: int, node_size: int = 2) -> dict:
    """Bytes of parameters, gradients and Adam state one rank holds at rest, by the ZeRO table (notebook 04).

    FSDP2 keeps fp32 parameters and gradients and fp32 Adam moments, whatever the compute
    precision (bf16 is only the gathered working copy): 4 + 4 + K = 8 bytes per parameter, the
    ``memory.OPTIMIZERS["adam_fp32"]`` bill. Sharded parts divide by Nd (``zero_nd``):

    - single, no_shard: the plain-DP row, 16Ψ;
    - full_shard, hybrid_shard: stage 3, 16Ψ/Nd;
    - shard_grad_op: stage 3's bytes at rest as well (FSDP2 reshards after backward); stage 2's
      extra 4Ψ of whole weights appears only during the step (``expected_peak_unsharded_bytes``).

    Exact per rank when every parameter's dim 0 divides by Nd; otherwise the ranks' sum is exact
    (FSDP2's local shards exclude the padding).
    """
    from .memory import OPTIMIZERS, model_state_bytes

    bill = OPTIMIZERS["adam_fp32"]
    nd = zero_nd(strategy, nproc, node_size)
    row = "zero3" if strategy in ("full_shard", "shard_grad_op", "hybrid_shard") else "ddp"
    sharded = 1 / nd if row == "zero3" else 1.0
    out = {"params": bill.weight_bytes * psi * sharded, "grads": bill.grad_bytes * psi * sharded,
           "optim": bill.k * psi * sharded}
    out["total"] = model_state_bytes(psi, nd, row, k=bill.k, weight_bytes=bill.weight_bytes,
                                     grad_bytes=bill.grad_bytes)
    return out


def _ring(kind: str, n: int) -> float:
    from .instrument import RING_FACTOR

    return RING_FACTOR[kind](n)


def expected_collectives(strategy: str, units: list[dict], nproc: int, node_size: int = 2, *,
                         param_bytes: int = 4, grad_bytes: int = 4) -> dict:
    """Collectives one rank issues per step, predicted from the units: ``{kind: {calls, payload_bytes,
    sent_bytes, group}}``, the shape of ``CommCounter.summary`` plus the group size (notebook 04).

    With U units of ``padded`` elements (``unit_table(model, shard_size)``) summing to Ψ':

    - full_shard: 2U all-gathers of Ψ' (params), U reduce-scatters of Ψ' (grads), group N;
      3(N-1)/N·Ψ' elements sent per rank;
    - shard_grad_op: U all-gathers, U reduce-scatters: 2(N-1)/N·Ψ', as DDP;
    - no_shard: U all-reduces of Ψ' gradients over N ranks: 2(N-1)/N·Ψ';
    - hybrid_shard: full_shard's collectives inside a node (group n), plus U all-reduces of
      the reduce-scattered Ψ'/n elements across the N/n nodes.

    ``param_bytes``: bytes per gathered element (2 under bf16 mixed precision); ``grad_bytes``:
    per reduced element (4: the reduction stays fp32).
    """
    u = len(units)
    psi = sum(r["padded"] for r in units)
    n = node_size if strategy == "hybrid_shard" else nproc
    rows = {}
    if strategy in ("full_shard", "hybrid_shard", "shard_grad_op"):
        gathers = 2 if strategy != "shard_grad_op" else 1
        rows["all_gather"] = (gathers * u, gathers * psi * param_bytes, n)
        rows["reduce_scatter"] = (u, psi * grad_bytes, n)
        if strategy == "hybrid_shard":  # FSDP2 all-reduces over the replicate dimension, even a group of one
            rows["all_reduce"] = (u, psi // n * grad_bytes, nproc // node_size)
    elif strategy == "no_shard":
        rows["all_reduce"] = (u, psi * grad_bytes, nproc)
    else:
        raise CourseInputError(f"unknown FSDP strategy {strategy!r}; choose one of {', '.join(FSDP_STRATEGIES)}")
    if n == 1:  # nothing to gather or scatter in a group of one
        rows.pop("all_gather", None)
        rows.pop("reduce_scatter", None)
    return {kind: {"calls": float(calls), "payload_bytes": float(payload),
                   "sent_bytes": _ring(kind, group) * payload, "group": group}
            for kind, (calls, payload, group) in sorted(rows.items())}


def predict(strategy: str, *, model: str = "tiny", nproc: int, node_size: int = 2, wrap: str = "block",
            prefetch: str = "default", precision: str = "fp32") -> dict:
    """Everything the formulas say about one run before it starts (notebook 04).

    Returns ``{"units", "held", "comm", "peak"}``: the units (``planned_units``, padded for this
    strategy's shard size), bytes held per rank at rest (``expected_held_bytes``), collectives
    per step (``expected_collectives``; bf16 gathers under mixed precision) and the peak of
    gathered parameter bytes (``expected_peak_unsharded_bytes``). For "single" only ``held``.
    """
    from .models import param_count

    held = expected_held_bytes(strategy, param_count(model), nproc, node_size)
    if strategy == "single":
        return {"units": [], "held": held, "comm": {}, "peak": None}
    shard = mesh_shape(strategy, nproc, node_size)[0][-1]
    units = planned_units(model, wrap, shard)
    w = 2 if precision == "mixed" else 4
    return {"units": units, "held": held,
            "comm": expected_collectives(strategy, units, nproc, node_size, param_bytes=w, grad_bytes=4),
            "peak": expected_peak_unsharded_bytes(units, strategy, prefetch, w)}


def _b(n) -> str:
    return "–" if n is None else f"{n:,.0f}"


def calls_text(comm: dict) -> str:
    """Collectives per step in short: "10 AG + 5 RS" (all-gather, reduce-scatter, all-reduce) (notebook 04)."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    return " + ".join(f"{v['calls']:g} {short.get(k, k)}" for k, v in comm.items()) or "none"


def comm_matches(row: dict, expected: dict) -> bool:
    """True if a run's collectives are the predicted ones: same kinds, calls, payload bytes and group
    sizes, and ring bytes sent equal up to float rounding (notebook 04)."""
    measured = row["comm_per_step"]
    if set(measured) != set(expected):
        return False
    for kind, e in expected.items():
        m = measured[kind]
        if (m["calls"], m["payload_bytes"]) != (e["calls"], e["payload_bytes"]):
            return False
        if abs(m["sent_bytes"] - e["sent_bytes"]) > 1e-9 * max(1.0, e["sent_bytes"]):
            return False
        if "comm_groups" in row and row["comm_groups"].get(kind) != [e["group"]]:
            return False
    return True


def side_by_side_table(rows: list, *, nproc: int, node_size: int) -> tuple[list, list]:
    """``(header, rows)`` of the notebook's strategy table, measured with predicted beside it (notebook 04).

    For each run: the FSDP1 name, rank 0's bytes at rest (measured / ZeRO row), peak gathered
    bytes (measured / schedule), collectives per step (AG all-gather, RS reduce-scatter, AR
    all-reduce), bytes sent per step by one rank, step time, final loss and the distance to single.
    """
    header = ["run", "FSDP1 name", "held per rank, B", "ZeRO row, B", "peak gathered, B", "predicted, B",
              "collectives / step", "sent / step, B", "step time, ms", "final loss", "‖Δw‖/‖w‖ vs single"]
    out = []
    for r in rows:
        cfg = r["config"]
        p = predict(r["strategy"], model=cfg["model"], nproc=nproc, node_size=node_size,
                    wrap=r["options"].get("wrap", "block"), prefetch=r["options"].get("prefetch", "default"),
                    precision=r["precision"])
        sent = sum(v["sent_bytes"] for v in r["comm_per_step"].values())
        out.append([r["label"], r["strategy_info"].get("fsdp1_name", "–"), _b(r["per_rank"][0]["total"]),
                    _b(p["held"]["total"]), _b(r["peak_unsharded_bytes"][0]), _b(p["peak"]),
                    calls_text(r["comm_per_step"]), _b(sent), f"{r['step_time_s'] * 1e3:.0f}", f"{r['losses'][-1]:.5f}",
                    f"{r['rel_weight_diff']:.1e}" if "rel_weight_diff" in r else "–"])
    return header, out


def _largest_unit(r) -> int | None:
    units = r["strategy_info"].get("units")
    return max(u["numel"] for u in units) * r["strategy_info"]["compute_bytes_per_element"] if units else None


#: Columns ``measurements_table`` can show: header -> cell from a run row (notebook 04).
COLUMNS = {
    "units": lambda r: str(len(r["strategy_info"].get("units", [])) or "–"),
    "collectives / step": lambda r: calls_text(r["comm_per_step"]),
    "largest unit, B": lambda r: _b(_largest_unit(r)),
    "peak gathered, B": lambda r: _b(r["peak_unsharded_bytes"][0]),
    "held per rank, B": lambda r: _b(r["per_rank"][0]["total"]),
    "held where": lambda r: ", ".join(f"{k}: {v:,}" for k, v in r["held_by_device"].items()),
    "all-gather payload, B": lambda r: _b(r["comm_per_step"].get("all_gather", {}).get("payload_bytes")),
    "reduce-scatter payload, B": lambda r: _b(r["comm_per_step"].get("reduce_scatter", {}).get("payload_bytes")),
    "sent / step, B": lambda r: _b(sum(v["sent_bytes"] for v in r["comm_per_step"].values())),
    ".item() every step": lambda r: "yes" if r["sync_every_step"] else "no",
    "step time, ms": lambda r: f"{r['step_time_s'] * 1e3:.1f}",
    "final loss": lambda r: f"{r['losses'][-1]:.5f}",
    "‖Δw‖/‖w‖ vs single": lambda r: f"{r['rel_weight_diff']:.1e}" if "rel_weight_diff" in r else "–",
    "GPU max allocated, B": lambda r: _b(r["max_memory_allocated"][0]),
}


def measurements_table(rows: list, columns: list[str]) -> tuple[list, list]:
    """``(header, rows)`` with the named ``COLUMNS`` for each run, labelled (notebook 04)."""
    return ["run", *columns], [[r["label"], *(COLUMNS[c](r) for c in columns)] for r in rows]


# ---------------------------------------------------------------------------------------------
# Many runs in one launch: the notebook's side-by-side tables
# ---------------------------------------------------------------------------------------------

#: Keys of a run description that are not ``TrainConfig`` fields.
RUN_KEYS = ("label", "sync_every_step", "cross_check", "kind", "run_dir")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _comm_debug_summary(counts: dict, steps: int) -> dict:
    kinds = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
             "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
    out: dict = {}
    for op, calls in counts.items():
        kind = kinds.get(str(op).split(".")[-1])
        if kind:
            out[kind] = out.get(kind, 0) + calls / steps
    return dict(sorted(out.items()))


def run_one(cfg: TrainConfig, info, *, sync_every_step: bool = True, cross_check: bool = False) -> dict:
    """Train one configuration on the ranks of an open session and measure it (notebook 04).

    The loop of ``train.train_worker`` (same model, data, optimizer, strategy function), with
    what the FSDP notebook adds: peak gathered bytes on every rank, the group size of every
    collective, ``torch.cuda.max_memory_allocated`` on a GPU, an optional CommDebugMode count
    (``cross_check``), and ``sync_every_step``: read the loss with ``.item()`` every step (the
    forced synchronisation of the overlap section) or only once at the end. ``step_time_s`` is
    the wall time from the end of step 1 to the end of the last step, device synchronised, per
    step. Strategy "single" runs on rank 0 only (the one-process reference, whole global batch)
    with this rank's CPU threads; the other ranks wait. (A one-process ``train`` gets all the
    cores, and more threads add up a matmul in a different order: the two agree within
    ``TOLERANCE``, not bit for bit.) Returns rank 0's row (other ranks: None).
    """
    single = cfg.strategy == "single"
    if single and info.rank != 0:
        return None
    rank, world = (0, 1) if single else (info.rank, info.world_size)
    return _run_one(cfg, info, rank, world, single, sync_every_step, cross_check)


def _run_one(cfg, info, rank, world, single, sync_every_step, cross_check):
    if cross_check:  # imported only when asked: it pulls in torch._dynamo (seconds per process)
        from torch.distributed.tensor.debug import CommDebugMode
    mcfg = get_config(cfg.model)
    model = build_model(mcfg, seed=cfg.seed, device=info.device)
    prepared = resolve_strategy(cfg.strategy)(model, cfg, info)
    comm, debug_counts = CommCounter(), {}
    losses, held = [], None
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    with comm:
        for step in range(cfg.steps):
            if step == min(1, cfg.steps - 1):
                _synchronize(info.device)
                t0 = time.perf_counter()
            x, y = batch_for_rank(step, rank, world, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab,
                                  seed=cfg.seed, device=info.device)
            debug = CommDebugMode() if cross_check else contextlib.nullcontext()
            with debug:  # CommDebugMode tracks modules too: one forward and backward per entry
                loss = prepared.model(x, y)
                loss.backward()
                prepared.before_step()
                prepared.optimizer.step()
            if cross_check:
                for op, calls in debug.get_comm_counts().items():
                    debug_counts[op] = debug_counts.get(op, 0) + calls
            if step == cfg.steps - 1:
                comm.paused = True
                held = held_bytes(*prepared.held())
                where = held_by_device(*prepared.held())
                comm.paused = False
            prepared.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if sync_every_step:
                losses[-1].item()  # the forced synchronisation: the host waits for the device
        _synchronize(info.device)
        elapsed = time.perf_counter() - t0
    timed_steps = max(1, cfg.steps - min(1, cfg.steps - 1))
    losses = torch.stack(losses).float()
    if not single:
        dist.all_reduce(losses)  # equal per-rank batches: the mean of rank means is the global mean
        losses /= world
    full = prepared.full_state_dict()
    groups: dict = {}
    for kind, _, n in comm.events:
        groups.setdefault(kind, set()).add(n)
    mine = {"rank": rank, **held, "where": where, "peak_unsharded_bytes": prepared.info.get("peak_unsharded_bytes"),
            "max_memory_allocated": torch.cuda.max_memory_allocated(info.device) if info.device.type == "cuda" else None,
            "step_time_s": elapsed / timed_steps}
    everyone = [mine]
    if not single:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if info.rank != 0:
        return None
    return {
        "strategy": cfg.strategy, "world_size": world, "device": info.device.type, "options": dict(cfg.options),
        "precision": cfg.precision,
        "losses": losses.cpu().tolist(), "weights_sha256": weights_sha256(full),
        "full_state_dict": {k: v.detach().to("cpu", torch.float32) for k, v in full.items()},
        "per_rank": [{k: row[k] for k in ("rank", "params", "grads", "optim", "total")} for row in everyone],
        "held_by_device": everyone[0]["where"],
        "comm_per_step": comm.summary(cfg.steps), "comm_groups": {k: sorted(v) for k, v in groups.items()},
        "comm_debug_per_step": _comm_debug_summary(debug_counts, cfg.steps) if cross_check else None,
        "peak_unsharded_bytes": [row["peak_unsharded_bytes"] for row in everyone],
        "max_memory_allocated": [row["max_memory_allocated"] for row in everyone],
        "step_time_s": max(row["step_time_s"] for row in everyone), "sync_every_step": sync_every_step,
        "strategy_info": {k: v for k, v in prepared.info.items() if k != "peak_unsharded_bytes"},
        "config": asdict(cfg),
    }


def held_by_device(params, grads, optim) -> dict:
    """Bytes held at rest by device type: ``{"cpu": ..., "cuda": ...}`` (what CPU offload moves) (notebook 04)."""
    from .instrument import tensor_bytes

    out: dict = {}
    for t in [*params, *grads, *optim]:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            out[local.device.type] = out.get(local.device.type, 0) + tensor_bytes([t])
    return out


def weight_diff(a: dict, b: dict) -> dict:
    """How far two full state dicts (same keys) are apart: ``{"max_abs", "relative"}`` (notebook 04).

    ``relative`` is ‖a − b‖ / ‖b‖ over all weights together (b is the reference).
    """
    if set(a) != set(b):
        raise CourseInputError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))[:4]}")
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return {"max_abs": max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
            "relative": (num / den) ** 0.5 if den else 0.0}


#: How close a run must end to the one-process reference (notebook 04). In fp32 the only
#: difference is the order of additions: N ranks each sum their part of the batch and the parts
#: are then summed, so gradients differ in their last bits (relative ~1e-7), and Adam, which
#: divides each gradient by its own running RMS, passes such differences on to the weights
#: even where the gradient itself is tiny. The limits sit a decade or more above what fp32
#: reordering gives here and a decade or more below what a real change of arithmetic gives
#: (bf16 working weights, the "mixed" row of the notebook): relative loss difference per step,
#: and ‖w − w_single‖ / ‖w_single‖ over all final weights.
TOLERANCE = {"fp32": {"loss_rel": 1e-6, "weight_rel": 1e-4}, "mixed": {"loss_rel": 1e-3, "weight_rel": 3e-2}}


def trains_like_single(row: dict) -> bool:
    """True if a run's losses and final weights are within ``TOLERANCE`` of the reference's (notebook 04)."""
    tol = TOLERANCE[row.get("precision", "fp32")]
    return row["max_loss_rel_diff"] <= tol["loss_rel"] and row["rel_weight_diff"] <= tol["weight_rel"]


def experiments_worker(runs: list[dict]) -> list[dict] | None:
    """Run several configurations in one launch; rank 0 returns one row per run (notebook 04).

    Each run is a dict of ``TrainConfig`` fields plus ``label``, ``sync_every_step`` and
    ``cross_check`` (see ``run_one``); a run with ``kind="state_dict"`` and a ``run_dir`` runs
    ``state_dict_round_trip`` instead and its row is that report. If a "single" run comes first, every later row gets
    ``max_weight_diff``, ``rel_weight_diff`` (``weight_diff`` of the full fp32 weights, on rank 0)
    and ``max_loss_rel_diff`` (largest relative difference of a step's loss) against it.
    """
    rows, reference = [], None
    with cdist.session() as info:
        for i, run in enumerate(runs):
            extra = {k: run[k] for k in RUN_KEYS if k in run}
            cfg = TrainConfig(**{k: v for k, v in run.items() if k not in RUN_KEYS})
            cfg.nproc = 1 if cfg.strategy == "single" else info.world_size
            cfg.validate()
            if extra.get("kind") == "state_dict":
                Path(extra["run_dir"]).mkdir(parents=True, exist_ok=True)
                row = state_dict_round_trip(cfg, info, extra["run_dir"])
            else:
                row = run_one(cfg, info, sync_every_step=extra.get("sync_every_step", True),
                              cross_check=extra.get("cross_check", False))
            cdist.report_progress(i + 1, len(runs), run=extra.get("label", cfg.strategy))
            if info.rank != 0:
                continue
            row["label"] = extra.get("label", cfg.strategy)
            if cfg.strategy == "single" and reference is None:
                reference = row
            if reference is not None and "full_state_dict" in row:
                diff = weight_diff(row["full_state_dict"], reference["full_state_dict"])
                row["max_weight_diff"], row["rel_weight_diff"] = diff["max_abs"], diff["relative"]
                row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference["losses"]))
            rows.append(row)
        dist.barrier()
    if info.rank != 0:
        return None
    for row in rows:
        row.pop("full_state_dict", None)
    return rows


def run_experiments(runs: list[dict], *, nproc: int, backend: str = "auto", timeout_s: float = 300.0) -> list[dict]:
    """Launch ``experiments_worker`` once on ``nproc`` processes and return its rows (notebook 04).

    Every run is validated here first, so a bad setting fails before anything starts.
    """
    from .launch import launch

    for run in runs:
        fields = {k: v for k, v in run.items() if k not in RUN_KEYS}
        strategy = fields.get("strategy", "single")
        cfg = TrainConfig(**{**fields, "nproc": 1 if strategy == "single" else nproc}).validate()
        if strategy in FSDP_STRATEGIES:
            fsdp_options(cfg)
    result = launch(experiments_worker, nproc=nproc, args=(list(runs),), backend=backend, timeout_s=timeout_s,
                    echo=False)
    return result[0]


# ---------------------------------------------------------------------------------------------
# State dicts: DCP sharded checkpoint, full state dict via DTensor, FSDP1's rank0_only pitfall
# ---------------------------------------------------------------------------------------------

def _train_steps(prepared, cfg: TrainConfig, info, steps: range) -> list[float]:
    mcfg = get_config(cfg.model)
    out = []
    for step in steps:
        x, y = batch_for_rank(step, info.rank, info.world_size, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab,
                              seed=cfg.seed, device=info.device)
        loss = prepared.model(x, y)
        loss.backward()
        prepared.optimizer.step()
        prepared.optimizer.zero_grad(set_to_none=True)
        out.append(float(loss))
    return out


def _fresh(cfg: TrainConfig, info, strategy: str, seed_offset: int = 1) -> Prepared:
    """A newly sharded model with *different* weights, so that a load that did nothing is caught."""
    model = build_model(cfg.model, seed=cfg.seed + seed_offset, device=info.device)
    return resolve_strategy(strategy)(model, cfg, info)


def _optimizer_locals(optimizer) -> list[torch.Tensor]:
    out = []
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        for key in sorted(optimizer.state[p]):
            v = optimizer.state[p][key]
            out.append((v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone())
    return out


def _files(folder: Path) -> list[dict]:
    return [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(folder.iterdir()) if f.is_file()]


def state_dict_round_trip(cfg: TrainConfig, info, run_dir: str) -> dict:
    """Save and load FSDP state three ways, on every rank of an open session; rank 0 reports (notebook 04).

    1. Full state dict: ``get_model_state_dict(full_state_dict=True)`` against ``full_tensor()``
       on each DTensor; rank 0 saves it (``torch.save``); a plain unsharded model and a freshly
       sharded one load it (``set_model_state_dict(broadcast_from_rank0=True)``).
    2. Sharded checkpoint: ``get_state_dict`` + ``torch.distributed.checkpoint.save`` (each rank
       writes its own shards, rank 0 the ``.metadata``), then ``dcp.load`` + ``set_state_dict``
       into a fresh model and optimizer; one more step on both must agree bit for bit.
    3. FSDP1's ``full_optim_state_dict(rank0_only=True)``: every rank writes what it got to a
       file; only rank 0's holds the optimizer state. The new API's ``cpu_offload=True`` does
       the same.

    ``cfg.strategy`` is the FSDP2 strategy trained for ``cfg.steps`` steps. Files go under
    ``run_dir`` only (a fresh folder per call: DCP must never reuse one).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         get_state_dict, set_model_state_dict, set_state_dict)

    root = Path(run_dir)
    out: dict = {"world_size": info.world_size, "run_dir": str(root)}
    prepared = resolve_strategy(cfg.strategy)(build_model(cfg.model, cfg.seed, info.device), cfg, info)
    _train_steps(prepared, cfg, info, range(cfg.steps))
    model, optimizer = prepared.model, prepared.optimizer

    # 1. the full state dict, two ways, and loading it back
    via_api, via_dtensor = full_state_dict(model), full_state_dict_via_dtensor(model)
    out["full_keys_match_model"] = sorted(via_api) == sorted(_meta_model(cfg.model).state_dict())
    out["full_dtensor_equals_api"] = all(torch.equal(via_api[k], via_dtensor[k]) for k in via_api)
    out["trained_sha"] = weights_sha256(via_api)
    full_path = root / "full_state_dict.pt"
    if info.rank == 0:
        torch.save({k: v.cpu() for k, v in via_api.items()}, full_path)
    dist.barrier()
    if info.rank == 0:
        plain = build_model(cfg.model, seed=cfg.seed + 1)
        plain.load_state_dict(torch.load(full_path, weights_only=True))
        out["full_into_plain_sha"] = weights_sha256(plain.state_dict())
        out["full_file_bytes"] = full_path.stat().st_size
    fresh = _fresh(cfg, info, cfg.strategy)
    out["fresh_sha_before_load"] = weights_sha256(full_state_dict(fresh.model))
    loaded = torch.load(full_path, weights_only=True) if info.rank == 0 else {}
    set_model_state_dict(fresh.model, loaded, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
    out["full_into_sharded_sha"] = weights_sha256(full_state_dict(fresh.model))

    # 2. the sharded checkpoint (DCP), into a fresh model and optimizer, then one more step on both
    ckpt = root / f"dcp-step-{cfg.steps}"
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    resumed = _fresh(cfg, info, cfg.strategy, seed_offset=2)
    msd2, osd2 = get_state_dict(resumed.model, resumed.optimizer)  # creates the optimizer state to load into
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ckpt))
    set_state_dict(resumed.model, resumed.optimizer, model_state_dict=msd2, optim_state_dict=osd2)
    out["dcp_files"] = _files(ckpt) if info.rank == 0 else None
    out["dcp_weights_equal"] = weights_sha256(full_state_dict(resumed.model)) == out["trained_sha"]
    mine = [torch.equal(a, b) for a, b in zip(_optimizer_locals(optimizer), _optimizer_locals(resumed.optimizer))]
    flags = [None] * info.world_size
    dist.all_gather_object(flags, bool(mine) and all(mine))
    out["dcp_optimizer_equal"] = all(flags)
    nxt = range(cfg.steps, cfg.steps + 1)
    out["next_loss_original"] = _train_steps(prepared, cfg, info, nxt)
    out["next_loss_resumed"] = _train_steps(resumed, cfg, info, nxt)
    out["next_step_equal"] = (weights_sha256(full_state_dict(model))
                              == weights_sha256(full_state_dict(resumed.model)))

    # 3. FSDP1: full_optim_state_dict(rank0_only=True), written by every rank
    old = _fresh(TrainConfig(**{**asdict(cfg), "options": {"api": "fsdp1"}}), info, "full_shard", seed_offset=0)
    _train_steps(old, cfg, info, range(2))
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        osd_old = FullyShardedDataParallel.full_optim_state_dict(old.model, old.optimizer, rank0_only=True)
    path = root / f"optim_full_rank{info.rank}.pt"
    torch.save(osd_old, path)
    osd_new = get_optimizer_state_dict(old.model, old.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    mine = {"rank": info.rank, "file": path.name, "file_bytes": path.stat().st_size,
            "params_with_state": len(torch.load(path, weights_only=False).get("state", {})),
            "new_api_params_with_state": len(osd_new.get("state", {}))}
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    out["rank0_only_files"] = everyone
    dist.barrier()
    return out


def state_dict_demo(cfg: TrainConfig | None = None, *, nproc: int, run_dir: str, backend: str = "auto",
                    timeout_s: float = 300.0, **overrides) -> dict:
    """Launch ``state_dict_round_trip`` alone on ``nproc`` processes; files go under ``run_dir`` (notebook 04)."""
    cfg = TrainConfig(**{**asdict(cfg or TrainConfig(strategy="full_shard")), **overrides})
    run = {**asdict(cfg), "kind": "state_dict", "run_dir": str(run_dir), "label": "state dicts"}
    return run_experiments([run], nproc=nproc, backend=backend, timeout_s=timeout_s)[0]


__all__ = [
    "FSDP_STRATEGIES", "FSDP1_NAMES", "RESHARD_AFTER_FORWARD", "ZERO_ROW", "OPTIONS", "fsdp_options",
    "mesh_shape", "fsdp_mesh", "unit_modules", "set_prefetch", "mixed_precision_policy", "offload_policy",
    "shard_model", "unit_table", "UnshardedTracker", "expected_peak_unsharded_bytes", "full_state_dict",
    "full_state_dict_via_dtensor", "apply_full_shard", "apply_shard_grad_op", "apply_no_shard",
    "apply_hybrid_shard", "apply_fsdp1", "zero_nd", "expected_held_bytes", "expected_collectives",
    "planned_units", "predict", "calls_text", "comm_matches", "side_by_side_table", "COLUMNS", "measurements_table", "TOLERANCE", "trains_like_single", "run_one", "held_by_device", "weight_diff", "experiments_worker", "run_experiments",
    "state_dict_round_trip", "state_dict_demo",
]


# ---------------------------------------------------------------- FSDP2's own defaults, measured (notebook 03)

def fsdp2_facts(config: dict) -> dict | None:
    """What FSDP2 (``fully_shard``) does that the hand-built stage 3 does not, measured (collective; notebook 03).

    1. The root unit. Each block gets ``fully_shard`` with the default ``reshard_after_forward=None``
       (True for a non-root module); the root once with the default (None: False for the root, so
       it stays gathered from forward to backward and is not all-gathered again) and once with
       True (as the hand-built ``Zero3Module`` does). Collectives are counted by ``CommCounter``
       over the steps after the first.
    2. Per-parameter sharding. Every parameter becomes a DTensor sharded on dim 0 (no flat
       buffer): the placements, and the local and global shapes of one weight.
    3. Gradient-norm clipping across shards: the global L2 norm of the gradient, computed by
       hand (each rank's sum of squares of its shards, one all-reduce, a square root), by
       ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware), from one rank's shards alone (wrong),
       and by one process on the whole batch (the reference); then the gradient clipped by hand
       to half that norm, gathered whole, against the reference clipped the same way.
    Rank 0 returns the facts; other ranks None.
    """
    from contextlib import nullcontext

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    cfg = TrainConfig(**config).validate()
    mcfg = get_config(cfg.model)
    with cdist.session() as info:
        mesh = fsdp_mesh(info, "full_shard")
        batches = [batch_for_rank(step, info.rank, info.world_size, batch=cfg.batch, seq=mcfg.seq,
                                  vocab=mcfg.vocab, seed=cfg.seed, device=info.device) for step in range(cfg.steps)]
        out = {"comm": {}}
        for root in ("default", "reshard"):
            model = build_model(mcfg, seed=cfg.seed, device=info.device)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh, **({} if root == "default" else {"reshard_after_forward": True}))
            optimizer = make_optimizer(model.parameters(), cfg)
            comm = CommCounter()
            for step, (x, y) in enumerate(batches):
                with comm if step else nullcontext():  # step 0 includes lazy initialisation
                    model(x, y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            out["comm"][root] = comm.summary(max(1, cfg.steps - 1))
        # 2. per-parameter sharding, read from the last model
        params = dict(model.named_parameters())
        out["all_dtensor_shard0"] = all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
                                        for p in params.values())
        name = "blocks.0.attn.qkv.weight"
        out["example"] = {"name": name, "global": tuple(params[name].shape),
                          "local": tuple(params[name].to_local().shape)}
        out["root_params"] = sum(p.numel() for n, p in params.items() if not n.startswith("blocks."))
        # 3. clipping across shards, on a fresh model's first gradient
        model = build_model(mcfg, seed=cfg.seed, device=info.device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(*batches[0]).backward()
        grads = [p.grad for p in model.parameters()]
        local_sq = torch.stack([g.to_local().double().pow(2).sum() for g in grads]).sum()
        alone = float(local_sq.sqrt())
        dist.all_reduce(local_sq)
        by_hand = float(local_sq.sqrt())
        by_torch = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        by_torch = float(by_torch.full_tensor() if isinstance(by_torch, DTensor) else by_torch)
        for g in grads:  # clip to half the norm, each rank on its own shards
            g.to_local().mul_(0.5)
        clipped = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
        if info.rank != 0:
            return None
        ref = build_model(mcfg, seed=cfg.seed, device=info.device)
        x, y = batch_for_rank(0, 0, 1, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed,
                              device=info.device)
        ref(x, y).backward()
        ref_norm = float(torch.stack([p.grad.double().pow(2).sum() for p in ref.parameters()]).sum().sqrt())
        worst = max(float((clipped[n] - 0.5 * p.grad.double()).abs().max()) for n, p in ref.named_parameters())
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        out.update(norm_by_hand=by_hand, norm_by_torch=by_torch, norm_one_rank_alone=alone,
                   norm_one_process=ref_norm, clipped_rel_error=worst / scale)
        return out
