"""Notebook 06's views of the runs beyond the restart: a healed replica group, hangs, DiLoCo across a slow link.

The runs are ``course_utils.ft.ft_run`` and ``course_utils.hangs.measure``; these functions turn their reports
into the rows and numbers the notebook shows and asserts.
"""

from __future__ import annotations

import re
import statistics
import textwrap


def healed_state_rows(ft: dict) -> list[list]:
    """Per replica group of an ``ft.ft_run`` report: what it ended with, hashed in its own process (notebook 06).

    ``[group, weights SHA-256 (16 hex), Adam's moments and step counts SHA-256 (16 hex), Adam's step,
    steps committed from the heal on]``.
    """
    return [
        [
            int(g),
            ft["weights_sha256"][g][:16],
            ft["adam_sha256"][g][:16],
            ", ".join(map(str, ft["adam_steps"][g])),
            ft["committed_after_heal"].get(g, 0),
        ]
        for g in sorted(ft["weights_sha256"])
    ]


def hang_rows(rows: list[dict]) -> list[list]:
    """``hangs.measure`` rows as table rows: detector, configured, measured, what it said (notebook 06)."""
    out = []
    for r in rows:
        said = r["report"].splitlines()[0]
        if r.get("peer_error"):  # gloo's messages start with their source file: [.../pair.cc:537]
            error = re.sub(r"^\[[^\]]*\]\s*", "", r["peer_error"])
            said += f"; the waiting side: `{textwrap.shorten(error, 90, placeholder=' ...')}`"  # whole words
        measured = "-" if r["detected_after_s"] is None else f"{r['detected_after_s']:.2f} s"
        out.append([r["detector"], f"{r['configured_s']:g} s", measured, said])
    return out


def hang_timeouts(timeouts_s, *, job: dict, gpus: int) -> list[dict]:
    """Time a whole job loses to one hang for each timeout T, from an ``interval_tradeoff`` job (notebook 06).

    ``job`` gives the restart R, the step t and Young's interval K; every one of ``gpus`` GPUs waits.
    Rows: ``{"timeout_s", "lost_s", "gpu_hours"}``, as ``hangs.time_lost_per_hang`` computes them.
    """
    from ..hangs import time_lost_per_hang

    cost = time_lost_per_hang(timeouts_s, restart_s=job["restart_s"], step_s=job["step_s"], every=job["k_young"])
    return [
        {"timeout_s": float(t), "lost_s": float(lost), "gpu_hours": float(lost) * gpus / 3600}
        for t, lost in zip(cost["wait_s"], cost["lost_s"])
    ]


def link_bytes_per_step(run: dict) -> float | None:
    """Mean bytes across node 0's cable per step with every group in, the heal aside (notebook 06).

    The heal sends the model and optimizer state across the link once, in the quorum of step
    ``healed_to_step`` (DiLoCo: of the synchronisation ending the round before it, so that round is left
    out whole: a round is the unit that crosses the link once): the report's ``heal_steps``, which the
    time-per-step median leaves out too. None on loopback.
    """
    both = _steps_both_in(run)
    return sum(both) / len(both) if both else None


def _steps_both_in(run: dict) -> list[int]:
    """Node 0's cable bytes of each step with every group in, the heal's step (DiLoCo: round) left out."""
    healing = set(run["heal_steps"])
    return [
        row["link_bytes"]
        for row in run["per_step"]
        if row["participants"] == run["replicas"] and row["link_bytes"] is not None and row["step"] not in healing
    ]


def loss_step_change(run: dict) -> float:
    """How much one step moved an ``ft_run``'s logged loss: the least-squares slope over its steps (notebook 06).

    A fit, not the median of step-to-step changes: those are mostly the batches' noise, not progress.
    """
    rows = [row for row in run["per_step"] if row["loss"] is not None]
    return abs(statistics.linear_regression([r["step"] for r in rows], [r["loss"] for r in rows]).slope)


