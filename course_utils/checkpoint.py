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
    D/_rejected/step-2-<time>/   a checkpoint a resume could not verify, kept with REJECTED.txt (why)
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
- A resume verifies everything it loaded (weights, optimizer state, step, data position, RNG)
  against checksums written in ``commit.json`` at save time (``checksums.state_checksums``: sums over
  shards, so they compare across world sizes and strategies); a checkpoint that fails is set
  aside under ``_rejected/`` and the one before is tried. Rank 0 alone decides which steps to
  try and broadcasts that list: on a shared filesystem two ranks can see different folders.

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
from .checksums import checksum_problems, state_checksums
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
            incomplete.append(
                {
                    "name": entry.name,
                    "step": int(m.group(1)) if m else None,
                    "files": files,
                    "has_metadata": METADATA in files,
                    "has_commit": COMMIT in files,
                }
            )
    return {"complete": sorted(complete), "incomplete": incomplete}


def latest_complete(root) -> int | None:
    """The step of the newest complete checkpoint in ``root``, or None (notebook 06)."""
    steps = scan(root)["complete"]
    return steps[-1] if steps else None


def read_commit(root, step: int) -> dict:
    """The commit marker of ``root/step-N``: step, world size, strategy, weights hash, losses so far."""
    return json.loads((step_dir(root, step) / COMMIT).read_text())


def prune(root, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and every leftover (rank 0 only).

    Leftovers: stale ``.partial`` folders, and ``step-N`` folders that are not complete (a
    deletion killed half-way). Call it only after a save has been committed: then no
    ``.partial`` is being written. A folder is renamed to ``.pruned-*`` before it is deleted,
    so a kill during the deletion leaves a name the next prune removes, never a torn ``step-N``.
    """
    root = Path(root)
    state = scan(root)
    doomed = [step_dir(root, s) for s in state["complete"][:-keep]]
    doomed += [
        root / row["name"] for row in state["incomplete"] if PARTIAL_RE.match(row["name"]) or STEP_RE.match(row["name"])
    ]
    for path in doomed:
        gone = root / f".pruned-{path.name.lstrip('.')}-{uuid.uuid4().hex[:6]}"
        try:
            os.rename(path, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
    for leftover in list(root.glob(".pruned-*")) + list(root.glob(".replaced-*")):
        shutil.rmtree(leftover, ignore_errors=True)  # what a killed prune or replace left
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
        return DTensor.from_local(
            tensor.detach()[:real], self.mesh, [Shard(0)], run_check=False, shape=torch.Size([flat.numel]), stride=(1,)
        )

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
        return {
            "flats": [[{"names": names[id(p)], "shape": list(p.shape)} for p in flat.params] for flat in self.flats]
        }


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
    state = {
        f"rng.rank{r}": torch.get_rng_state(),
        f"data.rank{r}": torch.tensor([step, step * batch + r * batch // info.world_size]),
    }
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

    1. rank 0 creates a fresh ``.step-N-*.partial`` folder and tells the others its name;
    2. every rank writes its pieces with DCP; DCP's coordinator writes ``.metadata`` last;
    3. every rank takes the checksum of everything it saved (``state_checksums``: sharded
       tensors summed over ranks, rank-local state per rank); the full weights are gathered
       to rank 0 only, on the CPU, for ``weights_sha256``;
    4. a barrier: every rank is done; rank 0 writes ``commit.json`` (checksums, file sizes)
       and renames the folder to ``step-N`` (atomic), then deletes what ``keep`` no longer needs;
    5. a barrier: the step counts as saved on every rank.

    ``die=True`` makes this rank die hard after writing its own pieces (``--fail-during-save``).
    """
    import torch.distributed.checkpoint as dcp

    from .instrument import weights_sha256

    root = Path(root)
    holder = [None]
    if info.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        holder[0] = tempfile.mkdtemp(prefix=f".step-{step}-", suffix=".partial", dir=root)
    dist.broadcast_object_list(holder, src=0)
    partial = Path(holder[0])
    source = state_of(prepared, strategy)
    state = {**source.get(), **rank_local_state(info, step, batch), "step": torch.tensor(step)}
    writer = (
        _DieAfterWrite(partial, f"fail_during_save while writing step-{step}") if die else dcp.FileSystemWriter(partial)
    )
    dcp.save(state, storage_writer=writer)
    sums = state_checksums(state, info)
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, sums)
    full = rank0_full_weights(prepared, strategy)
    dist.barrier()
    final = step_dir(root, step)
    if info.rank == 0:
        checksums = {}
        for rank_sums in everyone:  # replicated entries from rank 0; rank-local ones from their rank
            checksums.update({k: v for k, v in rank_sums.items() if k not in checksums})
        files = {p.name: p.stat().st_size for p in partial.iterdir() if p.is_file()}
        marker = {
            "step": step,
            "world_size": info.world_size,
            "strategy": strategy,
            "format": source.format,
            "weights_sha256": weights_sha256(full),
            "saved_at": time.time(),
            **source.layout(),
            **(extra or {}),
            "files": files,
            "checksums": checksums,
        }
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


