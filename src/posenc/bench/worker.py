"""The benchmark worker: one job, measured in this (fresh) process.

    python -m posenc.bench.worker '{"level": "attention", "mode": "train", "method": "alibi", ...}'

prints one line ``POSENC_BENCH_RESULT {json}`` on stdout: the job's fields plus its measurements.
A fresh process per job means no measurement inherits another's allocator state, caches or peak
memory. The worker builds the level's workload, records its baseline memory, runs ``warmup``
untimed steps, then ``repeats`` timed ones, and reports their median (this round's time for the
job), their minimum and every time.

Memory, CPU: the peak resident set (``getrusage().ru_maxrss``) during the measured steps, and the
baseline RSS just before them (imports, model, inputs). On Linux the peak is first reset to that
baseline (``/proc/self/clear_refs``), so an import-time transient does not hide the increase; where
that is not allowed the baseline is the peak so far. CUDA: ``torch.cuda.max_memory_allocated``
against the memory allocated before the steps.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Callable

import torch

from ..model.attention import Attention
from .job import POSENC, Job
from .levels import LEVELS, Refused

RESULT_TAG = "POSENC_BENCH_RESULT "  # prefix of the result line on stdout
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def maxrss_mb() -> float:
    """Peak RSS of this process so far, MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def reset_peak_rss() -> float | None:
    """Reset the peak RSS to the current RSS (Linux: clear_refs 5 resets VmHWM and ru_maxrss).

    Returns the current RSS in MB, or None where the kernel does not allow it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def timed(step: Callable[[], object], reps: int) -> dict:
    """Time ``step`` for a benchmark script's worker: one untimed warm-up, then ``reps`` timed
    runs; ``{"seconds": the fastest, "peak_over_baseline_mb": peak RSS over the RSS after the
    warm-up}`` (the warm-up's allocations are the baseline, so the peak is the step's own)."""
    step()  # warm-up
    base = reset_peak_rss()
    base = maxrss_mb() if base is None else base
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "peak_over_baseline_mb": maxrss_mb() - base}


def backends_used(module: torch.nn.Module | None) -> str:
    """The registered backend names the ``posenc.Attention`` layers of ``module`` last ran, "+"-joined.

    "-" for a compared library (no posenc attention), "?" if no layer has run.
    """
    if module is None:
        return "-"
    names = sorted({m.last_backend for m in module.modules() if isinstance(m, Attention) and m.last_backend})
    return "+".join(names) if names else "?"


def run_worker(job: Job) -> dict:
    """Measure ``job`` in this process; the result record has status ok, failed or refused."""
    result = job.to_dict()
    try:
        if job.threads:
            torch.set_num_threads(job.threads)
        result["threads_used"] = torch.get_num_threads()
        torch.manual_seed(job.seed)
        level = LEVELS[job.level]
        device, dtype = torch.device(job.device), DTYPES[job.dtype]
        cuda = device.type == "cuda"
        workload = level.build(job, device, dtype)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            result["baseline_mb"] = torch.cuda.memory_allocated(device) / 2**20
        else:
            result["setup_peak_mb"] = maxrss_mb()  # imports, model, inputs
            current = reset_peak_rss()
            result["peak_reset"] = current is not None
            result["baseline_mb"] = current if current is not None else result["setup_peak_mb"]
        for _ in range(job.warmup):
            workload.step()
        sync()
        times = []
        for _ in range(job.repeats):
            start = time.perf_counter()
            workload.step()
            sync()
            times.append(time.perf_counter() - start)
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else maxrss_mb()
        result["increase_mb"] = result["peak_mb"] - result["baseline_mb"]
        result["times_s"] = times
        result["median_s"] = statistics.median(times)
        result["min_s"] = min(times)
        result["tokens_per_s"] = level.tokens(job) / result["median_s"]
        result["backend_used"] = backends_used(workload.module) if job.impl == POSENC else "-"
        result["status"] = "ok"
    except Refused as err:
        result.update(status="refused", error=str(err))
    except Exception as err:  # out of memory, a backend that cannot run the call, ...: recorded
        result.update(status="failed", error=f"{type(err).__name__}: {err}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m posenc.bench.worker JOB_JSON", file=sys.stderr)
        return 2
    result = run_worker(Job.from_json(argv[0]))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
