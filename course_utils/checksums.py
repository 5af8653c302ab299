"""Checksums of a state dict in any layout: what a resume loads, verified (notebook 06).

``course_utils.checkpoint`` writes ``state_checksums`` into every ``commit.json`` at save time
and compares them after a resume has loaded (``checksum_problems``). Each checksum is a sum over
elements of a mix of the value's bits and its index in the global tensor, modulo 2^64: the
pieces of a sharded tensor (DTensor) add up to the same number however it is laid out (2 ranks,
4 ranks, whole on one), so a checkpoint saved by one strategy and world size verifies under
another without gathering anything, and a value moved to another position counts as a change.
Course-built; ``instrument.weights_sha256`` does the same job for a full state dict.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

#: splitmix64's multipliers as signed 64-bit integers (torch has no uint64 arithmetic).
_MIX = tuple(c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flat_items(state, prefix: str = ""):
    """``(dotted key, value)`` of a nested state dict, dicts and lists walked as DCP flattens them."""
    if isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from _flat_items(state[k], f"{prefix}{k}.")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from _flat_items(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], state


#: Elements hashed at once: the int64 temporaries stay ~100 MB however large a tensor is.
_CHUNK = 1 << 22


def _positional_sum(local: torch.Tensor, offsets, global_shape) -> torch.Tensor:
    """Σ over elements of mix(bits of the value, index in the global tensor), modulo 2^64.

    A sum, so the pieces of a sharded tensor add up to the same number in any layout (2 ranks,
    4 ranks, whole on one): the check needs no gather. Mixing in the global index makes a
    value moved to another position count as a change. Large tensors go in slices of rows.
    """
    if local.dim() > 0 and local.numel() > _CHUNK:
        rows = max(1, _CHUNK // max(1, local[0].numel()))
        total = torch.zeros((), dtype=torch.int64, device=local.device)
        for start in range(0, local.shape[0], rows):
            total += _positional_sum(local[start : start + rows], [int(offsets[0]) + start, *offsets[1:]], global_shape)
        return total
    t = local.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    bits = t.contiguous().reshape(-1).view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)
    index = torch.zeros((), dtype=torch.int64, device=t.device)
    stride = 1
    for d in reversed(range(len(global_shape))):
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        index = index + (torch.arange(t.shape[d], device=t.device) + int(offsets[d])).view(shape) * stride
        stride *= int(global_shape[d])
    z = bits * _MIX[0] + index.reshape(-1) * _MIX[1] + 1
    z = (z ^ (z >> 31)) * _MIX[2]
    z = z ^ (z >> 29)
    return z.sum()


def _dtensor_piece(v):
    """This rank's share of a DTensor's checksum: its local piece, or nothing for a replicated copy."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coord = v.device_mesh.get_coordinate()
    if coord is None or any(p.is_replicate() and c != 0 for p, c in zip(v.placements, coord)):
        return None  # not on this mesh, or another rank's copy of a replicated dim counts
    _, offsets = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
    return v.to_local(), offsets, v.shape


def state_checksums(state: dict, info) -> dict[str, str]:
    """A checksum per entry of a state dict as this rank holds it, in any layout (notebook 06).

    Collective (one all-reduce). Sharded tensors (DTensors) get one checksum for the whole
    global tensor, the sum of every rank's piece, so a checkpoint saved by ddp on 2 ranks and
    loaded by full_shard on 4 compares equal exactly when every element arrived at its place.
    Plain tensors (replicated weights, rank-local RNG and data position) and other values
    (step counts, learning rates) get this rank's own checksum. Course-built; the same job
    ``weights_sha256`` does for a full state dict, without gathering one.
    """
    from torch.distributed.tensor import DTensor

    items = dict(_flat_items(state))
    out, sharded = {}, sorted(k for k, v in items.items() if isinstance(v, DTensor))
    if sharded:
        parts = []
        for key in sharded:
            piece = _dtensor_piece(items[key])
            parts.append(
                _positional_sum(*piece).to(info.device)
                if piece
                else torch.zeros((), dtype=torch.int64, device=info.device)
            )
        total = torch.stack(parts)
        dist.all_reduce(total)  # sums of int64 wrap around: modulo 2^64, as the pieces were summed
        out.update({k: f"{int(s) & (2**64 - 1):016x}" for k, s in zip(sharded, total.cpu().tolist())})
    for key, value in items.items():
        if key in out:
            continue
        if isinstance(value, torch.Tensor):
            out[key] = f"{int(_positional_sum(value, [0] * value.dim(), value.shape)) & (2**64 - 1):016x}"
        else:
            out[key] = "repr:" + hashlib.sha256(repr(value).encode()).hexdigest()[:16]
    return out


def checksum_problems(now: dict, saved: dict) -> list[str]:
    """Entries whose checksum after loading differs from the one written at save time (notebook 06)."""
    return [
        f"{k} differs" if k in saved else f"{k} has no recorded checksum" for k in sorted(now) if now[k] != saved.get(k)
    ]


__all__ = ["state_checksums", "checksum_problems"]
