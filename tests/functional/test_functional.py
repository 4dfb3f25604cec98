"""posenc.attend, the functional call: grouped-query heads, packed documents, padded rows, per-row
positions, for every method; against independent references (PyTorch's SDPA with enable_gqa,
Hugging Face's LlamaAttention) and the invariants (a packed row equals its documents alone, a padded
batch equals its rows alone, GQA equals MHA with K/V repeated)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import posenc
from posenc import UsageError, attend, available, build
from posenc.encodings import get_class, has_hook, options_of

pytestmark = pytest.mark.usefixtures("one_thread")

H, HKV, D = 4, 2, 16


def encoding(method: str, causal: bool = True, dtype=torch.float32):
    torch.manual_seed(1)
    options = {"max_positions": 512} if method == "learned" else {}
    if method in ("rope_mixed", "fope"):  # frequencies (coefficients) per key head: a query and its key turn alike
        options = {"num_kv_heads": HKV}
    enc = build(method, num_heads=H, head_dim=D, causal=causal, **options)
    for p in enc.parameters():  # large enough that the position terms matter
        torch.nn.init.normal_(p, std=0.5)
    return enc.to(dtype)


# posenc.attend on q, k, v alone: a method whose gates or curves come from the layer input (fox,
# inkling) needs log_gates or query_curves as well, and has its own tests of packing, padding and
# caching (tests/encodings/test_fox.py, tests/encodings/test_inkling.py).
METHODS = [m for m in available() if not any(has_hook(build(m, num_heads=4, head_dim=8), hook) for hook in ("log_gates", "query_curves"))]
# Methods that offer the bias hook (its own checks of the positions it is given).
BIASES = [m for m in available() if has_hook(build(m, num_heads=4, head_dim=8), "bias")]
assert {"alibi", "t5", "kerple", "sandwich", "fire"} <= set(BIASES), BIASES


def grouped_options(method: str) -> dict:
    """Options for a model with num_kv_heads=2: a method that takes ``num_kv_heads`` (RoPE-Mixed's
    frequencies per key head) is built with it."""
    return {"num_kv_heads": 2} if "num_kv_heads" in options_of(get_class(method)) else {}


def qkv(b, t, hkv=HKV, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, t, D, generator=g, dtype=dtype), torch.randn(b, hkv, t, D, generator=g, dtype=dtype),
            torch.randn(b, hkv, t, D, generator=g, dtype=dtype))


def grads(out, *tensors):
    return torch.autograd.grad(out, tensors, torch.ones_like(out), allow_unused=True)


def close(a, b, tol=2e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("method", METHODS)
def test_grouped_heads_equal_repeated_heads(method):
    enc = encoding(method)
    q, k, v = (x.requires_grad_() for x in qkv(2, 200))
    out = attend(q, k, v, enc)
    g = H // HKV
    want = attend(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), enc)
    close(out, want)
    for a, b in zip(grads(out, q, k, v), grads(want, q, k, v)):
        close(a, b)


@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("method", ["alibi", "t5", "kerple", "fire"])
def test_the_blocked_backend_takes_grouped_heads_as_they_are(method, hkv, monkeypatch):
    """blocked's kernel calls get k and v with Hkv heads, nothing repeated (where the plan allows:
    :func:`posenc.backends.parts.tails.grouped`), and the result is the repeated
    call's, outputs and gradients; the kernel's own fallback for a torch whose flash ops refuse
    grouped heads gives the same."""
    from posenc.backends.parts import regions

    h, n = 8, 700
    torch.manual_seed(3)
    enc = build(method, num_heads=h, head_dim=D)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, h, n, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, D, generator=g, requires_grad=True) for _ in range(2))
    seen = []
    kernel = regions.kernel_forward

    def spy(q_, k_, v_, *args, **kwargs):
        seen.append((q_.shape[1], k_.shape[1]))
        return kernel(q_, k_, v_, *args, **kwargs)

    monkeypatch.setattr("posenc.backends.blocked.kernel_forward", spy)
    monkeypatch.setattr("posenc.backends.parts.explicit.kernel_forward", spy)
    out = attend(q, k, v, enc)
    native = seen and all(qh == kh * (h // hkv) for qh, kh in seen)  # whole groups of query heads with their key/value heads
    if method in ("kerple", "fire") or (method == "t5" and hkv >= 2):
        assert native, seen  # (one key/value head for a far call of T5 would run its backward on one thread)
    else:  # ALiBi's plan, and T5's with one key/value head, take them grouped or repeated, whole
        assert native or all(kh == qh for qh, kh in seen), seen
    want = attend(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), enc)
    close(out, want, 5e-5)
    for a, b in zip(grads(out, q, k, v, *enc.parameters()), grads(want, q, k, v, *enc.parameters())):
        close(a, b, 5e-5)
    monkeypatch.setattr(regions, "GROUPED_KERNEL", False)
    close(attend(q, k, v, enc), want, 5e-5)


def test_alibi_slope_groups_that_split_a_group_of_query_heads_take_the_keys_repeated():
    """32 heads in groups of 4: a slope group of heads 3..6 takes part of two groups, so the plan
    takes k and v repeated, and the result is the repeated call's."""
    from posenc.backends.parts import tails
    from posenc.backends.parts.base import ScoreSpec

    h, hkv, n = 32, 8, 600
    enc = build("alibi", num_heads=h, head_dim=D)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, h, n, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, D, generator=g, requires_grad=True) for _ in range(2))
    pos = torch.arange(n)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=D**-0.5)
    assert not tails.grouped(tails.make_plan(spec, n, n, torch.float32, None, tails.spread(q, k, spec.scale)), h, hkv)
    out = attend(q, k, v, enc)
    want = attend(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), enc)
    close(out, want)
    for a, b in zip(grads(out, q, k, v), grads(want, q, k, v)):
        close(a, b)


