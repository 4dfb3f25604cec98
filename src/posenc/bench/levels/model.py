"""Model level: the study's language model (:class:`posenc.LM`), or a compared library's.

train = one full training step (forward, cross-entropy, backward, AdamW step, zero_grad); infer =
one forward under ``torch.inference_mode``. With ``compare``, the same configuration built with
another library (:mod:`posenc.bench.libraries`) runs side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...model.lm import LM, LMConfig
from ..job import POSENC, Job
from ..libraries import library_of
from .base import Level, Refused, Workload, schedule_of


def build_posenc(job: Job) -> torch.nn.Module:
    schedule = schedule_of(job.method, job.depth)  # a method written as a layer schedule
    positions = {"encoding": job.method} if schedule is None else {"schedule": schedule.to_list()}
    config = LMConfig(
        **positions, vocab_size=job.vocab, dim=job.dim, depth=job.depth, num_heads=job.heads,
        max_positions=job.length, attention_backend=job.backend,
    )
    return LM(config)


def build(job: Job, device: torch.device, dtype: torch.dtype) -> Workload:
    if job.impl == POSENC:
        model = build_posenc(job)
    else:
        try:
            model = library_of(job.impl).build_model(job)
        except Exception as err:  # e.g. flash with the T5 bias: the library's own refusal
            raise Refused(f"{type(err).__name__}: {err}") from err
    model = model.to(device=device, dtype=dtype)
    shape = (job.batch, job.length)
    tokens = torch.randint(0, job.vocab, shape, device=device)  # (B, T)
    targets = torch.randint(0, job.vocab, shape, device=device)  # (B, T)
    reported = model if job.impl == POSENC else None
    if job.mode == "infer":
        model.eval()

        def infer() -> None:
            with torch.inference_mode():
                model(tokens)

        return Workload(infer, reported)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> None:
        logits = model(tokens)  # (B, T, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload(train, reported)


def describe(sizes: dict) -> str:
    return (
        f"LM dim {sizes['dim']}, depth {sizes['depth']}, {sizes['heads']} heads, batch {sizes['batch']}, "
        f"vocab {sizes['vocab']}"
    )


LEVEL = Level(
    name="model",
    summary="the study's LM (dim 256, depth 4, 8 heads, batch 1, vocab 256)",
    modes=("train", "infer"),
    sizes={"dim": 256, "heads": 8, "batch": 1, "depth": 4, "vocab": 256},
    build=build,
    describe=describe,
    units={"train": "s/step"},
    compare=("x-transformers",),
)
