"""The census: posenc.hf over every ``transformers`` family with RoPE, each exact or refused.

Every model type of the installed ``transformers``' causal-LM mapping and the text backbone of each
image-text-to-text model (tests/hf_census_configs.py), built from a tiny config with random weights.
For each family that uses RoPE, exactly one of two outcomes passes:

- ``posenc.hf.use(model, "rope")`` *is* the untouched model: outputs within float32 tolerance on a
  forward longer than any window (20 tokens, windows of 8), on a left-padded batch (at its real
  tokens), and the same tokens from cached greedy decoding (``generate``, or a cached loop for a
  bare backbone);
- ``use()`` refuses before any forward with a posenc UsageError that names the family's model type
  and what posenc lacks, and leaves the model as it was.

A family without RoPE whose posenc family row names its own encoding (Inkling, Inkling-2:
``Family.own == "inkling"``) is checked the same way under ``use(model, <its own>)``.

Accepted and then wrong, accepted and then crashing, or refused with another exception, fail. A
family that uses no RoPE (and has no such row) is skipped; a family that cannot be built here is skipped only when
tests/hf_census_configs.py says why (UNBUILDABLE). ``python tests/hf/test_census.py`` prints the
census (counts and each family's outcome).
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import posenc.hf as phf  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import family_of  # noqa: E402

if __name__ == "__main__":  # run as a script: the census configs are in tests/ (pytest: pythonpath)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_census_configs as census  # noqa: E402
import hf_census_encoders as encoders  # noqa: E402  (the masked-LM half: tests/hf/test_census_encoders.py)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

LENGTH = 20  # past every window and chunk (census.WINDOW)
PAD = 5  # left padding of the batch's first row
STEPS = 3  # cached greedy decoding steps
TOLERANCE = 1e-4  # float32, on outputs of order 1


@dataclass
class Outcome:
    """What the census found for one family: ``kind`` is "exact", "refused", "no rope", "unbuildable"
    or "failed"; ``detail`` the refusal's message, the reason, or what went wrong."""

    kind: str
    detail: str = ""
    seconds: float = 0.0


def _output(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, **kwargs)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """STEPS greedy tokens with a KV cache: ``generate`` for a causal LM, else a cached loop over
    the backbone (next token: the last hidden state against the input embeddings)."""
    if hasattr(model, "generate") and getattr(model, "can_generate", lambda: False)():
        return model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False)[:, ids.shape[1]:]
    table = model.get_input_embeddings().weight
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    # transformers' cache keyword (``cache`` since 5.24; ``past_key_values`` before, deprecated until 5.40)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        tokens = []
        for _ in range(STEPS):
            token = (out.last_hidden_state[:, -1] @ table.T).argmax(-1, keepdim=True)  # (B, 1)
            tokens.append(token)
            mask = torch.cat((mask, torch.ones_like(token)), dim=1)
            position_ids = position_ids[:, -1:] + 1
            held = out.cache if name == "cache" else out.past_key_values
            out = model(token, attention_mask=mask, position_ids=position_ids, use_cache=True, **{name: held})
    return torch.cat(tokens, dim=1)


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The census's three outputs: a forward, a left-padded batch (its real tokens), greedy tokens."""
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    return _output(model, ids), _output(model, ids, attention_mask=mask)[mask.bool()], _greedy(model, ids, mask)


