"""What DeepSpeed keeps per rank, where, and why (notebook 03's DeepSpeed section; ``lab03_deepspeed`` runs it).

``PLACES`` names where DeepSpeed 0.19.8 keeps each kind of bytes and the part of the bill it belongs to
(params, grads, optim, as in the paper; comm for its reduce buckets, ZeRO-R's constant-size buffer $C_B$,
the timeline's category too); ``expected_held`` says how many bytes each should be, in Ψ and N, from
DeepSpeed's source; ``census`` counts them in a rank (every tensor reachable from the engine, a storage
once); ``census_table`` sets them beside the course's stage and the paper's bill. Plain arithmetic but
``census``, which walks a live engine.
"""

from __future__ import annotations

import torch

from ..models import build_model, get_config
from ..per_param import deepspeed_group_numel
from ..predict.held import bill_bytes
from ..strategies import GRADS, OPTIM, PARAMS, Strategy

#: DeepSpeed's reduce and all-gather buckets, in elements: 4 MiB of fp32 (its default 5e8 is 2 GB per rank).
BUCKET_ELEMENTS = 2**20

FP32 = 4

#: The reduce buckets' part: communication buffers, ZeRO-R's $C_B$, outside the paper's model-state bill; the
#: parts are the timeline's category names (``timeline.CATEGORIES``), so the census and the timeline agree.
COMM = "comm"
#: Where DeepSpeed 0.19.8 keeps each kind of bytes (the first name found in a tensor's path wins), its part
#: (the paper's bill, or ``COMM``), and how the notebook names the place. Source lines:
#: ``runtime/zero/stage_1_and_2.py`` (s12), ``runtime/zero/stage3.py`` (s3).
PLACES = (
    ("ipg_buckets", "reduce bucket", COMM, "`ipg_buckets` (s3:782)"),
    ("grad_partitions_flat_buffer", "gradient partition", GRADS, "`grad_partitions_flat_buffer` (s3:791)"),
    ("single_partition_of_fp32_groups", "fp32 master partition", OPTIM, "`single_partition_of_fp32_groups` (s12:560)"),
    ("fp32_partitioned_groups_flat", "fp32 master partition", OPTIM, "`fp32_partitioned_groups_flat` (s3:1172)"),
    (".state[", "Adam m, v, step", OPTIM, "the client Adam's `state`, over the partition"),
    ("ds_tensor", "parameters", PARAMS, "each parameter's `ds_tensor`, one flat buffer"),
    ("module.", "parameters", PARAMS, "the module's weights: views into `bit16_groups_flat` (s12:509)"),
)
SCALARS = "scalars (norm, overflow flag)"


def expected_scalars(row: Strategy) -> dict:
    """The scalars a rank of DeepSpeed's ``row`` stage keeps after ``engine.step``, ``{census path: bytes}``, read
    in DeepSpeed 0.19.8: the global gradient norm, which stages 1-2 sum in fp32 (s12:2689 ``.float()``) and stage
    3 in ``get_norm_dtype()``, fp64 where the accelerator has it (s3:2457, s3:2467; ``zero/utils.py:62``, the
    CPU's); stage 3 also keeps its overflow flag, one bool (``inf_or_nan_tracker``, s3:335)."""
    if not row.gathers_units:
        return {"optimizer._global_grad_norm": FP32}
    return {"optimizer._global_grad_norm": 8, "optimizer.inf_or_nan_tracker": 1}


def scalars(storages: list) -> dict:
    """``{path: bytes}`` of the census's ``storages`` that ``PLACES`` names no place for: ``SCALARS``."""
    return {st["path"]: st["bytes"] for st in storages if st["category"] == SCALARS}


def expected_held(row: Strategy, psi: int, nd: int) -> dict:
    """What a rank of DeepSpeed's ``row`` stage holds between steps in fp32, by ``PLACES``' categories.

    Read in DeepSpeed 0.19.8's source (``PLACES`` cites the lines): the working parameters whole (stages
    1-2) or 1/N (stage 3); an fp32 master copy of this rank's partition, 4Ψ/N, also when the model is
    fp32; Adam's m and v over that partition, 8Ψ/N, and its step counter (one fp32 scalar, one parameter
    group); stage 3 alone keeps its gradient partition, 4Ψ/N, and its reduce bucket, ``BUCKET_ELEMENTS``
    fp32 elements, between steps. Exact when N divides Ψ (the course model on 2 ranks).
    """
    stage3 = row.gathers_units
    return {
        "parameters": FP32 * psi // nd if PARAMS in row.shards_at_rest else FP32 * psi,
        "gradient partition": FP32 * psi // nd if stage3 else 0,
        "reduce bucket": FP32 * BUCKET_ELEMENTS if stage3 else 0,
        "fp32 master partition": FP32 * psi // nd,
        "Adam m, v, step": 2 * FP32 * psi // nd + FP32,
    }


