"""The KV cache (posenc/model/cache.py) and the single-query paths (backends/parts/single.py).

The in-place cache against the old concatenating one, bit for bit; growth by doubling; crop and
reset; left padding; misuse as clear errors; every single-query path against the eager formula; and
a decode step that allocates nothing growing with the cache length."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import posenc
from models import tiny_lm
from posenc import backends
from posenc.backends import blocked, eager, flex, sdpa, terms
from posenc.backends.parts import single
from posenc.backends.parts.base import ScoreSpec
from posenc.encodings.protocol import ClippedTables, Curves, DistanceKeys, RelativeBias, Remaps, offers
from posenc.errors import UsageError
from posenc.model.attention import LayerCache
from toy_encodings import registered

METHODS = posenc.available()
ALL = METHODS + ["toy_scaled_rope", "toy_absolute_key"]


@pytest.fixture(autouse=True)
def _toys_and_one_thread(monkeypatch, one_thread):  # one_thread: conftest.py
    registered(monkeypatch)


def large_weights_lm(method: str, backend: str = "auto", depth: int = 2) -> posenc.LM:
    """Every weight matrix and position parameter redrawn large (tests/models.py), so that a wrong
    key or position shows far above rounding."""
    return tiny_lm(method, depth=depth, attention_backend=backend, weights_std=0.3,
                    max_positions=1024 if method == "learned" else None)


class ConcatLayerCache(LayerCache):
    """The old cache: every append concatenates the whole cache (the reference)."""

    def append(self, k, v):
        self.k = k if self.length == 0 else torch.cat((self.k[:, :, : self.length], k), dim=-2)
        self.v = v if self.length == 0 else torch.cat((self.v[:, :, : self.length], v), dim=-2)
        self.length = self.k.shape[-2]
        return self.k, self.v


def decode(model, tokens, chunks, cache):
    outs, at = [], 0
    for n in chunks:
        outs.append(model(tokens[:, at : at + n], cache=cache))
        at += n
    return torch.cat(outs, dim=1)


# --- the cache itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL)
def test_in_place_cache_equals_the_concatenating_one_bit_for_bit(method):
    # A length-dependent rotation: one layer, since a deeper layer's cached keys come from hidden
    # states of earlier steps, computed at earlier lengths (no cache can equal the full pass there).
    model = large_weights_lm(method, depth=1 if method == "toy_scaled_rope" else 2)
    tokens = torch.randint(0, 64, (2, 40))
    chunks = [7, 1, 1, 1, 12, 1, 17]  # grows past 16 and 32 on the way (capacities 16, 32, 64)
    with torch.no_grad():
        new = model.new_cache(2)
        got = decode(model, tokens, chunks, new)
        old = model.new_cache(2)
        old.layers = [ConcatLayerCache(workspace=old.workspace) for _ in old.layers]
        want = decode(model, tokens, chunks, old)
        # and both are the full pass: of each chunk's prefix, for a rotation that depends on the
        # current length (a chunk's queries see the length at its end, as the full pass of it)
        ends = torch.tensor(chunks).cumsum(0).tolist()
        full = torch.cat([model(tokens[:, :end])[:, end - n :] for n, end in zip(chunks, ends)], dim=1)
    assert new.layers[0].capacities == [16, 32, 64]
    assert torch.equal(got, want)
    torch.testing.assert_close(got, full, rtol=0, atol=2e-5)


def test_growth_by_doubling_keeps_every_token():
    cache = LayerCache()
    ks = [torch.randn(1, 2, n, 4) for n in [5] + [1] * 20 + [40, 1]]
    for k in ks:
        cache.append(k, -k)
    # 5 -> 16 (the minimum); 17 -> 32; 65 -> max(65, 64); 66 -> 130
    assert cache.capacities == [16, 32, 65, 130]
    k_all, v_all = cache.append(torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4))
    assert torch.equal(k_all, torch.cat(ks, dim=2)) and torch.equal(v_all, -torch.cat(ks, dim=2))
    reserved = LayerCache(capacity=100)
    for k in ks:
        reserved.append(k, k)
    assert reserved.capacities == [100]  # a reserve large enough never reallocates


@pytest.mark.parametrize("method", ["alibi", "rope", "toy_scaled_rope", "transformer_xl"])
def test_crop_and_reset(method):
    model = large_weights_lm(method, depth=1 if method == "toy_scaled_rope" else 2)

    a, b = torch.randint(0, 64, (1, 10)), torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        cache = model.new_cache(1)
        model(a, cache=cache)
        buffer = cache.layers[0].k.data_ptr()
        cache.crop(6)  # forget 4 tokens, then decode others in their place
        assert cache.length == 6
        got = decode(model, b, [1, 3], cache)
        prefix = torch.cat((a[:, :6], b), dim=1)
        want = torch.cat((model(prefix[:, :7])[:, 6:], model(prefix)[:, 7:]), dim=1)  # chunk by chunk (see above)

        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        cache.reset()
        assert cache.length == 0
        again = model(a, cache=cache)
        assert cache.layers[0].k.data_ptr() == buffer  # the memory is kept
        torch.testing.assert_close(again, model(a), rtol=0, atol=2e-5)
    with pytest.raises(UsageError, match=r"crop length must be an integer in \[0, 10\]"):
        cache.crop(11)
    with pytest.raises(UsageError, match="crop length"):
        cache.layers[0].crop(-1)


def test_a_cache_filled_in_inference_mode_continues_outside_it():
    model = large_weights_lm("alibi")
    tokens = torch.randint(0, 64, (1, 12))
    cache = model.new_cache(1)
    with torch.inference_mode():
        first = model(tokens[:, :8], cache=cache)
    with torch.no_grad():  # inference tensors cannot be written here: the cache copies itself once
        rest = decode(model, tokens[:, 8:], [1, 3], cache)
    torch.testing.assert_close(torch.cat((first, rest), 1), model(tokens).detach(), rtol=0, atol=2e-5)


def test_cached_decoding_with_autograd_still_backpropagates():
    model = large_weights_lm("alibi").train()
    tokens = torch.randint(0, 64, (1, 9))
    cache = model.new_cache(1)
    out = decode(model, tokens, [5, 1, 3], cache)  # appends concatenate: earlier views stay intact
    out.sum().backward()
    assert model.tok.weight.grad is not None and model.tok.weight.grad.abs().sum() > 0


def test_cache_misuse_is_a_clear_error():
    model, other = large_weights_lm("alibi"), large_weights_lm("alibi")
    cache = model.new_cache(2)
    with pytest.raises(UsageError, match="at least one token per row"):
        model(torch.zeros(2, 0, dtype=torch.long), cache=cache)
    with pytest.raises(UsageError, match="made by another model"):
        other(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(UsageError, match="batch_size=2, tokens have batch 3"):
        model(torch.zeros(3, 3, dtype=torch.long), cache=cache)
    with pytest.raises(UsageError, match="cache must come from"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=LayerCache())
    with pytest.raises(UsageError, match="padding must hold one integer >= 0 per row"):
        model.new_cache(2, padding=[1])
    with pytest.raises(UsageError, match="padding must hold one integer >= 0 per row"):
        model.new_cache(2, padding=[1, -1])
    with pytest.raises(UsageError, match="capacity must be a positive integer"):
        model.new_cache(2, capacity=0)
    layer_cache = LayerCache()
    a, b = model.blocks[0].attn, model.blocks[1].attn
    a(torch.randn(1, 3, 32), cache=layer_cache)
    with pytest.raises(UsageError, match="belongs to another attention layer"):
        b(torch.randn(1, 1, 32), cache=layer_cache)
    with pytest.raises(UsageError, match="cache holds batch_size=1 rows, got a batch of 2"):
        a(torch.randn(2, 1, 32), cache=layer_cache)


def test_a_failed_step_leaves_the_cache_as_it_was():
    model = large_weights_lm("shaw")
    cache = model.new_cache(1)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)), cache=cache)
        for block in model.blocks:
            block.attn.backend = "sdpa"  # cannot add Shaw's terms: an error in the first layer
        with pytest.raises(UsageError, match="backend 'sdpa' cannot run"):
            model(torch.randint(0, 64, (1, 2)), cache=cache)
    assert cache.length == 5 and all(layer.length == 5 for layer in cache.layers)


# --- left padding --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_rows_decode_as_if_alone(method):
    """Rows of 4, 9 and 6 real tokens left-padded to 9, prefill then single steps: each row's logits
    are its own full pass (every method is shift-invariant or embeds per row)."""
    model = large_weights_lm(method)
    lengths = [4, 9, 6]
    rows = [torch.randint(0, 64, (n + 3,)) for n in lengths]
    padding = [9 - n for n in lengths]
    batch = torch.stack([torch.cat((torch.full((p,), 63), r[:n])) for p, n, r in zip(padding, lengths, rows)])
    steps = torch.stack([r[n:] for n, r in zip(lengths, rows)])  # (3, 3) tokens decoded one at a time
    with torch.no_grad():
        cache = model.new_cache(3, padding=padding)
        prefill = model(batch, cache=cache)
        decoded = decode(model, steps, [1, 1, 1], cache)
        for b, (n, row) in enumerate(zip(lengths, rows)):
            alone = model(row[None])  # (1, n + 3, vocab)
            torch.testing.assert_close(prefill[b, padding[b]:], alone[0, :n], rtol=0, atol=5e-5)
            torch.testing.assert_close(decoded[b], alone[0, n:], rtol=0, atol=5e-5)


PADDED_BACKENDS = {"sdpa": sdpa, "blocked": blocked, "terms": terms}


def padded_prefill(method: str) -> tuple[ScoreSpec, torch.Tensor]:
    """A float64 spec of 6 queries over 20 keys, rows padded by 0, 16 and 7, and its q."""
    enc = posenc.build(method, num_heads=2, head_dim=8)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    positions = torch.arange(20)
    spec = ScoreSpec(encoding=copy.deepcopy(enc).double(), q_positions=positions[14:], k_positions=positions, causal=True, scale=0.35,
                     starts=torch.tensor([0, 16, 7]))
    return spec, torch.randn(3, 2, 6, 8, dtype=torch.float64)


# Every (backend, method) pair the row-splitting backends say they support on a padded prefill.
PADDED = [(b, m) for b, module in PADDED_BACKENDS.items() for m in METHODS if module.supports(*padded_prefill(m))]
assert {("sdpa", m) for m in ("nope", "rope", "alibi", "t5")} | {("blocked", m) for m in ("nope", "alibi", "t5")} | {
    ("terms", m) for m in ("shaw", "transformer_xl")} <= set(PADDED), PADDED


def fast_padded_backend(enc: torch.nn.Module) -> str | None:
    """The backend auto keeps for a padded call, by the capability that backend is for: terms for
    clipped tables or distance keys, blocked for a relative bias with tails; None: not asserted."""
    if offers(enc, ClippedTables) or offers(enc, DistanceKeys):
        return "terms"
    return "blocked" if offers(enc, RelativeBias) else None


assert {m: fast_padded_backend(posenc.build(m, num_heads=2, head_dim=8)) for m in ("alibi", "t5", "shaw", "transformer_xl")} == {
    "alibi": "blocked", "t5": "blocked", "shaw": "terms", "transformer_xl": "terms"}


@pytest.mark.parametrize("backend, method", PADDED)
def test_padded_prefill_split_by_rows_equals_eager(method, backend):
    """Several queries with padding: the fast backends split rows; eager masks. Same result."""
    torch.manual_seed(1)
    spec, _ = padded_prefill(method)
    q, k, v = (torch.randn(3, 2, n, 8, dtype=torch.float64) for n in (6, 20, 20))
    module = PADDED_BACKENDS[backend]
    assert module.supports(spec, q)
    fast = fast_padded_backend(spec.encoding)
    if fast is not None:  # auto keeps the fast backend for padded calls
        assert backends.choose("auto", spec, q)[0] == fast
    want = eager.attend(q, k, v, spec)
    torch.testing.assert_close(module.attend(q.float(), k.float(), v.float(), _float(spec)).double(), want, rtol=0, atol=1e-5)


def _float(spec: ScoreSpec) -> ScoreSpec:
    import dataclasses

    return dataclasses.replace(spec, encoding=copy.deepcopy(spec.encoding).float())


# --- single-query paths --------------------------------------------------------------------------


SINGLE = {  # method -> the backends whose single-query path it takes
    "nope": [sdpa, blocked], "rope": [sdpa], "alibi": [sdpa, blocked, flex], "t5": [sdpa, blocked, flex],
    "shaw": [terms], "transformer_xl": [terms], "toy_absolute_key": [sdpa, blocked, flex],
}


@pytest.mark.parametrize("method", list(SINGLE))
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_single_query_paths_equal_eager(method, padded, monkeypatch):
    """One query at the last key, as a decode step: each backend's single-query path (called, not
    the general one) against the eager formula in float64, with and without left padding."""
    torch.manual_seed(2)
    options = {"t5": dict(num_buckets=16, max_distance=20), "shaw": dict(max_relative_position=6)}.get(method, {})
    enc = posenc.build(method, num_heads=4, head_dim=8, **options) if method in METHODS else _toy(method)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    b, tk = 3, 70  # T5: past its last bucket; Shaw: far keys and a band
    q, k, v = torch.randn(b, 4, 1, 8), torch.randn(b, 4, tk, 8), torch.randn(b, 4, tk, 8)
    positions = torch.arange(tk)
    starts = torch.tensor([0, 12, 66]) if padded else None  # row 2: its far keys are all padding
    workspace = single.Workspace(capacity=96)
    spec = ScoreSpec(encoding=enc, q_positions=positions[-1:], k_positions=positions, causal=True, scale=1 / math.sqrt(8), starts=starts,
                     workspace=workspace)
    ref = ScoreSpec(encoding=copy.deepcopy(enc).double(), q_positions=positions[-1:], k_positions=positions, causal=True, scale=1 / math.sqrt(8),
                    starts=starts)
    want = eager.attend(q.double(), k.double(), v.double(), ref)
    taken = []
    for name in ("attend", "shaw", "distance_keys"):
        original = getattr(single, name)
        monkeypatch.setattr(single, name, lambda *a, _f=original, _n=name: taken.append(_n) or _f(*a))
    with torch.no_grad():
        for module in SINGLE[method]:
            if module is flex and not flex.compile_available("cpu"):
                continue
            taken.clear()
            for _ in range(2):  # the second step reads the workspace's kept buffers
                got = module.attend(q, k, v, spec)
            assert taken, f"{module.__name__} did not take its single-query path"
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def _toy(method):
    from toy_encodings import AbsoluteKeyBias

    return AbsoluteKeyBias(4, 8)


# --- memory ----------------------------------------------------------------------------------------


class NewStorage(TorchDispatchMode):
    """The largest storage any op allocates: outputs that share no storage with an input (views and
    ``out=`` writes are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("method", METHODS)
def test_a_decode_step_allocates_nothing_that_grows_with_the_cache(method):
    """Batch 2 with left padding, caches of 64 and 512 tokens: the largest allocation of one step is
    the same (the projections' outputs, a few KB), so nothing per step grows with N, let alone an
    (H, N, N) tensor."""
    model = large_weights_lm(method)
    largest = {}
    for n in (64, 512):
        cache = model.new_cache(2, capacity=n + 4, padding=[5, 0])
        with torch.inference_mode():
            model(torch.randint(0, 64, (2, n)), cache=cache)
            model(torch.randint(0, 64, (2, 1)), cache=cache)  # the first step builds the workspace
            with NewStorage() as seen:
                model(torch.randint(0, 64, (2, 1)), cache=cache)
        largest[n] = seen.largest
    if model.encoding.rotation_depends_on_length or offers(model.encoding, Remaps) or method in ("fire", "cope", "deberta", "fox", "selective"):
        # Some per-step work is one value per key by nature: keys kept un-rotated are rotated again
        # with the current length (xPos centred, dynamic NTK), or per region (a position remap); FIRE's bias of the new query depends
        # on its position, CoPE's on its gates over every key; DeBERTa's p2c term reads one
        # position-query row per key, FoX's decay is one summed gate per key (both eager, no
        # single-query path of their own), selective attention keeps one selection sum per key.
        # Linear in N (at most one (B, H, N, D) copy), never (N, N).
        assert largest[512] <= 2 * 4 * (512 + 8) * 8 * 4, largest
        assert largest[512] < 10 * largest[64], largest
        return
    assert largest[64] == largest[512], largest
    if offers(model.encoding, Curves):  # the new query's bias over its R backward distances (B, H, 1, R) float32, R = 1,024
        assert largest[512] <= 2 * 4 * model.encoding.distances * 4, largest
        return
    assert largest[512] <= 2 * 4 * 32 * 4 * 4, largest  # (B, 1, 4 x dim) float32: the MLP's hidden layer
