"""The dress rehearsal (notebook 05b): FSDP2 on fake tensors, checked against the formulas,
torch's own tracker, a real run on gloo ranks, and bad input.

Small fake configurations keep every rehearsal here under a second or two.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from course_utils import cli
from course_utils import rehearse as R
from course_utils.errors import CourseInputError
from course_utils.labs import lab05b
from course_utils.models import GPTConfig

pytestmark = pytest.mark.skipif(R.tracker_problem() is not None, reason="torch lacks FSDPMemTracker")

#: 4 blocks, dims that divide by 2, 4 and 8; 3 ranks exercise FSDP2's padding.
SMALL = GPTConfig(vocab=512, seq=64, layers=4, width=128, heads=4)


@pytest.fixture(scope="module")
def small_runs():
    runs = {}
    for nproc in (3, 4):
        for strategy in ("full_shard", "shard_grad_op"):
            runs[nproc, strategy] = R.rehearse(SMALL, nproc, strategy)
    runs[4, "no_shard"] = R.rehearse(SMALL, 4, "no_shard")
    runs[8, "hybrid_shard"] = R.rehearse(SMALL, 8, "hybrid_shard", node_size=4)
    runs[4, "full_shard+ckpt"] = R.rehearse(SMALL, 4, "full_shard", act_ckpt=True)
    return runs


def n_tensors(cfg) -> int:
    with torch.device("meta"):
        from course_utils.models import GPT

        return len(list(GPT(cfg).parameters()))


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(R.PRESETS))
def test_every_preset_has_the_parameters_its_name_says(name):
    """Ψ counted on a real meta-device model (not a formula) within 1% of the name, and equal to the
    released checkpoint's count: "70B" in notebook 05b is notebook 05's 70e9."""
    from course_utils.models import GPT

    p = R.PRESETS[name]
    with torch.device("meta"):
        psi = sum(t.numel() for t in GPT(p.cfg).parameters())
    assert abs(psi / (float(name.rstrip("B")) * 1e9) - 1) < 0.01, (name, psi)
    assert psi == p.released == R.param_count(p.cfg)
    assert p.name.split()[0] in p.shape and f"L = {p.cfg.layers}" in p.shape


def test_presets_by_alias_and_unknown():
    assert R.preset("llama-2-7b") is R.PRESETS["6.7B"] and R.preset("70b") is R.PRESETS["70B"]
    assert R.preset("llama-3-8b") is R.PRESETS["8B"]
    with pytest.raises(CourseInputError, match="6.74B"):  # "7B" is not a size any preset has
        R.preset("7B")
    with pytest.raises(CourseInputError, match="unknown preset"):
        R.preset("9B")


# --------------------------------------------------------------------------- category totals vs formulas


@pytest.mark.parametrize("nproc", [3, 4])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_sharded_state_is_4_8_4_bytes_over_n_within_padding(small_runs, nproc, strategy):
    r = small_runs[nproc, strategy]
    psi = r.psi
    padded = R.padded_shard_numel(SMALL, nproc)
    assert psi / nproc <= padded < psi / nproc + 0.02 * psi  # padding is small...
    assert (padded == psi / nproc) == (nproc == 4)  # ...and zero when every dim 0 divides by N
    # fp32 parameter shards: 4 bytes per padded element
    assert r.after_step["Sharded Param"] == 4 * padded
    # Adam's exp_avg + exp_avg_sq: 8 bytes per element, plus one 4-byte step counter per tensor
    assert r.after_step["OptState"] == 8 * padded + 4 * n_tensors(SMALL)
    # every gradient reduced into an fp32 shard by the end of backward
    assert r.after_backward["Sharded Grad"] == 4 * padded
    # the formula's optimizer row (K = 12) against master + moments, within padding and counters
    rows = {row["item"].split(",")[0]: row for row in R.compare(r)}
    assert rows["optimizer state"]["formula"] == pytest.approx(12 * psi / nproc)
    assert rows["optimizer state"]["ratio"] == pytest.approx(1.0, rel=0.02)
    assert rows["gradients"]["ratio"] == pytest.approx(2.0, rel=0.02)  # fp32, not 16-bit


def test_full_shard_model_state_matches_zero3_row(small_runs):
    r = small_runs[4, "full_shard"]
    row = next(x for x in R.compare(r) if x["item"] == "model states at rest")
    assert row["formula"] == pytest.approx(16 * r.psi / 4)
    assert row["rehearsal"] == 16 * r.psi / 4 + 4 * n_tensors(SMALL)  # 4 + 4 + 8 = 2 + 2 + 12


def test_full_shard_peak_is_below_shard_grad_op(small_runs):
    for nproc in (3, 4):
        fs, sgo = small_runs[nproc, "full_shard"], small_runs[nproc, "shard_grad_op"]
        assert fs.peak_bytes < sgo.peak_bytes
        # SHARD_GRAD_OP holds the whole bf16 working copy at once (the 2Ψ of stage 2)...
        assert sgo.category_peaks["Unsharded Param"] == pytest.approx(2 * sgo.psi, rel=0.01)
        # ...FULL_SHARD only a couple of units of it
        assert fs.category_peaks["Unsharded Param"] < 0.6 * sgo.category_peaks["Unsharded Param"]
        assert sum(fs.peak.values()) == fs.peak_bytes


def test_no_shard_and_hybrid(small_runs):
    ns, hy = small_runs[4, "no_shard"], small_runs[8, "hybrid_shard"]
    assert ns.nd == 1 and ns.after_step["Sharded Param"] == 4 * ns.psi
    assert ns.after_step["Sharded Param"] + ns.after_step["Sharded Grad"] + ns.after_step[
        "OptState"
    ] == 16 * ns.psi + 4 * n_tensors(SMALL)
    assert hy.nd == 4 and hy.after_step["Sharded Param"] == 4 * hy.psi / 4  # sharded within a node of 4
    # a rank of HYBRID_SHARD in nodes of 4 holds what a rank of FULL_SHARD on 4 ranks holds
    assert hy.peak == small_runs[4, "full_shard"].peak and hy.peak_bytes < ns.peak_bytes


def test_activation_checkpointing_lowers_activations(small_runs):
    plain, ckpt = small_runs[4, "full_shard"], small_runs[4, "full_shard+ckpt"]
    assert ckpt.peak["Activation"] < plain.peak["Activation"]
    assert ckpt.peak_bytes < plain.peak_bytes
    assert ckpt.after_step == plain.after_step  # checkpointing changes activations, not model states


def test_fast_tracker_records_what_torchs_tracker_records():
    cfg = GPTConfig(vocab=256, seq=32, layers=2, width=64, heads=4)
    a = R.rehearse(cfg, 4, "full_shard", act_ckpt=True)
    b = R.rehearse(cfg, 4, "full_shard", act_ckpt=True, stock_tracker=True)
    for attr in ("peak", "category_peaks", "after_backward", "after_step", "peak_bytes"):
        assert getattr(a, attr) == getattr(b, attr), attr


def test_tables_and_charts_render(small_runs):
    from course_utils.plots import png

    runs = [small_runs[4, "full_shard"], small_runs[4, "shard_grad_op"], small_runs[4, "full_shard+ckpt"]]
    from course_utils.plan import Cluster

    c = Cluster()  # a GPU whose usable memory (the planner's fits test) is 5.8 MB of tensors: two of three fit
    view = R.bars_view(runs, gpu_mem=c.context + (1 + c.reserve) * 5.8e6, planned={"NO_SHARD": 1e7})
    assert view["title"].startswith("2 of 3 rehearsed fit") and view["usable"] == pytest.approx(5.8e6)
    rows = R.summary_rows(runs)
    for fig in (R.rehearsal_figure(view), R.agreement_figure(rows)):
        assert png(fig)[:4] == b"\x89PNG"
    tables = (
        R.markdown_table(runs, gpu_mem=80e9),
        R.markdown_summary(rows),
        R.markdown_compare(runs[0], R.compare(runs[0])),
    )
    for text in tables:
        assert text.count("\n|") >= 3
    assert all(f"| {r.peak_at} |" in tables[0] for r in runs)  # each rehearsal's own moment, as the tracker saw it


def test_fp32_mode_maps_to_plain_fp32_adam():
    r = R.rehearse(GPTConfig(vocab=256, seq=32, layers=2, width=64, heads=4), 4, "full_shard", mixed_precision="fp32")
    rows = {row["item"].split(" (")[0].split(",")[0]: row for row in R.compare(r)}
    assert rows["fp32 weights"]["ratio"] == pytest.approx(1.0)
    assert rows["gradients"]["ratio"] == pytest.approx(1.0)
    assert rows["optimizer state"]["ratio"] == pytest.approx(1.0, rel=0.01)


def test_block_saves_16_numbers_per_token_per_width():
    """The count the comparison quotes: saved-tensor hooks on one real bf16 block."""
    from course_utils.models import Block

    cfg = GPTConfig(vocab=64, seq=64, layers=1, width=128, heads=4)
    block = Block(cfg).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randn(1, cfg.seq, cfg.width, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    per = sum(seen.values()) / 2 / (cfg.seq * cfg.width)
    assert per == pytest.approx(R.BLOCK_SAVED_PER_TOKEN_WIDTH, abs=0.1)


def test_planner_on_a_preset_shape():
    """A 2-block slice of Llama 2 7B (its real width, vocabulary, sequence) on 8 ranks: the model
    states agree to the step counters. (The peak is checked at full depth in notebook 05b: in a
    2-block slice the working set of about two blocks is as large as all the model states.)"""
    cfg = R.model_config("6.7B", layers=2)
    r = R.rehearse(cfg, 8, "full_shard", act_ckpt=True)
    a = R.agreement(r)
    assert a["model_states"] == pytest.approx(1.0, abs=R.MODEL_STATE_TOL)
    assert a["optimizer"] == pytest.approx(1.0, abs=R.MODEL_STATE_TOL)
    assert r.peak_bytes > R.predict(r)["model_states"]
    assert not a["peak_claim_applies"]  # shallow: the notebook's peak tolerance does not claim it


def test_peak_errors_add_up_to_the_planners_gap(small_runs):
    """The planner's items minus the tracker's parts at the peak add up to planner − peak: every tracker
    category is held against exactly one planner item, none left out or counted twice."""
    members = [part for parts in R.PEAK_ITEMS.values() for part in parts]
    assert sorted(members) == sorted(R.PARTS)
    for r in small_runs.values():
        e = R.peak_errors(r)
        assert sum(e[k] for k in R.PEAK_ITEMS) == pytest.approx(e["total"], rel=1e-9, abs=1)
        assert e["total"] == pytest.approx(R.predict(r)["total"] - r.peak_bytes)


def test_a_llama_block_rehearses_and_holds_16_bytes_per_parameter():
    cfg = GPTConfig(
        vocab=256, seq=32, layers=2, width=64, heads=4, kv_heads=2, mlp_hidden=96, arch="llama", tie_weights=False
    )
    r = R.rehearse(cfg, 4, "full_shard")
    assert r.after_step["Sharded Param"] + r.after_step["OptState"] + r.after_step[
        "Sharded Grad"
    ] == 16 * R.padded_shard_numel(cfg, 4) + 4 * n_tensors(cfg)


def test_background_rehearsal_equals_the_foreground_one(small_runs):
    job = R.start_rehearsals(SMALL, 4, ["full_shard+ckpt"])
    here = small_runs[4, "full_shard+ckpt"]  # R.rehearse(SMALL, 4, "full_shard", act_ckpt=True), in this process
    (there,) = job.result(timeout_s=120)
    assert there.peak == here.peak and there.after_step == here.after_step


def test_refuses_inside_a_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CourseInputError, match="fresh process"):
            R.rehearse(SMALL, 2)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the bridge to reality


def test_rehearsal_matches_a_real_run_on_two_gloo_ranks():
    rows = lab05b.bridge(2, ("full_shard", "no_shard"))
    for row in rows:
        assert row["equal"], row
        assert set(row["real"]) == {0, 1}
    assert rows[0]["rehearsal"]["params"] * 2 == rows[1]["rehearsal"]["params"]


# --------------------------------------------------------------------------- the command line


def run_cli(capsys, *args):
    code = cli.main(["rehearse", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_text_and_json(capsys):
    shape = ["--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--seq", "32"]
    code, out, err = run_cli(capsys, *shape, "--nproc", "4", "--strategy", "shard_grad_op")
    assert code == 0 and "SHARD_GRAD_OP on 4 ranks" in out and "peak per rank" in out
    assert "buffers: two 25 MB gradient buckets)" in out  # the first planner's buckets only where weights are whole
    code, out, err = run_cli(capsys, *shape, "--nproc", "4")
    assert code == 0 and "buffers: a gathered block twice and its 16-bit gradient)" in out
    code, out, err = run_cli(
        capsys, *shape, "--nproc", "16", "--strategy", "hybrid_shard", "--node-size", "4", "--act-ckpt", "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["nd"] == 4 and data["act_ckpt"] and data["peak_bytes"] == sum(data["peak"].values())
    assert {row["item"] for row in data["comparison"]} >= {"peak per rank", "model states at rest"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nproc", "0"], "nproc"),
        (["--nproc", "1025"], "1,024"),
        (["--params", "6.7B", "--width", "100", "--heads", "32"], "not divisible"),
        (["--params", "9B"], "unknown preset"),
        (["--strategy", "hybrid_shard", "--nproc", "12", "--node-size", "8"], "node"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--layers", "-1"], "--layers"),
        (["--recompute", "some"], "recomputation policy"),
        (["--act-ckpt", "--recompute", "selective"], "not both"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_strategy_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["rehearse", "--strategy", "zero4"])
    assert exc.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_missing_tracker_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.fsdp2_mem_tracker", None)
    assert "FSDP2 memory tracker" in R.tracker_problem() and R.PINNED_TORCH in R.tracker_problem()
    code, out, err = run_cli(capsys, "--layers", "2", "--width", "64", "--heads", "4", "--nproc", "2")
    assert code == 2 and "cannot rehearse" in err and len(err.strip().splitlines()) == 1


def test_pinned_torch_is_the_constraint():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "constraints.txt").read_text()
    assert f"torch=={R.PINNED_TORCH}" in text


# --------------------------------------------------------------------------- recomputation policies (issue 32)


def test_the_planners_recomputation_policies_rehearse_in_order(small_runs):
    """The rehearsal supports the planner's policies: full (torch's checkpoint_wrapper) keeps exactly what the
    composable checkpoint keeps; selective and every:2 lie between none and full."""
    plain, composable = small_runs[4, "full_shard"], small_runs[4, "full_shard+ckpt"]
    runs = {p: R.rehearse(SMALL, 4, "full_shard", recompute=p) for p in ("full", "selective", "every:2")}
    assert runs["full"].peak_bytes == composable.peak_bytes and runs["full"].recompute == "full"
    for p in ("selective", "every:2"):
        assert composable.peak["Activation"] < runs[p].peak["Activation"] < plain.peak["Activation"], p
        assert runs[p].after_step == plain.after_step
    assert R.parse_setting("full_shard+every4") == {"strategy": "full_shard", "act_ckpt": False, "recompute": "every:4"}
    assert R.parse_setting("shard_grad_op+selective")["recompute"] == "selective"
    for bad in ("full_shard+every", "full_shard+everyx", "full_shard+fast"):
        with pytest.raises(CourseInputError):
            R.parse_setting(bad)


def test_the_throughput_planner_is_calibrated_per_term_on_llama_2_7b():
    """Both extremes on a preset (Llama 2 7B, FULL_SHARD on 8 fake ranks), and SHARD_GRAD_OP with full
    recomputation: after calibration every term is within 12% and the peak within 3% (before: the paper's
    activation rule, 35% short); the CPU kernels' share is counted independently: RMSNorm's composite path keeps
    12h more bytes per token per block and 6h for the final norm (fp32 input and product instead of the bf16
    input), none of which a CUDA run keeps."""
    runs = [R.rehearse("6.7B", 8, "full_shard", recompute=p) for p in ("none", "full")]
    keep = R.rehearse("6.7B", 8, "shard_grad_op", recompute="full")
    rows = {(r["policy"], r["term"]): r for r in R.calibration_rows(runs)}
    kept = {r["term"]: r for r in R.calibration_rows([keep])}
    for (policy, term), row in [*rows.items(), *(((keep.label, t), r) for t, r in kept.items())]:
        assert abs(row["after_error"]) < (0.03 if term == "peak" else 0.12), (policy, term, row["after_error"])
    # SHARD_GRAD_OP keeps every block's bf16 weights from its forward to its backward, and FSDP2 frees each block's
    # after that block's backward (reshard_after_backward): the step peaks in the first block's backward, with every
    # block's weights, as the planner puts it; late in the backward only one block's are left
    assert keep.peak["Unsharded Param"] > 0.9 * 2 * keep.psi and kept["peak"]["moment"] == "first block's backward"
    assert R.planner_terms(keep)["peak moment"] == "first block's backward"
    assert rows["none", "peak"]["before_error"] < -0.30
    assert all(row["in_sample"] for row in rows.values())  # the fit saw Llama 2 7B at both extremes
    # the cheap measurement of every preset (3 to 5 blocks, extrapolated block by block) is this one, to the byte
    whole = {row["term"]: row["measured"] for row in R.preset_calibration("6.7B", "full")}
    assert whole == R.measured_terms(runs[1])
    h, T, L = 4096, 4096, 32
    assert rows["none", "activations"]["cpu_artefact"] == pytest.approx((12 * h * L + 6 * h) * T)
    # the peak's share is taken at the moment the rehearsal peaked: every norm at the end of the forward without
    # recomputation, one rebuilt block's late in backward with full
    assert rows["none", "peak"]["cpu_artefact"] == pytest.approx((12 * h * L + 6 * h) * T)
    assert rows["full", "peak"]["cpu_artefact"] == pytest.approx(12 * h * T)


#: Terms of the five presets outside 10%, and why: at a peak late in backward under full recomputation the tracker
#: files the head's gradient under temporaries (an activation category here) where the planner books it as a
#: gradient (notebook 05b, section 10), so the planner's activations come out short and its states and buffers
#: long; the peak itself is within 2.5% in every such setting, and on Llama the activations within 10% once the
#: head's gradient is taken out (GPT-2 XL's tied head: its own test below). The bound each is held to, so that a
#: change that moves it shows.
RESIDUALS = {
    (
        "1.56B",
        "full",
        "activations",
    ): 0.85,  # 0.09 GB planned against 0.49 GB: the tied head's three V x h tensors (below)
    ("6.7B", "full", "activations"): 0.15,
    ("13B", "full", "activations"): 0.15,
    ("70B", "full", "activations"): 0.25,
}


@pytest.mark.slow  # about 30 CPU s for the ten settings
@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("name", ["1.56B", "6.7B", "8B", "13B", "70B"])
def test_every_preset_is_calibrated_at_both_recomputation_extremes(name, policy):
    """Every preset, FULL_SHARD on 8 fake ranks, no recomputation and full: each term the rehearsal measures at
    three consecutive depths grows by the same bytes per block (to the byte), so the preset's whole depth is
    extrapolated; the planner priced at that depth is within 10% on every term, or the residual is named above."""
    for row in R.preset_calibration(name, policy):
        assert row["linear"], row
        bound = RESIDUALS.get((name, policy, row["term"]), 0.10)
        assert abs(row["after_error"]) < bound, (name, policy, row["term"], row["after_error"])
        if (name, policy, row["term"]) in RESIDUALS:
            assert row["moment"] == "backward" and abs(row["after_error"]) >= 0.10  # still a residual
            cfg = R.model_config(name)
            if not cfg.tie_weights:  # Llama: the residual is the head's bf16 gradient; without it, within 10%
                assert abs(row["after"] / (row["measured"] - cfg.vocab * cfg.width * 2) - 1) < 0.10, (name, row)


def test_the_calibrated_planner_holds_on_models_and_policies_it_was_not_fitted_to():
    """Held out (05b's calibration table is fitted on its own rehearsals: Llama 2 7B and Llama 3 70B at the two
    extremes, and Llama 3 8B for the loss): Llama 2 13B (40 blocks of width 5120) with full recomputation, and
    GPT-2 XL (another block: LayerNorm, GELU, biases, a tied head) under the two policies between the extremes,
    selective and every 4th block, FULL_SHARD on 8 fake ranks. The peak is within 3% and each term within what
    05b's table shows, so the constants are the models', not the fit's."""
    runs = [R.rehearse("13B", 8, "full_shard", recompute="full")]
    runs += [R.rehearse("1.56B", 8, "full_shard", recompute=p) for p in ("selective", "every:4")]
    rows = {(r["label"], r["policy"], r["term"]): r for r in R.calibration_rows(runs)}
    assert len(rows) == 9 and not any(r["in_sample"] for r in rows.values())  # 05b's table says "held out"
    for (_, policy, term), row in rows.items():
        tol = {"peak": 0.03, "states and buffers": 0.05, "activations": 0.15 if policy == "full" else 0.03}[term]
        assert abs(row["after_error"]) < tol, (policy, term, row["after_error"])