def documents_alone(q, k, v, enc, lengths):
    """Every row's documents (the same ``lengths`` in each row), each attended alone, put back in order."""
    pieces, s = [], 0
    for n in lengths:
        pieces.append(attend(q[:, :, s : s + n], k[:, :, s : s + n], v[:, :, s : s + n], enc))
        s += n
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("method", METHODS)
def test_a_packed_row_equals_its_documents_alone(method):
    """Three documents in one row of 300: no attention across them, positions restarting."""
    enc = encoding(method)
    q, k, v = (x.requires_grad_() for x in qkv(1, 300))
    lengths = [130, 70, 100]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]  # (1, 300)
    out = attend(q, k, v, enc, document_ids=doc)
    want = documents_alone(q, k, v, enc, lengths)
    close(out, want)
    for a, b in zip(grads(out, q, k, v, *enc.parameters()), grads(want, q, k, v, *enc.parameters())):
        if a is not None:
            close(a, b, 1e-4)


@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5", "shaw"])
@pytest.mark.parametrize("lengths", [[50, 50, 50], [50, 50, 30]])
def test_packed_rows_of_equal_documents_equal_the_documents_alone(method, lengths):
    """Two rows of documents: equal documents that tile the rows run as one slice (no gather),
    equal documents with a gap between them as a gather; both equal each document alone."""
    enc = encoding(method)
    t = sum(lengths)
    q, k, v = (x.requires_grad_() for x in qkv(2, t))
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, t)  # (2, T)
    out = attend(q, k, v, enc, document_ids=doc)
    want = documents_alone(q, k, v, enc, lengths)
    close(out, want)
    for a, w in zip(grads(out, q, k, v, *enc.parameters()), grads(want, q, k, v, *enc.parameters())):
        if a is not None:
            close(a, w, 1e-4)


