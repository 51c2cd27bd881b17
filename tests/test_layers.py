"""The floor plan holds: what each room of engine_ext may import, read from the code itself.

Rooms (docs: docs/DEVELOPMENT.md, "Layout"): ``format`` (the byte format, no I/O) < ``store`` (backends,
signing, verified reads) < ``trainer`` and ``server`` (the two sides, which never import
each other) < ``engines`` (the adapters, reached only through their entry points); ``kernels``
(``engine_ext.triton_kernels``, the device kernels) read the format's layouts, so the format never imports
them. Every import of every module is read with ``ast`` (function-level ones too), and so are the lazy
registries (``engine_ext.PUBLIC``, ``engine_ext.store.BACKENDS``), which name modules as strings. Also: at
most 12 modules directly in ``engine_ext/``, and a warning (not a failure) for a module over 600 lines: a
file is cut along its seams when it has them, never squeezed to meet a number (docs/DEVELOPMENT.md, "Style").
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "engine_ext"
BASE = {"engine_ext.settings", "engine_ext.errors", "engine_ext.metrics"}
# room -> rooms it must never import (besides itself, anything else is allowed)
NEVER = {
    "format": {"kernels", "store", "trainer", "server", "engines", "face"},  # the device kernels sit above the format
    "store": {"trainer", "server", "engines", "face"},
    "trainer": {"server", "engines", "face"},
    "server": {"trainer", "engines", "face"},
    "base": {"format", "store", "trainer", "server", "engines", "face"},
    "face": {"engines"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if module in BASE:
        return "base"
    if len(parts) > 1 and parts[1] in ("format", "store", "trainer", "server", "engines"):
        return parts[1]
    if len(parts) > 1 and parts[1] == "triton_kernels":
        return "kernels"
    return "face"


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(module: str, path: Path) -> set[str]:
    """Every engine_ext module ``module`` imports, relative or absolute, anywhere in the file."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (here[: len(here) - node.level + 1] if node.level else []) + (node.module.split(".") if node.module else [])
            target = ".".join(base)
            if target.startswith("engine_ext"):
                if target != "engine_ext":  # the root package's face is lazy: what counts is what is taken from it
                    out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("engine_ext"))
    return out


def test_no_room_imports_what_it_must_never():
    import engine_ext
    from engine_ext import store

    mods = modules()
    edges = {m: {t for t in imports(m, p) if t in mods} for m, p in mods.items()}
    edges["engine_ext"] |= set(engine_ext.PUBLIC.values())  # imported lazily, by name
    edges["engine_ext.store"] |= {f"engine_ext.store.{m}" for m, _ in store.BACKENDS.values()}
    bad = sorted(f"{m} -> {t} ({room(m)} must never import {room(t)})" for m, ts in edges.items() for t in ts
                 if room(t) in NEVER.get(room(m), set()))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rule", ["size", "top"])
def test_rooms_stay_small(rule):
    mods = modules()
    if rule == "size":
        big = {m: n for m, p in mods.items() if (n := len(p.read_text().splitlines())) > 600}
        if big:  # a prompt to look for a seam, not a limit to golf to
            warnings.warn(f"modules over 600 lines (cut along a seam where there is one): {big}", stacklevel=1)
    else:
        top = sorted(p.name for p in ROOT.glob("*.py"))
        assert len(top) <= 12, f"{len(top)} modules directly in engine_ext/: {top}"
        assert {"format", "store", "trainer", "server", "engines"} <= {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
