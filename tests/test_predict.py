"""The predictions (course_utils.predict) against the independent formulas they replaced or rest on.

``predict`` holds one implementation per fact. Where the package used to compute a fact twice
(ZeRO's and FSDP's bytes held; ZeRO's and FSDP's peak of gathered bytes; the ring factor of
``traffic_check``), these tests hold the one that stayed against the other way of computing it:
``memory.model_state_bytes`` (notebook 01's vectorised table) and ``comm`` (notebook 02's ring
formulas), over every strategy, precision and a spread of world sizes.
"""

from __future__ import annotations

import pytest

from course_utils import comm, memory, predict, strategies
from course_utils.errors import CourseInputError

PSI = 2 * 3 * 5 * 7 * 8 * 11  # divisible by every N below: the paper's Ψ/Nd is a whole number
PSI_BENCH = 1000  # a round Ψ for the formulas worked by hand


@pytest.mark.parametrize("precision,bill", [("mixed", "adam_mixed"), ("fp32", "adam_fp32")])
def test_bill_bytes_is_the_zero_table_of_notebook_01(precision, bill):
    b = memory.OPTIMIZERS[bill]
    for stage in memory.STAGES:
        for nd in (1, 2, 3, 4, 7, 8):
            for psi in (PSI, PSI + 1, 7.5e9):
                got = predict.bill_bytes(stage, psi, nd, precision=precision)["total"]
                ref = memory.model_state_bytes(
                    psi, nd, stage, k=b.k, weight_bytes=b.weight_bytes, grad_bytes=b.grad_bytes
                )
                assert got == pytest.approx(ref, rel=1e-12), (stage, nd, psi)
                if psi == PSI:
                    assert got == ref, (stage, nd)  # whole numbers: bit for bit


def test_strategy_held_bytes_reads_the_record():
    """What fsdp.expected_held_bytes computed (the record's row at rest, Nd = the shard group, the fp32
    bill through memory.model_state_bytes), for every strategy: the same bytes, to the byte."""
    b = memory.OPTIMIZERS["adam_fp32"]
    for name, record in strategies.STRATEGIES.items():
        for nproc in (1,) if record.single_process else (2, 4, 8):
            nd = strategies.shard_group_size(name, nproc, 2)
            got = predict.strategy_held_bytes(name, PSI, nproc, 2)
            ref = memory.model_state_bytes(
                PSI, nd, record.zero_row_at_rest, k=b.k, weight_bytes=b.weight_bytes, grad_bytes=b.grad_bytes
            )
            assert got["total"] == ref, (name, nproc)
            assert got["params"] + got["grads"] + got["optim"] == got["total"]
    assert predict.strategy_held_bytes("no_shard", PSI, 4)["total"] == 16 * PSI  # NO_SHARD's Nd is 1, not N
    assert predict.strategy_held_bytes("hybrid_shard", PSI, 8, 4)["total"] == 16 * PSI / 4


def test_the_traffic_tables_add_up_to_the_ring_formulas():
    """Without padding (one unit of Ψ elements), the per-collective predictions send what comm.step_sent says."""
    units = [{"name": "(root)", "numel": PSI, "padded": PSI, "trainable": True}]
    for n in (2, 3, 4, 8):
        for stage in ("zero1", "zero2", "zero3"):
            sent = sum(r["sent_bytes"] for r in predict.zero_traffic(stage, n, units, precision="fp32").values())
            assert sent == pytest.approx(comm.step_sent(strategies.get(stage), PSI, n) * 4, rel=1e-12)
            assert predict.paper_sent_bytes(stage, PSI, n) == pytest.approx(sent, rel=1e-12)
        for name in ("no_shard", "shard_grad_op", "full_shard"):
            sent = sum(r["sent_bytes"] for r in predict.fsdp_collectives(name, units, n).values())
            # the paper's count, less the root's second all-gather, which fully_shard's default saves
            # (here the root is the whole model: one unit, kept gathered from forward to backward)
            kept = PSI * 4 * (n - 1) / n if name == "full_shard" else 0
            assert predict.paper_sent_bytes(name, PSI, n) - kept == pytest.approx(sent, rel=1e-12), (name, n)
    hsdp = predict.fsdp_collectives("hybrid_shard", units, 8, 4)
    assert sum(r["sent_bytes"] for r in hsdp.values()) == pytest.approx(
        predict.paper_sent_bytes("hybrid_shard", PSI, 8, 4) - PSI * 4 * 3 / 4
    )


