"""Failure injection: a rank that dies on purpose, where and when a run asks (notebook 06).

torchrun's failure contract is taught on real failures: ``--fail-at RANK:STEP`` makes that rank
die hard during that step (after its forward pass, while its peers wait for its gradients), and
``--fail-during-save RANK:STEP`` makes it die after writing its pieces of that step's checkpoint,
before the checkpoint is committed. A list (``1:3,0:5``) injects one failure per attempt, so a
restarted group meets the next one.

This module only kills; what a failure cost (steps redone, time lost) is ``course_utils.recovery``,
and what survives it is ``course_utils.checkpoint``.
"""

from __future__ import annotations

import os

from . import dist as cdist
from .errors import CourseInputError
from .instrument import Observer


def parse_failures(text: str | None, flag: str = "--fail-at") -> list[tuple[int, int]]:
    """``"1:5"`` -> ``[(1, 5)]``; ``"1:5,0:7"``: item i fires on attempt i (notebook 06).

    One item is the usual case: rank 1 dies at step 5 on the first attempt only, so the
    restarted group can finish. A list injects one failure per attempt (a sweep in one launch,
    or more failures than ``max_restarts`` allows).
    """
    if not text:
        return []
    out = []
    for item in str(text).split(","):
        rank, sep, step = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((int(rank), int(step)))
        except ValueError:
            raise CourseInputError(
                f"{flag} takes RANK:STEP (e.g. 1:5), or one per attempt: 1:5,0:7; got {text!r}"
            ) from None
    return out


def planned_failure(text: str | None, rank: int, attempt: int) -> int | None:
    """The step at which this rank dies on this attempt, or None (notebook 06)."""
    items = parse_failures(text)
    if attempt < len(items) and items[attempt][0] == rank:
        return items[attempt][1]
    return None


def die_hard(reason: str) -> None:
    """Exit at once with no clean-up and no Python error: what a lost GPU looks like (notebook 06).

    ``os._exit`` skips ``finally`` blocks, the error file of ``@record`` and the process
    group's shutdown, so the peers only notice that a connection closed.
    """
    cdist.log(f"dying hard: {reason} (os._exit(1), no clean-up)")
    os._exit(1)


class FailOnPurpose(Observer):
    """This rank dies hard mid-step, after its forward pass: its peers wait for its gradients (notebook 06).

    ``log`` (a ``recovery.AttemptLog``, or None) makes the rank first wait until rank 0 has recorded
    the steps before: a faster rank reaching the failure while rank 0 still finishes the previous
    step would otherwise make the steps a restart redoes depend on which rank was faster.
    """

    def __init__(self, fail_step: int | None, info, log=None):
        self.fail_step, self.info, self.log = fail_step, info, log

    @classmethod
    def planned(cls, cfg, info, log=None) -> FailOnPurpose:
        """The observer for ``cfg.fail_at`` on this rank and attempt (it does nothing when none is due)."""
        return cls(planned_failure(cfg.fail_at, info.rank, info.restart_count), info, log)

    def after_forward(self, step: int, loss) -> None:
        if step == self.fail_step:
            if self.log is not None:
                self.log.wait_until_recorded(step)
            die_hard(f"fail_at {self.info.rank}:{step} on attempt {self.info.restart_count}")


def dying_writer(path, reason: str):
    """A DCP storage writer that writes this rank's pieces, then dies before the commit (``--fail-during-save``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            die_hard(reason)

    return Writer(path)


__all__ = ["parse_failures", "planned_failure", "die_hard", "FailOnPurpose", "dying_writer"]
