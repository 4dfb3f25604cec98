"""``posenc bench``: speed and memory of every method side by side, as ratios to NoPE.

The table follows the speed/memory table of the ALiBi paper (Press et al. 2021, "Train Short, Test
Long", Table 1: training speed, inference speed and memory per method): here per method and length,
each figure also divided by NoPE's (no positional information at all) measured in the same run.

Protocol. Every (level, mode, method, length, implementation) runs in a fresh subprocess
(``python -m posenc.bench --worker JSON``), so one measurement cannot inherit another's allocator
state, caches or peak memory. A worker builds its inputs, records its baseline memory, runs
``warmup`` untimed steps and then ``repeats`` timed ones; it reports the median and the minimum.
Memory: on CPU the peak resident set of the worker (``getrusage().ru_maxrss``) during the
measured work, and the baseline RSS before it (imports, model, inputs; on Linux the peak is reset
to that baseline first, so import-time transients do not hide the increase); on CUDA
``torch.cuda.max_memory_allocated`` against the memory allocated before the steps.

Levels:

- ``attention``: the attention core of one :class:`posenc.Attention` call, B=1, H=8, D=64 by
  default: q, k, v already projected, then everything the attention does with the encoding (its
  ``rotate``, ``bias``/``score``, ``query_terms``/``value_terms`` hooks) and the backend. This is
  what DESIGN.md §5 measures (SDPA causal, no bias, is the floor). It runs ``posenc.Attention``
  itself with its two projections replaced by identities, so it follows whatever the attention
  does. ``embed`` (sinusoidal, learned) is applied once per model forward, not per attention call,
  so at this level the absolute methods cost what NoPE costs; the model level shows their cost.
- ``model``: the study's LM (:class:`posenc.LM`), dim 256, depth 4, 8 heads, batch 1, vocab 256
  by default.

Modes: ``train`` is forward + backward at the attention level, and a full training step at the
model level (forward, cross-entropy, backward, AdamW step); ``infer`` is a forward pass under
``torch.inference_mode``.

``--compare x-transformers`` (model level) builds the same configuration with x-transformers
(``TransformerWrapper`` + ``Decoder``, head dim = dim / heads, tied embeddings, full-dim rotary)
with its default attention and with ``attn_flash=True``; a configuration it refuses (flash with
the T5 bias) is recorded as "refused", a method it lacks (Shaw, Transformer-XL) as "n/a".
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

LEVELS = ("attention", "model")
MODES = ("train", "infer")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
COMPARE = ("x-transformers",)
POSENC = "posenc"
XT, XT_FLASH = "x-transformers", "x-transformers flash"
BASELINE = "nope"
RESULT_TAG = "POSENC_BENCH_RESULT "  # prefix of the worker's result line on stdout

# Sizes per level; the command line can override each.
DEFAULT_SIZES = {
    "attention": {"dim": 512, "heads": 8, "batch": 1, "depth": 1, "vocab": 256},
    "model": {"dim": 256, "heads": 8, "batch": 1, "depth": 4, "vocab": 256},
}

# posenc method -> (TransformerWrapper kwargs, Decoder kwargs) of its x-transformers counterpart;
# None: x-transformers has no such method. Read from x-transformers 2.31's source: ALiBi does not
# switch its absolute embedding off by itself, and its rotary rotates half the head dim by default
# (posenc rotates all of it), hence the explicit options.
XT_METHODS: dict[str, tuple[dict, dict] | None] = {
    "nope": ({"use_abs_pos_emb": False}, {}),
    "sinusoidal": ({"use_abs_pos_emb": True, "scaled_sinu_pos_emb": True}, {}),  # plus a learned scale
    "learned": ({"use_abs_pos_emb": True}, {}),
    "rope": ({"use_abs_pos_emb": False}, {"rotary_pos_emb": True, "rotary_emb_dim": None}),  # None: head dim
    "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}),
    "t5": ({"use_abs_pos_emb": False}, {"rel_pos_bias": True, "rel_pos_num_buckets": 32, "rel_pos_max_distance": 128}),
    "shaw": None,
    "transformer_xl": None,
}


# ----------------------------------------------------------------------------------------------
# Worker side: one measurement in a fresh process.


def _maxrss_mb() -> float:
    """Peak RSS of this process so far (getrusage ru_maxrss), MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _reset_peak_rss() -> float | None:
    """Reset the peak RSS to the current RSS (Linux: clear_refs 5 resets VmHWM and ru_maxrss).

    Returns the current RSS in MB, or None where the kernel does not allow it; the baseline is then
    the peak so far (imports and setup included), which can hide a small increase.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def _attention_step(job: dict, device: torch.device, dtype: torch.dtype):
    """The attention core (q, k, v given) of posenc.Attention with its encoding and backend."""
    import posenc
    from torch import nn

    dim, heads, b, n = job["dim"], job["heads"], job["batch"], job["length"]
    encoding = posenc.build(job["method"], num_heads=heads, head_dim=dim // heads, causal=True)
    attn = posenc.Attention(dim, heads, encoding, causal=True, backend=job["backend"])
    # Identity projections: the input already holds q, k, v side by side, so the timed work is the
    # encoding's hooks plus the backend, exactly as Attention.forward runs them.
    attn.qkv, attn.proj = nn.Identity(), nn.Identity()
    attn = attn.to(device=device, dtype=dtype)
    train = job["mode"] == "train"
    attn.train(train)
    qkv = torch.randn(b, n, 3 * dim, device=device, dtype=dtype, requires_grad=train)  # (B, T, 3 x H x D)
    grad = torch.randn(b, n, dim, device=device, dtype=dtype)  # (B, T, H x D) upstream gradient
    params = [p for p in attn.parameters() if p.requires_grad]

    def step() -> None:
        if train:
            attn(qkv).backward(grad)
            qkv.grad = None
            for p in params:
                p.grad = None
        else:
            with torch.inference_mode():
                attn(qkv)

    return step


def _lm_tokens(job: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (job["batch"], job["length"])
    tokens = torch.randint(0, job["vocab"], shape, device=device)  # (B, T)
    targets = torch.randint(0, job["vocab"], shape, device=device)  # (B, T)
    return tokens, targets


def build_xt_model(job: dict) -> torch.nn.Module:
    """The x-transformers decoder LM matching posenc's LM config for ``job`` (raises if refused)."""
    from x_transformers import Decoder, TransformerWrapper

    counterpart = XT_METHODS.get(job["method"])
    if counterpart is None:
        raise ValueError(f"x-transformers has no counterpart of {job['method']!r}")
    wrapper_kwargs, decoder_kwargs = (dict(d) for d in counterpart)
    head_dim = job["dim"] // job["heads"]
    if "rotary_emb_dim" in decoder_kwargs:
        decoder_kwargs["rotary_emb_dim"] = head_dim
    if job["impl"] == XT_FLASH:
        decoder_kwargs["attn_flash"] = True
    decoder = Decoder(dim=job["dim"], depth=job["depth"], heads=job["heads"], attn_dim_head=head_dim, verbose=False, **decoder_kwargs)
    return TransformerWrapper(num_tokens=job["vocab"], max_seq_len=job["length"], attn_layers=decoder, tie_embedding=True, **wrapper_kwargs)


