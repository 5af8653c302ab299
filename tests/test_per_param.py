"""FSDP2-style per-parameter sharding built by hand (course_utils.per_param, notebook 04).

Against one process (SGD, Adam, AdamW; tied and frozen weights; fp32 and bf16; FULL_SHARD and
SHARD_GRAD_OP) on 2 and 4 ranks, against fully_shard's own shards, and bytes held, sent and
gathered against the formulas. One launch per world size.
"""

import math

import pytest
import torch

from course_utils import per_param
from course_utils.labs.lab04 import TOLERANCE
from course_utils.launch import launch
from course_utils.models import build_model, param_count

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
    assert per_param.expected_shard_bytes(model, 1) == 4 * param_count(model)
    for nd in (2, 3, 4):
        padded = sum(math.ceil(p.shape[0] / nd) * nd * math.prod(p.shape[1:]) for p in model.parameters())
        assert per_param.expected_shard_bytes(model, nd) * nd == 4 * padded >= 4 * param_count(model)


@pytest.mark.parametrize("nproc", [2, 4])
def test_per_param_sharding_trains_like_one_process(nproc):
    run = launch(per_param.compare_worker, nproc=nproc, args=(CASES,), timeout_s=180, progress=False)
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
    run = launch(per_param.clip_worker, nproc=2, timeout_s=60, progress=False)
    for _rank, row in run.items():
        assert row["norm"] == pytest.approx(row["reference_norm"], rel=1e-6)
        assert row["max_rel_err"] <= 1e-6