def partition_gradient_bytes(model: str, nd: int, rank: int = 0) -> int:
    """Stages 1-2 in fp32: the gradient buffer ``copy_grads_in_partition`` allocates after the reduce
    (``stage_1_and_2.py:2187-2189``), every *whole* parameter that overlaps ``rank``'s partition of the flat
    buffer (padded to a multiple of 2N, ``per_param.deepspeed_group_numel``); in the model's parameter order
    (notebook 03)."""
    numels = [p.numel() for p in build_model(get_config(model)).parameters()]
    padded = deepspeed_group_numel(sum(numels), nd)
    lo, hi = rank * padded // nd, (rank + 1) * padded // nd
    starts = [sum(numels[:i]) for i in range(len(numels))]
    return FP32 * sum(n for s, n in zip(starts, numels) if s < hi and s + n > lo)


#: The timeline's category (``timeline.CATEGORIES``) of each of ``expected_held``'s parts: its part in ``PLACES``.
TIMELINE_CATEGORY = {cat: part for _, cat, part, _ in PLACES}


def expected_rest(row: Strategy, psi: int, nd: int) -> dict:
    """``expected_held`` in the timeline's categories: what the watched step must find at rest (notebook 03)."""
    out: dict = {}
    for part, nbytes in expected_held(row, psi, nd).items():
        out[TIMELINE_CATEGORY[part]] = out.get(TIMELINE_CATEGORY[part], 0) + nbytes
    return out


def _place(path: str) -> tuple:
    """The entry of ``PLACES`` for a tensor DeepSpeed keeps at ``path`` (the first whose name it contains)."""
    return next((place for place in PLACES if place[0] in path), ("", SCALARS, "other", ""))


def category(path: str) -> tuple[str, str]:
    """``(category, part of the paper's bill)`` of a tensor DeepSpeed keeps at ``path``."""
    return _place(path)[1:3]


#: Why DeepSpeed's bytes differ from the course's stage (counted at the same moment: after the last update,
#: before the course's loop clears its gradients) in each part of the bill; read in DeepSpeed 0.19.8.
WHY = {
    (PARAMS, False): "the same: every weight whole on every rank",
    (PARAMS, True): "the same: 1/N of every weight",
    (GRADS, False): "DeepSpeed drops them inside `engine.step` (engine.py:3529-3530, s12:2613-2623, s12:3131); "
    "the course's count comes before its loop clears them",
    (GRADS, True): "the same bytes: the course holds its 1/N until its loop clears it, DeepSpeed keeps its "
    "partition between steps (s3:791)",
    (OPTIM, False): "an fp32 master copy of the partition, even in fp32 training (s12:558-560 clones it): "
    "the paper's mixed-precision K = 12, not fp32's 8",
    (OPTIM, True): "an fp32 master copy, even in fp32: s3:1163 would share the partition, but compares a "
    "`torch.device` with the string `'cpu'` (s3:333), never equal in torch 2.13, so s3:1170-1172 clone it",
    (COMM, False): "the same, none: DeepSpeed's reduce bucket lives in the backward and is gone after `engine.step`",
    (COMM, True): "DeepSpeed keeps one reduce bucket of `reduce_bucket_size` elements between steps (s3:782), ZeRO-R's "
    "constant-size buffer $C_B$; the course's stage 3 keeps no communication buffer between steps",
}


#: The formula of each part, in the paper's symbols (``expected_held`` computes it).
FORMULA = {
    (PARAMS, False): "4Ψ",
    (PARAMS, True): "4Ψ/N",
    (GRADS, False): "0",
    (GRADS, True): "4Ψ/N",
    (OPTIM, False): "4Ψ/N + 8Ψ/N + 4",
    (OPTIM, True): "4Ψ/N + 8Ψ/N + 4",
    (COMM, False): "0",
    (COMM, True): "4·2²⁰",
}