def _model_step(job: dict, device: torch.device, dtype: torch.dtype):
    """A training step or an inference forward of posenc's LM or its x-transformers counterpart."""
    import torch.nn.functional as F

    if job["impl"] == POSENC:
        import posenc

        config = posenc.LMConfig(
            encoding=job["method"], vocab_size=job["vocab"], dim=job["dim"], depth=job["depth"], num_heads=job["heads"],
            max_positions=job["length"], attention_backend=job["backend"],
        )
        model = posenc.LM(config)
    else:
        try:
            model = build_xt_model(job)
        except Exception as err:  # e.g. flash with the T5 bias: the library's own refusal
            raise Refused(f"{type(err).__name__}: {err}") from err
    model = model.to(device=device, dtype=dtype)
    tokens, targets = _lm_tokens(job, device)
    if job["mode"] == "infer":
        model.eval()

        def step() -> None:
            with torch.inference_mode():
                model(tokens)

        return step
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        logits = model(tokens)  # (B, T, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class Refused(Exception):
    """The compared library refuses this configuration (raised while building it)."""


def _record_backends(chosen: set[str]):
    """Wrap posenc.backends.choose so the worker can report which backend(s) auto picked."""
    from posenc import backends

    original = backends.choose

    def choose(*args, **kwargs):
        picked = original(*args, **kwargs)
        chosen.add(picked[0])
        return picked

    backends.choose = choose
    return lambda: setattr(backends, "choose", original)


