"""What each strategy saves in a checkpoint, and how it is put back (notebook 06).

The strategy decides the layout (``course_utils.loop.Prepared``): by default the model and optimizer
through ``torch.distributed.checkpoint.state_dict.get_state_dict`` (plain modules, DDP, FSDP2's
DTensors), keyed by parameter name, so DCP reshards them between strategies and world sizes; the
hand-built ZeRO optimizers of ``course_utils.zero`` save each flat slice as a DTensor of the global
flat buffer; any strategy may bring its own ``Prepared.get_state``/``set_state`` pair. Which layout
a strategy saves is a fact of the record (``Strategy.state``), so a resume can be refused
before any worker starts (``state_format``).

Rank-local state (the RNG, the position in the data stream) is saved under rank-keyed names
(``rng.rank1``): DCP keeps a single copy of a same-named plain tensor, as it would for a replicated
weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .strategies import get as strategy_record


def _inner(model):
    """The user's module inside a DDP-style wrapper (``.module``), or the module itself."""
    return getattr(model, "module", model)


def _init_optimizer_state(optimizer) -> None:
    """Create an optimizer's state before any step, so that a checkpoint can be loaded into it.

    What ``get_state_dict`` does for torch modules: one step with zero gradients and a
    learning rate of 0, which leaves the parameters unchanged bit for bit.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


class TorchState:
    """Model + optimizer through ``get_state_dict``/``set_state_dict``: plain modules, DDP, FSDP2 (notebook 06).

    Keys are parameter names (``blocks.0.attn.qkv.weight``), the same for every strategy and
    world size; FSDP2's DTensors carry their global shape, so DCP reshards them on load.
    """

    format = "torch"

    def __init__(self, prepared):
        self.model, self.optimizer = _inner(prepared.model), prepared.optimizer

    def get(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def set(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def layout(self) -> dict:
        return {}


class FlatState:
    """The hand-built ZeRO optimizers of ``course_utils.zero``: slices of flat buffers (notebook 06).

    Rank r owns ``[r·S, (r+1)·S)`` of each flat buffer of Ψ_f elements (padded to Nd·S). Its
    fp32 master slice and Adam's momentum and variance for that slice are saved as DTensors
    of the unpadded global buffer (``Shard(0)``, torch.chunk's split, which is exactly the
    ZeRO layout), so DCP records each piece by its offset: a slice saved by 4 ranks loads
    on 2. The layout (which parameters, in which order) is in the commit marker.
    """

    format = "zero-flat"

    def __init__(self, prepared):
        from torch.distributed.device_mesh import DeviceMesh

        self.prepared, self.optimizer = prepared, prepared.optimizer
        self.flats = list(self.optimizer.flats)
        device_type = self.flats[0].master.device.type
        self.mesh = DeviceMesh.from_group(self.flats[0].group or dist.group.WORLD, device_type)

    def _dtensor(self, flat, tensor):
        from torch.distributed.tensor import DTensor, Shard

        real = max(0, min(flat.shard_numel, flat.numel - flat.rank * flat.shard_numel))
        return DTensor.from_local(
            tensor.detach()[:real], self.mesh, [Shard(0)], run_check=False, shape=torch.Size([flat.numel]), stride=(1,)
        )

    def get(self) -> dict:
        inner = self.optimizer.optimizer
        _init_optimizer_state(inner)
        model, optim = {}, {}
        for i, flat in enumerate(self.flats):
            model[f"flat{i}"] = self._dtensor(flat, flat.master)
            for key, value in inner.state[flat.master].items():
                sharded = isinstance(value, torch.Tensor) and value.dim() > 0
                optim[f"flat{i}.{key}"] = self._dtensor(flat, value) if sharded else value
        return {"model": model, "optim": optim}

    def set(self, state: dict) -> None:
        # DCP loaded in place into views of the master slices and the optimizer state; the
        # working copies follow: the 16-bit slice (mixed precision), then the whole parameters
        # (stages 1 and 2 all-gather them; stage 3 gathers before each forward anyway).
        with torch.no_grad():
            for i, flat in enumerate(self.flats):
                for key, value in self.optimizer.optimizer.state[flat.master].items():
                    if isinstance(value, torch.Tensor) and value.dim() == 0:
                        value.copy_(state["optim"][f"flat{i}.{key}"])
                if flat.master is not flat.shard:
                    flat.shard.copy_(flat.master)
            self.optimizer.share_weights()

    def layout(self) -> dict:
        names: dict[int, list[str]] = {}
        for name, p in _inner(self.prepared.model).named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return {
            "flats": [[{"names": names[id(p)], "shape": list(p.shape)} for p in flat.params] for flat in self.flats]
        }


class CustomState:
    """A strategy's own ``Prepared.get_state``/``set_state`` pair (see ``course_utils.loop.Prepared``)."""

    def __init__(self, prepared, strategy: str):
        self.get, self.set = prepared.get_state, prepared.set_state
        self.format = f"custom:{strategy}"

    def layout(self) -> dict:
        return {}


