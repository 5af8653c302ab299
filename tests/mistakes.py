"""Known wrong answers, one or more per exercise: what students really write (used by the tests).

``MISTAKES[(notebook, name)]`` lists ``(function, words the check's message must contain)``: each
must fail its check with a message in the exercise's terms.
"""

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import Variable


# 01 -------------------------------------------------------------------------------------------
def zero_state_of_the_wrapper(optimizer):
    total = 0
    for state in optimizer.state.values():  # the usual place: empty for ZeroRedundancyOptimizer
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def zero_state_by_the_formula(optimizer):
    psi = sum(p.numel() for group in optimizer.param_groups for p in group["params"])  # every rank's parameters
    return 8 * psi / dist.get_world_size()  # what the paper's table says, not what this rank holds


def zero_state_with_step_counters(optimizer):
    total = 0
    for state in optimizer.optim.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))  # step too
    return total


def smallest_nd_strict(psi, stage, gpu_mem, reserve, k=12):
    whole = {"ddp": 4 + k, "zero1": 4, "zero2": 2, "zero3": 0}[stage] * psi
    split = (4 + k) * psi - whole
    for nd in range(1, 100_000):
        if whole + split / nd + reserve < gpu_mem:  # "fits" read as strictly less: a bill of exactly gpu_mem misses
            return nd
    return None


def activations_counted_per_tensor(block, x):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()  # views and parameters counted too
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return total[0]


# 02 -------------------------------------------------------------------------------------------
def summing_hook(grad):
    g = grad.clone()
    dist.all_reduce(g)
    return g  # the sum over ranks, not the mean


