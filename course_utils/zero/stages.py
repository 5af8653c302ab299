"""ZeRO stages 1 (P_os) and 2 (P_os+g) built by hand: a sharded optimizer around any torch.optim class (notebook 03).

- Stage 1 (``ShardedOptimizer``): gradients are reduce-scattered at the step so each rank gets the
  average of its own slice, the inner optimizer updates that slice with state for that slice only,
  and an all-gather shares the new weights.
- Stage 2 (``GradShardedOptimizer``): the flat buffers are gradient buckets, reduce-scattered from a
  backward hook as soon as the backward has produced all of a bucket's gradients; the full gradients
  are then dropped, so a rank keeps only its slice.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from .flat import FlatParams, unit_row

# ---------------------------------------------------------------------------------------------
# Stage 1 (P_os) and stage 2 (P_os+g): a sharded optimizer around any torch.optim class
# ---------------------------------------------------------------------------------------------


def _param_groups(params) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


def gradient_buckets(params, cap_bytes: float | None) -> list[list]:
    """Split parameters into buckets of at most ``cap_bytes``, filled in reverse order (notebook 03).

    The backward pass produces gradients roughly from the last layer to the first, so, as in
    DDP, buckets are filled from the end; a parameter larger than the cap gets a bucket of its
    own. ``None`` means one bucket for everything. Each bucket lists its parameters in model order.
    """
    params = list(params)
    if cap_bytes is None:
        return [params] if params else []
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current[::-1])
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current[::-1])
    return buckets


class ShardedOptimizer:
    """ZeRO stage 1 (P_os): any element-wise torch.optim optimizer, its state kept for this rank's slice only (notebook 03).

    Usage, on every rank (each rank's ``loss.backward()`` leaves full local gradients)::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    ``step()`` does three things: reduce-scatter the gradients (each rank receives the average
    of its own slice), update the slice with the inner optimizer, all-gather the new weights.
    Traffic: a reduce-scatter and an all-gather of Ψ elements, (N-1)/N·Ψ each per rank: the
    same 2Ψ as plain data parallelism's all-reduce, which is a reduce-scatter plus an all-gather.

    Args:
        params: parameters or param-group dicts, as for any torch.optim optimizer. Each group
            becomes its own flat buffer; frozen parameters are left alone (not sharded).
        optimizer_class: the inner optimizer, e.g. ``torch.optim.Adam``. Element-wise
            optimizers (SGD, Adam, AdamW, RMSprop, Adagrad) update a slice exactly as they would
            the whole tensor; one that looks at whole tensors (Adafactor, LAMB) would see slices.
        compute_dtype: None keeps the parameters' dtype (fp32: the optimizer updates the
            parameters' own memory, no copy). ``torch.bfloat16`` makes the parameters 16-bit
            working copies and keeps fp32 master weights for this rank's slice.
        group: the process group of the Nd ranks (default: all ranks).
        bucket_cap_mb: None: one flat buffer per param group (stage 1); a number: buffers of at
            most this many MB of working weights (stage 2 reduces them during the backward).
        **defaults: arguments of ``optimizer_class`` (lr, betas, weight_decay, ...).
    """

    keep_full_grads = True  # P_os: every rank keeps its full 16-bit gradients
    stage = 1

    def __init__(
        self,
        params,
        optimizer_class=torch.optim.Adam,
        *,
        compute_dtype=None,
        group=None,
        bucket_cap_mb: float | None = None,
        **defaults,
    ):
        self.flats: list[FlatParams] = []
        self.psi = 0  # Ψ of every parameter given, frozen ones included
        inner_groups = []
        cap = None if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024
        for g in _param_groups(params):
            options = {k: v for k, v in g.items() if k != "params"}
            self.psi += sum(p.numel() for p in g["params"])
            trainable = [p for p in g["params"] if p.requires_grad]
            for bucket in gradient_buckets(trainable, cap):
                flat = FlatParams(bucket, group=group, compute_dtype=compute_dtype)
                self.flats.append(flat)
                inner_groups.append({**options, "params": [flat.master]})
        self.optimizer = optimizer_class(inner_groups, **defaults)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def reduce_gradients(self) -> None:
        """Stage 1: reduce-scatter every flat buffer's gradients (at the step, after the backward)."""
        for flat in self.flats:
            if any(p.grad is not None for p in flat.params):
                flat.reduce_grads(drop_full_grads=not self.keep_full_grads)

    def update_shards(self) -> None:
        """Run the inner optimizer on the fp32 slices, then write them into the working slices."""
        for flat in self.flats:
            if flat.grad_shard is not None:
                flat.master.grad = flat.grad_shard.to(flat.master.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for flat in self.flats:
                flat.master.grad = None  # the fp32 copy of the gradient slice was only for the update
                if flat.master is not flat.shard:
                    flat.shard.copy_(flat.master)

    def share_weights(self) -> None:
        """All-gather the updated slices: every rank's parameters are whole and equal again."""
        for flat in self.flats:
            flat.gather()

    @torch.no_grad()
    def step(self) -> None:
        self.reduce_gradients()
        self.update_shards()
        self.share_weights()
        if self.keep_full_grads:  # stage 1's gradient home is the full .grad; the slice was transient
            for flat in self.flats:
                flat.grad_shard = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat in self.flats:
            flat.grad_shard = None
            for p in flat.params:
                p.grad = None

    def held(self) -> tuple[list, list, list]:
        """``(params, grads, optimizer state)``: the real tensors this rank holds (notebook 03)."""
        params = [p for flat in self.flats for p in flat.params]
        grads = [p.grad for p in params] + [flat.grad_shard for flat in self.flats]
        return params, grads, self.optimizer_tensors()

    def memory_roles(self) -> dict:
        """What this rank keeps, by role, for ``timeline.StepTimeline`` (notebook 03): the whole flat
        weights, the gradients (whole, then the reduced slices), the optimizer state and masters."""
        return {
            "params": [flat.full for flat in self.flats],
            "grads": [p.grad for flat in self.flats for p in flat.params]
            + [flat.grad_shard for flat in self.flats]
            + [flat.master.grad for flat in self.flats],
            "optim": self.optimizer_tensors(),
        }

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """The inner optimizer's state (its 0-dim step counters too) plus the fp32 master slices (when they
        are separate copies)."""
        out = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return out + [flat.master for flat in self.flats if flat.master is not flat.shard]

    def full_state_dict(self, module: nn.Module) -> dict:
        """The full fp32 weights of ``module``, keyed like its ``state_dict()`` (collective: all ranks call it)."""
        return _full_state_dict(module, self.flats)

    def describe(self) -> dict:
        """What a report says about the stage it built: its flat buffers, their padding, Nd, Ψ (notebook 03)."""
        return stage_report(
            self.stage, self.flats, self.psi, [unit_row(f"flat {i}", f) for i, f in enumerate(self.flats)]
        )


def stage_report(stage: int, flats: list, psi: int, units: list[dict]) -> dict:
    """The report of a hand-built stage: ``stage``, ``precision``, ``nd``, ``psi``, ``units``, ``padding``,
    ``shard_numel`` and ``bytes_per_element`` of the working copy (notebook 03)."""
    mixed = flats[0].full.element_size() == 2
    return {
        "stage": stage,
        "precision": "mixed" if mixed else "fp32",
        "nd": flats[0].nd,
        "psi": psi,
        "units": units,
        "padding": sum(u["padding"] for u in units),
        "shard_numel": sum(u["shard_numel"] for u in units),
        "bytes_per_element": 2 if mixed else 4,
    }


def _full_state_dict(module: nn.Module, flats) -> dict:
    values = {}
    for flat in flats:
        for p, v in zip(flat.params, flat.full_fp32()):
            values[p] = v
    named = dict(module.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        p = named.get(key)
        if p is None:  # a buffer: as it is
            out[key] = value.detach().clone()
        else:  # a parameter: from the fp32 master slices, or (not sharded: frozen) as fp32
            out[key] = values[p] if p in values else p.detach().float().clone()
    return out


class GradShardedOptimizer(ShardedOptimizer):
    """ZeRO stage 2 (P_os+g): stage 1 plus gradients reduce-scattered during the backward, bucket by bucket (notebook 03).

    Each flat buffer is a gradient bucket (``bucket_cap_mb``, filled from the last layer, as in
    DDP). A hook on every parameter counts the gradients the backward has produced; when a
    bucket is complete it is reduce-scattered at once, and the full gradients are dropped, so
    after the backward a rank holds only the averaged gradients of its own slices:
    2Ψ + (2 + K)Ψ/Nd bytes instead of stage 1's 4Ψ + KΨ/Nd. Same arguments as ``ShardedOptimizer``.
    """

    keep_full_grads = False
    stage = 2

    def __init__(self, params, optimizer_class=torch.optim.Adam, *, bucket_cap_mb: float = 25.0, **kwargs):
        super().__init__(params, optimizer_class, bucket_cap_mb=bucket_cap_mb, **kwargs)
        self._ready = {id(flat): 0 for flat in self.flats}
        for flat in self.flats:
            for p in flat.params:
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, flat))

    def _grad_ready(self, flat: FlatParams, param) -> None:
        self._ready[id(flat)] += 1
        if self._ready[id(flat)] == len(flat.params):  # the bucket is complete: send it now
            self._ready[id(flat)] = 0
            flat.reduce_grads(drop_full_grads=True)

    def reduce_gradients(self) -> None:
        """Buckets the hooks did not complete (a parameter without a gradient this step) go now."""
        for flat in self.flats:
            if self._ready[id(flat)]:
                self._ready[id(flat)] = 0
                flat.reduce_grads(drop_full_grads=True)
