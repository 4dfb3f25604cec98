"""Training one run (a method and seed, or a fine-tune): AdamW with warmup and cosine decay,
periodic resumable states, a clean stop on Ctrl-C / SIGTERM, and DistributedDataParallel under
torchrun.

The batch of step s is a pure function of (seed, s) (see :func:`posenc.study.data.train_batch` and
:func:`posenc.study.recall.train_batch`) and the RNG state is saved with the weights, so a run
continued from the state of step s computes the same numbers as one that never stopped. A ``+drop``
run removes the model's positions at a fixed step (:meth:`posenc.LM.drop_positions`); its states
from then on hold the model without them.

Divergence: a step whose loss or gradient norm is not finite, or whose forward fails on non-finite
activations once the weights have blown up (above ``DIVERGED_WEIGHT``), raises :class:`Diverged`
before the optimizer applies it; the study records the run as diverged and goes on.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import pickle
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from ..files import atomic_write
from . import distributed
from .events import Report, StepDone, TrainEnded, TrainStarted, ignore
from .studied import StudiedModel

IGNORE = -100  # a target that is not scored


def schedule(steps: int, warmup: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Learning-rate factor of each step: linear warmup, then cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


RECALIBRATION_WARMUP = 0.03  # DroPE's recalibration: warmup share of its own steps (the authors' trainer config)


def drope_schedule(steps: int, drop_at: int, warmup: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Learning-rate factor of a DroPE row (Gelberg et al. 2025, "Extending the Context of Pretrained
    LLMs by Dropping Their Positional Embeddings", the recalibration recipe of the authors' code):
    steps 0..drop_at-1 are the RoPE pretraining with a complete schedule of their own (warmup, cosine
    decay to ``min_lr_ratio``), and the recalibration without positions, steps drop_at..steps-1,
    starts again: a warmup of ``RECALIBRATION_WARMUP`` of its steps to the peak learning rate, then
    cosine decay to ``min_lr_ratio``. (The old rule ran the recalibration at the tail of the main
    schedule, at its smallest learning rates.)"""
    main = schedule(drop_at, max(1, round(warmup * drop_at / steps)), min_lr_ratio)
    recal = schedule(steps - drop_at, max(1, round(RECALIBRATION_WARMUP * (steps - drop_at))), min_lr_ratio)
    return lambda step: main(step) if step < drop_at else recal(step - drop_at)


@dataclass(frozen=True)
class TrainSettings:
    """Everything one training run reads, besides its model and its batches: the optimizer, the
    learning-rate schedule, the loop's checkpoints, and the batch it draws at each step.

    The schedule: ``warmup`` steps of linear warmup to ``lr``, then cosine decay to
    ``min_lr_ratio * lr`` (:func:`schedule`); with ``drop_at``, DroPE's two schedules
    (:func:`drope_schedule`); with ``constant`` (a fine-tune), the warmup and then ``lr`` held.
    """

    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    checkpoint_every: int
    batch_size: int  # sequences per step (the global batch; each process takes its share)
    length: int  # tokens per sequence
    data_seed: int  # the batch of step s is a pure function of (data_seed, s)
    drop_at: int | None = None  # positions are removed from this step on (``LM.drop_positions``)
    constant: bool = False  # after the warmup, lr held (no decay)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.length

    def factor(self) -> Callable[[int], float]:
        """The learning-rate factor of each step (see the class docstring)."""
        if self.constant:
            return lambda step: min(1.0, (step + 1) / max(1, self.warmup))
        if self.drop_at is not None:
            return drope_schedule(self.steps, self.drop_at, self.warmup, self.min_lr_ratio)
        return schedule(self.steps, self.warmup, self.min_lr_ratio)


def make_optimizer(model: StudiedModel, settings: TrainSettings) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW at ``settings.lr`` with ``settings.factor()`` as its schedule.

    Weight decay applies to weight matrices only; biases, norms and the encodings' own
    parameters (position tables, T5 buckets) are left undecayed, so no method is pulled to zero.
    """
    decay: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "encoding" not in name else rest).append(p)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, settings.factor())


class StopOnSignal:
    """First Ctrl-C / SIGTERM: finish the current step, checkpoint, then stop. Second: stop now."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.old: dict = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        for s, h in self.old.items():  # the next signal takes the usual path
            signal.signal(s, h)

    def __enter__(self) -> "StopOnSignal":
        if self.enabled:
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def rng_state() -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """The RNG states a training state saves: torch's, and every CUDA device's when there are any."""
    state: dict[str, torch.Tensor | list[torch.Tensor]] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Weights this large (in absolute value) in a LayerNorm'd model mean training has blown up.
