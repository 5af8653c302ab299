"""Notebook 05's exercises: the model-state bytes each strategy leaves on a GPU, and the decision rule.

References: ``plan.memory_breakdown`` and ``plan.plan(...).recommendation`` (the planner the
notebook uses), over a grid of models and clusters.
"""

from __future__ import annotations

from .. import plan, strategies
from ..units import GB
from .core import Exercise, Wrong, register

PARAMS = (1e9, 7e9, 30e9, 70e9, 175e9, 1e12)
CLUSTERS = (
    plan.Cluster(nodes=1),
    plan.Cluster(nodes=4),
    plan.Cluster(nodes=4, mp=2),
    plan.Cluster(nodes=16, gpu_mem=40 * GB),
    plan.Cluster(nodes=2, gpus_per_node=4, gpu_mem=24 * GB),
    plan.Cluster(nodes=2, inter_bw=1.25e9),
)  # 10 GbE: where the lowest stage that fits is not the fastest


def _cases():
    for params in PARAMS:
        for cluster in CLUSTERS:
            yield plan.model_spec(params), cluster


def _cluster_text(c: plan.Cluster) -> str:
    return f"{c.nodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_mem / GB:.0f} GB, Nm = {c.mp}"


def judge_model_states(fn) -> None:
    for model, cluster in _cases():
        for row in strategies.planned():
            if not plan.applicable(row, cluster):
                continue
            strategy = row.name
            m = plan.memory_breakdown(model, cluster, strategy)
            want = {"gpu": m["model_states"], "host": m["host_bytes"]}
            got = fn(model.params, cluster.gpus_per_node, cluster.nodes, cluster.mp, strategy)
            if not (isinstance(got, dict) and {"gpu", "host"} <= set(got)):
                raise Wrong("return a dict {'gpu': bytes, 'host': bytes}")
            for where in ("gpu", "host"):
                if abs(got[where] - want[where]) > 1e-9 * max(1.0, want[where]):
                    hint = ""
                    if row.shard_over == "node":
                        hint = " (HSDP shards within one node: over gpus_per_node / Nm GPUs, replicates across nodes)"
                    elif row.offload:
                        hint = " (offload moves the K·Ψ optimizer bytes to the host)"
                    raise Wrong(
                        f"{strategy} for {model.params:.3g} parameters on {_cluster_text(cluster)}: you put "
                        f"{got[where] / GB:.4g} GB on the {where}, the planner {want[where] / GB:.4g} GB{hint}"
                    )


register(
    Exercise(
        "05",
        "model_states_per_gpu",
        "Model-state bytes per GPU",
        f"bytes on the GPU and on the host for every strategy, {len(PARAMS)} model sizes and {len(CLUSTERS)} clusters, "
        "against plan.memory_breakdown",
        task='Write `model_states_per_gpu(params, gpus_per_node, nodes, mp, strategy)` returning `{"gpu": bytes, '
        '"host": bytes}`: the weights, gradients and optimizer state (2 + 2 + 12 bytes per parameter, mixed '
        "precision) that one GPU holds, for every strategy of the planner (`plan.STRATEGIES`), each GPU seeing "
        "$\\Psi/N_m$ parameters and $N_d$ = GPUs / $N_m$ replicas. Predict first: 70B, HSDP on 4 nodes of 8: how many GB?",
        stub="def model_states_per_gpu(params, gpus_per_node, nodes, mp, strategy):\n"
        '    """{"gpu": bytes, "host": bytes} of model states per GPU for one of plan.STRATEGIES."""\n'
        '    raise NotImplementedError("exercise 05.model_states_per_gpu: your code here")\n',
        hints=(
            "Per GPU: p = params / mp; weights 2p, gradients 2p, optimizer 12p; Nd = gpus_per_node·nodes / mp.",
            "zero1 divides the optimizer by Nd, zero2 also the gradients, zero3 all three; HSDP shards all three "
            "over the GPUs of one node (gpus_per_node / mp), not over Nd.",
            "The _offload strategies are zero2/zero3 with the (sharded) optimizer bytes moved to 'host'.",
        ),
        judge=judge_model_states,
    )
)


def judge_decide(fn) -> None:
    for model, cluster in _cases():
        p = plan.plan(model, cluster)
        numbers = {s: {"fits": sp.fits, "total": sp.total, "step_s": sp.step_s} for s, sp in p.strategies.items()}
        want = p.recommendation["strategy"]
        got = fn(numbers)
        if got != want:
            fitting = [s for s, n in numbers.items() if n["fits"]]
            raise Wrong(
                f"for {model.params:.3g} parameters on {_cluster_text(cluster)} (fitting: "
                f"{', '.join(fitting) or 'none'}) you chose {got!r}, the planner {want!r}: the rule takes, "
                "among the strategies that fit, the one with the lowest estimated step time; a strategy "
                f"within {plan.TIE_MARGIN:.0%} of the fastest counts as a tie, and a tie goes to the one "
                "earlier in the order (less sharding); 'none' when nothing fits"
            )


register(
    Exercise(
        "05",
        "decide",
        "The decision rule",
        f"the chosen strategy for {len(PARAMS)} model sizes on {len(CLUSTERS)} clusters against plan.plan(...).recommendation, "
        "ties "
        "within plan.TIE_MARGIN included",
        task="Write `decide(numbers)`: `numbers` maps each applicable strategy (in `plan.STRATEGIES` order: ddp, "
        'zero1, zero2, hybrid_shard, zero3, zero2_offload, zero3_offload) to `{"fits", "total", "step_s"}` from '
        'the planner. Return the strategy the notebook\'s rule picks, or `"none"`. Predict first: 13B on 2 '
        "nodes over 10 GbE fits stage 1 at 39 s a step and HSDP at 21 s; which does the rule pick?",
        stub="def decide(numbers):\n"
        '    """The strategy to use given {strategy: {"fits", "total", "step_s"}}, or "none"."""\n'
        '    raise NotImplementedError("exercise 05.decide: your code here")\n',
        hints=(
            "Keep the strategies that fit; if there are none, the answer is 'none'.",
            "Find the fastest step time among them; every strategy within plan.TIE_MARGIN (5%) of it is a tie.",
            "Walk the strategies in the order given (less sharding first) and return the first one in the tie.",
        ),
        judge=judge_decide,
    )
)


#: The Exercises slide's speaker notes (notebook 05's deck).
EXTRA_CELLS = (
    (
        "markdown",
        "The first exercise rebuilds the memory table of section 1 strategy by strategy (stage 1, "
        "2, 3, HSDP and the two optimizer offloads); the second the decision rule that picks among the rows "
        "that fit. Ask the class to predict 70B with HSDP on 4 nodes of 8 before anyone writes code, and "
        "which strategy the rule picks for 13B over 10 GbE.",
        "notes",
    ),
)
