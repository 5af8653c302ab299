"""Dress rehearsal: a real-size FSDP2 step on fake tensors, peak memory per GPU (introduced in notebook 05b).

The formulas of notebook 01 answer "will my 7B fit on 8 GPUs?" on paper. PyTorch can answer
with the library people train with: ``fully_shard`` (FSDP2) applied to the real-size model
under ``FakeTensorMode`` (tensors with shapes, dtypes and devices but no storage), joined to
the ``"fake"`` process group at the target world size (collectives that move nothing), and
watched by ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which sorts every
byte a rank would hold into categories. One optimizer step of a 7B model on 8 ranks takes
seconds on a laptop CPU and allocates nothing real.

What one rehearsal does (``rehearse``), the same for every strategy:

1. build the course model (``models.GPT``) at the preset's shape on the meta device;
2. wrap it the way the course wraps it (``fsdp.shard_model``, the function notebook 04 teaches):
   ``fully_shard`` on every block, then
   on the root, on a CPU ``DeviceMesh`` of the strategy's shape, bf16 compute with fp32 reduce;
3. materialise it as fake tensors, build fused AdamW and give it its state (a real run has it
   from step 2 on), so the tracked step is a steady-state step;
4. one tracked step (forward, backward, optimizer step) of ``micro_batch`` sequences of
   ``seq`` tokens on rank 0; the tracker gives the peak and what held it, by category.

FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD are FSDP1's names; in FSDP2 they are a
mesh shape and ``reshard_after_forward``, read from the strategy record (``course_utils.strategies``):

==============  ==========================  =====================  ==========
strategy        mesh                        reshard_after_forward  ZeRO row
==============  ==========================  =====================  ==========
full_shard      (N,)                        True                   zero3
shard_grad_op   (N,)                        False                  zero2 (*)
no_shard        (N, 1) replicate x shard    False                  ddp
hybrid_shard    (N/node, node)              True                   zero3 in a node
==============  ==========================  =====================  ==========

(*) FSDP2 keeps the fp32 parameters sharded at rest even here; what SHARD_GRAD_OP keeps
unsharded, between forward and backward, is the bf16 working copy: the 2Ψ of ZeRO stage 2.

The tracker runs as ``tracker_class()``: torch's ``FSDPMemTracker`` with its per-operation
peak bookkeeping done for the active modules only (same records, half the time; a test holds
it against the stock class).

The tracker is a private torch API (``torch.distributed._tools``): ``tracker_problem()``
feature-detects it, and ``rehearse`` raises ``CourseInputError`` with one line where it is
missing. The course pins torch (constraints.txt, ``PINNED_TORCH``) to the version checked here.

``labs.lab05b.bridge`` holds the rehearsal against a real run: the same wrapping on 2 or 4 gloo ranks of
the tiny course model, bytes counted on the real shards with ``instrument.tensor_bytes``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, replace

from . import memory
from .compat import TESTED_TORCH
from .errors import CourseInputError
from .models import GPTConfig, get_config
from .strategies import FSDP_STRATEGIES, get_fsdp, mesh_shape, shard_group_size
from .units import GB, MB, GiB, fmt_count
from .validate import not_empty

#: The torch version the set-up installs (constraints.txt) and the tracker was checked against.
PINNED_TORCH = TESTED_TORCH  # one place: course_utils.compat

PRECISIONS = ("bf16", "fp32")
MAX_NPROC = 1024

#: The tracker's categories (``_FSDPRefType`` values), in the order they are drawn.
CATEGORIES = (
    "Sharded Param",
    "OptState",
    "Sharded Grad",
    "Unsharded Param",
    "Unsharded Grad",
    "All Gather",
    "Reduce Scatter",
    "Activation",
    "Temp",
    "Inputs",
    "Buffer",
)

#: The tracker's categories gathered into the parts of the course's bill (notebook 05b).
PARTS = {
    "fp32 parameter shards": ("Sharded Param",),
    "optimizer state": ("OptState",),
    "gradients": ("Sharded Grad", "Unsharded Grad"),
    "16-bit weights being computed": ("Unsharded Param",),
    "communication buffers": ("All Gather", "Reduce Scatter"),
    "activations and temporaries": ("Activation", "Temp", "Inputs", "Buffer"),
}
PART_COLORS = {
    "fp32 parameter shards": "#7b5ea7",
    "optimizer state": "#3a7dc9",
    "gradients": "#e8883a",
    "16-bit weights being computed": "#c9b3e6",
    "communication buffers": "#9a9a9a",
    "activations and temporaries": "#5aa469",
}


# ---------------------------------------------------------------------------------------------
# Presets: published shapes, built as the course model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A published model shape, built as the course model (notebook 05b).

    A preset's name is its parameter count, within 1% (``tests/test_rehearse.py`` counts Ψ on a
    meta-device model): "70B" here means what notebook 05's planner means by 70e9. The Llama shapes
    are built with the course model's Llama block (``GPTConfig(arch="llama")``: RMSNorm, rotary
    positions, grouped-query attention, SwiGLU, no biases, untied head), so Ψ is the released
    checkpoint's to the parameter; GPT-2 XL is the course model's own GPT-2 block.
    """

    name: str
    cfg: GPTConfig
    released: int  # parameters of the released checkpoint
    source: str

    @property
    def shape(self) -> str:
        """The shape in one line: what notebook 05b prints before rehearsing it."""
        c = self.cfg
        attn = f"{c.heads} heads" + (
            f", {c.n_kv_heads} KV heads (grouped-query)" if c.n_kv_heads != c.heads else " (multi-head)"
        )
        mlp = f"SwiGLU {c.hidden}" if c.arch == "llama" else f"GELU {c.hidden}"
        return (
            f"{self.name}: L = {c.layers}, h = {c.width}, {attn}, MLP {mlp}, vocabulary {c.vocab:,}, "
            f"sequence {c.seq:,}, {'tied' if c.tie_weights else 'untied'} head"
        )


_LLAMA = dict(arch="llama", tie_weights=False)

