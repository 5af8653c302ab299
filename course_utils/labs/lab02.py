"""Notebook 02's experiments: the bucket sweep, what torch's DDP does read from torch itself, the ring's bytes
on the wire; the pitfalls (unused parameters, mismatched collective order) are ``labs.lab02_pitfalls``, the cap's
cost model ``labs.lab02_cost``; reading a step's timeline
(overlap, stragglers) ``labs.lab02_timeline``.

Each training run is the one loop (``loop.run_steps``) with the observers the notebook reads
(collectives counted, the bytes gloo wrote to its sockets, the replica
check). The mechanism they measure is ``course_utils.ddp`` (``BucketedDDP``, ``make_buckets``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import dist as cdist
from ..data import batch_for_rank
from ..ddp import BucketedDDP, make_buckets
from ..instrument import CountCollectives, Observer, weights_sha256
from ..loop import Prepared, TrainConfig, make_optimizer, module_held, run_steps
from ..models import GPT, build_model, get_config
from .lab02_cost import cap_costs
from .lab02_pitfalls import (  # noqa: F401 (notebook 02 reads them here)
    GPTWithAuxHead,
    default_collective_timeouts,
    mismatched_order,
    unused_parameters_demo,
    worker_log_errors,
)
from .lab02_timeline import GLOO_THREADS, on_one_axis, overlap_summary, straggler_summary  # noqa: F401 (notebook 02)

# ---------------------------------------------------------------- measurements (notebook 02)


def socket_bytes_written() -> int | None:
    """Bytes this process has written so far (Linux ``/proc/self/io`` wchar), or None (notebook 02).

    Around a gloo collective, and nothing else, the difference is what this rank put on its TCP sockets: the bytes
    on the wire, headers included. NCCL traffic (NVLink, InfiniBand) does not go through write() and is not seen.
    """
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("wchar"))
    except (OSError, StopIteration, ValueError):
        return None


def tcp_bytes_sent() -> int | None:
    """Bytes sent so far by every TCP socket this process holds but the store's (``TCP_INFO.tcpi_bytes_sent``), or None.

    Around a gloo collective it equals ``socket_bytes_written`` to the byte and, unlike it, ignores what the
    process prints or writes to files: exercise 02.2 reads it around a student's backward (notebook 02). The
    socket to the rendezvous store (``MASTER_PORT``) is left out: what the store exchanges is not the
    collectives' traffic (a check once read 597 bytes more than gloo's ring sent, in a run where it was there).
    """
    import os
    import socket
    import struct

    store_port = int(os.environ.get("MASTER_PORT") or 0)
    total, seen = 0, False
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd") if os.readlink(f"/proc/self/fd/{n}").startswith("socket:")]
    except OSError:
        return None
    for fd in fds:
        try:
            sock = socket.socket(fileno=os.dup(fd))  # a duplicate, its family and type read from the kernel
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ports = {sock.getsockname()[1]}
            if store_port in ports or (sock.getpeername()[1] == store_port if store_port else False):
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= 208:  # struct tcp_info: __u64 tcpi_bytes_sent at offset 200 (Linux >= 4.19)
                total, seen = total + struct.unpack_from("Q", info, 200)[0], True
        except OSError:  # a listening socket has no peer; a socket closed meanwhile
            pass
        finally:
            sock.close()
    return total if seen else None


def _gradient_vs_full_batch(model, cfg: TrainConfig, info) -> float | None:
    """On rank 0: ||g_DDP − g|| / ||g||, g the gradient one process gets from the whole global batch.

    Called after the first backward (weights still at their start), so a fresh model from the
    same seed is the reference. Other ranks return None.
    """
    if info.rank != 0:
        return None
    mcfg = get_config(cfg.model)
    ref = build_model(mcfg, seed=cfg.seed, device=info.device)
    x, y = batch_for_rank(0, 0, 1, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed, device=info.device)
    ref(x, y).backward()
    pairs = [(p.grad.double(), q.grad.double()) for p, q in zip(model.parameters(), ref.parameters())]
    return float(sum((g - r).pow(2).sum() for g, r in pairs).sqrt() / sum(r.pow(2).sum() for _, r in pairs).sqrt())


class _BucketWatch(Observer):
    """What notebook 02 watches on ``BucketedDDP`` each step (its timeline is ``lab02_cost``'s, from a step no
    ``CountCollectives`` slows): the bytes gloo wrote to its sockets during forward, backward and synchronisation,
    the step time, the first averaged gradient against the full batch's, and whether the replicas still agree."""

    def __init__(self, ddp: BucketedDDP, model, cfg: TrainConfig, info):
        self.ddp, self.model, self.cfg, self.info = ddp, model, cfg, info
        self.step_s, self.wire, self.replicas_identical, self.grad_rel = [], 0, [], None
        self.w0 = None

    def before_forward(self, step: int) -> None:
        self.w0 = socket_bytes_written()
        self.t0 = time.perf_counter()

    def before_update(self, step: int) -> None:  # finish_gradient_synchronization has run
        if self.w0 is not None:
            self.wire += socket_bytes_written() - self.w0
        if step == 0:
            self.grad_rel = _gradient_vs_full_batch(self.model, self.cfg, self.info)

    def after_step(self, step: int, losses: list) -> None:
        self.step_s.append(time.perf_counter() - self.t0)  # the median leaves out step 0 (and its check)
        hashes = [None] * self.info.world_size  # the replica check: not training, not counted
        dist.all_gather_object(hashes, weights_sha256(self.model.state_dict()))
        self.replicas_identical.append(len(set(hashes)) == 1)


