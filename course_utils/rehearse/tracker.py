"""The tracker the rehearsal watches a step with: torch's ``FSDPMemTracker``, feature-detected, made cheaper,
and its categories gathered into the parts of the course's bill (notebook 05b).

The tracker is a private torch API (``torch.distributed._tools``): ``tracker_problem()`` feature-detects
it, and the rehearsal raises ``CourseInputError`` with one line where it is missing. The course pins
torch (constraints.txt, ``PINNED_TORCH``) to the version checked here.
"""

from __future__ import annotations

from ..compat import TESTED_TORCH
from ..errors import CourseInputError
from ..instrument import Observer

#: The torch version the set-up installs (constraints.txt) and the tracker was checked against.
PINNED_TORCH = TESTED_TORCH  # one place: course_utils.compat
#: The tracker's categories (``_FSDPRefType`` values), in the order they are drawn.
CATEGORIES = (
    "Sharded Param",
    "OptState",
    "Sharded Grad",
    "Unsharded Param",
    "Unsharded Grad",
    "All Gather",
    "Reduce Scatter",
    "Activation",
    "Temp",
    "Inputs",
    "Buffer",
)

#: The tracker's categories gathered into the parts of the course's bill (notebook 05b).
PARTS = {
    "fp32 parameter shards": ("Sharded Param",),
    "optimizer state": ("OptState",),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "16-bit weights being computed": ("Unsharded Param",),
    "communication buffers": ("All Gather", "Reduce Scatter"),
    "activations and temporaries": ("Activation", "Temp", "Inputs", "Buffer"),
}
PART_COLORS = {
    "fp32 parameter shards": "#7b5ea7",
    "optimizer state": "#3a7dc9",
    "gradients": "#e8883a",
    "16-bit weights being computed": "#c9b3e6",
    "communication buffers": "#9a9a9a",
    "activations and temporaries": "#5aa469",
}


# ---------------------------------------------------------------------------------------------
# Feature detection: the tracker is a private API
# ---------------------------------------------------------------------------------------------


def tracker_problem() -> str | None:
    """None when this torch can rehearse; else one sentence saying what is missing (notebook 05b)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the package needs torch anyway
        return "torch is not installed; run `make setup`"
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return f"this torch build ({torch.__version__}) has no torch.distributed"
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
        from torch.distributed._composable import checkpoint  # noqa: F401
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as exc:  # ImportError, AttributeError, or a registration error
        return (
            f"torch {torch.__version__} lacks the FSDP2 memory tracker or the fake process group "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the course "
            f"pins torch {PINNED_TORCH} (run `make setup`)"
        )
    return None


def require_tracker() -> None:
    """Raise ``CourseInputError`` (one line) unless ``tracker_problem()`` is None (notebook 05b)."""
    problem = tracker_problem()
    if problem:
        raise CourseInputError(f"cannot rehearse: {problem}")


def _tensors(res, tensor_type, tree_leaves) -> list:
    """The tensors of an operation's result, in pytree order (what ``tree_map_only(torch.Tensor, ...)`` visits)."""
    if isinstance(res, tensor_type):
        return [res]
    if type(res) in (list, tuple) and all(x is None or isinstance(x, tensor_type) for x in res):
        return [x for x in res if x is not None]  # a flat result (most are): no pytree node inside
    return [x for x in tree_leaves(res) if isinstance(x, tensor_type)]


