"""``posenc.schedule_from_hf`` against ``transformers`` 5.24: the schedule each family's config
describes, and, per layer type, the HF attention module inside a tiny random HF model against
``posenc.attend`` given that layer's schedule entry and the module's own projection weights: a full
forward, a left-padded batch and cached decoding past the window, equal to 1e-5 (float32).

The posenc side takes from HF only the projections (and the q/k norms, which are not positional);
positions, RoPE, window, chunks, temperature and sinks come from the schedule.
"""

from __future__ import annotations

import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.encodings.query_scale import LogFloorScale, Temperature
from posenc.errors import UsageError


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


def raw(**changes) -> dict:
    """A Qwen2-VL config.json as published (a fresh dict: transformers' config class edits the block)."""
    return {"model_type": "qwen2_vl", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}, **changes}


tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=32, vocab_size=97, pad_token_id=0)


def text(schedule) -> str:
    return schedule.to_text()


def test_each_family_reads_like_its_model_card():
    eight = {**SMALL, "num_hidden_layers": 8}
    cases = {
        tf.Gemma2Config: "1x[rope:base=1e4 window=4096] 1x[rope:base=1e4]",
        tf.Gemma3TextConfig: "5x[rope:base=1e4 window=4096] 1x[rope:base=1e6]",
        tf.Cohere2Config: "3x[rope:base=1e4,layout=interleaved window=4096] 1x[nope]",
        tf.Llama4TextConfig: "3x[rope:base=5e5,layout=interleaved chunk=8192] 1x[nope temp=0.1/8192]",
        tf.SmolLM3Config: "3x[rope:base=2e6] 1x[nope]",
        tf.Olmo3Config: "3x[rope:base=5e5 window=4096] 1x[rope:base=5e5]",
    }
    for cls, want in cases.items():
        schedule = posenc.schedule_from_hf(cls(**eight))
        assert len(schedule) == 8
        assert text(schedule) == want, cls.__name__
    oss = posenc.schedule_from_hf(tf.GptOssConfig(**eight))
    assert [layer.window for layer in oss.layers[:2]] == [128, None]
    assert all(layer.sinks for layer in oss.layers)
    yarn = oss.layers[0].options["scaling"]
    assert yarn["rope_type"] == "yarn" and yarn["factor"] == 32 and yarn["truncate"] is False
    assert oss.layers[1].options == oss.layers[0].options  # YaRN on every layer
    mini = posenc.schedule_from_hf(tf.Ministral3Config(**eight))
    assert all(layer.query_scale == LogFloorScale(0.1, 16384) and layer.options["scaling"]["rope_type"] == "yarn"
               for layer in mini.layers)
    assert text(posenc.schedule_from_hf(tf.Gemma3Config(text_config={**eight, "model_type": "gemma3_text"}))) == \
        "5x[rope:base=1e4 window=4096] 1x[rope:base=1e6]"
    bert = {k: v for k, v in eight.items() if k not in ("num_key_value_heads", "head_dim")}
    assert text(posenc.schedule_from_hf(tf.ModernBertConfig(**bert))) == "1x[rope:base=1.6e5] 2x[rope:base=1e4 window=128]"


def test_scaling_only_where_the_model_applies_it():
    """Gemma 3 and OLMo 3 put rope_scaling in the full layers' block: the sliding layers keep plain
    RoPE with their own base (the vLLM / llama.cpp bug gave them the global scaling)."""
    for cls in (tf.Gemma3TextConfig, tf.Olmo3Config):
        s = posenc.schedule_from_hf(cls(**{**SMALL, "num_hidden_layers": 6}, rope_scaling={"rope_type": "linear", "factor": 8.0}))
        for layer in s.layers:
            if layer.window is None:
                assert layer.options["scaling"] == {"rope_type": "linear", "factor": 8.0}
            else:
                assert "scaling" not in layer.options
    llama = posenc.schedule_from_hf(tf.Llama4TextConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert llama.layers[0].options["scaling"]["rope_type"] == "llama3"
    assert llama.layers[3].encoding == "nope" and llama.layers[3].query_scale == Temperature(0.1, 8192)


def test_missing_or_unknown_keys_are_named():
    base = {"model_type": "gemma2", "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "hidden_size": 64,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    with pytest.raises(UsageError, match="rope_theta"):
        posenc.schedule_from_hf({**base, "rope_parameters": {"rope_type": "default"}})
    with pytest.raises(UsageError, match="rope_parameters"):
        posenc.schedule_from_hf(base)
    with pytest.raises(UsageError, match="layer_types"):
        posenc.schedule_from_hf({k: v for k, v in base.items() if k != "layer_types"} | {"rope_parameters": {"rope_theta": 1e4}})
    with pytest.raises(UsageError, match="sliding_window"):
        posenc.schedule_from_hf({k: v for k, v in base.items() if k != "sliding_window"} | {"rope_parameters": {"rope_theta": 1e4}})
    with pytest.raises(UsageError, match="bogus"):
        posenc.schedule_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2, "bogus": 1}})
    with pytest.raises(UsageError, match="striped_attention"):
        posenc.schedule_from_hf({**base, "layer_types": ["striped_attention", "full_attention"], "rope_parameters": {"rope_theta": 1e4}})
    with pytest.raises(UsageError, match="model_type"):
        posenc.schedule_from_hf({"model_type": "mamba"})
    with pytest.raises(UsageError, match=r"rope_parameters\['full_attention'\]"):
        posenc.schedule_from_hf({**base, "model_type": "olmo3", "rope_parameters": {"sliding_attention": {"rope_theta": 1e4}}})
    with pytest.raises(UsageError, match="no_rope_layers"):
        posenc.schedule_from_hf({**base, "model_type": "smollm3", "layer_types": ["full_attention"] * 2, "rope_parameters": {"rope_theta": 1e4}})


