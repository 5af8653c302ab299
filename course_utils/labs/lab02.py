"""Notebook 02's experiments: bucket sweeps, the hand-built DDP against torch's, unused parameters,
mismatched collective order.

Each training run is the one loop (``loop.run_steps``) with the observers the notebook reads
(collectives counted, each bucket's timeline, the bytes gloo wrote to its sockets, the replica
check). The mechanism they measure is ``course_utils.ddp`` (``BucketedDDP``, ``make_buckets``).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .. import dist as cdist
from ..data import batch_for_rank
from ..ddp import BucketedDDP
from ..instrument import CountCollectives, Observer, weights_sha256
from ..loop import Prepared, TrainConfig, make_optimizer, module_held, run_steps
from ..models import build_model, get_config

# ---------------------------------------------------------------- measurements (notebook 02)


def socket_bytes_written() -> int | None:
    """Bytes this process has written so far (Linux ``/proc/self/io`` wchar), or None (notebook 02).

    Around a gloo collective, and nothing else, the difference is what this rank put on its TCP
    sockets: the bytes on the wire, headers included. NCCL traffic (NVLink, InfiniBand) does
    not go through write() and is not seen.
    """
    try:
        with open("/proc/self/io") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("wchar"))
    except (OSError, StopIteration, ValueError):
        return None


def _timeline_rows(events: list, origin: float) -> dict:
    """Timeline events of one step as milliseconds after ``origin`` (the start of backward)."""
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    ready = [{"bucket": b, "param": n, "t_ms": ms(t)} for t, e, b, n in events if e == "ready"]
    start = {b: ms(t) for t, e, b, _ in events if e == "start"}
    end = {b: ms(t) for t, e, b, _ in events if e == "end"}
    return {
        "ready": ready,
        "all_reduce": [{"bucket": b, "start_ms": start[b], "end_ms": end.get(b)} for b in sorted(start)],
    }


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
    """What notebook 02 watches on ``BucketedDDP`` each step: the last step's timeline, the bytes
    gloo wrote to its sockets during forward, backward and synchronisation, the step time, the
    first averaged gradient against the full batch's, and whether the replicas still agree."""

    def __init__(self, ddp: BucketedDDP, model, cfg: TrainConfig, info):
        self.ddp, self.model, self.cfg, self.info = ddp, model, cfg, info
        self.step_s, self.wire, self.replicas_identical, self.grad_rel = [], 0, [], None
        self.w0 = None

    def before_forward(self, step: int) -> None:
        self.ddp.timeline.clear()
        self.w0 = socket_bytes_written()
        self.t0 = time.perf_counter()

    def after_forward(self, step: int, loss) -> None:
        self.t_backward = time.perf_counter()

    def after_backward(self, step: int) -> None:
        self.t_backward_end = time.perf_counter()

    def before_update(self, step: int) -> None:  # finish_gradient_synchronization has run
        self.t_synced = time.perf_counter()
        if self.w0 is not None:
            self.wire += socket_bytes_written() - self.w0
        if step == 0:
            self.grad_rel = _gradient_vs_full_batch(self.model, self.cfg, self.info)

    def after_step(self, step: int, losses: list) -> None:
        self.step_s.append(time.perf_counter() - self.t0)  # the median leaves out step 0 (and its check)
        hashes = [None] * self.info.world_size  # the replica check: not training, not counted
        dist.all_gather_object(hashes, weights_sha256(self.model.state_dict()))
        self.replicas_identical.append(len(set(hashes)) == 1)

    def timeline(self) -> dict:
        rows = _timeline_rows(self.ddp.timeline, self.t_backward)
        rows.update(
            forward_ms=(self.t0 - self.t_backward) * 1e3,
            backward_end_ms=(self.t_backward_end - self.t_backward) * 1e3,
            synced_ms=(self.t_synced - self.t_backward) * 1e3,
        )
        return rows


def _sweep_one_cap(cfg: TrainConfig, info, cap_mb: float) -> dict:
    """Train ``cfg.steps`` steps of BucketedDDP at one bucket cap in the one loop, and watch it."""
    model = build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    ddp = BucketedDDP(model, bucket_cap_mb=cap_mb, timeline=True)
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
    timeline = watch.timeline()
    timelines = [None] * info.world_size  # every rank's last step, each on its own clock
    dist.all_gather_object(timelines, timeline)
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
        "timeline": timeline,
        "timelines": timelines,
    }


