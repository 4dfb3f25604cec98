"""``posenc show METHOD``: what an encoding adds to the attention scores, as a heatmap per head.

Every position carries the same content vector c, so whatever varies across the (query, key)
grid comes from the encoding alone. The map is

    score(i, j) with the encoding  -  score(i, j) of the same content without positions,

both in logits (``q . k / sqrt(head_dim)`` plus any bias). "The same content without positions" is
what the encoding's ``embed`` makes of the content alone, ``embed(c, i) - embed(0, i)``: the
sinusoidal method multiplies the token embeddings by sqrt(dim) before adding its table (Vaswani et
al. 2017, §3.4), so its baseline is the score of sqrt(dim) c, not of c; a learned table leaves c as
it is. No encoding is special-cased: the rule follows from the hooks. For bias methods the map is
the bias itself (T5's near-fine, far-coarse buckets, ALiBi's slopes); for rotary methods it is the
change in the score of identical content vectors at two positions; Transformer-XL's global content
term u . k_j is included (the encoding adds it), a constant per head that softmax ignores.
Learned methods are shown at their initialisation (``seed``).

Every bound below is checked before anything is allocated or computed, and every user mistake is a
:class:`~posenc.errors.UsageError` naming the parameter and the allowed range. (The module is longer
than most, ~380 lines, because each check sits next to what it guards and the figure next to the map
it draws; split, one command would be spread over several files.)
"""

from __future__ import annotations

import argparse
import inspect
import io
import math
import struct
import tempfile
import typing
from pathlib import Path

import torch
import torch.nn.functional as F

from .encodings import available, build, get_class
from .encodings.base import has_hook
from .errors import UsageError
from .files import atomic_write

# A panel is a few hundred pixels wide: past 4096 positions a pixel averages over more than ten.
MAX_LENGTH = 4096
# One (H, T, T) float32 map; score_map holds a few such tensors at once (Transformer-XL's
# per-distance scores are twice as wide), so the peak is a few times this. 8 heads x 4096^2 x 4 B.
MAX_MAP_BYTES = 512 * 2**20
MAX_DIM = 8192  # num_heads * head_dim; Transformer-XL allocates a dim x dim weight (256 MiB here)
MAX_HEAD_DIM = 1024  # RoPE's cos/sin cache is cache_length x head_dim/2, built in float64
MAX_PANELS = 32  # heads in one figure
MAX_PIXELS = 512  # cells per panel axis; a longer map is averaged in blocks first (a panel is ~320 px)
MAX_INT_OPTION = 2**16  # tables and caches some encodings allocate from an option (cache_length)
MAX_ENCODING_BYTES = 2**30  # parameters and buffers of the encoding
SOFTWARE = "posenc show"  # written in the PNG; only a file carrying it is ever overwritten
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CONTENT_SEED_KEY = 0x5EED_C0DE  # the content's seed is seed ^ this: another stream than the weights'


