"""Two editions from one source: the student's notebook and the teacher's speaker notes (issue 28).

A notebook in ``notebooks/`` is what a student opens (JupyterLab, Colab, a downloaded file): the story
told once, in the student's voice, each prediction answered only after the cell that measures it.
The teacher's notes live in the metadata of the cell they belong to, and reach the deck's speaker notes
(tools/build_course.py); a student reading the notebook never sees them::

    "metadata": {"course": {
        "notes": "The point, a question for the room, the number to remember.",
        "more": "Longer material: the deck shows it after the notes, under More.",
        "computed": true,                 # notes and more are f-string bodies: {hang_s:.1f} ...
        "when": "BIG_MODEL"               # (computed only, optional) notes only when this is true
    }}

A computed note is filled in by the build in the kernel that ran the notebook, right after its cell
(``teacher_notebook`` puts one small cell after it, which never reaches ``notebooks/``), so its numbers
are this run's and the note stays beside the cell that computes them. Notes belong to the slide of their
cell (a cell outside the deck gives them to the slide it sits in); at most ``NOTES_MAX_WORDS`` words of
notes a slide, the rest goes into ``more``. Markdown cells with no slide metadata are the notebook's own
prose: the deck gives them to the teacher under More too, so no sentence is written twice.

Commands (NN: a notebook's number or name; none means every notebook)::

    python tools/editions.py convert [NN ...]   today's notes cells into cell metadata (idempotent)
    python tools/editions.py expand NN ...      the reverse, to edit notes as cells in JupyterLab
    python tools/editions.py check [NN ...]     the student edition's findings: teacher sentences, spoiled predictions
    python tools/editions.py report [--executed DIR] [NN ...]   the counts per notebook (issue 28's measure)

``convert`` takes a notebook in the form the course used before (``slide_type: notes`` cells, and code
cells marked ``notes`` that ``display(Markdown(f"..."))``) and moves each into the metadata of the cell
before it; a ``<!-- more -->`` line in a notes cell starts its More part, and a slide whose notes run
past ``NOTES_MAX_WORDS`` gets its last paragraphs moved into More (it says which, to review).
Converting a converted notebook changes nothing; the stored form (``stored_form``, written by
``nb_canonical.py``) includes the conversion.
"""

from __future__ import annotations

import ast
import builtins
import copy
import io
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

#: Where a cell's teacher notes live: ``cell.metadata[KEY]``.
KEY = "course"
PARTS = ("notes", "more")
#: What a teacher can take in at a glance while speaking (issue 28): the rest goes into More.
NOTES_MAX_WORDS = 120
#: In a notes cell of the old form, the line that starts its More part.
MORE_MARKER = "<!-- more -->"
#: The tag of the cells ``teacher_notebook`` adds, and the MIME type of what they display.
INJECTED_TAG = "course-notes"
NOTES_MIME = "application/vnd.course.notes+json"


