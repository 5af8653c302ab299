"""What a failure cost: each attempt of a run, the steps it redid and the time it lost (notebook 06).

torchrun restarts a failed group; nothing in torchrun says what the restart cost. Every attempt of
a run that checkpoints leaves a record here (rank 0 writes it, in the checkpoint folder)::

    D/_runs/<run id>/attempt_<n>.json   where the attempt started, what it resumed from, how far it
                                         got, and the wall clock when it resumed and finished each step

From those records: the steps each restart redid (``redone_per_restart``) and the time each failure
cost (``time_lost_per_restart``); from the launcher's per-rank logs, how each rank of each attempt
ended (``attempt_logs``). ``expected_resume`` is the arithmetic the measurements are held against.

This module only counts; the checkpoints themselves are ``course_utils.checkpoint`` and the failures
``course_utils.failures``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ._agent import CUT_SHORT, LOST_PEER, STOPPED, read_error_file

#: The line ``train_worker`` logs once its last step is done; only a rank that wrote it finished.
FINISHED_LINE = "finished training"

#: How a rank's process ended, read from its error file (torch's ``@record``) and its output.
ENDINGS = {
    "stopped": "stopped by the agent (SIGTERM)",
    "lost_peer": "its collective lost a peer, then it raised",
    "died": "died hard (no Python error)",
    "raised": "raised an error",
    "finished": "finished",
    "killed": "killed before Python could say why (no error file, never finished)",
}


def run_id() -> str:
    """torchrun's run id (the same for every attempt of a run); a plain process is a run of its own."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"local-{uuid.uuid4().hex[:8]}"


@dataclass
class Attempt:
    """One attempt of a run: where it started, what it resumed from, how far it got (notebook 06)."""

    attempt: int
    world_size: int
    start: int
    resumed_from: int | None
    reached: int
    complete_seen: list
    incomplete_seen: list
    resumed_at: float = 0.0  # wall clock (time.time()) once the checkpoint was loaded
    done_at: list = field(default_factory=list)  # wall clock when start + 1, start + 2, ... steps were done


class AttemptLog:
    """The records of one run's attempts under ``root/_runs/<run id>/`` (rank 0 writes; notebook 06)."""

    def __init__(self, root, info):
        self.info = info
        self.run_id = run_id()
        self.folder = Path(root) / "_runs" / self.run_id
        self.attempt: Attempt | None = None

    def begin(self, start: int, resumed_from: int | None, seen: dict) -> None:
        """This attempt starts at step ``start`` (resumed from ``resumed_from``, having seen ``seen`` on disk)."""
        self.attempt = Attempt(
            self.info.restart_count,
            self.info.world_size,
            start,
            resumed_from,
            start,
            seen["complete"],
            seen["incomplete"],
            resumed_at=time.time(),
        )
        self._write()

    def step_done(self, done: int) -> None:
        """``done`` steps are in the weights."""
        self.attempt.reached = done
        self.attempt.done_at.append(time.time())
        self._write()

    def _write(self) -> None:
        if self.info.rank == 0:  # temp file and rename: a reader never sees half a record
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"attempt_{self.attempt.attempt}.json"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(vars(self.attempt)))
            os.replace(tmp, path)

    def wait_until_recorded(self, done: int, timeout_s: float = 30.0) -> None:
        """Wait until rank 0 has recorded ``done`` completed steps of this attempt (``failures.FailOnPurpose``)."""
        path = self.folder / f"attempt_{self.attempt.attempt}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if json.loads(path.read_text())["reached"] >= done:
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)

    def attempts(self) -> list[dict]:
        """Every attempt of this run so far, in order."""
        rows = [json.loads(Path(f).read_text()) for f in glob.glob(str(self.folder / "attempt_*.json"))]
        return sorted(rows, key=lambda r: r["attempt"])

    def report(self) -> dict:
        """``restarts``, ``resumed_from`` (the step of each resume), ``steps_redone``, ``time_lost``, the attempts."""
        rows = self.attempts() if self.info.rank == 0 else []
        redone = redone_per_restart(rows)
        return {
            "restarts": self.info.restart_count,  # a restart with no checkpoint yet resumes from 0
            "resumed_from": [r["start"] for r in rows if r["attempt"] > 0 or r["resumed_from"] is not None],
            "steps_redone": sum(redone),
            "redone_per_restart": redone,
            "attempts": rows,
            "time_lost": time_lost_per_restart(rows),
            "run_id": self.run_id,
        }


def redone_per_restart(attempts: list[dict]) -> list[int]:
    """Steps each restart had to redo: how far the attempt before got, minus where this one started (notebook 06).

    Only completed steps count (their optimizer update was applied, then lost); the step that
    was in flight when the rank died is lost too, half done on average.
    """
    return [max(0, prev["reached"] - cur["start"]) for prev, cur in zip(attempts, attempts[1:])]


