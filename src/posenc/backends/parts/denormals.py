"""Denormals in the kernel loops: the one worker thread that runs them with denormals flushed to zero
(:func:`flushed`, :class:`_Flushed`), the probe that says whether the caller's thread pays for them
(:func:`denormal_penalty`), and :func:`opaque_to_compile` for the steps that read tensor values on
the host. What the ``blocked``, ``terms`` and ``curved`` backends share beside their kernel regions
(:mod:`.regions`).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")
Fn = TypeVar("Fn", bound=Callable[..., Any])


class _Flushed:
    """One worker thread that runs kernel loops with denormals flushed to zero.

    A bias that grows with distance (ALiBi) puts many probabilities exp(s - lse) in float32's
    denormal range (2^-149 .. 2^-126, i.e. s - lse in (-104, -87)), and on many x86 CPUs every
    multiply with a denormal operand takes a slow microcode path, so the CPU flash kernel's backward
    slows down on such inputs by a factor that depends on the CPU (``benchmarks/attention_table.sh``
    times ALiBi's train step at N=4096, where it shows). Those
    probabilities are below 2^-126 of the row's largest: flushing them to zero changes nothing a
    float32 result can show. ``torch.set_flush_denormal`` acts on the calling thread only (and the
    OpenMP team that thread starts inherits it), so the setting stays inside this worker: the
    user's threads never see it.

    Where the caller's thread pays no such penalty (:func:`denormal_penalty` below
    :data:`PENALTY`: a CPU that multiplies denormals at full speed, or a caller that flushes them
    itself), the hand-off would buy nothing and costs a second OpenMP team beside the caller's
    (on 2 cores of a CPU without the penalty, an attention training step of a bias method took
    1.1x-2x as long through the worker: ``benchmarks/flush_worker.py``): the loops then run in the caller's thread.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._threads = 0
        self._lock = threading.Lock()
        self.available = True  # False: the CPU has no flush mode (found when the worker starts)
        self.needed: bool | None = None  # whether the caller's thread pays for denormals (probed at first use)

    def _start(self) -> None:
        self._thread = threading.current_thread()
        self.available = torch.set_flush_denormal(True)  # False where the CPU has no such mode

    def wanted(self) -> bool:
        """Whether a loop should go to the worker: the CPU flushes, and the caller's thread pays for
        denormals (probed once, the first time it is asked)."""
        if self.needed is None:
            self.needed = denormal_penalty() >= PENALTY
        return self.available and self.needed

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the flushing thread, with the caller's intra-op thread count."""
        if threading.current_thread() is self._thread or not self.available:
            return fn(*args)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="posenc-ftz", initializer=self._start)
        return self._pool.submit(self._call, torch.get_num_threads(), torch.is_inference_mode_enabled(), fn, args).result()

    def _call(self, threads: int, inference: bool, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        if threads != self._threads:  # the OpenMP thread count is per thread: follow the caller's
            torch.set_num_threads(threads)
            self._threads = threads
        # Grad and inference mode are thread-local too: the loops record no graph.
        with torch.inference_mode(inference), torch.no_grad():
            return fn(*args)


FLUSHED = _Flushed()
PENALTY = 5.0  # a slowdown on denormals below this is not worth the worker's hand-off (a microcode path costs far more)


def denormal_penalty(n: int = 1 << 15, repeats: int = 15) -> float:
    """How many times slower the calling thread multiplies float32 numbers when an operand or the
    product is denormal than when neither is: the fastest of ``repeats`` products of n numbers each
    (2^15 numbers: torch's grain for one thread, so the calling thread is the one timed; well under
    a millisecond in all). Near 1 where the CPU handles denormals in hardware; many times that
    where each denormal operation takes a microcode path (measured figures: docs/results.md)."""
    half, tiny, small = torch.full((n,), 0.5), torch.full((n,), 1e-39), torch.full((n,), 1e-20)  # 1e-39: denormal
    out = torch.empty(n)

    def fastest(a: torch.Tensor, b: torch.Tensor) -> float:
        torch.mul(a, b, out=out)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mul(a, b, out=out)
            best = min(best, time.perf_counter() - start)
        return max(best, 1e-9)

    normal = fastest(half, half)
    return max(fastest(tiny, half), fastest(small, small)) / normal  # a denormal operand; a denormal product (1e-40)


def opaque_to_compile(fn: Fn) -> Fn:
    """``torch.compiler.disable(fn)``, typed: torch's stub of it declares no types. A backend wraps
    in it each step that reads values of its tensors on the host to plan kernel calls (a bound on
    |q . k|, the first key a block can see): a number read inside a compiled frame is specialized
    into its guards, so a new value at every training step would recompile the frame until
    dynamo's cache limit; opaque, the step is one graph break and the reads stay in eager code."""
    opaque: Fn = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]  # untyped in torch's stub
    return opaque


@opaque_to_compile  # opaque to torch.compile: a loop of kernel calls on a worker thread (one graph break)
def flushed(fn: Callable[..., T], *args: object, when: bool = True) -> T:
    """Run a loop of CPU kernel calls with denormals flushed (see :class:`_Flushed`). Work on
    another device, or watched by a profiler or dispatch mode, or where the caller's thread pays
    nothing for denormals (:meth:`_Flushed.wanted`), runs here in the caller's thread, without grad.

    ``when`` False: the loop runs here, without grad, as it would there: for a call with no score
    term that decays with distance (no bias, T5's constant far tail), whose probabilities are no
    more denormal than plain attention's, and where the hand-off to the worker costs more than it
    saves (on 2 cores a windowed RoPE step ran 20-30% slower through the worker, with the caller's
    idle OpenMP threads spinning beside the worker's)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if not when or (device is not None and device.type != "cpu") or _observed() or not FLUSHED.wanted():
        with torch.no_grad():
            return fn(*args)
    return FLUSHED.run(fn, *args)


def _observed() -> bool:
    """A profiler or a dispatch mode (FLOP counters, memory checks) watches this thread: both are
    thread-local, so the work stays here, where they see it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None or torch.autograd.profiler._is_profiler_enabled


__all__ = ["FLUSHED", "PENALTY", "denormal_penalty", "flushed", "opaque_to_compile"]