def _src(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def slide_type(cell) -> str | None:
    return (cell.get("metadata", {}).get("slideshow") or {}).get("slide_type")


def is_notes_cell(cell) -> bool:
    """A cell of the old form: teacher text in the student's notebook, marked ``slide_type: notes``."""
    return slide_type(cell) == "notes"


def is_injected(cell) -> bool:
    """A cell a build added (papermill's parameters or error banner, or a notes cell of ``teacher_notebook``)."""
    tags = set(cell.get("metadata", {}).get("tags", []))
    return bool({"injected-parameters", "papermill-error-cell-tag", INJECTED_TAG} & tags)


def notes_of(cell) -> dict:
    """The cell's teacher notes: ``{"notes", "more", "computed", "when"}``, only the keys it has."""
    meta = cell.get("metadata", {}).get(KEY) or {}
    return {k: meta[k] for k in (*PARTS, "computed", "when") if meta.get(k)}


def words(text: str) -> int:
    """Words a reader reads: a template's {field} counts as one, markup as none."""
    text = re.sub(r"\{[^{}]*(\{[^{}]*\}[^{}]*)*\}", " x ", text.replace("{{", "").replace("}}", ""))
    text = re.sub(r"\$[^$]*\$", " x ", text)  # a formula reads as one word
    return len(re.findall(r"[\w\d][\w\d'’.,/×%-]*", text))


# ---------------------------------------------------------------------------------------------
# Templates: a computed note is the body of a Python f-string
# ---------------------------------------------------------------------------------------------


def fstring_source(template: str) -> str:
    """``template`` as a raw f-string literal (backslashes are text, as in the notes: $\\Psi$)."""
    for quote in ('"""', "'''"):
        if quote not in template and not template.endswith((quote[0], "\\")):
            return f"rf{quote}{template}{quote}"
    raise ValueError("a computed note can hold neither both ''' and \"\"\" nor end with a quote or a backslash")


def compile_template(template: str, where: str = "<notes>"):
    """The code object that fills ``template`` in; SyntaxError with the note's place when it is not valid."""
    return compile(fstring_source(template), where, "eval")


def escape_braces(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


class _Free(ast.NodeVisitor):
    """Names an expression reads that it does not bind itself (comprehension and lambda variables)."""

    def __init__(self):
        self.free, self._bound = set(), [set()]

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and not any(node.id in b for b in self._bound):
            self.free.add(node.id)

    def _scope(self, node, bound, children):
        self._bound.append(set(bound))
        for child in children:
            self.visit(child)
        self._bound.pop()

    def visit_Lambda(self, node):
        a = node.args
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
        self._scope(node, names, [node.body])

    def _comprehension(self, node, results):
        bound = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        self._bound.append(bound)
        for g in node.generators:
            self.visit(g.iter)
            for cond in g.ifs:
                self.visit(cond)
        for r in results:
            self.visit(r)
        self._bound.pop()

    def visit_ListComp(self, node):
        self._comprehension(node, [node.elt])

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node):
        self._comprehension(node, [node.key, node.value])

    def visit_NamedExpr(self, node):
        self._bound[-1].add(node.target.id)
        self.visit(node.value)


def free_names(expression_source: str) -> set[str]:
    """Names ``expression_source`` (an expression, or an f-string literal) reads from its surroundings."""
    visitor = _Free()
    visitor.visit(ast.parse(expression_source, mode="eval"))
    return visitor.free - set(dir(builtins))


def _python(source: str) -> str:
    """A code cell's source as plain Python: IPython's %magics and !commands become blank lines."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def bound_names(source: str) -> set[str]:
    """Every name a code cell binds anywhere (assignments, imports, defs, loop and with targets)."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def template_problems(nb) -> list[str]:
    """What would stop a notebook's computed notes from being filled in: a template that is not an
    f-string, a name no code cell up to that one defines, notes marked computed on a markdown-only
    position that is not a cell at all, or ``when`` on notes that are not computed."""
    problems, defined = [], set()
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            defined |= bound_names(_src(cell))
        meta = notes_of(cell)
        where = f"cell {cell.get('id', index)}"
        if meta.get("when") and not meta.get("computed"):
            problems.append(f"{where}: `when` needs `computed: true` (it is evaluated in the kernel)")
        if not meta.get("computed"):
            continue
        for part in (*PARTS, "when"):
            if not meta.get(part):
                continue
            try:
                code = meta[part] if part == "when" else fstring_source(meta[part])
                missing = free_names(code) - defined
            except (SyntaxError, ValueError) as err:
                problems.append(f"{where}: its computed {part} is not a valid f-string body ({err})")
                continue
            if missing:
                problems.append(
                    f"{where}: its computed {part} reads {', '.join(sorted(missing))}, which no code cell up to "
                    "it defines (a computed note is filled in right after its cell runs)"
                )
    return problems


# ---------------------------------------------------------------------------------------------
# convert: today's notes cells into cell metadata (and expand, the way back)
# ---------------------------------------------------------------------------------------------


class NotConvertible(ValueError):
    """A code notes cell whose shape ``convert`` does not know (it stays, and the checks report it)."""


def _joined_template(node) -> str:
    """An f-string (or plain string) AST node as a template: text with {fields}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return escape_braces(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _joined_template(node.left) + _joined_template(node.right)
    if isinstance(node, ast.IfExp):
        raise NotConvertible(
            "a piece of the notes depends on a condition: write it as one field, {x if c else ''}, by hand"
        )
    if not isinstance(node, ast.JoinedStr):
        raise NotConvertible(f"the notes are not a string or an f-string ({ast.unparse(node)[:60]})")
    out = []
    for value in node.values:
        if isinstance(value, ast.Constant):
            out.append(escape_braces(value.value))
            continue
        expr = ast.unparse(value.value)
        if "\\" in expr:
            raise NotConvertible(f"a field holds a backslash ({expr[:60]}), which an f-string field cannot in 3.11")
        field = "{" + (" " if expr.startswith("{") else "") + expr
        if value.conversion != -1:
            field += "!" + chr(value.conversion)
        if value.format_spec is not None:
            field += ":" + _joined_template(value.format_spec).replace("{{", "{").replace("}}", "}")
        out.append(field + "}")
    return "".join(out)


class _Inline(ast.NodeTransformer):
    """Replace free names by the expressions a notes cell assigned to them."""

    def __init__(self, values: dict):
        self.values, self._bound = values, [set()]

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.values and not any(node.id in b for b in self._bound):
            return copy.deepcopy(self.values[node.id])
        return node

    def _bind(self, node, names):
        self._bound.append(set(names))
        self.generic_visit(node)
        self._bound.pop()
        return node

    def visit_Lambda(self, node):
        a = node.args
        return self._bind(node, [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs])

    def _comp(self, node):
        return self._bind(node, [n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)])

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comp


def _is_display_markdown(stmt) -> ast.expr | None:
    """The argument of ``display(Markdown(arg))``, or None."""
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None
    call = stmt.value
    if not (isinstance(call.func, ast.Name) and call.func.id == "display" and len(call.args) == 1):
        return None
    inner = call.args[0]
    if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "Markdown":
        return inner.args[0] if len(inner.args) == 1 else None
    return None


def code_notes_template(source: str) -> tuple[str, str | None]:
    """(template, when) of a code notes cell of the old form.

    Known shapes: ``display(Markdown(<f-string>))``, after ``from IPython.display import ...`` lines and
    simple assignments (``x = ...``, ``a, b = p, q``), whose expressions are put in place of the names;
    all of it may sit in one ``if COND:`` without ``else`` (then ``when`` is COND). Raises NotConvertible.
    """
    try:
        body = ast.parse(source).body
    except SyntaxError as err:
        raise NotConvertible(f"not valid Python ({err})") from None
    when = None
    body = [s for s in body if not (isinstance(s, ast.ImportFrom) and s.module == "IPython.display")]
    if len(body) == 1 and isinstance(body[0], ast.If) and not body[0].orelse:
        when, body = ast.unparse(body[0].test), body[0].body
    values, texts = {}, []
    for stmt in body:
        arg = _is_display_markdown(stmt)
        if arg is not None:
            texts.append(_joined_template(_Inline(values).visit(copy.deepcopy(arg))))
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], _Inline(values).visit(copy.deepcopy(stmt.value))
            if isinstance(target, ast.Name):
                values[target.id] = value
                continue
            if (
                isinstance(target, ast.Tuple)
                and all(isinstance(t, ast.Name) for t in target.elts)
                and isinstance(value, ast.Tuple)
                and len(value.elts) == len(target.elts)
            ):
                values.update({t.id: v for t, v in zip(target.elts, value.elts)})
                continue
        raise NotConvertible(f"a statement convert does not know: {ast.unparse(stmt).splitlines()[0][:70]}")
    if not texts:
        raise NotConvertible("no display(Markdown(...)) in the cell")
    return "\n\n".join(t.strip() for t in texts), when


def split_more(text: str) -> tuple[str, str]:
    """A notes text of the old form, cut at its ``<!-- more -->`` line into (notes, more)."""
    parts = re.split(r"^\s*" + re.escape(MORE_MARKER) + r"\s*$", text, maxsplit=1, flags=re.M)
    return parts[0].strip(), (parts[1].strip() if len(parts) > 1 else "")


def _add(owner, notes: str, more: str, computed: bool, when: str | None) -> None:
    """Append notes to ``owner``'s metadata, keeping one template language for the cell."""
    meta = owner.setdefault("metadata", {}).setdefault(KEY, {})
    had = any(meta.get(p) for p in PARTS)
    if when and (had or meta.get("when")) and meta.get("when") != when:
        raise NotConvertible(f"conditional notes (when {when}) beside other notes of cell {owner.get('id')}")
    if computed and not meta.get("computed"):
        for p in PARTS:
            if meta.get(p):
                meta[p] = escape_braces(meta[p])
        meta["computed"] = True
    elif meta.get("computed") and not computed:
        notes, more = escape_braces(notes), escape_braces(more)
    if when:
        meta["when"] = when
    for part, text in (("notes", notes), ("more", more)):
        if text:
            meta[part] = (meta[part] + "\n\n" + text) if meta.get(part) else text
    _in_order(owner)


def _in_order(cell) -> None:
    """One key order for a cell's notes (so that a diff shows only what changed); none left empty."""
    meta = cell.get("metadata", {}).get(KEY)
    if meta is None:
        return
    order = (*PARTS, "computed", "when")
    meta = {k: meta[k] for k in order if meta.get(k)} | {k: v for k, v in meta.items() if k not in order}
    if meta:
        cell["metadata"][KEY] = meta
    else:
        cell["metadata"].pop(KEY)


def slides(cells: list) -> list[list]:
    """The cells grouped by the slide they belong to: a slide or subslide cell starts one; every other
    cell, in the deck or not, belongs to the slide before it (cells before the first, to the first)."""
    out = []
    for cell in cells:
        if is_injected(cell):
            continue
        if not out or (slide_type(cell) in ("slide", "subslide") and cell["cell_type"] != "raw"):
            if out and not any(slide_type(c) in ("slide", "subslide") for c in out[-1]):
                out[-1].append(cell)  # the cells before the first slide belong to it
                continue
            out.append([])
        out[-1].append(cell)
    return out


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


def fit_notes(nb, max_words: int = NOTES_MAX_WORDS) -> list[str]:
    """Move the last paragraphs of a slide's notes into More until the slide's notes fit ``max_words``
    (the first paragraph of the slide stays). Returns what moved, one line per slide."""
    said = []
    for number, cells in enumerate(slides(nb["cells"]), 1):
        owners = [c for c in cells if notes_of(c).get("notes")]
        total = sum(words(notes_of(c)["notes"]) for c in owners)
        moved = 0
        while total > max_words:
            paragraphs = [(c, p) for c in owners for p in _paragraphs(notes_of(c).get("notes", ""))]
            if len(paragraphs) <= 1:
                break
            cell, last = paragraphs[-1]
            meta = cell["metadata"][KEY]
            kept = _paragraphs(meta["notes"])[:-1]
            if kept:
                meta["notes"] = "\n\n".join(kept)
            else:
                meta.pop("notes")
                owners.remove(cell)
            meta["more"] = last + ("\n\n" + meta["more"] if meta.get("more") else "")
            total -= words(last)
            moved += 1
        if moved:
            said.append(f"slide {number}: {moved} paragraph(s) of notes moved into More (review them)")
    return said


def convert(nb) -> list[str]:
    """Move every notes cell of ``nb`` (a dict, changed in place) into the metadata of the cell before it.

    Returns one line per thing done or left (a code notes cell of a shape it does not know stays).
    Idempotent: a converted notebook has no notes cells, and its slides' notes already fit.
    """
    out, said = [], []
    for cell in nb["cells"]:
        if not is_notes_cell(cell):
            out.append(cell)
            continue
        owner = next((c for c in reversed(out) if not is_notes_cell(c)), None)
        try:
            if cell["cell_type"] == "markdown":
                notes, more = split_more(_src(cell))
                computed, when = False, None
            else:
                template, when = code_notes_template(_src(cell))
                notes, more = split_more(template)
                computed = True
            if owner is None:
                raise NotConvertible("no cell before it to carry its notes")
            _add(owner, notes, more, computed, when)
            said.append(f"cell {cell.get('id')}: into the notes of cell {owner.get('id')}")
        except NotConvertible as err:
            out.append(cell)
            said.append(f"cell {cell.get('id')}: LEFT AS IT IS: {err}")
    nb["cells"] = out
    said += fit_notes(nb)
    for cell in out:
        _in_order(cell)
    return said


def expand(nb) -> int:
    """The reverse of ``convert`` (for editing notes as cells): each cell's notes become a notes cell after
    it. ``convert`` puts them back exactly. Returns how many cells were added."""
    out, added = [], 0
    for cell in nb["cells"]:
        out.append(cell)
        meta = notes_of(cell)
        if not any(meta.get(p) for p in PARTS):
            continue
        text = meta.get("notes", "") + (f"\n\n{MORE_MARKER}\n\n{meta['more']}" if meta.get("more") else "")
        if meta.get("computed"):
            line = f"display(Markdown({fstring_source(text)}))"
            if meta.get("when"):
                line = f"if {meta['when']}:\n    " + line
            new = {"cell_type": "code", "execution_count": None, "outputs": [], "source": line}
        else:
            new = {"cell_type": "markdown", "source": text}
        new["metadata"] = {"slideshow": {"slide_type": "notes"}}
        new["id"] = f"{cell.get('id', 'cell')}-notes"
        cell["metadata"].pop(KEY)
        out.append(new)
        added += 1
    nb["cells"] = out
    return added


# ---------------------------------------------------------------------------------------------
# The teacher's edition: the notebook the build executes, and the notes it yields
# ---------------------------------------------------------------------------------------------


def _notes_filler(cell_id: str, meta: dict) -> str:
    """The source of the cell that fills in ``meta``'s templates right after cell ``cell_id`` runs."""
    display = '__import__("IPython.display", fromlist=["display"]).display'
    parts = "".join(f", {part!r}: {fstring_source(meta[part])}" for part in PARTS if meta.get(part))
    show = f"{display}({{{NOTES_MIME!r}: {{'cell': {cell_id!r}{parts}}}}}, raw=True)"
    if meta.get("when"):  # the notes exist only when `when` holds; an empty filling says it did not
        empty = f"{display}({{{NOTES_MIME!r}: {{'cell': {cell_id!r}}}}}, raw=True)"
        show = f"if {meta['when']}:\n    {show}\nelse:\n    {empty}"
    return f"# tools/build_course.py: the speaker notes of cell {cell_id}, filled in from this run\n{show}"


def teacher_notebook(nb):
    """A copy of ``nb`` for the build to execute: after every cell with computed notes, a cell that fills
    them in (tagged ``course-notes``; ``filled_notes`` reads them back, fingerprints ignore them)."""
    import nbformat

    nb = copy.deepcopy(nb)
    cells = []
    for cell in nb["cells"]:
        cells.append(cell)
        meta = notes_of(cell)
        if meta.get("computed") and any(meta.get(p) for p in PARTS):
            filler = nbformat.v4.new_code_cell(_notes_filler(cell["id"], meta), id=f"{cell['id']}-filled")
            filler.metadata["tags"] = [INJECTED_TAG]
            cells.append(filler)
    nb["cells"] = cells
    return nb


def filled_notes(nb) -> dict:
    """``{cell id: {"notes", "more"}}`` from an executed teacher notebook's filler cells."""
    filled = {}
    for cell in nb["cells"]:
        if INJECTED_TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {}).get(NOTES_MIME)
            if data:
                filled[data["cell"]] = {p: data.get(p, "") for p in PARTS}
    return filled


