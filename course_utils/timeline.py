"""A per-operation memory timeline of one training step, the same for every strategy (notebooks 03 and 04).

``StepTimeline`` watches every tensor *storage* a rank makes, from before the model is built: a
``TorchDispatchMode`` (the mechanism under torch's own ``MemTracker`` and ``FSDPMemTracker``) sees
each operation's outputs, a weak reference sees each storage freed, and a wrapped
``UntypedStorage.resize_`` sees what no dispatch mode sees (FSDP2 and the hand-built stage 3 free and
re-allocate a gathered unit by resizing its storage); torch's ``ModTracker`` marks each module's
forward and backward. After every operation the live total is known, and a breakdown by category is
taken: at every operation of the watched step, at each module boundary and at the loop's phases.

Categories, decided at the moment of the breakdown:

    params       what a rank keeps between steps (whole for DDP and stages 1-2, its shards otherwise)
    gathered     working copies gathered for compute (stage 3's and FSDP's units)
    grads        gradients: whole ones before they are reduced, the reduced slices, the shards' .grad
    optim        optimizer state (and fp32 master copies)
    comm         buffers a collective read or wrote that are none of the above (DDP's buckets, FSDP2's
                 all-gather outputs and reduce-scatter inputs, stage 1's send copy)
    hidden       storages first seen as a *view* of something never seen allocated: a backend made them
                 where no mode looks (gloo's reduce-scatter clones its whole input; not on NCCL)
    activations  anything else born in the forward and still alive (saved for backward, the loss)
    data         the batch (made between steps)
    temp         the rest: activations' gradients, the optimizer's scratch, casts

The first four come from the strategy's own objects (``roles_of``): a mechanism that keeps tensors
of its own says which with a ``memory_roles()`` method (``zero.ShardedOptimizer``,
``zero.Zero3Module``, ``per_param.PerParamSharded``); FSDP2's are read from its parameter groups;
anything else is a plain model and optimizer. The others come from the storage's birth.

Exact where no allocator is involved: a CPU storage is numel x element size, no rounding, and the
same program makes the same storages every run. The tolerances, and why: (1) gloo's internal copies
(a reduce-scatter's clone of its input) are released by gloo's own thread at a moment the caller does
not control; ``settle`` waits (at most 1 s) before the next operation until they are gone, which makes
their life end with the collective in every run (measured: two runs of nine strategies identical
operation by operation). Only those copies: a collective's input, which gloo's thread may also keep a
moment after ``wait()`` returns, is not waited for (its caller may keep it on purpose). (2) What a kernel
allocates and frees inside itself is invisible at operation granularity: the peak is a lower bound by at
most one such workspace. (3) On a GPU the caching allocator rounds each block up (by 512 B, and a large block it does
not split by up to about 1 MiB) and keeps freed blocks, cuBLAS's workspace among them (allocated once through the
allocator and kept: 8 x 4 MiB under the course's ``CUBLAS_WORKSPACE_CONFIG=:4096:8``): compare the rise over the
step, ``torch.cuda.memory_stats()["requested_bytes.all.peak"]`` after a ``reset_peak_memory_stats()`` at the step's
start minus the requested bytes at rest, with the timeline's peak minus rest, never the allocated bytes.
"""

from __future__ import annotations

import time
import weakref

import torch

from .instrument import Observer

CATEGORIES = ("params", "gathered", "grads", "optim", "comm", "hidden", "activations", "data", "temp")
#: The model states and the buffers that move them: what the ZeRO paper's bill is about.
STATE_CATEGORIES = ("params", "gathered", "grads", "optim", "comm", "hidden")
_VIEW_OPS = {"split", "split_with_sizes", "chunk", "narrow", "view", "slice", "as_strided", "unbind", "select"}
_COMM_NAMESPACES = ("c10d", "_c10d_functional")


def _local(t):
    return getattr(t, "_local_tensor", t)


class _Storage:
    __slots__ = ("nbytes", "born", "comm", "hidden")

    def __init__(self, nbytes: int, born: str, hidden: bool):
        self.nbytes, self.born, self.comm, self.hidden = nbytes, born, False, hidden


