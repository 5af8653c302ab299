"""Notebook 02's cost model of the bucket cap: what it measures, with no instrumentation on the timed steps.

``cap_costs`` runs inside the same launch as the bucket sweep (``lab02.ddp_measurements``) and returns
what the arithmetic of ``plan.hostfit`` turns into a prediction, and the overlap chart's timelines:

- **step times per cap**, uninstrumented: the sweep's own step times are taken with ``CountCollectives`` on
  (a ``TorchDispatchMode`` that routes every operator through Python, about twice the step), so these are
  timed again here with no observer but a clock. The caps take turns, round by round, so that a burst of load
  on this shared machine falls on every cap rather than on one;
- **the compute alone**: the same steps with no communication at all (no hooks, no buckets);
- **one all-reduce of B bytes**, for B from 256 B to 4 MiB, timed in runs of back-to-back calls: the readings
  ``plan.fit_latency_bandwidth`` fits t(B) = latency + sent bytes / bandwidth to;
- **every rank's timeline of each cap's timed steps** (``lab02_timeline.step_timeline``, a few floats a step),
  so the overlap chart's milliseconds are not the counted run's, and it can draw a typical step, not the last;
- **when each gradient becomes final** in an undisturbed backward (one bucket, so no all-reduce starts before
  the backward ends): what the separate-engine model of ``plan.bucket_step_time`` schedules buckets from.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..ddp import BucketedDDP
from ..instrument import Observer
from ..loop import Prepared, TrainConfig, make_optimizer, module_held, run_steps
from ..models import build_model, get_config
from .lab02_timeline import step_timeline

#: All-reduce sizes of the micro-benchmark: 256 B to 4 MiB, a factor 4 apart (the tiny model's gradients
#: are 0.4 MiB in all; a 25 MiB cap never holds more).
ALL_REDUCE_BYTES = tuple(256 * 4**k for k in range(8))
#: All-reduces per reading, back to back.
ALL_REDUCE_CALLS = 8
#: A cap that puts every gradient of a course model in one bucket.
PROBE_CAP_MB = 1024.0


class _Clock(Observer):
    """Each step's seconds and its backward's, and the clock readings of ``step_timeline``, nothing else: the
    ranks meet at a barrier before every step (outside the timed window), so one rank's late start is not
    carried into the next step's reading. With ``ddp``, its timeline is read into ``timelines`` (one per timed
    step, in the order of ``step_s``) after that barrier, or by ``keep`` after the last step, then cleared: an
    all-reduce's end is marked by a callback on gloo's thread, which can run just after ``wait()`` returns."""

    def __init__(self, ddp: BucketedDDP | None = None):
        self.step_s, self.backward_s, self.timelines, self.ddp = [], [], [], ddp

    def before_forward(self, step: int) -> None:
        dist.barrier()
        self.keep()
        if self.ddp is not None:
            self.ddp.timeline.clear()
        self.t0 = time.perf_counter()

    def after_forward(self, step: int, loss) -> None:
        self.tb = time.perf_counter()

    def after_backward(self, step: int) -> None:
        self.tbe = time.perf_counter()
        self.backward_s.append(self.tbe - self.tb)

    def before_update(self, step: int) -> None:  # finish_gradient_synchronization has run
        self.ts = time.perf_counter()

    def after_step(self, step: int, losses: list) -> None:
        self.step_s.append(time.perf_counter() - self.t0)

    def keep(self) -> None:
        """The last timed step's timeline (``step_timeline``, on this rank's clock), if not yet kept."""
        if self.ddp is not None and len(self.timelines) < len(self.step_s):
            self.timelines.append(step_timeline(self.ddp.timeline, self.t0, self.tb, self.tbe, self.ts))


def _prepared(cfg: TrainConfig, info, cap_mb: float | None) -> tuple[Prepared, BucketedDDP | None]:
    """The tiny model behind ``BucketedDDP`` at ``cap_mb``, or alone (``None``: the compute, no communication)."""
    model = build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    ddp = None if cap_mb is None else BucketedDDP(model, bucket_cap_mb=cap_mb, timeline=True)
    optimizer = make_optimizer(model.parameters(), cfg)
    prepared = Prepared(
        model=model if ddp is None else ddp,
        optimizer=optimizer,
        full_state_dict=model.state_dict,
        held=lambda: module_held(model, optimizer),
        before_step=(lambda: None) if ddp is None else ddp.finish_gradient_synchronization,
    )
    return prepared, ddp


def _all_reduce_readings(info, reps: int, calls: int = ALL_REDUCE_CALLS) -> list[dict]:
    """Each reading: ``calls`` all-reduces back to back after a barrier, per call (the ranks leave a barrier up
    to a millisecond apart on two busy cores; one call timed alone would count that skew). The sizes take turns,
    round by round, so a burst of load on this shared machine widens every size's spread instead of moving one
    size's median."""
    tensors = {nbytes: torch.ones(nbytes // 4, device=info.device) for nbytes in ALL_REDUCE_BYTES}
    readings = {nbytes: [] for nbytes in ALL_REDUCE_BYTES}
    for t in tensors.values():
        dist.all_reduce(t)  # warm-up: the connection's buffers for each size
    for _ in range(reps):
        for nbytes, t in tensors.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(t)
            readings[nbytes].append((time.perf_counter() - t0) / calls)
    return [
        {"kind": "all_reduce", "bytes": nbytes, "world_size": info.world_size, "readings": readings[nbytes]}
        for nbytes in ALL_REDUCE_BYTES
    ]


def cap_costs(cfg: TrainConfig, info, caps_mb: list, rounds: int = 4, steps: int = 2, reps: int = 9) -> dict:
    """Uninstrumented step times per cap, the compute alone, the all-reduce micro-benchmark and one undisturbed
    backward's gradient-ready times (collective; notebook 02). Every rank returns the same keys, its own readings:

    ``{"step_s": {cap: [s, ...]}, "compute_s": [...], "buckets": {cap: [{"bytes", "names"}]},
    "all_reduce": [{"kind", "bytes", "world_size", "readings"}], "ready_s": {param: s after backward began},
    "backward_s", "timelines": {cap: [every rank's [one timeline per timed step]]}}``. Each model runs one untimed step
    first (buffers, the allocator, the first bucket fill).
    """
    settings = [None, *caps_mb]  # None: the compute alone
    built = {cap: _prepared(cfg, info, cap) for cap in settings}
    clocks = {cap: _Clock(built[cap][1]) for cap in settings}
    step = 0
    for cap in settings:
        run_steps(built[cap][0], cfg, info, [step])
    for r in range(rounds):
        for cap in settings[r % len(settings) :] + settings[: r % len(settings)]:  # each round starts elsewhere
            run_steps(built[cap][0], cfg, info, range(step, step + steps), [clocks[cap]])
        step += steps
    # an undisturbed backward: with one bucket (a 1 GiB cap holds every course model) the one all-reduce
    # starts only when the backward is over, so the gradient-ready times are the backward's own
    probe, ddp = _prepared(cfg, info, PROBE_CAP_MB)
    run_steps(probe, cfg, info, [0])
    ddp.timeline.clear()
    clock = _Clock()
    run_steps(probe, cfg, info, [1], [clock])
    began = clock.tb
    ready = {name: t - began for t, event, _, name in ddp.timeline if event == "ready"}
    timelines = {cap: [None] * info.world_size for cap in caps_mb}  # every rank's steps, each on its own clock
    for cap in caps_mb:
        clocks[cap].keep()
        dist.all_gather_object(timelines[cap], clocks[cap].timelines)
    return {
        "step_s": {cap: clocks[cap].step_s for cap in caps_mb},
        "compute_s": clocks[None].step_s,
        "buckets": {
            cap: [{"bytes": b.nbytes, "names": list(b.names)} for b in built[cap][1].buckets] for cap in caps_mb
        },
        "all_reduce": _all_reduce_readings(info, reps),
        "ready_s": ready,
        "backward_s": clock.backward_s[-1],
        "timelines": timelines,
    }
