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
    assert out.text.startswith("stage 1 (P_os): stage 1 fits") and "a tie goes to the lower stage" in out.text


def test_live_planner_follows_controls(live):
    box = widgets.planner(7e9)
    readout = _find(box, "course-plan-recommendation")
    for css in (
        "course-plan-model",
        "course-plan-nodes",
        "course-plan-gpus",
        "course-plan-gpu-mem",
        "course-plan-network",
        "course-plan-nvlink",
        "course-plan-batch",
        "course-plan-seq",
        "course-plan-checkpointing",
        "course-plan-chart",
    ):
        assert _find(box, css) is not None, css
    assert "stage 1" in readout.value
    _find(box, "course-plan-model").value = 70e9
    assert "offload" in readout.value
    _find(box, "course-plan-nodes").value = 4
    assert "stage 3 fits" in readout.value and "beats the runner-up, stage 3 + optimizer offload" in readout.value
    _find(box, "course-plan-seq").value = 131072
    assert "no data-parallel strategy fits" in readout.value


# ---------------------------------------------------------------------------------------------
# What JupyterLab showed wrong (issue: teach from it), checked on the widget objects
# ---------------------------------------------------------------------------------------------


def test_controls_accept_any_value_passed_in(live):
    """Notebook 03 draws the chart at Nd = 25; the Nd steps are powers of two (a TraitError before)."""
    box = widgets.memory_chart(60e9, nd=25, nm=16)
    nd = _find(box, "course-memory-nd")
    assert nd.value == 25 and list(nd.options) == sorted(nd.options)
    assert "Nd = 25" in _find(box, "course-memory-readout").value
    assert _find(widgets.bill_bars(8, nd=3), "course-bill-nd").value == 3
    assert _find(widgets.measured_memory_chart(1e6, {}, nd=3, nd_max=8), "course-measured-nd").value == 3


def test_preset_is_lit_only_while_the_slider_is_on_it(live):
    box = widgets.memory_chart(7.5e9, nd=64)
    model, presets = _find(box, "course-memory-model"), _find(box, "course-memory-presets")
    assert presets.value == "7.5B"  # the starting size is a preset
    presets.value = "1T"
    assert model.value == 1e12 and presets.value == "1T"
    model.value = 175e9  # the slider moves away: no preset is that size
    assert presets.value is None
    model.value = 128e9
    assert presets.value == "128B"


def _all(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _all(child)


@pytest.mark.parametrize(
    "make",
    [lambda: widgets.memory_chart(7.5e9), lambda: widgets.bill_bars(8), lambda: widgets.planner(7e9)],
    ids=["memory_chart", "bill_bars", "planner"],
)
def test_dropdowns_are_wide_enough_for_their_labels(live, make):
    """A Dropdown is 300 px whatever its labels; JupyterLab cut "12 bytes: mixed-precision Adam"."""
    dropdowns = [w for w in _all(make()) if type(w).__name__ == "Dropdown"]
    assert dropdowns
    for box in dropdowns:
        longest = max(len(label) for label in box._options_labels)
        width = box.layout.width
        assert width and width.endswith("ch"), (box.description, width)
        assert float(width[:-2]) >= longest + len(box.description) + 4, (box.description, width, longest)
        assert box.style.description_width == "initial"


def test_network_control_shows_its_whole_label(live):
    """A slider's readout is a fixed width ("4 x 100 Gb/s (5"); the network choice is a fitted dropdown."""
    net = _find(widgets.planner(7e9, inter_bw=50e9), "course-plan-network")
    assert type(net).__name__ == "Dropdown" and net.label == "4 x 100 Gb/s (50 GB/s)"
    assert list(net.options) == sorted(net.options, key=lambda o: o[1])  # still in order of speed


def test_readout_sizes_never_use_scientific_notation(live):
    box = widgets.memory_chart(1e12, nd=1, k=12)  # plain DP holds 16 TB on one GPU
    readout = _find(box, "course-memory-readout").value
    assert "e+" not in readout and "16 TB" in readout
    assert "e+" not in memory.memory_chart_view(1e12, nd=1)["readout_text"]
