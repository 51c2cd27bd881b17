"""JSON text as ``json.dumps(asdict(obj), indent=1)`` writes it, byte for byte, in under half the time.

A delta's manifest lists ~2.5 k tensor entries and cells at 1 B parameters: ``dataclasses.asdict``
(which deep-copies every leaf) and the json module's pure-Python encoder (the only one that
indents) took ~0.1 s of a publish's commit on the 2-core host. This walks the dataclasses once and
joins the text directly; strings go through the json module's C escaper. Anything it does not
know (a non-string key, a number type other than int and float) is left to ``json.dumps``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _string

_FIELDS: dict[type, tuple[str, ...]] = {}


def _list_like(o) -> bool:
    """A sequence other than a list, tuple or text, written as a JSON array (a read manifest's CellChunks)."""
    return isinstance(o, Sequence) and not isinstance(o, (str, bytes, bytearray))


class _Unknown(Exception):
    """A value this writer leaves to the json module."""


def _float(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def _text(o, pad: str, omit: dict) -> str:
    """``o`` as indented JSON, its first line unindented and later ones after ``pad`` ("\\n" and the indent)."""
    t = type(o)
    if t is str:
        return _string(o)
    if o is None:
        return "null"
    if o is True:
        return "true"
    if o is False:
        return "false"
    if t is int:
        return int.__repr__(o)
    if t is float:
        return _float(o)
    inner = pad + " "
    if t is list or t is tuple:
        if not o:
            return "[]"
        return "[" + inner + ("," + inner).join([_text(v, inner, omit) for v in o]) + pad + "]"
    if t is dict:
        if not o:
            return "{}"
        if any(type(k) is not str for k in o):
            raise _Unknown
        items = o.items()
    elif dataclasses.is_dataclass(o) and not isinstance(o, type):
        names = _FIELDS.get(t)
        if names is None:
            names = _FIELDS[t] = tuple(f.name for f in dataclasses.fields(o))
        gone = omit.get(t, ())
        items = [(n, v) for n in names if not ((v := getattr(o, n)) is None and n in gone)]
        if not items:
            return "{}"
    elif _list_like(o):
        return _text(list(o), pad, omit)
    else:
        raise _Unknown
    return "{" + inner + ("," + inner).join([_string(k) + ": " + _text(v, inner, omit) for k, v in items]) + pad + "}"


def dumps_indent1(obj, omit: dict[type, tuple[str, ...]] | None = None) -> bytes:
    """``json.dumps(d, indent=1).encode()`` of ``d = dataclasses.asdict(obj)`` (or of ``obj`` itself where it
    is plain JSON data), the fields ``omit[cls]`` of a ``cls`` instance left out where they are None."""
    omit = omit or {}
    try:
        return _text(obj, "\n", omit).encode()
    except _Unknown:
        return json.dumps(_plain(obj, omit), indent=1).encode()


def _plain(o, omit: dict):
    """``dataclasses.asdict`` with the omitted None fields dropped (for the json module's slow path)."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        gone = omit.get(type(o), ())
        return {
            f.name: _plain(v, omit)
            for f in dataclasses.fields(o)
            if not ((v := getattr(o, f.name)) is None and f.name in gone)
        }
    if isinstance(o, (list, tuple)):
        return type(o)(_plain(v, omit) for v in o)
    if _list_like(o):
        return [_plain(v, omit) for v in o]
    if isinstance(o, dict):
        return {k: _plain(v, omit) for k, v in o.items()}
    return o
