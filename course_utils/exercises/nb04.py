"""Notebook 04's exercises: FSDP2's per-parameter layout, gathering it back, clipping across shards,
and choosing wrapping and reshard_after_forward for a memory budget.

References: ``per_param`` (the course's hand-built FSDP2 layout, checked against ``fully_shard``
in its tests), ``torch.nn.utils.clip_grad_norm_`` on one process's full gradients, ``CommCounter``,
and ``fully_shard`` itself (``fsdp.shard_model`` with backward prefetching off) with
``fsdp.UnshardedTracker`` for the layouts of exercise 04.4.
"""

from __future__ import annotations

from functools import cache

import torch

from .. import dist as cdist
from .. import per_param
from ..comm import all_gather_sent
from ..compat import provide_renamed_collectives
from ..data import batch_for_rank
from ..instrument import CommCounter
from ..launch import launch
from ..models import build_model, get_config
from ..zero import assign_units
from .core import REFERENCE_LAUNCH, Exercise, Wrong, register

SHAPES = [(10, 3), (2, 5), (64,), (7,), (256, 64)]
WORLDS = (2, 3, 4)

# Shown in the section before the exercises: the course's per-parameter sharding beside fully_shard.
EXTRA_CELLS = [
    (
        "markdown",
        "### Per-parameter sharding: FSDP2's layout, built by hand\n\n"
        "Notebook 03's stage 3 (like FSDP1) cuts one flat buffer per unit into N "
        "slices, so a slice can end inside a weight matrix; DeepSpeed's stage 3 flattens and pads each parameter "
        "on its own and gives rank r its r-th piece. `fully_shard` shards *each parameter* on dim 0, padded with "
        "zero rows; "
        "`course_utils/per_param.py` builds that layout by hand. Rank r keeps\n\n"
        "$$\\text{rows } [rc,\\ (r+1)c), \\qquad c = \\lceil \\text{rows}/N \\rceil$$",
        "slide",
    ),
    (
        "markdown",
        "Its tests check every rank's rows against `fully_shard`'s local shards, and training against one "
        "process with SGD, Adam and AdamW. What per-parameter sharding changes: after the backward every parameter "
        "has its own gradient shard, so any `torch.optim` optimizer over `model.parameters()` drives the sharded "
        "model unchanged; an optimizer that is not element-wise (Shampoo, Adafactor's row and column statistics, "
        "LAMB's per-tensor trust ratio) sees a block of rows, not the whole tensor, and needs the tensor gathered "
        "or its statistics reduced across ranks; gradient-norm clipping must add every rank's squares before the "
        "square root (exercise 04.3).",
        None,
    ),
    (
        "markdown",
        "Ask the class: why does a 10-row weight on 4 ranks leave rank 3 one real row? (Each rank keeps "
        "c = ⌈10/4⌉ = 3 rows: ranks 0 to 2 hold nine, rank 3 the tenth and two zero rows. The next cell asserts the "
        "same rule on section 1's 5-row weight, c = 2, so the Predict's answer is not printed before it is asked.)",
        "notes",
    ),
    (
        "code",
        "from course_utils import per_param\n\n"
        "rows = [(r, per_param.shard_rows(5, 4, r)) for r in range(4)]  # section 1's 5-row weight\n"
        'print("a 5-row parameter on 4 ranks, rows kept per rank:", rows)\n'
        "assert [stop - start for _, (start, stop) in rows] == [2, 2, 1, 0]  # torch.chunk's split: c = 2",
        None,
    ),
]


# After the last exercise: the course's ShardedParam, whose all_gather and reduce_scatter answer 04.1 and 04.2.
AFTER_CHECK = {
    "choose_layout": [
        (
            "code",
            "# Exercises 04.1 and 04.2 answered: the course's per-parameter layout, gathered and reduced\n"
            "import inspect\n\n"
            "print(inspect.getsource(per_param.ShardedParam))",
            "skip",
        ),
    ],
}


