"""What only a GPU can check: flex training on CUDA (T5's table gradient through the score
modifier), the bfloat16 and float16 paths, and decoding on CUDA.

Marked ``cuda``: they skip cleanly without a GPU (``pytest -m cuda`` selects them;
benchmarks/gpu_check.sh runs them on a GPU machine). Every result is held to the eager formula in
float64 (on the CPU) or to the float32 model, never to itself.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import posenc
from models import tiny_lm
from posenc.backends import eager, flex
from posenc.backends.parts import single
from posenc.backends.parts.base import ScoreSpec
from posenc.model.attention import Attention
from posenc.model.generate import stream

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

METHODS = posenc.available()
H, D = 4, 16
CUDA = torch.device("cuda")


def enc_for(method: str, causal: bool = True):
    options = {"t5": dict(num_buckets=32, max_distance=64)}.get(method, {})
    enc = posenc.build(method, num_heads=H, head_dim=D, causal=causal, **options)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return enc


def wide_lm(method: str, dtype=torch.float32) -> posenc.LM:
    return tiny_lm(method, dim=64, positions_std=0.2, weights_std=0.2, seed=0,
                    max_positions=512 if method == "learned" else None)


# --- flex: training on CUDA ------------------------------------------------------------------------


@pytest.mark.skipif(not flex.compile_available("cuda"), reason="torch.compile cannot build CUDA kernels here (Triton)")
@pytest.mark.parametrize("method", ["alibi", "t5"])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_trains_on_cuda_like_the_eager_formula(method, causal):
    """A whole Attention layer on CUDA with auto (flex chosen): output and the gradients of every
    parameter (T5's bucket table through the score modifier) against eager in float64 on the CPU."""
    torch.manual_seed(1)
    layer = Attention(H * D, H, enc_for(method, causal), causal=causal).to(CUDA)
    ref = copy.deepcopy(layer).cpu().double()
    ref.backend = "eager"
    x = torch.randn(2, 300, H * D)
    out = layer(x.to(CUDA))
    assert layer.last_backend == "flex"
    grads = torch.autograd.grad(out, list(layer.parameters()), torch.ones_like(out))
    want = ref(x.double())
    want_grads = torch.autograd.grad(want, list(ref.parameters()), torch.ones_like(want))
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-4, atol=1e-4)
    names = [n for n, _ in layer.named_parameters()]
    for name, g, w in zip(names, grads, want_grads):
        scale = max(1.0, w.abs().max().item())
        assert (g.cpu().double() - w).abs().max().item() <= 1e-4 * scale, name
    if method == "t5":
        table = dict(zip(names, grads))["encoding.relative_attention_bias.weight"]
        assert table.abs().sum() > 0  # the table learns through the score modifier


# --- bfloat16 and float16 --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", METHODS)
def test_half_precision_forward_and_backward_close_to_float32(method, dtype):
    model = wide_lm(method).to(CUDA)
    half = copy.deepcopy(model).to(dtype).train()
    tokens = torch.randint(0, 64, (2, 256), device=CUDA)
    with torch.no_grad():
        want = model(tokens).float()
    got = half(tokens)
    err = (got.float() - want).abs().max().item()
    assert torch.isfinite(got).all() and err <= 0.05 * max(1.0, want.abs().max().item()), err
    got.float().logsumexp(-1).mean().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in half.parameters())


# --- decoding on CUDA ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_cached_decoding_on_cuda_equals_the_full_pass(method):
    model = wide_lm(method).to(CUDA)
    tokens = torch.randint(0, 64, (2, 70), device=CUDA)
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(2)
        parts, at = [], 0
        for n in [40] + [1] * 10 + [20]:
            parts.append(model(tokens[:, at : at + n], cache=cache))
            at += n
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_batched_generation_on_cuda_equals_each_row_alone(method):
    model = wide_lm(method).to(CUDA)
    prompts = [torch.randint(0, 64, (n,), device=CUDA) for n in (5, 17, 9)]

    def run(p):
        steps = list(stream(model, p, 8))
        return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)

    tokens, logits = run(prompts)
    for b, prompt in enumerate(prompts):
        alone_tokens, alone_logits = run([prompt])
        assert torch.equal(tokens[b], alone_tokens[0])
        torch.testing.assert_close(logits[b], alone_logits[0], rtol=0, atol=1e-4)
    again = model.generate(prompts[:1] * 2, 8, do_sample=True, temperature=1.0, top_p=0.9, seed=3)
    assert torch.equal(again, model.generate(prompts[:1] * 2, 8, do_sample=True, temperature=1.0, top_p=0.9, seed=3))


@pytest.mark.parametrize("method", ["nope", "alibi", "t5", "shaw", "transformer_xl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_single_query_paths_on_cuda(method, dtype):
    """One query after 1,000 keys, left-padded rows: auto on CUDA against eager in float64 (CPU)."""
    torch.manual_seed(2)
    enc = enc_for(method)
    b, tk = 3, 1000
    # Inputs and parameters rounded to dtype first: the reference sees what the kernel sees.
    q, k, v = (torch.randn(b, H, n, D).to(dtype) for n in (1, tk, tk))
    enc = enc.to(dtype)
    positions, starts = torch.arange(tk), torch.tensor([0, 40, 990])
    ref = ScoreSpec(encoding=copy.deepcopy(enc).double(), q_positions=positions[-1:], k_positions=positions, causal=True, scale=1 / math.sqrt(D),
                    starts=starts)
    want = eager.attend(q.double(), k.double(), v.double(), ref)
    cuda_enc = copy.deepcopy(enc).to(CUDA)
    spec = ScoreSpec(encoding=cuda_enc, q_positions=positions[-1:].to(CUDA), k_positions=positions.to(CUDA), causal=True, scale=1 / math.sqrt(D),
                     starts=starts.to(CUDA), workspace=single.Workspace(1024))
    from posenc import backends

    name, backend = backends.choose("auto", spec, q.to(CUDA, dtype))
    with torch.no_grad():
        got = backend.attend(q.to(CUDA, dtype), k.to(CUDA, dtype), v.to(CUDA, dtype), spec)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("method", ["alibi", "t5", "transformer_xl"])
def test_decoding_on_cuda_keeps_no_memory_per_step(method):
    """With the capacity reserved, twenty steps leave the allocated memory where one step left it."""
    model = wide_lm(method).to(CUDA)
    cache = model.new_cache(2, capacity=1100, padding=[7, 0])
    with torch.inference_mode():
        model(torch.randint(0, 64, (2, 1000), device=CUDA), cache=cache)
        token = torch.randint(0, 64, (2, 1), device=CUDA)
        model(token, cache=cache)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(20):
            model(token, cache=cache)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
