"""``posenc bench``: speed and memory of every method side by side, as ratios to NoPE.

Protocol. Every job, one (level, mode, method, length, implementation), runs in a fresh process
(:mod:`posenc.bench.worker`), so no measurement inherits another's allocator state, caches or
peak memory. The jobs of a table run in rounds (:mod:`posenc.bench.plan`): each round runs every
job once, NoPE included, in an order rotated from round to round; a method's ratio in a round is to
the NoPE of that round, and the table reports the median ratio over rounds with its min-max
(:mod:`posenc.bench.stats`). A control row, NoPE measured again as if another method, shows the
noise floor: it must read 1.00x within its spread.

Levels (:mod:`posenc.bench.levels`, one module each): ``attention`` times the core of one
:class:`posenc.Attention` call (q, k, v given: the encoding's hooks plus the backend); ``model`` a
training step or a forward of the study's LM, optionally next to the same model built with another
library (:mod:`posenc.bench.libraries`, :mod:`posenc.bench.libraries.xtransformers`). Every result records the
machine (:mod:`posenc.bench.machine`) and the registered backend each posenc attention ran
(``Attention.last_backend``).

    from posenc.bench import bench, markdown_table
    results = bench(methods=["alibi"], lengths=[256], rounds=3)
    print(markdown_table(results))
"""

from __future__ import annotations

from .harness import Results, bench, launch, run
from .job import BASELINE, CONTROL_LABEL, POSENC, Job
from .levels import LEVELS, Level, Refused, Workload
from .output import check_out, write_outputs
from .plan import Config, configure, plan
from .stats import summarize
from .tables import compare_table, csv_text, markdown_table

__all__ = [
    "BASELINE", "CONTROL_LABEL", "Config", "Job", "LEVELS", "Level", "POSENC", "Refused", "Results", "Workload",
    "bench", "check_out", "compare_table", "configure", "csv_text", "launch", "markdown_table", "plan", "run",
    "summarize", "write_outputs",
]
