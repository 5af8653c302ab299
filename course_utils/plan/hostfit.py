"""This host's rates, fitted from notebook 05's measurement: achievable FLOP/s and all-gather latency and
bandwidth, so the planner's formulas can be drawn for the machine the course runs on (notebook 05).

The run that measures (``labs.lab05.block_overlap_worker``) lives with the notebook's experiments; this
is arithmetic on its readings.
"""

from __future__ import annotations

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
    """Latency and bandwidth of a collective, t = latency + received bytes / bandwidth, fitted from
    ``labs.lab05.block_overlap_worker``'s sweep over every size, and judged against each size's spread
    (notebook 05).

    Least squares in relative terms (each size weighs 1/median², so a 4 KB gather counts as much as an 8 MB
    one), with 0 <= latency <= the smallest measured median: a collective cannot take longer to start than
    the smallest one took in all. When the free fit breaks a bound the latency is pinned there and the
    bandwidth refitted. Verdict: each size's prediction against its quartiles (``within_quartiles``) and its
    range (``within``); ``explains``: every size inside its range.
    Returns ``{"latency_s", "bandwidth", "latency_bound_s", "pinned", "points": [{"bytes", "received_bytes",
    "median_s", "min_s", "max_s", "q1_s", "q3_s", "n", "predicted_s", "within", "within_quartiles"}],
    "fitted_bytes", "sizes_within_quartiles", "explains"}``.
    """
    _need(len(sweep) >= 2, "the fit needs at least two sizes of all-gather readings")
    pts = []
    for r in sorted(sweep, key=lambda r: r["bytes"]):
        n = r["world_size"]
        _need(n >= 2, "a collective over one rank moves nothing: measure with two or more ranks")
        _need(len(r["readings"]) >= 2, "each size needs two or more readings to have a spread")
        pts.append({"bytes": r["bytes"], "received_bytes": r["bytes"] * (n - 1) / n,
                    **{k if k == "n" else f"{k}_s": v for k, v in _spread(r["readings"]).items()}})  # fmt: skip
    xs, ts = [p["received_bytes"] for p in pts], [p["median_s"] for p in pts]
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
        p["predicted_s"] = a + c * p["received_bytes"]
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
