"""The worker side of every run: one switch for backend and device (introduced in notebook 00).

A worker function calls ``init()`` first and gets a ``DistInfo``. The same call works

- under ``course_utils.launch`` (which sets ``COURSE_BACKEND`` and ``COURSE_TIMEOUT_S``),
- under plain ``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
- in a plain single process with none of those set (world size 1, an in-memory store),

so worker code is identical at world size 1 and N. The rule for the backend, in one place:
NCCL with one GPU per local rank when there are at least that many GPUs, gloo on CPU otherwise.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import CourseInputError

DEFAULT_TIMEOUT_S = 300.0
BACKENDS = ("auto", "gloo", "nccl")


def pick_backend(nproc_per_node: int, requested: str = "auto") -> tuple[str, str]:
    """Return ``(backend, device_type)`` for ``nproc_per_node`` local ranks (notebook 00).

    "auto" chooses ("nccl", "cuda") when ``torch.cuda.device_count() >= nproc_per_node``
    and ("gloo", "cpu") otherwise. "nccl" with too few GPUs is an error that says so.
    """
    if requested not in BACKENDS:
        raise CourseInputError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "gloo":
        return "gloo", "cpu"
    if requested == "nccl":
        if gpus < nproc_per_node:
            raise CourseInputError(
                f"backend='nccl' needs one GPU per rank: {nproc_per_node} ranks but {gpus} GPU(s) here; "
                "use backend='auto' (gloo on CPU) or fewer ranks"
            )
        return "nccl", "cuda"
    return ("nccl", "cuda") if gpus >= nproc_per_node and gpus > 0 else ("gloo", "cpu")


@dataclass(frozen=True)
class DistInfo:
    """Who this process is in the run (notebook 00)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one (a node of
    ``course_utils.cluster`` gets its own share of the host), else the machine's count (notebook 00)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