def check_int(name: str, value: object, low: int, high: int, why: str = "") -> int:
    """``value`` if it is an integer in [low, high], else a UsageError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{name} must be an integer in [{low}, {high}]{why}, got {value!r}")
    return value


def max_length(num_heads: int, max_positions: int | None = None) -> int:
    """Largest ``length`` show accepts for ``num_heads`` heads (and a table of ``max_positions``)."""
    by_memory = math.isqrt(MAX_MAP_BYTES // (4 * num_heads))
    return min(MAX_LENGTH, by_memory, max_positions or MAX_LENGTH)


def check_length(length: object, num_heads: int, max_positions: int | None = None, method: str = "the encoding") -> int:
    """``length`` if show can draw it: at most MAX_LENGTH, the memory bound for ``num_heads``, and the table."""
    by_memory = max_length(num_heads)
    limit = max_length(num_heads, max_positions)
    if max_positions is not None and limit == max_positions < by_memory:
        why = f" ({method}'s table has max_positions={max_positions} rows)"
    elif by_memory < MAX_LENGTH:
        why = f" for num_heads={num_heads} (num_heads x length^2 x 4 bytes of scores must fit in {MAX_MAP_BYTES >> 20} MiB)"
    else:
        why = " (a heatmap panel is a few hundred pixels wide)"
    return check_int("length", length, 1, limit, why)


def check_sizes(num_heads: object, head_dim: object) -> tuple[int, int]:
    num_heads = check_int("num_heads", num_heads, 1, MAX_DIM)
    head_dim = check_int("head_dim", head_dim, 1, MAX_HEAD_DIM)
    if num_heads * head_dim > MAX_DIM:
        raise UsageError(
            f"num_heads * head_dim (the model dim) must be at most {MAX_DIM}, got {num_heads} * {head_dim} = {num_heads * head_dim}"
        )
    return num_heads, head_dim


def check_heads(heads: object, num_heads: int) -> int:
    """Heads to draw: default min(8, num_heads); at most num_heads and MAX_PANELS."""
    if heads is None:
        return min(8, num_heads)
    why = f" (num_heads={num_heads})" if num_heads <= MAX_PANELS else f" (a figure shows at most {MAX_PANELS} heads)"
    return check_int("heads", heads, 1, min(num_heads, MAX_PANELS), why)


def check_seed(seed: object) -> int:
    """torch's seed range, [-2**63, 2**64 - 1]."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise UsageError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")
    return seed


def parse_options(pairs: list[str], method: str) -> dict:
    """``KEY=VALUE`` strings -> keyword options of ``method``, each cast to its constructor's type.

    The type comes from the constructor's annotation (``base: float``, ``layout: str``,
    ``rotary_dim: int | None``), so a value of the wrong type is a UsageError here, not a
    TypeError deep inside the encoding.
    """
    cls = get_class_checked(method)
    hints = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p not in ("self", "num_heads", "head_dim", "causal")]
    options: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"option must be KEY=VALUE (e.g. num_buckets=16), got {pair!r}")
        if key not in accepted:
            raise UsageError(f"unknown option {key!r} for {method}; accepted: {', '.join(accepted) or 'none'}")
        options[key] = _cast(key, text.strip(), hints.get(key, type(params[key].default)))
    return options


def _cast(key: str, text: str, hint: object) -> object:
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if len(kinds) < len(typing.get_args(hint)) and text.lower() == "none":
        return None
    kind = kinds[0]
    if kind is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise UsageError(f"option {key} must be true or false, got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"option {key} must be an integer, got {text!r}") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"option {key} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise UsageError(f"option {key} must be a finite number, got {text!r}")
        return value
    return text


def get_class_checked(method: str) -> type:
    if method not in available():
        raise UsageError(f"unknown encoding {method!r}; available: {', '.join(available())}")
    return get_class(method)


def build_checked(method: str, num_heads: int, head_dim: int, causal: bool, options: dict) -> torch.nn.Module:
    """Build on the meta device first (no memory) to measure it, then for real.

    The encodings reject bad sizes and option values with ValueError; every argument here came
    from the user, so those are usage errors.
    """
    get_class_checked(method)
    for key, value in options.items():  # some tables are built outside the meta device (RoPE's cache)
        if isinstance(value, int) and abs(value) > MAX_INT_OPTION:
            raise UsageError(f"option {key} must be at most {MAX_INT_OPTION} for show, got {value}")
    try:
        with torch.device("meta"):
            probe = build(method, num_heads=num_heads, head_dim=head_dim, causal=causal, **options)
        size = sum(t.numel() * t.element_size() for t in (*probe.parameters(), *probe.buffers()))
        if size > MAX_ENCODING_BYTES:
            raise UsageError(
                f"{method} with options {options or 'defaults'} would hold {size / 2**30:.1f} GiB of weights; "
                f"show allows at most {MAX_ENCODING_BYTES >> 30} GiB"
            )
        return build(method, num_heads=num_heads, head_dim=head_dim, causal=causal, **options)
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err)) from err


