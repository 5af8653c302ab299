"""Notebook 06's exercises: the newest complete checkpoint, and resuming bit for bit.

References: ``checkpoint.latest_complete`` (what counts as complete: DCP's ``.metadata`` and our
``commit.json`` for that step), ``checkpoint.save`` (the course's DCP checkpoints) and an
uninterrupted run's final weights (``instrument.weights_sha256``).
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
from dataclasses import replace
from functools import cache
from pathlib import Path

import torch.distributed as dist

from .. import checkpoint
from .. import dist as cdist
from ..data import batch_for_rank
from ..instrument import weights_sha256
from ..launch import launch
from ..loop import TrainConfig, prepare
from ..models import get_config
from ..strategies import DDP
from .core import REFERENCE_LAUNCH, Exercise, Wrong, register


def _step(root: Path, name: str, *, metadata=True, commit_step=None, extra=()) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"pieces")
    if metadata:
        (folder / checkpoint.METADATA).write_bytes(b"meta")
    if commit_step is not None:
        (folder / checkpoint.COMMIT).write_text(json.dumps({"step": commit_step}))
    for f in extra:
        (folder / f).write_text("")


# (what the folder holds, how to build it)
SCENARIOS = [
    (
        "step-2 complete; step-4 has its pieces and .metadata but no commit.json (killed before the commit)",
        lambda r: (_step(r, "step-2", commit_step=2), _step(r, "step-4")),
    ),
    ("step-9 and step-10 complete", lambda r: (_step(r, "step-9", commit_step=9), _step(r, "step-10", commit_step=10))),
    (
        "step-6 complete; .step-8-x1.partial still being written, with .metadata and commit.json",
        lambda r: (_step(r, "step-6", commit_step=6), _step(r, ".step-8-x1.partial", commit_step=8)),
    ),
    ("step-3 whose commit.json says step 5 (a folder copied by hand)", lambda r: _step(r, "step-3", commit_step=5)),
    (
        "step-7 with a commit.json but no .metadata (DCP never finished); step-5 complete",
        lambda r: (_step(r, "step-7", metadata=False, commit_step=7), _step(r, "step-5", commit_step=5)),
    ),
    ("an empty folder", lambda r: None),
    ("_logs/ and step-1 complete", lambda r: ((r / "_logs").mkdir(), _step(r, "step-1", commit_step=1))),
]


def judge_newest_complete(fn) -> None:
    for text, build in SCENARIOS:
        with tempfile.TemporaryDirectory(prefix="ckpt-exercise-") as tmp:
            root = Path(tmp)
            build(root)
            want = checkpoint.latest_complete(root)
            got = fn(str(root))
            if got != want:
                raise Wrong(
                    f"in a folder with {text} you returned {got!r}, the newest complete checkpoint is "
                    f"{want!r}: a step-N folder counts only with DCP's .metadata and a commit.json that "
                    "names step N; compare steps as numbers; anything else is not a checkpoint"
                )
    missing = fn(str(Path(tempfile.gettempdir()) / "no-such-checkpoint-folder-for-the-exercise"))
    if missing is not None:
        raise Wrong(f"for a folder that does not exist you returned {missing!r}: return None (start from step 0)")


#: Speaker notes for the Exercises slide (``tools/exercise_cells.py`` puts them right after it).
EXTRA_CELLS = [
    (
        "markdown",
        "**Point:** the two exercises rebuild the two halves of the script's side of the contract: find the "
        "newest *complete* checkpoint, and resume from it bit for bit. **Ask:** a run killed while saving step 4 leaves "
        "what on disk, and where must it resume? (A folder without a commit marker; step 2.) **Remember:** each check "
        "compares with the course's own code on real ranks, and `show_hint` opens hints one at a time.",
        "notes",
    ),
]


register(
    Exercise(
        "06",
        "newest_complete",
        "The newest complete checkpoint",
        "the step returned for 8 folders (uncommitted, half-written, copied, empty, missing...) against "
        "checkpoint.latest_complete",
        task="Write `newest_complete(root)`: the step N of the newest complete checkpoint folder `root/step-N`, or "
        "`None`. A checkpoint is complete only when its folder holds DCP's `.metadata` *and* a `commit.json` "
        'whose `"step"` is N (written last, after every rank\'s pieces). Predict first: a run killed while '
        "saving step 4 leaves what, and where must the restart resume?",
        stub="def newest_complete(root):\n"
        '    """The newest N such that root/step-N is a complete checkpoint (.metadata and commit.json of step N), or None."""\n'
        '    raise NotImplementedError("exercise 06.newest_complete: your code here")\n',
        hints=(
            '`Path(root).glob("step-*")`, and `re.fullmatch(r"step-(\\d+)", name)` for the number.',
            'Check `(folder / ".metadata").is_file()` and read `commit.json` with json: its "step" must equal N.',
            "Take the max of the complete steps as integers (step-10 is newer than step-9); None when there are none.",
        ),
        judge=judge_newest_complete,
    )
)


# ---------------------------------------------------------------------------------------------

STEPS, SAVED = 4, 2


def _run(info, cfg, steps, prepared=None):
    mcfg = get_config(cfg.model)
    if prepared is None:
        prepared = prepare(cfg, info)
    for step in steps:
        x, y = batch_for_rank(
            step, info.rank, info.world_size, batch=cfg.batch, seq=mcfg.seq, vocab=mcfg.vocab, seed=cfg.seed
        )
        prepared.model(x, y).backward()
        prepared.before_step()
        prepared.optimizer.step()
        prepared.optimizer.zero_grad(set_to_none=True)
    return prepared


def uninterrupted_on_rank() -> dict:
    """Worker: what a resume must reproduce: the weights after STEPS uninterrupted steps, and the Adam step
    counts a checkpoint at step SAVED holds (the course's code only)."""
    with cdist.session() as info:
        cfg = TrainConfig(strategy=DDP.name, nproc=info.world_size, steps=STEPS)
        saved = _run(info, cfg, range(SAVED))
        saved_steps = sorted({int(s["step"]) for s in saved.optimizer.state.values()})
        whole = _run(info, cfg, range(SAVED, STEPS), saved)
        return {"sha": weights_sha256(whole.full_state_dict()), "saved_steps": saved_steps}


@cache
def _uninterrupted(world: int) -> dict:
    return launch(uninterrupted_on_rank, nproc=world, progress=False, echo=False, backend="gloo")[0]


def uninterrupted(world: int) -> dict:
    """``uninterrupted_on_rank``'s answer, launched once per process and world size (graders call it from threads)."""
    with REFERENCE_LAUNCH:
        return _uninterrupted(world)


def resume_on_rank(fn, info) -> dict:
    cfg = TrainConfig(strategy=DDP.name, nproc=info.world_size, steps=STEPS)
    holder = [tempfile.mkdtemp(prefix="resume-exercise-") if info.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    first = _run(info, cfg, range(SAVED))
    checkpoint.save(root, SAVED, first, info, batch=cfg.batch, strategy=cfg.strategy, keep=3)
    _run(info, cfg, range(SAVED, STEPS), first)
    checkpoint.save(root, STEPS, first, info, batch=cfg.batch, strategy=cfg.strategy, keep=3)
    if info.rank == 0:  # the kill came after DCP's .metadata, before the commit: step-4 is not complete
        (checkpoint.step_dir(root, STEPS) / checkpoint.COMMIT).unlink()
    dist.barrier()
    fresh = prepare(replace(cfg, seed=cfg.seed + 1), info)
    start = fn(str(root), fresh.model.module, fresh.optimizer)
    state_steps = sorted({int(s["step"]) for s in fresh.optimizer.state.values()}) if fresh.optimizer.state else []
    got = None
    if isinstance(start, int) and 0 <= start <= STEPS:
        _run(info, cfg, range(start, STEPS), fresh)
        got = weights_sha256(fresh.full_state_dict())
    dist.barrier()
    if info.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    del first, fresh
    gc.collect()
    return {"start": start if isinstance(start, int) else None, "sha": got, "optimizer_steps": state_steps}


def resume_verdict(per_rank: dict) -> None:
    want = uninterrupted(len(per_rank))
    for rank, r in sorted(per_rank.items()):
        if r["start"] != SAVED:
            why = (
                f"step-{STEPS} has no commit.json (the kill interrupted its save), so it does not count"
                if r["start"] == STEPS
                else f"the newest complete checkpoint is step-{SAVED}"
            )
            raise Wrong(f"rank {rank}'s resume returned {r['start']!r}: {why}; return the step it restored")
        if r["optimizer_steps"] != want["saved_steps"]:
            steps = r["optimizer_steps"] or "empty"
            raise Wrong(
                f"rank {rank} resumed without its optimizer state (Adam's step count is {steps}, "
                f"saved {want['saved_steps']}): load the checkpoint's 'optim' entry too, or Adam restarts its "
                "moments from zero and the run diverges from the uninterrupted one"
            )
        if r["sha"] != want["sha"]:
            raise Wrong(
                f"rank {rank}'s weights after resuming and training to step {STEPS} differ from the "
                "uninterrupted run's (weights_sha256): restore the model's weights from the checkpoint too"
            )


register(
    Exercise(
        "06",
        "resume",
        "Resume bit for bit after a kill",
        "on 2 ranks of DDP: the step resumed from (a kill left step-4 uncommitted), Adam's restored state, and the final "
        "weights' SHA-256 against an uninterrupted run's",
        task="Write `resume(root, model, optimizer)`: load the newest complete checkpoint under `root` (written by "
        'the course\'s `checkpoint.save` with DCP: entries `"model"`, `"optim"` and `"step"`) into `model` '
        "and `optimizer`, and return the step to continue from (0 if there is none). The check trains 4 steps "
        "without stopping, then again with checkpoints at steps 2 and 4, where a kill interrupted the save of "
        "step 4 before its commit; your resume must make the run end with the same weights, bit for bit.",
        stub="def resume(root, model, optimizer):\n"
        '    """Load the newest complete checkpoint into model and optimizer; return the step to continue from."""\n'
        '    raise NotImplementedError("exercise 06.resume: your code here")\n',
        hints=(
            "Find the step with your `newest_complete` (or `checkpoint.latest_complete`); the folder is `root/step-N`.",
            "`from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict`: "
            '`m, o = get_state_dict(model, optimizer)`, then `state = {"model": m, "optim": o, "step": torch.tensor(-1)}`.',
            "`torch.distributed.checkpoint.load(state, checkpoint_id=folder)` fills `state` in place; then "
            '`set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])` '
            'and return `int(state["step"])`.',
        ),
        on_rank=resume_on_rank,
        verdict=resume_verdict,
        nproc=2,
        timeout_s=90.0,
    )
)
