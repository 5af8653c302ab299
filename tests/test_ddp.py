"""The hand-built BucketedDDP against torch DDP (bitwise on 2 ranks) and against one process (2 and 4 ranks)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from course_utils import comm, ddp
from course_utils import dist as cdist
from course_utils.instrument import Observer, weights_sha256
from course_utils.labs import lab02
from course_utils.launch import launch
from course_utils.loop import Prepared, make_optimizer, module_held, run_steps
from course_utils.models import build_model, param_count
from course_utils.train import TrainConfig, train

STEPS = 4
#: Losses: the same mean over B·s tokens summed in another order (PyTorch's own fp32 default tolerance).
LOSS_TOL = dict(rtol=1.3e-6, atol=1e-5)
#: Weights: ||Δw|| / ||w − w0||. fp32 rounding (2^-24) in the gradient sums, amplified by Adam where a
#: gradient is near zero (its step is normalised by its own RMS): a few times 1e-5 on 2 and 4 ranks over
#: these steps, against order 1 for a real bug (a bucket never reduced, a stale gradient).
WEIGHTS_REL_TOL = 1e-4


# ---------------------------------------------------------------- bucket layout (no processes)


def test_buckets_follow_reverse_parameter_order_under_the_cap():
    model = build_model("tiny")
    model.pos_emb.weight.requires_grad_(False)
    cap = int(0.1 * ddp.MiB)
    buckets = ddp.make_buckets(model, cap)
    names = [n for b in buckets for n in b.names]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == trainable[::-1]  # every trainable tensor once (tied head absent), reversed
    assert "pos_emb.weight" not in names and "head.weight" not in names
    for b in buckets:
        assert b.nbytes <= cap or len(b.params) == 1  # only a single tensor larger than the cap may exceed it
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.nbytes + nxt.params[0].numel() * 4 > cap  # a bucket closes only when the next tensor does not fit
    assert sum(b.nbytes for b in buckets) == 4 * (param_count(model) - model.pos_emb.weight.numel())


def test_one_bucket_when_the_cap_is_large():
    assert len(ddp.make_buckets(build_model("tiny"), 25 * ddp.MiB)) == 1


# ---------------------------------------------------------------- in one process (a world of one)


class _UsedBackwards(nn.Module):
    """``second`` is registered last but runs first: its bucket (0) fills *after* bucket 1."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        return self.first(self.second(x)).square().mean()


@pytest.fixture
def world_of_one(monkeypatch):
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with cdist.session(backend="gloo") as info:
        yield info


def test_all_reduces_go_out_in_bucket_index_order(world_of_one):
    torch.manual_seed(0)
    model = _UsedBackwards()
    wrapped = ddp.BucketedDDP(model, bucket_cap_mb=300 / ddp.MiB, timeline=True)  # 288 B per Linear
    assert [b.names for b in wrapped.buckets] == [["second.bias", "second.weight"], ["first.bias", "first.weight"]]
    wrapped(torch.randn(4, 8)).backward()
    wrapped.finish_gradient_synchronization()
    events = [(e, b) for _, e, b, _ in wrapped.timeline]
    ready = [b for e, b in events if e == "ready"]
    assert ready[0] == 1 and ready[-1] == 0  # bucket 1 filled first...
    starts = [i for i, (e, _) in enumerate(events) if e == "start"]
    assert [events[i][1] for i in starts] == [0, 1]  # ...but bucket 0 was all-reduced first
    assert starts[0] > max(i for i, (e, b) in enumerate(events) if e == "ready" and b == 0)


def test_world_of_one_leaves_gradients_as_they_were(world_of_one):
    torch.manual_seed(0)
    model, reference = _UsedBackwards(), _UsedBackwards()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    wrapped = ddp.BucketedDDP(model, bucket_cap_mb=300 / ddp.MiB)
    wrapped(x).backward()
    wrapped.finish_gradient_synchronization()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_unused_parameter_is_a_clear_error(world_of_one):
    model = lab02.GPTWithAuxHead("tiny")
    wrapped = ddp.BucketedDDP(model)
    x = torch.zeros(2, 32, dtype=torch.long)
    wrapped(x, x).backward()
    with pytest.raises(RuntimeError, match="aux_head.bias, aux_head.weight got no gradient"):
        wrapped.finish_gradient_synchronization()