def bucket_sweep(config: dict, caps_mb: list) -> list | dict:
    """One launch, several bucket caps: train with ``BucketedDDP`` at each and measure (notebook 02).

    Args:
        config: a ``TrainConfig`` as a dict (model, batch, steps, lr, seed), as ``train`` uses.
        caps_mb: bucket caps in MiB, one training run each, from the same seed and data.

    Rank 0 returns one row per cap: the bucket layout, all-reduce calls and bytes per step
    (counted by ``CommCounter``), the bytes gloo actually wrote to its sockets per step, the
    median step time, the losses, whether all ranks held byte-identical weights after every
    step, the first step's averaged gradient against the full-batch gradient of one process
    (relative L2 difference), the final weights, and the last step's timeline (gradient ready times, each bucket's
    all-reduce start and end, in ms after backward began). Other ranks return ``{"rank": r}``.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:
        rows = [_sweep_one_cap(cfg, info, float(cap)) for cap in caps_mb]
        return rows if info.rank == 0 else {"rank": info.rank}


class _TorchDDPBeside(Observer):
    """Torch DDP trained in lockstep beside the loop's BucketedDDP: same batch, same Adam (notebook 02).

    At ``before_update`` the loop's gradients are synchronised (its ``before_step`` ran) and not
    yet applied: torch DDP then runs its forward and backward on the very batch the loop used
    (``data.batch_for_rank`` of this step), the largest gradient difference is recorded, and its
    own optimizer steps. Each replica's arithmetic is its own, so interleaving them changes no bit.
    """

    def __init__(self, theirs, optimizer, ours, cfg: TrainConfig, info):
        self.theirs, self.optimizer, self.ours, self.cfg, self.info = theirs, optimizer, ours, cfg, info
        self.grad_max_diff, self.losses = [], []

    def before_update(self, step: int) -> None:
        mcfg = get_config(self.cfg.model)
        x, y = batch_for_rank(
            step,
            self.info.rank,
            self.info.world_size,
            batch=self.cfg.batch,
            seq=mcfg.seq,
            vocab=mcfg.vocab,
            seed=self.cfg.seed,
            device=self.info.device,
        )
        loss = self.theirs(x, y)
        loss.backward()
        self.grad_max_diff.append(
            max(
                float((p.grad - q.grad).abs().max())
                for p, q in zip(self.ours.module.parameters(), self.theirs.module.parameters())
                if p.requires_grad
            )
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss))


def check_against_torch_ddp(config: dict, cap_mb: float = 0.1) -> dict:
    """BucketedDDP and torch DDP side by side on every rank, step by step (notebook 02; the tests use it).

    Each rank builds the course model from a *different* seed (so only rank 0's broadcast can
    make the replicas agree) and freezes ``pos_emb.weight`` (a parameter that does not require
    gradients); the head is tied to the token embedding. One copy is wrapped in BucketedDDP and
    trained by the one loop (``loop.run_steps``); another is wrapped in torch DDP and steps
    beside it on the same batches with the same Adam (``_TorchDDPBeside``, an observer).

    Returns, per rank: whether both started from rank 0's weights, the largest gradient
    difference between the two after each step's synchronisation, both losses, and both final
    weight hashes.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:

        def replica():
            m = build_model(cfg.model, seed=1000 + info.rank, device=info.device)
            m.pos_emb.weight.requires_grad_(False)
            return m

        ours, theirs = (
            BucketedDDP(replica(), bucket_cap_mb=cap_mb),
            DistributedDataParallel(replica(), bucket_cap_mb=cap_mb),
        )
        rank0_start = weights_sha256(build_model(cfg.model, seed=1000).state_dict())
        started = [weights_sha256(m.state_dict()) == rank0_start for m in (ours.module, theirs.module)]
        opt_ours, opt_theirs = make_optimizer(ours.parameters(), cfg), make_optimizer(theirs.parameters(), cfg)
        prepared = Prepared(
            model=ours,
            optimizer=opt_ours,
            full_state_dict=lambda: ours.module.state_dict(),
            held=lambda: module_held(ours.module, opt_ours),
            before_step=ours.finish_gradient_synchronization,
        )
        beside = _TorchDDPBeside(theirs, opt_theirs, ours, cfg, info)
        losses = run_steps(prepared, cfg, info, range(cfg.steps), [beside])
        return {
            "rank": info.rank,
            "grad_max_diff": beside.grad_max_diff,
            "losses_ours": [float(v) for v in losses],
            "losses_torch": beside.losses,
            "buckets": len(ours.buckets),
            "started_from_rank0": started,
            "sha_ours": weights_sha256(ours.module.state_dict()),
            "sha_torch": weights_sha256(theirs.module.state_dict()),
        }


# ---------------------------------------------------------------- find_unused_parameters