def rank0_full_weights(prepared, strategy: str = "") -> dict:
    """The full fp32 weights, gathered one tensor at a time to the CPU of rank 0 only (notebook 06).

    Collective; rank 0 gets ``{name: tensor}`` keyed like ``build_model(...).state_dict()``, the
    other ranks ``{}``. No rank ever holds the whole model on its device: torch's
    ``get_model_state_dict(StateDictOptions(full_state_dict=True, cpu_offload=True))`` for torch
    modules (torch 2.13 keeps the result on rank 0 only), the same per-tensor gather for the flat
    buffers of the hand-built ZeRO. A strategy with its own checkpoint hooks uses its own
    ``full_state_dict`` (kept on rank 0).
    """
    source = state_of(prepared, strategy)
    if isinstance(source, TorchState):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(source.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().to("cpu", torch.float32) for k, v in full.items()} if _rank() == 0 else {}
    if isinstance(source, FlatState):
        flats = {}
        for key, value in source.get()["model"].items():
            whole = value.full_tensor()  # one flat buffer at a time
            if _rank() == 0:
                flats[key] = whole.detach().to("cpu", torch.float32)
            del whole
        return _unflatten(flats, source.layout()["flats"]) if _rank() == 0 else {}
    full = prepared.full_state_dict()
    return {k: v.detach().to("cpu", torch.float32) for k, v in full.items()} if _rank() == 0 else {}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _unflatten(saved: dict, layout: list) -> dict:
    """Parameters by name from the flat buffers of the hand-built ZeRO (``FlatState.layout``)."""
    out = {}
    for i, params in enumerate(layout):
        offset = 0
        for p in params:
            n = 1
            for s in p["shape"]:
                n *= s
            for name in p["names"]:
                out[name] = saved[f"flat{i}"][offset : offset + n].view(p["shape"]).float().clone()
            offset += n
    return out


class CheckpointUnusable(Exception):
    """A checkpoint that cannot be resumed: unreadable, torn, or its checksums disagree (notebook 06)."""


def precheck(root, step: int) -> str | None:
    """Why ``root/step-N`` cannot be resumed, from what is on disk alone, or None (notebook 06).

    Cheap: reads the commit marker and compares every file's size with the size written.
    Changed bytes of the same size are caught after loading, by the checksums.
    """
    path = step_dir(root, step)
    try:
        marker = read_commit(root, step)
    except (OSError, ValueError) as exc:
        return f"its {COMMIT} cannot be read ({exc})"
    if "checksums" not in marker or "files" not in marker:
        return "it was saved without checksums (by an older course_utils), so a resume cannot verify it"
    for name, size in sorted(marker["files"].items()):
        if name == COMMIT:
            continue
        on_disk = (path / name).stat().st_size if (path / name).is_file() else None
        if on_disk is None:
            return f"{name} is missing"
        if on_disk != size:
            return f"{name} has {on_disk} bytes, {size} were written"
    return None


