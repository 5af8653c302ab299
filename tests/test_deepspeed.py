"""DeepSpeed's ZeRO stages 1-3 beside the hand-built ones (course_utils.labs.lab03_deepspeed, notebook 03).

One launch (2 gloo ranks, 3 steps) trains DeepSpeed 0.19.8 and the course's stage from the same seed,
data and Adam for each stage; the tests hold its weights to the course's bit for bit and what DeepSpeed
keeps per rank to the formula read in DeepSpeed's source. ``make setup`` installs DeepSpeed (the
``deepspeed`` extra); without it only the arithmetic below runs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from course_utils import dist as cdist
from course_utils import per_param, plan, predict, timeline
from course_utils.labs import lab03_deepspeed as lab
from course_utils.launch import launch
from course_utils.models import build_model, param_count
from course_utils.plan import deepspeed3
from course_utils.strategies import FULL_SHARD, PARAMS, ZERO1, ZERO2, ZERO3
from course_utils.train import TrainConfig

PSI = param_count(build_model("tiny"))  # Ψ = 118,528: divides by 2, so every partition is exact
ND = 2
needs_deepspeed = pytest.mark.skipif(not lab.available(), reason=f"DeepSpeed is not installed: {lab.INSTALL_LINE}")


@pytest.fixture(scope="module")
def beside():
    return lab.beside(nproc=ND, steps=3)


# ---------------------------------------------------------------------------------------------
# Arithmetic and configuration (no DeepSpeed needed)
# ---------------------------------------------------------------------------------------------


def test_the_stage_comes_from_the_record():
    assert [lab.deepspeed_stage(r) for r in lab.STAGES] == [1, 2, 3]
    assert lab.deepspeed_stage(FULL_SHARD) == 3  # FSDP's FULL_SHARD is DeepSpeed's stage 3 in the record too


def test_config_turns_off_what_would_spoil_the_comparison():
    for row in lab.STAGES:
        cfg = lab.ds_config(row, world=ND, batch=8)
        zero = cfg["zero_optimization"]
        assert cfg["gradient_clipping"] == 0.0 and cfg["train_micro_batch_size_per_gpu"] == 4
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == lab.BUCKET_ELEMENTS < 5e8
        assert (zero.get("stage3_param_persistence_threshold") == 0) == (row is ZERO3)
    assert lab.ds_config(ZERO3, ND, 8)["zero_optimization"]["memory_efficient_linear"] is False
    assert lab.ds_config(ZERO3, ND, 8, own_linear=True)["zero_optimization"]["memory_efficient_linear"] is True


def test_expected_held_follows_what_each_stage_shards():
    one, two, three = (lab.expected_held(r, PSI, ND) for r in lab.STAGES)
    assert one == two  # stage 2's gradient shard exists only during the step in DeepSpeed too
    assert one["parameters"] == 4 * PSI and three["parameters"] == 4 * PSI // ND
    assert three["gradient partition"] == 4 * PSI // ND and three["reduce bucket"] == 4 * lab.BUCKET_ELEMENTS
    for held in (one, two, three):  # an fp32 master copy beside Adam's m and v, also in fp32 training
        assert held["fp32 master partition"] == 4 * PSI // ND and held["Adam m, v, step"] == 8 * PSI // ND + 4


def test_where_deepspeed_keeps_it_names_the_category():
    assert lab.category("optimizer.ipg_buckets[dtype].buffer") == ("reduce bucket", "comm")  # as in the timeline
    assert lab.category("optimizer.single_partition_of_fp32_groups[0]")[0] == "fp32 master partition"
    assert lab.category("optimizer.optimizer.state[Tensor][exp_avg]")[0] == "Adam m, v, step"
    assert lab.category("module.tok_emb.weight.ds_tensor") == ("parameters", PARAMS)
    assert lab.category("optimizer._global_grad_norm")[0] == lab.SCALARS
    # one sorting for the census and the timeline: every part is a timeline category (the bucket is comm in both)
    assert {part for _, _, part, _ in lab.PLACES} <= set(timeline.CATEGORIES)


def test_available_asks_without_importing(monkeypatch):
    monkeypatch.setattr(lab.importlib.util, "find_spec", lambda name: None)
    assert lab.available() is False and "pip install deepspeed==" in lab.INSTALL_LINE


# ---------------------------------------------------------------------------------------------
# One launch: DeepSpeed and the course, stage by stage, on 2 ranks
# ---------------------------------------------------------------------------------------------


@needs_deepspeed
def test_every_stage_ends_with_the_course_weights_bit_for_bit(beside):
    for row in lab.STAGES:
        r = beside[row.name]
        assert r["bit_identical"] and r["max_abs_diff"] == 0.0 and r["sha256"], (row.name, r["max_abs_diff"])
        assert r["losses_equal"] and len(r["losses"]) == 3, row.name


@needs_deepspeed
def test_deepspeeds_own_linear_is_replaced_process_wide_and_undone(beside):
    """Stage 3 with DeepSpeed's default ``memory_efficient_linear`` replaces ``torch.nn.functional.linear`` in the
    rank (the course's stages ran first, and the worker restores it); its weights stay within notebook 03's
    tolerance of the course's (lr/10), whatever the last bits do."""
    own = beside[lab.OWN_LINEAR]
    assert own["replaced_linear"] and own["sha256_course"] == beside[ZERO3.name]["sha256"]
    assert own["max_abs_diff"] < 3e-3 / 10
    assert not any(beside[r.name]["replaced_linear"] for r in lab.STAGES)


@needs_deepspeed
def test_what_deepspeed_holds_is_the_formula_read_in_its_source(beside):
    for name, row, _ in lab.RUNS:
        expected = lab.expected_held(row, PSI, ND)
        for rank, held in enumerate(beside[name]["per_rank"]):
            measured = held["deepspeed"]
            assert {k: measured[k] for k in expected} == expected, (name, rank, measured)
            assert measured[lab.SCALARS] == sum(lab.expected_scalars(row).values()), (name, rank, measured)
        assert lab.scalars(beside[name]["storages"]) == lab.expected_scalars(row), name  # rank 0's, path by path


@needs_deepspeed
def test_the_course_side_holds_the_papers_fp32_bill(beside):
    """The course's stage, counted in the same launch, is the paper's fp32 row to the byte: the reference
    DeepSpeed's census is set against in notebook 03."""
    for row in lab.STAGES:
        bill = predict.bill_bytes(row, PSI, ND, precision="fp32")
        for held in beside[row.name]["per_rank"]:
            assert {k: held["course"][k] for k in ("params", "grads", "optim")} == {
                k: bill[k] for k in ("params", "grads", "optim")
            }, row.name


@needs_deepspeed
def test_deepspeeds_estimators_count_mixed_precision(beside):
    model = build_model("tiny")
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert beside[ZERO1.name]["deepspeed_estimate"] is None  # DeepSpeed has no estimator for stage 1
    assert beside[ZERO2.name]["deepspeed_estimate"] == 2 * PSI + 18 * PSI // ND
    assert beside[ZERO3.name]["deepspeed_estimate"] == 4 * largest + 18 * PSI // ND


def test_expected_rest_sorts_the_formula_into_the_timelines_categories():
    for row in lab.STAGES:
        rest, held = lab.expected_rest(row, PSI, ND), lab.expected_held(row, PSI, ND)
        assert sum(rest.values()) == sum(held.values()) and set(rest) <= {"params", "grads", "optim", "comm"}
    assert lab.expected_rest(ZERO3, PSI, ND)["comm"] == 4 * lab.BUCKET_ELEMENTS  # the reduce bucket, kept


@needs_deepspeed
def test_deepspeeds_watched_step_at_rest_is_the_formula_and_peaks_in_the_backward(beside):
    """The timeline watched in the same launch (rank 0): every DeepSpeed category at rest to the byte; the model
    states peak at the end of the backward, with the reduce bucket alive (the peaks' sizes: the next test)."""
    for row in lab.STAGES:
        t = beside[row.name]["timeline"]
        expected = lab.expected_rest(row, PSI, ND)
        assert {c: t["rest"][c] for c in expected} == expected and t["rest"]["gathered"] == 0, (row.name, t["rest"])
        assert t["unsettled"] == 0
        assert t["states_peak"]["where"].startswith("backward"), (row.name, t["states_peak"]["where"])
        assert t["states_peak"]["comm"] >= 4 * lab.BUCKET_ELEMENTS, row.name
    assert beside[lab.OWN_LINEAR]["timeline"] is None  # the extra run is not watched


@needs_deepspeed
def test_deepspeeds_stage1_and_2_peaks_are_rest_plus_one_bucket_plus_every_gradient(beside):
    """At the end of the backward: at rest + one reduce bucket (``reduce_bucket_size`` from the config) + 4Ψ, to the
    byte; or that + the gradient partition ``copy_grads_in_partition`` allocates, when gloo's worker thread drops
    the all-reduce's flat input only after it (``ProcessGroupGloo::runLoop``: measured 1 run in 8, stage 1)."""
    late = lab.partition_gradient_bytes(TrainConfig().model, ND)
    for row in (ZERO1, ZERO2):
        peak = beside[row.name]["timeline"]["states_peak"]
        bucket = lab.ds_config(row, ND, TrainConfig().batch)["zero_optimization"]["reduce_bucket_size"]
        want = predict.bucket_and_gradients_states_peak(sum(lab.expected_rest(row, PSI, ND).values()), PSI, bucket)
        assert peak["states"] == want or (peak["states"] == want + late and peak["grads"] == late), (row.name, peak)


def test_the_partition_gradient_is_every_whole_parameter_over_the_slice():
    """One rank: every parameter; N ranks: each at least its slice, together at least every parameter once (a
    parameter that straddles a boundary counts whole on both sides)."""
    assert lab.partition_gradient_bytes("tiny", 1) == 4 * PSI
    parts = [lab.partition_gradient_bytes("tiny", ND, r) for r in range(ND)]
    assert all(p >= 4 * PSI // ND for p in parts) and 4 * PSI <= sum(parts) < 8 * PSI


def _group_slice() -> dict:
    """In every rank: DeepSpeed stage 1's partition of one parameter group, a 5 x 4 weight and a bias of 5 (each
    element holds its flat index + 1, so a slice names the elements it keeps and its padding is the zeros)."""
    with cdist.session("gloo") as info:
        lab._no_shm_build()
        deepspeed = importlib.import_module("deepspeed")
        deepspeed.utils.logger.setLevel("ERROR")
        model = torch.nn.Linear(4, 5)
        with torch.no_grad():
            model.weight.copy_(torch.arange(1.0, 21.0).reshape(5, 4))
            model.bias.copy_(torch.arange(21.0, 26.0))
        config = lab.ds_config(ZERO1, info.world_size, info.world_size)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=config)
        out = {
            "slice": engine.optimizer.single_partition_of_fp32_groups[0].tolist(),
            "flat": engine.optimizer.bit16_groups_flat[0].numel(),
        }
        engine.destroy()
        return out


@needs_deepspeed
def test_deepspeeds_stage1_group_buffer_is_per_params_layout(tmp_path):
    """``per_param.layouts``' DeepSpeed 1-2 column (notebook 04's figure) against DeepSpeed's own flat partition
    on 4 ranks: the buffer's length (the group padded to a multiple of 2N) and, rank by rank, the elements kept."""
    nd = 4
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    got = launch(_group_slice, nproc=nd, backend="gloo", env=env, echo=False, progress=False)
    view = per_param.layouts({"weight": (5, 4), "bias": (5,)}, nd)["group_flat"]
    owner = torch.cat([t.reshape(-1) for t in view["owner"].values()])
    for rank in range(nd):
        kept = torch.tensor(got[rank]["slice"])
        assert got[rank]["flat"] == owner.numel() + view["padding"] == nd * kept.numel(), rank
        assert (kept[kept != 0].long() - 1).tolist() == torch.nonzero(owner == rank).flatten().tolist(), rank


# ---------------------------------------------------------------------------------------------
# Stage 3's gathers and releases, live, against the planner's replay (plan.deepspeed3)
# ---------------------------------------------------------------------------------------------

#: a small Llama of the course model (grouped-query attention, SwiGLU, RMSNorm, untied head): the
#: embeddings and the head 8,192 elements each, blocks of 9,280 (qkv 2,048, proj 1,024, gate, fc and proj
#: 2,048 each, the norms 32)
_TINY_LLAMA = dict(arch="llama", vocab=256, seq=8, layers=4, width=32, heads=4, kv_heads=2, mlp_hidden=64,
                   tie_weights=False)  # fmt: skip


_BUCKET = 5_000  # elements: reduce_bucket_size, so that a step reduces several buckets, and the head's gradient
# (8,192 elements) does not fit one


def _strip(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _ds3_worker(cases: list) -> dict:
    """One gloo rank: the tiny Llama under DeepSpeed stage 3 for each (policy, reuse distance), every parameter
    released (no persistence threshold, no prefetch); in the third step (the trace is complete from the
    second: ``is_complete_trace``) the parameters gathered when the head's forward ends, and when each
    weight's gradient is made."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from course_utils.models import GPT
    from course_utils.presets import GPTConfig
    from course_utils.rehearse.recompute import wrap_blocks

    out = {}
    with cdist.session("gloo"):
        lab._no_shm_build()
        deepspeed.utils.logger.setLevel("ERROR")
        for policy, reuse in cases:
            torch.manual_seed(0)
            model, seen = GPT(GPTConfig(**_TINY_LLAMA)), {"backward": {}}
            wrap_blocks(model, policy)
            params = dict(model.named_parameters())

            def gathered(params=params):
                return frozenset(_strip(n) for n, p in params.items() if p.ds_status == ZeroParamStatus.AVAILABLE)

            def at_head_end(mod, inp, o, seen=seen, gathered=gathered):
                seen["forward_end"] = gathered()

            model.head.register_forward_hook(at_head_end)
            for name, p in params.items():
                if name.endswith(".weight") and p.dim() == 2:
                    module = _strip(name).rsplit(".", 1)[0]
                    p.register_hook(
                        lambda g, m=module, seen=seen, gathered=gathered: seen["backward"].__setitem__(m, gathered())
                    )
            zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_reuse_distance": reuse, "reduce_bucket_size": _BUCKET}  # fmt: skip
            config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": zero}
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.Adam(model.parameters()), config=config
            )
            flush = engine.optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads

            def counted(dtype, flush=flush, optimizer=engine.optimizer, seen=seen):
                seen["flushes"].append(sum(p.ds_numel for p in optimizer.ipg_buckets[dtype].params))
                return flush(dtype)

            engine.optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads = counted
            for _ in range(3):
                seen["backward"].clear()
                seen["flushes"] = []
                x = torch.randint(0, 256, (2, 8))
                engine.backward(engine(x, x))
                engine.step()
            out[(policy, reuse)] = {k: seen[k] for k in ("forward_end", "flushes")} | {
                "backward": dict(seen["backward"])
            }
    return out


#: (policy, reuse distance): below the head's two passes (16,384 elements) only the head stays gathered at the
#: forward's end; at 40,000 the last block and what the walk reaches of the one before. Each policy's blocks
#: run again (full, every 2nd, and selective: every block's modules called again) change the trace
_DS3_CASES = [("none", 16_000), ("none", 40_000), ("full", 16_000), ("full", 40_000), ("every:2", 40_000),
              ("selective", 40_000)]  # fmt: skip


@needs_deepspeed
def test_stage3_gathers_and_releases_module_by_module_as_the_planner_replays_it():
    """What the planner prices for DeepSpeed stage 3 (``plan.deepspeed3.replay``: the coordinator's reuse walk
    played on the course model's trace) is what DeepSpeed 0.19.8 holds gathered, parameter by parameter, at the
    forward's end and whenever a weight's gradient is made, under every recomputation policy."""
    from course_utils.presets import GPTConfig

    s = plan.shape_of_config(GPTConfig(**_TINY_LLAMA))
    got = launch(_ds3_worker, nproc=1, args=(_DS3_CASES,), backend="gloo", progress=False, echo=False)[0]
    matrices = {m for m, _ in deepspeed3.submodules(s) if not m.rpartition(".")[2].startswith("ln")}
    for policy, reuse in _DS3_CASES:
        want = deepspeed3.replay(s, policy, reuse=reuse, bucket=_BUCKET, persist=0)
        live = got[(policy, reuse)]
        assert live["forward_end"] == want["forward_end"], (policy, reuse)
        assert [x for x in live["flushes"] if x] == list(want["flushes"]), (policy, reuse)
        assert set(live["backward"]) == matrices
        for module, names in live["backward"].items():
            assert names == want["at_backward"][module], (policy, reuse, module)

    def weights(names):
        return {n for n in names if ".ln" not in n and not n.startswith("ln")}

    # no root unit: the head kept for its backward, the embeddings released (they come back last)
    assert got[("none", 16_000)]["forward_end"] == {"head.weight"}
    last = {f"blocks.3.{m}.weight" for m in ("attn.qkv", "attn.proj", "mlp.gate", "mlp.fc", "mlp.proj")}
    assert last | {"head.weight"} <= got[("none", 40_000)]["forward_end"]
    # the backward gathers one module at a time...
    for module, names in got[("none", 16_000)]["backward"].items():
        assert weights(names) == {f"{module}.weight"}, module
    # ...but a block run again is gathered whole by its recomputation and kept for its backward
    assert got[("full", 16_000)]["forward_end"] == {"head.weight"}
    assert weights(got[("full", 16_000)]["backward"]["blocks.3.mlp.proj"]) == last
