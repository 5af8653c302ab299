"""Notebook 02's exercises: an averaging gradient hook, and buckets that leave during the backward.

References: the full-batch gradient of one process (what data parallelism must reproduce),
``ddp.make_buckets`` (the course's bucket layout), ``CommCounter``, gloo's ring read from its source
(``comm.gloo_ring_plan``) against the bytes on the sockets, and torch's own ``DistributedDataParallel``
(a cached launch of the course's code, ``torch_ddp_reference``) for bit-identity.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import dist as cdist
from ..comm import gloo_ring_plan
from ..data import batch_for_rank
from ..ddp import make_buckets
from ..instrument import CommCounter, weights_sha256
from ..labs.lab02 import tcp_bytes_sent
from ..models import build_model, get_config
from .core import REFERENCE_LAUNCH, Exercise, Wrong, register

BATCH = 8  # global batch; every world size used here divides it
HOOK_RTOL = 1e-5  # 02.1: fp32 rounding passes (about 1e-7 relative); a missing or doubled division is off by order 1


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
            if err <= HOOK_RTOL:
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
        "gradient averaged over all ranks. After the backward every rank must hold the gradient one process "
        "computes on the whole global batch, up to fp32 rounding (the check allows a relative difference of "
        f"$10^{{{round(math.log10(HOOK_RTOL))}}}$). Predict first: what does rank 1 hold if you forget to divide?",
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

CAP_BYTES = 64 * 1024  # the tiny model in a dozen buckets (bucket_names): room to fill them out of order
STEPS = 3  # AdamW steps held bit for bit against torch's DDP
LR = 1e-3


def _model():
    return build_model(get_config("tiny"), seed=0)


def _batch(step: int, rank: int, world: int):
    cfg = get_config("tiny")
    return batch_for_rank(step, rank, world, batch=BATCH, seq=cfg.seq, vocab=cfg.vocab)


def bucket_names(model) -> list[list[str]]:
    """The buckets as parameter names, bucket 0 first to fill (the course's ``ddp.make_buckets``)."""
    return [b.names for b in make_buckets(model, CAP_BYTES)]


def readiness_order(names: list[list[str]]) -> list[str]:
    """The order in which the check makes gradients final: buckets fill in the order 1, 0, 3, 2, 5, 4, ... and
    each bucket's own gradients arrive last-listed first (the same on every rank). A correct hook starts buckets
    0 and 1 together once bucket 0 is full, then 2 and 3, and so on."""
    pairs = [names[i : i + 2][::-1] for i in range(0, len(names), 2)]
    return [n for pair in pairs for bucket in pair for n in reversed(bucket)]


def expected_issue_points(names: list[list[str]]) -> list[int]:
    """For each bucket b: the index of the gradient after which buckets 0..b are all full (in ``readiness_order``)."""
    seen, points, done = set(), [], 0
    for k, name in enumerate(readiness_order(names)):
        seen.add(name)
        while done < len(names) and all(n in seen for n in names[done]):
            points.append(k)
            done += 1
    return points


def local_gradients(rank: int, world: int) -> dict:
    """This rank's own gradients of step 0 (no averaging), by name: computed without any student code."""
    model = _model()
    model(*_batch(0, rank, world)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


class _Calls:
    """Stands in for ``dist.all_reduce`` while the student's code runs: each call's tensor (a copy, as issued),
    whether it was asynchronous, after how many gradients it came, and whether the backward had returned."""

    def __init__(self):
        self.real = dist.all_reduce
        self.ready = 0  # gradients made final so far (part A), set by the driver
        self.backward_returned = False  # part B, set by the driver
        self.calls = []
        self.works = []  # the asynchronous calls' handles, to count what is still in flight

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        self.calls.append(
            {
                "tensor": tensor.detach().clone(),
                "async": bool(async_op),
                "after_gradient": self.ready,
                "after_backward": self.backward_returned,
            }
        )
        work = self.real(tensor, *args, async_op=async_op, **kwargs)
        if work is not None:
            self.works.append(work)
        return work

    def __enter__(self):
        dist.all_reduce = self
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def _readiness_out_of_order(fn, info, names) -> dict:
    """Part A: the check makes each gradient final itself, one parameter at a time, buckets filling 1, 0, 3, 2, ..."""
    model = _model()
    params = dict(model.named_parameters())
    grads = local_gradients(info.rank, info.world_size)
    with _Calls() as calls:
        finish = fn([[params[n] for n in bucket] for bucket in names])
        for k, name in enumerate(readiness_order(names)):
            calls.ready = k
            (params[name] * grads[name]).sum().backward()  # params[name].grad = this rank's gradient, exactly
        calls.ready = len(params)
        finish()
    grads_after = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in params.items()}
    return {"calls": calls.calls, "grads": grads_after}


def _real_backward(fn, info, names) -> dict:
    """Part B: one real backward, its all-reduces timed against it, counted and read on the sockets."""
    model = _model()
    params = dict(model.named_parameters())
    with _Calls() as calls, CommCounter() as comm:
        finish = fn([[params[n] for n in bucket] for bucket in names])
        loss = model(*_batch(0, info.rank, info.world_size))
        before = tcp_bytes_sent()
        loss.backward()
        calls.backward_returned = True
        in_flight = sum(not w.is_completed() for w in calls.works)
        finish()
        after = tcp_bytes_sent()
    return {
        "calls": [{k: v for k, v in c.items() if k != "tensor"} | {"numel": c["tensor"].numel()} for c in calls.calls],
        "collectives": [(kind, payload) for kind, payload, _ in comm.events],
        "socket_bytes": None if before is None or after is None else after - before,
        "in_flight_at_return": in_flight,
    }


def overlap_on_rank(fn, info) -> dict:
    """Parts A, B and C on this rank; only what the student's code produced and what was measured comes back."""
    names = bucket_names(_model())
    out = {"A": _readiness_out_of_order(fn, info, names)}
    dist.barrier()
    out["B"] = _real_backward(fn, info, names)
    dist.barrier()
    model = _model()  # C: three AdamW steps
    params = dict(model.named_parameters())
    finish = fn([[params[n] for n in bucket] for bucket in names])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        model(*_batch(step, info.rank, info.world_size)).backward()
        finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["C"] = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return out


def torch_ddp_on_rank() -> dict | None:
    """Worker (the course's reference, torch's own DDP): the same three steps; rank 0 returns the weights' hash."""
    with cdist.session() as info:
        model = _model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_BYTES / 2**20)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
        for step in range(STEPS):
            ddp(*_batch(step, info.rank, info.world_size)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"sha256": weights_sha256(model.state_dict())} if info.rank == 0 else None


