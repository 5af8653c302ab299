"""The rehearsal itself: one training step of a real-size model under FSDP2 on fake ranks, tracked (notebook 05b).

What one rehearsal does (``rehearse``), the same for every strategy:

1. build the course model (``models.GPT``) at the preset's shape on the meta device;
2. apply the strategy's row of the record (``fully_shard`` on every block, then on the root, the
   function notebook 04 teaches) on a CPU ``DeviceMesh`` of the row's shape, joined to the ``"fake"``
   process group at the target world size, bf16 compute with fp32 reduce;
3. materialise it as fake tensors, build fused AdamW and give it its state (a real run has it
   from step 2 on), so the tracked step is a steady-state step;
4. one tracked step of the course's loop (``loop.run_steps``: forward, backward, optimizer step) of
   ``micro_batch`` sequences of ``seq`` tokens on rank 0; the tracker gives the peak and what held it,
   by category.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import asdict, dataclass, replace

from ..errors import CourseInputError
from ..models import get_config
from ..presets import PRESETS, GPTConfig, preset
from ..strategies import FSDP_STRATEGIES, FULL_SHARD, get_fsdp, shard_group_size
from ..units import fmt_count
from .recompute import check_policy, wrap_blocks
from .tracker import PARTS, TrackedStep, _categories, _category_peaks, require_tracker, tracker_class

PRECISIONS = ("bf16", "fp32")
MAX_NPROC = 1024


# ---------------------------------------------------------------------------------------------
# Presets: published shapes, built as the course model
# ---------------------------------------------------------------------------------------------


def model_config(model: str | GPTConfig = "6.7B", **shape) -> GPTConfig:
    """A model shape: a preset name, a course model name ("tiny"...) or a GPTConfig, with any of
    ``layers``, ``width``, ``heads``, ``vocab``, ``seq`` overridden (notebook 05b)."""
    if isinstance(model, GPTConfig):
        cfg = model
    elif isinstance(model, str) and model in ("tiny", "small", "medium"):
        cfg = get_config(model)
    else:
        cfg = preset(model).cfg
    changes = {k: v for k, v in shape.items() if v is not None}
    for name, value in changes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CourseInputError(f"{name} must be a positive whole number, got {value!r}")
    return replace(cfg, **changes) if changes else cfg  # GPTConfig checks width % heads


@functools.lru_cache(maxsize=32)
def _param_shapes(cfg: GPTConfig) -> tuple:
    """The shapes of the course model's distinct parameters at ``cfg``, from a meta-device build
    (no memory; remembered per shape: building an 80-block model on meta takes a moment)."""
    import torch

    from ..models import GPT

    with torch.device("meta"):
        return tuple(tuple(p.shape) for p in GPT(cfg).parameters())


def param_count(cfg: GPTConfig) -> int:
    """Ψ of the course model at ``cfg``, counted on the meta device (no memory) (notebook 05b)."""
    return sum(math.prod(shape) for shape in _param_shapes(cfg))


def param_tensor_count(cfg: GPTConfig) -> int:
    """Distinct parameter tensors of the course model at ``cfg`` (Adam keeps one step counter each) (notebook 05b)."""
    return len(_param_shapes(cfg))


# ---------------------------------------------------------------------------------------------
# What the rehearsal wraps and steps with, shared with the real run (gloo)
# ---------------------------------------------------------------------------------------------


def check_setting(nproc: int, strategy: str, node_size: int, micro_batch: int, mixed_precision: str) -> None:
    """Raise ``CourseInputError`` for a setting no run could have (notebook 05b)."""
    for name, value in (("nproc", nproc), ("node_size", node_size), ("micro_batch", micro_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CourseInputError(f"{name} must be a whole number >= 1, got {value!r}")
    if nproc > MAX_NPROC:
        raise CourseInputError(f"nproc {nproc} is more than {MAX_NPROC} ranks; rehearse at most {MAX_NPROC}")
    get_fsdp(strategy)
    if mixed_precision not in PRECISIONS:
        raise CourseInputError(f"mixed precision must be one of {', '.join(PRECISIONS)}, got {mixed_precision!r}")
    if get_fsdp(strategy).shard_over == "node" and (node_size > nproc or nproc % node_size):
        raise CourseInputError(
            f"{strategy} needs --node-size dividing --nproc: {nproc} ranks do not split into "
            f"nodes of {node_size}; pick a node size such as {math.gcd(nproc, 8)}"
        )


def apply_options(strategy, mixed_precision: str = "bf16", node_size: int = 8, *, act_ckpt: bool = False, device=None):
    """What the rehearsal hands a strategy's apply function: bf16 compute (fp32 reduce, fp32 shards) or fp32,
    activation checkpointing, the FSDP knobs at their defaults (``fully_shard`` per block) (notebook 05b)."""
    from ..apply import ApplyOptions, check_knobs

    return ApplyOptions(
        device=device,
        precision="mixed" if mixed_precision == "bf16" else "fp32",
        reshard_after_forward=strategy.reshard_after_forward,
        fsdp1=strategy.fsdp1,
        shard_over=strategy.shard_over,
        knobs=check_knobs(strategy, {}, node_size),
        act_ckpt=act_ckpt,
    )


def make_optimizer(model):
    """AdamW over the (sharded) parameters, fused, one parameter group per block (notebook 05b).

    Not the course's Adam (``loop.optimizer_factory``): the optimizer a GPU run uses, which is what the
    rehearsal prices.
    Fused: one kernel per group and no per-tensor temporaries (what GPU runs use). One group per
    block rather than one for the model changes nothing in the update or the bytes; it keeps the
    rehearsal fast, because DTensor's sharding propagation for a fused call over n tensors costs
    about n² on the CPU.
    """
    import torch

    groups, seen = [], set()
    for module in list(model.blocks) + [model]:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            groups.append({"params": params})
    return torch.optim.AdamW(groups, lr=1e-4, fused=True)


# ---------------------------------------------------------------------------------------------
# The rehearsal
# ---------------------------------------------------------------------------------------------


@dataclass
class Rehearsal:
    """What one rehearsal measured, bytes per rank (notebook 05b).

    - ``peak``: the tracker's categories at the moment of the peak; they sum to ``peak_bytes``.
    - ``category_peaks``: each category's own largest value in the step (from the tracker's
      snapshots around every FSDP module's forward and backward); these do not add up.
    - ``after_backward``, ``after_step``: the categories when backward has finished (every
      gradient reduced) and after the optimizer step: the model state at rest.
    """

    cfg: GPTConfig
    nproc: int
    strategy: str
    node_size: int
    micro_batch: int
    act_ckpt: bool
    mixed_precision: str
    psi: int
    peak_bytes: int
    peak: dict
    category_peaks: dict
    after_backward: dict
    after_step: dict
    wall_s: float
    torch_version: str
    label: str = ""
    recompute: str = "none"  # the planner's policy: "none", "full", "selective", "every:K"
    peak_at: str = ""  # where the tracker saw the peak: "forward of GPT.blocks.3", "backward of GPT"...

    @property
    def nd(self) -> int:
        """Nd of the sharded state (the shard group's size)."""
        return shard_group_size(self.strategy, self.nproc, self.node_size)

    @property
    def stage(self) -> str:
        return get_fsdp(self.strategy).zero_row_at_peak

    def parts(self, which: str = "peak") -> dict:
        """``{part: bytes}`` for the course's bill parts (``PARTS``) of ``peak``/``after_step``..."""
        cats = getattr(self, which)
        return {part: sum(cats.get(c, 0) for c in members) for part, members in PARTS.items()}

    def to_dict(self) -> dict:
        out = asdict(self)
        out["cfg"] = self.cfg.to_dict()
        out["nd"], out["stage"] = self.nd, self.stage
        return out


def rehearse(
    model: str | GPTConfig = "6.7B",
    nproc: int = 8,
    strategy: str = FULL_SHARD.name,
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    act_ckpt: bool = False,
    mixed_precision: str = "bf16",
    label: str = "",
    stock_tracker: bool = False,
    recompute: str = "none",
) -> Rehearsal:
    """One optimizer step of ``model`` under FSDP2 on ``nproc`` fake ranks, tracked (notebook 05b).

    Args:
        model: a preset ("1.56B", "6.7B", "8B", "13B", "70B"), a course model name or a ``GPTConfig``.
        nproc: N, the world size rehearsed (1 to 1024).
        strategy: "no_shard", "shard_grad_op", "full_shard" or "hybrid_shard".
        node_size: ranks per node: the shard group of hybrid_shard.
        micro_batch: sequences per rank per step (each ``cfg.seq`` tokens).
        act_ckpt: activation checkpointing on every block (torch's composable ``checkpoint``).
        recompute: a recomputation policy of the planner ("none", "full", "selective", "every:K"),
            applied with ``checkpoint_wrapper`` (``rehearse.recompute``); not with ``act_ckpt``.
        mixed_precision: "bf16" (bf16 compute, fp32 reduce, fp32 shards) or "fp32".
        stock_tracker: use torch's ``FSDPMemTracker`` as it is rather than ``tracker_class()``
            (same numbers, slower; for checking).

    Runs in this process on the CPU and allocates no tensor memory. It joins (and leaves) a
    fake process group, so it refuses to run inside a process that already has one.
    """
    cfg = model_config(model)
    check_setting(nproc, strategy, node_size, micro_batch, mixed_precision)
    recompute = check_policy(recompute)
    if act_ckpt and recompute != "none":
        raise CourseInputError("act_ckpt is full recomputation already; give act_ckpt or recompute, not both")
    require_tracker()
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..loop import device_mesh, one_process
    from ..models import GPT

    if dist.is_initialized():
        raise CourseInputError(
            "this process already belongs to a process group; rehearse in a fresh process "
            "(a notebook kernel, or python -m course_utils rehearse), not inside a worker"
        )
    start = time.perf_counter()
    row = get_fsdp(strategy)
    dist.init_process_group("fake", rank=0, world_size=nproc, store=FakeStore())
    try:
        info = replace(one_process(), world_size=nproc)  # rank 0 of nproc fake ranks
        mesh = device_mesh(row, info, node_size)  # outside FakeTensorMode: the mesh is real
        with torch.device("meta"):
            net = GPT(cfg)
        psi = sum(p.numel() for p in net.parameters())
        wrap_blocks(net, recompute)
        net = row.apply(net, mesh, apply_options(row, mixed_precision, node_size, act_ckpt=act_ckpt))
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
            warnings.simplefilter("ignore")  # FakeTensor's data_ptr and checkpoint notices
            net.to_empty(device="cpu")  # meta -> fake: shapes, no storage
            step = tracked_step(net, make_optimizer(net), cfg, info, micro_batch, stock_tracker=stock_tracker)
    finally:
        dist.destroy_process_group()
    after_backward, after_step, peak, category_peaks = (step[k] for k in TRACKED)
    return Rehearsal(
        cfg=cfg,
        nproc=nproc,
        strategy=strategy,
        node_size=node_size,
        micro_batch=micro_batch,
        act_ckpt=act_ckpt,
        mixed_precision=mixed_precision,
        psi=int(psi),
        peak_bytes=int(sum(peak.values())),
        peak=peak,
        category_peaks=category_peaks,
        after_backward=after_backward,
        after_step=after_step,
        wall_s=time.perf_counter() - start,
        torch_version=torch.__version__,
        label=label or _default_label(strategy, act_ckpt, recompute),
        recompute="full" if act_ckpt else recompute,
        peak_at=step.get("peak_at", ""),
    )


#: What ``tracked_step`` returns: the tracker's categories after the backward, after the step, at the peak, and
#: each category's own largest value.
TRACKED = ("after_backward", "after_step", "peak", "category_peaks")


def tracked_step(net, opt, cfg, info, micro_batch: int, *, observers=(), data=None, stock_tracker: bool = False):
    """One steady-state step of ``net`` through the one loop, watched by the tracker: ``{name: {category: bytes}}``
    for the names of ``TRACKED`` (notebook 05b). The rehearsal runs it on fake tensors and ranks, the bridge
    (``labs.lab05b``) on real gloo ranks: one measurement, two worlds.

    Adam gets its state first (zero gradients, one step), as a real run has it from step 2 on. ``data``: the
    loop's batches (``run_steps``); by default ``micro_batch`` random sequences of ``cfg.seq`` tokens, which
    the tracker counts as inputs. ``observers`` watch the same step.
    """
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from ..loop import Prepared, TrainConfig, run_steps

    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = (FSDPMemTracker if stock_tracker else tracker_class())(net, opt)
    if data is None:
        idx, tgt = (torch.randint(0, cfg.vocab, (micro_batch, cfg.seq)) for _ in range(2))
        tracker.track_inputs((idx, tgt))
        data = lambda step, rank, world: (idx, tgt)  # noqa: E731 (the tokens the tracker counts as inputs)
    watch = TrackedStep(tracker)
    prepared = Prepared(model=net, optimizer=opt, full_state_dict=dict, held=lambda: ((), (), ()))
    run = TrainConfig(model=cfg, batch=micro_batch * info.world_size)
    run_steps(prepared, run, info, range(1), [watch, *observers], data=data)  # the one loop
    peak = _categories(tracker.get_tracker_snapshot("peak"))
    parts = (watch.after_backward_parts, watch.after_step_parts, peak, _category_peaks(tracker, peak))
    return {**dict(zip(TRACKED, parts)), "peak_at": getattr(tracker, "peak_at", "")}  # not the stock tracker's


def _default_label(strategy: str, act_ckpt: bool, recompute: str = "none") -> str:
    extra = " + act. ckpt" if act_ckpt else ("" if recompute == "none" else f" + {recompute} recomputation")
    return get_fsdp(strategy).fsdp1_name + extra


def parse_setting(text: str) -> dict:
    """ "full_shard", "shard_grad_op+ckpt", "full_shard+selective", "full_shard+every4"...: a strategy, then
    "+ckpt" for activation checkpointing, or a recomputation policy ("+full", "+selective", "+everyK")
    (notebook 05b)."""
    name, _, extra = str(text).strip().partition("+")
    policy = "every:" + extra[5:] if extra.startswith("every") else extra
    known = extra in ("", "ckpt") or (policy in ("full", "selective") or policy.startswith("every:"))
    if name not in FSDP_STRATEGIES or not known or (policy.startswith("every:") and not policy[6:].isdigit()):
        raise CourseInputError(
            f"cannot read setting {text!r}; write a strategy ({', '.join(FSDP_STRATEGIES)}), optionally followed "
            "by +ckpt or a recomputation policy (+full, +selective, +every4), e.g. 'full_shard+selective'"
        )
    recompute = "none" if extra in ("", "ckpt") else policy
    return {"strategy": name, "act_ckpt": extra == "ckpt", "recompute": recompute}


def rehearse_settings(
    model: str | GPTConfig,
    nproc: int,
    settings,
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    mixed_precision: str = "bf16",
) -> list[Rehearsal]:
    """One rehearsal per setting ("full_shard", "full_shard+ckpt", ...), in order (notebook 05b).

    Every setting is read and checked before the first rehearsal starts.
    """
    parsed = [parse_setting(t) for t in settings]
    for s in parsed:
        check_setting(nproc, s["strategy"], node_size, micro_batch, mixed_precision)
    return [
        rehearse(
            model,
            nproc,
            s["strategy"],
            node_size=node_size,
            micro_batch=micro_batch,
            act_ckpt=s["act_ckpt"],
            mixed_precision=mixed_precision,
            recompute=s["recompute"],
        )
        for s in parsed
    ]


def start_rehearsals(
    model: str | GPTConfig,
    nproc: int,
    settings,
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    mixed_precision: str = "bf16",
):
    """``rehearse_settings`` in a second process, started now; ``.result()`` gives its list (notebook 05b).

    A rehearsal is one busy CPU core; a long one (the 70B: 80 blocks) runs on the machine's other
    core while the notebook goes on (``launch.Background``). Settings are checked here, before
    anything starts.
    """
    from ..launch import Background

    model_config(model)
    for s in (parse_setting(t) for t in settings):
        check_setting(nproc, s["strategy"], node_size, micro_batch, mixed_precision)
    return Background(
        rehearse_settings,
        model,
        nproc,
        list(settings),
        node_size=node_size,
        micro_batch=micro_batch,
        mixed_precision=mixed_precision,
    )


def padded_shard_numel(cfg: GPTConfig, nd: int) -> int:
    """Elements of one rank's parameter shards, FSDP2's padding included (notebook 05b).

    FSDP2 splits each parameter along dim 0 into Nd equal chunks, padding dim 0 up to a
    multiple of Nd; so a rank holds Σ ceil(d0/Nd)·(numel/d0) elements, between Ψ/Nd and
    Ψ/Nd + (padding). Tied weights count once.
    """
    return sum(math.ceil(shape[0] / nd) * math.prod(shape[1:]) for shape in _param_shapes(cfg))


def gathered_unit_bytes(cfg: GPTConfig, nd: int, nbytes: int = 2) -> dict:
    """Bytes of the root unit's and of one block's gathered parameters, ``nbytes`` per element (bf16: 2), FSDP2's
    padding included: each parameter padded along dim 0 to a multiple of Nd, as the all-gather output holds it
    (GPT-2 XL's 50,257-row vocabulary becomes 50,264 rows on 8 ranks) (notebook 05b). Tied weights count once."""
    import torch

    from ..models import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    in_blocks = {id(p) for p in model.blocks.parameters()}

    def padded(p) -> int:
        return math.ceil(p.shape[0] / nd) * nd * math.prod(p.shape[1:])

    root = sum(padded(p) for p in model.parameters() if id(p) not in in_blocks)
    return {"root": nbytes * root, "block": nbytes * sum(padded(p) for p in model.blocks[0].parameters())}


def short_size(psi: float) -> str:
    """Ψ as people say it: a preset's name when Ψ is that preset's (6.7B, 70B), else 1.6B, 65B (notebook 05b)."""
    named = next((name for name, p in PRESETS.items() if p.released == psi), None)
    return named or (f"{psi / 1e9:.2g}B" if psi >= 1e9 else fmt_count(round(psi, -3)))


def short_label(r: Rehearsal) -> str:
    """ "6.7B/8 FS+ckpt", "6.7B/8 FS+every4": model, ranks, strategy and recomputation, for crowded charts (notebook
    05b)."""
    policy = "" if r.recompute == "none" else "+" + r.recompute.replace(":", "")
    return f"{short_size(r.psi)}/{r.nproc} {get_fsdp(r.strategy).abbrev}" + ("+ckpt" if r.act_ckpt else policy)
