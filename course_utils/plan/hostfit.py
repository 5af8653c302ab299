"""This host's rates, fitted from notebook 05's measurement: achievable FLOP/s and all-gather latency and
bandwidth, so the planner's formulas can be drawn for the machine the course runs on (notebook 05).

The run that measures (``labs.lab05.block_overlap_worker``) lives with the notebook's experiments; this
is arithmetic on its readings.
"""

from __future__ import annotations

from ..comm import ring_bytes_sent
from .inputs import _need

# ---------------------------------------------------------------------------------------------
# Measured on this host (notebook 05): a block's compute against an all-gather of its parameters
# ---------------------------------------------------------------------------------------------


def _spread(readings) -> dict:
    """Median, range and quartiles of one size's readings (``statistics.quantiles``, inclusive): one slow
    reading widens the range but not the quartiles, so the fit is judged against the quartiles."""
    import statistics

    from ..instrument import spread

    out = spread(readings)
    q1, _, q3 = statistics.quantiles(sorted(readings), n=4, method="inclusive")
    return {**out, "q1": q1, "q3": q3}


def fit_latency_bandwidth(sweep: list) -> dict:
    """Latency and bandwidth of a collective, t = latency + sent bytes / bandwidth, fitted from a sweep over
    sizes (notebook 05: ``labs.lab05.block_overlap_worker``'s all-gathers; notebook 02: ``labs.lab02_cost``'s
    all-reduces), and judged against each size's spread.

    Each row is ``{"bytes", "world_size", "readings"}`` and optionally ``"kind"`` (the collective,
    ``"all_gather"`` when absent); the bytes one rank sends are ``comm.ring_bytes_sent`` of it (an all-gather's
    (N-1)/N of its output, which is also what it receives; an all-reduce's 2(N-1)/N), so the bandwidth is
    bytes per second through one rank, whatever the collective.

    Least squares in relative terms (each size weighs 1/median², so a 4 KB gather counts as much as an 8 MB
    one), with 0 <= latency <= the smallest measured median: a collective cannot take longer to start than
    the smallest one took in all. When the free fit breaks a bound the latency is pinned there and the
    bandwidth refitted. Verdict: each size's prediction against its quartiles (``within_quartiles``) and its
    range (``within``); ``explains``: every size inside its range.
    Returns ``{"latency_s", "bandwidth", "latency_bound_s", "pinned", "points": [{"bytes", "sent_bytes",
    "median_s", "min_s", "max_s", "q1_s", "q3_s", "n", "predicted_s", "within", "within_quartiles"}],
    "fitted_bytes", "sizes_within_quartiles", "explains"}``.
    """
    _need(len(sweep) >= 2, "the fit needs at least two sizes of all-gather readings")
    pts = []
    for r in sorted(sweep, key=lambda r: r["bytes"]):
        n = r["world_size"]
        _need(n >= 2, "a collective over one rank moves nothing: measure with two or more ranks")
        _need(len(r["readings"]) >= 2, "each size needs two or more readings to have a spread")
        pts.append({"bytes": r["bytes"], "sent_bytes": ring_bytes_sent(r.get("kind", "all_gather"), r["bytes"], n),
                    **{k if k == "n" else f"{k}_s": v for k, v in _spread(r["readings"]).items()}})  # fmt: skip
    xs, ts = [p["sent_bytes"] for p in pts], [p["median_s"] for p in pts]
    ws = [1.0 / t**2 for t in ts]
    sw, sx, sxx = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * x * x for w, x in zip(ws, xs))
    st, sxt = sum(w * t for w, t in zip(ws, ts)), sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * sxx - sx * sx
    a, c = ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det) if det > 0 else (0.0, sxt / sxx)
    bound, pinned = min(ts), None
    if a > bound or a < 0:
        a, pinned = (bound, "at the smallest median") if a > bound else (0.0, "at zero")
        c = sum(w * x * (t - a) for w, x, t in zip(ws, xs, ts)) / sxx
    _need(c > 0, "the readings do not grow with size: no bandwidth can be fitted (measure larger sizes)")
    for p in pts:
        p["predicted_s"] = a + c * p["sent_bytes"]
        p["within"] = p["min_s"] <= p["predicted_s"] <= p["max_s"]
        p["within_quartiles"] = p["q1_s"] <= p["predicted_s"] <= p["q3_s"]
    return {
        "latency_s": a,
        "bandwidth": 1.0 / c,
        "latency_bound_s": bound,
        "pinned": pinned,
        "points": pts,
        "fitted_bytes": [p["bytes"] for p in pts],
        "sizes_within_quartiles": sum(p["within_quartiles"] for p in pts),
        "explains": all(p["within"] for p in pts),
    }


def line_s(fit: dict, nbytes: float, world_size: int, kind: str = "all_gather") -> float:
    """Seconds the fitted line gives a collective of ``nbytes`` over ``world_size`` ranks (notebook 05: held
    against gathers timed apart from the sweep it was fitted to)."""
    return fit["latency_s"] + ring_bytes_sent(kind, nbytes, world_size) / fit["bandwidth"]