@cache
def _torch_ddp(world: int) -> dict:
    from ..launch import launch

    return launch(torch_ddp_on_rank, nproc=world, progress=False, echo=False, backend="gloo")[0]


def torch_ddp_reference(world: int) -> dict:
    with REFERENCE_LAUNCH:
        return _torch_ddp(world)


def _close(a, b) -> bool:
    """Equal up to fp32 rounding: relative L2 difference at most 1e-5 (a wrong bucket or scale is off by order 1)."""
    return float((a.double() - b.double()).norm()) <= 1e-5 * max(float(b.double().norm()), 1e-30)


def _which_bucket(t, names, local: dict, world: int) -> int | None:
    """The bucket whose gradients ``t`` holds (summed over nothing yet, or already divided by N), or None.

    Compared up to fp32 rounding: the grader recomputes the gradients with its own thread count, which can change
    a matmul's summation order (the bit-for-bit test is part C, against torch's DDP)."""
    for b, bucket in enumerate(names):
        flat = torch.cat([local[n].reshape(-1) for n in bucket])
        if isinstance(t, torch.Tensor) and t.shape == flat.shape and (_close(t, flat) or _close(t, flat / world)):
            return b
    return None


def _judge_issue_order(rank: int, a: dict, names, local: dict, world: int) -> None:
    issued = []
    for i, call in enumerate(a["calls"]):
        b = _which_bucket(call["tensor"], names, local, world)
        if b is None:
            raise Wrong(
                f"rank {rank}'s all-reduce #{i} carried numbers that are not one bucket's gradients: copy each "
                "gradient into its bucket, in the order the bucket lists them, and all-reduce the bucket as one flat "
                "tensor"
            )
        issued.append(b)
    if issued != list(range(len(names))):
        raise Wrong(
            f"with the buckets filling in the order 1, 0, 3, 2, ..., rank {rank} started buckets {issued}; start each "
            f"bucket once, in index order 0..{len(names) - 1} (bucket b only after buckets 0..b-1): ranks whose "
            "gradients arrive in different orders must still issue the same collectives in the same order"
        )
    blocking = [b for b, call in zip(issued, a["calls"]) if not call["async"]]
    if blocking:
        raise Wrong(
            f"bucket {blocking[0]}'s all-reduce was blocking (async_op=False): inside a hook it stops the backward "
            "until the sum arrives; pass async_op=True and wait in finish()"
        )
    points, total = expected_issue_points(names), sum(len(x) for x in names)
    for b, call in zip(issued, a["calls"]):
        k = call["after_gradient"]
        if k != points[b]:
            full = f"bucket {b} was full" if b == 0 else f"buckets 0..{b} were full"
            when = (
                "only in finish()"
                if k >= total
                else f"after gradient {k + 1}"
                if k > points[b]
                else f"after gradient {k + 1}, before it was full"
            )
            raise Wrong(
                f"{full} after gradient {points[b] + 1} of {total}, but rank {rank} started bucket {b}'s all-reduce "
                f"{when}: start it from the hook that fills it, so it overlaps the rest of the backward"
            )


def _judge_mean(rank: int, grads: dict, mean: dict, world: int) -> None:
    for name, want in mean.items():
        got = grads.get(name)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise Wrong(f"after finish(), rank {rank}'s {name}.grad is missing: write the mean back into p.grad")
        if not _close(got, want):
            ratio = float(got.norm() / want.norm()) if float(want.norm()) else float("nan")
            hint = f" ({ratio:.2f}x the mean: divide the sum by the world size)" if abs(ratio - world) < 0.01 else ""
            raise Wrong(f"after finish(), rank {rank}'s {name}.grad is not the mean over the ranks{hint}")


