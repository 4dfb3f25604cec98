"""``posenc bench --level decode`` and the transformers comparison: what a job times, never timings.

Tiny sizes, workers run in this process (``isolate=False``) except one end-to-end CLI run."""

from __future__ import annotations

import json

import pytest
import torch

from posenc import cli
from posenc.bench import harness
from posenc.bench.job import Job
from posenc.bench.levels import LEVELS
from posenc.bench.libraries import hftransformers
from posenc.bench.plan import configure
from posenc.errors import UsageError

TINY = dict(dim=16, heads=2, depth=1, vocab=32, repeats=1, warmup=1, rounds=1, progress=False, isolate=False)


def test_the_level_is_registered_with_its_modes_and_comparison():
    config = configure(level="decode", lengths=[512, 2048, 8192], compare=["transformers"])
    assert config.modes == ["single", "batched"] and config.sizes["batch"] == 8
    assert config.lengths == [512, 2048, 8192]
    with pytest.raises(UsageError, match=r"compare='x-transformers' needs level in \['model'\]"):
        configure(level="decode", compare=["x-transformers"])
    with pytest.raises(UsageError, match=r"compare='transformers' needs level in \['decode'\]"):
        configure(level="model", compare=["transformers"])


def test_a_posenc_step_decodes_one_token_per_row_at_the_same_length():
    job = Job(level="decode", mode="batched", method="alibi", length=24, dim=16, heads=2, depth=2, batch=3, vocab=32)
    workload = LEVELS["decode"].build(job, torch.device("cpu"), torch.float32)
    model, seen = workload.module, []
    forward = model.forward

    def record(tokens, cache=None):
        seen.append((tuple(tokens.shape), cache.length))
        return forward(tokens, cache=cache)

    model.forward = record
    for _ in range(3):
        workload.step()
    assert seen == [((3, 1), 24)] * 3  # every step: one token per row after a cache of N
    assert LEVELS["decode"].tokens(job) == 3 and LEVELS["decode"].tokens(Job(level="decode", mode="single", method="x", length=1)) == 1


def test_decode_runs_every_method_with_ratios_to_nope():
    results = harness.bench(level="decode", lengths=[16], batch=2, **TINY)
    ok = [r for r in results.jobs if r["status"] == "ok"]
    assert len(ok) == len(results.jobs) and {r["mode"] for r in ok} == {"single", "batched"}
    for r in ok:
        assert r["tokens_per_s"] == pytest.approx((1 if r["mode"] == "single" else 2) / r["median_s"])
        assert r["backend_used"] not in ("?", "-")
    alibi = next(c for c in results.cells if c["method"] == "alibi" and c["mode"] == "single")
    assert alibi["median_s_vs_nope"] is not None


def test_transformers_counterparts_decode_and_others_are_not_applicable():
    results = harness.bench(level="decode", lengths=[16], batch=2, methods=["rope", "alibi", "t5"], compare=["transformers"], **TINY)
    by = {(r["method"], r["impl"], r["mode"]): r for r in results.jobs}
    for method in ("rope", "alibi"):
        for mode in ("single", "batched"):
            assert by[(method, "transformers", mode)]["status"] == "ok", by[(method, "transformers", mode)].get("error")
    assert by[("t5", "transformers", "single")]["status"] == "n/a"


@pytest.mark.parametrize("method, arch", [("rope", "LlamaForCausalLM"), ("alibi", "BloomForCausalLM")])
def test_transformers_models_have_the_same_sizes_and_their_cache_stays_at_n(method, arch):
    job = Job(level="decode", mode="single", method=method, length=20, dim=32, heads=4, depth=2, vocab=48, impl="transformers")
    model = hftransformers.build_model(job).eval()
    assert type(model).__name__ == arch
    c = model.config
    assert (c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.vocab_size) == (32, 4, 2, 48)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied, as posenc
    step = hftransformers.decode_step(model, 3, 20, torch.device("cpu"), torch.float32)
    for _ in range(2):
        step()
        assert step.cache.get_seq_length() == 20
    assert not hftransformers.has_counterpart("t5") and not hftransformers.has_counterpart("nope")


def test_cli_smoke_through_real_workers(tmp_path, capsys):
    out = tmp_path / "decode"
    argv = ["bench", "--level", "decode", "--methods", "alibi", "--lengths", "16", "--rounds", "1", "--repeats", "1",
            "--dim", "16", "--heads", "2", "--depth", "1", "--mode", "single", "--out", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "single s/token" in table and "single tok/s" in table
    records = json.loads((out / "results.json").read_text())["jobs"]
    assert {r["status"] for r in records} == {"ok"}
