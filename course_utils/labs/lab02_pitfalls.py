"""Notebook 02's pitfalls: a parameter the loss never uses (``find_unused_parameters``), collectives issued in
a different order on different ranks, and where a failed collective says why (notebook 02).

Each training run is the one loop (``loop.run_steps``); the mechanism is ``course_utils.ddp``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .. import dist as cdist
from ..ddp import BucketedDDP
from ..instrument import Observer
from ..loop import Prepared, TrainConfig, make_optimizer, module_held, run_steps
from ..models import build_model

# ---------------------------------------------------------------- find_unused_parameters


class GPTWithAuxHead(nn.Module):
    """The course GPT plus an auxiliary head the language-model loss never touches (notebook 02).

    Think of a classifier head used only on some batches: on the others its parameters get no
    gradient, which is what ``find_unused_parameters`` is for.
    """

    def __init__(self, cfg="tiny", seed: int = 0, classes: int = 4):
        super().__init__()
        self.gpt = build_model(cfg, seed=seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.aux_head = nn.Linear(self.gpt.cfg.width, classes)

    def forward(self, idx, targets):
        return self.gpt(idx, targets)  # aux_head is not used: its gradient never arrives


class _ForwardBackwardTimer(Observer):
    """Seconds from the start of forward to the end of gradient synchronisation, each step."""

    def __init__(self):
        self.times = []

    def before_forward(self, step: int) -> None:
        self.t0 = time.perf_counter()

    def before_update(self, step: int) -> None:
        self.times.append(time.perf_counter() - self.t0)


def _timed_steps(wrapped, cfg: TrainConfig, info, steps: int, finish=None) -> tuple[list, float]:
    """Train ``steps`` steps of ``wrapped`` in the one loop; return the losses and the median forward+backward time."""
    optimizer = make_optimizer(wrapped.parameters(), cfg)
    prepared = Prepared(
        model=wrapped,
        optimizer=optimizer,
        full_state_dict=wrapped.state_dict,
        held=lambda: module_held(wrapped, optimizer),
        before_step=finish or (lambda: None),
    )
    timer = _ForwardBackwardTimer()
    losses = run_steps(prepared, cfg, info, range(steps), [timer])
    return [float(loss) for loss in losses], statistics.median(timer.times[1:] or timer.times)


def unused_parameters_demo(config: dict, mode: str) -> dict:
    """Torch DDP and BucketedDDP on a model with a branch the loss never uses (notebook 02).

    Modes:
        "torch_without_flag": torch DDP, ``find_unused_parameters=False``; raises at the next
            forward ("Expected to have finished reduction in the prior iteration...").
        "compare": on every rank, (1) torch DDP with the flag trains ``GPTWithAuxHead``;
            (2) the cost of the flag: the plain GPT (no unused parameters) timed with and
            without it; (3) BucketedDDP's own error for the unused head, as text.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:
        if mode == "torch_without_flag":
            model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
            _timed_steps(DistributedDataParallel(model), cfg, info, cfg.steps)
            return {"rank": info.rank}
        out = {"rank": info.rank}
        model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
        out["losses_with_flag"], _ = _timed_steps(
            DistributedDataParallel(model, find_unused_parameters=True), cfg, info, cfg.steps
        )
        for flag in (False, True) * 3:  # interleaved, so drift in machine load hits both
            plain = build_model(cfg.model, seed=cfg.seed, device=info.device)
            _, t = _timed_steps(DistributedDataParallel(plain, find_unused_parameters=flag), cfg, info, cfg.steps)
            out.setdefault(f"step_s_flag_{flag}", []).append(t)
        model = GPTWithAuxHead(cfg.model, cfg.seed).to(info.device)
        ours = BucketedDDP(model)
        try:
            _timed_steps(ours, cfg, info, 1, finish=ours.finish_gradient_synchronization)
            out["bucketed_error"] = None
        except RuntimeError as exc:
            out["bucketed_error"] = str(exc)
        return out


# ---------------------------------------------------------------- mismatched collective order


