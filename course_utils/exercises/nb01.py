"""Notebook 01's exercises: ZeroRedundancyOptimizer's state per rank measured, the model-state bill as a
function, and one block's activations measured.

References: the course's own measurement of a ZeroRedundancyOptimizer in a separate launch
(``zero_reference_state``), ``memory.model_state_bytes`` (the ZeRO paper's table) and
``memory.measure_activation_bytes`` (saved-tensor hooks on the real forward).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn as nn

from .. import memory
from ..data import batch_for_rank
from ..models import build_model, get_config, param_count
from ..units import GB
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
    )
)


FORMULA = {stage: memory.formula_text(stage) for stage in memory.STAGES}  # "2·Ψ + (2 + K)·Ψ/Nd" for stage 2
CASES = [
    (psi, nd, stage, k) for psi in (7.5e9, 1_000_003) for nd in (1, 4, 64) for stage in memory.STAGES for k in (12, 8)
]


def judge_model_state_bill(fn) -> None:
    for psi, nd, stage, k in CASES:
        want = memory.model_state_bytes(psi, nd, stage, k=k)
        got = fn(psi, nd, stage, k=k)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9 * want:
            same_as = [
                s
                for s in memory.STAGES
                if s != stage
                and isinstance(got, (int, float))
                and abs(got - memory.model_state_bytes(psi, nd, s, k=k)) <= 1e-9 * want
            ]
            also = f"; that is the {same_as[0]} bill" if same_as else ""
            raise Wrong(
                f"for stage {stage!r}, Ψ = {psi:g}, Nd = {nd}, K = {k} you returned {got!r} bytes"
                f"{also}; the bill is {FORMULA[stage]} = {want / GB:.4g} GB ({want:.6g} bytes)"
            )


register(
    Exercise(
        "01",
        "model_state_bill",
        "The model-state bill as a function",
        "bytes per GPU for every stage, Nd in (1, 4, 64), K in (12, 8), two model sizes, against memory.model_state_bytes",
        task="Write `model_state_bill(psi, nd, stage, k=12)`: the model-state bytes one GPU holds for a model of "
        "`psi` parameters trained in mixed precision (2-byte weights, 2-byte gradients, K optimizer bytes "
        'per parameter) on `nd` data-parallel GPUs, for `stage` in `"ddp"`, `"zero1"`, `"zero2"`, '
        '`"zero3"`. Predict first: 7.5B parameters, stage 2, Nd = 64, how many GB?',
        stub="def model_state_bill(psi, nd, stage, k=12):\n"
        '    """Model-state bytes per GPU: 2-byte weights, 2-byte gradients, k optimizer bytes per parameter."""\n'
        '    raise NotImplementedError("exercise 01.model_state_bill: your code here")\n',
        hints=(
            "Start from plain data parallelism: every GPU holds all (2 + 2 + K)·Ψ bytes.",
            "Each stage divides one more term by Nd: stage 1 the optimizer's K·Ψ, stage 2 also the "
            "gradients' 2Ψ, stage 3 also the weights' 2Ψ.",
            "Check yourself against the table of section 4 before you run the check: it prints all four rows for the "
            "paper's 7.5B on 64 GPUs.",
        ),
        judge=judge_model_state_bill,
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


def judge_block_activation_bytes(fn) -> None:
    for block, x, dtype, batch in block_cases():
        want = memory.measure_activation_bytes(_OneBlock(block), x)["total"]
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


#: Read once exercise 01.1's check has run (``tools/exercise_cells.py`` puts these right after its hints):
#: why a rank's share is not 8Ψ/Nd, from the course's arithmetic on the model's real tensor sizes, no launch.
AFTER_CHECK = {
    "zero_state_bytes": [
        (
            "markdown",
            "#### Once your check has run: why no rank holds exactly $8\\Psi/N_d$\n\n"
            "ZeroRedundancyOptimizer never splits a tensor. It sorts them largest first and gives each to the rank "
            "with the fewest elements so far (`_partition_parameters` in torch's `zero_redundancy_optimizer.py`), "
            "so a rank's share is a sum of whole tensors. `memory.whole_tensor_partition` does the same sum on the "
            "tiny model's tensor sizes, without a launch:",
            "skip",
        ),
        (
            "code",
            "from course_utils import memory\n"
            "from course_utils.models import build_model\n\n"
            'sizes = [p.numel() for p in build_model("tiny").parameters()]  # each tensor once\n'
            "ranks = memory.whole_tensor_partition(sizes, 4)\n"
            "even = 8 * sum(sizes) / 4  # 8Ψ/Nd: AdamW's two fp32 moments, split evenly\n"
            "for rank, tensors in enumerate(ranks):\n"
            "    held = 8 * sum(tensors)\n"
            "    print(\n"
            '        f"rank {rank}: {len(tensors):>2} tensors, the largest {tensors[0]:>6,} elements: "\n'
            '        f"{held:>7,} bytes of AdamW state = {held / even:.3f} × 8Ψ/Nd"\n'
            "    )\n"
            "big = max(sizes)\n"
            'print(f"largest tensors: {sizes.count(big)} of {big:,} elements, each {big / sum(sizes):.1%} of Ψ")\n'
            "assert sum(map(sum, ranks)) == sum(sizes)  # every tensor on exactly one rank\n"
            "assert max(8 * sum(t) for t in ranks) > even  # so some rank holds more than 8Ψ/Nd",
            "skip",
        ),
        (
            "markdown",
            "Five tensors tie for largest (the token embedding and each block's two MLP matrices): four ranks take "
            "one each and the fifth goes to rank 0, which ends above $8\\Psi/N_d$ while the others end below it. "
            "The small tensors cannot even that out, because a tensor, once placed, never moves; and the fullest "
            "rank is what sizes the GPU. The paper's $P_{os}$ and the course's own stages in notebook 03 instead lay "
            "the parameters end to end in one flat buffer and cut it into $N_d$ equal slices: $8\\Psi/N_d$ on every "
            "rank, up to a few elements of padding.",
            "skip",
        ),
    ]
}
