"""Checkpoints that survive a lost rank: sharded, complete-only, verified, one folder per step (notebook 06).

The failure contract of torchrun: when one worker dies, the collective it was part of cannot
finish; the agent stops every survivor and restarts the whole group, up to ``max_restarts``
times; RANK (and, with elastic min/max, the world size) may differ after the restart. Nothing
in torchrun restores training: the script must load the last *complete* checkpoint and redo
the steps since. This module is that half of the contract, and only that: what is on disk is
``course_utils.checkpoint_files``, what each strategy saves ``course_utils.checkpoint_state``,
the failures injected to teach it ``course_utils.failures``, and what a restart cost
``course_utils.recovery``.

Rules (each one a failure seen in real jobs):

- A save writes into a fresh ``.partial`` folder and becomes ``step-N/`` by a rename only
  after DCP finished on every rank, a barrier, and rank 0 writing ``commit.json``. It never
  writes into an existing step folder: a save that died there would leave the old
  ``.metadata`` beside new data files, a torn checkpoint that loads silently.
- Pieces are keyed by what they are (a parameter's name and its offset in the global tensor, which
  DCP records), never by the rank that wrote them: ranks move and world sizes change.
- The newest ``keep`` (>= 2) complete checkpoints are kept; a step counts as saved only when
  its checkpoint is complete (as in torchtitan). A save that fails (a full disk) leaves the
  complete checkpoints as they were and says so in one line.
- **A checkpoint is code** (DCP's index and byte entries are pickles): a resume reads the commit
  record as JSON and compares every file with the SHA-256 written at save time before anything
  is unpickled, then reads through ``checkpoint_files.safe_reader``/``safe_planner``. Load only
  checkpoints you wrote.
- After loading, everything loaded (weights, optimizer state, step, data position, RNG, the loss
  history) is checked against checksums written at save time (``checksums.state_checksums``: sums
  over shards, so they compare across world sizes and strategies).
- A checkpoint that cannot be resumed, for any reason, is set aside under ``_rejected/`` with a
  note saying why, never deleted, and the one before is tried. Rank 0 alone decides which steps
  to try and broadcasts that list: on a shared filesystem two ranks can see different folders.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import dist as cdist
from .checkpoint_files import (
    COMMIT,
    METADATA,
    MUST_MATCH,
    _first_line,
    check_marker,
    check_resume,
    copy_checkpoint,
    dcp_chunks,
    file_record,
    fsync_dir,
    is_complete,
    latest_complete,
    load_weights,
    nothing_left_to_resume,
    prune,
    read_commit,
    read_index,
    safe_planner,
    safe_reader,
    scan,
    set_aside,
    step_dir,
    verify_files,
    write_json_atomically,
)
from .checkpoint_state import (
    _inner,
    format_mismatch,
    rank0_full_weights,
    rank_local_state,
    state_format,
    state_of,
)
from .checksums import checksum_problems, state_checksums
from .errors import CourseInputError
from .failures import dying_writer, planned_failure
from .instrument import Observer
from .recovery import AttemptLog

__all__ = [
    "COMMIT",
    "METADATA",
    "MUST_MATCH",
    "Checkpointer",
    "CheckpointUnusable",
    "CheckpointWriteFailed",
    "check_marker",
    "check_resume",
    "copy_checkpoint",
    "dcp_chunks",
    "format_mismatch",
    "is_complete",
    "latest_complete",
    "load",
    "load_weights",
    "prune",
    "rank0_full_weights",
    "read_commit",
    "read_index",
    "save",
    "scan",
    "set_aside",
    "state_format",
    "state_of",
    "step_dir",
    "_inner",
]


class CheckpointUnusable(Exception):
    """A checkpoint that cannot be resumed: unreadable, torn, or its hashes or checksums disagree (notebook 06)."""


class CheckpointWriteFailed(CourseInputError):
    """A save failed (a full disk, a folder that cannot be written); the complete checkpoints are kept (notebook 06)."""


# ---------------------------------------------------------------- save (collective)


def save(
    root,
    step: int,
    prepared,
    info,
    *,
    batch: int,
    strategy: str = "",
    extra: dict | None = None,
    keep: int = 2,
    die: bool = False,
) -> Path:
    """Write the checkpoint after ``step`` optimizer steps; every rank calls it (notebook 06).

    Rank 0 creates a fresh ``.step-N-*.partial`` folder; every rank writes its pieces with DCP (whose
    coordinator writes ``.metadata`` last) and checksums what it saved (``state_checksums``); the full
    weights are gathered to rank 0's CPU for ``weights_sha256``; after a barrier rank 0 writes
    ``commit.json`` (checksums, each file's size and SHA-256), renames the folder to ``step-N`` and
    prunes; a last barrier makes the step saved on every rank. The loss history (``extra["losses"]``)
    is saved as a tensor too, so its checksum covers it. A save that fails on any rank raises
    ``CheckpointWriteFailed`` on every rank, removes its ``.partial`` folder and leaves the complete
    checkpoints as they were. ``die=True``: this rank dies hard after writing its pieces.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .instrument import weights_sha256

    root, extra = Path(root), dict(extra or {})
    partial = _fresh_partial(root, step, info)
    source = state_of(prepared, strategy)
    state = {**source.get(), **rank_local_state(info, step, batch), "step": torch.tensor(step)}
    state["losses"] = torch.tensor(extra.get("losses", []), dtype=torch.float64)
    reason, writer = None, dying_writer(partial, f"fail_during_save at step-{step}") if die else None
    try:
        dcp.save(state, storage_writer=writer or dcp.FileSystemWriter(partial))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        reason = _disk_error(exc, root, step)
    _agree_or_raise(reason, info, partial)
    sums = state_checksums(state, info)
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, sums)
    full = rank0_full_weights(prepared, strategy)
    dist.barrier()
    reason = None
    if info.rank == 0:
        marker = {
            "step": step,
            "world_size": info.world_size,
            "strategy": strategy,
            "format": source.format,
            "weights_sha256": weights_sha256(full),
            "saved_at": time.time(),
            **source.layout(),
            **extra,
        }
        try:
            _commit(root, partial, step, keep, marker, everyone)
        except OSError as exc:
            reason = _disk_error(exc, root, step)
    _agree_or_raise(reason, info, partial)
    return step_dir(root, step)


