"""The parts every view's controls share: ipywidgets imported when a view is built, CSS classes for the browser
tests, dropdowns as wide as their labels, and the value lists a control steps through (notebook 01).

``course_utils.widgets`` builds the views from them.
"""

from __future__ import annotations

from . import memory
from .units import fmt_count


def _ipw():
    import ipywidgets

    return ipywidgets


def _classed(widget, css_class: str):
    widget.add_class(css_class)
    return widget


def _fit_labels(widget):
    """Make a dropdown wide enough for its longest option label and its description.

    ipywidgets draws a Dropdown 300 px wide whatever its labels, which cut "12 bytes: mixed-precision
    Adam" to "12 bytes: mixed-precision A" in JupyterLab. Widths are in ``ch`` (the width of "0"),
    with a tenth more for wider letters and room for the arrow and padding.
    """
    longest = max(len(str(label)) for label in widget._options_labels)
    widget.style.description_width = "initial"
    widget.layout.width = f"{round((longest + len(widget.description)) * 1.1) + 6}ch"
    return widget


def _with(options, value) -> list:
    """``options`` plus ``value`` when it is not one of them, sorted: a control accepts any value a notebook
    passes in (notebook 03 asks for Nd = 25 on a slider whose steps are powers of two)."""
    return sorted(set(options) | {value})


#: Model sizes the model slider steps through (parameters).
MODEL_SIZES = (125e6, 350e6, 1.3e9, 1.5e9, 7e9, 7.5e9, 13e9, 30e9, 70e9, 128e9, 175e9, 530e9, 1e12)
#: K choices: label -> K.
K_CHOICES = {f"{b.k:g} bytes: {b.name}": b.k for key, b in memory.OPTIMIZERS.items() if key != "adam_fp32"}


def _model_options(extra=()):
    sizes = sorted(set(MODEL_SIZES) | {float(x) for x in extra})
    return [(fmt_count(s), float(s)) for s in sizes]


def _choices(options: dict, value, fmt) -> list:
    """``options`` (label -> value) as a list of pairs, plus ``value`` under the label ``fmt(value)`` when
    it is not one of them: a view accepts any value a notebook passes in."""
    pairs = list(options.items())
    if float(value) not in options.values():
        pairs.append((fmt(value), float(value)))
    return pairs


def _index(pairs: list, value) -> int:
    return [float(v) for _, v in pairs].index(float(value))
