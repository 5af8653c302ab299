"""Small worker functions the notebooks launch to show how runs behave (notebook 00).

They live in a module, not in a notebook cell, because worker processes must be able to
import the function they run.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from . import dist as cdist


def all_reduce_demo(n: int = 4) -> dict:
    """Every rank contributes ``rank + 1`` in each of ``n`` slots; all-reduce sums them (notebook 00).

    After the call every rank holds ``1 + 2 + ... + N = N(N+1)/2`` in every slot.
    """
    with cdist.session() as info:
        x = torch.full((n,), float(info.rank + 1), device=info.device)
        dist.all_reduce(x)  # default op: SUM
        return {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                "device": str(info.device), "pid": os.getpid(), "result": x.cpu().tolist()}


def fail_on_rank(bad_rank: int = 1) -> int:
    """Rank ``bad_rank`` raises; the others wait in a barrier it never reaches (notebook 00)."""
    with cdist.session() as info:
        if info.rank == bad_rank:
            raise RuntimeError(f"rank {info.rank} fails on purpose to show how errors surface")
        dist.barrier()
        return info.rank


def hang_on_rank(stuck_rank: int = 1, seconds: float = 3600.0) -> int:
    """Rank ``stuck_rank`` never joins the all-reduce; the others' collective times out (notebook 00)."""
    with cdist.session() as info:
        if info.rank == stuck_rank:
            time.sleep(seconds)
        x = torch.ones(1, device=info.device)
        dist.all_reduce(x)
        return info.rank


def count_with_progress(steps: int = 10, delay_s: float = 0.3) -> int:
    """A slow loop that reports its progress, to show the launcher's live status (notebook 00)."""
    with cdist.session():
        for step in range(1, steps + 1):
            time.sleep(delay_s)
            cdist.report_progress(step, steps)
        dist.barrier()
        return steps


def pid_of_rank() -> int:
    """The worker's process id, so a test can check no worker outlives a run (notebook 00)."""
    return os.getpid()


def fail_after_progress(bad_rank: int = 1) -> int:
    """Every rank reports progress (with its pid), then ``bad_rank`` dies hard (notebook 00)."""
    with cdist.session() as info:
        cdist.report_progress(1, 2)
        dist.barrier()
        if info.rank == bad_rank:
            os._exit(1)  # no clean-up, no error file: like a lost GPU
        dist.barrier()
        return info.rank


def model_sha256(model: str = "tiny", seed: int = 0) -> dict:
    """Build the course model from ``seed`` in this process and hash its weights (notebook 00).

    Launched on N ranks it shows that the seed alone fixes the weights: every process, with its
    own memory and its own random generator, gets the same SHA-256 as the notebook's kernel.
    """
    from .instrument import weights_sha256
    from .models import build_model, get_config

    return {"pid": os.getpid(), "sha256": weights_sha256(build_model(get_config(model), seed=seed).state_dict())}
