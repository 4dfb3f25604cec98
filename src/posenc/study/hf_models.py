"""The study's rows on a Hugging Face ``transformers`` architecture: ``posenc study --hf-config FILE``.

Every row trains ``AutoModelForCausalLM.from_config(config)`` from random weights, with the study's
loop, optimizer, schedule and data, and is scored with its evaluation (perplexity by length with
bootstrap intervals, or the recall task), so that encodings can be compared on the model family a
user actually runs. ``config`` is read from the JSON file (a ``config.json`` as ``save_pretrained``
writes it; no download, no weights).

- **Rows**: ``hf`` (:data:`posenc.study.rows.NATIVE`) is the model as its config builds it, its own
  attention and RoPE untouched: the baseline. Any other row ``METHOD[:KEY=VALUE]`` is the same model
  after ``posenc.hf.use(model, METHOD, **options)``, with the study's fair options (distance bounds
  capped at the training length, a learned table of exactly the training length). ``rope`` without
  options takes the model's own RoPE parameters, so at initialisation it is the ``hf`` model.
- **Variants**: ``+drop`` (DroPE: ``use(model, "nope")`` at the drop step), the RoPE scalings
  (``+yarn``, ...: ``set_scaling`` on the model's posenc RoPE), ``+blockwise`` and ``+ft`` map onto
  the model as on posenc's own; ``+random`` does not (the randomized positions are drawn inside
  posenc's own LM, ``LMConfig.random_positions``, which a transformers model has no place for) and
  is a UsageError naming the row, as is a variant of ``hf``. Position ids that increase and skip
  (PoSE's, ``posenc extend --pose``) reach the model through ``StudyModel``'s ``positions``.
- **Same start**: a trained row's model is built right after ``torch.manual_seed(seed)``, and the
  encoding (with any parameters of its own) only after the model, so every row of a seed starts
  from the same transformer weights.
- **Checked first** (:func:`check` and :meth:`HFModels.check`, from the study's plan): the family (one of
  ``posenc.hf.SUPPORTED``), ``vocab_size`` (>= 256: the study's tokens are bytes, token id = byte
  value; set to 256 when the file has none), ``attention_dropout`` 0, a sliding window no shorter
  than the longest sequence (posenc.hf runs full attention), and every row built on the meta device
  with its variant applied at every evaluation length.
- **Checkpoints**: ``R.safetensors`` (the weights) and ``R.json`` (the row, the config file's
  sha256, the weights' sha256); loading rebuilds the row's model from the config and refuses a
  checkpoint of another config file.

``max_position_embeddings`` is not a limit here: HF's rotary module and posenc's encodings compute
any position, so evaluation lengths past it run (and are what the study is for). It stays what the
file says, which matters only to a scaling in the file's own ``rope_parameters`` that reads it.

The model's parameters are float32 (the study trains in float32), whatever ``dtype`` the file names.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedModel

from ..encodings import get_class, options_of
from ..encodings.rope import RoPE
from ..errors import UsageError, as_kind
from ..files import write_bytes, write_json
from ..hf.adapter import SUPPORTED, use
from ..model.checkpoint import safetensors_header, unique_tensors
from ..model.lm import LM
from ..version import __version__
from . import rows, variants
from .config import StudyConfig

BYTES = 256  # the study's vocabulary: token id = byte value
FORMAT = "posenc-study-hf-checkpoint/1"


@dataclass
class Architecture:
    """A config file read and checked: its path, sha256, family and the config it builds."""

    path: str
    sha256: str
    model_type: str
    values: dict  # the file's keys (vocab_size added when it had none)
    vocab_from_file: bool
    config: Any  # the transformers config

    def record(self) -> dict:
        """What results.json keeps of it (``results["hf"]``)."""
        c = self.config
        heads = int(c.num_attention_heads)
        return {
            "path": self.path, "sha256": self.sha256, "model_type": self.model_type, "family": SUPPORTED[self.model_type],
            "vocab_size": int(c.vocab_size), "vocab_size_from": "file" if self.vocab_from_file else "study (bytes)",
            "hidden_size": int(c.hidden_size), "num_hidden_layers": int(c.num_hidden_layers),
            "num_attention_heads": heads, "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "max_position_embeddings": getattr(c, "max_position_embeddings", None), "config": self.values,
        }


def _config_path(cfg: StudyConfig) -> str:
    """``cfg.hf_config``, which a study of a transformers model has (posenc.study.models.models_for)."""
    if cfg.hf_config is None:
        raise UsageError("hf_config: a study of a transformers model needs the path of its config.json")
    return cfg.hf_config


def load_architecture(path: str) -> Architecture:
    """The config file at ``path``; UsageError naming ``hf_config``, ``model_type`` or ``vocab_size``.

    Raises:
        UsageError: ``path`` is not a file of valid JSON holding an object, its ``model_type`` is
            not a supported family, its ``vocab_size`` is below 256, or transformers cannot build it.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hf_config: {path} is not a file (give a transformers config.json)")
    data = p.read_bytes()
    try:
        values = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"hf_config: {path} is not valid JSON ({err})") from None
    if not isinstance(values, dict):
        raise UsageError(f"hf_config: {path} must hold a JSON object (a config.json), got {type(values).__name__}")
    model_type = values.get("model_type")
    if model_type not in SUPPORTED:
        raise UsageError(f"hf_config: model_type must be one of {', '.join(repr(k) for k in SUPPORTED)} (the "
                         f"{', '.join(SUPPORTED.values())} families posenc.hf supports), got {model_type!r} in {path}")
    vocab = values.get("vocab_size")
    vocab_from_file = vocab is not None
    if vocab is None:
        values["vocab_size"] = BYTES
    elif isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < BYTES:
        raise UsageError(f"hf_config: vocab_size must be an integer >= {BYTES} (the study's tokens are bytes, token "
                         f"id = byte value), got {vocab!r} in {path}")
    try:
        config = CONFIG_MAPPING[model_type].from_dict({k: v for k, v in values.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError) as err:
        raise UsageError(f"hf_config: {path} is not a usable {model_type} config ({err})") from None
    return Architecture(str(path), hashlib.sha256(data).hexdigest(), model_type, values, vocab_from_file, config)


@dataclass(frozen=True)
class StudyModelConfig:
    """What a :class:`StudyModel` is (``run["model"]`` in results.json), and what the study's
    evaluation reads of it (``num_heads`` sizes its batches; no ``random_positions``)."""

    hf_model_type: str
    hf_config_sha256: str
    attention: str  # "hf": the model's own; "posenc": posenc.hf.use
    encoding: str | None  # the posenc encoding (None for "hf")
    encoding_options: dict
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    depth: int
    vocab_size: int
    scaling: dict | None = None  # a +ft row's scaling
    random_positions: None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("random_positions")
        return d


class StudyModel(nn.Module):
    """A transformers causal LM as the study trains and scores it: ``model(tokens)`` -> logits.

    Shape legend: B batch, T tokens, V vocab_size.
    """

    def __init__(self, model: PreTrainedModel, config: StudyModelConfig) -> None:
        super().__init__()
        self.model = model
        self.config = config

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Args: tokens (B, T) byte ids; ``positions`` (B, T) or (T,): each token's position id, increasing
        along a row and free to skip (PoSE's chunks, ``posenc extend --pose``), passed as
        ``position_ids`` with an all-ones attention mask, so that the model reads one sequence (HF's
        own attention would otherwise read skipping ids as packed sequences). Returns logits (B, T, V).

        Raises:
            UsageError: for ``document_ids`` (the study refuses pack_documents with hf_config before
                it could come here), or ``positions`` that do not increase along a row.
        """
        if document_ids is not None:
            raise UsageError("document_ids: a study of a transformers model passes none")
        if positions is None:
            return self.model(input_ids=tokens, use_cache=False).logits  # (B, T, V)
        if positions.shape[-1] > 1 and bool((positions[..., 1:] <= positions[..., :-1]).any()):
            raise UsageError("positions: the position ids of a transformers model's row must increase (a restart "
                             "would start a packed document)")
        position_ids = positions.to(device=tokens.device, dtype=torch.long).expand(tokens.shape)
        return self.model(input_ids=tokens, position_ids=position_ids, attention_mask=torch.ones_like(tokens),
                          use_cache=False).logits  # (B, T, V)

    @property
    def max_length(self) -> int | None:
        """The longest input of a bounded encoding (a learned table), else None."""
        encodings = variants.encodings(self)
        return getattr(encodings[0], "max_positions", None) if encodings else None

    def drop_positions(self) -> None:
        """DroPE: the model's encoding becomes NoPE (``posenc.hf.use(model, "nope")``); every other
        weight stays, and an optimizer built before keeps the old encoding's parameters, without
        gradients (as :meth:`posenc.LM.drop_positions`)."""
        use(self.model, "nope")
        self.config = replace(self.config, attention="posenc", encoding="nope", encoding_options={}, scaling=None)


class HFModels:
    """The study's :class:`~posenc.study.models.Models` for a transformers architecture."""

    def __init__(self, cfg: StudyConfig, architecture: Architecture | None = None) -> None:
        self.cfg = cfg
        self.arch = architecture or load_architecture(_config_path(cfg))

    def _options(self, row: rows.Row) -> dict:
        options = rows.fair_options(row, self.cfg.train_length)
        cls = get_class(row.method)
        if not cls.extrapolates and "max_positions" in options_of(cls):  # as posenc.study.models.lm_config
            options.setdefault("max_positions", self.cfg.train_length)
        return options

    def check(self, row: rows.Row) -> None:
        """UsageError naming ``row`` when it cannot run on this architecture: +random, +ft of a
        method that is not RoPE, or a model (built on the meta device, its variant applied at every
        evaluation length) that cannot be built.

        Raises:
            UsageError: a row asks for ``+random`` (unsupported with hf_config), ``+ft`` of a method
                that is not RoPE, or options the encoding rejects.
        """
        cfg, name = self.cfg, row.name
        if "random" in row.train:
            raise UsageError(f"methods: {name!r}: +random is not supported with hf_config: the randomized positions "
                             "are drawn inside posenc's own LM (random_positions), which a transformers model has no "
                             "place for")
        if row.kind == "finetune" and not issubclass(get_class(row.method), RoPE):
            raise UsageError(f"methods: {name!r}: +ft fine-tunes a RoPE scaling; {row.method} is not RoPE")
        try:
            with torch.device("meta"):
                model = self.build(row)
                for length in cfg.eval_lengths:
                    with variants.applied(model, row, length, cfg.train_length):
                        pass
        except UsageError as err:
            raise UsageError(f"methods: {name!r}: {err}") from None
        except (ValueError, TypeError) as err:
            raise UsageError(f"methods: {name!r}: {err}") from None

    def build(self, row: rows.Row, scaling: dict[str, Any] | None = None) -> StudyModel:
        if row.kind == "eval":
            return self.build(row.parent)
        if row.kind == "finetune":  # the base row's model under the scaling it is fine-tuned with (or ``scaling``)
            model = self.build(row.parent)
            encodings = variants.encodings(model)
            ropes = [enc for enc in encodings if isinstance(enc, RoPE)]
            if not ropes or len(ropes) != len(encodings):  # (check refuses these rows first)
                raise UsageError(f"methods: {row.name!r}: +ft fine-tunes a RoPE scaling; {row.method} is not RoPE")
            rope = ropes[0]
            block = scaling if scaling is not None else variants.scaling_block(
                row.variant, self.cfg.ft_length / self.cfg.train_length, self.cfg.train_length, rope.base, rope.rotary_dim)
            for enc in ropes:
                enc.set_scaling(block)
            model.config = replace(model.config, scaling=block)
            return model
        config = copy.deepcopy(self.arch.config)  # use() writes into the config: one per model
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        options = {} if row.method == rows.NATIVE else self._options(row)
        if row.method != rows.NATIVE:
            use(hf, row.method, **options)
        c = hf.config
        heads = int(c.num_attention_heads)
        record = StudyModelConfig(
            hf_model_type=self.arch.model_type, hf_config_sha256=self.arch.sha256,
            attention="hf" if row.method == rows.NATIVE else "posenc",
            encoding=None if row.method == rows.NATIVE else row.method, encoding_options=options,
            num_heads=heads, num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads), hidden_size=int(c.hidden_size),
            depth=int(c.num_hidden_layers), vocab_size=int(c.vocab_size))
        return StudyModel(hf, record)

    def initial(self, row: rows.Row, seed: int) -> StudyModel:
        torch.manual_seed(seed)
        return self.build(row)

    def record(self, model: LM | StudyModel) -> dict:
        return as_kind(model, StudyModel).config.to_dict()

    def planned(self, row: rows.Row) -> dict:
        base = row.base_row or row
        return {"hf_model_type": self.arch.model_type, "hf_config_sha256": self.arch.sha256,
                "attention": "hf" if base.method == rows.NATIVE else "posenc",
                "encoding": None if base.method == rows.NATIVE else base.method,
                "encoding_options": {} if base.method == rows.NATIVE else self._options(base)}

    def architecture(self) -> dict:
        """The architecture's record (results.json's ``hf``)."""
        return self.arch.record()

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, model: LM | StudyModel, path: Path) -> None:
        """``path`` (safetensors; its header names the row and the config file) and its json."""
        from safetensors.torch import save

        model = as_kind(model, StudyModel)
        path = Path(path)
        kept, alias = unique_tensors(model.state_dict())
        meta = {"format": FORMAT, "hf_config_sha256": self.arch.sha256, "model": model.config.to_dict()}
        header = json.dumps(meta, sort_keys=True, allow_nan=False)
        data = save({k: v.detach().contiguous().cpu() for k, v in kept.items()}, metadata={"posenc": header})
        write_bytes(path, data)
        write_json(path.with_suffix(".json"), {**meta, "posenc": __version__, "weights": {
            "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "shared": alias}})

    def load(self, path: Path, row: rows.Row, device: torch.device) -> StudyModel:
        """``row``'s model rebuilt from the config file with the weights at ``path``; UsageError
        when the files do not match each other, this config file or this row.

        Raises:
            UsageError: ``path`` is no checkpoint of an hf_config study, cannot be read, fails its
                sha256, was trained on another hf_config, or holds another row's model.
        """
        from safetensors.torch import load

        path = Path(path)
        try:
            meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
            data = path.read_bytes()
            inside = json.loads(safetensors_header(data).get("__metadata__", {}).get("posenc", "{}"))
        except (OSError, ValueError, UnicodeDecodeError, AttributeError) as err:
            raise UsageError(f"path: {path} or its json cannot be read ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("weights"), dict):
            raise UsageError(f"path: {path.with_suffix('.json')} is not a checkpoint of a study with hf_config ({FORMAT})")
        if hashlib.sha256(data).hexdigest() != meta["weights"].get("sha256"):
            raise UsageError(f"path: {path} does not match the sha256 in its json: the weights were changed or replaced")
        if inside.get("hf_config_sha256") != self.arch.sha256 or meta.get("hf_config_sha256") != self.arch.sha256:
            raise UsageError(f"path: {path} was trained on another hf_config (sha256 {meta.get('hf_config_sha256')}, "
                             f"this one {self.arch.sha256})")
        name = row.name
        model = self.build(row)
        if "drop" in row.train:  # a +drop row's final model has no positions
            model.drop_positions()
        if inside.get("model") != model.config.to_dict():
            raise UsageError(f"path: {path} holds another model than row {name!r} builds ({inside.get('model')})")
        tensors = load(data)
        alias = meta["weights"].get("shared") or {}
        try:
            model.load_state_dict({**tensors, **{a: tensors[k] for a, k in alias.items()}})
        except (RuntimeError, KeyError) as err:
            raise UsageError(f"path: {path}'s tensors do not fit row {name!r} ({str(err).splitlines()[0]})") from None
        return model.to(device)


def check(cfg: StudyConfig) -> Architecture:
    """UsageError now, before any file is written, for a config file this study cannot run (see
    the module docstring; each row is :meth:`HFModels.check`'s); returns the architecture.

    Raises:
        UsageError: ``pack_documents`` with hf_config, an ``attention_dropout`` that is not 0, or a
            config that does not build a model. (A family's windows, sinks and chunks stay on every
            row: posenc.hf keeps them.)
    """
    arch = load_architecture(_config_path(cfg))
    if cfg.pack_documents:
        raise UsageError("pack_documents is not supported with hf_config: the rows would get their documents "
                         "from position_ids, which the model's own attention (the hf row) reads otherwise")
    dropout = getattr(arch.config, "attention_dropout", 0.0) or 0.0
    if dropout:
        raise UsageError(f"hf_config: attention_dropout must be 0 (posenc.hf's attention takes no dropout, and every "
                         f"row must train alike), got {dropout} in {arch.path}")
    try:
        with torch.device("meta"):
            HFModels(cfg, arch).build(rows.parse(rows.NATIVE))
    except (ValueError, TypeError, AttributeError) as err:
        raise UsageError(f"hf_config: {arch.path} does not build a model ({err})") from None
    return arch


__all__ = ["Architecture", "BYTES", "HFModels", "StudyModel", "StudyModelConfig", "check", "load_architecture"]
