"""The 16-byte bill counted on real tensors: a model and optimizer in this process, and the
activations autograd saves (notebook 01).

``memory.bill``'s formulas, held against what torch actually allocates: ``measured_bill`` counts the
storages of a model and its optimizer by part, ``measure_model_state_bytes`` runs one step of the
course's loop and counts them, ``measure_activation_bytes`` counts what a forward saves for backward.
torch is imported inside the functions: the calculators that share the ``memory`` package stay
quick to start.
"""

from __future__ import annotations

import contextlib
import math

from ..errors import CourseInputError
from .bill import activation_bytes


class MixedPrecisionAdam:
    """Adam as the ZeRO paper counts it: 16-bit working weights and gradients on the model,
    an fp32 master copy, fp32 momentum and fp32 variance in the optimizer (notebook 01).

    K = 4 + 4 + 4 = 12 bytes per parameter, on top of the model's 2 + 2. Construct it on an
    fp32 model: it takes fp32 master copies first, then turns the model's parameters into
    ``dtype`` (bf16 by default; fp16 counts the same). ``step()`` upcasts each 16-bit gradient
    one tensor at a time, updates the master copy exactly as ``torch.optim.Adam`` would, and
    writes the result back into the 16-bit weights.

    ``state`` maps each model parameter to ``{"master", "exp_avg", "exp_avg_sq"}``, shaped
    like ``torch.optim.Optimizer.state`` so ``measured_bill`` counts either the same way.
    """

    def __init__(self, model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, dtype=None):
        import torch

        dtype = torch.bfloat16 if dtype is None else dtype
        self.lr, self.betas, self.eps, self.steps = lr, betas, eps, 0
        self.params = list(model.parameters())  # distinct parameters: a tied weight appears once
        masters = [p.detach().to(torch.float32).clone() for p in self.params]
        for p in self.params:
            p.data = p.data.to(dtype)
        self.state = {
            p: {"master": m, "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
            for p, m in zip(self.params, masters)
        }

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        self.steps += 1
        b1, b2 = self.betas
        bc1, bc2_sqrt = 1 - b1**self.steps, math.sqrt(1 - b2**self.steps)
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    continue
                st = self.state[p]
                g = p.grad.to(torch.float32)  # a transient fp32 copy of one tensor's gradient
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(self.eps)
                st["master"].addcdiv_(st["exp_avg"], denom, value=-self.lr / bc1)
                p.copy_(st["master"])


def measured_bill(model, optimizer=None) -> dict:
    """Bytes the real tensors of one process's model and optimizer hold, by part of the bill (notebook 01).

    Counts each underlying storage once (a tied weight, or a view, is not counted twice):
    ``weights`` (the model's parameters), ``gradients`` (their ``.grad``), ``optimizer``
    (optimizer-state tensors with one number per parameter, e.g. master copy, momentum,
    variance), ``optimizer_scalars`` (small per-tensor state such as ``torch.optim.Adam``'s
    ``step`` counters) and ``total`` (the first three).
    """
    seen: set = set()

    def nbytes(tensors):
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in seen and st.nbytes():
                seen.add(key)
                total += st.nbytes()
        return total

    params = list(model.parameters())
    out = {"weights": nbytes(params), "gradients": nbytes([p.grad for p in params if p.grad is not None])}
    per_param, scalars = [], []
    if optimizer is not None:
        import torch

        for p, st in optimizer.state.items():
            for value in st.values():
                if isinstance(value, torch.Tensor):
                    (per_param if value.numel() == p.numel() else scalars).append(value)
    out["optimizer"] = nbytes(per_param)
    out["optimizer_scalars"] = nbytes(scalars)
    out["total"] = out["weights"] + out["gradients"] + out["optimizer"]
    return out


class MainGradAdamW:
    """``torch.optim.AdamW`` as large-scale trainers drive it: bf16 weights on the model, every bf16
    gradient added into an fp32 ``main_grad`` as soon as it is final (then freed), fp32 master weights
    and the AdamW moments in the optimizer (notebook 01).

    Megatron-Core's bf16 recipe (its ``accumulate_allreduce_grads_in_fp32``): 2 + 4 + (4 + 8) = 18 bytes
    per parameter, the figure its distributed-optimizer page states for "float16 param, fp32 grads".
    ``state`` maps each model parameter to its master copy and AdamW's moments, shaped like
    ``torch.optim.Optimizer.state`` so ``measured_bill`` counts it the same way.
    """

    def __init__(self, model, lr: float = 1e-3):
        import torch

        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone() for p in self.params]  # taken before the cast
        for p in self.params:
            p.data = p.data.to(torch.bfloat16)
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(self._accumulate)
        self.inner = torch.optim.AdamW(self.masters, lr=lr, foreach=False)

    @staticmethod
    def _accumulate(p) -> None:  # the bf16 gradient is final: add it into main_grad and free it
        p.main_grad.add_(p.grad)
        p.grad = None

    @property
    def state(self) -> dict:
        return {p: {"master": m, **self.inner.state.get(m, {})} for p, m in zip(self.params, self.masters)}

    def step(self) -> None:
        import torch

        for m, p in zip(self.masters, self.params):
            m.grad = p.main_grad  # AdamW reads main_grad itself: no copy
        self.inner.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.main_grad.zero_()  # the buffer lives on: it is part of the bill


