"""Every method inside the tiny LM: cached decoding equals the full pass, gradients reach every
learnable parameter, causal mode is causal and bidirectional mode is bidirectional."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import posenc
from models import tiny_lm

METHODS = posenc.available()
# Methods with a bidirectional form (xPos is causal only: its decay would grow toward future keys).
BIDIRECTIONAL = [m for m in METHODS if not posenc.encodings.get_class(m).causal_only]
# Methods whose encoding holds learned parameters, and those of them that learn them per layer
# (``shares_across_layers`` False: the model builds one instance per layer).
LEARNED = [m for m in METHODS if any(True for _ in posenc.build(m, num_heads=4, head_dim=8).parameters())]
assert {"learned", "shaw", "transformer_xl", "t5", "kerple", "fire", "cope", "deberta", "fox", "rope_mixed"} <= set(LEARNED), LEARNED
PER_LAYER = [m for m in METHODS if not posenc.build(m, num_heads=4, head_dim=8).shares_across_layers]
assert {"shaw", "transformer_xl", "fire", "cope", "deberta", "fox"} <= set(PER_LAYER), PER_LAYER
assert not {"nope", "rope", "alibi", "t5"} & set(PER_LAYER), PER_LAYER


def refuses_bidirectional(method: str) -> bool:
    """Causal-only methods (FIRE, CoPE): building them bidirectional is a UsageError naming causal."""
    if not posenc.encodings.get_class(method).causal_only:
        return False
    with pytest.raises(posenc.UsageError, match="causal=True"):
        option_lm(method, causal=False)
    return True


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors run on one thread


def option_lm(method: str, causal: bool = True, backend: str = "auto", std: float | None = None, **options) -> posenc.LM:
    """``std`` re-draws every weight matrix larger than the init (tests/models.py)."""
    return tiny_lm(method, causal=causal, encoding_options=options, attention_backend=backend, weights_std=std)


#: The tests against a reference (a paper's formula re-derived, or another library's implementation):
#: the per-method files of tests/encodings/ (test_invariants.py runs every method against the shift
#: property, not a reference), posenc show's maps re-derived by hand, NoPE against PyTorch's SDPA.
TESTS = Path(__file__).resolve().parents[1]
REFERENCE_TESTS = [p for p in sorted((TESTS / "encodings").glob("test_*.py")) if p.name != "test_invariants.py"]
REFERENCE_TESTS += [TESTS / "show" / "test_scores.py", TESTS / "functional" / "test_functional.py"]


def methods_exercised(path: Path, names: set[str]) -> set[str]:
    """The registered names a file's test functions exercise: named in the test's own name, or given
    as a string in its body or its parametrize decorators (``posenc.build("alibi", ...)``)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        found |= {n for n in names if f"_{n}_" in f"{node.name}_"}
        for part in [*node.decorator_list, *node.body]:
            found |= {c.value for c in ast.walk(part) if isinstance(c, ast.Constant) and c.value in names}
    return found


def test_every_registered_method_is_tested() -> None:
    """Every name in ``posenc.available()`` is exercised by some test against a reference: a method
    registered without one fails here, naming it."""
    names = set(posenc.available())
    assert all(path.exists() for path in REFERENCE_TESTS), REFERENCE_TESTS
    tested = set().union(*(methods_exercised(path, names) for path in REFERENCE_TESTS))
    assert names <= tested, f"registered without a reference test: {sorted(names - tested)}"


@pytest.mark.parametrize("backend", ["auto", "eager"])
@pytest.mark.parametrize("method", METHODS)
def test_cached_decoding_equals_full_pass(method: str, backend: str) -> None:
    model = option_lm(method, backend=backend, std=0.2)  # logits of a few units: a wrong position shows
    tokens = torch.randint(0, 64, (2, 14))
    with torch.no_grad():
        full = model(tokens)  # (B, T, vocab)
        for chunks in ([1] * 14, [5, 1, 1, 1, 3, 1, 2]):  # one at a time; prefill, singles, chunks
            cache = model.new_cache(2)
            parts, at = [], 0
            for n in chunks:
                parts.append(model(tokens[:, at : at + n], cache=cache))
                at += n
            assert cache.length == 14
            torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5, msg=lambda m: f"chunks {chunks}: {m}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("method", METHODS)
