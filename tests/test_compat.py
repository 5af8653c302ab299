"""course_utils.compat: the torch the course is tested with, and the plain sentence on another one."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import ROOT

from course_utils import compat, rehearse


def test_tested_torch_is_the_pinned_one():
    pinned = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert compat.TESTED_TORCH == pinned == rehearse.PINNED_TORCH
    # the set-up here installs the pinned torch, so the check passes on the tested version
    assert compat.torch_mismatch("anything") is None and torch.__version__.startswith(pinned)


@pytest.mark.parametrize("version", ["2.13.0", "2.13.0+cpu", "2.13.1+cu126"])
def test_same_minor_version_is_tested(version):
    assert compat.torch_mismatch("FSDP2 internals", tested="2.13.0", version=version) is None


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.14.0.dev20260101", "3.13.0"])
def test_another_version_gets_one_sentence_naming_what_and_the_fix(version):
    text = compat.torch_mismatch("FSDP2's parameter-group internals", tested="2.13.0", version=version)
    assert text and text.count("\n") == 0
    assert version in text and "2.13.0" in text and "FSDP2's parameter-group internals" in text
    assert "pip install torch==2.13.0" in text and "make setup" in text


def test_check_torch_prints_and_never_raises(capsys, monkeypatch):
    assert compat.check_torch(uses="X") is True
    assert "tested with" in capsys.readouterr().out
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    assert compat.check_torch(uses="the memory tracker") is False
    out = capsys.readouterr().out
    assert "2.6.0+cu124" in out and "the memory tracker" in out


@pytest.mark.parametrize("name", ["04_fsdp", "05b_dress_rehearsal"])
def test_notebooks_reading_private_internals_check_torch_near_the_top(name):
    cells = [
        c for c in json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"] if c["cell_type"] == "code"
    ]
    first = next(i for i, c in enumerate(cells) if "compat.check_torch(" in c["source"])
    # right after the parameters and the Colab set-up: before any cell that could fail on another torch
    assert first == 2 and "parameters" in cells[0]["metadata"].get("tags", []) and "google.colab" in cells[1]["source"]
