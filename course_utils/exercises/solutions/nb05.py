"""Reference solutions, notebook 05 (``load_solution("05", name)`` prints and defines one)."""


def model_states_per_gpu(params, gpus_per_node, nodes, mp, strategy):
    """{"gpu": bytes, "host": bytes} of model states per GPU for one of plan.STRATEGIES."""
    p = params / mp
    nd = gpus_per_node * nodes // mp
    parts = {"weights": 2 * p, "gradients": 2 * p, "optimizer": 12 * p}
    sharded = {
        "ddp": (),
        "zero1": ("optimizer",),
        "zero2": ("optimizer", "gradients"),
        "zero3": ("optimizer", "gradients", "weights"),
        "hybrid_shard": ("optimizer", "gradients", "weights"),
        "zero2_offload": ("optimizer", "gradients"),
        "zero3_offload": ("optimizer", "gradients", "weights"),
    }[strategy]
    over = gpus_per_node // mp if strategy == "hybrid_shard" else nd  # HSDP: shard inside one node
    held = {k: v / over if k in sharded else v for k, v in parts.items()}
    host = 0.0
    if strategy.endswith("_offload"):  # DeepSpeed's offload_optimizer: fp32 gradient partition (and stage 3's bf16)
        host = held["optimizer"] + (6 if strategy == "zero3_offload" else 4) * p / nd
        held["optimizer"], held["gradients"] = 0.0, 0.0
    return {"gpu": sum(held.values()), "host": host}


def exposed_comm(fwd, bwd, gather, reduce_scatter):
    """(forward, backward): seconds each pass takes beyond its compute, one list entry per unit."""

    def one_pass(compute, gathers, scatters):
        if not compute:
            return 0.0
        comm = ready = gathers[0]  # unit 0's gather: nothing runs before it
        done = 0.0  # the compute stream is free from here
        for i, seconds in enumerate(compute):
            start = max(ready, done)  # its gather is done and so is the unit before it
            if i + 1 < len(compute):  # prefetch: the next unit's gather is issued as this one starts
                comm = ready = max(comm, start) + gathers[i + 1]
            done = start + seconds
            comm = max(comm, done) + scatters[i]  # its reduce-scatter, issued when its compute ends
        return max(done, comm) - sum(compute)

    forward = one_pass(fwd, gather, [0.0] * len(fwd))
    backward = one_pass(bwd[::-1], gather[::-1], reduce_scatter[::-1])  # last unit first
    return forward, backward
