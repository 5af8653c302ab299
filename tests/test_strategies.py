"""The strategy record (notebooks 02-05b) against torch's own tables, the course's other layers, and a
strategy added from this module without editing any other file (issue 27's extensibility test)."""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import replace

import pytest
import torch

from course_utils import apply, memory, plan, predict, strategies
from course_utils.errors import CourseInputError
from course_utils.instrument import Observer
from course_utils.models import build_model, param_count

# ---------------------------------------------------------------------------------------------
# The rows against torch's own tables and each other
# ---------------------------------------------------------------------------------------------


def test_reshard_after_forward_follows_fsdp1_handle_strategies():
    # FSDP1 reshards after forward exactly for these handle strategies; FSDP2's flag is the same idea.
    from torch.distributed.fsdp._flat_param import RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES as RESHARD

    names = {h.name for h in RESHARD}
    for s in strategies.FSDP_STRATEGIES:
        rec = strategies.get(s)
        assert rec.reshard_after_forward == (rec.fsdp1 in names), s


def test_fsdp1_names_are_sharding_strategy_members():
    from torch.distributed.fsdp import ShardingStrategy

    fsdp = {s.fsdp1 for s in strategies.RECORD.values() if s.fsdp1}
    assert fsdp == {"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"}
    assert fsdp <= set(ShardingStrategy.__members__)
    assert {s.name for s in strategies.RECORD.values() if s.fsdp1} == set(strategies.FSDP_STRATEGIES)


def test_every_row_says_what_it_shards_and_sends_consistently():
    for s in strategies.RECORD.values():
        assert s.shards_at_peak <= s.shards_at_rest, s.name  # a step may gather what rest keeps sharded
        assert s.zero_row("rest") in strategies.ZERO_TABLE and s.zero_row("peak") in strategies.ZERO_TABLE
        for c in s.collectives:
            assert c.over in s.mesh and c.kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
        # what it shards it must move by collectives: sharded parameters are gathered, sharded gradients scattered
        if strategies.PARAMS in s.shards_at_rest and s.runnable:
            assert s.sends(strategies.PARAMS) and (s.gathers_units or s.layout == "flat"), s.name
        if strategies.GRADS in s.shards_at_peak:
            assert any(c.kind == "reduce_scatter" for c in s.sends(strategies.GRADS)), s.name
        assert bool(s.gathers_units) == (s.reshard_after_forward is not None), s.name


def test_the_zero_table_is_the_papers():
    assert [s.name for s in strategies.ZERO_TABLE] == list(memory.STAGES) == ["ddp", "zero1", "zero2", "zero3"]
    assert [memory.formula_text(s) for s in strategies.ZERO_TABLE] == [
        "(2 + 2 + K)·Ψ",
        "(2 + 2)·Ψ + K·Ψ/Nd",
        "2·Ψ + (2 + K)·Ψ/Nd",
        "(2 + 2 + K)·Ψ/Nd",
    ]
    # SHARD_GRAD_OP: stage 3's bytes at rest, stage 2's during the step
    assert strategies.SHARD_GRAD_OP.zero_row_at_rest == "zero3" and strategies.SHARD_GRAD_OP.zero_row_at_peak == "zero2"


def test_every_apply_function_is_a_callable_that_says_its_notebook():
    for s in strategies.STRATEGIES.values():
        assert callable(s.apply) and not isinstance(s.apply, str), s.name
        assert list(inspect.signature(s.apply).parameters)[:3] == ["model", "mesh", "options"], s.name
        assert re.search(r"\(notebooks? 0", inspect.getdoc(s.apply)), s.name
        if s.optimizer is not None:
            assert list(inspect.signature(s.optimizer).parameters)[:2] == ["model", "factory"], s.name
    priced_only = [s.name for s in strategies.RECORD.values() if not s.runnable]
    assert priced_only == ["zero2_offload", "zero3_offload"]
    with pytest.raises(CourseInputError, match="no implementation here"):
        strategies.runnable("zero3_offload")


def test_the_planner_weighs_the_record_in_its_order_of_preference():
    assert plan.STRATEGIES == ("ddp", "zero1", "zero2", "hybrid_shard", "zero3", "zero2_offload", "zero3_offload")
    assert [s.name for s in strategies.planned()] == list(plan.STRATEGIES)


@pytest.mark.parametrize(
    "name, shape, nd",
    [
        ("single", (1,), 1),
        ("ddp", (8,), 1),
        ("zero2", (8,), 8),
        ("full_shard", (8,), 8),
        ("shard_grad_op", (8,), 8),
        ("no_shard", (8, 1), 1),
        ("hybrid_shard", (4, 2), 2),
    ],
)
def test_mesh_and_shard_group(name, shape, nd):
    got, names = strategies.mesh_shape(name, 8, 2)
    assert got == shape and len(names) == len(shape)
    assert strategies.shard_group_size(name, 8, 2) == nd
    assert math.prod(got) == (1 if name == "single" else 8)


def test_bad_names_and_meshes_are_refused_with_a_sentence():
    with pytest.raises(CourseInputError, match="choose one of"):
        strategies.get("zero4")
    with pytest.raises(CourseInputError, match="FSDP strategy"):
        strategies.get_fsdp("zero3")
    with pytest.raises(CourseInputError, match="divisible by node_size"):
        strategies.mesh_shape("hybrid_shard", 6, 4)
    with pytest.raises(CourseInputError, match="already registered"):
        strategies.register(replace(strategies.DDP, title="another DDP"))


