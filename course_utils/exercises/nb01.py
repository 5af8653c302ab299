"""Notebook 01's exercises: ZeroRedundancyOptimizer's state per rank measured, the smallest Nd that fits
with a reserve, and one block's activations measured.

References: the course's own measurement of a ZeroRedundancyOptimizer in a separate launch
(``zero_reference_state``), ``memory.smallest_nd_that_fits`` (the ZeRO paper's table, solved for Nd) and
``memory.measure_activation_bytes`` (saved-tensor hooks on the real forward).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn as nn

from .. import memory
from ..data import batch_for_rank
from ..models import build_model, get_config, param_count
from ..strategies import DDP, ZERO1, ZERO2, ZERO3
from ..units import GB, GiB
from .core import REFERENCE_LAUNCH, Exercise, Wrong, register

# ---------------------------------------------------------------------------------------------
# 01.1: what ZeroRedundancyOptimizer keeps on each rank, measured

ZERO_NPROC = 4
ZERO_BATCH = 8  # global batch of the one step; divides by ZERO_NPROC
ADAMW_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32, per parameter


def zero_after_one_step(info):
    """The tiny model and a ZeroRedundancyOptimizer(AdamW) after one step on this rank's slice of the batch."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cfg = get_config("tiny")
    model = build_model(cfg, seed=0)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x, y = batch_for_rank(0, info.rank, info.world_size, batch=ZERO_BATCH, seq=cfg.seq, vocab=cfg.vocab)
    model(x, y).backward()  # no DDP here: the state's size does not depend on the gradients' values
    zero.step()  # AdamW on this rank's partition, then every rank's updated parameters broadcast
    return model, zero


def measured_state(zero) -> dict:
    """The course's measurement: this rank's per-parameter optimizer state, each storage once, by the real tensors."""
    seen, nbytes, scalars, owned = set(), 0, 0, 0
    for p, state in zero.optim.state.items():
        owned += p.numel()
        for t in state.values():
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if t.dim() == 0:
                scalars += st.nbytes()
            elif st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                nbytes += st.nbytes()
    return {"bytes": nbytes, "step_counter_bytes": scalars, "owned_params": owned, "tensors": len(zero.optim.state)}


def zero_reference_on_rank() -> list | None:
    """Worker (the course's code only): every rank's measured state, gathered to rank 0."""
    import torch.distributed as dist

    from .. import dist as cdist

    with cdist.session() as info:
        _, zero = zero_after_one_step(info)
        every = [None] * info.world_size
        dist.all_gather_object(every, measured_state(zero))
        return every if info.rank == 0 else None


@cache
def _zero_reference(world: int) -> tuple:
    from ..launch import launch

    return tuple(launch(zero_reference_on_rank, nproc=world, progress=False, echo=False, backend="gloo")[0])


def zero_reference_state(world: int) -> tuple:
    """``zero_reference_on_rank``'s answer, launched once per process and world size (graders call it from threads)."""
    with REFERENCE_LAUNCH:
        return _zero_reference(world)


def zero_state_on_rank(fn, info) -> dict:
    """The student's function on this rank's ZeroRedundancyOptimizer: only its answer comes back."""
    _, zero = zero_after_one_step(info)
    return {"bytes": fn(zero)}


