"""A tiny study from the command line, for the tests of the study's refusals: its arguments, the
call, and the one error line a refusal prints."""

from __future__ import annotations

from pathlib import Path

from posenc import cli

ARGS = ["--preset", "smoke", "--steps", "4", "--checkpoint-every", "2", "--eval-lengths", "32",
        "--valid-bytes", "512", "--threads", "1", "--dim", "16", "--depth", "1", "--num-heads", "2", "--batch-size", "2"]


def study(out: Path, *extra: str) -> int:
    return cli.main(["study", *ARGS, "--out", str(out), "--quiet", *extra])


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1].rstrip("\n")
