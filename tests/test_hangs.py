"""A rank that hangs (course_utils.hangs, notebook 06): each detector fires no earlier than its setting and says what it says.

Real runs: rank 1 of 2 stops in Python before step 2. The time to detection is measured on this
machine; the tests hold only what cannot depend on its load: no detector fires before its timeout, and
who raised, who was killed and who kept heartbeating.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from course_utils import hangs


def test_the_process_group_timeout_raises_in_the_waiting_rank_and_the_launcher_names_the_hung_one():
    row = hangs.pg_timeout_hang(1.0)
    assert row["detector"] == "process group timeout" and row["configured_s"] == 1.0
    assert row["detected_after_s"] >= 1.0
    assert "Timed out waiting 1000ms" in row["peer_error"]  # gloo's own words, in the rank that waited
    assert "rank 0 timed out in a collective that rank(s) 1 never reached" in row["report"]
    assert "rank 1: in before_forward" in row["report"] and "time.sleep" in row["report"]
    assert "/tmp/" not in row["report"]  # no temporary path in what a student reads


def test_the_file_timer_kills_the_hung_worker_and_then_its_agent():
    row = hangs.file_timer_hang(2.0)
    # timed by the timer's own first "Reaping worker_pid" line, not by the run's end
    assert 2.0 <= row["detected_after_s"] < row["run_end_s"]
    # the hung rank was SIGKILLed (no Python error); rank 0 went too: killed in the same check, or SIGINT as
    # its agent died (torch.multiprocessing's PR_SET_PDEATHSIG); the agent itself was killed, so no result
    assert row["reaped"] and sorted(row["reaped"] + row["not_reaped"]) == [0, 1]
    assert 1 not in row["ranks_that_raised"] and row["agent_killed"]
    assert row["report"].startswith("SIGKILLed rank(s) ") and row["report"].endswith(
        ": the launcher's agent ended without a result"
    )


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_a_hung_torchft_group_keeps_heartbeating_and_the_survivors_quorum_gives_up():
    row = hangs.torchft_hang(2.0, heartbeat_timeout_ms=500)
    # the heartbeat timeout (0.5 s) passed four times over and the lighthouse never dropped the hung group
    assert row["detector"] == "torchft quorum timeout" and row["detected_after_s"] >= 2.0
    assert row["report"] == "replica 0 failed (exit code 1)" and "Timeout expired" in row["peer_error"]


def test_time_lost_per_hang_is_the_timeout_plus_a_restart_plus_half_an_interval():
    cost = hangs.time_lost_per_hang([60, 600], restart_s=300, step_s=2.0, every=100)
    assert cost["redo_s"] == 100.0  # K t / 2
    assert np.array_equal(cost["lost_s"], [460.0, 1000.0])  # only T differs between the two


def test_the_hang_table_cuts_a_long_error_between_words():
    from course_utils.labs.lab06_ft import hang_rows

    error = 'TimeoutError: status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { x }'
    row = {"detector": "d", "configured_s": 3, "detected_after_s": 3.0, "report": "failed\nmore", "peer_error": error}
    said = hang_rows([row])[0][3]
    quoted = said.split("`")[1]
    assert said.startswith("failed; the waiting side: ") and quoted.endswith(" ...") and len(quoted) <= 90
    assert error.startswith(quoted.removesuffix(" ...") + " ")  # whole words of the error, cut before a space
