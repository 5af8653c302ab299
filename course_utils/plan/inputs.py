"""The planner's inputs: the transformer being planned and the machines (notebook 05).

``ModelSpec`` (Ψ and the shape that sets activations and a block's size) and ``Cluster`` (GPUs,
memory, links, FLOP/s). Symbols: Ψ parameters, h width, L layers, s sequence length, b micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CourseInputError
from ..presets import preset_for
from ..units import GB, fmt_count, parse_count
from ..validate import check_values

GiB = 2**30
MiB = 2**20

#: Head dimension used when heads are not given (width / 128 heads, as in GPT-3 and Llama).
HEAD_DIM = 128
#: Widths synthesized from Ψ alone are multiples of this (two heads), like published models' widths.
WIDTH_STEP = 2 * HEAD_DIM


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory (bytes), dense 16-bit peak (FLOP/s), HBM, achievable NVLink ring bandwidth per
    GPU inside a node and PCIe to the host (bytes/s), and the achievable fraction of peak (``mfu``)."""

    name: str
    mem: float
    peak_flops: float
    hbm_bw: float
    nvlink_bw: float
    pcie_bw: float
    mfu: float = 0.40


#: Where the default achievable fraction comes from.
MFU_SOURCE = (
    "0.40: the Llama 3 paper (arXiv:2407.21783, section 3.3.2, Table 4) reports 38-43% BF16 MFU on H100 "
    "for the 405B pre-training; that is end to end (exposed communication and pipeline bubbles included), "
    "so as a compute-only fraction it is conservative. An input: --mfu."
)

#: Memory as nvidia-smi reports it (81,559 MiB for an H100 80GB); peaks from NVIDIA's data sheets (dense BF16).
GPUS = {
    "H100-80GB": GPU("H100 SXM 80GB", 81559 * MiB, 989e12, 3.35e12, 360e9, 50e9),
    "A100-80GB": GPU("A100 SXM 80GB", 81920 * MiB, 312e12, 2.0e12, 240e9, 25e9),
    "H200": GPU("H200 SXM 141GB", 143771 * MiB, 989e12, 4.8e12, 360e9, 50e9),
}


#: The GPU both planners assume unless told otherwise (``plan.Cluster``'s defaults and ``plan --gpu``).
DEFAULT_GPU = GPUS["H100-80GB"]
#: What a GPU holds beyond tensors (CUDA context, cuBLAS and NCCL workspaces): both planners' fits test.
CONTEXT_BYTES = 1.5 * GiB
#: What the caching allocator reserves beyond the tensors' peak, a fraction of it (fragmentation).
ALLOCATOR_RESERVE = 0.10
#: A GPU node's host: CPU memory and its bandwidth (the CPU optimizer step of offload), both planners' default.
HOST_MEM = 2000 * GB
HOST_BW = 200e9


# ---------------------------------------------------------------------------------------------
# Inputs: the model and the cluster
# ---------------------------------------------------------------------------------------------


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise CourseInputError(message)


def _whole(name: str, value, minimum: int = 1) -> int:
    _need(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be a whole number >= {minimum}, got {value!r}",
    )
    return value


