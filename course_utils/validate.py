"""Input checks the command line runs before anything starts (introduced in notebook 00).

Each check raises ``CourseInputError`` with one sentence that names the flag and the fix;
``course_utils.cli`` turns it into one line on stderr and exit status 2. They run in the
process that parses the arguments, before a worker starts: an error raised inside a worker
reaches the user as a launch failure, after the cost of a launch.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CourseInputError

#: The largest whole number a flag may take: torch and the arithmetic work in 64-bit integers.
INT64_MAX = 2**63 - 1


def flag(dest: str) -> str:
    """``bucket_cap_mb`` -> ``--bucket-cap-mb``: the flag an argparse destination came from (notebook 00)."""
    return "--" + dest.replace("_", "-")


def check_numbers(args) -> None:
    """Every number parsed from the command line is finite and fits in 64 bits (notebook 00).

    argparse's ``type=float`` accepts ``nan`` and ``inf``, and ``type=int`` any number of digits;
    no flag of the course means either.
    """
    for dest, value in sorted(vars(args).items()):
        if dest.startswith("_") or isinstance(value, bool):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise CourseInputError(f"{flag(dest)} must be a finite number, got {v}")
            if isinstance(v, int) and not -INT64_MAX <= v <= INT64_MAX:
                raise CourseInputError(
                    f"{flag(dest)} is too large ({len(str(abs(v)))} digits); "
                    f"it must fit in 64 bits (at most {INT64_MAX})"
                )


def finite_result(name: str, value: float) -> float:
    """Refuse a result that overflowed to inf (or nan): the inputs were beyond what the formula can hold (notebook 01)."""
    if not math.isfinite(value):
        raise CourseInputError(f"{name} overflows ({value}); use smaller numbers")
    return value


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def writable_dir(name: str, path) -> Path:
    """A folder that exists or can be created, and can be written to (notebook 06)."""
    p = Path(path)
    if str(path).strip() == "":
        raise CourseInputError(f"{name} is empty; give a folder, e.g. runs/demo")
    if p.exists() and not p.is_dir():
        raise CourseInputError(f"{name} {path} is a file, not a folder; give a folder (it is created if missing)")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise CourseInputError(f"{name} {path}: {base} is a file, so the folder cannot be created; give another path")
    try:  # try it: permission bits say nothing for root, nor on a read-only or a full filesystem
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=base)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise CourseInputError(
            f"{name} {path}: cannot write in {base} ({exc.strerror}); give a folder you can write to"
        ) from None
    return p


def writable_file(name: str, path) -> Path:
    """A file path whose folder exists (or can be created) and is writable, and that is not a folder (notebook 02)."""
    p = Path(path)
    if str(path).strip() == "" or p.is_dir():
        raise CourseInputError(
            f"{name} {path!r} is {'a folder' if p.is_dir() else 'empty'}; give a file path, e.g. weights.pt"
        )
    writable_dir(name, p.parent if str(p.parent) else ".")
    if p.exists() and not os.access(p, os.W_OK):
        raise CourseInputError(f"{name} {path}: the file exists and is not writable; give another path")
    return p


def not_empty(name: str, text) -> None:
    """A text flag that was given must say something: ``--params ''`` is a typo, not the default (notebook 05b)."""
    if text is not None and not str(text).strip():
        raise CourseInputError(f"{name} is empty; give a value or leave the flag out")


#: The largest parameter count the calculators accept: a billion billion, far beyond any model;
#: beyond it the tables' bytes no longer print (1e40 parameters broke the formatting).
MAX_PARAMS = 1e18


def params_count(name: str, text) -> float:
    """``units.parse_count``, bounded by ``MAX_PARAMS``, and a size under 10^6 must say its unit (notebook 01).

    ``--params 7.5`` would be 7.5 parameters (a 120-byte bill): a plain number below a million is
    almost always a forgotten B or M, so it is refused with the reason; ``7.5e0`` says it on purpose.
    Shared by every subcommand that takes a parameter count.
    """
    from .units import parse_count

    value = parse_count(text, name=name)
    if isinstance(text, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]*\s*", text) and value < 1e6:
        raise CourseInputError(
            f"{name} {text.strip()} means {text.strip()} parameters: a count under a million needs its unit; "
            f"write {text.strip()}B or {text.strip()}M (or {text.strip()}e0 if you do mean {text.strip()})"
        )
    if value > MAX_PARAMS:
        raise CourseInputError(
            f"{name}: {text} parameters is beyond what the tables can show; use at most {MAX_PARAMS:.0e}"
        )
    return value


# ---------------------------------------------------------------- stated ranges: one layer for the CLI and the API

#: Memory one rank of a course run takes. Measured here (torch 2.13 CPU, /proc/self/smaps_rollup of a
#: worker that joined a gloo group and built the tiny model): under ``launch`` (forked from the agent
#: server) 271 MB RSS, 69 MB PSS, 11 MB private; under plain torchrun 259 MB RSS, 157 MB PSS, 144 MB
#: private. A training step of the course models adds tens of MB; 250 MB leaves room for them.
RANK_BYTES = 250e6
#: Ranks on one machine in any case: more than the course's runs ever start, far below the OS's limits.
MAX_LOCAL_RANKS = 256
MAX_STEPS = 10**9
#: Sequences per rank in one step: the medium course model's logits alone take ~2 MB per sequence.
MAX_BATCH_PER_RANK = 4096
#: Sequences in one global batch, however many ranks share it.
MAX_BATCH = 2**31 - 1
#: torch seeds generators with 64 bits and the data stream mixes the step in (``data.global_batch``).
MAX_SEED = 2**32 - 1
#: A week: a run that should wait longer is not a course run; ``timedelta`` overflows near 1e14 s.
MAX_TIMEOUT_S = 7 * 86400.0
MAX_BUCKET_MB = 1e5
MAX_RESTARTS = 100
MAX_KEEP = 1000
#: K, optimizer bytes per parameter: Adam in mixed precision is 12; 1000 is beyond any optimizer.
MAX_K = 1000.0
MAX_GPUS = 10**7
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 1024


def available_memory() -> float:
    """Bytes of memory this machine can still give new processes (``MemAvailable``; notebook 00)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return MAX_LOCAL_RANKS * RANK_BYTES