# ---------------------------------------------------------------- launched: 2 and 4 ranks


@pytest.fixture(scope="module")
def against_torch():
    cfg = TrainConfig(strategy="ddp_scratch", nproc=2, steps=STEPS)
    return launch(check_against_torch_ddp, nproc=2, args=(asdict(cfg), 0.1), echo=False)


def test_broadcast_makes_replicas_start_from_rank_0(against_torch):
    for out in against_torch.values():
        assert out["started_from_rank0"] == [True, True]  # each rank built other weights (seed 1000 + rank)
    assert len({out["sha_ours"] for out in against_torch.values()}) == 1


def test_bucketed_ddp_equals_torch_ddp_bit_for_bit_on_2_ranks(against_torch):
    # On 2 ranks the all-reduce is one fp32 addition g0/2 + g1/2: commutative, and halving is exact,
    # so the averaged gradients, and hence Adam's steps, are bit-identical whatever the buckets.
    for out in against_torch.values():
        assert out["buckets"] > 1
        assert out["grad_max_diff"] == [0.0] * STEPS
        assert out["losses_ours"] == out["losses_torch"]
        assert out["sha_ours"] == out["sha_torch"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weights")
    base = TrainConfig(steps=STEPS)
    out = {}
    for name, nproc, cap in [("single", 1, 25.0), ("ddp", 2, 25.0), ("ddp_scratch", 2, 0.1), ("ddp_scratch", 4, 0.1)]:
        path = folder / f"{name}-{nproc}.pt"
        report = train(base, strategy=name, nproc=nproc, bucket_cap_mb=cap, save_weights=str(path))
        out[name, nproc] = (report, torch.load(path))
    return out


def test_torch_ddp_and_bucketed_ddp_give_the_same_report_on_2_ranks(runs):
    (ours, _), (theirs, _) = runs["ddp_scratch", 2], runs["ddp", 2]
    assert ours["weights_sha256"] == theirs["weights_sha256"]  # see the bit-for-bit argument above
    assert ours["losses"] == theirs["losses"]
    assert ours["comm_per_step"]["all_reduce"]["calls"] == ours["strategy_info"]["buckets"] > 1
    assert theirs["comm_per_step"]["all_reduce"]["calls"] == 1  # 25 MiB: one bucket for 0.47 MB


@pytest.mark.parametrize("nproc", [2, 4])
def test_bucketed_ddp_matches_one_process_within_fp32_tolerance(runs, nproc):
    (single, w_single), (ours, w_ours) = runs["single", 1], runs["ddp_scratch", nproc]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(single["losses"]), **LOSS_TOL)
    agreement = lab02.weights_agreement(w_single, w_ours, build_model("tiny").state_dict())
    assert agreement["rel"] <= WEIGHTS_REL_TOL
    tensors = len(list(build_model("tiny").parameters()))
    for row in ours["per_rank"]:  # every replica holds the whole fp32 Adam bill, 16Ψ, and a step counter per tensor
        assert (row["total"], row["steps"]) == (16 * param_count(build_model("tiny")) + 4 * tensors, 4 * tensors)


def test_same_sized_buckets_in_swapped_order_silently_give_wrong_sums():
    result = launch(lab02.mismatched_order, nproc=2, args=("same_size", 16), echo=False)
    n = 2
    right = [n * (n + 1) / 2, 100 * n * (n + 1) / 2]
    for out in result.values():
        assert out["index_order"] == right
        assert out["swapped_order"] != right
    assert result[0]["swapped_order"] != result[1]["swapped_order"]  # the replicas have diverged