def _differs(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> str:
    """Empty when the outputs agree, else what differs."""
    for what, a, b in zip((f"a {LENGTH}-token forward", "a left-padded batch"), ours, theirs):
        gap = float((a - b).abs().max())
        if not gap < TOLERANCE:
            return f"{what} differs by {gap:.2e}"
    if not torch.equal(ours[2], theirs[2]):
        return f"cached greedy decoding differs: {ours[2].tolist()} against {theirs[2].tolist()}"
    return ""


def _refusal_names_the_family(error: UsageError, *model_types: str) -> bool:
    """The message names the model type (the census's, or the built model's config's)."""
    return any(repr(t) in str(error) for t in model_types)


def outcome(case: census.Case) -> Outcome:
    """Build the family, try ``use(model, "rope")``, and classify what happened. A refused model is
    checked against the untouched one on a forward (it must be left as it was); an accepted one on
    the three checks (:func:`_run`)."""
    start = time.perf_counter()
    reason = census.UNBUILDABLE.get(case.model_type)
    if reason is not None:
        return Outcome("unbuildable", reason)
    row = family_of(case.model_type)
    own = "rope" if row is None else row.own  # the family's own encoding ("inkling": no RoPE, a row of its own)
    if own == "rope" and not census.rotates(case):
        return Outcome("no rope")
    ids = torch.randint(3, census.VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    try:
        ref = census.build(case)
        first = _output(ref, ids)
    except Exception as error:  # the family's own code or config: a missing override
        return Outcome("failed", f"the untouched tiny model does not build or run ({type(error).__name__}: "
                                 f"{str(error)[:200]}); add an override or an UNBUILDABLE reason to tests/hf_census_configs.py")
    if own == "rope" and not census.uses_rope(ref):
        return Outcome("no rope")
    model = copy.deepcopy(ref)
    try:
        phf.use(model, own)
    except UsageError as error:
        if not _refusal_names_the_family(error, case.model_type, getattr(ref.config, "model_type", "")):
            return Outcome("failed", f"refused without naming model_type {case.model_type!r}: {error}")
        try:  # a refused use() leaves the model as it was
            left = not torch.equal(_output(model, ids), first)
        except Exception as after:
            left = True
            error = UsageError(f"{error} [then {type(after).__name__}: {str(after)[:200]}]")
        if left:
            return Outcome("failed", f"refused, but the model was changed: {error}")
        return Outcome("refused", str(error), time.perf_counter() - start)
    except Exception as error:
        return Outcome("failed", f"use() raised {type(error).__name__}, not a UsageError: {str(error)[:300]}")
    try:
        expected = _run(ref)
    except Exception as error:
        return Outcome("failed", f"the untouched tiny model does not decode ({type(error).__name__}: {str(error)[:200]}); "
                                 "add an override or an UNBUILDABLE reason to tests/hf_census_configs.py")
    try:
        wrong = _differs(_run(model), expected)
    except Exception as error:
        return Outcome("failed", f"accepted, then {type(error).__name__}: {str(error)[:300]}")
    if wrong:
        return Outcome("failed", f"accepted, then silently wrong: {wrong}")
    return Outcome("exact", "" if own == "rope" else f'under use(model, "{own}")', time.perf_counter() - start)


CASES = census.cases()
_SEEN: dict[str, Outcome] = {}


def _outcome(case: census.Case) -> Outcome:
    if case.model_type not in _SEEN:
        _SEEN[case.model_type] = outcome(case)
    return _SEEN[case.model_type]


def test_the_census_finds_the_families() -> None:
    """The enumeration itself: the causal-LM mapping's types and some backbones beyond them."""
    types = [c.model_type for c in CASES]
    assert len(types) == len(set(types))
    assert {"llama", "qwen2", "gemma3_text"} <= set(types)
    assert any(c.source.startswith("backbone of") for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_family_is_exact_or_refused(case: census.Case) -> None:
    found = _outcome(case)
    if found.kind in ("no rope", "unbuildable"):
        pytest.skip(f"{case.model_type}: {found.kind} {found.detail}".strip())
    assert found.kind in ("exact", "refused"), f"{case.model_type} ({case.source}): {found.detail}"


_MLA = "multi-head latent attention"
#: families the generic fallback used to accept and then run wrongly or crash (issue 47), and what
#: its refusal must name
REASONS = {
    "flint": "sink logits.*NoPE layers",  # was accepted, then silently wrong
    "granite_swa": "sink logits.*per-layer RoPE bases",  # was accepted, then silently wrong
    "granitemoe_swa": "sink logits.*per-layer RoPE bases",
    "muse_glimmer_text": "a base of 0",
    "afmoe": "NoPE layers",
    "doge": "prepares its own mask",  # crashed at its first forward
    "minicpm3": _MLA, "glm4_moe_lite": _MLA, "sarvam_mla": _MLA, "youtu": _MLA, "axk1": _MLA,
    "gemma4_text": "different head dims",
    "gemma3n_text": "share keys and values",
    "gemma4_unified_text": "bidirectional",
    "laguna": "one rotary table per layer type",  # was "no inv_freq buffer"
    "gpt_neox_japanese": "does not call transformers' attention interface",  # was accepted, posenc never ran
}


@pytest.mark.parametrize("model_type", sorted(REASONS))
def test_the_fallback_names_what_it_lacks(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback's refusal names what it lacks; for a family that has a row since (MLA, NoPE full
    layers, per-layer bases: issue 47 item 3) the fallback is run alone (the row hidden from use())."""
    case = next((c for c in CASES if c.model_type == model_type), None)
    if case is None:
        pytest.skip(f"{model_type} is not in this transformers")
    found = _outcome(case)
    if found.kind == "unbuildable":
        pytest.skip(found.detail)
    if family_of(model_type) is not None:
        import posenc.hf.adapter as adapter

        monkeypatch.setattr(adapter, "family_of", lambda model_type: None)
        with pytest.raises(UsageError) as refused:
            phf.use(census.build(case), "rope")
        found = Outcome("refused", str(refused.value))
    assert found.kind == "refused", f"{model_type}: {found.kind} {found.detail}"
    assert re.search(REASONS[model_type], found.detail), found.detail


# -- docs/hf.md's census table ---------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
BEGIN, END = "<!-- census: begin (python tests/hf/test_census.py --write) -->", "<!-- census: end -->"


def _why(detail: str) -> str:
    """A refusal's reason without the family's name (the table's row names it)."""
    for marker in ("the generic fallback cannot run it: ",):
        if marker in detail:
            return detail.split(marker, 1)[1]
    detail = re.sub(r"^model_type '[^']*' \([^)]*\): ", "", detail)
    return re.sub(r"^model: ", "", detail)


def census_table() -> str:
    """The census as a markdown block: counts, then one row per family with RoPE (its outcome), the
    decoders and backbones, then the encoders (tests/hf_census_encoders.py)."""
    rows, counts, plain = [], {"exact": 0, "refused": 0, "unbuildable": 0}, 0
    found: Outcome | encoders.Outcome
    for case, found in [*((c, _outcome(c)) for c in CASES), *((c, encoders.outcome_of(c)) for c in encoders.CASES)]:
        if found.kind == "no rope":
            plain += 1
            continue
        counts[found.kind] = counts.get(found.kind, 0) + 1
        what = {"exact": f"exact {found.detail}".strip(), "refused": f"refused: {_why(found.detail)}",
                "unbuildable": f"not built here: {found.detail}"}.get(found.kind, f"FAILED: {found.detail}")
        source = {"causal-lm": "", "masked-lm": " (masked LM, an encoder)"}.get(case.source, f" ({case.source})")
        rows.append(f"| `{case.model_type}`{source} | {what.replace('|', '/')} |")
    head = [f"transformers {transformers.__version__}: {len(CASES)} model types ({sum(c.source == 'causal-lm' for c in CASES)} "
            f"causal-LM types, {sum(c.source != 'causal-lm' for c in CASES)} image-text-to-text backbones) and "
            f"{len(encoders.CASES)} masked-LM types (encoders: a bidirectional forward and padded batches, no decoding); {plain} without "
            f"RoPE (nor an encoding of their own in posenc's family table); "
            f"of the others {counts['exact']} exact, {counts['refused']} refused at `use()`, "
            f"{counts['unbuildable']} not built here.", "", "| model_type | `use(model, \"rope\")` |", "|---|---|"]
    return "\n".join([*head, *rows])


def _docs_block() -> str:
    text = DOCS.read_text()
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip()


def test_docs_census_table_is_current() -> None:
    """docs/hf.md's census table is this census's (with the transformers it was written with)."""
    block = _docs_block()
    written = re.search(r"^transformers (\S+):", block)
    if written is None or written.group(1) != transformers.__version__:
        pytest.skip(f"the table was written with transformers {written and written.group(1)}")
    assert block == census_table(), "docs/hf.md's census table drifted: python tests/hf/test_census.py --write"


def main() -> None:
    """Print every family's outcome and the counts; ``--write`` rewrites docs/hf.md's table."""
    torch.set_num_threads(1)
    counts: dict[str, int] = {}
    start = time.perf_counter()
    for case in CASES:
        found = _outcome(case)
        counts[found.kind] = counts.get(found.kind, 0) + 1
        print(f"{case.model_type:28s} {found.kind:11s} {found.detail[:220]}", flush=True)
    print(counts, f"{len(CASES)} types, {time.perf_counter() - start:.1f}s")
    if "--write" in sys.argv:
        text = DOCS.read_text()
        DOCS.write_text(text[: text.index(BEGIN) + len(BEGIN)] + "\n" + census_table() + "\n" + text[text.index(END):])


if __name__ == "__main__":
    main()