def test_gradients_reach_every_parameter(method: str, causal: bool) -> None:
    if not causal and refuses_bidirectional(method):
        return
    model = option_lm(method, causal=causal).train()
    tokens = torch.randint(0, 64, (2, 20))
    targets = torch.randint(0, 64, (2, 20))  # a loss at every position, the last one included
    F.cross_entropy(model(tokens).reshape(-1, 64), targets.reshape(-1)).backward()
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient: {missing}"
    # The encoding's own parameters are among them (for the methods that have any).
    enc_params = [n for n, _ in model.blocks[0].attn.encoding.named_parameters()]
    if method in LEARNED:  # the model's layers hold the encoding's parameters (their gradients: above)
        assert enc_params, f"{method} should have learnable parameters"
    if method == "t5":  # every bucket some visible (query, key) pair falls in gets a gradient
        enc = model.blocks[0].attn.encoding
        pos = torch.arange(20)
        buckets = enc.bucket_table(pos, pos)
        visible = buckets[torch.ones(20, 20, dtype=torch.bool).tril()] if causal else buckets.flatten()
        reached = visible.unique()
        assert reached.numel() > 16  # exact and log buckets (and both sides when bidirectional)
        grad = enc.relative_attention_bias.weight.grad  # (buckets, H)
        assert (grad[reached].abs().sum(-1) > 0).all()
        unreached = torch.ones(grad.shape[0], dtype=torch.bool)
        unreached[reached] = False
        assert (grad[unreached] == 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_causal_is_causal(method: str) -> None:
    model = option_lm(method, std=0.2)
    tokens = torch.randint(0, 64, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-6)  # the past cannot see the future
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-2


@pytest.mark.parametrize("method", BIDIRECTIONAL)
def test_bidirectional_builds_and_sees_the_future(method: str) -> None:
    if refuses_bidirectional(method):
        return
    model = option_lm(method, causal=False, std=0.2)
    assert all(block.attn.encoding.causal is False for block in model.blocks)
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # only the last token
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 12, 64) and torch.isfinite(a).all()
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-2, "position 0 does not see the last token"
    with pytest.raises(ValueError, match="causal"):
        model.new_cache(2)


def test_bidirectional_t5_and_alibi_use_their_two_sided_forms() -> None:
    t5 = option_lm("t5", causal=False).blocks[0].attn.encoding
    pos = torch.arange(6)
    buckets = t5.bucket_table(pos, pos)
    assert (buckets[0, 1:] >= 16).all() and (buckets[1:, 0] < 16).all()  # keys after the query: upper half
    alibi = option_lm("alibi", causal=False).blocks[0].attn.encoding
    bias = alibi.bias(pos, pos)
    torch.testing.assert_close(bias, bias.transpose(-1, -2), rtol=0, atol=0)


@pytest.mark.parametrize("method", PER_LAYER)
def test_per_layer_methods_get_one_encoding_per_layer(method: str) -> None:
    model = option_lm(method)
    assert model.blocks[0].attn.encoding is not model.blocks[1].attn.encoding


def test_sharing_across_layers_is_derived_from_the_parameters() -> None:
    """No parameters: one instance for all layers. Learned parameters: one per layer, unless the
    class opts in (T5's table); a new learned method that forgets to say so is never tied."""
    from torch import nn

    from posenc.encodings.base import PositionalEncoding

    class Learned(PositionalEncoding):
        name = "toy_learned"

        def __init__(self, num_heads: int, head_dim: int, causal: bool = True) -> None:
            super().__init__(num_heads, head_dim, causal)
            self.weight = nn.Parameter(torch.zeros(num_heads))

    class Tied(Learned):
        shares_parameters = True

    assert not Learned(4, 8).shares_across_layers and Tied(4, 8).shares_across_layers
    assert PositionalEncoding(4, 8).shares_across_layers  # nothing learned
    for name in posenc.available():
        enc = posenc.build(name, num_heads=4, head_dim=8)
        learned = any(True for _ in enc.parameters())
        assert enc.shares_across_layers == (not learned or type(enc).shares_parameters), name
    tied = [name for name in posenc.available() if type(posenc.build(name, num_heads=4, head_dim=8)).shares_parameters]
    assert tied == ["learned", "t5", "kerple", "dpb"]  # dpb: one MLP for all layers, as x-transformers' DynamicPositionBias
    model = option_lm("t5")
    assert model.blocks[0].attn.encoding is model.blocks[1].attn.encoding


@pytest.mark.parametrize("method", ["rope", "alibi", "t5", "nope"])
def test_sdpa_and_eager_backends_agree(method: str) -> None:
    torch.manual_seed(3)
    eager = option_lm(method, backend="eager")
    torch.manual_seed(3)
    sdpa = option_lm(method, backend="sdpa")
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(tokens), eager(tokens), rtol=0, atol=1e-5)