def _fresh_partial(root: Path, step: int, info) -> Path:
    """Rank 0 creates a fresh ``.step-N-*.partial`` folder and tells the others its name (collective)."""
    holder = [None]
    if info.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            holder[0] = tempfile.mkdtemp(prefix=f".step-{step}-", suffix=".partial", dir=root)
        except OSError as exc:
            holder[0] = {"error": _disk_error(exc, root, step)}
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], dict):
        raise CheckpointWriteFailed(holder[0]["error"])
    return Path(holder[0])


def _commit(root: Path, partial: Path, step: int, keep: int, marker: dict, everyone: list) -> None:
    """Rank 0: the commit record (checksums, each file's size and SHA-256), the rename that makes the
    folder ``step-N``, then what ``keep`` no longer needs."""
    checksums = {}
    for rank_sums in everyone:  # replicated entries from rank 0; rank-local ones from their rank
        checksums.update({k: v for k, v in rank_sums.items() if k not in checksums})
    write_json_atomically(partial / COMMIT, {**marker, "checksums": checksums, "files": file_record(partial)})
    final = step_dir(root, step)
    if final.exists():  # a redone step: the new complete save replaces the old one whole
        old = root / f".replaced-{final.name}-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(partial, final)
    fsync_dir(root)
    prune(root, keep)


