"""Notebook 03's exercises that build the mechanism: stage 2's gradient hooks, stage 3's gather and free.

Beside 03.sharded_step and 03.sharded_optimizer (one step of the arithmetic, on flat tensors), these two build
what makes a stage that stage, inside the course's own mechanism (issue 30):

03.zero2_hooks     gradient hooks fill buckets; each bucket is reduce-scattered the moment its last
                   gradient arrives (inside the backward), and its full gradients are dropped. The
                   buckets and the update are ``zero.ShardedOptimizer``'s. Checked on 2 ranks: the
                   averaged slices against one process's gradient (step 0), the weights after 3 Adam
                   steps against the course's ``GradShardedOptimizer`` bit for bit, one reduce-scatter per
                   bucket and step issued during the backward, the bytes sent, no ``.grad`` left after the
                   backward, and the peak of live full-gradient bytes below the whole gradient's 4Ψ.
03.zero3_gather_free  the pre-forward gather and the post-forward free of a stage-3 unit (each block);
                   the backward half and the root unit are ``zero.Zero3Module``'s. Checked on 2 ranks:
                   the weights after 3 Adam steps against ``Zero3Module`` bit for bit, one all-gather of
                   each block per forward, and the gathered bytes at any moment of the forward: at most
                   the root plus one block.

As everywhere (``core.Exercise``), ``on_rank`` reports what the student's code did and what was measured
around it, and may only *fail* a check early (``Wrong``, where the student's hooks left the model unable
to run); the verdicts compute every reference and decide, in the grader's process.
"""

from __future__ import annotations

from functools import cache

import torch

from ..compat import provide_renamed_collectives
from ..data import batch_for_rank
from ..instrument import CommCounter
from ..models import build_model, get_config
from .core import REFERENCE_LAUNCH, Exercise, Wrong, register

LR = 3e-3
STEPS = 3
BUCKET_CAP_MB = 0.05  # the tiny model's 474 KB of fp32 gradients in 13 buckets (whole tensors: some exceed the cap)
BATCH = 8


def _batch(step, info, world=None, rank=None):
    cfg = get_config("tiny")
    return batch_for_rank(
        step,
        info.rank if rank is None else rank,
        info.world_size if world is None else world,
        batch=BATCH,
        seq=cfg.seq,
        vocab=cfg.vocab,
    )


class _Collectives(CommCounter):
    """``CommCounter`` (kinds, payloads, the bytes sent) that also keeps, per collective, ``(kind, payload bytes,
    issued inside a backward pass?, gradients arrived so far)``: when a bucket was sent, not only how much."""

    def __init__(self, arrived: list | None = None):
        super().__init__()
        self.calls: list[tuple] = []
        self.arrived = arrived  # a one-element list the caller's gradient probe counts in

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for kind, payload, _ in self.events[before:]:
            inside = torch._C._current_graph_task_id() != -1
            self.calls.append((kind, payload, inside, self.arrived[0] if self.arrived else None))
        return out


