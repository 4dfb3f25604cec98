"""A study's runs spread out (``--jobs``, ``--shard`` with ``posenc study merge``, ``--executor ray``)
give the numbers of a serial study at the same threads, exactly; an interrupt of the workers then
``--resume`` too; and every merge that cannot be right is refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc import cli
from posenc.errors import UsageError
from posenc.study import StudyConfig, run_experiment
from posenc.study.distributed import Context
from posenc.study.executors import Execution
from posenc.study.merge import merge
from posenc.study.models import models_for
from posenc.study.plan import groups, parse_shard, plan, shard
from posenc.study.results import Paths

# Two trained rows and one evaluated from the first, at two seeds: 6 runs in 4 groups.
ARGS = ["--preset", "smoke", "--methods", "rope", "rope+yarn", "alibi", "--steps", "12", "--eval-lengths", "32", "64",
        "--seeds", "2", "--threads", "1", "--quiet"]


def numbers(out: Path) -> dict:
    """Everything a run computes (not its timings), per row in results.json's order, with the seeds' means."""
    results = json.loads((out / "results.json").read_text())
    got = {}
    for name, entry in results["methods"].items():
        runs = [entry, *entry.get("seeds", [])]
        got[name] = {
            "runs": [(r["seed"], r["status"], r["train"].get("losses"), r["train"].get("final_loss"),
                      [(e["length"], e["loss"], e["perplexity"], e["ppl_low"], e["ppl_high"], e["windows"]) for e in r["eval"]])
                     for r in runs],
            "across": [(e["length"], e["perplexity"], e["ppl_low"], e["ppl_high"], e["seed_values"])
                       for e in entry["across_seeds"]["eval"]],
        }
    return got


def checkpoints(out: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "checkpoints").iterdir())}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "run"
    assert cli.main(["study", *ARGS, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three parts of the 4 groups (rope and alibi at seeds 0 and 1): part 1 has rope's first seed
    and alibi's second, so its alibi entry is a placeholder holding a later seed; part 3 has rope's
    second seed alone."""
    root = tmp_path_factory.mktemp("shards")
    for k in (1, 2, 3):
        assert cli.main(["study", *ARGS, "--shard", f"{k}/3", "--out", str(root / f"part{k}")]) == 0
    return root / "part1", root / "part2", root / "part3"


def test_jobs_2_equal_a_serial_study_number_for_number(serial, tmp_path):
    out = tmp_path / "run"
    assert cli.main(["study", *ARGS, "--jobs", "2", "--out", str(out)]) == 0
    assert numbers(out) == numbers(serial)
    assert checkpoints(out) == checkpoints(serial)  # the same weights, bit for bit
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "done" and results["versions"]["jobs"] == 2 and results["versions"]["torch_threads"] == 1
    assert table(out) == table(serial)


def table(out: Path) -> list[str]:
    """results.md without its last column (the training seconds)."""
    return ["|".join(line.split("|")[:-2]) for line in (out / "results.md").read_text().splitlines()]


def test_shards_merged_equal_a_serial_study(serial, shards, tmp_path):
    first = json.loads((shards[0] / "results.json").read_text())
    assert first["shard"] == {"index": 1, "count": 3} and first["status"] == "done"
    assert first["methods"]["alibi"]["status"] == "pending" and first["methods"]["alibi"]["seeds"][0]["status"] == "done"
    assert cli.main(["report", str(shards[2]), "--out", str(tmp_path / "part3.html")]) == 0  # a part alone reads too
    out = tmp_path / "merged"
    assert cli.main(["study", "merge", *map(str, shards), "--out", str(out)]) == 0
    assert numbers(out) == numbers(serial) and table(out) == table(serial)
    assert checkpoints(out) == checkpoints(serial)
    windows = sorted(p.relative_to(out).as_posix() for p in (out / "windows").rglob("*.json"))
    assert windows == sorted(p.relative_to(serial).as_posix() for p in (serial / "windows").rglob("*.json"))
    merged = json.loads((out / "results.json").read_text())
    assert merged["status"] == "done" and "shard" not in merged
    assert [m["shard"] for m in merged["merged_from"]] == [{"index": k, "count": 3} for k in (1, 2, 3)]
    assert cli.main(["report", str(out), "--out", str(tmp_path / "report.html")]) == 0


def test_a_partial_merge_is_completed_by_resume(serial, shards, tmp_path, capsys):
    out = tmp_path / "merged"
    merge([shards[0]], out, progress=False)
    assert "is partial" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["status"] == "partial"
    assert cli.main(["study", "--out", str(out), "--resume", "--quiet", "--jobs", "2"]) == 0
    assert numbers(out) == numbers(serial)


def _copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    (dst / ".posenc-lock").unlink(missing_ok=True)
    if edit is not None:
        results = json.loads((dst / "results.json").read_text())
        edit(results)
        (dst / "results.json").write_text(json.dumps(results))
    return dst


