"""The arguments of the attend call (posenc/functional.py): each case asserts
the exact message or result. References: the contiguous call, and the eager backend (the textbook
formula) in float64."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, T, D = 2, 2, 12, 8
GATES_ALONE = "log_gates (forget gates) take no window, chunk, sinks or softcap: give the full causal attention"
BIASES = ["alibi", "t5", "kerple", "fire", "shaw", "transformer_xl", "cope", "deberta"]


def qkv(dv: int = D, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g, dtype=dtype), torch.randn(B, H, T, D, generator=g, dtype=dtype),
            torch.randn(B, H, T, dv, generator=g, dtype=dtype))


def enc(name: str, causal: bool = True):
    return posenc.build(name, num_heads=H, head_dim=D, causal=causal)


# 1: forget gates with a window, chunk or sinks: refused by posenc's own layer (its windowed cache keeps no
# gates), one message; attend runs them (tests/backends/parts/test_gated_windows.py: against the formula)
@pytest.mark.parametrize("kwargs", [dict(chunk=4), dict(window=4), dict(sinks=True)])
def test_fox_with_a_window_chunk_or_sinks_is_refused_by_posencs_layer(kwargs) -> None:
    with pytest.raises(UsageError) as err:
        posenc.Attention(32, H, posenc.build("fox", num_heads=H, head_dim=16), **kwargs)
    assert str(err.value) == GATES_ALONE
    with pytest.raises(UsageError) as err:
        posenc.LM(posenc.LMConfig(schedule="[fox sinks]", dim=32, depth=1, num_heads=H))
    assert str(err.value) == GATES_ALONE


# 2: inputs whose last dimension is not contiguous, or stride-0, equal the contiguous call
@pytest.mark.parametrize("method", ["alibi", "t5", "kerple", "fire", "shaw", "transformer_xl", "cope", "deberta"])
def test_strided_inputs_equal_the_contiguous_call(method: str) -> None:
    e = enc(method)
    g = torch.Generator().manual_seed(1)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(True)

    cases = [  # (the leaf, its strided view, which input, the leaf's gradient from the view's)
        (leaf(B, H, D, T), lambda x: x.mT, 1, lambda gr: gr.mT),  # a key cache read as k.mT from (B, H, D, T)
        (leaf(B, H, T, 2 * D), lambda x: x[..., ::2], 0, lambda gr: gr),  # x[..., ::2]
        (leaf(B, H, 1, D), lambda x: x.expand(B, H, T, D), 2, lambda gr: gr.sum(2, keepdim=True)),  # a stride-0 expand
    ]
    for base, view, slot, back in cases:
        inputs = list(qkv())
        inputs[slot] = view(base)
        out = posenc.attend(*inputs, e)
        ref_in = [x.detach().contiguous().requires_grad_(True) for x in inputs]
        ref = posenc.attend(*ref_in, e)
        assert torch.allclose(out, ref, atol=1e-5)
        out.square().sum().backward()
        ref.square().sum().backward()
        got = base.grad[..., ::2] if slot == 0 else base.grad
        assert torch.allclose(got, back(ref_in[slot].grad), atol=1e-4)
    q, k, v = qkv()
    kt = k.transpose(-1, -2).contiguous().mT
    q1 = q[:, :, -1:].clone()  # a decode step against a transposed cache
    assert torch.allclose(posenc.attend(q1, kt, v, e, positions=torch.tensor([T - 1])),
                          posenc.attend(q1, kt.contiguous(), v, e, positions=torch.tensor([T - 1])), atol=1e-5)


# 5: a registry name is built for q's heads and head dim; other objects are refused
def test_the_encoding_argument() -> None:
    q, k, v = qkv()
    assert torch.allclose(posenc.attend(q, k, v, "rope"), posenc.attend(q, k, v, enc("rope")), atol=1e-6)
    assert not torch.allclose(posenc.attend(q, k, v, "rope"), posenc.attend(q, k, v, None), atol=1e-3)
    for bad, name in ((torch.nn.Linear(2, 2), "Linear"), (3, "int")):
        with pytest.raises(UsageError) as err:
            posenc.attend(q, k, v, bad)
        assert str(err.value) == f"encoding must be a posenc encoding (posenc.build(...)), a registry name or None, got {name}"
    with pytest.raises(UsageError, match="unknown encoding"):
        posenc.attend(q, k, v, "ropee")


# 6: FoX's gated backend with a value head dim unlike q's
@pytest.mark.parametrize("dv", [4, 16])
def test_fox_value_head_dim(dv: int) -> None:
    q, k, v = qkv(dv, torch.float64)
    gates = -torch.rand(B, H, T, dtype=torch.float64)
    e = enc("fox").double()
    out = posenc.attend(q, k, v, e, log_gates=gates)
    assert out.shape == (B, H, T, dv)
    ref = posenc.attend(q, k, v, e, log_gates=gates, backend="eager")
    assert torch.allclose(out, ref, atol=1e-8)
    assert torch.allclose(posenc.attend(q.float(), k.float(), v.float(), enc("fox"), log_gates=gates.float()), ref.float(), atol=1e-5)


# 7: dtypes: integers refused, mixed dtypes refused outside autocast, autocast followed as SDPA does
def test_dtypes() -> None:
    q, k, v = qkv()
    with pytest.raises(UsageError) as err:
        posenc.attend(q.long(), k.long(), v.long(), enc("alibi"))
    assert str(err.value) == "q must be a floating-point tensor, got dtype torch.int64"
    with pytest.raises(UsageError) as err:
        posenc.attend(q.double(), k, v, enc("alibi"))
    assert str(err.value) == ("q, k and v must share one dtype, got torch.float64, torch.float32 and torch.float32 "
                              "(or run under torch.autocast)")
    for method in ["rope", "nope", *BIASES]:
        e = enc(method)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = posenc.attend(q, k, v, e)
            sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == sdpa.dtype == torch.bfloat16, method
        assert torch.allclose(out.float(), posenc.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), e).float(), atol=1e-2), method


@pytest.mark.parametrize("method", ["alibi", "t5", "kerple", "fire", "shaw", "transformer_xl"])
def test_autocast_inside_posenc_hf(method: str) -> None:
    transformers = pytest.importorskip("transformers")
    import posenc.hf as phf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = phf.use(transformers.LlamaForCausalLM(config), method)
    ids = torch.randint(0, 64, (1, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


# 11: scale
@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "a", True])
def test_scale_is_checked(scale) -> None:
    q, k, v = qkv()
    for method in ("alibi", "rope", "shaw"):
        with pytest.raises(UsageError) as err:
            posenc.attend(q, k, v, enc(method), scale=scale)
        assert str(err.value) == f"scale must be a finite number > 0 (the factor of q . k) or None, got {scale!r}"


# 12: a query that sees no key gets 0 on every backend
@pytest.mark.parametrize("method", ["nope", "rope", *BIASES])
def test_a_query_that_sees_no_key_gets_zero(method: str) -> None:
    q, k, v = qkv()
    out = posenc.attend(q[:, :, :3], k, v, enc(method), positions=torch.tensor([0, 1, 6]), k_positions=torch.arange(5, 5 + T))
    assert torch.equal(out[:, :, :2], torch.zeros(B, H, 2, D))
    assert torch.isfinite(out).all() and out[:, :, 2].abs().sum() > 0


# 14: empty in, empty out
@pytest.mark.parametrize("method", ["nope", "rope", *BIASES])
def test_empty_inputs(method: str) -> None:
    e = enc(method)
    dv = D if method == "shaw" else 5  # (Shaw's relative value vectors have q's head dim)
    for b, tq, tk in ((1, 0, 0), (0, T, T)):
        q, k, v = torch.randn(b, H, tq, D), torch.randn(b, H, tk, D), torch.randn(b, H, tk, dv)
        out = posenc.attend(q, k, v, e)
        assert out.shape == (b, H, tq, dv) and not out.abs().sum()
