"""The house in numbers: what issue 27 counts in ``course_utils``, measured from the code's own syntax tree.

    python -m tools.house_counts            # the counts, one line each
    python -m tools.house_counts --list     # and every finding, file:line

``tests/test_layers.py`` holds the targets (CONTRIBUTING.md, "The house in numbers"). What is counted:

- **strategy-name literals**: a string constant (not a docstring) equal to a strategy's name (every row of
  ``strategies.RECORD``, plus the planner's old names ``hsdp``, ``zero2_offload``, ``zero3_offload``
  and notebook 03's ``torch_zero1``), anywhere in the package outside ``strategies.py``, except inside the
  command line's argument parsing (an ``add_argument`` or ``set_defaults`` call). Target 0: a strategy
  is named by its row (``strategies.ZERO3``), a fact about it is a field of its row.
- **name collections**: a tuple, list or set with two or more such literals, or a dict with two or more
  such keys (a table of strategy facts kept outside the record). Target 0.
- **name branches**: a comparison (``==``, ``!=``, ``in``, ``not in``) with a strategy-name literal or a
  collection of them, and a ``.startswith``/``.endswith`` test against a piece of a strategy's name
  (``"_offload"``). Target 0.
- **modules over 500 lines** (every module of the package; CONTRIBUTING names the one-idea exceptions).
- **long functions**: functions and methods over 60 lines, the docstring left out, in the mechanism and
  process-control rooms (``ROOMS``). Target 0.
- **optimizer-stepping functions**: a function that calls ``.backward()`` and then ``.step()`` (a training
  step), outside ``loop.py`` (the one loop) and ``exercises/`` (a student's own loop). Target 0.
- **dead code**: a module-level function, class or constant of the package that nothing names (the
  package, the tests, the tools, the solutions and the notebooks' code cells are searched; a name inside
  a string counts, for functions launched by name). **test-only**: named only by the tests. Target 0 for both.

The package never imports this file; it imports the package (for the record's names) and nothing else.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "course_utils"

#: Names used for strategies before the record had them all (the planner's rows, notebook 03's reference).
LEGACY_NAMES = {"hsdp", "zero2_offload", "zero3_offload", "torch_zero1"}
#: A module may be this long; CONTRIBUTING.md names the exceptions (one idea a reader would not want split).
MODULE_LINES = 500
#: A function in a mechanism or process-control room may be this long (docstring left out).
FUNCTION_LINES = 60
#: Which modules are mechanism (what a student reads to learn a strategy, and the one loop) and which are
#: process control (starting, watching and ending processes); a subpackage is named by its folder.
MECHANISM = {"ddp", "zero", "fsdp", "per_param", "examples", "apply", "strategies", "strategy_spec", "loop", "runtypes"}
PROCESS_CONTROL = {
    "launch",
    "_agent",
    "_procs",
    "_report",
    "background",
    "dist",
    "worker",
    "cluster",
    "cluster_jobs",
    "cluster_cli",
    "namespaces",
    "checkpoint",
    "checksums",
    "ft",
    "ft_config",
    "ft_groups",
    "ft_jobs",
    "ft_nodes",
    "hangs",
}
#: Calls whose string arguments are the command line's argument parsing.
ARGPARSE_CALLS = {"add_argument", "set_defaults", "add_parser", "add_argument_group"}


def strategy_names() -> set[str]:
    sys.path.insert(0, str(ROOT))
    from course_utils import strategies

    return set(getattr(strategies, "RECORD", strategies.STRATEGIES)) | LEGACY_NAMES


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


#: The reference answers to the exercises: what a student writes, who is handed a strategy's name as a string
#: (``model_states_per_gpu(..., strategy)`` is handed one), so its names are the exercise's vocabulary, not a
#: fact re-encoded.
STUDENT_CODE = PACKAGE / "exercises" / "solutions"


def room(path: Path) -> str:
    """The room a module belongs to: its name, or its folder's for a subpackage (``zero/stage3.py``: zero)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _argparse_constants(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ARGPARSE_CALLS:
            out.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Constant))
    return out


def _is_name(node, names) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names


def _pieces(names) -> set[str]:
    """Prefixes and suffixes of strategy names that a name test could use (``"_offload"``, ``"zero"``)."""
    out = set()
    for name in names:
        for i in range(4, len(name)):
            out.update({name[:i], name[-i:]})
    return out


