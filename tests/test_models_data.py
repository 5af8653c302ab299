"""The course model and data source: determinism, tied weights, identical samples at any world size."""

from __future__ import annotations

import pytest
import torch

from course_utils.data import batch_for_rank, global_batch
from course_utils.errors import CourseInputError
from course_utils.instrument import weights_sha256
from course_utils.models import GPTConfig, build_model, get_config, param_count


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = build_model("tiny", 0), build_model("tiny", 0), build_model("tiny", 1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), c.state_dict().values()))


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", 7)
    assert torch.equal(torch.rand(3), expected)


def test_param_count_counts_a_tied_weight_once():
    model = build_model("tiny", 0)
    assert model.head.weight is model.tok_emb.weight
    cfg = get_config("tiny")
    h, v, s, L = cfg.width, cfg.vocab, cfg.seq, cfg.layers
    per_block = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 4 * h
    expected = v * h + s * h + L * per_block + 2 * h
    assert param_count(model) == param_count("tiny") == param_count(cfg) == expected


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_slices_make_up_the_global_batch(world):
    x1, y1 = batch_for_rank(3, 0, 1, batch=8, seq=16, vocab=50, seed=2)
    parts = [batch_for_rank(3, r, world, batch=8, seq=16, vocab=50, seed=2) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x1)
    assert torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one token


def test_steps_differ_and_repeat():
    assert not torch.equal(global_batch(0, 4, 8, 50), global_batch(1, 4, 8, 50))
    assert torch.equal(global_batch(5, 4, 8, 50, seed=1), global_batch(5, 4, 8, 50, seed=1))


def test_the_data_is_learnable():
    model = build_model("tiny", 0)
    cfg = model.cfg
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        x, y = batch_for_rank(step, 0, 1, batch=8, seq=cfg.seq, vocab=cfg.vocab)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_bad_shapes_are_refused():
    with pytest.raises(CourseInputError, match="divisible by heads"):
        GPTConfig(width=64, heads=5)
    with pytest.raises(CourseInputError, match="layers"):
        GPTConfig(layers=0)
    with pytest.raises(CourseInputError, match="unknown model"):
        get_config("huge")
    with pytest.raises(CourseInputError, match="multiple of 3"):
        batch_for_rank(0, 0, 3, batch=8, seq=4, vocab=10)


@pytest.mark.parametrize("preset, seed", [("tiny", 0), ("small", 7)])
def test_meta_device_build_equals_the_eager_build_bit_for_bit(preset, seed):
    from course_utils.instrument import weights_sha256
    from course_utils.models import build_meta_model, init_weights

    meta = build_meta_model(preset)
    assert all(p.is_meta for p in meta.parameters())
    before = torch.random.get_rng_state()
    built = init_weights(meta, seed=seed)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is left as it was
    eager = build_model(preset, seed=seed)
    assert built.head.weight is built.tok_emb.weight
    for (name, a), (_, b) in zip(built.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(a, b), name
    assert weights_sha256(built.state_dict()) == weights_sha256(eager.state_dict())


def meta_init_worker(model: str = "tiny", seed: int = 0, node_size: int = 2) -> dict:
    """On every rank: shard a meta-device build, initialise it, and compare with the eager build.

    Returns ``{strategy: True/False}``: whether the full weights (gathered through DTensor) of
    ``loop.prepare``'s meta-device build equal ``build_model(model, seed)``'s, bit for bit.
    """
    from course_utils import dist as cdist
    from course_utils.loop import TrainConfig, prepare
    from course_utils.strategies import FSDP_STRATEGIES

    with cdist.session() as info:
        eager = weights_sha256(build_model(model, seed=seed).state_dict())
        out = {}
        for strategy in FSDP_STRATEGIES:
            cfg = TrainConfig(strategy=strategy, nproc=info.world_size, model=model, seed=seed, node_size=node_size)
            out[strategy] = weights_sha256(prepare(cfg, info).full_state_dict()) == eager
        return out


def test_sharded_meta_device_build_equals_the_eager_build():
    # FSDP2 on 4 gloo ranks: every rank materialises only its shards, gathered they are the eager weights
    from course_utils.launch import launch
    from course_utils.strategies import FSDP_STRATEGIES

    result = launch(meta_init_worker, nproc=4, args=("tiny", 5), echo=False)
    assert all(result[r] == {s: True for s in FSDP_STRATEGIES} for r in range(4)), dict(result)


# --------------------------------------------------------------------------- Llama's block (notebook 05b)

LLAMA = GPTConfig(
    vocab=64, seq=16, layers=2, width=32, heads=4, kv_heads=2, mlp_hidden=48, arch="llama", tie_weights=False
)


def test_llama_block_counts_by_hand():
    """Ψ of the Llama-block model against a hand count: grouped-query q/k/v/o, SwiGLU's three matrices,
    two RMSNorm scales per block, no biases, no position table, an untied head."""
    h, v, L, f = LLAMA.width, LLAMA.vocab, LLAMA.layers, LLAMA.mlp_hidden
    kv = h // LLAMA.heads * LLAMA.kv_heads
    per_block = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    assert param_count(LLAMA) == 2 * v * h + L * per_block + h
    model = build_model(LLAMA, 0)
    assert not hasattr(model, "pos_emb") and model.head.weight is not model.tok_emb.weight
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())


