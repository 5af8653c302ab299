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
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "backend": info.backend,
            "device": str(info.device),
            "pid": os.getpid(),
            "result": x.cpu().tolist(),
        }


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


def three_collectives(psi: int = 8) -> dict:
    """Broadcast, all-gather and reduce-scatter on a tiny example to check by hand: Ψ = 8 on Nd ranks (notebook 00).

    The Ψ parameters are the numbers 0 … Ψ−1, cut into Nd equal slices; rank r owns slice r.
    - broadcast: rank 0 sends its whole vector (r + 1 everywhere on rank r) to every rank;
    - all-gather: every rank contributes its slice and receives the whole vector 0 … Ψ−1;
    - reduce-scatter: rank r holds a full "gradient" whose element i is (r + 1)(i + 1), so no two
      elements are alike; each rank receives the sum over ranks of its own slice only:
      (i + 1)·N(N+1)/2 at each of its Ψ/Nd places i, a slice no other rank gets.
    Ψ must divide by the number of ranks. Returns this rank's three results.
    """
    from .errors import CourseInputError
    from .zero import all_gather_single, reduce_scatter_single

    with cdist.session() as info:
        n, r = info.world_size, info.rank
        if psi % n:
            raise CourseInputError(f"Ψ = {psi} does not divide into {n} equal slices: pick a multiple of {n}")
        s = psi // n
        mine = torch.full((psi,), float(r + 1), device=info.device)
        dist.broadcast(mine, src=0)
        whole = torch.empty(psi, device=info.device)
        all_gather_single(whole, torch.arange(r * s, (r + 1) * s, dtype=torch.float32, device=info.device))
        slice_sum = torch.empty(s, device=info.device)
        gradient = (r + 1.0) * torch.arange(1, psi + 1, dtype=torch.float32, device=info.device)
        reduce_scatter_single(slice_sum, gradient)
        return {
            "rank": r,
            "broadcast": mine.cpu().tolist(),
            "all_gather": whole.cpu().tolist(),
            "reduce_scatter": slice_sum.cpu().tolist(),
        }