DIVERGED_WEIGHT = 1e8


def max_weight(model: torch.nn.Module) -> float:
    """The largest |parameter| of ``model`` (inf or NaN when one is not finite): one device sync."""
    with torch.no_grad():
        peaks = [p.detach().abs().max().float() for p in model.parameters() if p.numel()]
        return float(torch.stack(peaks).max()) if peaks else 0.0


class Diverged(Exception):
    """Training produced a non-finite loss or gradient norm at ``step`` (1-based); the optimizer
    step was not taken. The study records the run as ``diverged`` and goes on with the others."""

    def __init__(self, step: int, loss: float, grad_norm: float, losses: list[float], reason: str | None = None) -> None:
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        super().__init__(reason or f"non-finite {what} at step {step} (loss {loss}, gradient norm {grad_norm})")
        self.step, self.loss, self.grad_norm, self.losses = step, loss, grad_norm, losses


class StateError(Exception):
    """A training state file that cannot be read or does not fit the model (damaged, or foreign)."""


def restore(path: Path, model: StudiedModel, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, device: torch.device,
            drop_at: int | None = None) -> tuple[int, list, float]:
    """Load the training state at ``path`` into model, optimizer, scheduler and RNG; returns
    (step, losses, training seconds). Tensors and plain values only: ``weights_only=True``, so the
    file cannot run code. StateError when it is damaged or from another model. A state saved at or
    after ``drop_at`` belongs to the model without positions: they are dropped before loading."""
    try:
        with warnings.catch_warnings():  # a foreign file's pickle protocol: our own error below says what to do
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            state = torch.load(path, map_location=device, weights_only=True)
        if drop_at is not None and int(state["step"]) > drop_at:
            model.drop_positions()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return int(state["step"]), list(state["losses"]), float(state["train_time_s"])
    except (RuntimeError, OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as err:
        reason = str(err).splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
        raise StateError(f"the training state {path} cannot be used ({reason.rstrip('.')})") from err


def _save(state: dict, tmp: Path) -> None:
    with open(tmp, "wb") as f:  # a file object: a full disk raises OSError, not torch's zip error
        torch.save(state, f)


@dataclass(frozen=True)
class TrainRecord:
    """What a finished training run reports (``run["train"]`` in results.json)."""

    steps: int
    tokens: int
    time_s: float
    tokens_per_s: float
    final_loss: float
    losses: list[float]
    positions_dropped_at_step: int | None = None
    base: str | None = None  # a fine-tune: the row it started from (``from`` in results.json)

    def to_json(self) -> dict:
        out = {"steps": self.steps, "tokens": self.tokens, "time_s": self.time_s, "tokens_per_s": self.tokens_per_s,
               "final_loss": self.final_loss, "losses": self.losses}
        if self.positions_dropped_at_step is not None:
            out["positions_dropped_at_step"] = self.positions_dropped_at_step
        if self.base is not None:
            out["from"] = self.base
        return out


def _wrap(model: StudiedModel, ctx: distributed.Context) -> torch.nn.Module:
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # Buffers (sinusoid and rotary tables) are the same on every process: no need to sync them.
    params = inspect.signature(DistributedDataParallel).parameters
    # (the keyword this torch has: dict[str, Any], since which one is known only at run time)
    no_sync: dict[str, Any] = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=ids, **no_sync)


@contextlib.contextmanager
def _loop_reported(report: Report, label: str, steps: int, start: int) -> Iterator[None]:
    """Within the block, the training loop: reported as started, and as ended however it is left."""
    report(TrainStarted(label, steps, start))
    try:
        yield
    finally:
        report(TrainEnded(label))


