"""The one training loop and the types around it (notebook 02).

``TrainConfig`` (everything that defines a run), ``Prepared`` (what a strategy's ``apply_*``
hands the loop), ``prepare`` (build the course model, apply the run's strategy) and
``run_steps`` (the loop itself: step, and tell the observers). Everything that trains in the
course steps through ``run_steps``: ``train.train_worker`` (runs launched by ``train``), and
each notebook's experiments (``course_utils.labs`` and the strategy modules' experiment
runners). It knows strategies only through the record (``course_utils.strategies``), so the
strategy modules can import it and it imports none of them.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .data import batch_for_rank
from .errors import CourseInputError
from .failures import parse_failures
from .instrument import CountCollectives, optimizer_tensors
from .models import build_meta_model, build_model, get_config
from .strategies import get, mesh_shape
from .validate import check_values


@dataclass
class TrainConfig:
    """Everything that defines a run; two runs with equal configs see identical data (notebook 02)."""

    strategy: str = "single"
    nproc: int = 1  # ranks (N); "single" is always 1
    steps: int = 4
    model: str = "tiny"  # a models.PRESETS name
    batch: int = 8  # global batch B (sequences per step, all ranks together)
    lr: float = 3e-3
    seed: int = 0
    precision: str = "fp32"  # "fp32" (exact comparisons) or "mixed" (16-bit working copy, where supported)
    bucket_cap_mb: float = 25.0  # DDP bucket size cap (ddp, ddp_scratch)
    node_size: int = 2  # ranks per "node": hybrid_shard shards inside one, replicates across;
    # cross-node bytes count groups spanning more than one (notebook 05)
    options: dict = field(default_factory=dict)  # strategy-specific knobs, e.g. {"prefetch": True}
    backend: str = "auto"
    timeout_s: float = 120.0
    # checkpointing and failure injection (notebook 06)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_restarts: int = 0
    fail_at: str | None = None  # "RANK:STEP": that rank dies hard at that step (first attempt only;
    # "1:3,0:5" = one failure per attempt)
    fail_during_save: str | None = None  # "RANK:STEP": dies while writing that step's checkpoint
    save_weights: str | None = None  # rank 0 writes the final full fp32 state dict here (torch.save)

    def validate(self) -> TrainConfig:
        check_values("train", self)  # types and stated ranges (course_utils.validate), before anything compares them
        get(self.strategy)
        for name in ("nproc", "steps", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CourseInputError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.strategy == "single" and self.nproc != 1:
            raise CourseInputError(
                "strategy 'single' is the one-process reference; use --nproc 1 (or another strategy)"
            )
        if self.batch % self.nproc:
            raise CourseInputError(
                f"global batch {self.batch} does not divide by {self.nproc} ranks; "
                f"pick a batch that is a multiple of {self.nproc}"
            )
        if self.precision not in ("fp32", "mixed"):
            raise CourseInputError(f"precision must be 'fp32' or 'mixed', got {self.precision!r}")
        mesh_shape(self.strategy, self.nproc, self.node_size)  # hybrid_shard: nproc must divide by node_size
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

        for name, what in (
            ("lr", "a learning rate, e.g. 3e-3"),
            ("bucket_cap_mb", "a bucket size in MB, e.g. 25"),
            ("timeout_s", "seconds, e.g. 120"),
        ):
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
        module = get(self.strategy).apply.partition(":")[0]
        if self.options and module == "course_utils.fsdp":  # the strategy module checks its own knobs
            importlib.import_module(module).fsdp_options(self)
        elif self.options:
            raise CourseInputError(
                f"strategy {self.strategy!r} takes no --option (got {', '.join(self.options)}); "
                "the knobs are for no_shard, shard_grad_op, full_shard and hybrid_shard"
            )
        if self.checkpoint_dir is not None:
            validate.writable_dir("--checkpoint-dir", self.checkpoint_dir)
        if self.save_weights is not None:
            validate.writable_file("--save-weights", self.save_weights)

    def _validate_recovery(self) -> None:
        """Checkpoint and failure-injection settings (notebook 06)."""
        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CourseInputError(f"{name} must be a whole number >= 0, got {value!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise CourseInputError("--checkpoint-every needs --checkpoint-dir (where the step-N/ folders go)")
        if (
            isinstance(self.keep_checkpoints, bool)
            or not isinstance(self.keep_checkpoints, int)
            or self.keep_checkpoints < 2
        ):
            raise CourseInputError(
                f"keep_checkpoints must be >= 2, got {self.keep_checkpoints}: if the newest checkpoint turns out "
                "unusable, the one before it is what a restart falls back to"
            )
        for flag, text in (("--fail-at", self.fail_at), ("--fail-during-save", self.fail_during_save)):
            for rank, step in parse_failures(text, flag):
                # --fail-at names the step that dies (0..steps-1); --fail-during-save the save after N steps
                last = self.steps - 1 if flag == "--fail-at" else self.steps
                first = 0 if flag == "--fail-at" else 1
                if not 0 <= rank < self.nproc or not first <= step <= last:
                    raise CourseInputError(
                        f"{flag} {text}: rank must be in 0..{self.nproc - 1} and step in "
                        f"{first}..{last} (a failure after the last step never fires)"
                    )
                if flag == "--fail-during-save" and not (self.checkpoint_every and step % self.checkpoint_every == 0):
                    raise CourseInputError(
                        f"--fail-during-save {text}: step {step} is not a checkpoint step; use a multiple of "
                        f"--checkpoint-every ({self.checkpoint_every or 'not set'})"
                    )


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
        observers: counting observers the strategy brings (FSDP's ``UnshardedTracker``); counting
            runs add them to the loop, timing runs leave them out.
    """

    model: torch.nn.Module
    optimizer: object
    full_state_dict: Callable[[], dict]
    held: Callable[[], tuple]
    before_step: Callable[[], None] = lambda: None
    info: dict = field(default_factory=dict)
    get_state: Callable[[], dict] | None = None
    set_state: Callable[[dict], None] | None = None
    observers: list = field(default_factory=list)


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
    return Prepared(
        model=model,
        optimizer=optimizer,
        full_state_dict=lambda: {k: v.detach().clone() for k, v in model.state_dict().items()},
        held=lambda: module_held(model, optimizer),
    )