# ---------------------------------------------------------------- torch's DDP read from torch (notebook 02)


def test_extra_buffer_bytes_counts_only_storage_no_gradient_shares():
    bucket = torch.zeros(10)
    views = list(bucket.split([4, 6]))
    separate = [torch.zeros(4), torch.zeros(6)]
    assert lab02.extra_buffer_bytes(views, [bucket]) == 0
    assert lab02.extra_buffer_bytes(separate, [bucket, bucket]) == 40  # one buffer, counted once


def test_torch_ddp_buckets_views_and_wait_read_from_torch():
    psi = param_count(build_model("tiny"))
    cfg = asdict(TrainConfig(strategy="ddp_scratch", nproc=2, steps=2))
    got = launch(lab02.ddp_measurements, nproc=2, args=(cfg, [], 0.1), echo=False)[0]["torch_ddp"]
    plain, view, default = (got["torch"][k] for k in ((0.1, False), (0.1, True), (None, False)))
    for t in (plain, view, default):
        assert t["first_iteration_bucket_sizes"] == [4 * psi]  # one bucket on the first iteration
        assert sum(t["rebuilt_bucket_sizes"]) == 4 * psi
        assert t["rel_to_mean_after_backward"] <= 1e-6  # averaged when backward returns
    assert len(plain["rebuilt_bucket_sizes"]) > 1 and len(default["rebuilt_bucket_sizes"]) == 1
    names = sorted(n for b in plain["rebuilt_names"] for n in b)
    assert names == sorted(n for b in got["scratch"]["bucket_names"] for n in b)
    assert plain["extra_bucket_bytes"] == got["scratch"]["extra_bucket_bytes"] == 4 * psi
    assert view["extra_bucket_bytes"] == 0
    assert got["scratch"]["rel_to_mean_after_backward"] > 1e-2 >= 1e-6 >= got["scratch"]["rel_to_mean_after_finish"]


def test_gloo_all_reduce_on_4_ranks_writes_exactly_what_gloos_ring_source_says():
    numel = 30_001  # not a multiple of the 8 segments: the last one is short
    wire = launch(lab02.all_reduce_on_the_wire, nproc=4, args=(numel,), echo=False)[0]
    assert None not in wire  # Linux: /proc/self/io counts every rank's writes
    for rank, w in enumerate(wire):
        plan = comm.gloo_ring_plan(4 * numel, 4, rank)
        assert w == plan["wire"], (rank, w, plan)  # to the byte: payload plus one 48-byte preamble per op
        assert plan["headers"] == 2 * 3 * 288  # 6 ring steps x (2 segments x 3 ops x 48 bytes)
    # the ring's volume: every rank sends 2(N−1)/N of the payload, N ranks 2(N−1) payloads in all
    assert sum(comm.gloo_ring_plan(4 * numel, 4, r)["data"] for r in range(4)) == 2 * 3 * 4 * numel


def test_default_timeouts_are_torchs():
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import _get_default_timeout

    got = lab02.default_collective_timeouts()
    assert got["gloo"] == _get_default_timeout("gloo") == constants.default_pg_timeout
    assert got["nccl"] is not None and got["nccl"] < got["gloo"]  # torch's NCCL default is the shorter one


def test_overlap_summary_reports_the_union_of_overlapping_all_reduces():
    timeline = {
        "forward_ms": -2.0,
        "backward_end_ms": 5.0,
        "synced_ms": 8.0,
        "ready": [],
        "all_reduce": [
            {"bucket": 0, "start_ms": 1.0, "end_ms": 6.0},
            {"bucket": 1, "start_ms": 2.0, "end_ms": 7.0},
            {"bucket": 2, "start_ms": 4.0, "end_ms": None},
        ],
    }  # None: done at synced_ms
    got = lab02.overlap_summary(timeline)
    assert got["in_flight_ms"] == 7.0  # [1, 8], not 5 + 5 + 4 = 14
    assert got["in_flight_during_backward_ms"] == 4.0  # [1, 5]
    assert got["step_ms"] == 10.0 and got["started_during_backward"] == 3
    assert got["for_all_reduces_ms"] == 3.0 and got["after_last_all_reduce_ms"] == 0.0  # bucket 2 ends at synced
    later = lab02.overlap_summary({**timeline, "synced_ms": 9.5, "all_reduce": timeline["all_reduce"][:2]})
    assert later["for_all_reduces_ms"] == 2.0 and later["after_last_all_reduce_ms"] == 2.5  # [5, 7], then [7, 9.5]
    assert later["wait_after_backward_ms"] == 4.5