def run_worker(job: dict) -> dict:
    """Measure one job in this process; returns the result record (status ok/failed/refused)."""
    result = dict(job)
    try:
        if job.get("threads"):
            torch.set_num_threads(job["threads"])
        result["threads_used"] = torch.get_num_threads()
        torch.manual_seed(job.get("seed", 0))
        device, dtype = torch.device(job["device"]), DTYPES[job["dtype"]]
        cuda = device.type == "cuda"
        make = _attention_step if job["level"] == "attention" else _model_step
        step = make(job, device, dtype)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            result["baseline_mb"] = torch.cuda.memory_allocated(device) / 2**20
        else:
            result["setup_peak_mb"] = _maxrss_mb()  # imports, model, inputs
            current = _reset_peak_rss()
            result["peak_reset"] = current is not None
            result["baseline_mb"] = current if current is not None else result["setup_peak_mb"]
        chosen: set[str] = set()  # the wrapper costs one Python call per attention call: negligible
        restore = _record_backends(chosen) if job["impl"] == POSENC else (lambda: None)
        times = []
        try:
            for _ in range(job["warmup"]):
                step()
            sync()
            for _ in range(job["repeats"]):
                start = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - start)
        finally:
            restore()
        result["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else _maxrss_mb()
        result["increase_mb"] = result["peak_mb"] - result["baseline_mb"]
        result["times_s"] = times
        result["median_s"] = statistics.median(times)
        result["min_s"] = min(times)
        result["tokens_per_s"] = job["batch"] * job["length"] / result["median_s"]
        result["backend_used"] = "+".join(sorted(chosen)) if chosen else ("-" if job["impl"] != POSENC else job["backend"])
        result["status"] = "ok"
    except Refused as err:
        result.update(status="refused", error=str(err))
    except Exception as err:  # OOM, unsupported backend, ...: recorded, the run goes on
        result.update(status="failed", error=f"{type(err).__name__}: {err}")
    return result


def worker_main(payload: str) -> int:
    result = run_worker(json.loads(payload))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# ----------------------------------------------------------------------------------------------
# Parent side: validate, plan, launch workers, collect.


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def validate(
    methods: list[str] | None,
    lengths: list[int],
    level: str,
    mode: str,
    compare: list[str] | None,
    repeats: int,
    warmup: int,
    device: str,
    backend: str,
    dtype: str,
    threads: int | None,
    sizes: dict,
) -> tuple[list[str], list[int], list[str]]:
    """Check every option before any work; returns (methods with NoPE first, lengths, modes)."""
    from . import backends
    from .encodings import available, get_class

    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if mode not in (*MODES, "both"):
        raise ValueError(f"mode must be one of {(*MODES, 'both')}, got {mode!r}")
    methods = list(available()) if not methods else list(methods)
    for m in methods:
        get_class(m)  # unknown name -> ValueError listing the choices
    methods = [BASELINE] + [m for m in dict.fromkeys(methods) if m != BASELINE]  # NoPE is the baseline
    if not lengths:
        raise ValueError("lengths must name at least one sequence length")
    for n in lengths:
        _positive("each length", n)
    lengths = sorted(set(lengths))
    _positive("repeats", repeats)
    _positive("warmup", warmup, minimum=0)
    if threads is not None:
        _positive("threads", threads)
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    backends.check_name(backend)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    for name in ("dim", "heads", "batch", "depth", "vocab"):
        _positive(name, sizes[name])
    if sizes["dim"] % sizes["heads"]:
        raise ValueError(f"dim ({sizes['dim']}) must be divisible by heads ({sizes['heads']})")
    for c in compare or []:
        if c not in COMPARE:
            raise ValueError(f"compare must be one of {COMPARE}, got {c!r}")
        if level != "model":
            raise ValueError("--compare x-transformers compares whole models: use it with --level model")
        import importlib.util

        if importlib.util.find_spec("x_transformers") is None:
            raise ValueError("--compare x-transformers needs the x-transformers package (pip install x-transformers)")
    return methods, lengths, list(MODES) if mode == "both" else [mode]


def plan(methods, lengths, modes, level, compare, common: dict) -> list[dict]:
    """Jobs in run order: per length, per mode, per method, posenc then the compared library."""
    impls = [POSENC] + ([XT, XT_FLASH] if compare else [])
    jobs = []
    for n in lengths:
        for mode in modes:
            for method in methods:
                for impl in impls:
                    jobs.append(dict(common, level=level, mode=mode, method=method, length=n, impl=impl))
    return jobs


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[1])  # the folder holding posenc/ (src/)


