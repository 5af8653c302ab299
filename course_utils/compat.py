"""Which torch the course was tested with, and what a notebook says on another one (notebooks 04, 05b).

Most of the course uses torch's public API. Two notebooks also read private internals that torch
may rename or drop in any release: notebook 04 counts the bytes of FSDP2's gathered parameter groups
(``_get_fsdp_state()``, ``_fsdp_param_group``, ``_all_gather_result``, ``_orig_size``) and notebook
05b rehearses with ``torch.distributed._tools.fsdp2_mem_tracker`` and the fake process group of
``torch.testing._internal``. Such a notebook calls ``check_torch`` once near the top, so a student on
another torch (Colab keeps its own) reads one plain sentence first instead of an AttributeError deep
in a cell.
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
