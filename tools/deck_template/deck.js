/* The course deck's behaviour (inlined into every deck by tools/build_course.py).

   1. Typeset math offline with KaTeX (vendored in slides/katex/); in speaker notes as MathML alone.
   2. Start reveal.js on a 1280 x 720 canvas, with the speaker-notes plugin.
   3. Fit every slide to the canvas, so one idea stays one slide and nothing is cut off:
      a. charts get at least MIN_CHART of the slide's height, and printed outputs the largest type
         (up to OUTPUT_PX, a size the back of the room reads) at which their longest line still fits
         the width. Columns (an output with aligned columns) go down to OUTPUT_MIN_PX rather than wrap;
         other text never goes below OUTPUT_WRAP_PX for that, and a line too long even there wraps, so
         one long line (a path, a traceback) does not shrink a whole output to footnote size;
      w. a table or displayed formula wider than the slide gets smaller type until it fits the width
         (down to WIDE_MIN_PX; a table not below TABLE_MIN of its own size); one still too wide scrolls
         sideways in its own box (a last resort that keeps every column reachable instead of cut off at
         the canvas edge);
      b. if the slide overflows, printed outputs get smaller (down to OUTPUT_MIN_PX), then its
         text shrinks a little, down to MILD;
      c. if it still overflows, its trailing prose (last list items, last paragraphs; never a cell's
         first paragraph, a heading, a table, code, an output or a "Predict" question) moves, in
         order, into the slide's speaker notes;
      d. if it still overflows, its text shrinks further, never below SMALLEST (TABLE_MIN on a slide
         with a table: a table the room cannot read is no table);
      e. printed outputs shrunk in b grow back, up to their size from a, while the slide still fits
         (moving prose into the notes may have freed the room); on a slide with a chart, the chart
         instead grows into whatever height is left.
   A course chart (plots.StaticFigure) carries its smallest text and its own size (data-min-text-px,
   data-css-width, data-css-height): it is never drawn smaller than the size at which that text is
   LABEL_PX on the canvas, unless the slide's width forbids it (the browser test then fails the slide).
   Each slide records what was done (data-course-fit, data-course-moved, data-course-overflow,
   data-course-narrowed, data-course-scrolled); each table its own size before any fitting
   (data-course-table-px);
   document.body.dataset.courseFitted = "1" once all slides are fitted (the browser tests wait for it). */