def launch(job: dict, timeout: float | None, isolate: bool = True) -> dict:
    """Run ``job`` in a fresh interpreter; any failure to produce a result becomes a failed record.

    ``isolate=False`` runs it in this process instead: for tests of the harness only, since the
    memory figures then include everything this process did before.
    """
    if job["impl"] != POSENC and XT_METHODS.get(job["method"]) is None:
        return dict(job, status="n/a", error=f"x-transformers has no counterpart of {job['method']!r}")
    if not isolate:
        start = time.perf_counter()
        return dict(run_worker(job), wall_s=time.perf_counter() - start)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "posenc.bench", "--worker", json.dumps(job)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(job, status="failed", error=f"timed out after {timeout} s", wall_s=time.perf_counter() - start)
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG):]), wall_s=wall)
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    if proc.returncode == -9:
        why += " (out of memory?)"
    return dict(job, status="failed", error=f"worker {why}: {tail}".strip(), wall_s=wall)


def add_ratios(results: list[dict]) -> None:
    """Every figure divided by posenc's NoPE at the same level, mode and length (None if missing)."""
    base = {
        (r["level"], r["mode"], r["length"]): r
        for r in results
        if r["impl"] == POSENC and r["method"] == BASELINE and r.get("status") == "ok"
    }
    for r in results:
        b = base.get((r["level"], r["mode"], r["length"]))
        for key in ("median_s", "tokens_per_s", "peak_mb", "increase_mb"):
            ok = b is not None and r.get("status") == "ok" and b[key] > 0
            r[f"{key}_vs_nope"] = r[key] / b[key] if ok else None


def bench(
    methods: list[str] | None = None,
    lengths: list[int] = (512, 1024, 2048, 4096),
    level: str = "attention",
    mode: str = "both",
    compare: list[str] | None = None,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    backend: str = "auto",
    dtype: str = "float32",
    threads: int | None = None,
    timeout: float | None = None,
    seed: int = 0,
    progress: bool = True,
    isolate: bool = True,
    **sizes,
) -> list[dict]:
    """Run the benchmark and return one record per job (with ``*_vs_nope`` ratios).

    ``sizes`` overrides the level's defaults: dim, heads, batch, depth, vocab. ``isolate=False``
    measures in this process (tests only; see :func:`launch`).
    """
    unknown = set(sizes) - set(DEFAULT_SIZES[level if level in LEVELS else "model"])
    if unknown:
        raise ValueError(f"unknown size option(s) {sorted(unknown)}; accepted: dim, heads, batch, depth, vocab")
    full = dict(DEFAULT_SIZES.get(level, DEFAULT_SIZES["model"]))
    full.update({k: v for k, v in sizes.items() if v is not None})
    methods, lengths, modes = validate(methods, list(lengths), level, mode, compare, repeats, warmup, device, backend, dtype, threads, full)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    common = dict(full, repeats=repeats, warmup=warmup, device=device, backend=backend, dtype=dtype, threads=threads, seed=seed)
    jobs = plan(methods, lengths, modes, level, compare, common)
    results = []
    for i, job in enumerate(jobs, 1):
        r = launch(job, timeout, isolate)
        results.append(r)
        if progress:
            print(f"[{i:>{len(str(len(jobs)))}}/{len(jobs)}] {_describe(r)}", file=sys.stderr, flush=True)
    add_ratios(results)
    return results


