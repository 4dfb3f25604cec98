"""``posenc extend``: a trained RoPE checkpoint fine-tuned under a scaling at a longer length.

A wing above the study: it reuses the study's training loop, data, evaluation and LongRoPE search
(:mod:`posenc.study`), and the study imports nothing from here.

    extend.py         the job: the checkpoint under the scaling, the fine-tune, the before/after table
    checkpoint_kinds.py  the checkpoint being extended (Checkpoint), posenc's kind (PosencCheckpoint)
    extend_config.py  its settings (ExtendConfig), the scaling kinds and the position remaps
    extend_cli.py     its command line (``posenc extend``)
    extend_hf.py      a transformers checkpoint's side (imports transformers)
    pose.py           PoSE's position ids (Zhu et al. 2024): short windows whose ids skip over a
                      target length (``posenc extend --pose``)
"""
