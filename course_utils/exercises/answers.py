"""The student's side of a grading seal: run the student's cells, then answer the grader's questions (issue 29).

Started by ``seal.Seal`` inside the seal as ``python -m course_utils.exercises.answers``; it reads one JSON request
per line on one pipe and writes one JSON answer per line on another (``COURSE_SEAL_FDS``). Everything here runs
beside the student's code and can be changed by it, so nothing here judges anything: it runs the student's
cells, calls the student's functions on the arguments the grader sends, and reports what came back as plain
data (``encode``; the grader decodes it without running any code: ``grading.decode``).

Requests (``op``):

- ``cells``: run the notebook's cells in an IPython shell (the names a notebook cell defines, as in Jupyter);
  answer which exercise names are defined, which are untouched stubs, and how each cell ended;
- ``call``: call one of the student's functions in a forked worker, one per exercise (an endless loop, a crash
  or a memory bomb there ends the worker and what it started, not this process), and answer its return value,
  what it raised, or how it died; ``done``: the grader is done with that exercise, end its worker;
- ``ranks``: run the distributed checks' ``on_rank`` on real ranks (``launch``, gloo on loopback) with the
  student's functions, and answer every rank's observations;
- ``bye``: exit.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import signal
import sys
import tarfile
import time
import traceback

#: Tensor dtypes that travel as raw bytes (anything else is reported by its type name only).
TENSOR_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


def encode(x, depth: int = 0):
    """``x`` as JSON-able data: numbers, strings, lists, tuples, dicts and tensors; anything else by its name."""
    torch = sys.modules.get("torch")  # no torch imported: no tensor to meet (and no import to wait for)
    if depth > 20:
        return {"__opaque__": type(x).__name__, "repr": "(nested too deep)"}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x)
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        name = str(t.dtype).replace("torch.", "")
        if name in TENSOR_DTYPES and not t.is_sparse:
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {"__tensor__": [name, list(t.shape), base64.b64encode(raw).decode()]}
    elif isinstance(x, (list, tuple)):
        items = [encode(v, depth + 1) for v in x]
        return items if type(x) is list else {"__tuple__": items}
    elif isinstance(x, dict):
        return {"__dict__": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    elif hasattr(x, "item") and hasattr(x, "dtype") and getattr(x, "shape", None) == ():  # a numpy scalar
        return encode(x.item(), depth + 1)
    try:
        text = repr(x)[:200]
    except Exception:
        text = "?"
    return {"__opaque__": type(x).__name__, "repr": text}


def one_line(exc: BaseException) -> dict:
    """What an exception of the student's code says, in one line, with the student's own line where known."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename.startswith("<") or "course_utils" not in f.filename]
    where = f"line {mine[-1].lineno}: {mine[-1].line.strip()}" if mine and mine[-1].line else ""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return {"type": type(exc).__name__, "message": text, "where": where}


class Answers:
    def __init__(self):
        self.shell = None
        self.calls = 0
        self.worker = None

    # -- cells ----------------------------------------------------------------------------------

    def cells(self, request: dict) -> dict:
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        import course_utils.exercises as exercises_package
        from course_utils.exercises import core

        if request.get("warm"):
            from course_utils import launch

            launch.warm_up()  # the launcher's agent server imports torch while the cells run
        config = Config()
        config.HistoryManager.enabled = False
        config.InteractiveShell.colors = "NoColor"
        self.shell = InteractiveShell.instance(config=config)
        exercises_package.check = deferred_check  # the grader checks; a cell's check call only says so
        ran = []
        # What every stub may use (core.CELL_GLOBALS), then the imports of the notebook's own cells, which the
        # grader does not run (its lecture): the student's functions see the names they saw in the notebook.
        for statement in [core.CELL_GLOBALS, *request.get("imports", ())]:
            self.shell.run_cell(statement, store_history=False)
        for index, source in request["cells"]:
            result = self.shell.run_cell(source, store_history=True)
            exc = result.error_before_exec or result.error_in_exec
            ran.append({"index": index, "error": one_line(exc) if exc is not None else None})
        names = {}
        for name in request.get("names", ()):
            ns = self.shell.user_ns
            if name not in ns:
                names[name] = {"defined": False}
                continue
            value = ns[name]
            names[name] = {"defined": True, "callable": callable(value), "type": type(value).__name__}
            if callable(value):
                try:
                    names[name]["stub"] = core.is_stub(value)
                except Exception:
                    names[name]["stub"] = False
        st = os.statvfs(os.environ.get("TMPDIR", "/tmp"))
        disk = {"used": (st.f_blocks - st.f_bfree) * st.f_frsize, "total": st.f_blocks * st.f_frsize}
        return {"cells": ran, "names": names, "disk": disk}

    # -- calls, in a child ------------------------------------------------------------------------

    def call(self, request: dict) -> dict:
        name = request["name"]
        fn = self.shell.user_ns.get(name) if self.shell else None
        if not callable(fn):
            return {"raised": {"type": "NameError", "message": f"{name} is not defined", "where": ""}}
        if self.worker is not None and self.worker.name != name:
            self.done({})
        if self.worker is None:
            self.worker = _Worker(name, fn)
        blob = request["args"]
        if request.get("trees"):
            import cloudpickle

            args, kwargs = pickle.loads(base64.b64decode(blob))
            self.calls += 1
            args, kwargs = self._unpack_trees(request["trees"], args, kwargs)
            blob = base64.b64encode(cloudpickle.dumps((args, kwargs))).decode()
        answer = self.worker.call(blob, float(request["timeout_s"]))
        if "timeout" in answer or "died" in answer:
            self.done({})
        return answer

    def done(self, request: dict) -> dict:
        """The grader is done with an exercise: end its worker and whatever the worker started."""
        if self.worker is not None:
            self.worker.end()
            self.worker = None
        return {"ok": True}

    def _unpack_trees(self, trees: dict, args, kwargs):
        """Folders the grader named in the arguments, copied here; the arguments name the copies."""
        if not trees:
            return args, kwargs
        base = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"grader-files-{self.calls}")
        mapping = {}
        for i, (original, blob) in enumerate(trees.items()):
            dest = os.path.join(base, str(i))
            os.makedirs(dest)
            with tarfile.open(fileobj=io.BytesIO(base64.b64decode(blob))) as tar:
                tar.extractall(dest, filter="data")
            mapping[original] = dest

        def swap(v):
            return mapping.get(str(v), v) if isinstance(v, (str, os.PathLike)) else v

        return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}

    # -- ranks ----------------------------------------------------------------------------------

    def ranks(self, request: dict) -> dict:
        from course_utils.exercises.core import run_on_ranks
        from course_utils.launch import LaunchError, launch

        self.done({})
        ns = self.shell.user_ns
        jobs = [(nb, name, ns.get(name)) for nb, name in request["jobs"]]
        try:
            run = launch(
                run_on_ranks,
                nproc=int(request["nproc"]),
                args=(jobs,),
                timeout_s=float(request["timeout_s"]),
                progress=False,
                echo=False,
                backend="gloo",
            )
        except LaunchError as exc:
            return {"launch_error": str(exc).strip().splitlines()[0][:500] if str(exc).strip() else "failed"}
        return {"per_rank": {str(rank): encode(values) for rank, values in run.items()}}