# ---------------------------------------------------------------- the worker: both DDPs in the course's loop


class _Gradients(Observer):
    """Every trainable parameter's averaged gradient, copied before each update."""

    def __init__(self, module):
        self.module, self.steps = module, []

    def before_update(self, step: int) -> None:
        self.steps.append([p.grad.detach().clone() for p in self.module.parameters() if p.requires_grad])


def check_against_torch_ddp(config: dict, cap_mb: float = 0.1) -> dict:
    """BucketedDDP and torch DDP on every rank, each trained by the one loop on the same batches with the same
    Adam; their averaged gradients compared step by step (each replica's arithmetic is its own, so training
    one after the other changes no bit).

    Each rank builds the course model from a *different* seed (so only rank 0's broadcast can
    make the replicas agree) and freezes ``pos_emb.weight`` (a parameter that does not require
    gradients); the head is tied to the token embedding.

    Returns, per rank: whether both started from rank 0's weights, the largest gradient
    difference between the two after each step's synchronisation, both losses, and both final
    weight hashes.
    """
    cfg = TrainConfig(**config).validate()
    with cdist.session() as info:

        def replica():
            m = build_model(cfg.model, seed=1000 + info.rank, device=info.device)
            m.pos_emb.weight.requires_grad_(False)
            return m

        ours, theirs = (
            ddp.BucketedDDP(replica(), bucket_cap_mb=cap_mb),
            DistributedDataParallel(replica(), bucket_cap_mb=cap_mb),
        )
        rank0_start = weights_sha256(build_model(cfg.model, seed=1000).state_dict())
        started = [weights_sha256(m.state_dict()) == rank0_start for m in (ours.module, theirs.module)]
        runs = {}
        for name, wrapped, sync in (
            ("ours", ours, ours.finish_gradient_synchronization),
            ("torch", theirs, lambda: None),
        ):
            optimizer = make_optimizer(wrapped.parameters(), cfg)
            prepared = Prepared(
                model=wrapped,
                optimizer=optimizer,
                full_state_dict=wrapped.module.state_dict,
                held=lambda wrapped=wrapped, optimizer=optimizer: module_held(wrapped.module, optimizer),
                before_step=sync,
            )
            grads = _Gradients(wrapped.module)
            runs[name] = ([float(v) for v in run_steps(prepared, cfg, info, range(cfg.steps), [grads])], grads.steps)
        (losses_ours, grads_ours), (losses_torch, grads_torch) = runs["ours"], runs["torch"]
        return {
            "rank": info.rank,
            "grad_max_diff": [
                max(float((a - b).abs().max()) for a, b in zip(mine, theirs_))
                for mine, theirs_ in zip(grads_ours, grads_torch)
            ],
            "losses_ours": losses_ours,
            "losses_torch": losses_torch,
            "buckets": len(ours.buckets),
            "started_from_rank0": started,
            "sha_ours": weights_sha256(ours.module.state_dict()),
            "sha_torch": weights_sha256(theirs.module.state_dict()),
        }


