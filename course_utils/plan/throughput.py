"""One configuration priced: its peak memory per GPU and its step time, term by term (notebook 05).

Memory is the largest of the moments of a step (end of forward; the loss's backward; the first block's
backward; late backward; for DeepSpeed stage 3 also the end of the backward, where it gathers the
embeddings), each split as notebook 05b's tracker splits it (``states``: shards, optimizer state and the
gradients existing then; ``unsharded``: gathered 16-bit parameters, unsharded gradients and
buffers; ``activations``), then the caching allocator's reserve and the CUDA context.

Time per step = for each micro-batch compute (FLOPs at ``mfu`` x the GPU's peak) + recomputation +
communication not hidden behind compute, unit by unit, on the link that carries it (``Impl.comm``); then the
optimizer step (memory-bound: fused AdamW moves 28 bytes per parameter it updates) and offload (PCIe and
the CPU's Adam, bound by the host's memory bandwidth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .activations import activation_terms, block_saved_bytes, block_selective_bytes, policy_parts, rebuilt_blocks
from .implementations import LAST_GATHER, Impl, ds_offload_pcie_bytes, host_bytes_per_param
from .shapes import GPUCluster, Shape


@dataclass(frozen=True)
class Config:
    """One point of the search: an implementation (``Impl.key``), a recomputation policy, the micro-batch
    b, accumulation steps, nodes used, the shard group S (N when fully sharded, 1 when replicated)."""

    impl: str
    policy: str
    micro_batch: int
    accum: int
    nodes: int
    shard: int
    kernels: str = "cuda"


def memory(s: Shape, impl: Impl, c: Config, cl: GPUCluster) -> dict:
    """Peak bytes per GPU and the moment it happens, every term kept (the JSON's ``memory``)."""
    n = c.nodes * cl.gpus_per_node
    T = c.micro_batch * s.seq
    states = impl.states(s, impl, n, c.shard, c.accum)
    bufs = impl.buffers(s, impl)
    act = activation_terms(s, c.policy, T, c.kernels)
    st = sum(states.values())
    # what backward makes and the step frees (with accumulation, what does not persist across micro-batches)
    fresh = impl.fresh_grads(s, impl, n, c.shard, c.accum)
    # of it, DeepSpeed's buckets come with the first gradient hook (the head's): there in the first block's backward
    hooked = impl.hook_made(s, impl, c.accum) if impl.hook_made else 0.0
    # and of it, what only step() or the backward's epilogue makes (DeepSpeed's partitions): not there late in it
    after = impl.after_backward(s, impl, n, c.accum) if impl.after_backward else 0.0
    # bf16 weights held from forward to backward (autocast's casts; SHARD_GRAD_OP's unsharded units) are freed
    # block by block in backward (FSDP2's post_backward reshards each unit: reshard_after_backward): late in it,
    # only the block in backward still holds its own
    held = states.get("autocast bf16 weight copies (fwd->bwd)", 0.0)
    held += states.get("bf16 parameters held fwd->bwd (all units)", 0.0)
    held_late = min(held, 2 * s.block_params)
    root = bufs.get("root bf16 parameters (not resharded after forward)", 0.0)
    gathered = bufs.get("two gathered blocks, bf16", 0.0)
    # a block's bf16 gradient is copied into the fp32 reduce-scatter input and freed: never both at once
    block_bwd = bufs.get("a block's reduce-scatter input, fp32", 0.0)
    head_grad = 2 * s.head_params if impl.holds_head_grad else 0.0
    kept = act["blocks kept"] + act["tail kept"]
    rebuilt = act["one block rebuilt"] + act["block backward working set"]
    V = s.vocab
    in_backward = root + gathered + block_bwd + head_grad
    phases = {
        "end of forward": {"states": st - fresh, "unsharded": root + gathered / 2 + bufs.get(LAST_GATHER, 0.0),
                           "activations": kept + act["loss transient"]},
        # the fp32 gradient of the logits (4V) and its bf16 cast (2V) beside the kept log-probabilities
        "backward of the loss": {"states": st - fresh, "unsharded": root + head_grad,
                                 "activations": kept + 6 * V * T},
        "first block's backward": {"states": st - fresh + hooked, "unsharded": in_backward,
                                   "activations": kept - 4 * V * T + rebuilt},
        "late backward": {"states": st - held + held_late - after, "unsharded": in_backward,
                          "activations": act["blocks kept"] / s.layers + rebuilt},
    }  # fmt: skip
    if impl.unsharded:  # DeepSpeed stage 3: no units; its coordinator's gathers and releases, replayed
        # (and one more moment: the embeddings' backward, whose weight is as large as the head's, and the
        # epilogue's reduction; no block's activations left, only the gradient reaching the embeddings, bf16)
        phases["end of backward"] = dict(phases["late backward"], activations=2 * s.width * T)
        for phase, gathered_then in impl.unsharded(s, c.policy).items():
            phases[phase]["unsharded"] = gathered_then
    for p in phases.values():
        p["total"] = p["states"] + p["unsharded"] + p["activations"]
    peak_phase = max(phases, key=lambda k: phases[k]["total"])
    tensors = phases[peak_phase]["total"]
    total = tensors * (1 + cl.allocator_reserve) + cl.context_bytes
    return {
        "states": states,
        "buffers": bufs,
        "activations": act,
        "phases": phases,
        "peak_phase": peak_phase,
        "tensors_peak": tensors,
        "allocator_reserve": tensors * cl.allocator_reserve,
        "context": cl.context_bytes,
        "total": total,
        "fits": total <= cl.gpu.mem,
        "headroom": cl.gpu.mem - total,
    }


class Timing:
    """The times and links one configuration's communication is weighed against (``Impl.comm`` reads it)."""

    def __init__(self, s: Shape, c: Config, cl: GPUCluster, mfu: float):
        self.cluster, self.gpus_per_node = cl, cl.gpus_per_node
        self.n = c.nodes * cl.gpus_per_node
        tokens = c.micro_batch * s.seq
        rate = cl.gpu.peak_flops * mfu
        # 2 FLOPs per matmul parameter per token, plus causal attention (QK^T and AV, half skipped): 2·s·h
        self.f_blk = (2.0 * s.block_matmul_params + 2.0 * s.seq * s.width) * tokens / rate
        self.head = 2.0 * s.head_params * tokens / rate
        self.layers = s.layers
        # each block's backward, in forward order: twice its forward, and once more where the policy rebuilds it
        self.block_backwards = tuple(
            2 * self.f_blk + (self.f_blk if r else 0.0) for r in rebuilt_blocks(c.policy, s.layers)
        )

    def backward_window(self, with_recompute: bool) -> float:
        """The backward's compute, which a collective on another stream can hide behind (the rebuilt blocks'
        forwards again only ``with_recompute``)."""
        return sum(self.block_backwards) if with_recompute else self.layers * 2 * self.f_blk

    def link(self, group: int, spans_nodes: bool):
        """(bandwidth, latency) of a ring of ``group`` GPUs: the node's network when it spans nodes, else
        NVLink; None for a group of one."""
        if group <= 1:
            return None
        cl = self.cluster
        return (cl.inter_bw, cl.inter_latency) if spans_nodes else (cl.gpu.nvlink_bw, cl.intra_latency)

    @staticmethod
    def wire(spans_nodes: bool) -> str:
        return "network" if spans_nodes else "nvlink"


def step_time(s: Shape, impl: Impl, c: Config, cl: GPUCluster, mfu: float) -> dict:
    """Seconds per optimizer step on one GPU, term by term (the JSON's ``time``)."""
    g, t = cl.gpu, Timing(s, c, cl, mfu)
    keep, rebuilt, sel = policy_parts(c.policy, s.layers)
    selective = sum(block_selective_bytes(s).values())
    whole = sum(block_saved_bytes(s).values())
    tokens = c.micro_batch * s.seq
    # full: one more forward per rebuilt block; selective: the cheap ops again, memory-bound (what was not
    # saved is written and read back at HBM speed)
    recompute = rebuilt * t.f_blk + sel * 2 * (whole - selective) * tokens / g.hbm_bw
    exposed, sent = impl.comm(s, impl, c, t)
    updated = s.params / impl.optimizer_share(t.n, c.shard)
    optimizer = (28 + impl.step_copy) * updated / g.hbm_bw
    offload, micro = 0.0, s.layers * 3 * t.f_blk + 3 * t.head
    if impl.offload == "optimizer":  # DeepSpeed: its gradient partition crosses PCIe every micro-batch, its CPU Adam
        offload, optimizer = ds_offload_s(impl.stage, updated, c.accum, t.backward_window(True), g.pcie_bw, cl), 0.0
    elif impl.offload == "all":  # FSDP2: the shards cross PCIe for every gather, torch.optim steps on the CPU
        gathers = 2 if impl.reshard_after_forward else 1
        offload = fsdp2_cpu_offload_s(
            updated, c.accum, micro + recompute, g.pcie_bw, cl.host_bw, cl.gpus_per_node, gathers
        )
        optimizer = 0.0
    terms = {
        "compute": c.accum * micro,
        "recompute": c.accum * recompute,
        "exposed comm": exposed,
        "optimizer step": optimizer,
        "offload": offload,
    }
    total = sum(terms.values())
    step_tokens = c.accum * tokens * t.n
    return {
        "terms": terms,
        "step_s": total,
        "tokens_per_step": step_tokens,
        "tokens_per_s_per_gpu": step_tokens / total / t.n,
        "link_bytes_per_gpu": {"nvlink": sent.get("nvlink", 0.0), "network": sent.get("network", 0.0)},
        "per_block_fwd_s": t.f_blk,
    }


def cpu_adam_s(updated: float, gpus_per_node: int, host_bw: float, k: float = 12.0) -> float:
    """Adam on the host, memory-bound: it reads and writes its K bytes of state per parameter, reads the
    gradient and writes the weight, (2K + 4) bytes, for each of the node's GPUs through the host's memory
    bandwidth (both planners: ``step_time`` and ``offload_modes``)."""
    return (2 * k + 4) * updated * gpus_per_node / host_bw


def ds_offload_s(stage: int, updated: float, accum: int, backward: float, pcie_bw: float, cl, k=12.0) -> float:
    """Seconds DeepSpeed's ``offload_optimizer`` adds to a step on a GPU that updates ``updated`` parameters (both
    planners): each micro-batch's gradient copies (``implementations.ds_offload_pcie_bytes``) are non-blocking
    and hide behind that micro-batch's ``backward`` where shorter (the last one's include the fp32 gradient for
    Adam); the updated weights' copy back waits for the step, as does the CPU's Adam (``cpu_adam_s``), once a step:
    accumulation spreads them over more tokens."""
    micro, per_step = ds_offload_pcie_bytes(stage, accum)
    hidden_not = sum(max(0.0, b * updated / pcie_bw - backward) for b in micro)
    return hidden_not + per_step * updated / pcie_bw + cpu_adam_s(updated, cl.gpus_per_node, cl.host_bw, k)


def fsdp2_cpu_offload_s(updated, accum, hidden, pcie_bw, host_bw, gpus_per_node, gathers=2, k=12.0) -> float:
    """Seconds FSDP2's ``CPUOffloadPolicy`` adds to a step on a GPU that updates ``updated`` parameters (torch
    2.13's ``_fully_shard``; both planners use it). On every micro-batch the fp32 shard is copied in before
    each of its ``gathers`` all-gathers (non-blocking: it hides behind ``hidden``, the micro-batch's compute).
    The reduced fp32 gradient is copied out after each unit's reduce-scatter: on the first micro-batch
    non-blocking (pinned memory, nothing to accumulate into: ``foreach_reduce`` in ``_fsdp_collectives.py``
    records an event the optimizer waits on), so it hides behind the rest of the backward; from the second
    micro-batch on blocking, since the CPU then adds it to the gradient so far (read 2, write 1: 12 bytes).
    Then ``torch.optim`` steps on the CPU (``cpu_adam_s``)."""
    copy_in, copy_out = gathers * 4 * updated / pcie_bw, 4 * updated / pcie_bw
    add = 12 * updated * gpus_per_node / host_bw
    return (
        accum * max(0.0, copy_in - hidden)
        + (accum - 1) * (copy_out + add)
        + cpu_adam_s(updated, gpus_per_node, host_bw, k)
    )


def evaluate(s: Shape, cl: GPUCluster, impl: Impl, c: Config, mfu: float) -> dict:
    """One configuration: its memory, its time, and whether it fits (offload: the host's memory too)."""
    mem = memory(s, impl, c, cl)
    host_ok = True
    if impl.offload:
        share = impl.optimizer_share(c.nodes * cl.gpus_per_node, c.shard)
        host_ok = host_bytes_per_param(impl) * s.params / share * cl.gpus_per_node <= cl.host_mem
    return {
        "config": asdict(c),
        "impl": impl.key,
        "gpus_per_node": cl.gpus_per_node,
        "memory": mem,
        "time": step_time(s, impl, c, cl, mfu),
        "fits": mem["fits"] and host_ok,
    }
