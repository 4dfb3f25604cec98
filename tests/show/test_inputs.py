"""Faults found by trying ``posenc show``, ``posenc list`` and ``posenc buckets`` as a new user would:
each is a UsageError with the exact message below, from the command line and from Python, and
nothing is computed, allocated or written before the check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import posenc
from posenc import cli
from posenc.errors import UsageError
from posenc.show import inputs as show_inputs
from posenc.show import scores as show_module
from posenc.show.describe import bucket_ranges, learnable_parameters
from posenc.show.inputs import check_out, parse_options
from posenc.show.scores import score_map, show


def fails(capsys, argv: list[str], message: str) -> None:
    """The command exits 2 and prints exactly one line: ``posenc CMD: error: MESSAGE``."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"posenc {argv[0]}: error: {message}\n"
    assert captured.out == ""


def raises(message: str):
    return pytest.raises(UsageError, match=f"^{re.escape(message)}$")


# ---- the sinusoidal picture ---------------------------------------------------------------------


def test_sinusoidal_change_is_the_position_term_not_the_embedding_scale(tmp_path, capsys) -> None:
    # Before: [2464.024, 5436.291], the sqrt(dim) scaling of the content counted as position.
    assert cli.main(["show", "sinusoidal", "--out", str(tmp_path / "s.png")]) == 0
    line = capsys.readouterr().out
    low, high = map(float, re.search(r"score change in \[(\S+), (\S+)\]", line).groups())
    assert -100 < low < 0 < high < 100  # +-(2 sqrt(dim) |c_h| |P_h| + |P_h|^2) / sqrt(D) ~ +-130 at most
    # The exact term is re-derived from the paper's table in tests/show/test_scores.py.


# ---- length past memory ---------------------------------------------------------------------------


def test_length_is_bounded_before_any_allocation(capsys) -> None:
    message = "length must be an integer in [1, 4096] (a heatmap panel is a few hundred pixels wide), got 100000"
    fails(capsys, ["show", "alibi", "--length", "100000"], message)
    with raises(message):
        score_map(posenc.build("alibi", num_heads=8, head_dim=8), 100000)
    # More heads, less length: 64 x 1448^2 x 4 bytes is the last map under 512 MiB.
    message = "length must be an integer in [1, 1448] for num_heads=64 (num_heads x length^2 x 4 bytes of scores must fit in 512 MiB), got 2000"
    fails(capsys, ["show", "alibi", "--num-heads", "64", "--head-dim", "8", "--length", "2000"], message)
    with raises(message):
        show("alibi", num_heads=64, head_dim=8, length=2000)
    fails(capsys, ["show", "rope", "--length", "0"], "length must be an integer in [1, 4096] (a heatmap panel is a few hundred pixels wide), got 0")
    message = "length must be an integer in [1, 16] (learned's table has max_positions=16 rows), got 40"
    fails(capsys, ["show", "learned", "--length", "40", "--option", "max_positions=16"], message)
    with raises(message):
        score_map(posenc.build("learned", num_heads=2, head_dim=4, max_positions=16), 40)


# ---- heads, num_heads, head_dim, seed ---------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--heads", "-1"], "heads must be an integer in [1, 8] (num_heads=8), got -1"),
    (["--heads", "0"], "heads must be an integer in [1, 8] (num_heads=8), got 0"),
    (["--heads", "9"], "heads must be an integer in [1, 8] (num_heads=8), got 9"),
    (["--num-heads", "64", "--head-dim", "8", "--heads", "40"], "heads must be an integer in [1, 32] (a figure shows at most 32 heads), got 40"),
    (["--num-heads", "0"], "num_heads must be an integer in [1, 8192], got 0"),
    (["--head-dim", "-3"], "head_dim must be an integer in [1, 1024], got -3"),
    (["--num-heads", "4096", "--head-dim", "1024"], "num_heads * head_dim (the model dim) must be at most 8192, got 4096 * 1024 = 4194304"),
    (["--seed", str(10**23)], f"seed must be an integer in [-2**63, 2**64 - 1], got {10**23}"),
])
def test_sizes(capsys, argv: list[str], message: str) -> None:
    fails(capsys, ["show", "t5", *argv], message)
    kwargs = {"--heads": "heads", "--num-heads": "num_heads", "--head-dim": "head_dim", "--seed": "seed"}
    call = {kwargs[flag]: int(value) for flag, value in zip(argv[::2], argv[1::2])}
    with raises(message):
        show("t5", **call)


