"""Layer schedules: the text form, the json form, LMConfig(schedule=...), shared encodings,
checkpoints, and an LM built from a schedule equal to its layers run one by one."""

from __future__ import annotations

import json
import re

import pytest
import torch

import posenc
import posenc.hf
from posenc.encodings.query_scale import LogFloorScale, ScalableSoftmax, Temperature
from posenc.errors import UsageError
from posenc.model.lm import LM, LMConfig
from posenc.model.schedule import Layer, Schedule


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_text_form_reads_like_a_model_card():
    s = Schedule.parse("3x[rope:base=1e4 window=64] 1x[nope]", depth=8)
    assert len(s) == 8
    assert [layer.encoding for layer in s.layers] == ["rope", "rope", "rope", "nope"] * 2
    assert s.layers[0] == Layer("rope", {"base": 10000.0}, window=64)
    assert s.layers[3] == Layer("nope")
    assert s.to_text() == "3x[rope:base=1e4 window=64] 1x[nope]"
    assert s.period == 4


def test_every_item_of_a_layer():
    s = Schedule.parse("2x[rope:layout=interleaved,rotary_dim=8 base=5e5 chunk=8192] [nope temp=0.1/8192] "
                       "[rope window=128 sinks scaling=yarn(factor=32;original_max_position_embeddings=4096;truncate=false)] "
                       "[alibi beta=0.1/16384] [t5:num_buckets=16 ssmax=0.4]")
    a, _, n, g, al, t5 = s.layers
    assert a.options == {"layout": "interleaved", "rotary_dim": 8, "base": 500000.0} and a.chunk == 8192 and a.kind == "chunk"
    assert n.query_scale == Temperature(0.1, 8192)
    assert g.sinks and g.window == 128 and g.options["scaling"] == {
        "rope_type": "yarn", "factor": 32, "original_max_position_embeddings": 4096, "truncate": False}
    assert al.query_scale == LogFloorScale(0.1, 16384)
    assert t5.query_scale == ScalableSoftmax(0.4) and t5.options == {"num_buckets": 16}
    # text -> schedule -> text -> the same schedule; json likewise
    again = Schedule.parse(s.to_text(), len(s))
    assert again == s
    assert Schedule.of(json.loads(json.dumps(s.to_list()))) == s


def test_a_pattern_is_cut_at_the_depth():
    """Gemma 3 at 26 layers: 5 local : 1 global, four times, then two local layers."""
    s = Schedule.parse("5x[rope:base=1e4 window=1024] 1x[rope:base=1e6]", depth=26)
    kinds = "".join("L" if layer.window else "G" for layer in s.layers)
    assert kinds == "LLLLLG" * 4 + "LL"
    assert Schedule.parse(s.to_text(), 26) == s


@pytest.mark.parametrize("text, match", [
    ("3x[rope window=0]", "window"),
    ("[rope window=4 chunk=4]", "not both"),
    ("[rope:base]", "KEY=VALUE"),
    ("[rope bogus=1]", "bogus"),
    ("[sinusoidal]", "absolute"),
    ("[rope temp=0.1]", "temp="),
    ("[rope temp=0.1/8 ssmax=0.3]", "one query scale"),
    ("[made_up]", "made_up"),
    ("3x[rope", "cannot read"),
    ("0x[rope]", "at least once"),
    ("[]", "empty"),
    ("[rope window]", "needs a value"),
    ("[rope window=1.5]", "window"),
    ("", "schedule"),
])
def test_bad_text_names_what_is_wrong(text, match):
    with pytest.raises(UsageError, match=match):
        Schedule.parse(text, 4)


def test_depth_must_fit():
    with pytest.raises(UsageError, match="more than depth"):
        Schedule.parse("3x[rope] 3x[nope]", 4)
    with pytest.raises(UsageError, match="depth is 4"):
        LMConfig(depth=4, schedule=[{"encoding": "rope"}] * 3)
    with pytest.raises(UsageError, match="encoding_options"):
        LMConfig(depth=2, schedule="[rope]", encoding_options={"base": 10})
    with pytest.raises(UsageError, match="unknown layer key"):
        LMConfig(depth=1, schedule=[{"encoding": "rope", "windw": 3}])


def test_lmconfig_without_a_schedule_is_unchanged():
    cfg = LMConfig(encoding="t5", depth=3)
    assert cfg.schedule is None and cfg.layers is None
    assert cfg.to_dict()["schedule"] is None
    model = LM(cfg)
    assert all(block.attn.encoding is model.encoding for block in model.blocks)
    assert all(block.attn.extras is None for block in model.blocks)


