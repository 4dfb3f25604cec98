"""``posenc study``: train short, test long (Press, Smith & Lewis 2021, "Train Short, Test Long:
Attention with Linear Biases Enables Input Length Extrapolation", arXiv:2108.12409).

For each positional encoding: train a small byte-level decoder (:class:`posenc.LM`) at one length,
then score the *same* validation tokens at every evaluation length, cut into windows of that length
(non-overlapping, as the paper's main setting, or sliding with ``--sliding STRIDE``). A method that
generalizes keeps its perplexity flat as the windows grow; one that does not gets worse.

Everything needed to repeat or continue a run is under ``--out``:

    results.json          config, corpus fingerprint, versions, per method: loss curve, timing, eval
    results.csv           one row per method and evaluation length
    extrapolation.png     perplexity vs evaluation length, training length marked
    checkpoints/M.safetensors + M.json    final weights (safetensors.torch.save_model) + LMConfig
    state/M.pt            training state while M trains (model, optimizer, scheduler, RNG, step)

Every file is written to a temporary name and renamed, so a kill at any moment leaves either the
old or the new version. The batch of step s is a pure function of (seed, s) (see
:func:`posenc.data.train_batch`) and training has no other randomness, so ``--resume`` from the
state of step s gives the same final numbers as a run that never stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import io
import json
import math
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import distributed
from .files import atomic_write, write_json, write_text
from .data import DEFAULT_VALID_BYTES, Corpus, load_corpus, train_batch
from .encodings import available, get_class
from .model import LM, LMConfig

SCHEMA = "posenc-study/1"

# Model and training sizes per preset. smoke: CI, seconds per method. default: the README's main
# job, DESIGN.md §7 (about 15-20 minutes for every method on 2 CPU cores). paper: the ALiBi paper's
# setup (train at 512, evaluate to 16x) at a size for one GPU.
PRESETS: dict[str, dict] = {
    "smoke": dict(
        dim=32, depth=2, num_heads=2, train_length=32, eval_lengths=[32, 64, 128], steps=60,
        batch_size=8, lr=1e-2, valid_bytes=4096, checkpoint_every=20,
    ),
    "default": dict(
        dim=128, depth=4, num_heads=4, train_length=64, eval_lengths=[64, 128, 256, 512, 1024],
        steps=800, batch_size=32, lr=2e-3, valid_bytes=DEFAULT_VALID_BYTES, checkpoint_every=100,
    ),
    "paper": dict(
        dim=512, depth=8, num_heads=8, train_length=512, eval_lengths=[512, 1024, 2048, 4096, 8192],
        steps=5000, batch_size=32, lr=1e-3, valid_bytes=4 * DEFAULT_VALID_BYTES, checkpoint_every=250,
    ),
}

# CPU threads per preset when --threads is not given: a smoke-sized model gains nothing from more
# than one, and several threads on a busy machine cost it 10x (threads wait for each other).
PRESET_THREADS = {"smoke": 1}

# Memory bounds for evaluation batches: tokens per forward, and attention scores per forward
# (batch x heads x L x L), so long windows are scored a few at a time.
EVAL_TOKENS = 16384
EVAL_SCORES = 2**25

# Called after every finished training step as hook(method, step); tests use it to interrupt.
step_hook: Callable[[str, int], None] | None = None


@dataclass
class StudyConfig:
    """Everything that determines a study's numbers (``methods`` aside, each method is independent)."""

    preset: str = "default"
    methods: list[str] = field(default_factory=available)
    data: str = "default"
    dim: int = 128
    depth: int = 4
    num_heads: int = 4
    train_length: int = 64
    eval_lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    steps: int = 800
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int | None = None  # None: a tenth of the steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    valid_bytes: int = DEFAULT_VALID_BYTES
    sliding: int | None = None
    device: str = "cpu"
    checkpoint_every: int = 100

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides) -> "StudyConfig":
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {list(PRESETS)}, got {preset!r}")
        values = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
        return cls(preset=preset, **values)

    def __post_init__(self) -> None:
        if self.warmup is None and isinstance(self.steps, int):
            self.warmup = self.steps // 10

    def validate(self) -> "StudyConfig":
        """ValueError naming the parameter for any unusable value; call before any training."""
        if not self.methods:
            raise ValueError("methods must name at least one encoding")
        for m in self.methods:
            get_class(m)  # unknown -> ValueError listing the choices
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods has duplicates: {self.methods}")
        for name in ("dim", "depth", "num_heads", "train_length", "steps", "batch_size", "valid_bytes", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not self.eval_lengths:
            raise ValueError("eval_lengths must list at least one length")
        for n in self.eval_lengths:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"eval lengths must be integers >= 1, got {n!r}")
        if self.sliding is not None and not 1 <= self.sliding <= min(self.eval_lengths):
            raise ValueError(
                f"sliding stride must be between 1 and the smallest eval length ({min(self.eval_lengths)}), got {self.sliding}"
            )
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not isinstance(self.warmup, int) or not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError(f"weight_decay must be >= 0 and grad_clip > 0, got {self.weight_decay}, {self.grad_clip}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
        for m in self.methods:
            self.lm_config(m)  # dim/heads combination, encoding options
        self.eval_lengths = sorted(set(self.eval_lengths))
        return self

    def lm_config(self, method: str) -> LMConfig:
        # A bounded method (a learned table) gets exactly the training length: the paper's
        # setting, and what makes "cannot run past N" show at the first longer evaluation length.
        bounded = not get_class(method).extrapolates
        return LMConfig(
            encoding=method, dim=self.dim, depth=self.depth, num_heads=self.num_heads,
            max_positions=self.train_length if bounded else None,
        )

    def comparable(self) -> dict:
        """The fields a resumed run must share with the original (methods may be added)."""
        d = asdict(self)
        d.pop("methods")
        return d


@dataclass
class Paths:
    root: Path

    @property
    def results(self) -> Path:
        return self.root / "results.json"

    def checkpoint(self, method: str) -> Path:
        return self.root / "checkpoints" / f"{method}.safetensors"

    def state(self, method: str) -> Path:
        return self.root / "state" / f"{method}.pt"


# ---------------------------------------------------------------- files, written atomically


def save_checkpoint(model: LM, path: Path) -> None:
    """Weights as safetensors (shared tensors, e.g. T5's one table for all layers, stored once)
    next to ``path.with_suffix('.json')`` holding the :class:`LMConfig`."""
    from safetensors.torch import save_model

    from . import __version__

    atomic_write(path, lambda p: save_model(model, str(p)))
    write_json(path.with_suffix(".json"), {"lm_config": model.config.to_dict(), "posenc": __version__})


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> LM:
    """An :class:`LM` from a study checkpoint (``checkpoints/METHOD.safetensors``)."""
    from safetensors.torch import load_model

    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    model = LM(LMConfig(**meta["lm_config"]))
    load_model(model, str(path), device=str(device))
    return model.to(device)


# ---------------------------------------------------------------- training


def make_optimizer(model: LM, cfg: StudyConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``.

    Weight decay applies to weight matrices only; biases, norms and the encodings' own
    parameters (position tables, T5 buckets) are left undecayed, so no method is pulled to zero.
    """
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "encoding" not in name else rest).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))

    def factor(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class _StopOnSignal:
    """First Ctrl-C / SIGTERM: finish the current step, checkpoint, then stop. Second: stop now."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        for s, h in self.old.items():  # the next signal takes the usual path
            signal.signal(s, h)

    def __enter__(self) -> "_StopOnSignal":
        if self.enabled:
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train_method(
    method: str, cfg: StudyConfig, corpus: Corpus, paths: Paths, ctx: distributed.Context, ui: "Progress"
) -> tuple[LM, dict]:
    """Train one method (continuing from ``state/METHOD.pt`` when there is one); returns the
    model and its training record. Each process computes its share of every global batch."""
    torch.manual_seed(cfg.seed)  # the same initial weights whatever else this study ran before
    model = LM(cfg.lm_config(method)).to(ctx.device)
    opt, sched = make_optimizer(model, cfg)
    start, losses, elapsed = 0, [], 0.0
    state_path = paths.state(method)
    if state_path.exists():
        state = torch.load(state_path, map_location=ctx.device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        start, losses, elapsed = state["step"], list(state["losses"]), state["train_time_s"]
        ui.log(f"[{method}] resuming from step {start}/{cfg.steps}")

    def save_state(step: int) -> None:
        if ctx.main:
            state = {
                "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": _rng_state(), "losses": losses, "train_time_s": elapsed,
            }
            atomic_write(state_path, lambda p: torch.save(state, p))

    net = model
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (sinusoid and rotary tables) are the same on every process: no need to sync them.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        net = DistributedDataParallel(model, device_ids=ids, **no_sync)
    share = cfg.batch_size // ctx.world
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
    tokens_per_step = cfg.batch_size * cfg.train_length
    bar = ui.method_bar(method, cfg.steps, start)
    model.train()
    with _StopOnSignal(enabled=not ctx.distributed) as stop, ui.closing(bar):
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            x, y = train_batch(corpus.train, cfg.seed, step, cfg.batch_size, cfg.train_length)  # (B, T) each
            x, y = x[rows].to(ctx.device), y[rows].to(ctx.device)
            logits = net(x)  # (B/world, T, 256)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            mean_loss = distributed.all_sum(ctx, loss.detach().clone()) / ctx.world
            losses.append(float(mean_loss))
            elapsed += time.perf_counter() - t0
            done = step + 1
            if done % cfg.checkpoint_every == 0 and done < cfg.steps:
                save_state(done)
            ui.step(bar, method, done, cfg.steps, losses[-1], tokens_per_step * done / max(elapsed, 1e-9))
            if step_hook is not None:
                step_hook(method, done)
            if stop.requested and done < cfg.steps:
                save_state(done)
                raise KeyboardInterrupt
    tail = losses[-max(1, len(losses) // 20) :]
    record = {
        "steps": cfg.steps,
        "tokens": cfg.steps * tokens_per_step,
        "time_s": round(elapsed, 3),
        "tokens_per_s": round(cfg.steps * tokens_per_step / max(elapsed, 1e-9), 1),
        "final_loss": sum(tail) / len(tail),
        "losses": [round(v, 5) for v in losses],
    }
    return model, record


# ---------------------------------------------------------------- evaluation


def windows(total: int, length: int, stride: int) -> list[tuple[int, int]]:
    """(start, first scored offset) of each window of ``length`` inputs over ``total`` targets.

    Window ends advance by ``stride``; each window scores only the targets no earlier window
    scored, so every target is predicted exactly once, and the last window is moved back to stay
    a full ``length`` long. stride == length: the paper's non-overlapping evaluation.
    """
    out, scored = [], 0
    end = min(length, total)
    while scored < total:
        begin = max(0, end - length)
        out.append((begin, scored - begin))
        scored = end
        end = min(end + stride, total)
    return out


@torch.inference_mode()
def evaluate(model: LM, valid: torch.Tensor, length: int, stride: int | None, ctx: distributed.Context) -> dict:
    """Total NLL of the validation targets scored in windows of ``length``; every target once."""
    total = valid.numel() - 1
    length = min(length, total)
    wins = windows(total, length, stride or length)[ctx.rank :: ctx.world]
    heads = model.config.num_heads
    per_batch = max(1, min(EVAL_TOKENS // length, EVAL_SCORES // (heads * length * length)))
    nll = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [sum of NLL, scored targets]
    offsets = torch.arange(length + 1)
    model.eval()
    for i in range(0, len(wins), per_batch):
        chunk = wins[i : i + per_batch]
        starts = torch.tensor([b for b, _ in chunk])
        ids = valid[starts[:, None] + offsets].long().to(ctx.device)  # (B, L + 1)
        logits = model(ids[:, :-1])  # (B, L, 256)
        token_nll = F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")  # (B, L)
        first = torch.tensor([s for _, s in chunk], device=ctx.device)
        keep = torch.arange(length, device=ctx.device)[None, :] >= first[:, None]  # (B, L)
        nll[0] += token_nll[keep].double().sum()
        nll[1] += keep.sum()
    distributed.all_sum(ctx, nll)
    loss = float(nll[0] / nll[1])
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2),
        "tokens": int(nll[1]),
    }


# ---------------------------------------------------------------- progress


class Progress:
    """tqdm bars on a terminal (one for the study, one per method); plain log lines otherwise."""

    def __init__(self, enabled: bool, bars: bool | None = None) -> None:
        self.enabled = enabled
        self.bars = enabled and (sys.stderr.isatty() if bars is None else bars)
        self.study = None
        self._last_log = 0

    def study_bar(self, total: int, done: int) -> None:
        if self.bars:
            from tqdm import tqdm

            self.study = tqdm(total=total, initial=done, desc="study", unit="method", position=0, dynamic_ncols=True)

    def method_bar(self, method: str, total: int, start: int):
        self._every = max(1, total // 10)
        self._t0, self._start = time.perf_counter(), start
        if not self.bars:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=start, desc=method, unit="step", position=1, leave=False, dynamic_ncols=True)

    def step(self, bar, method: str, done: int, total: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif done % self._every == 0 or done == total:
            rate = (done - self._start) / max(time.perf_counter() - self._t0, 1e-9)
            eta = (total - done) / max(rate, 1e-9)
            self.log(f"[{method}] step {done}/{total} loss {loss:.3f} {tokens_per_s:,.0f} tok/s eta {eta:.0f}s")

    def eval_bar(self, method: str, total: int, done: int):
        if not self.bars:
            return None
        from tqdm import tqdm

        return tqdm(total=total, initial=done, desc=f"{method} eval", unit="length", position=1, leave=False, dynamic_ncols=True)

    def evaluating(self, bar, length: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"L={length}")

    def advance(self, bar) -> None:
        if bar is not None:
            bar.update(1)

    def close(self, bar) -> None:
        if bar is not None:
            bar.close()

    @contextlib.contextmanager
    def closing(self, bar):
        try:
            yield bar
        finally:
            if bar is not None:
                bar.close()

    def method_done(self) -> None:
        if self.study is not None:
            self.study.update(1)

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bars:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.study is not None:
            self.study.close()


# ---------------------------------------------------------------- the study


def versions(ctx: distributed.Context) -> dict:
    import numpy
    import safetensors

    from . import __version__

    v = {
        "posenc": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "safetensors": safetensors.__version__, "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(), "world_size": ctx.world, "device": str(ctx.device.type),
    }
    if ctx.device.type == "cuda":
        v["device_name"] = torch.cuda.get_device_name(ctx.device)
    return v


def check_out_dir(out: Path) -> None:
    """Create ``out`` and prove it writable, or ValueError (before any training)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"out directory {str(out)!r} is not writable: {err.strerror or err}") from None


def load_results(out: Path) -> dict | None:
    path = Paths(out).results
    if not path.exists():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); cannot resume from it") from None
    if results.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a posenc study ({results.get('schema')!r}); cannot resume from it")
    return results


def _check_same(saved: dict, cfg: StudyConfig, corpus: Corpus, out: Path) -> None:
    old = {k: v for k, v in saved["config"].items() if k != "methods"}
    new = cfg.comparable()
    diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        raise ValueError(f"--resume: {out} was run with a different config ({'; '.join(diff)}); "
                         "use the original options or another --out")
    if saved.get("corpus", {}).get("sha256") != corpus.fingerprint["sha256"]:
        raise ValueError(f"--resume: the corpus differs from the one {out} was trained on "
                         f"(sha256 {saved.get('corpus', {}).get('sha256')} vs {corpus.fingerprint['sha256']})")


def prepare(cfg: StudyConfig, out: Path, resume: bool, ctx: distributed.Context) -> tuple[Corpus, dict]:
    """Validate everything and load the data: every user error surfaces here, before training."""
    cfg.validate()
    if cfg.batch_size % ctx.world:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the number of processes ({ctx.world})")
    saved = load_results(out) if out.exists() else None
    if saved is not None and not resume:
        raise ValueError(f"{out} already holds a study (results.json); pass --resume to continue it, or choose another --out")
    corpus = load_corpus(cfg.data, cfg.valid_bytes)
    if corpus.train.numel() < cfg.train_length + 2:
        raise ValueError(f"train_length ({cfg.train_length}) needs a training split longer than {corpus.train.numel()} bytes")
    if max(cfg.eval_lengths) > corpus.valid_tokens:
        raise ValueError(
            f"eval length {max(cfg.eval_lengths)} exceeds the {corpus.valid_tokens} validation tokens "
            f"(valid_bytes={cfg.valid_bytes}, or a small corpus); use shorter --eval-lengths or more data"
        )
    if saved is not None:
        _check_same(saved, cfg, corpus, out)
        results = saved
        results["config"]["methods"] = list(dict.fromkeys([*saved["config"]["methods"], *cfg.methods]))
    else:
        results = {
            "schema": SCHEMA, "status": "running", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": asdict(cfg), "seed": cfg.seed,
            "corpus": corpus.fingerprint, "methods": {},
        }
    if ctx.main:
        check_out_dir(out)  # last: an earlier error leaves no empty folder behind
    results["versions"] = versions(ctx)
    return corpus, results


def cannot_run(model: LM, length: int) -> str | None:
    """Why ``model`` cannot score windows of ``length`` (a bounded position table), or None."""
    limit = model.max_length
    if limit is not None and length > limit:
        return f"cannot run past {limit}: its position table has {limit} rows"
    return None


def run_method(method: str, cfg: StudyConfig, corpus: Corpus, results: dict, paths: Paths,
               ctx: distributed.Context, ui: Progress) -> None:
    entry = results["methods"].get(method)
    if entry is None or entry.get("status") not in ("trained", "done"):
        model, record = train_method(method, cfg, corpus, paths, ctx, ui)
        entry = {
            "status": "trained", "model": model.config.to_dict(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint": str(paths.checkpoint(method).relative_to(paths.root)),
            "train": record, "eval": [],
        }
        results["methods"][method] = entry
        if ctx.main:
            save_checkpoint(model, paths.checkpoint(method))
            write_json(paths.results, results)
            paths.state(method).unlink(missing_ok=True)  # the final checkpoint replaces it
        ui.log(f"[{method}] trained {record['steps']} steps in {record['time_s']:.1f}s "
               f"({record['tokens_per_s']:,.0f} tok/s), final loss {record['final_loss']:.3f}")
    else:
        model = load_checkpoint(paths.checkpoint(method), ctx.device)
        if ctx.main:  # a kill right after the final checkpoint can leave the last state behind
            paths.state(method).unlink(missing_ok=True)
    done_lengths = {e["length"] for e in entry["eval"]}
    todo = [n for n in cfg.eval_lengths if n not in done_lengths]
    bar = ui.eval_bar(method, len(cfg.eval_lengths), len(cfg.eval_lengths) - len(todo))
    for length in todo:
        ui.evaluating(bar, length)
        t0 = time.perf_counter()
        reason = cannot_run(model, length)
        if reason:
            row = {"length": length, "perplexity": None, "bits_per_byte": None, "loss": None,
                   "tokens": corpus.valid_tokens, "status": reason}
        else:
            row = {"length": length, **evaluate(model, corpus.valid, length, cfg.sliding, ctx), "status": "ok"}
        row["time_s"] = round(time.perf_counter() - t0, 3)
        entry["eval"].append(row)
        entry["eval"].sort(key=lambda e: e["length"])
        ui.log(f"[{method}] L={length}: " + (reason or f"perplexity {row['perplexity']:.3f}, {row['bits_per_byte']:.3f} bits/byte"))
        ui.advance(bar)
        if ctx.main:
            write_json(paths.results, results)
    ui.close(bar)
    entry["status"] = "done"
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, paths.root)


def write_outputs(results: dict, out: Path) -> None:
    """results.csv and extrapolation.png from results.json's content (methods finished so far)."""
    from . import plots

    write_text(out / "results.csv", results_csv(results))
    plots.save(plots.extrapolation_figure(results), out / "extrapolation.png")


def results_csv(results: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "train_length", "eval_length", "perplexity", "bits_per_byte", "loss", "tokens",
                "status", "train_time_s", "train_tokens_per_s", "parameters"])
    for method, e in results["methods"].items():
        for row in e["eval"]:
            w.writerow([method, results["config"]["train_length"], row["length"], row["perplexity"],
                        row["bits_per_byte"], row["loss"], row["tokens"], row["status"], e["train"]["time_s"],
                        e["train"]["tokens_per_s"], e["parameters"]])
    return buf.getvalue()


def markdown_table(results: dict, key: str = "perplexity") -> str:
    """Methods x evaluation lengths; a bounded method past its table shows 'n/a (> N)'."""
    lengths = sorted({r["length"] for e in results["methods"].values() for r in e["eval"]})
    train_len = results["config"]["train_length"]
    head = ["method", *(f"{n}{'*' if n == train_len else ''}" for n in lengths), "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, e in results["methods"].items():
        by = {r["length"]: r for r in e["eval"]}
        cells = []
        for n in lengths:
            r = by.get(n)
            if r is None:
                cells.append("")
            elif r[key] is None:
                cells.append(f"n/a (> {e['model'].get('max_positions') or train_len})")
            else:
                cells.append(f"{r[key]:.3f}")
        lines.append("| " + " | ".join([method, *cells, f"{e['train']['time_s']:.0f}"]) + " |")
    return "\n".join(lines)


def run_experiment(cfg: StudyConfig, out: str | Path, *, resume: bool = False, progress: bool = True,
                   ctx: distributed.Context | None = None) -> dict:
    """Run (or continue) a study; returns the results dict (also in ``out/results.json``)."""
    ctx = ctx or distributed.Context(torch.device(cfg.device))
    out = Path(out)
    failure = None
    try:
        corpus, results = prepare(cfg, out, resume, ctx)
    except ValueError as err:
        failure = err
    if ctx.distributed:  # every process stops together if any of them found a user error
        anyone, main_failed = distributed.flags(ctx, failure is not None, failure is not None and ctx.main)
        if anyone and failure is None:
            raise ValueError("another process rejected the configuration (see its message)")
        if failure is not None and not ctx.main and not main_failed:
            print(f"posenc study (rank {ctx.rank}): error: {failure}", file=sys.stderr)
    if failure is not None:
        raise failure
    paths = Paths(out)
    ui = Progress(progress and ctx.main)
    if ctx.main:
        write_json(paths.results, results)
    todo = cfg.methods
    ui.study_bar(len(todo), sum(results["methods"].get(m, {}).get("status") == "done" for m in todo))
    ui.log(f"posenc study: {len(todo)} method(s), train length {cfg.train_length}, eval {cfg.eval_lengths}, "
           f"{cfg.steps} steps of {cfg.batch_size} x {cfg.train_length} bytes, corpus "
           f"{results['corpus']['files']} files / {results['corpus']['bytes']:,} bytes, out {out}")
    try:
        for method in todo:
            if results["methods"].get(method, {}).get("status") == "done":
                ui.log(f"[{method}] done already, skipped")
                continue
            run_method(method, cfg, corpus, results, paths, ctx, ui)
            ui.method_done()
    finally:
        ui.finish()
    results["status"] = "done" if all(results["methods"].get(m, {}).get("status") == "done"
                                      for m in results["config"]["methods"]) else "partial"
    if ctx.main:
        write_json(paths.results, results)
        write_outputs(results, out)
        write_text(out / "results.md", markdown_table(results) + "\n")
        with contextlib.suppress(OSError):
            (out / "state").rmdir()  # only when empty: no method is mid-training
    return results


# ---------------------------------------------------------------- command line


def add_study_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="sizes: smoke (CI, seconds), default (~15-20 min on 2 CPU cores), paper (L=512, 16x, a GPU)")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help=f"encodings to study (default: all of {', '.join(available())})")
    p.add_argument("--data", help="'default' (Python stdlib source), a text file or folder, or hf:NAME[:CONFIG]")
    p.add_argument("--train-length", type=int, help="training sequence length in bytes")
    p.add_argument("--eval-lengths", type=int, nargs="+", metavar="L", help="evaluation window lengths")
    p.add_argument("--steps", type=int, help="training steps per method")
    p.add_argument("--batch-size", type=int, help="sequences per step (split across processes under torchrun)")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate (linear warmup, cosine decay)")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--dim", type=int, help="model width")
    p.add_argument("--depth", type=int, help="layers")
    p.add_argument("--num-heads", type=int, help="attention heads")
    p.add_argument("--valid-bytes", type=int, help="validation tokens scored at every length (default 65536)")
    p.add_argument("--sliding", type=int, metavar="STRIDE", help="sliding-window evaluation with this stride (default: non-overlapping)")
    p.add_argument("--checkpoint-every", type=int, help="steps between resumable checkpoints")
    p.add_argument("--seed", type=int, help="seed for initial weights and data order (default 0)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default=None, help="output directory (default runs/PRESET)")
    p.add_argument("--resume", action="store_true", help="continue the study in --out: finished methods are skipped")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: 1 for smoke, else torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress output")


_ARG_FIELDS = ["methods", "data", "train_length", "eval_lengths", "steps", "batch_size", "lr", "warmup", "dim",
               "depth", "num_heads", "valid_bytes", "sliding", "checkpoint_every", "seed", "device"]


def config_from_args(args: argparse.Namespace, saved: dict | None = None) -> StudyConfig:
    """Preset defaults, then (when resuming) the saved run's config, then the options given."""
    given = {k: getattr(args, k) for k in _ARG_FIELDS if getattr(args, k, None) is not None}
    preset = args.preset or (saved or {}).get("preset") or "default"
    base = dict(PRESETS.get(preset, {}))
    if saved is not None:
        names = {f.name for f in fields(StudyConfig)}
        base.update({k: v for k, v in saved.items() if k in names and k != "preset"})
    base.update(given)
    if "device" not in base:
        base["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if "methods" not in base:
        base["methods"] = available()
    return StudyConfig.from_preset(preset, **base)


def run_study(args: argparse.Namespace) -> int:
    out = Path(args.out or f"runs/{args.preset or 'default'}")
    saved = None
    if args.resume and (out / "results.json").exists():
        saved = (load_results(out) or {}).get("config")
    cfg = config_from_args(args, saved)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"threads must be >= 1, got {args.threads}")
    cfg.validate()  # the device string must be valid before a process group is joined
    ctx = distributed.setup(cfg.device)
    code = 0
    threads = torch.get_num_threads()
    if args.threads or PRESET_THREADS.get(cfg.preset):
        torch.set_num_threads(args.threads or PRESET_THREADS[cfg.preset])
    try:
        results = run_experiment(cfg, out, resume=args.resume, progress=not args.quiet, ctx=ctx)
        if ctx.main:
            print(f"\nperplexity (bytes) of {results['corpus'].get('valid_bytes_used')} validation tokens at each "
                  f"evaluation length; trained at {cfg.train_length} (*)\n")
            print(markdown_table(results))
            print(f"\nresults in {out}/ (results.json, results.csv, extrapolation.png, checkpoints/); "
                  f"`posenc report {out}` makes an HTML page")
    except ValueError as err:
        if not ctx.distributed:
            raise
        if ctx.main:
            print(f"posenc study: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        if not ctx.distributed:
            print(f"posenc study: interrupted; finished work is in {out}, continue with --resume", file=sys.stderr)
            return 130
        code = 130
    except BaseException:
        if not ctx.distributed:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        torch.set_num_threads(threads)
    return distributed.finish(ctx, code)