def test_sizes_the_encoding_rejects_are_usage_errors(capsys) -> None:
    fails(capsys, ["show", "rope", "--head-dim", "7"], "rope needs an even head_dim, got 7")
    with raises("rope needs an even head_dim, got 7"):
        show("rope", head_dim=7)
    fails(capsys, ["show", "nosuch"], f"unknown encoding 'nosuch'; available: {', '.join(posenc.available())}")


# ---- the output path and --option --------------------------------------------------------------------


def test_out_that_is_a_folder(tmp_path, capsys) -> None:
    folder = tmp_path / "figure.png"
    folder.mkdir()
    message = f"out is a folder: {str(folder)!r}; give a file name ending in .png"
    fails(capsys, ["show", "alibi", "--out", str(folder)], message)
    with raises(message):
        check_out(folder)
    assert folder.is_dir() and not any(folder.iterdir())


def test_out_without_png_suffix(tmp_path, capsys) -> None:
    # Before: matplotlib appended ".png" to a name without a suffix and reported the wrong path,
    # and wrote a PDF for ".pdf".
    for name in ("adir", "plot.pdf"):
        message = f"out must be a file name ending in .png, got {str(tmp_path / name)!r}"
        fails(capsys, ["show", "alibi", "--out", str(tmp_path / name)], message)
    assert list(tmp_path.iterdir()) == []


def test_out_under_a_file(tmp_path, capsys) -> None:
    (tmp_path / "afile").write_text("hi")
    out = tmp_path / "afile" / "sub" / "x.png"
    message = f"out {str(out)!r} cannot be written: {str(tmp_path / 'afile')!r} is a file, not a folder"
    fails(capsys, ["show", "alibi", "--out", str(out)], message)
    with raises(message):
        check_out(out)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc, where no file can be created")
