"""Notebook 05's measurement: a block's compute against an all-gather of its parameters, on this host.

``course_utils.plan`` holds the arithmetic (``plan.host_fit``, ``plan.fit_latency_bandwidth`` and
the overlap model); this worker is the run that feeds it, started by ``course_utils.launch``.
"""

from __future__ import annotations

import time

#: Sizes (bytes of the gathered fp32 tensor) of the all-gather sweep: from latency-bound to bandwidth-bound.
#: They stop at 8 MB: a 16 MB gather over loopback ran slower per byte here (past the CPU's caches) and fell
#: outside the range of its readings on the line fitted to 0.5-8 MB; one line describes one regime.
GATHER_BYTES = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 22, 1 << 23)


def time_on_device(fn, sync) -> float:
    """Seconds one call of ``fn()`` takes, with ``sync()`` called before the clock starts and again
    before it stops (notebook 05).

    ``sync`` is ``course_utils.dist.synchronize`` for the device the work runs on. CUDA queues
    kernels and returns at once, so without it the clock would stop when the work was launched,
    not when it was done (and the first reading would include whatever was still queued). On CPU
    it does nothing.
    """
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def time_collectives(fns: dict, sync, barrier=None, *, warmup: int = 2, repeats: int = 5, inner: int = 2) -> dict:
    """Seconds per call of each collective in ``fns`` (``{key: fn}``), one reading per repeat:
    ``{key: [seconds, ...]}`` (notebook 05).

    Each ``fn`` is called ``warmup`` times first (the first calls of a size allocate buffers and,
    on gloo, set up the pairs' transport). Then ``repeats`` rounds; in each round every ``fn`` in
    turn gets one reading of ``inner`` back-to-back calls. Interleaving the keys makes a burst of
    load on a shared machine land on all of them, not on one size's readings. ``barrier``
    (``dist.barrier``) lines the ranks up before each reading starts its clock, never inside the
    timed region: a barrier inside it would time the barrier's own round trip and the slowest
    rank's arrival as if they were the gather. The spread of the readings (``units.spread``) is what
    a comparison with a model has to beat.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    readings = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            if barrier is not None:
                barrier()
            readings[key].append(time_on_device(lambda fn=fn: [fn() for _ in range(inner)], sync) / inner)
    return readings


def time_collective(fn, sync, barrier=None, **kwargs) -> list:
    """``time_collectives`` for one collective: its readings, seconds per call (notebook 05)."""
    return time_collectives({0: fn}, sync, barrier, **kwargs)[0]


def block_overlap_worker(
    widths=(64, 128, 256),
    tokens=(64, 256, 1024),
    repeats: int = 3,
    seq: int = 64,
    gather_bytes=GATHER_BYTES,
    gather_repeats: int = 7,
) -> dict:
    """Worker for ``course_utils.launch``: time one course-model block's forward and backward, and
    an all-gather of its parameters sharded over the ranks, for each width and tokens per
    micro-batch; then all-gathers of ``gather_bytes`` sizes for the latency and bandwidth fit
    (notebook 05).

    Runs in fp32 with one thread per rank, on CPU (16-bit matmuls are slow there) or on this
    rank's GPU; every timer waits for the device (``time_on_device``), every gather is timed by
    ``time_collective(s)`` (warmed up, no barrier inside the clock, the sweep's sizes interleaved). Returns, on every rank,
    ``{"blocks": rows, "gathers": sweep}`` with rank 0's times: rows ``{"width", "tokens",
    "params", "fwd_s", "fwd_bwd_s", "gather_s", "gather_bytes", "world_size", "backend"}``
    (medians over ``repeats``), sweep ``{"bytes", "world_size", "readings"}`` (``gather_repeats``
    readings per size).
    """
    import functools
    import statistics

    import torch
    import torch.distributed as dist

    from .. import dist as cdist
    from ..models import Block, get_config

    info = cdist.init()
    sync = functools.partial(cdist.synchronize, info.device)  # CUDA work is asynchronous: wait before each clock read
    n = info.world_size

    def gather_of(numel):
        shard = torch.zeros(-(-numel // n), device=info.device)
        out = [torch.empty_like(shard) for _ in range(n)]
        return shard, out, functools.partial(dist.all_gather, out, shard)

    try:
        torch.set_num_threads(1)
        rows = []
        for width in widths:
            cfg = get_config("tiny", width=width, heads=max(1, width // 64), seq=seq)
            torch.manual_seed(0)
            block = Block(cfg).to(info.device)
            flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()])
            shard, _, gather = gather_of(flat.numel())
            part = flat[info.rank * shard.numel() : (info.rank + 1) * shard.numel()]
            shard[: part.numel()] = part
            gather_s = statistics.median(time_collective(gather, sync, dist.barrier, repeats=repeats))
            for ntok in tokens:
                b = max(1, ntok // seq)
                x = torch.randn(b, min(seq, ntok), width, device=info.device, requires_grad=True)
                fwd, both = [], []
                for _ in range(repeats + 1):
                    fwd.append(time_on_device(torch.no_grad()(lambda block=block, x=x: block(x)), sync))
                    both.append(time_on_device(lambda block=block, x=x: block(x).sum().backward(), sync))
                rows.append(
                    {
                        "width": width,
                        "tokens": b * min(seq, ntok),
                        "params": flat.numel(),
                        "fwd_s": statistics.median(fwd[1:]),
                        "fwd_bwd_s": statistics.median(both[1:]),
                        "gather_s": gather_s,
                        "gather_bytes": 4 * shard.numel() * n,
                        "world_size": n,
                        "backend": info.backend,
                    }
                )
        gathers = {}
        for nbytes in gather_bytes:
            shard, _, gather = gather_of(max(1, nbytes // 4))
            gathers[4 * shard.numel() * n] = gather
        readings = time_collectives(gathers, sync, dist.barrier, repeats=gather_repeats)
        sweep = [{"bytes": size, "world_size": n, "readings": readings[size]} for size in gathers]
        # every rank reports rank 0's numbers, so the table does not depend on which rank is read
        box = [{"blocks": rows, "gathers": sweep}]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    finally:
        cdist.shutdown()


def _overlap(span, spans) -> float:
    """Seconds of ``span`` (start, end) that fall inside any of ``spans`` (which do not overlap each other)."""
    return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in spans)


def backward_overlap(timeline: dict) -> dict:
    """One clocked backward (``instrument.CountCollectives.timeline``, a row of ``cluster.links_vs_planner``) read
    unit by unit: what of the cross-node collectives ran while a unit computed (notebook 05).

    Returns ``{"compute": [(began, ended)] per block in forward order, "cross": [(issued, done)] in issue order,
    "cross_s"`` (their durations added), ``"hidden_s"`` (the part of them inside a block's backward),
    ``"exposed_s" = cross_s - hidden_s``, ``"planned_exposed_s"}``: ``plan.exposed_comm`` on the same durations,
    each collective issued at the end of the unit before it, as on a GPU's second stream (the root's compute is
    what the backward spent outside the blocks and the collectives).
    """
    from .. import plan

    compute = [tuple(u) for u in timeline["units"] if None not in u]
    cross = [(c["issued"], c["done"]) for c in timeline["collectives"] if c["spans_nodes"] and c["done"] is not None]
    durations = [e - s for s, e in cross]
    cross_s = sum(durations)
    hidden_s = sum(_overlap(c, compute) for c in cross)
    blocks = [e - s for s, e in compute]
    comm = [e - s for c in timeline["collectives"] if (s := c["issued"]) is not None and (e := c["done"]) is not None]
    root = max(0.0, timeline["backward_end"] - sum(blocks) - sum(comm))
    bwd = [root, *blocks]  # forward order: the root unit first (its backward ends last)
    # the last-issued collective belongs to the root (DDP's one bucket, HSDP's root unit), the others to the blocks
    scatter = (durations[::-1] + [0.0] * len(bwd))[: len(bwd)]
    zeros = [0.0] * len(bwd)
    planned = plan.exposed_comm(zeros, bwd, zeros, scatter, backward_gather=zeros)[1]
    return {
        "compute": compute,
        "cross": cross,
        "cross_s": cross_s,
        "hidden_s": hidden_s,
        "exposed_s": cross_s - hidden_s,
        "planned_exposed_s": planned,
    }


def link_split(row: dict, base: dict, rate: float) -> dict:
    """What a slow link added to one timed step, split at the clocked backward (notebook 05). ``row`` and ``base``:
    rows of ``cluster.links_vs_planner``, one strategy on the slow link and on the unlimited cable; ``rate``: the
    link's bytes/s.

    Returns ``wire_s`` (the busier card's bytes at ``rate``: the link model), ``added_s`` (the step's seconds over
    ``base``'s), ``collectives_s`` and ``base_collectives_s`` (the clocked backward's cross-node collectives, here
    and on the unlimited cable), ``clocked_share`` (their part of the step's card bytes, ``comm.node_card_bytes``:
    below 1 where collectives outside the backward cross too, FULL_SHARD's forward all-gathers) and ``outside_s``:
    ``added_s`` less what the collectives took longer, the part of the step's addition outside them.
    """
    from ..comm import node_card_bytes

    here, there = (backward_overlap(r["timeline"])["cross_s"] for r in (row, base))
    crossing = [c for c in row["timeline"]["collectives"] if c["spans_nodes"]]
    clocked = sum(node_card_bytes(c["kind"], c["bytes"], c["group"], row["world_size"]) for c in crossing)
    added = row["step_time_s"] - base["step_time_s"]
    return {
        "wire_s": max(row["card_bytes_per_step"]) / rate,
        "added_s": added,
        "collectives_s": here,
        "base_collectives_s": there,
        "clocked_share": clocked / row["predicted_card_bytes"],
        "outside_s": added - (here - there),
    }
