"""Notebook 05b's bridge to reality: the rehearsal's wrapping on real gloo ranks, bytes counted on real shards.

``bridge`` runs one real optimizer step per strategy through the one loop (``loop.run_steps``)
with the strategy's row applied as the rehearsal applies it and the rehearsal's optimizer, and holds the
bytes each rank holds against what the rehearsal (``course_utils.rehearse``) says for the same setting.
"""

from __future__ import annotations

import torch

from .. import dist as cdist
from ..instrument import HeldAtRest
from ..launch import launch
from ..loop import device_mesh
from ..models import GPTConfig, build_model
from ..rehearse.run import apply_options, check_setting, make_optimizer, model_config, rehearse, tracked_step
from ..strategies import FULL_SHARD, SHARD_GRAD_OP, get_fsdp


def real_state_worker(
    cfg: dict, strategies: list, node_size: int = 2, mixed_precision: str = "bf16", micro_batch: int = 1, seed: int = 0
) -> dict:
    """One real optimizer step per strategy of the course model on this rank; bytes held, and the tracker's
    categories (notebook 05b).

    A worker for ``launch``: the same apply function, options, ``make_optimizer`` and tracked step
    (``rehearse.run.tracked_step``) as the rehearsal, on real ranks: gloo on CPU, or NCCL on a CUDA mesh where
    there is a GPU per rank. Returns ``{strategy: {"params", "grads", "optim", "steps", "total", "tracked"}}``: the bytes of
    the local shards this rank holds after the step, counted by ``instrument.rank_bytes`` (the optimizer's 0-dim
    step counters in ``steps``), and ``tracked``, ``tracked_step``'s categories of the same step on real tensors.
    """
    info = cdist.init()
    try:
        gcfg = GPTConfig(**cfg)
        out = {}
        for strategy in strategies:
            row = get_fsdp(strategy)
            mesh = device_mesh(row, info, node_size)
            net = build_model(gcfg, seed, device=info.device)
            net = row.apply(net, mesh, apply_options(row, mixed_precision, node_size, device=info.device))
            opt = make_optimizer(net)

            def held(net=net, opt=opt):  # the optimizer's 0-dim step counters included
                params = list(net.parameters())
                state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                return params, [p.grad for p in params], state

            counted = HeldAtRest(held, at=0)
            tracked = tracked_step(net, opt, gcfg, info, micro_batch, observers=[counted])
            out[strategy] = {**counted.bytes, "tracked": tracked}
        return out
    finally:
        cdist.shutdown()


def bridge(
    nproc: int = 2,
    strategies=(FULL_SHARD.name, SHARD_GRAD_OP.name),
    *,
    model: str | GPTConfig = "tiny",
    node_size: int = 2,
    mixed_precision: str = "bf16",
    micro_batch: int = 1,
    echo: bool = False,
) -> list[dict]:
    """Rehearsal against reality on ``nproc`` real gloo ranks, one row per strategy (notebook 05b).

    Each row: ``{"strategy", "nproc", "rehearsal": {"params", "grads", "optim"}, "real":
    {rank: {...}}, "equal": bool}``. The rehearsal side is the tracker's Sharded Param,
    Sharded Grad and OptState after the step; the real side is what each rank holds. The peak, beside them
    (``_peaks``): the same tracked step (``rehearse.run.tracked_step``) on fake and on real tensors.
    """
    cfg = model_config(model)
    strategies = list(strategies)
    for s in strategies:
        check_setting(nproc, s, node_size, micro_batch, mixed_precision)
    real = launch(
        real_state_worker,
        nproc=nproc,
        args=(cfg.to_dict(), strategies, node_size, mixed_precision, micro_batch),
        echo=echo,
        progress=False,
    )
    rows = []
    for s in strategies:
        r = rehearse(cfg, nproc, s, node_size=node_size, micro_batch=micro_batch, mixed_precision=mixed_precision)
        fake = {
            "params": r.after_step["Sharded Param"],
            "grads": r.after_step["Sharded Grad"],
            "optim": r.after_step["OptState"],
        }
        fake["total"] = sum(fake.values())
        per_rank = {  # the tracker's OptState holds Adam's step counters: so does optim here, one count of bytes
            rank: {
                "params": v[s]["params"],
                "grads": v[s]["grads"],
                "optim": v[s]["optim"] + v[s]["steps"],
                "total": v[s]["total"],
            }
            for rank, v in real.items()
        }
        rows.append(
            {
                "strategy": s,
                "nproc": nproc,
                "rehearsal": fake,
                "real": per_rank,
                "equal": all(v == fake for v in per_rank.values()),
                **_peaks(r, {rank: v[s]["tracked"] for rank, v in real.items()}),
                "rehearsal_wall_s": r.wall_s,
                "launch_wall_s": real.wall_s,
            }
        )
    return rows


def _peaks(r, tracked: dict) -> dict:
    """The rehearsal's tracked step against the real ranks' (notebook 05b): ``category_peaks`` ``{category:
    (rehearsal, [real per rank])}`` (each category's own largest value in the step), ``peak_bytes`` (rehearsal,
    [real per rank]) (the categories at the step's peak, added up), and ``rs_buffers``: FSDP2's own reduce-scatter
    buffers for the step's largest reduce-scatter, its input and its one-shard output (``foreach_reduce`` allocates
    both; the tracker files them under Temp until the collective runs). Both worlds hold them; real gloo ranks record
    them, because gloo's reduce-scatter clones its input (a new peak at that instant), the fake group does not. The
    input is the tracker's "Reduce Scatter" peak."""
    ranks = sorted(tracked)
    cats = {c: (v, [tracked[k]["category_peaks"].get(c, 0) for k in ranks]) for c, v in r.category_peaks.items()}
    largest = r.category_peaks.get("Reduce Scatter", 0)
    return {
        "category_peaks": cats,
        "peak_bytes": (r.peak_bytes, [sum(tracked[k]["peak"].values()) for k in ranks]),
        "rs_buffers": largest + largest // r.nd,
    }
