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

``apply_zero1``, ``apply_zero2``, ``apply_zero3`` plug the stages into ``course_utils.train``
(``python -m course_utils train --strategy zero1|zero2|zero3``). The paper's formulas with the
exact padding and (N-1)/N factors that the notebook asserts the real runs against
(``held_bytes``, ``zero_traffic``, ``memory_check``, ``traffic_check``, ...) are
``course_utils.predict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single / reduce_scatter_single;
# compat resolves the newest name this torch has (an older torch, Colab's say, has only the old ones)
from .compat import all_gather_single, newest_collective, reduce_scatter_single  # noqa: F401 (newest_collective)
from .errors import CourseInputError

# ---------------------------------------------------------------------------------------------
# Padding and the flat layout
# ---------------------------------------------------------------------------------------------


def padded_numel(numel: int, nd: int) -> int:
    """The smallest multiple of Nd that holds ``numel`` elements (notebook 03).

    Ψ = 10 on Nd = 4 ranks pads to 12: each rank owns S = 3 elements, 2 of them zeros.
    """
    return -(-int(numel) // int(nd)) * int(nd)


def shard_bounds(padded: int, nd: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of rank r's slice of a flat buffer of ``padded`` = Nd·S elements (notebook 03)."""
    s = padded // nd
    return rank * s, (rank + 1) * s


def _group_info(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class FlatParams:
    """Parameters laid end to end in one flat buffer of Nd·S elements; rank r owns [r·S, (r+1)·S) (notebook 03).

    After construction every parameter is a view into ``full``, the working copy in
    ``compute_dtype`` (default: the parameters' own dtype), so an all-gather into ``full``
    updates every parameter at once.

    Attributes:
        numel: Ψ of these parameters; ``padded`` = Nd·S; ``shard_numel`` = S;
            ``padding`` = padded - numel zero elements at the end (on the last ranks).
        shard: this rank's S working elements: a view of ``full``, or, with
            ``sharded_at_rest=True`` (stage 3), a tensor of its own while ``full`` is freed.
        master: the fp32 slice the optimizer updates; ``shard`` itself when the working copy
            is already fp32, else an fp32 copy taken before the weights were cast.
        grad_shard: averaged gradients of the slice (working dtype) once reduced, else None.
    """

    def __init__(self, params, *, group=None, compute_dtype=None, sharded_at_rest: bool = False):
        self.params = list(params)
        if not self.params:
            raise CourseInputError("FlatParams needs at least one parameter")
        self.group = group
        self.rank, self.nd = _group_info(group)
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_numel(self.numel, self.nd)
        self.shard_numel = self.padded // self.nd
        self.padding = self.padded - self.numel
        dtype = compute_dtype or self.params[0].dtype
        device = self.params[0].device
        values = torch.zeros(self.padded, dtype=self.params[0].dtype, device=device)
        torch.cat([p.detach().reshape(-1) for p in self.params], out=values[: self.numel])
        lo, hi = shard_bounds(self.padded, self.nd, self.rank)
        self.full = values.to(dtype)
        self.shard = self.full[lo:hi].clone() if sharded_at_rest else self.full[lo:hi]
        self.master = self.shard if values.dtype == dtype else values[lo:hi].clone()
        self.grad_shard: torch.Tensor | None = None
        offset = 0
        for p in self.params:
            p.data = self.full[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        if sharded_at_rest:
            self.free()

    @property
    def working_bytes(self) -> int:
        """Bytes of the gathered working copy (Nd·S elements)."""
        return self.padded * self.full.element_size()

    def gather(self) -> None:
        """All-gather every rank's slice into ``full``: the parameters become whole (notebook 03)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.working_bytes)
        # Stages 1 and 2: the shard is a view of ``full`` itself, so this gathers in place.
        all_gather_single(self.full, self.shard, group=self.group)

    def free(self) -> None:
        """Drop the gathered copy; the parameters keep their shapes but hold no memory (notebook 03)."""
        self.full.untyped_storage().resize_(0)

    def flat_grads(self) -> torch.Tensor:
        """Every parameter's gradient end to end, zero where a gradient is missing, padded to Nd·S."""
        parts = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=self.full.dtype, device=self.full.device)
            for p in self.params
        ]
        parts.append(torch.zeros(self.padding, dtype=self.full.dtype, device=self.full.device))
        return torch.cat(parts)

    def reduce_grads(self, *, drop_full_grads: bool) -> None:
        """Reduce-scatter the gradients: rank r receives the average over ranks of its slice (notebook 03).

        With ``drop_full_grads`` (stages 2 and 3) the full gradients are freed afterwards; a
        second backward before the step (gradient accumulation) adds to ``grad_shard``.
        """
        out = torch.empty(self.shard_numel, dtype=self.full.dtype, device=self.full.device)
        reduce_scatter_single(out, self.flat_grads(), group=self.group)
        out.div_(self.nd)
        self.grad_shard = out if self.grad_shard is None else self.grad_shard.add_(out)
        if drop_full_grads:
            for p in self.params:
                p.grad = None

    def full_fp32(self) -> list[torch.Tensor]:
        """All-gather the fp32 master slices and return each parameter's full fp32 value (collective)."""
        whole = torch.empty(self.padded, dtype=self.master.dtype, device=self.master.device)
        all_gather_single(whole, self.master.contiguous(), group=self.group)
        out, offset = [], 0
        for p in self.params:
            out.append(whole[offset : offset + p.numel()].view(p.shape).clone())
            offset += p.numel()
        return out


def _unit_row(name: str, flat: FlatParams, trainable: bool = True) -> dict:
    return {
        "name": name,
        "numel": flat.numel,
        "padded": flat.padded,
        "shard_numel": flat.shard_numel,
        "padding": flat.padding,
        "trainable": trainable,
    }


# ---------------------------------------------------------------------------------------------
# Stage 1 (P_os) and stage 2 (P_os+g): a sharded optimizer around any torch.optim class
# ---------------------------------------------------------------------------------------------


def _param_groups(params) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def gradient_buckets(params, cap_bytes: float | None) -> list[list]:
    """Split parameters into buckets of at most ``cap_bytes``, filled in reverse order (notebook 03).

    The backward pass produces gradients roughly from the last layer to the first, so, as in
    DDP, buckets are filled from the end; a parameter larger than the cap gets a bucket of its
    own. ``None`` means one bucket for everything. Each bucket lists its parameters in model order.
    """
    params = list(params)
    if cap_bytes is None:
        return [params] if params else []
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current[::-1])
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current[::-1])
    return buckets