def _sweep_one_cap(cfg: TrainConfig, info, cap_mb: float) -> dict:
    """Train ``cfg.steps`` steps of BucketedDDP at one bucket cap in the one loop, and watch it."""
    model = build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    ddp = BucketedDDP(model, bucket_cap_mb=cap_mb)
    optimizer = make_optimizer(ddp.parameters(), cfg)
    prepared = Prepared(
        model=ddp,
        optimizer=optimizer,
        full_state_dict=lambda: model.state_dict(),
        held=lambda: module_held(model, optimizer),
        before_step=ddp.finish_gradient_synchronization,
    )
    count, watch = CountCollectives(), _BucketWatch(ddp, model, cfg, info)
    losses = run_steps(prepared, cfg, info, range(cfg.steps), [count, watch])
    mean_losses = torch.stack(losses).to(info.device)
    dist.all_reduce(mean_losses)
    counted = count.summary(cfg.steps).get("all_reduce", {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})
    return {
        "cap_mb": cap_mb,
        **ddp.describe(),
        "calls_per_step": counted["calls"],
        "payload_bytes_per_step": counted["payload_bytes"],
        "sent_bytes_per_step": counted["sent_bytes"],
        "wire_bytes_per_step": None if watch.w0 is None or info.backend != "gloo" else watch.wire / cfg.steps,
        "step_time_s": statistics.median(watch.step_s[1:] or watch.step_s),
        "losses": (mean_losses / info.world_size).cpu().tolist(),
        "replicas_identical": watch.replicas_identical,
        "weights_sha256": weights_sha256(model.state_dict()),
        "grad_rel_vs_full_batch": watch.grad_rel,
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }


# ---------------------------------------------------------------- reading the results


def weights_agreement(a: dict, b: dict, start: dict) -> dict:
    """How close two runs' final weights are, relative to how far training moved them (notebook 02).

    ``rel`` = ||a − b|| / ||a − start|| over the whole model (each distinct tensor once); ``worst``
    lists the three tensors with the largest relative difference. The attention key bias (the
    middle third of each ``qkv.bias``) is listed apart: its true gradient is exactly zero
    (softmax ignores a shift shared by all keys), so each run moves it by Adam-normalised
    rounding noise; it cannot change any output.
    """
    rows, diff2, moved2 = [], 0.0, 0.0
    seen = set()
    for name in sorted(a):
        if a[name].data_ptr() in seen:  # a tied weight saved under two names
            continue
        seen.add(a[name].data_ptr())
        x, y, s = (t[name].detach().double().reshape(-1) for t in (a, b, start))
        parts = {name: slice(None)}
        if name.endswith("attn.qkv.bias"):
            h = x.numel() // 3
            parts = {f"{name}[q]": slice(0, h), f"{name}[k]": slice(h, 2 * h), f"{name}[v]": slice(2 * h, 3 * h)}
        for label, sl in parts.items():
            d, m = float((x[sl] - y[sl]).norm()), float((x[sl] - s[sl]).norm())
            rows.append({"tensor": label, "max_abs": float((x[sl] - y[sl]).abs().max()), "rel": d / m if m else 0.0})
            diff2, moved2 = diff2 + d * d, moved2 + m * m
    rows.sort(key=lambda r: -r["rel"])
    return {
        "rel": (diff2 / moved2) ** 0.5 if moved2 else 0.0,
        "max_abs": max(r["max_abs"] for r in rows),
        "worst": rows[:3],
        "key_bias": [r for r in rows if r["tensor"].endswith("[k]")],
    }


# ---------------------------------------------------------------- torch's DDP, read from torch itself (notebook 02)


