"""FoX (``use(model, "fox")``, the Forgetting Transformer, Lin et al. 2025) in the families whose attention
has sliding windows, attention sinks, a logit soft cap or MLA (issue 47 item 7).

Each family's tiny model (tests/hf_family_configs.py; MiniCPM3 from the census configs, Inkling-2 from
its family test) runs under FoX, and each attention call of a forward is compared with the formula
written out here in float64 from what the layer hands its attention function (q, k, v, the scaling,
the window, the soft cap, the sinks) and the layer's input x (a pre-hook):

    log f_t = log sigmoid(w_h . x_t + b_h)                                (eq. 2, the layer's gate)
    logit_ij = cap(q_i . k_j * scaling) + sum_{l=j+1..i} log f_l          (eq. 4, summed gate by gate)

with the causal mask, the window ``i - W < j <= i`` and the sink logit (gpt-oss: one per head;
Inkling-2: one per query, from ``sink_proj``) as one more softmax column with no value. The gradient
of each layer's output reaches its gate parameters and equals the formula's. Then, per family: cached
greedy decoding past the window equals the full pass (and a static cache gives its tokens), and a
left-padded batch equals its rows alone. Where FoX still cannot run (Zamba2's shared block) use() refuses.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import posenc.hf as phf  # noqa: E402
from hf_census_configs import Case, build  # noqa: E402
from hf_family_configs import TESTED, config_kwargs, logits, perturbed, tokens  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.attention import posenc_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_inkling_family  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

T = 20
#: model_type -> what its attention has beyond full causal attention (each asserted on the calls seen)
FAMILIES = {
    "gemma2": {"window", "softcap"},
    "gemma3_text": {"window"},
    "cohere2": {"window"},
    "mistral": {"window"},
    "gpt_oss": {"window", "sinks"},
    "deepseek_v3": {"mla"},
    "minicpm3": {"mla"},
    "inkling2_text": {"window", "query sinks"},
}
MORE = {"gemma2": dict(attn_logit_softcapping=0.5)}  # a cap the tiny scores reach (the default, 50, barely bends them)


def untouched(model_type: str):
    """The family's tiny model, every weight moved off its init value."""
    if model_type == "inkling2_text":
        return test_inkling_family.untouched(model_type)
    if model_type not in TESTED:
        return build(Case(model_type, "causal-lm"))
    return perturbed(transformers.AutoConfig.for_model(model_type, **config_kwargs(model_type, **MORE.get(model_type, {}))))


def with_fox(model_type: str):
    """``use(untouched, "fox")`` with gates that forget slowly (biases near 3: f ~ 0.95), so the keys a
    window drops still weigh something and the window is felt."""
    model = phf.use(untouched(model_type), "fox")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            plan = module.__dict__.get("_posenc_plan")
            if plan is not None:
                plan.encoding.gate.bias.copy_(3.0 + torch.randn(plan.encoding.gate.bias.shape, generator=gen))
    return model


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def recorded(model, ids: torch.Tensor) -> list[dict]:
    """Each posenc attention call of one forward with gradients: its module, the layer input x, q, k, v,
    the keyword arguments and the output (B, T, H, Dv)."""
    calls: list[dict] = []
    inputs: dict[int, torch.Tensor] = {}

    def recording(module, q, k, v, mask, **kwargs):
        out = posenc_attention(module, q, k, v, mask, **kwargs)
        if "_posenc_plan" in module.__dict__:
            calls.append(dict(module=module, x=inputs[id(module)], q=q, k=k, v=v, kwargs=kwargs, out=out[0]))
        return out

    def keep(module, args, kwargs):
        inputs[id(module)] = args[0] if args else kwargs["hidden_states"]

    hooks = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in model.modules() if "_posenc_plan" in m.__dict__]
    transformers.AttentionInterface.register("posenc", recording)
    try:
        model(ids, use_cache=False)
    finally:
        phf.adapter.register()
        for hook in hooks:
            hook.remove()
    return calls


def window_of(call: dict) -> int | None:
    """The layer's window as transformers hands it to its attention function (or holds it on the module)."""
    return call["kwargs"].get("sliding_window") or getattr(call["module"], "sliding_window", None)


def sinks_of(call: dict) -> torch.Tensor | None:
    """gpt-oss: the module's (H,) sink logits; Inkling-2: the (B, H, T, 1) per-query logits passed."""
    given = call["kwargs"].get("sinks")
    return given if isinstance(given, torch.Tensor) else getattr(call["module"], "sinks", None)