def test_shared_tables_stay_shared_among_equal_layers():
    """T5's table: one per distinct option set; RoPE likewise; Shaw (not shared): one per layer."""
    cfg = LMConfig(dim=32, num_heads=4, depth=6, schedule="[t5 window=8] [t5] [t5:num_buckets=16] [shaw] [shaw] [rope]")
    model = LM(cfg)
    encs = [block.attn.encoding for block in model.blocks]
    assert encs[0] is encs[1] and encs[2] is not encs[0] and encs[3] is not encs[4]
    tables = [name for name, _ in model.named_parameters() if "relative_attention_bias" in name]
    assert len(tables) == 2, tables  # the shared table is one parameter, the 16-bucket one another
    assert model.blocks[0].attn.window == 8 and model.blocks[1].attn.window is None


def test_schedule_is_saved_and_loaded(tmp_path):
    cfg = LMConfig(dim=32, num_heads=4, depth=4, schedule="3x[rope:base=1e4 window=8 sinks] 1x[nope temp=0.1/16]")
    assert cfg.encoding == "rope"
    model = LM(cfg)
    with torch.no_grad():
        model.blocks[0].attn.sinks.normal_()
    posenc.save_checkpoint(model, tmp_path / "m.safetensors")
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["lm_config"]["schedule"][3] == {"encoding": "nope", "query_scale": {"kind": "temp", "attn_scale": 0.1, "floor_scale": 16}}
    back = posenc.load_checkpoint(tmp_path / "m.safetensors")
    assert back.config == cfg
    tokens = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)


def test_an_lm_of_a_schedule_equals_its_layers_run_by_hand():
    """Each block's attention equals posenc.attend with its schedule entry (window, chunk, sinks,
    query scale), the block's projections and the same encoding."""
    cfg = LMConfig(dim=32, num_heads=4, depth=4, schedule="[rope window=5 sinks] [alibi chunk=7] [nope temp=0.5/3] [t5 window=9]")
    model = LM(cfg).double().eval()
    torch.nn.init.normal_(model.blocks[0].attn.sinks)
    x = torch.randn(2, 25, 32, dtype=torch.float64)
    for block, layer in zip(model.blocks, cfg.layers.layers):
        attn = block.attn
        q, k, v = attn.qkv(x).split(32, dim=-1)
        q, k, v = (t.view(2, 25, 4, 8).transpose(1, 2) for t in (q, k, v))
        out = posenc.attend(q, k, v, attn.encoding, window=layer.window, chunk=layer.chunk, query_scale=layer.query_scale,
                            sinks=attn.sinks)
        want = attn.proj(out.transpose(1, 2).reshape(2, 25, 32))
        torch.testing.assert_close(attn(x), want, rtol=0, atol=1e-12)


def test_left_padded_cache_refused_when_positions_are_absolute():
    model = LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[rope chunk=8] [rope]"))
    with pytest.raises(UsageError, match="padding"):
        model.new_cache(2, padding=[0, 3])
    model.new_cache(2)  # no padding: fine
    LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[rope window=8] [alibi]")).new_cache(2, padding=[0, 3])


def test_drop_positions_keeps_the_attention_kinds():
    model = LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[rope window=8] [t5]"))
    model.drop_positions()
    assert model.config.schedule == [{"encoding": "nope", "window": 8}, {"encoding": "nope"}]
    assert model.blocks[0].attn.window == 8
    assert LMConfig(**model.config.to_dict()) == model.config


def test_the_schedule_figure_marks_what_each_layer_sees():
    pytest.importorskip("matplotlib")
    from posenc.show.layers import schedule_figure, seen

    s = Schedule.parse("[rope window=4] [rope chunk=8] [nope]")
    m = seen(s, 20, 13)
    assert m[0].nonzero().flatten().tolist() == [10, 11, 12, 13]
    assert m[1].nonzero().flatten().tolist() == [8, 9, 10, 11, 12, 13]
    assert m[2].nonzero().flatten().tolist() == list(range(14))
    both = seen(Schedule.parse("[rope window=4]"), 20, 13, causal=False)
    assert both[0].nonzero().flatten().tolist() == [11, 12, 13, 14, 15]
    fig = schedule_figure("3x[rope:base=1e4 window=16] 1x[nope]", depth=8, length=64)
    assert len(fig.axes) == 1 and len(fig.axes[0].get_yticklabels()) == 8