def test_one_peak_for_zero3_by_hand_and_fsdp2():
    """ZeRO-3 by hand (padded flat buffers, no prefetch) and FULL_SHARD without prefetch are the same schedule:
    root + the largest unit; SHARD_GRAD_OP keeps the whole model gathered; prefetching adds a neighbour."""
    units = [
        {"name": "blocks.0", "numel": 30, "padded": 32},
        {"name": "blocks.1", "numel": 50, "padded": 52},
        {"name": "blocks.2", "numel": 40, "padded": 40},
        {"name": "(root)", "numel": 20, "padded": 20},
    ]
    assert predict.peak_gathered_bytes(units, 2) == (20 + 52) * 2  # zero3: padded sizes
    assert predict.peak_gathered_bytes(units, 2, "full_shard", "none") == (20 + 50) * 2  # FSDP2: unpadded
    same = [{**u, "padded": u["numel"]} for u in units]
    assert predict.peak_gathered_bytes(same, 4) == predict.peak_gathered_bytes(same, 4, "full_shard", "none")
    assert predict.peak_gathered_bytes(units, 4, "full_shard", "default") == (20 + 90) * 4
    assert predict.peak_gathered_bytes(units, 4, "shard_grad_op") == 140 * 4
    with pytest.raises(CourseInputError, match="gathers no parameters"):
        predict.peak_gathered_bytes(units, 4, "zero1")


def test_precision_bytes_are_the_optimizer_bills():
    for precision, name in (("mixed", "adam_mixed"), ("fp32", "adam_fp32")):
        w, g, k = predict.PRECISION_BYTES[precision]
        assert w + g + k == 16 and (w, g, k) == (
            memory.OPTIMIZERS[name].weight_bytes,
            memory.OPTIMIZERS[name].grad_bytes,
            memory.OPTIMIZERS[name].k,
        )
    with pytest.raises(CourseInputError, match="precision"):
        predict.bill_bytes("zero1", PSI, 2, precision="fp16")


# ---------------------------------------------------------------------------------------------
# The formulas each strategy is held to (worked by hand; the benchmark's theory rows use them)
# ---------------------------------------------------------------------------------------------


def test_paper_traffic_formulas():
    # one rank's ring bytes per step, fp32: all-reduce 2(N-1)/N·4Ψ, stage 3 3(N-1)/N·4Ψ
    assert predict.paper_sent_bytes("ddp", PSI_BENCH, 2) == 4 * PSI_BENCH
    assert predict.paper_sent_bytes("ddp_scratch", PSI_BENCH, 4) == pytest.approx(2 * 3 / 4 * 4 * PSI_BENCH)
    for s in ("zero1", "zero2", "shard_grad_op", "no_shard"):
        assert predict.paper_sent_bytes(s, PSI_BENCH, 4) == pytest.approx(
            comm.step_sent(strategies.DDP, PSI_BENCH, 4) * 4
        )
    assert predict.paper_sent_bytes("zero3", PSI_BENCH, 4) == pytest.approx(3 * 3 / 4 * 4 * PSI_BENCH)
    assert predict.paper_sent_bytes("full_shard", PSI_BENCH, 2) == pytest.approx(1.5 * 4 * PSI_BENCH)
    # HSDP, 2 nodes x 2: stage 3 inside the node (1.5Ψ) + all-reduce of the Ψ/2 shard across 2 nodes (0.5Ψ)
    assert predict.paper_sent_bytes("hybrid_shard", PSI_BENCH, 4, node_size=2) == pytest.approx(2.0 * 4 * PSI_BENCH)
    assert predict.paper_sent_bytes("single", PSI_BENCH, 1) == 0.0
    with pytest.raises(CourseInputError):
        predict.paper_sent_bytes("zero4", PSI_BENCH, 2)


@pytest.mark.parametrize(
    "strategy, nproc, per_param",
    [
        ("single", 1, 16),
        ("ddp", 2, 16),
        ("ddp_scratch", 4, 16),
        ("no_shard", 2, 16),
        ("zero1", 2, 8 + 8 / 2),
        ("zero2", 2, 4 + 12 / 2),
        ("zero3", 4, 16 / 4),
        ("full_shard", 2, 16 / 2),
        ("shard_grad_op", 2, 16 / 2),
        ("hybrid_shard", 4, 16 / 2),
    ],
)
def test_held_formulas_fp32(strategy, nproc, per_param):
    # fp32 Adam, 4 + 4 + 8 bytes per parameter; FSDP2's SHARD_GRAD_OP reshards after backward (16Ψ/N at rest)
    exp = predict.expected_bytes(strategy, PSI_BENCH, nproc)
    assert exp["held_paper"] == pytest.approx(per_param * PSI_BENCH) and exp["held_exact"] == exp["held_paper"]


def test_padding_is_counted_from_the_run():
    # Ψ = 10 on 4 ranks pads to 12: each rank owns S = 3 elements
    units = [{"name": "flat 0", "numel": 10, "padded": 12, "shard_numel": 3, "padding": 2, "trainable": True}]
    exp = predict.expected_bytes("zero1", 10, 4, strategy_info={"shard_numel": 3, "units": units})
    assert exp["held_paper"] == 8 * 10 + 8 * 10 / 4 and exp["held_exact"] == 8 * 10 + 8 * 3
    assert exp["sent_paper"] == pytest.approx(2 * 3 / 4 * 10 * 4)  # 60 B
    assert exp["sent_exact"] == pytest.approx(2 * 3 / 4 * 12 * 4)  # 72 B: the padded buffer travels
    assert exp["sent_exact"] == pytest.approx(
        sum(r["sent_bytes"] for r in predict.zero_traffic("zero1", 4, units, precision="fp32").values())
    )