class ShardedOptimizer:
    """ZeRO stage 1 (P_os): any element-wise torch.optim optimizer, its state kept for this rank's slice only (notebook 03).

    Usage, on every rank (each rank's ``loss.backward()`` leaves full local gradients)::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    ``step()`` does three things: reduce-scatter the gradients (each rank receives the average
    of its own slice), update the slice with the inner optimizer, all-gather the new weights.
    Traffic: a reduce-scatter and an all-gather of Ψ elements, (N-1)/N·Ψ each per rank: the
    same 2Ψ as plain data parallelism's all-reduce, which is a reduce-scatter plus an all-gather.

    Args:
        params: parameters or param-group dicts, as for any torch.optim optimizer. Each group
            becomes its own flat buffer; frozen parameters are left alone (not sharded).
        optimizer_class: the inner optimizer, e.g. ``torch.optim.Adam``. Element-wise
            optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) update a slice exactly as they would
            the whole tensor; one that looks at whole tensors (Adafactor, LAMB) would see slices.
        compute_dtype: None keeps the parameters' dtype (fp32: the optimizer updates the
            parameters' own memory, no copy). ``torch.bfloat16`` makes the parameters 16-bit
            working copies and keeps fp32 master weights for this rank's slice.
        group: the process group of the Nd ranks (default: all ranks).
        bucket_cap_mb: None: one flat buffer per param group (stage 1); a number: buffers of at
            most this many MB of working weights (stage 2 reduces them during the backward).
        **defaults: arguments of ``optimizer_class`` (lr, betas, weight_decay, ...).
    """

    keep_full_grads = True  # P_os: every rank keeps its full 16-bit gradients

    def __init__(
        self,
        params,
        optimizer_class=torch.optim.Adam,
        *,
        compute_dtype=None,
        group=None,
        bucket_cap_mb: float | None = None,
        **defaults,
    ):
        self.flats: list[FlatParams] = []
        inner_groups = []
        cap = None if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024
        for g in _param_groups(params):
            options = {k: v for k, v in g.items() if k != "params"}
            trainable = [p for p in g["params"] if p.requires_grad]
            for bucket in gradient_buckets(trainable, cap):
                flat = FlatParams(bucket, group=group, compute_dtype=compute_dtype)
                self.flats.append(flat)
                inner_groups.append({**options, "params": [flat.master]})
        self.optimizer = optimizer_class(inner_groups, **defaults)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter every flat buffer's gradients (at the step, after the backward)."""
        for flat in self.flats:
            if any(p.grad is not None for p in flat.params):
                flat.reduce_grads(drop_full_grads=not self.keep_full_grads)

    def update_shards(self) -> None:
        """Run the inner optimizer on the fp32 slices, then write them into the working slices."""
        for flat in self.flats:
            if flat.grad_shard is not None:
                flat.master.grad = flat.grad_shard.to(flat.master.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for flat in self.flats:
                flat.master.grad = None  # the fp32 copy of the gradient slice was only for the update
                if flat.master is not flat.shard:
                    flat.shard.copy_(flat.master)

    def share_weights(self) -> None:
        """All-gather the updated slices: every rank's parameters are whole and equal again."""
        for flat in self.flats:
            flat.gather()

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_gradients()
        self.update_shards()
        self.share_weights()
        if self.keep_full_grads:  # stage 1's gradient home is the full .grad; the slice was transient
            for flat in self.flats:
                flat.grad_shard = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat in self.flats:
            flat.grad_shard = None
            for p in flat.params:
                p.grad = None

    def held(self) -> tuple[list, list, list]:
        """``(params, grads, optimizer state)``: the real tensors this rank holds (notebook 03)."""
        params = [p for flat in self.flats for p in flat.params]
        grads = [p.grad for p in params] + [flat.grad_shard for flat in self.flats]
        return params, grads, self.optimizer_tensors()

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The inner optimizer's state plus the fp32 master slices (when they are separate copies)."""
        out = [
            v
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return out + [flat.master for flat in self.flats if flat.master is not flat.shard]

    def full_state_dict(self, module: nn.Module) -> dict:
        """The full fp32 weights of ``module``, keyed like its ``state_dict()`` (collective: all ranks call it)."""
        return _full_state_dict(module, self.flats)


def _full_state_dict(module: nn.Module, flats) -> dict:
    values = {}
    for flat in flats:
        for p, v in zip(flat.params, flat.full_fp32()):
            values[p] = v
    named = dict(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        p = named.get(key)
        if p is None:  # a buffer: as it is
            out[key] = value.detach().clone()
        else:  # a parameter: from the fp32 master slices, or (not sharded: frozen) as fp32
            out[key] = values[p] if p in values else p.detach().float().clone()
    return out


class GradShardedOptimizer(ShardedOptimizer):
    """ZeRO stage 2 (P_os+g): stage 1 plus gradients reduce-scattered during the backward, bucket by bucket (notebook 03).

    Each flat buffer is a gradient bucket (``bucket_cap_mb``, filled from the last layer, as in
    DDP). A hook on every parameter counts the gradients the backward has produced; when a
    bucket is complete it is reduce-scattered at once, and the full gradients are dropped, so
    after the backward a rank holds only the averaged gradients of its own slices:
    2Ψ + (2 + K)Ψ/Nd bytes instead of stage 1's 4Ψ + KΨ/Nd. Same arguments as ``ShardedOptimizer``.
    """

    keep_full_grads = False

    def __init__(self, params, optimizer_class=torch.optim.Adam, *, bucket_cap_mb: float = 25.0, **kwargs):
        super().__init__(params, optimizer_class, bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._ready = {id(flat): 0 for flat in self.flats}
        for flat in self.flats:
            for p in flat.params:
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, flat))

    def _grad_ready(self, flat: FlatParams, param) -> None:
        self._ready[id(flat)] += 1
        if self._ready[id(flat)] == len(flat.params):  # the bucket is complete: send it now
            self._ready[id(flat)] = 0
            flat.reduce_grads(drop_full_grads=True)

    def reduce_gradients(self) -> None:
        """Buckets the hooks did not complete (a parameter without a gradient this step) go now."""
        for flat in self.flats:
            if self._ready[id(flat)]:
                self._ready[id(flat)] = 0
                flat.reduce_grads(drop_full_grads=True)


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

    # -- what this rank holds -------------------------------------------------------------------
    def flats(self) -> list[FlatParams]:
        return [flat for unit in self.units for flat in unit.flats]

    def unit_table(self) -> list[dict]:
        """One row per flat buffer: name, Ψ of the unit, padded size, padding, trainable."""
        return [_unit_row(u.name, f, f in u.trainable) for u in self.units for f in u.flats]

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

    def share_weights(self) -> None:
        pass

    def held(self) -> tuple[list, list, list]:
        """``(params, grads, optimizer state)``: slices only; the gathered copies are freed at rest."""
        all_flats = self.module.flats()
        frozen_masters = [f.master for f in all_flats if f not in self.flats and f.master is not f.shard]
        params = [f.shard for f in all_flats] + frozen_masters
        return params, [f.grad_shard for f in self.flats], self.optimizer_tensors()


# ---------------------------------------------------------------------------------------------
# The stages as training strategies (python -m course_utils train --strategy zero1|zero2|zero3)
# ---------------------------------------------------------------------------------------------


def _compute_dtype(cfg):
    return torch.bfloat16 if cfg.precision == "mixed" else None


def _info(stage: int, cfg, nd: int, psi: int, units: list[dict]) -> dict:
    return {
        "stage": stage,
        "precision": cfg.precision,
        "nd": nd,
        "psi": psi,
        "units": units,
        "padding": sum(u["padding"] for u in units),
        "shard_numel": sum(u["shard_numel"] for u in units),
        "bytes_per_element": 2 if cfg.precision == "mixed" else 4,
    }


def _apply_sharded_optimizer(model, cfg, info, optimizer_cls, stage: int, **kwargs):
    from .loop import Prepared

    psi = sum(p.numel() for p in model.parameters())
    opt = optimizer_cls(
        model.parameters(), torch.optim.Adam, compute_dtype=_compute_dtype(cfg), lr=cfg.lr, foreach=False, **kwargs
    )
    units = [_unit_row(f"flat {i}", f) for i, f in enumerate(opt.flats)]
    return Prepared(
        model=model,
        optimizer=opt,
        full_state_dict=lambda: opt.full_state_dict(model),
        held=opt.held,
        info=_info(stage, cfg, info.world_size, psi, units),
    )


def apply_zero1(model, cfg, info):
    """ZeRO stage 1 (P_os) built by hand: ``ShardedOptimizer`` around Adam (notebook 03).

    Args:
        model: the course model, built from the same seed on every rank.
        cfg: the run's ``TrainConfig``; ``precision="mixed"`` gives bf16 working weights and
            gradients with fp32 master weights (4Ψ + 12Ψ/Nd bytes per rank); "fp32" gives
            8Ψ + 8Ψ/Nd (fp32 weights and gradients, Adam's fp32 momentum and variance).
        info: this rank's ``DistInfo``.
    """
    return _apply_sharded_optimizer(model, cfg, info, ShardedOptimizer, 1)


def apply_zero2(model, cfg, info):
    """ZeRO stage 2 (P_os+g) built by hand: ``GradShardedOptimizer`` around Adam (notebook 03).

    Args:
        model: the course model, built from the same seed on every rank.
        cfg: the run's ``TrainConfig``; ``cfg.bucket_cap_mb`` sizes the gradient buckets
            (the notebook uses a small cap to see several); mixed precision holds
            2Ψ + 14Ψ/Nd bytes per rank, fp32 4Ψ + 12Ψ/Nd.
        info: this rank's ``DistInfo``.
    """
    return _apply_sharded_optimizer(model, cfg, info, GradShardedOptimizer, 2, bucket_cap_mb=cfg.bucket_cap_mb)


def apply_zero3(model, cfg, info):
    """ZeRO stage 3 (P_os+g+p) built by hand: ``Zero3Module`` over the blocks + ``Zero3Optimizer`` (notebook 03).

    Args:
        model: the course model; each transformer block is a unit, the embeddings, the final
            norm and the head (tied to the token embedding) form the root unit.
        cfg: the run's ``TrainConfig``; mixed precision holds 16Ψ/Nd bytes per rank (bf16
            working slice and gradients, fp32 master, momentum, variance), fp32 16Ψ/Nd too.
        info: this rank's ``DistInfo``.

    ``info`` reports the units and their padding, the bytes of this rank's slices and the peak
    bytes of gathered parameters (``peak_gathered_bytes``, measured by ``GatheredBytes``).
    """
    from .loop import Prepared

    psi = sum(p.numel() for p in model.parameters())
    wrapped = Zero3Module(model, units=list(getattr(model, "blocks", [])), compute_dtype=_compute_dtype(cfg))
    opt = Zero3Optimizer(wrapped, torch.optim.Adam, lr=cfg.lr, foreach=False)
    report = _info(3, cfg, info.world_size, psi, wrapped.unit_table())
    report["peak_gathered_bytes_per_step"] = []

    def before_step():
        wrapped.finish_backward()
        report["peak_gathered_bytes_per_step"].append(wrapped.tracker.peak)
        report["peak_gathered_bytes"] = max(report["peak_gathered_bytes_per_step"])
        wrapped.tracker.reset()

    return Prepared(
        model=wrapped,
        optimizer=opt,
        full_state_dict=wrapped.full_state_dict,
        held=opt.held,
        before_step=before_step,
        info=report,
    )


def apply_torch_zero1(model, cfg, info):
    """The library's stage 1, for comparison: torch DDP + ``ZeroRedundancyOptimizer`` around Adam (notebook 03).

    Args:
        model: the course model, built from the same seed on every rank.
        cfg: the run's ``TrainConfig`` (fp32 only: the library optimizer has no master weights).
        info: this rank's ``DistInfo``.

    DDP all-reduces the gradients (2Ψ); each rank then runs Adam on the whole parameters
    ``ZeroRedundancyOptimizer`` assigned to it (greedy, by size, so the slices are uneven) and
    broadcasts them (Ψ): 3Ψ in all, where the hand-built ``ShardedOptimizer`` needs 2Ψ.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from .loop import Prepared

    ddp = DistributedDataParallel(
        model, device_ids=[info.device.index] if info.device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_cap_mb
    )
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr, foreach=False)

    def held():
        params = list(model.parameters())
        state = [
            v for st in opt.optim.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return params, [p.grad for p in params], state

    return Prepared(
        model=ddp,
        optimizer=opt,
        held=held,
        full_state_dict=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
        info={"library": "torch.distributed.optim.ZeroRedundancyOptimizer"},
    )


__all__ = [
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
    "apply_zero1",
    "apply_zero2",
    "apply_zero3",
    "apply_torch_zero1",
]
