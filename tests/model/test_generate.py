"""Generation (posenc/model/generate.py) and ``posenc sample`` (posenc/study/sample.py).

Batches of prompts of different lengths give each row what it gets alone (every method, and the
fallback for encodings that are not shift-invariant); greedy is the argmax of the full forward;
sampling repeats with a seed; top-k / top-p against Hugging Face's logits warpers; errors; the
``sample`` command end to end on a checkpoint saved here."""

from __future__ import annotations

import io

import pytest
import torch

import posenc
from models import saved_learned_lm, tiny_lm
from posenc.cli import main
from posenc.errors import UsageError
from posenc.model import generate as gen
from toy_encodings import registered

METHODS = posenc.available()


@pytest.fixture(autouse=True)
def _toys_and_one_thread(monkeypatch, one_thread):  # one_thread: conftest.py
    registered(monkeypatch)


def sharp_lm(method: str, vocab: int = 64, max_positions: int | None = None) -> posenc.LM:
    # weights redrawn large: logits of several units, argmax ties are out of the question
    return tiny_lm(method, vocab_size=vocab, weights_std=0.3,
                    max_positions=max_positions or (64 if method == "learned" else None))


def run(model, prompts, new=6, **options):
    steps = list(gen.stream(model, prompts, new, **options))
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)  # (B, new), (B, new, V)


PROMPT_LENGTHS = (5, 11, 1, 8)


@pytest.mark.parametrize("method", METHODS + ["toy_scaled_rope", "toy_absolute_key"])
def test_a_batch_of_different_lengths_gives_each_row_what_it_gets_alone(method):
    model = sharp_lm(method)
    prompts = [torch.randint(0, 64, (n,)) for n in PROMPT_LENGTHS]
    tokens, logits = run(model, prompts)
    for b, prompt in enumerate(prompts):
        alone_tokens, alone_logits = run(model, [prompt])
        assert torch.equal(tokens[b], alone_tokens[0])
        torch.testing.assert_close(logits[b], alone_logits[0], rtol=0, atol=5e-5)


def test_shared_positions_would_be_wrong_for_a_method_that_is_not_shift_invariant(monkeypatch):
    """The fallback is needed: forcing one padded batch on an absolute-position bias changes the rows."""
    model = sharp_lm("toy_absolute_key")
    assert not gen.shares_positions(model.encoding)
    prompts = [torch.randint(0, 64, (n,)) for n in PROMPT_LENGTHS]
    _, grouped = run(model, prompts)
    monkeypatch.setattr(gen, "shares_positions", lambda encoding: True)
    _, shared = run(model, prompts)
    assert (grouped - shared).abs().max() > 1e-2


def test_which_encodings_share_positions():
    # Every registered method batches with shared positions, except where the rotation follows the
    # current length (xPos centred) or the bias depends on positions themselves (FIRE normalises by
    # the query's position; CoPE counts gates over the keys, padding included): equal-length groups.
    # Position remaps (SelfExtend's groups, DCA's chunks) read positions themselves, not i - j alone;
    # so do Inkling's curves with their long-context factor (log_scaling), on the query's position;
    # selective attention's unmaskable first key is each row's first real token.
    own = {"fire", "cope", "selfextend", "rerope", "string", "dca", "inkling", "xdrope", "fope", "selective"}
    for method in METHODS:
        enc = sharp_lm(method).encoding
        assert gen.shares_positions(enc) == (not enc.rotation_depends_on_length and method not in own), method
    assert not gen.shares_positions(sharp_lm("toy_scaled_rope").encoding)
    assert not gen.shares_positions(sharp_lm("toy_absolute_key").encoding)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_the_argmax_of_the_full_forward(method):
    model = sharp_lm(method)
    prompt = torch.randint(0, 64, (2, 7))
    out = model.generate(prompt, 8)  # (2, 7 + 8): greedy by default
    assert out.shape == (2, 15) and torch.equal(out[:, :7], prompt)
    new = out[:, 7:]
    with torch.no_grad():
        logits = model(torch.cat((prompt, new), dim=1))  # (2, 15, V)
    assert torch.equal(new, logits[:, 6:-1].argmax(-1))