def census_table(result: dict, row: Strategy, psi: int, nd: int) -> tuple[list, list]:
    """``(header, rows)`` of notebook 03's table for ``row``: per part of the paper's bill (and ``COMM``, which
    the bill leaves out: "not in it"), where DeepSpeed keeps it, its bytes on rank 0 and the formula
    (``expected_held``), the course's stage and the paper's fp32 bill at the same moment, and why they differ
    (``WHY``)."""
    r = result[row.name]
    measured, course = r["per_rank"][0]["deepspeed"], r["per_rank"][0]["course"]
    expected, paper = expected_held(row, psi, nd), bill_bytes(row, psi, nd, precision="fp32")
    stage3 = row.gathers_units
    rows = []
    for part in (PARAMS, GRADS, OPTIM, COMM):
        cats = list(dict.fromkeys(cat for _, cat, p, _ in PLACES if p == part))
        where = {_place(st["path"])[3] for st in r["storages"] if _place(st["path"])[2] == part}
        rows.append(
            [
                part,
                "; ".join(sorted(where)) or "nothing",
                " + ".join(f"{measured[c]:,}" for c in cats if measured[c]) or "0",
                f"{FORMULA[(part, stage3)]} = {sum(expected[c] for c in cats):,}",
                f"{course.get(part, 0):,}",  # the course's stages keep no buffer between steps
                f"{paper[part]:,.0f}" if part in paper else "not in it",
                WHY[(part, stage3)],
            ]
        )
    total, extra = sum(measured.values()), scalars(r["storages"])
    rows.append(
        [
            "total",
            "scalars: " + ", ".join(f"`{path}` {n} B" for path, n in extra.items()),
            f"{total:,}",
            f"{sum(expected.values()):,} + {sum(extra.values())} B of scalars",
            f"{course['total']:,}",
            f"{paper['total']:,.0f}",
            "",
        ]
    )
    header = [
        "part",
        "DeepSpeed keeps it in",
        "DeepSpeed, B per rank, after `engine.step`",
        "formula",
        "course's stage, before its `zero_grad`",
        "paper, fp32",
        "why they differ",
    ]
    return header, rows


def _storages(root, path: str, found: dict) -> None:
    """Every tensor reachable from ``root`` through lists, dicts and DeepSpeed's (or torch.optim's) objects,
    one entry per storage, the first path that reaches it kept: ``{storage key: (path, bytes)}``."""
    seen, queue = set(), [(root, path, 0)]
    while queue:
        obj, path, depth = queue.pop(0)
        if id(obj) in seen or depth > 5:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if storage.nbytes() and obj.device.type != "meta":
                found.setdefault(key, (path, storage.nbytes()))
            for attr in ("grad", "ds_tensor"):
                if getattr(obj, attr, None) is not None:
                    queue.append((getattr(obj, attr), f"{path}.{attr}", depth + 1))
        elif isinstance(obj, dict):
            queue += [
                (v, f"{path}[{k if isinstance(k, str) else type(k).__name__}]", depth + 1) for k, v in obj.items()
            ]
        elif isinstance(obj, (list, tuple)):
            queue += [(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
            skip = ("module", "client_model_parameters", "engine")  # the model is walked on its own
            queue += [(v, f"{path}.{k}", depth + 1) for k, v in vars(obj).items() if k not in skip]


def census(engine) -> dict:
    """What this rank's DeepSpeed engine holds: ``{"by_category": {category: bytes}, "storages": [...]}``
    with every storage's path (where DeepSpeed keeps it), bytes and category; a storage two names share
    counts once."""
    found: dict = {}
    for name, p in engine.module.named_parameters():
        _storages(p, f"module.{name}", found)
    _storages(engine.optimizer, "optimizer", found)
    rows = [{"path": path, "bytes": n, "category": category(path)[0]} for path, n in found.values()]
    by_category = {cat: 0 for _, cat, _, _ in PLACES} | {SCALARS: 0}
    for r in rows:
        by_category[r["category"]] += r["bytes"]
    return {"by_category": by_category, "storages": sorted(rows, key=lambda r: -r["bytes"])}
