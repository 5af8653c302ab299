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
    if strategy.endswith("_offload"):
        host, held["optimizer"] = held["optimizer"], 0.0
    return {"gpu": sum(held.values()), "host": host}


def decide(numbers):
    """The strategy to use given {strategy: {"fits", "total", "step_s"}}, or "none"."""
    from course_utils import plan

    fitting = [s for s, n in numbers.items() if n["fits"]]
    if not fitting:
        return "none"
    fastest = min(numbers[s]["step_s"] for s in fitting)
    return next(s for s in fitting if numbers[s]["step_s"] <= fastest * (1 + plan.TIE_MARGIN))