def test_sampling_repeats_with_a_seed_and_rows_do_not_depend_on_each_other():
    model = sharp_lm("alibi")
    prompts = [torch.randint(0, 64, (n,)) for n in (4, 9, 6)]
    options = dict(do_sample=True, temperature=1.5, seed=7)
    a, _ = run(model, prompts, 20, **options)
    b, _ = run(model, prompts, 20, **options)
    assert torch.equal(a, b)
    c, _ = run(model, prompts, 20, do_sample=True, temperature=1.5, seed=8)
    assert not torch.equal(a, c)
    row2, _ = run(model, [prompts[2]], 20, do_sample=True, temperature=1.5, seed=9)  # row 2 draws from seed + 2
    assert torch.equal(a[2], row2[0])
    greedy, _ = run(model, prompts, 20)
    assert not torch.equal(a, greedy)
    top1, _ = run(model, prompts, 20, do_sample=True, temperature=1.5, seed=1, top_k=1)  # one candidate: the argmax
    assert torch.equal(top1, greedy)


def test_top_k_and_top_p_match_hugging_face_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(3)
    logits = torch.randn(6, 50) * 3
    ids = torch.zeros(6, 1, dtype=torch.long)
    for k in (1, 5, 49, 50):
        want = TopKLogitsWarper(top_k=k)(ids, logits.clone())
        assert torch.equal(gen.filter_logits(logits, top_k=k), want)
    for p in (0.05, 0.3, 0.9, 0.999):
        want = TopPLogitsWarper(top_p=p)(ids, logits.clone())
        assert torch.equal(gen.filter_logits(logits, top_p=p).isinf(), want.isinf()), p
    both = TopPLogitsWarper(top_p=0.8)(ids, TopKLogitsWarper(top_k=10)(ids, logits.clone()))
    assert torch.equal(gen.filter_logits(logits, top_k=10, top_p=0.8).isinf(), both.isinf())


def test_samples_stay_in_the_nucleus():
    """Many draws of one step: every token is among those top-p keeps, and more than one appears."""
    model = sharp_lm("nope")
    prompt = torch.randint(0, 64, (1, 5))
    logits = run(model, prompt, 1)[1][0, 0]
    kept = (~gen.filter_logits(logits[None] / 2.0, top_p=0.5).isinf())[0]
    seen = {int(run(model, prompt, 1, do_sample=True, temperature=2.0, top_p=0.5, seed=s)[0][0, 0]) for s in range(40)}
    assert all(kept[t] for t in seen) and len(seen) > 1


def test_eos_tokens_end_a_row_and_pad_after_it():
    model = sharp_lm("rope")
    prompts = [torch.randint(0, 64, (n,)) for n in (3, 6)]
    free = run(model, prompts, 12)[0]
    stop = int(free[0, 2])  # row 0 produces it by its third token
    out = model.generate(prompts, 12, eos_token_id=[stop, 63], pad_token_id=5)
    steps = out.shape[1] - 6  # prompts left-padded to 6 with the pad id
    assert torch.equal(out[0, :6], torch.tensor([5, 5, 5, *prompts[0].tolist()])) and torch.equal(out[1, :6], prompts[1])
    ended = []
    for row in range(2):
        hit = ((free[row] == stop) | (free[row] == 63)).nonzero()
        n = 12 if hit.numel() == 0 else int(hit[0]) + 1
        ended.append(n)
        assert torch.equal(out[row, 6 : 6 + min(n, steps)], free[row, : min(n, steps)])
        assert (out[row, 6 + n :] == 5).all()  # padded after its end token
    assert steps == max(ended)  # the stream ends when every row is done
    assert ended[0] <= 3 and int(out[0, 6 + ended[0] - 1]) in (stop, 63)



