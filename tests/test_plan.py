"""course_utils.plan: the decision rule's cases from the reference material, the CLI, bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from course_utils import memory, plan
from course_utils.cli import main
from course_utils.errors import CourseInputError
from course_utils.units import GB

ZERO_100B = dict(model=plan.model_spec(layers=125, width=8192, vocab=50257, seq=1024, micro_batch=32),
                 cluster=plan.Cluster(gpus_per_node=16, nodes=25, gpu_mem=32 * GB, mp=16, intra_bw=300e9,
                                      inter_bw=100e9, flops=38e12))


def test_7b_on_one_node_chooses_stage_1_with_room():
    p = plan.plan(params=7e9)
    assert p.recommendation["strategy"] == "zero1"
    assert not p.strategies["ddp"].fits
    assert p.strategies["zero1"].headroom > 20 * GB
    assert "a tie goes to the lower stage" in p.recommendation["reason"]  # stage 2's step time is the same
    assert p.recommendation["runner_up"] == "zero2"
    assert "ZeroRedundancyOptimizer" in p.recommendation["pytorch"]  # FSDP has no stage 1
    assert "FULL_SHARD" in p.recommendation["practice"]  # stage 3's gathers hide on one node


def test_70b_floors_and_stage_3_only_on_four_nodes():
    p = plan.plan(plan.model_spec(70e9), plan.Cluster(nodes=4))
    for s in ("ddp", "zero1", "zero2", "hsdp", "zero2_offload"):
        assert not p.strategies[s].fits, s
    assert p.strategies["zero3"].fits
    assert p.recommendation["strategy"] == "zero3"
    assert memory.floor_bytes(70e9, "zero1") == 280 * GB and memory.floor_bytes(70e9, "zero2") == 140 * GB
    huge = plan.plan(plan.model_spec(70e9), plan.Cluster(nodes=128))
    assert not huge.strategies["zero1"].fits and not huge.strategies["zero2"].fits


def test_70b_on_one_node_needs_offload_or_more_gpus():
    p = plan.plan(plan.model_spec(70e9), plan.Cluster(nodes=1))
    assert p.strategies["zero3"].model_states == 140 * GB and not p.strategies["zero3"].fits
    assert p.recommendation["strategy"] == "zero3_offload"
    assert "offload" in p.recommendation["reason"] and "nodes" in p.recommendation["reason"]
    assert p.limits["zero3_min_gpus"] > 8
    assert p.strategies["zero3_offload"].step_s > p.strategies["zero3"].step_s


def test_slow_ethernet_stage_3_cannot_hide_and_stage_2_is_faster():
    p = plan.plan(plan.model_spec(13e9), plan.Cluster(nodes=2, inter_bw=1.25e9))
    z2, z3 = p.strategies["zero2"], p.strategies["zero3"]
    assert z2.fits and z3.fits
    assert not z3.block["hides_fwd"] and not z3.block["hides_bwd"]
    assert z3.step_s > z2.step_s
    # issue 18: the planner used to recommend stage 1 here (39.0 s a step) beside HSDP's 21.1 s
    hsdp = p.strategies["hsdp"]
    assert hsdp.fits and hsdp.step_s < z2.step_s < z3.step_s
    r = p.recommendation
    assert r["strategy"] == "hsdp" and r["runner_up"] == "zero1"
    assert r["step_s"]["hsdp"] == hsdp.step_s and r["step_s"]["zero1"] == p.strategies["zero1"].step_s
    assert f"{p.strategies['zero1'].step_s - hsdp.step_s:.3g} s a step" in r["reason"]
    assert "HYBRID_SHARD" in r["pytorch"] and "init_device_mesh('cuda', (2, 8)" in r["pytorch"]
    fast = plan.plan(plan.model_spec(13e9, micro_batch=4), plan.Cluster(nodes=2, inter_bw=100e9))
    assert fast.strategies["zero3"].block["hides_fwd"] and fast.strategies["zero3"].block["hides_bwd"]


def test_activation_bound_no_stage_helps():
    p = plan.plan(plan.model_spec(7e9, seq=65536, micro_batch=4), plan.Cluster(nodes=8))
    assert p.recommendation["strategy"] == "none"
    assert p.recommendation["reason"].startswith(plan.NOTHING_FITS)
    assert p.limits["activations_limit"] and not any(sp.fits for sp in p.strategies.values())
    more = plan.plan(plan.model_spec(7e9, seq=65536, micro_batch=4), plan.Cluster(nodes=128))
    assert more.recommendation["strategy"] == "none"  # more GPUs do not help


def test_a_layer_too_large_to_gather():
    p = plan.plan(plan.model_spec(layers=4, width=65536), plan.Cluster(nodes=128))
    assert p.recommendation["strategy"] == "none"
    assert p.limits["single_layer_limit"] and "layer" in p.recommendation["reason"]
    assert p.strategies["zero3"].model_states < 10 * GB  # the model states alone would fit


def test_zero_100b_setting_fits_with_stage_2():
    p = plan.plan(ZERO_100B["model"], ZERO_100B["cluster"])
    assert round(ZERO_100B["model"].params / 1e9, 1) == 101.1
    assert ZERO_100B["cluster"].nd == 25
    assert p.strategies["zero2"].fits and not p.strategies["zero1"].fits
    assert p.recommendation["strategy"] == "zero2"
    assert "hsdp" not in p.strategies  # one model-parallel group per node leaves nothing to shard


def test_the_recommendation_is_the_fastest_that_fits_with_ties_to_the_lower_stage():
    cases = [plan.plan(params=7e9), plan.plan(plan.model_spec(70e9), plan.Cluster(nodes=4)),
             plan.plan(plan.model_spec(13e9), plan.Cluster(nodes=2, inter_bw=1.25e9)),
             plan.plan(ZERO_100B["model"], ZERO_100B["cluster"])]
    for p in cases:
        fits = [s for s in plan.STRATEGIES if s in p.strategies and p.strategies[s].fits]
        best = min(p.strategies[s].step_s for s in fits)
        chosen = p.recommendation["strategy"]
        assert p.strategies[chosen].step_s <= best * (1 + plan.TIE_MARGIN)
        # no strategy lower in the order was within the margin
        lower = fits[:fits.index(chosen)]
        assert all(p.strategies[s].step_s > best * (1 + plan.TIE_MARGIN) for s in lower)
        if chosen != "hsdp":  # HSDP's line names its mesh shape
            assert p.recommendation["pytorch"] == plan.PYTORCH[chosen]


def test_hsdp_picks_the_smallest_shard_group_that_fits():
    # issue 18: a shard group may span nodes (a 2-D mesh of any shape), not only one node
    p = plan.plan(plan.model_spec(70e9), plan.Cluster(nodes=8))
    assert plan.hsdp_shard_sizes(p.cluster) == [8, 16, 32]
    h = p.strategies["hsdp"]
    assert h.fits and h.shard_size == 32  # 8 and 16 GPUs per group hold 140 and 70 GB of model states: too many
    assert h.model_states == 16 * 70e9 / 32
    for n in (8, 16):
        assert plan.memory_breakdown(p.model, p.cluster, "hsdp", shard_size=n)["total"] > p.cluster.usable
    assert "network" in h.block["link"]  # a 4-node group gathers across nodes
    one = plan.plan(plan.model_spec(13e9), plan.Cluster(nodes=2, inter_bw=1.25e9)).strategies["hsdp"]
    assert one.shard_size == 8 and "NVLink" in one.block["link"]


def test_the_network_is_labelled_by_what_it_is():
    assert "modest" in plan.network_class(50e9)  # the default: 4 x 100 Gb/s per node
    assert "current training cluster" in plan.network_class(8 * 50e9)  # 8 x 400 Gb/s NICs
    assert "10 GbE" in plan.network_class(1.25e9)
    assert "modest" in plan.format_plan(plan.plan(params=7e9))
    assert plan.plan(params=7e9).to_dict()["cluster"]["network"] == plan.network_class(50e9)


def test_trillion_budget_and_days():
    assert round(memory.model_state_bytes(1e12, 1024, "zero3") / GB, 1) == 15.6
    assert round(plan.training_days(67, 3000), 1) == 139.6


def test_offload_arithmetic():
    o = plan.offload_arithmetic(70e9, 8)
    assert o["optimizer_offload"]["bytes"] == 4 * 70e9 / 8
    assert o["parameter_offload"]["bytes"] == 2 * o["optimizer_offload"]["bytes"]
    assert o["hbm_over_pcie"] == 80
    assert o["optimizer_offload"]["pcie_s"] == pytest.approx(80 * o["optimizer_offload"]["hbm_s"])


def test_pipeline_bubble():
    assert round(plan.bubble_fraction(4, 4), 3) == 0.429
    assert round(plan.bubble_fraction(4, 32), 3) == 0.086


def test_memory_breakdown_matches_memory_module():
    m, c = plan.model_spec(7e9), plan.Cluster()
    for s in ("ddp", "zero1", "zero2", "zero3"):
        b = plan.memory_breakdown(m, c, s)
        assert b["model_states"] == pytest.approx(memory.model_state_bytes(m.params, 8, s))
        assert b["total"] == pytest.approx(b["model_states"] + b["activations"] + b["buffers"])
    off = plan.memory_breakdown(m, c, "zero3_offload")
    assert off["optimizer"] == 0 and off["host_bytes"] == pytest.approx(12 * m.params / 8)


def test_model_spec_from_params_is_gpt_like():
    m = plan.model_spec(70e9)
    assert 0.9 < plan.shape_params(m.layers, m.width, m.vocab) / 70e9 < 1.1
    assert m.width % m.heads == 0 and 60 <= m.layers <= 90


@pytest.mark.parametrize("params, width, heads", [
    ("7B", 4096, 32), ("13B", 5120, 40), ("175B", 12288, 96),  # LLaMA 7B and 13B, GPT-3: the published widths
])
def test_shape_from_params_alone_lands_on_published_widths(params, width, heads):
    m = plan.model_spec(params)
    assert (m.width, m.heads) == (width, heads) and m.width % plan.WIDTH_STEP == 0
    assert plan.shape_params(m.layers, m.width, m.vocab) == pytest.approx(plan.parse_count(params), rel=0.05)


def test_overlap_crossover_is_flops_over_bandwidth():
    r = plan.overlap_ratio([1000.0, 4000.0], 4096, flops=200e12, bandwidth=50e9, n=32)
    assert r[1] == pytest.approx(4 * r[0])
    cross = 200e12 * 2 * (31 / 32) / (2 * 50e9)
    assert plan.overlap_ratio(cross, 4096, flops=200e12, bandwidth=50e9, n=32) == pytest.approx(1.0)
    curve = plan.overlap_curve(plan.model_spec(7e9), plan.Cluster(nodes=4), np.array([1e3, 1e4]))
    assert curve["crossover_intra"] < curve["crossover_network"]


@pytest.mark.parametrize("bad", [
    lambda: plan.Cluster(nodes=0),
    lambda: plan.Cluster(gpus_per_node=0),
    lambda: plan.Cluster(inter_bw=-1.0),
    lambda: plan.Cluster(mp=3),
    lambda: plan.model_spec(layers=4, width=100, heads=3),
    lambda: plan.model_spec(1e6),
    lambda: plan.model_spec(7e9, layers=80, width=8192),
    lambda: plan.model_spec(0),
    lambda: plan.model_spec(7e9, micro_batch=0),
    lambda: plan.parse_bandwidth("-5GB/s"),
    lambda: plan.parse_bandwidth("fast"),
    lambda: plan.bubble_fraction(0, 4),
])
def test_bad_input_raises(bad):
    with pytest.raises(CourseInputError):
        bad()


def test_parse_bandwidth_bits_and_bytes():
    assert plan.parse_bandwidth("200GB/s") == 200e9
    assert plan.parse_bandwidth("400Gb/s") == 50e9
    assert plan.parse_bandwidth("100Gbps") == 12.5e9
    assert plan.parse_bandwidth("2TB/s") == 2e12
    assert plan.parse_bandwidth(25) == 25e9


def test_cli_plan_defaults_and_json(capsys):
    assert main(["plan", "--params", "7B"]) == 0
    text = capsys.readouterr().out
    assert "Recommendation: zero1" in text and "Reason:" in text
    assert main(["plan", "--params", "70B", "--nodes", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommendation"]["strategy"] == "zero3" and out["recommendation"]["reason"]
    assert set(out["strategies"]) == set(plan.STRATEGIES)
    z3 = out["strategies"]["zero3"]
    for key in ("model_states", "activations", "buffers", "total", "fits", "headroom", "block", "step_comm_bytes",
                "step_s"):
        assert key in z3
    assert main(["plan", "--params", "7B", "--seq", "65536", "--micro-batch", "4", "--no-checkpointing",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommendation"]["strategy"] == "none"


@pytest.mark.parametrize("argv, names", [
    (["plan", "--params", "7B", "--nodes", "0"], "--nodes"),
    (["plan", "--params", "7B", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["plan", "--params", "7B", "--inter-bw", "-10GB/s"], "--inter-bw"),
    (["plan", "--params", "7B", "--intra-bw", "fast"], "--intra-bw"),
    (["plan", "--params", "7X"], "--params"),
    (["plan"], "--params"),
    (["plan", "--layers", "4", "--width", "100", "--heads", "3"], "heads"),
    (["plan", "--params", "1M"], "cannot exist"),
    (["plan", "--params", "7B", "--gpu-mem", "0GB"], "--gpu-mem"),
    (["plan", "--params", "7B", "--tflops", "-3"], "--tflops"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, names):
    proc = subprocess.run([sys.executable, "-m", "course_utils", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in proc.stderr
