"""Notebook 03's experiment: every ZeRO stage trains like one process, in one launch.

``agreement`` trains the one-process reference and each stage on the same model and data
through the one loop (``loop.run_steps``), and compares gradients, weights, losses and bytes
held. The mechanism it checks is ``course_utils.zero``.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist

from .. import dist as cdist
from ..data import batch_for_rank
from ..instrument import CountCollectives, HeldAtRest, Observer, weights_sha256
from ..launch import launch
from ..loop import Prepared, TrainConfig, device_mesh, make_optimizer, prepare, run_steps
from ..models import build_model, get_config, tail_numel
from ..per_param import shard_rows
from ..strategies import (
    DDP,
    FULL_SHARD,
    HYBRID_SHARD,
    NO_SHARD,
    SHARD_GRAD_OP,
    SINGLE,
    TORCH_ZERO1,
    ZERO1,
    ZERO2,
    ZERO3,
    get,
)
from ..zero import ShardedOptimizer, shard_bounds

#: What ``agreement`` compares with one process by default: plain DP, the three stages, torch's stage 1.
COMPARED = tuple(s.name for s in (DDP, ZERO1, ZERO2, ZERO3, TORCH_ZERO1))


def watches_update_peak(strategy) -> bool:
    """The stages whose last update ``agreement_worker`` also watches for its peak (``predict.peak_check``):
    the hand-built stages 1 and 2, flat buffers updated at the step. Stage 3's peak is its gathered units
    (``zero.GatheredBytes``), during forward and backward (notebook 03)."""
    return strategy.layout == "flat" and not strategy.gathers_units


def _train_steps(
    prepared, cfg, info, rank: int, world: int, count=None, peak: bool = False
) -> tuple[list[float], dict]:
    """The one loop (``loop.run_steps``) on ``rank``'s share of ``world``: the losses, and the bytes held
    counted where ``train`` counts them (the last step, after the update, before the gradients are cleared).
    ``count``: a ``CountCollectives`` observer to count the collectives too. ``peak``: also the peak of the
    last step's update (``HeldAtRest(peak=True)``), as ``update_peak`` and ``update_extra`` in the bytes."""
    held = HeldAtRest(
        prepared.held,
        at=cfg.steps - 1,
        peak=peak,
        optimizer=getattr(prepared.optimizer, "optimizer", prepared.optimizer),
    )
    losses = run_steps(
        prepared, cfg, info, range(cfg.steps), [held] + ([count] if count else []), rank=rank, world=world
    )
    peaks = {"update_peak": held.update_peak, "update_extra": held.update_extra} if peak else {}
    return [float(loss) for loss in losses], {**held.bytes, **peaks}


def gradient_error(prepared, model, ref_grads: dict) -> float:
    """Largest |g - g_single| of the averaged gradient this rank updates with, over max |g_single| (notebook 03).

    For the hand-built stages that is ``grad_shard`` of every flat buffer (this rank's slice,
    compared with the same slice of single's gradient, padding excluded); for DDP and the
    library reference it is every parameter's ``.grad``. A missing division by Nd gives ~1.
    """
    names = {p: n for n, p in model.named_parameters()}
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    opt = prepared.optimizer
    if not isinstance(opt, ShardedOptimizer):
        return max(float((p.grad - ref_grads[n]).abs().max()) for n, p in model.named_parameters()) / scale
    worst = 0.0
    for flat in opt.flats:
        ref = torch.cat([ref_grads[names[p]].reshape(-1) for p in flat.params])
        lo, hi = shard_bounds(flat.padded, flat.nd, flat.rank)
        mine = flat.grad_shard[: max(0, min(hi, flat.numel) - lo)].float()
        worst = max(worst, float((mine - ref[lo : lo + mine.numel()]).abs().max()) if mine.numel() else 0.0)
    return worst / scale


def _first_gradients(prepared, cfg, mcfg, rank: int, world: int, device) -> None:
    """One forward and backward of step 0, reduced but not applied."""
    x, y = batch_for_rank(0, rank, world, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed, device=device)
    prepared.model(x, y).backward()
    prepared.before_step()
    if type(prepared.optimizer) is ShardedOptimizer:  # stage 1 reduces at the step; do that part only
        prepared.optimizer.reduce_gradients()


