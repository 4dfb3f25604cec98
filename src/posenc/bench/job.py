"""One benchmark job: what a worker process measures, as a JSON-serialisable dataclass.

A job is one (level, mode, method, length, implementation) in one round. The parent process plans
the jobs, sends each one to a fresh worker as JSON (:meth:`Job.to_json`), and the worker sends back
a result record: the job's fields plus its measurements (see :mod:`posenc.bench.worker`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

POSENC = "posenc"  # the implementation under test; compared libraries name their own
BASELINE = "nope"  # every ratio is to posenc's NoPE of the same round, mode and length
CONTROL_LABEL = f"{BASELINE} (control)"  # NoPE measured a second time, as if another method


@dataclass
class Job:
    """One measurement, run in its own process.

    Args:
        level: a name in :data:`posenc.bench.levels.LEVELS` ("attention", "model").
        mode: "train" or "infer" (what a level offers, see its ``modes``).
        method: an encoding's registry name.
        length: sequence length N.
        impl: "posenc", or an implementation of a compared library (e.g. "x-transformers flash").
        control: NoPE measured again as if it were another method; its ratio to NoPE shows the noise.
        round: which round of the table this job belongs to (0-based).
        dim, heads, batch, depth, vocab: sizes (depth and vocab only matter at the model level).
        repeats: timed steps; the worker reports their median as this round's time.
        warmup: untimed steps before them.
        device, dtype, backend: where and how posenc runs ("auto" lets posenc choose the backend).
        threads: torch threads in the worker (None: torch's default).
        seed: torch seed for the inputs and the model.
        extra: level-specific options (JSON values), for levels that need more than the above.
    """

    level: str
    mode: str
    method: str
    length: int
    impl: str = POSENC
    control: bool = False
    round: int = 0
    dim: int = 512
    heads: int = 8
    batch: int = 1
    depth: int = 1
    vocab: int = 256
    repeats: int = 3
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "auto"
    threads: int | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The method as the tables print it: ``nope (control)`` for the control."""
        return CONTROL_LABEL if self.control else self.method

    @property
    def cell(self) -> tuple:
        """The table cell this job measures, whatever the round."""
        return cell_key(asdict(self))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> Job:
        """The job among ``data``'s keys (a result record holds more: they are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls.from_dict(json.loads(text))


def cell_key(record: dict) -> tuple:
    """(level, mode, length, method, impl, control) of a job or result record."""
    return (record["level"], record["mode"], record["length"], record["method"], record["impl"], bool(record.get("control")))


def label(record: dict) -> str:
    """A record's method as printed: ``nope (control)`` for the control row."""
    return CONTROL_LABEL if record.get("control") else record["method"]
