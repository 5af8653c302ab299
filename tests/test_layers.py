"""Which way imports point inside course_utils (CONTRIBUTING.md, "The map"): down only, no cycles; and the
house in numbers (issue 27): the counts ``tools/house_counts.py`` measures, held at their targets.

Every import counts, at the top of a module or inside a function: a lazy import must not hide
an upward dependency or a cycle. A module is a room; a package's ``__init__`` is its door (it re-exports
its rooms for the notebooks) and sits above its rooms. ``python -m pytest tests/test_layers.py`` prints
what is wrong.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

PACKAGE = ROOT / "course_utils"

#: The layers, lowest first. A module may import modules of its own layer or below, never above. A name
#: ending in ".*" stands for every module of that package (labs, exercises: each notebook's rooms).
LAYERS = [
    {"errors", "units", "__init__", "compat"},
    {"presets", "comm", "stepper", "validate", "strategy_spec"},  # shapes; ring arithmetic; the stage-3
    # schedule; input checks; what a row of the strategy record says
    {"models", "data", "dist", "instrument", "timeline", "_agent", "worker", "checksums", "_report", "recovery"}
    | {"namespaces", "cable", "scratch", "_agent_patches"},
    # model, data, observers, workers; what a launch says; what a restart cost; a cluster's nodes and their cards;
    # temporary folders that go with their process
    {"_procs", "failures"},  # a launch's processes and their clean-up; failure injection
    {"ddp", "zero.flat", "zero.stages", "zero.stage3", "zero", "fsdp", "per_param", "examples"},  # mechanism
    {"apply"},  # apply_*(model, mesh, options): the mechanism as the record holds it
    {"strategies", "checkpoint_state", "checkpoint_files"},  # the record; what each strategy saves; a folder on disk
    {"memory.bill", "memory.chart", "memory.cli"},  # the bill
    {"predict.held", "predict.sent", "predict.runs", "predict.timeline", "predict"},  # the predictions
    {"plan.inputs", "plan.network", "plan.price", "plan.offload", "plan.choose", "plan.cli", "plan.hostfit", "plan"}
    | {"plan.shapes", "plan.activations", "plan.implementations", "plan.deepspeed3", "plan.throughput", "plan.search"}
    | {"plan.report"},
    {"checkpoint", "launch", "background"},  # complete-only DCP checkpoints; the only place that starts processes
    {"runtypes"},  # TrainConfig, Prepared
    {"loop"},  # the one loop
    {"memory.measure", "memory", "train"},  # the bill on real tensors (one step of the loop); the run and its CLI
    {
        "rehearse.tracker",
        "rehearse.recompute",
        "rehearse.run",
        "rehearse.predictions",
        "rehearse.calibration",
    },  # the dress rehearsal
    {"plots.base", "plots.memory_views", "plots.ddp_views", "plots.zero_views", "plots.fsdp_views"}
    | {"plots.timeline_views"},  # views
    {"plots.plan_views", "plots.recovery_views", "plots", "rehearse.views", "rehearse.cli", "rehearse"},
    {"widget_parts", "instant"},  # the parts of every view's controls; the charts that redraw in the browser
    {"widgets", "bench", "cli", "__main__", "ft", "ft_config", "ft_groups", "ft_jobs", "ft_nodes", "hangs"}
    | {"cluster", "cluster_jobs", "cluster_cli"},
    # views, commands; TorchFT (and DiLoCo): what a run is, its processes and where they listen; hang detectors;
    # runs on the namespace nodes, the torchrun plumbing under them, their command line
    {"labs.*", "exercises.*"},  # each notebook's experiments and exercises
]
#: Arithmetic: what the course's numbers rest on. They start no process and never touch torch.distributed.
ARITHMETIC = {
    "comm",
    "memory.bill",
    "memory.chart",
    "predict.held",
    "predict.sent",
    "predict.runs",
    "predict.timeline",
    "plan.inputs",
    "plan.network",
    "plan.price",
    "plan.offload",
    "plan.choose",
    "plan.hostfit",
    "plan.shapes",
    "plan.activations",
    "plan.implementations",
    "plan.deepspeed3",
    "plan.throughput",
    "plan.search",
    "plan.report",
}


def _module(path) -> str:
    """``zero/stage3.py`` -> "zero.stage3", ``plan/__init__.py`` -> "plan", ``loop.py`` -> "loop"."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _exists(dotted: str) -> bool:
    target = PACKAGE.joinpath(*dotted.split("."))
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


