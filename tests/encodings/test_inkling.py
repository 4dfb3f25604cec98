"""The Inkling bias against its two live references, with the same weights, and its invariants.

References: transformers' Inkling-2 (``Inkling2RelativePositionBias`` and the whole
``Inkling2FullAttention`` module: its own q, k, v projections, short convolutions and gated output,
with posenc computing the attention from them) and x-transformers' ``RelativeProjPositionalBias``
(alone, and inside its ``Attention`` with ``use_rel_proj_pos_bias=True``). Then: cached decoding
equals the full pass, a packed row equals its documents alone, a padded batch its rows, gradients
reach every learned parameter, and a training pass at 4,096 tokens writes no (B, H, N, N) tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import MaxTensor, assert_decoding_equals_full, assert_packed_rows_equal_documents
from posenc.call.spec import curve_bias
from posenc.errors import UsageError

H, D, HKV = 4, 8, 2
DIM = H * D
R, K = 5, 3  # distances with a bias, curves in the bank (tiny: 12 tokens reach well past R)


def inkling2_config(**overrides):
    config = pytest.importorskip("transformers.models.inkling2.configuration_inkling2")
    fields = dict(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D,
                  swa_num_attention_heads=H, swa_num_key_value_heads=HKV, swa_head_dim=D, sliding_window_size=6, d_rel=K,
                  rel_extent=R, log_scaling_n_floor=4, log_scaling_alpha=0.3, layer_types=["hybrid", "hybrid_sliding"],
                  rel_l2_clip_threshold=0.7, vocab_size=64, unpadded_vocab_size=64, eos_token_id=1, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16)
    fields.update(overrides)
    cfg = config.Inkling2TextConfig(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def inkling2_encoding(module, log_scaling: float, floor: int, clip: float) -> posenc.PositionalEncoding:
    """posenc's Inkling bias holding the weights of an ``Inkling2RelativePositionBias``."""
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K, clip=clip, log_scaling=log_scaling, log_floor=floor)
    enc = enc.double()
    with torch.no_grad():
        enc.weights.weight.copy_(module.linear.weight)
        enc.scale.copy_(module.norm.scale)
        enc.bank.copy_(module.proj)
    return enc


@pytest.mark.parametrize("layer", [0, 1], ids=["full (log-scaled)", "sliding"])
def test_the_bias_equals_inkling2s_module(layer):
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    cfg = inkling2_config()
    sliding = cfg.layer_types[layer] == "hybrid_sliding"
    torch.manual_seed(layer)
    extent = cfg.sliding_window_size if sliding else R
    module = modeling.Inkling2RelativePositionBias(cfg, H, extent, log_scaling=not sliding).double()
    for p in module.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=extent, rank=K, clip=cfg.rel_l2_clip_threshold,
                       log_scaling=0.0 if sliding else cfg.log_scaling_alpha, log_floor=cfg.log_scaling_n_floor).double()
    with torch.no_grad():
        enc.weights.weight.copy_(module.linear.weight)
        enc.scale.copy_(module.norm.scale)
        enc.bank.copy_(module.proj)
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    q_pos = torch.arange(3, 15)  # queries at 3..14 after keys 0..2: a cached chunk
    k_pos = torch.arange(15)
    want = module(x, q_pos[:, None] - k_pos[None, :], q_pos[None].expand(2, -1))  # (B, H, Tq, Tk)
    got = curve_bias(enc.query_curves(x, q_pos), q_pos, k_pos)
    assert got.abs().max() > 0.1 and (want[..., :, :] == 0).sum() > 0  # a bias there is, and zeros beyond the extent
    norms = torch.linalg.vector_norm(enc.weights(x).view(2, 12, H, K) * enc.scale, dim=-1)
    assert (norms > cfg.rel_l2_clip_threshold).any() and (norms < cfg.rel_l2_clip_threshold).any()  # the clip acts on some
    # Inkling-2 scales, clips and log-scales the weights in float32 even for float64 input (``.float()``):
    # its float32 rounding is the difference (largest seen: 1.8e-7, on biases of size ~1).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - want).abs().max() < 1e-6