def _probe_reduce_scatters(monkeypatch, look):
    """Run ``look(tracker, output, input)`` just before each of FSDP2's reduce-scatters of the next rehearsal on fake
    ranks (the tracker the rehearsal made, captured by subclassing it); returns the list of what it returned."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    import course_utils.rehearse.run as run

    trackers, seen = [], []
    make_tracker, call = run.tracker_class, collectives.DefaultReduceScatter.__call__

    def capturing():
        class Capturing(make_tracker()):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                trackers.append(self)

        return Capturing

    def probed(self, output_tensor, input_tensor, *args, **kwargs):
        seen.append(look(trackers[-1], output_tensor, input_tensor))
        return call(self, output_tensor, input_tensor, *args, **kwargs)

    monkeypatch.setattr(run, "tracker_class", capturing)
    monkeypatch.setattr(collectives.DefaultReduceScatter, "__call__", probed)
    return seen


def test_the_real_ranks_extra_temp_is_fsdp2s_own_reduce_scatter_buffers(monkeypatch):
    """Notebook 05b §3: real gloo ranks record more Temp than the rehearsal, by the largest reduce-scatter's input
    and one-shard output. Both worlds hold those buffers: FSDP2's ``foreach_reduce`` allocates them and the tracker
    files them under Temp until ``c10d._reduce_scatter_base_`` relabels the input. Probed just before the call on
    fake ranks, Temp is the rehearsal's Temp peak plus both: a moment the rehearsal never writes down (the fake
    group allocates nothing inside the call, so no new peak), which gloo's clone of the input makes a peak."""

    def temp_before(tracker, output_tensor, input_tensor):
        snapshot = next(iter(tracker.get_tracker_snapshot().values()))
        return input_tensor.nbytes, output_tensor.nbytes, snapshot["Temp"]

    seen = _probe_reduce_scatters(monkeypatch, temp_before)
    r = R.rehearse("tiny", 4, "full_shard")
    largest_in, largest_out, temp = max(seen)
    assert largest_in == r.category_peaks["Reduce Scatter"] and largest_out * 4 == largest_in
    assert temp == r.category_peaks["Temp"] + largest_in + largest_out


