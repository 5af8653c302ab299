"""What every chart of the course shares: a figure on the Agg canvas, PNG bytes, a static image for a notebook,
Markdown tables, the course's colours (notebook 01).

pyplot is never used: figures are built on the Agg canvas directly, so nothing here depends on the
notebook's plotting backend or leaves global state behind.
"""

from __future__ import annotations

import io

from ..strategies import RECORD
from ..units import GB

#: One colour per part of the bill, and per strategy (its row's ``color``), used by every chart.
PART_COLORS = {
    "weights": "#7b5ea7",
    "gradients": "#e8883a",
    "optimizer": "#3a7dc9",
    "activations": "#5aa469",
    "buffers": "#9a9a9a",
}
# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def new_figure(width: float = 7.5, height: float = 4.5):
    """A fresh Figure on the Agg canvas (no pyplot state) (notebook 01)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


#: Pixel density of the charts ``show`` displays: drawn at twice the figure's 100 dpi and shown at its
#: size, so they stay sharp on a high-density screen and on a projector (widgets keep 1x).
SHOW_SCALE = 2


#: The smallest text a chart draws, in pixels at the figure's own size: a label a room can read on a
#: 1280 x 720 slide, where a deck shows every chart at least at its own size (issue 28). ``png`` raises
#: any smaller text to it, so the sizes the figures below ask for are a lower bound.
MIN_TEXT_PX = 14


def _readable(fig) -> None:
    """Raise every text of ``fig`` below ``MIN_TEXT_PX`` to it (tick labels through their axis, so new ticks follow)."""
    from matplotlib.text import Text

    fig.canvas.draw()  # the ticks and their labels exist once the figure is drawn
    floor = MIN_TEXT_PX * 72 / fig.dpi  # points
    for ax in fig.get_axes():
        for axis in (ax.xaxis, ax.yaxis):
            for which in ("major", "minor"):
                labels = axis.get_ticklabels(which=which)
                if labels and min(t.get_fontsize() for t in labels) < floor:
                    axis.set_tick_params(which=which, labelsize=floor)
    for text in fig.findobj(Text):
        if text.get_text().strip() and text.get_fontsize() < floor:
            text.set_fontsize(floor)


def min_text_px(fig) -> float:
    """The smallest text ``fig`` draws, in pixels at its own size (the decks check it reaches 14 px)."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) * fig.dpi / 72 if sizes else float(MIN_TEXT_PX)


def png(fig, scale: float = 1) -> bytes:
    """The figure as PNG bytes, at ``scale`` times its own dpi, no text under ``MIN_TEXT_PX`` (notebook 01)."""
    _readable(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi * scale)
    return buf.getvalue()


class StaticFigure:
    """A rendered chart a notebook displays as a PNG image, with its readout as text (notebook 01).

    What a widget returns when the notebook runs headless (``widgets.is_headless()``), and what
    ``show`` displays: executed notebooks then hold the chart as ``image/png``.
    """

    def __init__(self, fig, text: str = ""):
        self.png = png(fig, SHOW_SCALE)
        width, height = fig.get_size_inches() * fig.dpi
        self.size = {"width": int(round(width)), "height": int(round(height))}  # CSS pixels
        self.size["course_min_text_px"] = round(min_text_px(fig), 2)  # for the decks' check of label sizes
        self.text = text

    def _repr_png_(self):
        return self.png, self.size

    def __repr__(self):
        return self.text or "<chart>"


def show(fig, text: str = ""):
    """Display a figure in the notebook as a PNG image (and ``text`` under it) (notebook 01)."""
    from IPython.display import display

    display(StaticFigure(fig, text))


def _bytes_axis(ax, axis: str = "y", unit: str = "GB"):
    """Label an axis that holds bytes, scaled to ``unit`` (GB = 10^9; "bytes" for raw bytes)."""
    label = "bytes" if unit == "bytes" else f"{unit} ({'10^9' if unit == 'GB' else '2^30'} bytes)"
    (ax.set_ylabel if axis == "y" else ax.set_xlabel)(f"memory per GPU, {label}")


def _scale(unit: str) -> float:
    return {"bytes": 1.0, "GB": float(GB), "GiB": float(2**30)}[unit]


def table_markdown(header: list, rows: list) -> str:
    """A Markdown table from a header and rows of already formatted cells (notebook 02). A "|" inside a cell
    ("max |Δw|") is escaped: unescaped, it would end the cell and shift the row."""

    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def show_table(header: list, rows: list) -> None:
    """Display ``table_markdown(header, rows)`` in the notebook (notebook 02)."""
    from IPython.display import Markdown, display

    display(Markdown(table_markdown(header, rows)))


#: Each strategy's colour, read from its row of the record.
STAGE_COLORS = {s.name: s.color for s in RECORD.values()}