def _describe(r: dict) -> str:
    head = f"{r['level']}/{r['mode']} {r['method']} N={r['length']} {r['impl']}"
    if r.get("status") != "ok":
        return f"{head}: {r.get('status')}: {r.get('error', '')[:200]}"
    return (
        f"{head} [{r.get('backend_used')}]: {r['median_s']:.4g} s, {r['tokens_per_s']:,.0f} tok/s, "
        f"peak {r['peak_mb']:.0f} MB (+{r['increase_mb']:.0f})"
    )


# ----------------------------------------------------------------------------------------------
# Output: markdown table, CSV, JSON, plot.


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cell_status(r: dict | None) -> str | None:
    if r is None:
        return ""
    if r.get("status") == "ok":
        return None
    return {"n/a": "n/a", "refused": "refused"}.get(r.get("status"), "failed")


def _time_cells(r: dict | None) -> list[str]:
    s = _cell_status(r)
    if s is not None:
        return [s, "", ""]
    return [f"{r['median_s']:.4g}", f"{r['tokens_per_s']:,.0f}", _fmt_ratio(r["median_s_vs_nope"])]


def _mem_cells(r: dict | None) -> list[str]:
    s = _cell_status(r)
    if s is not None:
        return [s, ""]
    ratio = _fmt_ratio(r["peak_mb_vs_nope"])
    if r.get("increase_mb_vs_nope") is not None:
        ratio += f" ({r['increase_mb_vs_nope']:.2f}x)"
    return [f"{r['peak_mb']:.0f} (+{r['increase_mb']:.0f})", ratio]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(results: list[dict], meta: dict | None = None) -> str:
    """The paper-style table: per method and length, train and inference speed and memory."""
    if not results:
        return "(no results)\n"
    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    index = {(r["method"], r["impl"], r["length"], r["mode"]): r for r in results}
    rows = list(dict.fromkeys((r["length"], r["method"], r["impl"]) for r in results))
    cuda = results[0]["device"] == "cuda"
    mem = "MB allocated" if cuda else "peak RSS MB"
    compared = any(r["impl"] != POSENC for r in results)
    header = ["method", "impl", "N"] if compared else ["method", "N"]
    for m in modes:
        unit = "s/step" if m == "train" and results[0]["level"] == "model" else "s"
        header += [f"{m} {unit}", f"{m} tok/s", f"{m} time vs NoPE"]
    for m in modes:
        header += [f"{m} {mem} (+over base)", f"{m} mem vs NoPE: peak (increase)"]
    lines = []
    if meta:
        lines += [f"**{meta['title']}**", ""]
    lines += [_row(header), _row(["---"] * (3 if compared else 2) + ["---:"] * (len(header) - (3 if compared else 2)))]
    for n, method, impl in rows:
        cells = [method, impl.replace("x-transformers", "x-t"), str(n)] if compared else [method, str(n)]
        for m in modes:
            cells += _time_cells(index.get((method, impl, n, m)))
        for m in modes:
            cells += _mem_cells(index.get((method, impl, n, m)))
        lines.append(_row(cells))
    lines.append("")
    used: dict[str, dict[str, None]] = {}  # method -> "mode: backend" seen, in order
    for r in results:
        if r["impl"] == POSENC and r.get("status") == "ok":
            used.setdefault(r["method"], {})[f"{r['mode']} {r['backend_used']}"] = None
    if used:
        lines += ["posenc backends: " + "; ".join(f"{m} ({', '.join(v)})" for m, v in used.items()), ""]
    problems: dict[tuple, list[str]] = {}  # (method, impl, status, error) -> where it happened
    for r in results:
        if r.get("status") not in ("ok", "n/a"):
            key = (r["method"], r["impl"], r["status"], r.get("error", "")[:300])
            problems.setdefault(key, []).append(f"N={r['length']} {r['mode']}")
    if problems:
        lines.append("Not measured:")
        for (method, impl, status, error), where in problems.items():
            lines.append(f"- {method} {impl} ({', '.join(where)}): {status}: {error}")
        lines.append("")
    if compared:
        lines.append(compare_table(results))
    return "\n".join(lines)


