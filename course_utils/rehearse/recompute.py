"""Recomputation policies for the rehearsal, the same the planner weighs (notebooks 05 and 05b).

- "none": every block keeps what its backward needs;
- "full": every block keeps only its input and is rebuilt in backward (torch's ``checkpoint_wrapper``);
- "selective": the outputs of matmuls and attention are saved, everything else (norms, SiLU/GELU, rotary,
  products, copies) is recomputed (``create_selective_checkpoint_contexts``, ``MUST_SAVE`` for those ops);
- "every:K": every K-th block rebuilt, the others keep everything (torchtitan's layer policy: the K-th,
  2K-th, ... block, counted from 1).

The blocks are wrapped with ``checkpoint_wrapper`` before ``fully_shard`` goes on the wrapper (torchtitan's
order): with the composable ``checkpoint`` on the module ``fully_shard`` wraps, FSDP2's ``record_function``
calls run inside the checkpointed region only during recomputation, and the selective policy's cache
refuses them (``utils/checkpoint.py``: "... encountered during backward but not found in storage"). The
wrapper adds ``_checkpoint_wrapped_module.`` to parameter names; ``state_dict()`` and DCP's
``get_state_dict`` strip it, so a checkpoint keeps its keys.
"""

from __future__ import annotations

from ..errors import CourseInputError

#: The planner's policies (``plan.activations.POLICIES``), in the rehearsal's spelling too.
POLICY_WORDS = "none, full, selective or every:K (K a whole number from 1)"


def check_policy(policy: str) -> str:
    """``policy`` if the rehearsal knows it, else one ``CourseInputError`` that says what it accepts."""
    text = str(policy)
    if text in ("none", "full", "selective"):
        return text
    k = text.partition(":")[2]
    if text.startswith("every:") and k.isdigit() and int(k) >= 1:
        return text
    raise CourseInputError(f"recomputation policy {policy!r}: write {POLICY_WORDS}")


def _saved_ops() -> set:
    """The ops whose outputs "selective" keeps: matmuls and attention, CPU's and CUDA's."""
    import torch

    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def selective_context():
    """A fresh pair of contexts for one checkpointed call under the selective policy."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = _saved_ops()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def wrap_blocks(model, policy: str) -> int:
    """Wrap ``model.blocks`` for ``policy`` (before ``fully_shard``); returns how many blocks were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    policy = check_policy(policy)
    if policy == "none":
        return 0
    every = int(policy.partition(":")[2] or 1)
    wrapped = 0
    for i, block in enumerate(model.blocks):
        if (i + 1) % every:
            continue
        extra = {"context_fn": selective_context} if policy == "selective" else {}
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
        wrapped += 1
    return wrapped