class Autocast:
    """``model(x, y)`` under ``torch.autocast`` (bf16, the device's type), the PyTorch AMP recipe (notebook 01)."""

    def __init__(self, model):
        self.module = model

    def __call__(self, *args):
        import torch

        device = next(self.module.parameters()).device.type
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return self.module(*args)


def _sixteen_bit_copies_watcher(net):
    """A ``TorchDispatchMode`` that sees every 16-bit copy made of one of ``net``'s parameters.

    ``alive()`` adds up the copies still alive (a weak reference each): autocast's weight cache holds
    them inside the region, and autograd keeps those a matmul saved until the backward has used them.
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in net.parameters()}

    class SixteenBitCopies(TorchDispatchMode):
        copies: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            src = args[0] if args else None
            if (
                func is torch.ops.aten._to_copy.default
                and isinstance(src, torch.Tensor)
                and src.untyped_storage().data_ptr() in params
                and out.dtype in (torch.bfloat16, torch.float16)
            ):
                self.copies.append((out.nbytes, weakref.ref(out)))
            return out

        def alive(self) -> int:
            return sum(n for n, ref in self.copies if ref() is not None)

    return SixteenBitCopies()


def _linear_weight_numel(net) -> int:
    """Parameters read by an ``nn.Linear`` (each storage once: the tied head is the embedding's weight)."""
    import torch

    seen = {
        m.weight.untyped_storage().data_ptr(): m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear)
    }
    return sum(seen.values())


RECIPES = ("adam_mixed", "adam_fp32", "autocast_adamw", "main_grad_adamw")


def measure_model_state_bytes(
    model="tiny", optimizer: str = "adam_mixed", *, seed: int = 0, batch: int = 4, dtype=None
) -> dict:
    """Build the course model, run one real training step, and count the bytes it holds (notebook 01).

    ``optimizer`` (a recipe): "adam_mixed" (``MixedPrecisionAdam``: the paper's bf16 weights and grads,
    fp32 master, momentum, variance), "adam_fp32" (``torch.optim.Adam`` on an fp32 model),
    "autocast_adamw" (what a PyTorch user runs: an fp32 model called under ``torch.autocast`` bf16,
    ``torch.optim.AdamW``) or "main_grad_adamw" (``MainGradAdamW``: bf16 weights, an fp32 ``main_grad``,
    fp32 master and moments). The step is the course's one loop (``loop.run_steps``) in this process;
    the gradients are counted after the step, before they are cleared, as they are at the step's peak.

    Returns ``measured_bill(...)`` plus ``psi`` (Ψ, from ``models.param_count``), ``optimizer_name``,
    ``per_param`` ({part: bytes / Ψ}), ``loss``, ``copies_after_forward`` (bytes of 16-bit copies of
    the parameters alive between the forward and the backward, seen by a ``TorchDispatchMode`` in every
    recipe: only autocast makes any), ``copies_after_backward`` and ``linear_psi`` (parameters an
    ``nn.Linear`` reads, counted from the model's modules); with "main_grad_adamw" ``gradients`` counts the measured
    ``.grad`` bytes plus the ``main_grad`` buffers, and ``dot_grad`` the measured ``.grad`` bytes alone.
    """
    import torch

    from ..instrument import Observer
    from ..loop import Prepared, TrainConfig, one_process, run_steps
    from ..models import build_model, get_config, param_count

    net = build_model(get_config(model), seed=seed)
    forward = net
    if optimizer == "adam_mixed":
        opt = MixedPrecisionAdam(net, dtype=dtype)
    elif optimizer == "adam_fp32":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
    elif optimizer == "autocast_adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
        forward = Autocast(net)
    elif optimizer == "main_grad_adamw":
        opt = MainGradAdamW(net)
    else:
        raise CourseInputError(f"optimizer must be one of {', '.join(RECIPES)}, got {optimizer!r}")
    # every recipe: a 0 without autocast is measured. Built after the recipe's set-up, which may recast the weights
    # (MixedPrecisionAdam, MainGradAdamW): the watcher knows the parameters by their storages' addresses
    watcher = _sixteen_bit_copies_watcher(net)

    class BillAfterTheStep(Observer):
        copies: dict = {}

        def before_forward(self, step: int) -> None:
            watcher.__enter__()

        def after_forward(self, step: int, loss) -> None:
            self.copies["after_forward"] = watcher.alive()

        def after_backward(self, step: int) -> None:
            watcher.__exit__(None, None, None)
            self.copies["after_backward"] = watcher.alive()

        def after_update(self, step: int) -> None:
            self.bill = measured_bill(net, opt)
            if isinstance(opt, MainGradAdamW):  # measured .grad (the hook frees it) + the main_grad buffers
                self.bill["dot_grad"] = self.bill["gradients"]
                self.bill["gradients"] += sum(p.main_grad.nbytes for p in opt.params)
                self.bill["total"] = self.bill["weights"] + self.bill["gradients"] + self.bill["optimizer"]

    counted = BillAfterTheStep()
    prepared = Prepared(model=forward, optimizer=opt, full_state_dict=net.state_dict, held=lambda: ((), (), ()))
    (loss,) = run_steps(prepared, TrainConfig(model=model, batch=batch, seed=seed), one_process(), range(1), [counted])
    out = counted.bill
    psi = param_count(net)
    out["per_param"] = {k: out[k] / psi for k in ("weights", "gradients", "optimizer", "total")}
    out.update(psi=psi, optimizer_name=optimizer, loss=loss.item(), linear_psi=_linear_weight_numel(net))
    out.update(
        copies_after_forward=counted.copies["after_forward"], copies_after_backward=counted.copies["after_backward"]
    )
    return out


