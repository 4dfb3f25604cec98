"""``torchrun --nproc_per_node=2 -m posenc study`` on CPU (gloo): the same numbers as one process,
files written once, a clean exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posenc import cli

ARGS = ["study", "--preset", "smoke", "--methods", "alibi", "learned", "--steps", "6", "--batch-size", "8",
        "--eval-lengths", "32", "64", "--valid-bytes", "1024", "--device", "cpu", "--quiet"]


def test_two_processes_match_one(tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert cli.main([*ARGS, "--threads", "1", "--out", str(single)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "posenc", *ARGS, "--out", str(ddp)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr  # the clean-exit sequence of posenc.study.distributed.finish
    assert proc.stdout.count("| method |") == 1  # only rank 0 prints (and writes)
    one = json.loads((single / "results.json").read_text())
    two = json.loads((ddp / "results.json").read_text())
    assert two["versions"]["world_size"] == 2 and one["versions"]["world_size"] == 1
    assert two["config"] == one["config"] and two["corpus"] == one["corpus"]
    for method in ("alibi", "learned"):
        a, b = one["methods"][method], two["methods"][method]
        assert b["train"]["losses"] == pytest.approx(a["train"]["losses"], rel=1e-4)
        for ra, rb in zip(a["eval"], b["eval"], strict=True):
            assert rb["length"] == ra["length"] and rb["tokens"] == ra["tokens"] == 1024
            if ra["perplexity"] is None:
                assert rb["perplexity"] is None and rb["status"] == ra["status"]
            else:
                assert rb["perplexity"] == pytest.approx(ra["perplexity"], rel=1e-4)
    assert (ddp / "checkpoints" / "alibi.safetensors").is_file() and (ddp / "extrapolation.png").is_file()


def test_batch_must_split_evenly_across_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "posenc", *ARGS, "--batch-size", "7", "--out", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "must be divisible by the number of processes" in proc.stderr
    assert not (tmp_path / "run").exists()
