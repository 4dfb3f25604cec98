"""posenc.hf.use inside Hugging Face models built from configs (random weights, nothing downloaded).

References: the untouched HF model (RoPE: default, Llama 3, YaRN), and, for posenc's own methods,
the same model run on each document or row alone and the full forward of the generated tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import posenc
from posenc.encodings.protocol import RelativeBias, offers

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as phf  # noqa: E402
from hf_family_configs import logits, tokens  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
}


def llama(rope: str = "default", kv_heads: int = 2, **extra) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         rope_parameters=dict(ROPES[rope]), pad_token_id=0, **extra)
    return LlamaForCausalLM(config).eval()


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# -- RoPE: the adapter is exact -------------------------------------------------------------------


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_equals_untouched_model(rope: str) -> None:
    ref = llama(rope)
    model = phf.use(copy.deepcopy(ref), "rope")
    assert model.config._attn_implementation == "posenc"
    enc = model.model.posenc_encodings[0]
    assert enc.scaling.rope_type == rope and enc.base == ROPES[rope]["rope_theta"]
    ids = tokens(2, 40)  # past the original 16 positions of llama3 / yarn
    assert max_err(logits(model, ids), logits(ref, ids)) < 1e-5

    # left-padded batch: real tokens equal, with and without position_ids from the mask
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :9] = 0
    assert max_err(logits(model, ids, attention_mask=mask)[mask.bool()], logits(ref, ids, attention_mask=mask)[mask.bool()]) < 1e-5
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert max_err(logits(model, ids, attention_mask=mask, position_ids=pos)[mask.bool()],
                   logits(ref, ids, attention_mask=mask, position_ids=pos)[mask.bool()]) < 1e-5

    # greedy generate from the padded batch: identical tokens
    out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("rope", ["default", "yarn"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_rope_packed_equals_documents_alone(rope: str, use_cache: bool) -> None:
    ref = llama(rope)
    model = phf.use(copy.deepcopy(ref), "rope")
    lengths = [7, 12, 5]
    ids = tokens(1, sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = logits(model, ids, position_ids=pos, use_cache=use_cache)[0]
    alone = torch.cat([logits(ref, part[None])[0] for part in ids[0].split(lengths)])
    assert max_err(packed, alone) < 1e-5
    if use_cache:  # what HF itself does here: no document mask, attention leaks
        leaked = logits(ref, ids, position_ids=pos)[0]
        assert max_err(leaked, alone) > 1e-2


# -- bias methods --------------------------------------------------------------------------------


def setup_model(method: str, kv_heads: int = 2) -> LlamaForCausalLM:
    model = llama(kv_heads=kv_heads)
    phf.use(model, method)
    if method == "t5":
        with torch.no_grad():  # a table far from 0, so positions matter
            model.model.posenc_encodings[0].relative_attention_bias.weight.normal_()
    return model


# The methods whose bias is a relative_bias vector with tails (RelativeBias): the decode steps
# below keep that vector across forwards.
BIASES = [m for m in posenc.available() if offers(posenc.build(m, num_heads=4, head_dim=16), RelativeBias)]
assert {"alibi", "t5"} <= set(BIASES), BIASES


@pytest.mark.parametrize("method", BIASES)
def test_cached_generate_equals_full_forward(method: str) -> None:
    model = setup_model(method)
    ids = tokens(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding in row 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    seqs = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], dim=1)
    for row in range(2):  # each row alone, without padding, in one full forward
        real = full_mask[row].bool()
        full = logits(model, seqs[row][real][None], use_cache=False)[0]  # (T, V)
        n = int(mask[row].sum())
        for step, step_logits in enumerate(out.logits):
            assert max_err(step_logits[row], full[n - 1 + step]) < 1e-4, (method, row, step)


@pytest.mark.parametrize("method", BIASES)
def test_decode_steps_reuse_the_relative_bias_vector(method: str, monkeypatch) -> None:
    """A decode step reads the per-distance bias from buffers kept across forwards (as posenc's own
    KV cache keeps them), not recomputed by every layer at every step; the tokens stay those of
    the full forward (test above)."""
    model = setup_model(method)
    encodings = {id(layer.self_attn.__dict__["_posenc_plan"].encoding): layer.self_attn.__dict__["_posenc_plan"].encoding
                 for layer in model.model.layers}
    calls = []
    for enc in encodings.values():
        original = enc.relative_bias
        monkeypatch.setattr(enc, "relative_bias", lambda r, original=original: calls.append(r.numel()) or original(r))
    ids = tokens(1, 9)
    model.generate(ids, max_new_tokens=12, do_sample=False)
    decode_calls = [n for n in calls if n > 1]
    # a few per encoding (the prefill's, then once per capacity: 16, 32 keys), never once per layer and step
    assert 0 < len(decode_calls) <= 3 * len(encodings), decode_calls


@pytest.mark.parametrize("method", BIASES)
@pytest.mark.parametrize("use_cache", [True, False])
def test_packed_equals_documents_alone(method: str, use_cache: bool) -> None:
    model = setup_model(method)
    lengths = [6, 11, 4]
    ids = tokens(2, sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    packed = logits(model, ids, position_ids=pos, use_cache=use_cache)
    for row in range(2):
        alone = torch.cat([logits(model, part[None])[0] for part in ids[row].split(lengths)])
        assert max_err(packed[row], alone) < 1e-5


@pytest.mark.parametrize("method", BIASES)
def test_decode_after_packed_prefill_sees_last_document_only(method: str) -> None:
    model = setup_model(method)
    lengths = [6, 5]
    ids = tokens(1, sum(lengths) + 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = model(ids[:, :-1], position_ids=pos, use_cache=True)
        step = model(ids[:, -1:], position_ids=torch.tensor([[lengths[-1]]]), cache=out.cache).logits[0, -1]
    alone = logits(model, ids[:, lengths[0]:])[0, -1]
    assert max_err(step, alone) < 1e-5


@pytest.mark.parametrize("method", BIASES)
def test_padded_equals_rows_alone(method: str) -> None:
    model = setup_model(method)
    ids = tokens(3, 12)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    batch = logits(model, ids, attention_mask=mask)
    for row in range(3):
        real = mask[row].bool()
        alone = logits(model, ids[row][real][None])[0]
        assert max_err(batch[row][real], alone) < 1e-5


@pytest.mark.parametrize("method", BIASES)
def test_gqa_equals_repeated_kv(method: str) -> None:
    """2 kv heads for 4 query heads against the same weights with every kv head repeated (HF's
    repeat_kv order: query head h reads kv head h // 2)."""
    gqa = setup_model(method, kv_heads=2)
    mha = llama(kv_heads=4)
    state = gqa.state_dict()
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[key].view(2, 16, 64)  # (Hkv, D, dim)
            state[key] = w.repeat_interleave(2, dim=0).reshape(64, 64)
    phf.use(mha, method)
    mha.load_state_dict(state)
    ids = tokens(2, 15)
    assert max_err(logits(gqa, ids), logits(mha, ids)) < 1e-5


def test_training_gradients_reach_the_t5_table() -> None:
    model = setup_model("t5")
    model.train()
    table = model.model.posenc_encodings[0].relative_attention_bias.weight
    assert any(p is table for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = tokens(2, 16)
    before = table.detach().clone()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert table.grad is not None and float(table.grad.abs().sum()) > 0
    opt.step()
    assert not torch.equal(before, table.detach())


@pytest.mark.parametrize("method", ["t5", "alibi", "rope", "fire", "learned"])
def test_save_and_from_pretrained_restore_the_encoding(tmp_path, method: str) -> None:
    model = setup_model(method)
    ids = tokens(1, 20)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    loaded = phf.from_pretrained(LlamaForCausalLM, tmp_path).eval()
    assert type(loaded) is LlamaForCausalLM and loaded.config.posenc["encoding"] == method
    assert max_err(logits(loaded, ids), expected) < 1e-6
    auto = phf.from_pretrained(transformers.AutoModelForCausalLM, tmp_path).eval()
    assert max_err(logits(auto, ids), expected) < 1e-6


def test_families_and_errors() -> None:
    for name in ("MistralConfig", "Qwen2Config", "Qwen3Config"):
        cls = getattr(transformers, name)
        config = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
        ref = transformers.AutoModelForCausalLM.from_config(config).eval()
        model = phf.use(copy.deepcopy(ref), "rope")
        ids = tokens(2, 20)
        assert max_err(logits(model, ids), logits(ref, ids)) < 1e-5, name
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(posenc.UsageError, match="GPT2Model\\) has no rotary module"):
        phf.use(gpt2, "alibi")
    with pytest.raises(posenc.UsageError, match="unknown encoding"):
        phf.use(llama(), "nonsense")
    with pytest.raises(posenc.UsageError, match="unknown option"):
        phf.use(llama(), "t5", buckets=3)
    with pytest.raises(posenc.UsageError, match="num_heads=4, head_dim=16"):
        phf.use(llama(), posenc.build("alibi", num_heads=8, head_dim=8))


# Selective attention is refused by posenc.hf (test_selective_attention_is_refused).
@pytest.mark.parametrize("method", [m for m in posenc.available() if m != "selective"])
def test_every_encoding_generates_as_its_full_forward_and_packs(method: str) -> None:
    """Every posenc method in a Llama model: cached greedy decoding of a left-padded batch equals a
    full forward of each row alone; a packed row equals its documents alone."""
    model = llama()
    phf.use(model, method)
    ids = tokens(2, 9)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    for row in range(2):
        real = torch.cat([mask[row], torch.ones(5, dtype=torch.long)]).bool()
        full = logits(model, out.sequences[row][real][None], use_cache=False)[0]
        n = int(mask[row].sum())
        for step, step_logits in enumerate(out.logits):
            assert max_err(step_logits[row], full[n - 1 + step]) < 1e-4, (method, row, step)
    one = model.generate(ids[:1], max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, one.sequences, use_cache=False)[0]  # an unpadded row: the decode fast path
    for step, step_logits in enumerate(one.logits):
        assert max_err(step_logits[0], full[8 + step]) < 1e-4, (method, step)
    lengths = [5, 7]
    ids = tokens(1, sum(lengths), seed=3)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    alone = torch.cat([logits(model, part[None])[0] for part in ids[0].split(lengths)])
    assert max_err(logits(model, ids, position_ids=pos)[0], alone) < 1e-5


@pytest.mark.parametrize("method", ["rope", "alibi"])
def test_static_cache_generate_equals_dynamic(method: str) -> None:
    model = setup_model(method)
    ids = tokens(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0
    for kwargs in ({"attention_mask": mask}, {}):
        dynamic = model.generate(ids, max_new_tokens=5, do_sample=False, **kwargs)
        static = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static", **kwargs)
        assert torch.equal(dynamic, static)


def test_masks_are_never_none_for_padding() -> None:
    """The registered mask function hands the attention the padding mask (HF would pass None)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    phf.register()
    fn = ALL_MASK_ATTENTION_FUNCTIONS["posenc"]
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    got = fn(batch_size=2, q_length=3, kv_length=3, attention_mask=mask)
    assert torch.equal(got, mask.bool())
    assert fn(batch_size=2, q_length=3, kv_length=3, attention_mask=torch.ones(2, 3)) is None
    assert fn(batch_size=2, q_length=3, kv_length=3) is None
    # a static cache of 6 slots after 3 tokens: the unwritten slots are not real
    assert torch.equal(fn(batch_size=1, q_length=1, kv_length=6, q_offset=3), torch.tensor([[True] * 4 + [False] * 2]))


def test_cached_chunk_without_position_ids_takes_consecutive_positions() -> None:
    """Several queries after a cache, without position_ids (the registered attention function is
    public; HF's models pass them): the queries follow the cached keys, as with position_ids 3, 4.
    (mypy found it: the decode fast path read the missing position_ids and raised TypeError.)"""
    from posenc.hf.attention import _geometry

    q = torch.zeros(1, 4, 2, 16)  # (B, H, Tq, D): 2 queries after 3 cached keys (Tk = 5)
    derived = _geometry(q, 5, None, None, True)
    given = _geometry(q, 5, None, torch.tensor([[3, 4]]), True)
    assert torch.equal(derived.q_positions, torch.tensor([3, 4])) and torch.equal(derived.k_positions, torch.arange(5))
    assert torch.equal(given.q_positions, derived.q_positions) and torch.equal(given.k_positions, derived.k_positions)


def test_unsupported_inputs_are_usage_errors() -> None:
    model = setup_model("alibi")
    ids = tokens(1, 6)
    with pytest.raises(posenc.UsageError, match="4-D mask"):
        model(ids, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with torch.no_grad():
        out = model(ids[:, :4], use_cache=True)
        with pytest.raises(posenc.UsageError, match="position_ids"):
            model(ids[:, 4:], position_ids=torch.tensor([[0, 0]]), cache=out.cache)
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8))
    ref = copy.deepcopy(mistral).eval()
    phf.use(mistral, "rope")  # past the window: posenc's window, the untouched model's numbers
    long = tokens(1, 20)
    assert max_err(logits(mistral, long), logits(ref, long)) < 1e-5


def test_imported_t5_decoder_table_inside_llama() -> None:
    """A T5 decoder's table (HF T5, random init) drives a Llama model's attention: the bias the
    model adds is HF's compute_bias for that table."""
    t5 = transformers.T5Model(transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=64, num_layers=1,
                                                    num_decoder_layers=1, num_heads=4))
    encoding = phf.t5_from_hf(t5, stack="decoder")
    model = phf.use(llama(), encoding)
    assert model.model.posenc_encodings[0] is encoding
    owner = phf.t5_attention(t5, stack="decoder")
    assert torch.equal(encoding.bias(torch.arange(30), torch.arange(30)), owner.compute_bias(30, 30)[0])
    with pytest.raises(posenc.UsageError, match="stack='decoder'"):
        phf.use(llama(), phf.t5_from_hf(t5, stack="encoder"))


def test_one_geometry_per_forward(monkeypatch) -> None:
    """The layers of one forward share one geometry (positions and documents read once)."""
    from posenc.hf import attention as adapter

    calls = []
    real_of = adapter.Geometry.of
    monkeypatch.setattr(adapter.Geometry, "of", lambda *a, **k: calls.append(1) or real_of(*a, **k))
    model = setup_model("t5")
    ids = tokens(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :2] = 0
    logits(model, ids, attention_mask=mask)
    assert len(calls) == 1
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert len(calls) == 1 + 3  # prefill and two decode steps
    logits(model, tokens(1, 300))  # lengths past Python's small-int cache compare by value
    assert len(calls) == 5


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    model = setup_model("t5")
    model.train()
    ids = tokens(2, 12)
    table = model.model.posenc_encodings[0].relative_attention_bias.weight
    model(ids, labels=ids, use_cache=False).loss.backward()
    plain = table.grad.clone()
    model.zero_grad()
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model(ids, labels=ids, use_cache=False).loss.backward()
    torch.testing.assert_close(table.grad, plain, rtol=1e-5, atol=1e-7)


def test_rope_options_and_replacing_the_encoding() -> None:
    ref = llama()
    model = phf.use(copy.deepcopy(ref), "rope", base=10000.0)  # the same parameters, given
    ids = tokens(1, 20)
    assert max_err(logits(model, ids), logits(ref, ids)) < 1e-5
    phf.use(model, "rope", base=500.0)  # use again: the encoding is replaced
    assert model.config.posenc == {"encoding": "rope", "options": {"base": 500.0}, "causal": True}
    assert max_err(logits(model, ids), logits(ref, ids)) > 1e-3


def test_from_pretrained_with_a_built_encoding(tmp_path) -> None:
    """A built module: JSON options are recorded (T5's buckets); others (a RoPE module's scaling)
    are listed as unrecorded, and from_pretrained then asks for the encoding."""
    model = phf.use(llama(), posenc.build("t5", num_heads=4, head_dim=16, num_buckets=16, max_distance=40))
    assert model.config.posenc["options"] == {"num_buckets": 16, "max_distance": 40}
    ids = tokens(1, 12)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path / "t5")
    assert max_err(logits(phf.from_pretrained(LlamaForCausalLM, tmp_path / "t5"), ids), expected) < 1e-6

    rope = posenc.build("rope", num_heads=4, head_dim=16, scaling={"rope_type": "linear", "factor": 2.0})
    model = phf.use(llama(), rope)
    assert "scaling" in model.config.posenc["unrecorded"]
    expected = logits(model, ids)
    model.save_pretrained(tmp_path / "rope")
    with pytest.raises(posenc.UsageError, match="encoding="):
        phf.from_pretrained(LlamaForCausalLM, tmp_path / "rope")
    again = posenc.build("rope", num_heads=4, head_dim=16, scaling={"rope_type": "linear", "factor": 2.0})
    loaded = phf.from_pretrained(LlamaForCausalLM, tmp_path / "rope", encoding=again)
    assert max_err(logits(loaded, ids), expected) < 1e-6


def test_dynamic_ntk_plain_forward_equals_untouched_model() -> None:
    """Dynamic NTK depends on the length: rotated inside the attention (keys cached un-rotated)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    ref = LlamaForCausalLM(config).eval()
    model = phf.use(copy.deepcopy(ref), "rope")
    for n in (12, 40):
        ids = tokens(1, n)
        assert max_err(logits(model, ids), logits(ref, ids)) < 1e-5, n


def test_fox_gates_follow_the_cache() -> None:
    """FoX inside HF: the cached tokens' gates are kept with the cache, so cached beam search and a
    static cache give the tokens of generation without a cache."""
    model = phf.use(llama(), "fox")
    ids = tokens(2, 7)
    plain = model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=2, use_cache=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, num_beams=2), plain)
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static"), greedy)
    with torch.no_grad():
        first = phf.use(llama(), "alibi")(ids, use_cache=True)  # a cache filled by another model's calls
        with pytest.raises(posenc.UsageError, match="fox: the KV cache holds 7 keys"):
            model(ids[:, :1], cache=first.cache)


def test_selective_attention_is_refused() -> None:
    """A transformers cache keeps no per-key selection sums: refused at use(), naming why."""
    with pytest.raises(posenc.UsageError, match="selective attention"):
        phf.use(llama(), "selective")


def _graph_tensors(root: object) -> list[str]:
    """Paths of the tensors reachable from ``root``'s attributes that carry an autograd graph."""
    found, seen = [], set()

    def walk(obj: object, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 14:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.grad_fn is not None:
                found.append(path)
            return
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}[{key!r}]", depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for i, value in enumerate(obj):
                walk(value, f"{path}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for key, value in vars(obj).items():
                walk(value, f"{path}.{key}", depth + 1)

    walk(root, "model", 0)
    return found


@pytest.mark.parametrize("name", ["t5", "fox"])
def test_a_model_copies_after_a_forward_with_gradients(name: str) -> None:
    """Nothing of the last forward stays on the model: ``copy.deepcopy`` after a forward with
    gradients works and the copy computes what the model does (issue 48, item 18: T5's per-forward
    bias table and FoX's kept layer input held the graph, and deepcopy raised)."""
    model = setup_model(name)
    model.train()
    ids = tokens(2, 12)
    model(ids, labels=ids, use_cache=True).loss.backward()
    assert _graph_tensors(model) == []
    twin = copy.deepcopy(model)
    model.eval()
    twin.eval()
    assert max_err(logits(twin, ids), logits(model, ids)) == 0.0