def test_llama_model_learns_and_is_deterministic():
    a, b = build_model(LLAMA, 3), build_model(LLAMA, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    opt = torch.optim.Adam(a.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        x, y = batch_for_rank(step, 0, 1, batch=8, seq=LLAMA.seq, vocab=LLAMA.vocab)
        loss = a(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_rotary_scores_depend_only_on_the_distance():
    """RoPE's defining property: q at position m against k at position n scores the same as at m+t, n+t."""
    from course_utils.models import rotary_angles, rotate

    torch.manual_seed(0)
    d, s = 8, 12
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    cos, sin = rotary_angles(s, d, 10000.0, "cpu", torch.float64)
    qs, ks = rotate(q.expand(1, 1, s, d), cos, sin)[0, 0], rotate(k.expand(1, 1, s, d), cos, sin)[0, 0]
    assert torch.allclose(qs.norm(dim=-1), q.norm().expand(s))  # a rotation keeps lengths
    assert torch.allclose(qs[2] @ ks[5], qs[6] @ ks[9]) and torch.allclose(qs[0] @ ks[0], q @ k)
    assert not torch.allclose(qs[2] @ ks[5], qs[2] @ ks[6])


def test_grouped_query_attention_equals_repeated_heads():
    """kv_heads < heads: the same as multi-head attention with each key/value head repeated."""
    import torch.nn.functional as F

    from course_utils.models import CausalSelfAttention

    torch.manual_seed(0)
    attn = CausalSelfAttention(LLAMA)
    x = torch.randn(2, LLAMA.seq, LLAMA.width)
    b, s, h = x.shape
    d, g = h // LLAMA.heads, LLAMA.heads // LLAMA.kv_heads
    q, k, v = attn.qkv(x).split([h, d * LLAMA.kv_heads, d * LLAMA.kv_heads], dim=2)
    q = q.view(b, s, LLAMA.heads, d).transpose(1, 2)
    k, v = (t.view(b, s, LLAMA.kv_heads, d).transpose(1, 2).repeat_interleave(g, dim=1) for t in (k, v))
    from course_utils.models import rotary_angles, rotate

    cos, sin = rotary_angles(s, d, LLAMA.rope_theta, "cpu", x.dtype)
    y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
    assert torch.allclose(attn(x), attn.proj(y.transpose(1, 2).reshape(b, s, h)), atol=1e-5)


def test_bad_llama_shapes_are_refused():
    with pytest.raises(CourseInputError, match="kv_heads"):
        GPTConfig(width=64, heads=4, kv_heads=3, arch="llama")
    with pytest.raises(CourseInputError, match="arch"):
        GPTConfig(arch="mamba")
    with pytest.raises(CourseInputError, match="even head size"):
        GPTConfig(width=12, heads=4, arch="llama")
