"""Counting what a run holds and what it sends, the same way for every strategy (notebook 02).

- ``rank_bytes``: bytes of the real local tensors a rank holds (parameters, gradients,
  optimizer state and the optimizer's 0-dim step counters), a tensor shared by two names (a tied
  weight) counted once, a DTensor counted by its local shard.
- ``CommCounter``: a ``TorchDispatchMode`` that sees every c10d collective this process
  issues, from hand-built code, ``DistributedDataParallel``'s reducer or FSDP alike, and
  records calls and bytes by kind. It is the course's own small cousin of
  ``torch.distributed.tensor.debug.CommDebugMode``, which counts calls but not bytes.

Bytes are reported two ways. ``payload`` is the size of the tensor the collective is about
(the gradient all-reduced, the full parameter gathered, the full gradient scattered). ``sent``
is what one rank puts on the wire in a ring algorithm over a group of N ranks:

    all-reduce      2(N-1)/N × payload   (a reduce-scatter followed by an all-gather)
    all-gather       (N-1)/N × payload   (payload = the gathered output)
    reduce-scatter   (N-1)/N × payload   (payload = the full input)
    broadcast        (N-1)/N × payload   (N-1 receivers, each byte sent once to each: the group's
                                           total, (N-1) × payload, spread over its N ranks)

which is the accounting behind the ZeRO paper's 2Ψ (stages 1, 2) against 3Ψ (stage 3); the factors
are ``comm.RING_FACTOR``, the same the predictions and the planner use.

Across nodes (notebook 05): given ``node_size`` (ranks per node; rank r lives on node
r // node_size, as torchrun numbers them), each collective is also marked by whether its
group spans nodes, and ``cross_node_sent_bytes`` adds up the sent bytes of those only. That is
the process-group view: in a ring over a group that spans nodes, the busiest node-to-node cable
carries, in each direction, what one rank sends; a group that stays inside a node sends nothing
across.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .comm import node_card_bytes, ring_bytes_sent
from .errors import CourseInputError

# c10d op name -> (kind, index of the tensor argument whose size is the payload)
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "allgather_": ("all_gather", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "barrier": ("barrier", None),
}
# functional collectives (torch.ops._c10d_functional): (kind, payload from input × factor)
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
    "all_to_all_single": "all_to_all",
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group(args):
    """The ProcessGroup among a collective's arguments (boxed for c10d ops, a name for functional ones)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in args:
        if isinstance(a, torch._C.ScriptObject):
            try:  # a c10d op receives its ProcessGroup boxed; unbox it
                return dist.ProcessGroup.unbox(a)
            except Exception:  # not a ProcessGroup (e.g. a ReduceOp)
                continue
        if isinstance(a, str):  # functional collectives name their group
            try:
                return _resolve_process_group(a)
            except Exception:
                continue
    return None


def _group_size(args) -> int:
    import torch.distributed as dist

    group = _group(args)
    if group is not None:
        return int(group.size())
    return dist.get_world_size() if dist.is_initialized() else 1


