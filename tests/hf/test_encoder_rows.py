"""posenc.hf's encoder rows (posenc.hf.families, ``causal=False``: ModernBERT, EuroBERT, GTE, Nomic
BERT, Jina v3, ESM C, ESM-2, UltraBERT) beyond the census (tests/hf/test_census_encoders.py), which
checks ``use(model, "rope")``: the model rotating q and k with its own tables, posenc verifying them.

- posenc rotating: ``use(model, <its own schedule>)`` (:func:`posenc.schedule_from_hf` of its row)
  makes the rotary module the identity and rotates inside posenc's bidirectional attention; it must
  still be the untouched ``transformers`` model (a 20-token forward past every window, right- and
  left-padded batches at their real tokens; float32, 1e-4 on logits);
- ESM-2 (``EsmForMaskedLM``, ``position_embedding_type="rotary"``): its base is the config's
  ``rope_theta`` (no RoPE block: ``Family.theta_key``), a table that is not that RoPE is refused at
  ``use()``, as are ``is_decoder`` (a causal ESM) and absolute positions;
- ALiBi and T5 run bidirectionally in ESM-2 and equal the untouched model whose rotary tables are
  switched off (``inv_freq`` zero: cos 1, sin 0) and whose attention function is a plain softmax
  attention written here, adding a reference bias: x-transformers' ``AlibiPositionalBias``
  (``-m_h |i - j|``, Press et al. 2022, eq. 1 made symmetric) and T5's buckets from transformers'
  ``T5Attention._relative_position_bucket`` (bidirectional, Raffel et al. 2020, §2.1) over posenc's
  learned table;
- in every encoder row, ALiBi and T5 are bidirectional (the first token's output moves when only the
  last token changes) and a right-padded row's real tokens equal that row run alone.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers.masking_utils import sdpa_mask  # noqa: E402

import hf_census_configs as census  # noqa: E402
import hf_census_encoders as encoders  # noqa: E402
import posenc.hf as phf  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import FAMILIES  # noqa: E402
from posenc.hf.forward_state import RotaryStandIn  # noqa: E402
from posenc.hf.schedule_config import schedule_from_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

MASKED = set(transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
#: the encoder rows the installed transformers builds as masked LMs
ROWS = sorted(t for f in FAMILIES if not f.causal for t in f.model_types if t in MASKED)
REFERENCE = "posenc_test_reference"  # the test's own attention function, registered with transformers


def _build(model_type: str, **overrides: Any) -> torch.nn.Module:
    """The census's tiny masked LM of ``model_type`` with ``overrides`` on its config, every weight moved
    off its init value, in eval mode."""
    return census.build(census.Case(model_type, "masked-lm"), **overrides)


def _gap(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    return max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)


@pytest.mark.parametrize("model_type", ROWS)
def test_posenc_rotating_is_the_untouched_encoder(model_type: str) -> None:
    ref = _build(model_type)
    model = phf.use(census.untouched_copy(ref), schedule_from_hf(ref.config))
    stand_ins = [m for m in model.modules() if isinstance(m, RotaryStandIn)]
    assert stand_ins and all(m.identity for m in stand_ins)  # the model's own rotation is off: posenc rotates
    assert _gap(encoders.run(model), encoders.run(ref)) < encoders.TOLERANCE


@pytest.mark.parametrize("how", ["rope", "schedule"])
def test_esm_reads_its_base_from_rope_theta(how: str) -> None:
    ref = _build("esm", rope_theta=500.0)
    model = phf.use(census.untouched_copy(ref), "rope" if how == "rope" else schedule_from_hf(ref.config))
    assert _gap(encoders.run(model), encoders.run(ref)) < encoders.TOLERANCE
    # posenc rotating with the default base instead is far off: the base matters at these lengths
    other = phf.use(census.untouched_copy(ref), "rope", base=10000.0)
    assert _gap(encoders.run(other), encoders.run(ref)) > 100 * encoders.TOLERANCE


def test_esm_tables_that_are_not_its_rope_are_refused() -> None:
    model = _build("esm")
    with torch.no_grad():
        model.esm.rotary_embeddings.inv_freq[-1] *= 1.5
    with pytest.raises(UsageError, match="'esm'"):
        phf.use(model, "rope")


@pytest.mark.parametrize("overrides, match", [({"is_decoder": True}, "is_decoder"),
                                              ({"position_embedding_type": "absolute"}, "absolute")])
def test_esm_without_a_bidirectional_rope_is_refused(overrides: dict[str, Any], match: str) -> None:
    model = _build("esm", **overrides)
    with pytest.raises(UsageError, match=match):
        phf.use(model, "rope")


def _reference_attention(bias: torch.Tensor):
    """A plain softmax attention adding ``bias`` (H, T, T) to every row's scores, as transformers
    calls an attention function: q (B, H, T, D), k and v (B, H, S, D), a 4-D mask (bool: True
    attends, or additive) or None; returns (B, T, H, D) and the probabilities."""

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        t, s = query.shape[-2], key.shape[-2]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = query @ key.transpose(-1, -2) * scale + bias[:, :t, :s]  # (B, H, T, S)
        if isinstance(attention_mask, torch.Tensor):
            mask = attention_mask[..., :s]
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)  # (B, H, T, S)
        return (probs @ value).transpose(1, 2).contiguous(), probs  # (B, T, H, D)

    return attend


def _without_rope(model: torch.nn.Module, bias: torch.Tensor) -> torch.nn.Module:
    """ESM-2 with its rotation switched off (cos 1, sin 0) and the reference attention adding ``bias``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.esm.rotary_embeddings.inv_freq.zero_()
    transformers.AttentionInterface.register(REFERENCE, _reference_attention(bias))
    # its masks as for sdpa (bool, True attends): a function without a mask function of its own gets none
    transformers.AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    model.set_attn_implementation(REFERENCE)
    return model


