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
from posenc import backends, cli
from posenc.bench import harness, machine, plots, stats, tables
from posenc.bench.job import Job
from posenc.bench.libraries import xtransformers
from posenc.bench.worker import backends_used
from posenc.errors import UsageError

TINY = dict(dim=32, heads=4, depth=1, repeats=1, warmup=0, progress=False)
XT, XT_FLASH = xtransformers.XT, xtransformers.XT_FLASH


# --- bad input: UsageError naming the parameter, before any worker starts ----------------------


@pytest.fixture
def no_workers(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(harness, "launch", launch)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(methods=["nope", "fourier"]), "unknown encoding 'fourier'"),
        (dict(lengths=[64, 0]), "lengths"),
        (dict(lengths=[]), "lengths"),
        (dict(level="layer"), "level"),
        (dict(mode="decode"), "mode"),
        (dict(level="attention", compare=["x-transformers"]), r"needs level in \['model'\]"),
        (dict(level="model", compare=["flash-attn"]), "compare"),
        (dict(rounds=0), "rounds"),
        (dict(repeats=0), "repeats"),
        (dict(warmup=-1), "warmup"),
        (dict(device="tpu"), "device"),
        (dict(backend="nonsense"), "backend"),
        (dict(dtype="float8"), "dtype"),
        (dict(threads=0), "threads"),
        (dict(dim=30, heads=4), "divisible"),
        (dict(timeout=0), "timeout"),
        (dict(width=3), "size option"),
    ],
)
def test_bad_input_is_a_usage_error_before_any_work(no_workers, options, message):
    kwargs = dict(lengths=[32], progress=False) | options
    with pytest.raises(UsageError, match=message) as info:
        harness.bench(**kwargs)
    assert "--" not in str(info.value)  # parameters, not flags


