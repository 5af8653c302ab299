"""course_utils.comm: the ring all-reduce simulation against the plain sum and the volume formulas."""

from __future__ import annotations

import numpy as np
import pytest

from course_utils import comm, instrument, strategies
from course_utils.errors import CourseInputError


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("psi", [1, 7, 8, 64, 1000])
def test_ring_all_reduce_gives_every_rank_the_sum(n, psi):
    rng = np.random.default_rng(n * 1000 + psi)
    inputs = [rng.integers(-100, 100, psi).astype(float) for _ in range(n)]  # integers: sums are exact
    trace = comm.ring_all_reduce(inputs)
    expected = np.sum(inputs, axis=0)
    for result in trace.result:
        np.testing.assert_array_equal(result, expected)
    assert len(trace.messages) == 2 * n * (n - 1)  # N messages per step, N-1 steps, two phases


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("psi", [5, 12, 100, 118_528])
def test_ring_traffic_matches_the_formula(n, psi):
    trace = comm.ring_all_reduce([np.zeros(psi)] * n)
    # Each chunk travels N-1 hops in each phase, whatever the chunk sizes: exactly 2(N-1)Ψ in all.
    assert sum(trace.sent) == 2 * (n - 1) * psi
    assert sum(trace.sent_reduce_scatter) == sum(trace.sent_all_gather) == (n - 1) * psi
    if psi % n == 0:
        assert trace.sent == [comm.all_reduce_sent(psi, n)] * n
    else:  # chunks differ by at most one element, so ranks differ by at most one per phase
        assert max(trace.sent) - min(trace.sent) <= 2


def test_the_papers_tiny_example():
    # the tiny example, by hand: Ψ = 8 on 4 GPUs, three steps of two elements per phase.
    trace = comm.ring_all_reduce([[rank + 1.0] * 8 for rank in range(4)])
    assert trace.sent_reduce_scatter == [6] * 4 and trace.sent_all_gather == [6] * 4
    assert comm.all_reduce_sent(8, 4) == 12
    assert all(list(r) == [10.0] * 8 for r in trace.result)


def test_formulas_approach_the_papers_round_numbers():
    psi = 7.5e9
    assert comm.all_reduce_sent(psi, 1) == 0
    assert comm.all_reduce_sent(psi, 2) == psi
    assert comm.step_sent(strategies.DDP, psi, 1024) == pytest.approx(2 * psi, rel=1 / 512)
    for stage in ("zero1", "zero2"):
        assert comm.step_sent(strategies.get(stage), psi, 64) == comm.step_sent(strategies.DDP, psi, 64)
    assert comm.step_sent(strategies.ZERO3, psi, 64) / comm.step_sent(strategies.DDP, psi, 64) == pytest.approx(1.5)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_instrument_counts_with_the_same_factors(kind, n):
    payload = 4 * 118_528
    formula = {
        "all_reduce": comm.all_reduce_sent,
        "reduce_scatter": comm.reduce_scatter_sent,
        "all_gather": comm.all_gather_sent,
    }[kind]
    assert instrument.ring_bytes_sent(kind, payload, n) == pytest.approx(formula(payload, n))


def test_bad_input_says_what_to_do():
    with pytest.raises(CourseInputError, match="whole number"):
        comm.all_reduce_sent(10, 0)
    with pytest.raises(CourseInputError, match="same length"):
        comm.ring_all_reduce([[1.0, 2.0], [1.0]])
    with pytest.raises(CourseInputError, match="a row of the record"):
        comm.step_sent("zero3", 10, 2)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_a_broadcast_is_counted_per_sender(n):
    """N-1 ranks receive every byte once, so the group sends (N-1)·payload: (N-1)/N per rank on average.
    Measured on gloo's sockets (issue 30): from rank 0 on 4 ranks, rank 0 sends 2 payloads, rank 1 one,
    ranks 2 and 3 none; 3 = N-1 in all. Crediting every rank with the whole payload counted N."""
    payload = 1000
    group_total = n * instrument.ring_bytes_sent("broadcast", payload, n)
    assert group_total == pytest.approx((n - 1) * payload)
    # ZeroRedundancyOptimizer + DDP: the all-reduce and the broadcasts of every weight, 3(N-1)/N·Ψ per rank
    both = instrument.ring_bytes_sent("all_reduce", payload, n) + instrument.ring_bytes_sent("broadcast", payload, n)
    assert both == pytest.approx(3 * (n - 1) / n * payload)