def cell_notes(cell, filled: dict | None) -> dict:
    """``{"notes", "more"}`` of one cell as the deck shows them: static text, or the run's filled-in
    text (``filled`` from ``filled_notes``). Computed notes with no filled text raise KeyError."""
    meta = notes_of(cell)
    if not meta.get("computed"):
        return {p: meta.get(p, "") for p in PARTS}
    if filled is None or cell.get("id") not in filled:
        raise KeyError(cell.get("id"))
    return filled[cell["id"]]


# ---------------------------------------------------------------------------------------------
# The student's edition: teacher sentences and spoiled predictions
# ---------------------------------------------------------------------------------------------

#: Sentences addressed to a teacher. A lexicon is only half of the check: every notes cell and every
#: code cell that displays notes counts as teacher text whatever it says (``teacher_text``).
TEACHER_PHRASES = [
    r"\*\*\s*(point|ask|remember)\s*:?\s*\*\*",
    r"(^|\n)\s*(the point|point|ask|remember)\s*:",
    r"(?<!you )(?<!we )(?<!they )\bask\b\s*(:|the (room|class|audience|students)\b|(for|who|them|which|what|how|why|whether)\b)",
    r"\b(the|to the|of the|for the) (room|audience)\b",
    r"\b(ask|tell|show|poll) the class\b",
    r"\bthe class\b.{0,20}\b(predict|guess|answer|vote)",
    r"\bshow of hands\b",
    r"\b(out loud|aloud)\b",
    r"\b(before|after) (the click|showing|you show|the next slide)\b",
    r"\b(next|previous|this|last) slide\b",
    r"\bon the slide\b",
    r"\bpoint at\b",
    r"\b(take|collect) (a few )?(guesses|predictions|answers)\b",
    r"\bwrite (the|their) guesses\b",
    r"\bstudents?\b",
    r"\bopen by\b",
    r"\bnumbers? to (remember|leave with)\b",
    r"\bspeaker notes?\b",
]
_TEACHER = re.compile("|".join(f"(?:{p})" for p in TEACHER_PHRASES), re.I)


