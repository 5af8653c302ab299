"""What the throughput planner plans for: a model's shape and the machines (notebook 05).

A model's name means one model everywhere: the planner reads the published presets of ``presets`` (the
shapes notebook 05b rehearses), so ``plan --params 8B`` and ``rehearse --params 8B`` are both Llama 3 8B
(``tests/test_plan.py`` checks that Ψ counted here is each released checkpoint's, to the parameter). A size
without a preset gets a GPT-2-style shape from ``plan.inputs.model_spec``, and the planner says which.

GPUs: dense 16-bit peak from NVIDIA's data sheets, memory as ``nvidia-smi`` reports it (an "80GB" H100 holds
81,559 MiB = 85.5 GB), the achievable fraction of peak an input (``MFU_SOURCE`` says where 0.40 comes from).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..presets import NOT_THEIR_SIZE, PRESETS, Preset, preset_for
from .inputs import (  # noqa: F401 (the GPU record lives in inputs, read by both planners)
    ALLOCATOR_RESERVE,
    CONTEXT_BYTES,
    GB,
    GPU,
    GPUS,
    HOST_BW,
    HOST_MEM,
    MFU_SOURCE,
    GiB,
    ModelSpec,
    block_param_count,
    model_spec,
)


@dataclass(frozen=True)
class Shape:
    """A transformer as the course model builds it (``models.GPT``): ``arch`` "gpt2" (LayerNorm, GELU MLP,
    biases, learned positions) or "llama" (RMSNorm, SwiGLU, rotary positions, grouped-query attention)."""

    name: str
    arch: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    hidden: int  # the MLP's hidden size, f
    vocab: int
    seq: int
    tied: bool

    @property
    def kv_width(self) -> int:
        return self.width // self.heads * self.kv_heads

    @property
    def block_params(self) -> int:
        return block_param_count(self.arch, self.width, self.kv_width, self.hidden)

    @property
    def root_params(self) -> int:
        """The root unit ``fully_shard(model)`` keeps: embeddings, final norm, an untied head."""
        h, vocab = self.width, self.vocab
        embeddings = vocab * h + (self.seq * h if self.arch == "gpt2" else 0)
        norm = 2 * h if self.arch == "gpt2" else h
        return embeddings + norm + (0 if self.tied else vocab * h)

    @property
    def head_params(self) -> int:
        return self.vocab * self.width

    @property
    def params(self) -> int:
        """Ψ."""
        return self.layers * self.block_params + self.root_params

    @property
    def block_matmul_params(self) -> int:
        h, kv, f = self.width, self.kv_width, self.hidden
        return h * (h + 2 * kv) + h * h + (2 if self.arch == "gpt2" else 3) * h * f


def shape_of_config(c, name: str = "") -> Shape:
    """The planner's ``Shape`` of a course model's ``GPTConfig`` (what notebook 05b rehearses)."""
    return Shape(name, c.arch, c.layers, c.width, c.heads, c.n_kv_heads, c.hidden, c.vocab, c.seq, c.tie_weights)


def shape_of_preset(p: Preset, seq: int | None = None) -> Shape:
    """The planner's ``Shape`` of a published preset (notebook 05b's, ``presets.preset``)."""
    s = shape_of_config(p.cfg, p.name)
    return replace(s, seq=seq) if seq else s


def shape_of_spec(m: ModelSpec) -> Shape:
    """A size without a preset: ``model_spec``'s GPT-2-style shape (4h MLP, multi-head, tied head)."""
    return Shape(
        f"a GPT-2-style {m.params / 1e9:.3g}B", "gpt2", m.layers, m.width, m.heads, m.heads, 4 * m.width,
        m.vocab, m.seq, True,
    )  # fmt: skip


def shape_for(params=None, *, layers=None, width=None, heads=None, vocab=None, seq=None) -> tuple[Shape, str]:
    """The model a name or a size means (notebook 05): a preset's name is that preset (the rehearsal's model);
    anything else is ``model_spec``'s GPT-2-style shape, and the second value says which shape was assumed."""
    if params is not None and layers is None and width is None and heads is None:
        known = preset_for(params)
        if known is not None:
            return shape_of_preset(known, seq), ""
    m = model_spec(params, layers=layers, width=width, heads=heads, vocab=vocab or 32000, seq=seq or 2048)
    s = shape_of_spec(m)
    hint = NOT_THEIR_SIZE.get(str(params).strip().lower(), "") if params is not None else ""
    said = f"No preset is called {params!r}" + (f" ({hint})" if hint else "") if params is not None else "A shape"
    return s, (
        f"{said}: assumed a GPT-2-style shape, L = {s.layers}, h = {s.width}, {s.heads} heads, MLP {s.hidden}, "
        f"vocabulary {s.vocab:,}, sequence {s.seq:,}, tied head (Ψ = {s.params / 1e9:.2f}B). "
        f"Presets: {', '.join(PRESETS)}."
    )


@dataclass(frozen=True)
class GPUCluster:
    """The machines the throughput planner searches over (notebook 05): ``nodes`` is what is offered (fewer
    may be the answer); ``inter_bw`` is a node's network, all its cards together (bytes/s); latencies per
    collective; ``context_bytes`` is what a GPU holds beyond tensors (CUDA context, cuBLAS and NCCL
    workspaces); ``allocator_reserve`` what the caching allocator reserves beyond the tensors' peak, as a
    fraction of it (fragmentation)."""

    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    inter_bw: float = 400e9
    intra_latency: float = 15e-6
    inter_latency: float = 50e-6
    host_mem: float = HOST_MEM
    host_bw: float = HOST_BW
    context_bytes: float = CONTEXT_BYTES
    allocator_reserve: float = ALLOCATOR_RESERVE
