"""Reference solutions, notebook 03 (``load_solution("03", name)`` prints and defines one)."""

import torch
import torch.distributed as dist


def sharded_step(params, grads, lr):
    """One ZeRO-1 SGD step on flat, padded tensors; params ends updated and equal on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s = params.numel() // world
    grad_slice = torch.empty(s, dtype=grads.dtype)
    dist.reduce_scatter_single(grad_slice, grads)  # the sum over ranks of my slice only
    grad_slice /= world
    mine = params[rank * s : (rank + 1) * s]
    mine -= lr * grad_slice  # update my slice, nothing else
    dist.all_gather_single(params, mine.clone())  # share the new slices


def sharded_optimizer(params, optimizer_class, **defaults):
    """ZeRO-1: return step(grads) that updates the flat params with optimizer_class on this rank's slice."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s = params.numel() // world
    shard = params[rank * s : (rank + 1) * s].clone().requires_grad_()
    opt = optimizer_class([shard], **defaults)  # state for S elements: K·Ψ/Nd bytes

    def step(grads):
        shard.grad = torch.empty_like(shard)
        dist.reduce_scatter_single(shard.grad, grads)
        shard.grad /= world
        opt.step()
        dist.all_gather_single(params, shard.detach())

    return step


def zero2_hooks(flats):
    """Stage 2: reduce-scatter each bucket from a gradient hook as it fills, then drop its full gradients."""
    for flat in flats:
        arrived = [0]

        def ready(param, flat=flat, arrived=arrived):
            arrived[0] += 1
            if arrived[0] < len(flat.params):
                return  # the bucket is not complete yet
            arrived[0] = 0
            send = torch.zeros(flat.padded, dtype=param.grad.dtype)
            torch.cat([p.grad.reshape(-1) for p in flat.params], out=send[: flat.numel])
            out = torch.empty(flat.shard_numel, dtype=send.dtype)
            dist.reduce_scatter_single(out, send)  # the sum over ranks of my S elements only
            flat.grad_shard = out / flat.nd
            for p in flat.params:
                p.grad = None  # what stage 2 saves: the bucket's full gradients go now

        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def zero3_gather_free(module, flat):
    """Stage 3 for one unit: all-gather before its forward, free after it."""
    storage = flat.full.untyped_storage()

    def gather(mod, args):
        storage.resize_(flat.padded * flat.full.element_size())  # the parameters are views into it
        dist.all_gather_single(flat.full, flat.shard)

    def free(mod, args, output):
        storage.resize_(0)  # the shapes stay, the memory goes

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(free)
