"""course_utils.widgets, instant and plots.

Without a browser: every state an instant view carries is what the arithmetic modules say (the memory
chart's against ``memory.memory_chart_view``, the bill's against ``memory.bill_bars``, the stepper's
against ``stepper.stage3_schedule``, the planner's against ``plan.plan``); headless runs add the PNG.
In Chromium (Debian's, as tests/test_browser.py drives it): each instant view, in output
rendered the way JupyterLab renders it and in an exported deck, redraws its chart and its readout within
100 ms of a key press, with no kernel and no network."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import sys
import time

import pytest
from conftest import ROOT

from course_utils import instant, memory, plots, widgets
from course_utils.errors import CourseInputError
from course_utils.units import GB, fmt_count, fmt_size

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def live(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "0")


@pytest.fixture
def headless(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "1")


def test_is_headless(monkeypatch):
    monkeypatch.setenv("COURSE_HEADLESS", "1")
    assert widgets.is_headless()
    monkeypatch.setenv("COURSE_HEADLESS", "0")
    assert not widgets.is_headless()
    monkeypatch.delenv("COURSE_HEADLESS")
    assert not widgets.is_headless()


def _bundle(view):
    out = view._repr_mimebundle_()
    return out if isinstance(out, tuple) else (out, {})


def test_headless_memory_chart_is_a_png_with_readout(headless):
    out = widgets.memory_chart(7.5e9, nd=64)
    assert isinstance(out, instant.InstantView)
    data, meta = _bundle(out)
    png = base64.b64decode(data["image/png"])
    assert png.startswith(PNG_MAGIC)
    assert "31.4 GB" in data["text/plain"] and "1.88 GB" in data["text/plain"]
    # drawn at SHOW_SCALE x the pixels it is displayed at (sharp when projected); PNG width/height at bytes 16-24
    pixels = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    size = meta["image/png"]
    assert pixels == (plots.SHOW_SCALE * size["width"], plots.SHOW_SCALE * size["height"])
    assert f'{instant.MARKER}="memory-chart"' in data["text/html"]  # and live, for readers that run scripts


def test_live_views_carry_no_image(live):
    """In JupyterLab the kernel draws nothing: the browser does (no matplotlib per display)."""
    for view in (widgets.memory_chart(7.5e9), widgets.bill_bars(8), widgets.zero3_stepper(4)):
        data, meta = _bundle(view)
        assert set(data) == {"text/plain", "text/html"} and not meta


def _json(view) -> dict:
    """The data an instant view's HTML carries, read back from the HTML as the browser reads it."""
    found = re.search(r'<script type="application/json">(.*?)</script>', view.html(), re.S)
    return json.loads(found.group(1))  # JSON reads <\/ as </


def test_the_html_is_self_contained():
    page = widgets.memory_chart(7.5e9).html()
    assert "CourseInstant.mount(" in page and "<style>" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "an instant view loads nothing"
    # a title cannot end its script element early
    view = widgets.measured_memory_chart(1e6, {}, nd=2, title="</script><b>x")
    assert "</script><b>" not in view.html() and _json(view)["title"] == "</script><b>x"


def test_memory_chart_states_are_the_memory_modules():
    """Every number and sentence of the chart, in a sample of its 3,000-odd states, against memory_chart_view
    (which computes ``fits`` as bytes <= GPU memory, where the view reads it off the smallest Nd that fits)."""
    view = widgets.memory_chart(60e9, nd=25, nm=16, gpu_mem=24 * GB)  # a Nd and a GPU of the notebook's own
    d = _json(view)
    models = dict(widgets._model_options([60e9]))
    ks = list(widgets.K_CHOICES.values())
    gpus = list(memory.GPU_CHOICES.values()) + [24 * GB]
    assert d["nds"][d["nd"]] == 25 and d["gpuBytes"][d["gpu"]] == 24 * GB and d["models"][d["model"]] == "60B"
    assert [d["nds"][i] for i in d["axis"]] == list(memory.chart_nds())
    rng = random.Random(0)
    states = [(d["model"], d["k"], d["nd"], d["gpu"])] + [
        (rng.randrange(len(models)), rng.randrange(len(ks)), rng.randrange(len(d["nds"])), rng.randrange(len(gpus)))
        for _ in range(60)
    ]
    for m, k, n, g in states:
        psi = models[d["models"][m]]
        want = memory.memory_chart_view(psi, nd=d["nds"][n], k=ks[k], nm=16, gpu_mem=gpus[g])
        assert d["titles"][m][k][g] == want["title"]
        for r, stage in enumerate(memory.STAGES):
            assert d["bytes"][m][k][r][n] == pytest.approx(want["readout"][stage], rel=1e-12)
            assert d["exact"][m][k][r][n] == f"{want['readout'][stage]:,.0f}"
            assert d["sizes"][m][k][r][n] == fmt_size(want["readout"][stage])
            first = d["firstFit"][m][k][g][r]
            assert (first is not None and d["nds"][n] >= first) == want["fits"][stage], (psi, stage, d["nds"][n])
    assert d["presets"] == [[name, d["models"].index(fmt_count(size))] for name, size in memory.MODEL_PRESETS.items()]