def zero_state_verdict(per_rank: dict) -> None:
    world = len(per_rank)
    ref = zero_reference_state(world)
    psi = param_count(build_model(get_config("tiny")))
    formula = ADAMW_BYTES * psi / world
    for rank, r in sorted(per_rank.items()):
        got, want = r["bytes"], ref[rank]["bytes"]
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise Wrong(f"rank {rank} returned {got!r}: return a number of bytes")
        if got == want:
            continue
        if got == 0:
            why = "ZeroRedundancyOptimizer's own .state stays empty: this rank's AdamW, and its state, are optimizer.optim"
        elif abs(got - formula) < 1:
            why = (
                f"that is the formula 8Ψ/Nd = {formula:,.0f}, not a measurement: ZeroRedundancyOptimizer gives each "
                "rank whole tensors, so the ranks' shares differ; add up the tensors this rank really holds"
            )
        elif got == want + ref[rank]["step_counter_bytes"]:
            why = (
                f"you counted AdamW's 0-dim step counters too ({ref[rank]['tensors']} tensors x 4 bytes): they are "
                "one number per tensor, not per parameter; leave out tensors with dim() == 0"
            )
        elif got == ADAMW_BYTES * psi:
            why = "that is the state of every parameter: this rank holds only its own partition's"
        elif got == want + 4 * ref[rank]["owned_params"]:
            why = "you counted this rank's fp32 weights too: they are the model's, not the optimizer's state"
        else:
            why = "count each state tensor's storage once, from the optimizer this rank really steps"
        raise Wrong(f"rank {rank} holds {want:,} bytes of per-parameter optimizer state; you returned {got!r}: {why}")


# What the check shows once the answer passes (never before: it is the Predict's answer).
ZERO_AFTER_PASS = (
    "Why no rank holds exactly 8Ψ/Nd: ZeroRedundancyOptimizer never splits a tensor. It sorts them largest first "
    "and gives each to the rank with the fewest elements so far (_partition_parameters in torch's "
    "zero_redundancy_optimizer.py), so a rank's share is a sum of whole tensors.\n"
    "Five of the tiny model's tensors tie for largest (the token embedding and each block's two MLP matrices): "
    "four ranks take one each and the fifth goes to rank 0, which ends above 8Ψ/Nd while the others end below it. "
    "The small tensors cannot even that out, because a tensor, once placed, never moves; and the fullest rank is "
    "what sizes the GPU. The cell below replays torch's rule on the tiny model's tensor sizes.\n"
    "The paper's P_os and the course's own stages in notebook 03 instead lay the parameters end to end in one "
    "flat buffer and cut it into Nd equal slices: 8Ψ/Nd on every rank, up to a few elements of padding."
)


register(
    Exercise(
        "01",
        "zero_state_bytes",
        "Measure what ZeroRedundancyOptimizer keeps on each rank",
        "the per-parameter optimizer state each of 4 gloo ranks holds after one ZeroRedundancyOptimizer(AdamW) step, "
        "against the course's own measurement in a separate launch",
        task="Write `zero_state_bytes(optimizer)`: `optimizer` is a `torch.distributed.optim.ZeroRedundancyOptimizer` "
        "(ZeRO stage 1 in torch) wrapping `torch.optim.AdamW`, on this rank, after one step of the tiny model on 4 "
        "ranks. Return the bytes of optimizer state this rank holds: every state tensor with one number per "
        "parameter, each storage once (leave out AdamW's 0-dim `step` counters). Predict first: stage 1 promises "
        "$8\\Psi/N_d$ bytes of AdamW state per rank. Will every rank hold that?",
        stub="def zero_state_bytes(optimizer):\n"
        '    """Bytes of per-parameter optimizer state this rank holds (each storage once, no 0-dim step counters)."""\n'
        '    raise NotImplementedError("exercise 01.zero_state_bytes: your code here")\n',
        hints=(
            "ZeroRedundancyOptimizer runs an ordinary `torch.optim.AdamW` over this rank's parameters: it is "
            "`optimizer.optim`, and its `.state` maps each of those parameters to a dict of tensors.",
            "Keep the tensors with `t.dim() > 0` and add `t.untyped_storage().nbytes()` once per "
            "`t.untyped_storage().data_ptr()`.",
            "It hands out whole tensors, largest first, each to the rank with the fewest elements so far "
            "(`_partition_parameters` in torch's zero_redundancy_optimizer.py): print `sum(p.numel() for p in "
            "optimizer.optim.state)` on each rank and compare it with Ψ/4.",
        ),
        on_rank=zero_state_on_rank,
        verdict=zero_state_verdict,
        nproc=ZERO_NPROC,
        timeout_s=90.0,
        after_pass=ZERO_AFTER_PASS,
    )
)


