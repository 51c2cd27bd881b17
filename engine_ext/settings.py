"""Every ``ENGINE_EXT_*`` environment variable, read once into one typed object.

The vLLM ``envs`` pattern, smaller: :data:`VARIABLES` names each variable once with
its parser, default and meaning (docs/settings.md is this table, checked by a test);
:func:`current` reads them all the first time it is called (a plugin calls it when it
loads, in every engine process) and returns the same frozen :class:`Settings` after
that, so a module never reads the environment at import time or twice with different
answers. Tests pass a :class:`Settings` explicitly or use :func:`override`.
Store credentials that libraries define themselves (``AWS_*``, ``HF_TOKEN``) stay with
those libraries.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator, Mapping


def _int_or_none(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"not an integer: {s!r}") from None


def _csv(s: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in s.split(",") if p.strip())


@dataclass(frozen=True)
class Variable:
    name: str  # ENGINE_EXT_...
    field: str  # attribute of Settings
    parse: Callable[[str], object]
    default: object
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("ENGINE_EXT_SOURCES", "sources", _csv, (),
             "comma-separated store prefixes (paths or URIs) this server may read updates from; anything else is "
             "refused with 403 before any fetch"),
    Variable("ENGINE_EXT_TOKEN", "token", str, None,
             "bearer token the update routes require (`Authorization: Bearer <token>`)"),
    Variable("ENGINE_EXT_BASE_VERSION", "base_version", _int_or_none, None,
             "version of the weights the server starts with (else the file `engine_ext_version` in the model "
             "directory, else unknown)"),
    Variable("ENGINE_EXT_STAGE_DIR", "stage_dir", str, None,
             "where decoded deltas are handed to the ranks (default `/dev/shm`, else the temp dir); every rank "
             "must see it"),
    Variable("ENGINE_EXT_MAX_DECODED_BYTES", "max_decoded_bytes", int, 64 << 30,
             "refuse a delta whose decoded positions and values would take more bytes than this"),
    Variable("ENGINE_EXT_HTTP_TOKEN", "http_token", str, None,
             "bearer token sent to `http(s)://` stores"),
    Variable("ENGINE_EXT_S3_ENDPOINT", "s3_endpoint", str, None,
             "endpoint of `s3://` stores (else `AWS_ENDPOINT_URL`, else AWS)"),
)


@dataclass(frozen=True)
class Settings:
    """The values of :data:`VARIABLES` (see each one's meaning there)."""

    sources: tuple[str, ...] = ()
    token: str | None = None
    base_version: int | None = None
    stage_dir: str | None = None
    max_decoded_bytes: int = 64 << 30
    http_token: str | None = None
    s3_endpoint: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        """Parse every variable of ``env`` (default ``os.environ``); a bad value names the variable."""
        env = os.environ if env is None else env
        values = {}
        for v in VARIABLES:
            raw = env.get(v.name, "")
            if raw == "":
                continue
            try:
                values[v.field] = v.parse(raw)
            except ValueError as e:
                raise ValueError(f"{v.name}: {e}") from None
        return cls(**values)


assert {f.name for f in fields(Settings)} == {v.field for v in VARIABLES}

_current: Settings | None = None


def current() -> Settings:
    """The process's settings, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Run a block with some settings changed (tests)."""
    global _current
    old = current()
    _current = replace(old, **changes)
    try:
        yield _current
    finally:
        _current = old


def markdown_table() -> str:
    """docs/settings.md's table."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for v in VARIABLES:
        default = "unset" if v.default in (None, ()) else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {default} | {v.meaning} |")
    return "\n".join(rows) + "\n"
