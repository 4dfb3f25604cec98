"""LoRA (PEFT) on a model after posenc.hf.use, with a learned encoding (T5's table, FIRE's MLP):
posenc's parameters trained through ``modules_to_save``, saved with the adapter, reloaded onto a
fresh base, merged (issue 48, item 10).

The reference for "the attention runs the trained copy" is built by hand, without PEFT: the base
model with each LoRA pair's ``B @ A * scaling`` added to its projection and the trained copy's
parameters loaded into posenc's encoding. Were the attention to call the module installed by
``use`` (the frozen original), the PEFT model would differ from it.
"""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import posenc.hf as phf  # noqa: E402
from hf_family_configs import logits, tokens  # noqa: E402 (tests/hf_family_configs.py: the ids and logits every hf test uses)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def base(name: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    model = phf.use(LlamaForCausalLM(config), name)
    return model.eval()


def lora(model, modules_to_save: list[str]):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save,
                             init_lora_weights=False)  # (random B: the LoRA delta is not zero from the start)
    return peft.get_peft_model(model, config)


def trained(model, steps: int = 3):
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for step in range(steps):
        ids = tokens(2, 12, seed=10 + step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def by_hand(plain, tuned) -> LlamaForCausalLM:
    """``plain`` (the base before PEFT) with the LoRA deltas of ``tuned`` added and ``tuned``'s copy of
    posenc's encoding loaded, without PEFT."""
    out = copy.deepcopy(plain)
    state = dict(tuned.named_parameters())
    with torch.no_grad():
        for name, module in out.named_modules():
            a = state.get(f"base_model.model.{name}.lora_A.default.weight")
            if a is None:
                continue
            b = state[f"base_model.model.{name}.lora_B.default.weight"]
            module.weight += b @ a * (8 / 4)  # (out, r) @ (r, in) * lora_alpha / r
        copies = {n: p for n, p in state.items() if "posenc_encodings" in n and ".modules_to_save.default." in n}
        assert copies, "PEFT made no copy of posenc's encoding"
        held = dict(out.named_parameters())
        for n, p in copies.items():
            held[plain_name(n)].copy_(p)
    return out


def plain_name(name: str) -> str:
    """A PEFT model's name of a copy of posenc's parameter -> the name of that parameter without PEFT."""
    return name.removeprefix("base_model.model.").replace(".modules_to_save.default", "")


@pytest.mark.parametrize("save", [["posenc_encodings"], ["posenc_encodings.0"]], ids=["whole", "each"])
@pytest.mark.parametrize("name", ["t5", "fire"])
def test_lora_trains_saves_reloads_and_merges_posenc_parameters(name: str, save: list[str], tmp_path) -> None:
    plain = base(name)
    plain.save_pretrained(tmp_path / "base")
    before = {n: p.detach().clone() for n, p in plain.named_parameters() if "posenc_encodings" in n}
    tuned = trained(lora(copy.deepcopy(plain), save))
    ids = tokens(2, 16, seed=5)
    got = logits(tuned, ids)

    # the copy was trained (the original stays as it was), and the attention runs the copy
    copies = {n: p for n, p in tuned.named_parameters() if "posenc_encodings" in n and "modules_to_save" in n}
    originals = {n: p for n, p in tuned.named_parameters() if "posenc_encodings" in n and "original_module" in n}
    assert copies and all(p.requires_grad for p in copies.values())
    assert all(not p.requires_grad for p in originals.values())
    assert max(float((p.detach() - before[plain_name(n)]).abs().max()) for n, p in copies.items()) > 1e-3
    reference = by_hand(plain, tuned)
    torch.testing.assert_close(got, logits(reference, ids), rtol=0, atol=2e-5)
    with tuned.disable_adapter():  # adapters off: the base model, its original encoding
        torch.testing.assert_close(logits(tuned, ids), logits(plain, ids), rtol=0, atol=1e-6)

    # saved with the adapter, reloaded onto a fresh base: the same model
    tuned.save_pretrained(tmp_path / "adapter")
    fresh = phf.from_pretrained(AutoModelForCausalLM, tmp_path / "base").eval()
    torch.testing.assert_close(logits(fresh, ids), logits(plain, ids), rtol=0, atol=0)
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded, ids), got, rtol=0, atol=1e-6)

    # merged: a plain posenc.hf model holding the trained encoding, saved and loaded as one
    merged = reloaded.merge_and_unload()
    kept = {n: p for n, p in merged.named_parameters() if "posenc_encodings" in n}
    assert sorted(kept) == sorted(before)  # (PEFT's wrapper gone: the trained copy in its place)
    assert all(torch.equal(kept[plain_name(n)], p) for n, p in copies.items())
    torch.testing.assert_close(logits(merged, ids), got, rtol=0, atol=2e-5)
    merged.save_pretrained(tmp_path / "merged")
    back = phf.from_pretrained(AutoModelForCausalLM, tmp_path / "merged").eval()
    torch.testing.assert_close(logits(back, ids), logits(merged, ids), rtol=0, atol=0)
