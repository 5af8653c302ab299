"""course_utils.dist on a GPU, checked on CPU: the device synchronisation every timer of device work
uses (notebook 05) and the deterministic settings the bit-for-bit comparisons need (notebooks 02, 03, 06)."""

from __future__ import annotations

import os

import pytest
import torch

from course_utils import dist as cdist
from course_utils.labs import lab05


def test_time_on_device_syncs_before_starting_and_before_stopping_the_clock():
    events = []
    seconds = lab05.time_on_device(lambda: events.append("work"), lambda: events.append("sync"))
    assert events == ["sync", "work", "sync"] and seconds >= 0


def test_synchronize_waits_for_a_cuda_device_and_not_for_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    cdist.synchronize(torch.device("cpu"))
    assert calls == []
    cdist.synchronize(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_the_overlap_worker_times_with_the_device_sync(monkeypatch):
    """block_overlap_worker hands each timer this rank's device sync (one process, one small case)."""
    seen = []
    monkeypatch.setattr(cdist, "synchronize", lambda device: seen.append(device))
    out = lab05.block_overlap_worker(widths=(64,), tokens=(64,), repeats=1, gather_bytes=(4096,), gather_repeats=1)
    rows = out["blocks"]
    assert len(rows) == 1 and rows[0]["world_size"] == 1 and len(out["gathers"]) == 1
    # one timed reading of the block's gathers + 2 forwards + 2 forward-backwards + one reading of the sweep's
    # gathers, each with a sync before and after (warm-up calls are not timed)
    assert seen == [torch.device("cpu")] * 12


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def test_deterministic_settings_are_applied_on_cuda(restore_determinism):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    applied = cdist.make_deterministic(torch.device("cuda", 0))
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert applied["deterministic"] is True


def test_a_workspace_setting_of_the_user_is_kept(restore_determinism, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    cdist.make_deterministic(torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_nothing_is_changed_on_cpu(restore_determinism):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    assert cdist.make_deterministic(torch.device("cpu"))["deterministic"] is False
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_init_applies_the_settings_only_when_its_device_is_cuda(device_type, restore_determinism, monkeypatch):
    """``init`` on a (pretend) GPU host: same world of one, settings on for cuda only."""
    torch.use_deterministic_algorithms(False)
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cdist, "pick_backend", lambda n, requested="auto": ("gloo", device_type))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    threads = torch.get_num_threads()  # init splits the cores on cpu
    try:
        info = cdist.init()
        assert info.device.type == device_type
        assert torch.are_deterministic_algorithms_enabled() is (device_type == "cuda")
    finally:
        cdist.shutdown()
        torch.set_num_threads(threads)