def test_merge_refuses_what_cannot_be_one_study(serial, shards, tmp_path):
    one, two, _ = shards

    def steps(r):
        r["config"]["steps"] = 13

    def corpus(r):
        r["corpus"]["sha256"] = "0" * 64

    other = _copy(two, tmp_path / "steps", steps)
    with pytest.raises(UsageError, match=r"differ in config \(steps: 12 .* vs 13"):
        merge([one, other], tmp_path / "a")
    data = _copy(two, tmp_path / "corpus", corpus)
    with pytest.raises(UsageError, match="different data"):
        merge([one, data], tmp_path / "b")
    with pytest.raises(UsageError, match="rope is finished in both"):
        merge([serial, one], tmp_path / "c")
    with pytest.raises(UsageError, match="one of the folders"):
        merge([one, two], one)
    with pytest.raises(UsageError, match="named twice"):
        merge([one, one], tmp_path / "d")
    with pytest.raises(UsageError, match="holds no study"):
        merge([one, tmp_path], tmp_path / "e")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    with pytest.raises(UsageError, match="not empty"):
        merge([one, two], taken)
    assert (taken / "mine.txt").read_text() == "keep" and len(list(taken.iterdir())) == 1
    for name in "abcde":  # a refused merge writes nothing
        assert not (tmp_path / name).exists()
    assert cli.main(["study", "merge", str(one), "--out", str(tmp_path / "f"), "--steps", "3"]) == 2
    assert cli.main(["study", "merge", str(one)]) == 2
    assert cli.main(["study", "combine", str(one), "--out", str(tmp_path / "g")]) == 2


def test_a_part_resumes_as_the_same_part(shards, tmp_path):
    one = _copy(shards[0], tmp_path / "one")
    with pytest.raises(UsageError, match="holds part 1/3, not part 2/3"):
        run_experiment(_cfg(), one, resume=True, progress=False, shard=(2, 3))
    results = run_experiment(_cfg(), one, resume=True, progress=False)  # (no shard given: the saved part)
    assert results["shard"] == {"index": 1, "count": 3} and results["status"] == "done"


def _cfg(**kw) -> StudyConfig:
    return StudyConfig.from_preset("smoke", methods=["rope", "rope+yarn", "alibi"], steps=12, eval_lengths=[32, 64],
                                   seeds=2, **kw)


def test_shards_split_the_runs_by_groups_deterministically(tmp_path):
    cfg = StudyConfig.from_preset("smoke", methods=["rope", "rope+yarn", "rope+yarn+ft", "alibi", "nope"], seeds=2,
                                  finetune_steps=2, eval_lengths=[32, 64])
    runs = plan(cfg, models_for(cfg), Paths(tmp_path), 1).runs
    found = groups(runs)
    assert len(found) == 6 and sum(map(len, found)) == len(runs)
    for group in found:  # a base and everything evaluated or fine-tuned from it, at one seed
        assert group[0].base is None and all(r.base is not None and r.index == group[0].index for r in group[1:])
    parts = [shard(runs, k, 4) for k in range(1, 5)]
    labels = [r.label for part in parts for r in part]
    assert sorted(labels) == sorted(r.label for r in runs) and len(set(labels)) == len(labels)
    assert [r.label for r in parts[0]] == ["rope", "rope+yarn", "rope+yarn+ft", "alibi seed 1"]
    assert [r.label for r in shard(plan(cfg, models_for(cfg), Paths(tmp_path), 1).runs, 1, 4)] == [r.label for r in parts[0]]
    with pytest.raises(UsageError, match="7 parts exceed the study's 6 groups"):
        shard(runs, 1, 7)
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b", "1/2/3", "-1/2"):
        with pytest.raises(UsageError, match="shard must be K/N"):
            parse_shard(bad)


