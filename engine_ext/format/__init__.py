"""The byte format both sides share (spec: docs/FORMAT.md): the manifest, the codecs (v1 in
:mod:`.codec`, v2 in the package :mod:`.context`), dtypes and their ordered steps, fingerprints,
decoded deltas, grid cells, the fp8-block recipe. Pure data and math: nothing here reads or writes
a store, and nothing here imports one, nor the device kernels above it (``engine_ext.triton_kernels``)."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def kernel_module(module: str):
    """``engine_ext.format.<module>``, a module of numba kernels, imported (and its kernels loaded
    from numba's cache or compiled) on first use only, or None where numba is missing: the torch
    reference paths serve."""
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError:  # pragma: no cover - numba is a core dependency
        return None
