"""Engine touchpoints: what a compat table entry is, and a static check of a table against
an engine's source tree (a wheel or an installed package), without importing it.

Each engine adapter keeps every private or version-sensitive name it uses in one
``compat`` module (:mod:`engine_ext.engines.vllm.compat`, :mod:`engine_ext.engines.sglang.compat`) as
:class:`Touchpoint` entries with the versions they were checked on. :func:`check`
finds each one in the sources with ``ast`` (following ``from x import y`` re-exports)
and verifies the parameters we pass still exist, so a new engine release is judged
before anyone runs it (tests/test_compat.py reads vLLM 0.33.0's wheel this way).
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Touchpoint:
    """``module:qualname`` in the engine, with the parameters we pass (``()``: not called or no check).

    ``qualname`` is a module-level name, ``Class.member`` (method, class attribute or an
    attribute the class assigns to ``self``), or ``Class.member`` on an instance we receive.
    """

    module: str  # "a.b" or "a.b|c.d": where it is defined (either, for a name that moved between versions)
    qualname: str
    params: tuple[str, ...] = ()
    why: str = ""

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


class SourceTree:
    """Python sources of a package: a directory (site-packages) or a wheel (read in place)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._zip = zipfile.ZipFile(self.root) if self.root.suffix == ".whl" else None
        self._cache: dict[str, ast.Module | None] = {}

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        p = self.root / rel
        return p.read_text() if p.is_file() else None

    def module(self, name: str) -> ast.Module | None:
        if name not in self._cache:
            base = name.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._cache[name] = None if text is None else ast.parse(text)
        return self._cache[name]


def _defs(body) -> dict[str, ast.AST]:
    """Names a module or class body binds: defs, classes, assignments, imports (not ``*``)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name.split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, try/except imports
            for part in (node.body, getattr(node, "orelse", []), *[h.body for h in getattr(node, "handlers", [])]):
                out.update({k: v for k, v in _defs(part).items() if k not in out})
    return out


def _star_imports(body) -> list[ast.ImportFrom]:
    """``from x import *`` statements of a module body."""
    return [n for n in body if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)]


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def _resolve(tree: SourceTree, module: str, name: str, depth: int = 0):
    """(module, definition) of ``name`` as seen from ``module``, following imports; None if absent.

    A name imported from a module the tree lacks (a submodule, a third-party name) resolves
    to ``(module, None)``: present, but not inspectable.
    """
    mod = tree.module(module)
    if mod is None or depth > 5:
        return None
    defs = _defs(mod.body)
    node = defs.get(name)
    if isinstance(node, ast.ImportFrom):
        orig = next(a.name for a in node.names if (a.asname or a.name) == name)
        src = _absolute(tree, module, node)
        return _resolve(tree, src, orig, depth + 1) or (src, None)
    if node is None:  # from .x import *
        for star in _star_imports(mod.body):
            found = _resolve(tree, _absolute(tree, module, star), name, depth + 1)
            if found is not None:
                return found
        return None
    return module, node


def _member(tree: SourceTree, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
    """The definition of ``cls.name`` (a def or class attribute; True for a ``self.name`` assignment),
    looking through the base classes it names; None if absent."""
    member = _defs(cls.body).get(name)
    if member is not None:
        return member
    if name in _self_attrs(cls):
        return True
    for base in cls.bases:
        if isinstance(base, ast.Name) and depth < 8:
            found = _resolve(tree, module, base.id)
            if found is not None and isinstance(found[1], ast.ClassDef):
                member = _member(tree, found[0], found[1], name, depth + 1)
                if member is not None:
                    return member
    return None


def _absolute(tree: SourceTree, module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    is_pkg = tree._read(module.replace(".", "/") + "/__init__.py") is not None
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names, a.kwarg is not None


def check(tree: SourceTree, touchpoints) -> list[str]:
    """Problems with ``touchpoints`` in ``tree`` (empty: every one is there, with its parameters)."""
    problems = []
    for tp in touchpoints:
        head, *rest = tp.qualname.split(".")
        found = next((f for f in (_resolve(tree, m, head) for m in tp.module.split("|")) if f is not None), None)
        if found is None:
            problems.append(f"{tp}: {head} not found")
            continue
        module, node = found
        if rest:
            if not isinstance(node, ast.ClassDef):
                problems.append(f"{tp}: {head} is not a class defined in the sources")
                continue
            member = _member(tree, module, node, rest[0])
            if member is None:
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                problems.append(f"{tp}: no member {rest[0]!r} in class {head} or its bases {bases}")
                continue
            node = member
        if tp.params:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems.append(f"{tp}: expected a function, found {type(node).__name__}")
                continue
            names, any_kw = _params(node)
            missing = [p for p in tp.params if p not in names and not any_kw]
            if missing:
                problems.append(f"{tp}: parameters {missing} gone (has {sorted(names)})")
    return problems
