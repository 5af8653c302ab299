"""The strategy record (notebooks 02-05b) against torch's own tables and the course's other layers."""

from __future__ import annotations

import inspect
import math

import pytest

from course_utils import memory, plan, strategies
from course_utils.errors import CourseInputError
from course_utils.loop import resolve_strategy


def test_reshard_after_forward_follows_fsdp1_handle_strategies():
    # FSDP1 reshards after forward exactly for these handle strategies; FSDP2's flag is the same idea.
    from torch.distributed.fsdp._flat_param import RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES as RESHARD

    names = {h.name for h in RESHARD}
    for s in strategies.FSDP_STRATEGIES:
        rec = strategies.STRATEGIES[s]
        assert rec.reshard_after_forward == (rec.fsdp1_name in names), s


def test_fsdp1_names_are_sharding_strategy_members():
    from torch.distributed.fsdp import ShardingStrategy

    fsdp = {s.fsdp1_name for s in strategies.STRATEGIES.values() if s.is_fsdp}
    assert fsdp == {"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"}
    assert fsdp <= set(ShardingStrategy.__members__)
    assert {s.name for s in strategies.STRATEGIES.values() if s.is_fsdp} == set(strategies.FSDP_STRATEGIES)


def test_rows_name_rows_that_exist():
    for s in strategies.STRATEGIES.values():
        assert s.zero_row_at_rest in memory.STAGES and s.zero_row_at_peak in memory.STAGES, s.name
        assert s.plan_row in plan.STRATEGIES, s.name


def test_every_apply_function_resolves_and_says_its_notebook():
    for name, s in strategies.STRATEGIES.items():
        fn = resolve_strategy(name)
        assert fn.__name__ == f"apply_{name}" and f"(notebook {s.notebook})" in inspect.getdoc(fn), name


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