def judge_shard_dim0(fn) -> None:
    for shape in SHAPES:
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1
        for nd in WORLDS:
            for rank in range(nd):
                want = per_param.padded_shard(full, rank, nd)
                got = fn(full, rank, nd)
                if not isinstance(got, torch.Tensor):
                    raise Wrong(f"shard_dim0 returned {type(got).__name__}, not a tensor")
                if tuple(got.shape) != tuple(want.shape):
                    raise Wrong(
                        f"a {list(shape)} parameter on {nd} ranks: rank {rank}'s shard has shape "
                        f"{list(got.shape)}, FSDP2's has {list(want.shape)}: every rank keeps c = "
                        f"ceil({shape[0]}/{nd}) = {want.shape[0]} rows, zero-padded past the end"
                    )
                if not torch.equal(got, want):
                    start, stop = per_param.shard_rows(shape[0], nd, rank)
                    raise Wrong(
                        f"a {list(shape)} parameter on {nd} ranks: rank {rank}'s shard should hold rows "
                        f"[{start}, {stop}) then zero rows; did you start at rank·c, with c = "
                        f"ceil(rows / N), and pad with zeros (not repeat rows)?"
                    )


register(
    Exercise(
        "04",
        "shard_dim0",
        "Shard one parameter as FSDP2 does",
        "every rank's shard of parameters of 5 shapes on 2, 3 and 4 ranks, bit for bit, against per_param.padded_shard "
        "(whose rows the tests check against fully_shard's)",
        task="Write `shard_dim0(full, rank, world_size)`: rank r's shard of the parameter `full` as FSDP2 keeps it: "
        "rows [r·c, (r+1)·c) of dim 0 with c = ceil(rows / world_size), padded with zero rows to exactly c rows "
        "(a rank past the end gets c zero rows). Predict first: a 10-row weight on 4 ranks, how many real rows "
        "does rank 3 keep?",
        stub="def shard_dim0(full, rank, world_size):\n"
        '    """Rank r\'s rows of full along dim 0, FSDP2-style: c = ceil(rows / N) rows, zero-padded."""\n'
        '    raise NotImplementedError("exercise 04.shard_dim0: your code here")\n',
        hints=(
            "c = -(-full.shape[0] // world_size) is ceil without floats.",
            "start = min(rank * c, rows), stop = min((rank + 1) * c, rows).",
            "out = full.new_zeros((c, *full.shape[1:])); out[:stop - start] = full[start:stop].",
        ),
        judge=judge_shard_dim0,
    )
)


# ---------------------------------------------------------------------------------------------


def _full(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 100 + shape[0]))


def unshard_on_rank(fn, info) -> list:
    provide_renamed_collectives()  # the hint's torch 2.13 name, also on an older torch
    out = []
    for shape in SHAPES:
        shard = per_param.padded_shard(_full(shape), info.rank, info.world_size)
        with CommCounter() as comm:
            got = fn(shard.clone(), shape[0])
        out.append(
            {
                "got": got if isinstance(got, torch.Tensor) else None,
                "sent": sum(v["sent_bytes"] for v in comm.summary().values()),
            }
        )
    return out


def unshard_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    for rank, rows in sorted(per_rank.items()):
        for shape, r in zip(SHAPES, rows, strict=True):
            full, got = _full(shape), r["got"]
            got_shape = list(got.shape) if isinstance(got, torch.Tensor) else None
            if got_shape != list(shape):
                extra = (
                    " (the zero rows of padding are still there: keep the first dim0 rows)"
                    if got_shape and got_shape[0] > shape[0]
                    else ""
                )
                raise Wrong(f"rank {rank} returned shape {got_shape} for a {list(shape)} parameter{extra}")
            if not torch.equal(got, full):
                raise Wrong(
                    f"rank {rank}'s {list(shape)} parameter differs from the original: gather the shards in "
                    "rank order (rank r's rows go at [r·c, (r+1)·c))"
                )
            shard = per_param.padded_shard(full, rank, world)
            expected = all_gather_sent(shard.numel() * shard.element_size() * world, world)
            if abs(r["sent"] - expected) > 1e-6 * max(1.0, expected):
                raise Wrong(
                    f"rank {rank} sent {r['sent']:.0f} bytes for a {list(shape)} parameter; one all-gather of "
                    f"the padded rows sends (N-1)/N of them, {expected:.0f}"
                )


