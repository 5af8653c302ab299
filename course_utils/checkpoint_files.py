"""What a checkpoint folder holds on disk, and how it is read without running what is in it (notebook 06).

Under a checkpoint folder ``D``::

    D/step-4/            a complete checkpoint: the state after 4 optimizer steps
        .metadata        DCP's index of every piece (written last by DCP's coordinator)
        __0_0.distcp     the pieces rank 0 wrote, __1_0.distcp rank 1's, ...
        commit.json      our record, written after every rank finished: this folder counts
    D/.step-8-x1y2.partial/        a save in progress, or one that died: never loaded, pruned later
    D/_rejected/step-2-<time>/     a checkpoint that cannot be resumed, kept with REJECTED.txt (why)
    D/_runs/<run id>/attempt_<n>.json   what each attempt of a run did (``course_utils.recovery``)

**A checkpoint is code.** DCP's ``.metadata`` is a pickle that torch 2.13 reads with a plain
``pickle.load`` (``FileSystemReader.read_metadata``), and the non-tensor entries of a state dict (an
optimizer's hyper-parameters) are stored as pickles that ``DefaultLoadPlanner.load_bytes`` reads with
``torch.load(weights_only=False)``: a crafted file runs whatever it names, on every rank, the moment it
is read. ``torch.load(weights_only=True)`` (the default since torch 2.6) only rebuilds tensors and plain
Python data, and safetensors files hold raw tensor bytes under a JSON header, with no code at all; DCP
applies the first to its tensor pieces but to neither its index nor its byte entries, and its
safetensors route (``HuggingFaceStorageReader``) holds tensors only, not an optimizer's state
(pytorch/pytorch#189308 asks for the same hardening). So the course reads a checkpoint in this order:

1. ``commit.json`` as JSON (no code): it records the SHA-256 of ``.metadata`` and of every piece;
2. every file of the folder hashed and compared (``verify_files``): a folder whose files do not match,
   or hold a file the record does not name, is refused before anything in it is unpickled;
3. ``.metadata`` through an unpickler that only builds DCP's own record types (``SafeReader``), and
   every byte entry through ``torch.load(weights_only=True)`` first (``SafePlanner``).

That catches a damaged checkpoint and a file swapped by someone who did not also rewrite the record;
whoever can write the whole folder can rewrite the record too. Load only checkpoints you (or someone
you trust) wrote: the same rule as for any pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path

from .checkpoint_state import _unflatten, format_mismatch, state_format
from .errors import CourseInputError

COMMIT = "commit.json"
METADATA = ".metadata"
REJECTED_NOTE = "REJECTED.txt"
STEP_RE = re.compile(r"^step-(\d+)$")
PARTIAL_RE = re.compile(r"^\.step-(\d+)-.*\.partial$")
#: Config fields a checkpoint must agree with: resuming under other values would be another run.
MUST_MATCH = ("model", "seed", "batch", "lr", "precision")


def step_dir(root, step: int) -> Path:
    """``root/step-N``: the checkpoint after N optimizer steps (notebook 06)."""
    return Path(root) / f"step-{int(step)}"


def why_incomplete(path) -> str | None:
    """Why ``path`` (a ``step-N`` folder) is not a complete checkpoint, or None when it is (notebook 06).

    Complete: DCP's ``.metadata`` file *and* our ``commit.json`` for that step. A ``step-N`` name exists
    only after a save committed (the folder is renamed from ``.partial``), so anything else under that
    name is damage, and the reason is what a user needs to see.
    """
    path = Path(path)
    m = STEP_RE.match(path.name)
    if not m:
        return "it is not named step-N"
    try:
        names = set(os.listdir(path))
        if METADATA not in names:
            return f"its {METADATA} is missing"
        if not (path / METADATA).is_file():
            return f"its {METADATA} is not a file"
        if COMMIT not in names:
            return f"its {COMMIT} is missing (the save never committed)"
        marker = json.loads((path / COMMIT).read_text())
    except PermissionError as exc:
        return f"it cannot be read ({exc.strerror})"
    except (OSError, ValueError) as exc:
        return f"its {COMMIT} cannot be read ({exc})"
    if not isinstance(marker, dict) or marker.get("step") != int(m.group(1)):
        return f"its {COMMIT} is for step {marker.get('step') if isinstance(marker, dict) else marker!r}"
    return None


def is_complete(path) -> bool:
    """A step folder counts only with DCP's ``.metadata`` *and* our ``commit.json`` for that step (notebook 06)."""
    return why_incomplete(path) is None


