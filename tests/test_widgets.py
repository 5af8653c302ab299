"""course_utils.widgets and plots: headless renders a PNG; live widgets carry stable classes and
their readout follows the controls (no browser needed)."""
from __future__ import annotations

import pytest

from course_utils import memory, plots, widgets
from course_utils.units import GB

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def live(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "0")


@pytest.fixture
def headless(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "1")


def _find(widget, css_class):
    """Depth-first search of a widget tree for the one widget carrying ``css_class``."""
    if css_class in getattr(widget, "_dom_classes", ()):
        return widget
    for child in getattr(widget, "children", ()):
        found = _find(child, css_class)
        if found is not None:
            return found
    return None


def test_is_headless(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    assert widgets.is_headless()
    monkeypatch.setenv("COURSE_HEADLESS", "0")
    assert not widgets.is_headless()
    monkeypatch.delenv("COURSE_HEADLESS")
    assert not widgets.is_headless()


def test_headless_memory_chart_is_a_png_with_readout(headless):
    out = widgets.memory_chart(7.5e9, nd=64)
    assert isinstance(out, plots.StaticFigure)
    data, size = out._repr_png_()
    assert data.startswith(PNG_MAGIC)
    assert "31.4 GB" in repr(out) and "1.88 GB" in repr(out)
    # drawn at SHOW_SCALE x the pixels it is displayed at (sharp when projected); PNG width/height at bytes 16-24
    pixels = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert pixels == (plots.SHOW_SCALE * size["width"], plots.SHOW_SCALE * size["height"])


def test_headless_bill_bars(headless):
    out = widgets.bill_bars(8, nd=4)
    assert out.png.startswith(PNG_MAGIC)
    assert "128 bytes" in out.text and "32 bytes" in out.text


def test_live_memory_chart_controls_and_readout(live):
    box = widgets.memory_chart(7.5e9, nd=64)
    model = _find(box, "course-memory-model")
    readout = _find(box, "course-memory-readout")
    chart = _find(box, "course-memory-chart")
    for css in ("course-memory-k", "course-memory-nd", "course-memory-gpu", "course-memory-presets"):
        assert _find(box, css) is not None, css
    assert model.description == "Model Ψ"
    before, image = readout.value, bytes(chart.value)
    assert "7.5B" in before and image.startswith(PNG_MAGIC)
    model.value = 1e12
    assert readout.value != before and "1T" in readout.value
    assert bytes(chart.value) != image
    _find(box, "course-memory-presets").value = "128B"
    assert model.value == 128e9 and "128B" in readout.value
    _find(box, "course-memory-nd").value = 1024
    assert "Nd = 1024" in readout.value


def test_live_bill_bars(live):
    box = widgets.bill_bars(8, nd=4)
    readout = _find(box, "course-bill-readout")
    assert "56 bytes" in readout.value
    _find(box, "course-bill-nd").value = 8
    assert "Nd = 8" in readout.value


def test_figures_render():
    view = memory.memory_chart_view(1e12, nd=1024, gpu_mem=80 * GB)
    assert plots.png(plots.memory_chart_figure(view)).startswith(PNG_MAGIC)
    bars = memory.bill_bars(1.5e9, 1, activations=6e9)
    assert plots.png(plots.bill_bars_figure(bars, unit="GB", gpu_mem=32 * GB)).startswith(PNG_MAGIC)


def test_headless_planner(headless):
    out = widgets.planner(7e9)
    assert out.png.startswith(PNG_MAGIC)
    assert out.text.startswith("stage 1 (P_os): stage 1 is the lowest stage that fits")


def test_live_planner_follows_controls(live):
    box = widgets.planner(7e9)
    readout = _find(box, "course-plan-recommendation")
    for css in ("course-plan-model", "course-plan-nodes", "course-plan-gpus", "course-plan-gpu-mem",
                "course-plan-network", "course-plan-nvlink", "course-plan-batch", "course-plan-seq",
                "course-plan-checkpointing", "course-plan-chart"):
        assert _find(box, css) is not None, css
    assert "stage 1" in readout.value
    _find(box, "course-plan-model").value = 70e9
    assert "offload" in readout.value
    _find(box, "course-plan-nodes").value = 4
    assert "only stage 3 fits" in readout.value
    _find(box, "course-plan-seq").value = 131072
    assert "no data-parallel strategy fits" in readout.value