register(
    Exercise(
        "04",
        "unshard",
        "Gather a parameter back from its shards",
        "the gathered parameters of 5 shapes, bit for bit, and the bytes sent (CommCounter against one all-gather's "
        "(N-1)/N of the padded rows) on 2 ranks",
        task="Write `unshard(shard, dim0)`: every rank holds its padded shard (c rows, from `shard_dim0`); gather "
        "all ranks' shards with one all-gather and return the full parameter, its `dim0` real rows only. This is "
        "what FSDP2 does to each parameter of a unit before the unit's forward.",
        stub="def unshard(shard, dim0):\n"
        '    """All-gather every rank\'s padded shard (c rows) and return the full parameter (dim0 rows)."""\n'
        '    raise NotImplementedError("exercise 04.unshard: your code here")\n',
        hints=(
            "The gathered tensor has world_size · c rows: `torch.empty((N * shard.shape[0], *shard.shape[1:]))`.",
            "`dist.all_gather_single(out, shard)` puts rank r's shard at rows [r·c, (r+1)·c) (the name since "
            "torch 2.13; `all_gather_into_tensor` before).",
            "Return `out[:dim0]`: the rows past dim0 are padding.",
        ),
        on_rank=unshard_on_rank,
        verdict=unshard_verdict,
        nproc=2,
    )
)


# ---------------------------------------------------------------------------------------------

MAX_NORM = 0.05


def _tiny_batch(rank: int, world: int):
    cfg = get_config("tiny")
    return batch_for_rank(0, rank, world, batch=8, seq=cfg.seq, vocab=cfg.vocab)


