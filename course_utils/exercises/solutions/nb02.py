"""Reference solutions, notebook 02 (``load_solution("02", name)`` prints and defines one)."""

import torch
import torch.distributed as dist


def averaging_hook(grad):
    """Return grad averaged over every rank (runs on every rank, once per parameter, during backward)."""
    g = grad.clone()
    dist.all_reduce(g)
    return g / dist.get_world_size()


def overlapped_buckets(buckets):
    """Hook every parameter; start each bucket's async all-reduce from the hooks; return finish()."""
    buckets = [list(b) for b in buckets]
    flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in buckets]
    slot = {}  # parameter -> (bucket, offset)
    for i, bucket in enumerate(buckets):
        offset = 0
        for p in bucket:
            slot[p] = (i, offset)
            offset += p.numel()
    filled, works = [0] * len(buckets), []  # works: one handle per started bucket, in index order

    def ready(p):
        i, offset = slot[p]
        flats[i][offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        filled[i] += 1
        while len(works) < len(buckets) and filled[len(works)] == len(buckets[len(works)]):
            works.append(dist.all_reduce(flats[len(works)], async_op=True))

    for p in slot:
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        """After loss.backward(): wait for every bucket, leave the mean gradient in each p.grad."""
        if len(works) < len(buckets):
            raise RuntimeError(f"bucket {len(works)} never filled: a parameter got no gradient")
        for bucket, flat, work in zip(buckets, flats, works):
            work.wait()
            flat.div_(dist.get_world_size())
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        filled[:] = [0] * len(buckets)
        works.clear()

    return finish
