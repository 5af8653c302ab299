"""Views that answer at once: every state a chart's controls offer is computed here, by the course's own
modules, before the chart is shown; the browser only redraws (introduced in notebook 01).

A slider that asks the kernel for a new PNG costs a round trip and a matplotlib draw per step (about
2 s in JupyterLab on a laptop CPU, issue 28), and in an exported deck there is no kernel to ask. An
``InstantView`` instead carries, as JSON, what the chart and its readout show in every state (for the
memory chart: Ψ x K x Nd x GPU, a few thousand numbers, computed in tens of milliseconds) and a small
renderer (``instant.js``, shipped with the package) that builds the controls and draws SVG.

The hook for decks and other readers (``tools/build_course.py`` keeps it as it is):

- an instant view is one ``display_data`` output whose ``text/html`` is self-contained: its data, its
  script and its style are inline and it loads nothing, so it works in JupyterLab, Colab, VS Code and a
  deck opened from disk, with no kernel and no network;
- its outer element is ``<div class="course-instant" data-course-instant="KIND">`` (``MARKER``), and
  every control and readout carries a CSS class ``course-<view>-<role>`` for browser tests;
- when the notebook runs headless (papermill, nbval, ``make course``) the same output also holds the
  static chart as ``image/png`` for readers that run no script (a PDF, a repository viewer); a deck
  shows the ``text/html`` and drops that image.

This module knows nothing of what a view shows: ``widgets`` computes each view's states from
``memory``, ``stepper`` and ``plots``' colours and hands them here.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import uuid
from functools import cache
from importlib import resources

#: The attribute that marks an instant view's outer element (the hook for deck builders).
MARKER = "data-course-instant"

_STYLE = """
.course-instant{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:14px;color:#222;
 background:#fff;padding:4px 0;line-height:1.3;container-type:inline-size}
.course-instant .ci-grid{display:grid;grid-template-columns:minmax(0,720px);gap:4px 24px;
 grid-template-areas:"controls" "title" "chart" "readout"}
@container (min-width:1080px){.course-instant .ci-grid{grid-template-columns:720px minmax(0,1fr);align-items:start;
 grid-template-areas:"title title" "chart controls" "chart readout";grid-template-rows:auto auto 1fr}}
.course-instant .ci-controls{grid-area:controls}
.course-instant .ci-title{grid-area:title}
.course-instant .ci-chart{grid-area:chart}
.course-instant .ci-readout{grid-area:readout}
.course-instant .ci-row{display:flex;flex-wrap:wrap;align-items:center;gap:6px 18px;margin:2px 0}
.course-instant .ci-control{display:inline-flex;align-items:center;gap:6px;white-space:nowrap}
.course-instant .ci-name{font-weight:600}
.course-instant .ci-value{min-width:3.5em;font-variant-numeric:tabular-nums}
.course-instant input[type=range]{width:180px;margin:0}
.course-instant select,.course-instant button{font:inherit;padding:2px 8px}
.course-instant .ci-buttons{display:inline-flex;gap:4px}
.course-instant button.ci-on,.course-instant button.ci-primary{background:#3a7dc9;color:#fff;border:1px solid #2f6aab}
.course-instant .ci-title{font-weight:600;font-size:15px;margin:6px 0 0}
.course-instant .ci-chart{width:100%;height:auto;display:block}
.course-instant .ci-chart text{font-family:inherit}
.course-instant .ci-tick,.course-instant .ci-legend,.course-instant .ci-note{font-size:14px;fill:#333}
.course-instant .ci-axis{font-size:15px;fill:#222}
.course-instant .ci-bold{font-weight:700}
.course-instant .ci-readout{font-variant-numeric:tabular-nums}
.course-instant .ci-readout table{border-collapse:collapse;margin:2px 0;font-size:14px}
.course-instant .ci-readout td,.course-instant .ci-readout th{padding:1px 8px 1px 0;border:none;text-align:left;
 white-space:nowrap;background:none;font-size:14px;line-height:1.3}
.course-instant .ci-readout th{font-weight:400;color:#555}
.course-instant .ci-readout .ci-num{text-align:right}
.course-instant .ci-too-big{color:#8a8a8a}
"""


@cache
def renderer() -> str:
    """The browser half (``instant.js``), its version set to a hash of its text: a page that already holds
    an older renderer (a notebook re-run after an upgrade) takes the new one."""
    source = resources.files("course_utils").joinpath("instant.js").read_text(encoding="utf-8")
    return source.replace("__VERSION__", hashlib.sha256(source.encode()).hexdigest()[:12])


def _script_json(data) -> str:
    """JSON safe inside ``<script>``: no ``</`` can end the element early."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")


class InstantView:
    """A chart and its controls that redraw in the browser from states computed beforehand (notebooks 01, 03).

    ``kind`` names the renderer's view (``memory-chart``, ``bill-bars``, ``zero3-stepper``,
    ``measured-chart``); ``data`` is its JSON (every state); ``text`` the readout of the state it opens
    on (the ``text/plain`` of the output); ``png`` and ``size``, when given, the static chart of that
    state (added as ``image/png`` for readers that run no script: a headless run sets them).
    """

    def __init__(self, kind: str, data: dict, text: str, *, png: bytes | None = None, size: dict | None = None):
        self.kind, self.data, self.text, self.png, self.size = kind, {"view": kind, **data}, text, png, size

    def html(self) -> str:
        """The self-contained HTML of the view: style, data, a fallback line and the renderer, inline."""
        uid = f"ci-{uuid.uuid4().hex[:12]}"
        return (
            f'<div class="course-instant" id="{uid}" {MARKER}="{html.escape(self.kind)}">'
            f"<style>{_STYLE}</style>"
            f'<div class="ci-fallback">{html.escape(self.text)}</div>'
            f'<script type="application/json">{_script_json(self.data)}</script>'
            f"<script>{renderer()}\n"
            f"CourseInstant.mount((document.currentScript && document.currentScript.parentNode) || "
            f'document.getElementById("{uid}"));</script></div>'
        )

    def _repr_mimebundle_(self, include=None, exclude=None):
        bundle = {"text/plain": self.text, "text/html": self.html()}
        if self.png is None:
            return bundle
        bundle["image/png"] = base64.b64encode(self.png).decode()
        return bundle, {"image/png": dict(self.size or {})}

    def __repr__(self) -> str:
        return self.text or f"<{self.kind}>"
