"""posenc bench: the harness produces its files, tables and ratios; bad input fails before any work.

Tiny sizes only: these tests check the harness, never timings. One test goes through the real
subprocess workers; the others run the same worker function in this process (``isolate=False``)
to stay fast.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import posenc
from posenc import backends, bench, cli

TINY = dict(dim=32, heads=4, depth=1, repeats=1, warmup=0, progress=False)


# --- bad input: ValueError before any worker starts -------------------------------------------


@pytest.fixture
def no_workers(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(bench, "launch", launch)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(methods=["nope", "fourier"]), "unknown encoding 'fourier'"),
        (dict(lengths=[64, 0]), "length"),
        (dict(lengths=[]), "lengths"),
        (dict(level="layer"), "level"),
        (dict(mode="decode"), "mode"),
        (dict(level="attention", compare=["x-transformers"]), "--level model"),
        (dict(level="model", compare=["flash-attn"]), "compare"),
        (dict(repeats=0), "repeats"),
        (dict(warmup=-1), "warmup"),
        (dict(device="tpu"), "device"),
        (dict(backend="nonsense"), "backend"),
        (dict(dtype="float8"), "dtype"),
        (dict(threads=0), "threads"),
        (dict(dim=30, heads=4), "divisible"),
        (dict(timeout=0), "timeout"),
    ],
)
def test_bad_input_is_a_value_error_before_any_work(no_workers, options, message):
    kwargs = dict(lengths=[32], progress=False) | options
    with pytest.raises(ValueError, match=message):
        bench.bench(**kwargs)


def test_cli_reports_bad_input_as_one_line(no_workers, capsys, tmp_path):
    assert cli.main(["bench", "--methods", "fourier", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posenc bench: error:") and "fourier" in err[0]
    assert cli.main(["bench", "--lengths", "0", "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["bench", "--level", "block", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


# --- the attention level measures what posenc.Attention does ----------------------------------


@pytest.mark.parametrize("method", ["nope", "rope", "alibi", "t5", "shaw", "transformer_xl"])
def test_attention_core_is_attention_without_projections(method):
    """The timed core (identity projections on a q|k|v input) equals a real Attention call."""
    dim, heads, n = 32, 4, 24
    enc = posenc.build(method, num_heads=heads, head_dim=dim // heads)
    attn = posenc.Attention(dim, heads, enc)
    core = posenc.Attention(dim, heads, enc)
    core.qkv, core.proj = torch.nn.Identity(), torch.nn.Identity()
    x = torch.randn(2, n, dim)  # (B, T, dim)
    with torch.no_grad():
        expected = attn(x)
        qkv = attn.qkv(x)  # (B, T, 3 x dim): q, k, v side by side, as the benchmark feeds them
        got = attn.proj(core(qkv))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# --- x-transformers counterparts --------------------------------------------------------------


def _xt_job(method: str, impl: str = bench.XT) -> dict:
    return dict(method=method, impl=impl, dim=64, heads=4, depth=2, vocab=256, length=32)


def test_xt_counterparts_match_posenc_config():
    pytest.importorskip("x_transformers")
    job = _xt_job("alibi")
    xt = bench.build_xt_model(job)
    ours = posenc.LM(posenc.LMConfig(encoding="alibi", dim=64, depth=2, num_heads=4))
    # Same size model: parameter counts within 1% (x-transformers' norms have no affine weights).
    n_xt, n_ours = (sum(p.numel() for p in m.parameters()) for m in (xt, ours))
    assert abs(n_xt - n_ours) / n_ours < 0.01
    assert xt.attn_layers.attn_dim_head == 64 // 4
    assert "Alibi" in type(xt.attn_layers.rel_pos).__name__
    assert not any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == 32 for m in xt.modules())  # no abs table
    rope = bench.build_xt_model(_xt_job("rope"))
    assert rope.attn_layers.rotary_pos_emb.inv_freq.numel() * 2 == 64 // 4  # full-dim rotary, like posenc
    t5 = bench.build_xt_model(_xt_job("t5"))
    assert "RelativePositionBias" in type(t5.attn_layers.rel_pos).__name__
    with pytest.raises(AssertionError, match="flash"):
        bench.build_xt_model(_xt_job("t5", bench.XT_FLASH))
    with pytest.raises(ValueError, match="counterpart"):
        bench.build_xt_model(_xt_job("shaw"))


# --- tiny runs: files, tables, ratios ---------------------------------------------------------


def test_ratios_are_relative_to_nope_of_the_same_mode_and_length():
    def rec(method, mode, n, t, peak, inc, impl=bench.POSENC, status="ok"):
        return dict(level="model", impl=impl, method=method, mode=mode, length=n, status=status, median_s=t,
                    tokens_per_s=n / t, peak_mb=peak, increase_mb=inc)

    results = [rec("nope", "train", 64, 0.5, 300.0, 100.0), rec("alibi", "train", 64, 0.75, 330.0, 150.0),
               rec("nope", "train", 128, 2.0, 400.0, 200.0), rec("alibi", "train", 128, 3.0, 400.0, 200.0, impl=bench.XT),
               rec("alibi", "infer", 64, 0.1, 300.0, 0.0)]  # no infer NoPE: no ratio
    bench.add_ratios(results)
    assert [r["median_s_vs_nope"] for r in results[:4]] == [1.0, 1.5, 1.0, 1.5]
    assert results[1]["tokens_per_s_vs_nope"] == pytest.approx(1 / 1.5)
    assert results[1]["peak_mb_vs_nope"] == pytest.approx(1.1) and results[1]["increase_mb_vs_nope"] == 1.5
    assert results[4]["median_s_vs_nope"] is None


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cli_attention_level_through_subprocess_workers(tmp_path, capsys):
    """The real path: one fresh worker per (method, length, mode), files and table written."""
    out = tmp_path / "att"
    argv = ["bench", "--methods", "alibi", "--lengths", "32", "64", "--level", "attention", "--mode", "train",
            "--repeats", "1", "--warmup", "0", "--dim", "32", "--heads", "4", "--threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/4]" in captured.err and "[4/4]" in captured.err  # progress on stderr
    table = captured.out
    assert "| method | N | train s | train tok/s | train time vs NoPE |" in table
    for name in ("results.csv", "results.json", "table.md", "command.txt", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    rows = _csv_rows(out / "results.csv")
    assert [(r["method"], r["length"]) for r in rows] == [("nope", "32"), ("alibi", "32"), ("nope", "64"), ("alibi", "64")]
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert float(r["median_s"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["peak_mb"]) >= float(r["baseline_mb"]) > 0
        assert r["threads_used"] == "1"
        assert r["backend_used"] and set(r["backend_used"].split("+")) <= set(backends.names()) - {"auto"}
        if r["method"] == "nope":
            assert float(r["median_s_vs_nope"]) == 1.0 and float(r["peak_mb_vs_nope"]) == 1.0
        else:
            assert math.isfinite(float(r["median_s_vs_nope"]))
    nope_lines = [line for line in table.splitlines() if line.startswith("| nope |")]
    assert len(nope_lines) == 2 and all(line.count("1.00x") >= 2 for line in nope_lines)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["command"].startswith("posenc bench --methods alibi --lengths 32 64 --level attention")
    assert len(data["results"]) == 4


def test_model_level_with_x_transformers_in_process(tmp_path):
    pytest.importorskip("x_transformers")
    results = bench.bench(methods=["t5", "shaw"], lengths=[32], level="model", mode="both", compare=["x-transformers"],
                          isolate=False, **TINY)
    by = {(r["method"], r["impl"], r["mode"]): r for r in results}
    assert len(results) == 3 * 3 * 2  # (nope, t5, shaw) x (posenc, x-t, x-t flash) x (train, infer)
    for mode in ("train", "infer"):
        assert by[("nope", bench.POSENC, mode)]["median_s_vs_nope"] == 1.0
        assert by[("t5", bench.POSENC, mode)]["status"] == "ok"
        assert by[("t5", bench.XT, mode)]["status"] == "ok"
        assert by[("nope", bench.XT_FLASH, mode)]["status"] == "ok"
        refused = by[("t5", bench.XT_FLASH, mode)]
        assert refused["status"] == "refused" and "flash" in refused["error"]
        assert by[("shaw", bench.XT, mode)]["status"] == "n/a"
        assert by[("shaw", bench.POSENC, mode)]["median_s_vs_nope"] > 0
    table = bench.markdown_table(results)
    assert "| method | impl | N | train s/step |" in table and "infer time vs NoPE" in table
    assert "posenc vs x-transformers" in table and "refused" in table
    meta = {"title": "tiny", "command": "posenc bench (test)"}
    paths = bench.write_outputs(results, tmp_path, meta)
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert len(_csv_rows(paths["results.csv"])) == len(results)


def test_a_failing_worker_is_recorded_and_the_run_goes_on():
    # shaw moves values: a forced sdpa backend cannot run it, so that job fails; the others run.
    results = bench.bench(methods=["shaw", "alibi"], lengths=[16], level="attention", mode="infer",
                          backend="sdpa", isolate=False, **TINY)
    status = {r["method"]: r["status"] for r in results}
    assert status == {"nope": "ok", "shaw": "failed", "alibi": "ok"}
    failed = next(r for r in results if r["method"] == "shaw")
    assert "sdpa" in failed["error"] and failed["median_s_vs_nope"] is None
    assert "Not measured" in bench.markdown_table(results)


def test_a_worker_past_its_timeout_is_recorded():
    job = dict(level="attention", mode="infer", method="nope", length=16, impl=bench.POSENC, dim=32, heads=4, batch=1,
               depth=1, vocab=256, repeats=1, warmup=0, device="cpu", backend="auto", dtype="float32", threads=1)
    result = bench.launch(job, timeout=0.01)
    assert result["status"] == "failed" and "timed out" in result["error"]
