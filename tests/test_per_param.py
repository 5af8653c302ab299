"""FSDP2-style per-parameter sharding built by hand (course_utils.per_param, notebook 04).

Against one process (SGD, Adam, AdamW; tied and frozen weights; fp32 and bf16; FULL_SHARD and
SHARD_GRAD_OP) on 2 and 4 ranks, against fully_shard's own shards, and bytes held, sent and
gathered against the formulas. One launch per world size.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_utils import dist as cdist
from course_utils import per_param
from course_utils.data import batch_for_rank
from course_utils.instrument import CountCollectives, Observer, weight_diff
from course_utils.labs.lab04 import TOLERANCE
from course_utils.launch import launch
from course_utils.loop import Prepared, TrainConfig, run_steps
from course_utils.models import build_model, get_config, param_count
from course_utils.per_param import PerParamSharded, assign_units, chunk_rows, shard_rows
from course_utils.predict import peak_gathered_bytes
from course_utils.strategies import FULL_SHARD, SHARD_GRAD_OP

CASES = [
    dict(case, steps=2)
    for case in (
        {"optimizer": "SGD"},
        {"optimizer": "Adam"},
        {"optimizer": "AdamW", "reshard_after_forward": False},
        {"optimizer": "AdamW", "compute_dtype": "bfloat16"},
        {"optimizer": "Adam", "frozen": ["pos_emb.weight", "blocks.0.ln1.weight", "blocks.1.attn.qkv.weight"]},
    )
]


def test_rows_are_torch_chunks_padded():
    full = torch.arange(10 * 3).reshape(10, 3)
    for nd in (1, 2, 3, 4, 7, 12):
        chunks = list(torch.chunk(full, nd))  # what FSDP2 shards with (_chunk_with_empty)
        for rank in range(nd):
            start, stop = per_param.shard_rows(10, nd, rank)
            want = chunks[rank] if rank < len(chunks) else full[:0]
            assert torch.equal(full[start:stop], want)
            shard = per_param.padded_shard(full, rank, nd)
            assert shard.shape[0] == chunks[0].shape[0] and torch.equal(shard[: stop - start], want)
            assert not shard[stop - start :].any()
        gathered = torch.cat([per_param.padded_shard(full, r, nd) for r in range(nd)])
        assert torch.equal(per_param.unshard_rows(gathered, 10), full)


def test_shard_bytes_formula_counts_padding_and_ties_once():
    model = build_model("tiny")
    assert expected_shard_bytes(model, 1) == 4 * param_count(model)
    for nd in (2, 3, 4):
        padded = sum(math.ceil(p.shape[0] / nd) * nd * math.prod(p.shape[1:]) for p in model.parameters())
        assert expected_shard_bytes(model, nd) * nd == 4 * padded >= 4 * param_count(model)


@pytest.mark.parametrize("nproc", [2, 4])
def test_per_param_sharding_trains_like_one_process(nproc):
    run = launch(compare_worker, nproc=nproc, args=(CASES,), timeout_s=180, progress=False)
    psi = param_count(build_model("tiny"))
    for rank, rows in run.items():
        *cases, layout = rows
        assert layout["fully_shard_rows_match"], f"rank {rank}: rows differ from fully_shard's local shards"
        for row in cases:
            tol = TOLERANCE["mixed" if row.get("compute_dtype") else "fp32"]["weight_rel"]
            assert row["rel_weight_diff"] <= tol, row
            assert row["held_bytes"] == row["expected_held_bytes"], row
            assert row["grads_are_shards"], row  # zero_grad left nothing; no full gradient anywhere
            assert row["peak_gathered"] == row["expected_peak"], row
            for kind, want in row["expected_sent"].items():
                assert row["sent"][kind] == pytest.approx(want, rel=1e-12), (kind, row)
    # every real element lives on exactly one rank
    assert sum(rows[0]["real_elements"] for rows in run.values()) == psi


def test_clipping_across_shards_is_the_full_norm():
    run = launch(clip_worker, nproc=2, timeout_s=60, progress=False)
    for _rank, row in run.items():
        assert row["norm"] == pytest.approx(row["reference_norm"], rel=1e-6)
        assert row["max_rel_err"] <= 1e-6


# ---------------------------------------------------------------------------------------------
# The workers and the formulas they are held to (what per-parameter sharding changes)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, group=None) -> torch.Tensor:
    """Clip the gradient norm of a sharded model: the norm of the *whole* gradient.

    Each rank holds only its rows, so the squares are summed locally, all-reduced, and the
    square root taken of the total; every rank then scales its shards by the same factor, exactly
    what ``torch.nn.utils.clip_grad_norm_`` does to the full gradients of one process.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:
        total += g.float().pow(2).sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm


def expected_shard_bytes(model: nn.Module, nd: int, bytes_per_element: int = 4) -> int:
    """Bytes of padded shards one rank keeps: Σ over parameters of c·(other dims).

    Every rank keeps c rows of every parameter (a rank past the end keeps c zero rows of padding
    in its storage): Ψ/Nd plus at most Nd-1 rows of padding per parameter.
    """
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += chunk_rows(p.shape[0], nd) * math.prod(p.shape[1:])
    return total * bytes_per_element


def expected_traffic(
    model: nn.Module, units, nd: int, *, reshard_after_forward: bool = True, bytes_per_element: int = 4
) -> dict:
    """Bytes one rank sends per step by kind, in the ring model.

    all-gather: every parameter's Nd·c rows once for the forward, and again for the backward for
    the blocks when ``reshard_after_forward``; reduce-scatter: every trainable parameter once.
    Each sends (Nd-1)/Nd of the gathered (padded) bytes.
    """
    frac = (nd - 1) / nd
    out = {"all_gather": 0.0, "reduce_scatter": 0.0}
    for name, _mod, params in assign_units(model, list(units)):
        for p in params:
            nbytes = nd * chunk_rows(p.shape[0], nd) * math.prod(p.shape[1:]) * bytes_per_element
            again = reshard_after_forward and name != "(root)"
            out["all_gather"] += frac * nbytes * (2 if again else 1)
            if p.requires_grad:
                out["reduce_scatter"] += frac * nbytes
    return out


def _freeze(model: nn.Module, names) -> None:
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)


class _GradsAreShards(Observer):
    """After each backward: every trainable shard has a gradient shaped like itself, a frozen one none."""

    def __init__(self, sharded):
        self.sharded, self.ok = sharded, None

    def before_update(self, step: int) -> None:
        self.ok = all(
            (sp.local.grad is not None and sp.local.grad.shape == sp.local.shape)
            if sp.local.requires_grad
            else sp.local.grad is None
            for sp in self.sharded.sharded_params()
        )


def _prepared(model, optimizer) -> Prepared:
    return Prepared(model=model, optimizer=optimizer, full_state_dict=dict, held=lambda: ((), (), ()))


def compare_worker(cases: list[dict]) -> list[dict]:
    """Train the course model with ``PerParamSharded`` and with one process, both in the course's loop;
    report the differences, the bytes held, sent and gathered against their formulas, and the rows each
    rank keeps against ``fully_shard``'s."""
    cfg = get_config("tiny")
    out = []
    with cdist.session() as info:
        for case in cases:
            opt_kw = {
                "SGD": {"lr": 0.05, "momentum": 0.9},
                "Adam": {"lr": 3e-3},
                "AdamW": {"lr": 3e-3, "weight_decay": 0.1},
            }[case["optimizer"]]
            cls = getattr(torch.optim, case["optimizer"])
            dtype = getattr(torch, case["compute_dtype"]) if case.get("compute_dtype") else None
            reshard = case.get("reshard_after_forward", True)
            run = TrainConfig(model="tiny", batch=8, steps=case.get("steps", 3))
            ref, model = build_model(cfg, seed=0, device=info.device), build_model(cfg, seed=0, device=info.device)
            for m in (ref, model):
                _freeze(m, case.get("frozen", ()))
            sharded = PerParamSharded(
                model, units=list(model.blocks), reshard_after_forward=reshard, compute_dtype=dtype
            )
            ref_opt = cls([p for p in ref.parameters() if p.requires_grad], **opt_kw)
            opt = cls([p for p in sharded.parameters() if p.requires_grad], **opt_kw)  # unchanged torch.optim
            count, shards = CountCollectives(), _GradsAreShards(sharded)
            run_steps(_prepared(sharded, opt), run, info, range(run.steps), [count, shards])
            run_steps(_prepared(ref, ref_opt), run, info, range(run.steps), rank=0, world=1)
            bpe = 2 if dtype is not None else 4
            fresh = build_model(cfg, seed=0)
            _freeze(fresh, case.get("frozen", ()))
            units = [
                {"name": n, "numel": sum(p.numel() for p in ps)} for n, _, ps in assign_units(fresh, list(fresh.blocks))
            ]
            schedule = FULL_SHARD if reshard else SHARD_GRAD_OP
            out.append(
                {
                    **case,
                    "rel_weight_diff": weight_diff(sharded.full_state_dict(), ref.state_dict())["relative"],
                    "held_bytes": sharded.held_bytes(),
                    "expected_held_bytes": expected_shard_bytes(build_model(cfg, seed=0), info.world_size),
                    "real_elements": sum(sp.local.numel() for sp in sharded.sharded_params()),
                    "sent": {k: v["sent_bytes"] for k, v in count.summary(run.steps).items()},
                    "expected_sent": expected_traffic(
                        fresh, list(fresh.blocks), info.world_size, reshard_after_forward=reshard, bytes_per_element=bpe
                    ),
                    "peak_gathered": sharded.tracker.peak,
                    "expected_peak": peak_gathered_bytes(units, bpe, schedule, prefetch="none")
                    if info.world_size > 1
                    else None,
                    "grads_are_shards": shards.ok,
                }
            )
        out.append({"fully_shard_rows_match": _rows_match_fully_shard(info)})
    return out


