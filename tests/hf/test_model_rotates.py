"""posenc.hf in a family whose model must rotate q and k itself (``Family.model_rotates``): HunYuan v1
(``hunyuan_v1_dense``, ``hunyuan_v1_moe``: HunYuan-A13B and its dense kin), whose attention rotates q
and k and THEN applies ``query_layernorm`` / ``key_layernorm``, RMSNorms with a learned per-channel
weight, and Dory, which rotates unit-norm q and k and THEN scales q per channel by its learned ``sqk``
(and loops its recurrent layers, each loop its own cache layer through ``cache_offset``). A learned
per-channel weight does not commute with a rotation, so posenc (which rotates inside the attention
function, after that weight) cannot rotate there and be the model. Checked here:

- ``use(model, "rope")``: the model's own tables pass through, verified against posenc's RoPE read
  from the config (also HunYuan-A13B's NTK-alpha block, ``"dynamic"`` with ``alpha``), and the model
  equals the untouched one: a 20-token forward, a left-padded batch at its real tokens, and cached
  greedy decoding (float32, 1e-4 on logits);
- ALiBi: the stand-in gives the identity rotation, so the norm sees unrotated q and k, and posenc's
  bias runs; compared with the untouched model with its rotation switched off (inverse frequencies 0:
  cos 1, sin 0) and a plain attention adding x-transformers' ``AlibiPositionalBias`` (Press et al.
  2022, eq. 1: ``-m_h (i - j)`` under the causal mask);
- ALiBi, T5 (causal buckets) and NoPE: cached decoding equals the full pass, step by step (Dory in
  its default ``per_loop`` cache mode; under ``last_loop`` the untouched model's own cached steps
  differ from its full pass by design, and only ``"rope"`` against the untouched model is checked);
- any rotation of posenc's (``"rope"`` with options, a schedule's rope layers, xPos, FoPE, PoPE,
  SelfExtend, a built RoPE module) is refused at use(), naming the norm after the rotation, and
  leaves the model as it was;
- a rotary table or attention factor that is not posenc's RoPE read from the config is refused.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers.masking_utils import sdpa_mask  # noqa: E402

import hf_census_configs as census  # noqa: E402
import posenc  # noqa: E402
import posenc.hf as phf  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import FAMILIES, family_of  # noqa: E402
from posenc.hf.forward_state import RotaryStandIn  # noqa: E402
from posenc.hf.schedule_config import schedule_from_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

LENGTH, PAD, STEPS, TOLERANCE = 20, 5, 3, 1e-4
TYPES = ["hunyuan_v1_dense", "hunyuan_v1_moe", "dory"]
REFERENCE = "posenc_test_model_rotates_reference"  # the test's own attention function, registered with transformers
#: HunYuan-A13B's config.json block: "dynamic" with a fixed alpha (a static NTK base, transformers' ntk_alpha)
ALPHA = {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "alpha": 1000.0, "factor": 1.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
#: what each family's refusal names: the learned per-channel weight after the rotation
WHY = {"hunyuan_v1_dense": "normalises q and k after the rotation with a learned per-channel weight",
       "hunyuan_v1_moe": "normalises q and k after the rotation with a learned per-channel weight",
       "dory": r"scales q per channel after the rotation with a learned weight \(sqk\)"}


def build(model_type: str, **more: Any) -> torch.nn.Module:
    """The census's tiny causal LM of ``model_type``, with ``more`` over its config; the learned
    per-channel weights after the rotation made random (HunYuan's q/k norms start at 1, Dory's ``sqk``
    at one value: a uniform weight would commute with the rotation, a learned one does not)."""
    saved = census.OVERRIDES.get(model_type)
    census.OVERRIDES[model_type] = {**(saved or {}), **more}
    try:
        model = census.build(census.Case(model_type, "causal-lm"))
    finally:
        if saved is None:
            census.OVERRIDES.pop(model_type)
        else:
            census.OVERRIDES[model_type] = saved
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "query_layernorm" in name or "key_layernorm" in name or name.endswith(".sqk"):
                parameter.mul_(1 + 0.5 * torch.randn(parameter.shape, generator=gen))
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model(ids, **kwargs)


def run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward (B, T, V), a left-padded batch at its real tokens, STEPS greedy tokens (B, STEPS)
    from a cached loop, and the logits of those cached steps (B, STEPS, V)."""
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))  # (B, T)
    mask = torch.ones(2, LENGTH, dtype=torch.long)  # (B, T)
    mask[0, :PAD] = 0
    full = logits(model, ids).logits
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    out = logits(model, ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    padded = out.logits[mask.bool()]
    tokens, steps = [], []
    for _ in range(STEPS):
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(token)
        mask = torch.cat((mask, torch.ones_like(token)), dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = logits(model, token, attention_mask=mask, position_ids=position_ids, use_cache=True, cache=out.cache)
        steps.append(out.logits[:, -1])
    return full, padded, torch.cat(tokens, dim=1), torch.stack(steps, dim=1)


def full_pass(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The logits (B, STEPS, V) a full, uncached pass over the left-padded batch and ``tokens``
    (B, STEPS) gives at the positions of :func:`run`'s cached steps."""
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    ids = torch.cat((ids, tokens), dim=1)  # (B, T + STEPS)
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return logits(model, ids, attention_mask=mask, position_ids=position_ids).logits[:, LENGTH:]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def stand_ins(model: torch.nn.Module) -> list[RotaryStandIn]:
    return [m for m in model.modules() if isinstance(m, RotaryStandIn)]


def test_the_hunyuan_rows_say_the_model_rotates() -> None:
    for model_type in TYPES:
        row = family_of(model_type)
        assert row is not None and row.model_rotates is not None and re.search(WHY[model_type], row.model_rotates)
    assert all(row.model_rotates for row in FAMILIES if row.mrope)  # the M-RoPE rows, on the same path


@pytest.mark.parametrize("model_type, more", [(t, {}) for t in TYPES] + [("hunyuan_v1_dense", ALPHA),
                                              ("dory", {"recurrent_kv_cache_mode": "last_loop"})],
                         ids=["dense", "moe", "dory", "dense-alpha", "dory-last-loop"])
def test_rope_is_the_untouched_model(model_type: str, more: dict[str, Any]) -> None:
    ref = build(model_type, **more)
    model = phf.use(copy.deepcopy(ref), "rope")
    assert stand_ins(model) and not any(s.identity for s in stand_ins(model))  # the model's own rotation passes through
    ours, theirs = run(model), run(ref)
    assert gap(ours[0], theirs[0]) < TOLERANCE and gap(ours[1], theirs[1]) < TOLERANCE
    assert torch.equal(ours[2], theirs[2]) and gap(ours[3], theirs[3]) < TOLERANCE


def test_the_alpha_block_is_not_the_default_base() -> None:
    """The NTK-alpha base (1e4 * alpha ** (D / (D - 2))) is what posenc verified: the model's tables
    with alpha differ from those without, so the exactness above is not the default base passing."""
    plain, alpha = build("hunyuan_v1_dense"), build("hunyuan_v1_dense", **ALPHA)
    assert not torch.allclose(plain.model.rotary_emb.inv_freq, alpha.model.rotary_emb.inv_freq)


def _reference_attention(bias: torch.Tensor):
    """A plain softmax attention adding ``bias`` (H, T, T) to the scores, as transformers calls an
    attention function: q (B, H, T, D), k and v (B, Hkv, S, D), a 4-D bool mask (True attends) or None
    (then causal)."""

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        t, s = query.shape[-2], key.shape[-2]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = query @ key.transpose(-1, -2) * scale + bias[:, s - t: s, :s]  # (B, H, T, S)
        if isinstance(attention_mask, torch.Tensor):
            scores = scores.masked_fill(~attention_mask[..., :s].bool(), -math.inf)
        else:  # sdpa's masks leave an unpadded causal batch to is_causal: the causal mask here
            later = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)  # (T, S): key j after query i
            scores = scores.masked_fill(later, -math.inf)
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)  # (B, H, T, S)
        return (probs @ value).transpose(1, 2).contiguous(), probs  # (B, T, H, D)

    return attend


def test_alibi_is_alibi_on_unrotated_normed_queries_and_keys() -> None:
    """ALiBi in HunYuan: the norm sees q and k unrotated (the stand-in's identity), and the scores gain
    ALiBi's bias: against the untouched model with inverse frequencies 0 and a reference attention
    adding x-transformers' ALiBi."""
    x_transformers = pytest.importorskip("x_transformers.x_transformers")
    ref = build("hunyuan_v1_dense")
    heads = ref.config.num_attention_heads
    bias = x_transformers.AlibiPositionalBias(heads=heads, total_heads=heads)(LENGTH, LENGTH)  # (H, T, T): -m_h |i - j|
    plain = copy.deepcopy(ref)
    with torch.no_grad():
        plain.model.rotary_emb.inv_freq.zero_()  # cos 1, sin 0: no rotation before the norm
    transformers.AttentionInterface.register(REFERENCE, _reference_attention(bias.detach().float()))
    transformers.AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    plain.set_attn_implementation(REFERENCE)
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    theirs = logits(plain, ids).logits
    model = phf.use(copy.deepcopy(ref), "alibi")
    assert stand_ins(model) and all(s.identity for s in stand_ins(model))
    assert gap(logits(model, ids).logits, theirs) < TOLERANCE
    assert gap(logits(ref, ids).logits, theirs) > 100 * TOLERANCE  # the reference is not met by the model's own RoPE


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("encoding, options", [("alibi", {}), ("t5", {"num_buckets": 8, "max_distance": 12}), ("nope", {})])
def test_an_encoding_without_a_rotation_decodes_as_its_full_pass(model_type: str, encoding: str, options: dict[str, Any]) -> None:
    ref = build(model_type)
    model = phf.use(copy.deepcopy(ref), encoding, **options)
    table = next((m for m in model.modules() if hasattr(m, "relative_attention_bias")), None)
    if table is not None:  # T5's learned table, random so every bucket counts
        with torch.no_grad():
            weight = table.relative_attention_bias.weight
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)))
    full, padded, tokens, steps = run(model)
    assert gap(steps, full_pass(model, tokens)) < TOLERANCE
    assert gap(full, run(ref)[0]) > 100 * TOLERANCE  # another model than the untouched one