def _overlapped(buckets, *, issue, divide=True):
    """The reference's bookkeeping with one student mistake: ``issue`` says when a full bucket is started."""
    buckets = [list(b) for b in buckets]
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    slot, filled, works = {}, [0] * len(buckets), []
    for i, bucket in enumerate(buckets):
        offset = 0
        for p in bucket:
            slot[p] = (i, offset)
            offset += p.numel()

    def ready(p):
        i, offset = slot[p]
        flats[i][offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        filled[i] += 1
        if issue == "when_full" and filled[i] == len(buckets[i]):  # whatever its index
            works.append((i, dist.all_reduce(flats[i], async_op=True)))
        while issue == "in_order" and len(works) < len(buckets) and filled[len(works)] == len(buckets[len(works)]):
            works.append((len(works), dist.all_reduce(flats[len(works)], async_op=True)))

    for p in slot:
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        if issue == "at_the_end":  # nothing left during the backward
            works.extend((i, dist.all_reduce(flat, async_op=True)) for i, flat in enumerate(flats))
        for i, work in sorted(works, key=lambda w: w[0]):
            work.wait()
            if divide:
                flats[i].div_(dist.get_world_size())
            offset = 0
            for p in buckets[i]:
                p.grad.copy_(flats[i][offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        filled[:] = [0] * len(buckets)
        works.clear()

    return finish


def buckets_in_readiness_order(buckets):
    return _overlapped(buckets, issue="when_full")  # bucket 1 fills first, so it leaves first


def buckets_all_at_the_end(buckets):
    return _overlapped(buckets, issue="at_the_end")  # hooks copy, finish() starts everything


def buckets_summed_not_averaged(buckets):
    return _overlapped(buckets, issue="in_order", divide=False)


# 03 -------------------------------------------------------------------------------------------
def zero2_wrong_shard_offset(params, grads, lr):
    world, rank = dist.get_world_size(), dist.get_rank()
    s = params.numel() // world
    g = torch.empty(s)
    dist.reduce_scatter_single(g, grads)
    g /= world
    start = (world - 1 - rank) * s  # the slice of the wrong rank
    params[start : start + s] -= lr * g
    dist.all_gather_single(params, params[rank * s : (rank + 1) * s].clone())


def unsharded_inner_optimizer(params, optimizer_class, **defaults):
    world = dist.get_world_size()
    whole = params.clone().requires_grad_()
    opt = optimizer_class([whole], **defaults)  # state for all Ψ elements on every rank

    def step(grads):
        g = grads.clone()
        dist.all_reduce(g)
        whole.grad = g / world
        opt.step()
        params.copy_(whole.detach())

    return step


def zero2_keeps_full_grads(flats):
    for flat in flats:
        arrived = [0]

        def ready(param, flat=flat, arrived=arrived):
            arrived[0] += 1
            if arrived[0] == len(flat.params):
                arrived[0] = 0
                send = torch.zeros(flat.padded)
                torch.cat([p.grad.reshape(-1) for p in flat.params], out=send[: flat.numel])
                out = torch.empty(flat.shard_numel)
                dist.reduce_scatter_single(out, send)
                flat.grad_shard = out / flat.nd  # ... and the full gradients stay: that is stage 1's memory

        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def zero2_all_reduce(flats):
    for flat in flats:
        arrived = [0]

        def ready(param, flat=flat, arrived=arrived):
            arrived[0] += 1
            if arrived[0] == len(flat.params):
                arrived[0] = 0
                send = torch.zeros(flat.padded)
                torch.cat([p.grad.reshape(-1) for p in flat.params], out=send[: flat.numel])
                dist.all_reduce(send)  # every rank gets the whole sum, then keeps its slice
                s = flat.shard_numel
                flat.grad_shard = send[flat.rank * s : (flat.rank + 1) * s] / flat.nd
                for p in flat.params:
                    p.grad = None

        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def zero2_sum_not_mean(flats):
    for flat in flats:
        arrived = [0]

        def ready(param, flat=flat, arrived=arrived):
            arrived[0] += 1
            if arrived[0] == len(flat.params):
                arrived[0] = 0
                send = torch.zeros(flat.padded)
                torch.cat([p.grad.reshape(-1) for p in flat.params], out=send[: flat.numel])
                out = torch.empty(flat.shard_numel)
                dist.reduce_scatter_single(out, send)
                flat.grad_shard = out  # the sum over ranks, not the mean
                for p in flat.params:
                    p.grad = None

        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def zero2_after_backward(flats):
    """Everything right, but sent from a callback at the end of the backward: stage 1's timing."""
    queued = [False]

    def reduce_all():
        queued[0] = False
        for flat in flats:
            send = torch.zeros(flat.padded)
            torch.cat([p.grad.reshape(-1) for p in flat.params], out=send[: flat.numel])
            out = torch.empty(flat.shard_numel)
            dist.reduce_scatter_single(out, send)
            flat.grad_shard = out / flat.nd
            for p in flat.params:
                p.grad = None

    def ready(param):
        if not queued[0]:
            queued[0] = True
            Variable._execution_engine.queue_callback(reduce_all)

    for flat in flats:
        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def zero2_first_gradient(flats):
    """Sends a bucket when its *first* gradient arrives: the others are still missing (zeros)."""
    for flat in flats:
        arrived = [0]

        def ready(param, flat=flat, arrived=arrived):
            arrived[0] += 1
            if arrived[0] == 1:  # too early: the rest of the bucket has not been computed yet
                send = torch.zeros(flat.padded)
                off = 0
                for p in flat.params:
                    if p.grad is not None:
                        send[off : off + p.numel()] = p.grad.reshape(-1)
                    off += p.numel()
                out = torch.empty(flat.shard_numel)
                dist.reduce_scatter_single(out, send)
                flat.grad_shard = out / flat.nd
            if arrived[0] == len(flat.params):
                arrived[0] = 0
                for p in flat.params:
                    p.grad = None

        for p in flat.params:
            p.register_post_accumulate_grad_hook(ready)


def unit_never_freed(module, flat):
    storage = flat.full.untyped_storage()

    def gather(mod, args):
        if storage.nbytes() == 0:
            storage.resize_(flat.padded * flat.full.element_size())
        dist.all_gather_single(flat.full, flat.shard)

    module.register_forward_pre_hook(gather)  # ... and nothing after the forward


def unit_rebinds_instead_of_freeing(module, flat):
    def gather(mod, args):
        flat.full.untyped_storage().resize_(flat.padded * flat.full.element_size())
        dist.all_gather_single(flat.full, flat.shard)

    def free(mod, args, output):
        flat.full = flat.full[:0]  # a new (empty) view: the storage the parameters use is still there

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(free)


def unit_gathers_into_new_tensor(module, flat):
    def gather(mod, args):
        full = torch.empty(flat.padded, dtype=flat.shard.dtype)
        dist.all_gather_single(full, flat.shard)
        flat.full = full  # the parameters are views into the old storage: they never see this

    def free(mod, args, output):
        flat.full.untyped_storage().resize_(0)

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(free)


def unit_gathers_with_all_reduce(module, flat):
    storage = flat.full.untyped_storage()

    def gather(mod, args):
        storage.resize_(flat.padded * flat.full.element_size())
        flat.full.zero_()
        s = flat.shard_numel
        flat.full[flat.rank * s : (flat.rank + 1) * s] = flat.shard
        dist.all_reduce(flat.full)  # zeros everywhere but my slice: the sum is the whole unit

    def free(mod, args, output):
        storage.resize_(0)

    module.register_forward_pre_hook(gather)
    module.register_forward_hook(free)


# 04 -------------------------------------------------------------------------------------------
def shard_wrong_offset(full, rank, world_size):
    rows = full.shape[0]
    c = -(-rows // world_size)
    start, stop = min(rank * (c - 1), rows), min(rank * (c - 1) + c, rows)  # the wrong stride
    out = full.new_zeros((c, *full.shape[1:]))
    out[: stop - start] = full[start:stop]
    return out


def unshard_keeps_padding(shard, dim0):
    out = shard.new_empty((dist.get_world_size() * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_single(out, shard.contiguous())
    return out  # the padding rows are still there


def clip_with_local_norm(grads, max_norm):
    norm = torch.stack([g.norm() for g in grads]).norm()  # this rank's shards only
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))
    return norm


def layout_always_reshard(budget_bytes, units):
    return {"wrap": "block", "reshard_after_forward": True}


def layout_one_unit_when_it_fits(budget_bytes, units):
    """Right, not the reference's: with wrap="model" the only unit is the root, never resharded, so each parameter
    is all-gathered once, the same bytes as {"block", False}."""
    whole = 4 * sum(u["numel"] for u in units)
    root = 4 * sum(u["numel"] for u in units if u["name"] == "(root)")
    if whole <= budget_bytes:
        return {"wrap": "model", "reshard_after_forward": True}
    if root + 4 * max(u["numel"] for u in units if u["name"] != "(root)") <= budget_bytes:
        return {"wrap": "block", "reshard_after_forward": True}
    return None


# 05 -------------------------------------------------------------------------------------------
def hsdp_sharded_over_every_gpu(params, gpus_per_node, nodes, mp, strategy):
    p, nd = params / mp, gpus_per_node * nodes // mp
    sharded = {
        "ddp": 0,
        "zero1": 12,
        "zero2": 14,
        "zero3": 16,
        "hybrid_shard": 16,
        "zero2_offload": 14,
        "zero3_offload": 16,
    }[strategy]
    gpu, host = (16 - sharded) * p + sharded * p / nd, 0.0
    if strategy.endswith("_offload"):  # optimizer and gradient partitions on the host, right for these rows
        host = (12 + (6 if strategy == "zero3_offload" else 4)) * p / nd
        gpu -= (12 + 2) * p / nd
    return {"gpu": gpu, "host": host}


def _student_schedule(compute, gathers, scatters, *, first_gather_shows=True):
    comm = ready = gathers[0] if first_gather_shows else 0.0
    done = 0.0
    for i, seconds in enumerate(compute):
        start = max(ready, done)
        if i + 1 < len(compute):
            comm = ready = max(comm, start) + gathers[i + 1]
        done = start + seconds
        comm = max(comm, done) + scatters[i]
    return max(done, comm) - sum(compute)


def exposed_without_prefetch(fwd, bwd, gather, reduce_scatter):
    # each unit waits for its own gather, and for its reduce-scatter before the next: nothing overlaps
    return sum(gather), sum(gather) + sum(reduce_scatter)


def exposed_from_totals(fwd, bwd, gather, reduce_scatter):
    # perfect overlap: all communication against all compute
    return max(0.0, sum(gather) - sum(fwd)), max(0.0, sum(gather) + sum(reduce_scatter) - sum(bwd))


def exposed_first_gather_hidden(fwd, bwd, gather, reduce_scatter):
    # every gather "prefetched", the first one too, as if something computed before unit 0
    forward = _student_schedule(fwd, gather, [0.0] * len(fwd), first_gather_shows=False)
    backward = _student_schedule(bwd[::-1], gather[::-1], reduce_scatter[::-1], first_gather_shows=False)
    return forward, backward


def exposed_without_reduce_scatter(fwd, bwd, gather, reduce_scatter):
    # the backward "is the forward again, with twice the compute": the gradients' reduce-scatters forgotten
    zero = [0.0] * len(fwd)
    return _student_schedule(fwd, gather, zero), _student_schedule(bwd[::-1], gather[::-1], zero)


def exposed_backward_in_forward_order(fwd, bwd, gather, reduce_scatter):
    # the backward walked from unit 0, as the forward is
    return _student_schedule(fwd, gather, [0.0] * len(fwd)), _student_schedule(bwd, gather, reduce_scatter)


# 06 -------------------------------------------------------------------------------------------
def newest_by_name(root):
    names = sorted(p.name for p in Path(root).glob("step-*") if re.fullmatch(r"step-\d+", p.name))
    return int(names[-1].split("-")[1]) if names else None  # no commit check, and "step-9" > "step-10"


def resume_without_optimizer(root, model, optimizer):
    import torch.distributed.checkpoint as dcp

    from course_utils.checkpoint import latest_complete

    step = latest_complete(root)
    state = {"model": model.state_dict(), "step": torch.tensor(-1)}
    dcp.load(state, checkpoint_id=str(Path(root) / f"step-{step}"))
    model.load_state_dict(state["model"])
    return int(state["step"])


MISTAKES = {
    ("01", "zero_state_bytes"): [
        (zero_state_of_the_wrapper, "optimizer.optim"),
        (zero_state_by_the_formula, "not a measurement"),
        (zero_state_with_step_counters, "step counters"),
    ],
    ("01", "smallest_nd"): [(smallest_nd_strict, "'fits' is <=, not <")],
    ("01", "block_activation_bytes"): [(activations_counted_per_tensor, "weights")],
    ("02", "averaging_hook"): [(summing_hook, "did you average over ranks")],
    ("02", "overlapped_buckets"): [
        (buckets_in_readiness_order, "in index order"),
        (buckets_all_at_the_end, "from the hook that fills it"),
        (buckets_summed_not_averaged, "divide the sum by the world size"),
    ],
    ("03", "sharded_step"): [(zero2_wrong_shard_offset, "[r·S, (r+1)·S)")],
    ("03", "sharded_optimizer"): [(unsharded_inner_optimizer, "K·Ψ/Nd")],
    ("03", "zero2_hooks"): [
        (zero2_keeps_full_grads, "set each of its parameters' .grad to None"),
        (zero2_all_reduce, "called all_reduce"),
        (zero2_sum_not_mean, "divide by Nd"),
        (zero2_after_backward, "after the backward had finished producing gradients"),
        (zero2_first_gradient, "only once every one of them has arrived"),
    ],
    ("03", "zero3_gather_free"): [
        (unit_never_freed, "free each block after its forward"),
        (unit_rebinds_instead_of_freeing, "rebinding flat.full frees nothing"),
        (unit_gathers_into_new_tensor, "not into a new tensor"),
        (unit_gathers_with_all_reduce, "gathered with all_reduce"),
    ],
    ("04", "shard_dim0"): [(shard_wrong_offset, "did you start at rank·c")],
    ("04", "unshard"): [(unshard_keeps_padding, "padding")],
    ("04", "clip_sharded"): [(clip_with_local_norm, "all-reduce the sum of squares")],
    ("04", "choose_layout"): [(layout_always_reshard, "reshard_after_forward=False")],
    ("05", "model_states_per_gpu"): [(hsdp_sharded_over_every_gpu, "HSDP shards within one node")],
    ("05", "exposed_comm"): [
        (exposed_without_prefetch, "added up every collective"),
        (exposed_from_totals, "the totals against each other"),
        (exposed_first_gather_hidden, "first unit's all-gather cannot hide"),
        (exposed_without_reduce_scatter, "leaves out the reduce-scatters"),
        (exposed_backward_in_forward_order, "runs the units in reverse order"),
    ],
    ("06", "newest_complete"): [(newest_by_name, "no commit.json")],
    ("06", "resume"): [(resume_without_optimizer, "optimizer state")],
}

# Right answers other than the reference's, each of which the check must pass.
ALSO_RIGHT = {("04", "choose_layout"): [layout_one_unit_when_it_fits]}
