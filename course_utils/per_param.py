"""FSDP2's layout built by hand: every parameter sharded on dim 0, gathered one unit at a time (notebook 04).

One weight can be laid across ranks four ways. The hand-built stage 3 of notebook 03
(``zero.Zero3Module``) lays each unit's parameters end to end in one flat buffer and gives rank r
one contiguous slice of it, padded to a multiple of N: FSDP1's ``FlatParameter`` does the same. DeepSpeed's
stages 1 and 2 flatten a whole parameter group (``bit16_groups_flat``) and pad it to a multiple of 2N
(``stage_1_and_2.py``, ``nccl_start_alignment_factor = 2``), so their slices and padding differ. A slice
can cut a weight matrix anywhere, so the optimizer sees flat fragments. DeepSpeed's stage 3 flattens and pads
*each parameter* to a multiple of N and gives rank r the r-th piece of every parameter (``param.ds_tensor``,
``partition_parameters.py`` in DeepSpeed 0.19.8): a piece can still cut a row. PyTorch's FSDP2 (``fully_shard``) shards each
parameter by rows: rank r keeps rows
``[r·c, (r+1)·c)`` of dim 0, with c = ceil(dim0 / N) (``torch.chunk``; a rank past the end keeps
no rows, and the gathered buffer is padded with zeros to c·N rows, as torch 2.13's
``_fsdp_param.py`` does with ``_chunk_with_empty``). What that changes:

- after the backward every parameter has its own gradient shard, shaped like its own shard, so
  any ``torch.optim`` optimizer built over ``module.parameters()`` drives the model unchanged;
- an optimizer that looks at a whole tensor (Shampoo, Adafactor's row/column statistics, LAMB's
  per-tensor trust ratio) sees a block of rows, not a flat fragment that crosses tensors: rows are
  still not the whole tensor, so such optimizers need the full tensor gathered or their statistics
  reduced across ranks;
- gradient-norm clipping must sum the squares of every rank's shards before the square root
  (``clip_grad_norm_``): one rank's shards give only part of the norm.

How it runs. Each unit (a transformer block, and the root for everything else) has a forward
pre-hook that all-gathers its parameters into full tensors in the compute dtype and puts them
where the modules look for them; the module's registered parameters stay the shards. The
all-gather is an autograd function (``_Unshard``) whose backward reduce-scatters the full
gradient and divides it by N: the averaged gradient of this rank's rows lands in the shard's
``.grad``. With ``reshard_after_forward`` a block frees its full tensors after its forward and
gathers them again just before its backward (FULL_SHARD); the root stays gathered (FSDP2 does the
same: it would be gathered again at once for the backward). FSDP2 packs a unit's shards into one
all-gather and one reduce-scatter; here there is one collective per parameter, which keeps the code
short and sends the same bytes. ``tests/test_per_param.py`` checks it against one process with
SGD, Adam and AdamW, tied and frozen weights, fp32 and bf16, on 2 and 4 ranks, against
``fully_shard``'s own local shards, and the norm of a gradient clipped across shards (the sum of every
rank's squares, one all-reduce: notebook 04's exercise) against one process's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from .compat import all_gather_single, reduce_scatter_single
from .zero import GatheredBytes, assign_units

# ---------------------------------------------------------------------------------------------
# The layout: rows of dim 0, padded as torch.chunk pads
# ---------------------------------------------------------------------------------------------


#: The four layouts, in the order the course meets them (notebook 03's flat buffer first).
LAYOUTS = {
    "flat": "one flat buffer per unit (ours, FSDP1)",
    "group_flat": "one flat buffer per group, to 2N (DeepSpeed 1-2)",
    "per_parameter_flat": "each parameter flat and padded (DeepSpeed 3)",
    "rows": "each parameter by rows of dim 0 (FSDP2)",
}


def deepspeed_group_numel(numel: int, nd: int) -> int:
    """DeepSpeed 0.19.8's stages 1-2: a parameter group of ``numel`` elements, flattened (``bit16_groups_flat``) and
    padded to a multiple of 2N (``stage_1_and_2.py:387`` ``nccl_start_alignment_factor = 2``, ``:441`` ``alignment =
    2 * world``, ``:446``; no padding between parameters: ``parameter_alignment`` is false, ``zero/config.py:317``),
    then cut into N equal slices (``:2559``). 25 elements on N = 4 pad to 32 (notebook 04)."""
    return -(-int(numel) // (2 * int(nd))) * 2 * int(nd)


def _flat_owner(shapes: dict, sizes: dict, padded: int, nd: int) -> dict:
    """``{name: owner}``: the parameters end to end in one buffer of ``padded`` elements, Nd equal slices."""
    owner, offset = {}, 0
    for name, shape in shapes.items():
        owner[name] = ((torch.arange(sizes[name]) + offset) // (padded // nd)).reshape(shape)
        offset += sizes[name]
    return owner


def layouts(shapes: dict, nd: int) -> dict:
    """Which rank keeps each element of one unit's parameters, in each of the four layouts (notebook 04).

    ``shapes``: ``{name: shape}`` in the unit's order. Returns ``{layout: {"owner": {name: int tensor shaped like
    the parameter, the rank keeping each element}, "padding": zero elements added across the ranks}}`` for the
    layouts of ``LAYOUTS``: the unit end to end in Nd equal slices (``zero.padded_numel``: a slice can end inside a
    matrix); the same for DeepSpeed 1-2's parameter group (the unit here), padded to a multiple of 2N
    (``deepspeed_group_numel``); each parameter's own Nd equal pieces (padded to a multiple of Nd); each
    parameter's rows, c = ceil(dim0 / Nd) per rank (``chunk_rows``: a rank past the end keeps none, and pads c rows).
    """
    from .zero import padded_numel

    sizes = {n: int(torch.Size(s).numel()) for n, s in shapes.items()}
    total = sum(sizes.values())
    pieces = {n: (torch.arange(sizes[n]) // (padded_numel(sizes[n], nd) // nd)).reshape(s) for n, s in shapes.items()}
    rows = {}
    for name, shape in shapes.items():
        dim0, per_row = shape[0], sizes[name] // shape[0]
        rows[name] = (torch.arange(dim0) // chunk_rows(dim0, nd)).repeat_interleave(per_row).reshape(shape)
    return {
        "flat": {
            "owner": _flat_owner(shapes, sizes, padded_numel(total, nd), nd),
            "padding": padded_numel(total, nd) - total,
        },
        "group_flat": {
            "owner": _flat_owner(shapes, sizes, deepspeed_group_numel(total, nd), nd),
            "padding": deepspeed_group_numel(total, nd) - total,
        },
        "per_parameter_flat": {"owner": pieces, "padding": sum(padded_numel(n, nd) - n for n in sizes.values())},
        "rows": {
            "owner": rows,
            "padding": sum((chunk_rows(s[0], nd) * nd - s[0]) * (sizes[n] // s[0]) for n, s in shapes.items()),
        },
    }


def chunk_rows(dim0: int, nd: int) -> int:
    """c = ceil(dim0 / Nd): the rows of every (padded) shard, FSDP2's ``chunks[0].size(0)`` (notebook 04)."""
    return -(-int(dim0) // int(nd))


def shard_rows(dim0: int, nd: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` rows of dim 0 that rank r keeps; empty past the end (notebook 04).

    dim0 = 10 on Nd = 4: c = 3, ranks keep rows [0, 3), [3, 6), [6, 9), [9, 10).
    dim0 = 2 on Nd = 4: c = 1, ranks 2 and 3 keep nothing.
    """
    c = chunk_rows(dim0, nd)
    return min(rank * c, dim0), min((rank + 1) * c, dim0)


def padded_shard(full: torch.Tensor, rank: int, nd: int) -> torch.Tensor:
    """Rank r's shard of ``full`` padded with zero rows to c rows: what it sends in the all-gather (notebook 04)."""
    c = chunk_rows(full.shape[0], nd)
    start, stop = shard_rows(full.shape[0], nd, rank)
    out = full.new_zeros((c, *full.shape[1:]))
    out[: stop - start] = full[start:stop]
    return out


def unshard_rows(gathered: torch.Tensor, dim0: int) -> torch.Tensor:
    """The full parameter from the Nd·c gathered rows: the padding rows dropped (notebook 04)."""
    return gathered[:dim0]


# ---------------------------------------------------------------------------------------------
# One sharded parameter
# ---------------------------------------------------------------------------------------------


class ShardedParam:
    """A parameter kept as rank r's rows (fp32 master, what the optimizer updates), gathered on demand.

    ``local`` is the registered ``nn.Parameter``: a view of the first rows of ``padded`` (c rows),
    so the optimizer sees exactly this rank's real elements and the padding rides along unseen.
    """

    def __init__(self, param: nn.Parameter, *, group, compute_dtype):
        self.group = group
        self.rank, self.nd = dist.get_rank(group), dist.get_world_size(group)
        self.shape = param.shape
        self.c = chunk_rows(self.shape[0], self.nd)
        start, stop = shard_rows(self.shape[0], self.nd, self.rank)
        self.padded = padded_shard(param.detach(), self.rank, self.nd)
        self.local = nn.Parameter(self.padded[: stop - start], requires_grad=param.requires_grad)
        self.compute_dtype = compute_dtype or param.dtype
        self.on_reduced = lambda: None  # set by the unit: counts the gradients reduced in a backward

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the gathered tensor, padding included: Nd·c rows in the compute dtype."""
        return self.nd * self.padded.numel() * torch.empty((), dtype=self.compute_dtype).element_size()

    def all_gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Nd·c rows gathered from every rank's padded shard, in the compute dtype."""
        send = self.padded.to(self.compute_dtype)
        if out is None:
            out = torch.empty((self.nd * self.c, *self.shape[1:]), dtype=self.compute_dtype, device=send.device)
        all_gather_single(out, send, group=self.group)
        return out

    def reduce_scatter(self, grad_full: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of this rank's rows of ``grad_full``, shaped like ``local``."""
        padded = grad_full.new_zeros((self.nd * self.c, *self.shape[1:]))
        padded[: self.shape[0]] = grad_full
        out = grad_full.new_empty((self.c, *self.shape[1:]))
        reduce_scatter_single(out, padded.contiguous(), group=self.group)
        out.div_(self.nd)
        return out[: self.local.shape[0]].to(self.local.dtype)


class _Unshard(torch.autograd.Function):
    """Forward: the full parameter from every rank's rows. Backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, sp: ShardedParam, local: torch.Tensor, gathered: torch.Tensor):
        ctx.sp = sp
        # ``.data``: an alias of the gathered storage with its own version counter, so gathering
        # again into the freed storage before the backward is not an in-place change autograd sees
        # (FSDP does the same with its unsharded parameters).
        return unshard_rows(gathered, sp.shape[0]).data

    @staticmethod
    def backward(ctx, grad_full):
        grad = ctx.sp.reduce_scatter(grad_full)
        ctx.sp.on_reduced()
        return None, grad, None


# ---------------------------------------------------------------------------------------------
# Units and the module
# ---------------------------------------------------------------------------------------------


@dataclass
class PerParamUnit:
    """The parameters gathered together, and where the modules look for each of them."""

    name: str
    module: nn.Module
    params: list = field(default_factory=list)  # ShardedParam
    slots: list = field(default_factory=list)  # [(module, attribute name)] per ShardedParam
    buffers: list = field(default_factory=list)  # gathered storages while gathered, else []
    reshard_after_forward: bool = True
    pending: int = 0  # gradients still to reduce in this backward


class PerParamSharded(nn.Module):
    """FSDP2-style per-parameter sharding, built by hand (notebook 04).

    ``model = PerParamSharded(build_model(...), units=model.blocks)``; then build any optimizer
    over ``model.parameters()`` (the shards) and train as usual: ``loss = model(x, y)``,
    ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``.

    Args:
        module: any nn.Module of standard layers; tied weights and frozen parameters are fine.
        units: submodules gathered one at a time (for the course model: its blocks); every other
            parameter belongs to the root unit.
        reshard_after_forward: free each block's full parameters after its forward and gather
            them again before its backward (FULL_SHARD, 3 collectives per parameter and step);
            False keeps them until the backward (SHARD_GRAD_OP, 2 collectives).
        compute_dtype: dtype of the gathered weights, the gradients and both collectives
            (``torch.bfloat16``: FSDP2's ``MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)``);
            the shards stay fp32 masters. None keeps the parameters' dtype.
        group: the process group (default: all ranks).

    ``tracker`` (``zero.GatheredBytes``) records the live and peak bytes of gathered parameters.
    """

    def __init__(
        self, module: nn.Module, *, units=(), reshard_after_forward: bool = True, compute_dtype=None, group=None
    ):
        super().__init__()
        self.module = module
        self.tracker = GatheredBytes()
        self.units: list[PerParamUnit] = []
        self._backward_started = False
        slots_of: dict = {}
        for mod in module.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None:
                    slots_of.setdefault(p, []).append((mod, attr))
        for name, mod, params in assign_units(module, list(units)):
            unit = PerParamUnit(name, mod, reshard_after_forward=reshard_after_forward and mod is not module)
            for p in params:
                sp = ShardedParam(p, group=group, compute_dtype=compute_dtype)
                for owner, attr in slots_of[p]:
                    owner._parameters[attr] = sp.local  # the registered parameter is the shard
                sp.on_reduced = lambda unit=unit: self._reduced(unit)
                unit.params.append(sp)
                unit.slots.append(slots_of[p])
            self.units.append(unit)
            mod.register_forward_pre_hook(lambda m, args, unit=unit: self._before_forward(unit))
            mod.register_forward_hook(lambda m, args, out, unit=unit: self._after_forward(unit, out))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- gather and free --------------------------------------------------------------------------
    def _gather(self, unit: PerParamUnit) -> None:
        if unit.buffers:
            return
        for sp in unit.params:
            unit.buffers.append(sp.all_gather())
            self.tracker.add(sp.gathered_bytes)

    def _refill(self, unit: PerParamUnit) -> None:
        """Gather again into the storages the forward saved for the backward (freed in between)."""
        for sp, buf in zip(unit.params, unit.buffers):
            if buf.untyped_storage().nbytes() == 0:
                buf.untyped_storage().resize_(sp.gathered_bytes)
                sp.all_gather(out=buf)
                self.tracker.add(sp.gathered_bytes)

    def _free(self, unit: PerParamUnit, forget: bool) -> None:
        for sp, buf in zip(unit.params, unit.buffers):
            if buf.untyped_storage().nbytes():
                buf.untyped_storage().resize_(0)
                self.tracker.sub(sp.gathered_bytes)
        if forget:
            unit.buffers = []

    def _before_forward(self, unit: PerParamUnit) -> None:
        self._gather(unit)
        if torch.is_grad_enabled():
            unit.pending = sum(sp.local.requires_grad for sp in unit.params)
        for sp, buf, slots in zip(unit.params, unit.buffers, unit.slots):
            full = (
                _Unshard.apply(sp, sp.local, buf.detach())
                if torch.is_grad_enabled()
                else unshard_rows(buf, sp.shape[0])
            )
            for owner, attr in slots:
                owner._parameters[attr] = full  # what the module's forward reads as its weight

    def _after_forward(self, unit: PerParamUnit, output) -> None:
        for sp, slots in zip(unit.params, unit.slots):
            for owner, attr in slots:
                owner._parameters[attr] = sp.local  # the module's parameters are the shards again
        if not torch.is_grad_enabled():
            self._free(unit, forget=True)
            return
        outs = output if isinstance(output, (tuple, list)) else [output]
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, unit=unit: self._before_backward(unit))
        if unit.reshard_after_forward:
            self._free(unit, forget=False)  # the storages stay referenced by autograd, empty

    def _before_backward(self, unit: PerParamUnit) -> None:
        if not self._backward_started:  # once per backward: free everything when autograd is done
            self._backward_started = True
            Variable._execution_engine.queue_callback(self._after_backward)
        self._refill(unit)

    def _reduced(self, unit: PerParamUnit) -> None:
        """A gradient of the unit was reduce-scattered; after the last, the block's full copy goes."""
        unit.pending -= 1
        if unit.pending == 0 and unit.reshard_after_forward:
            self._free(unit, forget=True)

    def _after_backward(self) -> None:
        for unit in self.units:
            self._free(unit, forget=True)
        self._backward_started = False

    # -- what this rank holds -----------------------------------------------------------------------
    def sharded_params(self) -> list[ShardedParam]:
        return [sp for unit in self.units for sp in unit.params]

    def memory_roles(self) -> dict:
        """What this rank keeps, by role, for ``timeline.StepTimeline`` (notebook 04)."""
        sps = self.sharded_params()
        return {
            "params": [sp.padded for sp in sps],
            "grads": [sp.local.grad for sp in sps],
            "gathered": [b for unit in self.units for b in unit.buffers],
        }

    def held_bytes(self) -> int:
        """Bytes of the shards this rank keeps at rest, padding included (the padded storages)."""
        return sum(sp.padded.untyped_storage().nbytes() for sp in self.sharded_params())

    def full_state_dict(self) -> dict:
        """The full fp32 weights keyed like the wrapped module's ``state_dict()`` (collective)."""
        values = {}
        for sp in self.sharded_params():
            gathered = torch.empty((sp.nd * sp.c, *sp.shape[1:]), dtype=sp.padded.dtype, device=sp.padded.device)
            all_gather_single(gathered, sp.padded, group=sp.group)
            values[sp.local] = unshard_rows(gathered, sp.shape[0]).clone()
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            out[key] = values[value] if value in values else value.detach().clone()
        return out