def compare_table(results: list[dict]) -> str:
    """posenc against x-transformers, per method, length and mode: times and speedups."""
    index = {(r["method"], r["impl"], r["length"], r["mode"]): r for r in results}
    keys = list(dict.fromkeys((r["length"], r["mode"], r["method"]) for r in results))
    header = ["method", "N", "mode", "posenc s", "x-t s", "x-t flash s", "x-t / posenc", "x-t flash / posenc",
              "posenc +MB", "x-t +MB", "x-t flash +MB"]
    lines = [
        "**posenc vs x-transformers** (time ratios > 1: posenc is faster; +MB: memory over each worker's baseline)",
        "", _row(header), _row(["---"] * 3 + ["---:"] * 8),
    ]

    def t(r):
        return f"{r['median_s']:.4g}" if r and r.get("status") == "ok" else (_cell_status(r) or "")

    def mb(r):
        return f"{r['increase_mb']:.0f}" if r and r.get("status") == "ok" else (_cell_status(r) or "")

    def speedup(r, p):
        ok = r and p and r.get("status") == "ok" and p.get("status") == "ok"
        return f"{r['median_s'] / p['median_s']:.2f}x" if ok else "-"

    for n, mode, method in keys:
        p, x, xf = (index.get((method, impl, n, mode)) for impl in (POSENC, XT, XT_FLASH))
        lines.append(_row([method, str(n), mode, t(p), t(x), t(xf), speedup(x, p), speedup(xf, p), mb(p), mb(x), mb(xf)]))
    lines.append("")
    return "\n".join(lines)


CSV_FIELDS = [
    "level", "mode", "impl", "method", "length", "status", "median_s", "min_s", "tokens_per_s", "baseline_mb", "peak_mb",
    "setup_peak_mb", "peak_reset",
    "increase_mb", "median_s_vs_nope", "tokens_per_s_vs_nope", "peak_mb_vs_nope", "increase_mb_vs_nope", "backend",
    "backend_used", "dtype", "device", "threads_used", "dim", "heads", "depth", "batch", "vocab", "repeats", "warmup",
    "times_s", "wall_s", "error",
]


