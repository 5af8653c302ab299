"""ZeRO stage 3 (P_os+g+p) built by hand: parameters sharded at rest, gathered one unit at a time (notebook 03).

Each unit (a transformer block, and the root for everything else) keeps only its slice at rest; the
unit is all-gathered just before its forward and freed after, gathered again just before its
backward, and its gradients are reduce-scattered to their owners as soon as the unit's backward is
done (``Zero3Module``); ``Zero3Optimizer`` updates the fp32 master slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import CourseInputError
from .flat import FlatParams, unit_row
from .stages import ShardedOptimizer, _full_state_dict, stage_report

# ---------------------------------------------------------------------------------------------
# Stage 3 (P_os+g+p): parameters sharded at rest, gathered one unit at a time
# ---------------------------------------------------------------------------------------------


class GatheredBytes:
    """Live bytes of gathered (unsharded) parameters, and their peak (notebook 03).

    Stage 3 calls ``add`` when it gathers a unit and ``sub`` when it frees one; ``peak`` is the
    largest working set of whole parameters the rank has held at any moment since ``reset``.
    """

    def __init__(self):
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset(self) -> None:
        self.peak = self.live


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


@dataclass
class Unit:
    """One stage-3 unit: the parameters gathered together, and the module whose forward uses them (notebook 03)."""

    name: str
    module: nn.Module
    flats: list = field(default_factory=list)  # FlatParams: trainable first, then frozen
    gathered: bool = False
    pending: int = 0  # backward events still expected: one per trainable parameter, one per input hook
    armed: bool = False  # a forward with autograd ran since the last reduce

    @property
    def trainable(self) -> list:
        return [f for f in self.flats if f.params[0].requires_grad]


def assign_units(root: nn.Module, unit_modules) -> list[tuple[str, nn.Module, list]]:
    """Which parameters each unit owns: ``[(name, module, params)]``, the root last (notebook 03).

    A parameter belongs to the unit module that contains every module using it; a parameter
    used inside two units (a weight tied across them) falls back to the root unit, which is
    gathered for the whole forward and backward. Units may not be nested.
    """
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    unit_of = {}
    for i, m in enumerate(unit_modules):
        if m is root:
            raise CourseInputError("the root module is always a unit; list only its submodules as units")
        for sub in m.modules():
            if id(sub) in unit_of:
                raise CourseInputError(f"units may not be nested: {names.get(id(sub), sub)} is inside two units")
            unit_of[id(sub)] = i
    root_index = len(unit_modules)
    owners: dict = {}
    order = []
    for _, mod in root.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            if p not in owners:
                owners[p] = set()
                order.append(p)
            owners[p].add(unit_of.get(id(mod), root_index))
    params = [[] for _ in range(root_index + 1)]
    for p in order:
        units = owners[p]
        params[units.pop() if len(units) == 1 else root_index].append(p)
    out = [(names.get(id(m), str(i)), m, ps) for i, (m, ps) in enumerate(zip(unit_modules, params))]
    return out + [("(root)", root, params[root_index])]


class Zero3Module(nn.Module):
    """ZeRO stage 3 (P_os+g+p): a module whose parameters are sharded at rest (notebook 03).

    Each unit's parameters live as one ``FlatParams`` slice per rank. Around each unit's forward
    the unit is all-gathered and freed; the backward gathers it again just before the unit's
    gradients are computed, and when they are all there (every trainable parameter's gradient
    accumulated and the gradients of the unit's inputs computed) they are reduce-scattered to
    their owners and the unit is freed. Per step: 2 all-gathers and 1 reduce-scatter of every
    unit, 3Ψ elements (x (N-1)/N per rank), the paper's 1.5x of data parallelism's 2Ψ.

    Args:
        module: any nn.Module of standard layers; tied weights and frozen parameters are fine.
        units: submodules to gather one at a time (for the course model: its blocks). Every
            other parameter belongs to the root unit, gathered for the whole forward and again
            for the whole backward (as in FSDP).
        compute_dtype: dtype of the working weights, cast once per step from the fp32 master
            slices and all-gathered in that dtype (``torch.bfloat16`` for the paper's mixed
            precision); None keeps the parameters' dtype, and the shard is the master.
        group: the process group of the Nd ranks (default: all ranks).

    ``tracker`` (a ``GatheredBytes``) records the live and peak bytes of gathered parameters.
    """

    def __init__(self, module: nn.Module, *, units=(), compute_dtype=None, group=None):
        super().__init__()
        self.module = module
        self.tracker = GatheredBytes()
        self.units: list[Unit] = []
        for name, mod, params in assign_units(module, list(units)):
            unit = Unit(name, self if mod is module else mod)
            for kind in (True, False):  # trainable and frozen parameters never share a flat buffer
                chosen = [p for p in params if p.requires_grad is kind]
                if chosen:
                    unit.flats.append(
                        FlatParams(chosen, group=group, compute_dtype=compute_dtype, sharded_at_rest=True)
                    )
            if unit.flats:
                self.units.append(unit)
        for unit in self.units:
            unit.module.register_forward_pre_hook(partial(self._before_forward, unit))
            unit.module.register_forward_hook(partial(self._after_forward, unit))
            for flat in unit.trainable:
                for p in flat.params:
                    p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._backward_event(unit))
        psi = sum(flat.numel for flat in self.flats())
        self.report = stage_report(3, self.flats(), psi, self.unit_table())
        self.report["peak_gathered_bytes_per_step"] = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- gather and free ------------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        if not unit.gathered:
            for flat in unit.flats:
                flat.gather()
                self.tracker.add(flat.working_bytes)
            unit.gathered = True

    def _free(self, unit: Unit) -> None:
        if unit.gathered:
            for flat in unit.flats:
                flat.free()
                self.tracker.sub(flat.working_bytes)
            unit.gathered = False

    # -- forward: gather before, free after; arm the backward hooks -------------------------------
    def _before_forward(self, unit: Unit, module, args):
        self._gather(unit)
        if not torch.is_grad_enabled():
            return None
        if not unit.armed:
            unit.armed = True
            unit.pending += sum(len(f.params) for f in unit.trainable)
        flat_args, spec = tree_flatten(args)
        needs = [i for i, a in enumerate(flat_args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not needs:
            return None
        unit.pending += 1
        wrapped = _PostBackward.apply(partial(self._backward_event, unit), *[flat_args[i] for i in needs])
        for i, t in zip(needs, wrapped):
            flat_args[i] = t
        return tree_unflatten(flat_args, spec)

    def _after_forward(self, unit: Unit, module, args, output):
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: self._gather(unit))
        self._free(unit)
        return None

    # -- backward: reduce-scatter and free once the unit is done --------------------------------
    def _backward_event(self, unit: Unit) -> None:
        unit.pending -= 1
        if unit.pending == 0 and unit.armed:
            self._finish_unit(unit)

    def _finish_unit(self, unit: Unit) -> None:
        for flat in unit.trainable:
            flat.reduce_grads(drop_full_grads=True)
        unit.armed, unit.pending = False, 0
        self._free(unit)

    def finish_backward(self) -> None:
        """Reduce-scatter units the backward left open (parameters unused this step) and free all (notebook 03).

        Called at the start of ``Zero3Optimizer.step``; a no-op after a normal backward.
        """
        for unit in self.units:
            if unit.armed:
                self._finish_unit(unit)
            self._free(unit)

    def finish_gradient_synchronization(self) -> None:
        """After the backward: reduce what it left open (``finish_backward``) and record the step's peak of
        gathered bytes (``report["peak_gathered_bytes"]``, measured by ``GatheredBytes``) (notebook 03)."""
        self.finish_backward()
        self.report["peak_gathered_bytes_per_step"].append(self.tracker.peak)
        self.report["peak_gathered_bytes"] = max(self.report["peak_gathered_bytes_per_step"])
        self.tracker.reset()

    def describe(self) -> dict:
        """The stage's report: units and their padding, the bytes of this rank's slices, the peak of
        gathered bytes per step; kept up to date as the run goes (notebook 03)."""
        return self.report

    # -- what this rank holds -------------------------------------------------------------------
    def flats(self) -> list[FlatParams]:
        return [flat for unit in self.units for flat in unit.flats]

    def memory_roles(self) -> dict:
        """What this rank keeps, by role, for ``timeline.StepTimeline`` (notebook 03): its slices, the
        gathered units (empty storages when freed) and the gradients."""
        flats = self.flats()
        return {
            "params": [f.shard for f in flats],
            "gathered": [f.full for f in flats],
            "grads": [f.grad_shard for f in flats]
            + [p.grad for f in flats for p in f.params]
            + [f.master.grad for f in flats],
        }

    def unit_table(self) -> list[dict]:
        """One row per flat buffer: name, Ψ of the unit, padded size, padding, trainable."""
        return [unit_row(u.name, f, f in u.trainable) for u in self.units for f in u.flats]

    def full_state_dict(self) -> dict:
        """The full fp32 weights keyed like the wrapped module's ``state_dict()`` (collective)."""
        return _full_state_dict(self.module, self.flats())


class Zero3Optimizer(ShardedOptimizer):
    """The optimizer of a ``Zero3Module``: the inner optimizer over its fp32 master slices (notebook 03).

    ``step()`` finishes the backward (``Zero3Module.finish_backward``), updates the slices and
    writes them into the 16-bit working slices; there is nothing to all-gather, since each
    unit is gathered again just before its next forward.
    """

    keep_full_grads = False

    def __init__(self, module: Zero3Module, optimizer_class=torch.optim.Adam, **defaults):
        self.module = module
        self.flats = [f for u in module.units for f in u.trainable]
        self.optimizer = optimizer_class([f.master for f in self.flats], **defaults)

    def reduce_gradients(self) -> None:
        self.module.finish_backward()

    def describe(self) -> dict:
        """Nothing of its own: its module reports the stage (``Zero3Module.describe``)."""
        return {}

    def share_weights(self) -> None:
        pass

    def memory_roles(self) -> dict:
        """The optimizer state only: the flat buffers' roles are the module's (``Zero3Module.memory_roles``)."""
        return {"optim": self.optimizer_tensors()}

    def held(self) -> tuple[list, list, list]:
        """``(params, grads, optimizer state)``: slices only; the gathered copies are freed at rest."""
        all_flats = self.module.flats()
        frozen_masters = [f.master for f in all_flats if f not in self.flats and f.master is not f.shard]
        params = [f.shard for f in all_flats] + frozen_masters
        return params, [f.grad_shard for f in self.flats], self.optimizer_tensors()
