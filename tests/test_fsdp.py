"""FSDP strategies (notebook 04) against the one-process reference and the formulas.

One launch of 4 gloo ranks trains ``single`` and every strategy (FSDP2 and FSDP1) on the same
tiny model and data; the assertions share it. ``train()`` is checked to give the same run as the
experiment harness, and the state-dict demo runs once on 2 ranks.
"""

from __future__ import annotations

import pytest

from course_utils import apply, predict, strategies
from course_utils.errors import CourseInputError
from course_utils.labs import lab04
from course_utils.models import build_model, get_config, param_count
from course_utils.train import TrainConfig, train

MODEL = "tiny"
NPROC, NODE = 4, 2
STRATEGIES = strategies.FSDP_STRATEGIES


@pytest.fixture(scope="module")
def rows():
    runs = [dict(strategy="single")]
    runs += [dict(strategy=s, cross_check=True) for s in STRATEGIES]
    runs += [dict(strategy=s, options={"api": "fsdp1"}, label=f"{s}/fsdp1") for s in STRATEGIES]
    runs += [
        dict(strategy="full_shard", options={"prefetch": "none"}, label="no prefetch"),
        dict(strategy="full_shard", precision="mixed", label="mixed"),
    ]
    for run in runs:
        run.update(model=MODEL, node_size=NODE)
    return {r["label"]: r for r in lab04.run_experiments(runs, nproc=NPROC)}


@pytest.fixture(scope="module")
def train_reports():
    return {
        s: train(TrainConfig(strategy=s, nproc=1 if s == "single" else NPROC, model=MODEL, node_size=NODE))
        for s in ("single", "full_shard")
    }


def block_numel(h: int, ratio: int) -> int:
    """Parameters of one block, from the layer shapes: 2 LayerNorms, qkv, proj, fc, proj."""
    return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (ratio * h * h + ratio * h) + (ratio * h * h + h)


# ---------------------------------------------------------------- arithmetic, no processes


def test_planned_units_follow_the_model_shapes():
    c = get_config(MODEL)
    units = predict.planned_units(MODEL, "block", shard_size=NPROC)
    assert [u["name"] for u in units] == [f"blocks.{i}" for i in range(c.layers)] + ["(root)"]
    assert all(u["numel"] == block_numel(c.width, c.mlp_ratio) for u in units[:-1])
    assert units[-1]["numel"] == c.vocab * c.width + c.seq * c.width + 2 * c.width  # head tied: counted once
    assert sum(u["numel"] for u in units) == param_count(MODEL)
    linear = predict.planned_units(MODEL, "linear", shard_size=NPROC)
    assert len(linear) == 4 * c.layers + 1 and sum(u["numel"] for u in linear) == param_count(MODEL)
    assert predict.planned_units(MODEL, "model") == [
        {"name": "(root)", "numel": param_count(MODEL), "padded": param_count(MODEL)}
    ]


def test_padding_rounds_dim0_up_to_the_shard_size():
    units = predict.planned_units(MODEL, "block", shard_size=3)
    psi = param_count(MODEL)
    assert sum(u["padded"] for u in units) > psi
    assert all(u["padded"] >= u["numel"] for u in units)


def test_expected_collectives_are_the_zero_volumes():
    units = predict.planned_units(MODEL, "block", shard_size=NPROC)
    psi, u, n = param_count(MODEL), len(units), NPROC
    full = predict.fsdp_collectives("full_shard", units, n)
    root = next(r["padded"] for r in units if r["name"] == "(root)")
    # every unit twice but the root, which fully_shard's default keeps gathered from forward to backward
    assert full["all_gather"]["calls"] == 2 * u - 1 and full["reduce_scatter"]["calls"] == u
    assert full["all_gather"]["payload_bytes"] == (2 * psi - root) * 4
    sent = sum(r["sent_bytes"] for r in full.values())
    assert sent == pytest.approx((3 * psi - root) * (n - 1) / n * 4)  # the paper's 3Ψ less the root, fp32 bytes
    sgo = predict.fsdp_collectives("shard_grad_op", units, n)
    assert sum(r["sent_bytes"] for r in sgo.values()) == pytest.approx(2 * (n - 1) / n * psi * 4)
    ddp = predict.fsdp_collectives("no_shard", units, n)
    assert list(ddp) == ["all_reduce"] and ddp["all_reduce"]["sent_bytes"] == pytest.approx(2 * (n - 1) / n * psi * 4)
    hsdp = predict.fsdp_collectives("hybrid_shard", predict.planned_units(MODEL, "block", NODE), n, NODE)
    assert hsdp["all_reduce"]["group"] == n // NODE and hsdp["all_gather"]["group"] == NODE
    assert hsdp["all_reduce"]["payload_bytes"] == psi * 4 / NODE


