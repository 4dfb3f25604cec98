"""``posenc extend`` for a transformers causal LM with RoPE (:func:`posenc.extend.extend.extend`).

The checkpoint is a folder ``save_pretrained`` wrote (``config.json`` and the weights; a plain
transformers model, or one saved after ``posenc.hf.use(model, "rope")``; one saved after ``use`` with
another encoding, options or a schedule is refused: it does not run its own RoPE), a GGUF file or a folder
holding one (read by :func:`posenc.hf.load_pretrained`, dequantized to float32), or the model itself. The
job is the one :mod:`.extend` runs on posenc's own models, with the same blocks, training loop,
batches and table; what differs is only how the model is changed:

- **base**: the model as loaded, untouched (its own attention and rotary module).
- **a scaling**: a copy after ``posenc.hf.use(copy, "rope", base=..., scaling=block)``: posenc's
  RoPE with the model's base, rotated features and pair layout (the family's row in
  :data:`posenc.hf.families.FAMILIES`), under the block.
- **a remap** (a zero-shot column): a copy after ``posenc.hf.use(copy, NAME, **options)``, which
  keeps each layer's own RoPE base and scaling.
- **DroPE**: a copy after ``posenc.hf.use(copy, "nope")`` (the recalibration starts from the model's
  own RoPE, dropped at step 0).
- **saved**: ``OUT/model/``. A scaling transformers has (``linear``, ``yarn``, ``llama3``,
  ``longrope``) is written by :func:`posenc.hf.export`: a plain transformers checkpoint whose
  config.json carries the block as ``rope_parameters``, loaded by
  ``AutoModelForCausalLM.from_pretrained`` without posenc. posenc's static ``ntk`` and DroPE have no
  transformers form: ``save_pretrained`` after ``use``, loaded with
  ``posenc.hf.from_pretrained(AutoModelForCausalLM, OUT/model)``. ``extend.json``'s ``saved``
  says which (``format``: ``transformers`` or ``posenc.hf``).

Tokens: a checkpoint that brings its tokenizer (a GGUF file; a folder with tokenizer files) has the
data and the table in that tokenizer's ids (:func:`posenc.study.data.tokenized`), which is saved
with the result in ``OUT/model/``. Otherwise tokens are bytes, as in the study (token id = byte
value), and the model's vocabulary must cover the 256 byte values (a model passed in memory is
always fed bytes). ``train_length`` defaults to the config's ``max_position_embeddings``.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from .. import hf as posenc_hf
from ..encodings.rope import RoPE
from ..errors import UsageError
from ..hf.checkpoints import load_pretrained, read_config
from ..hf.families import text_config
from ..study.data import Corpus, tokenized
from ..study.hf_models import StudyModel, StudyModelConfig
from ..study.studied import StudiedModel
from ..study.variants import encodings
from .extend_config import ExtendConfig

FOLDER = "model"


def load(path: str | Path, device: str = "cpu") -> PreTrainedModel:
    """The causal LM in ``path`` (float32; a folder, a GGUF file or a folder holding one), posenc's
    encoding restored if it has one. :func:`posenc.hf.load_pretrained` gives its tokenizer too."""
    return load_pretrained(path, dtype=torch.float32, device=device)[0]


def train_length_of(path: str | Path) -> int | None:
    """The default training length of the model in ``path``: its ``max_position_embeddings`` (a GGUF
    file's context length, read from its metadata without its weights).

    Raises:
        UsageError: the folder's ``config.json`` is not JSON or not one object.
    """
    p = Path(path)
    if p.is_dir() and not (p / "config.json").is_file():
        p = next(iter(sorted(p.glob("*.gguf"))), p)  # a folder holding a GGUF file
    if p.is_file() and p.suffix.lower() == ".gguf":
        try:
            config = transformers.AutoConfig.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
        except Exception:  # (no gguf package, an unreadable file: load() reports it)
            return None
        n = getattr(text_config(config), "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and n > 0 else None
    if not (p / "config.json").is_file():
        return None
    values = read_config(p)  # (a corrupt config.json: named now, before anything else asks for a length)
    inner = values.get("text_config") or values
    n = inner.get("max_position_embeddings") if isinstance(inner, dict) else None
    return int(n) if isinstance(n, int) and n > 0 else None


class HFCheckpoint:
    """:class:`posenc.extend.checkpoint_kinds.Checkpoint` for a transformers model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, source: str, tokenizer: Any = None) -> None:
        self.model = model  # (never changed: every scaled or trained model is a copy)
        self.source = source
        self.tokenizer = tokenizer  # None: byte tokens
        inner = text_config(model.config)
        if tokenizer is not None and len(tokenizer) > int(getattr(inner, "vocab_size", 0) or 0):
            raise UsageError(f"checkpoint: its tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size "
                             f"{getattr(inner, 'vocab_size', None)}")
        if tokenizer is None and int(getattr(inner, "vocab_size", 0) or 0) < 256:
            raise UsageError(f"checkpoint: posenc extend's tokens are bytes; the model's vocab_size must be >= 256, got "
                             f"{getattr(inner, 'vocab_size', None)}")
        installed = getattr(self.model.config, "posenc", None)
        if isinstance(installed, dict) and not installed.get("from_config"):
            # The base column would score posenc's encoding, the extended ones the config's own RoPE.
            what = installed.get("schedule") or installed.get("encoding")
            options = installed.get("options") or {}
            raise UsageError(f"checkpoint: it runs posenc's {what!r}{f' with {options}' if options else ''} "
                             "(config.posenc, from posenc.hf.use), not its own RoPE; posenc extend extends the "
                             "model's own RoPE (its config's rope_parameters), so its base column and its extended "
                             "columns would score different models. Extend the model as it was before posenc.hf.use "
                             "(or after posenc.hf.use(model, 'rope'), which keeps its own RoPE)")
        own = posenc_hf.use(copy.deepcopy(self.model), "rope")  # the model's own RoPE, read and verified
        ropes = [e for e in encodings(own) if isinstance(e, RoPE)]
        if not ropes or len(ropes) != len(encodings(own)):
            raise UsageError(f"checkpoint: posenc extend needs a model with RoPE on every layer; {inner.model_type} has "
                             "NoPE layers or another encoding")
        kinds = {(e.base, e.rotary_dim, e.scaling.rope_type) for e in ropes}
        if len(kinds) > 1:
            raise UsageError(f"checkpoint: its layers' RoPE differ ({sorted(kinds)}); posenc extend scales one RoPE")
        self.rope = ropes[0]
        if self.rope.scaling.rope_type != "default":
            raise UsageError(f"checkpoint: its RoPE already has a {self.rope.scaling.rope_type!r} scaling; extend a "
                             "model trained without one")
        self.record = StudyModelConfig(
            hf_model_type=str(inner.model_type), hf_config_sha256=hashlib.sha256(
                self.model.config.to_json_string().encode()).hexdigest(),
            attention="hf", encoding=None, encoding_options={}, num_heads=int(inner.num_attention_heads),
            num_kv_heads=int(getattr(inner, "num_key_value_heads", None) or inner.num_attention_heads),
            head_dim=self.rope.head_dim, hidden_size=int(inner.hidden_size), depth=int(inner.num_hidden_layers),
            vocab_size=int(inner.vocab_size))
        self.base: StudiedModel = StudyModel(self.model, self.record)

    @classmethod
    def of(cls, checkpoint: str | Path | nn.Module, device: str = "cpu") -> HFCheckpoint:
        if isinstance(checkpoint, PreTrainedModel):
            name = f"{type(checkpoint).__name__} (in memory, config sha256 " \
                   f"{hashlib.sha256(checkpoint.config.to_json_string().encode()).hexdigest()[:16]})"
            nn.Module.to(checkpoint, torch.device(device))
            return cls(checkpoint, name)
        if isinstance(checkpoint, nn.Module):
            raise UsageError(f"checkpoint: a transformers PreTrainedModel, got {type(checkpoint).__name__}")
        model, tokenizer = load_pretrained(checkpoint, dtype=torch.float32, device=device)
        return cls(model, str(checkpoint), tokenizer)

    def corpus(self, corpus: Corpus) -> Corpus:
        """The data in the checkpoint's own tokens (its tokenizer's ids), or bytes when it has none."""
        if self.tokenizer is None:
            return corpus
        return tokenized(corpus, self.tokenizer, str(getattr(self.tokenizer, "name_or_path", "") or self.source))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def check(self, cfg: ExtendConfig) -> None:
        if cfg.pack_documents:
            raise UsageError("pack_documents: posenc extend of a transformers model trains on plain windows; leave it out")

    def _wrapped(self, model: PreTrainedModel, block: dict[str, Any] | None) -> StudyModel:
        if block is None:
            return StudyModel(model, StudyModelConfig(**{**self.record.to_dict(), "attention": "posenc", "encoding": "nope"}))
        return StudyModel(model, StudyModelConfig(**{**self.record.to_dict(), "attention": "posenc", "encoding": "rope",
                                                     "encoding_options": {"base": self.rope.base}, "scaling": block}))

    def scaled(self, block: dict[str, Any] | None) -> StudiedModel:
        """A copy of the model under ``block`` (None: its positions dropped)."""
        model = copy.deepcopy(self.model)
        if block is None:
            return self._wrapped(posenc_hf.use(model, "nope"), None)
        return self._wrapped(posenc_hf.use(model, "rope", base=self.rope.base, scaling=block), block)

    def remapped(self, remap: dict[str, Any]) -> StudiedModel:
        """A copy of the model after ``posenc.hf.use(copy, NAME, **options)``: the remap of each layer's
        own RoPE (its base and scaling kept)."""
        model = posenc_hf.use(copy.deepcopy(self.model), remap["name"], **remap["options"])
        return StudyModel(model, StudyModelConfig(**{**self.record.to_dict(), "attention": "posenc", "encoding": remap["name"],
                                                     "encoding_options": dict(remap["options"])}))

    def trainable(self, block: dict[str, Any] | None) -> StudiedModel:
        """The model the fine-tune starts from: scaled, or (DroPE) the model's own RoPE, dropped at step 0."""
        if block is not None:
            return self.scaled(block)
        own = self._wrapped(posenc_hf.use(copy.deepcopy(self.model), "rope"), None)
        return own

    def searchable(self) -> nn.Module:
        """The transformers model LongRoPE's search scores: a copy after ``use(copy, "rope", base=...)``."""
        return posenc_hf.use(copy.deepcopy(self.model), "rope", base=self.rope.base)

    def save(self, model: StudiedModel, out: Path) -> dict[str, Any]:
        """``model`` into ``out/model`` (a partial folder of an interrupted save is replaced)."""
        assert isinstance(model, StudyModel)
        hf = model.model
        partial, final = out / f"{FOLDER}.partial", out / FOLDER
        shutil.rmtree(partial, ignore_errors=True)
        try:
            posenc_hf.export(hf, partial)
            form = "transformers"
        except UsageError:
            shutil.rmtree(partial, ignore_errors=True)
            hf.save_pretrained(partial)
            form = "posenc.hf"
        if self.tokenizer is not None:  # (the table's tokens: load_pretrained(OUT/model) gives it back)
            self.tokenizer.save_pretrained(partial)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return {"weights": FOLDER, "format": form}

    def load(self, out: Path, saved: dict[str, Any]) -> StudiedModel | None:
        path = out / saved.get("weights", FOLDER)
        if not (path / "config.json").is_file():
            return None
        model = load(path, str(self.device))
        if saved.get("format") == "transformers":  # the block is the config's rope_parameters
            block = dict(getattr(model.config, "rope_parameters", None) or {})
            return self._wrapped(posenc_hf.use(model, "rope"), block)
        return StudyModel(model, self._wrapped(model, None).config)


__all__ = ["FOLDER", "HFCheckpoint", "load", "train_length_of"]
