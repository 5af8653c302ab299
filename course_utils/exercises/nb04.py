"""Notebook 04's exercises: FSDP2's per-parameter layout, gathering it back, clipping across shards,
and choosing wrapping and reshard_after_forward for a memory budget.

References: ``per_param`` (the course's hand-built FSDP2 layout, checked against ``fully_shard``
in its tests), ``torch.nn.utils.clip_grad_norm_`` on one process's full gradients, ``CommCounter``,
and ``per_param.PerParamSharded``'s tracker of gathered bytes.
"""

from __future__ import annotations

import torch

from .. import per_param
from ..comm import all_gather_sent
from ..data import batch_for_rank
from ..instrument import CommCounter
from ..models import build_model, get_config
from ..zero import assign_units
from .core import Exercise, Wrong, register

SHAPES = [(10, 3), (2, 5), (64,), (7,), (256, 64)]
WORLDS = (2, 3, 4)

# Shown in the section before the exercises: the course's per-parameter sharding beside fully_shard.
EXTRA_CELLS = [
    (
        "markdown",
        "### Per-parameter sharding: FSDP2's layout, built by hand\n\n"
        "Notebook 03's stage 3 cuts one flat buffer per unit into N slices, so a slice can end inside a weight "
        "matrix. `fully_shard` shards *each parameter* on dim 0, padded with zero rows; "
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
        "c = ⌈10/4⌉ = 3 rows: ranks 0 to 2 hold nine, rank 3 the tenth and two zero rows; the next cell asserts it.)",
        "notes",
    ),
    (
        "code",
        "import inspect\n\nfrom course_utils import per_param\n\n"
        "print(inspect.getsource(per_param.ShardedParam))\n"
        "rows = [(r, per_param.shard_rows(10, 4, r)) for r in range(4)]\n"
        'print("a 10-row parameter on 4 ranks, rows kept per rank:", rows)\n'
        "assert [stop - start for _, (start, stop) in rows] == [3, 3, 3, 1]  # torch.chunk's split: c = 3",
        None,
    ),
]


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


def unshard_on_rank(fn, info) -> list:
    out = []
    for shape in SHAPES:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 100 + shape[0]))
        shard = per_param.padded_shard(full, info.rank, info.world_size)
        with CommCounter() as comm:
            got = fn(shard.clone(), shape[0])
        sent = sum(v["sent_bytes"] for v in comm.summary().values())
        gathered_bytes = shard.numel() * shard.element_size() * info.world_size
        out.append(
            {
                "shape": list(shape),
                "got_shape": list(got.shape) if isinstance(got, torch.Tensor) else None,
                "equal": isinstance(got, torch.Tensor) and got.shape == full.shape and torch.equal(got, full),
                "sent": sent,
                "expected_sent": all_gather_sent(gathered_bytes, info.world_size),
            }
        )
    return out


def unshard_verdict(per_rank: dict) -> None:
    for rank, rows in sorted(per_rank.items()):
        for r in rows:
            if r["got_shape"] != r["shape"]:
                extra = (
                    " (the zero rows of padding are still there: keep the first dim0 rows)"
                    if r["got_shape"] and r["got_shape"][0] > r["shape"][0]
                    else ""
                )
                raise Wrong(f"rank {rank} returned shape {r['got_shape']} for a {r['shape']} parameter{extra}")
            if not r["equal"]:
                raise Wrong(
                    f"rank {rank}'s {r['shape']} parameter differs from the original: gather the shards in "
                    "rank order (rank r's rows go at [r·c, (r+1)·c))"
                )
            if abs(r["sent"] - r["expected_sent"]) > 1e-6 * max(1.0, r["expected_sent"]):
                raise Wrong(
                    f"rank {rank} sent {r['sent']:.0f} bytes for a {r['shape']} parameter; one all-gather of "
                    f"the padded rows sends (N-1)/N of them, {r['expected_sent']:.0f}"
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
            "`dist.all_gather_single(out, shard)` puts rank r's shard at rows [r·c, (r+1)·c).",
            "Return `out[:dim0]`: the rows past dim0 are padding.",
        ),
        on_rank=unshard_on_rank,
        verdict=unshard_verdict,
        nproc=2,
    )
)


# ---------------------------------------------------------------------------------------------

MAX_NORM = 0.05


def clip_on_rank(fn, info) -> dict:
    cfg = get_config("tiny")
    kw = dict(batch=8, seq=cfg.seq, vocab=cfg.vocab)
    ref = build_model(cfg, seed=0)
    ref(*batch_for_rank(0, 0, 1, **kw)).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
    model = build_model(cfg, seed=0)
    sharded = per_param.PerParamSharded(model, units=list(model.blocks))
    sharded(*batch_for_rank(0, info.rank, info.world_size, **kw)).backward()
    local_norm = torch.stack([p.grad.norm() for p in sharded.parameters()]).norm().item()
    norm = fn([p.grad for p in sharded.parameters()], MAX_NORM)
    full = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        start, stop = per_param.shard_rows(full[name].shape[0], info.world_size, info.rank)
        want = full[name].grad[start:stop]
        if want.numel():
            worst = max(worst, ((p.grad - want).norm() / want.norm()).item())
    return {
        "norm": float(norm) if norm is not None else None,
        "want_norm": want_norm,
        "local_norm": local_norm,
        "rel_err": worst,
    }