def test_the_attention_equals_inkling2s_full_attention_module():
    """The whole module (its own projections, convolutions, L2 clips, gated output) with posenc's
    attention in place of its eager one: the sinks are driven to -1000 (x's feature 0 is 1 and the
    sink projection reads -1000 of it), since posenc's attention has no per-query sink."""
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    cfg = inkling2_config()
    torch.manual_seed(0)
    module = modeling.Inkling2FullAttention(cfg, 0).double()
    for p in module.parameters():
        torch.nn.init.normal_(p, 0, 0.5)
    with torch.no_grad():
        module.sink_proj.weight.zero_()
        module.sink_proj.weight[:, 0] = -1000.0
    rel = module.relative_position_bias
    enc = inkling2_encoding(rel, cfg.log_scaling_alpha, cfg.log_scaling_n_floor, cfg.rel_l2_clip_threshold)
    b, t = 2, 12
    x = torch.randn(b, t, DIM, dtype=torch.float64)
    x[..., 0] = 1.0
    pos = torch.arange(t)
    causal = torch.zeros(t, t, dtype=torch.float64).masked_fill(pos[None, :] > pos[:, None], float("-inf"))[None, None]
    want, _ = module(x, x, x, causal.expand(b, 1, t, t), pos[:, None] - pos[None, :], position_ids=pos[None].expand(b, -1))
    q = module.q_proj(x, pos[None].expand(b, -1))  # (B, H, T, D)
    k, v = module.k_proj(x), module.v_proj(x)  # (B, Hkv, T, D)
    curves = enc.query_curves(x, pos)
    out = posenc.attend(q, k, v, enc, scale=module.scaling, query_curves=curves)  # (B, H, T, D)
    got = module.o_proj(out.transpose(1, 2).reshape(b, t, H * D), x)
    # The module's softmax with sinks, its L2 clips and log scales run in float32 (``.float()``) even for
    # float64 input: that rounding is the difference (largest seen: 4.6e-7 on outputs of size ~1).
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    plain = posenc.attend(q, k, v, "nope", scale=module.scaling)
    assert (module.o_proj(plain.transpose(1, 2).reshape(b, t, H * D), x) - want).abs().max() > 1e-3  # the bias matters
    # The gradients of the bias's weights agree too (the same loss through both).
    g = torch.randn_like(want)
    grads_ref = torch.autograd.grad((want * g).sum(), [rel.linear.weight, rel.norm.scale, rel.proj])
    grads = torch.autograd.grad((got * g).sum(), [enc.weights.weight, enc.scale, enc.bank])
    for a, c in zip(grads, grads_ref):
        assert c.abs().max() > 0
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)  # float32 inside the module (largest seen: ~1e-6)


def test_the_bias_equals_x_transformers():
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(1)
    ref = xt.RelativeProjPositionalBias(DIM, H, num_distance_basis=K, max_dist=R).double()
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K, clip=None, linear_bias=True).double()
    with torch.no_grad():
        enc.weights.weight.copy_(ref.to_distance_weights[0].weight)
        enc.weights.bias.copy_(ref.to_distance_weights[0].bias)
        enc.bank.copy_(ref.distance_bank * 30)
        ref.distance_bank.mul_(30)
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    want = ref(x, seq_len_k=11)  # 7 queries, the last of 11 keys
    got = curve_bias(enc.query_curves(x, torch.arange(4, 11)), torch.arange(4, 11), torch.arange(11))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # largest difference seen: 0 to ~1e-16


