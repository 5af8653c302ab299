"""Notebook 06's experiments: lost work against the checkpoint interval, and two checkpoint pitfalls.

The mechanism they exercise is ``course_utils.checkpoint`` (complete-only DCP checkpoints) and
``course_utils.train`` (the run that resumes); this module only runs and reports.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from .. import checkpoint as ck
from .. import dist as cdist
from ..loop import TrainConfig, prepare, run_steps
from ..train import train


def lost_work_sweep(intervals, *, strategy: str = "ddp", nproc: int = 2, **overrides) -> list[dict]:
    """Measure the steps redone for every failure position, one launch per checkpoint interval K (notebook 06).

    For interval K the run takes 2K steps and loses a rank once per attempt, during steps
    K, K+1, ..., 2K−1 (one residue f mod K each), so the mean over its K restarts is the
    average over a uniformly placed failure. Rows as ``lost_work_row``.
    """
    rows = []
    for k in intervals:
        fail_steps = [k + i for i in range(k)]
        spec = ",".join(f"{i % nproc}:{s}" for i, s in enumerate(fail_steps))
        d = tempfile.mkdtemp(prefix=f"sweep-k{k}-")
        report = train(strategy=strategy, nproc=nproc, steps=2 * k, checkpoint_dir=d, checkpoint_every=k,
                       max_restarts=k, fail_at=spec, **overrides)
        rows.append(ck.lost_work_row(report, k, fail_steps))
        shutil.rmtree(d, ignore_errors=True)
    return rows


def _one_step(config: dict, info):
    """Build the run's model and strategy and train one step in the one loop, so that the optimizer has state."""
    cfg = TrainConfig(**{**config, "nproc": info.world_size}).validate()
    prepared = prepare(cfg, info)
    run_steps(prepared, cfg, info, range(1))
    return prepared


def _local_shapes(prepared) -> dict:
    state = ck.state_of(prepared).get()["model"]
    return {k: list((v.to_local() if hasattr(v, "to_local") else v).shape) for k, v in state.items()}


def rank_named_pitfall(config: dict, folder: str, phase: str) -> dict:
    """Checkpoint files named by rank, saved at one world size and read at another (notebook 06).

    ``phase="save"``: every rank ``torch.save``s its local shards to ``rank<r>.pt`` (the
    tempting mistake), and writes a "full" optimizer state dict taken with
    ``full_state_dict=True, cpu_offload=True`` to ``full_optim_rank<r>.pt`` (gathered to rank 0
    only). ``phase="load"``: rank r reads ``rank<r>.pt`` and compares its shapes with what it
    holds now. Returns what each rank saw.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    with cdist.session() as info:
        prepared = _one_step(config, info)
        mine = Path(folder) / f"rank{info.rank}.pt"
        if phase == "save":
            state = ck.state_of(prepared).get()["model"]
            torch.save({k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in state.items()},
                       mine)
            full = get_optimizer_state_dict(ck._inner(prepared.model), prepared.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            optim_file = Path(folder) / f"full_optim_rank{info.rank}.pt"
            torch.save(full, optim_file)
            return {"rank": info.rank, "wrote": [mine.name, optim_file.name],
                    "optim_entries": len(full.get("state", {})), "optim_file_bytes": optim_file.stat().st_size}
        saved = {k: list(v.shape) for k, v in torch.load(mine).items()}
        needed = _local_shapes(prepared)
        wrong = {k: {"in_file": saved.get(k), "needed": shape} for k, shape in needed.items() if saved.get(k) != shape}
        return {"rank": info.rank, "read": mine.name, "tensors": len(needed), "wrong_shape": len(wrong),
                "example": next(iter(wrong.items()), None)}
