"""Notebook 04's experiments: the four FSDP strategies measured side by side, tuning, state dicts.

Each run is the one loop (``loop.run_steps``) with the observers the notebook reads (bytes
held, collectives and their groups, peak gathered bytes, an optional CommDebugMode count, step
time); many runs share one launch (``run_experiments``). The mechanism they measure is
``course_utils.fsdp``; the predictions they are held against are ``predict.fsdp_run``; the tables
that show the rows are views (``plots.fsdp_table``, ``plots.fsdp_side_by_side_table``).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import dist as cdist
from ..fsdp import full_state_dict_via_dtensor
from ..instrument import CountCollectives, HeldAtRest, Observer, StepTimer, weight_diff, weights_sha256
from ..loop import Prepared, TrainConfig, full_state_dict, prepare, run_steps
from ..models import build_model
from ..predict.runs import _meta_model
from ..strategies import FULL_SHARD, get


def bit_identical_groups(rows: list) -> list[list[str]]:
    """The runs' labels grouped by their final weights, bit for bit (``weights_sha256``), in run order (notebook 04).

    Runs without weights (the state-dict report) are left out. Two runs land in one group only if
    every final fp32 weight is the same bit pattern: the same numbers added in the same order.
    """
    groups: dict[str, list[str]] = {}
    for row in rows:
        if row.get("weights_sha256"):
            groups.setdefault(row["weights_sha256"], []).append(row["label"])
    return list(groups.values())


#: Keys of a run description that are not ``TrainConfig`` fields.
RUN_KEYS = ("label", "sync_every_step", "cross_check", "kind", "run_dir", "reuse")


def _comm_debug_summary(counts: dict, steps: int) -> dict:
    kinds = {
        "_allgather_base_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "allreduce_": "all_reduce",
        "allreduce_coalesced_": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }
    out: dict = {}
    for op, calls in counts.items():
        kind = kinds.get(str(op).split(".")[-1])
        if kind:
            out[kind] = out.get(kind, 0) + calls / steps
    return dict(sorted(out.items()))


def run_one(
    cfg: TrainConfig, info, *, sync_every_step: bool = True, cross_check: bool = False, keep: list | None = None
) -> dict:
    """Train one configuration on the ranks of an open session and measure it (notebook 04).

    The one loop (``loop.run_steps``: same model, data, optimizer, strategy function), with
    the observers the FSDP notebook adds: peak gathered bytes on every rank, the group size of
    every collective, ``torch.cuda.max_memory_allocated`` on a GPU, an optional CommDebugMode
    count (``cross_check``), and ``sync_every_step``: read the loss with ``.item()`` every step
    (the forced synchronisation of the overlap section) or only once at the end.
    ``step_time_s`` is the time per step after step 0 (``instrument.StepTimer``); on a GPU it
    comes from a second run of the same steps without counting observers (they would make the
    step CPU-bound), on the CPU from the counted run. Strategy "single" runs on rank 0 only (the
    one-process reference, whole global batch) with this rank's CPU threads; the other ranks
    wait. (A one-process ``train`` gets all the cores, and more threads add up a matmul in a
    different order: the two agree within ``TOLERANCE``, not bit for bit.) Returns rank 0's
    row (other ranks: None). ``keep``: a list the trained ``Prepared`` is appended to, for a later
    run of the same launch that goes on from it (``state_dict_round_trip``).
    """
    single = get(cfg.strategy).single_process
    if single and info.rank != 0:
        return None
    rank, world = (0, 1) if single else (info.rank, info.world_size)
    return _run_one(cfg, info, rank, world, single, sync_every_step, cross_check, keep)


class _SyncEveryStep(Observer):
    """Read the loss with ``.item()`` after every step: the host waits for the device (notebook 04's anti-pattern)."""

    def after_step(self, step: int, losses: list) -> None:
        losses[-1].item()


class _CommDebugCounts(Observer):
    """torch's ``CommDebugMode`` around each step, forward to optimizer step: a cross-check of ``CommCounter``."""

    def __init__(self):
        from torch.distributed.tensor.debug import CommDebugMode  # pulls in torch._dynamo: only when asked

        self.mode_class, self.counts, self.mode = CommDebugMode, {}, None

    def before_forward(self, step: int) -> None:
        self.mode = self.mode_class()  # it tracks modules too: one forward and backward per entry
        self.mode.__enter__()

    def after_update(self, step: int) -> None:
        self.mode.__exit__(None, None, None)
        for op, calls in self.mode.get_comm_counts().items():
            self.counts[op] = self.counts.get(op, 0) + calls


def _timed_only(cfg, info, rank, world, sync_every_step) -> float:
    """Seconds per step of the same run with no counting observer: the timing run (GPU)."""
    prepared = prepare(cfg, info)
    timer = StepTimer(info.device, skip=min(1, cfg.steps - 1))
    run_steps(
        prepared, cfg, info, range(cfg.steps), [_SyncEveryStep()] * sync_every_step + [timer], rank=rank, world=world
    )
    return timer.seconds_per_step()


def _run_one(cfg, info, rank, world, single, sync_every_step, cross_check, keep=None):
    prepared = prepare(cfg, info)
    if keep is not None:
        keep.append(prepared)
    count = CountCollectives(node_size=cfg.node_size)  # counted like train_worker
    held = HeldAtRest(prepared.held, at=cfg.steps - 1, also={"where": held_by_device})
    timer = StepTimer(info.device, skip=min(1, cfg.steps - 1))
    debug = _CommDebugCounts() if cross_check else None
    observers = [count, held, *prepared.observers, *[debug] * cross_check, *[_SyncEveryStep()] * sync_every_step, timer]
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    losses = torch.stack(run_steps(prepared, cfg, info, range(cfg.steps), observers, rank=rank, world=world)).float()
    step_time_s = timer.seconds_per_step()
    if info.device.type == "cuda":  # counting observers make a GPU step CPU-bound: time a second, bare run
        step_time_s = _timed_only(cfg, info, rank, world, sync_every_step)
    if not single:
        dist.all_reduce(losses)  # equal per-rank batches: the mean of rank means is the global mean
        losses /= world
    full = prepared.full_state_dict()
    mine = {
        "rank": rank,
        **held.bytes,
        "where": held.extra["where"],
        "peak_unsharded_bytes": prepared.info.get("peak_unsharded_bytes"),
        "max_memory_allocated": torch.cuda.max_memory_allocated(info.device) if info.device.type == "cuda" else None,
        "step_time_s": step_time_s,
    }
    everyone = [mine]
    if not single:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if info.rank != 0:
        return None
    return {
        "strategy": cfg.strategy,
        "world_size": world,
        "device": info.device.type,
        "options": dict(cfg.options),
        "precision": cfg.precision,
        "losses": losses.cpu().tolist(),
        "weights_sha256": weights_sha256(full),
        "full_state_dict": {k: v.detach().to("cpu", torch.float32) for k, v in full.items()},
        "per_rank": [{k: row[k] for k in ("rank", "params", "grads", "optim", "steps", "total")} for row in everyone],
        "held_by_device": everyone[0]["where"],
        "comm_per_step": count.summary(cfg.steps),
        "comm_groups": count.groups(),
        "comm_debug_per_step": _comm_debug_summary(debug.counts, cfg.steps) if cross_check else None,
        "peak_unsharded_bytes": [row["peak_unsharded_bytes"] for row in everyone],
        "max_memory_allocated": [row["max_memory_allocated"] for row in everyone],
        "step_time_s": max(row["step_time_s"] for row in everyone),
        "sync_every_step": sync_every_step,
        "strategy_info": {k: v for k, v in prepared.info.items() if k != "peak_unsharded_bytes"},
        "config": asdict(cfg),
    }


def held_by_device(params, grads, optim) -> dict:
    """Bytes held at rest by device type: ``{"cpu": ..., "cuda": ...}`` (what CPU offload moves) (notebook 04)."""
    from ..instrument import tensor_bytes

    out: dict = {}
    for t in [*params, *grads, *optim]:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            out[local.device.type] = out.get(local.device.type, 0) + tensor_bytes([t])
    return out


#: How close a run must end to the one-process reference (notebook 04). In fp32 the only
#: difference is the order of additions: N ranks each sum their part of the batch and the parts
#: are then summed, so gradients differ in their last bits (relative ~1e-7), and Adam, which
#: divides each gradient by its own running RMS, passes such differences on to the weights
#: even where the gradient itself is tiny. The limits sit a decade or more above what fp32
#: reordering gives here and a decade or more below what a real change of arithmetic gives
#: (bf16 working weights, the "mixed" row of the notebook): relative loss difference per step,
#: and ‖w − w_single‖ / ‖w_single‖ over all final weights.
TOLERANCE = {"fp32": {"loss_rel": 1e-6, "weight_rel": 1e-4}, "mixed": {"loss_rel": 1e-3, "weight_rel": 3e-2}}


def trains_like_single(row: dict) -> bool:
    """True if a run's losses and final weights are within ``TOLERANCE`` of the reference's (notebook 04)."""
    tol = TOLERANCE[row.get("precision", "fp32")]
    return row["max_loss_rel_diff"] <= tol["loss_rel"] and row["rel_weight_diff"] <= tol["weight_rel"]


def experiments_worker(runs: list[dict]) -> list[dict] | None:
    """Run several configurations in one launch; rank 0 returns one row per run (notebook 04).

    Each run is a dict of ``TrainConfig`` fields plus ``label``, ``sync_every_step`` and
    ``cross_check`` (see ``run_one``); a run with ``kind="state_dict"`` and a ``run_dir`` runs
    ``state_dict_round_trip`` instead and its row is that report; with ``reuse=(label, fsdp1_label)`` it goes on from
    the models those two earlier runs trained (the same ``TrainConfig``, the second with ``{"api": "fsdp1"}``)
    instead of building and training two of its own. If a "single" run comes first, every later row gets
    ``max_weight_diff``, ``rel_weight_diff`` (``weight_diff`` of the full fp32 weights, on rank 0)
    and ``max_loss_rel_diff`` (largest relative difference of a step's loss) against it.
    """
    rows, reference = [], None
    wanted = {label for run in runs for label in run.get("reuse", ())}
    trained: dict = {}  # label -> (TrainConfig, Prepared) of the runs a later run goes on from
    with cdist.session() as info:
        for i, run in enumerate(runs):
            extra = {k: run[k] for k in RUN_KEYS if k in run}
            cfg = TrainConfig(**{k: v for k, v in run.items() if k not in RUN_KEYS})
            single = get(cfg.strategy).single_process
            cfg.nproc = 1 if single else info.world_size
            cfg.validate()
            label = extra.get("label", cfg.strategy)
            if extra.get("kind") == "state_dict":
                Path(extra["run_dir"]).mkdir(parents=True, exist_ok=True)
                row = state_dict_round_trip(cfg, info, extra["run_dir"], *_reused(cfg, extra.get("reuse"), trained))
            else:
                keep = [] if label in wanted else None
                row = run_one(
                    cfg,
                    info,
                    sync_every_step=extra.get("sync_every_step", True),
                    cross_check=extra.get("cross_check", False),
                    keep=keep,
                )
                if keep:
                    trained[label] = (cfg, keep[0])
            cdist.report_progress(i + 1, len(runs), run=label)
            if info.rank != 0:
                continue
            row["label"] = label
            if single and reference is None:
                reference = row
            if reference is not None and "full_state_dict" in row:
                diff = weight_diff(row["full_state_dict"], reference["full_state_dict"])
                row["max_weight_diff"], row["rel_weight_diff"] = diff["max_abs"], diff["relative"]
                row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], reference["losses"]))
            rows.append(row)
        dist.barrier()
    if info.rank != 0:
        return None
    for row in rows:
        row.pop("full_state_dict", None)
    return rows