def scan(root) -> dict:
    """What a checkpoint folder holds: complete steps, and everything that does not count (notebook 06).

    Returns ``{"complete": [steps, oldest first], "incomplete": [{"name", "step", "files",
    "has_metadata", "has_commit", "why"}]}``. Folders starting with ``_`` (logs, run records, what
    was set aside) are not checkpoints and are ignored. A folder that cannot even be listed is
    incomplete, with the reason, never an error.
    """
    root = Path(root)
    complete, incomplete = [], []
    entries = sorted(root.iterdir()) if root.is_dir() else []
    for entry in entries:
        if entry.name.startswith("_") or not entry.is_dir():
            continue
        why = why_incomplete(entry)
        if why is None:
            complete.append(int(STEP_RE.match(entry.name).group(1)))
            continue
        m = STEP_RE.match(entry.name) or PARTIAL_RE.match(entry.name)
        try:
            files = sorted(os.listdir(entry))
        except OSError:
            files = []
        incomplete.append(
            {
                "name": entry.name,
                "step": int(m.group(1)) if m else None,
                "files": files,
                "has_metadata": METADATA in files,
                "has_commit": COMMIT in files,
                "why": why,
            }
        )
    return {"complete": sorted(complete), "incomplete": incomplete}


def latest_complete(root) -> int | None:
    """The step of the newest complete checkpoint in ``root``, or None (notebook 06)."""
    steps = scan(root)["complete"]
    return steps[-1] if steps else None


def read_commit(root, step: int) -> dict:
    """The commit record of ``root/step-N`` (JSON, no code): step, world size, strategy, hashes, losses so far."""
    return json.loads((step_dir(root, step) / COMMIT).read_text())


def sha256_of(path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks (notebook 06)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(folder) -> dict:
    """``{name: {"bytes", "sha256"}}`` of every file in a checkpoint folder but the record itself (notebook 06)."""
    folder = Path(folder)
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != COMMIT and not p.name.startswith(".commit.json-")
    }


def verify_files(root, step: int) -> str | None:
    """Why ``root/step-N``'s files do not match its commit record, or None; nothing is unpickled (notebook 06).

    Reads the record as JSON, then compares every file with the size and SHA-256 written at save
    time: a missing file, a file of another size or other bytes, and a file the record does not
    name are all refused. A checkpoint saved without hashes (an older course_utils) cannot be
    verified and is refused too.
    """
    path = step_dir(root, step)
    try:
        marker = read_commit(root, step)
        on_disk = {p.name for p in path.iterdir() if p.name != COMMIT}
    except PermissionError as exc:
        return f"it cannot be read ({exc.strerror})"
    except (OSError, ValueError) as exc:
        return f"its {COMMIT} cannot be read ({exc})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if (
        not isinstance(files, dict)
        or not all(isinstance(v, dict) and "sha256" in v for v in files.values())
        or "checksums" not in marker
    ):
        return f"its {COMMIT} records no file hashes (saved by an older course_utils), so it cannot be verified"
    if METADATA not in files:
        return f"its {COMMIT} does not record {METADATA}"
    extra = sorted(on_disk - set(files))
    if extra:
        return f"it holds {extra[0]}, which its {COMMIT} does not name"
    for name, want in sorted(files.items()):
        file = path / name
        try:
            if not file.is_file():
                return f"{name} is missing" if not file.exists() else f"{name} is not a file"
            size = file.stat().st_size
            if size != want.get("bytes"):
                return f"{name} has {size} bytes, {want.get('bytes')} were written"
            if sha256_of(file) != want["sha256"]:
                return f"{name} is not the file that was saved (its SHA-256 differs)"
        except PermissionError as exc:
            return f"{name} cannot be read ({exc.strerror})"
    return None


