"""User errors are ValueErrors whose message names the parameter and what is allowed."""

from __future__ import annotations

import math
import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.errors import UsageError
from posenc.model.schedule import Schedule


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def qkv(t: int = 5, heads: int = 2, d: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, heads, t, d), torch.randn(1, heads, t, d), torch.randn(1, heads, t, d)


METHODS = posenc.available()


def test_unknown_method_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="unknown encoding 'nosuch'") as err:
        posenc.build("nosuch", num_heads=2, head_dim=8)
    for name in METHODS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="available: .*alibi"):
        posenc.LMConfig(encoding="nosuch")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("field,value", [("num_heads", 0), ("num_heads", -2), ("head_dim", 0), ("head_dim", -8), ("num_heads", True)])
def test_non_positive_sizes(method: str, field: str, value: int) -> None:
    sizes = {"num_heads": 2, "head_dim": 8, field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        posenc.build(method, **sizes)


@pytest.mark.parametrize("field", ["vocab_size", "dim", "depth", "num_heads", "max_positions"])
def test_non_positive_model_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        posenc.LMConfig(**{"encoding": "alibi", "dim": 32, "num_heads": 4, field: 0})


def test_other_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        posenc.alibi_slopes(0)
    with pytest.raises(ValueError, match="max_relative_position must be a positive integer"):
        posenc.build("shaw", num_heads=2, head_dim=8, max_relative_position=0)
    with pytest.raises(ValueError, match="max_positions must be a positive integer"):
        posenc.build("learned", num_heads=2, head_dim=8, max_positions=-1)
    with pytest.raises(ValueError, match="cache_length must be a positive integer"):
        posenc.build("rope", num_heads=2, head_dim=8, cache_length=0)
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        posenc.Attention(0, 2, posenc.build("nope", num_heads=2, head_dim=8))


def test_dim_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match=r"dim \(30\) must be divisible by num_heads \(4\)"):
        posenc.LMConfig(encoding="alibi", dim=30, num_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        posenc.Attention(30, 4, posenc.build("nope", num_heads=4, head_dim=8))


def test_encoding_built_for_other_sizes_or_mode() -> None:
    with pytest.raises(ValueError, match="num_heads=2, head_dim=8"):
        posenc.Attention(32, 4, posenc.build("alibi", num_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="causal"):
        posenc.Attention(32, 4, posenc.build("alibi", num_heads=4, head_dim=8, causal=False), causal=True)


def test_rope_needs_even_head_dim() -> None:
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        posenc.build("rope", num_heads=2, head_dim=7)


@pytest.mark.parametrize("rotary_dim", [0, 3, 18, -4, 8.0, "8"])
def test_rope_bad_rotary_dim(rotary_dim) -> None:
    with pytest.raises(ValueError, match=r"rotary_dim must be an even integer in \[2, head_dim=16\]"):
        posenc.build("rope", num_heads=2, head_dim=16, rotary_dim=rotary_dim)


def test_rope_bad_layout_and_base() -> None:
    with pytest.raises(ValueError, match=r"layout must be one of \('half', 'interleaved'\), got 'neox'"):
        posenc.build("rope", num_heads=2, head_dim=8, layout="neox")
    with pytest.raises(ValueError, match=r"base must be a finite number in \(1, 1e\+12\], got 1.0"):
        posenc.build("rope", num_heads=2, head_dim=8, base=1.0)


@pytest.mark.parametrize("causal,num_buckets,max_distance,exact", [(True, 32, 16, 16), (True, 32, 3, 16), (False, 32, 8, 8), (False, 16, 4, 4)])
def test_t5_max_distance_must_be_above_exact_range(causal: bool, num_buckets: int, max_distance: int, exact: int) -> None:
    msg = f"max_distance must be above the exact range \\({exact} distances"
    with pytest.raises(ValueError, match=msg):
        posenc.build("t5", num_heads=2, head_dim=8, causal=causal, num_buckets=num_buckets, max_distance=max_distance)
    with pytest.raises(ValueError, match=msg):
        posenc.relative_position_bucket(torch.arange(4), bidirectional=not causal, num_buckets=num_buckets, max_distance=max_distance)
    # One more is accepted.
    posenc.relative_position_bucket(torch.arange(4), bidirectional=not causal, num_buckets=num_buckets, max_distance=exact + 1)


@pytest.mark.parametrize("causal,num_buckets", [(True, 1), (False, 2), (False, 3)])
def test_t5_too_few_buckets(causal: bool, num_buckets: int) -> None:
    with pytest.raises(ValueError, match=f"num_buckets must be >= {2 if causal else 4}"):
        posenc.build("t5", num_heads=2, head_dim=8, causal=causal, num_buckets=num_buckets, max_distance=8)
    with pytest.raises(ValueError, match="num_buckets must be a positive integer"):
        posenc.relative_position_bucket(torch.arange(4), bidirectional=not causal, num_buckets=0)


def test_t5_bucket_function_rejects_float_positions() -> None:
    with pytest.raises(ValueError, match="integer tensor"):
        posenc.relative_position_bucket(torch.arange(4.0), bidirectional=True)


def test_learned_length_past_the_table() -> None:
    model = posenc.LM(posenc.LMConfig(encoding="learned", vocab_size=16, dim=16, depth=1, num_heads=2, max_positions=8))
    model(torch.zeros(1, 8, dtype=torch.long))  # the full table is fine
    with pytest.raises(ValueError, match=r"max_positions=8.*length 9"):
        model(torch.zeros(1, 9, dtype=torch.long))
    # Decoding past the table: the same error, not an IndexError.
    cache = model.new_cache(1)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"max_positions=8.*length 9"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    enc = posenc.build("learned", num_heads=2, head_dim=4, max_positions=4)
    with pytest.raises(ValueError, match=r"max_positions=4.*length 6"):
        enc.embed(torch.zeros(1, 6, 8), torch.arange(6))


def test_unknown_encoding_option_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['num_bucket'\]; accepted: .*num_buckets"):
        posenc.build("t5", num_heads=2, head_dim=8, num_bucket=16)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['layout'\]; accepted: none"):
        posenc.build("alibi", num_heads=2, head_dim=8, layout="half")
    with pytest.raises(ValueError, match="unknown option"):
        posenc.LM(posenc.LMConfig(encoding="rope", dim=16, depth=1, num_heads=2, encoding_options={"thetaa": 5.0}))


def test_bad_attention_backend() -> None:
    with pytest.raises(ValueError, match="attention backend must be one of"):
        posenc.LMConfig(encoding="alibi", attention_backend="fast")
    # sdpa cannot add Shaw's value terms: forcing it is a clear error, not a silently wrong result.
    model = posenc.LM(posenc.LMConfig(encoding="shaw", dim=16, depth=1, num_heads=2, attention_backend="sdpa"))
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_bad_tokens_and_cache() -> None:
    model = posenc.LM(posenc.LMConfig(encoding="alibi", vocab_size=16, dim=16, depth=1, num_heads=2))
    with pytest.raises(ValueError, match=r"tokens must be \(batch, length\)"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size=2"):
        model(torch.zeros(3, 4, dtype=torch.long), cache=model.new_cache(2))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        model.new_cache(0)


def test_wrong_types_are_usage_errors() -> None:
    q, k, v = qkv()
    rope = posenc.build("rope", num_heads=2, head_dim=8)
    with raises("positions must be an integer tensor of shape (5,) or (1, 5), got list"):
        posenc.attend(q, k, v, rope, positions=[0, 1, 2, 3, 4])
    for scale in ("temp", 0.5, 2):
        with raises("query_scale must be None or a posenc.encodings.query_scale scale (Temperature, LogFloorScale or "
                    f"ScalableSoftmax, e.g. Temperature(0.1, 8192)), got {type(scale).__name__} {scale!r}"):
            posenc.attend(q, k, v, rope, query_scale=scale)
    with raises("query_scale must be None or a posenc.encodings.query_scale scale (Temperature, LogFloorScale or "
                "ScalableSoftmax, e.g. Temperature(0.1, 8192)), got str 'temp'"):
        posenc.Attention(16, 2, rope, query_scale="temp")
    with raises("schedule: the options of layer 'rope' must be a dict of KEY: VALUE, got list [1, 2]"):
        Schedule.of([{"encoding": "rope", "options": [1, 2]}])
    fox = posenc.build("fox", num_heads=2, head_dim=8)
    with raises("x: fox's forget gates read the layer input, a float (batch, length, dim) tensor with "
                "dim = num_heads * head_dim = 16, got shape (1, 5, 7) of float32"):
        fox.log_gates(torch.randn(1, 5, 7))


def test_a_table_asked_for_past_its_bound_names_cache_length() -> None:
    with raises("cache_length: a cos/sin table of 4 frequencies holds at most 2,796,202 positions (256 MiB), got "
                "1,000,000,000; larger positions are computed when they come, without a table"):
        posenc.build("rope", num_heads=2, head_dim=8, cache_length=10**9)


def test_gates_need_an_encoding_with_gates_and_must_be_log_gates() -> None:
    """Before: RoPE with gates ran as a decayed RoPE; positive and NaN gates ran."""
    q, k, v = qkv()
    gates = -torch.rand(1, 2, 5)
    for name, label in (("rope", "RoPE"), ("nope", "NoPE")):
        with raises(f"log_gates: encoding {label} has no forget gates (the Gates hook); gates would change its scores, "
                    "so leave log_gates None (for NoPE with gates computed elsewhere, pass a fox encoding: attend reads "
                    "only the gates given)"):
            posenc.attend(q, k, v, posenc.build(name, num_heads=2, head_dim=8), log_gates=gates)
    fox = posenc.build("fox", num_heads=2, head_dim=8)
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got up to 0.5"):
        posenc.attend(q, k, v, fox, log_gates=gates.clamp(max=-0.1).index_fill(-1, torch.tensor([2]), 0.5))
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got NaN"):
        posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), math.nan))
    with raises("log_gates are log forget gates, each finite and <= 0 (log sigmoid), got -inf"):
        posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), -math.inf))
    assert posenc.attend(q, k, v, fox, log_gates=gates.index_fill(-1, torch.tensor([1]), 0.0)).isfinite().all()
