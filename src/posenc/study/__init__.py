"""``posenc study``: train short, test long (Press, Smith & Lewis 2021, "Train Short, Test Long:
Attention with Linear Biases Enables Input Length Extrapolation", arXiv:2108.12409).

For each positional encoding: train a small byte-level decoder (:class:`posenc.LM`) at one length,
then score the *same* validation tokens at every evaluation length, cut into windows of that length
(non-overlapping, as the paper's main setting, or sliding with ``sliding=STRIDE``). A method that
generalizes keeps its perplexity flat as the windows grow; one that does not gets worse. Every
number carries a 95% bootstrap interval over the scored windows, and ``seeds=N`` trains each row N
times. Flat perplexity does not show that a model *uses* far context (a recency-biased model keeps
it flat by ignoring it): ``task="recall"`` measures that instead, the accuracy of fetching a value
placed near, mid-sequence or far from its query.

    from posenc.study import StudyConfig, run_experiment
    results = run_experiment(StudyConfig.from_preset("smoke"), "runs/smoke")

The modules, in the order a run meets them:

    config.py      StudyConfig (frozen, checked as it is made) and PRESETS (the one source of the
                   sizes and of each preset's rows)
    rows.py        what a row of ``methods`` is: METHOD[:KEY=VALUE][+VARIANT], parsed once into a
                   Row; the fair-table rule
    cli.py         the command line, derived from StudyConfig's fields
    run.py         run_experiment: check the study, claim the directory, load the data, plan the
                   runs, then the pipeline; each room below entered once before training starts
    models.py      how each row's model is made, checked, saved and loaded: posenc's LM, or
                   (hf_config) a transformers architecture through hf_models.py
    hf_models.py   (hf_config) the rows on a transformers architecture, through posenc.hf.use;
                   imported only then, so transformers stays optional
    hf_evaluation.py  the study's evaluation of any transformers causal LM
    plan.py        the study's runs (a row at a seed: paths, TrainSettings)
    pipeline.py    the stages of a run: its model (trained, fine-tuned or loaded), its scores at
                   each length, its record in results.json
    results_writer.py  results.json as the stages fill it (ResultsWriter, its one writer), and a row's record
    executors.py   (jobs > 1, executor ray) the runs in worker processes or Ray tasks, the main
                   process keeping results.json and the one progress display
    worker.py      a worker's side: the stages of the study, its records and log lines as messages
    studied.py     the model a study trains: posenc's LM or hf_models' StudyModel
    train.py       the training loop (it reads only its TrainSettings), optimizer and schedule,
                   clean stop on Ctrl-C, RNG state
    variants.py    evaluation variants: RoPE scalings, blockwise attention; a model rebuilt under
                   a scaling (``scaled``, for ``posenc extend``)
    longrope_search.py  LongRoPE's evolutionary search of per-frequency factors (+longrope_searched)
    evaluation.py  windows and scoring at one length (perplexity, or recall accuracy)
    metrics.py     a run's typed score at one length (LMScore, RecallScore), as results.json writes it
    recall.py      the associative-recall task: sequences, batches, evaluation sets
    bootstrap.py   intervals from resampling the scored windows
    fairness.py    position parameters an evaluation uses but training never updated
    seeds.py       several seeds: the runs, their mean, interval and spread
    events.py      what training, evaluation and the stages report while they run (small records
                   handed to one callable from the top of the run)
    progress.py    those events drawn at the top of the run: bars, or log lines with an ETA
    results.py     the output directory's layout, results.json, CSV, markdown, figure
    compare.py     which rows differ: two runs side by side (``posenc report RUN_A RUN_B``), and the
                   rows of one study apart beyond both noises (the windows' intervals, the seeds' spread)
    sample.py      ``posenc sample``: a study's checkpoint continuing a text prompt
    report.py      ``posenc report``: a study as one self-contained HTML page, or two side by side
    figures.py     the study's figures (one fixed colour per method, shades for its variants)
    data.py        byte-level corpora: the built-in stdlib corpus, a file or folder, a Hugging Face dataset
    distributed.py DDP plumbing for ``torchrun ... -m posenc study``
    merge.py       ``posenc study merge``: the folders of a study's parts (``--shard K/N``) joined, checked

Every file is written to a temporary name and renamed, so a kill at any moment leaves either the
old or the new version; ``resume=True`` (``--resume``) continues from the last saved step and gives
the same final numbers as a run that never stopped.
"""

from __future__ import annotations

from .config import PRESETS, StudyConfig
from .evaluation import evaluate, windows
from .results import SCHEMA, load_results, markdown_table, results_csv, run_status, write_outputs
from .run import run_experiment

__all__ = [
    "PRESETS",
    "SCHEMA",
    "StudyConfig",
    "evaluate",
    "load_results",
    "markdown_table",
    "results_csv",
    "run_experiment",
    "run_status",
    "windows",
    "write_outputs",
]