def _disk_error(exc: BaseException, root: Path, step: int) -> str:
    """One line for a save that failed: the cause named (ENOSPC above all), what is kept, what to do.

    torch's writer reports a failed write without its errno ("PytorchStreamWriter failed writing
    file"), so a full disk is also recognised by trying to write there now.
    """
    full = getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc) or _disk_full(root)
    cause = "no space left on the device (ENOSPC)" if full else _first_line(exc)
    kept = latest_complete(root)
    text = (
        f"saving step-{step} in {root} failed: {cause}; "
        + (f"the complete checkpoint step-{kept} is kept" if kept is not None else "no complete checkpoint was lost")
        + ("; free space there and run the same command again" if full else "; fix that and run the same command again")
    )
    return " ".join(text.split())


def _disk_full(root: Path) -> bool:
    """Whether writing 64 KiB in ``root`` fails with ENOSPC now."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".space-", dir=root)
    except OSError as exc:
        return exc.errno == errno.ENOSPC
    try:
        os.write(fd, b"\0" * 65536)
        os.fsync(fd)
        return False
    except OSError as exc:
        return exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
        os.unlink(probe)


def _agree_or_raise(reason: str | None, info, partial: Path) -> None:
    """Every rank learns whether any rank's save failed; then rank 0 removes the dead save's folder."""
    reasons = [None] * info.world_size
    dist.all_gather_object(reasons, reason)
    found = [r for r in reasons if r]
    if found:
        if info.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # its space back, and nothing half-written left
        raise CheckpointWriteFailed(found[0])


# ---------------------------------------------------------------- load and verify (collective)


def load(root, step: int, prepared, info, *, strategy: str = "") -> dict:
    """Load ``root/step-N`` into this rank's model and optimizer, at any world size (notebook 06).

    Every rank first checks the folder's files against their recorded hashes (nothing unpickled
    before that), then asks DCP, through ``safe_reader``/``safe_planner``, for exactly the pieces
    its own (possibly differently sharded) tensors need; DCP reads them by global offset.
    Rank-local state is loaded if this rank saved one (a world that grew has ranks that did not).
    Then every entry loaded (weights, optimizer state, step, data position, RNG, loss history) is
    checksummed as the model and optimizer now hold it and compared with the checksum written at
    save time. Returns the commit record, with ``"verified": True``; raises ``CheckpointUnusable``
    (on every rank alike) when the files do not match, cannot be read or a checksum differs,
    ``CourseInputError`` when the checkpoint belongs to a strategy whose state cannot be loaded here.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = step_dir(root, step)
    _agree(verify_files(root, step), info)
    marker = read_commit(root, step)
    source = state_of(prepared, strategy)
    if marker["format"] != source.format:
        raise CourseInputError(format_mismatch(path, marker, strategy, source.format))
    if source.layout() and source.layout() != {k: marker.get(k) for k in source.layout()}:
        raise CourseInputError(
            f"{path} holds flat buffers of another layout (bucket size?); use the same "
            "--bucket-cap-mb as the run that saved it, or a fresh --checkpoint-dir"
        )
    reason, saved = None, {}
    try:  # each rank reads the index on its own: agree on the outcome before any collective
        saved = safe_reader(path).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
        reason = f"its {METADATA} cannot be read: {_first_line(exc)}"
    _agree(reason, info)
    local = {k: v for k, v in rank_local_state(info, step, 0).items() if k in saved}
    losses = torch.zeros(step, dtype=torch.float64)
    state = {**source.get(), **local, "step": torch.tensor(-1), "losses": losses}
    try:  # DCP gathers every rank's read errors and raises them on every rank alike
        dcp.load(state, storage_reader=safe_reader(path), planner=safe_planner())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        reason = f"loading failed: {_first_line(exc)}"
    _agree(reason, info)
    source.set(state)
    problems = _problems_after_load(state, local, source, marker, step, info)
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, problems)
    ranks: dict[str, list[int]] = {}
    for i, rows in enumerate(everyone):
        for p in rows:
            ranks.setdefault(p, []).append(i)
    if ranks:  # one clause per problem, with the ranks that saw it
        found = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {p}" for p, rs in ranks.items()]
        raise CheckpointUnusable("; ".join(found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else ""))
    return {**marker, "losses": state["losses"].tolist(), "verified": True}


