"""One training entry point for every strategy (introduced in notebook 02).

The notebooks, the tests and the command line all train through here, so strategies are
compared on exactly the same model (``models.build_model(cfg.model, cfg.seed)``), the same
data (``data.batch_for_rank``: one global batch per step, split across ranks) and the same
optimizer (Adam, ``cfg.lr``).

From a notebook::

    from course_utils.train import TrainConfig, train
    report = train(TrainConfig(strategy="ddp", nproc=2, steps=4))

From a shell (the same loop, launched by course_utils.launch)::

    python -m course_utils train --strategy ddp --nproc 2 --steps 4 --json

Under plain torchrun (one machine, or the same line on every node of a multi-node job)::

    torchrun --standalone --nproc-per-node 2 -m course_utils.train --strategy ddp --steps 4 --json
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m course_utils.train --strategy full_shard --steps 100

A strategy is a row of the record (``course_utils.strategies``) holding a plain function
``apply(model, mesh, options) -> model`` (torchtitan's ``apply_fsdp`` shape); the loop builds the
model, the mesh and the optimizer around it (``loop.prepare``). ``train(cfg, observers=[...])`` adds
the caller's own observers to every rank's loop; they travel to the workers by value, and what each
returns from ``result()`` comes back in the report (``observed``, one list per rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from dataclasses import asdict, fields

import torch
import torch.distributed as dist

from . import dist as cdist
from .checkpoint import Checkpointer, rank0_full_weights
from .errors import CourseInputError
from .failures import FailOnPurpose
from .instrument import (
    CountCollectives,
    HeldAtRest,
    Observer,
    StepTimer,
    global_mean_losses,
    rank_bytes,
    weights_sha256,
)
from .loop import TrainConfig, prepare, run_steps
from .models import unit_modules
from .recovery import FINISHED_LINE
from .strategies import STRATEGIES, Strategy, register

#: Every how many steps a rank puts its loss on the progress line: fetching a loss from the
#: device waits for the step to finish, so it is not done every step (notebook 04's lesson).
PROGRESS_LOSS_EVERY = 10


class _Progress(Observer):
    """The live status line of ``launch`` (notebook 00); the loss only every ``PROGRESS_LOSS_EVERY`` steps."""

    def __init__(self, total: int):
        self.total = total

    def after_step(self, step: int, losses: list) -> None:
        done = step + 1
        if done % PROGRESS_LOSS_EVERY == 0 or done == self.total:
            value = float(losses[-1])  # the one host sync of these steps
            if not math.isfinite(value):  # nan or inf stays so: stop here, not after the last step
                raise CourseInputError(
                    f"the loss of step {step} is {value} on rank {dist.get_rank()}: training "
                    f"diverged; lower the learning rate"
                )
            cdist.report_progress(done, self.total, loss=value)
        else:
            cdist.report_progress(done, self.total)


def train_worker(config: dict, observe: bool = True, observers=(), strategy: Strategy | None = None) -> dict:
    """The training run every rank runs, under ``launch`` or ``torchrun`` (notebook 02).

    ``observe=True`` (the default; the notebooks, the tests and the command line) counts the
    bytes held and sent per step; ``observe=False`` is a timing run: no counting observer, and
    ``held_bytes`` and ``comm_per_step`` are left out of the report. ``observers``: the caller's own
    (``train(cfg, observers=[...])``). ``strategy``: a row registered by the caller rather than one of
    the course's own (a test module's), sent by value and registered here too. Rank 0 returns the whole
    report (every rank's bytes and traffic gathered to it); the other ranks return ``{"rank": r}``.
    """
    if strategy is not None:
        register(strategy)
    cfg = TrainConfig(**config).validate()
    with cdist.session(cfg.backend if cfg.backend != "auto" else None) as info:
        return run_training(cfg, info, observe, observers)


def run_training(cfg: TrainConfig, info, observe: bool = True, extra=(), clock: bool = False) -> dict:
    """``train_worker``'s run inside a process group that is already up (notebooks 02, 05).

    Several runs can share one group this way (``course_utils.cluster.sweep_worker``); the
    report is the same. ``extra``: the caller's observers, in every run (counting or timing).
    ``clock`` (a counting run): the report's ``timeline`` is rank 0's last backward, unit by unit
    (``instrument.CountCollectives.timeline``).
    """
    if info.world_size != cfg.nproc:
        cfg.nproc = info.world_size  # torchrun decides the world size; the batch split follows it
        cfg.validate()
    if info.local_world_size < info.world_size and cfg.node_size != info.local_world_size:
        raise CourseInputError(  # several real nodes: a "node" must be what torchrun put on one
            f"--node-size {cfg.node_size} but torchrun put {info.local_world_size} ranks on each node; "
            f"pass --node-size {info.local_world_size} (equal to --nproc-per-node)"
        )
    prepared = prepare(cfg, info)
    # notebook 06: resume from the newest complete checkpoint; die on purpose where asked
    ckpt = Checkpointer(cfg, prepared, info) if cfg.checkpoint_dir else None
    start_step = ckpt.resume() if ckpt else 0
    steps = range(start_step, cfg.steps)
    timer = StepTimer(info.device, skip=min(1, len(steps) - 1))
    observers = [timer, FailOnPurpose.planned(cfg, info, ckpt and ckpt.log)]
    count = held = None
    if observe:
        units = unit_modules(getattr(prepared.model, "module", prepared.model)) if clock else ()  # DDP wraps it
        count = CountCollectives(cfg.node_size, units, cfg.steps - 1 if clock else None)
        held = HeldAtRest(prepared.held, at=cfg.steps - 1)
        observers = [count, held, *prepared.observers, *observers]
    extra = list(extra)
    observers[-1:-1] = extra  # before the failure injection, after what the run itself counts
    if ckpt:  # saving is not training: its collectives are not counted
        observers.append(ckpt.observer())
    observers.append(_Progress(cfg.steps))
    local_losses = run_steps(prepared, cfg, info, steps, observers)
    cdist.log(f"{FINISHED_LINE} at step {cfg.steps - 1}")  # how attempt_logs tells a finished rank
    # Everything below is bookkeeping, outside the counted window.
    held_at_rest = None
    if observe:
        held_at_rest = held.bytes if held.bytes is not None else rank_bytes(*prepared.held())  # resumed at the end
    losses = (ckpt.history if ckpt else []) + global_mean_losses(local_losses, info)
    full = rank0_full_weights(prepared, cfg.strategy)  # {} on the other ranks: no full copy on their devices
    if cfg.save_weights and info.rank == 0:  # for comparing strategies within a tolerance
        torch.save({k: v.detach().to("cpu", torch.float32) for k, v in full.items()}, cfg.save_weights)
    mine = {
        "held_bytes": held_at_rest,
        "comm_per_step": count and count.summary(max(1, len(steps))),
        "step_time_s": timer.seconds_per_step(),
        "observed": [o.result() for o in extra],
    }
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, mine)  # rank 0 reports for all, under launch or torchrun
    strategy_info = prepared.info
    recovery = ckpt.report() if ckpt else {"restarts": info.restart_count, "resumed_from": [], "steps_redone": None}
    # Free the strategy while the process group is alive. DDP's reducer holds the group; a gloo
    # group destroyed from there (after destroy_process_group) waits for its worker thread while
    # holding the GIL that thread may need: an occasional hang at exit.
    timeline = count.timeline() if count else None  # rank 0's; count holds the units: freed below too
    del prepared, ckpt, observers, held, local_losses, count
    gc.collect()
    if info.rank != 0:
        return {"rank": info.rank}
    report = {
        "strategy": cfg.strategy,
        "world_size": info.world_size,
        "backend": info.backend,
        "steps": cfg.steps,
        "losses": losses,
        "weights_sha256": weights_sha256(full),
        "per_rank": [dict(rank=r, **row["held_bytes"]) for r, row in enumerate(everyone)] if observe else None,
        "comm_per_step": everyone[0]["comm_per_step"],
        "timeline": timeline,
        "comm_per_step_by_rank": [row["comm_per_step"] for row in everyone],
        "step_time_s": max(row["step_time_s"] for row in everyone),
        # the busiest rank's bytes to other nodes (ranks on nodes of cfg.node_size; notebook 05)
        "cross_node_bytes_per_step": max(
            sum(v["cross_node_sent_bytes"] for v in row["comm_per_step"].values()) for row in everyone
        )
        if observe
        else None,
        "strategy_info": strategy_info,
        "config": asdict(cfg),
        **recovery,
    }
    if extra:
        report["observed"] = [row["observed"] for row in everyone]
    return report


def train(
    cfg: TrainConfig | None = None, *, echo: bool = False, observers=(), observe: bool = True, **overrides
) -> dict:
    """Launch a training run on ``cfg.nproc`` local processes and return its report (notebook 02).

    ``observe=False``: no counting observer (``train_worker``'s timing run), so ``per_rank`` and
    ``comm_per_step`` are left out; notebook 06's runs, which compare weights and time their restarts,
    run so (the counter routes every operator through Python: 1-2 CPU s per 2-rank attempt).

    ``observers``: ``instrument.Observer`` objects of the caller's, copied to every rank and added to its
    loop (a run of a strategy registered by the caller, ``strategies.register``, works the same way);
    ``report["observed"]`` holds, per rank, what each returned from ``result()``.

    The report holds ``strategy``, ``world_size``, ``backend``, ``steps``, ``losses`` (global
    mean per step), ``weights_sha256`` (full fp32 weights), ``per_rank`` (bytes of params,
    grads and optimizer state each rank holds), ``comm_per_step`` (per collective kind:
    calls, payload and ring bytes sent by one rank per step), ``step_time_s`` and
    ``cross_node_bytes_per_step`` (the busiest rank's ring bytes in groups that span nodes of
    ``cfg.node_size`` ranks: on one host, the nodes the mesh pretends to have; notebook 05).
    """
    from .checkpoint import check_resume
    from .launch import launch

    cfg = TrainConfig(**{**asdict(cfg or TrainConfig()), **overrides}).validate()
    check_resume(cfg)  # another run's checkpoint, or another strategy's: refused before any worker starts
    results = launch(
        train_worker,
        nproc=cfg.nproc,
        args=(asdict(cfg), observe, list(observers), STRATEGIES[cfg.strategy]),
        backend=cfg.backend,
        timeout_s=cfg.timeout_s,
        max_restarts=cfg.max_restarts,
        echo=echo,
        run_dir=cfg.checkpoint_dir and os.path.join(cfg.checkpoint_dir, "_launch"),
    )
    report = results[0]
    report["command"] = torchrun_train_command(cfg)
    return report


def torchrun_train_command(cfg: TrainConfig) -> str:
    """The torchrun line that runs this same training outside the notebook (notebook 02)."""
    parts = [f"torchrun --standalone --nproc-per-node {cfg.nproc}"]
    if cfg.max_restarts:  # restarts need nothing in torchrun's environment: see dist.attempt_store
        parts.append(f"--max-restarts {cfg.max_restarts}")
    parts.append("-m course_utils.train")
    return " ".join(parts + train_flags(cfg))


def train_flags(cfg: TrainConfig) -> list[str]:
    """``course_utils.train``'s flags for ``cfg``, defaults left out; the launcher decides
    ``nproc``, ``backend``, ``timeout_s`` and ``max_restarts`` (notebooks 02, 05)."""
    defaults, parts = TrainConfig(), []
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in ("nproc", "backend", "timeout_s", "max_restarts") or value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name == "options":
            parts += [part for k, v in value.items() for part in ("--option", f"{k}={v}")]
        else:
            parts += [flag, str(value)]
    return parts


# ---------------------------------------------------------------- command line


def _parse_option(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CourseInputError(f"--option takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def train_arguments(parser: argparse.ArgumentParser, *, one_machine: bool = True) -> None:
    """``train``'s flags; ``one_machine=False`` leaves out ``--nproc`` and ``--node-size``, which the
    shape of a cluster decides (``python -m course_utils cluster``, notebook 05)."""
    d = TrainConfig()
    parser.add_argument("--strategy", default=d.strategy, help=f"one of: {', '.join(STRATEGIES)}")
    if one_machine:
        parser.add_argument("--nproc", type=int, default=d.nproc, help="ranks on this machine")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--model", default=d.model, help="tiny, small or medium")
    parser.add_argument("--batch", type=int, default=d.batch, help="global batch (all ranks together)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--precision", default=d.precision, help="fp32 or mixed")
    parser.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb)
    if one_machine:
        parser.add_argument("--node-size", type=int, default=d.node_size, help="ranks per node (hybrid_shard)")
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="strategy-specific knob, repeatable"
    )
    parser.add_argument("--backend", default=d.backend, help="auto, gloo or nccl")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts)
    parser.add_argument("--fail-at", default=None, metavar="RANK:STEP")
    parser.add_argument("--fail-during-save", default=None, metavar="RANK:STEP")
    parser.add_argument(
        "--save-weights",
        default=None,
        metavar="PATH",
        help="rank 0 saves the final full fp32 weights there (torch.save)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line (last line)")


def _config_from_args(args) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    values["options"] = dict(_parse_option(o) for o in args.option)
    return TrainConfig(**values).validate()


def print_report(report: dict, as_json: bool) -> None:
    if as_json:
        cdist.print_line(json.dumps(report, sort_keys=True))
        return
    print(f"strategy {report['strategy']} on {report['world_size']} rank(s), backend {report['backend']}")
    print("losses: " + " ".join(f"{x:.4f}" for x in report["losses"]))
    print(f"weights_sha256: {report['weights_sha256']}")
    for row in report["per_rank"]:
        print(f"rank {row['rank']}: params {row['params']} B, grads {row['grads']} B, optimizer {row['optim']} B")
    for kind, row in report["comm_per_step"].items():
        print(f"{kind}: {row['calls']:g} calls/step, {row['sent_bytes']:.0f} B sent/step per rank")
    print(f"step time {report['step_time_s'] * 1e3:.1f} ms (CPU/gloo timings are not GPU timings)")
    if report.get("restarts") or report.get("resumed_from"):  # notebook 06
        print(
            f"restarts {report['restarts']}, resumed from step(s) {report['resumed_from']}, "
            f"steps redone {report['steps_redone']}"
        )


def train_command(args) -> int:
    from .launch import WorkerFailed

    cfg = _config_from_args(args)
    try:
        report = train(cfg, echo=not args.json)
    except WorkerFailed as exc:
        cause = worker_input_error(exc)
        if cause is None:
            raise
        raise CourseInputError(cause) from None  # one line, as if it had been found before the launch
    print_report(report, args.json)
    return 0


def worker_input_error(exc: BaseException) -> str | None:
    """The message of a ``CourseInputError`` a worker raised (found only once it ran), or None (notebook 06).

    Some input can only be judged by the workers: whether the checkpoints in a folder verify,
    whether a learning rate drives the loss to nan. Its one sentence is what the user needs,
    not the launch's traceback.
    """
    for line in str(exc).splitlines():
        head, sep, message = line.partition("CourseInputError: ")
        if sep and message.strip():
            return message.strip()
    return None


def die_with_torchrun() -> None:
    """Under torchrun on Linux, have the kernel end this worker when torchrun dies (notebook 06).

    torchrun stops its workers when it is asked to (SIGTERM, Ctrl-C), but a torchrun that is
    killed outright (SIGKILL, an OOM kill, a closed job step) cannot: its workers, stuck in a
    collective, were left running under init. ``PR_SET_PDEATHSIG`` (prctl(2)) is the kernel's
    own "kill me when my parent exits"; torchrun starts ``-m`` workers itself, so the parent is it.
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # torchrun died before the request was in place
        os._exit(1)


def main(argv=None) -> int:
    """``python -m course_utils.train``: the worker entry point for plain torchrun (notebook 02)."""
    from .validate import check_numbers

    die_with_torchrun()
    parser = argparse.ArgumentParser(prog="python -m course_utils.train", description=__doc__.split("\n")[0])
    train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_numbers(args)
        args.nproc = int(os.environ.get("WORLD_SIZE", 1))  # torchrun decides the world size
        cfg = _config_from_args(args)
        report = train_worker(asdict(cfg))
    except CourseInputError as exc:
        print(f"python -m course_utils.train: error: {exc}", file=sys.stderr)
        return 2
    if "losses" in report:  # rank 0 reports for every rank
        print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
