"""Notebook 02's exercises: an averaging gradient hook, and buckets all-reduced asynchronously.

References: the full-batch gradient of one process (what data parallelism must reproduce),
``ddp.make_buckets`` (the course's bucket layout), ``CommCounter`` and ``comm.all_reduce_sent``.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist

from ..comm import all_reduce_sent
from ..data import batch_for_rank
from ..ddp import make_buckets
from ..instrument import CommCounter
from ..models import build_model, get_config
from .core import Exercise, Wrong, register

BATCH = 8  # global batch; every world size used here divides it


def _grads(model, x, y) -> dict:
    model.zero_grad(set_to_none=True)
    model(x, y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@cache
def reference_grads(world: int) -> tuple[dict, list[dict]]:
    """The full batch's gradients on one process, and each rank's own batch's (no averaging)."""
    cfg = get_config("tiny")
    model = build_model(cfg, seed=0)
    kw = dict(batch=BATCH, seq=cfg.seq, vocab=cfg.vocab)
    full = _grads(model, *batch_for_rank(0, 0, 1, **kw))
    return full, [_grads(model, *batch_for_rank(0, r, world, **kw)) for r in range(world)]


def hook_on_rank(fn, info) -> dict:
    """Every parameter gets the student's hook; this rank's gradients after the backward (the verdict compares)."""
    cfg = get_config("tiny")
    model = build_model(cfg, seed=0)
    x, y = batch_for_rank(0, info.rank, info.world_size, batch=BATCH, seq=cfg.seq, vocab=cfg.vocab)
    handles = [p.register_hook(fn) for p in model.parameters()]
    model(x, y).backward()
    for h in handles:
        h.remove()
    return {"grads": {name: p.grad for name, p in model.named_parameters()}}


def hook_verdict(per_rank: dict) -> None:
    n = len(per_rank)
    full, local = reference_grads(n)
    for rank, r in sorted(per_rank.items()):
        for name, ref in full.items():
            g = r["grads"].get(name)
            if not isinstance(g, torch.Tensor) or g.shape != ref.shape:
                raise Wrong(
                    f"after the backward rank {rank} has no gradient of {name}'s shape: return the new gradient"
                )
            err = ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if err <= 1e-5:
                continue
            where = f"rank {rank}'s gradient for {name}"
            ratio = (g.norm() / ref.norm().clamp_min(1e-30)).item()
            if torch.equal(g, local[rank][name]) and n > 1:
                raise Wrong(f"{where} is its own batch's gradient: the hook must all-reduce it with the other ranks")
            if abs(ratio - n) < 0.05 * n:
                raise Wrong(
                    f"{where} is {ratio:.2f}x the reference: did you average over ranks "
                    f"(divide the all-reduced sum by the world size, {n})?"
                )
            if abs(ratio - 1 / n) < 0.05 / n:
                raise Wrong(f"{where} is 1/{n} of the reference: did you divide by the world size twice?")
            raise Wrong(
                f"{where} differs from the full-batch gradient by {err:.2g} (relative): "
                "after the hook every rank must hold the mean of all ranks' gradients"
            )


register(
    Exercise(
        "02",
        "averaging_hook",
        "An averaging gradient hook",
        "every rank's gradients, with the hook on every parameter, against one process's full-batch gradient (2 ranks)",
        task="Write `averaging_hook(grad)`: a tensor hook (`p.register_hook(averaging_hook)`) that returns the "
        "gradient averaged over all ranks. After the backward every rank must hold exactly the gradient one "
        "process computes on the whole global batch. Predict first: what does rank 1 hold if you forget to "
        "divide?",
        stub="def averaging_hook(grad):\n"
        '    """Return grad averaged over every rank (runs on every rank, once per parameter, during backward)."""\n'
        '    raise NotImplementedError("exercise 02.averaging_hook: your code here")\n',
        hints=(
            "`torch.distributed` is imported as `dist`; `dist.all_reduce(t)` sums `t` over the ranks in place.",
            "Work on a copy (`g = grad.clone()`): the hook should return the new gradient, not edit autograd's.",
            "The mean is the sum divided by `dist.get_world_size()`: each rank's loss is already a mean over its "
            "own samples, and the ranks' batches are the same size.",
        ),
        on_rank=hook_on_rank,
        verdict=hook_verdict,
        nproc=2,
    )
)


# ---------------------------------------------------------------------------------------------

CAP_BYTES = 64 * 1024  # small buckets, so the tiny model has several