def _problems_after_load(state: dict, local: dict, source, marker: dict, step: int, info) -> list[str]:
    """What a loaded checkpoint gets wrong on this rank: step, data position, RNG, loss history, checksums."""
    r, problems = info.rank, []
    if int(state["step"]) != step:
        problems.append(f"it holds step {int(state['step'])}, its name says {step}")
    if f"data.rank{r}" in state and int(state[f"data.rank{r}"][0]) != step:
        problems.append(f"rank {r}'s saved data position is at step {int(state[f'data.rank{r}'][0])}, not {step}")
    if state["losses"].tolist() != list(marker.get("losses", [])):
        problems.append(f"the loss history in its {COMMIT} is not the one saved with the weights")
    try:  # a damaged generator state can be refused here, before its checksum is compared
        if f"rng.rank{r}" in state:
            torch.set_rng_state(state[f"rng.rank{r}"])
        if f"cuda_rng.rank{r}" in state and info.device.type == "cuda":
            torch.cuda.set_rng_state(state[f"cuda_rng.rank{r}"], info.device)
    except RuntimeError as exc:
        problems.append(f"rank {r}'s RNG state cannot be restored: {_first_line(exc)}")
    # what the model and optimizer now hold, and the rank-local state as it was read
    live = {**source.get(), **{k: state[k] for k in local}, "step": state["step"], "losses": state["losses"]}
    mismatch = checksum_problems(state_checksums(live, info), marker.get("checksums", {}))
    if mismatch:
        problems.append(
            f"checksum of {mismatch[0]}" + (f" (and {len(mismatch) - 1} more)" if len(mismatch) > 1 else "")
        )
    return problems


def _agree(reason: str | None, info) -> None:
    """Raise ``CheckpointUnusable`` on every rank if any rank found a reason (collective)."""
    reasons = [None] * info.world_size
    dist.all_gather_object(reasons, reason)
    found = [f"rank {i}: {r}" for i, r in enumerate(reasons) if r]
    if found:
        raise CheckpointUnusable(found[0] + (f" (and {len(found) - 1} more rank(s))" if len(found) > 1 else ""))


# ---------------------------------------------------------------- the training loop's side


