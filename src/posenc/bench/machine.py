"""The machine a benchmark ran on, recorded with every result.

Kernel speed differs between CPUs (e.g. the CPU flash kernel's backward with a mask), so two tables
are comparable only if they say where they were measured: CPU model, the instruction-set flags the
kernels use, core count, torch threads, torch version and what torch was built with.
"""

from __future__ import annotations

import os
import platform
import subprocess

import torch

# CPU flags that decide which kernels run: vector widths, bfloat16 and matrix units (x86), NEON/SVE (Arm).
KERNEL_FLAGS = (
    "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2",
)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _lscpu_model() -> str | None:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return None


def torch_build() -> list[str]:
    """The first lines of ``torch.__config__.show()``: compiler, BLAS, oneDNN, OpenMP, CPU capability."""
    lines = [line.strip().removeprefix("- ") for line in torch.__config__.show().splitlines()]
    return [line for line in lines if line and not line.startswith(("PyTorch built with", "Build settings"))][:8]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else the platform, else lscpu), or "unknown"."""
    return _cpuinfo().get("model name") or platform.processor() or _lscpu_model() or "unknown"


def describe_machine() -> dict:
    """CPU model and flags, cores, torch threads, versions and build; JSON values only."""
    info = _cpuinfo()
    model = cpu_model()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = None
    machine = {
        "cpu_model": model,
        # family/model/stepping name the CPU where a virtual machine calls it "Intel(R) Xeon(R) Processor"
        "cpu_id": " ".join(f"{k.split()[-1]} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info) or None,
        "cpu_flags": [f for f in KERNEL_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": capability,
        "torch_build": torch_build(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        machine["cuda_device"] = torch.cuda.get_device_name(0)
        machine["cuda"] = torch.version.cuda
    return machine


SKIP_IN_LINE = ("C++ Version", "LAPACK", "NNPACK", "CPU capability usage")  # in the JSON, not the header


def _short(line: str) -> str:
    """A build line without its hashes and build dates (kept in the JSON)."""
    for cut in (" (", "-Product Build", " for "):
        line = line.split(cut, 1)[0]
    return line


def machine_line(machine: dict, threads: int | None = None) -> str:
    """One line for a table header: where, with what, how many threads per worker."""
    flags = " ".join(machine.get("cpu_flags") or []) or "none of the listed"
    cores = f"{machine.get('cpu_count')} cores" + (
        f" ({machine['cpus_usable']} usable)" if machine.get("cpus_usable") != machine.get("cpu_count") else ""
    )
    gpu = f"; GPU {machine['cuda_device']} (CUDA {machine.get('cuda')})" if machine.get("cuda_device") else ""
    build = ", ".join(_short(line) for line in machine.get("torch_build") or [] if not line.startswith(SKIP_IN_LINE))
    threads = threads or machine.get("torch_threads")
    return (
        f"Machine: {machine.get('cpu_model')}" + (f" ({machine['cpu_id']})" if machine.get("cpu_id") else "")
        + f", {cores}, flags: {flags}{gpu}; torch {machine.get('torch')} "
        f"(CPU capability {machine.get('torch_cpu_capability')}), {threads} thread{'s' if threads != 1 else ''} "
        f"per worker; torch built with: {build}"
    )
