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

#: A size is bandwidth-bound when its bytes take at least this many times the latency on the wire (three
#: quarters of its time): nearer the latency, per-call overheads the line does not model show up (a 64 KB
#: gather with bytes/bandwidth just above the latency fell below its measured range here).
BANDWIDTH_DOMINATES = 3.0


def fit_latency_bandwidth(sweep: list) -> dict:
    """Latency and bandwidth of a collective, t = latency + received bytes / bandwidth, fitted from
    ``labs.lab05.block_overlap_worker``'s sweep, and whether the fit explains its points (notebook 05).

    Each size's readings give a median and a range (``instrument.spread``). The fit is least squares in
    relative terms (each point weighs by 1/median², so small sizes count as much as large ones)
    over the sizes where bandwidth dominates: received bytes / bandwidth at least
    ``BANDWIDTH_DOMINATES`` times the latency,
    chosen again after each fit until the choice settles (the three largest sizes if fewer qualify:
    a line through two points would explain them whatever they were).
    A negative latency (noise at the small end) is refitted as zero. ``explains``: every fitted
    size's prediction lies inside that size's measured range.
    Returns ``{"latency_s", "bandwidth", "points": [{"bytes", "received_bytes", "median_s", "min_s",
    "max_s", "n", "predicted_s", "fitted", "within"}], "fitted_bytes", "explains"}``.
    """
    from ..instrument import spread

    _need(len(sweep) >= 2, "the fit needs at least two sizes of all-gather readings")
    pts = []
    for r in sorted(sweep, key=lambda r: r["bytes"]):
        n = r["world_size"]
        _need(n >= 2, "a collective over one rank moves nothing: measure with two or more ranks")
        pts.append(
            {
                "bytes": r["bytes"],
                "received_bytes": r["bytes"] * (n - 1) / n,
                **{f"{k}_s" if k != "n" else k: v for k, v in spread(r["readings"]).items()},
            }
        )

    def fit(chosen):
        xs = [p["received_bytes"] for p in chosen]
        ts = [p["median_s"] for p in chosen]
        ws = [1.0 / t**2 for t in ts]
        sw, sx, sxx = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * x * x for w, x in zip(ws, xs))
        st, sxt = sum(w * t for w, t in zip(ws, ts)), sum(w * x * t for w, x, t in zip(ws, xs, ts))
        det = sw * sxx - sx * sx
        a, c = ((sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det) if det > 0 else (0.0, sxt / sxx)
        if a < 0 or c <= 0:  # noise at the small end: a line through the origin
            a, c = 0.0, sxt / sxx
        return a, c

    least = min(3, len(pts))  # a line through two points explains them whatever they are: fit three or more
    chosen = pts[-least:]
    for _ in range(len(pts)):
        a, c = fit(chosen)
        again = [p for p in pts if p["received_bytes"] * c >= BANDWIDTH_DOMINATES * a]
        again = again if len(again) >= least else pts[-least:]
        if again == chosen:
            break
        chosen = again
    for p in pts:
        p["predicted_s"] = a + c * p["received_bytes"]
        p["fitted"] = p in chosen
        p["within"] = p["min_s"] <= p["predicted_s"] <= p["max_s"]
    return {
        "latency_s": a,
        "bandwidth": 1.0 / c,
        "points": pts,
        "fitted_bytes": [p["bytes"] for p in chosen],
        "explains": all(p["within"] for p in chosen),
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
