"""Notebook 06's experiments: lost work against the checkpoint interval, what a checkpoint weighs,
the interval trade-off, ``dcp.async_save``, and three checkpoint pitfalls.

The mechanism they exercise is ``course_utils.checkpoint`` (complete-only DCP checkpoints) and
``course_utils.train`` (the run that resumes); this module only runs and reports.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .. import checkpoint as ck
from .. import dist as cdist
from .. import recovery, scratch
from ..loop import TrainConfig, prepare, run_steps
from ..memory import ADAM_MIXED_K, WEIGHT_BYTES
from ..strategies import DDP
from ..train import train


def lost_work_sweep(intervals, *, strategy: str = DDP.name, nproc: int = 2, **overrides) -> list[dict]:
    """Measure the steps redone for every failure position, one launch per checkpoint interval K (notebook 06).

    For interval K the run takes 2K steps and loses a rank once per attempt, during steps
    K, K+1, ..., 2K−1 (one residue f mod K each), so the mean over its K restarts is the
    average over a uniformly placed failure. Rows as ``lost_work_row``.
    """
    rows = []
    for k in intervals:
        fail_steps = [k + i for i in range(k)]
        spec = ",".join(f"{i % nproc}:{s}" for i, s in enumerate(fail_steps))
        d = str(scratch.folder(f"sweep-k{k}-"))
        report = train(
            strategy=strategy,
            nproc=nproc,
            steps=2 * k,
            checkpoint_dir=d,
            checkpoint_every=k,
            max_restarts=k,
            fail_at=spec,
            observe=False,  # a timing run: nothing counted, so the restarts' seconds are the run's own
            **overrides,
        )
        rows.append(recovery.lost_work_row(report, k, fail_steps))
        shutil.rmtree(d, ignore_errors=True)
    return rows


def time_lost_by_interval(rows: list[dict]) -> list[dict]:
    """Wall-clock time lost per failure, per checkpoint interval K, from ``lost_work_row`` rows (notebook 06).

    Rows with the same K are pooled. Each row: ``{"every", "failures", "redone" (mean completed steps
    redone), "restart_s", "redo_s", "lost_s" (means, seconds)}``; what was measured is
    ``recovery.time_lost_per_restart``.
    """
    pooled: dict[int, list] = {}
    for r in rows:
        pooled.setdefault(r["every"], []).extend(t for t in r["time_lost"] if t is not None)
    out = []
    for k in sorted(pooled):
        ts = pooled[k]
        mean = {f: sum(t[f] for t in ts) / len(ts) for f in ("redone", "restart_s", "redo_s", "lost_s")}
        out.append({"every": k, "failures": len(ts), **mean})
    return out


# ---------------------------------------------------------------- what a checkpoint weighs


def checkpoint_bytes(psi: float, *, with_16bit_copy: bool = False) -> float:
    """Bytes of a mixed-precision Adam checkpoint of Ψ parameters (notebook 06).

    What training needs to continue: the fp32 weights and Adam's two fp32 moments, K = 12 bytes
    per parameter (``memory.ADAM_MIXED_K``); the 16-bit working copy can be rebuilt from the fp32
    weights (14Ψ if it is saved too); gradients are recomputed by the next step and never saved.
    So 12Ψ, not the 16Ψ of the training bill.
    """
    return psi * (ADAM_MIXED_K + (WEIGHT_BYTES if with_16bit_copy else 0))


def folder_bytes(path) -> dict:
    """Bytes on disk of one DCP checkpoint folder, by kind (notebook 06).

    ``{"data": the *.distcp files, "metadata": DCP's .metadata index, "marker": commit.json,
    "files": how many data files}``.
    """
    path = Path(path)
    data = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return {
        "data": sum(p.stat().st_size for p in data),
        "files": len(data),
        "metadata": (path / ck.METADATA).stat().st_size,
        "marker": (path / ck.COMMIT).stat().st_size if (path / ck.COMMIT).exists() else 0,
    }


def checkpoint_breakdown(root, step: int) -> dict:
    """What one complete checkpoint holds, from DCP's own index, against its bytes on disk (notebook 06).

    Tensor bytes by kind, read from ``.metadata`` (each tensor's global size and dtype): ``weights``
    (``model.*``), ``moments`` (Adam's ``exp_avg`` and ``exp_avg_sq``), ``other`` (step counters,
    each rank's RNG state and data position); ``items``: entries stored; ``data``: the bytes of the
    ``*.distcp`` files, so ``data - tensors`` is the serialization's framing.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = ck.step_dir(root, step)
    meta = ck.read_index(root, step)  # DCP's index, read without running what it names
    kinds = {"weights": 0, "moments": 0, "other": 0}
    for key, item in meta.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue  # small Python values (learning rate, betas): framing, not tensors
        kind = "weights" if key.startswith("model.") else "moments" if ".exp_avg" in key else "other"
        kinds[kind] += math.prod(item.size) * item.properties.dtype.itemsize
    on_disk = folder_bytes(folder)
    tensors = sum(kinds.values())
    return {
        **kinds,
        "tensors": tensors,
        "items": len(meta.storage_data),
        "data": on_disk["data"],
        "files": on_disk["files"],
        "framing": on_disk["data"] - tensors,
        "metadata": on_disk["metadata"],
    }


# ---------------------------------------------------------------- the interval trade-off


def checkpoint_overhead(k, *, step_s: float, save_s: float, mtbf_s: float, restart_s: float):
    """Seconds lost per training step when saving every K steps (notebook 06; first-order, as Young 1974).

    ``save_s / K``: each save blocks training for ``save_s``, once per K steps. ``step_s / mtbf_s``
    failures per step, each costing ``restart_s`` plus half an interval of work, ``K·step_s/2``
    (the completed steps since the last save and the step in flight). Works on arrays of K.
    """
    k = np.asarray(k, dtype=float)
    return save_s / k + (step_s / mtbf_s) * (restart_s + k * step_s / 2)


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval, √(2·C·MTBF) seconds of training (notebook 06).

    Setting the derivative of ``checkpoint_overhead`` to zero: C/K² = step_s²/(2·MTBF), so
    K·step_s = √(2·C·MTBF) (J. W. Young, CACM 1974).
    """
    return math.sqrt(2 * save_s * mtbf_s)


def interval_tradeoff(
    *,
    psi: float,
    gpus: int,
    write_gb_s: float,
    mtbf_s: float,
    restart_s: float,
    step_s: float,
    with_16bit_copy: bool = False,
    points: int = 400,
) -> dict:
    """The overhead curve against K for one job, and its minimum (notebook 06).

    The save cost is the checkpoint's bytes (``checkpoint_bytes``) over the storage's aggregate
    write bandwidth (``write_gb_s``, GB/s), all ranks writing their shards at once. Returns the
    inputs, ``save_s``, ``bytes``, the curve (``k``, ``overhead_s``), the grid's minimum
    (``k_best``) and Young's interval in steps (``k_young``), and the overhead at the optimum as a
    fraction of the step.
    """
    nbytes = checkpoint_bytes(psi, with_16bit_copy=with_16bit_copy)
    save_s = nbytes / (write_gb_s * 1e9)
    k_young = young_interval_s(save_s, mtbf_s) / step_s
    ks = np.geomspace(max(1.0, k_young / 30), k_young * 30, points)
    cost = dict(step_s=step_s, save_s=save_s, mtbf_s=mtbf_s, restart_s=restart_s)
    overhead = checkpoint_overhead(ks, **cost)
    best = int(np.argmin(overhead))
    return {
        "psi": psi,
        "gpus": gpus,
        "write_gb_s": write_gb_s,
        "mtbf_s": mtbf_s,
        "restart_s": restart_s,
        "step_s": step_s,
        "bytes": nbytes,
        "save_s": save_s,
        "k": ks,
        "overhead_s": overhead,
        "k_best": float(ks[best]),
        "k_young": k_young,
        "overhead_at_best": float(checkpoint_overhead(k_young, **cost)) / step_s,
    }


# ---------------------------------------------------------------- dcp.async_save, and a torn checkpoint


def _trained_more(net, opt, model: str, step: int, seed: int = 0) -> None:
    """One AdamW step of the course model on step ``step``'s batch of the course's data (one process, the one loop)."""
    from ..loop import Prepared, TrainConfig, one_process, run_steps

    prepared = Prepared(model=net, optimizer=opt, full_state_dict=net.state_dict, held=lambda: ((), (), ()))
    run_steps(prepared, TrainConfig(model=model, batch=8, seed=seed), one_process(), range(step, step + 1))


def _trained(model: str = "tiny", steps: int = 1, seed: int = 0):
    """The course model and AdamW after ``steps`` steps, in this process."""
    from ..models import build_model

    net = build_model(model, seed=seed)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for step in range(steps):
        _trained_more(net, opt, model, step, seed)
    return net, opt


def _named_state(net, opt) -> dict:
    """Weights, Adam's two moments by parameter name, and the step: what a resume needs (copies)."""
    names = {id(p): n for n, p in net.named_parameters()}
    moments = {
        f"{key}.{names[id(p)]}": st[key].detach().clone()
        for p, st in opt.state.items()
        for key in ("exp_avg", "exp_avg_sq")
    }
    step = int(next(iter(opt.state.values()))["step"]) if opt.state else 0
    return {
        "model": {n: t.detach().clone() for n, t in net.state_dict().items()},
        "optim": moments,
        "step": torch.tensor(step),
    }


def _digest(tensors: dict) -> str:
    from ..instrument import weights_sha256

    return weights_sha256(tensors)


def async_save_demo(folder, model: str = "tiny", repeats: int = 3) -> dict:
    """``dcp.save`` against ``dcp.async_save`` in this process, training going on during the write (notebook 06).

    The state after one step is saved both ways. ``async_save`` (torch 2.13) stages the state (a
    copy in CPU memory), starts the write in a thread and returns a future; meanwhile this function
    takes another optimizer step on the live tensors, then loads the async folder back: it must hold
    the state at the call, not the one after. That first save of each kind pays the one-time costs
    (planner, stager, thread) and is not timed; each time is then the median of ``repeats`` calls,
    the async future collected at once (its time: the staging and the write, nothing else running).
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    net, opt = _trained(model, steps=1)
    live = {"model": net.state_dict(), "optim": opt.state_dict()}  # the live tensors, not copies
    at_call = _digest(net.state_dict())
    sync, blocked, done = [], [], []
    with warnings.catch_warnings():  # "no process group: saving in a single process" is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(live, checkpoint_id=str(folder / "warm-up"))
        future = dcp.async_save(live, checkpoint_id=str(folder / "async"))
        _trained_more(net, opt, model, step=1)  # the next step, on the tensors being saved
        after = _digest(net.state_dict())
        future.result()
        for i in range(repeats):
            t0 = time.perf_counter()
            dcp.save(live, checkpoint_id=str(folder / f"sync-{i}"))
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            future = dcp.async_save(live, checkpoint_id=str(folder / f"async-{i}"))
            blocked.append(time.perf_counter() - t0)
            future.result()
            done.append(time.perf_counter() - t0)
        back = {"model": _trained(model, steps=0)[0].state_dict()}
        dcp.load(back, checkpoint_id=str(folder / "async"))
    return {
        "sync_s": float(np.median(sync)),
        "async_blocked_s": float(np.median(blocked)),
        "async_future_s": float(np.median(done)),
        "digest_at_call": at_call,
        "digest_after_next_step": after,
        "digest_loaded": _digest(back["model"]),
        "bytes": folder_bytes(folder / "async")["data"],
    }


def torn_by_reused_folder(folder, model: str = "tiny") -> dict:
    """Re-save into an existing DCP folder, die before the commit, load: no error, a mixture (notebook 06).

    The state after step 1 is saved to ``folder`` with one file per tensor
    (``single_file_per_rank=False``: like many ranks' files, each written on its own). The state
    after step 2 is then saved into the same folder by a writer that writes the weights' files and
    dies before the rest, so DCP's ``finish`` never rewrites ``.metadata``. The old index still
    names every file, and ``dcp.load`` reads the new weights beside the old moments and step.
    Returns, for each part, whether what was loaded equals the old save's or the new one's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    class DiesAfterTheWeights(FileSystemWriter):
        def write_data(self, plan, planner):
            weights = [item for item in plan.items if item.index.fqn.startswith("model.")]
            super().write_data(replace(plan, items=weights), planner).wait()
            raise RuntimeError("died while saving, after the weights' files (simulated)")

    folder = Path(folder)
    net, opt = _trained(model, steps=1)
    old = _named_state(net, opt)
    _trained_more(net, opt, model, step=1)
    new = _named_state(net, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(old, storage_writer=FileSystemWriter(folder, single_file_per_rank=False, sync_files=False))
        index_before = (folder / ck.METADATA).read_bytes()
        try:
            dcp.save(new, storage_writer=DiesAfterTheWeights(folder, single_file_per_rank=False, sync_files=False))
            died = None
        except CheckpointException as exc:  # DCP gathers every rank's error into one (a BaseException)
            died = type(exc).__name__
        index_unchanged = (folder / ck.METADATA).read_bytes() == index_before
        back = {part: {k: torch.zeros_like(v) for k, v in old[part].items()} for part in ("model", "optim")}
        back["step"] = torch.tensor(-1)  # the keys and shapes to load into; every value is overwritten
        dcp.load(back, checkpoint_id=str(folder))

    def same(a, b, part):
        return int(a[part]) == int(b[part]) if part == "step" else _digest(a[part]) == _digest(b[part])

    return {
        "died": died,
        "index_unchanged": index_unchanged,
        "steps_saved": [int(old["step"]), int(new["step"])],
        "parts": {
            part: {"old": same(back, old, part), "new": same(back, new, part)} for part in ("model", "optim", "step")
        },
    }


def _one_step(config: dict, info):
    """Build the run's model and strategy and train one step in the one loop, so that the optimizer has state."""
    cfg = TrainConfig(**{**config, "nproc": info.world_size}).validate()
    prepared = prepare(cfg, info)
    run_steps(prepared, cfg, info, range(1))
    return prepared


def _local_shapes(prepared) -> dict:
    state = ck.state_of(prepared).get()["model"]
    return {k: list((v.to_local() if hasattr(v, "to_local") else v).shape) for k, v in state.items()}


def _pitfall_phase(config: dict, folder: str, phase: str, info) -> dict:
    """Checkpoint files named by rank, saved at one world size and read at another (notebook 06).

    ``phase="save"``: every rank ``torch.save``s its local shards to ``rank<r>.pt`` (the
    tempting mistake), and writes a "full" optimizer state dict taken with
    ``full_state_dict=True, cpu_offload=True`` to ``full_optim_rank<r>.pt`` (gathered to rank 0
    only). ``phase="load"``: rank r reads ``rank<r>.pt`` and compares its shapes with what it
    holds now. Returns what each rank saw.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    prepared = _one_step(config, info)
    mine = Path(folder) / f"rank{info.rank}.pt"
    if phase == "save":
        state = ck.state_of(prepared).get()["model"]
        torch.save(
            {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in state.items()}, mine
        )
        full = get_optimizer_state_dict(
            ck._inner(prepared.model),
            prepared.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        optim_file = Path(folder) / f"full_optim_rank{info.rank}.pt"
        torch.save(full, optim_file)
        return {
            "rank": info.rank,
            "wrote": [mine.name, optim_file.name],
            "optim_entries": len(full.get("state", {})),
            "optim_file_bytes": optim_file.stat().st_size,
        }
    saved = {k: list(v.shape) for k, v in torch.load(mine).items()}
    needed = _local_shapes(prepared)
    wrong = {k: {"in_file": saved.get(k), "needed": shape} for k, shape in needed.items() if saved.get(k) != shape}
    return {
        "rank": info.rank,
        "read": mine.name,
        "tensors": len(needed),
        "wrong_shape": len(wrong),
        "example": next(iter(wrong.items()), None),
    }


def runs_in_one_group(configs: list, pitfall: tuple | None = None) -> dict:
    """Several training runs, then optionally a phase of the rank-named pitfall, in ONE process group (notebook 06).

    Starting a group (processes, imports, rendezvous) costs seconds; a run of the course model well
    under one. Each config is a ``TrainConfig`` dict; a run with a ``checkpoint_dir`` resumes from
    its newest complete checkpoint and saves, exactly as under ``train`` (no failures: a failure
    needs a restart of its own). No run counts bytes (``train(observe=False)``): notebook 06 compares
    weights and losses. ``pitfall``: ``(config, folder, phase)``. Every rank returns
    ``{"reports": [...] (rank 0's are the reports, in order), "pitfall": its row or None}``.
    """
    from ..train import run_training

    with cdist.session() as info:
        reports = [run_training(TrainConfig(**c).validate(), info, observe=False) for c in configs]
        row = _pitfall_phase(*pitfall, info) if pitfall else None
    return {"reports": reports, "pitfall": row}
