"""Reference solutions, notebook 01 (``load_solution("01", name)`` prints and defines one)."""

import math

import torch


def zero_state_bytes(optimizer):
    """Bytes of per-parameter optimizer state this rank holds (each storage once, no 0-dim step counters)."""
    seen = {}
    for state in optimizer.optim.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def smallest_nd(psi, stage, gpu_mem, reserve, k=12):
    """The smallest whole Nd at which model states plus reserve fit in gpu_mem bytes, or None."""
    whole = {"ddp": 2 + 2 + k, "zero1": 2 + 2, "zero2": 2, "zero3": 0}[stage] * psi  # no Nd divides it
    split = (2 + 2 + k) * psi - whole  # divided by Nd
    budget = gpu_mem - reserve
    if not split:
        return 1 if whole <= budget else None
    if whole >= budget:
        return None  # the undivided part alone fills the budget: no Nd is enough
    nd = math.ceil(split / (budget - whole))
    return nd - 1 if nd > 1 and whole + split / (nd - 1) <= budget else nd  # a bill of exactly the budget fits


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