#: Presets by name; each name is Ψ within 1%. Shapes from the released configs (config.json / params.json).
PRESETS: dict[str, Preset] = {
    "1.56B": Preset(
        "GPT-2 XL",
        GPTConfig(vocab=50257, seq=1024, layers=48, width=1600, heads=25, mlp_ratio=4, tie_weights=True),
        1_557_611_200,
        "Radford et al. 2019, 'Language Models are Unsupervised Multitask Learners', Table 2 (48 layers, "
        "d_model 1600; the table calls it 1542M) and the released gpt2-xl config (25 heads, vocabulary 50,257, "
        "context 1024, tied head); the course model's own GPT-2 block",
    ),
    "6.7B": Preset(
        "Llama 2 7B",
        GPTConfig(vocab=32000, seq=4096, layers=32, width=4096, heads=32, mlp_hidden=11008, **_LLAMA),
        6_738_415_616,
        "Touvron et al. 2023, 'Llama 2' (arXiv:2307.09288), Table 1 (context 4096) and the released config "
        "(hidden 4096, 32 layers, 32 heads and 32 KV heads, intermediate 11008, vocabulary 32000); "
        "the LLaMA paper (arXiv:2302.13971, Table 2) lists this shape as 6.7B",
    ),
    "8B": Preset(
        "Llama 3 8B",
        GPTConfig(
            vocab=128256,
            seq=8192,
            layers=32,
            width=4096,
            heads=32,
            kv_heads=8,
            mlp_hidden=14336,
            rope_theta=500000.0,
            **_LLAMA,
        ),
        8_030_261_248,
        "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), Table 3, and the released "
        "Meta-Llama-3-8B config (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, "
        "vocabulary 128,256, pre-trained at 8192 tokens)",
    ),
    "13B": Preset(
        "Llama 2 13B",
        GPTConfig(vocab=32000, seq=4096, layers=40, width=5120, heads=40, mlp_hidden=13824, **_LLAMA),
        13_015_864_320,
        "Touvron et al. 2023, 'Llama 2' (arXiv:2307.09288), Table 1 and the released config (hidden 5120, "
        "40 layers, 40 heads and 40 KV heads, intermediate 13824, vocabulary 32000, context 4096)",
    ),
    "70B": Preset(
        "Llama 3 70B",
        GPTConfig(
            vocab=128256,
            seq=8192,
            layers=80,
            width=8192,
            heads=64,
            kv_heads=8,
            mlp_hidden=28672,
            rope_theta=500000.0,
            **_LLAMA,
        ),
        70_553_706_496,
        "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), Table 3, and the released "
        "Meta-Llama-3-70B config (hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate 28672, "
        "vocabulary 128,256, pre-trained at 8192 tokens). Llama 2 70B has the same block but a 32,000-token "
        "vocabulary: 68,976,648,192 parameters, 1.5% short of its name",
    ),
}

#: Other spellings accepted for the presets (each names the same model, never a rounder size).
ALIASES = {
    "gpt2-xl": "1.56B",
    "1.56b": "1.56B",
    "6.7b": "6.7B",
    "llama-2-7b": "6.7B",
    "llama2-7b": "6.7B",
    "8b": "8B",
    "llama-3-8b": "8B",
    "llama3-8b": "8B",
    "13b": "13B",
    "llama-2-13b": "13B",
    "llama2-13b": "13B",
    "70b": "70B",
    "llama-3-70b": "70B",
    "llama3-70b": "70B",
}

#: Names people use for a model whose count is not within 1% of them: said in the error, not guessed.
NOT_THEIR_SIZE = {
    "7b": "Llama 2 7B has 6.74B parameters: ask for '6.7B' (or '8B', Llama 3 8B)",
    "1.5b": "GPT-2 XL has 1.56B parameters: ask for '1.56B'",
}


def preset(name: str) -> Preset:
    """The ``Preset`` called ``name`` ("1.56B", "6.7B", "8B", "13B", "70B" or an alias) (notebook 05b)."""
    key = name if name in PRESETS else ALIASES.get(str(name).strip().lower())
    if key is None:
        why = NOT_THEIR_SIZE.get(str(name).strip().lower())
        raise CourseInputError(
            f"unknown preset {name!r}"
            + (f" ({why})" if why else "")
            + f"; choose one of {', '.join(PRESETS)} (a preset's name is its parameter count) "
            "or give --layers --width --heads --vocab --seq"
        )
    return PRESETS[key]


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

    from .models import GPT

    with torch.device("meta"):
        return tuple(tuple(p.shape) for p in GPT(cfg).parameters())


def param_count(cfg: GPTConfig) -> int:
    """Ψ of the course model at ``cfg``, counted on the meta device (no memory) (notebook 05b)."""
    return sum(math.prod(shape) for shape in _param_shapes(cfg))


def param_tensor_count(cfg: GPTConfig) -> int:
    """Distinct parameter tensors of the course model at ``cfg`` (Adam keeps one step counter each) (notebook 05b)."""
    return len(_param_shapes(cfg))


# ---------------------------------------------------------------------------------------------
# Feature detection: the tracker is a private API
# ---------------------------------------------------------------------------------------------