def state_of(prepared, strategy: str = ""):
    """How to save and load a strategy's state: its own hooks, ZeRO flat slices, or ``get_state_dict``."""
    if getattr(prepared, "get_state", None) is not None:
        return CustomState(prepared, strategy)
    opt = prepared.optimizer
    if hasattr(opt, "flats") and hasattr(opt, "optimizer") and hasattr(opt, "share_weights"):
        return FlatState(prepared)
    return TorchState(prepared)


def rank_local_state(info, step: int, batch: int) -> dict:
    """This rank's RNG and data position under rank-keyed names (notebook 06).

    The data position is the index of this rank's next sample in the step-keyed stream
    (``step·B + r·B/N``); the stream is keyed by step, so a resumed run draws the same batches.
    """
    r = info.rank
    state = {
        f"rng.rank{r}": torch.get_rng_state(),
        f"data.rank{r}": torch.tensor([step, step * batch + r * batch // info.world_size]),
    }
    if info.device.type == "cuda":
        state[f"cuda_rng.rank{r}"] = torch.cuda.get_rng_state(info.device)
    return state


def rank0_full_weights(prepared, strategy: str = "") -> dict:
    """The full fp32 weights, gathered one tensor at a time to the CPU of rank 0 only (notebook 06).

    Collective; rank 0 gets ``{name: tensor}`` keyed like ``build_model(...).state_dict()``, the
    other ranks ``{}``. No rank ever holds the whole model on its device: torch's
    ``get_model_state_dict(StateDictOptions(full_state_dict=True, cpu_offload=True))`` for torch
    modules (torch 2.13 keeps the result on rank 0 only), the same per-tensor gather for the flat
    buffers of the hand-built ZeRO. A strategy with its own checkpoint hooks uses its own
    ``full_state_dict`` (kept on rank 0).
    """
    source = state_of(prepared, strategy)
    if isinstance(source, TorchState):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(source.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().to("cpu", torch.float32) for k, v in full.items()} if _rank() == 0 else {}
    if isinstance(source, FlatState):
        flats = {}
        for key, value in source.get()["model"].items():
            whole = value.full_tensor()  # one flat buffer at a time
            if _rank() == 0:
                flats[key] = whole.detach().to("cpu", torch.float32)
            del whole
        return _unflatten(flats, source.layout()["flats"]) if _rank() == 0 else {}
    full = prepared.full_state_dict()
    return {k: v.detach().to("cpu", torch.float32) for k, v in full.items()} if _rank() == 0 else {}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _unflatten(saved: dict, layout: list) -> dict:
    """Parameters by name from the flat buffers of the hand-built ZeRO (``FlatState.layout``)."""
    out = {}
    for i, params in enumerate(layout):
        offset = 0
        for p in params:
            n = 1
            for s in p["shape"]:
                n *= s
            for name in p["names"]:
                out[name] = saved[f"flat{i}"][offset : offset + n].view(p["shape"]).float().clone()
            offset += n
    return out


def state_format(strategy: str) -> str:
    """Which state a strategy saves, without building it (notebook 06): the record's ``state``.

    "zero-flat" for the hand-built ZeRO stages' flat slices, "torch" for state dicts by parameter name
    (which DCP reshards between all of them). ``tests/test_checkpoint.py`` checks it against
    ``state_of`` for every strategy.
    """
    return strategy_record(strategy).state


def format_mismatch(path, marker: dict, strategy: str, fmt: str) -> str:
    """The one-line refusal for a checkpoint another strategy's state cannot be loaded from (notebook 06)."""
    return (
        f"{path} was saved by strategy {marker.get('strategy')!r} ({marker.get('format')} state) and "
        f"cannot be loaded by {strategy!r} ({fmt} state); resume with --strategy {marker.get('strategy')} "
        f"(or any strategy saving {marker.get('format')} state) or use a fresh --checkpoint-dir"
    )
