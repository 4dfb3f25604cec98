"""Positions on a subset of heads (``position_heads``, every method): live against x-transformers'
attention with ``alibi_num_heads`` (ALiBi on the first heads, its slopes those of that many heads)
and ``rotate_num_heads`` (the rotation on the last heads), whole layers with the same weights; the
other heads are NoPE; learned methods' gradients; backends; cached decoding; grouped keys; errors."""

from __future__ import annotations

import pytest
import torch

import agreement
import posenc
from agreement import assert_decoding_equals_full, check_backends
from models import tiny_lm
from posenc.encodings.partial_heads import PartialHeads
from posenc.errors import UsageError

H, D = 4, 8


@pytest.fixture
def xt():
    return pytest.importorskip("x_transformers.x_transformers")


def same_weights(layer: posenc.Attention, ref) -> None:
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat((ref.to_q.weight, ref.to_k.weight, ref.to_v.weight)))
        layer.proj.weight.copy_(ref.to_out.weight)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_alibi_on_the_first_heads_equals_x_transformers_alibi_num_heads(xt, causal: bool, count: int) -> None:
    torch.manual_seed(count)
    heads = 4
    ref = xt.Attention(heads * D, heads=heads, dim_head=D, causal=causal)
    enc = posenc.build("alibi", num_heads=heads, head_dim=D, causal=causal, position_heads=count)
    layer = posenc.Attention(heads * D, heads, enc, causal=causal)
    same_weights(layer, ref)
    x = torch.randn(2, 13, heads * D)
    want = ref(x, rel_pos=xt.AlibiPositionalBias(heads=count, total_heads=heads))
    got = layer(x)
    assert (got - want).abs().max().item() < 1e-5  # seen: ~1e-7
    # and the reference's bias itself, head by head (its slopes: those of `count` heads)
    pos = torch.arange(13)
    ours = enc.bias(pos, pos)  # (H, T, T)
    theirs = xt.AlibiPositionalBias(heads=count, total_heads=heads)(13, 13)  # (H, T, T)
    visible = torch.ones(13, 13, dtype=torch.bool).tril() if causal else torch.ones(13, 13, dtype=torch.bool)
    torch.testing.assert_close(ours[:, visible], theirs[:, visible].float(), rtol=0, atol=1e-6)
    assert (ours[count:] == 0).all()


