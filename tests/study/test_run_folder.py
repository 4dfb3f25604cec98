"""A study's run folder under faults (``posenc study`` / ``posenc report``): folders in use, locks,
unwritable outputs, truncated or foreign checkpoints, resume, progress; one test per fault a
user met, each asserting the exact sentence the user reads and that no finished result was lost or
changed. Every run here is tiny (a few steps of the smoke model on 512 validation bytes)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import posenc
from posenc import cli, files
from posenc.study import evaluation, figures, progress, report
from posenc.study.cli import run_study

ARGS = ["--preset", "smoke", "--methods", "alibi", "learned", "--steps", "4", "--checkpoint-every", "2",
        "--eval-lengths", "32", "64", "--valid-bytes", "512", "--threads", "1"]


def study(out: Path, *extra: str, quiet: bool = True) -> int:
    return cli.main(["study", *ARGS, "--out", str(out), *(["--quiet"] if quiet else []), *extra])


def numbers(out: Path) -> dict:
    """What must survive any fault: per method, status, loss curve and every evaluation row."""
    results = json.loads((out / "results.json").read_text())
    return {m: (e["status"], e["train"]["losses"], [(r["length"], r["loss"], r["status"]) for r in e["eval"]])
            for m, e in results["methods"].items()}


def one_error(capsys) -> str:
    """The one line a user error prints, without its 'posenc CMD: error: ' prefix."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1].rstrip("\n")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert study(out) == 0
    return out, numbers(out)


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A private copy of the finished run."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    return out


# ---------------------------------------------------------------- the corpus








# ---------------------------------------------------------------- the output directory


