"""Notebook 03's exercises: a ZeRO-2 step from reduce-scatter and all-gather, and a sharded optimizer (then, in
``nb03_stages``, stage 2's gradient hooks and stage 3's gather and free, built inside the course's mechanism).

References: one process applying the same optimizer to the mean of every rank's gradients (the
update data parallelism must reproduce), ``zero.padded_numel``/``zero.shard_bounds`` (the flat
layout), ``CommCounter`` against ``comm.reduce_scatter_sent``/``all_gather_sent``, and
``memory.optimizer_bill`` for the optimizer state a rank should keep (K·Ψ/Nd).
"""

from __future__ import annotations

from functools import cache

import torch

from ..comm import all_gather_sent, reduce_scatter_sent
from ..compat import provide_renamed_collectives
from ..instrument import CommCounter
from ..models import build_model, param_count
from ..zero import padded_numel, shard_bounds
from .core import Exercise, Wrong, register

LR = 0.1
#: The checks run on the tiny course model whatever the notebook's MODEL is: a check must answer in seconds,
#: and the flat layout it checks is the same at any size (the check's sentence says so).
CHECK_MODEL = "tiny"


@cache
def psi() -> int:
    """Ψ of the model the checks run on (computed on first use: importing this module stays cheap)."""
    return param_count(build_model(CHECK_MODEL, seed=0))


def flat_start(world: int) -> torch.Tensor:
    """The checked model's weights end to end, padded with zeros to Nd·S (the course's flat layout)."""
    model = build_model(CHECK_MODEL, seed=0)
    flat = torch.zeros(padded_numel(psi(), world))
    torch.cat([p.detach().reshape(-1) for p in model.parameters()], out=flat[: psi()])
    return flat


def flat_grad(step: int, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Rank r's gradient at a step: fixed by (step, rank), zero on the padding."""
    g = torch.randn(like.numel(), generator=torch.Generator().manual_seed(1000 * step + rank)) * 1e-2
    g[psi() :] = 0
    return g


def sharded_step_on_rank(fn, info) -> dict:
    provide_renamed_collectives()  # the hints' torch 2.13 names, also on an older torch
    params = flat_start(info.world_size)
    with CommCounter() as comm:
        fn(params, flat_grad(0, info.rank, params), LR)
    summary = comm.summary()
    return {
        "params": params,
        "calls": {k: v["calls"] for k, v in summary.items()},
        "sent": {k: v["sent_bytes"] for k, v in summary.items()},
    }


def sharded_step_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    start = flat_start(world)
    want = start - LR * sum(flat_grad(0, r, start) for r in range(world)) / world
    size = want.numel() // world
    n_bytes = want.numel() * want.element_size()
    expected = {"reduce_scatter": reduce_scatter_sent(n_bytes, world), "all_gather": all_gather_sent(n_bytes, world)}
    for rank, r in sorted(per_rank.items()):
        if "all_reduce" in r["calls"]:
            raise Wrong(
                f"rank {rank} called all_reduce: ZeRO-2 sends each rank only its slice's sum "
                "(reduce-scatter), then shares the updated slices (all-gather)"
            )
        got = r["params"]
        for s in range(world):
            part = slice(*shard_bounds(want.numel(), world, s))
            if not (
                isinstance(got, torch.Tensor)
                and got.shape == want.shape
                and torch.allclose(got[part], want[part], rtol=1e-5, atol=1e-7)
            ):
                raise Wrong(
                    f"after the step, rank {rank}'s copy of slice {s} (elements {s * size}..{(s + 1) * size - 1}) "
                    "differs from the reference: did each rank update the slice at [r·S, (r+1)·S) with the mean "
                    "gradient, then all-gather every slice?"
                )
        for kind, want_sent in expected.items():
            sent = r["sent"].get(kind, 0.0)
            if abs(sent - want_sent) > 1e-6 * want_sent:
                raise Wrong(
                    f"rank {rank} sent {sent:.0f} bytes by {kind.replace('_', '-')}; one {kind.replace('_', '-')} "
                    f"of the flat buffer sends (N-1)/N of its bytes, {want_sent:.0f}"
                )


register(
    Exercise(
        "03",
        "sharded_step",
        "One sharded SGD step: stage 1's reduce-scatter, update of a slice, all-gather",
        "every rank's weights after one SGD step against one process stepping on the mean gradient, and the bytes "
        "each collective sent (CommCounter against (N-1)/N·Ψ each) on 2 ranks, with the tiny course model's weights "
        "(whatever MODEL says: a check answers in seconds)",
        task="Write `sharded_step(params, grads, lr)`: `params` is the model's flat weights (padded to Nd·S, the same "
        "on every rank), `grads` this rank's full flat gradient. Reduce-scatter the gradients so rank r gets the "
        "mean of its slice `[r·S, (r+1)·S)`, take an SGD step on that slice only, and all-gather the slices back "
        "into `params`. SGD keeps no state, so this is the step alone; exercise 03.2 then keeps an optimizer's "
        "state sharded the same way. Predict first: how many bytes does each rank send, compared with DDP's "
        "all-reduce?",
        stub="def sharded_step(params, grads, lr):\n"
        '    """One ZeRO-1 SGD step on flat, padded tensors; params ends updated and equal on every rank."""\n'
        '    raise NotImplementedError("exercise 03.sharded_step: your code here")\n',
        hints=(
            "S = params.numel() // dist.get_world_size(); rank r owns params[r*S:(r+1)*S].",
            "`dist.reduce_scatter_single(out, grads)` leaves in `out` (S elements) the sum over ranks of this "
            "rank's slice (the name since torch 2.13; `reduce_scatter_tensor` before); divide by the world size.",
            "Update the slice in place, then `dist.all_gather_single(params, params[r*S:(r+1)*S].clone())` "
            "(the name since torch 2.13; `all_gather_into_tensor` before).",
        ),
        on_rank=sharded_step_on_rank,
        verdict=sharded_step_verdict,
        nproc=2,
    )
)


# ---------------------------------------------------------------------------------------------

OPTIMIZERS = [
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("Adam", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}),
]
STEPS = 3


