"""Notebook 05's measurement: a block's compute against an all-gather of its parameters, on this host.

``course_utils.plan`` holds the arithmetic (``plan.host_fit`` and the overlap model);
this worker is the run that feeds it, started by ``course_utils.launch``.
"""
from __future__ import annotations

import time


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


def block_overlap_worker(widths=(64, 128, 256), tokens=(64, 256, 1024), repeats: int = 3, seq: int = 64) -> list:
    """Worker for ``course_utils.launch``: time one course-model block's forward and backward, and
    an all-gather of its parameters sharded over the ranks, for each width and tokens per
    micro-batch (notebook 05).

    Runs in fp32 with one thread per rank, on CPU (16-bit matmuls are slow there) or on this
    rank's GPU; every timer waits for the device (``time_on_device``). Returns, on
    every rank, rows ``{"width", "tokens", "params", "fwd_s", "fwd_bwd_s", "gather_s",
    "gather_bytes", "world_size", "backend"}`` (medians over ``repeats``; times are rank 0's).
    """
    import functools
    import statistics

    import torch
    import torch.distributed as dist

    from .. import dist as cdist
    from ..models import Block, get_config

    info = cdist.init()
    sync = functools.partial(cdist.synchronize, info.device)  # CUDA work is asynchronous: wait before each clock read
    try:
        torch.set_num_threads(1)
        rows = []
        for width in widths:
            cfg = get_config("tiny", width=width, heads=max(1, width // 64), seq=seq)
            torch.manual_seed(0)
            block = Block(cfg).to(info.device)
            flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()])
            n = info.world_size
            shard_len = -(-flat.numel() // n)
            shard = torch.zeros(shard_len, device=info.device)
            part = flat[info.rank * shard_len:(info.rank + 1) * shard_len]
            shard[:part.numel()] = part
            out = [torch.empty_like(shard) for _ in range(n)]
            gathers = []
            for _ in range(repeats + 1):
                dist.barrier()
                gathers.append(time_on_device(lambda out=out, shard=shard: dist.all_gather(out, shard), sync))
            for ntok in tokens:
                b = max(1, ntok // seq)
                x = torch.randn(b, min(seq, ntok), width, device=info.device, requires_grad=True)
                fwd, both = [], []
                for _ in range(repeats + 1):
                    fwd.append(time_on_device(torch.no_grad()(lambda block=block, x=x: block(x)), sync))
                    both.append(time_on_device(lambda block=block, x=x: block(x).sum().backward(), sync))
                rows.append({"width": width, "tokens": b * min(seq, ntok), "params": flat.numel(),
                             "fwd_s": statistics.median(fwd[1:]), "fwd_bwd_s": statistics.median(both[1:]),
                             "gather_s": statistics.median(gathers[1:]), "gather_bytes": 4 * shard_len * n,
                             "world_size": n, "backend": info.backend})
        # every rank reports rank 0's numbers, so the table does not depend on which rank is read
        box = [rows]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    finally:
        cdist.shutdown()
