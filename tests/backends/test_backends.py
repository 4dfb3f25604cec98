"""Attention backends (sdpa, blocked, flex, eager) against the eager formula, and their selection.

Every backend must give the eager formula's outputs and gradients (q, k, v, the T5 table, the
attention's weights) to 1e-5 in float32, causal and bidirectional, full passes and KV-cache
decoding, at sizes that exercise several blocks and the far region of the blocked backend.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from agreement import MaxStorage  # tests/agreement.py: one definition for every memory check
from posenc import backends
from posenc.backends import blocked, eager, flex, sdpa
from posenc.backends.parts import band, tails
from posenc.backends.parts.base import ScoreSpec
from posenc.call.memo import ForwardMemo
from posenc.encodings import alibi_slopes, build
from posenc.encodings.t5 import T5Bias
from posenc.model.attention import Attention, LayerCache
from posenc.model.lm import LM, LMConfig

H, D = 4, 16
TOL = dict(rtol=1e-5, atol=1e-5)
# 32 buckets up to distance 32: T5's band is ~30 keys, so N=300 has a far region and several blocks.
OPTIONS = {"t5": dict(num_buckets=32, max_distance=32)}


def make(method: str, causal: bool) -> nn.Module:
    enc = build(method, num_heads=H, head_dim=D, causal=causal, **OPTIONS.get(method, {}))
    if method == "t5":
        nn.init.normal_(enc.relative_attention_bias.weight)  # order-1 biases, so errors show
    return enc


def run(attend, enc, q, k, v, spec, grad_out, dtype=torch.float32):
    """Output and gradients of (q, k, v, *encoding parameters) for one backend, in float32."""
    enc = copy.deepcopy(enc).to(dtype)
    spec = dataclasses.replace(spec, encoding=enc, memo=ForwardMemo())
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = attend(q, k, v, spec)
    params = [q, k, v, *enc.parameters()]
    return [t.float() for t in (out, *torch.autograd.grad(out, params, grad_out.to(dtype)))]


def reference(enc, q, k, v, spec, grad_out):
    """The eager formula in float64: the exact values every float32 backend is held to."""
    return run(REFERENCE, enc, q, k, v, spec, grad_out, torch.float64)


def assert_agree(got, want, tensors: int = 4):
    """1e-5 on the first ``tensors`` (output, q, k, v gradients). A parameter's gradient (the T5
    table) sums B x N^2 terms, so it is held to 1e-5 of its own scale: float32 eager itself is
    ~5e-6 of it off."""
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        atol = TOL["atol"] * (1 if n < tensors else max(1.0, w.abs().max().item()))
        torch.testing.assert_close(g, w, rtol=TOL["rtol"], atol=atol)


BACKENDS = {
    "blocked": lambda q, k, v, spec: blocked.attend(q, k, v, spec, block=64),
    "sdpa": sdpa.attend,
    "eager-blocked": lambda q, k, v, spec: eager.attend(q, k, v, spec, block=64),
}
REFERENCE = lambda q, k, v, spec: eager.attend(q, k, v, spec, block=10**6)  # noqa: E731 (one block: the plain formula)
# (queries, keys): a full pass; a KV-cache step of 37 tokens; one decoded token; block + 1 (odd).
CAUSAL_SHAPES = [(300, 300), (37, 300), (1, 300), (65, 65)]
ENCODER_SHAPES = [(300, 300), (65, 65)]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("method", ["alibi", "t5", "nope"])
@pytest.mark.parametrize(
    "causal,tq,tk", [(True, *s) for s in CAUSAL_SHAPES] + [(False, *s) for s in ENCODER_SHAPES]
)
def test_backend_agrees_with_eager(backend, method, causal, tq, tk):
    torch.manual_seed(1)
    enc = make(method, causal)
    b = 1 if tq == 300 else 2  # batch 1 runs the blocked band on views, batch 2 on copies
    q, k, v = torch.randn(b, H, tq, D), torch.randn(b, H, tk, D), torch.randn(b, H, tk, D)
    start = 5  # absolute positions need not start at 0
    k_positions = torch.arange(start, start + tk)
    spec = ScoreSpec(encoding=enc, q_positions=k_positions[tk - tq :], k_positions=k_positions, causal=causal, scale=1 / math.sqrt(D))
    grad_out = torch.randn(b, H, tq, D)
    assert_agree(run(BACKENDS[backend], enc, q, k, v, spec, grad_out), reference(enc, q, k, v, spec, grad_out))


def test_blocked_plan_covers_far_region_and_several_blocks():
    """The sizes above do exercise what they are meant to: far calls, batched band blocks."""
    for method in ("alibi", "t5"):
        for causal in (True, False):
            spec = ScoreSpec(encoding=make(method, causal), q_positions=torch.arange(300), k_positions=torch.arange(300), causal=causal, scale=0.25)
            plan = tails.make_plan(spec, 300, 300, block=64)
            assert plan.far and any(call.causal for call in plan.far)  # the shifted causal triangle
            assert method == "t5" or len(plan.far) >= 4  # sloped tail: far blocks of 64 queries
            # T5 writes out a band of batched blocks; ALiBi's bias is all per-key feature: no band.
            assert (method == "alibi") == (not plan.bands)
            assert method == "alibi" or any(group.inner and group.count > 1 for group in plan.bands)
            assert causal or any(call.flip for call in plan.far)


@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "blocked"])
def test_attention_with_kv_cache_agrees_with_eager(method, causal, backend, monkeypatch):
    """Whole Attention layers: a full pass (encoders) or prefill + cached steps (decoders), outputs
    and gradients of every parameter, backend vs eager. Small blocks so 70 tokens span several."""
    monkeypatch.setattr(tails, "BAND_BLOCK", 16)
    monkeypatch.setattr(tails, "TERM_SPAN", 16 * float(alibi_slopes(H).max()))  # far blocks of 16 queries
    monkeypatch.setattr(band, "BAND_GROUP", 2)
    torch.manual_seed(2)
    enc = make(method, causal)
    layers = {name: Attention(H * D, H, copy.deepcopy(enc), causal=causal, backend=name) for name in (backend, "eager")}
    layers[backend].load_state_dict(layers["eager"].state_dict())
    layers["eager"].double()  # the reference in float64
    x = torch.randn(2, 70, H * D)
    results = {}
    for name, layer in layers.items():
        x = x.to(next(layer.parameters()).dtype)
        if causal:  # prefill 40, then 1, 1, 5 and 23 tokens through the cache
            cache, outs, at = LayerCache(), [], 0
            for n in (40, 1, 1, 5, 23):
                outs.append(layer(x[:, at : at + n], cache=cache))
                at += n
            out = torch.cat(outs, dim=1)
        else:
            out = layer(x)
        params = list(layer.parameters())
        results[name] = [t.float() for t in (out, *torch.autograd.grad(out, params, torch.ones_like(out)))]
    assert_agree(results[backend], results["eager"], tensors=1)


def test_blocked_generic_path_for_other_bias_encodings():
    """A bias method without relative_bias/bias_tails: blocked runs the generic per-block path."""

    class PlainBias(T5Bias):
        relative_bias = None
        bias_tails = None

    torch.manual_seed(3)
    enc = PlainBias(H, D, causal=True, num_buckets=32, max_distance=32)
    nn.init.normal_(enc.relative_attention_bias.weight)
    q, k, v = torch.randn(1, H, 90, D), torch.randn(1, H, 150, D), torch.randn(1, H, 150, D)
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(60, 150), k_positions=torch.arange(150), causal=True, scale=0.25)
    assert not blocked.fast_path(spec, 90, 150)
    grad_out = torch.randn(1, H, 90, D)
    got = run(lambda *a: blocked.attend(*a, block=32), enc, q, k, v, spec, grad_out)
    assert_agree(got, reference(enc, q, k, v, spec, grad_out))


@pytest.mark.parametrize("method", ["alibi", "t5"])
def test_blocked_value_head_dim_may_differ(method):
    """v with another head dim than q, k (the flash kernel refuses it): blocked writes it out."""
    torch.manual_seed(7)
    enc = make(method, True)
    q, k, v = torch.randn(1, H, 130, D), torch.randn(1, H, 130, D), torch.randn(1, H, 130, 24)
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(130), k_positions=torch.arange(130), causal=True, scale=0.25)
    grad_out = torch.randn(1, H, 130, 24)
    got = run(lambda *a: blocked.attend(*a, block=32), enc, q, k, v, spec, grad_out)
    assert_agree(got, reference(enc, q, k, v, spec, grad_out))


def test_bias_tails_describe_the_bias():
    """The capabilities blocked relies on: f(r) = score(h, i, i + r), affine beyond the tails."""
    r = torch.arange(-400, 401)
    for method in ("alibi", "t5"):
        for causal in (True, False):
            enc = make(method, causal)
            f = enc.relative_bias(r)  # (H, R)
            torch.testing.assert_close(f, enc.bias(torch.zeros(1, dtype=torch.long), r)[:, 0])
            tails = enc.bias_tails()
            at = lambda d: f[:, d + 400]  # noqa: E731
            for d in range(-400, -tails.past + 1):
                slope = 0 if tails.past_slope is None else tails.past_slope * (d + tails.past)
                torch.testing.assert_close(at(d), at(-tails.past) + slope)
            if not causal:
                for d in range(tails.future, 401):
                    slope = 0 if tails.future_slope is None else tails.future_slope * (d - tails.future)
                    torch.testing.assert_close(at(d), at(tails.future) + slope)
    # T5: the last bucket (32 buckets, max distance 128) starts at distance 113, as the bucket function says
    assert build("t5", num_heads=2, head_dim=4).bias_tails().past == 113


def test_blocked_alibi_precision_at_long_range():
    """Steep ALiBi slopes over 1024 keys: blocked stays as close to float64 as a dense float32 bias.
    (One reference position for all queries would lose ~3e-5 here: docs/precision.md.)"""
    torch.manual_seed(4)
    h, n = 8, 1024  # 8 heads: slopes down from 1/2
    enc = build("alibi", num_heads=h, head_dim=D)
    q, k, v = (torch.randn(1, h, n, D) * 2 for _ in range(3))
    pos = torch.arange(n)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=0.25)
    with torch.no_grad():
        exact = eager.attend(q.double(), k.double(), v.double(), ScoreSpec(encoding=enc.double(), q_positions=pos, k_positions=pos, causal=True,
                                                                           scale=0.25))
        enc.float()
        dense = (sdpa.attend(q, k, v, spec).double() - exact).abs().max().item()
        ours = (blocked.attend(q, k, v, spec).double() - exact).abs().max().item()
    assert ours <= max(2 * dense, 2e-6), (ours, dense)


def test_blocked_bfloat16_close_to_float32():
    torch.manual_seed(5)
    for method in ("alibi", "t5"):
        enc = make(method, True)
        q, k, v = (torch.randn(1, H, 200, D) for _ in range(3))
        pos = torch.arange(200)
        spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=0.25)
        want = eager.attend(q, k, v, spec)
        got = blocked.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), spec, block=64)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0, atol=5e-2)


@pytest.mark.parametrize("method", ["alibi", "t5"])
@pytest.mark.parametrize("causal", [True, False])
def test_no_quadratic_tensor(method, causal):
    """Forward and backward at N=1024: blocked and eager never make anything near (N, N)."""
    n = 1024
    enc = build(method, num_heads=H, head_dim=D, causal=causal)
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)
    for attend in (blocked.attend, lambda *a: eager.attend(*a, block=64)):
        spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=causal, scale=0.25)
        with MaxStorage() as seen:
            attend(q, k, v, spec).sum().backward()
        # A quarter of ONE head's (N, N) square: a full (N, N) tensor, even for a single head,
        # fails this (the band and query blocks are O(H x block x N); the non-causal kernel's mask
        # is a (1, H, N, N) view of an (H, 2N - 1) table: its storage is what counts).
        assert seen.largest <= n * n // 4, seen.largest


# --- selection -----------------------------------------------------------------------------------


def spec_for(method: str, causal: bool = True) -> tuple[ScoreSpec, torch.Tensor]:
    enc = build(method, num_heads=H, head_dim=D, causal=causal)
    pos = torch.arange(8)
    return ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=causal, scale=0.25), torch.randn(1, H, 8, D, requires_grad=True)


def chosen(method: str, causal: bool = True, grad: bool = True, dtype=torch.float32) -> str:
    spec, q = spec_for(method, causal)
    with torch.set_grad_enabled(grad):
        name, backend = backends.choose("auto", spec, q.to(dtype))
    assert backends.BACKENDS[name] is backend and backends.name_of(backend) == name
    return name


def test_auto_picks_sdpa_without_score_terms():
    for method in ("nope", "rope", "sinusoidal", "learned"):
        for causal in (True, False):
            assert chosen(method, causal) == "sdpa"


def test_auto_picks_blocked_for_bias_methods_on_cpu():
    for method in ("alibi", "t5"):
        for causal in (True, False):
            for grad in (True, False):
                for dtype in (torch.float32, torch.bfloat16):
                    assert chosen(method, causal, grad, dtype) == "blocked"


def test_auto_never_picks_bias_backends_for_query_value_terms():
    for method in ("shaw", "transformer_xl"):
        assert chosen(method) not in ("sdpa", "blocked", "flex")


def test_flex_is_never_offered_where_it_cannot_run():
    spec, q = spec_for("alibi")
    with torch.enable_grad():
        assert not flex.supports(spec, q)  # no CPU backward
    assert not flex.supports(*spec_for("shaw"))
    assert not flex.preferred(spec, q.detach())  # CPU: blocked is faster and needs no compile


@pytest.mark.parametrize("method,backend", [("shaw", "sdpa"), ("transformer_xl", "blocked"), ("shaw", "flex"), ("alibi", "flex")])
def test_forcing_a_backend_that_cannot_run_raises(method, backend):
    enc = build(method, num_heads=H, head_dim=D)
    layer = Attention(H * D, H, enc, backend=backend)
    with pytest.raises(ValueError, match="allowed") as error:
        layer(torch.randn(1, 6, H * D))  # with grad: flex has no CPU backward
    assert "eager" in str(error.value) and repr(backend) in str(error.value)


def test_unknown_backend_names_are_refused_early():
    with pytest.raises(ValueError, match="attention backend"):
        Attention(H * D, H, build("alibi", num_heads=H, head_dim=D), backend="fast")
    with pytest.raises(ValueError, match="attention backend"):
        LMConfig(encoding="alibi", attention_backend="fast")


def test_lm_config_forces_a_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(eager, "attend", lambda *a, **k: calls.append(1) or sdpa.attend(*a))
    model = LM(LMConfig(encoding="alibi", dim=32, depth=2, num_heads=2, attention_backend="eager"))
    model(torch.randint(0, 256, (1, 10)))
    assert len(calls) == 2


def test_backends_are_tried_in_the_order_of_one_list(monkeypatch):
    class Everything:
        supports = preferred = staticmethod(lambda spec, q: True)
        attend = staticmethod(eager.attend)

    assert isinstance(Everything, backends.Backend)
    order = dict(backends.BACKENDS)
    late = {**{k: v for k, v in order.items() if k != "eager"}, "late": Everything, "eager": eager}
    monkeypatch.setattr(backends, "BACKENDS", late)
    assert backends.check_name("late") == "late"
    assert chosen("nope") == "sdpa"  # earlier backends still win
    assert list(backends.BACKENDS)[-2:] == ["late", "eager"]
    monkeypatch.setattr(backends, "BACKENDS", {"everything": type("First", (Everything,), {}), **order})
    assert chosen("nope") == chosen("shaw") == "everything"


def test_backend_file_names_are_their_registered_names():
    for name, backend in backends.BACKENDS.items():
        assert backend.__name__ == f"posenc.backends.{name}"
        assert name in backends.names()


def test_the_backends_folder_holds_registered_backends_only():
    folder = Path(backends.__file__).parent
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    assert modules == set(backends.BACKENDS)  # helpers live in backends/parts/
    assert (folder / "parts" / "__init__.py").exists()


# --- shared work ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["blocked", "eager"])
def test_t5_bias_is_computed_once_per_forward(backend, monkeypatch):
    model = LM(LMConfig(encoding="t5", dim=32, depth=3, num_heads=2, attention_backend=backend))
    enc = model.encoding
    hook = "relative_bias" if backend == "blocked" else "bias"
    calls = []
    original = getattr(enc, hook)
    monkeypatch.setattr(enc, hook, lambda *a: calls.append(1) or original(*a))
    model(torch.randint(0, 256, (2, 20)))
    assert len(calls) == 1
    model(torch.randint(0, 256, (2, 20)))
    assert len(calls) == 2


# --- flex (compiles: one small case, skipped where torch.compile cannot build) ---------------------


@pytest.mark.skipif(not flex.compile_available("cpu"), reason="torch.compile cannot build CPU kernels here")
def test_flex_agrees_with_eager_for_cpu_inference():
    torch.manual_seed(6)
    enc = make("t5", True)
    q, k, v = torch.randn(1, H, 7, D), torch.randn(1, H, 40, D), torch.randn(1, H, 40, D)
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(33, 40), k_positions=torch.arange(40), causal=True, scale=0.25)
    with torch.no_grad():
        assert flex.supports(spec, q)
        torch.testing.assert_close(flex.attend(q, k, v, spec), eager.attend(q, k, v, spec), **TOL)


@pytest.mark.skipif(not flex.compile_available("cpu"), reason="torch.compile cannot build CPU kernels here")
def test_flex_keeps_no_encoding_alive():
    import gc
    import weakref

    enc = make("alibi", True)
    q = torch.randn(1, H, 16, D)
    spec = ScoreSpec(encoding=enc, q_positions=torch.arange(16), k_positions=torch.arange(16), causal=True, scale=0.25)
    with torch.no_grad():
        flex.attend(q, q, q, spec)
    assert enc in flex._score_mods
    ref = weakref.ref(enc)
    del enc, spec
    gc.collect()
    assert ref() is None
    assert len(flex._score_mods) == 0


# --- ALiBi's feature path: head groups, windows, and the fallback without flash ops ----------------


def test_alibi_heads_are_grouped_by_slope():
    """Steep heads walk small far blocks, gentle ones large blocks; every group has >= 2 heads."""
    slopes = alibi_slopes(8)  # 1/2 .. 1/256
    groups = tails.head_groups(slopes, torch.float32, 4096, None, spread=10.0, past=0)
    covered = [h for heads, _, _ in groups for h in range(*heads.indices(8)[:2])]
    assert covered == list(range(8))
    assert all(heads.stop - heads.start >= tails.MIN_GROUP_HEADS for heads, _, _ in groups)
    rows = [r for _, r, _ in groups]
    assert rows[0] is not None and rows[0] * float(slopes[0]) <= tails.TERM_SPAN  # precision bound
    assert rows[-1] is None or rows[-1] > rows[0]  # gentle heads: larger blocks (or one)
    for heads, _, window in groups:  # a key past the window weighs below 2^-150 of the diagonal's
        s = float(slopes[heads].min())
        assert window is not None and s * window >= tails.ZERO_LOGIT + 2 * 10.0
    # float64, a constant tail or a forced block: one group of every head, no window.
    assert tails.head_groups(slopes, torch.float64, 4096, None, 10.0, 0) == [(slice(None), None, None)]
    assert tails.head_groups(None, torch.float32, 4096, None, 10.0, 0) == [(slice(None), None, None)]


def test_steep_alibi_heads_take_far_calls_where_the_window_is_over_half_the_queries():
    """At N=512 the steep heads' windows (several hundred keys) are over half the queries: they take
    windowed far calls with the per-key feature, not a written-out band, and stay exact."""
    torch.manual_seed(8)
    h, n = 8, 512
    enc = build("alibi", num_heads=h, head_dim=D)
    q, k, v = (torch.randn(1, h, n, D) for _ in range(3))
    pos = torch.arange(n)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=1 / math.sqrt(D))
    plan = tails.make_plan(spec, n, n, torch.float32, None, tails.spread(q, k, spec.scale))
    windows = [w for _, _, w in tails.head_groups(enc.bias_tails().past_slope, torch.float32, n, None,
                                                   tails.spread(q, k, spec.scale), 0)]
    assert windows[0] is not None and tails.BAND_SHARE * windows[0] > n  # the steepest group's window
    assert not plan.bands and any(c.heads.start == 0 for c in plan.far)
    grad_out = torch.randn(1, h, n, D)
    assert_agree(run(blocked.attend, enc, q, k, v, spec, grad_out), reference(enc, q, k, v, spec, grad_out))


@pytest.mark.parametrize("as_band", [True, False])
def test_alibi_windows_leave_out_only_keys_that_weigh_nothing(as_band, monkeypatch):
    """At N=2048 the steep heads' windows drop most far keys; the result is float64's to float32
    precision (and no worse than a dense float32 bias). Steep heads run as a written-out band of
    their window (as_band) or as windowed far calls with the per-key feature."""
    if not as_band:
        monkeypatch.setattr(tails, "BAND_WINDOW", 0)
    torch.manual_seed(8)
    h, n = 8, 2048
    enc = build("alibi", num_heads=h, head_dim=D)
    q, k, v = (torch.randn(1, h, n, D) for _ in range(3))
    pos = torch.arange(n)
    spec = ScoreSpec(encoding=enc, q_positions=pos, k_positions=pos, causal=True, scale=1 / math.sqrt(D))
    plan = tails.make_plan(spec, n, n, torch.float32, None, tails.spread(q, k, spec.scale))
    steep_band = [g for g in plan.bands if g.heads.start == 0]
    steep_far = [c for c in plan.far if c.heads.start == 0]
    if as_band:  # every key that weighs anything is within the window: a band of that many distances
        assert steep_band and not steep_far
        assert all(g.past <= tails.BAND_WINDOW + 1 and g.length < n // 2 for g in steep_band)
    else:
        assert steep_far and not steep_band
        rectangles = [c for c in steep_far if not c.causal]
        assert max(c.region.keys[1] - c.region.keys[0] for c in rectangles) < n // 2  # far keys left out
    grad_out = torch.randn(1, h, n, D)
    with torch.no_grad():
        exact = eager.attend(q.double(), k.double(), v.double(), ScoreSpec(encoding=enc.double(), q_positions=pos, k_positions=pos, causal=True,
                                                                           scale=1 / math.sqrt(D)))
        enc.float()
        dense = (sdpa.attend(q, k, v, spec).double() - exact).abs().max().item()
    got = run(blocked.attend, enc, q, k, v, spec, grad_out)
    assert (got[0].double() - exact).abs().max().item() <= max(2 * dense, 2e-6)
    assert_agree(got, reference(enc, q, k, v, spec, grad_out))


def test_without_flash_ops_bias_methods_fall_back_to_public_sdpa():
    """A torch without the private CPU flash ops: one warning at import, auto picks public SDPA for
    bias methods and eager for query/value terms, and the results are unchanged."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import warnings, torch
        namespace = type(torch.ops.aten)
        original = namespace.__getattr__
        def hide(self, name):
            if name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
                raise AttributeError(name)
            return original(self, name)
        namespace.__getattr__ = hide
        for name in [n for n in vars(torch.ops.aten) if n.startswith("_scaled_dot_product_flash_attention_for_cpu")]:
            delattr(torch.ops.aten, name)  # ops looked up already are cached as attributes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import posenc
            from posenc.backends.parts import regions
        flash = [w for w in caught if "flash" in str(w.message)]
        assert len(flash) == 1 and not regions.FLASH_OPS, [str(w.message) for w in caught]
        torch.manual_seed(0)
        for method, want in (("alibi", "sdpa"), ("t5", "sdpa"), ("shaw", "eager"), ("transformer_xl", "eager")):
            fast = posenc.Attention(32, 2, posenc.build(method, num_heads=2, head_dim=16))
            slow = posenc.Attention(32, 2, posenc.build(method, num_heads=2, head_dim=16), backend="eager")
            slow.load_state_dict(fast.state_dict())
            x = torch.randn(1, 40, 32)
            torch.testing.assert_close(fast(x), slow(x), rtol=1e-5, atol=1e-5)
            assert fast.last_backend == want, (method, fast.last_backend)
        print("ok")
    ''')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("method", ["alibi", "t5", "shaw", "transformer_xl", "cope", "sandwich", "rope", "fire"])
def test_selection_fills_nothing(method):
    """Choosing a path only reads the call: every backend's supports and preferred, auto's choice
    and the decode-step predicate (single.applies, which posenc.attend and terms ask before choosing
    a single-query path) leave the decode workspace and the forward memo as they were on a
    left-padded decode step (single.applies used to fill the workspace's padding mask)."""
    enc = build(method, num_heads=H, head_dim=D)
    positions = torch.arange(40)
    workspace, memo = backends.parts.single.Workspace(capacity=16), ForwardMemo()
    spec = ScoreSpec(encoding=enc, q_positions=positions[-1:], k_positions=positions, causal=True, scale=0.25, memo=memo, starts=torch.tensor([0,
                     7]), workspace=workspace)
    q, k, v = torch.randn(2, H, 1, D), torch.randn(2, H, 40, D), torch.randn(2, H, 40, D)
    with torch.no_grad():
        assert backends.parts.single.applies(spec, q, k, v)  # a decode step: row 1's query is real
        names = backends.allowed(spec, q)
        preferred = [name for name, backend in backends.BACKENDS.items() if backend.preferred(spec, q)]
        chosen, _ = backends.choose("auto", spec, q)
    assert chosen in names and chosen in preferred + ["eager"]
    assert workspace._entries == {} and workspace.capacity == 16  # no padding mask, no f(r) vector, no scratch
    assert memo._values == {}
    # The check can see a fill: the decode step itself makes the padding mask (CoPE's rows are split
    # into unpadded calls instead, which keep nothing).
    with torch.no_grad():
        backends.BACKENDS[chosen].attend(q, k, v, spec)
    assert (workspace._entries != {}) == (method != "cope")


@pytest.mark.parametrize("backend", ["contextual", "eager"])
def test_contextual_runs_left_padded_rows_as_eager_does(backend):
    """CoPE with a left-padded KV cache: the contextual backend splits the rows (padding.by_rows) and
    gives eager's result; its band path alone knows no padding (it gave another result before)."""
    torch.manual_seed(0)
    model = LM(LMConfig(encoding="cope", dim=32, depth=1, num_heads=2, attention_backend=backend)).eval()
    reference = copy.deepcopy(model)
    reference.blocks[0].attn.backend = "eager"
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        out = model(tokens, cache=model.new_cache(batch_size=2, padding=[0, 5]))
        want = reference.double()(tokens, cache=reference.new_cache(batch_size=2, padding=[0, 5]))
    assert model.blocks[0].attn.last_backend == backend
    torch.testing.assert_close(out[1, 5:].double(), want[1, 5:], **TOL)  # the padded row's real tokens
    torch.testing.assert_close(out[0].double(), want[0], **TOL)
