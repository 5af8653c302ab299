"""ZeRO's flat layout: parameters laid end to end in one buffer padded to Nd·S, rank r owning [r·S, (r+1)·S) (notebook 03).

Every hand-built stage (``zero.stages``, ``zero.stage3``) rests on ``FlatParams``. Padding is the
only thing in a flat buffer that is not a parameter; every function here counts it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single / reduce_scatter_single;
# compat resolves the newest name this torch has (an older torch, Colab's say, has only the old ones)
from ..compat import all_gather_single, newest_collective, reduce_scatter_single  # noqa: E402, F401 (newest_collective)
from ..errors import CourseInputError

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


def unit_row(name: str, flat: FlatParams, trainable: bool = True) -> dict:
    """One flat buffer as a report's row: name, Ψ of its parameters, padded size, slice, padding (notebook 03)."""
    return {
        "name": name,
        "numel": flat.numel,
        "padded": flat.padded,
        "shard_numel": flat.shard_numel,
        "padding": flat.padding,
        "trainable": trainable,
    }