def resolve_strategy(name: str) -> Callable:
    """The record's ``apply`` function of ``name`` (``strategies.STRATEGIES``), imported on first use (notebook 02)."""
    module, _, fn = get(name).apply.partition(":")
    return getattr(importlib.import_module(module), fn)


def prepare(cfg: TrainConfig, info) -> Prepared:
    """Build the course model and apply the run's strategy to it (notebook 02).

    FSDP2 strategies build the model on the meta device and initialise it after sharding
    (``models.build_meta_model`` + ``models.init_weights``), as FSDP2 users do for models that
    do not fit on one device: no rank ever holds the whole model. The weights are
    ``build_model(cfg.model, cfg.seed)``'s, bit for bit. The other strategies build it whole.
    """
    spec = get(cfg.strategy)
    if spec.is_fsdp and cfg.options.get("api", "fsdp2") == "fsdp2":
        model = build_meta_model(cfg.model)
    else:
        model = build_model(get_config(cfg.model), seed=cfg.seed, device=info.device)
    return resolve_strategy(cfg.strategy)(model, cfg, info)


def run_steps(
    prepared: Prepared,
    cfg: TrainConfig,
    info,
    steps,
    observers=(),
    *,
    rank: int | None = None,
    world: int | None = None,
) -> list[torch.Tensor]:
    """The training loop: every run of the course steps through here (notebook 02).

    Args:
        prepared: what a strategy's ``apply_*`` returned (model, optimizer, ``before_step``).
        cfg: the run's ``TrainConfig`` (model, global batch, seed pick the data).
        info: this rank's ``DistInfo`` (device, rank, world size).
        steps: the step numbers to run, e.g. ``range(start, cfg.steps)``; step k always sees
            the same global batch (``data.batch_for_rank``).
        observers: ``instrument.Observer`` objects that watch the loop (bytes held, bytes sent,
            timelines, socket bytes, per-step hooks); none in a timing run.
        rank, world: the share of the batch to train on, if not this rank's (the one-process
            reference on rank 0 uses ``rank=0, world=1``: the whole global batch).

    Returns this rank's loss of each step, detached and still on the device: the loop never
    waits for the device (``global_mean_losses`` fetches them once, at the end).
    """
    mcfg = get_config(cfg.model)
    rank = info.rank if rank is None else rank
    world = info.world_size if world is None else world
    losses: list[torch.Tensor] = []
    counters = [o.comm for o in observers if isinstance(o, CountCollectives)]

    def tell(hook: str, *args) -> None:
        for comm in counters:  # watching is not training: its collectives are not counted
            comm.paused = True
        for observer in observers:
            getattr(observer, hook)(*args)
        for comm in counters:
            comm.paused = False

    for observer in observers:
        observer.start()
    try:
        for step in steps:
            x, y = batch_for_rank(
                step, rank, world, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed, device=info.device
            )
            tell("before_forward", step)
            loss = prepared.model(x, y)
            tell("after_forward", step, loss)
            loss.backward()
            tell("after_backward", step)
            prepared.before_step()
            tell("before_update", step)
            prepared.optimizer.step()
            tell("after_update", step)
            prepared.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            tell("after_step", step, losses)
    finally:
        for observer in reversed(observers):
            observer.stop()
    return losses
