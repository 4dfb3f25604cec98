"""The encoder half of the census (tests/hf/test_census_encoders.py; docs/hf.md's census table):
every model type of the installed ``transformers``' masked-LM mapping, built from the census's tiny
config (tests/hf_census_configs.py) as its masked LM, with random weights.

A family uses RoPE by the census's rule (:func:`hf_census_configs.rotates`, then
:func:`hf_census_configs.uses_rope` on the built model). For each one, exactly one of two outcomes
passes:

- ``posenc.hf.use(model, "rope")`` *is* the untouched model, with posenc's attention running
  bidirectionally: outputs within float32 tolerance (:data:`TOLERANCE`) on a forward longer than any
  window (:data:`LENGTH` tokens, windows of ``WINDOW``), on a right-padded and on a left-padded batch
  (compared at their real tokens). An encoder has no cached decoding to check.
- ``use()`` refuses before any forward with a posenc UsageError naming the family's model type (and
  what posenc lacks for it), and leaves the model as it was.

Accepted and then wrong (a bidirectional model run causally: EuroBERT before its family row),
accepted and then crashing, or refused with another exception, fail. A family without RoPE is
skipped, as is one that tests/hf_census_configs.py says cannot be built here (UNBUILDABLE).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

import hf_census_configs as census
import posenc.hf as phf
from posenc.errors import UsageError

LENGTH = 20  # past every window (census.WINDOW: 8 keys on each side at most)
PAD = 5  # padding of the batch's first row (at its end, then at its start)
TOLERANCE = 1e-4  # float32, on outputs of order 1


@dataclass
class Outcome:
    """What the census found for one encoder: ``kind`` is "exact", "refused", "no rope",
    "unbuildable" or "failed"; ``detail`` the refusal's message, the reason, or what went wrong;
    ``gap`` the largest output difference of an exact one."""

    kind: str
    detail: str = ""
    seconds: float = 0.0
    gap: float = 0.0


def output(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The masked LM's logits (B, T, V), or a bare model's last hidden state (B, T, C)."""
    with torch.no_grad():
        out = model(ids, **kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def tokens() -> torch.Tensor:
    return torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))  # (B, T)


def masks() -> dict[str, torch.Tensor]:
    """The padded batches' attention masks (B, T), 1 = real token: padding at the end, then at the start."""
    right = torch.ones(2, LENGTH, dtype=torch.long)
    right[0, LENGTH - PAD:] = 0
    left = torch.ones(2, LENGTH, dtype=torch.long)
    left[0, :PAD] = 0
    return {"a right-padded batch": right, "a left-padded batch": left}


def run(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The encoder census's outputs: a forward, and each padded batch at its real tokens."""
    ids = tokens()
    found = {f"a {LENGTH}-token forward": output(model, ids)}
    for what, mask in masks().items():
        found[what] = output(model, ids, attention_mask=mask)[mask.bool()]
    return found


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[str, float]:
    """What differs (empty when nothing does) and the largest difference."""
    worst = 0.0
    for what in theirs:
        gap = float((ours[what] - theirs[what]).abs().max())
        if not gap < TOLERANCE:
            return f"{what} differs by {gap:.2e}", gap
        worst = max(worst, gap)
    return "", worst


def outcome(case: census.Case) -> Outcome:
    """Build the encoder, try ``use(model, "rope")``, and classify what happened (see the module
    docstring). A refused model is checked against the untouched one on a forward."""
    start = time.perf_counter()
    reason = census.UNBUILDABLE.get(case.model_type)
    if reason is not None:
        return Outcome("unbuildable", reason)
    if not census.rotates(case):
        return Outcome("no rope")
    ids = tokens()
    try:
        ref = census.build(case)
        first = output(ref, ids)
    except Exception as error:  # the family's own code or config: a missing override
        return Outcome("failed", f"the untouched tiny model does not build or run ({type(error).__name__}: "
                                 f"{str(error)[:200]}); add an override or an UNBUILDABLE reason to tests/hf_census_configs.py")
    if not census.uses_rope(ref):
        return Outcome("no rope")
    model = copy.deepcopy(ref)
    try:
        phf.use(model, "rope")
    except UsageError as error:
        if not any(repr(t) in str(error) for t in (case.model_type, getattr(ref.config, "model_type", ""))):
            return Outcome("failed", f"refused without naming model_type {case.model_type!r}: {error}")
        try:  # a refused use() leaves the model as it was
            changed = not torch.equal(output(model, ids), first)
        except Exception as after:
            return Outcome("failed", f"refused, then the model does not run ({type(after).__name__}): {error}")
        if changed:
            return Outcome("failed", f"refused, but the model was changed: {error}")
        return Outcome("refused", str(error), time.perf_counter() - start)
    except Exception as error:
        return Outcome("failed", f"use() raised {type(error).__name__}, not a UsageError: {str(error)[:300]}")
    if getattr(model.config, "_attn_implementation", None) != phf.NAME:
        return Outcome("failed", f"accepted, but its attention is {model.config._attn_implementation!r}, not posenc's")
    try:
        expected = run(ref)
    except Exception as error:
        return Outcome("failed", f"the untouched tiny model does not run a padded batch ({type(error).__name__}: "
                                 f"{str(error)[:200]})")
    try:
        wrong, gap = compare(run(model), expected)
    except Exception as error:
        return Outcome("failed", f"accepted, then {type(error).__name__}: {str(error)[:300]}")
    if wrong:
        return Outcome("failed", f"accepted, then silently wrong: {wrong}", gap=gap)
    return Outcome("exact", "", time.perf_counter() - start, gap)


CASES = census.encoder_cases()
_SEEN: dict[str, Outcome] = {}


def outcome_of(case: census.Case) -> Outcome:
    """:func:`outcome`, once per model type in a process."""
    if case.model_type not in _SEEN:
        _SEEN[case.model_type] = outcome(case)
    return _SEEN[case.model_type]


__all__ = ["CASES", "LENGTH", "Outcome", "TOLERANCE", "compare", "masks", "outcome", "outcome_of", "output", "run", "tokens"]
