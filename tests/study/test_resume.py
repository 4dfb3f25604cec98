"""Interrupt a study (an exception after step k, SIGINT, SIGKILL), ``--resume`` it, and get exactly
the numbers of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc import cli
from posenc.study.cli import run_study


def study(argv: list[str], on_step=None) -> int:
    """``posenc study ARGV`` with a step callback, as the command line runs it."""
    return run_study(cli.build_parser().parse_args(["study", *argv]), on_step=on_step)


ARGS = ["--preset", "smoke", "--methods", "t5", "rope", "--steps", "12", "--checkpoint-every", "4",
        "--eval-lengths", "32", "64", "--quiet", "--threads", "1"]


def numbers(out: Path) -> dict:
    """What must not depend on interruptions: per method, the loss curve and the evaluation."""
    results = json.loads((out / "results.json").read_text())
    return {
        m: {"losses": e["train"]["losses"], "eval": [(r["length"], r["loss"], r["perplexity"]) for r in e["eval"]]}
        for m, e in results["methods"].items()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert cli.main(["study", *ARGS, "--out", str(out)]) == 0
    return numbers(out)


def test_exception_mid_training_then_resume_gives_the_same_numbers(tmp_path, reference):
    out = tmp_path / "run"

    def interrupt(method, step):
        if method == "rope" and step == 10:
            raise KeyboardInterrupt

    assert study([*ARGS, "--out", str(out)], on_step=interrupt) == 130
    partial = json.loads((out / "results.json").read_text())
    assert partial["methods"]["t5"]["status"] == "done" and "rope" not in partial["methods"]
    state = torch.load(out / "state" / "rope.pt", weights_only=True)
    assert state["step"] == 8 and len(state["losses"]) == 8  # the last periodic checkpoint
    assert (out / "checkpoints" / "t5.safetensors").is_file()

    stepped = []
    assert study([*ARGS, "--out", str(out), "--resume"], on_step=lambda method, step: stepped.append((method, step))) == 0
    assert stepped == [("rope", k) for k in range(9, 13)]  # t5 skipped, rope continued from step 8
    assert numbers(out) == reference
    assert not (out / "state").exists()


SCRIPT = """
import sys, time
from posenc.cli import build_parser
from posenc.study.cli import run_study
slow = lambda method, step: time.sleep(0.15) if method == "rope" else None  # catchable mid-training
raise SystemExit(run_study(build_parser().parse_args(sys.argv[1:]), on_step=slow))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_signal_mid_training_then_resume_gives_the_same_numbers(tmp_path, reference, sig):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "study", *ARGS, "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    target = out / "state" / "rope.pt"  # the second method has a checkpoint: kill it mid-way
    deadline = time.time() + 150
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert target.exists(), proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:  # finishes the step, checkpoints it, says how to continue
        assert proc.returncode == 130 and "--resume" in err, err
        assert torch.load(target, weights_only=True)["step"] >= 4
    else:
        assert proc.returncode == -signal.SIGKILL
    json.loads((out / "results.json").read_text())  # never half-written
    assert cli.main(["study", *ARGS, "--out", str(out), "--resume"]) == 0
    assert numbers(out) == reference
