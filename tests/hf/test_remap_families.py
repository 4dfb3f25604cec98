"""The training-free position remaps (SelfExtend, ReRoPE, STRING, DCA) inside every family of posenc's
table, each built from a tiny config with random weights.

A remap takes each RoPE layer's own base and scaling and keeps the family's windows, sinks and NoPE
layers. Two checks per family: a remap that is plain RoPE on the call (SelfExtend with G = 1, ReRoPE
with a window past the length) *is* the untouched model (logits, a left-padded batch, greedy
decoding); a remap that is not (DCA with chunks shorter than the call, SelfExtend with G = 3) keeps
the invariants: cached greedy decoding equals the full forward of the generated tokens, a padded row
equals the row alone, a packed row its documents alone. A family whose attention a remap cannot
serve is refused by ``use`` with a UsageError, before any forward.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from posenc.errors import UsageError
from posenc.hf.families import family_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
import posenc.hf as phf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_families import err, logits, packed_and_alone, tokens, untouched  # noqa: E402

from hf_family_configs import TESTED  # noqa: E402

#: Families a remap refuses in their tiny config, and the words of the refusal (none today: a family
#: is refused under a length-dependent scaling only, test_a_length_dependent_scaling_is_refused_at_use).
REFUSED: dict[str, str] = {}


def use_or_refusal(model, name: str, **options):
    try:
        return phf.use(model, name, **options), None
    except UsageError as e:
        return None, str(e)


@pytest.mark.parametrize("model_type", list(TESTED))
def test_a_remap_that_is_plain_rope_on_the_call_is_the_untouched_model(model_type: str) -> None:
    ref = untouched(model_type)
    ids = tokens(2, 20)  # past every window (8)
    for name, options in (("selfextend", dict(group=1, window=4)), ("rerope", dict(window=64))):
        model, refusal = use_or_refusal(copy.deepcopy(ref), name, **options)
        if refusal is not None:
            assert REFUSED.get(model_type) and REFUSED[model_type] in refusal, refusal
            return
        assert err(logits(model, ids), logits(ref, ids)) < 1e-5, name
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[0, :5] = 0
        real = mask.bool()
        if not family_of(model_type).temperature:  # Llama 4's temperature counts padding slots (test_families.padded_reference)
            assert err(logits(model, ids, attention_mask=mask)[real], logits(ref, ids, attention_mask=mask)[real]) < 1e-5, name
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        assert torch.equal(ours, ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)), name


@pytest.mark.parametrize("name, options", [("dca", dict(chunk_size=9, local_size=3)), ("selfextend", dict(group=3, window=5))])
@pytest.mark.parametrize("model_type", list(TESTED))
def test_a_remap_keeps_the_invariants_in_the_family(model_type: str, name: str, options: dict) -> None:
    model, refusal = use_or_refusal(untouched(model_type), name, **options)
    if refusal is not None:
        assert REFUSED.get(model_type) and REFUSED[model_type] in refusal, refusal
        return
    if not family_of(model_type).no_attention:
        assert packed_and_alone(model, model) < 1e-5
    ids = tokens(2, 22)
    mask = torch.ones(2, 22, dtype=torch.long)
    mask[1, :4] = 0
    # A remap reads positions themselves: the padded row's ids count from its first real token, as generate's do.
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    assert err(logits(model, ids, attention_mask=mask, position_ids=position_ids)[1, 4:], logits(model, ids[1:, 4:])[0]) < 1e-5
    out = model.generate(ids[:1], max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    full = logits(model, out.sequences, use_cache=False)[0]
    for step, step_logits in enumerate(out.logits):
        assert err(step_logits[0], full[21 + step]) < 1e-4, step


def test_a_length_dependent_scaling_is_refused_at_use() -> None:
    """Phi-3 under LongRoPE (its rotation switches factors with the length): refused by use, naming the scaling."""
    config = transformers.AutoConfig.for_model("phi3", **{**__import__("hf_family_configs").config_kwargs("phi3"), "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UsageError, match="scaling"):
        phf.use(model, "selfextend")


def test_two_caches_decoding_in_turn_keep_their_own_rotated_keys() -> None:
    """The kept rotated keys of a decode step live in the model's workspace, one slot per layer: two
    caches of the same length decoding in turn must each get their own rows (checked by the raw keys)."""
    model = phf.use(untouched("llama"), "selfextend", group=3, window=5)
    a, b = tokens(1, 40, seed=3), tokens(1, 40, seed=4)
    caches = [transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)]
    with torch.no_grad():
        got: list[list[torch.Tensor]] = [[], []]
        for i, x in enumerate((a, b)):
            got[i].append(model(x[:, :30], cache=caches[i], use_cache=True).logits[:, -1])
        for t in range(30, 40):
            for i, x in enumerate((a, b)):
                got[i].append(model(x[:, t:t + 1], cache=caches[i], use_cache=True).logits[:, -1])
    for i, x in enumerate((a, b)):
        assert err(torch.stack(got[i][:-1], 1), logits(model, x, use_cache=False)[:, 29:-1]) < 1e-4, i
