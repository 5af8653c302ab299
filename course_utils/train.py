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

A strategy is a plain function ``apply_NAME(model, cfg, info) -> Prepared`` (torchtitan's
``apply_fsdp`` shape): it wraps the model, builds the optimizer over what this rank owns,
and says how to read back the full weights and which tensors this rank holds.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch
import torch.distributed as dist

from . import dist as cdist
from .data import batch_for_rank
from .errors import CourseInputError
from .checkpoint import FINISHED_LINE, Checkpointer, die_hard, planned_failure, rank0_full_weights
from .instrument import CommCounter, held_bytes, optimizer_tensors, weights_sha256
from .models import build_model, get_config

#: strategy name -> "module:function" that applies it (imported only when used)
STRATEGIES: dict[str, str] = {
    "single": "course_utils.train:apply_single",          # notebook 02: the reference
    "ddp": "course_utils.ddp:apply_ddp",                  # notebook 02: torch DistributedDataParallel
    "ddp_scratch": "course_utils.ddp:apply_ddp_scratch",  # notebook 02: bucketed DDP built by hand
    "zero1": "course_utils.zero:apply_zero1",             # notebook 03: P_os
    "zero2": "course_utils.zero:apply_zero2",             # notebook 03: P_os+g
    "zero3": "course_utils.zero:apply_zero3",             # notebook 03: P_os+g+p
    "no_shard": "course_utils.fsdp:apply_no_shard",       # notebook 04
    "shard_grad_op": "course_utils.fsdp:apply_shard_grad_op",
    "full_shard": "course_utils.fsdp:apply_full_shard",
    "hybrid_shard": "course_utils.fsdp:apply_hybrid_shard",
}