@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_new_tokens=0), r"max_new_tokens must be a positive integer"),
        (dict(do_sample=True, temperature=-0.5), r"temperature must be a finite number > 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), r"top_k must be a positive integer"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*64 - 1\]"),
        (dict(eos_token_id=[64]), r"eos_token_id must be a token id, an integer in \[0, vocab_size=64\)"),
        (dict(prompt=[torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)]), r"prompt row 1 is empty"),
        (dict(prompt=torch.tensor([[1, 70]])), r"prompt row 0: token ids must be in \[0, vocab_size=64\)"),
        (dict(prompt=torch.tensor([1, 2])), r"prompt must be a \(batch, length\) tensor"),
        (dict(prompt=[torch.tensor([0.5])]), r"prompt row 0 must be a 1-D tensor of integer token ids"),
    ],
)
def test_bad_generation_arguments_are_usage_errors(options, message):
    model = sharp_lm("alibi")
    args = dict(prompt=torch.tensor([[1, 2, 3]]), max_new_tokens=4) | options
    with pytest.raises(UsageError, match=message):
        model.generate(args.pop("prompt"), args.pop("max_new_tokens"), **args)


def test_a_learned_table_bounds_prompt_and_new_tokens():
    model = sharp_lm("learned", max_positions=16)
    with pytest.raises(UsageError, match=r"prompt has 17 tokens, more than the model's learned positions \(max_positions=16\)"):
        model.generate(torch.zeros(1, 17, dtype=torch.long), 1)
    with pytest.raises(UsageError, match=r"max_new_tokens must be <= 7 here"):
        model.generate(torch.zeros(1, 10, dtype=torch.long), 8)
    # the whole table: the 7th new token is produced at position 15 and never fed back (before: refused)
    assert model.generate(torch.zeros(1, 10, dtype=torch.long), 7).shape == (1, 17)
    assert model.generate(torch.zeros(1, 16, dtype=torch.long), 1).shape == (1, 17)


# --- posenc sample -------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    return saved_learned_lm(tmp_path, max_positions=40)


def test_sample_prints_the_prompt_and_what_generate_gives(checkpoint, capsys):
    prompt = "héllo, "
    assert main(["sample", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0.9",
                 "--top-p", "0.9", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    model = posenc.load_checkpoint(checkpoint)
    data = torch.tensor(list(prompt.encode("utf-8")))[None]
    new = model.generate(data, 12, do_sample=True, temperature=0.9, top_p=0.9, seed=3)[0, data.shape[1]:]
    assert printed == prompt + bytes(new.tolist()).decode("utf-8", errors="replace") + "\n"
    assert main(["sample", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0.9",
                 "--top-p", "0.9", "--seed", "3"]) == 0
    assert capsys.readouterr().out == printed  # the same command prints the same text


def test_sample_streams_and_waits_for_whole_characters(checkpoint, monkeypatch):
    """Tokens are written as they come; a UTF-8 character split over steps is written once whole,
    and an invalid byte as U+FFFD."""
    chosen = list("é!".encode("utf-8")) + [0xFF, ord("x")]

    def fake_stream(model, prompt, max_new_tokens, **options):
        for token in chosen:
            yield gen.Step(torch.tensor([token]), torch.zeros(1, 256), torch.zeros(1, dtype=torch.bool))

    import posenc.study.sample as sampling

    monkeypatch.setattr(sampling, "stream", fake_stream)  # the name sample() calls
    writes = []

    class Out(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    assert sampling.sample(checkpoint, "ab", max_new_tokens=4, out=Out()) == "é!\ufffdx"
    assert writes == ["ab", "é", "!", "\ufffd", "x", "\n"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
        (["--temperature", "-1"], "temperature must be a number >= 0"),
        (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["--top-p", "1.01"], r"top_p must be in \(0, 1\]"),
        (["--prompt", "x" * 41], r"prompt has 41 tokens, more than the model's learned positions \(max_positions=40\)"),
        (["--max-new-tokens", "37"], r"max_new_tokens must be <= 36 here"),
        (["--prompt", ""], "prompt must hold at least one character"),
    ],
)
def test_sample_user_errors_are_one_line(checkpoint, capsys, args, message):
    import re

    argv = ["sample", str(checkpoint), "--prompt", "hello"] + args
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed before the error
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("posenc sample: error: ") and re.search(message, lines[0]), lines


def test_sample_names_a_missing_checkpoint(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "nope.safetensors"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posenc sample: error: checkpoint: no file") and "nope.safetensors" in err
