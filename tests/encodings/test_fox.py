"""The Forgetting Transformer (Lin et al. 2025, eq. 2-4) against its formula written out in float64.

Reference, pair by pair: f_t = sigmoid(w_h . x_t + b_h), logit_ij = q_i . k_j / sqrt(D) +
sum_{l=j+1..i} log f_l (the sum over the gates in between, summed term by term, no cumsum), keys
after the query masked; out = proj(softmax(logit) v).
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from agreement import assert_decoding_equals_full
from posenc.errors import UsageError
from posenc.model.cache import LayerCache

H, D = 2, 8


def layer(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    enc = posenc.build("fox", num_heads=H, head_dim=D)
    attn = posenc.Attention(H * D, H, enc, **kw).to(dtype)
    with torch.no_grad():  # gates from strongly forgetting to nearly open, so the decay shows
        enc.gate.weight.normal_(0, 1.0)
        enc.gate.bias.uniform_(-2, 4)
    return attn


def formula(attn, x, documents=None):
    """The paper's equations, one pair and one gate at a time (float64)."""
    b, t, _ = x.shape
    q, k, v = attn.qkv(x).split(H * D, dim=-1)
    q, k, v = (z.view(b, t, H, D) for z in (q, k, v))
    log_f = torch.nn.functional.logsigmoid(x @ attn.encoding.gate.weight.t() + attn.encoding.gate.bias)  # (B, T, H)
    out = torch.zeros(b, t, H, D, dtype=x.dtype)
    for r in range(b):
        for i in range(t):
            keys = [j for j in range(i + 1) if documents is None or documents[r][j] == documents[r][i]]
            logits = []
            for j in keys:
                decay = sum((log_f[r, s] for s in range(j + 1, i + 1)), torch.zeros(H, dtype=x.dtype))
                logits.append((q[r, i] * k[r, j]).sum(-1) / math.sqrt(D) + decay)  # (H,)
            p = torch.softmax(torch.stack(logits), dim=0)  # (keys, H)
            out[r, i] = (p[:, :, None] * v[r, keys]).sum(0)
    return attn.proj(out.reshape(b, t, H * D))


