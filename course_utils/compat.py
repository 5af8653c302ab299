"""Which torch the course was tested with, and what a notebook says on another one (notebooks 04, 05b).

Most of the course uses torch's public API. Two notebooks also read private internals that torch
may rename or drop in any release: notebook 04 counts the bytes of FSDP2's gathered parameter groups
(``_get_fsdp_state()``, ``_fsdp_param_group``, ``_all_gather_result``, ``_orig_size``) and notebook
05b rehearses with ``torch.distributed._tools.fsdp2_mem_tracker`` and the fake process group of
``torch.testing._internal``. Such a notebook calls ``check_torch`` once near the top, so a student on
another torch (Colab keeps its own) reads one plain sentence first instead of an AttributeError deep
in a cell.

The course runs on every torch ``pyproject.toml`` allows; where torch renamed a public function, the
course calls it here by its newest name: ``all_gather_single`` and ``reduce_scatter_single`` (torch 2.13's
names, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` before), and
``provide_renamed_collectives()`` gives an older torch the new names for code written with them.
"""

from __future__ import annotations

#: The torch the course is tested with: constraints.txt pins this version (tests/test_compat.py keeps them equal).
TESTED_TORCH = "2.13.0"


def _minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "2.13.0+cpu" or "2.14.0.dev20260101"."""
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def torch_mismatch(uses: str, *, tested: str = TESTED_TORCH, version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed torch) has the major.minor of ``tested``; else one
    sentence that names both versions, what may not work (``uses``) and how to get the tested torch
    (notebooks 04, 05b)."""
    if version is None:
        import torch

        version = torch.__version__
    if _minor(version) == _minor(tested):
        return None
    return (
        f"This notebook was tested with torch {tested} and this is torch {version}: {uses} are private "
        f"torch internals that may have moved, so the cells that use them may fail; everything else uses "
        f"public APIs. For the tested torch: `make setup` here, or `pip install torch=={tested}` and "
        f"restart the kernel."
    )


def check_torch(uses: str, *, tested: str = TESTED_TORCH) -> bool:
    """Print whether the installed torch is the one this notebook was tested with, and if not, what may
    not work (``uses``: the private internals the notebook reads) and what to do; True when it is
    (notebooks 04 and 05b, one cell near the top). Never raises: the public parts still run."""
    import torch

    problem = torch_mismatch(uses, tested=tested)
    print(problem or f"torch {torch.__version__}: the version this notebook was tested with ({tested}).")
    return problem is None


# ---------------------------------------------------------------------------------------------
# Names torch renamed: the course calls the newest; an older torch gets them as aliases
# ---------------------------------------------------------------------------------------------

#: torch.distributed's single-tensor collectives: the name torch 2.13 gave each -> the name it had from
#: torch 1.13 to 2.12. torch 2.13 keeps the old names as aliases that warn (``@deprecated(...,
#: category=FutureWarning)`` in torch/distributed/distributed_c10d.py) and call the new ones; both run
#: the same c10d op, with the same signature, so CommCounter counts them alike.
RENAMED_COLLECTIVES = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


def newest_collective(*names: str):
    """The first of ``names`` that this ``torch.distributed`` has (notebooks 03, 04)."""
    import torch.distributed as dist

    from .errors import CourseInputError

    for name in names:
        if hasattr(dist, name):
            return getattr(dist, name)
    raise CourseInputError(f"this torch has none of torch.distributed.{', '.join(names)}: install torch >= 1.13")


def provide_renamed_collectives() -> list[str]:
    """Give an older torch the collective names torch 2.13 introduced, as aliases of the names it has
    (notebooks 03, 04); returns the names it added (none on torch >= 2.13, where nothing changes).

    The exercises and their hints teach ``dist.all_gather_single`` and ``dist.reduce_scatter_single``,
    the names that do not warn on torch 2.13; with this, a student's cell written with them also runs
    on the older torch ``pyproject.toml`` allows (Colab keeps its own). The exercise checks call it on
    every rank before the student's code runs.
    """
    import torch.distributed as dist

    added = []
    for new, old in RENAMED_COLLECTIVES.items():
        if not hasattr(dist, new):
            setattr(dist, new, newest_collective(old))
            added.append(new)
    return added


def __getattr__(name: str):
    """``from course_utils.compat import all_gather_single`` (or ``reduce_scatter_single``): torch's function
    under its torch 2.13 name, or under the name it had before, resolved when imported (notebooks 03, 04)."""
    if name in RENAMED_COLLECTIVES:
        return newest_collective(name, RENAMED_COLLECTIVES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