@contextlib.contextmanager
def checkpointed_blocks(model):
    """Inside this context every transformer block of the course model runs under activation
    checkpointing (``torch.utils.checkpoint``, non-reentrant): a block keeps only its input
    and recomputes the rest during the backward pass (notebook 01).
    """
    from torch.utils.checkpoint import checkpoint

    blocks = list(model.blocks)
    for block in blocks:
        block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(block.forward)
    try:
        yield model
    finally:
        for block in blocks:
            del block.forward  # back to the class's own forward


def measure_activation_bytes(model, idx, targets=None, *, checkpointing: bool = False) -> dict:
    """Bytes autograd saves for the backward pass during one forward, counted on the real tensors
    with ``torch.autograd.graph.saved_tensors_hooks`` (notebook 01).

    Each storage is counted once (views such as q, k, v of one qkv output share a storage);
    parameters are not activations and are left out. Returns ``{"total": bytes, "blocks": bytes
    saved inside the transformer blocks (what the paper's 12·h·b·s·L rule describes),
    "outside": embeddings, final norm, logits and loss, "loss": the loss tensor}``.
    """
    import torch

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict = {}
    where = {"inside": 0}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = (st.nbytes(), where["inside"] > 0)
        return t

    def enter(module, args):
        where["inside"] += 1

    def leave(module, args, output):
        where["inside"] -= 1

    handles = [h for b in model.blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    ctx = checkpointed_blocks(model) if checkpointing else contextlib.nullcontext()
    try:
        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, targets) if targets is not None else model(idx)
    finally:
        for h in handles:
            h.remove()
    blocks = sum(n for n, inside in saved.values() if inside)
    total = sum(n for n, _ in saved.values())
    return {"total": total, "blocks": blocks, "outside": total - blocks, "loss": loss}


def compare_activations(cases, *, model="tiny", dtype=None, seed: int = 0) -> list[dict]:
    """Measured activation bytes against the paper's rule for several (b, s, width, layers) (notebook 01).

    ``cases``: iterable of dicts with any of ``batch``, ``seq``, ``width``, ``layers``, ``heads``
    (others from the ``model`` preset). The model runs in ``dtype`` (bf16 by default) so saved
    activations are 16-bit numbers, as the rule assumes. Returns one row per case with the
    measured ``blocks``/``total`` bytes, with and without checkpointing, the rule's bytes
    (``activation_bytes``, both ways) and ``ratio`` = measured blocks / rule.
    """
    import torch

    from ..data import batch_for_rank
    from ..models import build_model, get_config

    dtype = torch.bfloat16 if dtype is None else dtype
    rows = []
    for case in cases:
        case = dict(case)
        batch = case.pop("batch", 4)
        cfg = get_config(model, **case)
        net = build_model(cfg, seed=seed).to(dtype)
        x, y = batch_for_rank(0, 0, 1, batch=batch, seq=cfg.seq, vocab=cfg.vocab, seed=seed)
        full = measure_activation_bytes(net, x, y)
        ckpt = measure_activation_bytes(net, x, y, checkpointing=True)
        rule = activation_bytes(cfg.width, batch, cfg.seq, cfg.layers)
        rule_ckpt = activation_bytes(cfg.width, batch, cfg.seq, cfg.layers, checkpointing=True)
        rows.append(
            {
                "batch": batch,
                "seq": cfg.seq,
                "width": cfg.width,
                "layers": cfg.layers,
                "heads": cfg.heads,
                "measured_blocks": full["blocks"],
                "measured_total": full["total"],
                "measured_blocks_ckpt": ckpt["blocks"],
                "measured_total_ckpt": ckpt["total"],
                "rule": rule,
                "rule_ckpt": rule_ckpt,
                "ratio": full["blocks"] / rule,
            }
        )
    return rows