def test_out_in_an_unwritable_folder(capsys) -> None:
    out = Path("/proc/posenc-show.png")  # no file can be created there, even by root
    with pytest.raises(UsageError, match=r"^out '/proc/posenc-show.png' cannot be written: no file can be created in '/proc' \(.+\)$"):
        check_out(out)
    assert cli.main(["show", "alibi", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc show: error: out '/proc/posenc-show.png' cannot be written: no file can be created in '/proc' (")
    assert err.count("\n") == 1


def test_out_is_never_a_users_file(tmp_path, capsys) -> None:
    mine = tmp_path / "photo.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n not written by posenc")
    message = f"out {str(mine)!r} exists and was not written by posenc show; it is left alone (remove it or pick another name)"
    fails(capsys, ["show", "alibi", "--out", str(mine)], message)
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n not written by posenc"
    # A PNG that posenc show wrote is replaced by the next run.
    ours = tmp_path / "ours.png"
    assert cli.main(["show", "alibi", "--length", "4", "--out", str(ours)]) == 0
    first = ours.read_bytes()
    assert cli.main(["show", "alibi", "--length", "6", "--out", str(ours)]) == 0
    assert ours.read_bytes() != first
    capsys.readouterr()


def test_png_is_written_atomically(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "a.png"
    assert cli.main(["show", "alibi", "--length", "4", "--out", str(out)]) == 0
    before = out.read_bytes()

    def broken(path: Path) -> None:  # the disk fills up after part of the new file is out
        path.write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    real = show_inputs.atomic_write
    monkeypatch.setattr(show_inputs, "atomic_write", lambda path, write: real(path, broken))
    # A full disk is reported as one sentence the user can act on (posenc.files.WriteError).
    assert cli.main(["show", "alibi", "--length", "8", "--out", str(out)]) == 2
    assert f"posenc show: error: cannot write {out}: No space left on device; the previous version is unchanged" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]  # no temporary left behind
    capsys.readouterr()


@pytest.mark.parametrize("method,option,message", [
    ("rope", "layout", "option must be KEY=VALUE (e.g. num_buckets=16), got 'layout'"),
    ("rope", "=5", "option must be KEY=VALUE (e.g. num_buckets=16), got '=5'"),
    ("alibi", "foo=1", "unknown option 'foo' for alibi; accepted: none"),
    ("t5", "num_bucket=16", "unknown option 'num_bucket' for t5; accepted: num_buckets, max_distance"),
    ("rope", "base=abc", "option base must be a number, got 'abc'"),
    ("rope", "base=nan", "option base must be a finite number, got 'nan'"),
    ("t5", "num_buckets=1.5", "option num_buckets must be an integer, got '1.5'"),
    ("sinusoidal", "scale_embeddings=maybe", "option scale_embeddings must be true or false, got 'maybe'"),
])
def test_option_syntax_and_types(capsys, method: str, option: str, message: str) -> None:
    fails(capsys, ["show", method, "--option", option], message)
    with raises(message):
        parse_options([option], method)


@pytest.mark.parametrize("method,option,head_dim,message", [
    ("rope", "layout=neox", 64, "layout must be one of ('half', 'interleaved'), got 'neox'"),
    ("t5", "num_buckets=1", 64, "num_buckets must be >= 2 (causal), got 1"),
    # Before: tracebacks after trying to allocate 2 TB and 8 GB.
    ("learned", "max_positions=1000000000", 64, "option max_positions must be at most 65536 for show, got 1000000000"),
    ("rope", "cache_length=1000000000", 64, "option cache_length must be at most 65536 for show, got 1000000000"),
    ("learned", "max_positions=65536", 1024, "learned with options {'max_positions': 65536} would hold 2.0 GiB of weights; "
                                                 "show allows at most 1 GiB"),
])
def test_option_values(capsys, method: str, option: str, head_dim: int, message: str) -> None:
    fails(capsys, ["show", method, "--head-dim", str(head_dim), "--option", option], message)
    with raises(message):
        show(method, head_dim=head_dim, options=parse_options([option], method))


def test_parsed_options_take_the_constructor_types() -> None:
    got = parse_options(["base=500", "layout=interleaved", "rotary_dim=none"], "rope")
    assert got == {"base": 500.0, "layout": "interleaved", "rotary_dim": None}
    assert parse_options(["rotary_dim=8"], "rope") == {"rotary_dim": 8}
    assert parse_options(["scale_embeddings=false"], "sinusoidal") == {"scale_embeddings": False}
    assert isinstance(parse_options(["base=500"], "rope")["base"], float)


# ---- list and buckets -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--num-heads", "0"], "num_heads must be an integer in [1, 4096], got 0"),
    (["--head-dim", "0"], "head_dim must be an integer in [1, 4096], got 0"),
    (["--num-heads", "100000", "--head-dim", "1000"], "num_heads must be an integer in [1, 4096], got 100000"),
])
def test_list_sizes(capsys, argv: list[str], message: str) -> None:
    fails(capsys, ["list", *argv], message)
    sizes = {"num_heads": 8, "head_dim": 64}
    sizes.update({flag[2:].replace("-", "_"): int(v) for flag, v in zip(argv[::2], argv[1::2])})
    with raises(message):
        learnable_parameters("t5", **sizes)


def test_list_a_method_that_cannot_take_the_sizes_does_not_hide_the_others(capsys) -> None:
    # Before: `posenc list --head-dim 7` failed as a whole on rope's even-head-dim rule.
    assert cli.main(["list", "--head-dim", "7"]) == 0
    out = capsys.readouterr().out
    assert "learnable parameters: n/a at num_heads=8, head_dim=7 (rope needs an even head_dim, got 7)" in out
    assert "learnable parameters: 57,344 (table 1024x56; shared by all layers)" in out  # learned still listed
    # Huge sizes are counted on the meta device, without allocating (TXL's W_R alone: 4096^4 floats).
    assert learnable_parameters("transformer_xl", 4096, 4096).startswith("281,475,010,265,088 ")