@cache
def reference_clip() -> tuple[float, dict, dict]:
    """One process's whole gradient: its norm, and every parameter's gradient before and after clipping."""
    ref = build_model(get_config("tiny"), seed=0)
    ref(*_tiny_batch(0, 1)).backward()
    before = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
    return norm, before, {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def clip_on_rank(fn, info) -> dict:
    model = build_model(get_config("tiny"), seed=0)
    sharded = per_param.PerParamSharded(model, units=list(model.blocks))
    sharded(*_tiny_batch(info.rank, info.world_size)).backward()
    norm = fn([p.grad for p in sharded.parameters()], MAX_NORM)
    try:
        norm = float(norm)
    except (TypeError, ValueError, RuntimeError):
        norm = None
    return {"norm": norm, "grads": {name: p.grad for name, p in model.named_parameters()}}


def clip_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    want_norm, before, after = reference_clip()
    for rank, r in sorted(per_rank.items()):
        rows = {n: slice(*per_param.shard_rows(g.shape[0], world, rank)) for n, g in after.items()}
        local_norm = torch.stack([before[n][rows[n]].norm() for n in before]).norm().item()
        if r["norm"] is None or abs(r["norm"] - want_norm) > 1e-5 * want_norm:
            if r["norm"] is not None and abs(r["norm"] - local_norm) <= 1e-4 * local_norm:
                raise Wrong(
                    f"rank {rank} returned the norm of its own shards ({r['norm']:.4g}), not of the whole "
                    f"gradient ({want_norm:.4g}): all-reduce the sum of squares before the square root"
                )
            raise Wrong(f"rank {rank} returned a norm of {r['norm']!r}; the whole gradient's norm is {want_norm:.4g}")
        worst = 0.0
        for name, full in after.items():
            want, got = full[rows[name]], r["grads"].get(name)
            if not want.numel():
                continue
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                worst = float("inf")
                break
            worst = max(worst, ((got - want).norm() / want.norm()).item())
        if not worst <= 1e-5:
            raise Wrong(
                f"rank {rank}'s clipped gradient shards differ from torch.nn.utils.clip_grad_norm_'s rows by "
                f"{worst:.2g} (relative): scale every shard by max_norm / total_norm (when it is below 1)"
            )


register(
    Exercise(
        "04",
        "clip_sharded",
        "Clip the gradient norm across shards",
        "the returned norm and every rank's clipped gradient rows against torch.nn.utils.clip_grad_norm_ on one "
        "process's full gradients, on 2 ranks with per_param sharding",
        task="Write `clip_sharded(grads, max_norm)`: `grads` are this rank's gradient shards (one per parameter, "
        "after a per-parameter-sharded backward). Return the norm of the *whole* gradient (all ranks' shards "
        "together) and scale the shards in place by `max_norm / norm` when that is below 1, exactly as "
        "`torch.nn.utils.clip_grad_norm_` does on one process.",
        stub="def clip_sharded(grads, max_norm):\n"
        '    """Clip gradient shards in place by the whole gradient\'s norm; return that norm."""\n'
        '    raise NotImplementedError("exercise 04.clip_sharded: your code here")\n',
        hints=(
            "The squared norm of the whole gradient is the sum over ranks of each rank's sum of squares.",
            "`total = sum(g.pow(2).sum() for g in grads)`, then `dist.all_reduce(total)`, then `total.sqrt()`.",
            "`scale = min(1.0, max_norm / (norm + 1e-6))`; `g.mul_(scale)` for every shard.",
        ),
        on_rank=clip_on_rank,
        verdict=clip_verdict,
        nproc=2,
    )
)


# ---------------------------------------------------------------------------------------------


def _units(model) -> list[dict]:
    return [{"name": n, "numel": sum(p.numel() for p in ps)} for n, _, ps in assign_units(model, list(model.blocks))]


def budgets(model) -> list[int]:
    """Three budgets of gathered bytes (fp32): the whole model, root plus one block, less than that."""
    units = _units(model)
    root = sum(u["numel"] for u in units if u["name"] == "(root)")
    whole = sum(u["numel"] for u in units)
    block = max(u["numel"] for u in units if u["name"] != "(root)")
    return [4 * whole + 1024, 4 * (root + block) + 1024, 4 * (root + block) - 1024]


LAYOUTS = [(wrap, reshard) for wrap in ("block", "model") for reshard in (True, False)]


def layouts_on_rank() -> dict:
    """Worker: every layout run by ``fully_shard`` itself (``fsdp.shard_model``: the root at its default, backward
    prefetching off), its peak of gathered bytes (``fsdp.UnshardedTracker``) and all-gather bytes, one
    forward-backward each."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..fsdp import UnshardedTracker, shard_model

    out = {}
    with cdist.session() as info:
        mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("shard",))
        for wrap, reshard in LAYOUTS:
            model = build_model(get_config("tiny"), seed=0)
            shard_model(model, mesh, reshard_after_forward=reshard, granularity=wrap, prefetch="none")
            tracker = UnshardedTracker(model)
            tracker.start()
            with CommCounter() as comm:
                model(*_tiny_batch(info.rank, info.world_size)).backward()
            tracker.stop()
            out[f"{wrap}/{reshard}"] = {
                "peak": tracker.peak,
                "gather_bytes": comm.summary()["all_gather"]["payload_bytes"],
            }
    return out


@cache
def _measured() -> dict:
    return launch(layouts_on_rank, nproc=2, progress=False, echo=False, backend="gloo")[0]


def measured_layouts() -> dict:
    """Each layout measured once on 2 ranks (the course's code only; cached): ``{"block/True": {peak, ...}}``."""
    with REFERENCE_LAUNCH:  # graders judge several notebooks at once, from threads
        return _measured()


def judge_choose_layout(fn) -> None:
    model = build_model(get_config("tiny"), seed=0)
    whole, middle, too_small = budgets(model)
    for budget in (whole, middle, too_small):
        choice = fn(budget, _units(model))
        if choice is not None and not (
            isinstance(choice, dict)
            and choice.get("wrap") in ("block", "model")
            and isinstance(choice.get("reshard_after_forward"), bool)
        ):
            raise Wrong(
                f"for a budget of {budget} bytes you returned {choice!r}: return "
                '{"wrap": "block" or "model", "reshard_after_forward": True or False}, or None'
            )
        m = measured_layouts()[f"{choice['wrap']}/{choice['reshard_after_forward']}"] if choice else None
        if budget == too_small:
            if choice is not None:
                raise Wrong(
                    f"with a budget of {budget} bytes (less than the root plus one block) nothing fits, yet you "
                    f"chose {choice}, which gathered {m['peak']} bytes at its peak; return None"
                )
            continue
        if choice is None:
            raise Wrong(
                f"with a budget of {budget} bytes you returned None, but a layout fits: compare the budget "
                "with the root plus the largest block"
            )
        if m["peak"] > budget:
            raise Wrong(
                f"with a budget of {budget} bytes, {choice} gathered {m['peak']} bytes at its peak (measured): "
                "wrap each block and reshard after forward to hold only the root and one block"
            )
        least = min(v["gather_bytes"] for v in measured_layouts().values() if v["peak"] <= budget)
        if m["gather_bytes"] > least:  # measured, against the least any layout within the budget all-gathers
            raise Wrong(
                f"with a budget of {budget} bytes, {choice} all-gathers {m['gather_bytes']:.0f} bytes a step (measured), "
                f"yet a layout within the budget all-gathers {least:.0f}: the whole model fits gathered, so gather "
                "each parameter once (reshard_after_forward=False, or one unit for the whole model)"
            )


register(
    Exercise(
        "04",
        "choose_layout",
        "Wrapping and reshard_after_forward for a memory budget",
        "the peak of gathered bytes of fully_shard itself (the root at its default, backward prefetching off), "
        "measured by fsdp.UnshardedTracker on 2 ranks against three budgets (whole model, root plus one block, "
        "less), and the all-gather bytes against the least the budget allows",
        task="Write `choose_layout(budget_bytes, units)`: `units` lists the unit table (`name`, `numel`; the root "
        'unit is named `"(root)"`; fp32, 4 bytes an element). Return `{"wrap": "block" or "model", '
        '"reshard_after_forward": bool}` whose peak of gathered parameters stays within `budget_bytes` with '
        "the fewest all-gathered bytes, or `None` if no layout fits. The check runs your choice with `fully_shard` on 2 "
        "ranks, the root at its default and backward prefetching off (the schedule: one block gathered at a time; "
        "FSDP2's default prefetch would add the next block, as section 4 measured), and measures the peak with "
        "`fsdp.UnshardedTracker`.",
        stub="def choose_layout(budget_bytes, units):\n"
        '    """{"wrap": "block"|"model", "reshard_after_forward": bool} that fits budget_bytes\n'
        '    with the fewest all-gathered bytes, or None."""\n'
        '    raise NotImplementedError("exercise 04.choose_layout: your code here")\n',
        hints=(
            "Without resharding (or with one unit for the whole model) the whole model is gathered at the end of "
            "the forward: 4·Σ numel bytes.",
            "With each block wrapped and reshard_after_forward=True the peak is the root plus the largest block: "
            "the root stays gathered for the whole forward and backward.",
            "Prefer reshard_after_forward=False when the whole model fits: it saves the backward's all-gather.",
        ),
        judge=judge_choose_layout,
    )
)
