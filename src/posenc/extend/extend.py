"""``posenc extend``: a trained RoPE model fine-tuned under a scaling at a longer length.

The job of the papers on context extension, on the user's own checkpoint and data: PI (``linear``,
Chen et al. 2023), ``ntk`` (bloc97 2023), ``yarn`` with its attention factor (Peng et al. 2023),
``llama3`` (Meta's Llama 3.1 rule), ``ntk_alpha`` (Hunyuan's NTK-alpha, alpha = s), ``resonance``
(Wang et al. 2024: integer wavelengths) and ``resonance_yarn`` (YaRN, then rounded), ``longrope`` (Ding et al. 2024: the factors given as a block,
or found first by LongRoPE's search, :mod:`posenc.study.longrope_search`, scored on the last windows of the
training split so that the table's validation bytes stay unseen), and ``drope`` (Gelberg et al. 2025:
the positions dropped, then the model recalibrated without them).

A scaling's block is the one the study's ``+ft`` rows use (:func:`posenc.study.variants.scaling_block`): the
factor ``s = length / train_length`` for the fine-tune and for every evaluation length. The
fine-tune is the study's: its training loop (:func:`posenc.study.train.train`), its batches (random windows, a
pure function of the data seed and the step, packed documents with ``pack_documents``), and for a
scaling its ``+ft`` settings (:func:`posenc.study.plan.settings_of`): ``steps`` at ``length`` with a tenth of
them of warmup to ``lr``, then ``lr`` held; the data seed ``seed + FINETUNE_STREAM``. DroPE's
recalibration takes DroPE's schedule (a 3% warmup, then cosine decay to ``min_lr_ratio``, no
weight decay).

A study's checkpoint (``OUT/checkpoints/ROW[.seedN].safetensors``) brings its study's settings as
the defaults: train length, data, validation bytes, packing, task, evaluation lengths, seed, and
``lr * min_lr_ratio`` with a batch of as many tokens as pre-training's, so ``posenc extend`` on
``rope.safetensors`` with ``--scaling yarn`` is the study's ``rope+yarn+ft`` row, number for number.

The output directory holds the extended checkpoint (``model.safetensors`` and its json:
:func:`posenc.save_checkpoint`, whose ``lm_config`` records the scaling, or ``nope`` after DroPE),
``extend.json`` (the settings, the scaling block, the training record, the search, every score),
and the before/after table by length (``table.json``, ``table.csv``, printed): the base model as
trained, the scaling zero-shot, and the extended model; perplexity on the lm task, far-recall
accuracy on the recall task. An interrupted run continues with ``resume`` from its last training
state (every ``checkpoint_every`` steps) and with the scores already written.

PoSE (``pose``, Zhu et al. 2024, :mod:`.pose`) is a recipe for the fine-tune under any scaling: the
model under the block for ``length``, trained on windows of ``train_length`` whose position ids skip
over ``length`` (drawn from the data seed and the step); ``extend.json`` records it (``recipe``) and
the extended column is named ``SCALING+pose``. A transformers model gets the ids as ``position_ids``
(posenc.hf reads ids that increase and skip as one document, each token at its own id).

Remaps (``remaps``: SelfExtend, ReRoPE, STRING, DCA; :mod:`posenc.encodings.remap`) add zero-shot
columns: the base model under the remap of its own RoPE (base, layout, rotary dim), nothing
trained, scored at every evaluation length (``scores["remap:LABEL"]``, the table's ``LABEL`` column).

A transformers causal LM with RoPE (a ``save_pretrained`` folder, or the model) is extended the same
way through ``posenc.hf`` (:mod:`.extend_hf`: what changes, and how its result is saved).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..encodings.rope import RoPE
from ..errors import UsageError
from ..files import MARKER, RunDir, write_json, write_text
from ..model.checkpoint import load_checkpoint
from ..study import distributed, recall
from ..study.data import Corpus, load_corpus, train_batch
from ..study.evaluation import evaluate, evaluate_recall
from ..study.longrope_search import search
from ..study.progress import Progress
from ..study.rows import SCALINGS
from ..study.studied import StudiedModel
from ..study.train import StateError, TrainSettings, train
from ..study.variants import EXTRA_SCALINGS, scaling_block
from .checkpoint_kinds import Checkpoint, PosencCheckpoint, is_transformers
from .extend_config import KINDS, ExtendConfig, remap_label
from .pose import step_positions

FORMAT = "posenc-extend-1"


# -- a study's checkpoint brings its study's settings ----------------------------------------------

_SEEDED = re.compile(r"^(?P<stem>.+)\.seed(?P<seed>\d+)$")


def study_defaults(checkpoint: Path, length: int | None, pose: bool = False) -> dict[str, Any]:
    """The settings a study's checkpoint brings (empty for any other checkpoint): see the module
    docstring. ``length``: the fine-tuning length (for the batch size); None: the study's own.
    ``pose``: PoSE trains at the study's train length, so the batch is pre-training's, on plain
    windows (no packing: PoSE's ids skip within one window)."""
    root = checkpoint.parent.parent
    if checkpoint.parent.name != "checkpoints" or not (root / "results.json").is_file():
        return {}
    try:
        results = json.loads((root / "results.json").read_text(encoding="utf-8"))
        cfg = results["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    match = _SEEDED.match(checkpoint.stem)
    seed = int(match["seed"]) if match else int(cfg.get("seed", 0))
    t = int(cfg["train_length"])
    target = length or int(cfg.get("finetune_length") or 2 * t)
    return {
        "train_length": t, "lr": float(cfg["lr"]) * float(cfg["min_lr_ratio"]), "min_lr_ratio": float(cfg["min_lr_ratio"]),
        "batch_size": max(1, int(cfg["batch_size"]) * t // (t if pose else target)), "weight_decay": float(cfg["weight_decay"]),
        "grad_clip": float(cfg["grad_clip"]), "checkpoint_every": int(cfg["checkpoint_every"]), "seed": seed,
        "data": cfg.get("data", "default"), "valid_bytes": int(cfg["valid_bytes"]),
        "pack_documents": bool(cfg.get("pack_documents", False)) and not pose, "task": cfg.get("task", "lm"),
        "recall_sequences": int(cfg.get("recall_sequences", 64)), "eval_lengths": list(cfg["eval_lengths"]),
        "length": target,
    }


# -- scores ----------------------------------------------------------------------------------------


@dataclass
class _Data:
    corpus: Corpus | None  # None: the recall task

    def batches(self, cfg: ExtendConfig, settings: TrainSettings) -> Callable[[int], tuple[torch.Tensor | None, ...]]:
        seed, size, length = settings.data_seed, settings.batch_size, settings.length
        batch = self._windows(cfg, seed, size, length)
        if not cfg.pose:
            return batch

        def posed(step: int) -> tuple[torch.Tensor | None, ...]:  # PoSE: windows of train_length, ids over cfg.length
            x, y = batch(step)[:2]
            return x, y, None, step_positions(seed, step, size, length, cfg.length, cfg.pose_chunks)

        return posed

    def _windows(self, cfg: ExtendConfig, seed: int, size: int, length: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
        if self.corpus is None:
            return lambda step: recall.train_batch(seed, step, size, length)
        corpus = self.corpus
        documents = corpus.train_documents if cfg.pack_documents else None
        if cfg.pack_documents and documents is None:
            raise UsageError("pack_documents needs a corpus of files (the built-in one, a file or a folder); this data has no file boundaries")
        return lambda step: train_batch(corpus.train, seed, step, size, length, documents)

    def score(self, model: StudiedModel, cfg: ExtendConfig, length: int) -> dict[str, Any]:
        ctx = distributed.Context(next(model.parameters()).device)
        if self.corpus is None:
            classes = evaluate_recall(model, length, cfg.train_length, cfg.recall_sequences, ctx)
            return {"length": length, **{f"{cls}_accuracy": d["accuracy"] for cls, d in classes.items()}}
        res = evaluate(model, self.corpus.valid, length, None, ctx)
        return {"length": length, "perplexity": res["perplexity"], "loss": res["loss"]}


def pose_recipe(cfg: ExtendConfig) -> dict[str, Any]:
    """What extend.json records of a PoSE fine-tune (:mod:`.pose`)."""
    return {"name": "pose", "paper": "Zhu et al., ICLR 2024, PoSE, arXiv 2309.10400, section 3.2",
            "window": cfg.pose_window or cfg.train_length, "target": cfg.length, "chunks": cfg.pose_chunks,
            "biases": "u_0 = 0, u_i ~ U({u_(i-1), .., target - window})", "cuts": "uniform, every chunk non-empty",
            "content": "the window's consecutive tokens (v_i = 0)"}


def _column(cfg: ExtendConfig) -> str:
    """The extended model's column name: the scaling, with ``+pose`` for a PoSE fine-tune."""
    return f"{cfg.scaling}+pose" if cfg.pose else cfg.scaling


def _metric(cfg: ExtendConfig) -> str:
    return "far_accuracy" if cfg.task == "recall" else "perplexity"


def remap_column(remap: dict[str, Any]) -> str:
    """A remap's key in ``extend.json``'s scores: ``remap:`` and its label."""
    return f"remap:{remap_label(remap)}"


def table_rows(record: dict, cfg: ExtendConfig) -> list[dict]:
    """One row per evaluation length: the base model, the scaling zero-shot, the extended model,
    then each remap zero-shot (keyed by its label, ``selfextend group=4 window=1024``)."""
    key = _metric(cfg)
    columns = [("base", "base"), ("zero_shot", "zero_shot"), ("extended", "extended"),
               *((remap_label(r), remap_column(r)) for r in cfg.remaps)]
    out = []
    for length in cfg.eval_lengths:
        row: dict[str, Any] = {"length": length}
        for name, column in columns:
            found = [s for s in record["scores"].get(column, []) if s["length"] == length]
            row[name] = found[0].get(key) if found else None
        out.append(row)
    return out


def _csv(rows: list[dict], key: str, pose: bool = False, remaps: list[str] | None = None) -> str:
    """The table as CSV; ``remaps``: the remaps' labels (a column each, ``LABEL_zero_shot_KEY`` with
    the label's spaces as underscores)."""
    extended = "pose_extended" if pose else "extended"
    labels = remaps or []
    lines = [",".join([f"length,base_{key},zero_shot_{key},{extended}_{key}",
                       *(f"{label.replace(' ', '_')}_zero_shot_{key}" for label in labels)])]
    for r in rows:
        cells = ["" if r[c] is None else f"{r[c]:.6g}" for c in ("base", "zero_shot", "extended", *labels)]
        lines.append(",".join([str(r["length"]), *cells]))
    return "\n".join(lines) + "\n"


def printed(rows: list[dict], key: str, scaling: str, extended: str | None = None, remaps: list[str] | None = None) -> str:
    """The before/after table as text; ``extended``: the fine-tune's name (default ``scaling``;
    ``yarn+pose`` for a PoSE fine-tune); ``remaps``: the remaps' labels, a zero-shot column each."""
    labels = remaps or []
    widths = [max(18, len(label) + 10) for label in labels]
    head = f"{'length':>8}  {'base':>12}  {scaling + ' zero-shot':>18}  {(extended or scaling) + ' extended':>18}"
    head += "".join(f"  {label + ' zero-shot':>{w}}" for label, w in zip(labels, widths))
    lines = [f"{key} by length", head]
    for r in rows:
        cells = [("-" if r[c] is None else f"{r[c]:.4f}") for c in ("base", "zero_shot", "extended", *labels)]
        line = f"{r['length']:>8}  {cells[0]:>12}  {cells[1]:>18}  {cells[2]:>18}"
        lines.append(line + "".join(f"  {c:>{w}}" for c, w in zip(cells[3:], widths)))
    return "\n".join(lines)


# -- the job ---------------------------------------------------------------------------------------


def _owned(path: Path) -> bool:
    try:
        return json.loads((path / "extend.json").read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def extend(checkpoint: str | Path | torch.nn.Module, out: str | Path, cfg: ExtendConfig, *, resume: bool = False,
           progress: bool = True, device: str = "cpu") -> dict:
    """Extend ``checkpoint`` as ``cfg`` says, into the directory ``out`` (see the module docstring
    for its files); returns the record (``out/extend.json``).

    Args:
        checkpoint: a posenc checkpoint (``NAME.safetensors``), or a transformers causal LM with
            RoPE: a folder ``save_pretrained`` wrote, a GGUF file (or a folder holding one), or the
            model itself (:mod:`.extend_hf`; a checkpoint's own tokenizer gives the data's tokens).

    Raises:
        UsageError: a checkpoint that is not a RoPE model or already has a scaling, data too short
            for the lengths, ``out`` holding another run (without ``resume``) or one made with other
            settings; for a transformers model, what :mod:`.extend_hf` refuses.
    """
    out = Path(out)
    ui = Progress(progress)
    models: Checkpoint
    if is_transformers(checkpoint):
        from .extend_hf import HFCheckpoint  # (imports transformers)

        models = HFCheckpoint.of(checkpoint, device)
        source = models.source
    else:
        if not isinstance(checkpoint, (str, Path)):
            raise UsageError(f"checkpoint: a posenc checkpoint file or a transformers model, got {type(checkpoint).__name__}")
        models = PosencCheckpoint(load_checkpoint(Path(checkpoint), device))
        source = str(checkpoint)
    if isinstance(checkpoint, (str, Path)) and out.resolve() in Path(checkpoint).resolve().parents:
        raise UsageError(f"out: {out} holds the checkpoint being extended ({checkpoint}), e.g. its study's folder; "
                         "choose a folder of its own")
    models.check(cfg)
    data = _Data(None if cfg.task == "recall" else models.corpus(load_corpus(cfg.data, cfg.valid_bytes)))
    if data.corpus is not None:
        if max(cfg.eval_lengths) > data.corpus.valid_tokens:
            raise UsageError(f"eval_lengths: {max(cfg.eval_lengths)} exceeds the {data.corpus.valid_tokens} validation "
                             "tokens; use shorter eval_lengths or more valid_bytes")
        if data.corpus.train.numel() < cfg.length + 2:
            raise UsageError(f"length ({cfg.length}) needs a training split longer than {data.corpus.train.numel()} bytes")
    settings = {**asdict(cfg), "search": None if cfg.search is None else
                {**asdict(cfg.search), "start_tokens": list(cfg.search.start_tokens)}}
    if not cfg.pose:  # (a run without PoSE keeps the settings, and so the resumability, of the runs before PoSE)
        del settings["pose"], settings["pose_chunks"], settings["pose_window"]
    elif cfg.pose_window is None:  # (likewise a PoSE run at the train length)
        del settings["pose_window"]
    if not cfg.remaps:  # (likewise without remaps)
        del settings["remaps"]
    fresh = not (out / MARKER).exists()
    rundir = RunDir.claim(out, "extend", owned=_owned)
    try:
        record = _start(out, source, settings, resume, fresh)
    except BaseException:
        rundir.discard()
        raise
    try:
        return _run(models, out, cfg, data, record, ui, resume)
    finally:
        rundir.release()


def _same_source(saved: object, source: str) -> bool:
    """The checkpoint of a run being resumed: the same text, or the same file named another way
    (a relative and an absolute path)."""
    if saved == source:
        return True
    if not isinstance(saved, str):
        return False
    a, b = Path(saved), Path(source)
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _start(out: Path, source: str, settings: dict, resume: bool, fresh: bool) -> dict:
    path = out / "extend.json"
    if path.exists():
        if not resume:
            raise UsageError(f"out: {out} already holds an extension (extend.json); continue it with resume, or choose another out")
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("settings") != settings or not _same_source(saved.get("checkpoint"), source):
            raise UsageError(f"resume: {out} was extended from another checkpoint or with other settings; use another out")
        return dict(saved)
    if resume and fresh:
        raise UsageError(f"resume: {out} holds no extension (no extend.json); leave out resume to start one")
    return {"format": FORMAT, "checkpoint": source, "settings": settings, "status": "running", "scores": {}}


def _block(models: Checkpoint, cfg: ExtendConfig, record: dict, out: Path, data: _Data, ui: Progress,
           resume: bool) -> dict[str, Any] | None:
    """The scaling block (None: DroPE), searched first for a searched LongRoPE."""
    enc = models.rope
    if cfg.scaling == "drope":
        return None
    if cfg.scaling == "longrope" and cfg.longrope is not None:
        block = dict(cfg.longrope)
        RoPE(enc.num_heads, enc.head_dim, base=enc.base, rotary_dim=enc.rotary_dim, scaling=block)  # checked now
        return block
    if cfg.scaling == "longrope" and cfg.search is not None:
        if "search" not in record:
            if data.corpus is None:
                raise UsageError("search: LongRoPE's search scores perplexity on text; use task lm, or give the "
                                 "factors (longrope)")
            ui.log(f"[extend] LongRoPE's search for {cfg.length} ({cfg.factor:g}x)")
            need = cfg.search.sequences * cfg.length + 1  # (training windows: the table's bytes stay unseen)
            if data.corpus.train.numel() < need:
                raise UsageError(f"search: {cfg.search.sequences} windows of {cfg.length} need {need} training bytes, "
                                 f"the training split has {data.corpus.train.numel()}")
            result = search(models.searchable(), data.corpus.train[-need:], cfg.search, state=out / "search-state.json",
                            resume=resume or (out / "search-state.json").exists(), report=ui)
            record["search"] = result.to_json()
        return dict(record["search"]["block"])
    assert cfg.scaling in (*SCALINGS, *EXTRA_SCALINGS)
    return scaling_block(cfg.scaling, cfg.factor, cfg.train_length, enc.base, enc.rotary_dim)


def _run(models: Checkpoint, out: Path, cfg: ExtendConfig, data: _Data, record: dict, ui: Progress, resume: bool) -> dict:
    path = out / "extend.json"
    started = time.perf_counter()
    block = _block(models, cfg, record, out, data, ui, resume)
    record["scaling"] = block if block is not None else {"drope": True}
    if cfg.pose:
        record["recipe"] = pose_recipe(cfg)
    write_json(path, record)
    start = models.scaled(block)

    def scores(column: str, model: StudiedModel) -> None:
        done = {s["length"] for s in record["scores"].get(column, [])}
        for length in cfg.eval_lengths:
            if length in done:
                continue
            if data.corpus is not None and length > data.corpus.valid_tokens:
                continue
            score = data.score(model, cfg, length)
            record["scores"].setdefault(column, []).append(score)
            ui.log(f"[extend] {column} L={length}: " + ", ".join(f"{k} {v:.4f}" for k, v in score.items() if k != "length"))
            write_json(path, record)

    scores("base", models.base)
    scores("zero_shot", start)
    for remap in cfg.remaps:  # the base model under each remap of its own RoPE, zero-shot
        scores(remap_column(remap), models.remapped(remap))
    model = start
    if cfg.steps:
        loaded = models.load(out, record["saved"]) if record.get("status") in ("trained", "done") and "saved" in record else None
        if loaded is not None:
            model = loaded
        else:
            settings = cfg.settings()
            try:
                model, trained = train(f"extend {_column(cfg)}", settings, models.trainable(block), data.batches(cfg, settings),
                                       out / "state.pt", distributed.Context(models.device), report=ui)
            except StateError as err:
                raise UsageError(f"{err}; delete it and continue with resume to fine-tune from step 0") from None
            record["train"] = trained.to_json()
            record["saved"] = models.save(model, out)
            record["status"] = "trained"
            write_json(path, record)
            (out / "state.pt").unlink(missing_ok=True)
        scores("extended", model)
    elif "saved" not in record:
        record["saved"] = models.save(model, out)
    rows = table_rows(record, cfg)
    key = _metric(cfg)
    record["table"] = rows
    record["status"] = "done"
    record["time_s"] = round(record.get("time_s", 0.0) + time.perf_counter() - started, 3)
    write_json(path, record)
    labels = [remap_label(r) for r in cfg.remaps]
    write_json(out / "table.json", {"metric": key, "scaling": cfg.scaling, **({"recipe": "pose"} if cfg.pose else {}),
                                    **({"remaps": cfg.remaps} if cfg.remaps else {}), "rows": rows})
    write_text(out / "table.csv", _csv(rows, key, cfg.pose, labels))
    ui.warn(printed(rows, key, cfg.scaling, _column(cfg), labels))
    return record


__all__ = ["ExtendConfig", "KINDS", "extend", "pose_recipe", "remap_column", "study_defaults", "table_rows"]