class StepTimeline:
    """Every storage of a rank from ``start`` on; the breakdown of the watched step, operation by operation.

    Use: ``tl = StepTimeline(watch_step=2).start()`` *before* the model is built (a storage made
    before is unknown), ``tl.roles = roles_of(prepared)``, run the loop with ``TimelineObserver(tl)``,
    ``tl.stop()``; ``tl.result()`` is plain data (notebooks 03, 04).
    """

    def __init__(self, watch_step: int = 2, settle: bool = True):
        self.watch_step = watch_step
        self.settle = settle
        self.roles = lambda: []
        self.live: dict = {}
        self.total = 0
        self.index = 0
        self.phase_name = "setup"
        self.recording = False
        self.boundary = ""
        self.samples: list = []
        self.rows: list = []
        self.peak = None
        self.states_peak = None
        self.phase_peaks: dict = {}
        self.pending_hidden: list = []
        self.unsettled = 0
        self._busy = False
        self._mode = self._tracker = self._resize = None

    # -- storages -------------------------------------------------------------------------------
    def _track(self, t, hidden: bool = False) -> _Storage:
        st = t.untyped_storage()
        key = st._cdata
        rec = self.live.get(key)
        if rec is None:
            rec = self.live[key] = _Storage(st.nbytes(), self.phase_name, hidden)
            self.total += rec.nbytes
            weakref.finalize(st, self._freed, key)
        return rec

    def _freed(self, key) -> None:
        # inside the storage's deallocation: only count (touching a storage here corrupts the heap)
        rec = self.live.pop(key, None)
        if rec is not None:
            self.total -= rec.nbytes

    def _resized(self, st) -> None:
        rec = self.live.get(st._cdata)
        if rec is not None and st.nbytes() != rec.nbytes:
            self.total += st.nbytes() - rec.nbytes
            rec.nbytes = st.nbytes()
            self._tick("resize_")

    def _dispatch(self, func, args, kwargs):
        from torch.utils._pytree import tree_flatten

        if self._busy:  # an operation of the roles' reading, not of the step
            return func(*args, **kwargs)
        name = func._overloadpacket.__name__
        self._settle(name)
        is_comm = func.namespace in _COMM_NAMESPACES
        if is_comm:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    self._track(_local(a)).comm = True
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                t = _local(t)
                unseen_view = t.untyped_storage()._cdata not in self.live and name in _VIEW_OPS
                rec = self._track(t, hidden=unseen_view)
                if unseen_view:
                    self.pending_hidden.append(t.untyped_storage()._cdata)
                rec.comm |= is_comm
        self.index += 1
        self._tick(name)
        return out

    def _settle(self, name: str) -> None:
        """Before the next operation, wait (at most 1 s) until what a backend made out of sight is freed.

        gloo's reduce-scatter clones its input; its ``wait()`` runs ``split`` and ``copy_`` on the clone
        (let through), then gloo's worker thread drops it a moment after the caller resumed. Waiting here
        ends the clone's life with the collective in every run, instead of a race. The clone only: a
        collective's input, which gloo's thread may keep a moment longer too, is not waited for."""
        if not self.settle or name in ("split", "copy_") or not self.pending_hidden:
            return
        deadline = time.monotonic() + 1.0
        while any(k in self.live for k in self.pending_hidden) and time.monotonic() < deadline:
            time.sleep(0.0002)
        self.unsettled += sum(k in self.live for k in self.pending_hidden)
        self.pending_hidden = []

    # -- breakdowns -----------------------------------------------------------------------------
    def breakdown(self) -> dict:
        """Bytes live now by category (``CATEGORIES``), and ``total``."""
        role = {}
        self._busy = True
        try:
            found = self.roles()
        finally:
            self._busy = False
        # Only live storages are looked up below, and a meta one is never live (``_dispatch`` skips them), so
        # no device check here: this loop runs at every operation of the watched step, over every role tensor.
        for cat, tensors in found.items() if isinstance(found, dict) else found:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = _local(t).untyped_storage()
                    if st.nbytes():
                        role.setdefault(st._cdata, cat)
        out = dict.fromkeys(CATEGORIES, 0)
        for key, rec in list(self.live.items()):  # a gloo thread may free a storage meanwhile
            cat = role.get(key) or (
                "hidden"
                if rec.hidden
                else "comm"
                if rec.comm
                else "activations"
                if rec.born == "forward"
                else "data"
                if rec.born == "rest"
                else "temp"
            )
            out[cat] += rec.nbytes
        out["total"] = sum(out.values())
        return out

    def _where(self) -> str:
        return self.phase_name + (f", after {self.boundary}" if self.boundary else "")

    def _tick(self, op: str) -> None:
        if not self.recording:
            return
        bd = self.breakdown()
        here = {"index": self.index, "where": self._where(), "op": op, **bd}
        here["states"] = sum(bd[c] for c in STATE_CATEGORIES)
        self.rows.append([self.index, self.phase_name, op] + [bd[c] for c in CATEGORIES])
        if self.peak is None or bd["total"] > self.peak["total"]:
            self.peak = here
        if self.states_peak is None or here["states"] > self.states_peak["states"]:
            self.states_peak = here
        if bd["total"] > self.phase_peaks.get(self.phase_name, {"total": -1})["total"]:
            self.phase_peaks[self.phase_name] = here

    def sample(self, label: str) -> None:
        if self.recording:
            self.samples.append({"index": self.index, "label": label, **self.breakdown()})

    def phase(self, name: str, step: int | None = None) -> None:
        if name == "forward" and step == self.watch_step:
            self.recording = True
            self.sample(f"rest (before step {step})")
        self.phase_name = name
        self.sample(f"{name} begins")

    def end_step(self, step: int) -> None:
        self.sample("after zero_grad")
        self.boundary, self.phase_name = "", "rest"
        if step == self.watch_step:
            self.recording = False

    def _module_hook(self, kind: str):
        def hook(module, *_):
            self.boundary = f"{kind} {self._tracker.get_known_fqn(module) if module is not None else '?'}"
            self.sample(self.boundary)

        return hook

    # -- start / stop ---------------------------------------------------------------------------
    def start(self) -> StepTimeline:
        from torch.distributed._tools.mod_tracker import ModTracker
        from torch.utils._python_dispatch import TorchDispatchMode

        timeline = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return timeline._dispatch(func, args, kwargs or {})

        self._resize = original = torch.UntypedStorage.resize_

        def resize_(st, size):
            out = original(st, size)
            timeline._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._tracker = ModTracker()
        self._tracker.register_user_hooks(*(self._module_hook(k) for k in ("pre_fw", "post_fw", "pre_bw", "post_bw")))
        self._tracker.__enter__()
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def stop(self) -> None:
        self._mode.__exit__(None, None, None)
        self._tracker.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._resize

    def result(self) -> dict:
        """Plain data: ``rest`` (before the watched step), ``peak`` and ``states_peak`` (each with its
        ``where``, operation and breakdown), ``phase_peaks``, ``samples`` at every boundary, ``rows``
        (``columns``: one per operation), ``unsettled`` (backend copies still alive after 1 s: 0 expected)."""
        return {
            "rest": next((s for s in self.samples if s["label"].startswith("rest")), None),
            "peak": self.peak,
            "states_peak": self.states_peak,
            "phase_peaks": self.phase_peaks,
            "samples": self.samples,
            "columns": ["index", "phase", "op", *CATEGORIES],
            "rows": self.rows,
            "unsettled": self.unsettled,
        }


