"""posenc.hf in the hybrid families: attention layers take the encoding, the state-space, linear-
attention and convolution layers are left as they are (issue 47, item 5).

Each family is built from a tiny config with random weights (tests/hf_census_configs.py, one layer of
each kind, Mamba-2 scans in chunks of 8) and checked against its untouched ``transformers`` model:

- ``use(model, "rope")`` is the untouched model (a forward past every window, a left-padded batch,
  cached greedy decoding), and posenc's attention function runs once per forward in exactly the
  attention layers (a spy on the registered function), never in a recurrent layer;
- the family's own schedule given as a schedule (posenc rotates inside the attention, the model's
  rotary module is the identity) is the untouched model: posenc's RoPE reaches each attention layer
  with the right base, slice and window;
- ALiBi keeps cached decoding equal to the full pass (the recurrent layers' own caches included);
- a packed row: posenc's attention separates its documents, and the recurrent layers do not (in
  transformers' torch code only RecurrentGemma's RG-LRU resets its state, where a position is 0, and
  its short convolution still crosses documents): with the recurrent mixers silenced the row equals
  its documents alone, with them on a later document does not.

RecurrentGemma (Griffin: RG-LRU recurrent blocks beside local attention, each attention module with
its own rotary module) is one of them; with its convolutions cut to the current token a packed row
equals its documents alone (the RG-LRU's reset).

Beyond the census: Qwen3.5's 3-axis M-RoPE ids under "rope", Zamba2's tied transformer blocks, and
the refusals (NoPE attention; forget gates in a shared block).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import hf_census_configs as census  # noqa: E402
import posenc  # noqa: E402
import posenc.hf as phf  # noqa: E402
from hf_family_configs import logits, tokens  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)
from posenc.hf.attention import NAME, posenc_attention, register  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

#: the hybrid families, as the census builds them (one layer of each kind)
HYBRIDS = ["bamba", "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "minimax", "olmo_hybrid", "qwen3_5_text",
           "qwen3_5_moe_text", "zamba2", "zaya", "recurrent_gemma"]
#: the modules of a layer that are not its attention (silenced in the packed-row test; RecurrentGemma's
#: temporal_block is its attention on an attention layer, which is never silenced)
MIXERS = ("mamba", "linear_attn", "conv", "temporal_block")
LENGTH, PAD = 20, 5


def build(model_type: str, **more: Any) -> torch.nn.Module:
    """The census's tiny model of ``model_type`` (a causal LM), with ``more`` over its overrides."""
    saved = census.OVERRIDES.get(model_type)
    census.OVERRIDES[model_type] = {**(saved or {}), **more}
    try:
        return census.build(census.Case(model_type, "causal-lm"))
    finally:
        if saved is None:
            census.OVERRIDES.pop(model_type)
        else:
            census.OVERRIDES[model_type] = saved


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokens(2, LENGTH)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    return ids, mask


def planned(model: torch.nn.Module) -> set[int]:
    """The ids of the attention modules posenc gave a plan."""
    return {id(m) for m in model.modules() if m.__dict__.get("_posenc_plan") is not None}