class Checkpointer:
    """The training loop's checkpoint and resume logic, one object per rank (notebook 06).

    ``resume()`` at start (load the newest checkpoint that verifies); ``after_step(n, local_losses)``
    after each step (save every K steps); ``report()`` for the JSON report. What each attempt did is
    recorded by ``self.log`` (``course_utils.recovery.AttemptLog``).
    """

    def __init__(self, cfg, prepared, info):
        self.cfg, self.prepared, self.info = cfg, prepared, info
        self.root = Path(cfg.checkpoint_dir)
        self.log = AttemptLog(self.root, info)
        self.history: list[float] = []  # global mean loss of every step before this attempt
        self.die_in_save = planned_failure(cfg.fail_during_save, info.rank, info.restart_count)

    def resume(self) -> int:
        """Load the newest checkpoint that verifies; return the step to start from (collective).

        Rank 0 alone looks at the folder and decides the order to try (newest first); every
        rank follows that one list, so ranks on a shared filesystem cannot pick different steps.
        A checkpoint that fails its checks is set aside under ``_rejected/`` with one line
        saying why, and the next one is tried; if none verifies, the run stops with one error.
        """
        plan = [None]
        if self.info.rank == 0:
            try:
                plan[0] = self._resume_plan()
            except CourseInputError as exc:  # every rank raises it, not only rank 0
                plan[0] = {"error": str(exc)}
        dist.broadcast_object_list(plan, src=0)
        if "error" in plan[0]:
            raise CourseInputError(plan[0]["error"])
        seen, candidates, rejected = plan[0]["seen"], plan[0]["candidates"], list(plan[0]["rejected"])
        step = None
        for candidate in candidates:
            try:
                marker = load(self.root, candidate, self.prepared, self.info, strategy=self.cfg.strategy)
            except CheckpointUnusable as exc:
                rejected.append((f"step-{candidate}", str(exc)))
                self._set_aside(f"step-{candidate}", str(exc))
                continue
            step, self.history = candidate, list(marker["losses"])
            cdist.log(
                f"attempt {self.info.restart_count}: resumed from step-{step} "
                f"(saved by {marker['world_size']} ranks, every file hash and checksum verified)"
            )
            break
        if step is None and rejected:
            raise CourseInputError(
                f"no checkpoint in {self.root} can be resumed ({'; '.join(f'{n}: {why}' for n, why in rejected)}); "
                f"they were moved to {self.root / '_rejected'}; start over with a fresh --checkpoint-dir"
            )
        if step is None:
            cdist.log(f"attempt {self.info.restart_count}: no complete checkpoint, starting at step 0")
        self.log.begin(step or 0, step, seen)
        return step or 0

    def _resume_plan(self) -> dict:
        """Rank 0's decision: the complete steps to try, newest first; every unusable one set aside with a note."""
        seen = scan(self.root)
        candidates, rejected = [], []
        for row in seen["incomplete"]:  # a step-N that is not complete is damage: kept, with why
            if row["name"].startswith("step-"):
                rejected.append((row["name"], row["why"]))
        for step in reversed(seen["complete"]):
            why = verify_files(self.root, step)
            if why:
                rejected.append((f"step-{step}", why))
                continue
            check_marker(self.root, step, self.cfg)  # another run's settings or strategy: an input error
            candidates.append(step)
        for name, why in rejected:
            self._set_aside(name, why)
        if not candidates and not rejected:
            nothing_left_to_resume(self.root)
        return {"seen": seen, "candidates": candidates, "rejected": rejected}

    def _set_aside(self, name: str, why: str) -> None:
        if self.info.rank == 0:
            dest = set_aside(self.root, name, why)
            cdist.log(f"{name} set aside, it cannot be resumed: {why} (kept in {dest})")

    def after_step(self, done: int, local_losses: list) -> None:
        """Step ``done - 1`` finished (``done`` steps are in the weights): log, record, maybe save."""
        cdist.log(f"step {done - 1} done, loss {float(local_losses[-1]):.4f}")
        self.log.step_done(done)
        k = self.cfg.checkpoint_every
        if k and done % k == 0:
            from .instrument import global_mean_losses

            history = self.history + global_mean_losses(local_losses, self.info)
            extra = {
                **{f: getattr(self.cfg, f) for f in MUST_MATCH},
                "bucket_cap_mb": self.cfg.bucket_cap_mb,
                "losses": history,
            }
            save(
                self.root,
                done,
                self.prepared,
                self.info,
                batch=self.cfg.batch,
                strategy=self.cfg.strategy,
                extra=extra,
                keep=self.cfg.keep_checkpoints,
                die=self.die_in_save == done,
            )
            cdist.log(f"saved step-{done}")

    def observer(self) -> Observer:
        """The loop's observer: after each step, ``after_step`` (log, record, save when due)."""
        return _Checkpointing(self)

    def report(self) -> dict:
        """``restarts``, ``resumed_from``, ``steps_redone``, ``time_lost``, the attempts, and the complete steps."""
        return {**self.log.report(), "checkpoints": scan(self.root)["complete"]}


class _Checkpointing(Observer):
    """After each step, the checkpointer logs, records and saves when it is due (notebook 06)."""

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def after_step(self, step: int, losses: list) -> None:
        self.ckpt.after_step(step + 1, losses)
