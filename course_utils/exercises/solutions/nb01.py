"""Reference solutions, notebook 01 (``load_solution("01", name)`` prints and defines one)."""

import torch


def zero_state_bytes(optimizer):
    """Bytes of per-parameter optimizer state this rank holds (each storage once, no 0-dim step counters)."""
    seen = {}
    for state in optimizer.optim.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def model_state_bill(psi, nd, stage, k=12):
    """Model-state bytes per GPU: 2-byte weights, 2-byte gradients, k optimizer bytes per parameter."""
    weights, grads, optim = 2 * psi, 2 * psi, k * psi
    if stage == "ddp":
        return weights + grads + optim
    if stage == "zero1":
        return weights + grads + optim / nd
    if stage == "zero2":
        return weights + (grads + optim) / nd
    if stage == "zero3":
        return (weights + grads + optim) / nd
    raise ValueError(f"unknown stage {stage!r}")


def block_activation_bytes(block, x):
    """Bytes autograd saves for the backward while block(x) runs (each storage once, no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())