class _Recorder:
    """Stands in for ``dist.all_reduce`` while the student's function runs: who was issued, how, waited."""

    def __init__(self, buckets):
        self.ids = {b.data_ptr(): i for i, b in enumerate(buckets)}
        self.issued, self.waited, self.first_wait_after = [], set(), None
        self.real = dist.all_reduce

    def all_reduce(self, tensor, *args, async_op=False, **kwargs):
        index = self.ids.get(tensor.data_ptr(), -1)
        self.issued.append((index, bool(async_op)))
        work = self.real(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        recorder = self

        class Work:
            def wait(self, *a, **k):
                if recorder.first_wait_after is None:
                    recorder.first_wait_after = len(recorder.issued)
                recorder.waited.add(index)
                return work.wait(*a, **k)

            def __getattr__(self, name):
                return getattr(work, name)

        return Work()


def _buckets(world: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients packed as the course packs them (``ddp.make_buckets``)."""
    cfg = get_config("tiny")
    model = build_model(cfg, seed=0)
    grads = _grads(model, *batch_for_rank(0, rank, world, batch=BATCH, seq=cfg.seq, vocab=cfg.vocab))
    names = {p: n for n, p in model.named_parameters()}
    return [torch.cat([grads[names[p]].reshape(-1) for p in b.params]) for b in make_buckets(model, CAP_BYTES)]


@cache
def reference_buckets(world: int) -> list[torch.Tensor]:
    """Every bucket's mean over the ranks: what each rank's buckets must hold afterwards."""
    return [sum(parts) / world for parts in zip(*(_buckets(world, r) for r in range(world)))]


def buckets_on_rank(fn, info) -> dict:
    mine = _buckets(info.world_size, info.rank)
    recorder = _Recorder(mine)
    dist.all_reduce = recorder.all_reduce
    try:
        with CommCounter() as comm:
            fn(mine)
    finally:
        dist.all_reduce = recorder.real
    return {
        "issued": recorder.issued,
        "waited": sorted(recorder.waited),
        "first_wait_after": recorder.first_wait_after,
        "buckets": mine,
        "sent": sum(v["sent_bytes"] for v in comm.summary().values()),
    }


def buckets_verdict(per_rank: dict) -> None:
    n_ranks = len(per_rank)
    want = reference_buckets(n_ranks)
    total = sum(t.numel() * t.element_size() for t in want)
    for rank, r in sorted(per_rank.items()):
        r = dict(r, n=len(want))
        order = [i for i, _ in r["issued"]]
        if order != list(range(r["n"])):
            raise Wrong(
                f"rank {rank} issued all-reduces for buckets {order}; every bucket once, in index order "
                f"0..{r['n'] - 1}, is what keeps the ranks' collectives matched"
            )
        sync = [i for i, a in r["issued"] if not a]
        if sync:
            raise Wrong(
                f"bucket {sync[0]}'s all-reduce was blocking: pass async_op=True so the next buckets "
                "start while it is on the wire"
            )
        missing = [i for i in range(r["n"]) if i not in r["waited"]]
        if missing:
            raise Wrong(
                f"bucket {missing[0]}'s all-reduce was started but never waited on: without work.wait() "
                "the bucket may still hold a partial sum when the optimizer reads it"
            )
        if r["first_wait_after"] is not None and r["first_wait_after"] < r["n"]:
            raise Wrong(
                f"you waited on a bucket after issuing only {r['first_wait_after']} of {r['n']}: start every "
                "all-reduce first, then wait, so the buckets overlap on the wire"
            )
        for i, (got, ref) in enumerate(zip(r["buckets"], want)):
            if (
                isinstance(got, torch.Tensor)
                and got.shape == ref.shape
                and torch.allclose(got, ref, rtol=1e-5, atol=1e-8)
            ):
                continue
            ratio = (got.norm() / ref.norm()).item() if isinstance(got, torch.Tensor) and got.shape == ref.shape else 0
            why = (
                f" ({ratio:.2f}x the mean: divide the sum by the world size, after the wait)"
                if abs(ratio - n_ranks) < 0.05 * n_ranks
                else ""
            )
            raise Wrong(f"rank {rank}'s bucket {i} does not hold the mean of the ranks' gradients{why}")
        expected_sent = all_reduce_sent(total, n_ranks)
        if abs(r["sent"] - expected_sent) > 1e-6 * expected_sent:
            raise Wrong(
                f"rank {rank} sent {r['sent']:.0f} bytes; one all-reduce per bucket sends "
                f"2(N-1)/N of the buckets' bytes, {expected_sent:.0f}"
            )


register(
    Exercise(
        "02",
        "bucketed_all_reduce",
        "Buckets: asynchronous all-reduces, waited on in order",
        "issue order, async_op, waits, the buckets' means and the bytes sent (CommCounter against 2(N-1)/N of the "
        "buckets' bytes) on 2 ranks",
        task="Write `bucketed_all_reduce(buckets)`: `buckets` is a list of flat gradient tensors (bucket 0 fills first "
        "in the backward). Start an asynchronous all-reduce for every bucket, in index order, then wait on each "
        "and leave every bucket holding the mean over ranks. This is what DDP does at the end of the backward.",
        stub="def bucketed_all_reduce(buckets):\n"
        '    """Start an async all-reduce per bucket (in order), then wait on each; buckets end as means over ranks."""\n'
        '    raise NotImplementedError("exercise 02.bucketed_all_reduce: your code here")\n',
        hints=(
            "`work = dist.all_reduce(bucket, async_op=True)` returns at once; `work.wait()` blocks until the sum "
            "has arrived.",
            "Keep the works in a list while you issue every bucket; waiting inside the first loop serialises them.",
            "After each wait, `bucket.div_(dist.get_world_size())`.",
        ),
        on_rank=buckets_on_rank,
        verdict=buckets_verdict,
        nproc=2,
    )
)