class GPTWithAuxHead(nn.Module):
    """The course GPT plus an auxiliary head the language-model loss never touches (notebook 02).

    Think of a classifier head used only on some batches: on the others its parameters get no
    gradient, which is what ``find_unused_parameters`` is for.
    """

    def __init__(self, cfg="tiny", seed: int = 0, classes: int = 4):
        super().__init__()
        self.gpt = build_model(cfg, seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.aux_head = nn.Linear(self.gpt.cfg.width, classes)

    def forward(self, idx, targets):
        return self.gpt(idx, targets)  # aux_head is not used: its gradient never arrives


class _ForwardBackwardTimer(Observer):
    """Seconds from the start of forward to the end of gradient synchronisation, each step."""

    def __init__(self):
        self.times = []

    def before_forward(self, step: int) -> None:
        self.t0 = time.perf_counter()

    def before_update(self, step: int) -> None:
        self.times.append(time.perf_counter() - self.t0)


def _timed_steps(wrapped, cfg: TrainConfig, info, steps: int, finish=None) -> tuple[list, float]:
    """Train ``steps`` steps of ``wrapped`` in the one loop; return the losses and the median forward+backward time."""
    optimizer = make_optimizer(wrapped.parameters(), cfg)
    prepared = Prepared(
        model=wrapped,
        optimizer=optimizer,
        full_state_dict=wrapped.state_dict,
        held=lambda: module_held(wrapped, optimizer),
        before_step=finish or (lambda: None),
    )
    timer = _ForwardBackwardTimer()
    losses = run_steps(prepared, cfg, info, range(steps), [timer])
    return [float(loss) for loss in losses], statistics.median(timer.times[1:] or timer.times)


def unused_parameters_demo(config: dict, mode: str) -> dict:
    """Torch DDP and BucketedDDP on a model with a branch the loss never uses (notebook 02).

    Modes:
        "torch_without_flag": torch DDP, ``find_unused_parameters=False``; raises at the next
            forward ("Expected to have finished reduction in the prior iteration...").
        "compare": on every rank, (1) torch DDP with the flag trains ``GPTWithAuxHead``;
            (2) the cost of the flag: the plain GPT (no unused parameters) timed with and
            without it; (3) BucketedDDP's own error for the unused head, as text.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:
        if mode == "torch_without_flag":
            model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
            _timed_steps(DistributedDataParallel(model), cfg, info, cfg.steps)
            return {"rank": info.rank}
        out = {"rank": info.rank}
        model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
        out["losses_with_flag"], _ = _timed_steps(
            DistributedDataParallel(model, find_unused_parameters=True), cfg, info, cfg.steps
        )
        for flag in (False, True) * 3:  # interleaved, so drift in machine load hits both
            plain = build_model(cfg.model, seed=cfg.seed, device=info.device)
            _, t = _timed_steps(DistributedDataParallel(plain, find_unused_parameters=flag), cfg, info, cfg.steps)
            out.setdefault(f"step_s_flag_{flag}", []).append(t)
        model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
        ours = BucketedDDP(model)
        try:
            _timed_steps(ours, cfg, info, 1, finish=ours.finish_gradient_synchronization)
            out["bucketed_error"] = None
        except RuntimeError as exc:
            out["bucketed_error"] = str(exc)
        return out


# ---------------------------------------------------------------- mismatched collective order


def mismatched_order(
    mode: str = "different_size", numel: int = 1000, collective_timeout_s: float | None = None
) -> dict:
    """Ranks issue collectives in different orders, as if each issued buckets as they filled (notebook 02).

    Rank 0 keeps index order (bucket a, then bucket b); every other rank issues b first.

    Modes:
        "same_size": both buckets hold ``numel`` elements. First issued in index order on every
            rank (correct sums), then in swapped order: gloo pairs rank 0's a with rank 1's b
            and returns wrong sums with no error; the replicas silently diverge.
        "different_size": a has ``numel`` elements, b has 3. The ranks wait on messages that do
            not match: the collective times out (or gloo aborts on a message of the wrong size).
        "different_kind": rank 0 all-reduces a then broadcasts b; the others broadcast first.

    Args:
        collective_timeout_s: how long a collective waits before raising (default: the launch's).
    """
    with cdist.session(timeout_s=collective_timeout_s) as info:

        def buckets():
            a = torch.full((numel,), float(info.rank + 1), device=info.device)  # sum over ranks: N(N+1)/2
            b = torch.full((numel if mode == "same_size" else 3,), 100.0 * (info.rank + 1), device=info.device)
            return a, b

        out = {"rank": info.rank, "world_size": info.world_size}
        if mode == "same_size":
            a, b = buckets()
            for t in (a, b):  # index order on every rank
                dist.all_reduce(t)
            out["index_order"] = [float(a[0]), float(b[0])]
        a, b = buckets()
        if mode == "different_kind":
            steps = [lambda: dist.all_reduce(a), lambda: dist.broadcast(b, src=0)]
        else:
            steps = [lambda: dist.all_reduce(a), lambda: dist.all_reduce(b)]
        for run in steps if info.rank == 0 else steps[::-1]:
            run()
        out["swapped_order"] = [float(a[0]), float(b[0])]
        return out


def worker_log_errors(run_dir, limit: int = 3) -> list[str]:
    """The lines of a launch's worker logs that say why a collective failed (notebook 02).

    A worker that gloo aborts (SIGABRT) leaves no Python traceback for the launcher to report;
    its reason is only in its stderr log (``run_dir/logs/<run>/attempt_<n>/<rank>/stderr.log``).
    """
    import re
    from pathlib import Path

    pattern = re.compile(r"what\(\)|Timed out|doesn't match|mismatch|Connection closed|Read error")
    found = []
    for log in sorted(Path(run_dir).glob("logs/*/attempt_*/*/stderr.log")):
        for line in log.read_text(errors="replace").splitlines():
            line = line.strip()
            if pattern.search(line) and not line.startswith(("File ", "raise ")) and line not in found:
                found.append(line)
    return found[:limit]


# ---------------------------------------------------------------- reading the results


def overlap_summary(timeline: dict) -> dict:
    """How much of the all-reduce time ran while backward was still computing (notebook 02).

    From a ``bucket_sweep`` timeline: how many buckets started before backward ended, the time
    at least one all-reduce was in flight (the union of their intervals: they overlap, so their
    sum would be longer than the step), the part of it inside the backward pass, and how long the
    optimizer waited after backward for the last all-reduce.
    """
    end = timeline["backward_end_ms"]
    spans = [
        (r["start_ms"], r["end_ms"] if r["end_ms"] is not None else timeline["synced_ms"])
        for r in timeline["all_reduce"]
    ]
    return {
        "buckets": len(spans),
        "started_during_backward": sum(start < end for start, _ in spans),
        "in_flight_ms": _union_ms(spans),
        "in_flight_during_backward_ms": _union_ms([(start, min(stop, end)) for start, stop in spans]),
        "wait_after_backward_ms": timeline["synced_ms"] - end,
        "step_ms": timeline["synced_ms"] - timeline["forward_ms"],
    }


def _union_ms(spans) -> float:
    """Length of the union of ``(start, stop)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total


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
    """One launch for notebook 02: ``bucket_sweep``'s rows and ``torch_ddp_internals`` at ``torch_cap_mb``.

    Rank 0 returns ``{"sweep": rows, "torch_ddp": internals}``; the other ranks None.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:
        rows = [_sweep_one_cap(cfg, info, float(cap)) for cap in caps_mb]
        internals = torch_ddp_internals(cfg, info, float(torch_cap_mb))
        return {"sweep": rows, "torch_ddp": internals} if info.rank == 0 else None


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


def default_collective_timeouts() -> dict:
    """How long a collective waits before it raises, when nobody sets ``timeout`` (notebook 02).

    Read from torch, not typed in: gloo's (and every non-NCCL backend's) from
    ``torch.distributed.constants.default_pg_timeout``; NCCL's from
    ``constants.default_pg_nccl_timeout`` when this torch was built with NCCL, otherwise from the
    C++ constant ``kProcessGroupNCCLDefaultTimeout`` in the header the wheel ships
    (``torch/include/.../ProcessGroupNCCL.hpp``). torch 2.13: 30 min and 10 min.
    """
    import datetime
    import re
    from pathlib import Path

    from torch.distributed import constants

    out = {"gloo": constants.default_pg_timeout, "gloo_source": "torch.distributed.constants.default_pg_timeout"}
    if constants.default_pg_nccl_timeout is not None:
        out.update(
            nccl=constants.default_pg_nccl_timeout, nccl_source="torch.distributed.constants.default_pg_nccl_timeout"
        )
        return out
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    found = (
        re.search(r"kProcessGroupNCCLDefaultTimeout\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)", header.read_text())
        if header.exists()
        else None
    )
    nccl = None
    if found:
        ms = 1
        for factor in found.group(1).split("*"):
            ms *= int(factor)
        nccl = datetime.timedelta(milliseconds=ms)
    out.update(
        nccl=nccl,
        nccl_source="kProcessGroupNCCLDefaultTimeout in torch's ProcessGroupNCCL.hpp (this torch has no NCCL)"
        if nccl
        else "not found in this torch",
    )
    return out
