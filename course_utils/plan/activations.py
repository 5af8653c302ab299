"""Activation bytes per architecture and recomputation policy, with the logits and the loss (notebook 05).

Counted, not assumed: what one course block keeps for backward was counted tensor by tensor with
saved-tensor hooks on the course's GPT-2 and Llama blocks (the formulas below reproduce the counts to the
byte), and checked against notebook 05b's rehearsal on fake tensors (``tests/test_plan.py``). The paper's
rule of 12 numbers per token per width (``memory.bill``) is GPT-2's block without its MLP's hidden states
and the softmax's statistics; a Llama block keeps about twice as much.

Policies (``POLICIES``): "none" keeps everything; "full" keeps each block's input and rebuilds the block in
backward; "selective" keeps the matmul and attention outputs and recomputes the cheap ops (torch's
``create_selective_checkpoint_contexts``); "every:K" rebuilds every K-th block (torchtitan's layer policy,
``count % ac_freq == 0``) and keeps the others whole.

``kernels="cpu"``: CPU has no fused RMSNorm (``_fused_rms_norm`` has CUDA, MPS and XPU kernels;
``rms_norm_composite`` elsewhere upcasts, and autograd keeps the fp32 input and the fp32 normalised product,
4h + 4h bytes instead of the bf16 input's 2h). CPU kernels are not CUDA kernels: the rehearsal, which runs
CPU kernels on fake tensors, keeps those bytes and a GPU does not.
"""

from __future__ import annotations

from .shapes import Shape

POLICIES = ("none", "selective", "every:4", "every:2", "full")


def block_saved_bytes(s: Shape, kernels: str = "cuda") -> dict:
    """Bytes per token one block keeps for backward, term by term (bf16 unless said)."""
    h, kv, f, a = s.width, s.kv_width, s.hidden, s.heads
    if s.arch == "gpt2":
        return {
            "norm inputs": 4 * h,
            "linear inputs (qkv, fc)": 4 * h,
            "qkv output (q, k, v views)": 2 * (h + 2 * kv),
            "attention output": 2 * h,
            "MLP hidden (fc out, GELU out)": 4 * f,
            "softmax lse": 4 * a,
            "norm statistics": 16 if kernels == "cuda" else 8,
        }
    norm = 4 * h if kernels == "cuda" else 2 * (4 * h + 4 * h)
    return {
        "norm inputs" + (" (fp32 on CPU)" if kernels == "cpu" else ""): norm,
        "linear inputs (qkv, proj, MLP)": 6 * h,
        "qkv output (v view)": 2 * (h + 2 * kv),
        "rotated q, k": 2 * (h + kv),
        "attention output": 2 * h,
        "MLP hidden (gate, SiLU, up, product)": 8 * f,
        "softmax lse": 4 * a,
        "norm statistics": 8,
    }


def block_selective_bytes(s: Shape) -> dict:
    """Bytes per token a block keeps under the selective policy (matmul and attention outputs saved)."""
    h, kv, f, a = s.width, s.kv_width, s.hidden, s.heads
    mlp = 2 * f if s.arch == "gpt2" else 4 * f
    return {
        "block input": 2 * h,
        "matmul outputs": 2 * (h + 2 * kv) + 2 * h + mlp + 2 * h,
        "attention output + lse": 2 * h + 4 * a,
    }


def head_bytes(s: Shape, kernels: str = "cuda") -> dict:
    """The tail, per token: the final norm, the head's input and the loss. The course model upcasts the
    logits and calls ``cross_entropy``, whose ``log_softmax`` keeps its fp32 output (4V); at the loss the
    bf16 logits, their fp32 copy and 2 bytes more per entry live beside it (8V, fitted on the rehearsal:
    8.405 GB = 8·V·T for Llama 3 8B at T = 8,192 tokens, under every policy)."""
    h, vocab = s.width, s.vocab
    norm = (2 * h if kernels == "cuda" else 8 * h) if s.arch == "llama" else 2 * h
    return {
        "final norm input": norm,
        "head input": 2 * h,
        "log-probabilities (fp32, kept)": 4 * vocab,
        "loss transient": 8 * vocab,
    }


def backward_working_bytes(s: Shape) -> float:
    """A block's gradients in flight during its own backward, per token (fitted on the rehearsal): the
    gradients of its output and input (2h each) and of the MLP's intermediates (SwiGLU's backward holds
    four of 2f bytes, GELU's two)."""
    return 2 * (2 * s.width) + (8 if s.arch == "llama" else 4) * s.hidden


def rebuilt_blocks(policy: str, layers: int) -> tuple[bool, ...]:
    """Which blocks, in forward order, the policy rebuilds whole in backward: all under "full", none under "none"
    and "selective", and under "every:K" the K-th, 2K-th, ... (torchtitan counts its blocks from 1 and wraps the
    one whose ``count % ac_freq == 0``)."""
    if policy == "full":
        return (True,) * layers
    if not policy.startswith("every:"):
        return (False,) * layers
    k = int(policy.split(":")[1])
    return tuple((i + 1) % k == 0 for i in range(layers))


def policy_parts(policy: str, layers: int) -> tuple[int, int, int]:
    """(blocks keeping everything, blocks fully recomputed, blocks selectively recomputed)."""
    if policy == "selective":
        return 0, 0, layers
    rebuilt = sum(rebuilt_blocks(policy, layers))
    return layers - rebuilt, rebuilt, 0


def activation_terms(s: Shape, policy: str, tokens: int, kernels: str = "cuda") -> dict:
    """Activation bytes on one GPU for ``tokens`` = b·s per micro-batch, term by term."""
    whole = sum(block_saved_bytes(s, kernels).values())
    selective = sum(block_selective_bytes(s).values())
    keep, rebuilt, sel = policy_parts(policy, s.layers)
    tail = head_bytes(s, kernels)
    # one block rebuilt at a time in backward; under the selective policy its saved outputs are handed back
    # by the policy's cache, so only the rest is new
    one_rebuilt = (whole if rebuilt else whole - selective) * tokens if (rebuilt or sel) else 0.0
    # the last block, whose backward runs first: what it keeps, and whether it is rebuilt (under "every:K" only
    # when K divides L)
    last_rebuilt = rebuilt_blocks(policy, s.layers)[-1]
    last_kept = selective if sel else 2 * s.width if last_rebuilt else whole
    return {
        "blocks kept": (keep * whole + rebuilt * 2 * s.width + sel * selective) * tokens,
        "one block rebuilt": one_rebuilt,
        "block backward working set": backward_working_bytes(s) * tokens,
        "tail kept": (tail["final norm input"] + tail["head input"] + tail["log-probabilities (fp32, kept)"]) * tokens,
        "loss transient": tail["loss transient"] * tokens,
        "last block kept": last_kept * tokens,
        "last block rebuilt": one_rebuilt if (sel or last_rebuilt) else 0.0,
        "per block (none)": whole * tokens,
        "per block (selective)": selective * tokens,
    }
