"""Notebook 05's exercises: the model-state bytes each strategy leaves on a GPU, and the communication a
sharded step exposes, unit by unit.

References: ``plan.memory_breakdown`` (over a grid of models and clusters) and ``plan.exposed_comm`` (FSDP's
schedule, the function the throughput planner prices a sharded step with, over a grid of units).
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
                        hint = " (offload_optimizer moves the optimizer bytes and the gradient partitions to the host)"
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
            "The _offload strategies are DeepSpeed's offload_optimizer: zero2/zero3 with the sharded optimizer bytes "
            "and the gradient partitions on the host, in fp32 (4 bytes per parameter of the shard) and, for stage 3, "
            "in bf16 too (2 more); no gradient bytes stay on the GPU.",
        ),
        judge=judge_model_states,
    )
)


#: (forward compute, backward compute, all-gather, reduce-scatter) per unit in forward order, in ms. Uneven units
#: first: on them every mistake of ``tests/mistakes.py`` gives its own answer.
UNEVEN_MS = (
    ((1, 4, 1, 1), (2, 8, 2, 2), (3, 1, 3, 0.5), (3, 1, 3, 0.5)),  # gathers longer than the compute before them
    ((0, 2, 2, 2, 3), (0, 4, 4, 4, 6), (2, 1, 1, 1, 0), (2, 1.5, 1.5, 1.5, 0)),  # a root unit, a head unit
    ((5, 4, 3, 2, 1), (10, 8, 6, 4, 2), (1, 2, 3, 4, 5), (1, 1, 1, 1, 1)),  # compute shrinks as gathers grow
    ((1, 3), (2, 6), (2, 2), (1, 4)),
)
#: Equal units: 1 ms forward, 2 ms backward; all-gathers from half the forward to three times it, the
#: reduce-scatter as long as the gather (bf16) or twice (fp32).
UNIFORM = [(n, g, r) for n in (1, 2, 8) for g in (0.5, 1.0, 1.5, 3.0) for r in (g, 2 * g)]


def _schedule_cases():
    ms = 1e-3
    for case in UNEVEN_MS:
        yield tuple([x * ms for x in v] for v in case)
    for n, g, r in UNIFORM:
        yield [1 * ms] * n, [2 * ms] * n, [g * ms] * n, [r * ms] * n


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 + 1e-9 * abs(b)


def _mistake(case, got: tuple, want: tuple) -> str:
    """The mistake whose answer ``got`` is, on this case: each is the schedule with one rule broken."""
    fwd, bwd, g, rs = case
    n = len(fwd)
    zero = [0.0] * n
    first_f = plan.exposed_comm(fwd, bwd, [0.0] + g[1:], rs)[0]
    first_b = plan.exposed_comm(fwd, bwd, g, rs, backward_gather=g[:-1] + [0.0])[1]
    forward = [
        (
            sum(g),
            "you added up every collective: FSDP issues unit i+1's all-gather while unit i computes (prefetch), "
            "so only what that compute cannot cover shows",
        ),
        (
            max(0.0, sum(g) - sum(fwd)),
            "you set the totals against each other, max(0, communication - compute), as if any compute could "
            "hide any gather: a gather hides only behind the unit computing before it",
        ),
        (first_f, "the first unit's all-gather cannot hide: nothing computes before unit 0, so the pass waits for it"),
    ]
    backward = [
        (sum(g) + sum(rs), forward[0][1] + ", and a reduce-scatter while the units before it compute"),
        (max(0.0, sum(g) + sum(rs) - sum(bwd)), forward[1][1] + " in the forward, or after it in the backward"),
        (
            first_b,
            "the first unit's all-gather cannot hide: the backward starts at the last unit, and nothing computes "
            "before it",
        ),
        (
            plan.exposed_comm(fwd, bwd, g, zero)[1],
            "your backward leaves out the reduce-scatters: each unit's gradients are reduce-scattered when its "
            "backward compute ends, on the same stream as the gathers, and the last one has nothing left to "
            "hide behind",
        ),
        (
            plan.exposed_comm(fwd[::-1], bwd[::-1], g[::-1], rs[::-1])[1],
            "your backward runs the units in forward order: the backward runs the units in reverse order, from "
            "the last unit (whose output the loss needs first) to unit 0",
        ),
        (
            plan.exposed_comm(fwd, bwd, g, rs, backward_gather=zero)[1],
            "FULL_SHARD frees each unit after its forward, so the backward all-gathers every unit again",
        ),
    ]
    which, options = (0, forward) if not _close(got[0], want[0]) else (1, backward)
    return next((why for value, why in options if _close(got[which], value)), "")


def _ms(values) -> str:
    return "[" + ", ".join(f"{v * 1e3:g}" for v in values) + "] ms"


#: The 8-unit Predict's answer: shown by the check once the student's answer passes.
EXPOSED_AFTER_PASS = (
    "The backward exposes more than the forward although it has twice the compute: it also has twice the "
    "collectives (a gather and a reduce-scatter per unit, on one stream), and its last reduce-scatter "
    "has no compute after it. Both shortcuts miss: adding up ignores prefetch, and totals against totals "
    "let a gather hide behind compute that ran before it was issued."
)


def judge_exposed_comm(fn) -> None:
    for case in _schedule_cases():
        fwd, bwd, g, rs = case
        want = plan.exposed_comm(fwd, bwd, g, rs)
        got = fn(list(fwd), list(bwd), list(g), list(rs))
        if not (
            isinstance(got, (tuple, list))
            and len(got) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in got)
        ):
            raise Wrong("return a pair of seconds, (forward, backward)")
        if _close(got[0], want[0]) and _close(got[1], want[1]):
            continue
        why = _mistake(case, tuple(got), want)
        raise Wrong(
            f"{len(fwd)} unit(s), forward compute {_ms(fwd)}, backward {_ms(bwd)}, all-gather {_ms(g)}, "
            f"reduce-scatter {_ms(rs)}: you returned forward {got[0] * 1e3:.4g} ms, backward {got[1] * 1e3:.4g} "
            f"ms exposed; the schedule gives {want[0] * 1e3:.4g} and {want[1] * 1e3:.4g} ms"
            + (f". {why[0].upper()}{why[1:]}" if why else ": play the two streams out unit by unit, as the task says")
        )


register(
    Exercise(
        "05",
        "exposed_comm",
        "What a sharded step exposes, unit by unit",
        f"(forward, backward) exposed seconds on {len(UNEVEN_MS)} uneven and {len(UNIFORM)} equal-unit cases (1 to 8 "
        "units, gathers from half to three times the compute) against plan.exposed_comm, the function the "
        "throughput planner prices FSDP's and DeepSpeed stage 3's step with",
        task="Write `exposed_comm(fwd, bwd, gather, reduce_scatter)`: seconds per unit in forward order in, "
        "`(forward, backward)` out: how much longer each pass takes than its compute alone, on FSDP's schedule "
        "(the stub's docstring gives its rules).\n\n"
        "*Predict first:* 8 equal units, each with 1 ms of forward and 2 ms of backward compute, a 1.5 ms "
        "all-gather and a 1.5 ms reduce-scatter. The backward has twice the compute to hide behind: does it "
        "expose less than the forward, or more?",
        stub="def exposed_comm(fwd, bwd, gather, reduce_scatter):\n"
        '    """(forward, backward): two floats, the seconds each pass takes beyond its compute.\n'
        "    Each input list has one entry per unit.\n"
        "\n"
        "    fwd, bwd, gather, reduce_scatter: each unit's forward compute, backward compute, all-gather of its\n"
        "    parameters and reduce-scatter of its gradients, in seconds, units in forward order. FULL_SHARD:\n"
        "    - two streams: compute runs one unit at a time; communication runs one collective at a time,\n"
        "      in the order they were issued;\n"
        "    - forward: unit 0's all-gather starts at 0; unit i+1's is issued when unit i starts computing\n"
        "      (one unit prefetched); a unit computes once its own gather and the unit before it are done;\n"
        "    - backward: the units in reverse order, each gathered again and prefetched the same way; a\n"
        "      unit's reduce-scatter is issued when its backward compute ends; the pass ends when its\n"
        "      compute and its last reduce-scatter are both done.\n"
        '    """\n'
        '    raise NotImplementedError("exercise 05.exposed_comm: your code here")\n',
        hints=(
            "Keep two clocks: when the compute stream is free and when the communication stream is free. A "
            "collective starts at the later of its issue time and the communication clock; a unit's compute at "
            "the later of its gather's end and the compute clock.",
            "One loop serves both passes: for each unit, start its compute, issue the next unit's gather at that "
            "start, end the compute, then issue its reduce-scatter (0 in the forward). The backward is the same "
            "loop over the reversed lists. Exposed = the later clock at the end minus the sum of the compute.",
            "The course's version, the one the throughput planner calls, is `plan.exposed_comm` (it also takes "
            "a `backward_gather`, for units kept gathered from forward to backward).",
        ),
        judge=judge_exposed_comm,
        after_pass=EXPOSED_AFTER_PASS,
    )
)