@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5", "fire"])
def test_a_padded_packed_row_equals_its_documents_alone(method):
    """One row: 15 padding tokens, then documents of 40, 40 and 25 (a run of two equal documents
    and one alone, cut from the row as pieces of one split with the padding a gap): outputs and
    gradients equal each document alone; padding gets 0 out and 0 gradient."""
    enc = encoding(method)
    pad, lengths = 15, [40, 40, 25]
    t = pad + sum(lengths)
    q, k, v = (x.requires_grad_() for x in qkv(1, t))
    doc = torch.cat([torch.zeros(pad, dtype=torch.long)] + [torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    mask = torch.arange(t)[None] >= pad  # (1, T)
    out = attend(q, k, v, enc, document_ids=doc, key_padding_mask=mask)
    real = [x[:, :, pad:] for x in (q, k, v)]
    want = documents_alone(*real, enc, lengths)
    close(out[:, :, pad:], want)
    assert torch.all(out[:, :, :pad] == 0)
    params = list(enc.parameters())
    got, ref = grads(out, q, k, v, *params), grads(want, q, k, v, *params)
    for a, w in zip(got, ref):
        if a is not None:
            close(a, w, 1e-4)
    assert all(torch.all(g[:, :, :pad] == 0) for g in got[:3])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_equals_its_rows_alone(method, side):
    enc = encoding(method)
    t, real = 160, [160, 97, 33]
    q, k, v = (x.requires_grad_() for x in qkv(3, t))
    mask = torch.zeros(3, t, dtype=torch.bool)
    for b, n in enumerate(real):
        if side == "left":
            mask[b, t - n :] = True
        else:
            mask[b, :n] = True
    out = attend(q, k, v, enc, key_padding_mask=mask)
    for b, n in enumerate(real):
        idx = mask[b].nonzero().squeeze(1)
        alone = attend(q[b : b + 1, :, idx], k[b : b + 1, :, idx], v[b : b + 1, :, idx], enc)
        close(out[b : b + 1, :, idx], alone)
        assert torch.all(out[b, :, ~mask[b]] == 0)  # padding queries: zeros
    # the gradient flows only into real tokens
    gq = grads(out, q)[0]
    assert torch.all(gq[~mask[:, None, :, None].expand_as(gq)] == 0)


@pytest.mark.parametrize("method", [m for m in METHODS if m != "learned"])
def test_per_row_positions_equal_each_row_alone(method):
    enc = encoding(method)
    q, k, v = qkv(2, 50)
    positions = torch.stack([torch.arange(50), torch.arange(7, 57)])  # (B, T)
    out = attend(q, k, v, enc, positions=positions)
    for b in range(2):
        close(out[b : b + 1], attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], enc, positions=positions[b]))


@pytest.mark.parametrize("method", [m for m in METHODS if not get_class(m).causal_only])
def test_encoder_packing(method):
    enc = encoding(method, causal=False)
    q, k, v = qkv(2, 40)
    doc = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
    out = attend(q, k, v, enc, causal=False, document_ids=doc)
    close(out[:1, :, :25], attend(q[:1, :, :25], k[:1, :, :25], v[:1, :, :25], enc, causal=False))
    close(out[:1, :, 25:], attend(q[:1, :, 25:], k[:1, :, 25:], v[:1, :, 25:], enc, causal=False))
    close(out[1:], attend(q[1:], k[1:], v[1:], enc, causal=False))


def test_nope_equals_pytorch_sdpa_with_enable_gqa():
    q, k, v = qkv(2, 64)
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        close(attend(q, k, v, None, causal=causal), want, 1e-6)