# ---------------------------------------------------------------------------------------------
# A new strategy: one row plus one apply function, defined here; nothing else edited
# ---------------------------------------------------------------------------------------------


def apply_every_second_block(model, mesh, options):
    """FULL_SHARD on the even blocks and the root, the odd blocks left to the root's unit: a strategy the
    course does not have, built from torch's ``fully_shard`` (notebook 04, an exercise in extending it)."""
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        if i % 2 == 0:
            fully_shard(block, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    return model


#: Stage 3's bill and traffic, FSDP2's layout, a unit for every second block.
EVERY_SECOND = strategies.Strategy(
    "every_second_block",
    "04",
    "FULL_SHARD every second block (a test's row)",
    shards_at_rest=strategies.ALL,
    shards_at_peak=strategies.ALL,
    shard_over="world",
    mesh=("shard",),
    collectives=strategies.FULL_SHARD.collectives,
    gathers_units=True,
    reshard_after_forward=True,
    layout="per_parameter",
    mixed="gathered",
    apply=apply_every_second_block,
    pytorch="fully_shard on blocks 0, 2, 4, ... and on the root",
    planned=True,
)


@pytest.fixture(scope="module")
def registered():
    """The row registered the public way (``strategies.register``) for this module's tests, and taken out of
    the record again after them, so no other test module's planner sees it."""
    before = dict(strategies.RECORD), dict(strategies.STRATEGIES)
    strategies.register(EVERY_SECOND)
    try:
        yield EVERY_SECOND
    finally:
        for table, old in zip((strategies.RECORD, strategies.STRATEGIES), before):
            table.clear()
            table.update(old)


class CountAllGathers(Observer):
    """An observer of the caller's: the all-gathers every step issues on this rank, counted by torch's own
    ``CommDebugMode`` (a different counter from the course's ``CommCounter``)."""

    def __init__(self):
        self.per_step = []

    def before_forward(self, step: int) -> None:
        from torch.distributed.tensor.debug import CommDebugMode

        self.mode = CommDebugMode()
        self.mode.__enter__()

    def after_update(self, step: int) -> None:
        self.mode.__exit__(None, None, None)
        counts = self.mode.get_comm_counts()
        self.per_step.append(sum(n for op, n in counts.items() if "all_gather" in str(op) or "allgather" in str(op)))

    def result(self):
        return self.per_step


def test_a_new_row_is_in_the_planner_and_the_predictions(registered):
    p = plan.plan(params=7e9)
    assert EVERY_SECOND.name in p.strategies
    assert p.strategies[EVERY_SECOND.name].model_states == p.strategies["zero3"].model_states  # stage 3's bill
    psi = param_count(build_model("tiny"))
    exp = predict.expected_bytes(EVERY_SECOND.name, psi, 2)
    assert exp["held_paper"] == predict.expected_bytes("full_shard", psi, 2)["held_paper"] == 16 * psi / 2
    assert exp["sent_paper"] == pytest.approx(3 * (2 - 1) / 2 * psi * 4)  # the paper's 3Ψ, fp32


@pytest.fixture(scope="module")
def new_row_run(tmp_path_factory, registered):
    """The new row on 2 gloo ranks with an observer of this module's, and the one-process reference."""
    from course_utils.train import TrainConfig, train

    d = tmp_path_factory.mktemp("weights")
    run = train(
        TrainConfig(strategy=EVERY_SECOND.name, nproc=2, steps=2, save_weights=str(d / "row.pt")),
        observers=[CountAllGathers()],
    )
    single = train(TrainConfig(strategy="single", steps=2, save_weights=str(d / "single.pt")))
    return run, single, torch.load(d / "row.pt"), torch.load(d / "single.pt")


def test_a_new_row_trains_like_one_process(new_row_run):
    from course_utils.labs.lab04 import TOLERANCE

    run, single, mine, ref = new_row_run
    assert run["strategy"] == EVERY_SECOND.name and run["world_size"] == 2
    tol = TOLERANCE["fp32"]
    assert max(abs(a - b) / b for a, b in zip(run["losses"], single["losses"])) <= tol["loss_rel"]
    num = sum(float((mine[k] - ref[k]).double().pow(2).sum()) for k in ref)
    den = sum(float(ref[k].double().pow(2).sum()) for k in ref)
    assert sorted(mine) == sorted(ref) and (num / den) ** 0.5 <= tol["weight_rel"]
    psi = param_count(build_model("tiny"))
    assert sum(r["total"] - r["steps"] for r in run["per_rank"]) == 16 * psi  # every byte of the fp32 bill, held once


def test_the_callers_observer_travelled_to_every_rank(new_row_run):
    """Two units (block 0, and the root with block 1), each gathered for the forward and again for the
    backward: the calls the record's collectives predict for these units, counted by torch's CommDebugMode."""
    from course_utils.models import build_meta_model, unit_table

    run = new_row_run[0]
    meta = build_meta_model("tiny")
    units = unit_table(meta, 2, [meta.blocks[0]])
    calls = predict.fsdp_collectives(EVERY_SECOND, units, 2)["all_gather"]["calls"]
    assert calls == 4
    assert run["observed"] == [[[calls, calls]], [[calls, calls]]]  # per rank, per observer, per step
    assert run["comm_per_step"]["all_gather"]["calls"] == calls  # the course's own counter agrees


def test_the_options_carry_the_rows_facts(registered):
    from course_utils.loop import TrainConfig

    opts = apply.options_for(EVERY_SECOND, TrainConfig(strategy=EVERY_SECOND.name, nproc=2))
    assert opts.reshard_after_forward is True and opts.knobs == ()
