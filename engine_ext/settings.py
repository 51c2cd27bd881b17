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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any


def _int_or_none(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"not an integer: {s!r}") from None


def _csv(s: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in s.split(",") if p.strip())


def _flag(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a yes/no value: {s!r} (use 1 or 0)")


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise ValueError(f"must be positive, got {s!r}")
    return v


def _non_negative_float(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise ValueError(f"must be 0 or more, got {s!r}")
    return v


def _verify_derived(s: str) -> str:
    v = s.strip().lower()
    if v not in ("sample", "all", "off"):
        raise ValueError(f"must be sample, all or off, got {s!r}")
    return v


def _shares(s: str) -> int:
    n = int(s)
    if not 1 <= n <= 64 or n & (n - 1):
        raise ValueError(f"a power of two from 1 to 64, got {s!r}")
    return n


CONTEXT_PASSES = ("auto", "numba", "avx512bw", "avx2", "scalar")


def _context_pass(s: str) -> str:
    v = s.strip().lower()
    if v not in CONTEXT_PASSES:
        raise ValueError(f"must be one of {', '.join(CONTEXT_PASSES)}, got {s!r}")
    return v


def _reader_device(s: str) -> str:
    v = s.strip().lower()
    if v not in ("gpu", "cpu"):
        raise ValueError(f"must be gpu or cpu, got {s!r}")
    return v


@dataclass(frozen=True)
class Variable:
    name: str  # ENGINE_EXT_...
    field: str  # attribute of Settings
    parse: Callable[[str], object]
    default: object
    meaning: str


# One Variable per setting, each the same shape on purpose (the `duplicates` tool pairs them): this table is
# the one place a setting is declared, and a loop over it parses the environment and renders docs/settings.md's table.
VARIABLES: tuple[Variable, ...] = (
    Variable(
        "ENGINE_EXT_SOURCES",
        "sources",
        _csv,
        (),
        "comma-separated store prefixes (paths or URIs) this server may read updates from; anything else is "
        "refused with 403 before any fetch",
    ),
    Variable(
        "ENGINE_EXT_TOKEN",
        "token",
        str,
        None,
        "bearer token the update routes require (`Authorization: Bearer <token>`); vLLM's `--api-key` and "
        "SGLang's `--api-key`/`--admin-api-key` are accepted too",
    ),
    Variable(
        "ENGINE_EXT_NO_AUTH",
        "no_auth",
        _flag,
        False,
        "`1` opens the update routes to anyone who can reach them; without it and without a token they "
        "refuse every request (secure by default)",
    ),
    Variable(
        "ENGINE_EXT_TRUSTED_KEYS",
        "trusted_keys",
        _csv,
        (),
        "comma-separated Ed25519 public keys (PEM files, or 64 hex digits) whose signatures the server "
        "accepts on manifests and `LATEST`",
    ),
    Variable(
        "ENGINE_EXT_SIGNATURE_THRESHOLD",
        "signature_threshold",
        int,
        1,
        "how many distinct trusted keys must sign each manifest",
    ),
    Variable(
        "ENGINE_EXT_ALLOW_UNSIGNED",
        "allow_unsigned",
        _flag,
        False,
        "`1` accepts unsigned versions (trusting the store and the network); without it an unsigned version is refused",
    ),
    Variable(
        "ENGINE_EXT_SIGNING_KEY",
        "signing_keys",
        _csv,
        (),
        "trainer side: Ed25519 private key file(s) (PEM, `engine-ext keygen`) the publisher and the CLI sign with",
    ),
    Variable(
        "ENGINE_EXT_FETCH_TIMEOUT",
        "fetch_timeout",
        _positive_float,
        600.0,
        "seconds one update may spend fetching (every manifest and blob of it, all retries included)",
    ),
    Variable(
        "ENGINE_EXT_MAX_WAITING",
        "max_waiting",
        int,
        4,
        'updates that may wait (`"wait": true`) behind a running one; more get 429',
    ),
    Variable(
        "ENGINE_EXT_BASE_VERSION",
        "base_version",
        _int_or_none,
        None,
        "version of the weights the server starts with (else the file `engine_ext_version` in the model "
        "directory, else unknown)",
    ),
    Variable(
        "ENGINE_EXT_MAX_DECODED_BYTES",
        "max_decoded_bytes",
        int,
        64 << 30,
        "refuse a delta whose decoded positions and values would take more bytes than this",
    ),
    Variable("ENGINE_EXT_HTTP_TOKEN", "http_token", str, None, "bearer token sent to `http(s)://` stores"),
    Variable(
        "ENGINE_EXT_S3_ENDPOINT",
        "s3_endpoint",
        str,
        None,
        "endpoint of `s3://` stores (else `AWS_ENDPOINT_URL`, else AWS)",
    ),
    Variable(
        "ENGINE_EXT_FOLLOW",
        "follow",
        str,
        None,
        "pull mode: a store prefix whose `LATEST` the server watches and updates itself to (chain or "
        "anchor, the fewer bytes); also an allowed source",
    ),
    Variable(
        "ENGINE_EXT_CHECK_LOAD",
        "check_load",
        _flag,
        True,
        "`0` skips the start-up check that every rank's live weights equal the checkpoint it loaded "
        "(it reads the checkpoint once and names every tensor that differs, e.g. a layout the engine "
        "derives after loading)",
    ),
    Variable(
        "ENGINE_EXT_VERIFY_DERIVED",
        "verify_derived",
        _verify_derived,
        "sample",
        "after every apply and rollback, inside the pause: compare the copies the engine's kernels read "
        "(packed, padded, derived) with a fresh derivation from the weights just written, and roll back on "
        "any difference. `sample`: one touched layer of each kind per update, taken in turn (about 2 % of a "
        "DeepSeek-V3 pause); `all`: every touched layer (as much again as the refresh); `off`: none (the "
        "audit `?audit=1` still checks every copy)",
    ),
    Variable(
        "ENGINE_EXT_COLD_AUDIT",
        "cold_audit",
        _flag,
        False,
        "`1` answers `GET ...?audit=1&cold=DIR`: every rank builds a second instance of the model from the "
        "checkpoint directory DIR (under an allowed source) with the engine's own loader and post-processing "
        "and compares every tensor each module holds with the served one, byte for byte (vLLM; for tests and "
        "conformance sweeps: it doubles the model's memory for the time of the call)",
    ),
    Variable(
        "ENGINE_EXT_FOLLOW_INTERVAL",
        "follow_interval",
        _positive_float,
        5.0,
        "seconds between two looks at `LATEST` in pull mode (each varied by +-20 %; doubled after each "
        "failure, up to 60 s)",
    ),
    Variable(
        "ENGINE_EXT_CONTEXT_CODER",
        "context_coder",
        _flag,
        True,
        "publisher: `0` never codes a part with the context-conditioned coder (codec v2, format 9 `ctx-rans`: "
        "~25 % fewer bytes on real training, each part coded given its base weights); otherwise a part is context "
        "coded where it saves 10 % and pays on the readers (`ENGINE_EXT_READER_DEVICE`, `ENGINE_EXT_READER_MBPS`)",
    ),
    Variable(
        "ENGINE_EXT_CONTEXT_PASS",
        "context_pass",
        _context_pass,
        "auto",
        "reader: which build of codec v2's pass over the base a host rank runs: `auto` the widest compiled "
        "variant its CPU runs (`avx512bw`, `avx2`, `scalar`; engine_ext/format/context/scan_native.c), else "
        "`numba`; naming a variant the CPU or the install lacks is an error (tests run each)",
    ),
    Variable(
        "ENGINE_EXT_READER_DEVICE",
        "reader_device",
        _reader_device,
        "gpu",
        "publisher: where the readers' weights live, `gpu` or `cpu`: a part is context coded only where it "
        'pays on them (docs/FORMAT.md, "Who chooses the coding")',
    ),
    Variable(
        "ENGINE_EXT_READER_MBPS",
        "reader_mbps",
        _non_negative_float,
        100.0,
        "publisher: the store bandwidth one reader rank fetches at, MB/s: a part is context coded only where "
        "a rank gets it sooner (the longer of its fetch and its decode, against v1's); GPU readers at 100 MB/s "
        "take v2 on big parts; `0`: bytes first (metered or slow links: v2 wherever it saves 10 %)",
    ),
    Variable(
        "ENGINE_EXT_READER_TP",
        "reader_tp",
        _shares,
        8,
        "publisher: the tensor-parallel degree delta blobs are laid out for: each blob holds the parts every "
        "rank may read whole, then each share's cells of the matrices whose layer names say their shard "
        "dimension, so that a rank of this TP degree (or of a smaller power of two) reads two ranges per blob "
        "(engine_ext/trainer/blob_layout.py); a version in tables keeps those matrices' chunk records in cell "
        'sections for as many shares (format 12, docs/FORMAT.md "Cell sections"), so that such a rank reads its '
        "share's records only; `1`: parts in the order they are encoded, cell tables of format 10",
    ),
    Variable(
        "ENGINE_EXT_INLINE_ENTRIES",
        "inline_entries",
        int,
        4096,
        "publisher: a manifest listing more tensors and grid cells than this (~400 bytes each) is written as "
        'format 10, its tensor entries and cell tables in a blob (docs/FORMAT.md, "Tables" and "Indexed '
        'tensor tables"; readers of format 9 and older refuse it); smaller ones inline, as format 5 or 6 (9 '
        "with a `ctx-rans` part; an anchor: format 8, its blobs carrying pieces digests); `0`: always tables",
    ),
)


@dataclass(frozen=True)
class Settings:
    """The values of :data:`VARIABLES` (see each one's meaning there)."""

    sources: tuple[str, ...] = ()
    token: str | None = None
    no_auth: bool = False
    trusted_keys: tuple[str, ...] = ()
    signature_threshold: int = 1
    allow_unsigned: bool = False
    signing_keys: tuple[str, ...] = ()
    fetch_timeout: float = 600.0
    max_waiting: int = 4
    base_version: int | None = None
    max_decoded_bytes: int = 64 << 30
    http_token: str | None = None
    s3_endpoint: str | None = None
    follow: str | None = None
    follow_interval: float = 5.0
    check_load: bool = True
    verify_derived: str = "sample"
    cold_audit: bool = False
    context_coder: bool = True
    context_pass: str = "auto"
    reader_device: str = "gpu"
    reader_mbps: float = 100.0
    reader_tp: int = 8
    inline_entries: int = 4096

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Parse every variable of ``env`` (default ``os.environ``); a bad value names the variable."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
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
        default = "unset" if v.default in (None, (), False) else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {default} | {v.meaning} |")
    return "\n".join(rows) + "\n"
