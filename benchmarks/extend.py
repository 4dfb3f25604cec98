"""LongRoPE's search at 8x on the default study's RoPE model, and posenc extend's speed against the
study's own fine-tune at the same size.

    PYTHONPATH=src python benchmarks/extend.py OUT [--threads 2]

Trains the default preset's ``rope`` row (800 steps at 64) with its ``rope+yarn+ft`` companion (20
steps at 256), then (1) runs LongRoPE's search (default settings) for 512 = 8x on that checkpoint
(on the last training windows), printing every individual's cost, then scores the found factors
and the PI / NTK / YaRN / default-rule LongRoPE blocks on the validation bytes at 512, and (2) runs ``posenc extend --scaling yarn`` for the same 20
steps at 256 and compares its tokens/s with the study's ``+ft`` row. Writes OUT/extend-bench.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from posenc.extend import extend as ex
from posenc.files import write_json
from posenc.model.checkpoint import load_checkpoint
from posenc.study import distributed
from posenc.study.config import StudyConfig
from posenc.study.data import load_corpus
from posenc.study.evaluation import evaluate
from posenc.study.longrope_search import SearchSettings, search
from posenc.study.progress import Progress
from posenc.study.run import run_experiment
from posenc.study.variants import scaled, scaling_block


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    cfg = StudyConfig.from_preset("default", methods=["rope+yarn+ft"], finetune_steps=20, finetune_length=256,
                                  eval_lengths=[64, 256, 512])
    study = out / "study"
    results = run_experiment(cfg, study, resume=(study / "results.json").exists())
    ckpt = study / "checkpoints" / "rope.safetensors"
    model = load_checkpoint(ckpt)
    corpus = load_corpus("default", cfg.valid_bytes)
    settings = SearchSettings(train_length=64, target_length=512)
    t0 = time.perf_counter()
    need = settings.sequences * settings.target_length + 1  # training windows: the validation bytes stay unseen
    found = search(model, corpus.train[-need:], settings, state=out / "search-state.json",
                   resume=(out / "search-state.json").exists(), report=Progress(True))  # (a line per individual)
    search_s = time.perf_counter() - t0
    # the found factors against the seeds on the validation bytes (never seen by the search) at 512
    ctx = distributed.Context(torch.device("cpu"))
    enc = model.attentions()[0].encoding
    blocks = {"searched": found.block(), "pi": scaling_block("linear", 8, 64, enc.base, enc.rotary_dim),
              "ntk": scaling_block("ntk", 8, 64, enc.base, enc.rotary_dim),
              "yarn": scaling_block("yarn", 8, 64, enc.base, enc.rotary_dim),
              "longrope_default_rule": scaling_block("longrope", 8, 64, enc.base, enc.rotary_dim)}
    validation = {}
    for name, block in blocks.items():
        with_block = scaled(model, block)
        validation[name] = round(evaluate(with_block, corpus.valid, 512, None, ctx)["perplexity"], 4)
    ext = ex.ExtendConfig(**{**ex.study_defaults(ckpt, 256), "scaling": "yarn", "steps": 20, "eval_lengths": [256]})
    target = out / "extend-yarn"
    record = ex.extend(ckpt, target, ext, resume=(target / "extend.json").exists())
    ft = results["methods"]["rope+yarn+ft"]["train"]
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads,
                    "torch": torch.__version__},
        "search": {"target_length": 512, "scale": 8, "evaluated": len(found.evaluated), "wall_s": round(search_s, 2),
                   "seconds_per_individual": found.seconds_per_individual, "best_perplexity": found.perplexity,
                   "baselines_on_search_windows": found.baselines, "best": found.to_json()["best"],
                   "validation_perplexity_at_512": validation},
        "extend_tokens_per_s": record["train"]["tokens_per_s"], "study_ft_tokens_per_s": ft["tokens_per_s"],
        "study_pretrain_tokens_per_s": results["methods"]["rope"]["train"]["tokens_per_s"],
        "extend_over_study_ft": round(record["train"]["tokens_per_s"] / ft["tokens_per_s"], 3),
    }
    write_json(out / "extend-bench.json", report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
