"""Reference solutions, notebook 03 (``load_solution("03", name)`` prints and defines one)."""

import torch
import torch.distributed as dist


def zero2_step(params, grads, lr):
    """One ZeRO-2 SGD step on flat, padded tensors; params ends updated and equal on every rank."""
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
