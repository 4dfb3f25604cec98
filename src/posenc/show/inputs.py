"""What ``posenc show`` accepts: every input checked before anything is allocated or computed.

Each user mistake is a :class:`~posenc.errors.UsageError` naming the parameter (library words,
``length``, not ``--length``) and the allowed range. The bounds keep one heatmap readable and its
memory sane: a panel is a few hundred pixels wide, and the score map is (H, T, T) float32.
"""

from __future__ import annotations

import inspect
import io
import math
import struct
import tempfile
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..encodings import available, build, get_class
from ..encodings.base import PositionalEncoding
from ..errors import UsageError, check_int
from ..files import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
    """``(num_heads, head_dim)``, checked before anything is built.

    Raises:
        UsageError: ``num_heads`` or ``head_dim`` is not an integer in its range (up to
            :data:`MAX_DIM`, :data:`MAX_HEAD_DIM`), or their product (the model dim) exceeds :data:`MAX_DIM`.
    """
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
    """torch's seed range, [-2**63, 2**64 - 1].

    Raises:
        UsageError: ``seed`` is not an integer in [-2**63, 2**64 - 1].
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise UsageError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")
    return seed


def parse_options(pairs: list[str], method: str) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> keyword options of ``method``, each cast to its constructor's type.

    The type comes from the constructor's annotation (``base: float``, ``layout: str``,
    ``rotary_dim: int | None``), so a value of the wrong type is a UsageError here, not a
    TypeError deep inside the encoding.

    Raises:
        UsageError: a pair is not ``KEY=VALUE``, or ``KEY`` is not an option of ``method`` (naming
            the accepted ones).
    """
    cls = get_class_checked(method)
    hints = typing.get_type_hints(cls.__init__)
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p not in ("self", "num_heads", "head_dim", "causal")]
    options: dict[str, Any] = {}
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


def get_class_checked(method: str) -> type[PositionalEncoding]:
    """The encoding class registered as ``method``.

    Raises:
        UsageError: no encoding is registered as ``method`` (listing the choices).
    """
    if method not in available():
        raise UsageError(f"unknown encoding {method!r}; available: {', '.join(available())}")
    return get_class(method)


def build_checked(method: str, num_heads: int, head_dim: int, causal: bool, options: dict[str, Any]) -> PositionalEncoding:
    """Build on the meta device first (no memory) to measure it, then for real.

    The encodings reject bad sizes and option values with ValueError; every argument here came
    from the user, so those are usage errors.

    Raises:
        UsageError: an integer option above :data:`MAX_INT_OPTION`, options whose weights would
            exceed :data:`MAX_ENCODING_BYTES`, or anything the encoding's constructor rejects.
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
    created and is writable. An existing file is replaced only if ``posenc show`` wrote it.

    Raises:
        UsageError: ``out`` does not end in ``.png``, is a folder, exists without posenc show's
            mark, or lies in a folder where no file can be created.
    """
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


def write_png(fig: Figure, out: Path) -> None:
    """Atomically (temporary name, then rename), tagged so a later run may replace it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": SOFTWARE})
    atomic_write(out, lambda p: p.write_bytes(buf.getvalue()))


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
