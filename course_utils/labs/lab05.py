"""Notebook 05's measurement: a block's compute against an all-gather of its parameters, on this host.

``course_utils.plan`` holds the arithmetic (``plan.host_fit`` and the overlap model);
this worker is the run that feeds it, started by ``course_utils.launch``.
"""
from __future__ import annotations


def block_overlap_worker(widths=(64, 128, 256), tokens=(64, 256, 1024), repeats: int = 3, seq: int = 64) -> list:
    """Worker for ``course_utils.launch``: time one course-model block's forward and backward, and
    an all-gather of its parameters sharded over the ranks, for each width and tokens per
    micro-batch (notebook 05).

    Runs in fp32 on CPU (16-bit matmuls are slow there) with one thread per rank. Returns, on
    every rank, rows ``{"width", "tokens", "params", "fwd_s", "fwd_bwd_s", "gather_s",
    "gather_bytes", "world_size", "backend"}`` (medians over ``repeats``; times are rank 0's).
    """
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from .. import dist as cdist
    from ..models import Block, get_config

    info = cdist.init()
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
                t0 = time.perf_counter()
                dist.all_gather(out, shard)
                gathers.append(time.perf_counter() - t0)
            for ntok in tokens:
                b = max(1, ntok // seq)
                x = torch.randn(b, min(seq, ntok), width, device=info.device, requires_grad=True)
                fwd, both = [], []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        block(x)
                    fwd.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    block(x).sum().backward()
                    both.append(time.perf_counter() - t0)
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
