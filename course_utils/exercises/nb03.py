"""Notebook 03's exercises: a ZeRO-2 step from reduce-scatter and all-gather, and a sharded optimizer.

References: one process applying the same optimizer to the mean of every rank's gradients (the
update data parallelism must reproduce), ``zero.padded_numel``/``zero.shard_bounds`` (the flat
layout), ``CommCounter`` against ``comm.reduce_scatter_sent``/``all_gather_sent``, and
``memory.optimizer_bill`` for the optimizer state a rank should keep (K·Ψ/Nd).
"""

from __future__ import annotations

from functools import cache

import torch

from ..comm import all_gather_sent, reduce_scatter_sent
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


def zero2_on_rank(fn, info) -> dict:
    world, rank = info.world_size, info.rank
    params = flat_start(world)
    want = params.clone()
    want -= LR * sum(flat_grad(0, r, params) for r in range(world)) / world
    with CommCounter() as comm:
        fn(params, flat_grad(0, rank, params), LR)
    bad = [
        r
        for r in range(world)
        if not torch.allclose(
            params[slice(*shard_bounds(params.numel(), world, r))],
            want[slice(*shard_bounds(params.numel(), world, r))],
            rtol=1e-5,
            atol=1e-7,
        )
    ]
    summary = comm.summary()
    n_bytes = params.numel() * params.element_size()
    return {
        "bad_slices": bad,
        "S": params.numel() // world,
        "calls": {k: v["calls"] for k, v in summary.items()},
        "sent": {k: v["sent_bytes"] for k, v in summary.items()},
        "expected": {
            "reduce_scatter": reduce_scatter_sent(n_bytes, world),
            "all_gather": all_gather_sent(n_bytes, world),
        },
    }


def zero2_verdict(per_rank: dict) -> None:
    for rank, r in sorted(per_rank.items()):
        if "all_reduce" in r["calls"]:
            raise Wrong(
                f"rank {rank} called all_reduce: ZeRO-2 sends each rank only its slice's sum "
                "(reduce-scatter), then shares the updated slices (all-gather)"
            )
        if r["bad_slices"]:
            s = r["bad_slices"][0]
            raise Wrong(
                f"after the step, rank {rank}'s copy of slice {s} (elements {s * r['S']}..{(s + 1) * r['S'] - 1}) "
                "differs from the reference: did each rank update the slice at [r·S, (r+1)·S) with the mean "
                "gradient, then all-gather every slice?"
            )
        for kind, want in r["expected"].items():
            got = r["sent"].get(kind, 0.0)
            if abs(got - want) > 1e-6 * want:
                raise Wrong(
                    f"rank {rank} sent {got:.0f} bytes by {kind.replace('_', '-')}; one {kind.replace('_', '-')} "
                    f"of the flat buffer sends (N-1)/N of its bytes, {want:.0f}"
                )


register(
    Exercise(
        "03",
        "zero2_step",
        "A ZeRO-2 step from reduce-scatter and all-gather",
        "every rank's weights after one SGD step against one process stepping on the mean gradient, and the bytes "
        "each collective sent (CommCounter against (N-1)/N·Ψ each) on 2 ranks, with the tiny course model's weights "
        "(whatever MODEL says: a check answers in seconds)",
        task="Write `zero2_step(params, grads, lr)`: `params` is the model's flat weights (padded to Nd·S, the same "
        "on every rank), `grads` this rank's full flat gradient. Reduce-scatter the gradients so rank r gets the "
        "mean of its slice `[r·S, (r+1)·S)`, take an SGD step on that slice only, and all-gather the slices back "
        "into `params`. Predict first: how many bytes does each rank send, compared with DDP's all-reduce?",
        stub="def zero2_step(params, grads, lr):\n"
        '    """One ZeRO-2 SGD step on flat, padded tensors; params ends updated and equal on every rank."""\n'
        '    raise NotImplementedError("exercise 03.zero2_step: your code here")\n',
        hints=(
            "S = params.numel() // dist.get_world_size(); rank r owns params[r*S:(r+1)*S].",
            "`dist.reduce_scatter_single(out, grads)` leaves in `out` (S elements) the sum over ranks of this "
            "rank's slice; divide by the world size.",
            "Update the slice in place, then `dist.all_gather_single(params, params[r*S:(r+1)*S].clone())`.",
        ),
        on_rank=zero2_on_rank,
        verdict=zero2_verdict,
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


def sharded_opt_on_rank(fn, info) -> list:
    world, rank = info.world_size, info.rank
    out = []
    for name, kw in OPTIMIZERS:
        cls = getattr(torch.optim, name)
        params = flat_start(world)
        ref = torch.nn.Parameter(params.clone())
        ref_opt = cls([ref], **kw)
        Recorded, made = _recording(cls)
        step = fn(params, Recorded, **kw)
        for s in range(STEPS):
            ref.grad = sum(flat_grad(s, r, params) for r in range(world)) / world
            ref_opt.step()
            step(flat_grad(s, rank, params))
        state = sum(
            t.numel() * t.element_size()
            for opt in made
            for st in opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        full_state = sum(
            t.numel() * t.element_size()
            for st in ref_opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        err = ((params - ref.detach()).norm() / ref.detach().norm()).item()
        out.append(
            {
                "optimizer": name,
                "rel_err": err,
                "state": state,
                "full_state": full_state,
                "want_state": full_state // world,
            }
        )
    return out


def sharded_opt_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    for rank, rows in sorted(per_rank.items()):
        for r in rows:
            if r["rel_err"] > 1e-5:
                raise Wrong(
                    f"with torch.optim.{r['optimizer']}, rank {rank}'s weights after {STEPS} steps differ from "
                    f"one process's by {r['rel_err']:.2g} (relative): the inner optimizer must step this rank's "
                    "slice with the mean gradient, and the slices be all-gathered after every step"
                )
            if r["state"] != r["want_state"]:
                times = r["state"] / r["want_state"] if r["want_state"] else float("inf")
                raise Wrong(
                    f"rank {rank}'s torch.optim.{r['optimizer']} keeps {r['state']} bytes of state, "
                    f"{times:.2g}x the K·Ψ/Nd = {r['want_state']} bytes of its slice: create the inner "
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
