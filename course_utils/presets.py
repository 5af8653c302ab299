"""Model shapes every part of the course can read without torch: the course model's ``GPTConfig`` and the
published presets (introduced in notebook 00; the published shapes in notebook 05b).

``GPTConfig`` is the shape of the course model (``models.GPT`` builds it). The published presets
(GPT-2 XL, Llama 2 7B and 13B, Llama 3 8B and 70B) are named by their parameter count; the dress
rehearsal (notebook 05b) builds them and the planner (notebook 05) can read them, so a preset means one
model everywhere. Nothing here imports torch: ``python -m course_utils plan`` stays quick to start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import CourseInputError
from .units import parse_count


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the course model (notebook 00). Ψ is ``param_count(cfg)``."""

    vocab: int = 256  # tokens in the vocabulary
    seq: int = 32  # context length (tokens per sample)
    layers: int = 2  # transformer blocks (L)
    width: int = 64  # hidden size (h)
    heads: int = 4  # attention heads; must divide width
    mlp_ratio: int = 4  # MLP hidden size = mlp_ratio * width (when mlp_hidden is 0)
    tie_weights: bool = True  # output head shares the token embedding (GPT-2 style)
    # Llama's block (notebook 05b's published shapes); the defaults keep GPT-2's.
    arch: str = "gpt2"  # "gpt2": LayerNorm, learned positions, GELU MLP, biases; "llama": see the module doc
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0 = heads (multi-head attention)
    mlp_hidden: int = 0  # MLP hidden size (Llama's intermediate_size); 0 = mlp_ratio * width
    rope_theta: float = 10000.0  # rotary base (arch "llama"; Llama 2 used 10^4, Llama 3 5·10^5)

    def __post_init__(self):
        for name in ("vocab", "seq", "layers", "width", "heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CourseInputError(f"model {name} must be a positive integer, got {value!r}")
        for name in ("kv_heads", "mlp_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CourseInputError(f"model {name} must be a whole number (0 for the default), got {value!r}")
        if self.arch not in ARCHS:
            raise CourseInputError(f"model arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.width % self.heads:
            raise CourseInputError(
                f"model width {self.width} is not divisible by heads {self.heads}; pick heads that divide it"
            )
        if self.heads % self.n_kv_heads:
            raise CourseInputError(
                f"model kv_heads {self.kv_heads} does not divide heads {self.heads}; "
                "pick a divisor (8 for Llama's 70B), or 0 for multi-head attention"
            )
        if self.arch == "llama" and (self.width // self.heads) % 2:
            raise CourseInputError(
                f"rotary positions need an even head size, not {self.width // self.heads}; "
                "pick heads so that width / heads is even"
            )

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` when it is 0 (multi-head attention)."""
        return self.kv_heads or self.heads

    @property
    def hidden(self) -> int:
        """The MLP's hidden size: ``mlp_hidden``, or ``mlp_ratio * width`` when it is 0."""
        return self.mlp_hidden or self.mlp_ratio * self.width

    def to_dict(self) -> dict:
        return asdict(self)


ARCHS = ("gpt2", "llama")


#: What one sharding unit of the course model can be (``unit_modules``); the first is the default.
UNIT_GRANULARITIES = ("block", "model", "linear")


# ---------------------------------------------------------------------------------------------
# Published shapes, built as the course model (notebook 05b)
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


def preset_for(params) -> Preset | None:
    """The preset a name or a size means (both planners, notebooks 05 and 05b): a preset's name or alias, or a
    parameter count within 1% of a released checkpoint's (70e9 is Llama 3 70B); None for any other size."""
    if isinstance(params, str):
        key = params if params in PRESETS else ALIASES.get(params.strip().lower())
        if key is not None:
            return PRESETS[key]
        try:
            params = parse_count(params, name="params")
        except CourseInputError:
            return None
    if isinstance(params, (int, float)) and not isinstance(params, bool) and params > 0:
        near = [p for p in PRESETS.values() if abs(params / p.released - 1) <= 0.01]
        return min(near, key=lambda p: abs(params / p.released - 1)) if near else None
    return None
