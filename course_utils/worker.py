"""What every worker runs: under ``launch``, and any course worker function under plain torchrun (notebook 00).

One machine, four processes::

    torchrun --standalone --nproc-per-node 4 -m course_utils.worker course_utils.examples:all_reduce_demo

Two machines of 8 GPUs (run the same line on both; HOST is the first machine)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m course_utils.worker course_utils.examples:all_reduce_demo

Positional and keyword arguments travel as JSON: ``--args '[1, 2]' --kwargs '{"n": 4}'``.
Each rank prints its return value as one JSON line.

Under ``course_utils.launch`` every worker runs ``run_in_worker``: it unpacks the call the caller
sent, runs it, and leaves its result (or the one line that explains its failure) in the run's folder.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import pickle
import signal
import sys
import tempfile
import time

from .dist import print_line, release_left_groups


def call(target: str, args: tuple, kwargs: dict):
    """Worker entry point under plain torchrun: import ``module:qualname`` and call it (``course_utils.worker``)."""
    return _resolve(target)(*args, **kwargs)


def _resolve(target: str):
    module, _, qualname = target.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def target_of(fn) -> str | None:
    """``module:qualname`` when a worker can import ``fn`` by name, else None (it travels by value).

    A string names the target itself, and must import here (``CourseInputError`` otherwise).
    """
    from .errors import CourseInputError

    if isinstance(fn, str):
        target = fn
        module, sep, qualname = target.partition(":")
        if not (module and sep and qualname):
            raise CourseInputError(f"launch takes a function or 'module:function', got {fn!r}")
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module in (None, "__main__") or "<" in qualname:  # a notebook cell, a lambda, a nested def
            return None
        target = f"{module}:{qualname}"
    try:
        obj = _resolve(target)
    except (ImportError, AttributeError, ValueError) as exc:
        if isinstance(fn, str):
            raise CourseInputError(f"launch cannot import {target!r} ({exc}); check the module and name") from None
        return None
    if not callable(obj):
        raise CourseInputError(f"{target!r} is not callable; pass a function")
    return target


_stack_file = None  # kept open for the life of the worker: faulthandler writes to its descriptor


def dump_stacks_on(path: str) -> None:
    """On SIGUSR1, write every thread's Python stack to ``path`` (appended; read from the end).

    The launcher sends SIGUSR1 to a run's whole process group before it stops a hung run, so the
    error can say where each rank was waiting, and a rank whose collective timed out sends it to
    its peers before it raises, so a hang names the rank that never arrived.
    """
    global _stack_file
    if _stack_file is not None:
        _stack_file.close()
    _stack_file = open(path, "a")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    # a native crash (SIGABRT from glibc's heap checks, SIGSEGV) leaves no Python error: dump every thread's stack
    # to the same file first, so the launcher's error says where the rank was (the file outlives pytest's tmp dirs
    # only through that message)
    faulthandler.enable(file=_stack_file, all_threads=True)


def adopt_sys_path(caller_path: list) -> None:
    """Put the caller's ``sys.path`` first, so what imports in the notebook imports here too."""
    sys.path[:] = list(caller_path) + [p for p in sys.path if p not in caller_path]


def _looks_like_a_collective_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return "Timed out" in text or "timed out" in text or "Timeout" in type(exc).__name__


def _ask_peers_where_they_are() -> None:
    """A collective of this rank timed out: every process of the run (the rank that never arrived
    too) writes its stack now, before the agent stops them; the launcher puts it in the error."""
    try:
        os.killpg(os.getpgrp(), signal.SIGUSR1)
        time.sleep(0.3)
    except OSError:
        pass