#: cuBLAS's workspace setting for reproducible results (NVIDIA's cuBLAS guide, "Results reproducibility";
#: torch's reproducibility notes). It must be in the environment before the first cuBLAS call.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def make_deterministic(device: torch.device) -> dict:
    """Make this process's CUDA kernels deterministic, so the course's bit-for-bit comparisons hold
    on GPUs as they do on CPU (called by ``init``; notebooks 02, 03 and 06 compare SHA-256s).

    On CPU nothing is changed: torch's CPU kernels the course uses already give the same bits for
    the same inputs, and the CPU comparisons are what the tests check. On CUDA:

    - ``torch.use_deterministic_algorithms(True)`` (strict, not ``warn_only``): operations with a
      deterministic variant use it (for example scaled-dot-product attention's flash and
      memory-efficient backward passes, which otherwise add with atomics), and one without raises
      rather than silently differing;
    - ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set only if unset): what torch asked for before cuBLAS
      workspaces became per handle and stream; harmless where torch no longer checks it;
    - ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark = False``:
      cuDNN picks the same deterministic algorithm every run instead of the fastest it timed.

    What this cannot promise: NCCL chooses a ring or tree algorithm from the message size and the
    topology, and the order a ring or tree adds the ranks' values follows from it. With 2 ranks
    every element is one addition a + b, the same bits in either order, so 2-rank comparisons stay
    bit for bit. With more ranks, runs whose gradients travel in different message sizes (DDP's
    buckets against a hand-built layout, a reduce-scatter against an all-reduce) can round
    differently: those comparisons get the tolerance the notebooks already use on CPU for more
    than 2 ranks (relative weight difference <= 1e-4, labs.lab04.TOLERANCE["fp32"]). The same run
    repeated (same ranks, sizes, GPUs and NCCL version), as a resumed run is, reduces in the same
    order. Returns the settings in force, for reports.
    """
    if device.type != "cuda":
        return {"deterministic": False, "why": "CPU kernels need no settings"}
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {
        "deterministic": True,
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
    }


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued on it; nothing to wait for on CPU (notebook 05).

    CUDA kernels run asynchronously: a host clock read right after a launch measures the launch,
    not the work. Every host-side timer of device work calls this before reading the clock.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(backend: str | None = None, timeout_s: float | None = None, *, deterministic: bool = True) -> DistInfo:
    """Join the process group (or create a world of one) and pick this rank's device (notebook 00).

    Args:
        backend: "auto", "gloo" or "nccl"; default from ``COURSE_BACKEND``, else "auto".
        timeout_s: how long a collective may wait for the other ranks before it raises;
            default from ``COURSE_TIMEOUT_S``, else 300 s. This is what turns a hang
            (a rank that never arrives) into an error.
        deterministic: on a GPU, apply ``make_deterministic`` (what the bit-for-bit comparisons
            need); a pure timing run may pass False for the faster, non-deterministic kernels.
    """
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    requested = backend or os.environ.get("COURSE_BACKEND", "auto")
    backend_name, device_type = pick_backend(local_world, requested)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if deterministic:
            make_deterministic(device)
    else:
        device = torch.device("cpu")
        # N processes on a few cores: split the cores instead of oversubscribing them
        # (torchrun sets OMP_NUM_THREADS=1 for the same reason).
        torch.set_num_threads(max(1, usable_cores() // max(1, local_world)))
    if not dist.is_initialized():
        release_left_groups()  # the last session's locals are gone by now: its groups can go too
        timeout = timedelta(seconds=float(timeout_s or os.environ.get("COURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
        if "MASTER_ADDR" in os.environ and local_world == world:
            listen_on_loopback()  # every rank on this machine: nothing needs to listen beyond it
        if "MASTER_ADDR" in os.environ:  # torchrun / elastic agent: rendezvous through env://
            dist.init_process_group(
                backend_name,
                store=attempt_store(timeout),
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=device if device_type == "cuda" else None,
            )
        else:  # a plain process: a world of one, so the same collectives still run
            dist.init_process_group(backend_name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world,
        backend=backend_name,
        device=device,
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
    )


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), or None (notebook 00)."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def listen_on_loopback() -> None:
    """Make gloo and NCCL's bootstrap listen on loopback, unless told otherwise (notebook 00; issue 34).

    Both listen on the interface they pick, by default the one this machine's host name resolves to:
    on a machine whose name resolves to its network address, a plain ``torchrun --standalone`` job
    would accept connections from the network. A job whose every rank is on this machine needs none,
    so ``init`` sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to loopback when they are unset
    (``launch`` does the same for its runs). torchrun's own rendezvous store is another matter: torch
    2.13's ``TCPStore`` takes no bind address and listens on every interface (README, "Nothing
    listens beyond the machine").
    """
    name = loopback_interface()
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def attempt_store(timeout: timedelta):
    """Under plain torchrun, the agent's store seen through a prefix of this attempt, else None (notebook 06).

    torchrun (torch 2.13) hands its own rendezvous TCPStore to the workers and keeps it across
    restarts, with no prefix per attempt (``torch.distributed.rendezvous._create_c10d_store``:
    "We create a new TCPStore for every retry"; the agent does not). A restarted group then
    reads the dead attempt's gloo addresses under the same keys: "Gloo connectFullMesh failed
    ... Connection refused", or a hang (pytorch/pytorch#135712). Measured with the README's
    torchrun line on 4 gloo ranks: 0 of 3 tries finished. Prefixing every key with the attempt
    number gives each attempt keys of its own, whatever torchrun's environment, so ``launch`` no
    longer sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (``tools/torchrun_store_check.py`` runs
    both on a two-rank gloo job); with that variable set the store is not shared and this returns None.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None  # init_process_group's env:// store, as usual
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"course_utils/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", store)


@contextmanager
def session(backend: str | None = None, timeout_s: float | None = None):
    """``with session() as info:`` joins the group and leaves it when the block ends (notebook 00).

    On an exception the group is *not* torn down first: the error is recorded (torch's
    ``@record`` error file) before this process's sockets close, so the launcher can tell the
    rank that failed first from the peers whose collectives then lost it.
    """
    info = init(backend, timeout_s)
    yield info
    shutdown()


#: The groups ``shutdown`` left, kept until ``release_left_groups``: see ``shutdown`` for why.
_left_groups: list = []


def shutdown() -> None:
    """Leave the process group if this process joined one (notebook 00).

    Leaving does not free a gloo group: torch 2.13's ``destroy_process_group`` only unregisters it
    (gloo has no ``shutdown``), and a DDP module's C++ Reducer still holds it. It was freed when the
    DDP module was, as the worker function returned, in ``~ProcessGroupGloo``, which joins gloo's
    worker threads while the main thread holds the GIL. The thread that ran a backward's last
    all-reduce may not have retired that work yet, and retiring it needs the GIL: the work copied
    the thread-local state of the backward, which holds a Python object (the ``contextvars.Context``
    that ``torch.autograd.graph._engine_run_backward`` stashes). Each waited for the other, for
    ever: a rank that returned and never finished (2 of 65 launches of notebook 02's DDP reference
    beside two busy loops; the native stacks are in the commit that made this change).

    So the groups left here are kept, and ``release_left_groups`` frees them once the function's
    locals are gone. Freed from Python, a group's destructor runs with the GIL released (torch binds
    ``ProcessGroup`` so, pytorch/pytorch#154976), and gloo's threads can finish
    (``tests/test_launch.py`` makes the wait certain and checks that the rank finishes).
    """
    if dist.is_initialized():
        _left_groups.extend(dist.distributed_c10d._world.pg_map)  # the default group and any subgroup
        dist.destroy_process_group()


def release_left_groups() -> None:
    """Free the groups ``shutdown`` left, now that nothing else should hold them (notebook 00).

    Called where a worker function's locals are gone: by ``run_in_worker`` once the function has
    returned, by ``init`` before it joins a new group, and at exit. A group that something still
    holds (a DDP module kept in a global) is freed with that object instead.
    """
    _left_groups.clear()


atexit.register(release_left_groups)  # before the interpreter tears down: gloo's threads may still need it


def check_mesh_shape(world_size: int, mesh_shape) -> tuple[int, ...]:
    """Validate a device-mesh shape against the world size (notebook 04)."""
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s < 1 for s in shape):
        raise CourseInputError(f"mesh shape {mesh_shape!r} must be positive integers, e.g. (2, 2)")
    prod = 1
    for s in shape:
        prod *= s
    if prod != world_size:
        raise CourseInputError(
            f"mesh shape {shape} holds {prod} ranks but the world has {world_size}; "
            f"choose sizes whose product is {world_size} (e.g. ({max(world_size // 2, 1)}, {min(2, world_size)}))"
        )
    return shape


def init_mesh(info: DistInfo, mesh_shape, names: tuple[str, ...]):
    """A DeviceMesh over all ranks on this run's device type (notebook 04)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = check_mesh_shape(info.world_size, mesh_shape)
    return init_device_mesh(info.device.type, shape, mesh_dim_names=names)


def print_line(text: str) -> None:
    """Write ``text`` and its newline to stdout in one system call (notebook 00).

    Ranks of one job often share a pipe (plain torchrun does not separate them). ``print``
    may issue the text and the newline as two writes (it does when Python runs unbuffered, as
    under torchrun), so two ranks' lines can splice into one. A single write of up to
    PIPE_BUF (4096) bytes lands whole.
    """
    stream = sys.stdout
    try:  # a notebook's or a test's own stream has no file descriptor of its own
        fd = stream.fileno() if isinstance(stream, io.TextIOWrapper) else None
    except (OSError, ValueError):
        fd = None
    if fd is None:
        stream.write(text + "\n")
        stream.flush()
        return
    stream.flush()
    data = (text + "\n").encode(stream.encoding or "utf-8", "replace")
    while data:
        data = data[os.write(fd, data) :]


def log(*parts) -> None:
    """Print one line prefixed with this rank, flushed at once so it shows up live (notebook 00)."""
    rank = dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)
    print_line(" ".join([f"[rank {rank}]", *map(str, parts)]))


def report_progress(step: int, total: int, **fields) -> None:
    """Tell ``course_utils.launch`` how far this rank has got (no-op under plain torchrun).

    Written atomically (temp file + rename) to ``$COURSE_PROGRESS_DIR/rank<r>.json``; the
    launcher reads it to draw a live per-rank status line (notebook 00).
    """
    folder = os.environ.get("COURSE_PROGRESS_DIR")
    if not folder:
        return
    rank = dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)
    payload = {"rank": rank, "step": int(step), "total": int(total), "pid": os.getpid(), **fields}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".rank{rank}-")
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def environment_report(nproc: int = 2) -> dict:
    """What this machine offers the course, and which backend ``launch`` picks for ``nproc`` ranks (notebook 00)."""
    import platform

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, device_type = pick_backend(nproc, "auto")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "cuda_gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "gloo_available": dist.is_gloo_available(),
        "nccl_available": dist.is_nccl_available(),
        f"backend_for_{nproc}_ranks": f"{backend} on {device_type}",
    }


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
