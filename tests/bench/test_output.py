"""posenc bench under faults: a bad output folder fails before any work, measurements are never lost.

Workers are replaced by a fake that returns made-up records at once (these tests check what the
command does with its files, not the measurements), except where noted.
"""

from __future__ import annotations

import json
import os

import pytest

from posenc import cli
from posenc.bench import harness, output
from posenc.errors import UsageError

ARGV = ["bench", "--methods", "alibi", "--lengths", "16", "--mode", "infer", "--rounds", "2", "--repeats", "1",
        "--warmup", "0", "--dim", "32", "--heads", "4"]
JOBS = 2 * 3  # 2 rounds x (nope, alibi, control)


@pytest.fixture
def launched(monkeypatch):
    """Replace the workers by a fake; the list holds every job launched."""
    jobs = []

    def launch(job, timeout=None, isolate=True):
        jobs.append(job)
        t = 0.01 * (1 + len(jobs) % 3)
        return dict(job.to_dict(), status="ok", times_s=[t], median_s=t, min_s=t, tokens_per_s=job.length / t,
                    baseline_mb=200.0, peak_mb=210.0, increase_mb=10.0, backend_used="sdpa", threads_used=1)

    monkeypatch.setattr(harness, "launch", launch)
    return jobs


@pytest.fixture
def no_workers(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError("a worker was launched although the output folder is unusable")

    monkeypatch.setattr(harness, "launch", launch)


# --- an unusable output folder: one line, before any job (it used to fail after all of them) ----


def test_out_under_a_file_fails_before_any_job(no_workers, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert cli.main([*ARGV, "--out", str(tmp_path / "file" / "results")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posenc bench: error: out: cannot write in") and "results" in err[0]


def test_out_that_is_a_file_fails_and_the_file_is_kept(no_workers, tmp_path, capsys):
    target = tmp_path / "table.md"
    target.write_text("a user's file")
    assert cli.main([*ARGV, "--out", str(target)]) == 2
    assert "out must be a folder" in capsys.readouterr().err
    assert target.read_text() == "a user's file"


def test_an_unwritable_folder_is_a_usage_error(tmp_path, monkeypatch):
    def refuse(path, text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(output, "write_text", refuse)  # the probe goes through the outputs' own writer
    with pytest.raises(UsageError, match="out: cannot write in .*Permission denied"):
        output.check_out(tmp_path / "ro")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_read_only_folder_fails_before_any_job(no_workers, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert cli.main([*ARGV, "--out", str(ro)]) == 2
    finally:
        ro.chmod(0o700)


def test_the_probe_leaves_nothing_behind(tmp_path):
    assert output.check_out(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert list((tmp_path / "a" / "b").iterdir()) == []


# --- measurements survive: saved as they come, and elsewhere if the folder fails at the end -----


def test_measurements_are_saved_as_they_come(launched, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    seen = []

    def launch_then_look(job, timeout=None, isolate=True):
        if (out / output.JOURNAL).exists():
            seen.append(len(json.loads((out / output.JOURNAL).read_text())["jobs"]))
        if len(seen) == 3:
            raise KeyboardInterrupt  # the user gives up in the middle of the run
        return record(job)

    record = harness.launch
    monkeypatch.setattr(harness, "launch", launch_then_look)
    assert cli.main([*ARGV, "--out", str(out)]) == 130
    assert seen == [1, 2, 3]  # the journal held every finished job before the next one started
    assert f"the measurements so far are in {out / output.JOURNAL}" in capsys.readouterr().err
    journal = json.loads((out / output.JOURNAL).read_text())
    assert len(journal["jobs"]) == 3 and journal["command"].startswith("posenc bench")
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


def test_a_folder_that_fails_at_the_end_keeps_the_measurements(launched, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(output.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out"
    record = harness.launch

    def launch_then_break_the_folder(job, timeout=None, isolate=True):
        if len(launched) == 3:  # the folder goes away mid-run (unmounted, removed, replaced by a file)
            for p in out.iterdir():
                p.unlink()
            out.rmdir()
            out.write_text("")
        return record(job)

    monkeypatch.setattr(harness, "launch", launch_then_break_the_folder)
    assert cli.main([*ARGV, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "| alibi | 16 |" in captured.out  # the table is printed before the files are written
    assert "warning: cannot save measurements" in captured.err  # the journal's failure, once
    assert captured.err.count("warning") == 1
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("posenc bench: error: cannot write the results in") and f"all {JOBS} measurements" in last
    saved = list((tmp_path / "tmp").glob("posenc-bench-*.json"))
    assert len(saved) == 1 and str(saved[0]) in last
    data = json.loads(saved[0].read_text())
    assert len(data["jobs"]) == JOBS and len(data["cells"]) == 3 and data["meta"]["command"].startswith("posenc bench")


# --- every output is written atomically -------------------------------------------------------


def test_outputs_are_atomic(launched, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert cli.main([*ARGV, "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"table.md", "results.csv", "results.json", "command.txt", "plot.png", ".posenc-run", ".posenc-lock"}

    import matplotlib.figure

    def half_a_png(self, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_a_png)
    results = harness.bench(methods=["rope"], lengths=[16], mode="infer", rounds=1, repeats=1, progress=False)
    from posenc.files import WriteError

    with pytest.raises(WriteError, match="No space left on device; the previous version is unchanged"):
        output.write_outputs(results, out)
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(after) == set(before)  # no temporary file left behind
    assert after["plot.png"] == before["plot.png"]  # the old plot, whole, not half a new one
    for name in ("table.md", "results.json"):  # written before the plot: complete new files
        assert after[name] != before[name] and b"rope" in after[name]
    json.loads(after["results.json"])


def test_a_folder_posenc_did_not_make_is_refused_before_any_job(tmp_path, monkeypatch, capsys):
    """Never a user's file overwritten: a non-empty folder without posenc's run marker (and no
    older bench results in it) is refused at once."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my own numbers\n")
    ran = []
    monkeypatch.setattr(harness, "launch", lambda *a, **k: ran.append(1))
    assert cli.main([*ARGV, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"posenc bench: error: out: {out} is not empty (results.csv) and was not made by posenc" in err
    assert not ran and (out / "results.csv").read_text() == "my own numbers\n"


# --- round 3: --resume, journals never deleted, sizes checked up front, strict JSON ------------------


def interrupted(out, launched, monkeypatch, after: int) -> None:
    """Run ARGV into ``out`` and press Ctrl-C after ``after`` jobs."""
    record = harness.launch

    def launch(job, timeout=None, isolate=True):
        if len(launched) == after:
            raise KeyboardInterrupt
        return record(job)

    monkeypatch.setattr(harness, "launch", launch)
    assert cli.main([*ARGV, "--out", str(out)]) == 130
    monkeypatch.setattr(harness, "launch", record)


def test_resume_keeps_the_finished_jobs_and_runs_the_rest(launched, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    interrupted(out, launched, monkeypatch, after=4)
    assert capsys.readouterr().err.strip().splitlines()[-2:] == [
        f"posenc bench: the measurements so far are in {out / output.JOURNAL}; continue with the same command and --resume",
        "posenc bench: interrupted"]
    first = json.loads((out / output.JOURNAL).read_text())["jobs"]
    assert len(first) == 4
    # the same command again, without --resume: refused, the journal kept (before: wiped, 0 of 4 kept)
    assert cli.main([*ARGV, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"posenc bench: error: out: {out / output.JOURNAL} holds the measurements of an interrupted run; continue it "
        "with --resume, or choose another out (posenc never deletes it)\n")
    assert json.loads((out / output.JOURNAL).read_text())["jobs"] == first
    launched.clear()
    assert cli.main([*ARGV, "--out", str(out), "--resume"]) == 0
    assert len(launched) == JOBS - 4  # only the jobs the journal did not hold
    results = json.loads((out / "results.json").read_text())
    assert results["jobs"][:4] == first and len(results["jobs"]) == JOBS
    assert not (out / output.JOURNAL).exists()  # results.json holds every record now


def test_resume_with_other_options_or_nothing_to_resume(launched, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert cli.main([*ARGV, "--out", str(out), "--resume"]) == 2
    assert capsys.readouterr().err == (f"posenc bench: error: resume: {str(out)!r} holds no {output.JOURNAL} (no "
                                       "interrupted run to continue); leave out --resume\n")
    interrupted(out, launched, monkeypatch, after=2)
    capsys.readouterr()
    argv = [a if a != "2" else "3" for a in ARGV]  # --rounds 3
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posenc bench: error: resume: {out / output.JOURNAL} was measured with other options "
                          "(rounds: 2 -> 3); resume with its command: posenc bench ")
    assert err.endswith(" --resume\n")
    (out / output.JOURNAL).write_text('{"command": "x", "jobs": []}')  # from an older posenc: no options
    assert cli.main([*ARGV, "--out", str(out), "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"posenc bench: error: resume: {out / output.JOURNAL} is not a bench journal with its options (written by an "
        "older posenc, or edited); move it away and run without --resume\n")


def test_an_interrupted_second_run_never_sits_beside_the_first_runs_results(launched, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert cli.main([*ARGV, "--out", str(out)]) == 0
    assert (out / "results.json").exists()
    capsys.readouterr()
    launched.clear()
    interrupted(out, launched, monkeypatch, after=2)
    err = capsys.readouterr().err
    assert (f"posenc bench: replacing the earlier results in {out} (table.md, results.csv, results.json, command.txt, "
            "plot.png)") in err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [output.JOURNAL]


def test_an_odd_rope_head_dim_is_refused_before_any_job(no_workers, tmp_path, capsys):
    assert cli.main(["bench", "--methods", "rope", "--dim", "36", "--heads", "4", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("posenc bench: error: methods: rope cannot run with dim 36 and heads 4 (head dim "
                                       "9): rope needs an even head_dim, got 9\n")
    assert not (tmp_path / "o").exists()


def test_help_says_which_level_each_library_compares_at(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "x-transformers (level model); transformers (level decode)" in text


def test_bench_results_are_strict_json(tmp_path):
    from posenc.bench.harness import Results
    from posenc.bench.plan import configure

    results = Results(configure(methods=["alibi"], lengths=[16]), {"x": float("nan")})
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        output._json(results)