def test_output_and_gradients_equal_the_formula_in_float64():
    attn = layer()
    x = torch.randn(2, 12, H * D, dtype=torch.float64, requires_grad=True)
    got, want = attn(x), formula(attn, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(got)
    params = [x, *attn.parameters()]
    names = ["x"] + [n for n, _ in attn.named_parameters()]
    assert "encoding.gate.weight" in names and "encoding.gate.bias" in names
    for name, a, b in zip(names, torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")
        assert a.abs().sum() > 0, name


def test_the_gates_matter():
    """The check can fail: the same layer with every gate open (log f = 0) is NoPE, and differs."""
    attn = layer()
    x = torch.randn(1, 12, H * D, dtype=torch.float64)
    nope = posenc.Attention(H * D, H, posenc.build("nope", num_heads=H, head_dim=D)).double()
    nope.load_state_dict({n: p for n, p in attn.state_dict().items() if not n.startswith("encoding.")})
    assert (attn(x) - nope(x)).abs().max() > 1e-2
    with torch.no_grad():
        attn.encoding.gate.weight.zero_()
        attn.encoding.gate.bias.fill_(60.0)  # sigmoid(60) = 1 to float64's precision
    torch.testing.assert_close(attn(x), nope(x), rtol=1e-12, atol=1e-12)


def test_packed_documents_restart_the_sum():
    attn = layer(1)
    docs = [[0] * 5 + [1] * 4 + [2] * 3, [0] * 12]
    x = torch.randn(2, 12, H * D, dtype=torch.float64)
    got = attn(x, document_ids=torch.tensor(docs))
    torch.testing.assert_close(got, formula(attn, x, docs), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[:1, 5:9], attn(x[:1, 5:9]), rtol=1e-10, atol=1e-10)  # a document alone


def test_a_padded_batch_equals_its_rows_alone():
    attn = layer(2)
    x = torch.randn(2, 10, H * D, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    got = attn(x, attention_mask=mask)
    torch.testing.assert_close(got[1:, 4:], attn(x[1:, 4:]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[:1], attn(x[:1]), rtol=1e-10, atol=1e-10)


def test_cached_decoding_equals_the_full_pass():
    config = posenc.LMConfig(vocab_size=32, dim=32, depth=2, num_heads=4, encoding="fox")
    torch.manual_seed(3)
    model = posenc.LM(config).eval()
    for block in model.blocks:
        with torch.no_grad():
            block.attn.encoding.gate.weight.normal_(0, 1.0)
    assert_decoding_equals_full(model, length=20)


def test_float32_stays_close_over_a_long_sequence():
    """c grows with T (strongly forgetting gates: c ~ -T); the float32 sums still give float64's output."""
    attn = layer(4, dtype=torch.float64)
    with torch.no_grad():
        attn.encoding.gate.bias.fill_(-1.0)
    x = torch.randn(1, 1500, H * D, dtype=torch.float64)
    with torch.no_grad():
        want = attn(x)
        got = attn.float()(x.float())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_attend_takes_the_gates_and_refuses_to_run_without_them():
    enc = posenc.build("fox", num_heads=H, head_dim=D).double()
    q, k, v = (torch.randn(1, H, 9, D, dtype=torch.float64) for _ in range(3))
    x = torch.randn(1, 9, H * D, dtype=torch.float64)
    with pytest.raises(UsageError, match="pass log_gates=encoding.log_gates"):
        posenc.attend(q, k, v, enc)
    with pytest.raises(UsageError, match=r"log_gates must be a float tensor of shape \(batch, heads, keys\) = \(1, 2, 9\)"):
        posenc.attend(q, k, v, enc, log_gates=torch.zeros(1, 9, 2))
    gates = enc.log_gates(x)
    out = posenc.attend(q, k, v, enc, log_gates=gates)
    c = gates.cumsum(-1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D) + c[..., :, None] - c[..., None, :]
    logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-12, atol=1e-12)
    # Gates are refused by a method without them (tests/test_errors.py); fox with gates from
    # elsewhere is NoPE plus those gates: attend reads only the gates given.
    other = posenc.build("fox", num_heads=H, head_dim=D).double()
    torch.testing.assert_close(posenc.attend(q, k, v, other, log_gates=gates), out, rtol=1e-12, atol=1e-12)


def test_fox_has_no_bidirectional_form():
    with pytest.raises(UsageError, match="no bidirectional form"):
        posenc.build("fox", num_heads=H, head_dim=D, causal=False)


def test_grouped_query_heads_equal_repeated_heads():
    """The gates stay per query head; keys and values grouped (Hkv = 1) equal them repeated."""
    torch.manual_seed(5)
    enc = posenc.build("fox", num_heads=H, head_dim=D).double()
    gqa = posenc.Attention(H * D, H, enc, num_kv_heads=1).double()
    full = posenc.Attention(H * D, H, enc).double()
    q_w, k_w, v_w = gqa.qkv.weight.split((H * D, D, D))
    with torch.no_grad():
        full.qkv.weight.copy_(torch.cat([q_w, k_w.repeat(H, 1), v_w.repeat(H, 1)]))
        full.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(2, 11, H * D, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), full(x), rtol=1e-12, atol=1e-12)
    cache = LayerCache()
    with torch.no_grad():
        steps = torch.cat([gqa(x[:, :6], cache=cache)] + [gqa(x[:, t : t + 1], cache=cache) for t in range(6, 11)], 1)
    torch.testing.assert_close(steps, full(x), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# The gated backend (the gates as one key feature on the fused kernel) against eager.


@pytest.mark.parametrize("tq, tk", [(300, 300), (37, 300), (1, 300), (65, 65), (513, 513)])
def test_the_gated_backend_equals_eager(tq, tk):
    from posenc.backends import eager, gated
    from posenc.call.spec import ScoreSpec

    torch.manual_seed(tq + tk)
    enc = posenc.build("nope", num_heads=H, head_dim=D)
    q, k, v = torch.randn(2, H, tq, D), torch.randn(2, H, tk, D), torch.randn(2, H, tk, D)
    g = torch.nn.functional.logsigmoid(torch.randn(2, H, tk) * 2 + 1)  # (B, H, Tk) log gates
    grad_out = torch.randn(2, H, tq, D)
    kp = torch.arange(5, 5 + tk)
    results = {}
    for name, backend, dtype in (("eager", eager, torch.float64), ("gated", gated, torch.float64), ("gated32", gated, torch.float32)):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v, g)]
        spec = ScoreSpec(encoding=enc, q_positions=kp[tk - tq :], k_positions=kp, causal=True, scale=D ** -0.5, log_gates=xs[3])
        assert name == "eager" or gated.supports(spec, xs[0])
        out = backend.attend(*xs[:3], spec)
        results[name] = [out] + list(torch.autograd.grad(out, xs, grad_out.to(dtype)))
    for n, (a, b) in enumerate(zip(results["gated"], results["eager"])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"tensor {n}: {m}")
    for n, (a, b) in enumerate(zip(results["gated32"], results["eager"])):
        # as agreement.py: 1e-5 of the scale on outputs and q, k, v gradients, 1e-4 on the gates'
        # (sums over every query after the key); float32 eager is as far off
        tol = (1e-5 if n < 4 else 1e-4) * max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, rtol=0, atol=tol, msg=lambda m: f"float32 tensor {n}: {m}")