# ---- references: the course's own code, never in the student's process (``core.Exercise``'s contract)
def course_stage2_on_rank() -> torch.Tensor:
    """Worker: the course's stage 2 (``GradShardedOptimizer``), same model, buckets, data and Adam; its weights."""
    from .. import dist as cdist
    from ..zero import GradShardedOptimizer

    with cdist.session() as info:
        model = build_model("tiny", seed=0)
        opt = GradShardedOptimizer(
            model.parameters(), torch.optim.Adam, lr=LR, foreach=False, bucket_cap_mb=BUCKET_CAP_MB
        )
        for step in range(STEPS):
            model(*_batch(step, info)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def course_stage3_on_rank() -> torch.Tensor:
    """Worker: the course's stage 3 (``Zero3Module``, the blocks as units), same model, data and Adam; its weights."""
    from .. import dist as cdist
    from ..zero import Zero3Module, Zero3Optimizer

    with cdist.session() as info:
        model = build_model("tiny", seed=0)
        wrapped = Zero3Module(model, units=list(model.blocks))
        opt = Zero3Optimizer(wrapped, torch.optim.Adam, lr=LR, foreach=False)
        for step in range(STEPS):
            wrapped(*_batch(step, info)).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([t.reshape(-1) for t in wrapped.full_state_dict().values()])


@cache
def _course(worker: str, world: int) -> dict:
    from ..launch import launch

    return launch(globals()[worker], nproc=world, progress=False, echo=False, backend="gloo")


def course_weights(worker: str, world: int) -> dict:
    """Each rank's weights after the course's own run (one launch per grader process, cached)."""
    with REFERENCE_LAUNCH:
        return _course(worker, world)


def _weights_off(mine, reference: torch.Tensor) -> float | None:
    """None when a rank's weights equal the reference bit for bit; else the largest difference (nan: not a tensor
    of the reference's shape)."""
    if not isinstance(mine, torch.Tensor) or mine.shape != reference.shape:
        return float("nan")
    return None if torch.equal(mine, reference) else float((mine - reference).abs().max())


@cache
def _one_process_first_grads() -> torch.Tensor:
    """One process's gradient of step 0 on the whole global batch: what the averaged slices must equal."""
    model = build_model("tiny", seed=0)
    model(*_batch(0, None, world=1, rank=0)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# =============================================================================================
# 03.zero2_hooks
# =============================================================================================


def zero2_hooks_on_rank(fn, info) -> dict:
    provide_renamed_collectives()  # the hints' torch 2.13 names, also on an older torch
    from ..zero import ShardedOptimizer

    class Stage2Check(ShardedOptimizer):
        """Stage 1's flat buckets and update; the reduction is the student's hooks, nothing else."""

        keep_full_grads = False

        def reduce_gradients(self):
            pass

    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    opt = Stage2Check(model.parameters(), torch.optim.Adam, lr=LR, foreach=False, bucket_cap_mb=BUCKET_CAP_MB)
    flats = opt.flats
    params = [p for f in flats for p in f.params]
    full_grad_bytes = sum(p.numel() * p.element_size() for p in params)
    peak, arrived = [0], [0]

    def probe(_p):  # registered before the student's hooks: sees each bucket complete, before it is dropped
        arrived[0] += 1
        live = sum(q.grad.numel() * q.grad.element_size() for q in params if q.grad is not None)
        peak[0] = max(peak[0], live)

    for p in params:
        p.register_post_accumulate_grad_hook(probe)
    fn(flats)  # the student's hooks

    events, left_after_backward, shards0 = [], [], None
    with _Collectives(arrived) as seen:
        for step in range(STEPS):
            arrived[0] = 0
            model(*_batch(step, info)).backward()
            left_after_backward.append(sum(p.grad is not None for p in params))
            if step == 0:
                shards0 = [None if f.grad_shard is None else f.grad_shard.clone() for f in flats]
            opt.step()
            opt.zero_grad()
            events.append(len(seen.calls))
    # where each bucket's parameters sit in the model's order: the verdict lays one process's gradient out the same way
    index = {id(p): i for i, p in enumerate(model.parameters())}
    per_step = [seen.calls[(events[i - 1] if i else 0) : events[i]] for i in range(STEPS)]
    return {
        "buckets": len(flats),
        "params": len(params),
        "bucket_bytes": [f.padded * 4 for f in flats],
        "full_grad_bytes": full_grad_bytes,
        "peak_live_full_grad_bytes": peak[0],
        "grads_left_after_backward": left_after_backward,
        "per_step": [[list(e) for e in s] for s in per_step],
        "bucket_params": [[index[id(p)] for p in f.params] for f in flats],
        "shard_numel": [f.shard_numel for f in flats],
        "padded": [f.padded for f in flats],
        "rank": info.rank,
        "slices0": shards0,
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "sent": {k: v["sent_bytes"] for k, v in seen.summary(STEPS).items()},
    }


def zero2_hooks_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    course = course_weights("course_stage2_on_rank", world)
    sizes = [p.numel() for p in build_model("tiny", seed=0).parameters()]
    ref_grads = list(torch.split(_one_process_first_grads(), sizes))
    for rank, r in sorted(per_rank.items()):
        kinds = {e[0] for s in r["per_step"] for e in s}
        if "all_reduce" in kinds:
            raise Wrong(
                f"rank {rank} called all_reduce: stage 2 reduce-scatters each bucket, so every rank receives only "
                "the averaged slice it owns (an all-reduce sends twice the bytes and leaves every rank the whole sum)"
            )
        rs = [[e for e in s if e[0] == "reduce_scatter"] for s in r["per_step"]]
        if not any(rs):
            raise Wrong(
                "no reduce-scatter was issued: register a hook on every parameter "
                "(p.register_post_accumulate_grad_hook) and reduce-scatter a bucket when its last gradient has arrived"
            )
        for step, s in enumerate(rs):
            if len(s) != r["buckets"]:
                raise Wrong(
                    f"step {step}: {len(s)} reduce-scatters for {r['buckets']} buckets on rank {rank}: exactly one per "
                    "bucket and step, when the bucket's last gradient arrives (count the hooks per bucket, and reset "
                    "the count after sending)"
                )
            late = sum(not inside or seen_so_far == r["params"] for _, _, inside, seen_so_far in s)
            if late > 1:  # only the bucket holding the first layers completes with the backward's last gradient
                raise Wrong(
                    f"step {step}: {late} of {len(s)} buckets were reduce-scattered after the backward had finished "
                    "producing gradients: stage 2 sends a bucket from its last gradient's hook, while the rest of the "
                    "backward still runs, so the traffic overlaps it and the bucket's full gradients can go at once"
                )
        if any(r["grads_left_after_backward"]):
            held = r["peak_live_full_grad_bytes"]
            raise Wrong(
                f"after the backward rank {rank} still held {max(r['grads_left_after_backward'])} full gradients "
                f"(the live full gradients peaked at {held:,} bytes of {r['full_grad_bytes']:,}): after a bucket is "
                "reduce-scattered, set each of its parameters' .grad to None, that is what stage 2 saves"
            )
        for b, (idx, got) in enumerate(zip(r["bucket_params"], r["slices0"])):
            size = r["shard_numel"][b]
            want = torch.zeros(r["padded"][b])  # one process's gradient, laid out as this bucket is
            flat_ref = torch.cat([ref_grads[i].reshape(-1) for i in idx])
            want[: flat_ref.numel()] = flat_ref
            w = want[rank * size : (rank + 1) * size]
            if not isinstance(got, torch.Tensor) or got.shape != w.shape:
                raise Wrong(
                    f"bucket {b} has no averaged slice on rank {rank} after the backward: store the reduce-scatter's "
                    "output (this rank's S elements) in flat.grad_shard"
                )
            err = float((got - w).abs().max() / w.abs().max().clamp_min(1e-30))
            if err > 1e-5:
                ratio = float(got.abs().sum() / w.abs().sum().clamp_min(1e-30))
                if abs(ratio - world) < 0.05 * world:
                    raise Wrong(
                        f"bucket {b}'s slice on rank {rank} is {ratio:.2f}x one process's gradient: the "
                        f"reduce-scatter sums over the {world} ranks; divide by Nd = {world} for the average"
                    )
                raise Wrong(
                    f"bucket {b}'s averaged slice on rank {rank} differs from one process's gradient (relative "
                    f"error {err:.1e}): reduce-scatter the bucket's gradients laid end to end in the flat "
                    "order of flat.params, zero-padded to flat.padded, only once every one of them has arrived"
                )
        off = _weights_off(r["weights"], course[rank])
        if off is not None:
            raise Wrong(
                f"after {STEPS} Adam steps rank {rank}'s weights differ from the course's stage 2 by {off:.1e}: on "
                f"{world} ranks they must agree bit for bit; is every bucket reduced exactly once per step?"
            )
        if r["peak_live_full_grad_bytes"] >= r["full_grad_bytes"]:
            raise Wrong(
                f"the full gradients were all alive at once on rank {rank} ({r['peak_live_full_grad_bytes']:,} "
                f"bytes, the whole model's): drop each bucket's gradients right after its reduce-scatter"
            )
        want_rs = sum(b * (len(per_rank) - 1) / len(per_rank) for b in r["bucket_bytes"])
        got_rs = r["sent"].get("reduce_scatter", 0.0)
        if abs(got_rs - want_rs) > 1e-6 * want_rs:
            raise Wrong(
                f"rank {rank} sent {got_rs:,.0f} bytes by reduce-scatter per step; the buckets' padded bytes give "
                f"(N-1)/N x {sum(r['bucket_bytes']):,} = {want_rs:,.0f}: reduce-scatter each padded bucket once"
            )


register(
    Exercise(
        "03",
        "zero2_hooks",
        "Stage 2's mechanism: a gradient hook reduce-scatters each bucket as it fills",
        "on 2 ranks: the averaged slices against one process's gradient, the weights after 3 Adam steps against "
        "the course's GradShardedOptimizer bit for bit, one reduce-scatter per bucket issued during the backward, "
        "the bytes sent, no .grad left after the backward, and the peak of live full gradients below 4Ψ",
        task="Write `zero2_hooks(flats)`: `flats` are a stage-1 optimizer's gradient buckets (`zero.FlatParams`: "
        "`.params`, `.padded` = Nd·S, `.shard_numel` = S, `.nd`, `.grad_shard` to fill). Hook every parameter so "
        "that when a bucket's *last* gradient arrives, its gradients are laid end to end (zero-padded), "
        "reduce-scattered into this rank's averaged S elements in `.grad_shard`, and dropped (`p.grad = None`). "
        "The course's optimizer does the rest. Predict first: the most full-gradient bytes a rank holds at once, "
        "against the whole gradient's $4\\Psi$?",
        stub="def zero2_hooks(flats):\n"
        '    """Stage 2: reduce-scatter each bucket from a gradient hook as it fills, then drop its full gradients."""\n'
        '    raise NotImplementedError("exercise 03.zero2_hooks: your code here")\n',
        hints=(
            "p.register_post_accumulate_grad_hook(hook) calls hook(p) once p.grad holds this backward's gradient; "
            "count the calls per bucket and act when the count reaches len(flat.params) (then reset it).",
            "send = torch.zeros(flat.padded); torch.cat([p.grad.reshape(-1) for p in flat.params], "
            "out=send[:flat.numel]); out = torch.empty(flat.shard_numel); dist.reduce_scatter_single(out, send).",
            "flat.grad_shard = out / flat.nd, then p.grad = None for every p in flat.params.",
        ),
        on_rank=zero2_hooks_on_rank,
        verdict=zero2_hooks_verdict,
        nproc=2,
        timeout_s=120.0,
    )
)


# =============================================================================================
# 03.zero3_gather_free
# =============================================================================================


def zero3_gather_free_on_rank(fn, info) -> dict:
    provide_renamed_collectives()
    from ..zero import Zero3Module, Zero3Optimizer

    class StudentUnits(Zero3Module):
        """The course's stage 3 with the blocks' forward gather and free left to the student's hooks.

        The backward half (gather again before the unit's backward, reduce-scatter and free after it) and
        the root unit stay the course's.
        """

        def __init__(self, module, units):
            super().__init__(module, units=units)
            self.student = {id(u) for u in self.units if u.module is not self}
            self.gathered_peak, self.gathered_by_module = 0, []
            for unit in self.units:
                if id(unit) in self.student:
                    fn(unit.module, unit.flats[0])  # the student's pre-forward gather and post-forward free
                    unit.module.register_forward_pre_hook(lambda m, a, unit=unit: self._check_gathered(unit))
                    unit.module.register_forward_hook(lambda m, a, o, unit=unit: self._check_freed(unit))

        def gathered_now(self) -> int:  # read through the parameters: rebinding flat.full cannot hide bytes
            return sum(f.params[0].untyped_storage().nbytes() for f in self.flats())

        def _check_freed(self, unit):  # runs after the student's forward hook
            left = unit.flats[0].params[0].untyped_storage().nbytes()
            if left and torch.is_grad_enabled():
                raise Wrong(
                    f"{unit.name}'s gathered weights are still allocated after its forward ({left:,} bytes; kept, "
                    "the root and every block would be gathered at once): free each block after its forward with "
                    "flat.full.untyped_storage().resize_(0) (rebinding flat.full frees nothing: the parameters are "
                    "views into that storage)"
                )

        def _check_gathered(self, unit):  # runs after the student's pre-forward hook
            flat = unit.flats[0]
            if flat.full.untyped_storage().nbytes() == 0 or any(p.untyped_storage().nbytes() == 0 for p in flat.params):
                raise Wrong(
                    f"{unit.name}'s parameters have no storage when its forward starts: they are views into "
                    "flat.full, so gather into flat.full's own storage (resize it back to its bytes, then "
                    "all_gather_single(flat.full, flat.shard)), not into a new tensor"
                )
            self.sample()

        def sample(self):
            now = self.gathered_now()
            self.gathered_peak = max(self.gathered_peak, now)

        def _gather(self, unit):
            if id(unit) in self.student and not unit.gathered and not self._in_backward():
                unit.gathered = True  # the forward gather is the student's
                return
            super()._gather(unit)

        def _free(self, unit):
            if id(unit) in self.student and not self._in_backward() and unit.armed:
                unit.gathered = False  # the post-forward free is the student's
                return
            super()._free(unit)

        @staticmethod
        def _in_backward() -> bool:
            return torch._C._current_graph_task_id() != -1

    model = build_model("tiny", seed=0)
    wrapped = StudentUnits(model, list(model.blocks))
    for m in model.modules():
        m.register_forward_hook(lambda *_: wrapped.sample())
    opt = Zero3Optimizer(wrapped, torch.optim.Adam, lr=LR, foreach=False)
    block_bytes = [u.flats[0].working_bytes for u in wrapped.units if u.module is not wrapped]
    root_bytes = sum(f.working_bytes for u in wrapped.units if u.module is wrapped for f in u.flats)
    with _Collectives() as seen:
        for step in range(STEPS):
            wrapped(*_batch(step, info)).backward()
            opt.step()
            opt.zero_grad()
    fwd = [e for e in seen.calls if not e[2]]
    return {
        "block_bytes": block_bytes,
        "root_bytes": root_bytes,
        "gathered_peak_forward": wrapped.gathered_peak,
        "forward_collectives": [list(e) for e in fwd],
        "weights": torch.cat([t.reshape(-1) for t in wrapped.full_state_dict().values()]),
    }


def zero3_gather_free_verdict(per_rank: dict) -> None:
    course = course_weights("course_stage3_on_rank", len(per_rank))
    for rank, r in sorted(per_rank.items()):
        kinds = [e[0] for e in r["forward_collectives"]]
        if "all_reduce" in kinds:
            raise Wrong(
                f"rank {rank} gathered with all_reduce: that sends 2(N-1)/N of the unit (the zeros too); "
                "all_gather_single(flat.full, flat.shard) sends (N-1)/N and fills every rank's copy"
            )
        block_ag = [e for e in r["forward_collectives"] if e[0] == "all_gather" and e[1] in r["block_bytes"]]
        if len(block_ag) != len(r["block_bytes"]) * 3:  # one per block per step (3 steps) in the forward
            raise Wrong(
                f"rank {rank} issued {len(block_ag)} all-gathers of a block in {3} forward passes over "
                f"{len(r['block_bytes'])} blocks: gather each block once, in its forward pre-hook"
            )
        allowed = r["root_bytes"] + max(r["block_bytes"])
        if r["gathered_peak_forward"] > allowed:
            raise Wrong(
                f"during the forward rank {rank} held {r['gathered_peak_forward']:,} bytes of gathered weights at once, "
                f"more than the root plus one block ({allowed:,}): free each block after its forward, "
                "flat.full.untyped_storage().resize_(0) (rebinding flat.full frees nothing: the parameters are "
                "views into that storage)"
            )
        off = _weights_off(r["weights"], course[rank])
        if off is not None:
            raise Wrong(
                f"after {STEPS} Adam steps rank {rank}'s weights differ from the course's stage 3 by "
                f"{off:.1e}: on {len(per_rank)} ranks they must agree bit for bit; does the pre-forward hook "
                "all-gather every rank's slice into flat.full before the block computes?"
            )


register(
    Exercise(
        "03",
        "zero3_gather_free",
        "Stage 3's gather and free for one unit",
        "on 2 ranks: the weights after 3 Adam steps against the course's Zero3Module bit for bit, one all-gather "
        "of each block per forward, and the gathered bytes at any moment of the forward (at most the root plus one "
        "block)",
        task="Write `zero3_gather_free(module, flat)`: `module` is one transformer block, `flat` its "
        "`zero.FlatParams`, sharded at rest (`flat.shard`: this rank's S elements; `flat.full`: the Nd·S buffer, "
        "storage freed, every parameter of the block a view into it). Register a forward pre-hook that gathers the "
        "block into `flat.full`'s own storage and a forward hook that frees it; the course does the backward half. "
        "Predict first: the most gathered weight bytes a rank holds during the forward?",
        stub="def zero3_gather_free(module, flat):\n"
        '    """Stage 3 for one unit: all-gather before its forward, free after it."""\n'
        '    raise NotImplementedError("exercise 03.zero3_gather_free: your code here")\n',
        hints=(
            "module.register_forward_pre_hook(lambda m, args: gather()) and "
            "module.register_forward_hook(lambda m, args, out: free()).",
            "gather: flat.full.untyped_storage().resize_(flat.padded * flat.full.element_size()), then "
            "dist.all_gather_single(flat.full, flat.shard).",
            "free: flat.full.untyped_storage().resize_(0): the parameters keep their shapes, the memory goes.",
        ),
        on_rank=zero3_gather_free_on_rank,
        verdict=zero3_gather_free_verdict,
        nproc=2,
        timeout_s=120.0,
    )
)