def test_expected_held_bytes_are_the_zero_rows():
    from course_utils.memory import model_state_bytes

    psi = param_count(MODEL)
    assert predict.strategy_held_bytes("no_shard", psi, NPROC)["total"] == 16 * psi
    assert predict.strategy_held_bytes("full_shard", psi, NPROC)["total"] == 16 * psi / NPROC
    assert predict.strategy_held_bytes("hybrid_shard", psi, NPROC, NODE)["total"] == 16 * psi / NODE
    zero2 = model_state_bytes(psi, NPROC, "zero2", k=8, weight_bytes=4, grad_bytes=4)
    sgo = predict.strategy_held_bytes("shard_grad_op", psi, NPROC)
    units = predict.planned_units(MODEL, "block", NPROC)
    # at rest + the whole model gathered during the step = stage 2's row
    assert sgo["grads"] + sgo["optim"] + predict.peak_gathered_bytes(units, 4, "shard_grad_op", "default") == zero2


def test_bad_settings_are_refused_with_a_sentence():
    with pytest.raises(CourseInputError, match="divisible by node_size"):
        train(strategy="hybrid_shard", nproc=6, batch=12, node_size=4)
    with pytest.raises(CourseInputError, match="divisible by node_size"):
        strategies.mesh_shape("hybrid_shard", 6, 4)
    with pytest.raises(CourseInputError, match="prefetch"):
        TrainConfig(strategy="full_shard", options={"prefetch": "sometimes"}).validate()
    with pytest.raises(CourseInputError, match="unknown FSDP option"):
        TrainConfig(strategy="full_shard", options={"wrapping": "block"}).validate()
    with pytest.raises(CourseInputError, match="fsdp1"):
        lab04.run_experiments([dict(strategy="full_shard", options={"api": "fsdp1", "wrap": "linear"})], nproc=2)
    with pytest.raises(CourseInputError, match="node_size 1"):
        TrainConfig(strategy="hybrid_shard", nproc=2, node_size=1, options={"api": "fsdp1"}).validate()
    assert dict(apply.check_knobs(strategies.FULL_SHARD, {"offload": "true"}, 2))["offload"] is True
    with pytest.raises(CourseInputError, match="takes no --option"):
        TrainConfig(strategy="ddp", nproc=2, options={"offload": True}).validate()


# ---------------------------------------------------------------- real runs on 4 gloo ranks


@pytest.mark.parametrize("label", [*STRATEGIES, *(f"{s}/fsdp1" for s in STRATEGIES)])
def test_every_strategy_trains_like_single(rows, label):
    row = rows[label]
    assert row["world_size"] == NPROC
    assert lab04.trains_like_single(row), (row["max_loss_rel_diff"], row["rel_weight_diff"])


