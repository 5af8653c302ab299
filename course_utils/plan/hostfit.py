"""This host's rates, fitted from notebook 05's measurement: achievable FLOP/s and all-gather latency and
bandwidth, so the planner's formulas can be drawn for the machine the course runs on (notebook 05); and DDP's
bucket cap, priced with this host's fitted line and with a GPU's link table (notebook 02).

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

    from ..units import spread

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
    ``fit_latency_bandwidth`` (``"gather_fit"``), without it from the blocks' own gathers.

    Compute is fitted as a line, forward seconds = ``compute_overhead_s`` + FLOPs / ``flops`` (least squares
    of the relative misses over every row): a per-call overhead makes small calls look slow, so a median of
    per-row rates would mix the two."""
    import statistics

    import numpy as np

    work = np.array([24.0 * r["width"] ** 2 * r["tokens"] for r in rows])
    secs = np.array([r["fwd_s"] for r in rows])
    slope, overhead = np.polyfit(work, secs, 1, w=1 / secs) if len(rows) > 1 and np.ptp(work) > 0 else (0.0, 0.0)
    if slope <= 0 or overhead < 0:  # too few or too noisy rows for a line: through the origin
        slope, overhead = float(np.sum(work * secs) / np.sum(work * work)), 0.0
    compute = {"flops": 1.0 / float(slope), "compute_overhead_s": float(overhead)}
    if gathers:
        f = fit_latency_bandwidth(gathers)
        return {
            **compute,
            "gather_bw": f["bandwidth"],
            "gather_latency_s": f["latency_s"],
            "gather_fit": f,
        }
    bws = [
        r["gather_bytes"] * (r["world_size"] - 1) / r["world_size"] / r["gather_s"] for r in rows if r["gather_s"] > 0
    ]
    return {**compute, "gather_bw": statistics.median(bws) if bws else float("nan")}


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


def _order_pairs(rows: list) -> dict:
    """The shared-cores model's one claim about the pick, tested on every pair of caps: more calls, a slower step.
    Only pairs whose interquartile ranges do not overlap are judged (``apart``); ``in_order`` of them ran slower
    with more calls. Caps whose spreads overlap cannot be ranked by this run."""
    apart = in_order = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if a["calls"] == b["calls"]:
                continue
            few, many = (a, b) if a["calls"] < b["calls"] else (b, a)
            if few["measured"]["q3"] < many["measured"]["q1"]:
                apart, in_order = apart + 1, in_order + 1
            elif many["measured"]["q3"] < few["measured"]["q1"]:
                apart += 1
    return {"apart": apart, "in_order": in_order}


