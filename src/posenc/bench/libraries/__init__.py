"""Libraries posenc can be compared with (the bench's ``compare`` option), by name: the registry.

A library is a module with ``NAME``, ``PACKAGE`` (its import name), ``IMPLS`` (the implementations
it runs, each a column of the tables), ``has_counterpart(method)`` and ``build_model(job)``. A new
one (e.g. HF transformers' LLaMA/BLOOM built from configs) is one module and one line here.
"""

from __future__ import annotations

from types import ModuleType

from . import hftransformers, xtransformers

LIBRARIES: dict[str, ModuleType] = {m.NAME: m for m in (xtransformers, hftransformers)}


def library_of(impl: str) -> ModuleType:
    """The library that runs implementation ``impl`` (e.g. "x-transformers flash")."""
    for library in LIBRARIES.values():
        if impl in library.IMPLS:
            return library
    raise KeyError(f"no compared library runs {impl!r}")


def impls(compare: list[str]) -> list[str]:
    """Every implementation of the named libraries, in order."""
    return [impl for name in compare for impl in LIBRARIES[name].IMPLS]
