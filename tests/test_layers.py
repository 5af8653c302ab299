"""Which way imports point inside course_utils (CONTRIBUTING.md, "The map"): down only, no cycles.

Every import counts, at the top of a module or inside a function: a lazy import must not hide
an upward dependency or a cycle. ``python -m pytest tests/test_layers.py`` prints what is wrong.
"""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGE = ROOT / "course_utils"

#: The layers, lowest first. A module may import modules of its own layer or below, never above.
LAYERS = [
    {"errors", "units", "__init__", "compat"},
    {"strategies", "comm", "stepper", "validate"},  # the record; pure arithmetic; input checks
    {
        "models",
        "data",
        "memory",
        "dist",
        "instrument",
        "_agent",
        "worker",  # model, data, the bill, observers;
        "checksums",
    },  # a state dict's checksums in any layout
    {"launch", "checkpoint", "plan", "predict"},  # processes; DCP; planner; predictions
    {"loop"},  # the one loop and its types
    {"ddp", "zero", "fsdp", "per_param", "examples"},  # strategies: the mechanism, apply_*
    {"train", "rehearse", "plots"},  # the run and its CLI; rehearsal; figures
    {"widgets", "bench", "cli", "__main__", "ft", "ft_groups", "ft_nodes", "hangs", "cluster"},  # views; commands
    {"labs", "exercises"},  # each notebook's experiments and exercises
]
#: Arithmetic: what the course's numbers rest on. They start no process and never touch torch.distributed.
ARITHMETIC = {"memory", "comm", "plan", "predict"}


def _name(path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0] if len(rel.parts) > 1 else rel.name  # a subpackage (labs, exercises) is one unit


def _imports(path) -> set[tuple[str, str]]:
    """``(module, what)`` for every import of a package module in ``path``."""
    here = path.relative_to(PACKAGE).parent.parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - (node.level - 1)]) if node.level > 1 else list(here)
            target = (node.module or "").split(".") if node.module else []
            parts = base + [p for p in target if p]
            if parts:
                out.add((parts[0], node.module or ""))
            else:  # from . import x, y
                out.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_utils."):
            out.add((node.module.split(".")[1], node.module))
        elif isinstance(node, ast.Import):
            out.update((a.name.split(".")[1], a.name) for a in node.names if a.name.startswith("course_utils."))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        graph.setdefault(_name(path), set()).update(m for m, _ in _imports(path) if m != _name(path))
    return graph


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i
    raise AssertionError(f"course_utils.{module} is in no layer: add it to LAYERS (and to CONTRIBUTING.md's map)")


def test_every_relative_import_names_a_module_that_exists():
    for path in PACKAGE.rglob("*.py"):
        here = path.relative_to(PACKAGE).parent
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                base = PACKAGE.joinpath(*here.parts[: len(here.parts) - (node.level - 1)])
                target = base.joinpath(*node.module.split("."))
                assert target.with_suffix(".py").exists() or (target / "__init__.py").exists(), (
                    f"{path.relative_to(PACKAGE)}:{node.lineno} imports {'.' * node.level}{node.module}, which does not exist"
                )


def test_every_module_has_a_layer():
    for module in _graph():
        _layer(module)


def test_imports_point_down():
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_arithmetic_modules_start_no_processes():
    for module in sorted(ARITHMETIC):
        tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
        deps = _graph()[module]
        assert not deps & {"dist", "launch", "_agent", "worker"}, f"{module} imports {deps}"
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        reach = {m for m in mods if m.startswith(("torch.distributed", "subprocess", "multiprocessing"))}
        assert not reach, f"{module} reaches for processes: {sorted(reach)}"


def test_the_package_never_imports_tools():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "tools" or m.startswith("tools.") for m in mods), f"{path.name} imports tools/"