def test_a_cached_step_with_fewer_queries_than_keys():
    """Tq < Tk: the queries are the last keys; padding on the left is hidden from them."""
    enc = encoding("alibi")
    q, k, v = qkv(2, 40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :10] = False
    full = attend(q, k, v, enc, key_padding_mask=mask)
    step = attend(q[:, :, -5:], k, v, enc, key_padding_mask=mask)
    close(step, full[:, :, -5:])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"document_ids": torch.zeros(2, 9, dtype=torch.long)}, r"document_ids must have shape \(batch, length\) = \(2, 8\), got \(2, 9\)"),
        ({"document_ids": torch.zeros(2, 8)}, "document_ids must be an integer tensor"),
        ({"key_padding_mask": torch.ones(2, 8)}, r"key_padding_mask must be a bool tensor \(True = real token\)"),
        ({"key_padding_mask": torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]] * 2, dtype=torch.bool)}, "one contiguous run of real tokens"),
        ({"positions": torch.arange(9)}, r"positions must have shape \(8,\) or \(batch, 8\)"),
        ({"positions": torch.arange(8.0)}, "positions must be an integer tensor"),
        ({"k_positions": torch.arange(8)}, "k_positions needs positions"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    q, k, v = qkv(2, 8)
    with pytest.raises(UsageError, match=message):
        attend(q, k, v, encoding("alibi"), **kwargs)


def test_bad_shapes_are_refused():
    q, k, v = qkv(2, 8)
    with pytest.raises(UsageError, match=r"query heads \(4\) must be a multiple of the key/value heads \(3\)"):
        attend(q, torch.randn(2, 3, 8, D), torch.randn(2, 3, 8, D))
    with pytest.raises(UsageError, match="encoding was built for num_heads=8"):
        attend(q, k, v, build("alibi", num_heads=8, head_dim=D))
    with pytest.raises(UsageError, match=r"q must be a 4-D tensor"):
        attend(q[0], k, v)


# -- Hugging Face's LlamaAttention with grouped-query heads: the same weights, the same outputs --------


def llama(hkv=2):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=hkv, head_dim=8,
                                      intermediate_size=64, num_hidden_layers=1, vocab_size=32,
                                      max_position_embeddings=256, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    mine = posenc.Attention(64, 8, posenc.rope_from_hf(config), num_kv_heads=hkv).eval()
    with torch.no_grad():
        mine.qkv.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        mine.proj.weight.copy_(attn.o_proj.weight)
    return attn, rotary, mine


def hf_forward(attn, rotary, x, position_ids, mask4d):
    cos, sin = rotary(x, position_ids)
    return attn(x, position_embeddings=(cos, sin), attention_mask=mask4d)[0]


def causal_mask(real: torch.Tensor) -> torch.Tensor:
    """HF's eager additive mask (B, 1, T, T) from a (B, T) real-token mask."""
    t = real.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_gqa_rope_equals_llama_attention():
    attn, rotary, mine = llama()
    x = torch.randn(2, 40, 64)
    with torch.no_grad():
        want = hf_forward(attn, rotary, x, torch.arange(40)[None], causal_mask(torch.ones(2, 40, dtype=torch.bool)))
        close(mine(x), want, 1e-5)


def test_gqa_rope_equals_llama_attention_on_a_left_padded_batch():
    attn, rotary, mine = llama()
    x = torch.randn(2, 30, 64)
    real = torch.ones(2, 30, dtype=torch.bool)
    real[1, :12] = False
    position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)  # HF's convention for left padding
    with torch.no_grad():
        want = hf_forward(attn, rotary, x, position_ids, causal_mask(real))
        got = mine(x, attention_mask=real.long())
    close(got[real], want[real], 1e-5)


def test_gqa_rope_decoding_with_a_cache_equals_llama_attention():
    attn, rotary, mine = llama(hkv=1)  # multi-query
    x = torch.randn(1, 24, 64)
    cache = posenc.model.cache.LayerCache()
    with torch.no_grad():
        want = hf_forward(attn, rotary, x, torch.arange(24)[None], causal_mask(torch.ones(1, 24, dtype=torch.bool)))
        steps = [mine(x[:, :16], cache=cache)] + [mine(x[:, t : t + 1], cache=cache) for t in range(16, 24)]
    close(torch.cat(steps, dim=1), want, 1e-5)
    assert cache.k.shape[1] == 1  # the cache holds the key/value heads only


# -- FlexAttention compiled on CPU (inference) with a document mask: the reference for packed biases --