def tracker_problem() -> str | None:
    """None when this torch can rehearse; else one sentence saying what is missing (notebook 05b)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the package needs torch anyway
        return "torch is not installed; run `make setup`"
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return f"this torch build ({torch.__version__}) has no torch.distributed"
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
        from torch.distributed._composable import checkpoint  # noqa: F401
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as exc:  # ImportError, AttributeError, or a registration error
        return (
            f"torch {torch.__version__} lacks the FSDP2 memory tracker or the fake process group "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the course "
            f"pins torch {PINNED_TORCH} (run `make setup`)"
        )
    return None


def require_tracker() -> None:
    """Raise ``CourseInputError`` (one line) unless ``tracker_problem()`` is None (notebook 05b)."""
    problem = tracker_problem()
    if problem:
        raise CourseInputError(f"cannot rehearse: {problem}")


# ---------------------------------------------------------------------------------------------
# The wrapping, shared by the rehearsal (fake) and the real run (gloo)
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
    if strategy == "hybrid_shard" and (node_size > nproc or nproc % node_size):
        raise CourseInputError(
            f"hybrid_shard needs --node-size dividing --nproc: {nproc} ranks do not split into "
            f"nodes of {node_size}; pick a node size such as {math.gcd(nproc, 8)}"
        )


def make_mesh(strategy: str, nproc: int, node_size: int = 8, device_type: str = "cpu"):
    """A DeviceMesh for ``strategy`` over the current process group (notebook 05b).

    "cpu" for the rehearsal (fake ranks) and gloo ranks; a run on GPUs (NCCL) passes "cuda".
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = mesh_shape(strategy, nproc, node_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mixed_precision_policy(mixed_precision: str):
    """bf16: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, the parameters
    stay fp32 in their shards; fp32: the default policy (notebook 05b)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def make_optimizer(model):
    """AdamW over the (sharded) parameters, fused, one parameter group per block (notebook 05b).

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


def tracker_class():
    """``FSDPMemTracker`` with its per-operation peak bookkeeping made cheaper (notebook 05b).

    After every operation the tracker updates the running peak of each module that is active
    (``MemTracker._update_peak_stats``). torch does it by scanning every tracked module and
    deep-copying the snapshot; on a 48-block model that loop is a quarter of the rehearsal's
    time. This subclass does the same updates visiting only the active modules and copying
    the flat ``{category: bytes}`` dicts shallowly; what it records is identical
    (``tests/test_rehearse.py`` checks it against the stock tracker).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Tracker(FSDPMemTracker):
        _index_size = -1
        _index: dict = {}

        def _update_peak_stats(self, peak_state) -> None:
            curr = self._curr_mem_snap
            if self._index_size != len(self.memory_tracking):
                index: dict = {}
                for stats in self.memory_tracking.values():
                    index.setdefault(stats.mod_fqn, []).append(stats)
                self._index, self._index_size = index, len(self.memory_tracking)
            for fqn in self._mod_tracker.parents:
                for stats in self._index.get(fqn, ()):
                    if peak_state in stats.snapshots:
                        for dev, dev_snap in curr.items():
                            if stats.local_peak.get(dev, 0) < dev_snap["Total"]:
                                stats.local_peak[dev] = dev_snap["Total"]
                                stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
            for dev, dev_snap in curr.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return Tracker


def _categories(snapshot: dict) -> dict:
    """``{category: bytes}`` for the (single) CPU device of a tracker snapshot."""
    out = {c: 0 for c in CATEGORIES}
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            if name != "Total":
                out[name] = out.get(name, 0) + int(value)
    return out


def _category_peaks(tracker, peak: dict) -> dict:
    out = dict(peak)
    for stats in tracker.memory_tracking.values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for name, value in _categories(snap).items():
                    out[name] = max(out.get(name, 0), value)
    return out


def rehearse(
    model: str | GPTConfig = "6.7B",
    nproc: int = 8,
    strategy: str = "full_shard",
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    act_ckpt: bool = False,
    mixed_precision: str = "bf16",
    label: str = "",
    stock_tracker: bool = False,
) -> Rehearsal:
    """One optimizer step of ``model`` under FSDP2 on ``nproc`` fake ranks, tracked (notebook 05b).

    Args:
        model: a preset ("1.56B", "6.7B", "8B", "13B", "70B"), a course model name or a ``GPTConfig``.
        nproc: N, the world size rehearsed (1 to 1024).
        strategy: "no_shard", "shard_grad_op", "full_shard" or "hybrid_shard".
        node_size: ranks per node: the shard group of hybrid_shard.
        micro_batch: sequences per rank per step (each ``cfg.seq`` tokens).
        act_ckpt: activation checkpointing on every block.
        mixed_precision: "bf16" (bf16 compute, fp32 reduce, fp32 shards) or "fp32".
        stock_tracker: use torch's ``FSDPMemTracker`` as it is rather than ``tracker_class()``
            (same numbers, slower; for checking).

    Runs in this process on the CPU and allocates no tensor memory. It joins (and leaves) a
    fake process group, so it refuses to run inside a process that already has one.
    """
    cfg = model_config(model)
    check_setting(nproc, strategy, node_size, micro_batch, mixed_precision)
    require_tracker()
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .fsdp import shard_model
    from .models import GPT

    if dist.is_initialized():
        raise CourseInputError(
            "this process already belongs to a process group; rehearse in a fresh process "
            "(a notebook kernel, or python -m course_utils rehearse), not inside a worker"
        )
    start = time.perf_counter()
    dist.init_process_group("fake", rank=0, world_size=nproc, store=FakeStore())
    try:
        mesh = make_mesh(strategy, nproc, node_size)  # outside FakeTensorMode: the mesh is real
        with torch.device("meta"):
            net = GPT(cfg)
        psi = sum(p.numel() for p in net.parameters())
        shard_model(
            net,
            mesh,
            reshard_after_forward=get_fsdp(strategy).reshard_after_forward,
            mp_policy=mixed_precision_policy(mixed_precision),
            act_ckpt=act_ckpt,
        )
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
            warnings.simplefilter("ignore")  # FakeTensor's data_ptr and checkpoint notices
            net.to_empty(device="cpu")  # meta -> fake: shapes, no storage
            opt = make_optimizer(net)
            for p in net.parameters():  # give Adam its state, as a real run has from step 2 on
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            idx = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq))
            tgt = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq))
            tracker = (FSDPMemTracker if stock_tracker else tracker_class())(net, opt)
            tracker.track_inputs((idx, tgt))
            with tracker:
                loss = net(idx, tgt)
                loss.backward()
                after_backward = _categories(tracker.get_tracker_snapshot("current"))
                opt.step()
                after_step = _categories(tracker.get_tracker_snapshot("current"))
                opt.zero_grad(set_to_none=True)
            peak = _categories(tracker.get_tracker_snapshot("peak"))
            category_peaks = _category_peaks(tracker, peak)
    finally:
        dist.destroy_process_group()
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
        label=label or _default_label(strategy, act_ckpt),
    )


def _default_label(strategy: str, act_ckpt: bool) -> str:
    return get_fsdp(strategy).fsdp1_name + (" + act. ckpt" if act_ckpt else "")


def parse_setting(text: str) -> dict:
    """ "full_shard", "shard_grad_op+ckpt"...: a strategy, "+ckpt" for activation checkpointing (notebook 05b)."""
    name, _, extra = str(text).strip().partition("+")
    if name not in FSDP_STRATEGIES or extra not in ("", "ckpt"):
        raise CourseInputError(
            f"cannot read setting {text!r}; write a strategy ({', '.join(FSDP_STRATEGIES)}), "
            "optionally followed by +ckpt, e.g. 'full_shard+ckpt'"
        )
    return {"strategy": name, "act_ckpt": extra == "ckpt"}


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
    from .launch import Background

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


# ---------------------------------------------------------------------------------------------
# The formulas' side: what memory.py predicts for the same setting, item by item
# ---------------------------------------------------------------------------------------------


def optimizer_bill_for(mixed_precision: str) -> memory.OptimizerBill:
    """bf16 -> mixed-precision Adam (2 + 2 + 12); fp32 -> plain fp32 Adam (4 + 4 + 8) (notebook 05b)."""
    return memory.optimizer_bill("adam_mixed" if mixed_precision == "bf16" else "adam_fp32")


#: Numbers per token per unit of width one GPT-2 course block saves for backward (16-bit), counted
#: with saved-tensor hooks on a real block (``tests/test_rehearse.py``); the paper's rule says 12.
BLOCK_SAVED_PER_TOKEN_WIDTH = 16


def predict(r: Rehearsal) -> dict:
    """The planner's bytes per rank for a rehearsal's setting, item by item (notebook 05b).

    See ``predict_setting``; this reads the setting from ``r``.
    """
    return _predict(r.cfg, r.psi, r.nproc, r.strategy, r.node_size, r.micro_batch, r.act_ckpt, r.mixed_precision)


def predict_setting(
    model: str | GPTConfig = "6.7B",
    nproc: int = 8,
    strategy: str = "full_shard",
    *,
    node_size: int = 8,
    micro_batch: int = 1,
    act_ckpt: bool = False,
    mixed_precision: str = "bf16",
) -> dict:
    """The planner's bytes per rank before any rehearsal: the "predict" of predict-then-run (notebook 05b).

    ``plan.memory_breakdown`` for the same model, GPUs, strategy, micro-batch and checkpointing:
    model states by the ZeRO row (``memory.model_state_bytes``, Nd = the shard group),
    activations by the paper's rule (12·h·b·s·L numbers of 2 bytes), buffers (two 25 MB
    buckets, or for stage 3 the gathered block twice plus its 16-bit gradient). The planner
    assumes mixed precision; for fp32 the items are rescaled to 4-byte weights, gradients,
    activations and gathers, and K = 8 (plain fp32 Adam). Returns ``{"weights", "gradients",
    "optimizer", "model_states", "activations", "buffers", "total", "stage", "nd", "psi"}``.
    """
    cfg = model_config(model)
    check_setting(nproc, strategy, node_size, micro_batch, mixed_precision)
    return _predict(cfg, param_count(cfg), nproc, strategy, node_size, micro_batch, act_ckpt, mixed_precision)


def _predict(cfg, psi, nproc, strategy, node_size, micro_batch, act_ckpt, mixed_precision) -> dict:
    from . import plan

    bill = optimizer_bill_for(mixed_precision)
    stage, nd = get_fsdp(strategy).zero_row_at_peak, shard_group_size(strategy, nproc, node_size)
    spec = plan.ModelSpec(
        params=float(psi),
        layers=cfg.layers,
        width=cfg.width,
        heads=cfg.heads,
        vocab=cfg.vocab,
        seq=cfg.seq,
        micro_batch=micro_batch,
        checkpointing=act_ckpt,
    )
    if strategy == "hybrid_shard":
        cluster = plan.Cluster(gpus_per_node=node_size, nodes=nproc // node_size)
    else:
        cluster = plan.Cluster(gpus_per_node=nproc, nodes=1)
    out = dict(plan.memory_breakdown(spec, cluster, get_fsdp(strategy).plan_row, k=bill.k))
    if mixed_precision == "fp32":
        scale = bill.weight_bytes / memory.WEIGHT_BYTES
        out["weights"] *= scale
        out["gradients"] *= bill.grad_bytes / memory.GRAD_BYTES
        out["activations"] *= scale
        if stage == "zero3":
            out["buffers"] *= scale
    out["model_states"] = out["weights"] + out["gradients"] + out["optimizer"]
    check = memory.model_state_bytes(
        psi, nd, stage, k=bill.k, weight_bytes=bill.weight_bytes, grad_bytes=bill.grad_bytes
    )
    assert math.isclose(out["model_states"], check, rel_tol=1e-9), (out["model_states"], check)
    out["total"] = out["model_states"] + out["activations"] + out["buffers"]
    out["stage"], out["nd"], out["psi"] = stage, nd, int(psi)
    return out


#: Model states: the formula (with FSDP2's padding counted, ``padded_shard_numel``) and the
#: tracker agree to this relative tolerance. The only difference left is Adam's 4-byte step
#: counter per tensor: ~1e-8 of a 6.7B's states, 2.4e-4 of the 867k-parameter "small" model's.
MODEL_STATE_TOL = 1e-3
#: The peak: the planner within this fraction of the tracker, for full-depth models (at least
#: ``PEAK_MIN_LAYERS`` blocks) whose rule-based activations are at most ``PEAK_MAX_ACT_SHARE`` of
#: the planner's total. Why so narrow a claim: the planner's activation rule counts 12 numbers per
#: token per unit of width per block (a GPT-2-era count); a Llama block (SwiGLU's three
#: hidden-size tensors, RMSNorm computed in fp32, rotated copies of q and k) and the fp32 logits of
#: the loss hold about 2.5 times that (notebook 05b measures it on Llama 2 7B at 4096 tokens), so an
#: activation term of 10% of the total can be 15% of it. Without checkpointing the activations are
#: a third or more of the total and the planner's peak is far low; the notebook shows by how much
#: (``peak_errors``) instead of claiming a tolerance.
PEAK_TOL = 0.15
PEAK_MAX_ACT_SHARE = 0.10
PEAK_MIN_LAYERS = 16

#: The planner's items and the tracker's parts (``PARTS``) they are held against at the peak.
PEAK_ITEMS = {
    "model states": ("fp32 parameter shards", "optimizer state", "gradients", "16-bit weights being computed"),
    "activations": ("activations and temporaries",),
    "buffers": ("communication buffers",),
}


def peak_errors(r: Rehearsal) -> dict:
    """Where the planner's peak is wrong, item by item: planner minus rehearsal at the peak, bytes (notebook 05b).

    ``{"model states", "activations", "buffers", "total"}``; positive means the planner says more
    than FSDP2 holds at the moment of the peak. Model states at the peak are the fp32 parameter
    shards, the optimizer state, the gradients held and the bf16 weights gathered at that moment
    (the planner counts 2Ψ/Nd of 16-bit weights and 2Ψ/Nd of 16-bit gradients whatever the moment).
    The items add up to the total: ``total`` = planner's peak − rehearsal's peak.
    """
    p, parts = predict(r), r.parts("peak")
    planner = {"model states": p["model_states"], "activations": p["activations"], "buffers": p["buffers"]}
    out = {item: planner[item] - sum(parts[x] for x in members) for item, members in PEAK_ITEMS.items()}
    out["total"] = p["total"] - r.peak_bytes
    return out


def agreement(r: Rehearsal) -> dict:
    """How closely the formulas match the rehearsal, as numbers a notebook can assert (notebook 05b).

    Model states are held against the formula with FSDP2's padding counted (``padded_shard_numel``:
    each tensor's dim 0 rounded up to a multiple of Nd), so the ratios are 1 up to Adam's step
    counters for any world size:

    - ``"optimizer"``: optimizer state held after the step over K·(padded Ψ/Nd); with bf16 the
      fp32 parameter shard is counted here, as the paper's master copy;
    - ``"gradients"``: gradients at the end of backward over 2·(padded Ψ/Nd), the formula's
      16-bit gradients (2.0 with bf16: FSDP2 keeps them in fp32) or over 4·(...) with fp32;
    - ``"model_states"``: everything held after the step over 16·(padded Ψ/Nd);
    - ``"planner_model_states"``: the same bytes over the planner's model-states row (16Ψ/Nd, no padding);
    - ``"padding"``: how much FSDP2's padding adds to Ψ/Nd (0 when every dim 0 divides by Nd);
    - ``"peak"``: the rehearsal's peak over the planner's total (``predict``); ``"activation_share"``:
      the planner's activations over its total; ``"peak_claim_applies"`` (``PEAK_TOL`` is claimed
      for this setting) and ``"peak_within_tol"``.
    """
    bill = optimizer_bill_for(r.mixed_precision)
    shard = padded_shard_numel(r.cfg, r.nd)
    a, b = r.after_step, r.after_backward
    mixed = r.mixed_precision == "bf16"
    p = predict(r)
    out = {
        "optimizer": ((a["Sharded Param"] if mixed else 0) + a["OptState"]) / (bill.k * shard),
        "gradients": (b["Sharded Grad"] + b["Unsharded Grad"])
        / ((memory.GRAD_BYTES if mixed else bill.grad_bytes) * shard),
        "model_states": (a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]) / (bill.total * shard),
        "planner_model_states": (a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]) / p["model_states"],
        "padding": shard * r.nd / r.psi - 1,
        "peak": r.peak_bytes / p["total"],
        "activation_share": p["activations"] / p["total"],
    }
    out["peak_claim_applies"] = r.cfg.layers >= PEAK_MIN_LAYERS and out["activation_share"] <= PEAK_MAX_ACT_SHARE
    out["peak_within_tol"] = abs(out["peak"] - 1) <= PEAK_TOL
    return out


def compare(r: Rehearsal) -> list[dict]:
    """The planner against the rehearsal, one row per item of the bill, with why they differ (notebook 05b).

    Each row: ``{"item", "formula", "rehearsal", "ratio", "when", "why"}`` (bytes per rank);
    ``ratio`` is rehearsal / formula.
    """
    p = predict(r)
    bill = optimizer_bill_for(r.mixed_precision)
    a, b, top = r.after_step, r.after_backward, r.category_peaks
    nd = f"/{r.nd}" if r.nd > 1 else ""
    mixed = r.mixed_precision == "bf16"
    rows = []

    def row(item, formula, rehearsal, when, why):
        rows.append(
            {
                "item": item,
                "formula": float(formula),
                "rehearsal": float(rehearsal),
                "ratio": (rehearsal / formula) if formula else float("nan"),
                "when": when,
                "why": why,
            }
        )

    if mixed:
        row(
            f"optimizer state, K = {bill.k:g}",
            p["optimizer"],
            a["Sharded Param"] + a["OptState"],
            "after the step",
            f"the paper's 12 bytes are an fp32 master copy, momentum and variance. FSDP2's fp32 parameter shard IS "
            f"the master copy (Sharded Param, 4Ψ{nd}); AdamW's exp_avg and exp_avg_sq are OptState (8Ψ{nd}). Only "
            "extra: padding of each tensor to a multiple of Nd rows, and Adam's 4-byte step counter per tensor",
        )
        row(
            "gradients",
            p["gradients"],
            b["Sharded Grad"] + b["Unsharded Grad"],
            "end of backward",
            "the paper counts 16-bit gradients (2 bytes). FSDP2 reduce-scatters in fp32 (reduce_dtype) and keeps "
            "each gradient shard in the parameter's dtype, fp32: 4 bytes, twice the formula"
            + ("; no_shard keeps all of them on every rank" if r.strategy == "no_shard" else ""),
        )
        if r.stage == "zero3":
            why = (
                "the paper keeps a sharded 16-bit copy (2Ψ/Nd). FSDP2 keeps none at rest: it casts a block's "
                "fp32 shards to bf16 as it gathers them, computes, and frees the block; the largest it holds is "
                "about two blocks (computing and prefetched) and the root's embeddings"
            )
        elif r.strategy == "shard_grad_op":
            why = (
                "stage 2 keeps the 16-bit weights whole (2Ψ). FSDP2's SHARD_GRAD_OP keeps each block's bf16 copy "
                "gathered from its forward until its backward: at the start of backward that is all of them"
            )
        else:
            why = "every rank computes with the whole bf16 working copy"
        row("16-bit working weights", p["weights"], top["Unsharded Param"], "largest in the step", why)
    else:
        row(
            "fp32 weights",
            p["weights"],
            a["Sharded Param"],
            "after the step",
            "plain fp32 training: the parameter shard is both the working weights and what Adam updates",
        )
        row(
            "gradients (fp32)",
            p["gradients"],
            b["Sharded Grad"] + b["Unsharded Grad"],
            "end of backward",
            "fp32 gradient shards, as the formula counts them",
        )
        row(
            f"optimizer state, K = {bill.k:g}",
            p["optimizer"],
            a["OptState"],
            "after the step",
            "AdamW's exp_avg and exp_avg_sq, plus a 4-byte step counter per tensor",
        )
    at_rest = a["Sharded Param"] + a["OptState"] + a["Sharded Grad"]
    if mixed and r.stage == "zero3":
        why = (
            "2 + 2 + 12 bytes per parameter in the paper, 4 + 4 + 8 in FSDP2 (fp32 shard, fp32 gradient, "
            "momentum and variance): the same 16 bytes when everything is sharded"
        )
    elif r.strategy == "shard_grad_op":
        why = (
            "the formula's 2Ψ of 16-bit weights is held only between forward and backward (row above); at rest "
            "FSDP2 holds 16 bytes per parameter, all sharded"
        )
    else:
        why = "16 bytes per parameter, as the formula counts them, held whole on every rank"
    row("model states at rest", p["model_states"], at_rest, "after the step", why)
    row(
        "buffers",
        p["buffers"],
        top["All Gather"] + top["Reduce Scatter"] + top["Unsharded Grad"],
        "largest in the step",
        "not in the 16-byte bill (ZeRO-R's constant buffers). The planner allows "
        + ("a gathered block twice and its 16-bit gradient" if r.stage == "zero3" else "two 25 MB gradient buckets")
        + "; FSDP2 holds an all-gather output, a reduce-scatter input (fp32) and a block's unsharded gradient",
    )
    if r.cfg.arch == "gpt2":
        kept = (
            f"this GPT-2 block keeps {BLOCK_SAVED_PER_TOKEN_WIDTH} (LayerNorm inputs 2h, the qkv input h, q k v "
            "3h, the attention output h, the MLP input h, 4h before and 4h after GELU)"
        )
    else:
        kept = (
            f"this Llama block keeps more: SwiGLU's gate, up and product ({3 * r.cfg.hidden / r.cfg.width:.1f}h "
            "of them), RMSNorm's input and output in fp32, rotated copies of q and k"
        )
    row(
        "activations",
        p["activations"],
        r.peak["Activation"] + r.peak["Temp"] + r.peak["Inputs"],
        "at the peak",
        f"the paper's rule is about 12 numbers per token per unit of width per layer, 16-bit; {kept}; the loss "
        f"keeps fp32 logits of the {r.cfg.vocab:,}-token vocabulary. Per rank; sharding never touches them"
        + ("; with checkpointing, one input per block plus one block rebuilt at a time" if r.act_ckpt else ""),
    )
    row(
        "peak per rank",
        p["total"],
        r.peak_bytes,
        "at the peak",
        "the planner's total (model states + activations + buffers) against the tracker's peak",
    )
    return rows


# ---------------------------------------------------------------------------------------------
# Views and text
# ---------------------------------------------------------------------------------------------


def short_size(psi: float) -> str:
    """Ψ as people say it: a preset's name when Ψ is that preset's (6.7B, 70B), else 1.6B, 65B (notebook 05b)."""
    named = next((name for name, p in PRESETS.items() if p.released == psi), None)
    return named or (f"{psi / 1e9:.2g}B" if psi >= 1e9 else fmt_count(round(psi, -3)))


def short_label(r: Rehearsal) -> str:
    """ "6.7B/8 FS+ckpt": model, ranks, strategy, for crowded charts (notebook 05b)."""
    return f"{short_size(r.psi)}/{r.nproc} {get_fsdp(r.strategy).abbrev}" + ("+ckpt" if r.act_ckpt else "")


UNITS = {"GB": GB, "GiB": GiB, "MB": MB}


def _fmt(n: float, unit: str) -> str:
    return f"{n / UNITS[unit]:,.2f}"


def format_table(rehearsals: list[Rehearsal], unit: str = "GB") -> str:
    """A plain-text table of peaks per rank by part, one line per rehearsal (notebook 05b)."""
    heads = ["setting", "peak"] + list(PARTS) + ["wall"]
    lines = [f"bytes per rank at the peak, {_unit_name(unit)}", " | ".join(heads)]
    for r in rehearsals:
        parts = r.parts("peak")
        lines.append(
            " | ".join(
                [r.label, _fmt(r.peak_bytes, unit)] + [_fmt(parts[p], unit) for p in PARTS] + [f"{r.wall_s:.1f} s"]
            )
        )
    return "\n".join(lines)


def format_report(r: Rehearsal, unit: str = "GB") -> str:
    """The text ``python -m course_utils rehearse`` prints (notebook 05b)."""
    c = r.cfg
    u = _unit_name(unit)
    head = (
        f"dress rehearsal: Ψ = {r.psi:,} ({short_size(r.psi)}; L={c.layers} h={c.width} heads={c.heads} "
        f"vocab={c.vocab} seq={c.seq}), {get_fsdp(r.strategy).fsdp1_name} on {r.nproc} ranks"
        + (f" (nodes of {r.node_size})" if r.strategy == "hybrid_shard" else "")
        + f", micro-batch {r.micro_batch} x {c.seq} tokens, {r.mixed_precision}"
        + (", activation checkpointing" if r.act_ckpt else "")
        + f"; torch {r.torch_version}, FSDPMemTracker on fake tensors, {r.wall_s:.1f} s"
    )
    lines = [head, "", f"peak per rank {_fmt(r.peak_bytes, unit)} {u}; what held it (largest of each in the step):"]
    for cat in CATEGORIES:
        at, most = r.peak.get(cat, 0), r.category_peaks.get(cat, 0)
        if at or most:
            lines.append(f"  {cat:<16} {_fmt(at, unit):>10}   ({_fmt(most, unit)})")
    lines += [
        "",
        f"the planner (course_utils.plan.memory_breakdown: memory.py's {r.stage} row with Nd = {r.nd}, "
        f"the paper's activation rule, buffers) against the rehearsal, {u}:",
    ]
    for row in compare(r):
        ratio = "" if math.isnan(row["ratio"]) else f"  x{row['ratio']:.2f}"
        lines.append(
            f"  {row['item']:<58} {_fmt(row['formula'], unit):>10} {_fmt(row['rehearsal'], unit):>10}"
            f"{ratio}  ({row['when']})"
        )
        lines.append(f"      {row['why']}")
    return "\n".join(lines)


def bars_view(
    rehearsals: list[Rehearsal], *, gpu_mem: float = 80 * GB, title: str = "", planned: dict | None = None
) -> dict:
    """What the stacked-bar chart draws: one bar per rehearsal, its peak by part (notebook 05b).

    ``planned``: ``{label: bytes}`` of settings not rehearsed, drawn as outlined bars of the
    planner's total beside the rehearsed ones (cheap context for a slow model).
    """
    bars = [{"label": r.label, "parts": r.parts("peak"), "peak": r.peak_bytes} for r in rehearsals]
    planned_bars = [{"label": f"{label} (planner)", "peak": float(v)} for label, v in (planned or {}).items()]
    if not title and bars:
        lo = min(bars, key=lambda b: b["peak"])
        fits = sum(b["peak"] <= gpu_mem for b in bars)
        title = (
            f"{fits} of {len(bars)} rehearsed fit {gpu_mem / GB:g} GB; lowest peak: {lo['label']}, "
            f"{lo['peak'] / GB:.1f} GB per GPU"
        )
    return {
        "bars": bars,
        "planned": planned_bars,
        "parts": list(PARTS),
        "colors": PART_COLORS,
        "gpu_mem": gpu_mem,
        "title": title,
    }


def _unit_name(unit: str) -> str:
    return f"{unit} ({ {'GB': '10^9', 'GiB': '2^30', 'MB': '10^6'}[unit] } bytes)"


def markdown_table(rehearsals: list[Rehearsal], unit: str = "GB", *, gpu_mem: float | None = None) -> str:
    """The peak per rank by part, one row per rehearsal, as a Markdown table (notebook 05b)."""
    heads = ["setting", "N", "Nd"] + list(PARTS) + ["**peak**"] + (["fits?"] if gpu_mem else []) + ["rehearsal"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rehearsals:
        parts = r.parts("peak")
        cells = [r.label, str(r.nproc), str(r.nd)] + [_fmt(parts[p], unit) for p in PARTS]
        cells.append(f"**{_fmt(r.peak_bytes, unit)}**")
        if gpu_mem:
            cells.append("yes" if r.peak_bytes <= gpu_mem else "no")
        cells.append(f"{r.wall_s:.1f} s")
        lines.append("| " + " | ".join(cells) + " |")
    psi = {short_size(r.psi) for r in rehearsals}
    return (
        f"Bytes per GPU at the peak of one training step, {_unit_name(unit)}; Ψ = {', '.join(sorted(psi))}"
        + (f"; one GPU holds {gpu_mem / GB:g} GB" if gpu_mem else "")
        + "\n\n"
        + "\n".join(lines)
    )


def markdown_compare(r: Rehearsal, unit: str = "GB") -> str:
    """``compare(r)`` as a Markdown table: item, planner, rehearsal, ratio, when, why (notebook 05b)."""
    lines = [
        f"{r.label}, {r.nproc} ranks, Ψ = {short_size(r.psi)}; bytes per GPU, {_unit_name(unit)}",
        "",
        "| item | planner | rehearsal | ratio | when | what the formula counts, what FSDP2 holds |",
        "|---|---|---|---|---|---|",
    ]
    for row in compare(r):
        ratio = "" if math.isnan(row["ratio"]) else f"{row['ratio']:.3f}"
        lines.append(
            f"| {row['item']} | {_fmt(row['formula'], unit)} | {_fmt(row['rehearsal'], unit)} | {ratio} "
            f"| {row['when']} | {row['why']} |"
        )
    return "\n".join(lines)


def summary_rows(rehearsals: list[Rehearsal]) -> list[dict]:
    """Planner against rehearsal, one row per rehearsal: what notebook 05b's summary shows (notebook 05b)."""
    rows = []
    for r in rehearsals:
        a, p = agreement(r), predict(r)
        rows.append(
            {
                "setting": f"{short_size(r.psi)} on {r.nproc}: {r.label}",
                "short": short_label(r),
                "planner": p["total"],
                "rehearsal": r.peak_bytes,
                "ratio": a["peak"],
                "model_states": a["model_states"],
                "activation_share": a["activation_share"],
                "claimed": a["peak_claim_applies"],
                "within": a["peak_within_tol"],
            }
        )
    return rows