#: What the student reads once the check has run: the reference replayed on the Predict's case. Why it falls
#: as it does (the Predict's answer) is the record's ``after_pass``: the check shows it once the answer passes.
AFTER_CHECK = {
    "exposed_comm": [
        (
            "markdown",
            "#### After the check: the 8-unit replay\n\n"
            "The reference played out on the task's case, beside the two shortcuts: adding every collective "
            "up, and setting the totals against each other. Once your answer passes, the check says why the "
            "numbers fall as they do.",
            "skip",
        ),
        (
            "code",
            "from course_utils import plan\n"
            "from course_utils.exercises import passed\n"
            "\n"
            'if not passed("05", "exposed_comm"):\n'
            '    print("The 8-unit replay shows once your check passes (stuck? load_solution, then the check again).")\n'
            "else:\n"
            "    ms = 1e-3\n"
            "    units = 8\n"
            "    fwd, bwd, gather, scatter = [1 * ms] * units, [2 * ms] * units, [1.5 * ms] * units, [1.5 * ms] * units\n"
            "    forward, backward = plan.exposed_comm(fwd, bwd, gather, scatter)\n"
            "    added = sum(gather), sum(gather) + sum(scatter)\n"
            "    totals = max(0, sum(gather) - sum(fwd)), max(0, sum(gather) + sum(scatter) - sum(bwd))\n"
            "    for label, (f, b) in [\n"
            '        ("the schedule", (forward, backward)),\n'
            '        ("every collective added", added),\n'
            '        ("totals against totals", totals),\n'
            "    ]:\n"
            '        print(f"{label:<24} forward {f / ms:5.2f} ms   backward {b / ms:5.2f} ms exposed")',
            "skip",
        ),
    ]
}


#: The Exercises slide's speaker notes (notebook 05's deck).
EXTRA_CELLS = (
    (
        "markdown",
        "The first exercise rebuilds section 1's memory table strategy by strategy; the second plays FSDP's "
        "schedule unit by unit, the function the throughput planner prices a sharded step with. Ask for 70B "
        "with HSDP on 4 nodes of 8, and whether the 8-unit backward exposes more than its forward (more: twice "
        "the collectives, and a last reduce-scatter with nothing after it).",
        "notes",
    ),
)
