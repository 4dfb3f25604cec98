"""The arguments of ``generate`` / ``stream`` / ``posenc sample``: the arguments a new user
tries (each a UsageError with the exact message), and generation that follows ``transformers``'
conventions (greedy by default, the prompt and the new tokens in one padded tensor, end and pad
ids, left-padding masks, several sequences per prompt, a cache that grows as it goes)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import posenc
from models import saved_learned_lm, tiny_lm
from posenc.cli import main
from posenc.errors import UsageError
from posenc.model import generate as gen
from posenc.model.checkpoint import save_checkpoint


def seeded_lm(method: str = "alibi", vocab: int = 64, max_positions: int | None = None) -> posenc.LM:
    return tiny_lm(method, vocab_size=vocab, weights_std=0.3, seed=0, max_positions=max_positions)


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


PROMPT = torch.tensor([[1, 2, 3]])


# ---- arguments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options,message", [
    (dict(eos_token_id=5.0), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got 5.0"),
    (dict(eos_token_id=3.7), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got 3.7"),
    (dict(eos_token_id="10"), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got '10'"),
    (dict(eos_token_id=["10"]), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got '10'"),
    (dict(eos_token_id=[True]), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got True"),
    (dict(eos_token_id=64), "eos_token_id must be a token id, an integer in [0, vocab_size=64), got 64"),
    (dict(eos_token_id=[]), "eos_token_id must be an integer token id or a non-empty list of them, got []"),
    (dict(pad_token_id=-1), "pad_token_id must be a token id, an integer in [0, vocab_size=64), got -1"),
    (dict(do_sample=True, temperature=0), "temperature must be a finite number > 0 (greedy decoding is do_sample=False), got 0"),
    (dict(do_sample=True, temperature=float("inf")), "temperature must be a finite number > 0, got inf"),
    (dict(do_sample=True, temperature=float("nan")), "temperature must be a finite number > 0, got nan"),
    (dict(do_sample="yes"), "do_sample must be True or False, got 'yes'"),
    (dict(seed=2**64), f"seed must be an integer in [0, 2**64 - 1] or None, got {2**64}"),
    (dict(seed=1.5), "seed must be an integer in [0, 2**64 - 1] or None, got 1.5"),
    (dict(num_return_sequences=2), "num_return_sequences=2 needs do_sample=True: greedy decoding would return the "
                                   "same sequence every time"),
    (dict(num_return_sequences=0), "num_return_sequences must be a positive integer (>= 1), got 0"),
    (dict(attention_mask=torch.ones(1, 2)), "attention_mask must be a tensor of the prompt's shape (1, 3), got (1, 2)"),
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), "attention_mask row 0 is not left padding (zeros first, then "
                                                     "ones): generation continues after the last token, so padding "
                                                     "must come before the prompt"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), "attention_mask row 0 is all padding: every prompt needs at least one token"),
    (dict(attention_mask=torch.tensor([[0, 2, 1]])), "attention_mask must hold only 0 (padding) and 1 (a real token)"),
    (dict(prompt=[[1, 2]], attention_mask=torch.ones(1, 2)), "attention_mask goes with a (batch, length) prompt tensor; "
                                                              "a list of prompts needs none (each row is its own length)"),
    (dict(prompt=[["a"]]), "prompt row 0 must be a 1-D tensor of integer token ids, got ['a']"),
])
def test_bad_arguments(options, message) -> None:
    model = seeded_lm()
    prompt = options.pop("prompt", PROMPT)
    with raises(message):
        model.generate(prompt, 4, **options)
    with raises(message):
        next(gen.stream(model, prompt, 4, **options))


def test_neighbours_of_the_bad_arguments_work() -> None:
    model = seeded_lm()
    for eos in (5, [5, 6], (7,), torch.tensor([5, 6]), torch.tensor(5)):
        assert model.generate(PROMPT, 3, eos_token_id=eos).shape[0] == 1
    assert model.generate(PROMPT, 3, do_sample=True, seed=2**64 - 1).shape == (1, 6)


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    model = seeded_lm()
    greedy = model.generate(PROMPT, 6)
    for t in (1e-45, 1e-30, 1e-8):  # before: inf/nan probabilities, a RuntimeError from multinomial
        assert torch.equal(model.generate(PROMPT, 6, do_sample=True, temperature=t, seed=0), greedy)


def test_the_largest_seed_with_a_batch_wraps_around() -> None:
    model = seeded_lm()
    # before: seed + row overflowed torch's seed range for row 1
    two = model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), 5, do_sample=True, seed=2**64 - 1)
    row1 = model.generate(torch.tensor([[4, 5, 6]]), 5, do_sample=True, seed=0)  # (2**64 - 1) + 1 wraps to 0
    assert torch.equal(two[1], row1[0])


def test_run_until_the_end_token_grows_the_cache_instead_of_reserving_it(monkeypatch) -> None:
    model = seeded_lm()
    first = int(model.generate(PROMPT, 1)[0, -1])  # what greedy produces first: make it the end token
    caches = []
    real = posenc.LM.new_cache

    def spy(self, *args, **kwargs):
        caches.append(real(self, *args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(posenc.LM, "new_cache", spy)
    out = model.generate(PROMPT, 10**9, eos_token_id=first)  # before: a 10**9-token cache, dead in the allocator
    assert out.tolist() == [[1, 2, 3, first]]
    assert max(caches[0].layers[0].capacities) <= 16
    # and a longer run keeps doubling from what it needs
    caches.clear()
    model.generate(PROMPT, 40)
    capacities = caches[0].layers[0].capacities
    assert capacities[0] <= 16 and max(capacities) < 128


# ---- generation as transformers does it -------------------------------------------------------------


def test_greedy_by_default_and_the_same_at_every_call() -> None:
    model = seeded_lm()
    a, b = model.generate(PROMPT, 8), model.generate(PROMPT, 8)
    assert torch.equal(a, b) and a.shape == (1, 11) and torch.equal(a[:, :3], PROMPT)
    with torch.no_grad():
        logits = model(a)
    assert torch.equal(a[0, 3:], logits[0, 2:-1].argmax(-1))


def test_sampling_without_a_seed_follows_torch_manual_seed() -> None:
    model = seeded_lm()
    torch.manual_seed(11)
    a = model.generate(PROMPT, 8, do_sample=True, temperature=2.0)
    torch.manual_seed(11)
    b = model.generate(PROMPT, 8, do_sample=True, temperature=2.0)
    assert torch.equal(a, b)


def test_eos_then_pad_and_pad_defaults_to_eos() -> None:
    model = seeded_lm()
    prompts = torch.tensor([[1, 2, 3], [9, 8, 7]])
    free = model.generate(prompts, 10)
    eos = int(free[0, 5])  # row 0 ends at its third new token
    out = model.generate(prompts, 10, eos_token_id=eos)  # pad_token_id defaults to eos_token_id
    end0 = int((free[0, 3:] == eos).nonzero()[0]) + 1
    assert torch.equal(out[0, : 3 + end0], free[0, : 3 + end0]) and (out[0, 3 + end0:] == eos).all()
    padded = model.generate(prompts, 10, eos_token_id=eos, pad_token_id=0)
    assert (padded[0, 3 + end0:] == 0).all() and int(padded[0, 3 + end0 - 1]) == eos
    hits = (free[1, 3:] == eos).nonzero()
    if hits.numel() == 0:  # row 1 never ends: it runs all 10 steps, and so does the tensor
        assert torch.equal(padded[1], free[1])


def test_attention_mask_left_padding_equals_the_list_of_prompts() -> None:
    model = seeded_lm("rope")
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([3, 4])]
    listed = model.generate(prompts, 6, pad_token_id=0)
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    masked = model.generate(ids, 6, attention_mask=mask, pad_token_id=0)
    assert torch.equal(listed, masked) and torch.equal(masked[:, :5], ids)
    alone = model.generate(prompts[1][None], 6)
    assert torch.equal(masked[1, 5:], alone[0, 2:])  # the padded row is what it is alone


def test_num_return_sequences_repeats_each_prompt_in_place() -> None:
    model = seeded_lm()
    prompts = torch.tensor([[1, 2, 3], [9, 8, 7]])
    out = model.generate(prompts, 6, do_sample=True, temperature=3.0, num_return_sequences=3, seed=4)
    assert out.shape == (6, 9)
    assert torch.equal(out[:, :3], prompts.repeat_interleave(3, dim=0))
    for r in range(6):  # output row r draws from seed + r
        alone = model.generate(prompts[r // 3][None], 6, do_sample=True, temperature=3.0, seed=4 + r)
        assert torch.equal(out[r], alone[0])
    assert len({tuple(out[r].tolist()) for r in range(3)}) > 1


# ---- posenc sample ----------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    return saved_learned_lm(tmp_path, max_positions=33)


def test_a_full_table_prompt_plus_one_token(checkpoint, capsys) -> None:
    # before: "max_new_tokens must be <= 0" for a 33-byte prompt + 1 token (the last is never fed back)
    assert main(["sample", str(checkpoint), "--prompt", "x" * 33, "--max-new-tokens", "1", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("x" * 33)
    assert main(["sample", str(checkpoint), "--prompt", "x" * 33, "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == ("posenc sample: error: max_new_tokens must be <= 1 here: the model has "
                                       "max_positions=33 learned positions and the prompt has 33 tokens (the last new "
                                       "token is not fed back)\n")


def test_a_prompt_that_is_not_utf8_uses_its_bytes(checkpoint) -> None:
    from posenc.study.sample import sample

    raw = b"caf\xe9 "  # Latin-1, as a terminal might pass it; Python's argv holds it with a surrogate
    prompt = raw.decode("utf-8", errors="surrogateescape")
    out = io.StringIO()
    new = sample(checkpoint, prompt, max_new_tokens=4, temperature=0, out=out)
    assert out.getvalue().startswith("caf\ufffd ")
    model = posenc.load_checkpoint(checkpoint)
    want = model.generate(torch.tensor([list(raw)]), 4)[0, len(raw):]
    assert new == bytes(want.tolist()).decode("utf-8", errors="replace")


def test_output_piped_into_head_ends_quietly(tmp_path) -> None:
    import os

    model = posenc.LM(posenc.LMConfig(encoding="alibi", vocab_size=256, dim=16, depth=1, num_heads=2))
    path = tmp_path / "alibi.safetensors"
    save_checkpoint(model, path)
    code = (f"import sys; from posenc.cli import main; sys.exit(main(['sample', {str(path)!r}, '--prompt', 'hi', "
            "'--max-new-tokens', '100000', '--temperature', '0']))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(posenc.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.read(2) == b"hi"
    proc.stdout.close()  # what `head -c 2` does: before, a BrokenPipeError traceback
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0
    assert err == ""


def test_a_json_given_for_the_weights_says_give_the_safetensors(checkpoint, capsys) -> None:
    json_path = checkpoint.with_suffix(".json")
    assert main(["sample", str(json_path), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"posenc sample: error: checkpoint: give the weights file {str(checkpoint)!r}, not its json {str(json_path)!r} "
        "(a study writes OUT/checkpoints/METHOD.safetensors beside METHOD.json)\n")
    with raises(f"path: give the weights file {checkpoint}, not its json {json_path}"):
        posenc.load_checkpoint(json_path)


def test_checkpoint_dtypes_are_checked(tmp_path) -> None:
    import hashlib
    import json

    from safetensors.torch import load, save

    model = posenc.LM(posenc.LMConfig(encoding="alibi", vocab_size=64, dim=16, depth=1, num_heads=2))
    path = tmp_path / "m.safetensors"
    save_checkpoint(model, path)
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    tensors = load(data)
    tensors["tok.weight"] = tensors["tok.weight"].to(torch.int32)  # an int32 file: was loaded as float32
    forged = save(tensors, metadata=header)
    path.write_bytes(forged)
    meta = json.loads(path.with_suffix(".json").read_text())
    meta["weights"].update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    path.with_suffix(".json").write_text(json.dumps(meta))
    with raises(f"path: {path}'s tensors have other dtypes than its config's model (tok.weight: model float32, file int32)"):
        posenc.load_checkpoint(path)


def test_the_documented_import_of_stream_works() -> None:
    # docs/decoding.md once wrote posenc.model.generate.stream(...), an AttributeError after `import posenc`
    import subprocess as sp

    code = "from posenc.model.generate import stream, generate; import posenc; print(callable(stream), callable(posenc.LM.generate))"
    out = sp.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                 env={**__import__("os").environ, "PYTHONPATH": str(Path(posenc.__file__).parents[1])})
    assert out.stdout == "True True\n"
    from pathlib import Path as P
    docs = (P(posenc.__file__).parents[2] / "docs" / "decoding.md")
    if docs.exists():
        assert "posenc.model.generate.stream(" not in docs.read_text()