def _sentences(text: str) -> list[str]:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    return [s.strip() for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z*(`])|\n\s*\n|\n\s*[-*] ", text) if s.strip()]


def _code_text(source: str) -> str:
    """The comments and string literals of a code cell: the words in it a student reads."""
    parts = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(_python(source)).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string.lstrip("# "))
            elif tok.type == tokenize.STRING:
                parts.append(re.sub(r"^[rbfuRBFU]*('''|\"\"\"|'|\")|('''|\"\"\"|'|\")$", "", tok.string))
    except (tokenize.TokenError, IndentationError):
        return source
    return "\n\n".join(parts)


def output_text(cell) -> str:
    """What a code cell's outputs say in text (stdout, plain text, markdown, html without tags)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(_src({"source": out.get("text", "")}))
        elif out.get("output_type") in ("display_data", "execute_result"):
            data = out.get("data", {})
            for mime in ("text/markdown", "text/plain", "text/html"):
                if mime in data:
                    text = _src({"source": data[mime]})
                    parts.append(re.sub(r"<[^>]+>", " ", text) if mime == "text/html" else text)
                    break
    return "\n".join(parts)


def teacher_text(nb) -> list[dict]:
    """Everything in the student's notebook that speaks to the teacher: ``{"cell", "kind", "text", "words"}``.

    kind: ``notes cell`` (a whole cell marked notes: its words, or for a code cell its displayed text when
    executed, else its literal text), ``sentence`` (a sentence of a markdown cell, a code cell's comments or
    strings, or, executed, its outputs, that matches ``TEACHER_PHRASES``).
    """
    found = []
    for cell in nb["cells"]:
        if is_injected(cell):
            continue
        cid = cell.get("id", "?")
        if is_notes_cell(cell):
            if cell["cell_type"] == "markdown":
                text = _src(cell)
            else:
                text = output_text(cell) or re.sub(r"\{[^{}]*\}", "x", _code_text(_src(cell)))
            found.append({"cell": cid, "kind": "notes cell", "text": text, "words": words(text)})
            continue
        texts = [_src(cell)] if cell["cell_type"] == "markdown" else [_code_text(_src(cell)), output_text(cell)]
        for text in texts:
            for sentence in _sentences(text):
                if _TEACHER.search(sentence):
                    found.append({"cell": cid, "kind": "sentence", "text": sentence, "words": words(sentence)})
    return found


_PREDICT = re.compile(r"(\*{1,2}|_|#+ .*?)\s*Predict\b|\bPredict (first|before|then)\b")
_NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")


def numbers(text: str) -> set[str]:
    """The numbers in ``text`` as written without thousands separators (1,600, 1{,}600 -> 1600)."""
    text = text.replace("{,}", ",")
    return {m.group().replace(",", "") for m in _NUMBER.finditer(text)}


def predictions(nb) -> list[dict]:
    """The prediction prompts of ``nb``: ``{"cell", "index", "prompt", "between", "answer"}``.

    ``prompt``: the cell's text from its "Predict" on; ``between``: the cells after it up to the first code
    cell (what a student reads before running anything); ``answer``: that code cell and the code cells
    right after it (the cells whose outputs answer the prompt).
    """
    cells = [c for c in nb["cells"] if not is_injected(c)]
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown" or is_notes_cell(cell):
            continue
        m = _PREDICT.search(_src(cell))
        if not m:
            continue
        j = i + 1
        while j < len(cells) and cells[j]["cell_type"] != "code":
            j += 1
        k = j
        while k < len(cells) and (cells[k]["cell_type"] == "code" or is_notes_cell(cells[k])):
            k += 1
        found.append(
            {
                "cell": cell.get("id"),
                "index": i,
                "prompt": _src(cell)[m.start() :],
                "between": cells[i + 1 : j],
                "answer": cells[j:k],
            }
        )
    return found


def spoiled_predictions(nb) -> list[dict]:
    """Prediction prompts a student could read the answer of before running its cell.

    Three checks, each one a way a prompt has been spoiled in this course:

    * between the prompt and the code cell that answers it there is nothing but a heading that is itself
      a question (no notes, no prose, no heading that states the result);
    * the prompt answers its own question: a parenthesis right after a question mark (``? (10.)``), other
      than a hint (``(Hint: ...)``);
    * when ``nb`` is executed: the prompt, or a heading between, holds a number that the answering cells
      compute (a number in their outputs that no code cell up to them and no text before the prompt
      holds; single digits are left out, as they are ranks and counts as often as results).
    """
    cells = [c for c in nb["cells"] if not is_injected(c)]
    spoiled = []
    for p in predictions(nb):
        reasons = []
        for cell in p["between"]:
            text = _src(cell).strip()
            heading_only = (
                cell["cell_type"] == "markdown" and re.fullmatch(r"#+ [^\n]+", text) and not is_notes_cell(cell)
            )
            if not heading_only:
                kind = "teacher notes" if is_notes_cell(cell) else "prose"
                reasons.append(f"{kind} between the prompt and its cell (cell {cell.get('id')}): {text[:80]!r}")
            elif not text.rstrip("*_ ").endswith("?"):
                reasons.append(f"a heading between the prompt and its cell states a result: {text[:80]!r}")
        for m in re.finditer(r"\?\s*\((?!\s*(a )?hint\b)([^)]*)\)", p["prompt"], re.I):
            reasons.append(f"the prompt answers itself: ({m.group(2)[:60]})")
        outputs = "\n".join(output_text(c) for c in p["answer"] if c["cell_type"] == "code")
        if outputs:
            last = cells.index(p["answer"][-1]) if p["answer"] else p["index"]
            given = set()
            for c in cells[: last + 1]:
                if c["cell_type"] == "code":
                    given |= numbers(_src(c))
            for c in cells[: p["index"]]:
                if c["cell_type"] == "markdown" and not is_notes_cell(c):
                    given |= numbers(_src(c))
            given |= numbers(_src(cells[p["index"]])[: -len(p["prompt"])] if p["prompt"] else "")
            computed = {n for n in numbers(outputs) - given if not re.fullmatch(r"\d", n)}
            text = p["prompt"] + "\n" + "\n".join(_src(c) for c in p["between"] if c["cell_type"] == "markdown")
            shown = sorted(numbers(text) & computed, key=float)
            if shown:
                reasons.append(f"the prompt shows what its cells compute: {', '.join(shown)}")
        if reasons:
            spoiled.append({"cell": p["cell"], "prompt": p["prompt"][:120], "reasons": reasons})
    return spoiled


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def select(names) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not names:
        return paths
    chosen = [p for p in paths if any(p.stem == n or p.stem.split("_")[0] == n or str(p) == n for n in names)]
    missing = [n for n in names if not any(p.stem == n or p.stem.split("_")[0] == n or str(p) == n for p in paths)]
    if missing:
        raise SystemExit(f"no notebook named {', '.join(missing)} (have: {', '.join(p.stem for p in paths)})")
    return chosen


def stored_form(nb: dict, said: list | None = None) -> dict:
    """The stored form of a notebook (stripped; sources as one string; every cell with an id; notes in
    metadata: ``convert``). What the notes conversion did is appended to ``said``."""
    import uuid

    prefix = None
    for cell in nb["cells"]:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
        prefix = prefix or (cell.get("id") or "").split("-")[0]
        if not cell.get("id"):
            cell["id"] = f"{prefix or 'cell'}-{uuid.uuid4().hex[:6]}"
    converted = convert(nb)
    if said is not None:
        said += converted
    return nb


def dumps(nb: dict) -> str:
    """The stored text of a notebook already in its stored form."""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def write_notebook(path: Path, nb: dict) -> bool:
    """Write ``nb`` to ``path`` in the stored form; True if that changed the file."""
    new = dumps(stored_form(nb))
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if new != old:
        path.write_text(new, encoding="utf-8")
    return new != old


def _write(path: Path, nb, stored: bool = True) -> None:
    """Write ``nb`` in the repository's stored form (``expand`` writes its cells as they are)."""
    if stored:
        write_notebook(path, nb)
    else:
        path.write_text(dumps(nb), encoding="utf-8")


def report(nb, executed=None) -> dict:
    """The counts of issue 28's measure for one notebook (``executed``: its executed copy, if any)."""
    source = executed if executed is not None else nb
    teacher = teacher_text(source)
    meta_words = sum(words(notes_of(c).get(p, "")) for c in nb["cells"] for p in PARTS)
    return {
        "teacher_words": sum(t["words"] for t in teacher),
        "teacher_items": len(teacher),
        "notes_cells": sum(1 for c in nb["cells"] if is_notes_cell(c)),
        "predictions": len(predictions(source)),
        "spoiled": len(spoiled_predictions(source)),
        "notes_in_metadata_words": meta_words,
    }


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("convert", "expand", "check", "report"):
        print(__doc__.split("Commands")[1].split("``convert``")[0].strip(), file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    executed_dir = None
    if "--executed" in args:
        at = args.index("--executed")
        executed_dir, args = Path(args[at + 1]), args[:at] + args[at + 2 :]
    if command == "expand" and not args:
        print("expand which notebook? (python tools/editions.py expand 03)", file=sys.stderr)
        return 2
    status = 0
    rows = []
    for path in select(args):
        nb = json.loads(path.read_text(encoding="utf-8"))
        if command == "convert":
            said = convert(nb)
            _write(path, nb)
            print(f"{path.name}: " + ("; ".join(said) if said else "nothing to convert"))
            status |= any("LEFT" in s for s in said)
        elif command == "expand":
            print(f"{path.name}: {expand(nb)} notes cells (run `convert` or nb_canonical.py when done)")
            _write(path, nb, stored=False)
        elif command == "check":
            problems = [
                f"teacher text in cell {t['cell']} ({t['kind']}): {t['text'][:100]!r}" for t in teacher_text(nb)
            ]
            problems += [f"prediction in cell {s['cell']}: {'; '.join(s['reasons'])}" for s in spoiled_predictions(nb)]
            problems += template_problems(nb)
            for line in problems:
                print(f"{path.stem}: {line}")
            status |= bool(problems)
        else:
            executed = None
            if executed_dir is not None and (executed_dir / path.name).exists():
                executed = json.loads((executed_dir / path.name).read_text(encoding="utf-8"))
            rows.append((path.stem, report(nb, executed), executed is not None))
    if command == "report":
        print(
            f"{'notebook':<26} {'teacher words':>13} {'items':>5} {'notes cells':>11} {'predictions':>11} {'spoiled':>7}  outputs"
        )
        for stem, r, ran in rows:
            print(
                f"{stem:<26} {r['teacher_words']:>13} {r['teacher_items']:>5} {r['notes_cells']:>11} "
                f"{r['predictions']:>11} {r['spoiled']:>7}  {'executed' if ran else 'source only'}"
            )
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