def agreement_worker(config: dict, strategies=COMPARED) -> dict:
    """Train ``single`` and each strategy in one launch; compare gradients and final weights with single's (notebook 03).

    Rank 0 trains the one-process reference on the whole global batch by itself (no
    collectives) and sends its gradients and weights to every rank; then each strategy runs on
    its share of the batch, exactly as ``train`` would (same model, data, Adam; fp32 unless
    ``precision`` says otherwise). Rank 0 returns, per strategy: ``grad_error``
    (``gradient_error`` after step 0's backward, worst over ranks),
    ``max_abs_diff`` (largest |w - w_single| over every final weight), ``rel_diff``
    (‖w - w_single‖ / ‖w_single‖), the losses (averaged over ranks), ``weights_sha256``, and, shaped
    like a ``train`` report so that ``predict.memory_check`` reads them, ``strategy``, ``world_size``,
    ``per_rank`` (every rank's bytes held, counted as ``train`` counts them; for stages 1 and 2 also
    ``update_peak`` and ``update_extra``, the peak of the last step's update, ``predict.peak_check``),
    ``strategy_info`` and ``comm_per_step`` (rank 0's collectives per step, ``CountCollectives``).
    The other ranks return ``{"rank": r}``.
    """

    cfg = TrainConfig(**config).validate()
    mcfg = get_config(cfg.model)
    with cdist.session(cfg.backend if cfg.backend != "auto" else None) as info:
        reference = [None]
        if info.rank == 0:  # the one-process reference, on the whole global batch, without collectives
            single = prepare(cfg, info, SINGLE)
            model = single.model
            _first_gradients(single, cfg, mcfg, 0, 1, info.device)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            single.optimizer.zero_grad(set_to_none=True)
            losses, _ = _train_steps(single, cfg, info, 0, 1)
            reference = [
                (
                    {k: v.cpu() for k, v in grads.items()},
                    {k: v.cpu() for k, v in single.full_state_dict().items()},
                    losses,
                )
            ]
        dist.broadcast_object_list(reference, src=0)
        ref_grads, ref, ref_losses = reference[0]
        ref_grads = {k: v.to(info.device) for k, v in ref_grads.items()}
        ref = {k: v.to(info.device) for k, v in ref.items()}
        out = {SINGLE.name: {"losses": ref_losses, "weights_sha256": weights_sha256(ref)}}
        for name in strategies:
            row = get(name)
            first = prepare(cfg, info, row)
            model = getattr(first.model, "module", first.model)  # the course model inside a DDP wrapper
            _first_gradients(first, cfg, mcfg, info.rank, info.world_size, info.device)
            grad_error = torch.tensor(gradient_error(first, model, ref_grads), device=info.device)
            dist.all_reduce(grad_error, op=dist.ReduceOp.MAX)
            prepared = prepare(cfg, info, row)
            count = CountCollectives()  # the same counter as train(): ZeroRedundancyOptimizer's traffic too
            losses, held = _train_steps(
                prepared, cfg, info, info.rank, info.world_size, count, peak=watches_update_peak(row)
            )
            losses = torch.tensor(losses, device=info.device)
            dist.all_reduce(losses)
            full = prepared.full_state_dict()
            per_rank = [None] * info.world_size
            dist.all_gather_object(per_rank, held)
            diff = max(float((full[k].float() - ref[k].float()).abs().max()) for k in ref)
            num = sum(float((full[k].float() - ref[k].float()).pow(2).sum()) for k in ref)
            den = sum(float(ref[k].float().pow(2).sum()) for k in ref)
            out[name] = {
                "losses": (losses / info.world_size).cpu().tolist(),
                "grad_error": float(grad_error),
                "max_abs_diff": diff,
                "rel_diff": (num / den) ** 0.5,
                "weights_sha256": weights_sha256(full),
                "strategy": name,
                "world_size": info.world_size,
                "per_rank": [dict(rank=r, **row) for r, row in enumerate(per_rank)],
                "strategy_info": prepared.info,
                "comm_per_step": count.summary(cfg.steps),
                "config": {"model": cfg.model},  # what predict.memory_check reads the tensors from
            }
        return {"rank": info.rank, **out} if info.rank == 0 else {"rank": info.rank}


def agreement(cfg=None, *, strategies=COMPARED, **overrides) -> dict:
    """Launch ``agreement_worker`` on ``cfg.nproc`` ranks and return rank 0's comparison (notebook 03).

    ``cfg`` is a ``loop.TrainConfig`` (or its fields as keyword arguments); the strategies
    are names from ``strategies.STRATEGIES``.
    """
    base = asdict(cfg or TrainConfig(strategy=ZERO1.name))  # cfg.strategy is not used: ``strategies`` are
    cfg = TrainConfig(**{**base, **overrides}).validate()
    result = launch(
        agreement_worker,
        nproc=cfg.nproc,
        args=(asdict(cfg), tuple(strategies)),
        backend=cfg.backend,
        timeout_s=cfg.timeout_s,
        echo=False,
    )
    out = result[0]
    out.pop("rank", None)
    return out