def test_timelines_on_one_clock_show_who_waited_for_whom():
    """Two ranks' timelines, each in ms after its own backward began, moved onto rank 0's clock: rank 1 began
    3 ms later, so rank 0's bucket waited 3 ms for it (in flight, but waiting for the straggler)."""

    def timeline(origin_s, start, end):
        return {
            "clock_origin_s": origin_s,
            "forward_ms": -2.0,
            "backward_end_ms": 5.0,
            "synced_ms": 7.0,
            "ready": [{"bucket": 0, "param": "w", "t_ms": start}],
            "all_reduce": [{"bucket": 0, "start_ms": start, "end_ms": end}],
        }

    moved = lab02.on_one_axis([timeline(100.0, 1.0, 5.0), timeline(100.003, 1.0, 2.0)])
    assert moved[1]["all_reduce"][0] == {"bucket": 0, "start_ms": pytest.approx(4.0), "end_ms": pytest.approx(5.0)}
    assert moved[1]["backward_start_ms"] == pytest.approx(3.0) and moved[0]["backward_start_ms"] == 0.0
    s = lab02.straggler_summary(moved)
    assert s["buckets"] == [
        {"bucket": 0, "last_start_ms": pytest.approx(4.0), "last_rank": 1, "earliest_end_ms": pytest.approx(5.0)}
    ]
    assert [r["waiting_for_others_ms"] for r in s["ranks"]] == [pytest.approx(3.0), 0.0]
    assert [r["backward_ms"] for r in s["ranks"]] == [pytest.approx(5.0), pytest.approx(5.0)]


def test_straggler_summary_splits_the_union_of_overlapping_bars():
    """Two buckets whose bars overlap on each rank (the second queued behind the first): the parts add up to the
    union of the bars, never to their sum. Rank 1 began 3 ms later; rank 0's bars are [1, 6] and [2, 8]."""

    def timeline(origin_s, bars):
        return {
            "clock_origin_s": origin_s,
            "forward_ms": -2.0,
            "backward_end_ms": 5.0,
            "synced_ms": 9.0,
            "ready": [],
            "all_reduce": [{"bucket": b, "start_ms": start, "end_ms": end} for b, start, end in bars],
        }

    moved = lab02.on_one_axis([timeline(100.0, [(0, 1, 6), (1, 2, 8)]), timeline(100.003, [(0, 1, 3), (1, 2, 5)])])
    rank0, rank1 = lab02.straggler_summary(moved)["ranks"]
    assert rank0["in_flight_ms"] == pytest.approx(7.0)  # [1, 8], not 5 + 6 = 11
    # [1, 5]: rank 1 issues bucket 0 at 4 and bucket 1 at 5; until then rank 0 cannot finish, even while bucket 0 moves
    assert rank0["waiting_for_others_ms"] == pytest.approx(4.0)
    # [5, 8]: two in flight at most, each on one of gloo's two threads: none waiting for a thread
    assert rank0["gloo_working_ms"] == pytest.approx(3.0) and rank0["of_which_thread_wait_ms"] == 0.0
    assert rank0["issued_last"] == 0
    assert rank1 == {
        "backward_ms": pytest.approx(5.0),
        "issued_last": 2,  # both buckets: the straggler of each
        "in_flight_ms": pytest.approx(4.0),  # [4, 8] on rank 0's clock
        "waiting_for_others_ms": 0.0,  # the last to issue: never waits
        "gloo_working_ms": pytest.approx(4.0),
        "of_which_thread_wait_ms": 0.0,
    }
    # a third bucket in flight beside two, all issued everywhere: it waits for one of gloo's 2 threads
    three = lab02.on_one_axis(
        [timeline(100.0, [(0, 1, 6), (1, 2, 7), (2, 3, 8)]), timeline(100.0, [(0, 0, 6), (1, 0, 7), (2, 0, 8)])]
    )
    r0 = lab02.straggler_summary(three)["ranks"][0]
    assert r0["waiting_for_others_ms"] == 0.0 and r0["of_which_thread_wait_ms"] == pytest.approx(3.0)  # [3, 6]
    assert r0["gloo_working_ms"] == pytest.approx(7.0)  # [1, 8]: the thread wait is part of it, not beside it
