"""study/models.py: a fine-tuned row's model under a given scaling (a searched row's block) is its
base's model rebuilt under that block."""

from __future__ import annotations

import torch

from posenc.study.config import StudyConfig
from posenc.study.models import PosencModels
from posenc.study.rows import parse
from posenc.study.variants import scaled, scaling_block


def test_a_fine_tune_under_a_given_scaling_is_its_base_rebuilt_under_it():
    cfg = StudyConfig(methods=["rope", "rope+longrope_searched+ft"], dim=16, depth=2, num_heads=2, train_length=16,
                      eval_lengths=[16, 32], steps=2, batch_size=2, finetune_steps=2, finetune_length=32)
    models = PosencModels(cfg)
    base = models.initial(parse("rope"), 0)
    block = scaling_block("longrope", 2.0, 16, 10000.0, 8)
    block["long_factor"] = [1.0, 1.3, 1.9, 2.0]  # (a search's factors: not the default rule's)
    start = models.build(parse("rope+longrope_searched+ft"), block)
    start.load_state_dict(base.state_dict())
    reference = scaled(base, block)  # the base checkpoint rebuilt under the block, as posenc extend does
    assert start.config.to_dict() == reference.config.to_dict()
    assert start.config.encoding_options["scaling"] == block
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(start(ids), reference(ids))
    unscaled = models.build(parse("rope+longrope_searched+ft"))  # without a block: the variant's stand-in
    assert unscaled.config.encoding_options["scaling"]["long_factor"] != block["long_factor"]