def test_bill_bars_states_are_the_bill():
    d = _json(widgets.bill_bars(8, nd=3))
    assert d["nds"][d["nd"]] == 3
    ks = list(widgets.K_CHOICES.values())
    for n, nd in enumerate(d["nds"]):
        for j, k in enumerate(ks):
            state, bars = d["states"][n][j], memory.bill_bars(8, nd, k=k)
            for i, stage in enumerate(memory.STAGES):
                held = [bars[stage][p]["held"] for p in memory.BILL_PARTS]
                assert state["bars"][i]["held"] == pytest.approx(held)
                full = [bars[stage][p]["full"] for p in memory.BILL_PARTS]
                assert [h + x for h, x in zip(held, state["bars"][i]["dropped"])] == pytest.approx(full)
            assert f"Nd = {nd}, K = {k:g}" in state["text"]
    start = d["states"][d["nd"]][d["k"]]
    # by hand, Ψ = 8 on Nd = 3: 8·16, 8·(4 + 12/3), 8·(2 + 14/3), 8·16/3 bytes
    assert [b["label"] for b in start["bars"]] == ["128", "64", "53.3", "42.7"]


def test_stepper_states_are_the_schedule():
    from course_utils.stepper import TRAFFIC_KINDS, stage3_schedule

    d = _json(widgets.zero3_stepper(4))
    schedule = stage3_schedule(4)
    assert len(d["states"]) == len(schedule) == 4 * 4 + 6
    assert d["labels"] == ["layer 0", "layer 1", "layer 2", "layer 3", "root"]
    for shown, state in zip(d["states"], schedule):
        assert shown["caption"] == state.caption and shown["layer"] == state.layer
        assert shown["whole"] == [[h == "whole" for h in row] for row in state.held]
        assert shown["sent"] == [[state.sent[g][kind] for kind in TRAFFIC_KINDS] for g in range(4)]
    assert d["states"][-1]["totals"] == ["2.25Ψ"] * 4  # 3(Nd-1)/Nd


def test_measured_chart_reads_out_the_formula_at_every_nd():
    measured = {"zero1": [(2, 123456)], "ddp": [(2, 654321)]}
    d = _json(widgets.measured_memory_chart(98_880, measured, nd=3, nd_max=8))
    assert d["nds"] == [1, 2, 3, 4, 8] and d["nds"][d["nd"]] == 3
    assert d["points"][memory.STAGES.index("zero1")] == [[2, 123456]]
    for n, nd in enumerate(d["nds"]):
        want = memory.memory_chart_view(98_880, nd=nd, nd_max=8)["readout"]
        assert d["at"][n] == pytest.approx([want[s] for s in memory.STAGES])
        assert f"Nd = {nd}:" in d["texts"][n]


def test_figures_render():
    view = memory.memory_chart_view(1e12, nd=1024, gpu_mem=80 * GB)
    assert plots.png(plots.memory_chart_figure(view)).startswith(PNG_MAGIC)
    bars = memory.bill_bars(1.5e9, 1, activations=6e9)
    assert plots.png(plots.bill_bars_figure(bars, unit="GB", gpu_mem=32 * GB)).startswith(PNG_MAGIC)