def check_out(out: Path) -> Path:
    """Where the PNG goes: a .png path that is not a folder, in a folder that exists or can be
    created and is writable. An existing file is replaced only if ``posenc show`` wrote it."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UsageError(f"out must be a file name ending in .png, got {str(out)!r}")
    if out.is_dir():
        raise UsageError(f"out is a folder: {str(out)!r}; give a file name ending in .png")
    if out.exists() and not _written_by_show(out):
        raise UsageError(f"out {str(out)!r} exists and was not written by posenc show; it is left alone (remove it or pick another name)")
    folder = out.parent.absolute()
    while not folder.exists():  # the nearest folder that exists must hold the new ones
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"out {str(out)!r} cannot be written: {str(folder)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(f"out {str(out)!r} cannot be written: no file can be created in {str(folder)!r} ({err.strerror})") from None
    return out


def _written_by_show(path: Path) -> bool:
    """True for a PNG whose tEXt ``Software`` chunk, placed before the image data, says posenc show."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != PNG_SIGNATURE:
                return False
            while len(head := f.read(8)) == 8:
                size, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND"):
                    return False
                data = f.read(size)
                f.read(4)  # CRC
                if kind == b"tEXt" and data.startswith(b"Software\x00" + SOFTWARE.encode()):
                    return True
    except OSError:
        return False
    return False


def score_map(encoding: torch.nn.Module, length: int, seed: int = 0, content: torch.Tensor | None = None) -> torch.Tensor:
    """(H, length, length) score change due to positions; NaN where a causal mask hides the key.

    Args:
        encoding: any encoding (hooks ``embed``, ``rotate``, ``bias``, ``query_terms``).
        length: positions on each axis.
        seed: draws the content vector when ``content`` is None.
        content: (H*D,) the content at every position (default: random, unit-variance features).
    Shape legend: H heads, T = length, D head dim.
    """
    h, d = encoding.num_heads, encoding.head_dim
    length = check_length(length, h, encoding.max_positions, getattr(encoding, "name", "the encoding"))
    if content is None:
        # Not `seed` itself: show seeds the initial weights with it, and a learned table's first row
        # would then be the content vector (scaled), drawing a false stripe at key 0.
        gen = torch.Generator().manual_seed(check_seed(seed) ^ CONTENT_SEED_KEY)
        content = torch.randn(h * d, generator=gen)
        content = content / content.norm() * math.sqrt(h * d)  # unit-variance features
    elif tuple(content.shape) != (h * d,):
        raise UsageError(f"content must have shape ({h * d},) = (num_heads * head_dim,), got {tuple(content.shape)}")
    positions = torch.arange(length)
    scale = 1.0 / math.sqrt(d)
    x = content.expand(1, length, h * d)  # (1, T, dim): the same content at every position
    with torch.no_grad():
        plain = x  # the content as the model sees it, without positions
        if has_hook(encoding, "embed"):
            embedded = encoding.embed(x, positions)
            # What the embedding makes of the content alone (e.g. sqrt(dim) c for sinusoidal).
            plain = embedded - encoding.embed(torch.zeros_like(x), positions)
            x = embedded
        plain = plain.reshape(1, length, h, d).transpose(1, 2)  # (1, H, T, D)
        q = k = x.reshape(1, length, h, d).transpose(1, 2)  # (1, H, T, D)
        if has_hook(encoding, "rotate"):
            q, k = encoding.rotate(q, k, positions, positions)
        scores = torch.matmul(q, k.transpose(-1, -2))[0].mul_(scale)  # (H, T, T)
        scores.sub_(torch.matmul(plain, plain.transpose(-1, -2))[0].mul_(scale))  # minus the score without positions
        if has_hook(encoding, "bias"):
            scores.add_(encoding.bias(positions, positions))
        if has_hook(encoding, "query_terms"):
            scores.add_(encoding.query_terms(q, k, positions, positions)[0])
    if encoding.causal:
        scores.masked_fill_(positions[None, :] > positions[:, None], float("nan"))
    return scores