def bucket_cap_model(costs: dict, world_size: int) -> dict:
    """The cost model of DDP's bucket cap, fitted and checked on one run's readings (notebook 02).

    ``costs`` is ``labs.lab02_cost.cap_costs``'s. Fits t(B) to its isolated all-reduces and prices every cap with
    ``bucket_step_time`` (the compute alone: the median of its steps). Every cap sends the same bytes, so the
    shared-cores price differs between caps only by latency x calls: its pick is the fewest calls whatever the
    fit (``best_shared``), and what can be checked is its claim about the order and its prices:

    - ``order``: every pair of caps whose measured interquartile ranges are apart, ranked by calls
      (``_order_pairs``); ``order_holds``: at least one pair is apart and every such pair ran slower with more
      calls. Readings where more calls ran faster (an overlap that pays) fail it.
    - each row's ``shared_within_quartiles``: the isolated-call price inside that cap's measured quartiles;
      ``price_is_a_floor``: no cap ran faster than its price by more than the two readings' spread (each price,
      less the compute's interquartile range, at most that cap's upper quartile): the model's one assumption,
      nothing hides on shared cores. Readings where communication hid behind the compute fail it;
    - the in-step price: a least-squares line of the measured medians against the calls, fitted on the caps with
      the fewest and the most calls and every other cap between (``fitted``); the others are ``held_out``, priced
      by the line without having shaped it (``in_step_residual_s``: measured median less price). Its slope
      ``per_call_in_step_s`` is what one more all-reduce costs *inside a step* (to compare with the isolated
      latency) and whose intercept ``in_step_intercept_s`` is a step with no call overhead (to compare with
      the compute alone plus the bytes at the isolated bandwidth, ``compute_plus_bytes_s``); each row's
      ``in_step_s`` and ``in_step_within`` (inside that cap's measured quartiles); ``in_step_explains``: every
      cap's; ``held_out_within`` of the ``held_out`` caps. Whether one cost per call, the same at every cap,
      explains the steps (on two shared cores many small calls also queue behind each other, so it need not):
      measured, not promised, so nothing here is asserted.

    Returns ``{"fit", "compute_s", "compute_plus_bytes_s", "rows": [{"cap_mb", "calls", "measured": spread,
    "shared_s", "engine_s", "exposed_s", "shared_within_quartiles", "held_out", "in_step_s", "in_step_within",
    "in_step_residual_s"}],
    "best_measured", "best_shared", "best_engine", "order", "order_holds", "price_is_a_floor", "per_call_in_step_s",
    "in_step_intercept_s", "in_step_explains", "held_out_within", "held_out"}``."""
    import statistics

    fit = fit_latency_bandwidth(costs["all_reduce"])
    compute_spread = _spread(costs["compute_s"])
    compute = compute_spread["median"]
    rows = []
    for cap, readings in costs["step_s"].items():
        buckets = costs["buckets"][cap]
        priced = bucket_step_time(fit, world_size, compute, buckets, costs["ready_s"], costs["backward_s"])
        m = _spread(readings)
        rows.append({"cap_mb": cap, "calls": len(buckets), "measured": m, **priced,
                     "shared_within_quartiles": m["q1"] <= priced["shared_s"] <= m["q3"]})  # fmt: skip
    by_calls = sorted(rows, key=lambda r: r["calls"])
    fitted = [r for i, r in enumerate(by_calls) if i % 2 == 0 or i == len(by_calls) - 1]  # the ends, every other
    fit_calls = [r["calls"] for r in fitted]
    line = (
        statistics.linear_regression(fit_calls, [r["measured"]["median"] for r in fitted])
        if len(set(fit_calls)) > 1
        else None
    )
    for r in rows:
        r["held_out"] = r not in fitted
        r["in_step_s"] = float("nan") if line is None else line.intercept + line.slope * r["calls"]
        r["in_step_within"] = r["measured"]["q1"] <= r["in_step_s"] <= r["measured"]["q3"]
        r["in_step_residual_s"] = r["measured"]["median"] - r["in_step_s"]
    order = _order_pairs(rows)
    payload = sum(b["bytes"] for b in next(iter(costs["buckets"].values())))
    return {
        "fit": fit,
        "compute_s": compute,
        "compute_plus_bytes_s": compute + ring_bytes_sent("all_reduce", payload, world_size) / fit["bandwidth"],
        "rows": rows,
        "best_measured": min(rows, key=lambda r: r["measured"]["median"])["cap_mb"],
        "best_shared": min(rows, key=lambda r: (r["shared_s"], r["calls"]))["cap_mb"],
        "best_engine": min(rows, key=lambda r: (r["engine_s"], r["calls"]))["cap_mb"],
        "order": order,
        "order_holds": order["apart"] >= 1 and order["in_order"] == order["apart"],
        "price_is_a_floor": all(
            r["shared_s"] - (compute_spread["q3"] - compute_spread["q1"]) <= r["measured"]["q3"] for r in rows
        ),
        "per_call_in_step_s": float("nan") if line is None else line.slope,
        "in_step_intercept_s": float("nan") if line is None else line.intercept,
        "in_step_explains": all(r["in_step_within"] for r in rows),
        "held_out_within": sum(r["in_step_within"] for r in rows if r["held_out"]),
        "held_out": sum(r["held_out"] for r in rows),
    }


# ---------------------------------------------------------------------------------------------
# DDP's bucket cap on a GPU, priced with the planner's link table (notebook 02)
# ---------------------------------------------------------------------------------------------


def bucket_cap_closed_form(grad_bytes: float, backward_s: float, world_size: int, fit: dict) -> dict:
    """The best bucket cap when the backward makes its gradients at an even rate, solved by hand (notebook 02): the
    model ``tensor_backward_caps`` schedules for the blocks' buckets. With G bytes made evenly
    over a backward of T seconds, a bucket of C bytes fills in T·C/G and its all-reduce takes α + β'C
    (β' = 2(N-1)/N / bandwidth). When T > β'G the all-reduces keep up once α + β'C <= T·C/G, from
    C* = αG / (T - β'G) on, and the step then pays only the last bucket, α + β'C: the best cap is C*. When
    T <= β'G they never keep up: the step pays T·C/G + (G/C)·α + β'G - T, least at C = G·sqrt(α/T).
    Returns ``{"cap_bytes", "keeps_up"}``."""
    import math

    per_byte = ring_bytes_sent("all_reduce", 1.0, world_size) / fit["bandwidth"]
    spare = backward_s - per_byte * grad_bytes
    if spare > 0:
        return {"cap_bytes": fit["latency_s"] * grad_bytes / spare, "keeps_up": True}
    return {"cap_bytes": grad_bytes * math.sqrt(fit["latency_s"] / backward_s), "keeps_up": False}