def name_findings(names=None) -> dict[str, list[str]]:
    """``{"literals", "collections", "branches"}``: each finding as ``path:line``."""
    names = names or strategy_names()
    pieces = _pieces(names) - names
    found = {"literals": [], "collections": [], "branches": []}
    for path in _modules():
        if (path.name == "strategies.py" and path.parent == PACKAGE) or STUDENT_CODE in path.parents:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree) | _argparse_constants(tree)
        rel = path.relative_to(ROOT)
        where = lambda n, rel=rel: f"{rel}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if _is_name(node, names) and id(node) not in skip:
                found["literals"].append(where(node))
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                if sum(_is_name(e, names) and id(e) not in skip for e in node.elts) >= 2:
                    found["collections"].append(where(node))
            elif isinstance(node, ast.Dict):
                if sum(k is not None and _is_name(k, names) for k in node.keys) >= 2:
                    found["collections"].append(where(node))
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(
                    _is_name(s, names)
                    or (isinstance(s, (ast.Tuple, ast.List, ast.Set)) and any(_is_name(e, names) for e in s.elts))
                    for s in sides
                ):
                    found["branches"].append(where(node))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in pieces
            ):
                found["branches"].append(where(node))
    return found


def long_modules() -> list[str]:
    out = []
    for path in _modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LINES:
            out.append(f"{path.relative_to(ROOT)}: {lines} lines")
    return out


def function_lines(node) -> int:
    """Lines of a function, its docstring left out."""
    total = node.end_lineno - node.lineno + 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        total -= body[0].end_lineno - body[0].lineno + 1
    return total


def long_functions() -> list[str]:
    out = []
    for path in _modules():
        if room(path) not in MECHANISM | PROCESS_CONTROL:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = function_lines(node)
                if n > FUNCTION_LINES:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    return out


def _calls(node, attr: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr and not n.args
        for n in ast.walk(node)
    )


def stepping_functions() -> list[str]:
    """Functions outside ``loop.py`` and ``exercises/`` that run a training step of their own."""
    out = []
    for path in _modules():
        if path.name == "loop.py" or room(path) == "exercises":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = [n for n in ast.walk(node) if n is not node and isinstance(n, ast.FunctionDef)]
                if (
                    _calls(node, "backward")
                    and _calls(node, "step")
                    and not any(_calls(i, "backward") and _calls(i, "step") for i in inner)
                ):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return out


def _notebook_code() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
                out.append((str(path.relative_to(ROOT)), src))
    return out


def _uses(tree, skip_docstrings: bool = True) -> set[str]:
    """Every name a piece of code uses: names and attributes read, names imported, and the identifier-like
    words of its string constants (a function launched by name, ``"module:function"``), docstrings and
    ``__all__`` left out."""
    import re

    skip = _docstrings(tree) if skip_docstrings else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            skip.update(id(n) for n in ast.walk(node.value))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.name.split(".")[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return out


def _code_uses(paths) -> set[str]:
    out = set()
    for path in paths:
        out |= _uses(ast.parse(path.read_text(encoding="utf-8")))
    return out


def _notebook_uses() -> set[str]:
    out = set()
    for _, src in _notebook_code():
        lines = [line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))]
        try:
            out |= _uses(ast.parse("\n".join(lines)))
        except SyntaxError:
            continue
    return out


def _definitions() -> list[tuple[Path, str, int]]:
    """Module-level functions, classes and constants of the package: ``(path, name, line)``."""
    out = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append((path, node.name, node.lineno))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and not t.id.startswith("__"):
                        out.append((path, t.id, node.lineno))
    return out


def unused_definitions() -> dict[str, list[str]]:
    """``{"dead": [...], "test_only": [...]}``: package definitions nothing names, or only the tests name."""
    cli = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    commands = {
        k.value
        for node in ast.walk(cli)
        if isinstance(node, ast.Dict)
        for k in node.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }
    dynamic = {f"{c}_{kind}" for c in commands for kind in ("arguments", "command")}  # cli.py: getattr by name
    used = _code_uses(_modules()) | _code_uses(p for p in (ROOT / "tools").rglob("*.py")) | _notebook_uses()
    tests = _code_uses((ROOT / "tests").glob("*.py"))
    dead, test_only = [], []
    for path, name, line in _definitions():
        if name in used or name in dynamic or name.startswith("__"):
            continue
        where = f"{path.relative_to(ROOT)}:{line} {name}"
        (test_only if name in tests else dead).append(where)
    return {"dead": dead, "test_only": test_only}


def counts() -> dict:
    names = name_findings()
    unused = unused_definitions()
    return {
        "strategy-name literals": names["literals"],
        "name collections": names["collections"],
        "name branches": names["branches"],
        f"modules over {MODULE_LINES} lines": long_modules(),
        f"functions over {FUNCTION_LINES} lines (mechanism, process control)": long_functions(),
        "optimizer-stepping functions outside loop and exercises": stepping_functions(),
        "dead code": unused["dead"],
        "test-only code in the package": unused["test_only"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.house_counts", description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print every finding")
    args = parser.parse_args(argv)
    for what, found in counts().items():
        print(f"{len(found):5d}  {what}")
        if args.list:
            for item in found:
                print(f"         {item}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
