/* The browser half of course_utils.instant (notebooks 01 and 03): controls and pictures that answer at once.
 *
 * Every number, label and sentence a view shows arrives in its JSON, computed by course_utils for every
 * state its controls offer; this file builds the controls and draws (SVG lines, bars, a grid) and never
 * computes a result. It runs wherever the output's HTML runs its scripts: JupyterLab and Jupyter
 * Notebook (trusted outputs, which a cell run in the session is), Colab, VS Code, and the exported decks,
 * with no kernel and no network. Each view's root carries data-course-instant="KIND".
 */
(function () {
  "use strict";
  var VERSION = "__VERSION__";
  if (window.CourseInstant && window.CourseInstant.version === VERSION) return;

  var SVG = "http://www.w3.org/2000/svg";
  var W = 720, H = 400; // the SVG's own coordinates: drawn 1:1 at 720 px wide, it scales with its box
  var PLOT = { left: 86, right: 16, top: 14, bottom: 58 };

  function svg(tag, attrs, parent) {
    var el = document.createElementNS(SVG, tag);
    for (var k in attrs) el.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(el);
    return el;
  }
  function label(parent, x, y, words, attrs) {
    var t = svg("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = words;
    return t;
  }
  function tag(name, attrs, parent, words) {
    var el = document.createElement(name);
    for (var k in attrs) el.setAttribute(k, attrs[k]);
    if (words !== undefined) el.textContent = words;
    if (parent) parent.appendChild(el);
    return el;
  }
  function clear(el) { while (el.firstChild) el.removeChild(el.firstChild); }

  // ------------------------------------------------------------------------------------------
  // Controls: a slider over a list of labelled choices, a dropdown, a row of buttons
  // ------------------------------------------------------------------------------------------

  function slider(box, c, onchange) {
    var wrap = tag("label", { "class": "ci-control" }, box);
    tag("span", { "class": "ci-name" }, wrap, c.label);
    var input = tag("input", { type: "range", min: 0, max: c.labels.length - 1, step: 1, "class": c.cls,
                               "aria-label": c.label }, wrap);
    input.value = c.value;
    var shown = tag("span", { "class": "ci-value" }, wrap);
    function show() {
      shown.textContent = c.labels[+input.value];
      input.setAttribute("aria-valuetext", c.labels[+input.value]);
    }
    input.addEventListener("input", function () { show(); onchange(+input.value); });
    show();
    return { get: function () { return +input.value; }, set: function (i) { input.value = i; show(); } };
  }

  function dropdown(box, c, onchange) {
    var wrap = tag("label", { "class": "ci-control" }, box);
    tag("span", { "class": "ci-name" }, wrap, c.label);
    var sel = tag("select", { "class": c.cls, "aria-label": c.label }, wrap);
    c.labels.forEach(function (text, i) { tag("option", { value: i }, sel, text); });
    sel.value = c.value;
    sel.addEventListener("change", function () { onchange(+sel.value); });
    return { get: function () { return +sel.value; } };
  }

  function buttonRow(box, cls, names, onclick) {
    var row = tag("span", { "class": "ci-buttons " + cls }, box);
    return names.map(function (name, i) {
      var b = tag("button", { type: "button" }, row, name);
      b.addEventListener("click", function () { onclick(i); });
      return b;
    });
  }

  // ------------------------------------------------------------------------------------------
  // Axes
  // ------------------------------------------------------------------------------------------

  function tickText(v) {
    if (v >= 1) return v.toLocaleString("en-US", { maximumFractionDigits: 0 });
    return String(+v.toPrecision(3));
  }

  function powersOfTen(lo, hi) {
    var out = [];
    for (var e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      var v = Math.pow(10, e);
      if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
    }
    return out;
  }

  function niceStep(hi, n) {
    var raw = hi / n, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }

  /* A plot frame in a cleared SVG: x and y map data to pixels (log or linear), ticks and grid drawn. */
  function frame(root, o) {
    var x0 = PLOT.left, x1 = W - PLOT.right, y0 = H - PLOT.bottom, y1 = PLOT.top;
    function scale(lo, hi, a, b, log) {
      if (log) { lo = Math.log(lo); hi = Math.log(hi); }
      return function (v) { return a + ((log ? Math.log(v) : v) - lo) / (hi - lo) * (b - a); };
    }
    var x = scale(o.xlo, o.xhi, x0, x1, o.xlog), y = scale(o.ylo, o.yhi, y0, y1, o.ylog);
    var grid = svg("g", { "class": "ci-grid" }, root);
    svg("rect", { x: x0, y: y1, width: x1 - x0, height: y0 - y1, fill: "none", stroke: "#888" }, root);
    (o.xticks || []).forEach(function (t) {
      svg("line", { x1: x(t[0]), x2: x(t[0]), y1: y0, y2: y1, stroke: "#ddd" }, grid);
      label(root, x(t[0]), y0 + 20, t[1], { "text-anchor": "middle", "class": "ci-tick" });
    });
    (o.yticks || []).forEach(function (t) {
      svg("line", { x1: x0, x2: x1, y1: y(t[0]), y2: y(t[0]), stroke: "#ddd" }, grid);
      label(root, x0 - 6, y(t[0]) + 5, t[1], { "text-anchor": "end", "class": "ci-tick" });
    });
    if (o.xlabel) label(root, (x0 + x1) / 2, H - 10, o.xlabel, { "text-anchor": "middle", "class": "ci-axis" });
    if (o.ylabel) {
      label(root, 16, (y0 + y1) / 2, o.ylabel,
            { "text-anchor": "middle", "class": "ci-axis", transform: "rotate(-90 16 " + (y0 + y1) / 2 + ")" });
    }
    return { x: x, y: y, x0: x0, x1: x1, y0: y0, y1: y1 };
  }

  function polyline(root, xs, ys, f, color, extra) {
    var pts = xs.map(function (v, i) { return f.x(v).toFixed(1) + "," + f.y(ys[i]).toFixed(1); }).join(" ");
    return svg("polyline", Object.assign({ points: pts, fill: "none", stroke: color, "stroke-width": 2 }, extra || {}), root);
  }

  function legend(root, x, y, items) {
    items.forEach(function (it, i) {
      var yy = y + i * 20;
      if (it.dash) svg("rect", { x: x, y: yy - 9, width: 18, height: 11, fill: "none", stroke: it.color,
                                 "stroke-dasharray": "3 2" }, root);
      else if (it.box) svg("rect", { x: x, y: yy - 9, width: 18, height: 11, fill: it.color }, root);
      else svg("line", { x1: x, x2: x + 18, y1: yy - 4, y2: yy - 4, stroke: it.color, "stroke-width": 2.5 }, root);
      label(root, x + 24, yy, it.text, { "class": "ci-legend" });
    });
  }

  function rangeOf(values) {
    var lo = Infinity, hi = -Infinity;
    values.forEach(function (v) { if (v > 0) { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    return [lo, hi];
  }

  /* The view's four parts in a grid (instant.py's style): controls, title, chart and readout stacked in a
     notebook's output; on a wider page (a deck's 1280 px slide) the title on top, the chart at its own size
     on the left and the controls and readout beside it, so the slide holds it without shrinking a label. */
  function setup(root, d) {
    var grid = tag("div", { "class": "ci-grid" }, root);
    var box = { controls: tag("div", { "class": "ci-controls" }, grid) };
    box.title = tag("div", { "class": "ci-title" }, grid);
    box.chart = svg("svg", { viewBox: "0 0 " + W + " " + H, "class": "ci-chart " + d.css + "-chart",
                             role: "img" }, grid);
    box.readout = tag("div", { "class": "ci-readout " + d.css + "-readout" }, grid);
    return box;
  }

  // ------------------------------------------------------------------------------------------
  // The views
  // ------------------------------------------------------------------------------------------

  var VIEWS = {};

  /* Notebook 01: memory per GPU against Nd for each row of the ZeRO table. */
  VIEWS["memory-chart"] = function (root, d) {
    var s = { m: d.model, k: d.k, n: d.nd, g: d.gpu };
    var box = setup(root, d);
    var row1 = tag("div", { "class": "ci-row" }, box.controls), row2 = tag("div", { "class": "ci-row" }, box.controls);
    var model = slider(row1, { cls: d.css + "-model", label: "Model Ψ", labels: d.models, value: s.m },
                       function (i) { s.m = i; draw(); });
    var presets = buttonRow(row1, d.css + "-presets", d.presets.map(function (p) { return p[0]; }), function (i) {
      s.m = d.presets[i][1]; model.set(s.m); draw();
    });
    dropdown(row2, { cls: d.css + "-k", label: "K", labels: d.ks, value: s.k }, function (i) { s.k = i; draw(); });
    slider(row2, { cls: d.css + "-nd", label: "Nd", labels: d.nds.map(String), value: s.n },
           function (i) { s.n = i; draw(); });
    dropdown(row2, { cls: d.css + "-gpu", label: "GPU", labels: d.gpus, value: s.g }, function (i) { s.g = i; draw(); });

    function draw() {
      var bytes = d.bytes[s.m][s.k], gpu = d.gpuBytes[s.g], axis = d.axis.map(function (i) { return d.nds[i]; });
      var all = [gpu];
      bytes.forEach(function (row) { d.axis.forEach(function (i) { all.push(row[i]); }); });
      var r = rangeOf(all), lo = r[0] / 3, hi = r[1] * 3, scale = d.scale;
      clear(box.chart);
      var f = frame(box.chart, {
        xlo: axis[0] / 1.25, xhi: axis[axis.length - 1] * 1.25, xlog: true, ylo: lo, yhi: hi, ylog: true,
        xticks: axis.map(function (n) { return [n, String(n)]; }),
        yticks: powersOfTen(lo / scale, hi / scale).map(function (v) { return [v * scale, tickText(v)]; }),
        xlabel: "Nd, data-parallel GPUs (log scale)", ylabel: d.ylabel
      });
      var nd = d.nds[s.n];
      svg("line", { x1: f.x(nd), x2: f.x(nd), y1: f.y0, y2: f.y1, stroke: "#999", "stroke-dasharray": "2 3" }, box.chart);
      svg("line", { x1: f.x0, x2: f.x1, y1: f.y(gpu), y2: f.y(gpu), stroke: "#c0392b", "stroke-dasharray": "7 4",
                    "stroke-width": 1.5 }, box.chart);
      label(box.chart, f.x1 - 6, f.y(gpu) - 6, d.gpuLine[s.g], { fill: "#c0392b", "text-anchor": "end", "class": "ci-note" });
      bytes.forEach(function (row, j) {
        polyline(box.chart, axis, d.axis.map(function (i) { return row[i]; }), f, d.colors[j]);
        svg("circle", { cx: f.x(nd), cy: f.y(row[s.n]), r: 6, fill: "none", stroke: d.colors[j], "stroke-width": 2 },
            box.chart);
      });
      legend(box.chart, f.x0 + 10, f.y0 - 12 - 20 * (d.stageNames.length - 1),
             d.stageNames.map(function (n, j) { return { text: n, color: d.colors[j] }; }));
      box.title.textContent = d.titles[s.m][s.k][s.g];
      presets.forEach(function (b, i) { b.classList.toggle("ci-on", d.presets[i][1] === s.m); });
      clear(box.readout);
      tag("b", {}, box.readout, "Ψ = " + d.models[s.m] + (d.nmText || "") + ", K = " + d.kShort[s.k] + ", Nd = " + nd + ", GPU " +
          d.gpuShort[s.g]);
      var table = tag("table", {}, box.readout), head = tag("tr", {}, table);
      ["", "bytes per GPU", "", ""].forEach(function (h) { tag("th", { "class": h ? "ci-num" : "" }, head, h); });
      d.stageNames.forEach(function (name, j) {
        var first = d.firstFit[s.m][s.k][s.g][j], fits = first !== null && nd >= first;
        var tr = tag("tr", { "class": fits ? "ci-fits" : "ci-too-big" }, table);
        tag("td", {}, tr, name);
        tag("td", { "class": "ci-num" }, tr, d.exact[s.m][s.k][j][s.n]);
        tag("td", { "class": "ci-num" }, tr, d.sizes[s.m][s.k][j][s.n]);
        tag("td", {}, tr, fits ? "fits" : "does not fit");
      });
    }
    draw();
  };

  /* Notebook 01: one GPU's bill as stacked bars per row, dashed where sharding dropped a part. */
  VIEWS["bill-bars"] = function (root, d) {
    var s = { n: d.nd, k: d.k };
    var box = setup(root, d);
    var row = tag("div", { "class": "ci-row" }, box.controls);
    slider(row, { cls: d.css + "-nd", label: "Nd", labels: d.nds.map(String), value: s.n },
           function (i) { s.n = i; draw(); });
    dropdown(row, { cls: d.css + "-k", label: "K", labels: d.ks, value: s.k }, function (i) { s.k = i; draw(); });

    function draw() {
      var st = d.states[s.n][s.k];
      clear(box.chart);
      var step = niceStep(st.top, 5), ticks = [];
      for (var v = 0; v <= st.top * 1.0001; v += step) ticks.push([v, tickText(v)]);
      var f = frame(box.chart, { xlo: -0.5, xhi: d.stageNames.length - 0.5 + 1.6, ylo: 0, yhi: st.top,
                                 yticks: ticks, ylabel: d.ylabel });
      var width = (f.x(0.6) - f.x(0));
      st.bars.forEach(function (bar, i) {
        var bottom = 0, xl = f.x(i) - width / 2;
        bar.held.forEach(function (h, p) {
          if (h > 0) {
            svg("rect", { x: xl, y: f.y(bottom + h), width: width, height: f.y(bottom) - f.y(bottom + h),
                          fill: d.partColors[p], stroke: "white" }, box.chart);
            bottom += h;
          }
        });
        label(box.chart, f.x(i), f.y(bottom) - 6, bar.label, { "text-anchor": "middle", "class": "ci-note ci-bold" });
        bar.dropped.forEach(function (h, p) {
          if (h > 0) {
            svg("rect", { x: xl, y: f.y(bottom + h), width: width, height: f.y(bottom) - f.y(bottom + h),
                          fill: "none", stroke: d.partColors[p], "stroke-dasharray": "5 3", "stroke-width": 1.4 },
                box.chart);
            bottom += h;
          }
        });
        d.stageLines[i].forEach(function (line, j) {
          label(box.chart, f.x(i), f.y0 + 20 + 16 * j, line, { "text-anchor": "middle", "class": "ci-tick" });
        });
      });
      if (st.gpu !== null) {
        svg("line", { x1: f.x0, x2: f.x1, y1: f.y(st.gpu), y2: f.y(st.gpu), stroke: "#c0392b",
                      "stroke-dasharray": "7 4" }, box.chart);
        label(box.chart, f.x1 - 6, f.y(st.gpu) - 6, d.gpuLine, { fill: "#c0392b", "text-anchor": "end", "class": "ci-note" });
      }
      var items = d.parts.map(function (p, i) { return { text: p, color: d.partColors[i], box: true }; })
        .filter(function (it, i) { return d.partShown[i]; });
      items.push({ text: "no longer held", color: "#555", dash: true });
      legend(box.chart, f.x(d.stageNames.length - 0.5) + 10, f.y1 + 20, items);
      box.title.textContent = st.title;
      box.readout.textContent = st.text;
    }
    draw();
  };

  /* Notebook 05: the planner. Every strategy's bytes per GPU as a stacked bar against the usable memory,
     its step, and the recommendation, for each model size, node count and network. */
  VIEWS["planner"] = function (root, d) {
    var s = { m: d.model, n: d.node, w: d.network };
    var box = setup(root, d);
    var row1 = tag("div", { "class": "ci-row" }, box.controls), row2 = tag("div", { "class": "ci-row" }, box.controls);
    slider(row1, { cls: d.css + "-model", label: "Model Ψ", labels: d.models, value: s.m }, function (i) { s.m = i; draw(); });
    slider(row2, { cls: d.css + "-nodes", label: "Nodes", labels: d.nodes, value: s.n }, function (i) { s.n = i; draw(); });
    dropdown(row2, { cls: d.css + "-network", label: "Network", labels: d.networks, value: s.w },
             function (i) { s.w = i; draw(); });
    tag("div", { "class": "ci-row ci-fixed" }, box.controls, d.fixed);

    function draw() {
      var st = d.states[s.m][s.n][s.w], tallest = 0;
      st.bars.forEach(function (b) { if (b) tallest = Math.max(tallest, b.reduce(function (a, v) { return a + v; }, 0)); });
      var top = Math.max(d.usable * 1.3, Math.min(tallest * 1.25, d.usable * 2.5)); // a bar taller is cut, marked ▲
      clear(box.chart);
      var step = niceStep(top, 5), ticks = [];
      for (var v = 0; v <= top * 1.0001; v += step) ticks.push([v, tickText(v)]);
      var n = d.ticks.length;
      var f = frame(box.chart, { xlo: -0.5, xhi: n - 0.5, ylo: 0, yhi: top, yticks: ticks, ylabel: d.ylabel });
      var width = f.x(0.62) - f.x(0);
      st.bars.forEach(function (bar, i) {
        var lines = d.ticks[i].split("\n");
        lines.forEach(function (line, j) {
          label(box.chart, f.x(i), f.y0 + 18 + 15 * j, line,
                { "text-anchor": "middle", "class": "ci-tick" + (i === st.choice ? " ci-bold" : "") });
        });
        if (!bar) {
          label(box.chart, f.x(i), f.y0 - 8, "n/a", { "text-anchor": "middle", "class": "ci-note" });
          return;
        }
        var bottom = 0, xl = f.x(i) - width / 2;
        bar.forEach(function (h, p) {
          var hi = Math.min(bottom + h, top);
          if (h > 0 && bottom < top) {
            svg("rect", { x: xl, y: f.y(hi), width: width, height: f.y(bottom) - f.y(hi), fill: d.partColors[p],
                          stroke: "white", opacity: st.fits[i] ? 1 : 0.45 }, box.chart);
          }
          bottom += h;
        });
        var said = bottom >= 100 ? bottom.toFixed(0) : bottom.toPrecision(3);
        var cut = bottom > top * (1 - 48 / (f.y0 - f.y1)); // would reach the legend's strip: labelled inside
        label(box.chart, f.x(i), cut ? f.y1 + 44 : f.y(bottom) - 6, cut ? "▲ " + said : said,  // a cut bar: inside, below the strip
              { "text-anchor": "middle", "class": "ci-note" + (i === st.choice ? " ci-bold" : "") });
      });
      svg("line", { x1: f.x0, x2: f.x1, y1: f.y(d.usable), y2: f.y(d.usable), stroke: "#c0392b", "stroke-dasharray": "7 4",
                    "stroke-width": 1.5 }, box.chart);
      label(box.chart, f.x1 - 6, f.y(d.usable) - 6, d.usableLine, { fill: "#c0392b", "text-anchor": "end", "class": "ci-note" });
      // the parts, in one row along the top, on a white strip so that a bar cut at the top does not hide them
      svg("rect", { x: f.x0 + 1, y: f.y1 + 1, width: f.x1 - f.x0 - 2, height: 24, fill: "white", opacity: 0.85 }, box.chart);
      d.parts.forEach(function (p, i) {
        var x = f.x0 + 10 + i * 120;
        svg("rect", { x: x, y: f.y1 + 8, width: 18, height: 11, fill: d.partColors[i] }, box.chart);
        label(box.chart, x + 24, f.y1 + 18, p, { "class": "ci-legend" });
      });
      box.title.textContent = st.choice >= 0 ? "Recommendation: " + d.names[st.choice] : "Nothing fits";
      clear(box.readout);
      tag("b", { "class": d.css + "-recommendation" }, box.readout, st.text);
      var table = tag("table", {}, box.readout), head = tag("tr", {}, table);
      ["strategy", "GB per GPU", "", "step (est.)"].forEach(function (h, j) { tag("th", { "class": j ? "ci-num" : "" }, head, h); });
      d.ticks.forEach(function (tick, i) {
        var bar = st.bars[i], name = tick.replace("\n", " ");
        if (!bar) return;
        var total = bar.reduce(function (a, v) { return a + v; }, 0);
        var tr = tag("tr", { "class": st.fits[i] ? "ci-fits" : "ci-too-big" }, table);
        tag("td", {}, tr, name);
        tag("td", { "class": "ci-num" }, tr, total.toFixed(1));
        tag("td", {}, tr, st.fits[i] ? "fits" : "does not fit");
        tag("td", { "class": "ci-num" }, tr, st.step[i]);
      });
    }
    draw();
  };

  /* Notebook 03: the stage-3 schedule, one state per step: GPUs x units (layers, root), and what each GPU has sent. */
  VIEWS["zero3-stepper"] = function (root, d) {
    var s = { i: 0 }, last = d.states.length - 1;
    var box = setup(root, d);
    var row = tag("div", { "class": "ci-row" }, box.controls);
    var step = tag("button", { type: "button", "class": d.css + "-step ci-primary" }, row, "Step");
    var back = tag("button", { type: "button", "class": d.css + "-back" }, row, "Back");
    var reset = tag("button", { type: "button", "class": d.css + "-reset" }, row, "Reset");
    var bar = slider(row, { cls: d.css + "-slider", label: "step", labels: d.states.map(function (st) { return String(st.step); }),
                            value: 0 }, function (i) { s.i = i; draw(); });
    step.addEventListener("click", function () { s.i = Math.min(s.i + 1, last); draw(); });
    back.addEventListener("click", function () { s.i = Math.max(s.i - 1, 0); draw(); });
    reset.addEventListener("click", function () { s.i = 0; draw(); });

    function draw() {
      var st = d.states[s.i], nd = d.nd, layers = d.layers;
      bar.set(s.i);
      step.disabled = s.i === last;
      back.disabled = s.i === 0;
      clear(box.chart);
      // left: the grid, one row per GPU, one column per unit cut into nd slices
      var gx = 70, gy = 34, cell = Math.min(300 / layers, (H - 90) / nd), slice = cell * 0.92 / nd;
      label(box.chart, gx, 20, st.heading, { "class": "ci-axis" });
      for (var g = 0; g < nd; g++) {
        label(box.chart, gx - 8, gy + g * cell + cell * 0.5, "GPU " + g, { "text-anchor": "end", "class": "ci-tick" });
        for (var l = 0; l < layers; l++) {
          var x = gx + l * cell, y = gy + g * cell;
          svg("rect", { x: x, y: y, width: cell * 0.92, height: cell * 0.92,
                        fill: st.whole[g][l] ? "#cdbde6" : "#f2f2f2" }, box.chart);
          svg("rect", { x: x + g * slice, y: y, width: slice, height: cell * 0.92, fill: d.colors.weights,
                        stroke: "white" }, box.chart);
          if (st.grads[l]) svg("circle", { cx: x + (g + 0.5) * slice, cy: y + cell * 0.46, r: Math.max(3, 12 / nd),
                                           fill: d.colors.gradients }, box.chart);
        }
      }
      for (l = 0; l < layers; l++) {
        label(box.chart, gx + l * cell + cell * 0.46, gy + nd * cell + 16, d.labels[l],
              { "text-anchor": "middle", "class": "ci-tick" });
      }
      if (st.layer !== null) {
        svg("rect", { x: gx + st.layer * cell - 3, y: gy - 3, width: cell * 0.92 + 6, height: nd * cell + 3,
                      fill: "none", stroke: "#222", "stroke-width": 2.5 }, box.chart);
      }
      // right: what each GPU has sent so far, by kind, against plain DP
      var bx0 = 410, bx1 = W - 70, by = 34, bh = Math.min(44, (H - 110) / nd);
      var xs = function (v) { return bx0 + v / d.xmax * (bx1 - bx0); };
      label(box.chart, bx0, 20, "sent by each GPU so far (units of Ψ)", { "class": "ci-axis" });
      for (g = 0; g < nd; g++) {
        var left = 0, y0 = by + g * (bh + 8);
        label(box.chart, bx0 - 8, y0 + bh * 0.6, "GPU " + g, { "text-anchor": "end", "class": "ci-tick" });
        st.sent[g].forEach(function (v, k) {
          if (v > 0) svg("rect", { x: xs(left), y: y0, width: xs(left + v) - xs(left), height: bh,
                                   fill: d.kindColors[k] }, box.chart);
          left += v;
        });
        label(box.chart, xs(left) + 4, y0 + bh * 0.65, st.totals[g], { "class": "ci-note" });
      }
      var dpx = xs(d.dp), yEnd = by + nd * (bh + 8);
      svg("line", { x1: dpx, x2: dpx, y1: by - 6, y2: yEnd, stroke: "#444", "stroke-dasharray": "6 4" }, box.chart);
      label(box.chart, dpx, yEnd + 18, d.dpLabel, { "text-anchor": "middle", "class": "ci-note" });
      legend(box.chart, bx0, yEnd + 44, d.kinds.map(function (k, i) { return { text: k, color: d.kindColors[i], box: true }; }));
      box.title.textContent = st.caption;
      box.readout.innerHTML = st.readout; // course_utils' own markup (html-escaped there)
    }
    draw();
  };

  /* Notebook 03: the memory chart for a real run's Ψ, with the bytes measured on real runs as points. */
  VIEWS["measured-chart"] = function (root, d) {
    var s = { n: d.nd };
    var box = setup(root, d);
    var row = tag("div", { "class": "ci-row" }, box.controls);
    slider(row, { cls: d.css + "-nd", label: "Nd", labels: d.nds.map(String), value: s.n },
           function (i) { s.n = i; draw(); });

    function draw() {
      var axis = d.axis, all = [];
      d.curves.forEach(function (c) { all = all.concat(c); });
      d.points.forEach(function (ps) { ps.forEach(function (p) { all.push(p[1]); }); });
      var r = rangeOf(all), lo = r[0] / 3, hi = r[1] * 3;
      clear(box.chart);
      var f = frame(box.chart, {
        xlo: axis[0] / 1.25, xhi: axis[axis.length - 1] * 1.25, xlog: true, ylo: lo, yhi: hi, ylog: true,
        xticks: axis.map(function (n) { return [n, String(n)]; }),
        yticks: powersOfTen(lo, hi).map(function (v) { return [v, tickText(v)]; }),
        xlabel: "Nd, data-parallel ranks (log scale)", ylabel: "model-state bytes per rank (log scale)"
      });
      var nd = d.nds[s.n];
      svg("line", { x1: f.x(nd), x2: f.x(nd), y1: f.y0, y2: f.y1, stroke: "#999", "stroke-dasharray": "2 3" }, box.chart);
      d.curves.forEach(function (c, j) {
        polyline(box.chart, axis, c, f, d.colors[j], { "stroke-width": 1.6 });
        d.points[j].forEach(function (p) {
          svg("circle", { cx: f.x(p[0]), cy: f.y(p[1]), r: 8, fill: "none", stroke: d.colors[j], "stroke-width": 2.5 },
              box.chart);
        });
        svg("circle", { cx: f.x(nd), cy: f.y(d.at[s.n][j]), r: 4, fill: d.colors[j] }, box.chart);
      });
      var items = d.stageNames.map(function (n, j) { return { text: n + ", formula", color: d.colors[j] }; });
      legend(box.chart, f.x0 + 10, f.y0 - 12 - 20 * items.length, items);
      label(box.chart, f.x0 + 14, f.y0 - 12, "○  measured on a real run (real tensors)", { "class": "ci-legend" });
      box.title.textContent = d.title;
      box.readout.textContent = d.texts[s.n];
    }
    draw();
  };

  window.CourseInstant = {
    version: VERSION,
    mount: function (root) {
      if (!root || root.dataset.courseMounted) return;
      var data = JSON.parse(root.querySelector("script[type='application/json']").textContent);
      var fallback = root.querySelector(".ci-fallback");
      if (fallback) fallback.parentNode.removeChild(fallback);
      root.dataset.courseMounted = "1";
      // a key pressed on a control is the control's: not a deck's (reveal.js would turn the slide on an arrow
      // key or a space, and take a dropdown's arrow keys) nor JupyterLab's command shortcuts
      root.addEventListener("keydown", function (event) { event.stopPropagation(); });
      VIEWS[data.view](root, data);
    }
  };
})();