def test_the_attention_equals_x_transformers_attention():
    xt = pytest.importorskip("x_transformers.x_transformers")
    torch.manual_seed(2)
    ref = xt.Attention(DIM, dim_head=D, heads=H, causal=True, use_rel_proj_pos_bias=True,
                       rel_proj_num_distance_basis=K, rel_proj_max_dist=R).double()
    with torch.no_grad():
        ref.rel_proj_pos_bias.distance_bank.normal_(0, 1.0)
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K, clip=None, linear_bias=True)
    attn = posenc.Attention(DIM, H, enc).double()
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.cat([ref.to_q.weight, ref.to_k.weight, ref.to_v.weight]))
        attn.proj.weight.copy_(ref.to_out.weight)
        enc.weights.weight.copy_(ref.rel_proj_pos_bias.to_distance_weights[0].weight)
        enc.weights.bias.copy_(ref.rel_proj_pos_bias.to_distance_weights[0].bias)
        enc.bank.copy_(ref.rel_proj_pos_bias.distance_bank)
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    # x-transformers' softmax runs in float32 (``dtype=torch.float32``) for any input: that rounding is
    # the difference (largest seen: 4.8e-8); the bias alone agrees to 1e-12 (the test above).
    torch.testing.assert_close(attn(x), ref(x), rtol=0, atol=1e-6)
    nope = posenc.Attention(DIM, H, posenc.build("nope", num_heads=H, head_dim=D)).double()
    nope.load_state_dict({k: v for k, v in attn.state_dict().items() if not k.startswith("encoding.")})
    assert (nope(x) - attn(x)).abs().max() > 1e-3  # the bias matters here


def test_the_formula_written_out_pair_by_pair():
    """curve_bias against the definition, pair by pair: w_i P read at p_i - p_j inside [0, R), else 0."""
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K, clip=0.5).double()
    x = torch.randn(1, 9, DIM, dtype=torch.float64)
    pos = torch.arange(9) * 1
    with torch.no_grad():
        bias = curve_bias(enc.query_curves(x, pos), pos, pos)
        w = (x @ enc.weights.weight.t()).view(1, 9, H, K) * enc.scale
    for i in range(9):
        for h in range(H):
            u = w[0, i, h] * min(1.0, 0.5 / (float(w[0, i, h].norm()) + 1e-6))
            for j in range(9):
                want = float(u @ enc.bank.detach()[:, i - j]) if 0 <= i - j < R else 0.0
                assert math.isclose(float(bias[0, h, i, j]), want, abs_tol=1e-12)


def model(seed=3, **options):
    config = posenc.LMConfig(vocab_size=32, dim=DIM, depth=2, num_heads=H, encoding="inkling",
                             encoding_options=dict(distances=R, rank=K, clip=0.7, **options))
    torch.manual_seed(seed)
    lm = posenc.LM(config).eval()
    for block in lm.blocks:
        with torch.no_grad():
            block.attn.encoding.bank.normal_(0, 1.0)
    return lm


@pytest.mark.parametrize("options", [{}, {"log_scaling": 0.5, "log_floor": 3}], ids=["plain", "log-scaled"])
def test_cached_decoding_equals_the_full_pass(options):
    assert_decoding_equals_full(model(**options), length=20)


def test_a_packed_row_equals_its_documents_alone():
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K)
    attn = posenc.Attention(DIM, H, enc).double()
    with torch.no_grad():
        enc.bank.normal_(0, 1.0)
    x = torch.randn(2, 15, DIM, dtype=torch.float64)
    got = assert_packed_rows_equal_documents(attn, x)
    assert (got[0, 9:] - attn(x[:1])[0, 9:]).abs().max() > 1e-4  # the documents matter


def test_a_padded_batch_equals_its_rows_alone():
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K)
    attn = posenc.Attention(DIM, H, enc).double()
    x = torch.randn(2, 10, DIM, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    got = attn(x, attention_mask=mask)
    torch.testing.assert_close(got[1:, 4:], attn(x[1:, 4:]), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[:1], attn(x[:1]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("clip", [0.7, None])
def test_gradients_reach_every_learned_parameter(clip):
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K, clip=clip, linear_bias=clip is None)
    attn = posenc.Attention(DIM, H, enc)
    attn(torch.randn(2, 12, DIM)).square().sum().backward()
    names = [n for n, _ in enc.named_parameters()]
    assert set(names) == ({"weights.weight", "scale", "bank"} if clip else {"weights.weight", "weights.bias", "bank"})
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize(("tq", "tk", "block"), [(12, 12, 4), (7, 12, 3), (1, 12, 4), (20, 20, 256), (300, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_curved_backend_equals_eager(tq, tk, block, dtype):
    """Far keys on the kernel and the band written out, against eager's formula: outputs and the
    gradients of q, k, v and the curves, a full pass, a chunk after a cache, a decode step, blocks
    whose band starts inside the keys and before them."""
    from posenc.backends import curved, eager
    from posenc.backends.parts.base import ScoreSpec

    enc = posenc.build("inkling", num_heads=2, head_dim=8, distances=R, rank=K)
    g = torch.Generator().manual_seed(tq + tk)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=dtype).requires_grad_() for n in (tq, tk, tk))
    c = torch.randn(2, 2, tq, R, generator=g, dtype=dtype).requires_grad_()
    kp = torch.arange(3, 3 + tk)
    spec = ScoreSpec(encoding=enc, q_positions=kp[tk - tq :], k_positions=kp, causal=True, scale=8 ** -0.5, curves=c)
    assert curved.supports(spec, q)
    got, want = curved.attend(q, k, v, spec, block), eager.attend(q, k, v, spec)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=0, atol=tol)  # largest seen: 3e-15 (float64)
    w = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * w).sum(), [q, k, v, c]), torch.autograd.grad((want * w).sum(), [q, k, v, c])):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)  # largest seen: 7e-15 (float64)


