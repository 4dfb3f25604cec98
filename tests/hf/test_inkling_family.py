"""Inkling and Inkling-2 in posenc.hf (issue 49 item 2): their family rows.

- ``use(model, "inkling")`` with no options *is* the untouched model (transformers' own Inkling,
  Inkling-2 and Inkling-2-Loop modules, random weights): a 20-token forward past the window (6) and
  the curves' reach (5 distances) with the log scaling on (from position 8), a left-padded batch,
  greedy decoding with a cache; the gradients of the model's own curve bank, projection, scale and
  sinks are the untouched model's, and posenc holds no copy of them.
- Other encodings (RoPE, ALiBi, NoPE) swap in and keep the family's windows and per-query sinks:
  each attention call equals the formula written out here (the encoding's rotation or bias, the
  window, the sink logits the layer passed), and cached decoding equals the full pass.
- What posenc does not run there is refused at ``use()``, leaving the model as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import posenc  # noqa: E402
import posenc.hf as phf  # noqa: E402
from hf_family_configs import logits, perturbed, tokens  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.attention import posenc_attention  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

VOCAB, WINDOW, REACH, T = 64, 6, 5, 20
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=WINDOW,
            rel_extent=REACH, d_rel=4, num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"],
            max_position_embeddings=256, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, log_scaling_n_floor=8)
MORE = {"inkling_text": dict(n_shared_experts=1), "inkling2_text": dict(unpadded_vocab_size=VOCAB),
        "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB, num_hidden_layers=3, n_layers_per_attn_res_block=1,
                                   layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], loop_layer_index_start=1,
                                   loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4)}
TYPES = list(MORE)


def untouched(model_type: str):
    """The family's tiny model, every weight moved off its init value."""
    return perturbed(transformers.AutoConfig.for_model(model_type, **{**TINY, **MORE[model_type]}))


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("model_type", TYPES)
def test_inkling_is_the_untouched_model(model_type: str) -> None:
    ref = untouched(model_type)
    model = phf.use(copy.deepcopy(ref), "inkling")
    assert model.config.posenc == {"encoding": "inkling", "options": {}, "causal": True, "from_config": True}
    assert not list(model.model.posenc_encodings.parameters())  # the model's own parameters, no copy
    ids = tokens(2, T)
    assert gap(logits(model, ids), logits(ref, ids)) < 1e-4
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :5] = 0
    real = mask.bool()
    assert gap(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-4
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    theirs = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, theirs)
    # the curves matter here, so the comparisons above can fail: without them (NoPE) the model differs
    assert gap(logits(phf.use(copy.deepcopy(ref), "nope"), ids), logits(ref, ids)) > 1e-3


@pytest.mark.parametrize("model_type", ["inkling_text", "inkling2_text"])
def test_gradients_reach_the_models_own_parameters(model_type: str) -> None:
    ref = untouched(model_type)
    model = phf.use(copy.deepcopy(ref), "inkling")
    ids = tokens(2, T)
    for m in (ref, model):
        m.train()
        m(ids, labels=ids).loss.backward()
    own = [n for n, _ in ref.named_parameters() if any(k in n for k in ("relative_position_bias", "rel_logits_proj", "r_proj", "sink_proj"))]
    assert len(own) >= 4
    theirs, ours = dict(ref.named_parameters()), dict(model.named_parameters())
    for name in own:
        assert ours[name].grad is not None and ours[name].grad.abs().sum() > 0, name
        torch.testing.assert_close(ours[name].grad, theirs[name].grad, rtol=1e-4, atol=1e-6)


def _recorded(model, ids: torch.Tensor) -> list[tuple]:
    """Each posenc attention call of one forward: (module, q, k, v, kwargs, output)."""
    calls: list[tuple] = []

    def recording(module, q, k, v, mask, **kwargs):
        out = posenc_attention(module, q, k, v, mask, **kwargs)
        if "_posenc_plan" in module.__dict__:
            calls.append((module, q, k, v, kwargs, out[0]))
        return out

    transformers.AttentionInterface.register("posenc", recording)
    try:
        logits(model, ids, use_cache=False)
    finally:
        phf.adapter.register()
    return calls