# ---------------------------------------------------------------- FSDP2's own defaults, measured (notebook 03)


class _CountAfterTheFirstStep(Observer):
    """The collectives of every forward and backward but the first (``instrument.CommCounter``)."""

    def __init__(self):
        from ..instrument import CommCounter

        self.comm = CommCounter()

    def before_forward(self, step: int) -> None:
        if step:
            self.comm.__enter__()

    def after_backward(self, step: int) -> None:
        if step:
            self.comm.__exit__(None, None, None)


def fsdp2_facts(config: dict) -> dict | None:
    """What FSDP2 (``fully_shard``) does that the hand-built stage 3 does not, measured (collective; notebook 03).

    1. The root unit. Each block gets ``fully_shard`` with the default ``reshard_after_forward=None``
       (True for a non-root module); the root once with the default (None: False for the root, so
       it stays gathered from forward to backward and is not all-gathered again) and once with
       True (as the hand-built ``Zero3Module`` does). Collectives are counted by ``CommCounter``
       over the steps after the first.
    2. Per-parameter sharding. Every parameter becomes a DTensor sharded on dim 0 (no flat
       buffer): the placements, and the local and global shapes of one weight.
    3. Gradient-norm clipping across shards: the global L2 norm of the gradient, computed by
       hand (each rank's sum of squares of its shards, one all-reduce, a square root), by
       ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware), from one rank's shards alone (wrong),
       and by one process on the whole batch (the reference); then the gradient clipped to half that
       norm by ``clip_grad_norm_`` on the shards, gathered whole, against one process's
       ``clip_grad_norm_`` (``clipped_rel_error``), and the mistake of clipping each rank's shards by
       their own norm, against the same reference (``clipped_by_local_norm_rel_error``: it must fail).
    Rank 0 returns the facts; other ranks None.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    cfg = TrainConfig(**config).validate()
    mcfg = get_config(cfg.model)
    with cdist.session() as info:
        mesh = device_mesh(FULL_SHARD, info)
        out = {"comm": {}}
        for root in ("default", "reshard"):
            model = build_model(mcfg, seed=cfg.seed, device=info.device)
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh, **({} if root == "default" else {"reshard_after_forward": True}))
            optimizer = make_optimizer(model.parameters(), cfg)
            prepared = Prepared(model=model, optimizer=optimizer, full_state_dict=dict, held=lambda: ((), (), ()))
            count = _CountAfterTheFirstStep()  # step 0 includes lazy initialisation
            run_steps(prepared, cfg, info, range(cfg.steps), [count])
            out["comm"][root] = count.comm.summary(max(1, cfg.steps - 1))
        # 2. per-parameter sharding, read from the last model
        params = dict(model.named_parameters())
        out["all_dtensor_shard0"] = all(
            isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in params.values()
        )
        name = "blocks.0.attn.qkv.weight"
        out["example"] = {
            "name": name,
            "global": tuple(params[name].shape),
            "local": tuple(params[name].to_local().shape),
        }
        out["root_params"] = sum(p.numel() for n, p in params.items() if not n.startswith("blocks."))
        # 3. clipping across shards, on a fresh model's first gradient
        model = build_model(mcfg, seed=cfg.seed, device=info.device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(
            *batch_for_rank(
                0,
                info.rank,
                info.world_size,
                batch=cfg.batch,
                seq=mcfg.seq,
                vocab=mcfg.vocab,
                seed=cfg.seed,
                device=info.device,
            )
        ).backward()
        grads = [p.grad for p in model.parameters()]
        local_sq = torch.stack([g.to_local().double().pow(2).sum() for g in grads]).sum()
        alone = float(local_sq.sqrt())
        dist.all_reduce(local_sq)
        by_hand = float(local_sq.sqrt())
        by_torch = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
        by_torch = float(by_torch.full_tensor() if isinstance(by_torch, DTensor) else by_torch)
        # clip to half the global norm: torch's clip_grad_norm_ on the DTensor shards, and the mistake a
        # rank makes when it clips by its own shards' norm (its own factor, applied to its own rows only)
        max_norm = by_hand / 2
        local_factors = [None] * info.world_size
        dist.all_gather_object(local_factors, min(1.0, max_norm / (alone + 1e-6)))
        unclipped = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        clipped = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
        if info.rank != 0:
            return None
        ref = build_model(mcfg, seed=cfg.seed, device=info.device)
        x, y = batch_for_rank(
            0, 0, 1, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed, device=info.device
        )
        ref(x, y).backward()
        ref_norm = float(torch.stack([p.grad.double().pow(2).sum() for p in ref.parameters()]).sum().sqrt())
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=ref_norm / 2)  # one process, the reference
        wrong = {n: _scaled_by_rows(g, local_factors) for n, g in unclipped.items()}
        out.update(
            norm_by_hand=by_hand,
            norm_by_torch=by_torch,
            norm_one_rank_alone=alone,
            norm_one_process=ref_norm,
            clipped_rel_error=_worst(clipped, ref) / scale,
            clipped_by_local_norm_rel_error=_worst(wrong, ref) / scale,
        )
        return out


def _scaled_by_rows(full: torch.Tensor, factors: list) -> torch.Tensor:
    """``full`` with rank r's dim-0 rows (FSDP2's layout, ``per_param.shard_rows``) scaled by ``factors[r]``."""
    out = full.clone()
    for r, factor in enumerate(factors):
        lo, hi = shard_rows(full.shape[0], len(factors), r)
        out[lo:hi] *= factor
    return out


def _worst(grads: dict, ref) -> float:
    """Largest |g - g_ref| over every element of every parameter of the reference model ``ref``."""
    return max(float((grads[n] - p.grad.double()).abs().max()) for n, p in ref.named_parameters())


#: The strategies whose step ``timelines`` watches by default: one of each kind of layout and schedule.
TIMELINE_STRATEGIES = tuple(
    s.name for s in (SINGLE, DDP, ZERO1, ZERO2, ZERO3, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD)
)


def timelines_worker(config: dict, names=TIMELINE_STRATEGIES, watch_step: int = 2) -> dict:
    """One step of each strategy watched operation by operation (``timeline.StepTimeline``; notebooks 03, 04).

    Each run builds its model under the timeline (so every storage is known), trains ``watch_step + 1``
    steps through the one loop and watches step ``watch_step`` (DDP rebuilds its buckets after its first
    step, FSDP2 initialises lazily at its first). Returns ``{name: {"timeline": StepTimeline.result(),
    "info": the strategy's report (units, padding), "tensors": parameter tensors}}`` on every rank.
    """
    from dataclasses import replace

    from ..timeline import StepTimeline, TimelineObserver, roles_of

    base = TrainConfig(**config).validate()
    out = {}
    with cdist.session(base.backend if base.backend != "auto" else None) as info:
        for name in names:
            cfg = replace(base, strategy=name, steps=watch_step + 1)
            timeline = StepTimeline(watch_step=watch_step).start()
            try:
                prepared = prepare(cfg, info, get(name))
                timeline.roles = roles_of(prepared)
                run_steps(prepared, cfg, info, range(cfg.steps), [TimelineObserver(timeline)])
            finally:
                timeline.stop()
            report = dict(prepared.info)
            out[name] = {
                "timeline": timeline.result(),
                "info": report,
                "world": info.world_size,
                "watch_step": watch_step,
                "backend": info.backend,  # gloo clones a reduce-scatter's input; NCCL does not (predict.timeline)
            }
            del prepared
    return out


#: The timelines' launch: the tiny model on 2 ranks, whatever the notebook's own parameters (a few seconds).
TIMELINE_RANKS, TIMELINE_MODEL = 2, "tiny"


def timelines(names=TIMELINE_STRATEGIES, *, bucket_cap_mb: float = 25.0) -> dict:
    """One launch of ``timelines_worker`` on ``TIMELINE_RANKS`` ranks of the ``TIMELINE_MODEL``; rank 0's
    ``{name: {"timeline", "info", "world"}}`` plus ``"tensors"`` and the loop's batch and sequence length,
    what ``predict.rest_bytes`` reads (notebooks 03, 04)."""
    cfg = TrainConfig(strategy=DDP.name, nproc=TIMELINE_RANKS, model=TIMELINE_MODEL, bucket_cap_mb=bucket_cap_mb)
    out = launch(timelines_worker, nproc=TIMELINE_RANKS, args=(asdict(cfg), tuple(names)), echo=False)[0]
    mcfg = get_config(TIMELINE_MODEL)
    model = build_model(mcfg)
    params = list(model.parameters())  # the tied head counts once
    facts = {"tensors": len(params), "psi": sum(p.numel() for p in params), "batch": cfg.batch, "seq": mcfg.seq}
    facts["tail_grads"] = tail_numel(model)
    return {name: {**run, **facts} for name, run in out.items()}
