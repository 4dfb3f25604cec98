"""T5 relative position bias (Raffel et al. 2020) against Hugging Face's T5, imported live.

The reference is ``transformers.models.t5.modeling_t5.T5Attention``: its bucket function (a port
of the original Mesh TensorFlow one) and ``compute_bias`` with the same table weights.
"""

from __future__ import annotations

import re

import pytest
import torch

import posenc
from posenc import cli

modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
from transformers import T5Config  # noqa: E402

HF_T5Attention = modeling_t5.T5Attention

# (num_buckets, max_distance): the T5 defaults, smaller and larger tables, odd bucket counts and a
# max_distance just above the exact range.
SETTINGS = [(32, 128), (16, 64), (8, 20), (64, 256), (32, 512), (33, 100), (31, 17), (32, 9), (16, 9), (6, 7), (4, 2)]


def hf_bucket(r: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    return HF_T5Attention._relative_position_bucket(
        r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )


def valid(num_buckets: int, max_distance: int, bidirectional: bool) -> bool:
    per_side = num_buckets // 2 if bidirectional else num_buckets
    return max_distance > per_side // 2  # others are rejected (see test_errors)


CASES = [(nb, md, bi) for nb, md in SETTINGS for bi in (True, False) if valid(nb, md, bi)]


@pytest.mark.parametrize("num_buckets,max_distance,bidirectional", CASES)
def test_buckets_equal_hf_for_every_r(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    r = torch.arange(-2000, 2001)
    ours = posenc.relative_position_bucket(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    theirs = hf_bucket(r, bidirectional, num_buckets, max_distance)
    assert ours.dtype == torch.long and ours.shape == r.shape
    mismatch = (ours != theirs).nonzero().flatten()
    assert mismatch.numel() == 0, f"first mismatches at r={r[mismatch[:5]].tolist()}"
    # Every bucket index is in range; a 2-D input keeps its shape.
    assert int(ours.min()) >= 0 and int(ours.max()) < num_buckets
    grid = r[:40].view(5, 8)
    assert torch.equal(
        posenc.relative_position_bucket(grid, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance),
        hf_bucket(grid, bidirectional, num_buckets, max_distance),
    )


def test_design_example_one_side_of_16_buckets() -> None:
    """docs/conventions.md: 16 buckets a side, max distance 128."""
    distances = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 16, 32, 64, 128, 129, 1000, 10**6])
    expected = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 10, 12, 14, 15, 15, 15, 15])
    # Causal with 16 buckets: keys in the past, r = -distance.
    causal = posenc.relative_position_bucket(-distances, bidirectional=False, num_buckets=16, max_distance=128)
    assert causal.tolist() == expected.tolist()
    # Bidirectional with 32 buckets: the past side is the lower half, keys after the query the upper.
    past = posenc.relative_position_bucket(-distances, bidirectional=True, num_buckets=32, max_distance=128)
    assert past.tolist() == expected.tolist()
    future = posenc.relative_position_bucket(distances[1:], bidirectional=True, num_buckets=32, max_distance=128)
    assert future.tolist() == (expected[1:] + 16).tolist()
    # Causal: every key after the query falls in bucket 0.
    ahead = posenc.relative_position_bucket(torch.arange(1, 50), bidirectional=False, num_buckets=16, max_distance=128)
    assert ahead.eq(0).all()