class Spy:
    """posenc's registered attention function, wrapped to record which modules call it."""

    def __init__(self) -> None:
        self.modules: list[int] = []

    def __enter__(self) -> Spy:
        def spy(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            self.modules.append(id(module))
            return posenc_attention(module, *args, **kwargs)

        transformers.AttentionInterface.register(NAME, spy)
        return self

    def __exit__(self, *_: Any) -> None:
        register()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_rope_is_the_untouched_model_and_runs_in_the_attention_layers_only(model_type: str) -> None:
    ref = build(model_type)
    model = phf.use(copy.deepcopy(ref), "rope")
    ids, mask = padded()
    with Spy() as spy:
        assert err(logits(model, ids), logits(ref, ids)) < 1e-4
    attention_layers = planned(model)
    recurrent = [m for m in model.modules() if type(m).__name__.endswith(("Mixer", "GatedDeltaNet", "ShortConv",
                                                                           "LightningAttention", "RecurrentBlock"))]
    assert attention_layers and set(spy.modules) == attention_layers  # each attention layer, none of the others
    assert not any(id(m) in attention_layers for m in recurrent)
    assert len(spy.modules) == len(attention_layers)  # once per forward
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-4
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours, ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_the_family_schedule_rotated_in_the_attention_is_the_untouched_model(model_type: str) -> None:
    """posenc's RoPE read from the config, rotating inside the attention (the model's rotary module
    the identity): the right base, rotated slice, window and table per layer type in each attention
    layer, the recurrent layers untouched."""
    ref = build(model_type)
    schedule = posenc.schedule_from_hf(ref.config)
    assert {layer.encoding for layer in schedule.layers} <= {"rope", "nope"}
    model = phf.use(copy.deepcopy(ref), schedule)
    assert next(m for m in model.modules() if isinstance(m, phf.RotaryStandIn)).identity
    ids, mask = padded()
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-4
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(ours, ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_alibi_cached_decoding_is_the_full_pass(model_type: str) -> None:
    """Another encoding in the attention layers (the recurrent layers' caches beside posenc's):
    each cached greedy step's logits equal the full forward of the generated tokens, and the output
    differs from the model's own RoPE (the encoding reached the attention)."""
    ref = build(model_type)
    model = phf.use(copy.deepcopy(ref), "alibi")
    ids = tokens(1, 12)
    assert err(logits(model, ids), logits(ref, ids)) > 1e-3
    out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, out.sequences, use_cache=False)[0]
    for step, step_logits in enumerate(out.logits):
        assert err(step_logits[0], full[11 + step]) < 1e-4


def _silenced(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every recurrent mixer's parameters zero (its output then zero: the layer
    passes its residual on)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attention = getattr(layer, "self_attn", None)
            mixers = [getattr(holder, name, None) for holder in (layer, getattr(layer, "mamba_decoder", None))
                      for name in MIXERS if holder is not None]
            if type(attention).__name__.endswith("LightningAttention"):
                mixers.append(attention)
            for mixer in mixers:
                if isinstance(mixer, torch.nn.Module) and mixer.__dict__.get("_posenc_plan") is not None:
                    continue  # an attention layer's (RecurrentGemma's temporal_block)
                for p in (mixer.parameters() if isinstance(mixer, torch.nn.Module) else ()):
                    p.zero_()
    return model


PACKED = ["bamba", "falcon_h1", "lfm2", "minimax", "qwen3_5_text", "granitemoehybrid", "recurrent_gemma"]


@pytest.mark.parametrize("model_type", PACKED)
def test_a_packed_row_separates_documents_in_attention_not_in_recurrent_layers(model_type: str) -> None:
    """docs/hf.md, "Hybrid families": position_ids restarting mark documents, which posenc's
    attention keeps apart; the recurrent layers carry their state from one document into the next."""
    lengths = (7, 9)
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    model = phf.use(build(model_type), "rope")
    packed = logits(model, ids, position_ids=pos, use_cache=False)
    alone = [logits(model, d, use_cache=False) for d in docs]
    assert err(packed[:, :7], alone[0]) < 1e-4  # the first document sees nothing before it
    assert err(packed[:, 7:], alone[1]) > 1e-3  # the second inherits the recurrent state of the first
    quiet = _silenced(model)
    packed = logits(quiet, ids, position_ids=pos, use_cache=False)
    assert err(packed, torch.cat([logits(quiet, d, use_cache=False) for d in docs], dim=1)) < 1e-4


def test_recurrent_gemma_resets_its_rg_lru_where_a_position_is_zero() -> None:
    """RecurrentGemma's RG-LRU restarts its state where a token's position is 0 (its own reset), and its
    short convolution (width 4) does not: with each recurrent block's kernel cut to the current token a
    packed row equals its documents alone (posenc's attention keeps them apart, the RG-LRU resets);
    with the whole kernel the second document sees the first one's last tokens."""
    lengths = (7, 9)
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    model = phf.use(build("recurrent_gemma"), "rope")
    blocks = [layer.temporal_block for layer in model.model.layers if hasattr(layer.temporal_block, "rg_lru")]
    assert blocks
    assert err(logits(model, ids, position_ids=pos, use_cache=False)[:, 7:], logits(model, docs[1], use_cache=False)) > 1e-3
    with torch.no_grad():
        for block in blocks:
            block.conv_1d.weight[..., :-1] = 0  # (lru_width, 1, width): the last tap is the current token
    packed = logits(model, ids, position_ids=pos, use_cache=False)
    assert err(packed, torch.cat([logits(model, d, use_cache=False) for d in docs], dim=1)) < 1e-4
    assert err(packed, logits(model, ids, use_cache=False)) > 1e-3  # one document: the RG-LRU carries on


def test_qwen3_5_three_axis_ids_under_rope_are_the_untouched_model() -> None:
    """Qwen3.5 rotates with interleaved M-RoPE over (3, B, T) ids; text-only ids are one row
    repeated (1-D RoPE at the text positions). Under "rope" the model's own tables rotate, so ids
    whose axes differ (an image grid) stay exact too; the layers see no text row then (posenc counts
    positions from the padding mask)."""
    ref = build("qwen3_5_text")
    model = phf.use(copy.deepcopy(ref), "rope")
    ids = tokens(1, 12)
    grid = torch.arange(12)[None].expand(3, 1, 12).clone()  # (3, B, T)
    grid[1, 0, 3:7], grid[2, 0, 3:7] = torch.tensor([3, 3, 4, 4]), torch.tensor([3, 4, 3, 4])  # a 2x2 image
    assert err(logits(model, ids, position_ids=grid), logits(ref, ids, position_ids=grid)) < 1e-4
    assert err(logits(model, ids, position_ids=grid), logits(model, ids)) > 1e-4  # the image axes were used
    text = torch.cat((torch.arange(12)[None, None], grid), dim=0)  # (4, B, T): the text row first
    assert err(logits(model, ids, position_ids=text), logits(ref, ids, position_ids=text)) < 1e-4


def test_zamba2_tied_blocks() -> None:
    """Zamba2's hybrid layers run transformer blocks whose weights are tied (one module per layer,
    per-layer adapters): "rope" is the untouched model over two hybrid layers of one tied block; a
    schedule plans each hybrid layer on its own; forget gates (they read the layer input, which is
    twice hidden_size wide there) are refused."""
    kinds = ["linear_attention", "hybrid", "linear_attention", "hybrid"]
    ref = build("zamba2", layer_types=kinds, layers_block_type=kinds, num_hidden_layers=4, use_shared_attention_adapter=True, adapter_rank=4,
                num_key_value_heads=4)  # its adapters need a key head per query head
    blocks = [layer.shared_transformer.self_attn for layer in ref.model.layers if hasattr(layer, "shared_transformer")]
    assert len(blocks) == 2 and blocks[0].q_proj.weight is blocks[1].q_proj.weight  # tied
    model = phf.use(copy.deepcopy(ref), "rope")
    ids, mask = padded()
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-4
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False),
                       ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    mixed = phf.use(copy.deepcopy(ref), "1x[nope] 1x[alibi] 1x[nope] 1x[nope]")
    names = [type(layer.shared_transformer.self_attn.__dict__["_posenc_plan"].encoding).__name__
             for layer in mixed.model.layers if hasattr(layer, "shared_transformer")]
    assert names[0] != names[1]
    assert err(logits(mixed, ids), logits(phf.use(copy.deepcopy(ref), "1x[nope] 1x[nope] 1x[nope] 1x[nope]"), ids)) > 1e-3
    with pytest.raises(posenc.UsageError, match="shared transformer block"):
        phf.use(copy.deepcopy(ref), "fox")