def _rows_match_fully_shard(info) -> bool:
    """Does every parameter's shard here hold the same rows as ``fully_shard``'s local tensor?"""
    from torch.distributed.fsdp import fully_shard

    theirs = build_model("tiny", seed=0, device=info.device)
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    mine = build_model("tiny", seed=0, device=info.device)
    PerParamSharded(mine, units=list(mine.blocks))
    ours = dict(mine.named_parameters())
    return all(torch.equal(ours[name].detach(), p.to_local().detach()) for name, p in theirs.named_parameters())


def clip_worker(max_norm: float = 0.05) -> dict:
    """``clip_grad_norm_`` on shards against ``torch.nn.utils.clip_grad_norm_`` on one process's full gradients."""
    cfg = get_config("tiny")
    with cdist.session() as info:
        kw = dict(batch=8, seq=cfg.seq, vocab=cfg.vocab, device=info.device)
        ref, model = build_model(cfg, seed=0, device=info.device), build_model(cfg, seed=0, device=info.device)
        ref(*batch_for_rank(0, 0, 1, **kw)).backward()
        reference_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        sharded = PerParamSharded(model, units=list(model.blocks))
        sharded(*batch_for_rank(0, info.rank, info.world_size, **kw)).backward()
        norm = clip_grad_norm_(sharded.parameters(), max_norm)
        full = dict(ref.named_parameters())
        worst = 0.0
        for name, p in sharded.module.named_parameters():
            start, stop = shard_rows(full[name].shape[0], info.world_size, info.rank)
            want = full[name].grad[start:stop]
            if want.numel():
                worst = max(worst, ((p.grad - want).norm() / want.norm().clamp_min(1e-30)).item())
        return {"norm": norm.item(), "reference_norm": reference_norm.item(), "max_rel_err": worst}


def test_the_four_layouts_cut_where_torch_chunk_cuts():
    """``per_param.layouts`` against torch.chunk (FSDP2 cuts dim 0 with it; a flat buffer, DeepSpeed 1-2's group
    buffer and DeepSpeed stage 3's per-parameter pieces are equal chunks of a padded 1-D tensor), for shapes that
    leave a rank empty (``test_deepspeed.py`` holds the group buffer to DeepSpeed's own partition)."""
    from course_utils.zero import padded_numel

    shapes = {"weight": (5, 4), "bias": (5,), "w2": (3, 7)}
    for nd in (2, 3, 4):
        view = per_param.layouts(shapes, nd)

        def owners(chunks, length):
            out = torch.empty(length, dtype=torch.long)
            for rank, piece in enumerate(chunks):
                out[piece[piece < length]] = rank
            return out

        total = sum(torch.Size(s).numel() for s in shapes.values())
        flat = owners(torch.arange(padded_numel(total, nd)).chunk(nd), total)
        assert torch.equal(torch.cat([t.reshape(-1) for t in view["flat"]["owner"].values()]), flat)
        group = owners(torch.arange(-(-total // (2 * nd)) * 2 * nd).chunk(nd), total)  # DeepSpeed 1-2: to 2N
        assert torch.equal(torch.cat([t.reshape(-1) for t in view["group_flat"]["owner"].values()]), group)
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            piece = owners(torch.arange(padded_numel(n, nd)).chunk(nd), n).reshape(shape)
            assert torch.equal(view["per_parameter_flat"]["owner"][name], piece)
            rows = owners(torch.arange(shape[0]).chunk(nd), shape[0])
            assert torch.equal(view["rows"]["owner"][name], rows.reshape(-1, *[1] * (len(shape) - 1)).expand(shape))
        kept_rows = [len(c) for c in torch.arange(5).chunk(nd)]
        assert view["rows"]["padding"] >= (nd * max(kept_rows) - 5) * 4  # the weight's empty rows, at least