def write_outputs(results: list[dict], out: Path, meta: dict) -> dict[str, Path]:
    """results.csv, results.json, table.md, command.txt and plot.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("results.csv", "results.json", "table.md", "command.txt", "plot.png")}
    with open(paths["results.csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in results:
            row = dict(r)
            if "times_s" in row:
                row["times_s"] = " ".join(f"{t:.6g}" for t in row["times_s"])
            writer.writerow(row)
    paths["results.json"].write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    paths["table.md"].write_text(markdown_table(results, meta) + "\n")
    paths["command.txt"].write_text(meta["command"] + "\n")
    plot(results, paths["plot.png"], meta["title"])
    return paths


def plot(results: list[dict], path: Path, title: str = "") -> None:
    """Median time against length, one line per method and implementation, log-log; one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    colors = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r["method"] for r in results))}  # one per method
    styles = {POSENC: "-", XT: "--", XT_FLASH: ":"}  # one per implementation
    for ax, mode in zip(axes[0], modes):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in results:
            if r["mode"] == mode and r.get("status") == "ok":
                series.setdefault((r["method"], r["impl"]), []).append((r["length"], r["median_s"]))
        for (method, impl), points in series.items():
            points.sort()
            label = method if impl == POSENC else f"{method} ({impl})"
            ax.plot([p[0] for p in points], [p[1] for p in points], styles.get(impl, "-."), color=colors[method], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({r["length"] for r in results})
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("median seconds" + (" per step" if mode == "train" else " per forward"))
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
    handles = {}  # one legend for all panels, outside them, so no line is hidden
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="center right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8 if handles else 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe_setup(level: str, results: list[dict], sizes: dict, args_like: dict) -> str:
    first = results[0] if results else {}
    threads = first.get("threads_used", args_like.get("threads"))
    what = (
        f"attention core, B={sizes['batch']}, H={sizes['heads']}, D={sizes['dim'] // sizes['heads']}, causal"
        if level == "attention"
        else f"LM dim {sizes['dim']}, depth {sizes['depth']}, {sizes['heads']} heads, batch {sizes['batch']}, vocab {sizes['vocab']}"
    )
    return (
        f"posenc bench, {level} level ({what}); {args_like['dtype']}, {args_like['device']}, threads={threads}, "
        f"backend {args_like['backend']}; median of {args_like['repeats']} after {args_like['warmup']} warm-up"
    )


# ----------------------------------------------------------------------------------------------
# Command line.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="+", default=None, help="encodings to run (default all; nope is always included)")
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="sequence lengths (default 512 1024 2048 4096)")
    parser.add_argument("--level", default="attention", help="attention (one attention core, B=1 H=8 D=64) or model (the study's LM)")
    parser.add_argument("--mode", default="both", help="train (forward+backward / training step), infer (forward) or both")
    parser.add_argument("--compare", nargs="+", default=None, metavar="LIB", help="x-transformers: the same LM built with it (model level)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default bench-results/LEVEL)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per job; the median is reported (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps per job (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    from . import backends

    parser.add_argument("--backend", default="auto", help=f"posenc attention backend, one of {', '.join(backends.names())} (default auto)")
    parser.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's default)")
    parser.add_argument("--dim", type=int, default=None, help="model width (default 512 attention, 256 model)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 8)")
    parser.add_argument("--depth", type=int, default=None, help="layers, model level (default 4)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 1)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary, model level (default 256)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a worker is abandoned (default none)")


def command_line(options: dict, sizes: dict, out: Path) -> str:
    """The command that reproduces this run, every option spelled out."""
    words = ["posenc", "bench"]
    for key, value in {**options, **sizes}.items():
        if value is None:
            continue
        words.append("--" + key)
        words += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return shlex.join(words + ["--out", str(out)])


def run(args: argparse.Namespace) -> int:
    sizes = {k: getattr(args, k) for k in ("dim", "heads", "depth", "batch", "vocab")}
    out = args.out if args.out is not None else Path("bench-results") / str(args.level)
    options = dict(
        methods=args.methods, lengths=args.lengths, level=args.level, mode=args.mode, compare=args.compare,
        repeats=args.repeats, warmup=args.warmup, device=args.device, backend=args.backend, dtype=args.dtype,
        threads=args.threads, timeout=args.timeout,
    )
    results = bench(**options, **sizes)
    full = dict(DEFAULT_SIZES[args.level])
    full.update({k: v for k, v in sizes.items() if v is not None})
    meta = {
        "title": describe_setup(args.level, results, full, options),
        "command": command_line(options, sizes, out),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "options": {k: v for k, v in options.items()},
        "sizes": full,
    }
    if args.compare:
        from importlib.metadata import version

        meta["x_transformers"] = version("x-transformers")
    paths = write_outputs(results, out, meta)
    print(paths["table.md"].read_text(), end="")
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(worker_main(sys.argv[2]))
    from .cli import main

    raise SystemExit(main(["bench", *sys.argv[1:]]))
