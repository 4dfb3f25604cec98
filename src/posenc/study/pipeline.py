"""The stages after the plan (:mod:`.plan`), one run (a row at a seed) at a time:

- **model**: the run's model, in memory, from its checkpoint, or made by the *train* stage; an
  evaluated row (``+yarn``, ``+blockwise``, ...) takes its base run's model.
- **train**: a trained row's initial model (the seed's, :meth:`.models.Models.initial`) or a
  fine-tuned row's start (its base's trained weights, ``+ft``), its batches, then the training loop
  (:func:`.train.train`) with the run's :class:`~.train.TrainSettings`; checkpointed.
- **score**: every evaluation length not yet in results.json, under the row's variant
  (:mod:`.variants`); each length's record gets its 95% bootstrap interval (:mod:`.bootstrap`),
  its per-window numbers are saved beside results.json, and a model with position parameters is
  checked for parameters it uses there but never trained (:mod:`.fairness`).
- **write**: the run's record into results.json (:class:`.results_writer.ResultsWriter`) after each step, so that an
  interrupted study continues exactly where it stopped, and the seeds' aggregate (:mod:`.seeds`).

A run whose training diverges (:class:`.train.Diverged`), or a model with non-finite parameters, is
recorded as ``diverged`` (with its step) without a checkpoint or evaluation, and so are the runs
evaluated or fine-tuned from it; the study goes on with the other rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from ..encodings.rope import RoPE
from ..errors import UsageError
from ..files import write_json
from . import bootstrap, distributed, fairness, recall, variants
from .data import Corpus, train_batch
from .evaluation import cannot_run, evaluate, evaluate_recall
from .events import LengthScored, LengthStarted, Log, Report, RunDone, ScoringEnded, ScoringStarted, StudyEnded, StudyStarted, Warn
from .longrope_search import SearchSettings, search
from .metrics import LMScore, RecallScore, Score
from .plan import Plan, Run
from .results import write_outputs
from .results_writer import ResultsWriter, record_of
from .rows import SEARCHED
from .studied import StudiedModel
from .train import Diverged, StateError, TrainSettings, train


@dataclass
class Stages:
    """What the stages share: the plan, the data (None: the recall task generates its own), the
    results being written, this process's place, and where the run's events go (:mod:`.events`:
    the top of the run shows them)."""

    plan: Plan
    corpus: Corpus | None
    writer: ResultsWriter
    ctx: distributed.Context
    report: Report
    _last: tuple[Run, StudiedModel | None] | None = None  # the last model made (None: diverged): a row's variants reuse it
    _searched: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (base run, length) -> its block

    # -- model ------------------------------------------------------------------------------------

    def model(self, run: Run) -> StudiedModel | None:
        """The final model of ``run``: in memory, from its checkpoint, or trained now (continuing
        from its saved state) and checkpointed; None when its training diverged (its run, or its
        base's, says ``diverged``).

        Raises:
            UsageError: the run's checkpoint cannot be loaded (naming it, and how to train the row again).
        """
        if run.settings is None:  # an evaluated row: its base run's model
            return self.model(run.parent)
        if self._last is not None and self._last[0] is run:
            return self._last[1]
        record = self.writer.run_of(run)
        if record is not None and record.get("status") == "diverged":
            return None
        model = None
        if record is not None and record.get("status") in ("trained", "done"):
            if run.checkpoint.exists():
                try:
                    model = self.plan.models.load(run.checkpoint, run.row, self.ctx.device)
                except UsageError as err:
                    raise UsageError(f"{err}; delete {run.checkpoint} and continue with resume to train {run.label} "
                                     "again") from None
            else:
                self.report(Warn(f"[{run.label}] its checkpoint {run.checkpoint} is missing: training it again"))
        if model is None:
            model = self.train(run, run.settings)
        self._last = (run, model)
        return model

    # -- train ------------------------------------------------------------------------------------

    def train(self, run: Run, settings: TrainSettings) -> StudiedModel | None:
        """Train ``run``'s model as ``settings`` say, checkpoint it and record it; None (recorded as
        diverged) when the training, or a fine-tune's base, diverged.

        Raises:
            UsageError: a kept checkpoint cannot be resumed (naming it, and how to train the row again).
        """
        models = self.plan.models
        if run.row.kind == "finetune":
            base = self.model(run.parent)
            if base is None:
                self.diverged(run, {"base": run.row.base, "reason": f"its base row {run.row.base} diverged"})
                return None
            # the base's weights under the row's scaling: a searched row's, the factors searched for the fine-tuning length
            scaling = self.searched(run, base, self.plan.cfg.ft_length) if run.row.variant == SEARCHED else None
            start = models.build(run.row, scaling)
            start.load_state_dict({k: v.detach().clone() for k, v in base.state_dict().items()})
        else:
            start = models.initial(run.row, run.seed)
        try:
            model, record = train(run.label, settings, start, self.batches(settings), run.state, self.ctx, self.report)
        except StateError as err:
            raise UsageError(f"{err}; delete it and continue with resume: {run.label} then trains again from step 0, "
                             "other methods keep their results") from None
        except Diverged as err:
            if self.ctx.main:
                run.state.unlink(missing_ok=True)  # its states lead to the same step again
            self.diverged(run, {"steps": settings.steps, "diverged_at_step": err.step, "reason": str(err),
                                "losses": [round(v, 5) for v in err.losses]})
            return None
        if run.row.kind == "finetune":
            record = replace(record, base=run.row.base)
        self.writer.set(run, {
            "status": "trained", "seed": run.seed, "model": models.record(model),
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint": str(run.checkpoint.relative_to(self.writer.paths.root)), "train": record.to_json(), "eval": [],
        })
        if self.ctx.main:
            models.save(model, run.checkpoint)
            self.writer.save()
            run.state.unlink(missing_ok=True)  # the final checkpoint replaces it
        self.report(Log(f"[{run.label}] trained {record.steps} steps in {record.time_s:.1f}s "
                        f"({record.tokens_per_s:,.0f} tok/s), final loss {record.final_loss:.3f}"))
        return model

    def searched(self, run: Run, model: StudiedModel, length: int) -> dict[str, Any]:
        """The longrope block LongRoPE's search finds for ``model`` (unscaled) at ``length``: its
        fitness on training-split windows (the last ones), never on the validation bytes; kept in
        ``state/BASE[.seedN].search-L{length}.json`` (BASE: the run whose model is searched; a resumed
        study evaluates nothing twice) and memoised: the evaluated row and its ``+ft`` share it. At or
        below the training length: the plain rotation (all 1)."""
        cfg = self.plan.cfg
        source = run.parent  # the run whose model is searched (an evaluated row's, and a fine-tune's start)
        key = (source.label, length)
        if key in self._searched:
            return self._searched[key]
        ropes = [e for e in variants.encodings(model) if isinstance(e, RoPE)]
        if not ropes:
            raise UsageError(f"[{run.label}] +{SEARCHED} needs a RoPE model")
        enc = ropes[0]
        if length <= cfg.train_length:
            block = variants.scaling_block("longrope", 1.0, cfg.train_length, enc.base, enc.rotary_dim)
        else:
            if self.corpus is None:
                raise UsageError(f"[{run.label}] +{SEARCHED}: the search scores text (task lm)")
            settings = SearchSettings(train_length=cfg.train_length, target_length=length, seed=run.seed)
            need = settings.sequences * length + 1
            if self.corpus.train.numel() < need:
                raise UsageError(f"[{run.label}] +{SEARCHED}: the search at {length} needs {need} training bytes, "
                                 f"the training split has {self.corpus.train.numel()}")
            state = source.state.with_name(f"{source.state.stem}.search-L{length}.json")
            self.report(Log(f"[{run.label}] LongRoPE's search for L={length}"))
            # (one summary line below, not one per individual)
            result = search(model, self.corpus.train[-need:], settings, state=state, resume=state.exists())
            self.report(Log(f"[{run.label}] searched L={length}: ppl {result.perplexity:.3f} on training windows "
                            f"(PI {result.baselines['pi']:.3f}, YaRN {result.baselines['yarn']:.3f}), "
                            f"{result.seconds_per_individual:.2f}s per individual"))
            block = result.block()
        self._searched[key] = block
        return block

    def batches(self, settings: TrainSettings) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """step -> the global batch of ``settings`` (a pure function of its data seed and the step).

        Raises:
            UsageError: ``pack_documents`` is set but the data has no file boundaries to pack by.
        """
        seed, size, length = settings.data_seed, settings.batch_size, settings.length
        corpus = self.corpus
        if corpus is None:
            return lambda step: recall.train_batch(seed, step, size, length)
        documents = corpus.train_documents if self.plan.cfg.pack_documents else None
        if self.plan.cfg.pack_documents and documents is None:
            raise UsageError("pack_documents needs a corpus of files (the built-in one, a file or a folder); this data has no file boundaries")
        return lambda step: train_batch(corpus.train, seed, step, size, length, documents)

    def diverged(self, run: Run, train: dict) -> None:
        """Record ``run`` as diverged (no model, no evaluation)."""
        self.writer.set(run, {"status": "diverged", "seed": run.seed, "model": self.plan.models.planned(run.row),
                            "checkpoint": None, "train": train, "eval": []})
        self.report(Warn(f"[{run.label}] diverged: {train['reason']}; recorded as diverged, going on with the other rows"))
        self.writer.save()

    # -- the stages of one run ----------------------------------------------------------------------

    def run(self, run: Run) -> None:
        """Get ``run``'s model, then score every length not yet done, writing as it goes."""
        model = self.model(run)
        if model is not None and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
            self.diverged(run, {"reason": f"non-finite parameters ({', '.join(bad[:3])})"})
            model = None
        if model is None:
            record = self.writer.run_of(run)
            if record is None or record.get("status") != "diverged":
                self.diverged(run, {"base": run.row.base, "reason": f"its base row {run.row.base} diverged"})
            self.writer.aggregate(run)
            return
        if self.ctx.main:  # a kill right after the final checkpoint can leave the last state behind
            run.state.unlink(missing_ok=True)
        record = self.writer.run_of(run)
        if run.settings is None and (record is None or record.get("status") == "pending"):
            base = self.writer.run_of(run.parent)
            if base is None:  # (its model is the base run's, which recorded it)
                raise UsageError(f"[{run.label}] its base run {run.parent.label} has no record in results.json")
            record = self.writer.set(run, {
                "status": "trained", "seed": run.seed, "model": base["model"], "parameters": base["parameters"],
                "checkpoint": base["checkpoint"], "train": {}, "eval": [],
            })
        if record is None:  # (training or loading the model recorded it)
            raise UsageError(f"[{run.label}] has a model but no record in results.json")
        self.score(run, model, record)
        record["status"] = "done"
        self.writer.aggregate(run)

    # -- score ------------------------------------------------------------------------------------

    def score(self, run: Run, model: StudiedModel, record: dict) -> None:
        """Score ``model`` as ``run``'s row at every evaluation length not yet in ``record``."""
        cfg = self.plan.cfg
        done_lengths = {e["length"] for e in record["eval"]}
        todo = [n for n in cfg.eval_lengths if n not in done_lengths]
        self.report(ScoringStarted(run.label, len(cfg.eval_lengths), len(cfg.eval_lengths) - len(todo)))
        initial = None
        try:
            for length in todo:
                t0 = time.perf_counter()
                searched = (lambda n, model=model: self.searched(run, model, n)) if run.row.eval == SEARCHED else None
                with variants.applied(model, run.row, length, cfg.train_length, searched) as applied:
                    self.report(LengthStarted(run.label, length))
                    score = self.score_length(model, run, length)
                    if score.ok and fairness.position_parameters(model):
                        if initial is None:
                            initial = self.plan.models.initial(run.row.ancestor, run.seed).to(self.ctx.device)
                        score.untrained = fairness.untrained_used(model, initial, self.probe(length))
                score.variant = applied
                score.time_s = round(time.perf_counter() - t0, 3)
                record["eval"].append(score.to_json())
                record["eval"].sort(key=lambda e: e["length"])
                self.report(LengthScored(run.label, length, score.log_line()))
                self.writer.save()
        finally:
            self.report(ScoringEnded(run.label))

    def probe(self, length: int) -> torch.Tensor:
        """(1, L + 1) tokens for the untrained-parameter check: the first validation window, or a
        recall sequence with its pairs far away."""
        if self.corpus is None:
            return recall.eval_set(length, "far", 1, self.plan.cfg.train_length)[0].to(self.ctx.device)
        return self.corpus.valid[: length + 1].long()[None].to(self.ctx.device)

    def score_length(self, model: StudiedModel, run: Run, length: int) -> Score:
        """One length's score (its per-window numbers saved beside results.json)."""
        cfg = self.plan.cfg
        reason = cannot_run(model, length)
        if reason:
            if self.corpus is None:
                return RecallScore(length=length, status=reason)
            return LMScore(length=length, status=reason, tokens=self.corpus.valid_tokens)
        score: Score
        if self.corpus is None:
            classes = evaluate_recall(model, length, cfg.train_length, cfg.recall_sequences, self.ctx, self.report)
            windows = {cls: d.pop("windows") for cls, d in classes.items()}
            score = _recall_score(length, classes, windows)
        else:
            res = evaluate(model, self.corpus.valid, length, cfg.sliding, self.ctx, self.report)
            windows = res.pop("windows")
            low, high = bootstrap.interval(windows["nll"], windows["count"], bootstrap.exp)
            score = LMScore(length=length, perplexity=res["perplexity"], ppl_low=low, ppl_high=high,
                            bits_per_byte=res["bits_per_byte"], loss=res["loss"], tokens=res["tokens"],
                            windows=len(windows["count"]))
        if self.ctx.main:
            write_json(self.writer.paths.window_scores(run.row.stem, run.seed, length),
                       {"row": run.row.name, "seed": run.seed, "length": length, **windows})
        return score