def _reused(cfg: TrainConfig, labels, trained: dict) -> tuple:
    """The two trained ``Prepared`` a state-dict run goes on from, checked to be the runs it would train itself."""
    if not labels:
        return ()
    fsdp1_cfg = replace(cfg, options={**cfg.options, "api": "fsdp1"})
    out = []
    for label, expected in zip(labels, (cfg, fsdp1_cfg)):
        if label not in trained:
            raise ValueError(f"the state-dict run reuses {label!r}: list that run before it, in the same launch")
        if trained[label][0] != expected:
            raise ValueError(
                f"run {label!r} is not the state-dict run's configuration: {trained[label][0]} != {expected}"
            )
        out.append(trained.pop(label)[1])
    return tuple(out)


def run_experiments(runs: list[dict], *, nproc: int, backend: str = "auto", timeout_s: float = 300.0) -> list[dict]:
    """Launch ``experiments_worker`` once on ``nproc`` processes and return its rows (notebook 04).

    Every run is validated here first, so a bad setting fails before anything starts.
    """
    from ..launch import launch

    for run in runs:  # the options are checked too (``TrainConfig.validate``: the row's knobs)
        fields = {k: v for k, v in run.items() if k not in RUN_KEYS}
        single = get(fields.get("strategy", TrainConfig.strategy)).single_process
        TrainConfig(**{**fields, "nproc": 1 if single else nproc}).validate()
    result = launch(
        experiments_worker, nproc=nproc, args=(list(runs),), backend=backend, timeout_s=timeout_s, echo=False
    )
    return result[0]


