"""Reference solutions, notebook 04 (``load_solution("04", name)`` prints and defines one)."""

import torch
import torch.distributed as dist


def shard_dim0(full, rank, world_size):
    """Rank r's rows of full along dim 0, FSDP2-style: c = ceil(rows / N) rows, zero-padded."""
    rows = full.shape[0]
    c = -(-rows // world_size)
    start, stop = min(rank * c, rows), min((rank + 1) * c, rows)
    out = full.new_zeros((c, *full.shape[1:]))
    out[: stop - start] = full[start:stop]
    return out


def unshard(shard, dim0):
    """All-gather every rank's padded shard (c rows) and return the full parameter (dim0 rows)."""
    out = shard.new_empty((dist.get_world_size() * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_single(out, shard.contiguous())
    return out[:dim0]


def clip_sharded(grads, max_norm):
    """Clip gradient shards in place by the whole gradient's norm; return that norm."""
    total = torch.zeros(())
    for g in grads:
        total += g.float().pow(2).sum()
    dist.all_reduce(total)  # every rank's squares: the whole gradient's
    norm = total.sqrt()
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
    for g in grads:
        g.mul_(scale)
    return norm


def choose_layout(budget_bytes, units):
    """{"wrap": "block"|"model", "reshard_after_forward": bool} that fits budget_bytes with the fewest all-gathered
    bytes, or None."""
    whole = 4 * sum(u["numel"] for u in units)
    root = 4 * sum(u["numel"] for u in units if u["name"] == "(root)")
    largest_block = 4 * max((u["numel"] for u in units if u["name"] != "(root)"), default=0)
    if whole <= budget_bytes:
        return {"wrap": "block", "reshard_after_forward": False}  # each parameter all-gathered once
    if root + largest_block <= budget_bytes:
        return {"wrap": "block", "reshard_after_forward": True}  # gathered again for the backward
    return None