def test_auto_picks_curved_and_eager_takes_what_it_cannot():
    enc = posenc.build("inkling", num_heads=H, head_dim=D, distances=R, rank=K)
    attn = posenc.Attention(DIM, H, enc)
    x = torch.randn(2, 12, DIM)
    attn(x)
    assert attn.last_backend == "curved"
    cache = posenc.model.cache.LayerCache()
    attn(x[:, :8], cache=cache)
    attn(x[:, 8:9], cache=cache)  # a decode step
    assert attn.last_backend == "curved"
    attn(x.bfloat16().float(), positions=torch.arange(12) * 2)  # positions that skip values
    assert attn.last_backend == "eager"
    padded = posenc.model.cache.LayerCache(padding=[3, 0])
    attn(x[:, :8], cache=padded)  # left padding in the cache
    assert attn.last_backend == "eager"


@pytest.mark.parametrize("backend", ["curved", "eager"])
def test_a_training_pass_at_4096_tokens_writes_no_quadratic_tensor(backend):
    n = 4096
    enc = posenc.build("inkling", num_heads=2, head_dim=8, distances=64, rank=4)
    attn = posenc.Attention(16, 2, enc, backend=backend)
    x = torch.randn(1, n, 16, requires_grad=True)
    with MaxTensor() as seen:
        attn(x).sum().backward()
    assert attn.last_backend == backend
    # one block of queries against every key at most (eager), or against its band (curved): not (H, N, N)
    assert seen.largest < 2 * n * n // 4, seen.largest
    if backend == "curved":
        assert seen.largest <= 2 * n * 256, seen.largest  # the band: 256 queries x (256 + 63) keys x 2 heads, or (H, N, D)
    assert enc.bank.grad is not None


def test_bad_options_name_their_parameter():
    for options, name in (({"distances": 0}, "distances"), ({"rank": -1}, "rank"), ({"clip": 0.0}, "clip"),
                          ({"clip": float("inf")}, "clip"), ({"log_scaling": -0.1}, "log_scaling"), ({"log_floor": 0}, "log_floor"),
                          ({"input_dim": 0}, "input_dim"), ({"linear_bias": 1}, "linear_bias")):
        with pytest.raises(UsageError, match=name):
            posenc.build("inkling", num_heads=H, head_dim=D, **options)
    enc = posenc.build("inkling", num_heads=H, head_dim=D)
    with pytest.raises(UsageError, match="x"):
        enc.query_curves(torch.randn(1, 3, DIM + 1), torch.arange(3))
    q = torch.randn(1, H, 3, D)
    with pytest.raises(UsageError, match="query_curves"):
        posenc.attend(q, q, q, enc)  # the curves are required
    with pytest.raises(UsageError, match="query_curves"):
        posenc.attend(q, q, q, enc, query_curves=torch.randn(1, H, 2, 5))  # wrong shape
    with pytest.raises(UsageError, match="query_curves"):
        posenc.attend(q, q, q, "alibi", query_curves=torch.randn(1, H, 3, 5))  # an encoding without curves
    with pytest.raises(UsageError, match="window"):
        posenc.Attention(DIM, H, enc, window=4)