def _recording(cls):
    """``cls`` with every instance remembered, so the check can weigh the optimizer state a rank keeps."""
    made = []

    class Recorded(cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    Recorded.__name__ = cls.__name__
    return Recorded, made


def _state_bytes(optimizers) -> int:
    return sum(
        t.numel() * t.element_size()
        for opt in optimizers
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


@cache
def reference_steps(world: int) -> list[dict]:
    """Per optimizer: one process's weights after STEPS steps on the mean gradient, and its whole state's bytes."""
    out = []
    for name, kw in OPTIMIZERS:
        params = flat_start(world)
        ref = torch.nn.Parameter(params.clone())
        opt = getattr(torch.optim, name)([ref], **kw)
        for s in range(STEPS):
            ref.grad = sum(flat_grad(s, r, params) for r in range(world)) / world
            opt.step()
        out.append({"optimizer": name, "params": ref.detach(), "full_state": _state_bytes([opt])})
    return out


def sharded_opt_on_rank(fn, info) -> list:
    provide_renamed_collectives()
    out = []
    for name, kw in OPTIMIZERS:
        params = flat_start(info.world_size)
        Recorded, made = _recording(getattr(torch.optim, name))
        step = fn(params, Recorded, **kw)
        for s in range(STEPS):
            step(flat_grad(s, info.rank, params))
        out.append({"optimizer": name, "params": params, "state": _state_bytes(made)})
    return out


def sharded_opt_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    for rank, rows in sorted(per_rank.items()):
        for r, ref in zip(rows, reference_steps(world), strict=True):
            got, want = r["params"], ref["params"]
            err = (
                ((got - want).norm() / want.norm()).item()
                if isinstance(got, torch.Tensor) and got.shape == want.shape
                else float("inf")
            )
            if not err <= 1e-5:
                raise Wrong(
                    f"with torch.optim.{ref['optimizer']}, rank {rank}'s weights after {STEPS} steps differ from "
                    f"one process's by {err:.2g} (relative): the inner optimizer must step this rank's "
                    "slice with the mean gradient, and the slices be all-gathered after every step"
                )
            want_state = ref["full_state"] // world
            if r["state"] != want_state:
                times = r["state"] / want_state if want_state else float("inf")
                raise Wrong(
                    f"rank {rank}'s torch.optim.{ref['optimizer']} keeps {r['state']} bytes of state, "
                    f"{times:.2g}x the K·Ψ/Nd = {want_state} bytes of its slice: create the inner "
                    f"optimizer over a tensor of this rank's S elements only (Nd = {world})"
                )


register(
    Exercise(
        "03",
        "sharded_optimizer",
        "A sharded optimizer for any element-wise torch optimizer",
        "weights after 3 steps of SGD with momentum, Adam and AdamW against one process, and the optimizer state "
        "each rank keeps against K·Ψ/Nd bytes, on 2 ranks, with the tiny course model's weights (whatever MODEL says)",
        task="Write `sharded_optimizer(params, optimizer_class, **defaults)` returning a function `step(grads)`: "
        "ZeRO stage 1 for any element-wise `torch.optim` class. `params` is the flat, padded weights (the same "
        "on every rank); each rank creates `optimizer_class` over its own slice only, and `step(grads)` "
        "reduce-scatters this rank's full flat gradient, steps the slice, and all-gathers the new weights. "
        "Predict first: how many bytes of Adam state does each of 2 ranks keep for $\\Psi$ parameters?",
        stub="def sharded_optimizer(params, optimizer_class, **defaults):\n"
        '    """ZeRO-1: return step(grads) that updates the flat params with optimizer_class on this rank\'s slice."""\n'
        '    raise NotImplementedError("exercise 03.sharded_optimizer: your code here")\n',
        hints=(
            "Make the slice a leaf the optimizer can own: `shard = params[r*S:(r+1)*S].clone().requires_grad_()`, "
            "then `opt = optimizer_class([shard], **defaults)`.",
            "In `step(grads)`: reduce-scatter into `shard.grad` (divide by the world size), `opt.step()`.",
            "Then `dist.all_gather_single(params, shard.detach())`: every rank's params are whole again.",
        ),
        on_rank=sharded_opt_on_rank,
        verdict=sharded_opt_verdict,
        nproc=2,
    )
)


# The two that build the mechanism (stage 2's hooks, stage 3's gather and free), registered after these two.
from . import nb03_stages  # noqa: E402, F401
