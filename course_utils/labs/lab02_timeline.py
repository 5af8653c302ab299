"""Reading one DDP step's timeline (notebook 02): how much communication ran inside the backward, every
rank's step on one clock, and what each rank's all-reduces waited for.

The timelines are ``step_timeline``'s, built by ``labs.lab02_cost`` from ``BucketedDDP(timeline=True)``
events of an uninstrumented step (in ms after the rank's backward began); these functions are plain arithmetic
on them.
"""

from __future__ import annotations


def step_timeline(events: list, t0: float, t_backward: float, t_backward_end: float, t_synced: float) -> dict:
    """One step's ``BucketedDDP`` timeline events and the loop's clock readings (``time.perf_counter``: step
    start, backward start and end, gradients synchronised) as ms after the backward began."""
    ms = lambda t: (t - t_backward) * 1e3  # noqa: E731
    start = {b: ms(t) for t, e, b, _ in events if e == "start"}
    end = {b: ms(t) for t, e, b, _ in events if e == "end"}
    return {
        "ready": [{"bucket": b, "param": n, "t_ms": ms(t)} for t, e, b, n in events if e == "ready"],
        "all_reduce": [{"bucket": b, "start_ms": start[b], "end_ms": end.get(b)} for b in sorted(start)],
        "forward_ms": ms(t0),
        "backward_end_ms": ms(t_backward_end),
        "synced_ms": ms(t_synced),
        "clock_origin_s": t_backward,  # perf_counter is CLOCK_MONOTONIC: one clock for every process of a host
    }


def overlap_summary(timeline: dict) -> dict:
    """How much of the all-reduce time ran while backward was still computing (notebook 02).

    From a ``bucket_sweep`` timeline: how many buckets started before backward ended, the time
    at least one all-reduce was in flight (the union of their intervals: they overlap, so their
    sum would be longer than the step), the part of it inside the backward pass, and how long the
    optimizer waited after backward, in two parts: until the last all-reduce ended (``for_all_reduces_ms``),
    then host time until the step could start (``after_last_all_reduce_ms``: ``wait()`` returning, the mean
    copied into every ``.grad``), which no peer causes.
    """
    end = timeline["backward_end_ms"]
    spans = [
        (r["start_ms"], r["end_ms"] if r["end_ms"] is not None else timeline["synced_ms"])
        for r in timeline["all_reduce"]
    ]
    done = max([end] + [stop for _, stop in spans])  # the backward and every all-reduce over
    return {
        "for_all_reduces_ms": done - end,
        "after_last_all_reduce_ms": timeline["synced_ms"] - done,
        "buckets": len(spans),
        "started_during_backward": sum(start < end for start, _ in spans),
        "in_flight_ms": _union_ms(spans),
        "in_flight_during_backward_ms": _union_ms([(start, min(stop, end)) for start, stop in spans]),
        "wait_after_backward_ms": timeline["synced_ms"] - end,
        "step_ms": timeline["synced_ms"] - timeline["forward_ms"],
    }


def on_one_axis(timelines: list) -> list:
    """Every rank's timeline moved onto rank 0's: ms after rank 0's backward began (notebook 02).

    The sweep's timelines are each in ms after that rank's own backward began; their ``clock_origin_s``
    is that moment on ``time.perf_counter``, which on Linux is ``CLOCK_MONOTONIC``, one clock shared by
    every process of the host, so shifting by the difference puts all ranks on one time axis with no
    clock alignment. Only for ranks on one host.
    """
    zero = timelines[0]["clock_origin_s"]
    moved = []
    for t in timelines:
        d = (t["clock_origin_s"] - zero) * 1e3
        moved.append(
            {
                **t,
                **{k: t[k] + d for k in ("forward_ms", "backward_end_ms", "synced_ms")},
                "backward_start_ms": d,
                "ready": [{**r, "t_ms": r["t_ms"] + d} for r in t["ready"]],
                "all_reduce": [
                    {**r, "start_ms": r["start_ms"] + d, "end_ms": None if r["end_ms"] is None else r["end_ms"] + d}
                    for r in t["all_reduce"]
                ],
            }
        )
    return moved


