"""The core commands: ``posenc list``, ``posenc buckets``, ``posenc show``; errors are one line, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import posenc
from posenc import cli
from posenc.show.scores import score_map


def test_list_names_every_method(capsys) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    blocks = {}
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.strip() in posenc.available():
            current = line.strip()
            blocks[current] = []
        elif line.startswith("    ") and blocks:
            blocks[current].append(line.strip())
    assert list(blocks) == posenc.available()
    for name, lines in blocks.items():
        assert len(lines) == 3, f"{name}: description, parameters, extrapolation"
        assert lines[1].startswith("learnable parameters: ")
        assert lines[2].startswith("runs past its training length: ")
    assert blocks["learned"][2].endswith("no (bounded by its table)")
    assert blocks["alibi"][2].endswith("yes")
    assert blocks["alibi"][1].endswith("none")
    # Parameter counts for the default 8 heads x 64: T5's table is 32 buckets x 8 heads.
    assert blocks["t5"][1].startswith("learnable parameters: 256 ")
    assert blocks["shaw"][1].startswith(f"learnable parameters: {2 * 33 * 64:,} ")


def test_buckets_bidirectional(capsys) -> None:
    assert cli.main(["buckets", "--bidirectional"]) == 0
    out = capsys.readouterr().out
    assert "bidirectional" in out.splitlines()[0]
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(32))
    by_bucket = {int(r[0]): r for r in rows}
    assert by_bucket[0][1:3] == ["0", "0"]  # r = 0, the query itself
    assert by_bucket[15][1:3] == ["-inf", "-91"] and by_bucket[15][-1] == "last"
    assert by_bucket[17][1:3] == ["1", "1"] and by_bucket[31][2] == "+inf"
    assert by_bucket[16][-1] == "unused"  # r > 0 starts at distance 1: bucket 16 is never used (as in T5)


def test_buckets_bad_arguments_are_one_line(capsys) -> None:
    assert cli.main(["buckets", "--max-distance", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("posenc buckets: error: max_distance")


def test_show_t5_writes_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "tmp.png"
    assert cli.main(["show", "t5", "--length", "24", "--num-heads", "4", "--out", str(out)]) == 0
    assert out.exists() and out.stat().st_size > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in capsys.readouterr().out


def test_show_unknown_method_exits_2_with_one_line(capsys) -> None:
    assert cli.main(["show", "nosuch"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("posenc show: error: unknown encoding 'nosuch'; available: ")
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("argv,message", [
    (["show", "learned", "--length", "40", "--option", "max_positions=16"], "max_positions=16"),
    (["show", "alibi", "--option", "foo=1"], "unknown option"),
    (["show", "rope", "--option", "layout"], "KEY=VALUE"),
    (["show", "rope", "--length", "0"], ": length must be an integer in [1, 4096]"),  # the library word, not the flag
])
def test_show_bad_arguments(capsys, argv, message) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_only_usage_errors_are_one_line(monkeypatch, capsys) -> None:
    from posenc.study import report

    def user_mistake(args):
        raise posenc.UsageError("run_dir 'x' holds no results.json")

    def bug(args):
        raise ValueError("an internal inconsistency")

    monkeypatch.setattr(report, "run_report", user_mistake)
    assert cli.main(["report", "x"]) == 2
    assert capsys.readouterr().err == "posenc report: error: run_dir 'x' holds no results.json\n"
    monkeypatch.setattr(report, "run_report", bug)
    with pytest.raises(ValueError, match="an internal inconsistency"):  # a bug keeps its traceback
        cli.main(["report", "x"])


def test_console_entry_point_exit_code() -> None:
    proc = subprocess.run([sys.executable, "-m", "posenc", "show", "nosuch"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown encoding" in proc.stderr


# ---- what `show` plots ------------------------------------------------------------------------------


def test_show_map_of_bias_methods_is_the_bias() -> None:
    for causal in (True, False):
        enc = posenc.build("alibi", num_heads=4, head_dim=16, causal=causal)
        pos = torch.arange(12)
        scores = score_map(enc, 12)
        bias = enc.bias(pos, pos)
        visible = ~scores.isnan()
        if causal:
            assert torch.equal(visible[0], pos[None, :] <= pos[:, None])
        else:
            assert visible.all()
        torch.testing.assert_close(scores[visible], bias[visible], rtol=0, atol=1e-5)


def test_show_map_of_rope_depends_on_distance_only() -> None:
    enc = posenc.build("rope", num_heads=2, head_dim=16, causal=False)
    scores = score_map(enc, 20)  # (H, T, T)
    torch.testing.assert_close(scores[:, 1:, 1:], scores[:, :-1, :-1], rtol=0, atol=1e-5)  # constant along diagonals
    torch.testing.assert_close(scores.diagonal(dim1=-2, dim2=-1), torch.zeros(2, 20), rtol=0, atol=1e-5)  # i = j: no change
    assert scores.abs().max() > 0.1


def test_show_map_of_nope_is_zero() -> None:
    scores = score_map(posenc.build("nope", num_heads=2, head_dim=8, causal=False), 10)
    torch.testing.assert_close(scores, torch.zeros(2, 10, 10), rtol=0, atol=1e-5)
