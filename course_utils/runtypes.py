"""The run's types: what defines a run (``TrainConfig``) and what a strategy hands the loop (``Prepared``) (notebook 02).

A small module of its own, below the loop and the strategies' mechanism: the loop builds a
``Prepared`` from what a strategy's apply function returned (``loop.prepare``), the checkpointer saves
from it, the notebooks' experiments read it. It knows strategies only through the record.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .apply import options_for
from .errors import CourseInputError
from .failures import parse_failures
from .models import get_config
from .strategies import SINGLE, STRATEGIES, runnable
from .validate import check_values


@dataclass
class TrainConfig:
    """Everything that defines a run; two runs with equal configs see identical data (notebook 02)."""

    strategy: str = SINGLE.name  # a name of strategies.STRATEGIES
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
        strategy = runnable(self.strategy)
        for name in ("nproc", "steps", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CourseInputError(f"{name} must be a whole number >= 1, got {value!r}")
        if strategy.single_process and self.nproc != 1:
            raise CourseInputError(
                f"strategy {strategy.name!r} is the one-process reference; use --nproc 1 (or another strategy)"
            )
        if self.batch % self.nproc:
            raise CourseInputError(
                f"global batch {self.batch} does not divide by {self.nproc} ranks; "
                f"pick a batch that is a multiple of {self.nproc}"
            )
        if self.precision not in ("fp32", "mixed"):
            raise CourseInputError(f"precision must be 'fp32' or 'mixed', got {self.precision!r}")
        strategy.mesh_shape(self.nproc, self.node_size)  # hybrid_shard: nproc must divide by node_size
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
        options_for(runnable(self.strategy), self, with_knobs=[s for s in STRATEGIES.values() if s.knobs])
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
