"""One row of a study at one seed: get its model (train it, fine-tune it, or load it), then score
every evaluation length not yet in results.json, saving after each, so that an interrupted study
continues exactly where it stopped.

A trained row trains from scratch; a fine-tuned row (``+ft``) starts from its base row's model of the
same seed; an evaluated row (``+yarn``, ``+blockwise``, ...) scores its base row's model under its
variant (:mod:`.variants`), without training. Each length's row gets its 95% bootstrap interval
(:mod:`.bootstrap`), its per-window numbers are saved beside results.json, and a model with position
parameters is checked for parameters it uses there but never trained (:mod:`.fairness`).

A run whose training diverges (:class:`.train.Diverged`), or a model with non-finite parameters, is
recorded as ``diverged`` (with its step) without a checkpoint or evaluation, and so are the rows
evaluated or fine-tuned from it; the study goes on with the other rows.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from ..errors import UsageError
from ..files import write_json
from ..model import LM
from ..schedule import Schedule
from . import bootstrap, distributed, fairness, recall, rows, seeds, variants
from .builders import models_for
from .config import StudyConfig
from .data import Corpus, train_batch
from .evaluation import cannot_run, evaluate, evaluate_recall
from .progress import Progress
from .results import Paths, write_outputs
from .train import Diverged, Job, StateError, StepCallback, drope_schedule, schedule, train

# A fine-tune draws its batches from another stream than pre-training (the same text, other windows).
FINETUNE_STREAM = 1_000_000


class Runner:
    """Runs rows for one study; holds the last model, so a row's variants reuse it."""

    def __init__(self, cfg: StudyConfig, corpus: Corpus | None, results: dict, paths: Paths,
                 ctx: distributed.Context, ui: Progress, on_step: StepCallback | None) -> None:
        self.cfg, self.corpus, self.results, self.paths = cfg, corpus, results, paths
        self.ctx, self.ui, self.on_step = ctx, ui, on_step
        self.models = models_for(cfg)  # posenc's LM, or a transformers architecture (hf_config)
        self._last: tuple[str, int, LM] | None = None
        for entry in results["methods"].values():  # (a study from before seeds: its one seed)
            entry.setdefault("seed", results.get("seed", 0))

    # -- bookkeeping ------------------------------------------------------------------------------

    def save(self, outputs: bool = False) -> None:
        if self.ctx.main:
            write_json(self.paths.results, self.results)
            if outputs:
                write_outputs(self.results, self.paths.root)

    def label(self, row: rows.Row, index: int) -> str:
        return row.name if index == 0 else f"{row.name} seed {self.cfg.seed + index}"

    def _set_run(self, row: rows.Row, index: int, run: dict) -> dict:
        """Store ``run`` as the ``index``-th seed's run of ``row``; returns the stored dict."""
        methods = self.results["methods"]
        if index == 0:
            old = methods.get(row.name, {})
            methods[row.name] = entry = {**run, "row": describe(row, self.cfg)}
            if old.get("seeds"):
                entry["seeds"] = old["seeds"]
            return entry
        entry = methods[row.name]
        later = entry.setdefault("seeds", [])
        while len(later) < index:
            later.append({"seed": self.cfg.seed + len(later) + 1, "status": "pending", "train": {}, "eval": []})
        later[index - 1] = run
        return run

    # -- models -----------------------------------------------------------------------------------

    def initial(self, name: str, seed: int) -> LM:
        """A trained row's model at initialization: the same at every call for this seed."""
        return self.models.initial(name, seed)

    def model(self, row: rows.Row, index: int) -> LM | None:
        """The final model of ``row`` at the ``index``-th seed: in memory, from its checkpoint, or
        trained now (continuing from its saved state) and checkpointed; None when its training
        diverged (its run, or its base's, says ``diverged``)."""
        if row.kind == "eval":
            return self.model(rows.parse(row.base), index)
        if self._last is not None and self._last[:2] == (row.name, index):
            return self._last[2]
        seed = self.cfg.seed + index
        label = self.label(row, index)
        entry = self.results["methods"].get(row.name)
        run = seeds.run_of(entry, index) if entry else None
        if run is not None and run.get("status") == "diverged":
            return None
        checkpoint = seeds.path_of(self.paths, row.stem, index, seed)
        model = None
        if run is not None and run.get("status") in ("trained", "done"):
            if checkpoint.exists():
                try:
                    model = self.models.load(checkpoint, row.name, self.ctx.device)
                except UsageError as err:
                    raise UsageError(f"{err}; delete {checkpoint} and continue with resume to train {label} "
                                     "again") from None
            else:
                self.ui.warn(f"[{label}] its checkpoint {checkpoint} is missing: training it again")
        if model is None:
            model = self._train(row, index, seed, label, checkpoint)
        self._last = (row.name, index, model)
        return model

    def _job(self, row: rows.Row, index: int, seed: int, label: str) -> Job | None:
        cfg = self.cfg
        if row.kind == "finetune":
            base = self.model(rows.parse(row.base), index)
            if base is None:
                return None
            weights = {k: v.detach().clone() for k, v in base.state_dict().items()}

            def make() -> LM:
                model = self.models.build(row.name)
                model.load_state_dict(weights)
                return model

            length = cfg.ft_length
            size = max(self.ctx.world, cfg.batch_size * cfg.train_length // length // self.ctx.world * self.ctx.world)
            warm = max(1, cfg.finetune_steps // 10)
            return Job(label, make, self._batches(seed + FINETUNE_STREAM, size, length), cfg.finetune_steps,
                       lambda step: min(1.0, (step + 1) / warm), cfg.lr * cfg.min_lr_ratio, size * length)
        drop_at = cfg.drop_step if "drop" in row.train else None
        factor = (schedule(cfg.steps, cfg.warmup, cfg.min_lr_ratio) if drop_at is None
                  else drope_schedule(cfg.steps, drop_at, cfg.warmup, cfg.min_lr_ratio))
        return Job(label, partial(self.initial, row.name, seed), self._batches(seed, cfg.batch_size, cfg.train_length),
                   cfg.steps, factor, cfg.lr, cfg.batch_size * cfg.train_length, drop_at)

    def _batches(self, seed: int, size: int, length: int):
        if self.corpus is None:
            return lambda step: recall.train_batch(seed, step, size, length)
        documents = self.corpus.train_documents if self.cfg.pack_documents else None
        if self.cfg.pack_documents and documents is None:
            raise UsageError("pack_documents needs a corpus of files (the built-in one, a file or a folder); this data has no file boundaries")
        return lambda step: train_batch(self.corpus.train, seed, step, size, length, documents)

    def _train(self, row: rows.Row, index: int, seed: int, label: str, checkpoint) -> LM | None:
        state = self.paths.state(row.stem, None if index == 0 else seed)
        job = self._job(row, index, seed, label)
        if job is None:  # a fine-tune whose base diverged
            self._diverged(row, index, {"base": row.base, "reason": f"its base row {row.base} diverged"})
            return None
        try:
            model, record = train(job, self.cfg, state, self.ctx, self.ui, self.on_step)
        except StateError as err:
            raise UsageError(f"{err}; delete it and continue with resume: {label} then trains again from step 0, "
                             "other methods keep their results") from None
        except Diverged as err:
            if self.ctx.main:
                state.unlink(missing_ok=True)  # its states lead to the same step again
            self._diverged(row, index, {
                "steps": job.steps, "diverged_at_step": err.step, "reason": str(err),
                "losses": [round(v, 5) for v in err.losses],
            })
            return None
        if row.kind == "finetune":
            record["from"] = row.base
        run = {
            "status": "trained", "seed": seed, "model": self.models.record(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint": str(checkpoint.relative_to(self.paths.root)), "train": record, "eval": [],
        }
        self._set_run(row, index, run)
        if self.ctx.main:
            self.models.save(model, checkpoint)
            self.save()
            state.unlink(missing_ok=True)  # the final checkpoint replaces it
        self.ui.log(f"[{label}] trained {record['steps']} steps in {record['time_s']:.1f}s "
                    f"({record['tokens_per_s']:,.0f} tok/s), final loss {record['final_loss']:.3f}")
        return model

    def _diverged(self, row: rows.Row, index: int, train: dict) -> None:
        """Record the run of ``row`` at the ``index``-th seed as diverged (no model, no evaluation)."""
        seed, label = self.cfg.seed + index, self.label(row, index)
        self._set_run(row, index, {"status": "diverged", "seed": seed, "model": self.models.planned(row.name),
                                   "checkpoint": None, "train": train, "eval": []})
        self.ui.warn(f"[{label}] diverged: {train['reason']}; recorded as diverged, going on with the other rows")
        self.save()

    # -- evaluation -------------------------------------------------------------------------------

    def run_row(self, row: rows.Row, index: int) -> None:
        """Get the model of ``row`` at the ``index``-th seed, then score every length not yet done."""
        cfg, seed, label = self.cfg, self.cfg.seed + index, self.label(row, index)
        model = self.model(row, index)
        if model is not None and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
            self._diverged(row, index, {"reason": f"non-finite parameters ({', '.join(bad[:3])})"})
            model = None
        if model is None:
            run = seeds.run_of(self.results["methods"].get(row.name) or {}, index) if row.name in self.results["methods"] else None
            if run is None or run.get("status") != "diverged":
                self._diverged(row, index, {"base": row.base, "reason": f"its base row {row.base} diverged"})
            seeds.aggregate(self.results["methods"][row.name], row.stem, self.paths, cfg.task == "recall")
            self.save(outputs=True)
            return
        if self.ctx.main:  # a kill right after the final checkpoint can leave the last state behind
            self.paths.state(row.stem, None if index == 0 else seed).unlink(missing_ok=True)
        entry = self.results["methods"].get(row.name)
        run = seeds.run_of(entry, index) if entry else None
        if row.kind == "eval" and (run is None or run.get("status") == "pending"):
            base = seeds.run_of(self.results["methods"][row.base], index)
            run = self._set_run(row, index, {
                "status": "trained", "seed": seed, "model": base["model"], "parameters": base["parameters"],
                "checkpoint": base["checkpoint"], "train": {}, "eval": [],
            })
        done_lengths = {e["length"] for e in run["eval"]}
        todo = [n for n in cfg.eval_lengths if n not in done_lengths]
        bar = self.ui.eval_bar(label, len(cfg.eval_lengths), len(cfg.eval_lengths) - len(todo))
        ancestor = row.name if row.kind == "train" else row.base
        initial = None
        for length in todo:
            self.ui.evaluating(bar, length)
            t0 = time.perf_counter()
            with variants.applied(model, row, length, cfg.train_length) as applied:
                out = self._score(model, row, index, length)
                if out["status"] == "ok" and fairness.position_parameters(model):
                    if initial is None:
                        initial = self.initial(ancestor, seed).to(self.ctx.device)
                    out["untrained"] = fairness.untrained_used(model, initial, self._probe(length))
            out.update(applied)
            out["time_s"] = round(time.perf_counter() - t0, 3)
            run["eval"].append(out)
            run["eval"].sort(key=lambda e: e["length"])
            self.ui.log(f"[{label}] L={length}: " + describe_row(out))
            self.ui.advance(bar)
            self.save()
        self.ui.close(bar)
        run["status"] = "done"
        seeds.aggregate(self.results["methods"][row.name], row.stem, self.paths, cfg.task == "recall")
        self.save(outputs=True)

    def _probe(self, length: int) -> torch.Tensor:
        """(1, L + 1) tokens for the untrained-parameter check: the first validation window, or a
        recall sequence with its pairs far away."""
        if self.corpus is None:
            return recall.eval_set(length, "far", 1, self.cfg.train_length)[0].to(self.ctx.device)
        return self.corpus.valid[: length + 1].long()[None].to(self.ctx.device)

    def _score(self, model: LM, row: rows.Row, index: int, length: int) -> dict:
        """One length's evaluation row (its per-window numbers saved beside results.json)."""
        cfg, label, seed = self.cfg, self.label(row, index), self.cfg.seed + index
        reason = cannot_run(model, length)
        if reason:
            if self.corpus is None:
                return {"length": length, "accuracy": None, "status": reason}
            return {"length": length, "perplexity": None, "bits_per_byte": None, "loss": None,
                    "tokens": self.corpus.valid_tokens, "status": reason}
        on_batch, done = self.ui.windows(label, length)
        try:
            if self.corpus is None:
                res = evaluate_recall(model, length, cfg.train_length, cfg.recall_sequences, self.ctx, on_batch)
            else:
                res = evaluate(model, self.corpus.valid, length, cfg.sliding, self.ctx, on_batch)
        finally:
            done()
        if self.corpus is None:
            windows = {cls: d.pop("windows") for cls, d in res.items()}
            out = _recall_row(length, res, windows)
        else:
            windows = res.pop("windows")
            low, high = bootstrap.interval(windows["nll"], windows["count"], bootstrap.exp)
            out = {"length": length, "perplexity": res["perplexity"], "ppl_low": low, "ppl_high": high,
                   "bits_per_byte": res["bits_per_byte"], "loss": res["loss"], "tokens": res["tokens"],
                   "windows": len(windows["count"]), "status": "ok"}
        if self.ctx.main:
            write_json(self.paths.windows(row.stem, seed, length),
                       {"row": row.name, "seed": seed, "length": length, **windows})
        return out


def _recall_row(length: int, res: dict, windows: dict) -> dict:
    """A recall length's row: accuracy per distance class and over all, each with its interval
    (the bootstrap over sequences)."""
    for cls, d in res.items():
        d["acc_low"], d["acc_high"] = bootstrap.interval(windows[cls]["correct"], windows[cls]["count"])
    correct = sum((w["correct"] for w in windows.values()), [])
    count = sum((w["count"] for w in windows.values()), [])
    low, high = bootstrap.interval(correct, count)
    return {"length": length, "accuracy": sum(correct) / sum(count), "acc_low": low, "acc_high": high,
            "distances": res, "status": "ok"}


def describe(row: rows.Row, cfg: StudyConfig) -> dict:
    """What a row is, for results.json."""
    out = {"method": row.method, "kind": row.kind, "options": rows.fair_options(row, cfg.train_length)}
    if row.schedule is not None:  # per layer, as trained (its first layer's method is "method")
        layers = rows.fair_schedule(row, cfg.train_length, cfg.depth)
        out["schedule"] = Schedule(tuple(layers)).to_text()
        out["layers"] = layers
    if row.train:
        out["train_variants"] = list(row.train)
    if "drop" in row.train:
        out["positions_dropped_after"] = cfg.drop_fraction
        out["recalibration"] = "own warmup + cosine schedule, no weight decay (DroPE)"
    if "random" in row.train:
        out["random_positions"] = cfg.lm_config(row.name).random_positions
    if row.eval:
        out["variant"] = row.eval
    if row.base:
        out["base"] = row.base
    if row.finetune:
        out["finetune"] = {"steps": cfg.finetune_steps, "length": cfg.ft_length}
    return out


def describe_row(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    if "accuracy" in r:
        far = r["distances"]["far"]
        return (f"accuracy {r['accuracy']:.3f} [{r['acc_low']:.3f}, {r['acc_high']:.3f}], far "
                f"{far['accuracy']:.3f} (distance {far['distance_min']}-{far['distance_max']})")
    return (f"perplexity {r['perplexity']:.3f} [{r['ppl_low']:.3f}, {r['ppl_high']:.3f}], "
            f"{r['bits_per_byte']:.3f} bits/byte")


__all__ = ["Runner", "describe"]