def host_fit(rows, gathers: list | None = None) -> dict:
    """Achievable FLOP/s and all-gather bandwidth of this host, fitted from ``labs.lab05.block_overlap_worker``
    rows, so the planner's formulas can be drawn for this machine (notebook 05).

    ``gathers``: the worker's all-gather sweep; with it the bandwidth (and latency) come from
    ``fit_latency_bandwidth`` (``"gather_fit"``), without it from the blocks' own gathers."""
    import statistics

    flops = [(24.0 * r["width"] ** 2 * r["tokens"]) / r["fwd_s"] for r in rows]
    if gathers:
        f = fit_latency_bandwidth(gathers)
        return {
            "flops": statistics.median(flops),
            "gather_bw": f["bandwidth"],
            "gather_latency_s": f["latency_s"],
            "gather_fit": f,
        }
    bws = [
        r["gather_bytes"] * (r["world_size"] - 1) / r["world_size"] / r["gather_s"] for r in rows if r["gather_s"] > 0
    ]
    return {"flops": statistics.median(flops), "gather_bw": statistics.median(bws) if bws else float("nan")}


# ---------------------------------------------------------------------------------------------
# DDP's bucket cap, priced with the fitted line (notebook 02)
# ---------------------------------------------------------------------------------------------


def bucket_step_time(
    fit: dict, world_size: int, compute_s: float, buckets: list, ready_s: dict, backward_s: float
) -> dict:
    """One DDP step's seconds at one bucket cap, two ways, from a ``fit_latency_bandwidth`` of all-reduces
    (notebook 02).

    ``buckets``: ``[{"bytes", "names"}]`` in issue order; ``ready_s``: when each gradient became final, seconds
    after the backward began (an undisturbed backward); ``compute_s``: the step with no communication. Each
    bucket's all-reduce costs t(B) = latency + ring bytes sent / bandwidth.

    - ``shared_s``: communication adds to the step, compute + sum of t(B). What a CPU run is: gloo's threads and
      the backward compete for the same cores, so little hides.
    - ``engine_s``: communication on its own engine (what NCCL on a GPU approximates): bucket k starts when
      its last gradient is ready and bucket k-1 is done, and the step pays compute + whatever is still in
      flight when the backward ends (``exposed_s``).
    Returns ``{"shared_s", "engine_s", "comm_s", "exposed_s", "calls"}``."""
    cost = [
        fit["latency_s"] + ring_bytes_sent("all_reduce", b["bytes"], world_size) / fit["bandwidth"] for b in buckets
    ]
    done = 0.0
    for b, t in zip(buckets, cost):
        done = max(done, max(ready_s[name] for name in b["names"])) + t
    exposed = max(0.0, done - backward_s)
    return {
        "shared_s": compute_s + sum(cost),
        "engine_s": compute_s + exposed,
        "comm_s": sum(cost),
        "exposed_s": exposed,
        "calls": len(buckets),
    }


def _iqr(row: dict) -> float:
    return row["measured"]["q3"] - row["measured"]["q1"]


def bucket_cap_model(costs: dict, world_size: int) -> dict:
    """The cost model of DDP's bucket cap, fitted and checked on one run's readings (notebook 02).

    ``costs`` is ``labs.lab02_cost.cap_costs``'s. Fits t(B) to its isolated all-reduces, prices every cap with
    ``bucket_step_time`` (the compute alone: the median of its steps), and holds each price against that cap's
    measured steps. Also fits the measured medians against the number of calls (a least-squares line): its
    slope is what one more all-reduce costs *inside a step*, to compare with the isolated latency.

    Returns ``{"fit", "compute_s", "rows": [{"cap_mb", "calls", "measured": spread, "shared_s", "engine_s",
    "exposed_s"}], "best_measured", "best_shared", "best_engine", "agrees", "per_call_in_step_s"}``;
    ``agrees``: the cap the shared-cores model picks ran, at its median, slower than the fastest cap by no more
    than the spread between repeats of one cap (the larger interquartile range of the two): the model picked the
    best cap, as far as this run can tell. Two caps a few percent apart swap places from run to run here."""
    import statistics

    fit = fit_latency_bandwidth(costs["all_reduce"])
    compute = statistics.median(costs["compute_s"])
    rows = []
    for cap, readings in costs["step_s"].items():
        buckets = costs["buckets"][cap]
        priced = bucket_step_time(fit, world_size, compute, buckets, costs["ready_s"], costs["backward_s"])
        rows.append({"cap_mb": cap, "calls": len(buckets), "measured": _spread(readings), **priced})
    best = min(rows, key=lambda r: r["measured"]["median"])
    shared = min(rows, key=lambda r: (r["shared_s"], r["calls"]))
    engine = min(rows, key=lambda r: (r["engine_s"], r["calls"]))
    calls, medians = [r["calls"] for r in rows], [r["measured"]["median"] for r in rows]
    slope = statistics.linear_regression(calls, medians).slope if len(set(calls)) > 1 else float("nan")
    return {
        "fit": fit,
        "compute_s": compute,
        "rows": rows,
        "best_measured": best["cap_mb"],
        "best_shared": shared["cap_mb"],
        "best_engine": engine["cap_mb"],
        "agrees": shared["measured"]["median"] - best["measured"]["median"] <= max(_iqr(shared), _iqr(best)),
        "per_call_in_step_s": slope,
    }