def train(label: str, settings: TrainSettings, model: StudiedModel, batch: Callable[[int], tuple[torch.Tensor | None, ...]],
          state_path: Path, ctx: distributed.Context, report: Report = ignore) -> tuple[StudiedModel, TrainRecord]:
    """Train ``model`` (its initial state) as ``settings`` say, continuing from ``state_path`` when
    it exists; returns the model and its training record. Each process computes its share of
    every global batch; targets equal to ``IGNORE`` are not scored (the recall task scores only its
    answers).

    Args:
        label: the run's name in the events it reports.
        batch: step -> inputs, targets (B, T) each [, document ids (B, T) or None [, positions
            (B, T): the inputs' position ids, e.g. PoSE's (:mod:`.pose`)]]: a pure function of the
            step, so a run continued from a saved state sees the batches an unbroken one would.
        report: where the loop's events go (:mod:`.events`): :class:`~.events.TrainStarted`, a
            :class:`~.events.StepDone` after every step (raising in it, e.g. KeyboardInterrupt,
            stops the run there), and :class:`~.events.TrainEnded` however the loop is left.

    Raises:
        StateError: ``state_path`` is damaged or from another model.
        Diverged: a non-finite loss, gradient norm or activation (the step is not applied).
    """
    model = model.to(ctx.device)
    opt, sched = make_optimizer(model, settings)
    steps, drop_at = settings.steps, settings.drop_at
    start, elapsed = 0, 0.0
    losses: list[float] = []
    if state_path.exists():
        start, losses, elapsed = restore(state_path, model, opt, sched, ctx.device, drop_at)

    def save_state(step: int) -> None:
        if ctx.main:
            state = {
                "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": rng_state(), "losses": losses, "train_time_s": elapsed,
            }
            atomic_write(state_path, lambda p: _save(state, p))

    net = _wrap(model, ctx)
    dropped = drop_at is not None and start > drop_at  # (restore dropped them already)
    model.train()
    with StopOnSignal(enabled=not ctx.distributed) as stop, _loop_reported(report, label, steps, start):
        for step in range(start, steps):
            t0 = time.perf_counter()
            if not dropped and drop_at is not None and step >= drop_at:
                model.drop_positions()  # from here on the attention calls no position hook
                for group in opt.param_groups:  # the authors' recalibration trains without weight decay
                    group["weight_decay"] = 0.0
                net = _wrap(model, ctx)  # DDP over the parameters that remain
                dropped = True
            x, y, *more = batch(step)  # (B, T) each, the global batch; packed rows: document ids; PoSE: positions
            assert x is not None and y is not None
            share = x.shape[0] // ctx.world
            mine = slice(ctx.rank * share, (ctx.rank + 1) * share)
            x, y = x[mine].to(ctx.device), y[mine].to(ctx.device)
            extra = {name: t[mine].to(ctx.device) for name, t in zip(("document_ids", "positions"), more) if t is not None}
            try:
                logits = net(x, **extra)  # (B/world, T, vocab)
            except (ValueError, OverflowError) as err:
                # A backend that plans from the scores' range (blocked's tails) fails on inf/NaN
                # activations: that is divergence when the weights have blown up, a bug otherwise.
                largest = max_weight(model)
                if math.isfinite(largest) and largest < DIVERGED_WEIGHT:
                    raise
                raise Diverged(step + 1, math.nan, math.nan, losses,
                               f"non-finite activations at step {step + 1} (weights up to {largest:.3g}: {err})") from err
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            mean_loss = distributed.all_sum(ctx, loss.detach().clone()) / ctx.world
            # Every process sees the same mean loss and (synced gradients) the same norm: all stop together.
            if not (math.isfinite(float(mean_loss)) and math.isfinite(float(norm))):
                raise Diverged(step + 1, float(mean_loss), float(norm), losses)
            opt.step()
            sched.step()
            losses.append(float(mean_loss))
            elapsed += time.perf_counter() - t0
            done = step + 1
            if done % settings.checkpoint_every == 0 and done < steps:
                save_state(done)
            report(StepDone(label, done, steps, losses[-1], settings.tokens_per_step * done / max(elapsed, 1e-9)))
            if stop.requested and done < steps:
                save_state(done)
                raise KeyboardInterrupt
    tail = losses[-max(1, len(losses) // 20) :]
    return model, TrainRecord(
        steps=steps, tokens=steps * settings.tokens_per_step, time_s=round(elapsed, 3),
        tokens_per_s=round(steps * settings.tokens_per_step / max(elapsed, 1e-9), 1),
        final_loss=sum(tail) / len(tail), losses=[round(v, 5) for v in losses], positions_dropped_at_step=drop_at)