def test_packed_alibi_equals_flex_attention_with_a_document_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    enc = encoding("alibi")
    q, k, v = qkv(1, 128, hkv=H)
    doc = torch.cat([torch.zeros(80, dtype=torch.long), torch.ones(48, dtype=torch.long)])
    start = torch.tensor([0] * 80 + [80] * 48)
    slopes = posenc.alibi_slopes(H)

    def mask_mod(b, h, i, j):
        return (doc[i] == doc[j]) & (j <= i)

    def score_mod(score, b, h, i, j):
        return score - slopes[h] * ((i - start[i]) - (j - start[j])).abs()

    block = flex.create_block_mask(mask_mod, 1, 1, 128, 128, device="cpu")
    try:
        want = torch.compile(flex.flex_attention)(q, k, v, score_mod=score_mod, block_mask=block)
    except Exception as error:  # a CPU without the compiled template (needs AVX2)
        pytest.skip(f"FlexAttention on this CPU: {error}")
    with torch.no_grad():
        close(attend(q, k, v, enc, document_ids=doc[None]), want, 1e-5)


# -- the model: documents, padding and grouped heads through LM.forward ---------------------------


@pytest.mark.parametrize("method", available())
def test_lm_packed_and_padded_rows(method):
    cfg = posenc.LMConfig(encoding=method, dim=32, depth=2, num_heads=4, num_kv_heads=2, max_positions=64,
                          encoding_options=grouped_options(method))
    model = posenc.LM(cfg).eval()
    a, b = torch.randint(0, 256, (1, 20)), torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 20 + [1] * 12]))
        close(packed[:, :20], model(a), 1e-5)
        close(packed[:, 20:], model(b), 1e-5)
        padded = model(torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1), attention_mask=torch.tensor([[0] * 8 + [1] * 12]))
        close(padded[:, 8:], model(b), 1e-5)


def test_lm_grouped_heads_shrink_the_cache():
    full = posenc.LM(posenc.LMConfig(encoding="alibi", dim=64, depth=2, num_heads=8)).eval()
    gqa = posenc.LM(posenc.LMConfig(encoding="alibi", dim=64, depth=2, num_heads=8, num_kv_heads=2)).eval()
    sizes = []
    for model in (full, gqa):
        cache = model.new_cache(1)
        with torch.no_grad():
            model(torch.randint(0, 256, (1, 64)), cache=cache)
        sizes.append(sum(layer.k.numel() + layer.v.numel() for layer in cache.layers))
    assert sizes[1] * 4 == sizes[0]


def test_lm_random_positions_within_documents():
    cfg = posenc.LMConfig(encoding="rope", dim=32, depth=1, num_heads=4, random_positions=256)
    model = posenc.LM(cfg).train()
    seen = {}
    original = model._random_positions

    def spy(*args):
        seen["p"] = original(*args)
        return seen["p"]

    model._random_positions = spy
    model(torch.randint(0, 256, (1, 30)), document_ids=torch.tensor([[0] * 10 + [1] * 20]))
    p = seen["p"][0]
    assert torch.all(p[1:10] > p[:9]) and torch.all(p[11:] > p[10:-1])  # increasing inside each document
    assert torch.equal(p[10:20], p[:10])  # the same draw, indexed by in-document position


@pytest.mark.parametrize("method", available())
def test_lm_grouped_heads_decoding_equals_the_full_pass(method):
    cfg = posenc.LMConfig(encoding=method, dim=32, depth=2, num_heads=4, num_kv_heads=2, encoding_options=grouped_options(method))
    model = posenc.LM(cfg).eval()
    tokens = torch.randint(0, 256, (2, 24))
    cache = model.new_cache(2)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :16], cache=cache)] + [model(tokens[:, t : t + 1], cache=cache) for t in range(16, 24)]
    close(torch.cat(steps, dim=1), full, 1e-5)


@pytest.mark.parametrize("method", BIASES)
def test_bias_hooks_refuse_per_row_positions_with_a_pointer_to_attend(method):
    enc = encoding(method)
    pos = torch.arange(6).expand(2, 6)
    with pytest.raises(UsageError, match=r"bias: q_positions must be 1-D \(T,\), got \(2, 6\); for positions per row \(B, T\) call posenc.attend"):
        enc.bias(pos, pos)


def test_non_finite_queries_are_a_clear_error_not_a_crash():
    enc = encoding("alibi")
    q, k, v = qkv(1, 300, hkv=H)
    q[0, 0, 5, 0] = float("nan")
    with pytest.raises(UsageError, match="q and k must be finite"):
        attend(q, k, v, enc)