def test_minimax_window_and_lightning_layers() -> None:
    """MiniMax-01: a window on every attention layer (shorter than the input), the Lightning
    layers' attention modules given no plan."""
    ref = build("minimax", num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    model = phf.use(copy.deepcopy(ref), "rope")
    plans = [layer.self_attn.__dict__.get("_posenc_plan") for layer in model.model.layers]
    assert [p is None for p in plans] == [True, False, True, False]
    assert all(p.window == census.WINDOW for p in plans if p is not None)
    ids, mask = padded()
    real = mask.bool()
    assert err(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-4


@pytest.mark.parametrize(("model_type", "more"), [("granitemoehybrid", {"position_embedding_type": None}),
                                                  ("zamba2", {"use_mem_rope": False}), ("jamba", {}), ("nemotron_h", {}),
                                                  ("kimi_linear", {})])
def test_attention_without_rope_is_refused(model_type: str, more: dict[str, Any]) -> None:
    """A hybrid whose attention has no RoPE (Granite 4 hybrid's and Zamba2's defaults, Jamba,
    Nemotron-H, Kimi-Linear) has no rotary module for posenc to stand in for: refused at use(), the
    model left as it was."""
    ref = build(model_type, **more)
    model = copy.deepcopy(ref)
    with pytest.raises(posenc.UsageError, match=rf"model_type '{model_type}'.*(no RoPE|rotary)"):
        phf.use(model, "rope")
    ids = tokens(1, 10)
    assert torch.equal(logits(model, ids), logits(ref, ids))