# The cases: section 4's boundaries first, where the bill plus the reserve is exactly the card ("fits" is <=),
# then no reserve, a reserve that moves the answer far, floors no Nd gets under, and K = 8.
V100, H100 = 32 * GiB, 80 * GiB  # the cards sold as "32 GB" and "80 GB" hold 32 GiB and 80 GiB
FIT_CASES = [
    (7.5e9, ZERO1.name, V100, V100 - 32 * GB, 12),  # 45: 30 + 90/45 = 32.0 GB, the chart's "stage 1 from 45"
    (1e12, ZERO3.name, V100, V100 - 32 * GB, 12),  # 500: 16,000/500 = 32.0 GB
    (70e9, ZERO3.name, H100, H100 - 80 * GB, 12),  # 14: 1,120/14 = 80.0 GB
    (7.5e9, ZERO1.name, V100, 0, 12),
    (7.5e9, ZERO1.name, V100, 4 * GB, 12),
    (7.5e9, ZERO3.name, V100, 4 * GB, 12),
    (70e9, ZERO1.name, H100, 0, 12),  # the 280 GB floor: never
    (7.5e9, DDP.name, V100, 0, 12),
    (1e9, DDP.name, V100, 2 * GB, 12),
    (7.5e9, ZERO2.name, V100, 4 * GB, 8),
    (7.5e9, ZERO3.name, V100, 40 * GB, 12),  # a reserve larger than the card: never
]


def _gb(n) -> str:
    return f"{n / GB:.4g} GB"


def judge_smallest_nd(fn) -> None:
    for psi, stage, gpu_mem, reserve, k in FIT_CASES:
        want = memory.smallest_nd_that_fits(psi, stage, gpu_mem, k=k, other_bytes=reserve)
        got = fn(psi, stage, gpu_mem, reserve, k=k)
        if got == want and (got is None) == (want is None):
            continue
        case = f"for Ψ = {psi:g}, stage {stage!r}, gpu_mem = {_gb(gpu_mem)}, reserve = {_gb(reserve)}, K = {k}"
        if want is None:
            floor = memory.floor_bytes(psi, stage, k=k)
            raise Wrong(
                f"{case} you returned {got!r}, but no Nd is enough: the part no Nd divides, "
                f"{_gb(floor)}, plus the reserve already fills {_gb(gpu_mem)}; return None"
            )
        bill = memory.model_state_bytes(psi, want, stage, k=k) + reserve
        exact = " exactly: 'fits' is <=, not <, so that Nd fits" if bill == gpu_mem else ""
        raise Wrong(
            f"{case} you returned {got!r}; at Nd = {want} the bill plus the reserve is {_gb(bill)}{exact}, "
            f"and at Nd = {want - 1} it is more than {_gb(gpu_mem)}"
            if want > 1
            else f"{case} you returned {got!r}; at Nd = 1 the bill plus the reserve is {_gb(bill)}, which fits"
        )


register(
    Exercise(
        "01",
        "smallest_nd",
        "The smallest Nd that fits, with a reserve",
        "the smallest Nd for eleven cases (section 4's three boundaries first, no reserve, floors, K = 8) "
        "against memory.smallest_nd_that_fits",
        task="Write `smallest_nd(psi, stage, gpu_mem, reserve, k=12)`: the smallest whole number of data-parallel "
        "GPUs $N_d$ at which one GPU's model states (2-byte weights, 2-byte gradients, K optimizer bytes per "
        'parameter, sharded as `stage`: `"ddp"`, `"zero1"`, `"zero2"` or `"zero3"`) plus `reserve` bytes kept back '
        "(CUDA context, communication buffers, fragmentation) fit in `gpu_mem` bytes; `None` when no $N_d$ is "
        "enough. Predict first: the paper's 7.5B with stage 1 on a V100 (32 GiB), with no reserve at all, and "
        "with 4 GB kept back. From which $N_d$ each?",
        stub="def smallest_nd(psi, stage, gpu_mem, reserve, k=12):\n"
        '    """The smallest whole Nd at which model states plus reserve fit in gpu_mem bytes, or None."""\n'
        '    raise NotImplementedError("exercise 01.smallest_nd: your code here")\n',
        hints=(
            "Split one GPU's bill in two: the part no Nd divides (stage 1: the 4Ψ of 16-bit weights and gradients) "
            "and the part divided by Nd. The budget for the second is gpu_mem minus the reserve minus the first.",
            "If the undivided part alone fills the budget, no Nd is enough: return None. If nothing divides by Nd "
            "(plain DP), the answer is 1 or None.",
            "'Fits' means at most gpu_mem: at the smallest Nd the bill plus the reserve can be exactly gpu_mem. "
            "Round up with math.ceil, and mind that a bill of exactly the budget must not round up to Nd + 1.",
        ),
        judge=judge_smallest_nd,
    )
)


