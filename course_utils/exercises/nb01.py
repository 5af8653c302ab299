"""Notebook 01's exercises: the model-state bill as a function, and one block's activations measured.

References: ``memory.model_state_bytes`` (the ZeRO paper's table) and
``memory.measure_activation_bytes`` (saved-tensor hooks on the real forward).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import memory
from ..data import batch_for_rank
from ..models import build_model, get_config
from ..units import GB
from .core import Exercise, Wrong, register

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
            "Stage 2 is 2·Ψ + (2 + K)·Ψ / Nd: 7.5e9 parameters at Nd = 64 is 16.6 GB.",
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