def test_auto_picks_gated_and_eager_takes_what_it_cannot():
    attn = layer(dtype=torch.float32)
    x = torch.randn(2, 40, H * D)
    attn(x)
    assert attn.last_backend == "gated"
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :9] = 0
    attn(x, attention_mask=mask)  # segments: each row alone, unpadded
    assert attn.last_backend == "gated"
    cache = LayerCache(padding=[3, 0])
    with torch.no_grad():
        attn(x[:, :10], cache=cache)  # left padding in the cache: eager
    assert attn.last_backend == "eager"


def test_the_gated_backend_writes_no_quadratic_tensor():
    from agreement import MaxTensor

    n = 1024
    attn = posenc.Attention(H * D, H, posenc.build("fox", num_heads=H, head_dim=D))
    x = torch.randn(1, n, H * D, requires_grad=True)
    with MaxTensor() as seen:
        attn(x).sum().backward()
    assert attn.last_backend == "gated"
    assert seen.largest <= H * n * 128, seen.largest  # one block's (H, 128, N) at most, not (H, N, N)
    attn.backend = "eager"
    with MaxTensor() as eager_seen:
        attn(x).sum().backward()
    assert eager_seen.largest >= H * n * 256  # the check sees a block of scores


def test_the_feature_path_without_the_flash_kernel_equals_the_kernel_path(monkeypatch):
    """Where the CPU flash kernel with its log-sum-exp is missing, the gates ride on the keys as a
    feature of public SDPA: the same outputs and gradients (float64)."""
    from posenc.backends import gated
    from posenc.call.spec import ScoreSpec

    torch.manual_seed(7)
    enc = posenc.build("nope", num_heads=H, head_dim=D)
    q, k, v = (torch.randn(1, H, 200, D, dtype=torch.float64) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, H, 200, dtype=torch.float64) * 2 + 1)
    grad_out = torch.randn(1, H, 200, D, dtype=torch.float64)
    results = []
    for kernel in (True, False):
        monkeypatch.setattr(gated, "use_kernel", lambda q, v, kernel=kernel: kernel)
        xs = [x.clone().requires_grad_() for x in (q, k, v, g)]
        spec = ScoreSpec(encoding=enc, q_positions=torch.arange(200), k_positions=torch.arange(200), causal=True, scale=D ** -0.5, log_gates=xs[3])
        out = gated.attend(*xs[:3], spec, block=64)
        results.append([out, *torch.autograd.grad(out, xs, grad_out)])
    for n, (a, b) in enumerate(zip(*results)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"tensor {n}: {m}")