def test_cli_reports_bad_input_as_one_line(no_workers, capsys, tmp_path):
    assert cli.main(["bench", "--methods", "fourier", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posenc bench: error:") and "fourier" in err[0]
    assert cli.main(["bench", "--lengths", "0", "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["bench", "--level", "block", "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["bench", "--rounds", "0", "--out", str(tmp_path / "x")]) == 2
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


# --- which backend ran: registered names, read from Attention.last_backend ----------------------


def test_backends_used_collects_every_attention_of_a_model():
    dim, heads = 32, 4
    model = torch.nn.ModuleList(
        posenc.Attention(dim, heads, posenc.build("nope", num_heads=heads, head_dim=dim // heads), backend=b)
        for b in ("eager", "auto", "auto")
    )
    assert backends_used(model) == "?"  # nothing ran yet
    x = torch.randn(1, 8, dim)  # (B, T, dim)
    with torch.no_grad():
        for attn in model:
            attn(x)
    assert backends_used(model) == "eager+sdpa"
    assert backends_used(None) == "-"


def test_reported_backends_are_registered_names():
    results = harness.bench(methods=["alibi", "shaw", "rope"], lengths=[16], level="attention", mode="infer",
                            rounds=1, isolate=False, **TINY)
    used = {r["method"]: r["backend_used"] for r in results.cells}
    assert used == {"nope": "sdpa", "alibi": "blocked", "shaw": "terms", "rope": "sdpa"}
    model = harness.bench(methods=["shaw"], lengths=[16], level="model", mode="train", rounds=1, isolate=False,
                          **(TINY | dict(depth=2)))
    assert {r["method"]: r["backend_used"] for r in model.cells} == {"nope": "sdpa", "shaw": "terms"}
    assert all(set(j["backend_used"].split("+")) <= set(backends.BACKENDS) for j in model.jobs)


# --- x-transformers counterparts --------------------------------------------------------------


def _xt_job(method: str, impl: str = XT) -> Job:
    return Job(level="model", mode="infer", method=method, impl=impl, dim=64, heads=4, depth=2, vocab=256, length=32)


def test_xt_counterparts_match_posenc_config():
    pytest.importorskip("x_transformers")
    xt = xtransformers.build_model(_xt_job("alibi"))
    ours = posenc.LM(posenc.LMConfig(encoding="alibi", dim=64, depth=2, num_heads=4))
    # Same size model: parameter counts within 1% (x-transformers' norms have no affine weights).
    n_xt, n_ours = (sum(p.numel() for p in m.parameters()) for m in (xt, ours))
    assert abs(n_xt - n_ours) / n_ours < 0.01
    assert xt.attn_layers.attn_dim_head == 64 // 4
    assert "Alibi" in type(xt.attn_layers.rel_pos).__name__
    assert not any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == 32 for m in xt.modules())  # no abs table
    rope = xtransformers.build_model(_xt_job("rope"))
    assert rope.attn_layers.rotary_pos_emb.inv_freq.numel() * 2 == 64 // 4  # full-dim rotary, like posenc
    t5 = xtransformers.build_model(_xt_job("t5"))
    assert "RelativePositionBias" in type(t5.attn_layers.rel_pos).__name__
    with pytest.raises(AssertionError, match="flash"):
        xtransformers.build_model(_xt_job("t5", XT_FLASH))
    with pytest.raises(ValueError, match="counterpart"):
        xtransformers.build_model(_xt_job("shaw"))


# --- tiny runs: files, tables, ratios ---------------------------------------------------------


def _rec(method, mode, n, t, peak, inc, impl="posenc", status="ok", round_=0, control=False):
    return dict(level="model", impl=impl, method=method, mode=mode, length=n, status=status, median_s=t,
                tokens_per_s=n / t, baseline_mb=peak - inc, peak_mb=peak, increase_mb=inc, round=round_, control=control)


def test_ratios_are_relative_to_nope_of_the_same_mode_and_length():
    results = [_rec("nope", "train", 64, 0.5, 300.0, 100.0), _rec("alibi", "train", 64, 0.75, 330.0, 150.0),
               _rec("nope", "train", 128, 2.0, 400.0, 200.0), _rec("alibi", "train", 128, 3.0, 400.0, 200.0, impl=XT),
               _rec("alibi", "infer", 64, 0.1, 300.0, 0.0)]  # no infer NoPE: no ratio
    cells = stats.summarize(results)
    assert [r["median_s_vs_nope"] for r in cells[:4]] == [1.0, 1.5, 1.0, 1.5]
    assert cells[1]["tokens_per_s_vs_nope"] == pytest.approx(1 / 1.5)
    assert cells[1]["peak_mb_vs_nope"] == pytest.approx(1.1) and cells[1]["increase_mb_vs_nope"] == 1.5
    assert cells[4]["median_s_vs_nope"] is None


def test_round_ratios_median_and_spread():
    """Each round's ratio is to the NoPE of that round; the table gives their median and min-max."""
    nope, alibi, control = [1.0, 2.0, 1.0, 1.0], [1.2, 2.2, 1.5, 1.0], [1.0, 2.4, 0.9, 1.0]
    records = []
    for r in range(4):
        records.append(_rec("nope", "train", 64, nope[r], 300.0, 100.0, round_=r))
        records.append(_rec("alibi", "train", 64, alibi[r], 330.0 + r, 150.0, round_=r, status="ok" if r < 3 else "failed"))
        records.append(_rec("nope", "train", 64, control[r], 300.0, 100.0 + 10 * r, round_=r, control=True))
    cells = {(c["label"]): c for c in stats.summarize(records)}
    a, c, n = cells["alibi"], cells["nope (control)"], cells["nope"]
    assert a["median_s_vs_nope_rounds"] == pytest.approx([1.2, 1.1, 1.5, None])  # round 4 failed: no ratio
    assert (a["median_s_vs_nope"], a["median_s_vs_nope_lo"], a["median_s_vs_nope_hi"]) == pytest.approx((1.2, 1.1, 1.5))
    assert a["round_median_s"] == [1.2, 2.2, 1.5, None] and a["median_s"] == pytest.approx(1.5)
    assert a["rounds"] == 4 and a["rounds_ok"] == 3 and a["status"] == "ok"
    assert a["peak_mb_vs_nope"] == pytest.approx(331.0 / 300.0)  # median of 330, 331, 332 over 300
    # The control goes through the same arithmetic: ratios 1.0, 1.2, 0.9, 1.0 -> median 1.0 (even count: mean of 1.0, 1.0).
    assert c["median_s_vs_nope_rounds"] == pytest.approx([1.0, 1.2, 0.9, 1.0])
    assert (c["median_s_vs_nope"], c["median_s_vs_nope_lo"], c["median_s_vs_nope_hi"]) == pytest.approx((1.0, 0.9, 1.2))
    assert c["increase_mb_vs_nope"] == pytest.approx(1.15)  # 110/100 and 120/100 in the middle
    assert n["median_s_vs_nope_rounds"] == [1.0] * 4 and not n["control"]
    assert tables.ratio_cell(a, "median_s_vs_nope") == "1.20x (1.10-1.50)"
    assert tables.ratio_cell(c, "median_s_vs_nope") == "1.00x (0.90-1.20)"
    # A round whose NoPE failed gives no ratio to anyone; the other rounds still do.
    records[0]["status"] = "failed"
    a = next(c for c in stats.summarize(records) if c["label"] == "alibi")
    assert a["median_s_vs_nope_rounds"] == pytest.approx([None, 1.1, 1.5, None])
    assert a["median_s_vs_nope"] == pytest.approx(1.3)


def test_plan_runs_every_cell_once_per_round_with_a_control_and_rotates():
    config = posenc.bench.configure(methods=["alibi", "rope", "t5"], lengths=[32, 16], mode="both", rounds=5, level="attention")
    jobs = posenc.bench.plan(config)
    assert config.methods == ["nope", "alibi", "rope", "t5"] and config.lengths == [16, 32]
    entries = 5  # nope, alibi, rope, t5 and the control
    assert len(jobs) == 5 * 2 * 2 * entries
    for r in range(5):
        mine = [j for j in jobs if j.round == r]
        assert sorted(j.cell for j in mine) == sorted({j.cell for j in jobs})  # every cell, once
        assert sum(j.control for j in mine) == 2 * 2 and all(j.method == "nope" for j in mine if j.control)
    firsts = [next(j for j in jobs if j.round == r and j.length == 16 and j.mode == "train") for r in range(5)]
    assert len({(j.method, j.control) for j in firsts}) == 5  # with 5 entries and 5 rounds: each one goes first once
    positions = {}
    for r in range(5):
        order = [(j.method, j.control) for j in jobs if j.round == r and j.length == 32 and j.mode == "infer"]
        for i, entry in enumerate(order):
            positions.setdefault(entry, set()).add(i)
    assert all(p == set(range(5)) for p in positions.values())  # each entry at every place once
    round0 = [(j.method, j.control) for j in jobs if j.round == 0 and j.length == 16 and j.mode == "train"]
    assert abs(round0.index(("nope", True)) - round0.index(("nope", False))) > 1  # the control is not NoPE's neighbour


def test_job_round_trips_through_json():
    job = Job(level="model", mode="train", method="t5", length=64, impl=XT, control=False, round=3, threads=2, extra={"k": 1})
    assert Job.from_json(job.to_json()) == job
    assert Job.from_dict(dict(job.to_dict(), status="ok", median_s=1.0)) == job  # a result record holds more
    assert Job(level="attention", mode="infer", method="nope", length=8, control=True).label == "nope (control)"


def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_cli_attention_level_through_subprocess_workers(tmp_path, capsys):
    """The real path: one fresh worker per (method, length, mode, round), files and table written."""
    out = tmp_path / "att"
    argv = ["bench", "--methods", "alibi", "--lengths", "32", "64", "--level", "attention", "--mode", "train", "--rounds", "1",
            "--repeats", "1", "--warmup", "0", "--dim", "32", "--heads", "4", "--threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "[1/6]" in captured.err and "[6/6]" in captured.err  # progress on stderr
    table = captured.out
    assert "| method | N | train s | train tok/s | train time vs NoPE |" in table
    assert machine.describe_machine()["cpu_model"] in table and "Machine:" in table
    for name in ("results.csv", "results.json", "table.md", "command.txt", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "jobs.json").exists()  # the journal is gone once results.json holds it all
    rows = _csv_rows(out / "results.csv")
    assert [(r["label"], r["length"]) for r in rows] == [
        ("nope", "32"), ("nope (control)", "32"), ("alibi", "32"), ("nope", "64"), ("nope (control)", "64"), ("alibi", "64")]
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert float(r["median_s"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["peak_mb"]) >= float(r["baseline_mb"]) > 0
        assert r["threads_used"] == "1" and r["cpu_model"] and r["torch"] == torch.__version__
        assert r["backend_used"] == {"nope": "sdpa", "alibi": "blocked"}[r["method"]]
        if r["label"] == "nope":
            assert float(r["median_s_vs_nope"]) == 1.0 and float(r["peak_mb_vs_nope"]) == 1.0
        else:
            assert math.isfinite(float(r["median_s_vs_nope"]))
    nope_lines = [line for line in table.splitlines() if line.startswith("| nope |")]
    assert len(nope_lines) == 2 and all(line.count("1.00x") >= 2 for line in nope_lines)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["command"].startswith("posenc bench --methods alibi --lengths 32 64 --level attention")
    assert "--rounds 1" in data["meta"]["command"]
    assert data["meta"]["machine"]["torch"] == torch.__version__ and "cpu_flags" in data["meta"]["machine"]
    assert len(data["cells"]) == 6 and len(data["jobs"]) == 6


def test_model_level_with_x_transformers_in_process(tmp_path):
    pytest.importorskip("x_transformers")
    results = harness.bench(methods=["t5", "shaw"], lengths=[32], level="model", mode="both", compare=["x-transformers"],
                            rounds=2, isolate=False, **TINY)
    by = {(r["label"], r["impl"], r["mode"]): r for r in results.cells}
    # ((nope, t5, shaw) x (posenc, x-t, x-t flash) + the control) x (train, infer), each in 2 rounds
    assert len(results.cells) == (3 * 3 + 1) * 2 and len(results.jobs) == 2 * len(results.cells)
    for mode in ("train", "infer"):
        assert by[("nope", "posenc", mode)]["median_s_vs_nope"] == 1.0
        assert by[("nope (control)", "posenc", mode)]["median_s_vs_nope"] > 0
        assert by[("t5", "posenc", mode)]["status"] == "ok"
        assert by[("t5", XT, mode)]["status"] == "ok" and by[("t5", XT, mode)]["median_s_vs_posenc"] > 0
        assert by[("nope", XT_FLASH, mode)]["status"] == "ok"
        refused = by[("t5", XT_FLASH, mode)]
        assert refused["status"] == "refused" and "flash" in refused["error"]
        assert by[("shaw", XT, mode)]["status"] == "n/a"
        assert by[("shaw", "posenc", mode)]["median_s_vs_nope"] > 0
    table = tables.markdown_table(results)
    assert "| method | impl | N | train s/step |" in table and "infer time vs NoPE" in table
    assert "posenc vs x-transformers" in table and "refused" in table and "| nope (control) | posenc |" in table
    assert "x (" in table  # ratios with their spread over the two rounds
    results.meta["command"] = "posenc bench (test)"
    paths = posenc.bench.write_outputs(results, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert len(_csv_rows(paths["results.csv"])) == len(results.cells)
    assert all(len(r["round_median_s"].split()) == 2 for r in _csv_rows(paths["results.csv"]))


def test_a_failing_worker_is_recorded_and_the_run_goes_on():
    # shaw moves values: a forced sdpa backend cannot run it, so that job fails; the others run.
    results = harness.bench(methods=["shaw", "alibi"], lengths=[16], level="attention", mode="infer",
                            backend="sdpa", rounds=1, isolate=False, **TINY)
    status = {r["label"]: r["status"] for r in results.cells}
    assert status == {"nope": "ok", "nope (control)": "ok", "shaw": "failed", "alibi": "ok"}
    failed = next(r for r in results.cells if r["method"] == "shaw")
    assert "sdpa" in failed["error"] and failed["median_s_vs_nope"] is None
    assert "Not measured" in tables.markdown_table(results)


def test_a_worker_past_its_timeout_is_recorded():
    job = Job(level="attention", mode="infer", method="nope", length=16, dim=32, heads=4, repeats=1, warmup=0, threads=1)
    result = harness.launch(job, timeout=0.01)
    assert result["status"] == "failed" and "timed out" in result["error"]


def test_the_worker_is_its_own_entry_point(monkeypatch):
    """A worker is ``python -m posenc.bench.worker JOB_JSON``, never the command line again."""
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        raise harness.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(harness.subprocess, "run", fake_run)
    job = Job(level="attention", mode="infer", method="nope", length=16)
    harness.launch(job, timeout=1)
    assert seen["cmd"][1:4] == ["-m", "posenc.bench.worker", job.to_json()]


# --- plots: bars for one length, lines with error bars for several -----------------------------


def _cells(lengths, impls=("posenc", XT)):
    records = []
    for r in range(3):
        for n in lengths:
            for method in ("nope", "alibi"):
                for impl in impls:
                    records.append(_rec(method, "train", n, n * (1 + 0.1 * r) * (2 if impl != "posenc" else 1), 300.0, 10.0,
                                        impl=impl, round_=r))
    return stats.summarize(records)


def test_one_length_is_a_grouped_bar_chart_with_distinct_colours():
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer, ErrorbarContainer

    fig = plots.figure(_cells([64]))
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 and all(len(b) == 2 for b in bars)  # one group per implementation, one bar per method
    assert bars[0].patches[0].get_facecolor() != bars[1].patches[0].get_facecolor()
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["nope", "alibi"]
    plt.close(fig)


def test_several_lengths_are_lines_with_error_bars(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.container import BarContainer, ErrorbarContainer

    cells = _cells([64, 128])
    fig = plots.figure(cells)
    ax = fig.axes[0]
    assert not any(isinstance(c, BarContainer) for c in ax.containers)
    errorbars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(errorbars) == 4  # (nope, alibi) x (posenc, x-t)
    plt.close(fig)
    plots.plot(cells, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- benchmarks/schedule.py: the layer-schedule checks of issue 19, in its --quick mode ------------


def test_the_schedule_benchmark_writes_its_three_tables(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "schedule.py"
    spec = importlib.util.spec_from_file_location("schedule_benchmark", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "schedule"
    script.main(["--quick", "--in-process", "--methods", "rope", "--out", str(out)])
    table = (out / "table.md").read_text()
    assert table.strip() in capsys.readouterr().out  # printed too
    assert table.startswith("Machine: ") and machine.cpu_model() in table and "Quick mode" in table
    for title in ("### Sliding window W=32 vs full causal", "### Decoding a windowed layer (W=32",
                  "### 3 local (W=32) : 1 global layers"):
        assert title in table, title
    assert sum(line.startswith("| rope | ") for line in table.splitlines()) == 3
    data = json.loads((out / "results.json").read_text())
    assert data["quick"] is True and data["rounds"] == 1 and data["command"].startswith("python benchmarks/schedule.py --quick")
    assert set(data["ratios"]) == {"window", "decode", "schedule"} == set(data["jobs"])
    for name, per in data["ratios"].items():
        got = per["rope"]
        assert got["target"] == script.TARGETS[name] and len(got["rounds"]) == 1
        assert got["min"] <= got["median"] <= got["max"] and got["median"] > 0
        assert got["meets_target"] == (got["median"] <= got["target"])
    jobs = {(j["table"], j["variant"]): j for round_ in data["jobs"].values() for j in round_[0]}
    assert {k for k in jobs} == {("window", "full"), ("window", "window"), ("decode", "cache 64"), ("decode", "cache 512"),
                                 ("schedule", "local"), ("schedule", "global"), ("schedule", "mixed")}
    # the ratios are the jobs' own figures
    window = data["ratios"]["window"]["rope"]["median"]
    assert window == pytest.approx(jobs[("window", "window")]["seconds"] / jobs[("window", "full")]["seconds"])
    decode = data["ratios"]["decode"]["rope"]["median"]
    assert decode == pytest.approx(jobs[("decode", "cache 512")]["per_token_s"] / jobs[("decode", "cache 64")]["per_token_s"])
    s = {v: jobs[("schedule", v)]["seconds"] for v in ("local", "global", "mixed")}
    assert data["ratios"]["schedule"]["rope"]["median"] == pytest.approx(s["mixed"] / (0.75 * s["local"] + 0.25 * s["global"]))
    # what was timed is what the table says: a windowed cache keeps O(W) keys; the 3:1 LM has its kinds
    assert jobs[("decode", "cache 512")]["kept_keys"] <= 2 * 32 and jobs[("decode", "cache 512")]["cache_capacity"] <= 2 * 32
    assert jobs[("schedule", "mixed")]["windows"] == [32, 32, 32, None]
    assert jobs[("schedule", "local")]["windows"] == [32] * 4 and jobs[("schedule", "global")]["windows"] == [None] * 4


# --- schedule rows: a method written as a layer schedule -----------------------------------------


def test_schedule_rows_are_checked_before_any_work(no_workers):
    with pytest.raises(UsageError, match=r"'3x\[rope window=8\] 1x\[rope\]'.*more than depth=1"):
        harness.bench(methods=["3x[rope window=8] 1x[rope]"], lengths=[32], level="attention", progress=False)
    with pytest.raises(UsageError, match="no option"):
        harness.bench(methods=["[rope windw=8]"], lengths=[32], level="model", progress=False)
    with pytest.raises(UsageError, match="head dim"):
        harness.bench(methods=["[rope:rotary_dim=10 window=8]"], lengths=[32], level="attention", dim=32, heads=4, progress=False)


def test_a_one_layer_schedule_is_that_layer_at_the_attention_level():
    from posenc.bench.levels import attention as level

    job = Job(level="attention", mode="infer", method="[rope window=16]", length=48, dim=32, heads=4, batch=1)
    work = level.build(job, torch.device("cpu"), torch.float32)
    assert work.module.window == 16
    qkv = torch.randn(1, 48, 96)  # (B, T, 3 x H x D)
    q, k, v = (t.view(1, 48, 4, 8).transpose(1, 2) for t in qkv.split(32, dim=-1))
    expected = posenc.attend(q, k, v, posenc.build("rope", num_heads=4, head_dim=8), window=16)  # (B, H, T, D)
    with torch.no_grad():
        got = work.module(qkv)  # (B, T, H x D)
    torch.testing.assert_close(got, expected.transpose(1, 2).reshape(1, 48, 32))


@pytest.mark.parametrize("level, method, mode", [
    ("attention", "[alibi window=8]", "train"),
    ("model", "3x[rope window=8] 1x[nope]", "train"),
    ("decode", "3x[rope window=8] 1x[rope]", "single"),
])
def test_schedule_rows_run_in_the_bench(level, method, mode):
    results = harness.bench(methods=[method], lengths=[32], level=level, mode=mode, rounds=1, isolate=False,
                            **{**TINY, "depth": 4 if level != "attention" else 1})
    row = next(r for r in results.cells if r["label"] == method)
    assert row["status"] == "ok" and row["median_s"] > 0 and row["median_s_vs_nope"] > 0, row
    assert cli.main(["bench", "--methods", method, "--level", level, "--lengths", "8", "--rounds", "0"]) == 2  # (checked first)


def test_the_schedule_benchmark_alternates_each_tables_variants_in_one_process(tmp_path):
    """--alternate K: every variant's record holds K runs, the round's time their median, and each
    ratio is the alternated records' own figures."""
    import importlib.util
    import statistics
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "schedule.py"
    spec = importlib.util.spec_from_file_location("schedule_benchmark", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "schedule"
    script.main(["--quick", "--in-process", "--methods", "alibi", "--alternate", "3", "--out", str(out)])
    data = json.loads((out / "results.json").read_text())
    assert data["command"].endswith("--alternate 3")
    records = {table: {j["variant"]: j for j in rounds[0]} for table, rounds in data["jobs"].items()}
    assert set(records["window"]) == {"full", "window"} and set(records["decode"]) == {"cache 64", "cache 512"}
    assert set(records["schedule"]) == {"local", "global", "mixed"}
    for per in records.values():
        for r in per.values():
            assert len(r["runs_s"]) == 3 and r["seconds"] == statistics.median(r["runs_s"])
    w, c, s = records["window"], records["decode"], records["schedule"]
    assert data["ratios"]["window"]["alibi"]["median"] == pytest.approx(w["window"]["seconds"] / w["full"]["seconds"])
    assert data["ratios"]["decode"]["alibi"]["median"] == pytest.approx(c["cache 512"]["per_token_s"] / c["cache 64"]["per_token_s"])
    assert c["cache 512"]["kept_keys"] <= c["cache 512"]["cache_capacity"]
    mean = 0.75 * s["local"]["seconds"] + 0.25 * s["global"]["seconds"]
    assert data["ratios"]["schedule"]["alibi"]["median"] == pytest.approx(s["mixed"]["seconds"] / mean)
    with pytest.raises(SystemExit, match="--alternate"):
        script.main(["--quick", "--in-process", "--tables", "window", "--alternate", "-1", "--out", str(out)])