def run_in_worker(payload: bytes, progress_dir: str) -> None:
    """What every worker of a ``launch`` runs: unpack the call, run it, leave its result in a file.

    ``payload`` is ``(sys.path, fn or "module:qualname", args, kwargs)`` pickled by the caller with
    cloudpickle, so a function defined in a notebook cell travels by value. The return value goes
    to ``result-rank<r>.pkl`` in the run's folder, written by the rank itself: the caller reads the
    results from there, whatever the agent does after the workers return.

    Two ways a worker could otherwise vanish without a word: a ``KeyboardInterrupt`` raised by the
    function is swallowed by torch's worker wrapper (``torch.multiprocessing.spawn._wrap``: the
    process exits 0 with no result while its peers wait), so it is raised again as an error; and a
    SIGINT sent to this one process writes its Python stack, then ends it at once (the launcher
    names the signal and where the rank was), instead of waiting for the collective it is in.
    """
    rank = int(os.environ.get("RANK", "0"))
    tempfile.tempdir = (
        None  # the agent's points into the run's folder (for torch's error files); the user's code gets TMPDIR's
    )
    dump_stacks_on(os.path.join(progress_dir, f"stack-rank{rank}.txt"))
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    faulthandler.register(signal.SIGINT, file=_stack_file, all_threads=True, chain=True)
    _, fn, args, kwargs = _unpack(payload)
    if isinstance(fn, str):
        fn = _resolve(fn)
    try:
        value = run_the_function(fn, args, kwargs)
    except KeyboardInterrupt as exc:
        raise RuntimeError(
            f"rank {rank}'s function raised KeyboardInterrupt; a worker is never sent Ctrl-C (the launch is), "
            "so it came from the code itself: raise another exception to stop a rank"
        ) from exc
    except BaseException as exc:
        if _looks_like_a_collective_timeout(exc):
            _ask_peers_where_they_are()
        _note_the_cause(exc, progress_dir, rank)
        raise
    try:
        data = pickle.dumps((int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), value))
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a value that cannot be sent back to the caller ({exc}); "
            "return plain data (numbers, strings, lists, dicts, tensors)"
        ) from None
    tmp = os.path.join(progress_dir, f".result-rank{rank}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, os.path.join(progress_dir, f"result-rank{rank}.pkl"))
    del value
    release_left_groups()  # the function's locals are gone: free the groups it left (dist.shutdown says why)


def run_the_function(fn, args, kwargs):
    """Call the worker function: its own frame, so a stack stopped here after ``fn`` returned (no deeper
    Python frame) says the rank was freeing the function's locals (``_report._where``)."""
    return fn(*args, **kwargs)


def _note_the_cause(exc: BaseException, progress_dir: str, rank: int) -> None:
    """Leave the one line a user needs when a worker fails for a reason that is theirs to fix.

    Bad input found only once the workers ran (a ``CourseInputError``: a checkpoint folder that does
    not verify, a loss gone to nan) and a full disk (ENOSPC). The launcher puts the line first in its
    error (``WorkerFailed.input_error``), so the command line can print it alone.
    """
    import errno

    from .errors import CourseInputError

    if isinstance(exc, CourseInputError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else ""
        text = f"rank {rank}: no space left on the device (ENOSPC){where}; free space and run the same command again"
    else:
        return
    try:
        with open(os.path.join(progress_dir, f"cause-rank{rank}.txt"), "w") as fh:
            fh.write(" ".join(text.split()))
    except OSError:  # a full disk may refuse this too: the traceback still says it
        pass


def _unpack(payload: bytes):
    caller_path, blob = pickle.loads(payload)
    adopt_sys_path(caller_path)  # before the call is unpickled: it may name the caller's modules
    return (caller_path, *pickle.loads(blob))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.worker", description=__doc__.split("\n")[0])
    parser.add_argument("target", help="module:function, e.g. course_utils.examples:all_reduce_demo")
    parser.add_argument("--args", default="[]", help="JSON list of positional arguments")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    ns = parser.parse_args(argv)
    try:
        args, kwargs = json.loads(ns.args), json.loads(ns.kwargs)
    except json.JSONDecodeError as exc:
        print(f"python -m course_utils.worker: error: --args/--kwargs must be JSON ({exc})", file=sys.stderr)
        return 2
    value = call(ns.target, tuple(args), kwargs)
    print_line(json.dumps({"rank": int(os.environ.get("RANK", 0)), "result": value}, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