def test_shard_grad_op_reduces_a_block_after_its_backward_freed_its_activations(monkeypatch):
    """Notebook 05b §9: the calibrated planner's peak for SHARD_GRAD_OP on the small model comes in the first
    block's backward, which it prices at once: the block's fp32 reduce-scatter input beside that block's saved
    activations and backward working set. FSDP2 builds the input in ``post_backward``, after the backward freed
    them: probed at each reduce-scatter on fake ranks, the tracker's activations are the not-yet-reduced blocks'
    only, the same bytes for each, and at the last block's reduce-scatter nothing of any block."""
    from course_utils.rehearse.tracker import _categories

    seen = _probe_reduce_scatters(
        monkeypatch, lambda tracker, *_: _categories(tracker.get_tracker_snapshot())["Activation"]
    )
    r = R.rehearse("small", 4, "shard_grad_op")
    L = r.cfg.layers
    steps = [a - b for a, b in zip(seen[: L - 1], seen[1:L])]  # the blocks, last first
    assert len(set(steps)) == 1 and steps[0] > 0 and seen[L - 1] < steps[0] / 100  # then nothing of any block
    assert R.planner_terms(r)["peak moment"] == "first block's backward"
    assert R.planner_moments(r)["one block kept"] == steps[0]  # the block the planner prices there, to the byte
    # the step itself peaks in the forward, right after the loss, with the last block's all-gather output still held
    # (SHARD_GRAD_OP: only the root's post_forward frees it): the planner books it, and there it is within 5%
    from course_utils.plan.implementations import LAST_GATHER

    terms, booked = R.planner_terms(r), R.calibration._planned(r)["buffers"][LAST_GATHER]
    assert r.peak_at == "forward of GPT" and terms["moment"] == "end of forward"
    assert abs(r.peak["All Gather"] / booked - 1) < 0.01 and abs(terms["at moment"] / r.peak_bytes - 1) < 0.05