def test_esm_alibi_is_bidirectional_alibi() -> None:
    x_transformers = pytest.importorskip("x_transformers.x_transformers")
    ref = _build("esm")
    heads, length = ref.config.num_attention_heads, encoders.LENGTH
    bias = x_transformers.AlibiPositionalBias(heads=heads, total_heads=heads)(length, length)  # (H, T, T): -m_h |i - j|
    assert float(bias[0, 0, -1]) < 0 and torch.equal(bias, bias.transpose(-1, -2))
    theirs = encoders.run(_without_rope(ref, bias.detach().float()))
    model = phf.use(census.untouched_copy(ref), "alibi")
    gap = _gap(encoders.run(model), theirs)
    assert gap < encoders.TOLERANCE, gap
    # the same model with its own RoPE left on is far from it (the reference is not trivially met)
    assert _gap(encoders.run(ref), theirs) > 100 * encoders.TOLERANCE


def test_esm_t5_is_the_bidirectional_bucketed_bias() -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    ref = _build("esm")
    buckets, far = 8, 12  # 4 buckets a side, exact below 2, logarithmic to 12: the census's 20 tokens cross it
    model = phf.use(census.untouched_copy(ref), "t5", num_buckets=buckets, max_distance=far)
    table = next(m for m in model.modules() if hasattr(m, "relative_attention_bias")).relative_attention_bias.weight
    with torch.no_grad():
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(3)))  # (buckets, H)
    positions = torch.arange(encoders.LENGTH)  # (T,)
    relative = positions[None, :] - positions[:, None]  # (T, S): j - i
    index = T5Attention._relative_position_bucket(relative, bidirectional=True, num_buckets=buckets, max_distance=far)
    assert len(index.unique()) == buckets - 1  # every bucket but the upper half's first (distance 0 after the query)
    bias = table.detach()[index].permute(2, 0, 1)  # (H, T, S)
    gap = _gap(encoders.run(model), encoders.run(_without_rope(ref, bias)))
    assert gap < encoders.TOLERANCE, gap


@pytest.mark.parametrize("encoding", ["alibi", "t5"])
@pytest.mark.parametrize("model_type", ROWS)
def test_alibi_and_t5_run_each_encoder_bidirectionally(model_type: str, encoding: str) -> None:
    model = phf.use(_build(model_type), encoding)
    ids = encoders.tokens()  # (B, T)
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1 - 3) % (census.VOCAB - 3) + 3  # another real token last
    moved = float((encoders.output(model, ids)[:, 0] - encoders.output(model, other)[:, 0]).abs().max())
    assert moved > 100 * encoders.TOLERANCE  # the first token sees the last
    real = encoders.LENGTH - encoders.PAD
    padded = encoders.output(model, ids, attention_mask=encoders.masks()["a right-padded batch"])[0, :real]
    alone = encoders.output(model, ids[:1, :real])[0]
    assert float((padded - alone).abs().max()) < encoders.TOLERANCE


def test_esm_saved_after_use_loads_back(tmp_path: Any) -> None:
    """ESM-2's ``inv_freq`` is a persistent buffer, saved under the stand-in (``rotary_embeddings.original``):
    :func:`posenc.hf.from_pretrained` rebuilds the encoding before the weights load, and the model comes back."""
    model = phf.use(_build("esm"), "t5", num_buckets=8, max_distance=12)
    model.save_pretrained(tmp_path)
    back = phf.from_pretrained(transformers.AutoModelForMaskedLM, tmp_path)
    assert torch.equal(back.esm.rotary_embeddings.original.inv_freq, model.esm.rotary_embeddings.original.inv_freq)
    assert _gap(encoders.run(back), encoders.run(model)) == 0.0