def extra_buffer_bytes(grads, buffers) -> int:
    """Bytes of ``buffers`` whose storage no gradient in ``grads`` shares (notebook 02).

    The communication buckets are a second gradient-sized copy unless ``param.grad`` is a view
    into them (torch's ``gradient_as_bucket_view=True``): this counts what they really add, by
    comparing storages, not by a formula.
    """
    grad_storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
    seen, extra = set(), 0
    for b in buffers:
        ptr = b.untyped_storage().data_ptr()
        if ptr not in grad_storages and ptr not in seen:
            seen.add(ptr)
            extra += b.untyped_storage().nbytes()
    return extra


def _mean_local_gradients(cfg: TrainConfig, info, x, y) -> dict:
    """The gradient of this rank's batch on a plain model, averaged over ranks by one all-reduce each:
    the mean every DDP must deliver, computed without any DDP."""
    model = build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    model(x, y).backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out[name] = g / info.world_size
    return out


def _rel_to_mean(model, mean: dict) -> float:
    """max |grad − mean| / max |mean| over every parameter of ``model`` (inf where a grad is missing)."""
    scale = max(float(g.abs().max()) for g in mean.values())
    worst = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            return float("inf")
        worst = max(worst, float((p.grad - mean[name]).abs().max()))
    return worst / scale


def _torch_layout(ddp_model, names: list) -> dict:
    """torch DDP's bucket sizes (bytes) and parameter names per bucket, from its own logging data."""
    data = ddp_model._get_ddp_logging_data()

    def sizes(key):
        return [int(s) for s in str(data[key]).split(",")] if key in data else None

    indices = data.get("rebuilt_per_bucket_param_indices")
    return {
        "bucket_cap_bytes": int(data["bucket_cap_bytes"]),
        "bucket_sizes": sizes("bucket_sizes"),
        "rebuilt_bucket_sizes": sizes("rebuilt_bucket_sizes"),
        "rebuilt_names": None
        if indices is None
        else [[names[int(i)] for i in part.split()] for part in str(indices).split(",")],
        "gradient_as_bucket_view": bool(data["gradient_as_bucket_view"]),
    }


def torch_ddp_internals(cfg: TrainConfig, info, cap_mb: float, steps: int = 3) -> dict:
    """What torch's DDP does, read from torch itself, beside the hand-built one (collective; notebook 02).

    For torch's default cap (``bucket_cap_mb=None``) and for ``cap_mb``, with and without
    ``gradient_as_bucket_view``, trains ``steps`` steps and reports: the bucket sizes from
    ``_get_ddp_logging_data()`` before the first backward and after the rebuild, with the
    parameter names of each rebuilt bucket; the bytes its bucket buffers add beyond the
    gradients (buffers captured by a comm hook, storages compared with ``param.grad``'s); and,
    right after ``loss.backward()`` returns, how far ``param.grad`` is from the mean of every
    rank's local gradient (computed without DDP). The same two measurements are made on
    ``BucketedDDP`` (after backward, and after ``finish_gradient_synchronization``).
    Measured on torch 2.13 CPU, tiny model: one 474,112-byte bucket on the first iteration at
    any cap; at 0.1 MiB four rebuilt buckets in gradient-arrival order; 4Ψ extra bytes without
    the view option, 0 with it; torch's gradients averaged when backward returns, the
    hand-built one's only after the explicit wait.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    mcfg = get_config(cfg.model)
    batches = [
        batch_for_rank(
            step,
            info.rank,
            info.world_size,
            batch=cfg.batch,
            seq=mcfg.seq,
            vocab=mcfg.vocab,
            seed=cfg.seed,
            device=info.device,
        )
        for step in range(steps)
    ]
    mean0 = _mean_local_gradients(cfg, info, *batches[0])
    out = {"default_first_bucket_bytes": dist._DEFAULT_FIRST_BUCKET_BYTES, "torch": {}}
    for cap, view in ((None, False), (cap_mb, False), (cap_mb, True)):
        model = build_model(mcfg, seed=cfg.seed, device=info.device)
        names = [n for n, _ in model.named_parameters()]
        wrapped = DistributedDataParallel(model, bucket_cap_mb=cap, gradient_as_bucket_view=view)
        first = _torch_layout(wrapped, names)["bucket_sizes"]
        buffers = {}

        def hook(state, bucket, buffers=buffers):  # the default all-reduce; it only keeps a handle on the buffer
            buffers[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, hook)
        row = {}
        for step, (x, y) in enumerate(batches):
            wrapped(x, y).backward()
            if step == 0:  # nothing called after backward: is the gradient already the mean?
                row["rel_to_mean_after_backward"] = _rel_to_mean(model, mean0)
            if step == steps - 1:
                row["extra_bucket_bytes"] = extra_buffer_bytes([p.grad for p in model.parameters()], buffers.values())
            model.zero_grad(set_to_none=True)
        layout = _torch_layout(wrapped, names)
        out["torch"][(cap, view)] = {**layout, "first_iteration_bucket_sizes": first, **row}
        del wrapped
    model = build_model(mcfg, seed=cfg.seed, device=info.device)
    scratch = BucketedDDP(model, bucket_cap_mb=cap_mb)
    scratch(*batches[0]).backward()
    after_backward = _rel_to_mean(model, mean0)
    scratch.finish_gradient_synchronization()
    out["scratch"] = {
        "rel_to_mean_after_backward": after_backward,
        "rel_to_mean_after_finish": _rel_to_mean(model, mean0),
        "extra_bucket_bytes": extra_buffer_bytes(
            [p.grad for p in model.parameters()], [b.buffer for b in scratch.buckets]
        ),
        "bucket_sizes": [b.nbytes for b in scratch.buckets],
        "bucket_names": [b.names for b in scratch.buckets],
    }
    return out


def ddp_measurements(config: dict, caps_mb: list, torch_cap_mb: float) -> dict | None:
    """One launch for notebook 02: the sweep's rows (``step_time_s`` from ``lab02_cost.cap_costs``' clean steps;
    ``counted_step_time_s`` with every operator counted; ``timelines``: every rank's timeline of the clean step
    ``timeline_step`` nearest the median, which took ``timeline_step_s`` on rank 0), ``torch_ddp_internals`` at
    ``torch_cap_mb`` and the cost model's readings. Rank 0 returns ``{"sweep", "torch_ddp", "costs"}``; the other
    ranks None.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:
        rows = [_sweep_one_cap(cfg, info, float(cap)) for cap in caps_mb]
        internals = torch_ddp_internals(cfg, info, float(torch_cap_mb))
        costs = cap_costs(cfg, info, [float(cap) for cap in caps_mb]) if caps_mb else None
        for row in rows:  # the sweep's own steps ran with every operator counted: time from the clean run
            row["counted_step_time_s"] = row["step_time_s"]
            steps = costs["step_s"][row["cap_mb"]]  # rank 0's clean steps, in order
            row["step_time_s"] = statistics.median(steps)
            k = min(range(len(steps)), key=lambda i: abs(steps[i] - row["step_time_s"]))  # a typical step
            row["timelines"] = [per_rank[k] for per_rank in costs["timelines"][row["cap_mb"]]]  # own clocks
            row["timeline_step_s"], row["timeline_step"] = steps[k], k
        return {"sweep": rows, "torch_ddp": internals, "costs": costs} if info.rank == 0 else None