def most(result: dict, category: str) -> int:
    """The most bytes of one category a rank held at any operation of the watched step (``StepTimeline.result``'s
    rows; notebook 03)."""
    column = result["columns"].index(category)
    return max(row[column] for row in result["rows"])


class TimelineObserver(Observer):
    """Tells a ``StepTimeline`` the loop's phases (an observer of ``loop.run_steps``, notebooks 03 and 04)."""

    def __init__(self, timeline: StepTimeline):
        self.timeline = timeline

    def before_forward(self, step: int) -> None:
        self.timeline.phase("forward", step)

    def after_forward(self, step: int, loss) -> None:
        self.timeline.phase("backward")

    def after_backward(self, step: int) -> None:
        self.timeline.phase("before_step")

    def before_update(self, step: int) -> None:
        self.timeline.phase("optimizer")

    def after_update(self, step: int) -> None:
        self.timeline.phase("zero_grad")

    def after_step(self, step: int, losses: list) -> None:
        self.timeline.end_step(step)

    def result(self):
        return self.timeline.result()


def optimizer_state(optimizer) -> list:
    """Every tensor of a ``torch.optim`` optimizer's state, the step counters included."""
    state = getattr(optimizer, "state", None) or {}
    return [v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _fsdp2_roles(units) -> dict:
    """FSDP2's own tensors, read from the parameter groups of ``units``, the model's ``FSDPModule``s (private
    attributes, checked on torch 2.13)."""
    params, gathered, grads = [], [], []
    for m in units:
        state = m._get_fsdp_state()
        for group in list(getattr(state, "_fsdp_param_groups", None) or []):
            for fp in group.fsdp_params:
                params.append(fp._sharded_param_data)
                gathered += list(getattr(fp, "all_gather_outputs", None) or [])
                if hasattr(fp, "_unsharded_param"):
                    gathered.append(fp._unsharded_param)
                    grads.append(fp._unsharded_param.grad)
                grads += [fp.sharded_param.grad, getattr(fp, "unsharded_accumulated_grad", None)]
    return {"params": params, "gathered": gathered, "grads": grads}


def roles_of(prepared):
    """``roles() -> [(category, [tensors])]`` for a prepared run: what the strategy keeps, read from its own objects.

    The model's ``memory_roles()`` first (a storage takes the first role that claims it), then the
    optimizer's, then FSDP2's parameter groups, then the plain parameters, gradients and optimizer state.
    """
    from torch.distributed.fsdp import FSDPModule

    model, optimizer = prepared.model, prepared.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    # roles() runs at every operation of the watched step: walk the module tree once, not each time (it was
    # 40% of a timeline's CPU time). The modules are fixed once the strategy is applied; what each module
    # registers as its parameters is not (FSDP2 swaps sharded and gathered ones), so that is read each time.
    modules = list(model.modules())
    units = [m for m in modules if isinstance(m, FSDPModule)]

    def roles() -> list:
        sources = [getattr(model, "memory_roles", None), getattr(optimizer, "memory_roles", None)]
        found = [s() for s in sources if callable(s)] + [_fsdp2_roles(units)]
        # last: FSDP2 registers its gathered copies as the parameters (a tied weight may come twice: one storage)
        params = [p for m in modules for p in m._parameters.values() if p is not None]
        found.append({"params": params, "grads": [p.grad for p in params], "optim": optimizer_state(inner)})
        return [(cat, tensors) for roles in found for cat, tensors in roles.items()]

    return roles