def _judge_real_backward(rank: int, b: dict, sizes: list, world: int) -> None:
    late = [i for i, call in enumerate(b["calls"]) if call["after_backward"]]
    if late:
        raise Wrong(
            f"in a real backward, rank {rank} started {len(late)} of {len(b['calls'])} all-reduces after "
            "loss.backward() returned: start each bucket from the hooks, during the backward"
        )
    payloads = [p for kind, p in b["collectives"] if kind == "all_reduce"]
    if payloads != [4 * s for s in sizes] or len(payloads) != len(b["collectives"]):
        raise Wrong(
            f"rank {rank} issued {[k for k, _ in b['collectives']]} carrying {payloads} bytes; one all-reduce per "
            f"bucket carries the buckets' {[4 * s for s in sizes]} bytes, nothing else"
        )
    if b["socket_bytes"] is not None:
        predicted = sum(gloo_ring_plan(4 * s, world, rank)["wire"] for s in sizes)
        if b["socket_bytes"] != predicted:
            raise Wrong(
                f"rank {rank}'s sockets sent {b['socket_bytes']:,} bytes; gloo's ring all-reduce of the {len(sizes)} "
                f"buckets sends {predicted:,} (their data plus gloo's headers): did you all-reduce something else, "
                "or a bucket twice?"
            )


def overlap_verdict(per_rank: dict) -> str:
    world = len(per_rank)
    model = _model()
    names = bucket_names(model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sizes = [sum(numel[n] for n in bucket) for bucket in names]
    local = [local_gradients(r, world) for r in range(world)]
    mean = {n: sum(g[n] for g in local) / world for n in local[0]}
    for rank, r in sorted(per_rank.items()):
        _judge_issue_order(rank, r["A"], names, local[rank], world)
        _judge_mean(rank, r["A"]["grads"], mean, world)
        _judge_real_backward(rank, r["B"], sizes, world)
    ref = torch_ddp_reference(world)["sha256"]
    for rank, r in sorted(per_rank.items()):
        if weights_sha256(r["C"]["weights"]) != ref:
            raise Wrong(
                f"after {STEPS} AdamW steps rank {rank}'s weights differ from torch's DistributedDataParallel trained "
                "the same way (on 2 ranks they must match bit for bit): is finish() called once per step, and are "
                "the buckets emptied for the next backward?"
            )
    left = ", ".join(f"rank {r}: {b['B']['in_flight_at_return']}" for r, b in sorted(per_rank.items()))
    return (
        f"all-reduces of the {len(sizes)} still in flight when loss.backward() returned: {left} "
        "(this run's timing, not a rule)"
    )


register(
    Exercise(
        "02",
        "overlapped_buckets",
        "Buckets that leave during the backward: hooks, asynchronous all-reduces, one wait",
        "which bucket each all-reduce carries and when it starts, with the buckets filling in the order 1, 0, 3, 2, "
        "...; every all-reduce started inside a real backward, the buckets' bytes on the calls and on gloo's sockets "
        "(to the byte); 3 AdamW steps bit-identical to torch's DDP (2 ranks)",
        task="Write `overlapped_buckets(buckets)`: `buckets` lists lists of parameters (bucket 0 fills first in a real "
        "backward; the check also fills them out of order). Hook every parameter "
        "(`p.register_post_accumulate_grad_hook`) to copy `p.grad` into its bucket's flat tensor; once a bucket "
        "and every bucket before it are full, start `dist.all_reduce(flat, async_op=True)`. Return `finish()`: "
        "after `loss.backward()` it waits on every handle and leaves the mean over ranks in each `p.grad`. "
        f"Predict first: with {len(bucket_names(_model()))} buckets, how many "
        "all-reduces are still in flight when the backward returns?",
        stub="def overlapped_buckets(buckets):\n"
        '    """Hook every parameter; start each bucket\'s async all-reduce from the hooks; return finish()."""\n'
        '    raise NotImplementedError("exercise 02.overlapped_buckets: your code here")\n',
        hints=(
            "One flat tensor per bucket (`torch.zeros(numel)`), and a map from each parameter to (bucket, offset); "
            "`p.register_post_accumulate_grad_hook(hook)` calls `hook(p)` once `p.grad` is final.",
            "Keep a count of filled slots per bucket and the list of started handles; in the hook, after the copy, "
            "start every full bucket from index `len(handles)` on (a `while` loop), never one whose predecessor is "
            "not full.",
            "In `finish()`: `work.wait()`, `flat.div_(dist.get_world_size())`, copy each slice back with "
            "`p.grad.copy_(flat[o:o + n].view_as(p))`, then reset the counts and handles for the next backward.",
        ),
        on_rank=overlap_on_rank,
        verdict=overlap_verdict,
        nproc=2,
        timeout_s=120.0,
    )
)