def block_mean(scores: torch.Tensor, factor: int) -> torch.Tensor:
    """(N, T, T) -> (N, ceil(T/factor), ceil(T/factor)): mean of the visible (non-NaN) cells of each
    factor x factor block, NaN where a block is all masked. What a screen pixel would show."""
    if factor == 1:
        return scores
    pad = (-scores.shape[-1]) % factor
    visible = F.pad((~scores.isnan()).float(), (0, pad, 0, pad))  # (N, T + pad, T + pad)
    total = F.avg_pool2d(F.pad(scores.nan_to_num(0.0), (0, pad, 0, pad)), factor)
    count = F.avg_pool2d(visible, factor)  # same divisor as `total`: it cancels
    return torch.where(count > 0, total / count.clamp(min=1e-12), float("nan"))


def heatmap(scores: torch.Tensor, title: str, note: str):
    """A figure of (N, T, T) ``scores``: one panel per head, one colour scale shared by all panels,
    symmetric around 0 (red: position raises the score, blue: lowers it); NaN (masked) is hatched."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    heads, length = scores.shape[0], scores.shape[-1]
    factor = math.ceil(length / MAX_PIXELS)
    cells = block_mean(scores, factor)  # (N, T', T')
    drawn = cells.shape[-1] * factor - 0.5  # the last block may run past the last position: cropped below
    finite = scores[~scores.isnan()]
    vmax = float(finite.abs().max()) if finite.numel() else 0.0
    norm = Normalize(-vmax, vmax) if vmax > 0 else Normalize(-1.0, 1.0)  # all zero: white
    cmap = colormaps["RdBu_r"].with_extremes(bad=(0, 0, 0, 0))  # masked cells: transparent
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    if factor > 1:
        note += f"\neach cell is the mean of a {factor} x {factor} block of (query, key) pairs"
    lines = 2 + note.count("\n")  # of the title
    fig = Figure(figsize=(max(2.9 * cols + 1.4, 6.0), 2.9 * rows + 0.2 * lines + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)
    for idx, ax in enumerate(axes.flat):
        if idx >= heads:
            ax.axis("off")
            continue
        # Behind the image: hatching that shows through the transparent (masked) cells.
        ax.add_patch(Rectangle((-0.5, -0.5), length, length, facecolor="white", edgecolor="0.75", hatch="////", lw=0, zorder=0))
        im = ax.imshow(cells[idx].numpy(), cmap=cmap, norm=norm, interpolation="antialiased", extent=(-0.5, drawn, drawn, -0.5), zorder=1)
        ax.set_xlim(-0.5, length - 0.5)
        ax.set_ylim(length - 0.5, -0.5)
        values = scores[idx][~scores[idx].isnan()]  # the shared scale can wash out a weak head: say its range
        low, high = (0.0 if abs(v) <= 1e-5 * vmax else v for v in (float(values.min()), float(values.max())))  # float noise: 0
        ax.set_title(f"head {idx}: {low:.3g} to {high:.3g}", fontsize=9)
        if idx % cols == 0:
            ax.set_ylabel("query position i", fontsize=8)
        if idx + cols >= heads:
            ax.set_xlabel("key position j", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        ax.tick_params(labelsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="score change (logits)")
    fig.suptitle(f"{title}\n{note}", fontsize=9)
    return fig


def write_png(fig, out: Path) -> None:
    """Atomically (temporary name, then rename), tagged so a later run may replace it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": SOFTWARE})
    atomic_write(out, lambda p: p.write_bytes(buf.getvalue()))