def _written_out(enc, q, k, v, scaling: float, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """softmax(rotated q . k * scaling + bias + window and causal masks [, sink]) v: (B, T, H, D)."""
    t, group = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(t)
    if hasattr(enc, "rotate"):
        q, k = enc.rotate(q, k, pos, pos)
    s = q @ k.transpose(-1, -2) * scaling
    if hasattr(enc, "bias"):
        s = s + enc.bias(pos, pos)
    i, j = pos[:, None], pos[None]
    s = s.masked_fill(~((j <= i) & ((j > i - window) if window else True)), float("-inf"))
    probs = torch.softmax(torch.cat((s, sinks), dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("encoding", ["rope", "alibi", "nope"])
def test_other_encodings_keep_the_windows_and_sinks(encoding: str) -> None:
    ref = untouched("inkling2_text")
    model = phf.use(copy.deepcopy(ref), encoding)
    calls = _recorded(model, tokens(2, T))
    windows = [getattr(module, "sliding_window", None) for module, *_ in calls]
    assert windows == [WINDOW, None]
    for module, q, k, v, kwargs, out in calls:
        enc = module.__dict__["_posenc_plan"].encoding
        assert enc.name == encoding
        want = _written_out(enc, q, k, v, kwargs["scaling"], module.sliding_window, kwargs["sinks"])
        assert gap(out, want) < 1e-5
        if module.sliding_window:  # the window cuts here: without it the layer differs
            assert gap(out, _written_out(enc, q, k, v, kwargs["scaling"], None, kwargs["sinks"])) > 1e-4
        assert gap(out, _written_out(enc, q, k, v, kwargs["scaling"], module.sliding_window, kwargs["sinks"] - 30)) > 1e-4


@pytest.mark.parametrize(("model_type", "encoding", "options"), [
    ("inkling2_text", "rope", {}), ("inkling2_text", "alibi", {}), ("inkling2_text", "nope", {}),
    ("inkling2_text", "inkling", {"rank": 3}), ("inkling_text", "alibi", {}), ("inkling2_loop_text", "rope", {})])
def test_other_encodings_decode_as_the_full_pass(model_type: str, encoding: str, options: dict) -> None:
    model = phf.use(untouched(model_type), encoding, **options)
    ids = tokens(2, 16)
    full = logits(model, ids, use_cache=False)
    with torch.no_grad():
        out = model(ids[:, :10], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(10, 16):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits[:, -1])
    assert gap(torch.stack(steps[:-1], 1), full[:, 9:15]) < 1e-4


@pytest.mark.parametrize(("encoding", "match"), [
    ("2x[rope]", "layer schedule"), ("sinusoidal", "absolute encoding"),
    ("selective", "selective attention"), ("selfextend", "per-query sinks")])
def test_what_posenc_lacks_is_refused(encoding: str, match: str) -> None:
    ref = untouched("inkling2_text")
    model = copy.deepcopy(ref)
    with pytest.raises(UsageError, match=match) as error:
        phf.use(model, encoding)
    assert "'inkling2_text'" in str(error.value)
    ids = tokens(1, 12)
    assert torch.equal(logits(model, ids), logits(ref, ids))  # left as it was


def test_a_saved_model_loads_with_its_own_curves(tmp_path) -> None:
    ref = untouched("inkling2_text")
    model = phf.use(copy.deepcopy(ref), "inkling")
    model.save_pretrained(tmp_path)
    loaded = phf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    ids = tokens(2, T)
    assert gap(logits(loaded, ids), logits(ref, ids)) < 1e-4
    assert isinstance(loaded.model.posenc_encodings[0], phf.inkling.HeldInkling)
    assert posenc.available()  # (the registry is untouched)