def load(root, step: int, prepared, info, *, strategy: str = "") -> dict:
    """Load ``root/step-N`` into this rank's model and optimizer, at any world size (notebook 06).

    Every rank asks DCP for exactly the pieces its own (possibly differently sharded) tensors
    need; DCP reads them by global offset. Rank-local state is loaded if this rank saved one
    (a world that grew has ranks that did not). Then every entry loaded (weights, optimizer
    state, step, data position, RNG) is checksummed as the model and optimizer now hold it and
    compared with the checksum written at save time. Returns the commit marker, with
    ``"verified": True``; raises ``CheckpointUnusable`` (on every rank alike) when the files
    cannot be read or a checksum differs, ``CourseInputError`` when the checkpoint belongs to
    a strategy whose state cannot be loaded here.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = step_dir(root, step)
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
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any failure to read makes the checkpoint unusable
        reason = f"its {METADATA} cannot be read: {_first_line(exc)}"
    _agree(reason, info)
    local = {k: v for k, v in rank_local_state(info, step, 0).items() if k in saved}
    state = {**source.get(), **local, "step": torch.tensor(-1)}
    try:  # DCP gathers every rank's read errors and raises them on every rank alike
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        reason = f"loading failed: {_first_line(exc)}"
    _agree(reason, info)
    source.set(state)
    r = info.rank
    problems = []
    if int(state["step"]) != step:
        problems.append(f"it holds step {int(state['step'])}, its name says {step}")
    if f"data.rank{r}" in state and int(state[f"data.rank{r}"][0]) != step:
        problems.append(f"rank {r}'s saved data position is at step {int(state[f'data.rank{r}'][0])}, not {step}")
    try:  # a damaged generator state can be refused here, before its checksum is compared
        if f"rng.rank{r}" in state:
            torch.set_rng_state(state[f"rng.rank{r}"])
        if f"cuda_rng.rank{r}" in state and info.device.type == "cuda":
            torch.cuda.set_rng_state(state[f"cuda_rng.rank{r}"], info.device)
    except RuntimeError as exc:
        problems.append(f"rank {r}'s RNG state cannot be restored: {_first_line(exc)}")
    # what the model and optimizer now hold, and the rank-local state as it was read
    live = {**source.get(), **{k: state[k] for k in local}, "step": state["step"]}
    mismatch = checksum_problems(state_checksums(live, info), marker.get("checksums", {}))
    if mismatch:
        problems.append(
            f"checksum of {mismatch[0]}" + (f" (and {len(mismatch) - 1} more)" if len(mismatch) > 1 else "")
        )
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, problems)
    ranks: dict[str, list[int]] = {}
    for i, rows in enumerate(everyone):
        for p in rows:
            ranks.setdefault(p, []).append(i)
    if ranks:  # one clause per problem, with the ranks that saw it
        found = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {p}" for p, rs in ranks.items()]
        raise CheckpointUnusable("; ".join(found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else ""))
    return {**marker, "verified": True}


def _agree(reason: str | None, info) -> None:
    """Raise ``CheckpointUnusable`` on every rank if any rank found a reason (collective)."""
    reasons = [None] * info.world_size
    dist.all_gather_object(reasons, reason)
    found = [f"rank {i}: {r}" for i, r in enumerate(reasons) if r]
    if found:
        raise CheckpointUnusable(found[0] + (f" (and {len(found) - 1} more rank(s))" if len(found) > 1 else ""))


def _first_line(exc: BaseException) -> str:
    """The line of an exception that says what went wrong (DCP wraps each rank's error in a traceback)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception): ", ln)]
    text = causes[-1] if causes else (lines[0] if lines else "")
    text = text.split(". ")[0]  # the first sentence says what broke; the rest is advice on torch.load
    return f"{type(exc).__name__}: {text}"[:300] if not causes else text[:300]


def format_mismatch(path, marker: dict, strategy: str, fmt: str) -> str:
    """The one-line refusal for a checkpoint another strategy's state cannot be loaded from (notebook 06)."""
    return (
        f"{path} was saved by strategy {marker.get('strategy')!r} ({marker.get('format')} state) and "
        f"cannot be loaded by {strategy!r} ({fmt} state); resume with --strategy {marker.get('strategy')} "
        f"(or any strategy saving {marker.get('format')} state) or use a fresh --checkpoint-dir"
    )


def state_format(strategy: str) -> str:
    """Which state a strategy saves, without building it (notebook 06): checked in ``check_resume``.

    The hand-built ZeRO stages save flat slices ("zero-flat"); every other strategy saves
    torch state dicts by parameter name ("torch"), which DCP reshards between all of them.
    ``tests/test_checkpoint.py`` checks this against ``state_of`` for every strategy.
    """
    from .strategies import get

    return get(strategy).state


def set_aside(root, step: int, why: str) -> Path:
    """Move an unusable ``step-N`` to ``root/_rejected/`` with a note saying why (rank 0; notebook 06).

    Kept, not deleted: it is what a user needs to find out what broke. Folders under ``_``
    are not checkpoints, so a resume never looks at it again.
    """
    dest = Path(root) / "_rejected" / f"step-{step}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(step_dir(root, step), dest)
    (dest / "REJECTED.txt").write_text(why + "\n")
    return dest


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
    return _unflatten(saved, marker["flats"])


# ---------------------------------------------------------------- the training loop's side


def check_marker(root, step: int, cfg) -> dict:
    """Refuse a checkpoint another run wrote: other settings, or another strategy's state (notebook 06).

    Reads only the commit marker, so ``train`` calls it before any worker starts; the resume
    calls it again (a torchrun line never passes through ``train``).
    """
    marker = read_commit(root, step)
    mismatched = {k: (marker.get(k), getattr(cfg, k)) for k in MUST_MATCH if marker.get(k) != getattr(cfg, k)}
    if mismatched:
        raise CourseInputError(
            f"{step_dir(root, step)} belongs to another run "
            f"({', '.join(f'{k}: saved {a!r}, now {b!r}' for k, (a, b) in mismatched.items())}); "
            "use the same settings or a fresh --checkpoint-dir"
        )
    if marker.get("format") != state_format(cfg.strategy):
        raise CourseInputError(format_mismatch(step_dir(root, step), marker, cfg.strategy, state_format(cfg.strategy)))
    if marker.get("format") == "zero-flat" and marker.get("bucket_cap_mb", cfg.bucket_cap_mb) != cfg.bucket_cap_mb:
        raise CourseInputError(
            f"{step_dir(root, step)} holds flat buffers of {marker['bucket_cap_mb']} MB buckets; use "
            f"--bucket-cap-mb {marker['bucket_cap_mb']} as the run that saved it, or a fresh --checkpoint-dir"
        )
    return marker


def check_resume(cfg) -> None:
    """Before any worker starts: would the newest complete checkpoint of ``cfg.checkpoint_dir`` be refused? (notebook 06)"""
    if cfg.checkpoint_dir:
        complete = scan(cfg.checkpoint_dir)["complete"]
        for step in reversed(complete):
            if precheck(cfg.checkpoint_dir, step) is None:  # the one the resume will try first
                check_marker(cfg.checkpoint_dir, step, cfg)
                return
        if not complete:
            nothing_left_to_resume(cfg.checkpoint_dir)


def nothing_left_to_resume(root) -> None:
    """No complete checkpoint, but some were set aside: starting at step 0 here would be a silent restart (notebook 06).

    A restarted attempt (torchrun ``--max-restarts``) after "no checkpoint can be resumed"
    would otherwise find the folder empty and train from scratch.
    """
    rejected = Path(root) / "_rejected"
    if rejected.is_dir() and any(rejected.iterdir()):
        raise CourseInputError(
            f"no checkpoint in {root} can be resumed: every one was set aside in {rejected} (REJECTED.txt in each "
            f"says why); start over with a fresh --checkpoint-dir, or delete {rejected} to train this folder from step 0"
        )


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
    resumed_at: float = 0.0  # wall clock (time.time()) once the checkpoint was loaded
    done_at: list = None  # wall clock when start + 1, start + 2, ... steps were done


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
        self.history: list[float] = []  # global mean loss of every step before this attempt
        self.attempt: Attempt | None = None
        self.die_in_save = planned_failure(cfg.fail_during_save, info.rank, info.restart_count)

    def _match(self) -> dict:
        return {k: getattr(self.cfg, k) for k in MUST_MATCH}

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
        for row in rejected:
            self._set_aside(*row)
        step = None
        for candidate in candidates:
            try:
                marker = load(self.root, candidate, self.prepared, self.info, strategy=self.cfg.strategy)
            except CheckpointUnusable as exc:
                rejected.append((candidate, str(exc)))
                self._set_aside(candidate, str(exc))
                continue
            step, self.history = candidate, list(marker["losses"])
            cdist.log(
                f"attempt {self.info.restart_count}: resumed from step-{step} "
                f"(saved by {marker['world_size']} ranks, every checksum verified)"
            )
            break
        if step is None and rejected:
            raise CourseInputError(
                f"no checkpoint in {self.root} can be resumed ({'; '.join(f'step-{s}: {why}' for s, why in rejected)}); "
                f"they were moved to {self.root / '_rejected'}; start over with a fresh --checkpoint-dir"
            )
        if step is None:
            cdist.log(f"attempt {self.info.restart_count}: no complete checkpoint, starting at step 0")
        start = step or 0
        self.attempt = Attempt(
            self.info.restart_count,
            self.info.world_size,
            start,
            step,
            start,
            seen["complete"],
            seen["incomplete"],
            resumed_at=time.time(),
            done_at=[],
        )
        self._record()
        return start

    def _resume_plan(self) -> dict:
        """Rank 0's decision: the complete steps to try, newest first, and those already unusable."""
        seen = scan(self.root)
        candidates, rejected = [], []
        for step in reversed(seen["complete"]):
            why = precheck(self.root, step)
            if why:
                rejected.append((step, why))
                continue
            check_marker(self.root, step, self.cfg)  # another run's settings or strategy: an input error
            candidates.append(step)
        if not candidates and not rejected:
            nothing_left_to_resume(self.root)
        return {"seen": seen, "candidates": candidates, "rejected": rejected}

    def _set_aside(self, step: int, why: str) -> None:
        if self.info.rank == 0:
            dest = set_aside(self.root, step, why)
            cdist.log(f"step-{step} set aside, it cannot be resumed: {why} (kept in {dest})")

    def _record(self) -> None:
        if self.info.rank == 0:
            self.records.mkdir(parents=True, exist_ok=True)
            _atomic_write_json(self.records / f"attempt_{self.attempt.attempt}.json", vars(self.attempt))

    def after_step(self, done: int, local_losses: list) -> None:
        """Step ``done - 1`` finished (``done`` steps are in the weights): log, record, maybe save."""
        cdist.log(f"step {done - 1} done, loss {float(local_losses[-1]):.4f}")
        self.attempt.reached = done
        self.attempt.done_at.append(time.time())
        self._record()
        k = self.cfg.checkpoint_every
        if k and done % k == 0:
            from .instrument import global_mean_losses

            history = self.history + global_mean_losses(local_losses, self.info)
            extra = {**self._match(), "bucket_cap_mb": self.cfg.bucket_cap_mb, "losses": history}
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

    def wait_until_recorded(self, done: int, timeout_s: float = 30.0) -> None:
        """Wait until rank 0 has recorded ``done`` completed steps of this attempt (notebook 06's
        failure injection). A rank that dies on purpose at step ``done`` first waits for it: rank 0
        may still be finishing step ``done - 1`` when a faster rank reaches the failure, and the
        steps a restart redoes would then depend on which rank was faster."""
        path = self.records / f"attempt_{self.attempt.attempt}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if json.loads(path.read_text())["reached"] >= done:
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)

    def attempts(self) -> list[dict]:
        """Every attempt of this run so far, in order (read from ``D/_runs/<run id>``)."""
        rows = [json.loads(Path(f).read_text()) for f in glob.glob(str(self.records / "attempt_*.json"))]
        return sorted(rows, key=lambda r: r["attempt"])

    def report(self) -> dict:
        """``restarts``, ``resumed_from`` (the step of each resume), ``steps_redone`` and the attempts."""
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
            "checkpoints": scan(self.root)["complete"],
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