def _train_steps(prepared, cfg: TrainConfig, info, steps: range) -> list[float]:
    return [float(loss) for loss in run_steps(prepared, cfg, info, steps)]


def _fresh(cfg: TrainConfig, info, strategy: str, seed_offset: int = 1) -> Prepared:
    """A newly sharded model with *different* weights, so that a load that did nothing is caught."""
    return prepare(replace(cfg, strategy=strategy, seed=cfg.seed + seed_offset), info)


def _optimizer_locals(optimizer) -> list[torch.Tensor]:
    out = []
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        for key in sorted(optimizer.state[p]):
            v = optimizer.state[p][key]
            out.append((v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone())
    return out


def _files(folder: Path) -> list[dict]:
    return [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(folder.iterdir()) if f.is_file()]


def state_dict_round_trip(
    cfg: TrainConfig, info, run_dir: str, trained: Prepared | None = None, trained_fsdp1: Prepared | None = None
) -> dict:
    """Save and load FSDP state three ways, on every rank of an open session; rank 0 reports (notebook 04).

    1. Full state dict: ``get_model_state_dict(full_state_dict=True)`` against ``full_tensor()``
       on each DTensor; rank 0 saves it (``torch.save``); a plain unsharded model and a freshly
       sharded one load it (``set_model_state_dict(broadcast_from_rank0=True)``).
    2. Sharded checkpoint: ``get_state_dict`` + ``torch.distributed.checkpoint.save`` (each rank
       writes its own shards, rank 0 the ``.metadata``), then ``dcp.load`` + ``set_state_dict``
       into a fresh model and optimizer; one more step on both must agree bit for bit.
    3. FSDP1's ``full_optim_state_dict(rank0_only=True)``: every rank writes what it got to a
       file; only rank 0's holds the optimizer state. The new API's ``cpu_offload=True`` does
       the same.

    ``cfg.strategy`` is the FSDP2 strategy trained for ``cfg.steps`` steps. Files go under
    ``run_dir`` only (a fresh folder per call: DCP must never reuse one). ``trained`` and
    ``trained_fsdp1``: that run, and the same with FSDP1, already trained in this launch (notebook 04's
    runs of section 2 and 3); otherwise both are built and trained here.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    root = Path(run_dir)
    out: dict = {"world_size": info.world_size, "run_dir": str(root)}
    prepared = trained
    if prepared is None:
        prepared = prepare(cfg, info)
        _train_steps(prepared, cfg, info, range(cfg.steps))
    model, optimizer = prepared.model, prepared.optimizer

    # 1. the full state dict, two ways, and loading it back
    via_api, via_dtensor = full_state_dict(model), full_state_dict_via_dtensor(model)
    out["full_keys_match_model"] = sorted(via_api) == sorted(_meta_model(cfg.model).state_dict())
    out["full_dtensor_equals_api"] = all(torch.equal(via_api[k], via_dtensor[k]) for k in via_api)
    out["trained_sha"] = weights_sha256(via_api)
    full_path = root / "full_state_dict.pt"
    if info.rank == 0:
        torch.save({k: v.cpu() for k, v in via_api.items()}, full_path)
    dist.barrier()
    if info.rank == 0:
        plain = build_model(cfg.model, seed=cfg.seed + 1)
        plain.load_state_dict(torch.load(full_path, weights_only=True))
        out["full_into_plain_sha"] = weights_sha256(plain.state_dict())
        out["full_file_bytes"] = full_path.stat().st_size
    fresh = _fresh(cfg, info, cfg.strategy)
    out["fresh_sha_before_load"] = weights_sha256(full_state_dict(fresh.model))
    loaded = torch.load(full_path, weights_only=True) if info.rank == 0 else {}
    set_model_state_dict(fresh.model, loaded, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["full_into_sharded_sha"] = weights_sha256(full_state_dict(fresh.model))

    # 2. the sharded checkpoint (DCP), into a fresh model and optimizer, then one more step on both
    ckpt = root / f"dcp-step-{cfg.steps}"
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
    resumed = _fresh(cfg, info, cfg.strategy, seed_offset=2)
    msd2, osd2 = get_state_dict(resumed.model, resumed.optimizer)  # creates the optimizer state to load into
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ckpt))
    set_state_dict(resumed.model, resumed.optimizer, model_state_dict=msd2, optim_state_dict=osd2)
    out["dcp_files"] = _files(ckpt) if info.rank == 0 else None
    out["dcp_weights_equal"] = weights_sha256(full_state_dict(resumed.model)) == out["trained_sha"]
    mine = [torch.equal(a, b) for a, b in zip(_optimizer_locals(optimizer), _optimizer_locals(resumed.optimizer))]
    flags = [None] * info.world_size
    dist.all_gather_object(flags, bool(mine) and all(mine))
    out["dcp_optimizer_equal"] = all(flags)
    nxt = range(cfg.steps, cfg.steps + 1)
    out["next_loss_original"] = _train_steps(prepared, cfg, info, nxt)
    out["next_loss_resumed"] = _train_steps(resumed, cfg, info, nxt)
    out["next_step_equal"] = weights_sha256(full_state_dict(model)) == weights_sha256(full_state_dict(resumed.model))

    # 3. FSDP1: full_optim_state_dict(rank0_only=True), written by every rank
    old = trained_fsdp1
    if old is None:
        old = _fresh(TrainConfig(**{**asdict(cfg), "options": {"api": "fsdp1"}}), info, FULL_SHARD.name, seed_offset=0)
        _train_steps(old, cfg, info, range(cfg.steps))
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        osd_old = FullyShardedDataParallel.full_optim_state_dict(old.model, old.optimizer, rank0_only=True)
    path = root / f"optim_full_rank{info.rank}.pt"
    torch.save(osd_old, path)
    osd_new = get_optimizer_state_dict(
        old.model, old.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    mine = {
        "rank": info.rank,
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "params_with_state": len(torch.load(path, weights_only=True).get("state", {})),
        "new_api_params_with_state": len(osd_new.get("state", {})),
    }
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    out["rank0_only_files"] = everyone
    dist.barrier()
    return out


def division_or_order(draws: int = 100_000, seed: int = 0) -> dict:
    """What makes two reductions of the same four fp32 gradients differ in their bits (notebook 04).

    FSDP1 divides each gradient by 2 before the sum and by 2 after it (on 4 ranks,
    ``_gradient_predivide_factor`` and ``_gradient_postdivide_factor``); FSDP2 sums, then divides by 4
    (``ReduceOp.AVG``, which gloo runs as SUM then a division). Dividing by 2 only lowers the exponent,
    so ``(Σ x/2)/2 == (Σ x)/4`` bit for bit whatever the order of the sum (short of underflow). The
    order is what changes bits: which rank's chunk of gloo's ring an element falls in decides the
    order its four values are added in, and FSDP1's flat buffer and FSDP2's per-parameter rows put
    the same element in different chunks. Returns ``draws``, ``division_mismatches`` (over all 24
    orders of the four operands) and ``order_changes`` (the fraction of sums that change when only
    the order changes). Operands are log-normal in magnitude, like gradients.
    """
    import itertools

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(draws, generator=g) * torch.exp(torch.randn(draws, generator=g) * 3) for _ in range(4)]

    def fold(order, values):
        total = values[order[0]].clone()
        for i in order[1:]:
            total += values[i]
        return total

    halves = [x / 2 for x in xs]
    mismatches = sum(int((fold(p, halves) / 2 != fold(p, xs) / 4).sum()) for p in itertools.permutations(range(4)))
    changed = float((fold((0, 1, 2, 3), xs) != fold((1, 2, 3, 0), xs)).float().mean())
    return {"draws": draws, "division_mismatches": mismatches, "order_changes": changed}