def tracker_class():
    """``FSDPMemTracker`` with its per-operation bookkeeping made cheaper (notebook 05b).

    After every operation the tracker updates the running peak of each module that is active
    (``MemTracker._update_peak_stats``). torch does it by scanning every tracked module and
    deep-copying the snapshot; on a 48-block model that loop is a quarter of the rehearsal's
    time. This subclass does the same updates visiting only the active modules and copying
    the flat ``{category: bytes}`` dicts shallowly. Its ``__torch_dispatch__`` is torch's (2.13)
    with one change: the result's tensors are found by ``_tensors`` instead of pytree's
    ``tree_map_only``, which rebuilt every result's structure (about a tenth of a 6.7B
    rehearsal's CPU time in cProfile). What it records is identical (``tests/test_rehearse.py``
    checks it against the stock tracker).
    """
    import torch
    from torch._guards import active_fake_mode
    from torch.distributed._tools.fsdp2_mem_tracker import (
        FSDPMemTracker,
        _FSDPModState,
        _FSDPRefType,
        _FSDPState,
    )
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    c10d, wait_tensor = torch.ops.c10d, torch.ops._c10d_functional.wait_tensor.default

    class Tracker(FSDPMemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t == DTensor for t in types):
                return NotImplemented  # let DTensor desugar into local ops first, as torch's does
            if func is wait_tensor and active_fake_mode():
                res = args[0]  # torch's override of wait_tensor's meta kernel (no new tensor in eager)
            else:
                res = func(*args, **kwargs or {})
            if active_fake_mode() is self._fake_mode_on_entry:  # not DTensor's sharding propagation
                if self._in_opt:
                    reftype = _FSDPRefType.OPT
                elif self._mod_tracker.is_bw and not self._in_ac:
                    reftype = _FSDPRefType.TEMP
                else:
                    reftype = _FSDPRefType.ACT
                if func is c10d._allgather_base_.default and self._fsdp_state in (_FSDPState.PRE_FW, _FSDPState.PRE_BW):
                    self._update_and_maybe_create_winfos(args[0], _FSDPRefType.ALL_GATHER, update_existing=True)
                if func is c10d._reduce_scatter_base_.default and self._fsdp_state == _FSDPState.POST_BW:
                    self._update_and_maybe_create_winfos(args[1], _FSDPRefType.REDUCE_SCATTER, update_existing=True)
                for t in _tensors(res, torch.Tensor, tree_leaves):
                    self._track(reftype, t)
                self._update_peak_stats(_FSDPModState.PEAK_BW if self._mod_tracker.is_bw else _FSDPModState.PEAK_FW)
            return res

        _index_size = -1
        _index: dict = {}

        def _update_peak_stats(self, peak_state) -> None:
            curr = self._curr_mem_snap
            if self._index_size != len(self.memory_tracking):
                index: dict = {}
                for stats in self.memory_tracking.values():
                    index.setdefault(stats.mod_fqn, []).append(stats)
                self._index, self._index_size = index, len(self.memory_tracking)
            for fqn in self._mod_tracker.parents:
                for stats in self._index.get(fqn, ()):
                    if peak_state in stats.snapshots:
                        for dev, dev_snap in curr.items():
                            if stats.local_peak.get(dev, 0) < dev_snap["Total"]:
                                stats.local_peak[dev] = dev_snap["Total"]
                                stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
            for dev, dev_snap in curr.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)
                    # where the step peaked: forward or backward, of the innermost module running
                    self.peak_at = f"{'backward' if self._mod_tracker.is_bw else 'forward'} of " + max(
                        self._mod_tracker.parents, key=len
                    ).removeprefix("FSDP")

    return Tracker


def _categories(snapshot: dict) -> dict:
    """``{category: bytes}`` for the (single) CPU device of a tracker snapshot."""
    out = {c: 0 for c in CATEGORIES}
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            if name != "Total":
                out[name] = out.get(name, 0) + int(value)
    return out


def _category_peaks(tracker, peak: dict) -> dict:
    out = dict(peak)
    for stats in tracker.memory_tracking.values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for name, value in _categories(snap).items():
                    out[name] = max(out.get(name, 0), value)
    return out


class TrackedStep(Observer):
    """The tracker around one step of the loop: entered before it starts, its categories read when the
    backward has finished and after the optimizer step, left when the loop ends (notebook 05b)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.after_backward_parts: dict = {}
        self.after_step_parts: dict = {}

    def start(self) -> None:
        self.tracker.__enter__()

    def after_backward(self, step: int) -> None:
        self.after_backward_parts = _categories(self.tracker.get_tracker_snapshot("current"))

    def after_update(self, step: int) -> None:
        self.after_step_parts = _categories(self.tracker.get_tracker_snapshot("current"))

    def stop(self) -> None:
        self.tracker.__exit__(None, None, None)