# ---------------------------------------------------------------- reading DCP's files without running them

#: The only classes a DCP index may name (torch 2.13's ``Metadata`` and what it holds).
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class IndexRefused(pickle.UnpicklingError):
    """A ``.metadata`` that names something other than DCP's own record types (notebook 06)."""


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's record types, ``torch.Size`` and dtypes; refuses every other name a pickle asks for."""

    def find_class(self, module: str, name: str):
        import torch

        if module in _INDEX_CLASSES and name in _INDEX_CLASSES[module]:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise IndexRefused(f"{METADATA} asks to run {module}.{name}, which a DCP index never holds")


def safe_reader(path):
    """A DCP ``FileSystemReader`` whose index is read by ``_IndexUnpickler`` instead of ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.storage import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, rank: int | None = None, **kwargs):
            name = METADATA if rank is None else f"__{rank}{METADATA}"  # DCP's own names for the two
            with open(Path(self.path) / name, "rb") as fh:
                metadata = _IndexUnpickler(fh).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def safe_planner():
    """DCP's ``DefaultLoadPlanner``, but every byte entry must load with ``torch.load(weights_only=True)`` first."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            torch.load(value, weights_only=True)  # raises on anything but tensors and plain data, runs nothing
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafePlanner()


# ---------------------------------------------------------------- what is kept, what is set aside


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write JSON to a temporary file, fsync it, rename it over ``path``: a reader sees all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_aside(root, name: str, why: str) -> Path:
    """Move ``root/name`` to ``root/_rejected/`` with a note saying why; return where it went (notebook 06).

    Kept, not deleted: it is what a user needs to find out what broke. Folders under ``_`` are not
    checkpoints, so a resume never looks at it again. A folder that cannot be moved into
    ``_rejected/`` (one that denies its owner writing: Linux must rewrite its ``..`` to move it to
    another parent) is renamed in place to ``_rejected-<name>-...``, and the note in ``_rejected/``
    says where it is.
    """
    root = Path(root)
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    rejected = root / "_rejected"
    rejected.mkdir(exist_ok=True)
    dest = rejected / f"{name.lstrip('.')}-{stamp}"
    try:
        os.rename(root / name, dest)
        (dest / REJECTED_NOTE).write_text(why + "\n")
        return dest
    except PermissionError:
        beside = root / f"_rejected-{name.lstrip('.')}-{stamp}"
        os.rename(root / name, beside)
        (rejected / f"{beside.name}.{REJECTED_NOTE}").write_text(f"{why}\n(the folder is {beside})\n")
        return beside