def time_lost_per_restart(attempts: list[dict]) -> list[dict]:
    """Wall-clock time each failure cost, read from the attempts' records (rank 0's clock; notebook 06).

    From the moment the failed attempt began the step it never finished (its last step done) to the
    moment the next attempt had done as many steps again: ``restart_s`` (the dead rank noticed, the
    survivors stopped, new processes, rendezvous, the checkpoint loaded) plus ``redo_s`` (the
    completed steps done a second time). The step in flight is inside ``restart_s``. ``None`` where
    the next attempt never caught up (it failed first).
    """
    rows = []
    for prev, cur in zip(attempts, attempts[1:]):
        stopped = prev["done_at"][-1] if prev.get("done_at") else prev.get("resumed_at")
        behind = prev["reached"] - cur["start"]
        caught = (
            cur["resumed_at"]
            if behind <= 0
            else (cur["done_at"][behind - 1] if len(cur.get("done_at") or []) >= behind else None)
        )
        if stopped is None or caught is None:
            rows.append(None)
            continue
        rows.append(
            {
                "redone": max(0, behind),
                "restart_s": cur["resumed_at"] - stopped,
                "redo_s": caught - cur["resumed_at"],
                "lost_s": caught - stopped,
            }
        )
    return rows


def expected_resume(fail_step: int, every: int) -> tuple[int, int]:
    """``(checkpoint resumed from, steps redone)`` when a rank dies during step f, saving every K (notebook 06).

    Checkpoints exist after K, 2K, ... steps, so the newest before step f is ⌊f/K⌋·K, and
    the f − ⌊f/K⌋·K = f mod K completed steps since it are redone. Averaged over f, that is
    (K − 1)/2 whole steps, plus the step in flight: K/2 steps of work, half an interval.
    """
    last = (fail_step // every) * every if every else 0
    return last, fail_step - last


def lost_work_row(report: dict, every: int, fail_steps: list) -> dict:
    """One point of the lost-work chart from a run's report: steps redone per restart, their mean (notebook 06).

    ``every_position`` is True when the failures hit each position f mod K exactly once: only
    then is the mean the average over a uniformly placed failure, (K − 1)/2.
    """
    redone = report["redone_per_restart"]
    return {
        "every": every,
        "fail_at": list(fail_steps),
        "redone": redone,
        "resumed_from": report["resumed_from"],
        "time_lost": report["time_lost"],
        "mean_redone": sum(redone) / len(redone),
        "expected_mean": (every - 1) / 2,
        "every_position": sorted(f % every for f in fail_steps) == list(range(every)),
    }


def _ending(error_text: str, lines: list[str]) -> str:
    """How one rank's process ended, from its error file's text and its output lines."""
    if any(c in error_text for c in STOPPED):
        return ENDINGS["stopped"]
    if any(c in error_text for c in LOST_PEER):
        return ENDINGS["lost_peer"]
    if error_text:
        return ENDINGS["raised"]
    if any("dying hard" in ln for ln in lines):
        return ENDINGS["died"]
    if any(FINISHED_LINE in ln for ln in lines):
        return ENDINGS["finished"]
    return ENDINGS["killed"]  # e.g. stuck in a collective when the agent's SIGTERM grace ran out, then SIGKILLed


def attempt_logs(checkpoint_dir, run: str) -> list[dict]:
    """Per attempt and rank of a ``train()`` run: last step done and how the process ended (notebook 06).

    ``train()`` keeps the launcher's per-rank logs under ``checkpoint_dir/_launch/logs/<run id>_*/
    attempt_<n>/<rank>/`` (stdout.log, and error.json when Python saw an error). Rows:
    ``{"attempt", "rank", "last_step_done", "ending", "first_line", "last_line"}``.
    """
    rows = []
    pattern = os.path.join(str(checkpoint_dir), "_launch", "logs", f"{run}_*", "attempt_*", "*")
    for folder in glob.glob(pattern):
        attempt, rank = int(Path(folder).parent.name.split("_")[1]), int(Path(folder).name)
        out = Path(folder, "stdout.log")
        lines = [ln for ln in (out.read_text().splitlines() if out.exists() else []) if ln.strip()]
        done = [int(m.group(1)) for ln in lines for m in [re.search(r"step (\d+) done", ln)] if m]
        error = Path(folder, "error.json")
        text = ""
        if error.exists():
            data = read_error_file(error)  # {}: no whole JSON document, the agent stopped the rank mid-write
            text = data.get("message", "") if data else CUT_SHORT
        text = text.get("message", "") if isinstance(text, dict) else str(text)
        rows.append(
            {
                "attempt": attempt,
                "rank": rank,
                "last_step_done": max(done) if done else None,
                "ending": _ending(text, lines),
                "first_line": lines[0] if lines else "",
                "last_line": lines[-1] if lines else "",
            }
        )
    return sorted(rows, key=lambda r: (r["attempt"], r["rank"]))
