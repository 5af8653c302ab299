"""Checkpoints that survive a lost rank: sharded, complete-only, one folder per step (notebook 06).

The failure contract of torchrun: when one worker dies, the collective it was part of cannot
finish; the agent stops every survivor and restarts the whole group, up to ``max_restarts``
times; RANK (and, with elastic min/max, the world size) may differ after the restart. Nothing
in torchrun restores training: the script must load the last *complete* checkpoint and redo
the steps since. This module is that half of the contract.

On disk, under a checkpoint folder ``D``::

    D/step-4/            a complete checkpoint: the state after 4 optimizer steps
        .metadata        DCP's index of every piece (written last by DCP's coordinator)
        __0_0.distcp     the pieces rank 0 wrote, __1_0.distcp rank 1's, ...
        commit.json      our marker, written after every rank finished: this folder counts
    D/step-6/
    D/.step-8-x1y2.partial/   a save in progress, or one that died: never loaded, pruned later
    D/_runs/<run id>/attempt_<n>.json   what each attempt of a run resumed from and reached

Rules (each one a failure seen in real jobs):

- A save writes into a fresh ``.partial`` folder and becomes ``step-N/`` by a rename only
  after DCP finished on every rank, a barrier, and rank 0 writing ``commit.json``. It never
  writes into an existing step folder: a save that died there would leave the old
  ``.metadata`` beside new data files, a torn checkpoint that loads silently.
- Pieces are keyed by what they are (a parameter's name and its offset in the global tensor,
  which DCP records), never by the rank that wrote them: ranks move and world sizes change.
- Rank-local state (the RNG, the position in the data stream) is saved under rank-keyed
  names (``rng.rank1``): DCP keeps a single copy of a same-named plain tensor, as it would
  for a replicated weight.
- The newest ``keep`` (>= 2) complete checkpoints are kept; a step counts as saved only when
  its checkpoint is complete (as in torchtitan).

What is saved comes from the strategy (``course_utils.loop.Prepared``): by default the
model and optimizer through ``torch.distributed.checkpoint.state_dict.get_state_dict`` (plain
modules, DDP, FSDP2's DTensors); the hand-built ZeRO optimizers of ``course_utils.zero``
(flat slices) save each slice as a DTensor of the global flat buffer; any strategy may supply
its own ``Prepared.get_state``/``set_state`` pair.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from . import dist as cdist
from .errors import CourseInputError

COMMIT = "commit.json"
METADATA = ".metadata"
STEP_RE = re.compile(r"^step-(\d+)$")
PARTIAL_RE = re.compile(r"^\.step-(\d+)-.*\.partial$")
#: Config fields a checkpoint must agree with: resuming under other values would be another run.
MUST_MATCH = ("model", "seed", "batch", "lr", "precision")


# ---------------------------------------------------------------- failure injection

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
            raise CourseInputError(f"{flag} takes RANK:STEP (e.g. 1:5), or one per attempt: 1:5,0:7; got {text!r}") from None
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


# ---------------------------------------------------------------- what is on disk

def step_dir(root, step: int) -> Path:
    """``root/step-N``: the checkpoint after N optimizer steps (notebook 06)."""
    return Path(root) / f"step-{int(step)}"


def is_complete(path) -> bool:
    """A step folder counts only with DCP's ``.metadata`` *and* our ``commit.json`` for that step."""
    path = Path(path)
    m = STEP_RE.match(path.name)
    if not m or not (path / METADATA).is_file() or not (path / COMMIT).is_file():
        return False
    try:
        return json.loads((path / COMMIT).read_text())["step"] == int(m.group(1))
    except (OSError, ValueError, KeyError):
        return False


def scan(root) -> dict:
    """What a checkpoint folder holds: complete steps, and everything that does not count (notebook 06).

    Returns ``{"complete": [steps, oldest first], "incomplete": [{"name", "step", "files",
    "has_metadata", "has_commit"}]}``. Folders starting with ``_`` (logs, run records) are not
    checkpoints and are ignored.
    """
    root = Path(root)
    complete, incomplete = [], []
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if not entry.is_dir() or entry.name.startswith("_"):
                continue
            if is_complete(entry):
                complete.append(int(STEP_RE.match(entry.name).group(1)))
                continue
            m = STEP_RE.match(entry.name) or PARTIAL_RE.match(entry.name)
            files = sorted(p.name for p in entry.iterdir())
            incomplete.append({"name": entry.name, "step": int(m.group(1)) if m else None, "files": files,
                               "has_metadata": METADATA in files, "has_commit": COMMIT in files})
    return {"complete": sorted(complete), "incomplete": incomplete}