def test_a_directory_that_is_not_a_run_is_never_written(tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    for name in ("results.csv", "results.md", "extrapolation.png", "checkpoints/alibi.json"):
        (out / name).write_text(f"user data {name}\n")
    before = {p: p.read_bytes() for p in out.rglob("*")  if p.is_file()}
    assert study(out) == 2
    assert one_error(capsys) == (f"out: {out} is not empty (checkpoints, extrapolation.png, results.csv, ...) and "
                                 "was not made by posenc (no .posenc-run file); choose a new or empty directory, "
                                 "posenc does not write over other files")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_second_run_into_a_directory_in_use_fails_at_once(run, finished, capsys):
    holder = files.RunDir.claim(run, "study")  # a live study holds the directory
    try:
        info = json.loads((run / files.LOCK).read_text())
        assert info["pid"] == os.getpid()
        t0 = time.perf_counter()
        assert study(run, "--resume") == 2
        assert time.perf_counter() - t0 < 10
        assert one_error(capsys) == (f"out: {run} is in use by another posenc study (pid {os.getpid()} on "
                                     f"{info['host']}, started {info['started']}); wait for it to end, or "
                                     "choose another out")
    finally:
        holder.release()
    assert numbers(run) == finished[1]


def test_a_stale_lock_is_reported_and_taken_over(run, finished, capsys):
    stale = {"pid": 999999, "host": "elsewhere", "kind": "study", "started": "2026-01-01T00:00:00+0000"}
    (run / files.LOCK).write_text(json.dumps(stale))  # written by a run that was killed: no flock held
    assert files.lock_holder(run) is None
    assert study(run, "--resume") == 0
    assert capsys.readouterr().err.splitlines() == [
        f"out: {run} was left locked by a posenc study that did not finish (pid 999999 on elsewhere, started "
        "2026-01-01T00:00:00+0000; killed?); taking it over"]
    assert numbers(run) == finished[1]
    assert (run / files.LOCK).read_text() == ""  # released at the end


def test_unwritable_outputs_fail_before_any_work(tmp_path, finished, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert study(blocker / "run") == 2
    assert one_error(capsys) == f"out directory {str(blocker / 'run')!r} is not writable: Not a directory"
    # the report: checked before rendering (render would fail the test)
    monkeypatch.setattr(report, "render", lambda *a, **k: pytest.fail("rendered before checking out"))
    assert cli.main(["report", str(finished[0]), "--out", str(blocker / "r.html")]) == 2
    assert one_error(capsys) == f"out: cannot write {blocker / 'r.html'}: {blocker} is not a directory"
    assert cli.main(["report", str(finished[0]), "--out", str(blocker)]) == 2
    assert one_error(capsys) == (f"out: {blocker} exists and is not a posenc report; choose another name "
                                 "(posenc does not overwrite other files)")
    assert blocker.read_text() == "not a folder"


# ---------------------------------------------------------------- damaged or foreign files


@pytest.mark.parametrize("content, problem", [
    ({"schema": "posenc-study/1"}, "is not a complete posenc study result (no config; no methods); it was edited or damaged"),
    ({"schema": "posenc-study/1", "config": {"train_length": 32}, "methods": {}},
     "is not a complete posenc study result (config has no steps; config has no batch_size; config has no "
     "eval_lengths); it was edited or damaged"),
    ({"a": 1}, "is not a posenc study's results (schema None, expected 'posenc-study/1')"),
    ([1, 2], "is not a posenc study's results (schema None, expected 'posenc-study/1')"),
])
def test_results_json_that_is_not_a_run(tmp_path, capsys, content, problem):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(content))
    assert cli.main(["report", str(out)]) == 2  # was: KeyError: 'config'
    assert one_error(capsys) == f"{out / 'results.json'} {problem}"
    assert study(out, "--resume") == 2
    assert one_error(capsys) == f"{out / 'results.json'} {problem}"
    assert json.loads((out / "results.json").read_text()) == content


def _unevaluated(run: Path, method: str) -> None:
    """Make ``method`` trained but not yet evaluated, as a run killed after its checkpoint leaves it."""
    results = json.loads((run / "results.json").read_text())
    results["methods"][method].update(status="trained", eval=[])
    (run / "results.json").write_text(json.dumps(results))


def test_a_truncated_checkpoint_is_named_and_retrained_on_request(run, finished, capsys):
    _unevaluated(run, "alibi")
    ckpt = run / "checkpoints" / "alibi.safetensors"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    assert study(run, "--resume") == 2  # was: SafetensorError: incomplete metadata
    assert one_error(capsys) == (f"path: {ckpt} is damaged: {len(whole) // 2:,} bytes where its json recorded "
                                 f"{len(whole)} (truncated or replaced); delete {ckpt} and continue with resume "
                                 "to train alibi again")
    with pytest.raises(posenc.UsageError, match="is damaged"):
        posenc.load_checkpoint(ckpt)
    ckpt.unlink()  # as the message says
    assert study(run, "--resume") == 0
    assert capsys.readouterr().err.splitlines() == [f"[alibi] its checkpoint {ckpt} is missing: training it again"]
    assert numbers(run) == finished[1] and ckpt.read_bytes() == whole  # the same weights, byte for byte


def test_a_truncated_training_state_says_delete_and_resume(tmp_path, finished, capsys):
    out = tmp_path / "run"

    def stop(method, step):
        if method == "learned" and step == 3:
            raise KeyboardInterrupt

    assert run_study(cli.build_parser().parse_args(["study", *ARGS, "--out", str(out), "--quiet"]), on_step=stop) == 130
    capsys.readouterr()
    state = out / "state" / "learned.pt"
    state.write_bytes(state.read_bytes()[:300])
    assert study(out, "--resume") == 2  # was: RuntimeError: PytorchStreamReader failed ...
    assert one_error(capsys) == (
        f"the training state {state} cannot be used (PytorchStreamReader failed reading zip archive: failed finding "
        "central directory); delete it and continue with resume: learned then trains again from step 0, other "
        "methods keep their results")
    state.unlink()
    assert study(out, "--resume") == 0
    assert numbers(out) == finished[1]


def test_disk_full_keeps_the_previous_file_and_says_how_to_continue(run, finished, monkeypatch, capsys):
    before = (run / "results.json").read_bytes()
    real = Path.write_bytes

    def full(self, data):  # the disk fills up half-way through writing results.json
        if self.name.startswith(".results.json.tmp"):
            real(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    assert study(run, "--resume", "--methods", "alibi", "learned", "nope") == 2  # was: OSError traceback
    assert one_error(capsys) == (f"cannot write {run / 'results.json'}: No space left on device; the previous "
                                 f"version is unchanged; finished work is in {run}: make room, then continue with resume")
    assert (run / "results.json").read_bytes() == before and not list(run.rglob(".*.tmp*"))
    monkeypatch.setattr(Path, "write_bytes", real)

    def full_state(obj, f):  # torch's own writer fails the same way
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    from posenc.study import train

    monkeypatch.setattr(train.torch, "save", full_state)
    assert study(run, "--resume", "--methods", "alibi", "learned", "nope") == 2
    assert one_error(capsys) == (f"cannot write {run / 'state' / 'nope.pt'}: No space left on device; finished work "
                                 f"is in {run}: make room, then continue with resume")
    monkeypatch.undo()
    assert study(run, "--resume", "--methods", "alibi", "learned", "nope") == 0
    after = numbers(run)
    assert {m: after[m] for m in finished[1]} == finished[1] and after["nope"][0] == "done"


@pytest.mark.parametrize("edit, diff", [
    ({"extra": 1}, "extra: json 1, weights '(absent)'"),
    ({"dim": 64}, "dim: json 64, weights 32"),
    ({"encoding": "nope"}, "encoding: json 'nope', weights 'alibi'"),
    ({"causal": False}, "causal: json False, weights True"),
])
def test_a_checkpoint_json_that_does_not_describe_its_weights_is_refused(run, finished, capsys, edit, diff):
    meta_path = run / "checkpoints" / "alibi.json"
    meta = json.loads(meta_path.read_text())
    meta["lm_config"].update(edit)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(posenc.UsageError) as e:  # was: loaded silently (encoding, causal) or a TypeError/RuntimeError
        posenc.load_checkpoint(run / "checkpoints" / "alibi.safetensors")
    assert str(e.value) == (f"path: the json of alibi.safetensors does not describe its weights ({diff}); it was "
                            "edited or belongs to other weights, refusing to load")
    _unevaluated(run, "alibi")
    assert study(run, "--resume") == 2
    assert one_error(capsys).startswith(f"path: the json of alibi.safetensors does not describe its weights ({diff})")
    assert numbers(run)["learned"] == finished[1]["learned"]


def test_weights_from_elsewhere_are_refused_without_running_code(run, tmp_path, capsys):
    ckpt = run / "checkpoints" / "alibi.safetensors"
    shutil.copy(run / "checkpoints" / "learned.safetensors", ckpt)  # another run's (or method's) weights
    with pytest.raises(posenc.UsageError) as e:
        posenc.load_checkpoint(ckpt)
    assert str(e.value) == f"path: {ckpt} is damaged: " + (
        f"{ckpt.stat().st_size:,} bytes where its json recorded {json.loads(ckpt.with_suffix('.json').read_text())['weights']['bytes']} "
        "(truncated or replaced)")
    # the same size, other bytes: the sha256 tells
    meta = json.loads(ckpt.with_suffix(".json").read_text())
    meta["weights"]["bytes"] = ckpt.stat().st_size
    ckpt.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(posenc.UsageError) as e:
        posenc.load_checkpoint(ckpt)
    assert str(e.value) == f"path: {ckpt} does not match the sha256 in alibi.json: the weights were changed or replaced"
    # a pickle that would run code, in place of the weights and of a training state: refused, never run
    flag = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    ckpt.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(posenc.UsageError):
        posenc.load_checkpoint(ckpt)
    results = json.loads((run / "results.json").read_text())
    del results["methods"]["learned"]  # learned not trained yet, and a "training state" waiting for it
    (run / "results.json").write_text(json.dumps(results))
    state = run / "state" / "learned.pt"
    state.parent.mkdir()
    state.write_bytes(pickle.dumps(Payload()))
    assert study(run, "--resume", "--methods", "learned") == 2
    assert one_error(capsys).startswith(f"the training state {state} cannot be used (Weights only load failed")
    assert not flag.exists()


def test_resume_of_a_directory_that_does_not_exist_is_an_error(tmp_path, capsys):
    out = tmp_path / "typo"
    assert study(out, "--resume") == 2  # was: a fresh study, silently
    assert one_error(capsys) == (f"resume: {out} does not exist, so there is nothing to resume; leave out resume "
                                 "to start a new study there")
    assert not out.exists()


SLOW = """
import sys, time
from posenc.cli import build_parser
from posenc.study.cli import run_study
# learned checkpoints after step 2, then waits to be killed: the run cannot finish before the test kills it
slow = lambda method, step: time.sleep(600 if step >= 2 else 0.2) if method == "learned" else None
raise SystemExit(run_study(build_parser().parse_args(sys.argv[1:]), on_step=slow))
"""


def test_report_of_a_killed_run_says_interrupted_and_resume_restores_it(tmp_path, finished, capsys):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", SLOW, "study", *ARGS, "--out", str(out), "--quiet"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    target = out / "state" / "learned.pt"
    deadline = time.time() + 120
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert target.exists(), proc.communicate()
    # while it runs: the report says so
    holder = files.lock_holder(out)
    assert holder["pid"] == proc.pid
    assert cli.main(["report", str(out), "--out", str(tmp_path / "live.html")]) == 0
    assert f"Status: running (pid {proc.pid}, started {holder['started']})." in (tmp_path / "live.html").read_text()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert cli.main(["report", str(out)]) == 0  # was: "Status: running"
    assert "Status: interrupted (resume with --resume)." in (out / "report.html").read_text()
    capsys.readouterr()
    assert study(out, "--resume") == 0
    assert capsys.readouterr().err.startswith(f"out: {out} was left locked by a posenc study that did not finish (pid {proc.pid}")
    assert numbers(out) == finished[1]


# ---------------------------------------------------------------- long jobs, the figure, DDP


def test_long_evaluation_shows_progress_and_an_estimate(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "LONG_S", 0.0)  # every stage counts as long
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # and logs every batch
    monkeypatch.setattr(evaluation, "EVAL_TOKENS", 128)  # 4 windows of 32 per batch
    assert study(tmp_path / "run", "--methods", "alibi", quiet=False) == 0
    err = capsys.readouterr().err.splitlines()
    duration = r"\d+(s|m\d\ds|h\d\dm)"
    assert any(re.fullmatch(rf"\[alibi\] training will take about {duration} more \(2 steps at \d+\.\d\d s/step\)", e)
               for e in err), err
    windows = {32: 16, 64: 8}  # 512 targets
    for length, total in windows.items():
        estimate = [e for e in err if e.startswith(f"[alibi] L={length}: scoring")]
        assert len(estimate) == 1 and re.fullmatch(
            rf"\[alibi\] L={length}: scoring {total} windows will take about {duration} \(from the first batch\); "
            r"an interrupt loses only this length", estimate[0]), estimate
        per_batch = 128 // length
        logged = [e for e in err if re.fullmatch(rf"\[alibi\] L={length}: \d+/{total} windows, eta {duration}", e)]
        assert [int(e.split(": ")[1].split("/")[0]) for e in logged] == list(range(per_batch, total, per_batch))


def test_the_legend_of_a_one_point_method_is_a_marker(finished):
    results = json.loads((finished[0] / "results.json").read_text())
    fig = figures.extrapolation_figure(results)
    legend = fig.axes[0].get_legend()
    entries = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert set(entries) == {"alibi", "learned (cannot run past 32)"}
    one = entries["learned (cannot run past 32)"]
    assert one.get_linestyle() == "None" and one.get_marker() == "o"  # was: a line, for a single point
    assert entries["alibi"].get_linestyle() == "-"


FAIL_ON_RANK_1 = """
import os, sys
from posenc.cli import build_parser
from posenc.study.cli import run_study
def fail(method, step):
    if step == 2 and os.environ.get("RANK") == "1":
        raise RuntimeError("simulated fault on rank 1")
raise SystemExit(run_study(build_parser().parse_args(sys.argv[1:]), on_step=fail))
"""


def test_a_failing_rank_prints_one_clear_line(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
         "study", "--preset", "smoke", "--methods", "alibi", "--steps", "4", "--device", "cpu", "--quiet",
         "--valid-bytes", "512", "--eval-lengths", "32", "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert lines.count("posenc study (rank 1): failed: RuntimeError: simulated fault on rank 1") == 1
    assert lines.count(f"posenc study (rank 0): stopped: another process failed (see its message); finished work "
                       f"is in {out}, continue with --resume") == 1
    assert "Connection closed by peer" not in proc.stderr  # was: rank 0's traceback from gloo
    root = proc.stderr.split("Root Cause (first observed failure):")[1]  # torchrun names the right process
    assert "traceback : posenc study (rank 1): failed: RuntimeError: simulated fault on rank 1" in root