def link_comparison(runs: dict) -> list[list]:
    """Synchronous DDP against DiLoCo over the same link, same steps, data and failure (notebook 06).

    ``runs``: ``{label: ft_run report}``. Rows: what was measured, one column per run: bytes across
    node 0's cable per step with both groups in (counted by the kernel on the node's interface), the
    median step with every group in (DiLoCo: a round's steps, synchronisation included, per step), the
    run's wall time, the mean loss of the last H steps, the loss's fitted change per step (its
    scale), the final weights' loss on a batch no step trained on, and what the failure cost.
    """

    def per_step_bytes(r):
        mean, n = link_bytes_per_step(r), len(_steps_both_in(r)) // (r["sync_every"] if r["diloco"] else 1)
        return (
            "- (loopback: no link to count)"
            if mean is None
            else f"{mean / 1e6:.2f} MB ({n} {'round' if r['diloco'] else 'step'}{'s' * (n != 1)})"
        )

    def step_time(r):  # how many distinct steps (DiLoCo: rounds) the median is over; step 0 is warm-up
        n, unit = r["timed"], "round" if r["diloco"] else "step"
        return (
            "-" if r["time_per_step_s"] is None else f"{r['time_per_step_s'] * 1e3:.0f} ms ({n} {unit}{'s' * (n != 1)})"
        )

    def train_time(r):  # steps x time per step; the launch's wall time adds the same fixed costs to both
        tps = r["time_per_step_s"]
        return ("-" if tps is None else f"{r['steps'] * tps:.2f} s") + f" (launch {r['wall_s']:.1f} s)"

    def final_loss(r):
        tail = [row["loss"] for row in r["per_step"][-max(r["sync_every"], 4) :]]
        return f"{sum(tail) / len(tail):.4f}"

    def step_change(r):  # the scale of the row above: how much one step moved the loss, fitted over the run
        return f"{loss_step_change(r):.4f}"

    def held_out(r):
        losses = set(r["held_out_loss"].values())  # one value when the groups' weights are equal
        return " / ".join(f"{x:.4f}" for x in sorted(losses))

    def failure(r):  # keys: "0" a group's first process, "1 restarted" its second (ft._discarded_by_group)
        def who(key):
            group, _, again = key.partition(" ")
            role = "restarted" if again else "killed" if any(k.startswith(f"{group} ") for k in keys) else "survivor"
            if again and r["diloco"]:
                role += ", its first round alone, replaced by the heal"
            return f"group {group} ({role})"

        keys = r["discarded_by_group"]
        parts = [f"{who(k)}: {n}" for k, n in keys.items() if n]
        unit = f"local steps (a round of {r['sync_every']} is kept or dropped whole)" if r["diloco"] else "step tries"
        waited = f"; survivors waited {r['stall_s']:.2f} s" if r.get("stall_s") is not None else ""
        return f"{unit} not committed: {'; '.join(parts) or 'none'}{waited}"

    return [
        [
            "bytes across the link per step (both groups in, the heal aside)",
            *(per_step_bytes(r) for r in runs.values()),
        ],
        ["time per step, every group in (median; DiLoCo: a round's time / H)", *(step_time(r) for r in runs.values())],
        [
            "training time, extrapolated: steps x time per step",
            *(train_time(r) for r in runs.values()),
        ],
        ["loss, mean of the last steps (DiLoCo: its groups' local models)", *(final_loss(r) for r in runs.values())],
        [
            "loss change per step (least-squares slope over the run, the scale of the row above)",
            *(step_change(r) for r in runs.values()),
        ],
        [
            "loss of the final, synchronised weights on a batch no step trained on",
            *(held_out(r) for r in runs.values()),
        ],
        [
            "a group killed inside the same step's all-reduce (logged tries only: the killed try never logged)",
            *(failure(r) for r in runs.values()),
        ],
        ["final weights of the groups", *("equal" if r["weights_equal"] else "DIFFERENT" for r in runs.values())],
    ]