def test_a_pipe_in_a_table_cell_stays_in_its_cell():
    """Notebook 03's run table headed a column "max |Δw|": unescaped, the header split into two more cells
    and every row of the table shifted."""
    text = plots.table_markdown(["run", "max |Δw|"], [["zero3", "4e-06"], ["a|b", "0"]])
    for line in text.splitlines():
        assert len(re.split(r"(?<!\\)\|", line)) == 4, line  # two cells between three unescaped pipes
    assert "max \\|Δw\\|" in text


def test_headless_planner(headless):
    out = widgets.planner(7e9)
    assert out.png.startswith(PNG_MAGIC)
    assert out.text.startswith("stage 3 (P_os+g+p, FULL_SHARD): stage 3 fits") and "the most headroom" in out.text


def test_planner_states_are_the_planner():
    """Every number and sentence of the planner view, in a sample of its states, against ``plan.plan`` called for
    that state: the browser only draws what the planner said (issue 28: it asked the kernel before)."""
    from course_utils import plan, strategies

    view = widgets.planner(7e9, gpus_per_node=4, gpu_mem=40 * GB, checkpointing=False)
    d = _json(view)
    names = [row.name for row in strategies.planned()]
    assert len(d["models"]) * len(d["nodes"]) * len(d["networks"]) >= 600
    nets = dict(widgets.NETWORK_CHOICES)
    rng = random.Random(0)
    for _ in range(40):
        m, n, w = (rng.randrange(len(d[key])) for key in ("models", "nodes", "networks"))
        st = d["states"][m][n][w]
        psi = dict(widgets._model_options())[d["models"][m]]
        want = plan.plan(
            plan.model_spec(psi, checkpointing=False),
            plan.Cluster(gpus_per_node=4, nodes=int(d["nodes"][n]), gpu_mem=40 * GB, inter_bw=nets[d["networks"][w]]),
        )
        assert st["text"] == widgets.plan_summary(want)
        for i, name in enumerate(names):
            row = want.strategies.get(name)
            if row is None:
                assert st["bars"][i] is None
                continue
            total = row.weights + row.gradients + row.optimizer + row.activations + row.buffers
            assert sum(st["bars"][i]) == pytest.approx(total / GB, abs=3e-3), (name, psi)
            assert st["fits"][i] == row.fits and "e+" not in st["step"][i]
        choice = want.recommendation["strategy"]
        assert st["choice"] == (names.index(choice) if choice in names else -1)
    assert view.text == d["states"][d["model"]][d["node"]][d["network"]]["text"]
    assert "checkpointing off" in d["fixed"] and "4 GPUs of 40 GB" in d["fixed"]


def test_the_planner_opens_on_any_value_passed_in_and_says_what_cannot_exist():
    d = _json(widgets.planner(9e9, nodes=3, inter_bw=7e9))
    assert d["models"][d["model"]] == fmt_count(9e9) and d["nodes"][d["node"]] == "3"
    assert d["networks"][d["network"]] == "7 GB/s"
    assert d["networks"] == [label for label, _ in sorted(_network_pairs(7e9), key=lambda o: o[1])]  # by speed
    with pytest.raises(CourseInputError):
        widgets.planner(7e9, nodes=0)


def _network_pairs(extra):
    return [*widgets.NETWORK_CHOICES.items(), ("7 GB/s", extra)]


# ---------------------------------------------------------------------------------------------
# What JupyterLab showed wrong (issue: teach from it), checked on the widget objects
# ---------------------------------------------------------------------------------------------


def test_controls_accept_any_value_passed_in():
    """Notebook 03 draws the chart at Nd = 25; the Nd steps are powers of two (a TraitError before)."""
    d = _json(widgets.memory_chart(60e9, nd=25, nm=16))
    assert d["nds"][d["nd"]] == 25 and d["nds"] == sorted(d["nds"])
    assert "Nd = 25" in widgets.memory_chart(60e9, nd=25, nm=16).text
    assert _json(widgets.bill_bars(8, nd=3))["nds"][_json(widgets.bill_bars(8, nd=3))["nd"]] == 3
    k7 = _json(widgets.memory_chart(7.5e9, k=7))
    assert k7["ks"][k7["k"]] == "7 bytes"


def test_readout_sizes_never_use_scientific_notation():
    d = _json(widgets.memory_chart(1e12, nd=1, k=12))  # plain DP holds 16 TB on one GPU
    text = json.dumps([d["exact"], d["sizes"]])
    assert "e+" not in text and "16 TB" in d["sizes"][d["model"]][d["k"]][0][d["nd"]]
    assert "e+" not in memory.memory_chart_view(1e12, nd=1)["readout_text"]