@pytest.mark.parametrize("count", [1, 2, 4])
def test_rotation_on_the_last_heads_equals_x_transformers_rotate_num_heads(xt, count: int) -> None:
    torch.manual_seed(10 + count)
    ref = xt.Attention(H * D, heads=H, dim_head=D, causal=True, rotate_num_heads=count)
    enc = posenc.build("rope", num_heads=H, head_dim=D, layout="interleaved", position_heads=count, position_heads_at="last")
    layer = posenc.Attention(H * D, H, enc)
    same_weights(layer, ref)
    x = torch.randn(2, 11, H * D)
    want = ref(x, rotary_pos_emb=xt.RotaryEmbedding(D)(torch.arange(11)))
    got = layer(x)
    assert (got - want).abs().max().item() < 1e-5
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(layer.qkv.weight.grad, torch.cat((ref.to_q.weight.grad, ref.to_k.weight.grad, ref.to_v.weight.grad)),
                               rtol=1e-4, atol=1e-5)
    if count < H:  # rotating every head instead differs: the option matters
        full = posenc.Attention(H * D, H, posenc.build("rope", num_heads=H, head_dim=D, layout="interleaved"))
        full.load_state_dict(layer.state_dict())
        assert (full(x) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("name,options", [("t5", {}), ("kerple", {}), ("shaw", {}), ("rope", {}), ("fire", {}), ("sandwich", {})])
def test_the_other_heads_are_nope_and_the_chosen_ones_the_method(name: str, options: dict) -> None:
    """Head by head: the chosen heads equal the method built for that many heads (same parameters),
    the others plain attention; gradients reach the method's parameters."""
    torch.manual_seed(3)
    at = "last" if name == "rope" else "first"
    enc = posenc.build(name, num_heads=H, head_dim=D, position_heads=2, position_heads_at=at, **options)
    assert isinstance(enc, PartialHeads)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    q, k, v = (torch.randn(2, H, 9, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = posenc.attend(q, k, v, enc.double())
    nope = posenc.attend(q, k, v, None)
    chosen = slice(2, 4) if at == "last" else slice(0, 2)
    others = slice(0, 2) if at == "last" else slice(2, 4)
    torch.testing.assert_close(out[:, others], nope[:, others], rtol=0, atol=1e-12)
    alone = posenc.attend(q[:, chosen], k[:, chosen], v[:, chosen], enc.inner)
    torch.testing.assert_close(out[:, chosen], alone, rtol=0, atol=1e-12)
    out.square().sum().backward()
    for p in enc.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("name,causal", [("alibi", True), ("alibi", False), ("shaw", True)])  # tails; query and value terms
def test_every_backend_agrees_with_eager(name: str, causal: bool) -> None:
    check_backends(posenc.build(name, num_heads=agreement.H, head_dim=agreement.D, causal=causal, position_heads=2), causal)


@pytest.mark.parametrize("name,at", [("alibi", "first"), ("rope", "last"), ("t5", "last"), ("fope", "first")])
def test_cached_decoding_equals_the_full_pass(name: str, at: str) -> None:
    assert_decoding_equals_full(tiny_lm(name, encoding_options={"position_heads": 2, "position_heads_at": at}))


def test_grouped_keys_turn_with_their_group() -> None:
    """With 2 key heads for 4 query heads, rotating the last 2 query heads turns the last key head;
    the grouped call equals the call with repeated keys."""
    enc = posenc.build("rope", num_heads=4, head_dim=D, position_heads=2, position_heads_at="last")
    q = torch.randn(1, 4, 7, D, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, 7, D, dtype=torch.float64).unbind(0)
    grouped = posenc.attend(q, k, v, enc)
    repeated = posenc.attend(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), enc)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-12)
    odd = posenc.build("rope", num_heads=4, head_dim=D, position_heads=1)
    with pytest.raises(UsageError, match=r"^position_heads: k has 2 heads; with num_heads=4 the first 1 positioned heads "
                                         r"must be whole groups of them$"):
        odd.rotate(q, k, torch.arange(7), torch.arange(7))


def test_a_study_row_and_a_schedule_take_the_option() -> None:
    model = posenc.LM(posenc.LMConfig(encoding="alibi", dim=32, depth=2, num_heads=4, vocab_size=64,
                                      encoding_options={"position_heads": 2}))
    assert isinstance(model.blocks[0].attn.encoding, PartialHeads)
    model(torch.randint(0, 64, (1, 9)))
    scheduled = posenc.LM(posenc.LMConfig(dim=32, depth=2, num_heads=4, vocab_size=64,
                                          schedule="1x[rope position_heads=2] 1x[nope]"))
    assert isinstance(scheduled.blocks[0].attn.encoding, PartialHeads)


@pytest.mark.parametrize("options,message", [
    (dict(position_heads=0), "position_heads must be an integer in [1, num_heads=4], got 0"),
    (dict(position_heads=5), "position_heads must be an integer in [1, num_heads=4], got 5"),
    (dict(position_heads=True), "position_heads must be an integer in [1, num_heads=4], got True"),
    (dict(position_heads="2"), "position_heads must be an integer in [1, num_heads=4], got '2'"),
    (dict(position_heads=2, position_heads_at="middle"), "position_heads_at must be one of ('first', 'last'), got 'middle'"),
    (dict(position_heads_at="last"), "position_heads_at needs position_heads (the number of heads with positions)"),
])
def test_bad_counts_are_usage_errors(options: dict, message: str) -> None:
    with pytest.raises(UsageError) as err:
        posenc.build("alibi", num_heads=4, head_dim=D, **options)
    assert str(err.value) == message


def test_methods_that_cannot_act_on_some_heads_are_refused() -> None:
    with pytest.raises(UsageError, match=r"^position_heads: sinusoidal cannot act on a subset of heads \(embed adds to the whole "
                                         r"width, not to heads\)$"):
        posenc.build("sinusoidal", num_heads=4, head_dim=D, position_heads=2)
    pope = posenc.build("pope", num_heads=4, head_dim=D, position_heads=2)
    q = torch.randn(1, 4, 3, D)
    with pytest.raises(UsageError, match=r"rotation changes the head width \(8 -> 16\)"):
        pope.rotate(q, q, torch.arange(3), torch.arange(3))


def test_forget_gates_on_some_heads_read_the_whole_input() -> None:
    """FoX on 2 of 4 heads: its gate reads the layer's whole input (input_dim = H x D), its log gates
    sit on the chosen heads and are 0 (no decay) on the others; a model trains through them."""
    enc = posenc.build("fox", num_heads=4, head_dim=D, position_heads=2, position_heads_at="last")
    x = torch.randn(2, 5, 4 * D)
    gates = enc.log_gates(x)  # (B, H, T)
    assert gates.shape == (2, 4, 5) and (gates[:, :2] == 0).all()
    torch.testing.assert_close(gates[:, 2:], enc.inner.log_gates(x))
    assert (gates[:, 2:] < 0).all()
    model = posenc.LM(posenc.LMConfig(encoding="fox", dim=4 * D, depth=1, num_heads=4, vocab_size=64,
                                      encoding_options={"position_heads": 2}))
    model(torch.randint(0, 64, (1, 9))).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.blocks[0].attn.encoding.parameters())


@pytest.mark.parametrize("name,why", [("inkling", "its curves are not per head alone"), ("selective", "its selection is shared by the heads")])
def test_data_dependent_methods_without_a_per_head_form_are_refused(name: str, why: str) -> None:
    with pytest.raises(UsageError, match=rf"^position_heads: {name} cannot act on a subset of heads \({why}\)$"):
        posenc.build(name, num_heads=4, head_dim=D, position_heads=2)
