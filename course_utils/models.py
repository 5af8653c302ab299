"""The course model: a small GPT-style transformer every notebook trains (introduced in notebook 00).

It is deliberately ordinary (token + position embeddings, pre-norm blocks of causal
self-attention and an MLP, a final norm, an output head tied to the token embedding, as in
GPT-2) so that what the course measures on it carries over to real models. Sizes are
configurable; the defaults are tiny so that 4 CPU processes train it in seconds.

``arch="llama"`` builds the same model with Llama's block instead (RMSNorm, rotary positions
and no position table, grouped-query attention with ``kv_heads``, a SwiGLU MLP of ``mlp_hidden``,
no biases, an untied head): notebook 05b builds the published Llama shapes with it, so that a
"70B" has 70B parameters.

``build_model(cfg, seed)`` gives the same weights for the same seed in every process, which
is what lets the notebooks compare strategies bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import CourseInputError
from .presets import ARCHS, UNIT_GRANULARITIES, GPTConfig  # noqa: F401 (the course model's shape, read here too)

#: Named sizes. "tiny" is what the notebooks' defaults train on a 2-core CPU.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(vocab=512, seq=64, layers=4, width=128, heads=4),
    "medium": GPTConfig(vocab=1024, seq=128, layers=6, width=256, heads=8),
}


def get_config(model: str | GPTConfig = "tiny", **overrides) -> GPTConfig:
    """A preset by name ("tiny", "small", "medium") or a config, with field overrides (notebook 00)."""
    if isinstance(model, GPTConfig):
        cfg = model
    elif model in PRESETS:
        cfg = PRESETS[model]
    else:
        raise CourseInputError(f"unknown model {model!r}; choose one of {', '.join(PRESETS)}")
    return replace(cfg, **overrides) if overrides else cfg


class CausalSelfAttention(nn.Module):
    """Causal self-attention; with ``kv_heads`` < ``heads``, grouped-query attention (``arch="llama"``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.kv_heads, self.rope_theta = cfg.heads, cfg.n_kv_heads, cfg.rope_theta
        self.rotary = cfg.arch == "llama"
        kv = cfg.width // cfg.heads * cfg.n_kv_heads  # width of k (and of v)
        self.qkv = nn.Linear(cfg.width, cfg.width + 2 * kv, bias=cfg.arch == "gpt2")  # q, k, v in one matrix
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.arch == "gpt2")

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).split([h, d * self.kv_heads, d * self.kv_heads], dim=2)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, d).transpose(1, 2) for t in (k, v))
        if self.rotary:
            cos, sin = rotary_angles(s, d, self.rope_theta, x.device, x.dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


def rotary_angles(s: int, d: int, theta: float, device, dtype):
    """cos and sin of rotary position embedding (RoFormer, as in Llama) for ``s`` positions of a head of size ``d``."""
    inv = theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angle = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv  # (seq, d/2)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate(x, cos, sin):
    """Rotary position embedding of ``x`` (batch, heads, seq, head size), in the half-split layout
    of GPT-NeoX and Hugging Face's Llama: no parameters, so it adds nothing to Ψ."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLP(nn.Module):
    """GPT-2's MLP (GELU, ``mlp_ratio * width``) or, with ``arch="llama"``, SwiGLU: three matrices."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        self.fc = nn.Linear(cfg.width, cfg.hidden, bias=not self.swiglu)
        if self.swiglu:
            self.gate = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.width, bias=not self.swiglu)

    def forward(self, x):
        if self.swiglu:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))