Execute = Callable[[ResultsWriter, Sequence[Run], Report], None]  # runs the given runs, filling the writer (see .executors)


def run_all(study: Plan, corpus: Corpus | None, results: dict, ctx: distributed.Context, report: Report,
            started: float, execute: Execute | None = None) -> dict:
    """Every run of ``study`` through the stages (:class:`Stages`), skipping the runs a resumed
    study finished, then the study's status and wall time into results.json with its tables and
    figures; returns the results. ``results``: as :func:`.run.prepare` made them (already in
    results.json); ``report``: where the study's events go (:mod:`.events`); ``started``: when the
    study began (``time.perf_counter()``); ``execute``: runs the runs not yet finished (in plan
    order), several at a time (:mod:`.executors`); None: one after another in this process."""
    cfg, paths = study.cfg, study.paths
    writer = ResultsWriter(results, paths, ctx, cfg)
    stages = Stages(study, corpus, writer, ctx, report)
    what = (f"{cfg.steps} steps of {cfg.batch_size} x {cfg.train_length} bytes" if corpus is not None else
            f"{cfg.steps} steps of {cfg.batch_size} recall sequences of {cfg.train_length}")
    report(Log(f"posenc study: {len(cfg.rows)} row(s) x {cfg.seeds} seed(s), task {cfg.task}, train length "
               f"{cfg.train_length}, eval {cfg.eval_lengths}, {what}, out {paths.root}"))
    if results.get("hf"):
        hf = results["hf"]
        report(Log(f"model: {hf['model_type']} from {hf['path']} (sha256 {hf['sha256'][:12]}), "
                   f"{hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, {hf['num_attention_heads']} heads "
                   f"({hf['num_key_value_heads']} key/value), vocab {hf['vocab_size']}, random initialisation"))
    if corpus is not None:
        report(Log(corpus.summary()))
        for s in corpus.skipped:
            report(Warn(f"data: skipped {s['file']}: {s['reason']}"))
    report(StudyStarted(len(study.runs)))
    try:
        todo = []
        for run in study.runs:
            if writer.finished(run):
                report(Log(f"[{run.label}] {(writer.run_of(run) or {}).get('status')} already, skipped"))
                report(RunDone(run.label))
            else:
                todo.append(run)
        if execute is None:
            for run in todo:
                stages.run(run)
                report(RunDone(run.label))
        else:
            execute(writer, todo, report)
    finally:
        report(StudyEnded())
    count = results["config"].get("seeds", 1)  # (every row of the study: a resumed study's saved rows too)
    if results.get("shard"):  # (a part of a study: its own runs)
        status = [writer.run_of(run) for run in study.runs]
    else:
        status = [record_of(results, name, i) for name in results["config"]["methods"] for i in range(count)]
    results["status"] = "done" if all(s is not None and s.get("status") in ("done", "diverged") for s in status) \
        else "partial"
    # Wall time of the study: this run's, plus that of the earlier runs of a resumed study that finished.
    results["wall_s"] = round(results.get("wall_s", 0.0) + time.perf_counter() - started, 1)
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, paths.root, table=True)
        with contextlib.suppress(OSError):
            (paths.root / "state").rmdir()  # only when empty: no method is mid-training
    return results


def _recall_score(length: int, res: dict, windows: dict) -> RecallScore:
    """A recall length's score: accuracy per distance class and over all, each with its interval
    (the bootstrap over sequences)."""
    for cls, d in res.items():
        d["acc_low"], d["acc_high"] = bootstrap.interval(windows[cls]["correct"], windows[cls]["count"])
    correct: list[int] = sum((w["correct"] for w in windows.values()), [])
    count: list[int] = sum((w["count"] for w in windows.values()), [])
    low, high = bootstrap.interval(correct, count)
    return RecallScore(length=length, accuracy=sum(correct) / sum(count), acc_low=low, acc_high=high, distances=res)


__all__ = ["Stages", "run_all"]