def max_local_ranks() -> int:
    """How many ranks this machine can start now: one per ``RANK_BYTES`` of available memory, at most
    ``MAX_LOCAL_RANKS`` (notebook 00). Every command and function that starts ranks is held to it."""
    return max(1, min(MAX_LOCAL_RANKS, int(available_memory() // RANK_BYTES)))


def _ranks_words() -> str:
    return (
        f"this machine can start {max_local_ranks()} ranks now: one per {RANK_BYTES / 1e6:.0f} MB of available "
        f"memory, {MAX_LOCAL_RANKS} at most"
    )


@dataclass(frozen=True)
class Range:
    """A number's stated range: ``low`` to ``high`` (``high`` may be a function of the machine), whole or not."""

    low: float
    high: float | Callable[[], float]
    whole: bool = True
    above_low: bool = False  # strictly above ``low`` (a timeout of 0 s never fires)
    why: str = ""  # said when the value is out of range

    def check(self, name: str, value) -> None:
        if value is None:
            return
        high = self.high if not callable(self.high) else _machine_high(self.high)
        kind = "a whole number" if self.whole else "a number"
        if self.above_low:
            words = f"{kind} above {_num(self.low)}" + (f" and at most {_num(high)}" if math.isfinite(high) else "")
        else:
            words = f"{kind} from {_num(self.low)}" + (f" to {_num(high)}" if math.isfinite(high) else "")
        why = f" ({self.why() if callable(self.why) else self.why})" if self.why else ""
        ok_type = isinstance(value, int) if self.whole else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or (not self.whole and not math.isfinite(value)):
            raise CourseInputError(f"{name} must be {words}, got {value!r}{why}")
        low_ok = value > self.low if self.above_low else value >= self.low
        if not low_ok or value > high:
            raise CourseInputError(f"{name} must be {words}, got {value!r}{why}")


def _num(x: float) -> str:
    """A bound as a reader writes it: 604,800 or 1,000; 0.99 or 1e+07 for the rest."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _machine_high(high: Callable[[], float]) -> float:
    """A bound that depends on what this machine can start holds where ranks are started, not in a rank:
    under torchrun on several nodes a rank's world size counts every node's ranks (``RANK`` is set)."""
    return math.inf if "RANK" in os.environ else high()


def _whole(low, high, why=""):
    return Range(low, high, True, False, why)


def _seconds(
    high=MAX_TIMEOUT_S, why="a finite number of seconds: 0 never fires, and a week is the most a course run waits"
):
    return Range(0, high, False, True, why)


_RANKS = _whole(1, max_local_ranks, _ranks_words)
_TRAIN = {
    "nproc": _RANKS,
    "steps": _whole(1, MAX_STEPS),
    "batch": _whole(1, MAX_BATCH, "sequences per step, all ranks together"),  # and per rank: _per_rank_batch
    "seed": _whole(0, MAX_SEED),
    "lr": Range(0, math.inf, False, True),
    "bucket_cap_mb": Range(0, MAX_BUCKET_MB, False, True, "MB per DDP bucket; 25 is PyTorch's default"),
    "node_size": _RANKS,
    "timeout_s": _seconds(),
    "checkpoint_every": _whole(0, MAX_STEPS),
    "keep_checkpoints": _whole(
        2, MAX_KEEP, "if the newest checkpoint turns out unusable, the one before it is what a restart falls back to"
    ),
    "max_restarts": _whole(0, MAX_RESTARTS),
}
_SHAPE = {
    "layers": _whole(1, 10**5),
    "width": _whole(1, 10**7),
    "heads": _whole(1, 10**6),
    "vocab": _whole(1, 10**8),
    "seq": _whole(1, 10**8),
    "micro_batch": _whole(1, 10**6),
}

#: Every number a command or a function takes, with its stated range, by command. The command line
#: checks the parsed flags (``check_command``, before it dispatches); the functions check their own
#: arguments against the same rows (``check_values``): ``launch``, ``TrainConfig``, ``FTConfig``.
RANGES: dict[str, dict[str, Range]] = {
    "launch": {"nproc": _RANKS, "timeout_s": _seconds(), "max_restarts": _whole(0, MAX_RESTARTS)},
    "train": _TRAIN,
    "cluster": {
        **{k: v for k, v in _TRAIN.items() if k not in ("nproc", "node_size")},
        "nodes": _whole(2, 9, "addresses .11 to .19 of the cluster's subnet, replacements included"),
        "nproc_per_node": _RANKS,
        "wall_timeout_s": _seconds(),
    },
    "ft": {
        "replicas": Range(2, max_local_ranks, True, False, _ranks_words),
        "steps": _whole(1, 10**6),
        "batch": _TRAIN["batch"],
        "seed": _TRAIN["seed"],
        "lr": _TRAIN["lr"],
        "restart_after": _whole(0, 10**6),
        "heartbeat_timeout_ms": _whole(200, 600_000, "torchft's lighthouse timeout; its default is 5000"),
        "timeout_s": _seconds(),
    },
    "memory": {"dp": _whole(1, MAX_GPUS), "mp": _whole(1, MAX_GPUS), "k": Range(0, MAX_K, False)},
    "table": {"mp": _whole(1, MAX_GPUS), "k": Range(0, MAX_K, False)},  # its --dp is a list: see check_command
    "plan": {
        **_SHAPE,
        "nodes": _whole(1, MAX_NODES),
        "gpus_per_node": _whole(1, MAX_GPUS_PER_NODE),
        "tflops": Range(0, 1e7, False, True),
        "reserve": Range(0, 0.99, False),
        "batch": _whole(1, 10**9, "the global batch, in sequences of the model's length"),
        "mfu": Range(0, 1, False, True, "the achievable fraction of the GPU's peak, e.g. 0.4"),
    },
    "rehearse": {**_SHAPE, "nproc": _whole(1, 1024, "fake ranks: no process is started"), "node_size": _whole(1, 1024)},
    "bench": {
        "rounds": _whole(1, 100),
        "steps": _whole(3, 1000, "the first step is warm-up and not timed"),
        "repeats": _whole(2, 100),
    },
}


def check_values(command: str, values, *, flags: bool = False) -> None:
    """Hold ``values`` (an object's attributes or a dict) to ``RANGES[command]`` (notebook 00).

    ``flags=True`` names them as the command line does (``--bucket-cap-mb``), else as the Python
    API does (``bucket_cap_mb``). One ``CourseInputError`` for the first value out of range.
    """
    get = values.get if isinstance(values, dict) else (lambda k, d=None: getattr(values, k, d))
    for name, rule in RANGES[command].items():
        items = get(name)
        for item in items if isinstance(items, (list, tuple)) else [items]:
            rule.check(flag(name) if flags else name, item)
    if command in ("train", "ft"):
        _per_rank_batch(get("batch"), get("nproc") or get("replicas"), flag("batch") if flags else "batch")


def _per_rank_batch(batch, ranks, name: str) -> None:
    """The global batch is split across the ranks: each rank's share is what must fit its memory."""
    if isinstance(batch, int) and isinstance(ranks, int) and ranks > 0 and batch > MAX_BATCH_PER_RANK * ranks:
        raise CourseInputError(
            f"{name} {batch} is {batch // ranks:,} sequences per rank; at most {MAX_BATCH_PER_RANK} per rank "
            "(the medium course model's logits alone take ~2 MB per sequence)"
        )


#: Subcommands whose ``--params`` is a parameter count (``rehearse`` also takes preset names).
_COUNTS = ("memory", "table", "plan")


def check_command(command: str, args) -> None:
    """What the command line checks for every subcommand before it dispatches (notebook 00): every number
    finite and within 64 bits (``check_numbers``), within its stated range (``RANGES``), and a
    parameter count that says its unit (``params_count``)."""
    check_numbers(args)
    if command in RANGES:
        check_values(command, args, flags=True)
    if command in _COUNTS and getattr(args, "params", None) is not None:
        for text in str(args.params).split(","):
            params_count("--params", text)
    if command == "table" and isinstance(getattr(args, "dp", None), str):
        for part in args.dp.split(","):
            if part.strip().lstrip("-").isdigit():  # anything else the table refuses itself
                RANGES["memory"]["dp"].check("--dp", int(part))
    if command == "cluster":  # the cluster's shape starts nodes x ranks processes on this machine
        total = (getattr(args, "nodes", 0) or 0) * (getattr(args, "nproc_per_node", 0) or 0)
        if total > max_local_ranks():
            raise CourseInputError(f"--nodes x --nproc-per-node is {total} ranks, but {_ranks_words()}")


def launch_arguments(fn, nproc, args, kwargs, timeout_s, max_restarts, run_dir, env) -> None:
    """What ``launch.launch`` takes, checked before anything starts (notebook 00)."""
    if fn is None or not (callable(fn) or isinstance(fn, str)):
        raise CourseInputError(f"launch runs a function (or 'module:function') on every rank, got {fn!r}")
    check_values("launch", {"nproc": nproc, "timeout_s": timeout_s, "max_restarts": max_restarts})
    if not isinstance(args, (tuple, list)):
        raise CourseInputError(f"args must be a tuple or list of positional arguments, got {args!r}")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise CourseInputError(f"kwargs must be a dict of keyword arguments by name, got {kwargs!r}")
    if run_dir is not None:
        if not isinstance(run_dir, (str, os.PathLike)):
            raise CourseInputError(f"run_dir must be a folder's path, got {run_dir!r}")
        writable_dir("run_dir", run_dir)
    if env is None:
        return
    if not isinstance(env, dict):
        raise CourseInputError(f"env must be a dict of environment variables, got {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise CourseInputError(f"env: {key!r} cannot be an environment variable's name (empty, or with '=')")
        if value is None or "\0" in str(value):
            raise CourseInputError(f"env: the value of {key} must be text without NUL characters, got {value!r}")