def norm(cfg: GPTConfig) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (Llama: a scale, no shift, no mean)."""
    return nn.RMSNorm(cfg.width, eps=1e-5) if cfg.arch == "llama" else nn.LayerNorm(cfg.width)


class Block(nn.Module):
    """One transformer block: the unit FSDP and ZeRO-3 gather at a time (notebook 03)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Embedding):
    """``nn.Embedding`` that draws no initial weights on the meta device (notebook 00).

    A meta tensor has no values, and ``normal_`` on one runs torch's Python reference
    implementation, whose first call imports ``torch._dynamo`` (measured: 2.4 CPU s, the largest
    part of building the first meta model in a notebook's kernel). Elsewhere it is ``nn.Embedding``,
    drawing the same numbers in the same order.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class GPT(nn.Module):
    """The course model (notebook 00). ``model(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = Embedding(cfg.vocab, cfg.width)
        if cfg.arch == "gpt2":  # Llama's positions are rotary, inside attention: no table
            self.pos_emb = Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = norm(cfg)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L); nothing on meta."""
        for name, p in self.named_parameters():
            if p.is_meta:  # no values to draw (see ``Embedding``)
                continue
            if p.dim() == 1:
                nn.init.zeros_(p) if not name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else nn.init.ones_(
                    p
                )
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx)
        if self.cfg.arch == "gpt2":
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def unit_modules(model: nn.Module, granularity: str = "block") -> list[nn.Module]:
    """The submodules that become their own sharding unit, in forward order; the root is always one more (notebook 04).

    "model": none (one unit, the whole model). "block": each transformer block (the usual
    choice). "linear": each linear layer inside the blocks (the head is tied to the token
    embedding, so it stays with the root, like the LayerNorms). ``fsdp.shard_model`` wraps these;
    ``predict.planned_units`` counts them before any process starts.
    """
    if granularity == "model":
        return []
    if granularity == "block":
        return list(model.blocks)
    if granularity == "linear":
        return [m for block in model.blocks for m in block.modules() if isinstance(m, nn.Linear)]
    raise CourseInputError(f"wrap must be one of {', '.join(UNIT_GRANULARITIES)}, got {granularity!r}")


def unit_table(model: nn.Module, shard_size: int, units: list[nn.Module]) -> list[dict]:
    """Each unit's parameters: ``[{"name", "numel", "padded"}]`` in forward order, the root last (notebook 04).

    ``units``: the unit modules below the root (``models.unit_modules``, the modules
    ``fsdp.shard_model`` wraps). A unit owns the parameters of its subtree that no other unit
    owns (a tied weight counts once). ``padded``: FSDP2 pads dim 0 of every parameter to a
    multiple of the shard size before splitting it, so an all-gather moves ``padded`` elements.
    """
    names = {id(m): n for n, m in model.named_modules()}
    seen, rows = set(), []
    for module in [*units, model]:  # units do not nest; whatever they leave belongs to the root
        numel = padded = 0
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            dim0 = p.shape[0] if p.dim() else 1
            numel += p.numel()
            padded += -(-dim0 // shard_size) * shard_size * (p.numel() // max(dim0, 1))
        rows.append({"name": names[id(module)] or "(root)", "numel": numel, "padded": padded})
    return rows


def build_model(cfg: GPTConfig | str = "tiny", seed: int = 0, device="cpu") -> GPT:
    """The course model with weights fixed by ``seed`` alone, identical in every process (notebook 00).

    The global RNG is left as it was (the initialisation uses a forked RNG state).
    """
    cfg = get_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(device)


def build_meta_model(cfg: GPTConfig | str = "tiny") -> GPT:
    """The course model's structure on the meta device: shapes, no storage, no random numbers drawn (notebook 04).

    What FSDP2 users build a large model as: shard it first (``fully_shard`` works on meta
    parameters), then ``init_weights`` gives each rank's shards their values.
    """
    with torch.device("meta"):
        return GPT(get_config(cfg))


@torch.no_grad()
def init_weights(model: GPT, seed: int = 0, device="cpu") -> GPT:
    """Give a meta-built (possibly sharded) model ``build_model(cfg, seed)``'s weights on ``device`` (notebook 04).

    ``model.to_empty(device)`` gives every parameter storage (for FSDP2, its local shard); then
    each parameter gets the very values the eager build gives it, bit for bit: the random
    numbers are drawn on the CPU in the eager build's order (each layer's own
    ``reset_parameters`` as its constructor calls it, then ``GPT.reset_parameters``), one full
    parameter at a time, and each rank keeps only its shard (``distribute_tensor`` with
    ``src_data_rank=None``: no communication). Host memory peaks at the largest parameter, not
    the model. The global RNG is left as it was.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    if model.cfg.tie_weights:  # to_empty gives each module a new parameter: tie the head again
        model.head.weight = model.tok_emb.weight
    shapes = build_meta_model(model.cfg)  # unsharded shapes, in construction order
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in shapes.modules():  # the draws of each layer's constructor
            if hasattr(module, "reset_parameters") and not isinstance(module, GPT):
                module.to_empty(device="cpu").reset_parameters()
        for (name, full), (_, param) in zip(shapes.named_parameters(), model.named_parameters()):
            fresh = torch.empty(full.shape)
            if full.dim() == 1:
                fresh.fill_(1.0 if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) else 0.0)
            else:
                std = 0.02 / math.sqrt(2 * model.cfg.layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(fresh, mean=0.0, std=std)
            if isinstance(param, DTensor):
                local = distribute_tensor(fresh, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(fresh)
    return model


def param_count(model_or_cfg) -> int:
    """Ψ: the number of distinct parameters (a tied weight counts once) (notebook 01)."""
    if isinstance(model_or_cfg, nn.Module):
        model = model_or_cfg
    else:
        with torch.device("meta"):  # built on meta so weights stay tied (``.to("meta")`` would untie them)
            model = GPT(get_config(model_or_cfg))
    return sum(p.numel() for p in model.parameters())


def tail_numel(model: GPT) -> int:
    """Elements of the parameters used only after the last block (the final norm, and the head unless it is
    tied to the embedding): their gradients are whole from the start of the backward, before any block's;
    a tied head's gradient completes with the embedding's, at the end (notebooks 03, 04)."""
    before = {id(p) for m in (model.tok_emb, getattr(model, "pos_emb", None)) if m is not None for p in m.parameters()}
    after = {id(p): p for m in (model.ln_f, model.head) for p in m.parameters() if id(p) not in before}
    return sum(p.numel() for p in after.values())