#: The worker threads a ``ProcessGroupGloo`` runs collectives on by default (``int threads{2}``,
#: ``ProcessGroupGloo.hpp``, torch 2.13): a third collective in flight waits for one of them to be free.
GLOO_THREADS = 2


def straggler_summary(timelines: list) -> dict:
    """What each rank's all-reduces waited for, from timelines on one axis (``on_one_axis``) (notebook 02).

    An all-reduce completes on a rank only once every rank has issued it. Per bucket: ``last_start_ms``
    (when the last rank issued it), ``last_rank`` (that rank, the bucket's straggler) and ``earliest_end_ms``
    (the first rank to see it complete), which can never be before the last start. Per rank, ``issued_last``
    (how many buckets it was the straggler of) and times on its own clock that add up without counting an
    instant twice (the bars overlap, so their sum would not fit in the step):

    - ``in_flight_ms``: the union of its all-reduces' bars, the time at least one was in flight;
    - ``waiting_for_others_ms``: the part of it when some all-reduce in flight on this rank had not yet been
      issued by every rank (a straggler is still computing, and this rank cannot finish its step without it,
      whatever gloo is doing with the older buckets meanwhile);
    - ``gloo_working_ms``: the rest, every all-reduce in flight issued everywhere: gloo moving and adding bytes;
    - ``of_which_thread_wait_ms``: information, not a third cost: the part of ``gloo_working_ms`` when more were in
      flight on the rank than gloo has worker threads (``GLOO_THREADS``), so a bucket waited for a thread while
      the two oldest were worked on. Nothing measured says a third thread would have moved the bytes sooner (on a
      busy CPU the threads share the same cores), so this time is not charged to the thread limit.
    """
    starts = [{r["bucket"]: r["start_ms"] for r in t["all_reduce"]} for t in timelines]
    ends = [
        {r["bucket"]: r["end_ms"] if r["end_ms"] is not None else t["synced_ms"] for r in t["all_reduce"]}
        for t in timelines
    ]
    buckets = sorted(starts[0])
    last = {b: max(s[b] for s in starts) for b in buckets}
    last_rank = {b: max(range(len(starts)), key=lambda r: starts[r][b]) for b in buckets}
    ranks = []
    for rank, (t, s, e) in enumerate(zip(timelines, starts, ends)):
        parts = _in_flight_parts([(b, s[b], e[b], last[b]) for b in buckets])
        issued_last = sum(last_rank[b] == rank for b in buckets)
        ranks.append(
            {"backward_ms": t["backward_end_ms"] - t["backward_start_ms"], "issued_last": issued_last, **parts}
        )
    return {
        "buckets": [
            {
                "bucket": b,
                "last_start_ms": last[b],
                "last_rank": last_rank[b],
                "earliest_end_ms": min(e[b] for e in ends),
            }
            for b in buckets
        ],
        "ranks": ranks,
    }


def _in_flight_parts(bars: list) -> dict:
    """One rank's ``(bucket, start, end, last rank's start)`` bars cut at every edge: each slice with an
    all-reduce in flight is waiting (one of them not yet issued everywhere), else gloo working (of which a thread
    wait when more are in flight than gloo's threads)."""
    edges = sorted({x for _, start, end, last in bars for x in (start, end, last)})
    out = {"in_flight_ms": 0.0, "waiting_for_others_ms": 0.0, "gloo_working_ms": 0.0, "of_which_thread_wait_ms": 0.0}
    for lo, hi in zip(edges, edges[1:]):
        live = [(b, last) for b, start, end, last in bars if start <= lo and hi <= end]
        if not live:
            continue
        out["in_flight_ms"] += hi - lo
        if any(lo < last for _, last in live):
            out["waiting_for_others_ms"] += hi - lo
        else:
            out["gloo_working_ms"] += hi - lo
            if len(live) > GLOO_THREADS:
                out["of_which_thread_wait_ms"] += hi - lo
    return out


def _union_ms(spans) -> float:
    """Length of the union of ``(start, stop)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total