@pytest.mark.parametrize("model_type", TYPES)
def test_a_rotation_of_posencs_is_refused_naming_the_norm(model_type: str) -> None:
    ref = build(model_type)
    expected = run(ref)[0]
    heads, head_dim = ref.config.num_attention_heads, ref.config.head_dim
    attempts: list[tuple[Any, dict[str, Any]]] = [
        ("rope", {"base": 500.0}), ("rope", {"scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}}),
        (schedule_from_hf(ref.config), {}), ("1x[alibi] 1x[rope]", {}), ("xpos", {}), ("fope", {}), ("pope", {}),
        ("selfextend", {}), (posenc.build("rope", num_heads=heads, head_dim=head_dim), {})]
    for encoding, options in attempts:
        model = copy.deepcopy(ref)
        with pytest.raises(UsageError, match=f"'{model_type}' {WHY[model_type]}.*is a rotation"):
            phf.use(model, encoding, **options)
        assert gap(run(model)[0], expected) == 0  # the refusal left the model as it was


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("tamper", ["frequency", "attention_scaling"])
def test_a_rotary_table_that_is_not_the_configs_rope_is_refused(model_type: str, tamper: str) -> None:
    model = build(model_type)
    rotary = model.model.rotary_emb
    # its table (Dory: one per layer type, the full layers' tampered)
    name = next(n for n, _ in rotary.named_buffers() if n.endswith("inv_freq") and "original" not in n)
    with torch.no_grad():
        if tamper == "frequency":
            getattr(rotary, name)[-1] *= 1.5
        else:
            setattr(rotary, name.replace("inv_freq", "attention_scaling"), 1.25)
    with pytest.raises(UsageError, match=f"'{model_type}'.*(differs from the model's rotary module|attention factor)"):
        phf.use(model, "rope")