def mismatched_order(
    mode: str = "different_size", numel: int = 1000, collective_timeout_s: float | None = None
) -> dict:
    """Ranks issue collectives in different orders, as if each issued buckets as they filled (notebook 02).

    Rank 0 keeps index order (bucket a, then bucket b); every other rank issues b first.

    Modes:
        "same_size": both buckets hold ``numel`` elements. First issued in index order on every
            rank (correct sums), then in swapped order: gloo pairs rank 0's a with rank 1's b
            and returns wrong sums with no error; the replicas silently diverge.
        "different_size": a has ``numel`` elements, b has 3. The ranks wait on messages that do
            not match: the collective times out (or gloo aborts on a message of the wrong size).
        "different_kind": rank 0 all-reduces a then broadcasts b; the others broadcast first.

    Args:
        collective_timeout_s: how long a mismatched collective waits before raising (default: the
            launch's). The group starts with the launch's timeout and takes this one only after a
            barrier, every rank present (what ``init_process_group(timeout=...)`` sets; as
            ``hangs.Stall`` does): a slow start of one rank on a loaded machine is never taken for
            the mismatch, so the timeout can be short.
    """
    with cdist.session() as info:
        if collective_timeout_s is not None:
            from datetime import timedelta

            from torch.distributed.distributed_c10d import _set_pg_timeout

            dist.barrier()  # every rank is here: from now on, a wait can only be the mismatch
            _set_pg_timeout(timedelta(seconds=collective_timeout_s))

        def buckets():
            a = torch.full((numel,), float(info.rank + 1), device=info.device)  # sum over ranks: N(N+1)/2
            b = torch.full((numel if mode == "same_size" else 3,), 100.0 * (info.rank + 1), device=info.device)
            return a, b

        out = {"rank": info.rank, "world_size": info.world_size}
        if mode == "same_size":
            a, b = buckets()
            for t in (a, b):  # index order on every rank
                dist.all_reduce(t)
            out["index_order"] = [float(a[0]), float(b[0])]
        a, b = buckets()
        if mode == "different_kind":
            steps = [lambda: dist.all_reduce(a), lambda: dist.broadcast(b, src=0)]
        else:
            steps = [lambda: dist.all_reduce(a), lambda: dist.all_reduce(b)]
        for run in steps if info.rank == 0 else steps[::-1]:
            run()
        out["swapped_order"] = [float(a[0]), float(b[0])]
        return out


def worker_log_errors(run_dir, limit: int = 3) -> list[str]:
    """The lines of a launch's worker logs that say why a collective failed (notebook 02).

    A worker that gloo aborts (SIGABRT) leaves no Python traceback for the launcher to report;
    its reason is only in its stderr log (``run_dir/logs/<run>/attempt_<n>/<rank>/stderr.log``).
    """
    import re
    from pathlib import Path

    pattern = re.compile(r"what\(\)|Timed out|doesn't match|mismatch|Connection closed|Read error")
    found = []
    for log in sorted(Path(run_dir).glob("logs/*/attempt_*/*/stderr.log")):
        for line in log.read_text(errors="replace").splitlines():
            line = line.strip()
            if pattern.search(line) and not line.startswith(("File ", "raise ")) and line not in found:
                found.append(line)
    return found[:limit]


def default_collective_timeouts() -> dict:
    """How long a collective waits before it raises, when nobody sets ``timeout`` (notebook 02).

    Read from torch, not typed in: gloo's (and every non-NCCL backend's) from
    ``torch.distributed.constants.default_pg_timeout``; NCCL's from
    ``constants.default_pg_nccl_timeout`` when this torch was built with NCCL, otherwise from the
    C++ constant ``kProcessGroupNCCLDefaultTimeout`` in the header the wheel ships
    (``torch/include/.../ProcessGroupNCCL.hpp``). torch 2.13: 30 min and 10 min.
    """
    import datetime
    import re
    from pathlib import Path

    from torch.distributed import constants

    out = {"gloo": constants.default_pg_timeout, "gloo_source": "torch.distributed.constants.default_pg_timeout"}
    if constants.default_pg_nccl_timeout is not None:
        out.update(
            nccl=constants.default_pg_nccl_timeout, nccl_source="torch.distributed.constants.default_pg_nccl_timeout"
        )
        return out
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    found = (
        re.search(r"kProcessGroupNCCLDefaultTimeout\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)", header.read_text())
        if header.exists()
        else None
    )
    nccl = None
    if found:
        ms = 1
        for factor in found.group(1).split("*"):
            ms *= int(factor)
        nccl = datetime.timedelta(milliseconds=ms)
    out.update(
        nccl=nccl,
        nccl_source="kProcessGroupNCCLDefaultTimeout in torch's ProcessGroupNCCL.hpp (this torch has no NCCL)"
        if nccl
        else "not found in this torch",
    )
    return out