def test_the_held_out_activation_residual_is_the_heads_gradient():
    """Notebook 05b §10: under full recomputation on Llama 2 the planner's activations come out short at the late
    backward peak by the head's unsharded bf16 gradient (the tracker files it under Temp, the planner books it as a
    gradient): halve the vocabulary and the shortfall falls by exactly the bytes of the half of the head removed."""
    from dataclasses import replace

    from course_utils.rehearse.calibration import measured_terms, planner_terms

    cfg = R.model_config("13B", layers=3)

    def shortfall(vocab):
        r = R.rehearse(replace(cfg, vocab=vocab), 8, "full_shard", recompute="full")
        assert planner_terms(r)["moment"] == "late backward"
        return measured_terms(r)["activations"] - planner_terms(r)["activations"]

    assert shortfall(cfg.vocab) - shortfall(cfg.vocab // 2) == (cfg.vocab - cfg.vocab // 2) * cfg.width * 2


def test_gpt2_xls_residual_is_its_tied_heads_three_gradients():
    """Notebook 05b §10: GPT-2 XL under full recomputation peaks late in backward, in the embedding's backward after
    every block's. What the tracker holds there as activations is, to the byte, three V x h bf16 tensors (the tied
    weight's gradient from the head, its gradient from the embedding, and the sum autograd adds them into) and the
    position embedding's and final norm's bf16 gradients: nothing of any block (the depth does not change it)."""
    from course_utils.rehearse.calibration import planner_terms

    cfg = R.model_config("1.56B", layers=13)  # the first depth that peaks where the whole model does
    r = R.rehearse(cfg, 8, "full_shard", recompute="full")
    assert cfg.tie_weights and planner_terms(r)["moment"] == "late backward"
    assert r.peak["Temp"] == 3 * cfg.vocab * cfg.width * 2 + cfg.seq * cfg.width * 2 + 2 * cfg.width * 2
    assert r.peak.get("Activation", 0) < cfg.width  # no block's tensor is alive


def test_full_shard_gathers_the_root_and_one_block_padded_to_the_ranks():
    """05b's "to the byte" check of FULL_SHARD's gathered bf16 weights holds where FSDP2 pads (the twenty-third
    reading: GPT-2 XL's 50,257-row vocabulary on 8 ranks, and Llama 2 on 6, failed it unpadded)."""
    for name, nproc in (("1.56B", 8), ("6.7B", 6)):
        r = R.rehearse(R.model_config(name, layers=2), nproc, "full_shard")
        g = R.gathered_unit_bytes(r.cfg, nproc)
        assert r.category_peaks["Unsharded Param"] == g["root"] + g["block"], name
    xl = R.model_config("1.56B")
    unpadded = 2 * (xl.vocab * xl.width + xl.seq * xl.width + 2 * xl.width)
    assert R.gathered_unit_bytes(xl, 8)["root"] - unpadded == 2 * (50264 - 50257) * xl.width


def test_a_chart_label_names_the_recomputation_policy():
    """05b's summary chart: "+full", "+selective" and "+every4" runs are told apart from the plain one."""
    labels = {
        s: R.short_label(R.rehearse(R.model_config("6.7B", layers=2), 8, **R.parse_setting(s)))
        for s in ("full_shard", "full_shard+ckpt", "full_shard+selective", "full_shard+every4")
    }
    assert len(set(labels.values())) == 4 and labels["full_shard+every4"].endswith("+every4"), labels