class _Worker:
    """A forked child that calls one of the student's functions, call after call (a check calls it many times,
    as a notebook would, in one process). It leads its own process group; when its exercise is done, or a call
    runs out of time or kills it, the group is ended: nothing it started outlives it."""

    def __init__(self, name: str, fn):
        self.name = name
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)
                os.close(req_w)
                os.close(resp_r)
                _serve(fn, req_r, resp_w)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(resp_w)
        self.pid = self.pgid = pid
        self.req_w, self.resp_r, self.buffer = req_w, resp_r, b""

    def call(self, blob: str, timeout_s: float) -> dict:
        import select

        try:
            _write_all(self.req_w, blob.encode() + b"\n")
        except OSError:
            return self._died()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"timeout": True}
            ready, _, _ = select.select([self.resp_r], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self.resp_r, 1 << 20)
                if not chunk:
                    return self._died()
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def _died(self) -> dict:
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        if os.WIFSIGNALED(status):
            return {"died": f"killed by {signal.Signals(os.WTERMSIG(status)).name}"}
        return {"died": f"exited with status {os.WEXITSTATUS(status)} before returning"}

    def end(self) -> None:
        _end_group(self.pgid)  # the worker and every process it started
        if self.pid is not None:
            os.waitpid(self.pid, 0)
        for fd in (self.req_w, self.resp_r):
            os.close(fd)


def _serve(fn, read_fd: int, write_fd: int) -> None:
    """In the worker: one call per request line, one answer per line."""
    for line in os.fdopen(read_fd, "rb"):
        args, kwargs = pickle.loads(base64.b64decode(line))
        try:
            answer = {"value": encode(fn(*args, **kwargs))}
        except NotImplementedError:
            answer = {"not_done": True}
        except Exception as exc:
            answer = {"raised": one_line(exc)}
        _write_all(write_fd, json.dumps(answer).encode() + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def deferred_check(notebook, name, fn):
    """``check`` inside the seal: the grader runs every check itself, outside, after the cells."""
    print(f"(exercise {notebook}.{name} is checked by the grader)")


def main() -> int:
    read_fd, write_fd = (int(fd) for fd in os.environ["COURSE_SEAL_FDS"].split(","))
    os.set_inheritable(read_fd, False)
    os.set_inheritable(write_fd, False)
    requests, answers = os.fdopen(read_fd, "rb"), os.fdopen(write_fd, "wb")
    server = Answers()
    for line in requests:
        request = json.loads(line)
        op = request.get("op")
        if op == "bye":
            answers.write(json.dumps({"ok": True, "id": request.get("id")}).encode() + b"\n")
            answers.flush()
            break
        try:
            known = ("cells", "call", "done", "ranks")
            answer = getattr(server, op)(request) if op in known else {"error": "unknown op"}
        except Exception as exc:  # the student's code broke this process's own machinery
            answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        answer["id"] = request.get("id")
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.flush()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
