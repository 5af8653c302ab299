"""A student's function called from outside the seal, and what comes back (issue 29; the grader is ``grading``).

``Call`` stands in for the student's function when a check's ``judge`` runs in the grader: each call sends the
arguments into the seal (pickled: the grader's data going in), where the student's process runs the function in
a child of its own, and brings back the return value as JSON that ``decode`` turns into numbers, strings,
lists, tuples, dicts and tensors, and nothing else: no code of the student's runs here, whatever it sends.
"""

from __future__ import annotations

import base64
import io
import os
import tarfile
import time
from pathlib import Path

from .seal import Seal, SealEnded

# ---------------------------------------------------------------------------------------------
# What comes out of the seal: plain data only
# ---------------------------------------------------------------------------------------------


class Opaque:
    """Something the student's function returned that is not plain data: only its type's name came out."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = str(type_name)[:100], str(text)[:200]

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"


def decode(x):
    """Build the value ``answers.encode`` described: numbers, strings, lists, tuples, dicts, tensors. Runs no code
    of the student's (JSON in, plain objects and tensors of the known dtypes out)."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(decode(v) for v in x["__tuple__"])
    if "__dict__" in x:
        out = {}
        for k, v in x["__dict__"]:
            k = decode(k)
            try:
                out[k] = decode(v)
            except TypeError:  # an unhashable key (a list): not a dict the check can use
                return Opaque("dict", "with unhashable keys")
        return out
    if "__tensor__" in x:
        import torch

        from .answers import TENSOR_DTYPES

        name, shape, data = x["__tensor__"]
        if name not in TENSOR_DTYPES or not all(isinstance(s, int) and s >= 0 for s in shape):
            return Opaque("Tensor", "of an unknown kind")
        dtype = getattr(torch, name)
        raw = base64.b64decode(data)
        numel = 1
        for s in shape:
            numel *= s
        if numel * torch.empty((), dtype=dtype).element_size() != len(raw):
            return Opaque("Tensor", "whose bytes do not match its shape")
        if not numel:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()
    if "__opaque__" in x:
        return Opaque(x["__opaque__"], x.get("repr", ""))
    return Opaque("dict", "unreadable")


# ---------------------------------------------------------------------------------------------
# Calling the student's function from here
# ---------------------------------------------------------------------------------------------


class StudentRaised(Exception):
    """The student's function raised; ``line`` says what, in one line."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


class CallTimedOut(Exception):
    pass


class CallDied(Exception):
    pass


class Call:
    """The student's function, as the course's ``judge`` sees it: each call runs inside the seal, in a fresh
    child of the student's process, and returns the decoded answer. A folder named in the arguments travels
    by value (the seal has its own filesystem): the function gets the path of a copy."""

    def __init__(self, seal: Seal, name: str, deadline: float):
        self.seal, self.name, self.deadline = seal, name, deadline

    def __call__(self, *args, **kwargs):
        import cloudpickle

        trees = {}
        for v in (*args, *kwargs.values()):
            if isinstance(v, (str, os.PathLike)) and os.path.isabs(str(v)) and os.path.isdir(v):
                trees[str(v)] = _tar(Path(v))
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CallTimedOut
        request = {
            "op": "call",
            "name": self.name,
            "args": base64.b64encode(cloudpickle.dumps((args, kwargs))).decode(),
            "trees": trees,
            "timeout_s": left,
        }
        try:
            answer = self.seal.ask(request, left + 10.0)
        except TimeoutError:  # the student's process itself stopped answering, not only the call
            raise SealEnded(self.seal.close(kind="stuck")) from None
        if "value" in answer:
            return decode(answer["value"])
        if answer.get("not_done"):
            raise NotImplementedError
        if answer.get("timeout"):
            raise CallTimedOut
        if "died" in answer:
            raise CallDied(str(answer["died"])[:200])
        raised = answer.get("raised")
        if isinstance(raised, dict):
            where = f" ({raised.get('where')})" if raised.get("where") else ""
            msg = f": {raised.get('message')}" if raised.get("message") else ""
            raise StudentRaised(f"it raised {str(raised.get('type'))[:60]}{msg}{where}"[:400])
        raise StudentRaised("the student's process answered nonsense (its machinery was changed by a cell)")


def _tar(folder: Path) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(folder, arcname=".")
    return base64.b64encode(buffer.getvalue()).decode()