(function () {
  "use strict";
  var WIDTH = 1280, HEIGHT = 720, MIN_CHART = 0.45, MILD = 0.85, SMALLEST = 0.7, TABLE_MIN = 0.9;
  var OUTPUT_PX = 24, OUTPUT_WRAP_PX = 19, OUTPUT_MIN_PX = 15, WIDE_MIN_PX = 14, LABEL_PX = 14;
  var slides = document.querySelector(".reveal .slides");
  var toArray = function (list) { return Array.prototype.slice.call(list); };

  // Speaker notes get MathML only: the speaker view (notes plugin) shows their HTML without KaTeX's
  // stylesheet, where KaTeX's HTML rendering would show each formula twice; browsers draw MathML natively.
  if (window.renderMathInElement) {
    var math = function (ignored, output) {
      return {
        delimiters: [
          {left: "$$", right: "$$", display: true}, {left: "\\[", right: "\\]", display: true},
          {left: "$", right: "$", display: false}, {left: "\\(", right: "\\)", display: false}
        ],
        ignoredClasses: ["jp-OutputArea", "jp-InputArea-editor"].concat(ignored),
        output: output, throwOnError: false
      };
    };
    window.renderMathInElement(slides, math(["notes"], "htmlAndMathml"));
    toArray(slides.querySelectorAll("aside.notes")).forEach(function (aside) {
      window.renderMathInElement(aside, math([], "mathml"));
    });
  }

  var leaves = toArray(slides.querySelectorAll("section")).filter(function (s) { return !s.querySelector("section"); });
  if (leaves.length) leaves[0].classList.add("course-title");

  function chartsOf(section) { return toArray(section.querySelectorAll(".jp-OutputArea-output img")); }

  // The height (canvas px) at which a course chart's smallest text is LABEL_PX; 0 when it does not say.
  function readableHeight(img) {
    var px = parseFloat(img.dataset.minTextPx), h = parseFloat(img.dataset.cssHeight);
    return px > 0 && h > 0 ? Math.ceil(h * LABEL_PX / px) : 0;
  }

  function sizeCharts(section, free) {
    var charts = chartsOf(section);
    charts.forEach(function (img) {
      var ratio = img.naturalWidth ? img.naturalHeight / img.naturalWidth : 0.6;
      var widest = (section.clientWidth - 8) * ratio;  // as tall as the slide's width allows
      var h = Math.min(free / charts.length, widest);
      h = Math.max(h, Math.min(readableHeight(img), widest));  // never so small that a label goes under LABEL_PX
      img.style.maxHeight = "none";
      img.style.width = "auto";
      img.style.height = Math.floor(Math.max(h, 80)) + "px";
    });
  }

  function overflow(section) { return section.scrollHeight - HEIGHT; }

  // Printed outputs: as large as their longest line allows, up to OUTPUT_PX (step a above). The room
  // is measured from the output's left edge to the slide's right edge, and the line at its own width
  // (max-content): a pre's clientWidth is only as wide as its text, so comparing the two said every
  // short output "fits at 20 px" and none ever got larger.
  function sizeOutputs(section) {
    var pres = toArray(section.querySelectorAll(".jp-OutputArea-output pre"));
    var scale = section.getBoundingClientRect().width / section.offsetWidth || 1;
    pres.forEach(function (pre) {
      pre.style.whiteSpace = "pre";
      pre.style.fontSize = "20px";
      pre.style.width = "max-content";
      var natural = pre.getBoundingClientRect().width / scale;
      pre.style.width = "";
      var room = roomRightOf(section, pre) - 2;
      var fits = Math.floor(20 * room / Math.max(natural, 1));
      var floor = columns(pre) ? OUTPUT_MIN_PX : OUTPUT_WRAP_PX;
      pre.style.fontSize = Math.max(floor, Math.min(OUTPUT_PX, fits)) + "px";
      pre.dataset.courseWidthPx = pre.style.fontSize;  // the most step e may give back
      pre.style.whiteSpace = "pre-wrap";  // a line too long even at the floor wraps, never is cut
    });
    while (overflow(section) > 0) {
      var larger = pres.filter(function (pre) { return parseFloat(pre.style.fontSize) > OUTPUT_MIN_PX; });
      if (!larger.length) break;
      larger.forEach(function (pre) { pre.style.fontSize = (parseFloat(pre.style.fontSize) - 1) + "px"; });
    }
  }

  // Step e: outputs shrunk for height grow back, a pixel at a time, while the slide fits.
  function growOutputs(section) {
    var pres = toArray(section.querySelectorAll(".jp-OutputArea-output pre"));
    for (;;) {
      var smaller = pres.filter(function (pre) {
        return parseFloat(pre.style.fontSize) < parseFloat(pre.dataset.courseWidthPx);
      });
      if (!smaller.length) return;
      smaller.forEach(function (pre) { pre.style.fontSize = (parseFloat(pre.style.fontSize) + 1) + "px"; });
      if (overflow(section) > 0) {
        smaller.forEach(function (pre) { pre.style.fontSize = (parseFloat(pre.style.fontSize) - 1) + "px"; });
        return;
      }
    }
  }

  // How far (canvas px) an element reaches past the slide's right edge, inside its padding; <= 0 fits.
  // Measured on screen rectangles, so it holds wherever the element sits (a flex output area grows
  // with a wide table, so comparing with the parent's width would say it fits).
  function pastRightEdge(section, el) {
    var box = section.getBoundingClientRect();
    var scale = box.width / section.offsetWidth || 1;
    var pad = parseFloat(window.getComputedStyle(section).paddingRight) || 0;
    return (el.getBoundingClientRect().right - (box.right - pad * scale)) / scale;
  }

  // A table printed by a cell: two or more lines with a gap of two spaces or more between words.
  function columns(pre) {
    return pre.textContent.split("\n").filter(function (line) { return /\S {2,}\S/.test(line); }).length >= 2;
  }

  // The width (canvas px) from the element's left edge to the slide's right edge, inside its padding.
  function roomRightOf(section, el) {
    var box = section.getBoundingClientRect();
    var scale = box.width / section.offsetWidth || 1;
    var pad = parseFloat(window.getComputedStyle(section).paddingRight) || 0;
    return (box.right - pad * scale - el.getBoundingClientRect().left) / scale;
  }

  // Width: tables (markdown or printed by a cell) and displayed formulas never run off the right edge.
  function fitWidth(section) {
    var narrowed = 0, scrolled = 0;
    toArray(section.querySelectorAll("table, .katex-display")).forEach(function (el) {
      if (el.closest("aside") || el.parentNode.closest("table, .katex-display") || pastRightEdge(section, el) <= 0.5) return;
      var parentPx = parseFloat(window.getComputedStyle(el.parentNode).fontSize) || 16;
      var px = parseFloat(window.getComputedStyle(el).fontSize);
      var least = el.tagName === "TABLE" ? Math.max(WIDE_MIN_PX, TABLE_MIN * px) : WIDE_MIN_PX;
      while (pastRightEdge(section, el) > 0.5 && px > least) {
        px = Math.max(px - 1, least);
        el.style.fontSize = (px / parentPx) + "em";  // em: the slide's own shrinking (below) still applies
      }
      narrowed += 1;
      var past = pastRightEdge(section, el);
      if (past > 0.5) {
        var box = document.createElement("div");
        box.className = "course-scroll";
        box.style.overflowX = "auto";
        box.style.maxWidth = Math.floor(el.getBoundingClientRect().width / (section.getBoundingClientRect().width / section.offsetWidth || 1) - past) + "px";
        el.parentNode.insertBefore(box, el);
        box.appendChild(el);
        scrolled += 1;
      }
    });
    if (narrowed) section.dataset.courseNarrowed = String(narrowed);
    if (scrolled) section.dataset.courseScrolled = String(scrolled);
  }

  function asksToPredict(el) {
    return toArray(el.querySelectorAll("em, strong")).some(function (e) { return /^\s*Predict/.test(e.textContent); });
  }

  // Prose a slide may hand to its speaker notes, in reading order.
  function movable(section) {
    var all = [];
    toArray(section.querySelectorAll(".jp-RenderedMarkdown")).forEach(function (md) {
      if (md.closest("aside")) return;
      var units = [];
      toArray(md.children).forEach(function (el) {
        var tag = el.tagName;
        if (tag === "P" || tag === "BLOCKQUOTE") {
          if (!el.querySelector("img, .katex-display") && !asksToPredict(el)) units.push(el);
          else units.push(null);  // stays, and keeps its place in the order
        } else if (tag === "UL" || tag === "OL") {
          toArray(el.children).forEach(function (li) { units.push(li); });
        } else {
          units.push(null);
        }
      });
      var first = units.findIndex(function (u) { return u !== null; });
      all = all.concat(units.filter(function (u, i) { return u !== null && i !== first; }));
    });
    return all;
  }

  function notesOf(section) {
    var aside = section.querySelector(":scope > aside.notes.course-moved");
    if (!aside) {
      aside = document.createElement("aside");
      aside.className = "notes course-moved";
      section.appendChild(aside);
    }
    return aside;
  }

  function moveToNotes(section, unit) {
    var aside = notesOf(section);
    var list = unit.tagName === "LI" ? unit.parentNode : null;
    var piece = unit;
    if (list) {
      piece = document.createElement(list.tagName);
      piece.appendChild(unit);
      if (!list.children.length) list.remove();
    }
    toArray(piece.querySelectorAll(".katex-html")).forEach(function (el) { el.remove(); });  // MathML stays (step 1)
    aside.insertBefore(piece, aside.firstChild);  // moved from the end backwards: notes keep the order
  }

  function fit(section) {
    var shown = [section, section.parentNode].filter(function (el) { return el.tagName === "SECTION"; });
    var saved = shown.map(function (el) { return el.style.display; });
    shown.forEach(function (el) { el.style.display = "block"; });
    var charts = chartsOf(section).length;
    var tables = toArray(section.querySelectorAll("table")).filter(function (t) { return !t.closest("aside"); });
    tables.forEach(function (t) { t.dataset.courseTablePx = window.getComputedStyle(t).fontSize; });
    if (charts) sizeCharts(section, HEIGHT * MIN_CHART);
    sizeOutputs(section);
    fitWidth(section);
    var scale = 1;
    // No table below TABLE_MIN of its own size, counting what fitWidth already took from a wide one.
    function tablesReadable() {
      return tables.every(function (t) {
        return parseFloat(window.getComputedStyle(t).fontSize) >= TABLE_MIN * parseFloat(t.dataset.courseTablePx) - 0.01;
      });
    }
    function shrink(floor) {
      while (overflow(section) > 0 && scale > floor + 1e-6) {
        var before = scale;
        scale = Math.round((scale - 0.05) * 100) / 100;
        section.style.fontSize = Math.round(scale * 100) + "%";
        if (!tablesReadable()) {  // one step too far for a table: take it back and stop
          scale = before;
          section.style.fontSize = Math.round(scale * 100) + "%";
          break;
        }
      }
    }
    shrink(tables.length ? TABLE_MIN : MILD);
    var moved = 0, units = movable(section);
    while (overflow(section) > 0 && units.length) {
      moveToNotes(section, units.pop());
      moved += 1;
    }
    shrink(tables.length ? TABLE_MIN : SMALLEST);
    if (charts) {
      chartsOf(section).forEach(function (img) { img.style.height = "0px"; });
      sizeCharts(section, HEIGHT - section.scrollHeight - 8);
    } else {
      growOutputs(section);
    }
    section.dataset.courseFit = scale < 1 ? "shrunk to " + Math.round(scale * 100) + "%" : "fits";
    if (moved) section.dataset.courseMoved = String(moved);
    if (overflow(section) > 0) section.dataset.courseOverflow = String(overflow(section));
    shown.forEach(function (el, i) { el.style.display = saved[i]; });
  }

  function decoded(img) {
    if (img.complete && img.naturalWidth) return Promise.resolve();
    return (img.decode ? img.decode() : new Promise(function (ok) { img.onload = img.onerror = ok; }))
      .catch(function () {});
  }

  window.Reveal.initialize({
    width: WIDTH, height: HEIGHT, margin: 0.04, minScale: 0.2, maxScale: 2.0,
    center: false, hash: true, controls: true, progress: true, slideNumber: "c/t",
    navigationMode: "linear",   // the arrow keys and the space bar walk through every slide in order
    transition: "fade", transitionSpeed: "fast",
    plugins: [window.RevealNotes]
  }).then(function () {
    var images = toArray(slides.querySelectorAll("img")).map(decoded);
    return Promise.all(images.concat([document.fonts ? document.fonts.ready : Promise.resolve()]));
  }).then(function () {
    leaves.forEach(fit);
    window.Reveal.layout();
    document.body.dataset.courseFitted = "1";
  });
})();