def test_generate_with_a_windowed_schedule_batches_rows_of_any_length():
    """Windows are relative: left-padded rows decode together and each equals its prompt alone
    (greedy). A chunked schedule (absolute positions) decodes rows of one length together."""
    model = LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[rope window=4 sinks] [alibi window=3]")).eval()
    torch.nn.init.normal_(model.blocks[0].attn.sinks)
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8, 9, 10])]
    together = model.generate(prompts, 12, pad_token_id=0)
    for p, got in zip(prompts, together):
        assert got[-12:].tolist() == model.generate([p], 12)[0, -12:].tolist()
    chunked = LM(LMConfig(dim=32, num_heads=4, depth=2, schedule="[rope chunk=4] [nope temp=0.5/2]")).eval()
    same = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])]
    for p, got in zip(same, chunked.generate(same, 6)):
        assert got[-6:].tolist() == chunked.generate([p], 6)[0, -6:].tolist()


def test_to_text_round_trips_every_option_exactly() -> None:
    """Before: max_distance=10000 was written '1e4', read back as 10000.0 and refused by T5."""
    s = Schedule.of([{"encoding": "t5", "options": {"max_distance": 10000, "num_buckets": 32}},
                     {"encoding": "rope", "options": {"base": 10000.0, "scaling": {"rope_type": "linear", "factor": 8.0}}},
                     {"encoding": "xpos", "options": {"scale_base": 512.0, "block_size": 20000}}])
    text = s.to_text()
    assert text == ("1x[t5:max_distance=10000,num_buckets=32] 1x[rope:base=1e4,scaling=linear(factor=8.0)] "
                    "1x[xpos:scale_base=512.0,block_size=20000]")
    again = Schedule.parse(text)
    for a, b in zip(again.layers, s.layers):
        assert a.options == b.options
        assert [type(v) for v in a.options.values()] == [type(v) for v in b.options.values()]
    assert again.layers[1].options["scaling"] == {"rope_type": "linear", "factor": 8.0}
    model = posenc.LM(posenc.LMConfig(dim=16, num_heads=2, depth=3, vocab_size=32, schedule=text))
    assert model.blocks[0].attn.encoding.max_distance == 10000
    for value in (12345.0, 1.5e4, 0.1, 1e-7, 2**60, -3, 1.2345678901234567e19):
        layer = Schedule.parse(Schedule.of([{"encoding": "rope", "options": {"base": value}}]).to_text()).layers[0]
        assert layer.options["base"] == value and type(layer.options["base"]) is type(value)
    for scale in (Temperature(0.123456789, 8192), LogFloorScale(0.1, 16384), ScalableSoftmax(0.43)):
        assert Schedule.parse(f"[{Layer('nope', query_scale=scale).to_text()}]").layers[0].query_scale == scale
    with raises("schedule: option value '10' cannot be written in the text form (it would read back as another "
                "value); only the json form (to_list) can hold it"):
        Layer("rope", {"layout": "10"}).to_text()


def test_an_absolute_encoding_with_a_schedule_is_refused() -> None:
    """Before: encoding='sinusoidal' became 'rope' and the input embedding was dropped."""
    for method in ("sinusoidal", "learned"):
        with raises(f"encoding={method!r} is an absolute method (it adds to the token embeddings), and a schedule "
                    "gives every layer's encoding: the two do not combine; drop encoding, or the schedule"):
            posenc.LMConfig(encoding=method, schedule="[rope]", depth=1, dim=16, num_heads=2)
    assert posenc.LMConfig(schedule="[rope]", depth=1, dim=16, num_heads=2).encoding == "rope"


def test_a_key_given_twice_in_a_schedule_is_refused() -> None:
    """Before: the last one won."""
    cases = {
        "[rope window=4 window=8]": "schedule: [rope window=4 window=8]: 'window' is given twice; a layer takes each key once",
        "[rope:base=10 base=100]": "schedule: [rope:base=10 base=100]: 'base' is given twice; a layer takes each key once",
        "[rope:base=10,base=100]": "schedule: [rope:base=10,base=100]: 'base' is given twice; a layer takes each key once",
        "[rope sinks sinks]": "schedule: [rope sinks sinks]: 'sinks' is given twice; a layer takes each key once",
        "[nope temp=0.1/8192 ssmax=0.4]": "schedule: [nope temp=0.1/8192 ssmax=0.4]: one query scale per layer (temp, beta or ssmax)",
        "[rope scaling=linear(factor=2;factor=4)]":
            "schedule: 'linear(factor=2;factor=4)': 'factor' is given twice; a block takes each key once",
    }
    for text, message in cases.items():
        with raises(message):
            Schedule.parse(text)
