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
from ..loop import Prepared, TrainConfig, device_mesh, run_steps
from ..models import GPTConfig, build_model
from ..rehearse.run import apply_options, check_setting, make_optimizer, model_config, rehearse
from ..strategies import FULL_SHARD, SHARD_GRAD_OP, get_fsdp


def real_state_worker(
    cfg: dict, strategies: list, node_size: int = 2, mixed_precision: str = "bf16", micro_batch: int = 1, seed: int = 0
) -> dict:
    """One real optimizer step per strategy of the course model on this rank; bytes held (notebook 05b).

    A worker for ``launch``: the same apply function, options and ``make_optimizer`` as the rehearsal,
    on real ranks: gloo on CPU, or NCCL on a CUDA mesh where there is a GPU per rank. Returns
    ``{strategy: {"params", "grads", "optim", "steps", "total", "loss"}}``, the bytes of the local shards
    this rank holds after the step, counted by ``instrument.rank_bytes`` (the optimizer's 0-dim
    step counters in ``steps``).
    """
    info = cdist.init()
    try:
        gcfg = GPTConfig(**cfg)
        run = TrainConfig(model=gcfg, batch=micro_batch * info.world_size, seed=seed)  # the rehearsal's step
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

            prepared = Prepared(model=net, optimizer=opt, full_state_dict=dict, held=held)
            counted = HeldAtRest(held, at=0)
            (loss,) = run_steps(prepared, run, info, range(1), [counted])
            out[strategy] = {**counted.bytes, "loss": float(loss)}
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
    Sharded Grad and OptState after the step; the real side is what each rank holds.
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
                "rehearsal_wall_s": r.wall_s,
                "launch_wall_s": real.wall_s,
            }
        )
    return rows
