"""Students' notebooks for the grading tests and benchmark: the course's own notebook with the stubs filled in.

``STUDENT`` holds correct answers written the way a student would (not the reference solutions' text: a copy of
the reference is graded "reference used"); ``notebook(nb, answers, extra)`` is the course's notebook ``nb`` with
those answers in its stub cells and ``extra`` cells (an attack, a stray print) added at its end.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from course_utils.exercises import core

ROOT = Path(__file__).resolve().parent.parent

STUDENT = {
    "zero_state_bytes": """def zero_state_bytes(optimizer):
    total, counted = 0, set()
    for per_param in optimizer.optim.state.values():
        for value in per_param.values():
            if torch.is_tensor(value) and value.ndim > 0:
                key = value.untyped_storage().data_ptr()
                if key not in counted:
                    counted.add(key)
                    total += value.untyped_storage().nbytes()
    return total
""",
    "smallest_nd": """def smallest_nd(psi, stage, gpu_mem, reserve, k=12):
    kept = {"ddp": 4 + k, "zero1": 4, "zero2": 2, "zero3": 0}[stage] * psi  # on every GPU, whatever Nd
    shared = (4 + k) * psi - kept
    room = gpu_mem - reserve - kept
    if room < 0 or (shared and room == 0):
        return None
    nd = 1
    while kept + shared / nd + reserve > gpu_mem:
        nd *= 2  # overshoot, then come back one at a time
    while nd > 1 and kept + shared / (nd - 1) + reserve <= gpu_mem:
        nd -= 1
    return nd
""",
    "block_activation_bytes": """def block_activation_bytes(block, x):
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()}
    sizes = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            sizes[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block(x)
    total = 0
    for n in sizes.values():
        total += n
    return total
""",
    "averaging_hook": """def averaging_hook(grad):
    mean = grad.detach().clone() / dist.get_world_size()
    dist.all_reduce(mean)
    return mean
""",
    "overlapped_buckets": """def overlapped_buckets(buckets):
    flat = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    where = {}
    for i, b in enumerate(buckets):
        start = 0
        for p in b:
            where[p] = (i, start, start + p.numel())
            start += p.numel()
    missing = [len(b) for b in buckets]
    handles = []

    def on_grad(p):
        i, a, z = where[p]
        flat[i][a:z] = p.grad.flatten()
        missing[i] -= 1
        while len(handles) < len(buckets) and missing[len(handles)] == 0:
            handles.append(dist.all_reduce(flat[len(handles)], async_op=True))

    for p in where:
        p.register_post_accumulate_grad_hook(on_grad)

    def finish():
        n = dist.get_world_size()
        for i, h in enumerate(handles):
            h.wait()
            for p in buckets[i]:
                _, a, z = where[p]
                p.grad.copy_((flat[i][a:z] / n).view_as(p))
        missing[:] = [len(b) for b in buckets]
        handles.clear()

    return finish
""",
    "sharded_step": """def sharded_step(params, grads, lr):
    n, r = dist.get_world_size(), dist.get_rank()
    size = params.numel() // n
    mine = torch.zeros(size, dtype=grads.dtype)
    dist.reduce_scatter_single(mine, grads)
    params[r * size : (r + 1) * size].sub_(lr * mine / n)
    dist.all_gather_single(params, params[r * size : (r + 1) * size].clone())
""",
    "zero2_hooks": """def zero2_hooks(flats):
    for flat in flats:
        seen = {"n": 0}

        def hook(p, flat=flat, seen=seen):
            seen["n"] += 1
            if seen["n"] < len(flat.params):
                return
            seen["n"] = 0
            grads = torch.zeros(flat.padded)
            grads[: flat.numel] = torch.cat([q.grad.flatten() for q in flat.params])
            mine = torch.zeros(flat.shard_numel)
            dist.reduce_scatter_single(mine, grads)
            flat.grad_shard = mine / dist.get_world_size()
            for q in flat.params:
                q.grad = None

        for p in flat.params:
            p.register_post_accumulate_grad_hook(hook)
""",
    "zero3_gather_free": """def zero3_gather_free(module, flat):
    def before(m, args):
        flat.full.untyped_storage().resize_(flat.padded * 4)
        dist.all_gather_single(flat.full, flat.shard)

    def after(m, args, out):
        flat.full.untyped_storage().resize_(0)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
""",
    "sharded_optimizer": """def sharded_optimizer(params, optimizer_class, **defaults):
    n, r = dist.get_world_size(), dist.get_rank()
    size = params.numel() // n
    piece = params[r * size : (r + 1) * size].detach().clone().requires_grad_(True)
    inner = optimizer_class([piece], **defaults)

    def step(grads):
        g = torch.zeros_like(piece)
        dist.reduce_scatter_single(g, grads)
        piece.grad = g / n
        inner.step()
        dist.all_gather_single(params, piece.detach())

    return step
""",
}


def course_notebook(nb: str) -> dict:
    return json.loads(next((ROOT / "notebooks").glob(f"{nb}_*.ipynb")).read_text())


def code_cell(source: str, cid: str | None = None) -> dict:
    return {
        "cell_type": "code",
        "id": cid or uuid.uuid4().hex[:8],
        "metadata": {},
        "execution_count": None,
        "outputs": [],
        "source": source,
    }


def notebook(nb: str, answers: dict | None = None, extra: list[str] = (), keep=None, section_only=False) -> dict:
    """The course's notebook ``nb``, its stubs replaced by ``answers`` (name -> source), ``extra`` code cells
    added at its end, (``keep``: names) every other exercise's cells deleted, and (``section_only``) its
    lecture left out: only the exercises section (the grader runs only that and the lecture's imports)."""
    data = course_notebook(nb)
    if section_only:
        data["cells"] = [c for c in data["cells"] if c["id"].startswith(f"{nb}-ex-")]
    answers = answers or {}
    exs = core.exercises(nb)
    cells = []
    for c in data["cells"]:
        src = c["source"] if isinstance(c["source"], str) else "".join(c["source"])
        owner = next((ex for ex in exs if ex.name in src and c["id"].startswith(f"{nb}-ex-")), None)
        if keep is not None and owner is not None and owner.name not in keep and c["cell_type"] == "code":
            continue
        if c["cell_type"] == "code" and owner is not None and src.strip() == owner.stub.strip():
            c = dict(c, source=answers.get(owner.name, src))
        cells.append(c)
    return dict(data, cells=cells + [code_cell(src) for src in extra])


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=1))
    return path
