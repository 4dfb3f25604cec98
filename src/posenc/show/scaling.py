"""Figure of a RoPE scaling: the wavelength of every rotated pair, original vs scaled.

Pair k turns once every ``2 pi / theta_k`` positions. A pair whose wavelength is longer than the
training length never made a full turn in training; the scalings differ in which pairs they
stretch (all of them: linear; the slow ones: ntk, yarn, llama3; per pair: longrope) and p-RoPE
stops rotating the slowest. Built on ``matplotlib.figure.Figure`` directly (no pyplot state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure

from ..encodings.rope import RoPE
from ..encodings.rope_scaling import RopeScaling, parse_scaling
from ..errors import UsageError
from ..hf.rope_config import resolve_hf


def _wavelengths(inv_freq: torch.Tensor) -> list[float]:
    """2 pi / theta per pair; NaN for an unrotated pair (theta = 0), which has no wavelength."""
    return [2 * math.pi / f if f > 0 else math.nan for f in inv_freq.double().tolist()]


def _trained(cfg: RopeScaling) -> int:
    """L of a scaling whose frequencies depend on the length (``RopeScaling`` checks it names one)."""
    if cfg.original_length is None:
        raise UsageError(f"rope scaling: rope_type {cfg.rope_type!r} needs original_max_position_embeddings")
    return cfg.original_length


def scaling_figure(
    scaling: dict | RopeScaling | None,
    head_dim: int = 64,
    base: float | None = None,
    rotary_dim: int | None = None,
    length: int | None = None,
    original_length: int | None = None,
) -> Figure:
    """Wavelength per pair (log scale) of plain RoPE and of ``scaling``, the original length marked.

    Args:
        scaling: a Hugging Face style block, as for ``posenc.build("rope", scaling=...)``.
        head_dim, base, rotary_dim: as for the encoding.
        length: the current length for ``dynamic`` (default: factor x the original length).
        original_length: the training length to mark when the block does not name one (linear, ntk).
    """
    cfg = parse_scaling(scaling)
    enc = RoPE(1, head_dim, base=base, rotary_dim=rotary_dim, scaling=cfg, cache_length=1)
    plain = RoPE(1, head_dim, base=enc.base, rotary_dim=enc.rotary_dim, cache_length=1)
    pairs = list(range(enc.rotary_dim // 2))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(pairs, _wavelengths(plain.inv_freq), color="black", lw=1.5, label=f"original (base {enc.base:g})")

    original = cfg.original_length or original_length
    name = cfg.rope_type if cfg.factor is None else f"{cfg.rope_type} (factor {cfg.factor:g})"
    if cfg.rope_type == "longrope":
        trained = _trained(cfg)  # (= original)
        ax.plot(pairs, _wavelengths(enc.frequencies(trained)), marker=".", label=f"longrope short (length <= {trained})")
        ax.plot(pairs, _wavelengths(enc.frequencies(trained + 1)), marker=".", label=f"longrope long (length > {trained})")
    elif cfg.rope_type == "dynamic":
        at = length or math.ceil(cfg.scale * _trained(cfg))  # (scale: dynamic's factor, which it needs)
        ax.plot(pairs, _wavelengths(enc.frequencies(at)), marker=".", label=f"{name} at length {at}")
    elif cfg.rope_type != "default":
        ax.plot(pairs, _wavelengths(enc.inv_freq), marker=".", label=name)
    unrotated = [k for k, f in zip(pairs, enc.inv_freq.tolist()) if f == 0]
    if unrotated:
        ax.axvspan(unrotated[0] - 0.5, unrotated[-1] + 0.5, color="grey", alpha=0.2)
        ax.text(unrotated[0], 0.5, f"pairs {unrotated[0]}..{unrotated[-1]} not rotated (p-RoPE)",
                transform=ax.get_xaxis_transform(), fontsize=8)
    if original:
        ax.plot([pairs[0], pairs[-1]], [original, original], ls="--", color="grey", lw=1, label=f"original length {original}")
    ax.set_yscale("log")
    ax.set_xlabel("pair k (rotated features 2k, 2k+1 or k, k + r/2)")
    ax.set_ylabel("wavelength 2 pi / theta_k (positions)")
    ax.set_title(f"RoPE {cfg.rope_type}: wavelength per pair, head_dim {head_dim}, rotary_dim {enc.rotary_dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


CONFIG_KEYS = ("rope_scaling", "rope_parameters", "num_attention_heads", "hidden_size", "head_dim", "rope_theta",
               "max_position_embeddings", "partial_rotary_factor")


@dataclass(frozen=True)
class ScalingSource:
    """What ``--scaling`` names: a scaling block, and, from a whole config, its head dim, base and
    the key its block was read from (``note``, said in the command's output)."""

    scaling: dict
    head_dim: int | None = None
    base: float | None = None
    note: str = "the JSON block given"


def scaling_from_text(text: str, head_dim: int | None = None) -> ScalingSource:
    """``--scaling``'s value: JSON text (starting with ``{``) or the path of a JSON file. A bare
    block is used as it is; a whole model config (any of ``CONFIG_KEYS`` at its top level) is read by
    :func:`posenc.hf.rope_config.resolve_hf`, exactly as ``rope_from_hf`` reads it: its
    head dim (``head_dim``, or ``hidden_size / num_attention_heads``; ``head_dim`` fills in when the
    config has neither), ``rope_theta``, ``partial_rotary_factor`` and the block that
    ``transformers`` would read. UsageError otherwise.

    Raises:
        UsageError: ``text`` is neither a JSON object nor the path of a readable JSON file holding
            one.
    """
    import json
    from pathlib import Path


    example = '\'{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 2048}\''
    if text.lstrip().startswith("{"):
        source, raw = "its JSON text", text
    else:
        path = Path(text).expanduser()
        if not path.is_file():
            raise UsageError(f"scaling: no file {text!r} (give a JSON object such as {example}, or the path of a "
                             "model's config.json)")
        source = f"the file {text!r}"
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"scaling: cannot read {source}: {err}") from None
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise UsageError(f"scaling must be a JSON object or a JSON file (e.g. {example}); cannot read {source}: {err}") from None
    if not isinstance(data, dict):
        raise UsageError(f"scaling must be a JSON object, got {type(data).__name__}")
    if not any(key in data for key in CONFIG_KEYS):
        return ScalingSource(data)
    config = dict(data)
    if config.get("num_attention_heads") is None and config.get("head_dim") is None:
        config.update(num_attention_heads=1, head_dim=head_dim or 64)  # a config without sizes: --head-dim
        config.pop("hidden_size", None)
    resolved = resolve_hf(config)
    return ScalingSource(resolved.scaling, resolved.head_dim, resolved.base, resolved.which())


__all__ = ["ScalingSource", "scaling_figure", "scaling_from_text"]