# ---- the attention modules themselves ------------------------------------------------------------


def projections(family: str, attn, h: torch.Tensor):
    """q (B, H, T, D), k, v (B, Hkv, T, D) from the HF module's own weights (and q/k norms)."""
    b, t, _ = h.shape
    d = attn.head_dim
    if family == "olmo3":
        q, k = attn.q_norm(attn.q_proj(h)), attn.k_norm(attn.k_proj(h))
    else:
        q, k = attn.q_proj(h), attn.k_proj(h)
    q, k, v = q.view(b, t, -1, d), k.view(b, t, -1, d), attn.v_proj(h).view(b, t, -1, d)
    if family == "gemma3":
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def ours(family: str, attn, layer, h, causal=True, key_padding_mask=None, last: int | None = None):
    """posenc's attention output for hidden states h (B, T, dim), or for its last ``last`` queries."""
    q, k, v = projections(family, attn, h)
    b, nh, t, d = q.shape
    enc = posenc.build(layer.encoding, num_heads=nh, head_dim=d, causal=causal, **layer.options)
    kw = dict(window=layer.window, chunk=layer.chunk, query_scale=layer.query_scale,
              sinks=attn.sinks if layer.sinks else None, scale=attn.scaling, causal=causal)
    if last is None:
        out = posenc.attend(q, k, v, enc, key_padding_mask=key_padding_mask, **kw)
    else:
        pos = torch.arange(t)
        out = posenc.attend(q[:, :, -last:], k, v, enc, positions=pos[-last:], k_positions=pos, **kw)
    return attn.o_proj(out.transpose(1, 2).reshape(b, out.shape[2], -1))


class Capture:
    """Every call of each layer's self-attention: its hidden-state input and its output."""

    def __init__(self, model):
        self.calls: dict[int, list] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attn
            self.handles.append(attn.register_forward_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i):
        def hook(module, args, kwargs, out):
            h = kwargs.get("hidden_states", args[0] if args else None)
            self.calls.setdefault(i, []).append((h.detach(), out[0].detach()))
        return hook


def attention_of(model, i):
    layer = model.model.layers[i]
    return layer.self_attn if hasattr(layer, "self_attn") else layer.attn