# ---------------------------------------------------------------- reading a run's logs (notebook 06)

#: How a rank's process ended, read from its error file (torch's ``@record``) and its output.
ENDINGS = {
    "stopped": "stopped by the agent (SIGTERM)",
    "lost_peer": "its collective lost a peer, then it raised",
    "died": "died hard (no Python error)",
    "raised": "raised an error",
    "finished": "finished",
    "killed": "killed before Python could say why (no error file, never finished)",
}
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
        rows.append(
            {
                "attempt": attempt,
                "rank": rank,
                "last_step_done": max(done) if done else None,
                "ending": ending,
                "first_line": lines[0] if lines else "",
                "last_line": lines[-1] if lines else "",
            }
        )
    return sorted(rows, key=lambda r: (r["attempt"], r["rank"]))


def dcp_chunks(root, step: int, key: str) -> list[dict]:
    """How DCP recorded one tensor of a checkpoint: its pieces by global offset (notebook 06)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(step_dir(root, step))).read_metadata()
    item = meta.state_dict_metadata[key]
    return [
        {
            "offsets": list(c.offsets),
            "sizes": list(c.sizes),
            "file": meta.storage_data[_index(meta, key, c.offsets)].relative_path,
        }
        for c in item.chunks
    ]


def _index(meta, key, offsets):
    for index in meta.storage_data:
        if index.fqn == key and list(index.offset or []) == list(offsets):
            return index
    raise KeyError(key)
