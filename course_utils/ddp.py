"""Data parallelism: torch's DistributedDataParallel, and a bucketed DDP built by hand (notebook 02).

- torch's ``DistributedDataParallel`` (the record's ``ddp`` row, ``apply.apply_ddp``): the library
  version every later notebook compares against.
- ``BucketedDDP`` (the ``ddp_scratch`` row): the same design written out, following PyTorch's
  DDP design note. Rank 0 broadcasts its weights at construction; gradients are packed into
  buckets in roughly the reverse of ``parameters()`` order, capped by a byte size; a hook fires
  as each gradient is ready; a full bucket's all-reduce starts at once, asynchronously, and the
  all-reduces go out in bucket-index order; before the optimizer step every handle is waited on
  and the mean gradient is written into ``param.grad``. It never calls torch's DDP.
- The notebook's experiments (the bucket sweep, unused parameters, mismatched collective order) are
  ``course_utils.labs.lab02``.

Every rank holds the full model, its gradients and its optimizer state: 16Ψ bytes (fp32 Adam:
4 + 4 + 8; mixed-precision Adam: 2 + 2 + 12). Only the gradients are communicated.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .units import MiB  # torch's bucket_cap_mb counts MiB (2^20 bytes); so does BucketedDDP

# ---------------------------------------------------------------- DDP by hand


class Bucket:
    """Gradients all-reduced together as one flat tensor (notebook 02)."""

    def __init__(self, index: int, named_params: list):
        self.index = index
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.buffer = torch.zeros(
            sum(p.numel() for p in self.params), dtype=self.params[0].dtype, device=self.params[0].device
        )
        self.views = list(self.buffer.split([p.numel() for p in self.params]))  # one slice per gradient
        self.ready: set[int] = set()  # positions whose gradient arrived in this backward
        self.work = None  # the async all-reduce, once issued

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def is_full(self) -> bool:
        return len(self.ready) == len(self.params)


def make_buckets(module: nn.Module, cap_bytes: int) -> list[Bucket]:
    """Pack the gradients of ``module`` into buckets of at most ``cap_bytes`` (notebook 02).

    Backward produces the last layer's gradients first, so the parameters go in reverse
    ``parameters()`` order and bucket 0 is the first to fill. A new bucket starts when the next
    gradient would pass the cap (a gradient larger than the cap gets a bucket of its own) or
    has another dtype or device. A tied weight appears once; frozen parameters not at all.
    """
    groups, current, size = [], [], 0
    for name, p in reversed(list(module.named_parameters())):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and (
            size + nbytes > cap_bytes or (p.dtype, p.device) != (current[0][1].dtype, current[0][1].device)
        ):
            groups.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        groups.append(current)
    return [Bucket(i, g) for i, g in enumerate(groups)]


class BucketedDDP(nn.Module):
    """Data parallelism built by hand, after PyTorch's DDP design note (notebook 02).

    ``ddp = BucketedDDP(model)``; then each step: ``loss = ddp(x, y)``, ``loss.backward()``,
    ``ddp.finish_gradient_synchronization()``, ``optimizer.step()``.

    Args:
        module: any ``nn.Module`` (kept as ``.module``); tied weights and frozen parameters are fine.
        bucket_cap_mb: bucket size cap in MiB, as torch's ``bucket_cap_mb``.
        group: the process group to average over (default: every rank).
        timeline: record ``(time, event, bucket, parameter)`` in ``.timeline`` for the overlap plot.
            "end" is when the all-reduce's future completed on the host: with gloo, when the sum
            arrived; with NCCL the future follows CUDA stream order, so use torch.profiler there.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None, timeline: bool = False):
        super().__init__()
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.timeline = [] if timeline else None
        self._broadcast_from_rank0()
        self.buckets = make_buckets(module, int(bucket_cap_mb * MiB))
        self._slot = {}  # parameter -> (its bucket, its position there)
        for bucket in self.buckets:
            for pos, p in enumerate(bucket.params):
                self._slot[p] = (bucket, pos)
                p.register_post_accumulate_grad_hook(self._gradient_ready)
        self._next = 0  # index of the next bucket to all-reduce

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Every replica starts from rank 0's weights (and buffers)."""
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            dist.broadcast(t, group=self.group, group_src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, param) -> None:
        """Hook: ``param.grad`` is final for this backward; copy it into its bucket."""
        bucket, pos = self._slot[param]
        bucket.views[pos].copy_(param.grad.reshape(-1))
        bucket.ready.add(pos)
        self._mark("ready", bucket.index, bucket.names[pos])
        self._issue_full_buckets()

    def _issue_full_buckets(self) -> None:
        """Start the all-reduce of each full bucket, strictly in bucket-index order.

        Every rank must issue the same collectives in the same order. Buckets can fill in a
        different order on different ranks; indices are the same everywhere.
        """
        while self._next < len(self.buckets) and self.buckets[self._next].is_full():
            bucket = self.buckets[self._next]
            bucket.buffer.div_(self.world_size)  # the sum over ranks of g / N is the mean
            self._mark("start", bucket.index)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            if self.timeline is not None:
                bucket.work.get_future().then(lambda _, i=bucket.index: self._mark("end", i))
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the mean gradient into ``param.grad``."""
        for bucket in self.buckets:
            if bucket.work is None:
                missing = [n for pos, n in enumerate(bucket.names) if pos not in bucket.ready]
                raise RuntimeError(
                    f"bucket {bucket.index} never filled: {', '.join(missing)} got no gradient in this "
                    f"backward, so bucket {bucket.index} and every later bucket (issued in index order) "
                    "were never all-reduced. Make the loss use every parameter, or freeze the unused ones "
                    "(requires_grad=False) before wrapping."
                )
            bucket.work.wait()
            for p, view in zip(bucket.params, bucket.views):
                p.grad.copy_(view.view_as(p))
            bucket.ready.clear()
            bucket.work = None
        self._next = 0
        self._mark("synced")

    def _mark(self, event: str, bucket: int | None = None, name: str = "") -> None:
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), event, bucket, name))

    def full_state_dict(self) -> dict:
        """The weights of the wrapped module, keyed like its ``state_dict()`` (every rank holds them whole)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def describe(self) -> dict:
        """Bucket layout for reports: cap, count, bytes and parameter names per bucket."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "buckets": len(self.buckets),
            "bucket_bytes": [b.nbytes for b in self.buckets],
            "bucket_params": [b.names for b in self.buckets],
        }