def test_mixed_precision_is_a_visibly_different_arithmetic(rows):
    mixed, fp32 = rows["mixed"], rows["full_shard"]
    assert lab04.trains_like_single(mixed)
    assert mixed["rel_weight_diff"] > lab04.TOLERANCE["fp32"]["weight_rel"] > fp32["rel_weight_diff"]
    # bf16 gathers halve; the fp32 reduction and the fp32 shards at rest do not change
    assert (
        mixed["comm_per_step"]["all_gather"]["payload_bytes"]
        == fp32["comm_per_step"]["all_gather"]["payload_bytes"] / 2
    )
    assert mixed["comm_per_step"]["reduce_scatter"] == fp32["comm_per_step"]["reduce_scatter"]
    assert mixed["per_rank"] == fp32["per_rank"]
    assert mixed["peak_unsharded_bytes"][0] * 2 == fp32["peak_unsharded_bytes"][0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_match_the_prediction_and_comm_debug_mode(rows, strategy):
    row = rows[strategy]
    units = row["strategy_info"]["units"]
    expected = predict.fsdp_collectives(strategy, units, NPROC, NODE)
    assert predict.comm_matches(row, expected), (row["comm_per_step"], row["comm_groups"], expected)
    assert row["comm_debug_per_step"] == {k: v["calls"] for k, v in row["comm_per_step"].items()}


def test_comm_matches_notices_a_wrong_group_or_count(rows):
    row = rows["hybrid_shard"]
    expected = predict.fsdp_collectives("hybrid_shard", row["strategy_info"]["units"], NPROC, NODE)
    wrong_group = {k: {**v, "group": NPROC} if k == "all_reduce" else v for k, v in expected.items()}
    fewer = {k: {**v, "calls": v["calls"] - 1} for k, v in expected.items()}
    assert not predict.comm_matches(row, wrong_group) and not predict.comm_matches(row, fewer)


def test_full_shard_gathers_twice_per_unit_but_the_root_and_shard_grad_op_once(rows):
    units = len(rows["full_shard"]["strategy_info"]["units"])
    assert rows["full_shard"]["comm_per_step"]["all_gather"]["calls"] == 2 * units - 1  # the root: kept
    assert rows["shard_grad_op"]["comm_per_step"]["all_gather"]["calls"] == units


def test_hybrid_shard_all_reduces_across_the_replicate_dimension(rows):
    row = rows["hybrid_shard"]
    assert row["strategy_info"]["mesh"] == {"shape": [NPROC // NODE, NODE], "names": ["replicate", "shard"]}
    assert row["comm_groups"]["all_reduce"] == [NPROC // NODE]
    assert row["comm_groups"]["all_gather"] == row["comm_groups"]["reduce_scatter"] == [NODE]


@pytest.mark.parametrize("strategy", ["single", *STRATEGIES])
def test_bytes_held_match_the_zero_row(rows, strategy):
    row = rows[strategy]
    expected = predict.fsdp_run(strategy, model=MODEL, nproc=NPROC, node_size=NODE)["held"]  # with the counters
    assert expected["steps"] == 4 * predict.model_tensors(MODEL)
    for held in row["per_rank"]:
        assert {k: held[k] for k in expected} == expected


def test_fsdp1_holds_the_same_bytes_up_to_flat_padding(rows):
    for s in STRATEGIES:
        new, old = rows[s]["per_rank"], rows[f"{s}/fsdp1"]["per_rank"]
        units = len(rows[s]["strategy_info"]["units"])
        for a, b in zip(new, old):
            bill = (b["total"] - b["steps"]) - (a["total"] - a["steps"])  # FSDP1 steps flat units, FSDP2 tensors
            assert 0 <= bill <= 16 * units * (NPROC - 1)  # < N padding elements per flat unit


def test_peak_gathered_bytes_follow_the_schedule(rows):
    for label, strategy, prefetch in [
        ("full_shard", "full_shard", "default"),
        ("shard_grad_op", "shard_grad_op", "default"),
        ("hybrid_shard", "hybrid_shard", "default"),
        ("no_shard", "no_shard", "default"),
        ("no prefetch", "full_shard", "none"),
    ]:
        row = rows[label]
        expected = predict.peak_gathered_bytes(row["strategy_info"]["units"], 4, strategy, prefetch)
        assert row["peak_unsharded_bytes"] == [expected] * NPROC, label
    assert rows["no prefetch"]["peak_unsharded_bytes"][0] < rows["full_shard"]["peak_unsharded_bytes"][0]


def test_runs_one_schedule_knob_apart_end_bit_for_bit_the_same(rows):
    groups = lab04.bit_identical_groups(list(rows.values()))
    assert sorted(label for g in groups for label in g) == sorted(rows)  # every run, once
    same = next(g for g in groups if "full_shard" in g)
    assert {"shard_grad_op", "no prefetch"} <= set(same)  # reshard_after_forward and prefetch move bytes, not sums
    assert "single" not in same and "mixed" not in same  # another order of sums; another arithmetic


def test_tables_show_each_run_beside_its_prediction(rows):
    from course_utils import plots

    side = [rows[s] for s in STRATEGIES]
    pred = {s: predict.fsdp_run(s, model=MODEL, nproc=NPROC, node_size=NODE) for s in STRATEGIES}
    header, table = plots.fsdp_side_by_side_table(side, pred)
    col = header.index
    assert [r[0] for r in table] == list(STRATEGIES) and all(len(r) == len(header) for r in table)
    for r, s in zip(table, STRATEGIES):
        assert (
            r[col("held / rank, B")] == r[col("ZeRO row + step counters, B")] == f"{rows[s]['per_rank'][0]['total']:,}"
        )
        assert r[col("gathered params at most, B")] == r[col("predicted, B")] == f"{pred[s]['peak']:,}"
    header, table = plots.fsdp_table(side, list(plots.FSDP_COLUMNS))
    assert header == ["run", *plots.FSDP_COLUMNS]
    # a CPU host cannot resolve step times: the table says so instead of printing noise
    step_time = header.index("step time, ms")
    assert {r[step_time] for r in table} == {"not meaningful (CPU)"}
    gpu_row = {**rows["full_shard"], "device": "cuda", "step_time_s": 0.0125}
    assert plots.step_time_cell(gpu_row) == "12.5"


def test_train_gives_the_same_run_as_the_harness(rows, train_reports):
    report, row = train_reports["full_shard"], rows["full_shard"]  # same world, same threads: bit for bit
    assert report["weights_sha256"] == row["weights_sha256"]
    assert report["per_rank"] == row["per_rank"]
    assert report["comm_per_step"] == row["comm_per_step"]
    assert report["losses"] == pytest.approx(row["losses"], rel=1e-6)
    info = report["strategy_info"]
    assert info["peak_unsharded_bytes"] == row["peak_unsharded_bytes"][0]
    assert info["fsdp1_name"] == "FULL_SHARD" and info["reshard_after_forward"] is True
    # the one-process launch has all the cores (threads sum matmuls in another order): within tolerance
    single = train_reports["single"]
    assert single["per_rank"] == rows["single"]["per_rank"]
    rel = max(abs(a - b) / b for a, b in zip(single["losses"], rows["single"]["losses"]))
    assert rel <= lab04.TOLERANCE["fp32"]["loss_rel"]


def test_world_of_one_in_this_process_is_exactly_single():
    rows = lab04.experiments_worker(
        [dict(strategy="single", model=MODEL, steps=2), dict(strategy="full_shard", model=MODEL, steps=2)]
    )
    assert rows[1]["world_size"] == 1 and rows[1]["weights_sha256"] == rows[0]["weights_sha256"]


# ---------------------------------------------------------------- state dicts on 2 ranks


def test_state_dicts_round_trip(tmp_path):
    run = dict(strategy="full_shard", model=MODEL, steps=2, kind="state_dict", run_dir=str(tmp_path))
    out = lab04.run_experiments([run], nproc=2)[0]
    assert out["full_keys_match_model"] and out["full_dtensor_equals_api"]
    assert out["fresh_sha_before_load"] != out["trained_sha"]
    assert out["full_into_plain_sha"] == out["full_into_sharded_sha"] == out["trained_sha"]
    assert out["dcp_weights_equal"] and out["dcp_optimizer_equal"] and out["next_step_equal"]
    assert out["next_loss_original"] == out["next_loss_resumed"]
    names = {f["name"] for f in out["dcp_files"]}
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 2
    files = {f["rank"]: f for f in out["rank0_only_files"]}
    n_params = len(list(build_model(MODEL).parameters()))  # the tied head counts once
    assert files[0]["params_with_state"] == n_params and files[1]["params_with_state"] == 0
    assert files[1]["new_api_params_with_state"] == 0
    assert (tmp_path / "full_state_dict.pt").is_file() and (tmp_path / "dcp-step-2" / ".metadata").is_file()


def test_fsdp2_keeps_the_root_gathered_and_clips_across_shards():
    from dataclasses import asdict

    from course_utils.labs import lab03
    from course_utils.launch import launch

    model = build_model("tiny")
    psi = param_count(model)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    facts = launch(
        lab03.fsdp2_facts, nproc=2, args=(asdict(TrainConfig(strategy="full_shard", nproc=2, steps=2)),), echo=False
    )[0]
    default, reshard = (facts["comm"][k]["all_gather"] for k in ("default", "reshard"))
    assert reshard["payload_bytes"] == 2 * 4 * psi and reshard["payload_bytes"] - default["payload_bytes"] == 4 * root
    assert facts["all_dtensor_shard0"] and facts["example"]["local"] == (96, 64)  # 192 rows of qkv over 2 ranks
    assert facts["norm_by_hand"] == pytest.approx(facts["norm_one_process"], rel=1e-5)
    assert facts["norm_by_torch"] == pytest.approx(facts["norm_by_hand"], rel=1e-6)
    assert facts["norm_one_rank_alone"] < facts["norm_by_hand"] and facts["clipped_rel_error"] < 1e-5