# ---------------------------------------------------------------------------------------------
# In Chromium: a control moved, the chart and the readout redrawn within 100 ms, with no kernel
# ---------------------------------------------------------------------------------------------

from test_browser import browser  # noqa: E402, F401 (the fixture: Debian's chromium at 1280 x 720)

#: What JupyterLab does with a trusted text/html output (@jupyterlab/rendermime's renderHTML): it sets the
#: output's innerHTML, then replaces every <script> by a new one so that it runs.
JUPYTER_LIKE = """<!doctype html><html><head><meta charset="utf-8"><title>output</title></head><body>
<div class="jp-OutputArea-output jp-RenderedHTMLCommon" id="out"></div>
<script>
const host = document.getElementById("out");
host.innerHTML = OUTPUT;
host.querySelectorAll("script").forEach((old) => {
  const fresh = document.createElement("script");
  for (const a of old.attributes) fresh.setAttribute(a.name, a.value);
  fresh.textContent = old.textContent;
  old.parentNode.replaceChild(fresh, old);
});
</script></body></html>"""

#: Times, in the page, from the key press (or click) to each watched element's first change.
WATCH = """
const root = document.querySelector(arguments[0]);
const rec = {t0: null, changed: {}, before: {}};
window.__course = rec;
const start = () => { if (rec.t0 === null) rec.t0 = performance.now(); };
for (const type of ["keydown", "click", "change"]) root.addEventListener(type, start, true);
for (const sel of arguments[1]) {
  const el = root.querySelector(sel);
  rec.before[sel] = el.innerHTML;
  new MutationObserver(() => { if (!(sel in rec.changed)) rec.changed[sel] = performance.now(); })
    .observe(el, {childList: true, subtree: true, characterData: true, attributes: true});
}
"""
LIMIT_MS = 100