def written_out(call: dict, weight: torch.Tensor, bias: torch.Tensor, *, window: int | None = None, sinks=None,
                softcap: float | None = None, gates: bool = True) -> torch.Tensor:
    """The FoX attention of one call in float64 (see the module docstring): (B, T, H, Dv)."""
    x, q, k, v = (call[n].detach().double() for n in ("x", "q", "k", "v"))
    b, h, t, _ = q.shape
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * call["kwargs"]["scaling"]  # (B, H, T, T)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    log_f = torch.nn.functional.logsigmoid(x @ weight.double().T + bias.double()).transpose(1, 2)  # (B, H, T)
    i, j, g = (torch.arange(t).view(*shape) for shape in ((t, 1, 1), (1, t, 1), (1, 1, t)))
    between = ((g > j) & (g <= i)).double()  # (T, T, T): the gates g with j < g <= i
    if gates:
        s = s + torch.einsum("bhl,ijl->bhij", log_f, between)
    i, j = i[:, :, 0], j[:, :, 0]  # (T, 1), (1, T)
    ok = (j <= i) & ((j > i - window) if window else True)
    s = s.masked_fill(~ok, -math.inf)
    if sinks is not None:
        column = sinks.double().view(1, h, 1, 1).expand(b, h, t, 1) if sinks.dim() == 1 else sinks.double()
        probs = torch.softmax(torch.cat((s, column), -1), -1)[..., :-1]
    else:
        probs = torch.softmax(s, -1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_layer_equals_the_formula_and_its_gate_gets_the_formulas_gradient(model_type: str) -> None:
    model = with_fox(model_type)
    calls = recorded(model, tokens(2, T))
    assert calls and len({id(c["module"]) for c in calls}) == len(calls)
    kinds = FAMILIES[model_type]
    windows = [window_of(c) for c in calls]
    assert ("window" in kinds) == any(w is not None and w < T for w in windows), windows  # a window that cuts
    assert ("sinks" in kinds or "query sinks" in kinds) == all(sinks_of(c) is not None for c in calls)
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    assert ("softcap" in kinds) == (softcap is not None)
    if "mla" in kinds:  # the q/k head dim is not the value head dim
        assert all(c["q"].shape[-1] != c["v"].shape[-1] for c in calls)
    for n, call in enumerate(calls):
        gate = call["module"].__dict__["_posenc_plan"].encoding.gate
        assert call["x"].shape[-1] == gate.in_features == model.config.hidden_size
        setting = dict(window=windows[n], sinks=sinks_of(call), softcap=call["kwargs"].get("softcap"))
        want = written_out(call, gate.weight, gate.bias, **setting)
        assert gap(call["out"], want) < 1e-5, n
        # each part is felt here, so the comparison above can fail without it
        assert gap(call["out"], written_out(call, gate.weight, gate.bias, **{**setting, "gates": False})) > 1e-3
        for part in ("window", "sinks", "softcap"):
            if setting[part] is not None:
                assert gap(call["out"], written_out(call, gate.weight, gate.bias, **{**setting, part: None})) > 1e-4, part
        # the gradient of this layer's output reaches its gate's parameters and is the formula's
        direction = torch.randn(call["out"].shape, generator=torch.Generator().manual_seed(n))
        ours = torch.autograd.grad((call["out"] * direction).sum(), (gate.weight, gate.bias), retain_graph=True)
        theirs = torch.autograd.grad((written_out(call, gate.weight, gate.bias, **setting) * direction.double()).sum(),
                                     (gate.weight, gate.bias))
        for a, b in zip(ours, theirs):
            assert float(b.abs().max()) > 1e-4 and gap(a, b) < 1e-4 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("model_type", [*FAMILIES, "diffllama"])
def test_cached_greedy_decoding_equals_the_full_pass(model_type: str) -> None:
    """Past every window: the sliding layers' caches drop their oldest keys, and with them their gates.
    DiffLlama calls its attention function twice per layer (once per half of the values): both calls
    take the gates of one step."""
    model = with_fox(model_type)
    n, new = 14, 8
    ids = tokens(1, n)
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert out.sequences.shape[1] == n + new
    full = logits(model, out.sequences, use_cache=False)[0]
    for step, step_logits in enumerate(out.logits):
        assert gap(step_logits[0], full[n - 1 + step]) < 1e-4, step
    if model_type != "inkling2_text":  # a static cache: its sliding layers roll their keys, the gates follow
        greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert torch.equal(model.generate(ids, cache_implementation="static", **greedy), out.sequences)


#: Inkling-2's own layers see the padding (its untouched model's padded rows differ from the rows alone by 1.7e-3)
@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t != "inkling2_text"])
def test_a_left_padded_batch_equals_its_rows_alone(model_type: str) -> None:
    model = with_fox(model_type)
    ids = tokens(2, 16, seed=4)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    batch = logits(model, ids, attention_mask=mask)
    for row in range(2):
        real = mask[row].bool()
        assert gap(batch[row, real], logits(model, ids[row: row + 1, real])[0]) < 1e-4, row


def test_gradients_reach_every_gate_in_training() -> None:
    """A training step of gpt-oss (windows and sinks) and DeepSeek-V3 (MLA): each layer's gate gets a
    finite, non-zero gradient from the loss."""
    for model_type in ("gpt_oss", "deepseek_v3"):
        model = with_fox(model_type)
        model.train()
        ids = tokens(2, T)
        model(ids, labels=ids).loss.backward()
        gates = list(phf.adapter._installed(model))
        assert len(gates) == model.config.num_hidden_layers
        for enc in gates:
            for p in enc.gate.parameters():
                assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, model_type


def test_the_layers_are_left_as_they_were_where_fox_is_refused() -> None:
    """Where FoX still cannot run (a shared transformer block: Zamba2), use() refuses before any
    forward, naming why, and the model is left as it was."""
    ref = build(Case("zamba2", "causal-lm"))
    model = copy.deepcopy(ref)
    with pytest.raises(UsageError, match="shared transformer block"):
        phf.use(model, "fox")
    ids = tokens(1, 12)
    assert torch.equal(logits(model, ids), logits(ref, ids))