def markdown_bridge(rows: list[dict]) -> str:
    """``labs.lab05b.bridge`` rows as a Markdown table: rehearsal bytes against every real rank's (notebook 05b)."""
    lines = [
        "Bytes one rank holds after one optimizer step of the tiny course model: the rehearsal "
        "(tracker, fake tensors) against real gloo ranks (instrument.tensor_bytes on the local shards)",
        "",
        "| ranks | strategy | | parameters | gradients | optimizer state | total | equal on every rank? |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = get_fsdp(row["strategy"]).fsdp1_name
        fake = row["rehearsal"]
        lines.append(
            f"| {row['nproc']} | {name} | rehearsal | {fake['params']:,} | {fake['grads']:,} "
            f"| {fake['optim']:,} | {fake['total']:,} | |"
        )
        real = row["real"][0]
        lines.append(
            f"| | | real, rank 0 of {len(row['real'])} | {real['params']:,} | {real['grads']:,} "
            f"| {real['optim']:,} | {real['total']:,} | {'yes' if row['equal'] else '**no**'} |"
        )
    return "\n".join(lines)


def markdown_summary(rehearsals: list[Rehearsal], unit: str = "GB") -> str:
    """``summary_rows`` as a Markdown table (notebook 05b)."""
    lines = [
        f"Peak bytes per GPU, {_unit_name(unit)}: the planner (notebook 05) against the rehearsal; model states "
        "after the step against 16 bytes per parameter of the shard (FSDP2's padding counted)",
        "",
        "| setting | planner | rehearsal | rehearsal / planner | model states at rest, rehearsal / formula "
        f"| peak within {PEAK_TOL:.0%} claimed? |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary_rows(rehearsals):
        claim = (
            ("yes: " + ("holds" if row["within"] else "FAILS"))
            if row["claimed"]
            else f"no (activations {row['activation_share']:.0%} of the planner's total)"
        )
        lines.append(
            f"| {row['setting']} | {_fmt(row['planner'], unit)} | {_fmt(row['rehearsal'], unit)} "
            f"| {row['ratio']:.3f} | {row['model_states']:.5f} | {claim} |"
        )
    return "\n".join(lines)


def rehearsal_figure(view: dict, *, width: float = 7.5, height: float = 5.0):
    """Stacked bars: one GPU's peak per setting, by part, against the GPU's memory (notebook 05b).

    ``view`` is ``bars_view(...)``. Lives here rather than in ``plots`` (whose owner is editing
    it); it uses ``plots.new_figure`` like every course chart.
    """
    from matplotlib.patches import Patch

    from .plots import new_figure

    fig = new_figure(width, height)
    ax = fig.add_subplot()
    bars = view["bars"]
    planned = view.get("planned", [])
    for j, bar in enumerate(planned):
        x = len(bars) + j
        ax.bar(x, bar["peak"] / GB, width=0.6, fill=False, edgecolor="#555555", ls="--", hatch="//", lw=1)
        ax.text(
            x, bar["peak"] / GB, f"{bar['peak'] / GB:.1f} GB", ha="center", va="bottom", fontsize=12, color="#555555"
        )
    for i, bar in enumerate(bars):
        bottom = 0.0
        for part in view["parts"]:
            value = bar["parts"][part] / GB
            if value > 0:
                ax.bar(i, value, bottom=bottom, width=0.6, color=view["colors"][part], edgecolor="white", lw=0.5)
                bottom += value
        ax.text(i, bottom, f"{bar['peak'] / GB:.1f} GB", ha="center", va="bottom", fontsize=12)
    gpu = view["gpu_mem"] / GB
    ax.axhline(gpu, color="#c0392b", ls="--", lw=1.5)
    every = bars + planned
    ax.text(-0.55, gpu, f" one {gpu:g} GB GPU", color="#c0392b", ha="left", va="bottom", fontsize=12)
    ax.set_xticks(
        range(len(every)),
        [
            b["label"]
            .replace(" + ", "\n+ ")
            .replace("_GRAD_", "_GRAD\n_")
            .replace("HYBRID_", "HYBRID\n_")
            .replace(" (planner)", "\n(planner)")
            for b in every
        ],
        fontsize=11,
    )
    ax.set_xlim(-0.6, max(len(every), 3) - 0.4)
    ax.set_ylim(0, max([b["peak"] / GB for b in every] + [gpu]) * 1.15)
    ax.set_ylabel("peak memory per GPU, GB (10⁹ bytes)", fontsize=12)
    ax.tick_params(axis="y", labelsize=11)
    used = [p for p in view["parts"] if any(b["parts"][p] > 0 for b in bars)]
    handles = [Patch(color=view["colors"][p], label=p) for p in used]
    if planned:
        handles.append(
            Patch(fill=False, edgecolor="#555555", ls="--", hatch="//", label="not rehearsed: the planner's total")
        )
    fig.legend(handles=handles, fontsize=11, loc="outside lower center", ncols=2)
    ax.set_title(view["title"], fontsize=12)
    return fig


def agreement_figure(rehearsals: list[Rehearsal], *, width: float = 7.0, height: float = 4.6):
    """The planner's peak against the rehearsal's, one point per setting, with the ±PEAK_TOL band (notebook 05b).

    Linear axes in GB from 0 (the settings span a few times, not decades), type large enough to
    read on a 1280 x 720 slide.
    """
    import numpy as np

    from .plots import new_figure

    rows = summary_rows(rehearsals)
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    xs = np.array([r["planner"] for r in rows]) / GB
    ys = np.array([r["rehearsal"] for r in rows]) / GB
    hi = max(xs.max(), ys.max()) * 1.12
    grid = np.array([0, hi])
    ax.plot(grid, grid, color="#555555", lw=1.2, label="rehearsal = planner")
    ax.fill_between(
        grid,
        grid * (1 - PEAK_TOL),
        grid * (1 + PEAK_TOL),
        color="#3a7dc9",
        alpha=0.15,
        label=f"planner ±{PEAK_TOL:.0%}",
    )
    for r, x, y in zip(rows, xs, ys):
        ax.scatter([x], [y], color="#3a7dc9" if r["claimed"] else "#e8883a", zorder=3, s=60)
        ax.annotate(r["short"], (x, y), fontsize=11, xytext=(8, -4), textcoords="offset points")
    ax.scatter([], [], color="#3a7dc9", s=60, label=f"claimed (activations ≤ {PEAK_MAX_ACT_SHARE:.0%} of the total)")
    ax.scatter([], [], color="#e8883a", s=60, label="not claimed: activations larger")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.tick_params(labelsize=12)
    ax.set_xlabel("planner's peak per GPU, GB", fontsize=13)
    ax.set_ylabel("rehearsal's peak per GPU, GB", fontsize=13)
    inside = sum(r["within"] for r in rows)
    ax.set_title(
        f"The planner is within {PEAK_TOL:.0%} of FSDP2's peak for {inside} of {len(rows)} settings", fontsize=13
    )
    ax.legend(fontsize=11, loc="upper left")
    return fig


# ---------------------------------------------------------------------------------------------
# Command line: python -m course_utils rehearse
# ---------------------------------------------------------------------------------------------


def rehearse_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m course_utils rehearse`` (notebook 05b)."""
    parser.add_argument(
        "--params",
        default=None,
        help=f"a preset: {', '.join(PRESETS)} (default 6.7B, Llama 2 7B), or a course model (tiny, small, "
        "medium); the shape flags below override its fields",
    )
    for name, what in (
        ("layers", "transformer blocks L"),
        ("width", "hidden size h"),
        ("heads", "attention heads (must divide --width)"),
        ("vocab", "vocabulary"),
        ("seq", "tokens per sequence"),
    ):
        parser.add_argument(f"--{name}", type=int, default=None, help=what)
    parser.add_argument("--nproc", type=int, default=8, help="ranks (GPUs) to rehearse, 1 to 1024 (default 8)")
    parser.add_argument(
        "--strategy", default="full_shard", choices=FSDP_STRATEGIES, help="FSDP strategy (default full_shard)"
    )
    parser.add_argument(
        "--node-size", type=int, default=8, help="ranks per node: hybrid_shard's shard group (default 8)"
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--act-ckpt", action="store_true", help="activation checkpointing on every block")
    parser.add_argument(
        "--mixed-precision",
        default="bf16",
        choices=PRECISIONS,
        help="bf16 compute with fp32 reduce and fp32 shards (default), or fp32 throughout",
    )
    parser.add_argument(
        "--unit",
        default="GB",
        choices=tuple(UNITS),
        help="GB = 10^9 bytes (default), GiB = 2^30, MB = 10^6 (for small models)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def rehearse_command(args) -> int:
    """Run one rehearsal from the command line; bad input raises CourseInputError (exit 2) (notebook 05b)."""
    not_empty("--params", args.params)  # '' is a typo, not the 6.7B default
    cfg = model_config(
        args.params or "6.7B", layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq
    )
    r = rehearse(
        cfg,
        args.nproc,
        args.strategy,
        node_size=args.node_size,
        micro_batch=args.micro_batch,
        act_ckpt=args.act_ckpt,
        mixed_precision=args.mixed_precision,
    )
    if args.json:
        out = r.to_dict()
        out["prediction"] = {k: v for k, v in predict(r).items()}
        out["comparison"] = compare(r)
        print(json.dumps(out, default=float))
    else:
        print(format_report(r, args.unit))
    return 0