def _moved(driver, root: str, control: str, watched: list, acts: list) -> dict:
    """Act on ``control`` inside the view ``root`` once per function in ``acts``; each time, every watched
    element must change. Returns {watched selector: median ms from the act to its change}: the redraw takes
    a few ms, and the median of three keeps one sample of a renderer descheduled on a loaded machine from
    deciding (a slow redraw is slow every time)."""
    from selenium.webdriver.common.by import By

    samples = {s: [] for s in watched}
    for act in acts:
        driver.execute_script(WATCH, root, watched)
        element = driver.find_element(By.CSS_SELECTOR, f"{root} {control}")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        act(element)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rec = driver.execute_script("return window.__course")
            if rec["t0"] is not None and all(s in rec["changed"] for s in watched):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{root}: {watched} did not all change after {control} was used: {rec}")
        after = driver.execute_script(
            "return arguments[1].map(s => document.querySelector(arguments[0] + ' ' + s).innerHTML)", root, watched
        )
        assert all(a != rec["before"][s] for a, s in zip(after, watched)), f"{root}: something did not change"
        for s in watched:
            samples[s].append(rec["changed"][s] - rec["t0"])
    return {s: sorted(v)[len(v) // 2] for s, v in samples.items()}


def _arrow_right(element):
    from selenium.webdriver.common.keys import Keys

    element.send_keys(Keys.ARROW_RIGHT)


def _arrow_down(element):  # a closed dropdown takes the next choice, as a keyboard user picks one
    from selenium.webdriver.common.keys import Keys

    element.send_keys(Keys.ARROW_DOWN)


def _text(driver, css: str) -> str:
    return driver.execute_script(f"return document.querySelector('{css}').innerText")


def _views():
    return [
        widgets.memory_chart(7.5e9, nd=64),
        widgets.bill_bars(8, nd=4),
        widgets.zero3_stepper(4),
        widgets.measured_memory_chart(98_880, {"zero1": [(2, 988_800)]}, nd=2),
        widgets.planner(7e9),
    ]


def _plan_text(*args, **kwargs) -> str:
    """The planner's opening text for these arguments (``plan_summary``), without the PNG a headless run draws."""
    was = os.environ.get("COURSE_HEADLESS")
    os.environ["COURSE_HEADLESS"] = "0"
    try:
        return widgets.planner(*args, **kwargs).text
    finally:
        if was is None:
            del os.environ["COURSE_HEADLESS"]
        else:
            os.environ["COURSE_HEADLESS"] = was


def _exercise(driver, where: str, goto=lambda kind: None) -> dict:
    """Move controls of each view as a user would (``goto(kind)`` first brings the view on screen); every
    chart and readout redraws within LIMIT_MS. Returns the milliseconds measured, per control."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    times, three_right, three_down = {}, [_arrow_right] * 3, [_arrow_down] * 3
    goto("memory-chart")
    mem = "[data-course-instant=memory-chart]"
    before = _text(driver, f"{mem} .course-memory-readout")
    chart, readout = ".course-memory-chart", ".course-memory-readout"
    times["memory: model slider"] = _moved(driver, mem, ".course-memory-model", [chart, readout], three_right)
    after = _text(driver, f"{mem} .course-memory-readout")
    head = re.search(r"Ψ = (\S+), K = ([\d.]+), Nd = (\d+)", after)
    sizes = dict(widgets._model_options())
    assert head and head.group(1) == "70B" and "7.5B" in before, (before[:80], after[:80])  # 13B, 30B, 70B
    rows = [line.split("\t") for line in after.splitlines()]  # the readout table, as the reader sees it
    shown = [int(r[1].replace(",", "")) for r in rows if r[0] in memory.STAGE_NAMES.values()]
    expected = memory.bytes_per_gpu(sizes["70B"], int(head.group(3)), k=float(head.group(2)))
    assert shown == [round(expected[s]) for s in memory.STAGES], "the readout is the formula for the new Ψ"
    times["memory: Nd slider"] = _moved(driver, mem, ".course-memory-nd", [chart, readout], three_right)
    assert "Nd = 512" in _text(driver, f"{mem} .course-memory-readout")  # 128, 256, 512
    times["memory: GPU dropdown"] = _moved(driver, mem, ".course-memory-gpu", [chart, readout], three_down)
    assert "GPU 141 GB" in _text(driver, f"{mem} .course-memory-readout")
    assert Select(driver.find_element(By.CSS_SELECTOR, f"{mem} .course-memory-gpu")).first_selected_option.text == (
        "141 GB (H200)"
    )
    presets = [lambda e, n=n: e.find_element(By.XPATH, f"button[{n}]").click() for n in (3, 2, 1)]  # 1T, 128B, 7.5B
    times["memory: presets"] = _moved(driver, mem, ".course-memory-presets", [chart, readout], presets)
    assert "Ψ = 7.5B" in _text(driver, f"{mem} .course-memory-readout")
    lit = driver.find_elements(By.CSS_SELECTOR, f"{mem} .course-memory-presets button.ci-on")
    assert [b.text for b in lit] == ["7.5B"], "the preset is lit while the slider is on it"

    goto("bill-bars")
    bill = "[data-course-instant=bill-bars]"
    times["bill: Nd slider"] = _moved(
        driver, bill, ".course-bill-nd", [".course-bill-chart", ".course-bill-readout"], three_right
    )
    assert "Nd = 32" in _text(driver, f"{bill} .course-bill-readout")  # 8, 16, 32

    goto("zero3-stepper")
    z3 = "[data-course-instant=zero3-stepper]"
    clicks = [lambda e: e.click()] * 3
    times["stepper: Step"] = _moved(
        driver, z3, ".course-zero3-step", [".course-zero3-chart", ".course-zero3-readout"], clicks
    )
    assert _text(driver, f"{z3} .course-zero3-readout").startswith("step 3,")
    times["stepper: slider"] = _moved(
        driver, z3, ".course-zero3-slider", [".course-zero3-chart", ".course-zero3-readout"], three_right
    )
    assert _text(driver, f"{z3} .course-zero3-readout").startswith("step 6,")

    goto("measured-chart")
    meas = "[data-course-instant=measured-chart]"
    times["measured: Nd slider"] = _moved(
        driver, meas, ".course-measured-nd", [".course-measured-chart", ".course-measured-readout"], three_right
    )
    assert "Nd = 16:" in _text(driver, f"{meas} .course-measured-readout")  # 4, 8, 16

    goto("planner")
    pl = "[data-course-instant=planner]"
    chart, readout = ".course-plan-chart", ".course-plan-readout"
    times["planner: model slider"] = _moved(driver, pl, ".course-plan-model", [chart, readout], three_right)
    assert _text(driver, f"{pl} .course-plan-recommendation") == _plan_text(30e9)  # 7.5B, 13B, 30B
    times["planner: nodes slider"] = _moved(driver, pl, ".course-plan-nodes", [chart, readout], three_right)
    # the network moves no bar, only the step (and on one node, where nothing crosses it, not even that)
    times["planner: network"] = _moved(driver, pl, ".course-plan-network", [readout], [_arrow_down])
    assert _text(driver, f"{pl} .course-plan-recommendation") == _plan_text(30e9, nodes=8, inter_bw=200e9)

    slow = {k: v for k, v in times.items() if max(v.values()) > LIMIT_MS}
    assert not slow, f"{where}: slower than {LIMIT_MS} ms from the key press to the redraw: {slow}"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{where}: the page logged errors: {errors}"
    return times


@pytest.mark.browser
def test_views_answer_at_once_in_jupyterlab_output(browser, tmp_path, live):  # noqa: F811
    views = "".join(view.html() for view in _views())
    page = tmp_path / "output.html"
    page.write_text(JUPYTER_LIKE.replace("OUTPUT", json.dumps(views).replace("</", "<\\/")))
    browser.get(page.as_uri())
    times = _exercise(browser, "JupyterLab-like output")
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "instant-views-lab.json").write_text(json.dumps(times, indent=1))


@pytest.mark.browser
def test_views_answer_at_once_in_a_deck(browser, tmp_path, headless):  # noqa: F811
    """The deck keeps each view's HTML (and drops the static PNG beside it): live in front of the class."""
    import nbformat

    sys.path.insert(0, str(ROOT))
    from tools import build_course as bc

    nb = nbformat.v4.new_notebook()
    cells = [nbformat.v4.new_markdown_cell("# 97 · Instant views")]
    for i, view in enumerate(_views()):
        cells.append(nbformat.v4.new_markdown_cell(f"## View {i}"))
        code = nbformat.v4.new_code_cell("view")
        data, meta = _bundle(view)
        assert "image/png" in data  # a headless run holds the static chart too
        code.outputs = [nbformat.v4.new_output("display_data", data=data, metadata=meta)]
        cells.append(code)
    for i, cell in enumerate(cells):
        cell.metadata["slideshow"] = {"slide_type": "slide" if cell.cell_type == "markdown" else "-"}
        cell["id"] = f"v-{i}"
    nb.cells = cells
    nbformat.write(nb, tmp_path / "97_instant.ipynb")
    html, _ = bc.export_deck(tmp_path / "97_instant.ipynb")
    bc._vendored(tmp_path)
    deck = tmp_path / f"97_instant{bc.DECK_SUFFIX}"
    deck.write_text(html)
    browser.get(deck.as_uri())
    deadline = time.monotonic() + 30
    while not browser.execute_script("return document.body.dataset.courseFitted === '1'"):
        assert time.monotonic() < deadline, "the deck did not open"
        time.sleep(0.2)
    assert browser.execute_script("return document.querySelectorAll('[data-course-instant]').length") == 5
    assert browser.execute_script("return document.querySelectorAll('.jp-OutputArea-output img').length") == 0
    slide_of = {"memory-chart": 1, "bill-bars": 2, "zero3-stepper": 3, "measured-chart": 4, "planner": 5}
    moved = []

    def goto(kind):  # each view is moved on its own slide, as a teacher would; the keys must not move the deck
        if moved:
            assert browser.execute_script("return Reveal.getIndices().h") == moved[-1], "a key moved the deck"
        browser.execute_script(f"Reveal.slide({slide_of[kind]}, 0, 0)")
        time.sleep(0.3)
        assert browser.execute_script(
            f"return Reveal.getCurrentSlide().querySelector('[data-course-instant={kind}]') !== null"
        )
        moved.append(slide_of[kind])

    times = _exercise(browser, "deck", goto)
    assert browser.execute_script("return Reveal.getIndices().h") == moved[-1], "a key moved the deck"
    (ROOT / "build" / "instant-views-deck.json").write_text(json.dumps(times, indent=1))
