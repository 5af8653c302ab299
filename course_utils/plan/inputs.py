"""The planner's inputs: the transformer being planned and the machines (notebook 05).

``ModelSpec`` (Ψ and the shape that sets activations and a block's size) and ``Cluster`` (GPUs,
memory, links, FLOP/s). Symbols: Ψ parameters, h width, L layers, s sequence length, b micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CourseInputError
from ..units import GB, fmt_count, parse_count
from ..validate import check_values

#: Head dimension used when heads are not given (width / 128 heads, as in GPT-3 and Llama).
HEAD_DIM = 128
#: Widths synthesized from Ψ alone are multiples of this (two heads), like published models' widths.
WIDTH_STEP = 2 * HEAD_DIM

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

    @property
    def block_params(self) -> float:
        """One transformer block: attention 4h² + 4h, MLP 8h² + 5h, two norms 4h: 12h² + 13h."""
        return shape_block_params(self.width)

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
    seq: int = 2048,
    micro_batch: int = 1,
    checkpointing: bool = True,
) -> ModelSpec:
    """A ``ModelSpec`` from Ψ alone, from a shape, or from both (they must agree within 25%) (notebook 05).

    From Ψ alone the shape is GPT-like: width h ≈ (128Ψ/12)^(1/3) (so that L ≈ h/128, the aspect
    of GPT-3 and Llama) rounded to a multiple of 256, as published widths are (an even number of
    128-wide heads: 7B gives h = 4096 and 32 heads, 13B 5120 and 40, 175B 12288 and 96), then
    L = (Ψ − V·h) / (12h² + 13h).
    Raises CourseInputError for a model that cannot exist (non-positive sizes, heads that do not
    divide the width, a Ψ too small for its own vocabulary, a Ψ that contradicts the shape).
    """
    vocab = _whole("vocab", vocab)
    seq = _whole("seq", seq)
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
    ``flops``: achievable 16-bit FLOP/s per GPU (well below the data-sheet peak); ``mp``: Nm;
    ``reserve``: the fraction of GPU memory kept free for the allocator, CUDA context and
    fragmentation.
    """

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_mem: float = 80 * GB
    intra_bw: float = 200e9
    inter_bw: float = 50e9
    flops: float = 200e12
    pcie_bw: float = 25e9
    hbm_bw: float = 2e12
    host_mem: float = 1000 * GB
    host_bw: float = 100e9
    mp: int = 1
    reserve: float = 0.10
    nvme_bw: float = 25e9

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
        """GPU bytes a plan may fill: ``gpu_mem`` less the ``reserve``."""
        return self.gpu_mem * (1 - self.reserve)
