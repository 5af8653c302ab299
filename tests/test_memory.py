"""course_utils.memory: the paper's numbers, the CLI (good and bad input), and the bill measured
on real tensors against 16Ψ."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from course_utils import memory
from course_utils.cli import main
from course_utils.errors import CourseInputError
from course_utils.units import GB

# --- the formulas against the paper -------------------------------------------------------------


def test_tiny_model_on_four_gpus():
    assert memory.bytes_per_gpu(8, 4) == {"ddp": 128, "zero1": 56, "zero2": 44, "zero3": 32}


def test_gpt2_bill():
    assert memory.model_state_bytes(1.5e9) == 24 * GB
    assert memory.WEIGHT_BYTES * 1.5e9 == 3 * GB
    assert round(memory.activation_bytes(1600, 32, 1024, 48) / GB, 1) == 60.4
    assert round(memory.activation_numbers(1600, 32, 1024, 48) / 1e9, 1) == 30.2
    assert memory.fused_gradient_buffer_bytes(1.5e9) == 6 * GB


def test_paper_model_and_trillion():
    b = memory.bytes_per_gpu(7.5e9, 64)
    assert (round(b["zero1"] / GB, 1), round(b["zero2"] / GB, 1), round(b["zero3"] / GB, 2)) == (31.4, 16.6, 1.88)
    assert round(memory.model_state_bytes(1e12, 1024, "zero3") / GB, 1) == 15.6


def test_floors_of_70b():
    assert memory.floor_bytes(70e9, "zero1") == 280 * GB
    assert memory.floor_bytes(70e9, "zero2") == 140 * GB
    assert memory.floor_bytes(70e9, "zero3") == 0
    huge = np.array([1, 8, 64, 1024, 10**6])
    for stage in ("zero1", "zero2"):
        assert np.all(memory.model_state_bytes(70e9, huge, stage) > 80 * GB)
        assert memory.smallest_nd_that_fits(70e9, stage, 80 * GB) is None
    assert memory.smallest_nd_that_fits(70e9, "zero3", 80 * GB) == 14


def test_model_parallel_and_bytes_per_param():
    m = lambda nd: memory.model_state_bytes(60e9, nd, "zero2", nm=16) / GB  # noqa: E731
    assert (round(m(4), 1), round(m(25), 1)) == (20.6, 9.6)
    assert round(memory.model_state_bytes(13e9, 128, "zero2") / GB, 1) == 27.4
    assert memory.model_state_bytes(1, 25, "zero2") == pytest.approx(2.56)
    assert memory.model_state_bytes(1, 25, "zero3") == pytest.approx(0.64)


def test_vectorised_and_k():
    nds = memory.chart_nds()
    assert list(nds) == [2**i for i in range(11)]
    curve = memory.model_state_bytes(7.5e9, nds, "zero3")
    assert curve.shape == nds.shape and np.all(np.diff(curve) < 0)
    for name, bill in memory.OPTIMIZERS.items():
        assert sum(b for _, b in bill.parts) == bill.k, name
    assert memory.OPTIMIZERS["adam_mixed"].total == memory.OPTIMIZERS["adam_fp32"].total == 16
    assert memory.model_state_bytes(1, 1, k=8) == 12
    assert memory.model_state_bytes(1, 1, weight_bytes=4, grad_bytes=4, k=8) == 16


def test_table1_matches_paper():
    rows = {(r["params"], r["nd"]): r for r in memory.table1()}
    assert len(rows) == 18
    four = rows[(7.5e9, 4)]["bytes_per_gpu"]
    assert [memory.gb_cell(four[s]) for s in memory.STAGES] == ["120", "52.5", "41.3", "30.0"]
    assert rows[(7.5e9, 64)]["fits"] == {"ddp": False, "zero1": True, "zero2": True, "zero3": True}
    assert rows[(128e9, 64)]["fits"]["zero3"] and not rows[(128e9, 16)]["fits"]["zero3"]
    assert rows[(1e12, 1024)]["fits"]["zero3"] and not rows[(1e12, 256)]["fits"]["zero3"]


def test_activation_checkpointing_rule():
    full = memory.activation_numbers(1600, 32, 1024, 48)
    ckpt = memory.activation_numbers(1600, 32, 1024, 48, checkpointing=True)
    assert ckpt == 1600 * 32 * 1024 * 48 + 12 * 1600 * 32 * 1024
    assert ckpt < full / 5


@pytest.mark.parametrize(
    "bad",
    [
        lambda: memory.model_state_bytes(0, 4),
        lambda: memory.model_state_bytes(-1, 4),
        lambda: memory.model_state_bytes(1e9, 0),
        lambda: memory.model_state_bytes(1e9, 4, "zero4"),
        lambda: memory.model_state_bytes(1e9, 4, k=-1),
        lambda: memory.floor_bytes(1e9, "stage9"),
        lambda: memory.activation_bytes(0, 1, 1, 1),
        lambda: memory.memory_chart_view(1e9, nd=0),
        lambda: memory.optimizer_bill("lion9"),
    ],
)
def test_bad_input_raises(bad):
    with pytest.raises(CourseInputError):
        bad()


# --- what the charts show (pure functions) -------------------------------------------------------


def test_memory_chart_view():
    v = memory.memory_chart_view(7.5e9, nd=64, gpu_mem=32 * GB)
    assert v["readout"] == memory.bytes_per_gpu(7.5e9, 64)
    assert v["fits"] == {"ddp": False, "zero1": True, "zero2": True, "zero3": True}
    # by hand: 30 + 90/Nd <= 32 from Nd = 45; 15 + 105/Nd <= 32 from 7; 120/Nd <= 32 from 4 (GB)
    assert v["first_fit"] == {"ddp": None, "zero1": 45, "zero2": 7, "zero3": 4}
    assert v["title"] == "7.5B on one 32 GB GPU: stage 3 from Nd = 4, stage 2 from 7, stage 1 from 45, plain DP never"
    assert "31.4 GB" in v["readout_text"] and "1.88 GB" in v["readout_text"]
    t = memory.memory_chart_view(1e12, nd=1024)
    assert t["first_fit"]["zero3"] == 500 and t["first_fit"]["zero1"] is None  # 16e12 / 32e9
    assert memory.memory_chart_view(1e12, nd=1024)["readout_text"] != v["readout_text"]


def test_bill_bars_drop_one_part_per_stage():
    bars = memory.bill_bars(8, 4, activations=10)
    held = {s: sum(p["held"] for p in parts.values()) for s, parts in bars.items()}
    assert held == {"ddp": 138, "zero1": 66, "zero2": 54, "zero3": 42}
    assert bars["zero2"]["gradients"] == {"held": 4, "full": 16}
    assert bars["zero3"]["activations"] == {"held": 10, "full": 10}


# --- command line --------------------------------------------------------------------------------


def test_cli_memory_json(capsys):
    assert main(["memory", "--params", "7.5B", "--dp", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 7.5e9 and out["dp"] == 64 and out["mp"] == 1 and out["k"] == 12
    assert out["bytes_per_gpu"] == memory.bytes_per_gpu(7.5e9, 64)


def test_cli_memory_table_text(capsys):
    assert main(["memory", "--params", "7.5e9", "--dp", "64"]) == 0
    text = capsys.readouterr().out
    assert "31,406,250,000" in text and "GB (10^9)" in text and "GiB (2^30)" in text
    assert main(["table"]) == 0
    text = capsys.readouterr().out
    assert "15.6*" in text and "41.3" in text and "fits a 32 GB GPU" in text
    assert main(["table", "--gpu-mem", "80GB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 18 and rows[1]["fits"]["zero1"] is True  # 7.5B, Nd = 4: 52.5 GB < 80 GB


@pytest.mark.parametrize(
    "argv, names",
    [
        (["memory", "--params", "7.5X", "--dp", "4"], "--params"),
        (["memory", "--params", "0", "--dp", "4"], "--params"),
        (["memory", "--params", "-3B"], "--params"),
        (["memory", "--params", "1B", "--dp", "0"], "--dp"),
        (["memory", "--params", "1B", "--mp", "-2"], "--mp"),
        (["memory", "--params", "1B", "--k", "-1"], "--k"),
        (["memory", "--params", "1B", "--stage", "zero4"], "--stage"),
        (["memory", "--params", "1B", "--dp", "1.5"], "--dp"),
        (["table", "--dp", "0,4"], "--dp"),
        (["table", "--gpu-mem", "-80GB"], "--gpu-mem"),
        (["table", "--params", "7.5B,abc"], "--params"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, names):
    proc = subprocess.run(
        [sys.executable, "-m", "course_utils", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# --- measured on real tensors ---------------------------------------------------------------------


def test_mixed_precision_adam_holds_16_bytes_per_parameter():
    m = memory.measure_model_state_bytes("tiny", "adam_mixed")
    psi = m["psi"]
    assert (m["weights"], m["gradients"], m["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    assert m["total"] == 16 * psi and m["optimizer_scalars"] == 0


def test_fp32_adam_splits_16_bytes_4_4_8():
    m = memory.measure_model_state_bytes("tiny", "adam_fp32")
    psi = m["psi"]
    assert (m["weights"], m["gradients"], m["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert m["optimizer_scalars"] > 0  # torch.optim.Adam's per-tensor step counters


def test_mixed_precision_adam_updates_like_torch_adam():
    import torch

    from course_utils.models import build_model

    ours, ref = build_model("tiny", seed=1), build_model("tiny", seed=1)
    opt = memory.MixedPrecisionAdam(ours, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(ours.parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            p.grad, q.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(opt.state[p]["master"], q.detach(), rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), q.detach().to(torch.bfloat16), rtol=0, atol=0)


def test_measured_activations_against_rule():
    rows = memory.compare_activations([{"batch": 2}, {"batch": 4, "seq": 64}, {"width": 128, "heads": 4}])
    for r in rows:
        assert 1.2 < r["ratio"] < 1.5
        # checkpointing keeps exactly one 16-bit input of b·s·h numbers per block
        assert r["measured_blocks_ckpt"] == 2 * r["batch"] * r["seq"] * r["width"] * r["layers"]
        assert r["measured_total_ckpt"] < r["measured_total"] / 2
    assert rows[1]["measured_blocks"] == 2 * rows[0]["measured_blocks"] * 2  # linear in b·s
    for r in rows:  # Korthikanti et al. 2022, no dropout, fused attention: 32·s·b·h bytes, plus per-row statistics
        k22 = memory.activation_bytes_korthikanti(
            r["width"], r["batch"], r["seq"], r["layers"], r["heads"], dropout=False, fused_attention=True
        )
        assert 0 <= r["measured_blocks"] - k22 < 0.02 * k22
    # with dropout and unfused attention, the paper's 34·s·b·h + 5·a·s²·b bytes per layer
    assert memory.activation_bytes_korthikanti(64, 1, 32, 1, 4) == 34 * 32 * 64 + 5 * 4 * 32 * 32
    # the chart's view: one point per measured shape, in bytes per h·b·s·L, on the formulas' constants
    view = memory.activation_view(rows)
    assert len(set(view["labels"])) == len(rows)  # every shape its own labelled x position
    assert all(32 <= v < 32 * 1.02 for v in view["full"]) and view["checkpointed"] == [2.0] * len(rows)
    assert sorted(view["lines"].values()) == [2, 12 * 2, 32, 34]  # block input, the paper, Korthikanti et al.
    with pytest.raises(CourseInputError, match="at least one measured row"):
        memory.activation_view([])


def test_gpt2_bill_stacks_whole_bills_with_both_activation_counts():
    from course_utils import plots

    psi, h, layers, b, s = 1.5e9, 1600, 48, 32, 1024
    view = memory.gpt2_bill_view(psi, h=h, layers=layers, heads=25, b=b, s=s)
    states_and_buffer = (2 + 2 + 12 + 4) * psi  # bf16 weights and grads, K = 12, the fused fp32 buffer
    by_hand = [
        states_and_buffer + 2 * (h * b * s * layers + 12 * h * b * s),  # L layer inputs + one layer rebuilt
        states_and_buffer + 2 * 12 * h * b * s * layers,  # the paper's 12·h·b·s·L numbers
        states_and_buffer + 32 * s * b * h * layers,  # Korthikanti et al., fused attention, no dropout
    ]
    assert list(view["totals"].values()) == pytest.approx(by_hand, rel=1e-12)
    assert round(by_hand[0] / GB, 1) == 36.3 and "36.3 GB" in view["title"] and "no bill fits" in view["title"]
    fig = plots.gpt2_bill_figure(view)
    assert list(fig.course_totals.values()) == pytest.approx([t / GB for t in by_hand], rel=1e-12)  # drawn ends


def test_bill_chart_stacks_what_is_held_from_zero():
    from course_utils import plots

    fig = plots.bill_bars_figure(memory.bill_bars(8, 4))
    held = {s: h for s, (h, _) in fig.course_heights.items()}
    assert held == memory.bytes_per_gpu(8, nd=4)  # bars as tall as the bytes held
    assert all(h + dropped == 16 * 8 for h, dropped in fig.course_heights.values())  # dashed up to the full bill


def test_headlines_hold_the_formulas_against_the_papers_words_not_against_themselves():
    rows = {r["claim"]: r for r in memory.zero_r_and_headlines()}
    stated = list(rows.values())
    # every row is one the paper states, in its own words, and says what the comparison shows
    assert len(stated) == 6 and all(r["words"] and r["stated"] is not None and r["note"] for r in stated)
    assert all(memory.paper_agrees(r) is True for r in stated)
    # the two Pa sizes agree only with the paper's "GB" read as billions of numbers: flagged, not hidden
    assert [r["claim"] for r in stated if r["unit_reinterpreted"]] == [
        "Pa: the 100B model's activation checkpoints",
        "Pa: the same, split over Nm = 16",
    ]
    # by hand, from the paper's inputs: L·b·s·h of the 100B model, and 3e9 fp32 gradients
    pa = rows["Pa: the 100B model's activation checkpoints"]
    assert pa["ours"] == 125 * 32 * 1024 * 8192 / 1e9 and "67.1 GB" in pa["note"]  # "33 GB" is one byte a number
    assert rows["CB: one fused fp32 gradient buffer for 3B parameters"]["ours"] == 3e9 * 4 / GB
    # the relation can fail: a formula off by 10% in any stated row is caught
    for r in stated:
        wrong = dict(r, ours=r["ours"] * (1.1 if r["relation"] != "above" else 0.5))
        if r["relation"] == "below":
            wrong["ours"] = r["stated"] * 1.01
        assert not memory.paper_agrees(wrong), r["claim"]


def test_fmt_size_picks_a_unit_and_never_writes_an_exponent():
    from course_utils.units import fmt_size

    assert fmt_size(8.48e12) == "8.48 TB" and fmt_size(31.4e9) == "31.4 GB" and fmt_size(1.88e9) == "1.88 GB"
    assert fmt_size(999.96e9) == "1 TB"  # rounds to 1000 GB: the next unit up
    assert fmt_size(2.5e15) == "2,500 TB" and fmt_size(512) == "512 bytes"


def test_a_pytorch_users_bill_is_measured_not_assumed():
    """torch.autocast + AdamW holds fp32 weights and gradients and two fp32 moments, plus a bf16 copy of every
    weight an nn.Linear reads from the forward to the backward; the main_grad recipe holds 18 bytes (Megatron-Core)."""
    amp = memory.measure_model_state_bytes("tiny", "autocast_adamw")
    psi = amp["psi"]
    assert (amp["weights"], amp["gradients"], amp["optimizer"]) == (4 * psi, 4 * psi, 8 * psi)
    assert 0 < amp["linear_psi"] < psi  # LayerNorm weights and every bias are not cast
    assert amp["copies_after_forward"] == 2 * amp["linear_psi"] and amp["copies_after_backward"] == 0
    mg = memory.measure_model_state_bytes("tiny", "main_grad_adamw")
    assert (mg["weights"], mg["gradients"], mg["optimizer"], mg["total"]) == (2 * psi, 4 * psi, 12 * psi, 18 * psi)
    assert mg["dot_grad"] == 0  # measured: every bf16 .grad was added into main_grad and freed
    # the same step as the paper's recipe, to rounding: main_grad changes the bill, not the arithmetic
    paper = memory.measure_model_state_bytes("tiny", "adam_mixed")
    assert abs(mg["loss"] - paper["loss"]) < 1e-3 and abs(amp["loss"] - paper["loss"]) < 1e-2
    fp32 = memory.measure_model_state_bytes("tiny", "adam_fp32")
    for r in (paper, fp32, mg):  # the same watcher in every recipe: without autocast no 16-bit copy is made
        assert r["copies_after_forward"] == r["copies_after_backward"] == 0, r["optimizer_name"]
    with pytest.raises(CourseInputError, match="autocast_adamw"):
        memory.measure_model_state_bytes("tiny", "sgd")


@pytest.mark.parametrize("recipe", ["adam_mixed", "main_grad_adamw", "adam_fp32", "autocast_adamw"])
def test_the_copy_watcher_knows_the_weights_the_step_reads(recipe, monkeypatch):
    """Notebook 01 §2: the 16-bit copy watcher knows the parameters by their storages' addresses, so it must be
    built after a recipe recasts the weights (the paper's and main_grad's hold bf16 weights): else its 0 for
    those recipes watches freed fp32 memory, not the weights the step reads."""
    from course_utils.memory import measure

    built, real = [], measure._sixteen_bit_copies_watcher

    def spy(net):
        built.append((net, {p.untyped_storage().data_ptr() for p in net.parameters()}))
        return real(net)

    monkeypatch.setattr(measure, "_sixteen_bit_copies_watcher", spy)
    memory.measure_model_state_bytes("tiny", recipe)
    ((net, watched),) = built
    assert watched == {p.untyped_storage().data_ptr() for p in net.parameters()}


def test_whole_tensor_partition_is_torchs_zero_redundancy_optimizer_partition():
    """memory.whole_tensor_partition against torch's own _partition_parameters, run on the course model's
    real parameters (no process group: torch's method on a stand-in that holds what it reads)."""
    from types import SimpleNamespace

    from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

    from course_utils.models import build_model, get_config

    params = list(build_model(get_config("small"), seed=0).parameters()) + list(
        build_model(get_config("tiny"), seed=0).parameters()
    )
    for nd in (1, 2, 3, 4, 8):
        zero = SimpleNamespace(_partition_parameters_cache=[], world_size=nd, param_groups=[{"params": params}])
        zero._get_min_index = lambda values, disallowed=None, z=zero: Zero._get_min_index(z, values, disallowed)
        zero._partition_param_group = lambda group, per_rank, z=zero: Zero._partition_param_group(z, group, per_rank)
        torch_ranks = [[p.numel() for g in groups for p in g["params"]] for groups in Zero._partition_parameters(zero)]
        assert memory.whole_tensor_partition([p.numel() for p in params], nd) == torch_ranks
    # the tiny model on 4 ranks (exercise 01.1): five 16,384-element matrices on four ranks, so one rank holds two
    tiny = [p.numel() for p in build_model(get_config("tiny"), seed=0).parameters()]
    shares = [sum(r) for r in memory.whole_tensor_partition(tiny, 4)]
    assert sum(shares) == sum(tiny) and max(shares) > sum(tiny) / 4 > min(shares)
    with pytest.raises(CourseInputError, match="whole number of ranks"):
        memory.whole_tensor_partition(tiny, 0)
