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
  step, except the root, which ``fully_shard``'s default keeps gathered from its forward to its
  backward (2U - 1 all-gathers): (3Ψ - Ψ_root)(N-1)/N elements sent per rank, the ZeRO paper's 1.5x
  less the root's second gather.
- SHARD_GRAD_OP keeps each unit gathered from its forward to its backward: one all-gather fewer
  (stage 2's traffic), and while a step runs the whole model is unsharded at once. FSDP2 reshards
  after the backward, so *at rest* it holds exactly what FULL_SHARD holds (stage 3's bytes). At the
  end of the forward, where the loop has set the gradients to None, it holds its shards, Adam's
  state and the whole model gathered: 4Ψ/N + 8Ψ/N + 4Ψ in fp32, stage 2's row; beside them sit
  FSDP2's flat all-gather outputs of the two last blocks (at the last block's copy-out the one
  before is not yet freed: FSDP2 frees it late to overlap the copy-out; ``predict.kept_all_gather_outputs``),
  so the measured model states peak is stage 2's row plus those two buffers and Adam's step
  counters (notebook 04's timeline, to the byte).
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
import torch.nn as nn

from .errors import CourseInputError
from .instrument import Observer
from .models import Block, unit_modules

# ---------------------------------------------------------------------------------------------
# Units, prefetching, policies
# ---------------------------------------------------------------------------------------------


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
        raise CourseInputError(f"prefetch must be one of default, explicit, none, got {mode!r}")
    if layers:
        root.set_modules_to_forward_prefetch(layers[:depth])
        root.set_modules_to_backward_prefetch(layers[-depth:][::-1])
    for i, unit in enumerate(layers):
        unit.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + depth])
        unit.set_modules_to_backward_prefetch(layers[max(0, i - depth) : i][::-1])


def mixed_precision_policy(precision: str):
    """``MixedPrecisionPolicy``: bf16 working parameters, fp32 gradient reduction, or None in fp32 (notebook 04).

    ``precision``: "mixed" (a run's ``TrainConfig.precision``) or "bf16" (the dress rehearsal's word for
    it) give the bf16 policy; "fp32" gives None (``fully_shard``'s default: no casting).

    The sharded parameters stay fp32 (they are the master copy the optimizer updates); the
    all-gathered working copy is bf16, so the all-gathers and the gathered bytes halve, while
    the reduce-scatters still carry fp32 gradients.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in ("mixed", "bf16"):
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
    reshard_after_forward: bool | int,
    granularity: str = "block",
    mp_policy=None,
    offload=None,
    prefetch: str = "default",
    act_ckpt: bool = False,
) -> list:
    """Apply ``fully_shard`` bottom-up: each unit module, then the root; return the units, root last (notebook 04).

    The root gets ``fully_shard``'s default, ``reshard_after_forward=None``: it is not resharded after
    its forward, because the backward begins with it (torch 2.13, ``_fsdp_state.py``: the root's
    ``post_forward_mesh_info`` is None); the record says so (``Strategy.keeps_root``) and
    ``predict.fsdp_collectives`` counts it.

    The one wrapping function of the course: real runs (``apply.apply_fsdp``, for every FSDP row of
    the record) and the dress rehearsal (notebook 05b) both wrap through it.

    Args:
        model: the course model (same seed on every rank).
        mesh: from ``loop.device_mesh``: 1-D shards over it, 2-D shards over dim 1, replicates over dim 0.
        reshard_after_forward: for every unit but the root: True frees each unit after its forward
            (FULL_SHARD), False keeps it gathered until its backward (SHARD_GRAD_OP), an integer k
            reshards to groups of k; the record's ``reshard_after_forward``.
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
    units.append(fully_shard(model, **{**kwargs, "reshard_after_forward": None}))  # the root: the default
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
    sees it (mixed in with everything else); on CPU there is no ``max_memory_allocated`` (torch's
    ``MemTracker`` and ``FSDPMemTracker`` do count storages on CPU, by their own categories), so this
    counts the gathered parameters directly: before and after every leaf module's forward, and when the gradient of a
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


def full_state_dict_via_dtensor(model: nn.Module) -> dict:
    """The same full state dict assembled by hand: ``DTensor.full_tensor()`` on each sharded value (notebook 04)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def apply_fsdp1(model: nn.Module, mesh, options):
    """The same strategy through the FSDP1 class ``FullyShardedDataParallel(sharding_strategy=...)`` (notebook 04).

    Args:
        model: the course model, built whole on every rank from the same seed.
        mesh: the strategy's device mesh; HYBRID_SHARD (a 2-D mesh) gets it, the others FSDP1's default group.
        options: ``apply.ApplyOptions``: ``fsdp1`` (the ``ShardingStrategy`` member), the ``wrap`` knob
            ("block" uses ``ModuleWrapPolicy({Block})``, one unit per block like ``shard_model``; "model"
            none), ``precision``, ``device``.

    FSDP1 flattens each unit's parameters into one ``FlatParameter`` and shards that (padded to a
    multiple of N); the optimizer sees the flat shards. On CPU ``device_id`` is the CPU device.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kwargs = {}
    if options.shard_over == "node":  # HYBRID_SHARD: its two groups come from the 2-D mesh
        kwargs["device_mesh"] = mesh
    if options.precision == "mixed":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = ModuleWrapPolicy({Block}) if options.knob("wrap") == "block" else None
    with warnings.catch_warnings():  # FSDP1 announces its own deprecation; the notebook says so in words
        warnings.simplefilter("ignore", FutureWarning)
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[options.fsdp1],
            device_id=options.device,
            auto_wrap_policy=policy,
            **kwargs,
        )


def calls_text(comm: dict) -> str:
    """Collectives per step in short: "10 AG + 5 RS" (all-gather, reduce-scatter, all-reduce) (notebook 04)."""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    return " + ".join(f"{v['calls']:g} {short.get(k, k)}" for k, v in comm.items()) or "none"


__all__ = [
    "set_prefetch",
    "mixed_precision_policy",
    "offload_policy",
    "shard_model",
    "UnshardedTracker",
    "full_state_dict_via_dtensor",
    "apply_fsdp1",
    "calls_text",
]