@dataclass
class TrainConfig:
    """Everything that defines a run; two runs with equal configs see identical data (notebook 02)."""

    strategy: str = "single"
    nproc: int = 1                 # ranks (N); "single" is always 1
    steps: int = 4
    model: str = "tiny"            # a models.PRESETS name
    batch: int = 8                 # global batch B (sequences per step, all ranks together)
    lr: float = 3e-3
    seed: int = 0
    precision: str = "fp32"        # "fp32" (exact comparisons) or "mixed" (16-bit working copy, where supported)
    bucket_cap_mb: float = 25.0    # DDP bucket size cap (ddp, ddp_scratch)
    node_size: int = 2             # ranks per "node": hybrid_shard shards inside one, replicates across;
                                   # cross-node bytes count groups spanning more than one (notebook 05)
    options: dict = field(default_factory=dict)  # strategy-specific knobs, e.g. {"prefetch": True}
    backend: str = "auto"
    timeout_s: float = 120.0
    # checkpointing and failure injection (notebook 06)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_restarts: int = 0
    fail_at: str | None = None           # "RANK:STEP": that rank dies hard at that step (first attempt only;
                                         # "1:3,0:5" = one failure per attempt)
    fail_during_save: str | None = None  # "RANK:STEP": dies while writing that step's checkpoint
    save_weights: str | None = None      # rank 0 writes the final full fp32 state dict here (torch.save)

    def validate(self) -> "TrainConfig":
        if self.strategy not in STRATEGIES:
            raise CourseInputError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        for name in ("nproc", "steps", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CourseInputError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.strategy == "single" and self.nproc != 1:
            raise CourseInputError("strategy 'single' is the one-process reference; use --nproc 1 (or another strategy)")
        if self.batch % self.nproc:
            raise CourseInputError(
                f"global batch {self.batch} does not divide by {self.nproc} ranks; pick a batch that is a multiple of {self.nproc}")
        if self.precision not in ("fp32", "mixed"):
            raise CourseInputError(f"precision must be 'fp32' or 'mixed', got {self.precision!r}")
        if self.strategy == "hybrid_shard" and (self.node_size < 1 or self.nproc % self.node_size):
            raise CourseInputError(
                f"hybrid_shard needs nproc ({self.nproc}) divisible by node_size ({self.node_size}); "
                "e.g. --nproc 4 --node-size 2 (2 nodes x 2 ranks)")
        if not self.lr > 0:
            raise CourseInputError(f"lr must be positive, got {self.lr!r}")
        get_config(self.model)
        self._validate_numbers_and_paths()
        self._validate_recovery()
        return self

    def _validate_numbers_and_paths(self) -> None:
        """What argparse lets through: nan and inf, seeds beyond 64 bits, knobs a strategy ignores, bad paths."""
        from . import validate
        from .dist import BACKENDS

        for name, what in (("lr", "a learning rate, e.g. 3e-3"), ("bucket_cap_mb", "a bucket size in MB, e.g. 25"),
                           ("timeout_s", "seconds, e.g. 120")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise CourseInputError(f"{name} must be a finite number > 0 ({what}), got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= validate.INT64_MAX:
            raise CourseInputError(f"seed must be a whole number in 0..2^63-1, got {self.seed!r}")
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) or self.node_size < 1:
            raise CourseInputError(f"node_size must be a whole number >= 1, got {self.node_size!r}")
        if self.backend not in BACKENDS:
            raise CourseInputError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.options, dict):
            raise CourseInputError(f"options must be a dict of KEY: VALUE, got {self.options!r}")
        if self.options and STRATEGIES[self.strategy].startswith("course_utils.fsdp:"):
            from .fsdp import fsdp_options

            fsdp_options(self)
        elif self.options:
            raise CourseInputError(f"strategy {self.strategy!r} takes no --option (got {', '.join(self.options)}); "
                                   "the knobs are for no_shard, shard_grad_op, full_shard and hybrid_shard")
        if self.checkpoint_dir is not None:
            validate.writable_dir("--checkpoint-dir", self.checkpoint_dir)
        if self.save_weights is not None:
            validate.writable_file("--save-weights", self.save_weights)

    def _validate_recovery(self) -> None:
        """Checkpoint and failure-injection settings (notebook 06)."""
        from .checkpoint import parse_failures

        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CourseInputError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise CourseInputError("--checkpoint-every needs --checkpoint-dir (where the step-N/ folders go)")
        if isinstance(self.keep_checkpoints, bool) or not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 2:
            raise CourseInputError(
                f"keep_checkpoints must be >= 2, got {self.keep_checkpoints}: if the newest checkpoint turns out "
                "unusable, the one before it is what a restart falls back to")
        for flag, text in (("--fail-at", self.fail_at), ("--fail-during-save", self.fail_during_save)):
            for rank, step in parse_failures(text, flag):
                # --fail-at names the step that dies (0..steps-1); --fail-during-save the save after N steps
                last = self.steps - 1 if flag == "--fail-at" else self.steps
                first = 0 if flag == "--fail-at" else 1
                if not 0 <= rank < self.nproc or not first <= step <= last:
                    raise CourseInputError(f"{flag} {text}: rank must be in 0..{self.nproc - 1} and step in "
                                           f"{first}..{last} (a failure after the last step never fires)")
                if flag == "--fail-during-save" and not (self.checkpoint_every and step % self.checkpoint_every == 0):
                    raise CourseInputError(
                        f"--fail-during-save {text}: step {step} is not a checkpoint step; use a multiple of "
                        f"--checkpoint-every ({self.checkpoint_every or 'not set'})")


@dataclass
class Prepared:
    """What a strategy hands the training loop (notebook 02).

    Attributes:
        model: the module to call for forward (it returns the loss).
        optimizer: has ``step()`` and ``zero_grad()``; built over what this rank owns.
        full_state_dict: collective call (all ranks) returning the full unsharded fp32
            weights keyed like ``build_model(...).state_dict()``.
        held: returns ``(params, grads, optim)`` lists of the local tensors this rank holds.
        before_step: called after backward, before ``optimizer.step()`` (e.g. wait for
            gradient all-reduces).
        info: strategy facts for the report (buckets, padding, ...).
        get_state, set_state: optional checkpoint hooks (notebook 06). ``get_state()`` returns
            ``{"model": {...}, "optim": {...}}`` of tensors this rank holds, sharded pieces as
            DTensors (so that DCP records them by global offset, not by rank); ``set_state(d)``
            takes the same structure after DCP loaded into it in place. Leave them None and
            ``course_utils.checkpoint`` uses ``get_state_dict``/``set_state_dict`` (plain modules,
            DDP, FSDP2), or the flat-slice layout of the hand-built ZeRO optimizers.
    """

    model: torch.nn.Module
    optimizer: object
    full_state_dict: Callable[[], dict]
    held: Callable[[], tuple]
    before_step: Callable[[], None] = lambda: None
    info: dict = field(default_factory=dict)
    get_state: Callable[[], dict] | None = None
    set_state: Callable[[dict], None] | None = None


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The course optimizer: Adam with the run's learning rate, same for every strategy (notebook 02).

    ``foreach=False`` keeps the per-tensor arithmetic identical however parameters are grouped.
    """
    return torch.optim.Adam(params, lr=cfg.lr, foreach=False)


def module_held(model, optimizer) -> tuple:
    """``(params, grads, optimizer state)`` of a plain module and torch optimizer (notebook 02)."""
    params = list(model.parameters())
    return params, [p.grad for p in params], optimizer_tensors(optimizer)


def apply_single(model, cfg: TrainConfig, info) -> Prepared:
    """The reference: one process, the whole global batch, a local Adam (notebook 02)."""
    optimizer = make_optimizer(model.parameters(), cfg)
    return Prepared(model=model, optimizer=optimizer,
                    full_state_dict=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
                    held=lambda: module_held(model, optimizer))


def resolve_strategy(name: str) -> Callable:
    module, _, fn = STRATEGIES[name].partition(":")
    return getattr(importlib.import_module(module), fn)


def global_mean_losses(local_losses: list, info) -> list[float]:
    """The global mean loss of each step, from every rank's local losses (collective; notebook 02).

    Equal per-rank batches: the mean of the rank means is the global mean. The sum runs in
    rank order, one element at a time, so it does not depend on how many steps are reduced
    together: a resumed run reports the very numbers of an uninterrupted one (notebook 06).
    """
    local = torch.stack(list(local_losses) + [torch.zeros(())]).to(info.device)
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return (total / info.world_size).cpu().tolist()[:-1]


def train_worker(config: dict) -> dict:
    """The training loop every rank runs, under ``launch`` or ``torchrun`` (notebook 02).

    Rank 0 returns the whole report (every rank's bytes and traffic gathered to it); the other
    ranks return ``{"rank": r}``.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session(cfg.backend if cfg.backend != "auto" else None) as info:
        return run_training(cfg, info)


def run_training(cfg: TrainConfig, info) -> dict:
    """``train_worker``'s loop inside a process group that is already up (notebooks 02, 05).

    Several runs can share one group this way (``course_utils.cluster.sweep_worker``); the
    report is the same.
    """
    if info.world_size != cfg.nproc:
        cfg.nproc = info.world_size  # torchrun decides the world size; the batch split follows it
        cfg.validate()
    if info.local_world_size < info.world_size and cfg.node_size != info.local_world_size:
        raise CourseInputError(  # several real nodes: a "node" must be what torchrun put on one
            f"--node-size {cfg.node_size} but torchrun put {info.local_world_size} ranks on each node; "
            f"pass --node-size {info.local_world_size} (equal to --nproc-per-node)")
    mcfg = get_config(cfg.model)
    model = build_model(mcfg, seed=cfg.seed, device=info.device)
    prepared = resolve_strategy(cfg.strategy)(model, cfg, info)
    # notebook 06: resume from the newest complete checkpoint; die on purpose where asked
    ckpt = Checkpointer(cfg, prepared, info) if cfg.checkpoint_dir else None
    start_step = ckpt.resume() if ckpt else 0
    fail_step = planned_failure(cfg.fail_at, info.rank, info.restart_count)
    held = loss = None
    local_losses, step_times = [], []
    comm = CommCounter(node_size=cfg.node_size)
    with comm:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            x, y = batch_for_rank(step, info.rank, info.world_size, batch=cfg.batch, seq=mcfg.seq,
                                  vocab=mcfg.vocab, seed=cfg.seed, device=info.device)
            loss = prepared.model(x, y)
            if step == fail_step:  # mid-step: the peers are about to wait for this rank's gradients
                die_hard(f"fail_at {info.rank}:{step} on attempt {info.restart_count}")
            loss.backward()
            prepared.before_step()
            prepared.optimizer.step()
            if step == cfg.steps - 1:  # bytes held at rest, gradients still present
                comm.paused = True
                held = held_bytes(*prepared.held())
                comm.paused = False
            prepared.optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            local_losses.append(loss.detach().float().cpu())
            if ckpt:  # saving is not training: its collectives are not counted
                comm.paused = True
                ckpt.after_step(step + 1, local_losses)
                comm.paused = False
            value = float(local_losses[-1])  # already on the CPU: this adds no sync
            if not math.isfinite(value):  # nan or inf stays so: stop now, not after the last step
                raise CourseInputError(f"the loss of step {step} is {value} on rank {info.rank}: training diverged; "
                                       f"lower the learning rate (now {cfg.lr:g})")
            cdist.report_progress(step + 1, cfg.steps, loss=value)
    cdist.log(f"{FINISHED_LINE} at step {cfg.steps - 1}")  # how attempt_logs tells a finished rank
    # Everything below is bookkeeping, outside the counted window.
    if held is None:  # nothing left to train (resumed at the last step)
        held = held_bytes(*prepared.held())
    losses = (ckpt.history if ckpt else []) + global_mean_losses(local_losses, info)
    full = rank0_full_weights(prepared, cfg.strategy)  # {} on the other ranks: no full copy on their devices
    if cfg.save_weights and info.rank == 0:  # for comparing strategies within a tolerance
        torch.save({k: v.detach().to("cpu", torch.float32) for k, v in full.items()}, cfg.save_weights)
    mine = {"held_bytes": held, "comm_per_step": comm.summary(max(1, cfg.steps - start_step)),
            "step_time_s": statistics.median(step_times[1:] or step_times or [0.0])}
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, mine)  # rank 0 reports for all, under launch or torchrun
    strategy_info = prepared.info
    recovery = ckpt.report() if ckpt else {"restarts": info.restart_count, "resumed_from": [], "steps_redone": None}
    # Free the strategy while the process group is alive. DDP's reducer holds the group; a gloo
    # group destroyed from there (after destroy_process_group) waits for its worker thread while
    # holding the GIL that thread may need: an occasional hang at exit.
    del prepared, ckpt, model, loss
    gc.collect()
    if info.rank != 0:
        return {"rank": info.rank}
    return {
        "strategy": cfg.strategy, "world_size": info.world_size, "backend": info.backend,
        "steps": cfg.steps, "losses": losses, "weights_sha256": weights_sha256(full),
        "per_rank": [dict(rank=r, **row["held_bytes"]) for r, row in enumerate(everyone)],
        "comm_per_step": everyone[0]["comm_per_step"],
        "comm_per_step_by_rank": [row["comm_per_step"] for row in everyone],
        "step_time_s": max(row["step_time_s"] for row in everyone),
        # the busiest rank's bytes to other nodes (ranks on nodes of cfg.node_size; notebook 05)
        "cross_node_bytes_per_step": max(sum(v["cross_node_sent_bytes"] for v in row["comm_per_step"].values())
                                         for row in everyone),
        "strategy_info": strategy_info, "config": asdict(cfg), **recovery,
    }


def train(cfg: TrainConfig | None = None, *, echo: bool = False, **overrides) -> dict:
    """Launch a training run on ``cfg.nproc`` local processes and return its report (notebook 02).

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
    results = launch(train_worker, nproc=cfg.nproc, args=(asdict(cfg),), backend=cfg.backend,
                     timeout_s=cfg.timeout_s, max_restarts=cfg.max_restarts, echo=echo,
                     run_dir=cfg.checkpoint_dir and os.path.join(cfg.checkpoint_dir, "_launch"))
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
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="strategy-specific knob, repeatable")
    parser.add_argument("--backend", default=d.backend, help="auto, gloo or nccl")
    parser.add_argument("--timeout-s", type=float, default=d.timeout_s)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    parser.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    parser.add_argument("--max-restarts", type=int, default=d.max_restarts)
    parser.add_argument("--fail-at", default=None, metavar="RANK:STEP")
    parser.add_argument("--fail-during-save", default=None, metavar="RANK:STEP")
    parser.add_argument("--save-weights", default=None, metavar="PATH",
                        help="rank 0 saves the final full fp32 weights there (torch.save)")
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
        print(f"restarts {report['restarts']}, resumed from step(s) {report['resumed_from']}, "
              f"steps redone {report['steps_redone']}")


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
