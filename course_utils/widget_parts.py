"""The parts every view's controls share: the value lists a control steps through, and a value a notebook passes
in kept among them (notebook 01).

``course_utils.widgets`` builds the views from them.
"""

from __future__ import annotations

from . import memory
from .units import fmt_count


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