def clip_verdict(per_rank: dict) -> None:
    for rank, r in sorted(per_rank.items()):
        if r["norm"] is None or abs(r["norm"] - r["want_norm"]) > 1e-5 * r["want_norm"]:
            if r["norm"] is not None and abs(r["norm"] - r["local_norm"]) <= 1e-5 * r["local_norm"]:
                raise Wrong(
                    f"rank {rank} returned the norm of its own shards ({r['norm']:.4g}), not of the whole "
                    f"gradient ({r['want_norm']:.4g}): all-reduce the sum of squares before the square root"
                )
            raise Wrong(
                f"rank {rank} returned a norm of {r['norm']!r}; the whole gradient's norm is {r['want_norm']:.4g}"
            )
        if r["rel_err"] > 1e-5:
            raise Wrong(
                f"rank {rank}'s clipped gradient shards differ from torch.nn.utils.clip_grad_norm_'s rows by "
                f"{r['rel_err']:.2g} (relative): scale every shard by max_norm / total_norm (when it is below 1)"
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


def layout_on_rank(fn, info) -> list:
    cfg = get_config("tiny")
    kw = dict(batch=8, seq=cfg.seq, vocab=cfg.vocab)
    out = []
    for budget in budgets(build_model(cfg, seed=0)):
        choice = fn(budget, _units(build_model(cfg, seed=0)))
        row = {"budget": budget, "choice": choice}
        if choice is not None:
            model = build_model(cfg, seed=0)
            units = list(model.blocks) if choice["wrap"] == "block" else []
            sharded = per_param.PerParamSharded(
                model, units=units, reshard_after_forward=choice["reshard_after_forward"]
            )
            with CommCounter() as comm:
                sharded(*batch_for_rank(0, info.rank, info.world_size, **kw)).backward()
            row.update(peak=sharded.tracker.peak, gather_bytes=comm.summary()["all_gather"]["payload_bytes"])
        out.append(row)
    return out


def layout_verdict(per_rank: dict) -> None:
    whole, middle, too_small = per_rank[0]  # the budgets of ``budgets``, in order (the same on every rank)
    for r in (whole, middle, too_small):
        budget, choice = r["budget"], r["choice"]
        if r is too_small:
            if choice is not None:
                raise Wrong(
                    f"with a budget of {budget} bytes (less than the root plus one block) nothing fits, yet you "
                    f"chose {choice}, which gathered {r['peak']} bytes at its peak; return None"
                )
            continue
        if choice is None:
            raise Wrong(
                f"with a budget of {budget} bytes you returned None, but a layout fits: compare the budget "
                "with the root plus the largest block"
            )
        if r["peak"] > budget:
            raise Wrong(
                f"with a budget of {budget} bytes, {choice} gathered {r['peak']} bytes at its peak (measured): "
                "wrap each block and reshard after forward to hold only the root and one block"
            )
        if r is whole and choice["reshard_after_forward"]:
            raise Wrong(
                f"with a budget of {budget} bytes the whole model fits gathered, but reshard_after_forward=True "
                f"all-gathers {r['gather_bytes']:.0f} bytes a step instead of gathering each parameter once: "
                "keep the units gathered until their backward (reshard_after_forward=False)"
            )


register(
    Exercise(
        "04",
        "choose_layout",
        "Wrapping and reshard_after_forward for a memory budget",
        "the peak of gathered bytes measured by the tracker on 2 ranks against three budgets (whole model, root plus "
        "one block, less), and the all-gather bytes against the least the budget allows",
        task="Write `choose_layout(budget_bytes, units)`: `units` lists the unit table (`name`, `numel`; the root "
        'unit is named `"(root)"`; fp32, 4 bytes an element). Return `{"wrap": "block" or "model", '
        '"reshard_after_forward": bool}` whose peak of gathered parameters stays within `budget_bytes` with '
        "the fewest all-gathers, or `None` if no layout fits. The check runs your choice on 2 ranks and "
        "measures the peak with the tracker.",
        stub="def choose_layout(budget_bytes, units):\n"
        '    """{"wrap": "block"|"model", "reshard_after_forward": bool} that fits budget_bytes\n'
        '    with the fewest gathers, or None."""\n'
        '    raise NotImplementedError("exercise 04.choose_layout: your code here")\n',
        hints=(
            "Without resharding (or with one unit for the whole model) the whole model is gathered at the end of "
            "the forward: 4·Σ numel bytes.",
            "With each block wrapped and reshard_after_forward=True the peak is the root plus the largest block: "
            "the root stays gathered for the whole forward and backward.",
            "Prefer reshard_after_forward=False when the whole model fits: it saves the backward's all-gather.",
        ),
        on_rank=layout_on_rank,
        verdict=layout_verdict,
        nproc=2,
    )
)