class _OneBlock(nn.Module):
    """A model of one block, shaped as ``measure_activation_bytes`` expects (``.blocks``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList([block])

    def forward(self, x):
        return self.blocks[0](x)


def block_cases():
    """One transformer block and an input for it: fp32 and bf16, two batch sizes."""
    cfg = get_config("tiny")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (2, 4):
            model = build_model(cfg, seed=0).to(dtype)
            idx, _ = batch_for_rank(0, 0, 1, batch=batch, seq=cfg.seq, vocab=cfg.vocab)
            with torch.no_grad():
                x = model.tok_emb(idx) + model.pos_emb(torch.arange(cfg.seq))
            yield model.blocks[0], x.requires_grad_(True), dtype, batch


def judge_block_activation_bytes(fn) -> str:
    """Every case against the reference; on a pass, the Predict's answer measured (``bf16_reading``)."""
    measured = {}
    for block, x, dtype, batch in block_cases():
        measured[dtype, batch] = ref = memory.measure_activation_bytes(_OneBlock(block), x)
        want = ref["total"]
        got = fn(block, x)
        if got == want:
            continue
        params = sum(p.numel() * p.element_size() for p in block.parameters())
        where = f"one block of the tiny model in {str(dtype).replace('torch.', '')} with batch {batch}"
        if isinstance(got, (int, float)) and got >= want + params:
            why = "you counted the block's weights: parameters are saved for the backward too, but they are not activations"
        elif isinstance(got, (int, float)) and got > want:
            why = (
                "you counted a storage more than once: q, k and v are views of one qkv output (and a tensor "
                "can be saved twice); count each t.untyped_storage() once"
            )
        else:
            why = "some saved tensors were missed: count every tensor the pack hook sees during the forward"
        raise Wrong(f"for {where} you measured {got!r} bytes, the reference {want} bytes: {why}")
    return bf16_reading(measured[torch.float32, 2], measured[torch.bfloat16, 2])


def _kept_in_fp32(output) -> list[tuple[str, torch.Tensor]]:
    """The tensors autograd saved in fp32 behind ``output`` (a bf16 run's), read from its graph's nodes."""
    kept, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in (a for a in dir(node) if a.startswith("_saved_")):
            value = getattr(node, attr)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                kept.append((f"{type(node).__name__}.{attr}", value))
        todo.extend(n for n, _ in node.next_functions)
    return kept


def bf16_reading(fp32: dict, bf16: dict) -> str:
    """Exercise 01.3's Predict answered from the reference's measurement (batch 2): what bf16 saves, and why not half."""
    f, h = fp32["total"], bf16["total"]
    kept = {t.untyped_storage().data_ptr(): (name, t) for name, t in _kept_in_fp32(bf16["loss"])}.values()
    k = sum(t.untyped_storage().nbytes() for _, t in kept)
    names = ", ".join(f"{name} {tuple(t.shape)}" for name, t in kept) or "none"
    why = (
        " Flash attention keeps one log-sum-exp per query row and head (batch, heads, seq) in fp32, so that its "
        "backward can rebuild the softmax exactly."
        if kept and all("logsumexp" in name for name, _ in kept)
        else ""
    )
    return (
        f"Measured on one block of the tiny model, batch 2: {f:,} bytes saved in fp32, {h:,} in bf16, "
        f"{h / f:.3f} of it{' and not 0.5' if 2 * h != f else ''}.\n"
        f"The bf16 run still saves {k:,} bytes in fp32: {names}.{why} Without them: {h - k:,} bytes in bf16 "
        f"against {f - k:,} in fp32, {(h - k) / (f - k):.3f}."
    )