def model_of(cls_config, cls_model, **extra):
    config = cls_config(**{**SMALL, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls_model(config).eval()
    for layer in model.model.layers:  # sinks of the size of the scores, so that they matter
        attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attn
        if getattr(attn, "sinks", None) is not None:
            torch.nn.init.normal_(attn.sinks, std=1.0)
    return config, model


FAMILIES = {
    "gemma3": lambda: model_of(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, sliding_window=6, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "cohere2": lambda: model_of(tf.Cohere2Config, tf.Cohere2ForCausalLM, sliding_window=6, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "llama4": lambda: model_of(tf.Llama4TextConfig, tf.Llama4ForCausalLM, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                               use_qk_norm=False, no_rope_layers=[1, 0, 1, 0], num_local_experts=1, intermediate_size_mlp=32),
    "gpt_oss": lambda: model_of(tf.GptOssConfig, tf.GptOssForCausalLM, sliding_window=6, num_local_experts=2, num_experts_per_tok=1),
    "smollm3": lambda: model_of(tf.SmolLM3Config, tf.SmolLM3ForCausalLM, no_rope_layers=[1, 0, 1, 0]),
    "olmo3": lambda: model_of(tf.Olmo3Config, tf.Olmo3ForCausalLM, sliding_window=6, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # YaRN and the beta scale on every layer; original length 4 so that floor(pos / 4) moves in 20 tokens
    "ministral3": lambda: model_of(tf.Ministral3Config, tf.Ministral3ForCausalLM, sliding_window=6, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "llama_4_scaling_beta": 0.5}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_attention_modules_equal_posenc_with_the_schedule(family):
    """Every layer (local and global, RoPE and NoPE) in a full forward of 20 tokens (window 6,
    chunk 8), a left-padded batch, and cached decoding token by token past the window."""
    config, model = FAMILIES[family]()
    schedule = posenc.schedule_from_hf(config)
    kinds = {layer.kind for layer in schedule.layers} | {layer.encoding for layer in schedule.layers}
    assert len(kinds) >= (2 if family == "ministral3" else 3), kinds  # two layer kinds (Ministral 3 has one)
    torch.manual_seed(1)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 20))
    seen = Capture(model)
    with torch.no_grad():
        model(tokens, use_cache=False)
        for i, layer in enumerate(schedule.layers):
            h, out = seen.calls[i][-1]
            torch.testing.assert_close(ours(family, attention_of(model, i), layer, h), out, rtol=0, atol=1e-5,
                                       msg=lambda m: f"{family} layer {i} {layer.to_text()}: {m}")
        # left padding: HF positions cumsum(mask) - 1, posenc's default for a key padding mask
        if family != "llama4":  # Llama 4 counts its temperature from the cache index, padding included
            mask = torch.ones(2, 20, dtype=torch.long)
            mask[1, :5] = 0
            model(tokens, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=False)
            for i, layer in enumerate(schedule.layers):
                h, out = seen.calls[i][-1]
                got = ours(family, attention_of(model, i), layer, h, key_padding_mask=mask.bool())
                torch.testing.assert_close(got[1, 5:], out[1, 5:], rtol=0, atol=1e-5, msg=lambda m: f"{family} padded layer {i}: {m}")
                torch.testing.assert_close(got[0], out[0], rtol=0, atol=1e-5)
        # cached decoding: 4 tokens of prompt, then one at a time to 20 (past the window and a chunk)
        for i in seen.calls:
            seen.calls[i].clear()
        cache = tf.DynamicCache(config=config)
        model(tokens[:, :4], cache=cache, use_cache=True)
        for t in range(4, 20):
            model(tokens[:, t : t + 1], cache=cache, use_cache=True)
        for i, layer in enumerate(schedule.layers):
            steps = seen.calls[i]
            prefix = steps[0][0]
            for h, out in steps[1:]:
                prefix = torch.cat((prefix, h), 1)
                got = ours(family, attention_of(model, i), layer, prefix, last=1)
                torch.testing.assert_close(got, out, rtol=0, atol=1e-5, msg=lambda m: f"{family} decode layer {i} at {prefix.shape[1]}: {m}")


def test_modernbert_local_and_global_layers_equal_posenc():
    """The encoder: bidirectional window local_attention = 8 (|i - j| <= 4), two bases."""
    config = tf.ModernBertConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=32,
                                 vocab_size=97, local_attention=8, pad_token_id=0)
    config._attn_implementation = "eager"
    model = tf.ModernBertModel(config).eval()
    schedule = posenc.schedule_from_hf(config)
    assert [layer.window for layer in schedule.layers] == [None, 8, 8]
    captured = {}

    def hook(i):
        def fn(module, args, kwargs, out):
            captured[i] = (kwargs.get("hidden_states", args[0] if args else None), out[0])
        return fn

    for i, layer in enumerate(model.layers):
        layer.attn.register_forward_hook(hook(i), with_kwargs=True)
    tokens = torch.randint(1, 97, (2, 20))
    with torch.no_grad():
        model(tokens)
        for i, layer in enumerate(schedule.layers):
            attn = model.layers[i].attn
            h, out = captured[i]
            b, t, _ = h.shape
            qkv = attn.Wqkv(h).view(b, t, 3, config.num_attention_heads, -1)
            q, k, v = (qkv[:, :, n].transpose(1, 2) for n in range(3))
            enc = posenc.build("rope", num_heads=4, head_dim=16, causal=False, **layer.options)
            o = posenc.attend(q, k, v, enc, causal=False, window=layer.window)  # scale 1/sqrt(D), as HF
            got = attn.Wo(o.transpose(1, 2).reshape(b, t, -1))
            torch.testing.assert_close(got, out, rtol=0, atol=1e-5, msg=lambda m: f"modernbert layer {i}: {m}")


def test_numeric_texts_in_hf_configs_are_refused() -> None:
    from posenc.hf.rope_config import mrope_from_hf

    with raises("mrope_from_hf: rope_theta must be a number > 1, got '1e6'"):
        mrope_from_hf(raw(rope_theta="1e6"))
    with raises("mrope_from_hf: num_attention_heads must be a positive integer, got '2'"):
        mrope_from_hf(raw(num_attention_heads="2"))
    with raises("mrope_from_hf: head_dim must be a positive integer, got '32'"):
        mrope_from_hf(raw(head_dim="32"))
    with raises("rope_from_hf: rope_theta must be a number in (1, 1e+12], got '500000'"):
        posenc.rope_from_hf({"num_attention_heads": 2, "hidden_size": 32, "rope_theta": "500000"})


def test_the_hf_config_readers_need_no_transformers() -> None:
    # transformers made unimportable: posenc.hf and its config readers import, its model names refuse
    import subprocess
    import sys

    code = """
import sys
sys.modules["transformers"] = None
import posenc, posenc.hf
config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
assert posenc.schedule_from_hf(config).to_text()
assert posenc.rope_from_hf(config).scaling.rope_type == "linear"
try:
    posenc.hf.use
except ImportError as error:
    assert "pip install 'posenc[hf]'" in str(error), error
else:
    raise AssertionError("posenc.hf.use without transformers")
assert sys.modules["transformers"] is None
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