def latest_complete(root) -> int | None:
    """The step of the newest complete checkpoint in ``root``, or None (notebook 06)."""
    steps = scan(root)["complete"]
    return steps[-1] if steps else None


def read_commit(root, step: int) -> dict:
    """The commit marker of ``root/step-N``: step, world size, strategy, weights hash, losses so far."""
    return json.loads((step_dir(root, step) / COMMIT).read_text())


def prune(root, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and every stale ``.partial`` (rank 0 only).

    Call it only after a save has been committed: then no ``.partial`` is being written.
    """
    root = Path(root)
    state = scan(root)
    doomed = [step_dir(root, s) for s in state["complete"][:-keep]]
    doomed += [root / row["name"] for row in state["incomplete"] if PARTIAL_RE.match(row["name"])]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in doomed]


def copy_checkpoint(src_root, step: int, dst_root) -> Path:
    """Copy one complete checkpoint into another folder, e.g. to resume it at another world size (notebook 06)."""
    src = step_dir(src_root, step)
    if not is_complete(src):
        raise CourseInputError(f"{src} is not a complete checkpoint; pick one of {scan(src_root)['complete']}")
    dst = step_dir(dst_root, step)
    shutil.copytree(src, dst)
    return dst


def _atomic_write_json(path: Path, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- what a strategy saves

def _inner(model):
    """The user's module inside a DDP-style wrapper (``.module``), or the module itself."""
    return getattr(model, "module", model)


def _init_optimizer_state(optimizer) -> None:
    """Create an optimizer's state before any step, so that a checkpoint can be loaded into it.

    What ``get_state_dict`` does for torch modules: one step with zero gradients and a
    learning rate of 0, which leaves the parameters unchanged bit for bit.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


class TorchState:
    """Model + optimizer through ``get_state_dict``/``set_state_dict``: plain modules, DDP, FSDP2 (notebook 06).

    Keys are parameter names (``blocks.0.attn.qkv.weight``), the same for every strategy and
    world size; FSDP2's DTensors carry their global shape, so DCP reshards them on load.
    """

    format = "torch"

    def __init__(self, prepared):
        self.model, self.optimizer = _inner(prepared.model), prepared.optimizer

    def get(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def set(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def layout(self) -> dict:
        return {}


class FlatState:
    """The hand-built ZeRO optimizers of ``course_utils.zero``: slices of flat buffers (notebook 06).

    Rank r owns ``[r·S, (r+1)·S)`` of each flat buffer of Ψ_f elements (padded to Nd·S). Its
    fp32 master slice and Adam's momentum and variance for that slice are saved as DTensors
    of the unpadded global buffer (``Shard(0)``, torch.chunk's split, which is exactly the
    ZeRO layout), so DCP records each piece by its offset: a slice saved by 4 ranks loads
    on 2. The layout (which parameters, in which order) is in the commit marker.
    """

    format = "zero-flat"

    def __init__(self, prepared):
        from torch.distributed.device_mesh import DeviceMesh

        self.prepared, self.optimizer = prepared, prepared.optimizer
        self.flats = list(self.optimizer.flats)
        device_type = self.flats[0].master.device.type
        self.mesh = DeviceMesh.from_group(self.flats[0].group or dist.group.WORLD, device_type)

    def _dtensor(self, flat, tensor):
        from torch.distributed.tensor import DTensor, Shard

        real = max(0, min(flat.shard_numel, flat.numel - flat.rank * flat.shard_numel))
        return DTensor.from_local(tensor.detach()[:real], self.mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([flat.numel]), stride=(1,))

    def get(self) -> dict:
        inner = self.optimizer.optimizer
        _init_optimizer_state(inner)
        model, optim = {}, {}
        for i, flat in enumerate(self.flats):
            model[f"flat{i}"] = self._dtensor(flat, flat.master)
            for key, value in inner.state[flat.master].items():
                sharded = isinstance(value, torch.Tensor) and value.dim() > 0
                optim[f"flat{i}.{key}"] = self._dtensor(flat, value) if sharded else value
        return {"model": model, "optim": optim}

    def set(self, state: dict) -> None:
        # DCP loaded in place into views of the master slices and the optimizer state; the
        # working copies follow: the 16-bit slice (mixed precision), then the whole parameters
        # (stages 1 and 2 all-gather them; stage 3 gathers before each forward anyway).
        with torch.no_grad():
            for i, flat in enumerate(self.flats):
                for key, value in self.optimizer.optimizer.state[flat.master].items():
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        value.copy_(state["optim"][f"flat{i}.{key}"])
                if flat.master is not flat.shard:
                    flat.shard.copy_(flat.master)
            self.optimizer.share_weights()

    def layout(self) -> dict:
        names: dict[int, list[str]] = {}
        for name, p in _inner(self.prepared.model).named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return {"flats": [[{"names": names[id(p)], "shape": list(p.shape)} for p in flat.params]
                          for flat in self.flats]}


class CustomState:
    """A strategy's own ``Prepared.get_state``/``set_state`` pair (see ``course_utils.loop.Prepared``)."""

    def __init__(self, prepared, strategy: str):
        self.get, self.set = prepared.get_state, prepared.set_state
        self.format = f"custom:{strategy}"

    def layout(self) -> dict:
        return {}


def state_of(prepared, strategy: str = ""):
    """How to save and load a strategy's state: its own hooks, ZeRO flat slices, or ``get_state_dict``."""
    if getattr(prepared, "get_state", None) is not None:
        return CustomState(prepared, strategy)
    opt = prepared.optimizer
    if hasattr(opt, "flats") and hasattr(opt, "optimizer") and hasattr(opt, "share_weights"):
        return FlatState(prepared)
    return TorchState(prepared)


def rank_local_state(info, step: int, batch: int) -> dict:
    """This rank's RNG and data position under rank-keyed names (notebook 06).

    The data position is the index of this rank's next sample in the step-keyed stream
    (``step·B + r·B/N``); the stream is keyed by step, so a resumed run draws the same batches.
    """
    r = info.rank
    state = {f"rng.rank{r}": torch.get_rng_state(),
             f"data.rank{r}": torch.tensor([step, step * batch + r * batch // info.world_size])}
    if info.device.type == "cuda":
        state[f"cuda_rng.rank{r}"] = torch.cuda.get_rng_state(info.device)
    return state


# ---------------------------------------------------------------- save and load (collective)

class _DieAfterWrite:
    """A DCP storage writer that writes this rank's pieces and then dies before the checkpoint is committed."""

    def __new__(cls, path, reason: str):
        from torch.distributed.checkpoint import FileSystemWriter

        class Writer(FileSystemWriter):
            def write_data(self, plan, planner):
                super().write_data(plan, planner).wait()
                die_hard(reason)

        return Writer(path)


def save(root, step: int, prepared, info, *, batch: int, strategy: str = "", extra: dict | None = None,
         keep: int = 2, die: bool = False) -> Path:
    """Write the checkpoint after ``step`` optimizer steps; every rank calls it (notebook 06).

    1. rank 0 creates a fresh ``.step-N-*.partial`` folder and tells the others its name;
    2. every rank writes its pieces with DCP; DCP's coordinator writes ``.metadata`` last;
    3. a barrier: every rank is done; rank 0 writes ``commit.json`` and renames the folder
       to ``step-N`` (atomic), then deletes what ``keep`` no longer needs;
    4. a barrier: the step counts as saved on every rank.

    ``die=True`` makes this rank die hard after writing its own pieces (``--fail-during-save``).
    """
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    holder = [None]
    if info.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        holder[0] = tempfile.mkdtemp(prefix=f".step-{step}-", suffix=".partial", dir=root)
    dist.broadcast_object_list(holder, src=0)
    partial = Path(holder[0])
    source = state_of(prepared, strategy)
    state = {**source.get(), **rank_local_state(info, step, batch), "step": torch.tensor(step)}
    writer = _DieAfterWrite(partial, f"fail_during_save while writing step-{step}") if die else \
        dcp.FileSystemWriter(partial)
    dcp.save(state, storage_writer=writer)
    sha = _weights_sha(prepared)
    dist.barrier()
    final = step_dir(root, step)
    if info.rank == 0:
        marker = {"step": step, "world_size": info.world_size, "strategy": strategy, "format": source.format,
                  "weights_sha256": sha, "saved_at": time.time(), **source.layout(), **(extra or {})}
        _atomic_write_json(partial / COMMIT, marker)
        if final.exists():  # a redone step: the new complete save replaces the old one whole
            old = root / f".replaced-{final.name}-{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(partial, final)
        _fsync_dir(root)
        prune(root, keep)
    dist.barrier()
    return final


def _weights_sha(prepared) -> str:
    from .instrument import weights_sha256

    return weights_sha256(prepared.full_state_dict())


def load(root, step: int, prepared, info, *, strategy: str = "") -> dict:
    """Load ``root/step-N`` into this rank's model and optimizer, at any world size (notebook 06).

    Every rank asks DCP for exactly the pieces its own (possibly differently sharded) tensors
    need; DCP reads them by global offset. Rank-local state is loaded if this rank saved one
    (a world that grew has ranks that did not). Returns the commit marker, with
    ``"verified": True`` once the loaded full weights hash to the value recorded at save time.
    """
    import torch.distributed.checkpoint as dcp

    path = step_dir(root, step)
    marker = read_commit(root, step)
    source = state_of(prepared, strategy)
    if marker["format"] != source.format:
        raise CourseInputError(
            f"{path} was saved by strategy {marker['strategy']!r} ({marker['format']} state) and cannot be "
            f"loaded by {strategy!r} ({source.format}); resume with --strategy {marker['strategy']} or use a "
            "fresh --checkpoint-dir")
    if source.layout() and source.layout() != {k: marker.get(k) for k in source.layout()}:
        raise CourseInputError(f"{path} holds flat buffers of another layout (bucket size?); use the same "
                               "--bucket-cap-mb as the run that saved it, or a fresh --checkpoint-dir")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    local = {k: v for k, v in rank_local_state(info, step, 0).items() if k in saved}
    state = {**source.get(), **local, "step": torch.tensor(-1)}
    dcp.load(state, checkpoint_id=path)
    source.set(state)
    if int(state["step"]) != step:
        raise RuntimeError(f"{path} holds step {int(state['step'])}, its name says {step}")
    r = info.rank
    if f"rng.rank{r}" in state:
        torch.set_rng_state(state[f"rng.rank{r}"])
    if f"cuda_rng.rank{r}" in state and info.device.type == "cuda":
        torch.cuda.set_rng_state(state[f"cuda_rng.rank{r}"], info.device)
    if f"data.rank{r}" in state and int(state[f"data.rank{r}"][0]) != step:
        raise RuntimeError(f"rank {r}'s saved data position is at step {int(state[f'data.rank{r}'][0])}, not {step}")
    sha = _weights_sha(prepared)
    if sha != marker["weights_sha256"]:
        raise RuntimeError(f"{path}: the loaded weights do not hash to the value recorded at save time")
    return {**marker, "verified": True}


def load_weights(root, step: int | None = None) -> dict:
    """The full fp32 weights of a complete checkpoint, in this process, no process group (notebook 06).

    Keys are parameter names, as in ``build_model(...).state_dict()``; it works for a
    checkpoint saved by any strategy at any world size. Use it to inspect what a crashed run
    left behind: ``weights_sha256(load_weights(D))`` equals the ``weights_sha256`` in its commit marker.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    step = latest_complete(root) if step is None else step
    if step is None or not is_complete(step_dir(root, step)):
        raise CourseInputError(f"no complete checkpoint {'' if step is None else f'step-{step} '}in {root}")
    marker = read_commit(root, step)
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the point here
        warnings.simplefilter("ignore", UserWarning)
        saved = _load_state_dict_from_keys(checkpoint_id=str(step_dir(root, step)))["model"]
    if marker["format"] != "zero-flat":
        return {k: v.float() for k, v in saved.items()}
    out = {}
    for i, params in enumerate(marker["flats"]):
        offset = 0
        for p in params:
            n = 1
            for s in p["shape"]:
                n *= s
            for name in p["names"]:
                out[name] = saved[f"flat{i}"][offset:offset + n].view(p["shape"]).float().clone()
            offset += n
    return out


# ---------------------------------------------------------------- the training loop's side

def _run_id() -> str:
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


class Checkpointer:
    """The training loop's checkpoint and resume logic, one object per rank (notebook 06).

    ``resume()`` at start (load the newest complete checkpoint, record the attempt);
    ``after_step(n, local_losses)`` after each step (record progress; save every K steps);
    ``report()`` for the JSON report (restarts, resumed_from, steps_redone).
    """

    def __init__(self, cfg, prepared, info):
        self.cfg, self.prepared, self.info = cfg, prepared, info
        self.root = Path(cfg.checkpoint_dir)
        self.run_id = _run_id()
        self.records = self.root / "_runs" / self.run_id
        self.history: list[float] = []     # global mean loss of every step before this attempt
        self.attempt: Attempt | None = None
        self.die_in_save = planned_failure(cfg.fail_during_save, info.rank, info.restart_count)

    def _match(self) -> dict:
        return {k: getattr(self.cfg, k) for k in MUST_MATCH}

    def resume(self) -> int:
        """Load the newest complete checkpoint if there is one; return the step to start from."""
        seen = scan(self.root)
        step = seen["complete"][-1] if seen["complete"] else None
        if step is not None:
            marker = read_commit(self.root, step)
            mismatched = {k: (marker.get(k), v) for k, v in self._match().items() if marker.get(k) != v}
            if mismatched:
                differ = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in mismatched.items())
                raise CourseInputError(
                    f"{step_dir(self.root, step)} belongs to another run ({differ}); "
                    "use the same settings or a fresh --checkpoint-dir")
            load(self.root, step, self.prepared, self.info, strategy=self.cfg.strategy)
            self.history = list(marker["losses"])
            cdist.log(f"attempt {self.info.restart_count}: resumed from step-{step} "
                      f"(saved by {marker['world_size']} ranks, weights verified)")
        else:
            cdist.log(f"attempt {self.info.restart_count}: no complete checkpoint, starting at step 0")
        start = step or 0
        self.attempt = Attempt(self.info.restart_count, self.info.world_size, start, step, start,
                               seen["complete"], seen["incomplete"])
        self._record()
        return start

    def _record(self) -> None:
        if self.info.rank == 0:
            self.records.mkdir(parents=True, exist_ok=True)
            _atomic_write_json(self.records / f"attempt_{self.attempt.attempt}.json", vars(self.attempt))

    def after_step(self, done: int, local_losses: list) -> None:
        """Step ``done - 1`` finished (``done`` steps are in the weights): log, record, maybe save."""
        cdist.log(f"step {done - 1} done, loss {float(local_losses[-1]):.4f}")
        self.attempt.reached = done
        self._record()
        k = self.cfg.checkpoint_every
        if k and done % k == 0:
            from .instrument import global_mean_losses

            history = self.history + global_mean_losses(local_losses, self.info)
            extra = {**self._match(), "losses": history}
            save(self.root, done, self.prepared, self.info, batch=self.cfg.batch, strategy=self.cfg.strategy,
                 extra=extra, keep=self.cfg.keep_checkpoints, die=self.die_in_save == done)
            cdist.log(f"saved step-{done}")

    def attempts(self) -> list[dict]:
        """Every attempt of this run so far, in order (read from ``D/_runs/<run id>``)."""
        rows = [json.loads(Path(f).read_text()) for f in glob.glob(str(self.records / "attempt_*.json"))]
        return sorted(rows, key=lambda r: r["attempt"])

    def report(self) -> dict:
        """``restarts``, ``resumed_from`` (the step of each resume), ``steps_redone`` and the attempts."""
        rows = self.attempts() if self.info.rank == 0 else []
        redone = redone_per_restart(rows)
        return {"restarts": self.info.restart_count,  # a restart with no checkpoint yet resumes from 0
                "resumed_from": [r["start"] for r in rows if r["attempt"] > 0 or r["resumed_from"] is not None],
                "steps_redone": sum(redone), "redone_per_restart": redone, "attempts": rows,
                "run_id": self.run_id, "checkpoints": scan(self.root)["complete"]}


def redone_per_restart(attempts: list[dict]) -> list[int]:
    """Steps each restart had to redo: how far the attempt before got, minus where this one started (notebook 06).

    Only completed steps count (their optimizer update was applied, then lost); the step that
    was in flight when the rank died is lost too, half done on average.
    """
    return [max(0, prev["reached"] - cur["start"]) for prev, cur in zip(attempts, attempts[1:])]


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
    return {"every": every, "fail_at": list(fail_steps), "redone": redone, "resumed_from": report["resumed_from"],
            "mean_redone": sum(redone) / len(redone), "expected_mean": (every - 1) / 2,
            "every_position": sorted(f % every for f in fail_steps) == list(range(every))}


# ---------------------------------------------------------------- reading a run's logs (notebook 06)

#: How a rank's process ended, read from its error file (torch's ``@record``) and its output.
ENDINGS = {"stopped": "stopped by the agent (SIGTERM)", "lost_peer": "its collective lost a peer, then it raised",
           "died": "died hard (no Python error)", "raised": "raised an error", "finished": "finished",
           "killed": "killed before Python could say why (no error file, never finished)"}
#: The line ``train_worker`` logs once its last step is done; only a rank that wrote it finished.
FINISHED_LINE = "finished training"


def attempt_logs(checkpoint_dir, run_id: str) -> list[dict]:
    """Per attempt and rank of a ``train()`` run: last step done and how the process ended (notebook 06).

    ``train()`` keeps the launcher's per-rank logs under ``checkpoint_dir/_launch/logs/<run id>_*/
    attempt_<n>/<rank>/`` (stdout.log, and error.json when Python saw an error). Rows:
    ``{"attempt", "rank", "last_step_done", "ending", "first_line", "last_line"}``.
    """
    rows = []
    pattern = os.path.join(str(checkpoint_dir), "_launch", "logs", f"{run_id}_*", "attempt_*", "*")
    for folder in glob.glob(pattern):
        attempt, rank = int(Path(folder).parent.name.split("_")[1]), int(Path(folder).name)
        out = Path(folder, "stdout.log")
        lines = [ln for ln in (out.read_text().splitlines() if out.exists() else []) if ln.strip()]
        done = [int(m.group(1)) for ln in lines for m in [re.search(r"step (\d+) done", ln)] if m]
        error = Path(folder, "error.json")
        text = json.loads(error.read_text()).get("message", {}) if error.exists() else ""
        text = text.get("message", "") if isinstance(text, dict) else str(text)
        if "SignalException" in text:
            ending = ENDINGS["stopped"]
        elif any(c in text for c in ("closed by peer", "Connection reset", "Read error", "remote process")):
            ending = ENDINGS["lost_peer"]
        elif text:
            ending = ENDINGS["raised"]
        elif any("dying hard" in ln for ln in lines):
            ending = ENDINGS["died"]
        elif any(FINISHED_LINE in ln for ln in lines):
            ending = ENDINGS["finished"]
        else:  # e.g. stuck in a collective when the agent's SIGTERM grace ran out, then SIGKILLed
            ending = ENDINGS["killed"]
        rows.append({"attempt": attempt, "rank": rank, "last_step_done": max(done) if done else None,
                     "ending": ending, "first_line": lines[0] if lines else "", "last_line": lines[-1] if lines else ""})
    return sorted(rows, key=lambda r: (r["attempt"], r["rank"]))


def dcp_chunks(root, step: int, key: str) -> list[dict]:
    """How DCP recorded one tensor of a checkpoint: its pieces by global offset (notebook 06)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(step_dir(root, step))).read_metadata()
    item = meta.state_dict_metadata[key]
    return [{"offsets": list(c.offsets), "sizes": list(c.sizes),
             "file": meta.storage_data[_index(meta, key, c.offsets)].relative_path}
            for c in item.chunks]


def _index(meta, key, offsets):
    for index in meta.storage_data:
        if index.fqn == key and list(index.offset or []) == list(offsets):
            return index
    raise KeyError(key)