def all_reduce_on_the_wire(numel: int) -> list | None:
    """Bytes each rank writes to gloo's sockets for one fp32 all-reduce of ``numel`` elements (collective; notebook 02).

    A warm-up all-reduce first opens every connection; then one all-reduce of ``numel`` ones is
    timed by ``socket_bytes_written`` on every rank, and its result checked (every element = N).
    Rank 0 returns the list of every rank's bytes (None where ``/proc/self/io`` is missing);
    the other ranks None. This is the measurement the ring model 4·2(N−1)/N·numel is held to.
    """
    with cdist.session() as info:
        dist.all_reduce(torch.ones(numel, device=info.device))  # warm-up: connections, buffers
        t = torch.ones(numel, device=info.device)
        before = socket_bytes_written()
        dist.all_reduce(t)
        after = socket_bytes_written()
        if not bool((t == info.world_size).all()):
            raise RuntimeError("all-reduce returned a wrong sum")
        wire = None if before is None or info.backend != "gloo" else after - before
        everyone = [None] * info.world_size
        dist.all_gather_object(everyone, wire)
        return everyone if info.rank == 0 else None


#: The caps notebook 02 prices on a GPU: powers of two from 256 KiB to 1 GiB, and torch's default of 25 MiB.
GPU_CAPS = sorted([2**k for k in range(18, 31)] + [25 * 2**20])


def preset_buckets(name: str, caps_bytes=GPU_CAPS) -> dict:
    """A published model's gradients and DDP's buckets at each cap, for ``plan.gpu_bucket_caps`` (notebook 02).

    The preset is built on the meta device (shapes, no memory) and bucketed by ``ddp.make_buckets``, the rule
    the hand-built DDP uses: whole tensors in reverse ``parameters()`` order, the embedding last. Returns
    ``{"tensors": [(name, bytes)] in that order, "buckets": {cap: [{"bytes", "names"}]}}``."""
    from ..presets import preset

    with torch.device("meta"):
        model = GPT(preset(name).cfg)
    tensors = [(n, p.numel() * p.element_size()) for n, p in reversed(list(model.named_parameters()))]
    return {
        "tensors": tensors,
        "buckets": {
            cap: [{"bytes": b.nbytes, "names": b.names} for b in make_buckets(model, cap)] for cap in caps_bytes
        },
    }