@dataclass(frozen=True)
class ModelSpec:
    """The transformer being planned (notebook 05).

    ``params`` is Ψ; ``layers`` (L), ``width`` (h), ``heads`` and ``vocab`` give the shape that
    sets activations and the size of one block; ``seq`` (s) and ``micro_batch`` (b, per
    data-parallel replica) the work in flight; ``checkpointing`` activation checkpointing.
    """

    params: float
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    checkpointing: bool
    arch: str = "gpt2"  # a preset's block ("llama": RMSNorm, SwiGLU, grouped-query attention); see presets
    kv_heads: int = 0  # key/value heads; 0 = heads
    hidden: int = 0  # the MLP's hidden size; 0 = 4h
    name: str = ""  # the preset's name ("Llama 2 7B"), or "" for a shape built from Ψ or given

    @property
    def block_params(self) -> float:
        """One transformer block: GPT-2's 12h² + 13h (attention 4h² + 4h, MLP 8h² + 5h, two norms 4h), or a
        preset's own block (``block_param_count``)."""
        kv = self.width // self.heads * (self.kv_heads or self.heads)
        return float(block_param_count(self.arch, self.width, kv, self.hidden or 4 * self.width))

    @property
    def embedding_params(self) -> float:
        return float(self.vocab * self.width)

    @property
    def largest_unit_params(self) -> float:
        """The largest unit stage 3 gathers at once: one block, or the token embedding if bigger."""
        return max(self.block_params, self.embedding_params)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch, b·s."""
        return self.micro_batch * self.seq


def block_param_count(arch: str, h: int, kv: int, f: int) -> int:
    """Parameters of one block of width h, key/value width kv and MLP hidden size f (both planners)."""
    if arch == "gpt2":  # 2 LayerNorms, qkv and its bias, projection, fc, proj, their biases
        return 4 * h + h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + h * f + f + f * h + h
    return 2 * h + h * (h + 2 * kv) + h * h + 3 * h * f  # 2 RMSNorms, qkv, projection, gate/up/down


def shape_block_params(width: int) -> float:
    """Parameters of one GPT block of width h: 12h² + 13h (notebook 05)."""
    return 12.0 * width * width + 13.0 * width


def shape_params(layers: int, width: int, vocab: int) -> float:
    """Ψ of a GPT of L blocks of width h with a vocabulary of V tokens (tied head):
    L(12h² + 13h) + V·h + 2h (notebook 05)."""
    return layers * shape_block_params(width) + vocab * width + 2.0 * width


def model_spec(
    params=None,
    *,
    layers: int | None = None,
    width: int | None = None,
    heads: int | None = None,
    vocab: int = 32000,
    seq: int | None = None,
    micro_batch: int = 1,
    checkpointing: bool = True,
) -> ModelSpec:
    """A ``ModelSpec`` from Ψ alone, from a shape, or from both (they must agree within 25%) (notebook 05).

    A preset's name, or a Ψ within 1% of a preset's ("6.7B", 70e9), is that preset (``presets.preset_for``):
    the model notebook 05b rehearses and the throughput planner searches, its shape, Ψ and sequence length
    (``seq`` overrides the sequence). Any other size gets the GPT-like shape below, sequence 2048.

    From Ψ alone the shape is GPT-like: width h ≈ (128Ψ/12)^(1/3) (so that L ≈ h/128, the aspect
    of GPT-3 and Llama) rounded to a multiple of 256, as published widths are (an even number of
    128-wide heads: 7B gives h = 4096 and 32 heads, 13B 5120 and 40, 175B 12288 and 96), then
    L = (Ψ − V·h) / (12h² + 13h).
    Raises CourseInputError for a model that cannot exist (non-positive sizes, heads that do not
    divide the width, a Ψ too small for its own vocabulary, a Ψ that contradicts the shape).
    """
    if params is not None and layers is None and width is None and heads is None:
        known = preset_for(params)
        if known is not None:
            c = known.cfg
            micro_batch = _whole("micro-batch", micro_batch)
            return ModelSpec(
                float(known.released), c.layers, c.width, c.heads, c.vocab, _whole("seq", seq or c.seq),
                micro_batch, bool(checkpointing), c.arch, c.n_kv_heads, c.hidden, known.name,
            )  # fmt: skip
    vocab = _whole("vocab", vocab)
    seq = _whole("seq", 2048 if seq is None else seq)
    micro_batch = _whole("micro-batch", micro_batch)
    if params is not None:
        params = parse_count(params, name="params")
    if layers is not None or width is not None:
        _need(layers is not None and width is not None, "give both layers and width (or neither, and Ψ alone)")
        layers, width = _whole("layers", layers), _whole("width", width)
        implied = shape_params(layers, width, vocab)
        if params is None:
            params = implied
        else:
            _need(
                0.75 <= params / implied <= 1.25,
                f"a model that cannot exist: {layers} layers of width {width} with a {vocab}-token vocabulary "
                f"have {fmt_count(implied)} parameters, not {fmt_count(params)}; drop --params or fix the shape",
            )
    else:
        _need(params is not None, "give the model: params (Ψ), or layers and width")
        width = max(HEAD_DIM, int(round((HEAD_DIM * params / 12.0) ** (1 / 3) / WIDTH_STEP)) * WIDTH_STEP)
        body = params - vocab * width
        _need(
            body >= 0.5 * shape_block_params(width),
            f"a model that cannot exist: {fmt_count(params)} parameters is less than a {vocab}-token vocabulary "
            f"of width {width} needs ({fmt_count(vocab * width)}); give a larger --params or a smaller --vocab",
        )
        layers = max(1, int(round(body / shape_block_params(width))))
    if heads is None:
        heads = max(1, width // HEAD_DIM) if width % HEAD_DIM == 0 else 1
    heads = _whole("heads", heads)
    _need(width % heads == 0, f"a model that cannot exist: width {width} does not divide into {heads} heads")
    return ModelSpec(float(params), layers, width, heads, vocab, seq, micro_batch, bool(checkpointing))


@dataclass(frozen=True)
class Cluster:
    """The machines (notebook 05). Bandwidths in bytes/s, memory in bytes, compute in FLOP/s.

    ``intra_bw``: per GPU inside a node (NVLink-class); ``inter_bw``: per node between nodes
    (all its network cards together); ``pcie_bw``: per GPU to host memory; ``hbm_bw``: a GPU's
    own memory; ``host_bw``: a node's CPU memory bandwidth (the CPU optimizer step of offload);
    ``nvme_bw``: a node's NVMe drives together (ZeRO-Infinity's offload target; one PCIe 4.0 drive reads
    about 7 GB/s, so the default assumes a few striped);
    ``flops``: achievable 16-bit FLOP/s per GPU (the data-sheet peak times the achievable fraction); ``mp``: Nm;
    ``reserve``: what the caching allocator reserves beyond the tensors' peak, a fraction of it, and
    ``context``: what a GPU holds beyond tensors. The GPU's numbers default to ``DEFAULT_GPU``, the record the
    throughput planner reads (``GPUS``), and the fits test is its: tensors x (1 + reserve) + context <= memory.
    """

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_mem: float = DEFAULT_GPU.mem
    intra_bw: float = DEFAULT_GPU.nvlink_bw
    inter_bw: float = 50e9
    flops: float = DEFAULT_GPU.peak_flops * DEFAULT_GPU.mfu
    pcie_bw: float = DEFAULT_GPU.pcie_bw
    hbm_bw: float = DEFAULT_GPU.hbm_bw
    host_mem: float = HOST_MEM
    host_bw: float = HOST_BW
    mp: int = 1
    reserve: float = ALLOCATOR_RESERVE
    nvme_bw: float = 25e9
    context: float = CONTEXT_BYTES

    def __post_init__(self):
        check_values("plan", self)  # the stated ranges (course_utils.validate): nodes, GPUs per node, Nm
        _whole("gpus-per-node", self.gpus_per_node)
        _whole("nodes", self.nodes)
        _whole("mp (Nm)", self.mp)
        for name in ("gpu_mem", "intra_bw", "inter_bw", "flops", "pcie_bw", "hbm_bw", "host_mem", "host_bw", "nvme_bw"):
            value = getattr(self, name)
            _need(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
                f"{name.replace('_', '-')} must be a positive number, got {value!r}",
            )
        _need(0 <= self.reserve < 1, f"reserve must be a fraction in [0, 1), got {self.reserve!r}")
        _need(0 <= self.context < self.gpu_mem, f"context must be bytes below the GPU's memory, got {self.context!r}")
        _need(
            self.gpus % self.mp == 0,
            f"mp (Nm) = {self.mp} must divide the {self.gpus} GPUs into whole data-parallel replicas",
        )

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def nd(self) -> int:
        """Nd: data-parallel replicas, GPUs / Nm."""
        return self.gpus // self.mp

    @property
    def usable(self) -> float:
        """Tensor bytes a plan may fill: what leaves, after the allocator's reserve on top of them and the
        context, the GPU's memory (the throughput planner's fits test, ``throughput.memory``)."""
        return (self.gpu_mem - self.context) / (1 + self.reserve)
