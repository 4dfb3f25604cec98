"""Training one method: AdamW with warmup and cosine decay, periodic resumable states, a clean stop
on Ctrl-C / SIGTERM, and DistributedDataParallel under torchrun.

The batch of step s is a pure function of (seed, s) (see :func:`posenc.data.train_batch`) and the
RNG state is saved with the weights, so a run continued from the state of step s computes the same
numbers as one that never stopped.
"""

from __future__ import annotations

import inspect
import math
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .. import distributed
from ..data import Corpus, train_batch
from ..files import atomic_write
from ..model import LM
from .config import StudyConfig
from .progress import Progress

# Called after every finished training step as on_step(method, step): a progress hook for callers
# (and how the tests interrupt a run at an exact step).
StepCallback = Callable[[str, int], None]


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


class StopOnSignal:
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

    def __enter__(self) -> "StopOnSignal":
        if self.enabled:
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StateError(Exception):
    """A training state file that cannot be read or does not fit the model (damaged, or foreign)."""


def restore(path: Path, model: LM, opt: torch.optim.Optimizer, sched, device: torch.device) -> tuple[int, list, float]:
    """Load the training state at ``path`` into model, optimizer, scheduler and RNG; returns
    (step, losses, training seconds). Tensors and plain values only: ``weights_only=True``, so the
    file cannot run code. StateError when it is damaged or from another model."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
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


def train_method(
    method: str, cfg: StudyConfig, corpus: Corpus, state_path: Path, ctx: distributed.Context, ui: Progress,
    on_step: StepCallback | None = None,
) -> tuple[LM, dict]:
    """Train one method (continuing from ``state_path`` when it exists); returns the model and
    its training record. Each process computes its share of every global batch."""
    torch.manual_seed(cfg.seed)  # the same initial weights whatever else this study ran before
    model = LM(cfg.lm_config(method)).to(ctx.device)
    opt, sched = make_optimizer(model, cfg)
    start, losses, elapsed = 0, [], 0.0
    if state_path.exists():
        start, losses, elapsed = restore(state_path, model, opt, sched, ctx.device)
        ui.log(f"[{method}] resuming from step {start}/{cfg.steps}")

    def save_state(step: int) -> None:
        if ctx.main:
            state = {
                "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": rng_state(), "losses": losses, "train_time_s": elapsed,
            }
            atomic_write(state_path, lambda p: _save(state, p))

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
    with StopOnSignal(enabled=not ctx.distributed) as stop, ui.closing(bar):
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
            if on_step is not None:
                on_step(method, done)
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