def show(
    method: str, *, length: int = 64, num_heads: int = 8, head_dim: int = 64, heads: int | None = None,
    causal: bool = True, seed: int = 0, options: dict | None = None, out: Path | None = None,
) -> tuple[Path, torch.Tensor]:
    """Draw ``method``'s score map to ``out`` (default posenc-show-METHOD.png); returns (path, (N, T, T) drawn map)."""
    get_class_checked(method)
    num_heads, head_dim = check_sizes(num_heads, head_dim)
    shown = check_heads(heads, num_heads)
    check_length(length, num_heads)  # before the encoding exists; its own table is checked in score_map
    seed = check_seed(seed)
    out = check_out(Path(out) if out is not None else Path(f"posenc-show-{method}.png"))
    with torch.random.fork_rng(devices=[]):  # initial weights from `seed`, the caller's RNG untouched
        torch.manual_seed(seed)
        encoding = build_checked(method, num_heads, head_dim, causal, options or {})
    scores = score_map(encoding, length, seed)[:shown]
    mode = "causal" if causal else "bidirectional"
    title = f"{method} ({mode}): score change due to positions, {shown} of {num_heads} heads"
    note = (f"score with positions minus score of the same content without them (seed {seed})"
            "\nrows: query i, columns: key j")
    if causal:
        note += "; hatched: masked (key after query)"
    if not scores.nan_to_num().any():
        note += "\nzero everywhere: this encoding adds nothing to the scores"
    if any(True for _ in encoding.parameters()):
        note += f"\nlearned weights at initialisation (seed {seed}), not trained"
    write_png(heatmap(scores, title, note), out)
    return out, scores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("method", help=f"one of: {', '.join(available())}")
    parser.add_argument("--length", type=int, default=64, help=f"positions on each axis (default 64, at most {MAX_LENGTH})")
    parser.add_argument("--num-heads", type=int, default=8, help="heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    parser.add_argument("--heads", type=int, default=None, help=f"draw the first N heads (default min(8, num_heads), at most {MAX_PANELS})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="causal", action="store_true", help="decoder: keys after the query are masked (default)")
    mode.add_argument("--bidirectional", dest="causal", action="store_false", help="encoder: every pair")
    parser.set_defaults(causal=True)
    parser.add_argument("--seed", type=int, default=0, help="seed for the content vector and initial weights")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="encoding option, e.g. --option num_buckets=16 (repeatable)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default posenc-show-METHOD.png); an existing file is replaced only if posenc show wrote it")
    parser.add_argument("--scaling", default=None, metavar="JSON|FILE",
                        help="rope only: draw the wavelength of every pair, original vs this Hugging Face style scaling block "
                             "(JSON text, or a model's config.json), instead of the score map")


def show_scaling(method: str, scaling_text: str, head_dim: int, options: dict, out: Path | None) -> Path:
    """``posenc show rope --scaling ...``: the frequency picture of a RoPE scaling."""
    from .encodings.rope import RoPE
    from .rope_plot import scaling_figure, scaling_from_text

    get_class_checked(method)
    if not issubclass(get_class(method), RoPE):
        raise UsageError(f"scaling draws a RoPE scaling: method must be rope, got {method!r}")
    _, head_dim = check_sizes(1, head_dim)
    out = check_out(Path(out) if out is not None else Path(f"posenc-show-{method}-scaling.png"))
    scaling = scaling_from_text(scaling_text)
    try:
        fig = scaling_figure(scaling, head_dim, base=options.get("base"), rotary_dim=options.get("rotary_dim"))
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(f"scaling: {err}") from err
    write_png(fig, out)
    return out


def run(args: argparse.Namespace) -> int:
    options = parse_options(args.option, args.method)
    if args.scaling is not None:
        out = show_scaling(args.method, args.scaling, args.head_dim, options, args.out)
        print(f"{args.method}: wavelength per pair, original vs scaled -> {out}")
        return 0
    out, scores = show(args.method, length=args.length, num_heads=args.num_heads, head_dim=args.head_dim,
                       heads=args.heads, causal=args.causal, seed=args.seed, options=options, out=args.out)
    finite = scores[~scores.isnan()]
    print(f"{args.method}: {scores.shape[0]} of {args.num_heads} heads, length {args.length}, "
          f"score change in [{finite.min():.3f}, {finite.max():.3f}] -> {out}")
    return 0