register(
    Exercise(
        "01",
        "block_activation_bytes",
        "Measure one block's activations with saved-tensor hooks",
        "bytes saved for the backward by one block (fp32 and bf16, batch 2 and 4) against memory.measure_activation_bytes",
        task="Write `block_activation_bytes(block, x)`: run `block(x)` under "
        "`torch.autograd.graph.saved_tensors_hooks` and return the bytes autograd saves for the backward, "
        "each storage counted once and the block's parameters left out. Predict first: does bf16 halve it?",
        stub="def block_activation_bytes(block, x):\n"
        '    """Bytes autograd saves for the backward while block(x) runs (each storage once, no parameters)."""\n'
        '    raise NotImplementedError("exercise 01.block_activation_bytes: your code here")\n',
        hints=(
            "`with torch.autograd.graph.saved_tensors_hooks(pack, unpack): block(x)`: pack(t) sees every saved "
            "tensor and must return it (unpack can be `lambda t: t`).",
            "Key what you saw by `t.untyped_storage().data_ptr()` and add `t.untyped_storage().nbytes()` once per key.",
            "Collect the parameters' storage pointers first and skip them: a Linear saves its weight for the backward.",
        ),
        judge=judge_block_activation_bytes,
    )
)


#: Read once exercise 01.1's check has run (``tools/exercise_cells.py`` puts these right after its hints): torch's
#: placement rule replayed on the model's real tensor sizes, no launch. Why the shares differ (the Predict's answer)
#: is the record's ``after_pass``: the check shows it once the student's answer passes.
AFTER_CHECK = {
    "zero_state_bytes": [
        (
            "markdown",
            "#### After the check: how ZeroRedundancyOptimizer places tensors\n\n"
            "`memory.whole_tensor_partition` is the course's copy of torch's placement rule (`_partition_parameters` "
            "in torch's `zero_redundancy_optimizer.py`), run on the tiny model's tensor sizes without a launch: a "
            "model of torch's code, not a measurement (the measured bytes are the ones your check compared, rank by "
            "rank). Once your answer passes, the check says what these numbers mean.",
            "skip",
        ),
        (
            "code",
            "from course_utils import memory\n"
            "from course_utils.exercises import passed\n"
            "from course_utils.models import build_model\n"
            "\n"
            'if not passed("01", "zero_state_bytes"):\n'
            '    print("The placement shows once your check passes (stuck? load_solution, then the check again).")\n'
            "else:\n"
            '    sizes = [p.numel() for p in build_model("tiny").parameters()]  # each tensor once\n'
            "    ranks = memory.whole_tensor_partition(sizes, 4)\n"
            "    even = 8 * sum(sizes) / 4  # 8Ψ/Nd: AdamW's two fp32 moments, split evenly\n"
            "    for rank, tensors in enumerate(ranks):\n"
            "        held = 8 * sum(tensors)\n"
            "        print(\n"
            '            f"rank {rank}: {len(tensors):>2} tensors, the largest {tensors[0]:>6,} elements: "\n'
            '            f"{held:>7,} bytes of AdamW state = {held / even:.3f} × 8Ψ/Nd"\n'
            "        )\n"
            "    big = max(sizes)\n"
            '    print(f"largest tensors: {sizes.count(big)} of {big:,} elements, each {big / sum(sizes):.1%} of Ψ")',
            "skip",
        ),
    ]
}