@pytest.mark.parametrize("argv,message", [
    (["--num-buckets", "1"], "num_buckets must be an integer in [2, 4096] (causal: an exact and a log bucket), got 1"),
    (["--num-buckets", "0"], "num_buckets must be an integer in [2, 4096] (causal: an exact and a log bucket), got 0"),
    (["--num-buckets", "3", "--bidirectional"],
     "num_buckets must be an integer in [4, 4096] (bidirectional: an exact and a log bucket on each side), got 3"),
    (["--max-distance", "0"], "max_distance must be an integer in [17, 1048576] (beyond the 16 exact distances of num_buckets=32), got 0"),
    (["--max-distance", "-5"], "max_distance must be an integer in [17, 1048576] (beyond the 16 exact distances of num_buckets=32), got -5"),
    (["--max-distance", "10"], "max_distance must be an integer in [17, 1048576] (beyond the 16 exact distances of num_buckets=32), got 10"),
    (["--max-distance", "1000000000"],
     "max_distance must be an integer in [17, 1048576] (beyond the 16 exact distances of num_buckets=32), got 1000000000"),
    (["--max-distance", "8", "--bidirectional"],
     "max_distance must be an integer in [9, 1048576] (beyond the 8 exact distances of num_buckets=32), got 8"),
])
def test_bucket_sizes(capsys, argv: list[str], message: str) -> None:
    fails(capsys, ["buckets", *argv], message)
    args = {"num_buckets": 32, "max_distance": 128, "bidirectional": "--bidirectional" in argv}
    args.update({flag[2:].replace("-", "_"): int(v) for flag, v in zip(argv[::2], argv[1::2]) if flag != "--bidirectional"})
    with raises(message):
        bucket_ranges(**args)


def test_bucket_table_at_the_largest_max_distance_is_quick() -> None:
    rows = bucket_ranges(4096, 2**20, bidirectional=True)  # one pass over the distances, not one per bucket
    assert len(rows) == 4096 and rows[2047][1] is None and rows[2047][3] == "last" and rows[-1][2] is None


# ---- the picture ------------------------------------------------------------------------------------


def test_masked_cells_render_blank_and_the_scale_is_centred(tmp_path) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    scores = torch.full((2, 20, 20), 1.0)
    scores[1] = -0.25  # a weak negative head: on the shared scale it is pale blue, not dark red
    scores.masked_fill_(torch.ones(20, 20, dtype=torch.bool).triu(1), float("nan"))
    fig = show_module.heatmap(scores, "t", "n")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)  # (height, width, 3), row 0 at the top
    height = pixels.shape[0]

    def at(ax, i: float, j: float) -> np.ndarray:  # the pixel of query i, key j
        x, y = ax.transData.transform((j, i))
        return pixels[int(height - y), int(x)]

    panels = [ax for ax in fig.axes if ax.images]
    strong, weak = at(panels[0], 17, 2), at(panels[1], 17, 2)
    assert strong[0] > 100 and strong[2] < 80  # +1, the top of the scale: dark red
    assert weak[2] > weak[0] and weak.min() > 150  # -0.25: pale blue
    for ax in panels:
        masked = at(ax, 2, 17)
        assert abs(masked[0] - masked[2]) < 10 and masked.min() > 150  # white or the grey hatching, no colour


# ---- nothing is computed before the checks ------------------------------------------------------------


def test_checks_come_before_building_or_computing(tmp_path, monkeypatch, capsys) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("computed before the arguments were checked")

    monkeypatch.setattr(show_inputs, "build", boom)
    monkeypatch.setattr(show_module, "score_map", boom)
    (tmp_path / "user.png").write_text("mine")
    for argv in (["--length", "100000"], ["--heads", "-1"], ["--out", str(tmp_path / "user.png")], ["--out", str(tmp_path)]):
        assert cli.main(["show", "alibi", *argv]) == 2
    assert capsys.readouterr().err.count("\n") == 4


@pytest.mark.parametrize("num_buckets,max_distance,bidirectional", [(32, 128, False), (32, 128, True), (33, 20, True), (7, 40, False), (4, 3, True)])
def test_bucket_table_matches_a_scan_of_every_distance(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    # The one-pass table against a plain scan, bucket by bucket; each bucket is one interval of r,
    # so the printed count hi - lo + 1 is the number of distances in it.
    span = 2 * max_distance + 2
    r = torch.arange(-span, span + 1)
    b = posenc.relative_position_bucket(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    for bucket, lo, hi, kind in bucket_ranges(num_buckets, max_distance, bidirectional):
        hit = r[b == bucket]
        if kind == "unused":
            assert hit.numel() == 0
            continue
        assert (lo is None) == (int(hit.min()) == -span) and (hi is None) == (int(hit.max()) == span)
        assert lo is None or lo == int(hit.min())
        assert hi is None or hi == int(hit.max())
        assert hit.numel() == int(hit.max()) - int(hit.min()) + 1  # contiguous