def test_bad_execution_options_are_refused(tmp_path):
    for execution, what in ((Execution(jobs=0), "jobs must be >= 1"), (Execution(threads=0), "threads must be >= 1"),
                            (Execution(executor="dask"), "executor must be one of local, ray"),
                            (Execution(address="auto"), "ray_address needs executor ray")):
        with pytest.raises(UsageError, match=what):
            run_experiment(_cfg(), tmp_path / "x", progress=False, execution=execution)
    with pytest.raises(UsageError, match="torchrun"):  # (DDP's processes: one big run)
        run_experiment(_cfg(), tmp_path / "x", progress=False, execution=Execution(jobs=2),
                       ctx=Context(torch.device("cpu"), 0, 2))
    with pytest.raises(UsageError, match="on_step"):
        run_experiment(_cfg(), tmp_path / "x", progress=False, execution=Execution(jobs=2), on_step=lambda m, s: None)
    assert not (tmp_path / "x").exists()
    for bad in ("0", "two", "-1"):
        assert cli.main(["study", *ARGS, "--jobs", bad, "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "y").exists()
    from posenc.study.cli import jobs_of
    from posenc.study.executors import cores

    assert jobs_of("auto") == cores() and jobs_of("3") == 3


LONG = ["--preset", "smoke", "--methods", "t5", "rope", "--steps", "120", "--checkpoint-every", "5", "--eval-lengths", "32",
        "--threads", "1", "--quiet"]


def test_an_interrupt_of_the_workers_then_resume_gives_the_serial_numbers(tmp_path):
    reference = tmp_path / "serial"
    assert cli.main(["study", *LONG, "--out", str(reference)]) == 0
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posenc", "study", *LONG, "--jobs", "2", "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not list((out / "state").glob("*.pt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert list((out / "state").glob("*.pt")), proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the main process and its workers
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130 and "--resume" in err, err
    partial = json.loads((out / "results.json").read_text())  # never half-written
    assert partial["status"] == "running" and partial["methods"].get("rope", {}).get("status") != "done"
    assert cli.main(["study", *LONG, "--jobs", "2", "--out", str(out), "--resume"]) == 0

    def plain(out: Path) -> dict:
        results = json.loads((out / "results.json").read_text())
        return {m: (e["train"]["losses"], [(r["loss"], r["perplexity"]) for r in e["eval"]]) for m, e in results["methods"].items()}

    assert plain(out) == plain(reference)
    assert not (out / "state").exists()


def test_ray_equals_a_serial_study_and_resume_and_report_work_on_it(serial, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        out = tmp_path / "run"
        results = run_experiment(_cfg(), out, progress=False, execution=Execution(threads=1, executor="ray"))
        assert results["status"] == "done" and results["versions"]["executor"] == "ray"
        assert numbers(out) == numbers(serial)
        assert checkpoints(out) == checkpoints(serial)
    finally:
        ray.shutdown()
    again = run_experiment(_cfg(), out, resume=True, progress=False)  # every run finished: all skipped
    assert numbers(out) == numbers(serial) and again["status"] == "done"
    assert cli.main(["report", str(out), "--out", str(tmp_path / "report.html")]) == 0


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_workers_exit_when_the_main_process_is_killed(tmp_path):
    """SIGKILL of `posenc study --jobs 2`'s main process (no cleanup runs) ends its workers too (issue 48, item 16)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posenc", "study", *LONG, "--jobs", "2", "--out", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not list((out / "state").glob("*.pt")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    workers = _descendants(proc.pid)
    assert len(workers) >= 2, workers  # the forkserver and its workers
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    alive = workers
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = {p for p in workers if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]}
    for p in alive:  # (leave nothing behind, whatever the result)
        os.kill(p, signal.SIGKILL)
    assert not alive


def test_resume_with_jobs_evaluates_a_run_trained_but_not_evaluated(serial, tmp_path):
    """A run killed after its final checkpoint and before its evaluation (results.json: ``trained``, no
    scores) is evaluated by ``--resume --jobs 2``, which then equals the serial study (issue 48, item 7:
    the worker never sent those evaluations back; the study stayed ``partial`` however often resumed)."""
    def unevaluated(results: dict) -> None:
        for name in ("alibi", "rope"):
            entry = results["methods"][name]
            entry.update(status="trained", eval=[])
            entry.pop("across_seeds", None)
        results["status"] = "running"

    out = _copy(serial, tmp_path / "run", unevaluated)
    assert cli.main(["study", "--out", str(out), "--resume", "--quiet", "--jobs", "2"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "done", {m: e["status"] for m, e in results["methods"].items()}
    assert numbers(out) == numbers(serial)


def test_executor_ray_without_ray_is_refused_before_the_study_folder_is_made(tmp_path, monkeypatch, capsys):
    """Refused before anything is written, so the same command runs once ray is installed (issue 48,
    item 21: the folder left behind then refused it as another study's)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # (import ray fails, find_spec finds nothing: as if not installed)
    out = tmp_path / "run"
    assert cli.main(["study", *ARGS, "--executor", "ray", "--out", str(out)]) == 2
    assert "pip install 'posenc[ray]'" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(UsageError, match="ray package"):
        run_experiment(_cfg(), out, progress=False, execution=Execution(executor="ray"))
    assert not out.exists()


def test_merge_refuses_a_part_without_its_checkpoints_or_at_other_threads(shards, tmp_path):
    """A part whose checkpoints were deleted, and parts run at different --threads, are refused before
    anything is written (issue 48, item 22: both were merged without a word)."""
    one, two, three = shards
    gone = _copy(two, tmp_path / "gone")
    deleted = sorted((gone / "checkpoints").glob("*.safetensors"))
    assert deleted
    deleted[0].unlink()
    with pytest.raises(UsageError, match=f"checkpoint .*{deleted[0].name} is missing"):
        merge([one, gone, three], tmp_path / "a")

    def threads(r):
        r["versions"]["torch_threads"] = 2

    other = _copy(two, tmp_path / "threads", threads)
    with pytest.raises(UsageError, match=r"different threads \(--threads\): 1 vs 2"):
        merge([one, other, three], tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    merge([one, two, three], tmp_path / "c", progress=False)  # (the parts as they ran: merged)
