"""PoSE (Zhu et al., ICLR 2024, arXiv 2309.10400, §3.2): the position ids against the paper's
definition, and ``posenc extend --pose``: its batches, its record, and an exact resume.

The definition checked here, written out independently of posenc.extend.pose: a window of N tokens is
cut into K non-empty chunks; chunk i, starting at st_i in the window, has ids u_i + st_i ..
u_i + st_i + l_i - 1; u_0 = 0 and u_i ~ U({u_(i-1), .., L - N}).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

from models import tiny_rope_checkpoint
from posenc.cli import main
from posenc.errors import UsageError
from posenc.extend import extend as ex
from posenc.extend.pose import pose_layout, pose_position_ids, pose_position_ids_batch, positions_of, step_positions
from posenc.model.checkpoint import load_checkpoint
from posenc.study.events import StepDone
from posenc.study.plan import FINETUNE_STREAM


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _chunks_of(ids: list[int], lengths: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in lengths:
        out.append(ids[at:at + n])
        at += n
    return out


# -- the construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("window,target,chunks", [(16, 64, 2), (10, 30, 3), (8, 1000, 8), (5, 6, 4), (32, 33, 2)])
def test_ids_follow_the_definition(window, target, chunks):
    lengths, biases = pose_layout(400, window, target, chunks, _gen(1))
    ids = positions_of(lengths, biases)
    assert ids.shape == (400, window) and ids.dtype == torch.int64
    assert lengths.shape == biases.shape == (400, chunks)
    for row, ls, us in zip(ids.tolist(), lengths.tolist(), biases.tolist()):
        assert len(ls) == chunks and min(ls) >= 1 and sum(ls) == window  # K chunks, none empty, the whole window
        assert us[0] == 0 and all(a <= b for a, b in zip(us, us[1:])) and us[-1] <= target - window
        assert row[0] == 0 and row[-1] <= target - 1
        starts = [sum(ls[:i]) for i in range(chunks)]
        for piece, st, u, n in zip(_chunks_of(row, ls), starts, us, ls):
            assert piece == list(range(u + st, u + st + n))  # Pos(c_i) = {u_i + st_i, .., u_i + st_i + l_i - 1}
        firsts = [piece[0] for piece in _chunks_of(row, ls)]
        assert all(a < b for a, b in zip(firsts, firsts[1:]))  # chunk starts increase (u_i never decreases)
        assert all(a < b for a, b in zip(row, row[1:]))  # ids strictly increasing over the window


def test_the_single_and_the_batch_forms_draw_the_same():
    for window, target, chunks in [(16, 64, 2), (9, 40, 3)]:
        one = pose_position_ids(window, target, chunks, _gen(7))
        assert one.shape == (window,) and one.dtype == torch.int64
        assert torch.equal(one, pose_position_ids_batch(1, window, target, chunks, _gen(7))[0])
        assert torch.equal(pose_position_ids_batch(5, window, target, chunks, _gen(3)),
                           positions_of(*pose_layout(5, window, target, chunks, _gen(3))))
        assert torch.equal(step_positions(4, 11, 3, window, target, chunks), step_positions(4, 11, 3, window, target, chunks))
        assert not torch.equal(step_positions(4, 11, 8, window, target, chunks), step_positions(4, 12, 8, window, target, chunks))


@pytest.mark.parametrize("window,target,chunks", [(16, 64, 1), (16, 16, 2), (16, 16, 16), (1, 1, 1), (1, 50, 1)])
def test_one_chunk_or_no_room_is_arange(window, target, chunks):
    for seed in range(5):
        assert torch.equal(pose_position_ids(window, target, chunks, _gen(seed)), torch.arange(window))


def test_every_distance_up_to_target_is_reached():
    # Over many examples each relative distance 1 .. L-1 appears (within one example, i - j of two ids).
    window, target = 16, 64
    ids = pose_position_ids_batch(2000, window, target, 2, _gen(2))
    distances = (ids[:, :, None] - ids[:, None, :]).flatten()
    seen = set(distances[distances > 0].unique().tolist())
    assert seen == set(range(1, target))
    assert int(ids.max()) == target - 1 and int((ids[:, -1] - ids[:, 0]).max()) == target - 1


def _dkw(n: int, p: float = 1e-6) -> float:
    # Dvoretzky-Kiefer-Wolfowitz (Massart's constant): P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2) for
    # n i.i.d. draws of any distribution, so eps = sqrt(ln(2/p) / 2n) fails with probability <= p.
    return math.sqrt(math.log(2 / p) / (2 * n))


def _sup_distance(samples: list[int], pmf: dict[int, Fraction]) -> float:
    n = len(samples)
    counts: dict[int, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(pmf)  # no value the definition rules out
    worst, emp, cdf = 0.0, 0, Fraction(0)
    for v in sorted(pmf):
        emp += counts.get(v, 0)
        cdf += pmf[v]
        worst = max(worst, abs(emp / n - float(cdf)))
    return worst


def test_last_id_is_distributed_as_the_definition_says():
    # The last id is u_(K-1) + N - 1. From the definition alone, with M = L - N:
    # K = 2: u_1 ~ U{0..M}: P(u_1 = m) = 1/(M+1);
    # K = 3: u_1 ~ U{0..M}, u_2 ~ U{u_1..M}: P(u_2 = m) = sum_{a<=m} 1/(M+1) * 1/(M-a+1).
    # The empirical CDF of n draws must lie within the DKW band (failure probability 1e-6 for a
    # correct sampler; the seed is fixed, so the test is deterministic), and the mean within 5
    # standard errors of the exact mean.
    window, target, n = 12, 60, 6000
    m = target - window
    pmfs = {
        2: {window - 1 + u: Fraction(1, m + 1) for u in range(m + 1)},
        3: {window - 1 + u: sum((Fraction(1, m + 1) * Fraction(1, m - a + 1) for a in range(u + 1)), Fraction(0))
            for u in range(m + 1)},
    }
    for chunks, pmf in pmfs.items():
        assert sum(pmf.values()) == 1
        last = pose_position_ids_batch(n, window, target, chunks, _gen(10 + chunks))[:, -1].tolist()
        assert _sup_distance(last, pmf) < _dkw(n)
        mean = sum(v * float(p) for v, p in pmf.items())
        sd = math.sqrt(sum((v - mean) ** 2 * float(p) for v, p in pmf.items()))
        assert abs(sum(last) / n - mean) < 5 * sd / math.sqrt(n)
        assert len(set(last)) == m + 1  # spread: every allowed last id occurs (each has P >= 1/(M+1)^2 ... here >= 1/49)


def test_split_point_is_uniform():
    # 2 chunks: the first chunk's length l_0 is uniform over {1, .., N-1} (the paper's uniform split point).
    window, n = 20, 6000
    lengths, _ = pose_layout(n, window, 100, 2, _gen(5))
    pmf = {v: Fraction(1, window - 1) for v in range(1, window)}
    assert _sup_distance(lengths[:, 0].tolist(), pmf) < _dkw(n)


@pytest.mark.parametrize("args,name", [
    ((0, 10, 1), "window"), ((8, 7, 2), "target"), ((8, 16, 0), "chunks"), ((8, 16, 9), "chunks"),
    ((8.0, 16, 2), "window"), ((8, 16, True), "chunks"),
])
def test_bad_inputs_name_the_parameter(args, name):
    with pytest.raises(UsageError, match=name):
        pose_position_ids(*args, _gen())
    with pytest.raises(UsageError, match="batch"):
        pose_position_ids_batch(0, 8, 16, 2, _gen())


# -- posenc extend --pose ------------------------------------------------------------------------------


def interrupted(args: list[str], at: int = 3) -> int:
    """``posenc extend`` with these arguments, interrupted (Ctrl-C) when training reaches step ``at``."""
    import posenc.extend.extend as module

    def stop(event):
        if isinstance(event, StepDone) and event.step == at:
            raise KeyboardInterrupt

    original = module.train
    module.train = lambda *a, **k: original(*a, **{**k, "report": stop})
    try:
        return main(args)
    finally:
        module.train = original


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_rope_checkpoint(tmp_path_factory.mktemp("pose"))


def _args(ckpt, text, out, *more):
    return ["extend", str(ckpt), "--out", str(out), "--scaling", "yarn", "--train-length", "16", "--length", "64",
            "--steps", "6", "--batch-size", "3", "--checkpoint-every", "2", "--data", str(text), "--valid-bytes", "512",
            "--eval-lengths", "16", "64", "--threads", "1", "--no-progress", "--pose", *more]


def test_pose_batches_are_short_windows_with_skipping_ids(tiny):
    ckpt, text = tiny
    cfg = ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=4, batch_size=3, data=str(text),
                          valid_bytes=512, pose=True, pose_chunks=3)
    settings = cfg.settings()
    assert settings.length == 16 and settings.batch_size == 3
    data = ex._Data(ex.load_corpus(str(text), 512))
    plain = data._windows(cfg, settings.data_seed, 3, 16)
    for step in range(4):
        x, y, docs, ids = data.batches(cfg, settings)(step)
        assert docs is None and x.shape == y.shape == ids.shape == (3, 16)
        assert all(torch.equal(a, b) for a, b in zip((x, y), plain(step)))  # the windows the text gives, unchanged
        assert torch.equal(ids, step_positions(FINETUNE_STREAM, step, 3, 16, 64, 3))
    assert ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=4, batch_size=3).settings().length == 64
    assert ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=4, tokens_per_step=320, pose=True).settings().batch_size == 20
    with pytest.raises(UsageError, match="pose"):
        ex.ExtendConfig(scaling="drope", length=64, train_length=16, steps=1, pose=True)
    with pytest.raises(UsageError, match="pose"):
        ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=1, pose=True, pack_documents=True)
    with pytest.raises(UsageError, match=r"pose_chunks.*\[1, window=16\]"):
        ex.ExtendConfig(scaling="yarn", length=64, train_length=16, steps=1, pose=True, pose_chunks=17)
    assert main(["extend", str(ckpt), "--out", "unused", "--scaling", "yarn", "--train-length", "16", "--length", "64",
                 "--steps", "1", "--pose-chunks", "3"]) == 2  # --pose-chunks needs --pose


def test_interrupted_pose_run_resumes_exactly(tiny, tmp_path):
    ckpt, text = tiny
    assert main(_args(ckpt, text, tmp_path / "whole")) == 0
    whole = json.loads((tmp_path / "whole" / "extend.json").read_text())
    assert whole["settings"]["pose"] is True and whole["settings"]["pose_chunks"] == 2
    assert whole["recipe"]["name"] == "pose" and (whole["recipe"]["window"], whole["recipe"]["target"]) == (16, 64)
    assert (tmp_path / "whole" / "table.csv").read_text().startswith(
        "length,base_perplexity,zero_shot_perplexity,pose_extended_perplexity")
    assert json.loads((tmp_path / "whole" / "table.json").read_text())["recipe"] == "pose"
    assert load_checkpoint(tmp_path / "whole" / "model.safetensors").config.encoding_options["scaling"]["rope_type"] == "yarn"

    assert interrupted(_args(ckpt, text, tmp_path / "broken")) == 130  # (the command's code for an interrupt)
    assert (tmp_path / "broken" / "state.pt").exists()  # the state of step 2
    assert main(_args(ckpt, text, tmp_path / "broken", "--resume")) == 0
    broken = json.loads((tmp_path / "broken" / "extend.json").read_text())
    assert broken["train"]["losses"] == whole["train"]["losses"]
    assert broken["scores"] == whole["scores"] and broken["table"] == whole["table"]
    a = load_checkpoint(tmp_path / "whole" / "model.safetensors").state_dict()
    b = load_checkpoint(tmp_path / "broken" / "model.safetensors").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The ids reach the model: with one chunk (ids 0..15, the same windows) the weights differ.
    assert main(_args(ckpt, text, tmp_path / "one", "--pose-chunks", "1")) == 0
    c = load_checkpoint(tmp_path / "one" / "model.safetensors").state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def _hf_args(folder, text, out, *more):
    return ["extend", str(folder), "--out", str(out), "--scaling", "yarn", "--length", "64", "--steps", "6",
            "--batch-size", "3", "--checkpoint-every", "2", "--data", str(text), "--valid-bytes", "512",
            "--eval-lengths", "16", "64", "--threads", "1", "--no-progress", "--pose", *more]


def _hf_weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model" / "model.safetensors"))


def test_a_transformers_model_trains_with_pose_and_resumes_exactly(tiny, tmp_path):
    # posenc.hf reads ids that increase and skip as one document: the PoSE ids reach the model as position_ids.
    transformers = pytest.importorskip("transformers")
    from posenc.extend.extend_hf import HFCheckpoint

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=32, vocab_size=256, max_position_embeddings=16)
    _, text = tiny
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)

    # the trained model's forward with PoSE ids is transformers' own YaRN model fed them as position_ids
    models = HFCheckpoint.of(folder)
    block = ex.scaling_block("yarn", 4.0, 16, models.rope.base, models.rope.rotary_dim)
    study = models.trainable(block)
    own = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**config.to_dict(), "rope_parameters": {**block, "rope_theta": models.rope.base}}))
    own.load_state_dict(models.model.state_dict())
    ids = step_positions(FINETUNE_STREAM, 0, 3, 16, 64, 3)
    x = torch.randint(0, 256, (3, 16), generator=_gen(2))
    with torch.no_grad():
        want = own(x, position_ids=ids, attention_mask=torch.ones_like(x)).logits
        assert float((study(x, positions=ids) - want).abs().max()) < 1e-5
    with pytest.raises(UsageError, match="positions"):
        study(x[:, :4], positions=torch.tensor([0, 5, 5, 6]))

    assert main(_hf_args(folder, text, tmp_path / "whole")) == 0
    whole = json.loads((tmp_path / "whole" / "extend.json").read_text())
    assert whole["settings"]["pose"] is True and whole["recipe"]["name"] == "pose"
    assert whole["saved"]["format"] == "transformers"
    assert all(math.isfinite(s["perplexity"]) for s in whole["scores"]["extended"])

    assert interrupted(_hf_args(folder, text, tmp_path / "broken")) == 130
    assert (tmp_path / "broken" / "state.pt").exists()
    assert main(_hf_args(folder, text, tmp_path / "broken", "--resume")) == 0
    broken = json.loads((tmp_path / "broken" / "extend.json").read_text())
    assert broken["train"]["losses"] == whole["train"]["losses"]
    assert broken["scores"] == whole["scores"] and broken["table"] == whole["table"]
    a, b = _hf_weights(tmp_path / "whole"), _hf_weights(tmp_path / "broken")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # The ids reach the model: with one chunk (ids 0..15, the same windows) the weights differ.
    assert main(_hf_args(folder, text, tmp_path / "one", "--pose-chunks", "1")) == 0
    c = _hf_weights(tmp_path / "one")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_a_pose_window_shorter_than_the_train_length() -> None:
    """--pose-window N trains on windows of N tokens whose ids still skip over the target length."""
    from posenc.errors import UsageError
    from posenc.extend.extend_config import ExtendConfig

    cfg = ExtendConfig(scaling="yarn", length=256, steps=2, train_length=64, pose=True, pose_window=16)
    assert cfg.settings().length == 16
    with pytest.raises(UsageError, match="pose_window"):
        ExtendConfig(scaling="yarn", length=256, steps=2, train_length=64, pose=True, pose_window=65)
    with pytest.raises(UsageError, match="pose_window"):
        ExtendConfig(scaling="yarn", length=256, steps=2, train_length=64, pose_window=16)