def _spans_nodes(args, node_size: int | None) -> bool:
    """Whether the collective's group holds ranks of more than one node (rank r on node r // node_size)."""
    import torch.distributed as dist

    if not node_size or not dist.is_initialized():
        return False
    group = _group(args)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return len({r // node_size for r in ranks}) > 1


class CommCounter(TorchDispatchMode):
    """Count collectives by kind: calls, payload bytes and ring bytes sent (notebook 02).

    Use as ``with CommCounter() as comm: ...``; then ``comm.summary(steps)`` gives per-step
    numbers for this rank. ``comm.events`` keeps (kind, payload, group size) in issue order,
    ``comm.spans`` beside it whether each group spans nodes of ``node_size`` ranks (notebook 05).
    """

    def __init__(self, node_size: int | None = None):
        super().__init__()
        self.events: list[tuple[str, int, int]] = []
        self.spans: list[bool] = []
        self.node_size = node_size
        self.paused, self.clock = False, False  # clock: ``times[i]`` = event i's [issued, done] (notebook 05)
        self.times: dict[int, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, before = kwargs or {}, len(self.events)
        if not self.paused:
            ns, name = func.namespace, func._overloadpacket.__name__
            if ns == "c10d" and name in _C10D:
                kind, idx = _C10D[name]
                payload = 0 if idx is None else _nbytes(args[idx])
                if kind == "all_gather" and name == "allgather_":
                    payload = _nbytes(args[0])  # list of lists of outputs
                self.events.append((kind, payload, _group_size(args)))
                self.spans.append(_spans_nodes(args, self.node_size))
            elif ns == "_c10d_functional" and name in _FUNCTIONAL:
                kind = _FUNCTIONAL[name]
                group_size = next((a for a in args[1:] if isinstance(a, int)), None)
                payload = _nbytes(args[0])
                if kind == "all_gather":
                    payload *= group_size or 1
                self.events.append((kind, payload, group_size or _group_size(args)))
                self.spans.append(_spans_nodes(args, self.node_size))
        counted = self.clock and len(self.events) > before
        return self._clocked(func, args, kwargs) if counted else func(*args, **kwargs)

    def _clocked(self, func, args, kwargs):
        """Run the collective just counted; ``times`` gets when it was issued and when its work (a c10d op's boxed
        ``Work``) completed: its future calls back from gloo's thread (None if it has no future), or on return."""
        stamp = self.times[len(self.events) - 1] = [time.perf_counter(), None]
        out = func(*args, **kwargs)
        works = [w for w in (out if isinstance(out, tuple) else [out]) if "Work" in str(getattr(w, "_type", str)())]
        try:
            done = torch._C._distributed_c10d.Work.unbox(works[0]).get_future() if works else None
        except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce_scatter_single)
            return out
        finish = lambda *_: stamp.__setitem__(1, time.perf_counter())  # noqa: E731
        done.add_done_callback(finish) if done is not None else finish()
        return out

    def summary(self, steps: int = 1) -> dict:
        """``{kind: {"calls", "payload_bytes", "sent_bytes", "cross_node_sent_bytes", "node_card_bytes"}}`` per step
        for this rank; ``node_card_bytes``: what its node's network card sends for them under gloo
        (``comm.node_card_bytes``), the collectives that span nodes only."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        keys = ("calls", "payload_bytes", "sent_bytes", "cross_node_sent_bytes", "node_card_bytes")
        out: dict = defaultdict(lambda: dict.fromkeys(keys, 0.0))
        for (kind, payload, n), spans in zip(self.events, self.spans):
            row = out[kind]
            row["calls"] += 1
            row["payload_bytes"] += payload
            row["sent_bytes"] += ring_bytes_sent(kind, payload, n)
            row["cross_node_sent_bytes"] += ring_bytes_sent(kind, payload, n) if spans else 0.0
            row["node_card_bytes"] += node_card_bytes(kind, payload, n, world) if spans else 0.0
        return {k: {key: v[key] / steps for key in keys} for k, v in sorted(out.items())}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (a tensor reachable under two names counts once) (notebook 02)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        key = (t.data_ptr(), t.numel(), t.dtype) if t.numel() else (id(t), 0, t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (momentum, variance, master copies, and the 0-dim step
    counter Adam keeps per tensor it steps) (notebook 02).

    torch's ``ZeroRedundancyOptimizer`` keeps its rank's share in the optimizer it wraps (``.optim``):
    that is what this rank holds.
    """
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def rank_bytes(params, grads, optim) -> dict:
    """``{"params", "grads", "optim", "steps", "total"}``: bytes of the local tensors this rank holds, by part
    (notebook 02). ``optim`` is the per-element state (the paper's K bytes a parameter); ``steps`` the
    optimizer's 0-dim tensors (Adam's step counter, 4 bytes per tensor it steps), which no formula of the
    paper counts; ``total`` is every byte."""
    optim = [t for t in optim if t is not None]
    row = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(grads),
        "optim": tensor_bytes(t for t in optim if _local(t).dim() > 0),
        "steps": tensor_bytes(t for t in optim if _local(t).dim() == 0),
    }
    row["total"] = sum(row.values())
    return row


def weights_sha256(state_dict: dict) -> str:
    """SHA-256 of a full, unsharded state dict in fp32, keys in sorted order (notebook 02).

    Two runs that end with the same weights, bit for bit, give the same hash whatever
    strategy produced them.
    """
    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = _local(state_dict[key]).detach().to("cpu", torch.float32).contiguous()
        h.update(key.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Observers: what a run watches, plugged into the one training loop (``loop.run_steps``)
# ---------------------------------------------------------------------------------------------


class Observer:
    """Something the training loop tells what happens, step by step (notebook 02).

    ``loop.run_steps`` calls, for every step: ``before_forward`` (the batch is made),
    ``after_forward(loss)``, ``after_backward``, ``before_update`` (the strategy's
    ``before_step`` has run: gradients are reduced), ``after_update`` (the optimizer stepped,
    gradients still present), ``after_step(losses)`` (gradients cleared; ``losses`` are this
    rank's detached losses so far, still on the device). ``start`` and ``stop`` bracket the
    whole loop. Override only what you need. While any hook runs, ``CountCollectives``
    observers stop counting: watching is not training.

    Timing runs carry no counting observers (a dispatch mode or module hooks put every op
    through Python, and on a GPU the step becomes CPU-bound); counting runs make no timing claims.
    """

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def before_forward(self, step: int) -> None:
        pass

    def after_forward(self, step: int, loss: torch.Tensor) -> None:
        pass

    def after_backward(self, step: int) -> None:
        pass

    def before_update(self, step: int) -> None:
        pass

    def after_update(self, step: int) -> None:
        pass

    def after_step(self, step: int, losses: list) -> None:
        pass

    def result(self):
        """What the caller gets back from a run it watched (``train``'s report, ``observed``); None by default."""
        return None


class CountCollectives(Observer):
    """Bytes sent per group: every collective of the loop, counted by ``CommCounter`` (notebook 02);
    with ``node_size``, also whether each group spans nodes (notebook 05). With ``units``
    (``models.unit_modules``) and ``clock_step``, ``timeline()`` is that step's backward, clocked (notebook 05)."""

    def __init__(self, node_size: int | None = None, units=(), clock_step: int | None = None):
        self.comm = CommCounter(node_size=node_size)
        self.units, self.clock_step, self._hooks, self._t0, self._end = list(units), clock_step, [], None, None
        self._unit_times = [[None, None] for _ in self.units]

    def _stamp(self, i: int, edge: int):  # a backward hook's result would replace the gradients: this returns None
        return lambda *_: None if self._t0 is None else self._unit_times[i].__setitem__(edge, time.perf_counter())

    def start(self) -> None:
        for i, unit in enumerate(self.units if self.clock_step is not None else []):
            self._hooks += [unit.register_full_backward_pre_hook(self._stamp(i, 0))]
            self._hooks += [unit.register_full_backward_hook(self._stamp(i, 1))]
        self.comm.__enter__()

    def stop(self) -> None:
        self.comm.__exit__(None, None, None)
        for handle in self._hooks:
            handle.remove()

    def after_forward(self, step: int, loss) -> None:
        if step == self.clock_step:
            self._t0, self.comm.clock = time.perf_counter(), True

    def after_backward(self, step: int) -> None:
        if step == self.clock_step:
            self._end, self.comm.clock = time.perf_counter(), False

    def timeline(self) -> dict | None:
        """Seconds from the clocked backward's start: ``{"units": [[began, ended], ...]`` (each unit's backward
        compute, forward order: its backward pre-hook and backward hook), ``"collectives": [{"kind", "bytes",
        "group", "spans_nodes", "issued", "done"}]`` (issue order), ``"backward_end"}``; None if none was clocked."""
        if self._t0 is None:
            return None

        rel = lambda *ts: [None if t is None else t - self._t0 for t in ts]  # noqa: E731
        keys, comm = ("kind", "bytes", "group", "spans_nodes", "issued", "done"), self.comm  # clocked in this step only
        clocked = [dict(zip(keys, [*comm.events[i], comm.spans[i], *rel(*comm.times[i])])) for i in sorted(comm.times)]
        return {"units": [rel(*e) for e in self._unit_times], "collectives": clocked, "backward_end": rel(self._end)[0]}

    def summary(self, steps: int) -> dict:
        return self.comm.summary(steps)

    def groups(self) -> dict:
        """``{kind: [group sizes seen]}`` (notebook 04)."""
        out: dict = {}
        for kind, _, n in self.comm.events:
            out.setdefault(kind, set()).add(n)
        return {k: sorted(v) for k, v in out.items()}


class HeldAtRest(Observer):
    """Bytes held: ``rank_bytes`` of ``held()`` after the update of step ``at``, gradients still present (notebook 02);
    with ``peak=True``, also the most bytes the update of that step held (notebook 03).

    Args:
        held: the strategy's ``Prepared.held`` (or any function returning ``(params, grads, optim)``).
        at: the step to count at (the last one, usually).
        also: more functions of ``(params, grads, optim)`` to record at the same moment, by name.
        peak: watch the update of step ``at`` (from ``before_update`` to ``after_update``: stage 1's
            reduce-scatter, the optimizer's arithmetic, the all-gather) with torch's own memory tracker,
            ``torch.distributed._tools.mem_tracker.MemTracker`` (the base of the ``FSDPMemTracker`` that
            notebook 05b rehearses with; here on the real tensors). ``update_extra`` is then the most bytes
            the update held at any moment above what was held when it began, and ``update_peak`` that plus
            ``rank_bytes`` at its start: the peak of the bytes held during the update. The tracker sees
            every tensor the rank's operators create (not a collective library's internal buffers).
        optimizer: the torch optimizer inside the strategy's optimizer, so that its 0-dim step counters
            are counted from the start (the tracker would otherwise count them when first touched).
    """

    def __init__(self, held, at: int, also: dict | None = None, *, peak: bool = False, optimizer=None):
        self.held, self.at, self.also = held, at, also or {}
        self.bytes: dict | None = None
        self.extra: dict = {}
        self.peak, self.optimizer = peak, optimizer
        self.update_extra: int | None = None
        self.update_peak: int | None = None
        self._tracker = None

    def before_update(self, step: int) -> None:
        if self.peak and step == self.at:
            from torch.distributed._tools.mem_tracker import MemTracker

            params, grads, optim = self.held()
            self._start = rank_bytes(params, grads, optim)["total"]
            self._tracker = MemTracker()
            self._tracker.track_external(
                *[t for t in (*params, *grads, *optim) if t is not None],
                *([self.optimizer] if self.optimizer is not None else []),
            )
            self._tracker.__enter__()
            self._base = _tracked_total(self._tracker, "current")

    def after_update(self, step: int) -> None:
        if step == self.at:
            if self._tracker is not None:
                self._tracker.__exit__(None, None, None)
                self.update_extra = _tracked_total(self._tracker, "peak") - self._base
                self.update_peak = self._start + self.update_extra
                self._tracker = None
            parts = self.held()
            self.bytes = rank_bytes(*parts)
            self.extra = {name: fn(*parts) for name, fn in self.also.items()}


def _tracked_total(tracker, which: str) -> int:
    """Bytes a ``MemTracker`` snapshot holds, every device together."""
    return sum(int(snap.get("Total", 0)) for snap in tracker.get_tracker_snapshot(which).values())


class StepTimer(Observer):
    """Seconds per step, from the start of step ``skip`` to the end of the last one (notebook 02).

    The device is synchronised at the two edges of the window only (never inside it); what
    observers do between steps (a checkpoint save, the progress line) and making the next
    batch are left out. The first ``skip`` steps are warm-up and not timed (pass
    ``min(1, steps - 1)`` to time a one-step run at all).
    """

    def __init__(self, device: torch.device, skip: int = 1):
        self.device, self.skip = device, skip
        self.first: int | None = None
        self.elapsed, self.steps, self._t0 = 0.0, 0, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_forward(self, step: int) -> None:
        if self.first is None:
            self.first = step
        if step - self.first >= self.skip:
            if self.steps == 0:
                self._sync()
            self._t0 = time.perf_counter()

    def after_step(self, step: int, losses: list) -> None:
        if self._t0 is not None:
            self.elapsed += time.perf_counter() - self._t0
            self.steps += 1
            self._t0 = None

    def stop(self) -> None:
        if self.steps:
            t = time.perf_counter()
            self._sync()
            self.elapsed += time.perf_counter() - t

    def seconds_per_step(self) -> float:
        return self.elapsed / self.steps if self.steps else 0.0


def global_mean_losses(local_losses: list, info) -> list[float]:
    """The global mean loss of each step, from every rank's local losses (collective; notebook 02).

    Equal per-rank batches: the mean of the rank means is the global mean. The sum runs in
    rank order, one element at a time, so it does not depend on how many steps are reduced
    together: a resumed run reports the very numbers of an uninterrupted one (notebook 06).
    The losses stay on the device until here: one transfer for the whole run, not one per step.
    """
    import torch.distributed as dist

    local = torch.stack(
        [loss.detach().float().to(info.device) for loss in local_losses] + [torch.zeros((), device=info.device)]
    )
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return (total / info.world_size).cpu().tolist()[:-1]


def weight_diff(a: dict, b: dict) -> dict:
    """How far two full state dicts (same keys) are apart: ``{"max_abs", "relative"}`` (notebook 04).

    ``relative`` is ‖a − b‖ / ‖b‖ over all weights together (b is the reference).
    """
    if set(a) != set(b):
        raise CourseInputError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))[:4]}")
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return {
        "max_abs": max(float((a[k].float() - b[k].float()).abs().max()) for k in a),
        "relative": (num / den) ** 0.5 if den else 0.0,
    }