def _imports(path) -> set[str]:
    """Every package module ``path`` imports (the longest dotted name that is a module of the package)."""
    here = path.relative_to(PACKAGE).parent.parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - (node.level - 1)]) if node.level > 1 else list(here)
            module = base + [p for p in (node.module or "").split(".") if p]
            targets = [module + [alias.name] for alias in node.names] + [module]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_utils."):
            module = node.module.split(".")[1:]
            targets = [module + [alias.name] for alias in node.names] + [module]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("course_utils.")]
        for parts in targets:  # `from . import x`: x when it is a module, else the package it comes from
            while parts and not _exists(".".join(parts)):
                parts = parts[:-1]
            if parts:
                out.add(".".join(parts))
                break
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        graph.setdefault(name, set()).update(m for m in _imports(path) if m != name)
    return graph


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer or any(n.endswith(".*") and module.split(".")[0] == n[:-2] for n in layer):
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
    graph = _graph()
    for module in sorted(ARITHMETIC):
        path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not graph[module] & {"dist", "launch", "_agent", "worker"}, f"{module} imports {graph[module]}"
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        reach = {m for m in mods if m.startswith(("torch.distributed", "subprocess", "multiprocessing"))}
        assert not reach, f"{module} reaches for processes: {sorted(reach)}"


def test_the_calculators_start_without_torch():
    """``python -m course_utils memory`` and ``plan`` read the record, the bill and the planner; none of it
    may import torch (seconds), so the calculators start in a fraction of a second."""
    code = (
        "import sys; import course_utils.memory, course_utils.plan, course_utils.strategies; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the calculators import torch: {out.stdout}"


def test_the_package_never_imports_tools():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "tools" or m.startswith("tools.") for m in mods), f"{path.name} imports tools/"


# ---------------------------------------------------------------------------------------------
# The house in numbers (issue 27; CONTRIBUTING.md): measured by tools/house_counts.py
# ---------------------------------------------------------------------------------------------

#: Modules that may pass 500 lines: one idea a reader would not want split (CONTRIBUTING.md says why).
LONG_MODULES_ALLOWED: dict[str, str] = {}
#: Package code only the tests name, left where it is for a reason (CONTRIBUTING.md): none.
TEST_ONLY_ALLOWED = {
    # Launcher probes of tests/test_launch.py (the process-control tests, the safety branch's), whose
    # assertions name examples.py and whose subprocess scripts import course_utils.examples.
    "course_utils/examples.py": {"count_with_progress", "pid_of_rank", "fail_after_progress"},
}


@pytest.fixture(scope="module")
def counts():
    sys.path.insert(0, str(ROOT))
    from tools import house_counts

    return house_counts


def test_no_strategy_name_outside_the_record(counts):
    found = counts.name_findings()
    assert not found["literals"], "strategy names outside strategies.py:\n" + "\n".join(found["literals"])
    assert not found["collections"] and not found["branches"]


def test_no_module_over_500_lines_but_the_named_ones(counts):
    long = [m for m in counts.long_modules() if m.split(":")[0] not in LONG_MODULES_ALLOWED]
    assert not long, "modules over 500 lines (split along the idea):\n" + "\n".join(long)


def test_no_long_function_in_mechanism_or_process_control(counts):
    long = counts.long_functions()
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


def test_every_training_step_is_the_one_loop(counts):
    found = counts.stepping_functions()
    assert not found, "a training step outside loop.run_steps:\n" + "\n".join(found)


def test_no_dead_or_test_only_code(counts):
    unused = counts.unused_definitions()
    assert not unused["dead"], "nothing calls:\n" + "\n".join(unused["dead"])
    test_only = [w for w in unused["test_only"] if w.split()[-1] not in TEST_ONLY_ALLOWED.get(w.split(":")[0], set())]
    assert not test_only, "only the tests call (move them to tests/):\n" + "\n".join(test_only)
