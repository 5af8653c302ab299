"""What a TorchFT run is: ``FTConfig``, its fields and their checks (notebook 06).

R replica groups of one process each, K steps, at most one planned failure (a kill or a hang), synchronous
DDP or DiLoCo, on loopback or across cluster nodes. ``validate`` refuses a run that cannot happen in one
sentence; ``train_config`` is the same run as ``train.TrainConfig`` sees it. ``ft.ft_run`` runs one;
``ft_groups`` is one replica group's process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CourseInputError
from .strategies import DDP
from .validate import check_values


@dataclass
class FTConfig:
    """One TorchFT run: R replica groups of one process each, K steps, one planned failure (notebook 06)."""

    replicas: int = 2  # replica groups (R); each holds the whole model
    steps: int = 16  # committed steps every group ends at (K)
    kill: str | None = None  # "REPLICA:STEP": that group dies at that step (first attempt only)
    during_allreduce: bool = False  # die inside the step's all-reduce (DiLoCo: its round's), not between steps
    # The job manager restarts the dead group once the survivors have committed this many steps
    # without it, so the run shows both phases on any machine (None: the group stays dead). A real job
    # manager restarts as soon as it can, and a restart (new process, imports, joining) takes seconds to
    # minutes.
    restart_after: int | None = 2
    # A short run must still show the healed group training: the survivors' last AFTER_HEAL steps wait
    # for a dead group that is being restarted (a real job has thousands of steps left after a restart).
    # The healed group then commits at least AFTER_HEAL steps with them (DiLoCo: AFTER_HEAL - 1 rounds of H).
    after_heal: int = 3
    diloco: bool = False  # synchronise every SYNC_EVERY steps (torchft's DiLoCo) instead of every step
    sync_every: int = 4  # H: local steps between two synchronisations (DiLoCo)
    outer_lr: float = 0.7  # DiLoCo's outer SGD (Nesterov, momentum 0.9), as torchft's train_diloco.py example
    hang: str | None = None  # "REPLICA:STEP": that group's Python stops for ever before that step
    heal_optimizer: bool = True  # False: the mistake to compare with, a heal that copies the weights only
    link: str | None = None  # None: loopback; "20mbit": two cluster nodes joined by that link (root)
    model: str = "tiny"
    batch: int = 8  # global batch per step, split across the R groups
    lr: float = 3e-3
    seed: int = 0
    # How long the lighthouse waits for a silent group's heartbeat before it forms a quorum without
    # it (torchft's default is 5000 ms). 1000 ms keeps a notebook run short and is still 10 of the
    # managers' 100 ms heartbeats: a busy CPU does not miss that many.
    heartbeat_timeout_ms: int = 1000
    quorum_timeout_s: float | None = None  # a group waiting longer for a quorum raises (None: timeout_s)
    timeout_s: float = 60.0  # the whole run; everything is stopped after it

    def validate(self) -> FTConfig:
        check_values("ft", self)  # types and stated ranges (course_utils.validate)

        def whole(name, low, value=None):
            value = getattr(self, name) if value is None else value
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise CourseInputError(f"--{name.replace('_', '-')} must be a whole number >= {low}, got {value!r}")

        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or not 2 <= self.replicas <= 8:
            raise CourseInputError(
                f"--replicas must be a whole number from 2 to 8 (one group to lose, one to survive; each group "
                f"is a process of this machine), got {self.replicas!r}"
            )
        if isinstance(self.batch, int) and self.batch >= 1 and self.batch % self.replicas:
            raise CourseInputError(
                f"--batch {self.batch} does not split across {self.replicas} replica groups; "
                f"pick a multiple of {self.replicas}"
            )
        self.train_config()  # steps, lr, model, seed: the checks train.py makes
        for name in ("kill", "hang"):
            spots = self.planned(name)
            if len(spots) > 1:
                raise CourseInputError(f"--{name} takes one REPLICA:STEP, got {getattr(self, name)!r}")
            for replica, step in spots:
                if not 0 <= replica < self.replicas or not 0 <= step < self.steps:
                    raise CourseInputError(
                        f"--{name} {getattr(self, name)}: REPLICA must be in 0..{self.replicas - 1} and STEP in "
                        f"0..{self.steps - 1} (a step the run reaches)"
                    )
        if self.during_allreduce and not self.kill:
            raise CourseInputError("--during-allreduce needs --kill REPLICA:STEP (which group dies, and when)")
        if self.kill and self.hang:
            raise CourseInputError("--kill and --hang: one planned failure per run; pick one")
        if self.restart_after is not None:
            whole("restart_after", 0)
        whole("after_heal", 1)
        whole("sync_every", 1)
        if self.diloco and self.steps % self.sync_every:
            raise CourseInputError(
                f"--steps {self.steps} with --diloco must be a multiple of --sync-every {self.sync_every} "
                "(the run ends on a synchronisation, where every group holds the same weights)"
            )
        if not isinstance(self.outer_lr, (int, float)) or not math.isfinite(self.outer_lr) or self.outer_lr <= 0:
            raise CourseInputError(f"--outer-lr must be a finite number > 0, got {self.outer_lr!r}")
        if not isinstance(self.heartbeat_timeout_ms, int) or not 200 <= self.heartbeat_timeout_ms <= 600_000:
            raise CourseInputError(
                f"--heartbeat-timeout-ms must be a whole number from 200 to 600000, got {self.heartbeat_timeout_ms!r}"
            )
        for name in ("timeout_s", "quorum_timeout_s"):
            value = getattr(self, name)
            if name == "quorum_timeout_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
                raise CourseInputError(f"--{name.replace('_', '-')} must be seconds in (0, 86400], got {value!r}")
        if self.link is not None:
            from .namespaces import parse_link

            if parse_link(self.link).delay:
                raise CourseInputError(f"--link {self.link}: give a rate only (e.g. 20mbit); this kernel has no delay")
        return self

    def train_config(self):
        """The same run as ``train.TrainConfig`` sees it: R ranks of plain DDP (notebook 06)."""
        from .train import TrainConfig

        return TrainConfig(
            strategy=DDP.name,
            nproc=self.replicas,
            steps=self.steps,
            model=self.model,
            batch=self.batch,
            lr=self.lr,
            seed=self.seed,
        ).validate()

    def planned(self, name: str = "kill") -> list[tuple[int, int]]:
        """``[(replica, step)]`` of the planned kill (or ``name="hang"``), at most one (notebook 06)."""
        from .failures import parse_failures

        return parse_failures(getattr(self, name), f"--{name}")

    def kill_at(self) -> tuple[int, int] | None:
        """``(replica, step)`` of the planned failure, or None (notebook 06)."""
        kills = self.planned("kill")
        return kills[0] if kills else None