def hf_attention(num_heads: int, num_buckets: int, max_distance: int, is_decoder: bool) -> torch.nn.Module:
    config = T5Config(
        d_model=num_heads * 8,
        d_kv=8,
        num_heads=num_heads,
        relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance,
        is_decoder=is_decoder,
    )
    return HF_T5Attention(config, has_relative_attention_bias=True, layer_idx=0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
@pytest.mark.parametrize("tq,tk,past", [(40, 40, 0), (1, 300, 299), (7, 150, 143), (200, 200, 0)])
def test_bias_equals_hf_compute_bias(causal: bool, num_buckets: int, max_distance: int, tq: int, tk: int, past: int) -> None:
    heads = 4
    ours = posenc.build("t5", num_heads=heads, head_dim=8, causal=causal, num_buckets=num_buckets, max_distance=max_distance)
    with torch.no_grad():
        ours.relative_attention_bias.weight.normal_()  # distinct values per bucket and head
    theirs = hf_attention(heads, num_buckets, max_distance, is_decoder=causal)
    with torch.no_grad():
        theirs.relative_attention_bias.weight.copy_(ours.relative_attention_bias.weight)
        expected = theirs.compute_bias(tq, tk, past_seen_tokens=past)[0]  # (H, Tq, Tk)
        got = ours.bias(torch.arange(past, past + tq), torch.arange(tk))
    assert got.shape == (heads, tq, tk)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bias_gradient_equals_hf_compute_bias() -> None:
    """The table's gradient through posenc's lookup (a selection along the transposed table)
    equals the one through transformers' embedding lookup, for a window-sized block."""
    heads, tq, tk, past = 4, 256, 511, 255
    ours = posenc.build("t5", num_heads=heads, head_dim=8, causal=True)
    theirs = hf_attention(heads, 32, 128, is_decoder=True)
    with torch.no_grad():
        ours.relative_attention_bias.weight.normal_()
        theirs.relative_attention_bias.weight.copy_(ours.relative_attention_bias.weight)
    grad = torch.randn(heads, tq, tk, generator=torch.Generator().manual_seed(0))
    ours.bias(torch.arange(past, past + tq), torch.arange(tk)).backward(grad)
    theirs.compute_bias(tq, tk, past_seen_tokens=past)[0].backward(grad)
    torch.testing.assert_close(ours.relative_attention_bias.weight.grad, theirs.relative_attention_bias.weight.grad,
                               rtol=1e-5, atol=1e-4)


def test_scalar_score_equals_dense_bias() -> None:
    enc = posenc.build("t5", num_heads=3, head_dim=8, causal=False)
    with torch.no_grad():
        enc.relative_attention_bias.weight.normal_()
    qpos, kpos = torch.arange(5, 25), torch.arange(0, 25)
    dense = enc.bias(qpos, kpos)
    h = torch.arange(3)[:, None, None]
    torch.testing.assert_close(enc.score(h, qpos[None, :, None], kpos[None, None, :]), dense, rtol=0, atol=0)


def test_one_table_shared_by_every_layer() -> None:
    model = posenc.LM(posenc.LMConfig(encoding="t5", dim=32, depth=3, num_heads=4))
    tables = {id(block.attn.encoding) for block in model.blocks}
    assert len(tables) == 1
    names = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert len(names) == 1


def parse_bucket_table(text: str) -> list[tuple[int, int | None, int | None, str]]:
    rows = []
    for line in text.splitlines():
        m = re.match(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+\S+\s+\S+\s+\S+\s+(exact|log|last|unused)\s*$", line)
        if not m:
            continue
        bucket, lo, hi, kind = m.groups()
        if kind == "unused":
            rows.append((int(bucket), None, None, kind))
            continue
        lo_v = None if lo == "-inf" else int(lo)
        hi_v = None if hi == "+inf" else int(hi)
        rows.append((int(bucket), lo_v, hi_v, kind))
    return rows


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 40)])
def test_cli_buckets_table_agrees_with_function(capsys, bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    argv = ["buckets", "--num-buckets", str(num_buckets), "--max-distance", str(max_distance)]
    argv.append("--bidirectional" if bidirectional else "--causal")
    assert cli.main(argv) == 0
    rows = parse_bucket_table(capsys.readouterr().out)
    assert [b for b, *_ in rows] == list(range(num_buckets))
    far = 4 * max_distance

    def bucket_of(r: torch.Tensor) -> torch.Tensor:
        return posenc.relative_position_bucket(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)

    covered = torch.zeros(2 * far + 1, dtype=torch.bool)  # r in [-far, far]
    for bucket, lo, hi, kind in rows:
        if kind == "unused":
            assert not (bucket_of(torch.arange(-far, far + 1)) == bucket).any()
            continue
        lo_r = -far if lo is None else lo
        hi_r = far if hi is None else hi
        r = torch.arange(lo_r, hi_r + 1)
        assert bucket_of(r).eq(bucket).all(), f"bucket {bucket}: r in [{lo_r}, {hi_r}]"
        # The range is tight: the neighbours outside it belong to other buckets.
        if lo is not None:
            assert int(bucket_of(torch.tensor([lo - 1]))) != bucket
        if hi is not None:
            assert int(bucket_of(torch.tensor([hi + 1]))) != bucket
        covered[lo_r + far : hi_r + far + 1] = True
        per_side = num_buckets // 2 if bidirectional else num_buckets
        side = bucket % per_side
        assert kind == ("exact" if side < per_side // 2 else "last" if side == per_side - 1 else "log")
    assert covered.all(), "the table leaves some relative positions out"