def tensor_backward_caps(layout: dict, backward_s: float, world_size: int, fit: dict) -> list:
    """Each cap's exposed communication for a model's real buckets (notebook 02), scheduled by
    ``bucket_step_time``'s own engine (``fit``: ``{"latency_s", "bandwidth"}``).

    ``layout``: ``{"tensors": [(name, bytes)] in the order the backward makes them final, "buckets": {cap bytes:
    [{"bytes", "names"}] in issue order}}`` (``labs.lab02.preset_buckets``: DDP's rule, whole tensors only). The
    blocks' gradients (names under ``blocks.``, the course model's) are made at an even rate over ``backward_s``,
    each final when its last byte is; a tensor outside the blocks is final when the blocks before it in that order
    are: the final norm's at once, the embeddings' (the tied head's gradient among them) when the backward ends.
    Returns ``[{"cap_bytes", "calls", "comm_s", "exposed_s"}]``."""
    blocks = sum(b for name, b in layout["tensors"] if name.startswith("blocks."))
    ready, made = {}, 0
    for name, nbytes in layout["tensors"]:
        made += nbytes if name.startswith("blocks.") else 0
        ready[name] = backward_s * made / blocks
    rows = []
    for cap, buckets in layout["buckets"].items():
        p = bucket_step_time(fit, world_size, 0.0, buckets, ready, backward_s)
        rows.append({"cap_bytes": cap, "calls": len(buckets), "comm_s": p["comm_s"], "exposed_s": p["exposed_s"]})
    return rows


def gpu_bucket_caps(preset: str, micro_batches, layout: dict, *, gpus: int = 8, gpu: str = "H100-80GB") -> list:
    """DDP's bucket cap for ``preset`` data-parallel over one node's ``gpus`` GPUs, per micro-batch (notebook 02).

    α and β are the throughput planner's link table (``GPUCluster``'s ``intra_latency``, the GPU's ``nvlink_bw``),
    not a measurement of this host. The backward takes twice the blocks' forward FLOPs (``block_flops``, no
    activation checkpointing) at the GPU's achievable FLOP/s. ``layout``: the model's gradients and each cap's
    buckets (``labs.lab02.preset_buckets``: fp32 weights, so fp32 buckets), priced by ``tensor_backward_caps``; its
    caps must include torch's default of 25 MiB. The last gradient to become final is the embedding's, so no cap
    exposes less than its all-reduce alone (``floor_s``); ``closed`` solves the even-rate model
    (``bucket_cap_closed_form``) for the blocks' gradients alone (``blocks_bytes``), the part the backward makes
    evenly.
    Returns per micro-batch ``{"micro_batch", "latency_s", "bandwidth", "backward_s", "bytes_s" (β'G), "floor_s",
    "last_bytes", "blocks_bytes", "best" (a row of ``tensor_backward_caps``), "closed" (``bucket_cap_closed_form``),
    "default" (the 25 MiB row)}``."""
    from .inputs import GPUS, model_spec
    from .network import block_flops
    from .shapes import GPUCluster

    card = GPUS[gpu]
    cluster = GPUCluster(card, gpus_per_node=gpus)
    fit = {"latency_s": cluster.intra_latency, "bandwidth": card.nvlink_bw}
    total = sum(b for _, b in layout["tensors"])
    blocks = sum(b for name, b in layout["tensors"] if name.startswith("blocks."))
    last = layout["tensors"][-1][1]
    out = []
    for mb in micro_batches:
        spec = model_spec(preset, micro_batch=mb, checkpointing=False)
        backward = 2 * spec.layers * block_flops(spec) / (card.peak_flops * card.mfu)
        rows = tensor_backward_caps(layout, backward, gpus, fit)
        out.append({
            "micro_batch": mb,
            **fit, "backward_s": backward,
            "bytes_s": ring_bytes_sent("all_reduce", total, gpus) / card.nvlink_bw,
            "floor_s": fit["latency_s"] + ring_bytes_sent("all_reduce", last, gpus) / card.nvlink_bw,
            "last_bytes": last, "blocks_bytes": blocks,
            "best": min(rows, key=lambda r: (r["exposed_s"], r["calls"])),
            "closed": bucket_cap_closed_form(blocks, backward, gpus, fit),
            "default": next(r for r in rows if r["cap_bytes"] == 25 * 2**20),
        })  # fmt: skip
    return out