def prune(root, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints and the leftovers of dead saves (rank 0 only).

    Leftovers: stale ``.partial`` folders, and what a killed prune or replace left (``.pruned-*``,
    ``.replaced-*``). Call it only after a save has been committed: then no ``.partial`` is being
    written. A folder is renamed to ``.pruned-*`` before it is deleted, so a kill during the
    deletion leaves a name the next prune removes, never a torn ``step-N``. A ``step-N`` that is not
    complete is damage, never pruned: it is set aside with a note (``set_aside``).
    Returns the names deleted and set aside.
    """
    root = Path(root)
    state = scan(root)
    doomed = [step_dir(root, s) for s in state["complete"][:-keep]]
    doomed += [root / row["name"] for row in state["incomplete"] if PARTIAL_RE.match(row["name"])]
    for row in state["incomplete"]:
        if STEP_RE.match(row["name"]):
            set_aside(root, row["name"], f"found incomplete after a later save: {row['why']}")
    for path in doomed:
        gone = root / f".pruned-{path.name.lstrip('.')}-{uuid.uuid4().hex[:6]}"
        try:
            os.rename(path, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
    for leftover in list(root.glob(".pruned-*")) + list(root.glob(".replaced-*")):
        shutil.rmtree(leftover, ignore_errors=True)  # what a killed prune or replace left
    return [p.name for p in doomed] + [row["name"] for row in state["incomplete"] if STEP_RE.match(row["name"])]


# ---------------------------------------------------------------- refusals before any worker starts


def check_marker(root, step: int, cfg) -> dict:
    """Refuse a checkpoint another run wrote: other settings, or another strategy's state (notebook 06).

    Reads only the commit record, so ``train`` calls it before any worker starts; the resume
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
    """Before any worker starts: would the newest verified checkpoint of ``cfg.checkpoint_dir`` be refused? (notebook 06)"""
    if cfg.checkpoint_dir:
        complete = scan(cfg.checkpoint_dir)["complete"]
        for step in reversed(complete):
            if verify_files(cfg.checkpoint_dir, step) is None:  # the one the resume will try first
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


# ---------------------------------------------------------------- reading a checkpoint in this process


def load_weights(root, step: int | None = None) -> dict:
    """The full fp32 weights of a complete checkpoint, in this process, no process group (notebook 06).

    Keys are parameter names, as in ``build_model(...).state_dict()``; it works for a
    checkpoint saved by any strategy at any world size. Use it to inspect what a crashed run
    left behind: ``weights_sha256(load_weights(D))`` equals the ``weights_sha256`` in its commit
    record. The files are checked against their recorded hashes first, and read as ``load`` reads
    them: a folder that does not verify is refused in one line (``CourseInputError``).
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    step = latest_complete(root) if step is None else step
    if step is None or not is_complete(step_dir(root, step)):
        raise CourseInputError(f"no complete checkpoint {'' if step is None else f'step-{step} '}in {root}")
    why = verify_files(root, step)
    if why:
        raise CourseInputError(f"{step_dir(root, step)} cannot be read: {why}; nothing in it was loaded")
    marker = read_commit(root, step)
    try:  # the index alone first: what it refuses to build is said in its own words
        read_index(root, step)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index makes the checkpoint unreadable
        raise CourseInputError(f"{step_dir(root, step)} cannot be read: {_first_line(exc)}") from None
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the point here
        warnings.simplefilter("ignore", UserWarning)
        saved = _load_state_dict_from_keys("model", storage_reader=safe_reader(step_dir(root, step)))["model"]
    if marker["format"] != "zero-flat":
        return {k: v.float() for k, v in saved.items()}
    return _unflatten(saved, marker["flats"])


def read_index(root, step: int):
    """DCP's index (``.metadata``) of ``root/step-N``, read by ``checkpoint_files.safe_reader``: only DCP's own
    record types are built, anything else a pickle asks for is refused (notebook 06)."""
    return safe_reader(step_dir(root, step)).read_metadata()


def dcp_chunks(root, step: int, key: str) -> list[dict]:
    """How DCP recorded one tensor of a checkpoint: its pieces by global offset (notebook 06)."""
    meta = read_index(root, step)
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


def _first_line(exc: BaseException) -> str:
    """The line of an exception that says what went wrong (DCP wraps each rank's error in a traceback)."""
    refused = re.search(r"unsupported GLOBAL (\S+)", str(exc))  # torch.load(weights_only=True) said no
    if refused:
        return f"a pickled entry asks to run {refused.group(1)}, which weights_only=True refuses"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    causes = [ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Refused): ", ln)]
    text = causes[-1] if causes else (lines[0] if lines else "")
    text = text.split(". ")[0]  # the first sentence says what broke; the rest is advice on torch.load
    return f"{type(exc).__name__}: {text}"[:300] if not causes else text[:300]


def copy_checkpoint(src_root, step: int, dst_root) -> Path:
    """Copy one complete checkpoint into another folder, e.g. to resume it at another world size (notebook 06)."""
    src = step_dir(src_root, step)
    if not is_complete(src):
        raise CourseInputError(f"{src} is not a complete checkpoint; pick one of {scan(src_root)['complete']}")
    dst = step_dir(dst_root, step)
    shutil.copytree(src, dst)
    return dst
