"""The census's encoders: posenc.hf over every masked-LM family of the installed ``transformers``
that uses RoPE, each exact or refused (tests/hf_census_encoders.py says how each is built and
checked; docs/hf.md's census table lists them with the decoders).

Exact: ``use(model, "rope")`` runs posenc's attention bidirectionally and equals the untouched model
on a forward past every window and on right- and left-padded batches. Refused: a UsageError at
``use()`` naming the model type and what posenc lacks, the model left as it was. The encoders with a
family row (posenc.hf.families: ``causal=False``) must be exact; the others' refusals must say why.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import hf_census_configs as census  # noqa: E402
import hf_census_encoders as encoders  # noqa: E402
import posenc.hf as phf  # noqa: E402
from posenc.errors import UsageError  # noqa: E402
from posenc.hf.families import FAMILIES  # noqa: E402
from posenc.hf.schedule_config import schedule_from_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

CASES = encoders.CASES
BY_TYPE = {c.model_type: c for c in CASES}
#: the encoders of posenc's family table (an encoder row, or a vision-language wrapper of one)
ROWED = sorted({t for f in FAMILIES if not f.causal for t in f.model_types} | {"modernvbert", "ultravbert"})
#: the encoders posenc refuses, and what the refusal must name
REASONS = {
    # its attention computes its scores itself (no attention interface), rotating with the encoder's sinusoidal table
    "roformer": "not through transformers' attention interface.*embed_positions",
    "neomme": "bidirectional.*one rotary table per layer type",  # 2-axis positions, per-layer configs: no row
}


def _case(model_type: str) -> census.Case:
    case = BY_TYPE.get(model_type)
    if case is None:
        pytest.skip(f"{model_type} is not a masked-LM type of this transformers")
    return case


def test_the_census_finds_the_encoders() -> None:
    """The enumeration: every masked-LM type once; the RoPE ones found by the census's rule, the
    others (BERT) skipped."""
    types = [c.model_type for c in CASES]
    assert len(types) == len(set(types))
    rotary = {c.model_type for c in CASES if encoders.outcome_of(c).kind != "no rope"}
    assert {"modernbert", "eurobert", "gte", "nomic_bert", "jina_embeddings_v3", "roformer"} <= rotary
    assert encoders.outcome_of(_case("bert")).kind == "no rope"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_encoder_is_exact_or_refused(case: census.Case) -> None:
    found = encoders.outcome_of(case)
    if found.kind in ("no rope", "unbuildable"):
        pytest.skip(f"{case.model_type}: {found.kind} {found.detail}".strip())
    assert found.kind in ("exact", "refused"), f"{case.model_type}: {found.detail}"


@pytest.mark.parametrize("model_type", ROWED)
def test_the_encoder_rows_are_exact(model_type: str) -> None:
    """Each encoder of the family table runs exactly, and is bidirectional: its first token's output
    moves when only its last token changes (so a causal run, EuroBERT's fate under the generic
    fallback before its row, would miss the census's tolerance by far)."""
    found = encoders.outcome_of(_case(model_type))
    assert found.kind == "exact", found.detail
    assert found.gap < encoders.TOLERANCE
    ref = census.build(_case(model_type))
    ids = encoders.tokens()
    other = ids.clone()
    other[:, -1] = (other[:, -1] + 1 - 3) % (census.VOCAB - 3) + 3  # (B, T): another real token last
    moved = float((encoders.output(ref, ids)[:, 0] - encoders.output(ref, other)[:, 0]).abs().max())
    assert moved > 100 * encoders.TOLERANCE


@pytest.mark.parametrize("model_type", sorted(REASONS))
def test_the_refusals_name_what_posenc_lacks(model_type: str) -> None:
    found = encoders.outcome_of(_case(model_type))
    assert found.kind == "refused", f"{model_type}: {found.kind} {found.detail}"
    assert re.search(REASONS[model_type], found.detail), found.detail


def test_ultrabert_window_is_its_total_width() -> None:
    """UltraBERT's local layers see ``|i - j| <= sliding_window``; posenc's bidirectional window is
    the total width, twice that (ModernBERT's ``local_attention`` already is)."""
    config = census.tiny_config("ultrabert")
    schedule = schedule_from_hf(config)
    windows = {kind: layer.window for kind, layer in zip(config.layer_types, schedule.layers)}
    assert windows == {"sliding_attention": 2 * config.sliding_window, "full_attention": None}
    assert encoders.LENGTH > config.sliding_window + 1  # the census's forward crosses it


def test_esmc_chains_are_refused_at_the_forward() -> None:
    """ESM C's ``sequence_id`` adds a chain mask of its own, which posenc's attention would not apply:
    a UsageError at that forward, never silently attending across chains. Position ids restarting
    at each chain (posenc's packed rows) give the model's own chain-masked output."""
    ref = census.build(_case("esmc"))
    model = phf.use(census.untouched_copy(ref), "rope")
    ids = encoders.tokens()
    chains = (torch.arange(encoders.LENGTH) >= 10).long().expand(2, -1)  # (B, T): two chains per row
    positions = torch.cat((torch.arange(10), torch.arange(encoders.LENGTH - 10))).expand(2, -1)  # (B, T)
    with torch.no_grad():
        theirs = ref(ids, sequence_id=chains, position_ids=positions).logits
        with pytest.raises(UsageError, match="sequence_id"):
            model(ids, sequence_id=chains)
        ours = model(ids, position_ids=positions).logits
    assert float((ours - theirs).abs().max()) < encoders.TOLERANCE
