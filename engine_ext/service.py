"""The engine-agnostic controller behind ``POST /update_weights_delta``.

One :class:`Controller` lives in the process that answers HTTP (vLLM's API server,
SGLang's launcher). It validates the request, refuses sources outside
``ENGINE_EXT_SOURCES`` before any fetch, fetches/verifies/decodes the delta in a
thread while the engine keeps serving, stages the decoded tensors in shared memory,
and only then pauses the engine, has every rank apply (see :mod:`engine_ext.updater`),
checks the combined fingerprints against the manifest, and resumes. Any failure on
any rank makes every rank roll back; the answer says what went wrong.

The engine is reached only through the small :class:`Engine` protocol, so the vLLM
and SGLang adapters share everything here.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from . import fingerprint as fpr
from . import metrics
from .errors import BaseMismatchError, DeltaError, ForbiddenSourceError, VerifyError

log = logging.getLogger("engine_ext")

ROUTE = "/update_weights_delta"
PAUSE_MODES = ("keep", "wait", "abort")
SOURCES_ENV, TOKEN_ENV, BASE_VERSION_ENV, STAGE_DIR_ENV = (
    "ENGINE_EXT_SOURCES", "ENGINE_EXT_TOKEN", "ENGINE_EXT_BASE_VERSION", "ENGINE_EXT_STAGE_DIR")
VERSION_SIDECAR = "engine_ext_version"  # optional file in the model dir holding the checkpoint's version


class RequestError(DeltaError):
    reason, http_status = "bad_request", 400


class Unauthorized(DeltaError):
    reason, http_status = "unauthorized", 401


class Busy(DeltaError):
    reason, http_status = "busy", 409


class ApplyError(DeltaError):
    """A rank failed to apply (kernel error, unknown tensor, loader failure)."""

    reason, http_status = "apply", 500


# --------------------------------------------------------------------------- request


@dataclass
class UpdateRequest:
    url: str
    base_version: int | None = None  # refuse (409) unless this is the served version
    pause_mode: str = "keep"  # vLLM: keep (freeze in-flight requests), wait (drain), abort
    wait: bool = False  # wait for a running update instead of answering 409


_FIELDS = {"url": str, "base_version": int, "pause_mode": str, "wait": bool}


def parse_request(body: bytes | str | dict) -> UpdateRequest:
    """Validate a request body; anything unexpected is a 400 that names the problem."""
    if not isinstance(body, dict):
        try:
            body = json.loads(body or b"")
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError('body must be a JSON object like {"url": "<manifest URI or path>"}')
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    for k, v in body.items():
        want = _FIELDS[k]
        if v is None and k != "url":
            continue
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise RequestError(f"field {k!r} must be {want.__name__}, got {type(v).__name__}")
    if not body.get("url"):
        raise RequestError('missing "url" (manifest URI or path)')
    req = UpdateRequest(**body)
    if req.pause_mode not in PAUSE_MODES:
        raise RequestError(f"pause_mode must be one of {PAUSE_MODES}, got {req.pause_mode!r}")
    return req


def check_token(authorization: str | None, token: str | None = None) -> None:
    """With ``ENGINE_EXT_TOKEN`` set, require ``Authorization: Bearer <token>``."""
    token = os.environ.get(TOKEN_ENV) if token is None else token
    if not token:
        return
    given = (authorization or "").removeprefix("Bearer ").strip()
    if not (authorization or "").startswith("Bearer ") or not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("missing or wrong bearer token (ENGINE_EXT_TOKEN is set)")


# --------------------------------------------------------------------------- sources

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _normalise(uri: str) -> tuple[str, str, str]:
    """(scheme, authority, path) with the path made canonical.

    Local paths go through ``realpath`` (symlinks and ``..`` resolved); remote URIs
    must not contain ``..`` or ``.`` segments at all (raw or percent-encoded), since
    servers resolve them differently.
    """
    if not isinstance(uri, str) or not uri or "\x00" in uri:
        raise ForbiddenSourceError("empty or invalid source")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if not _SCHEME_RE.match(uri):
        return "file", "", os.path.realpath(os.path.expanduser(uri))
    parts = urlsplit(uri)
    path = parts.path or "/"
    segs = unquote(path).split("/")
    if any(s in ("..", ".") for s in segs) or "\\" in unquote(path):
        raise ForbiddenSourceError(f"source {uri!r} contains '.' or '..' path segments")
    authority = (parts.hostname or "").lower() + (f":{parts.port}" if parts.port else "")
    if parts.username or parts.password:
        raise ForbiddenSourceError(f"source {uri!r} carries credentials in the URI")
    return parts.scheme.lower(), authority, posixpath.normpath(unquote(path))


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix if prefix == "/" else prefix + "/")


class Sources:
    """The allow-list of manifest sources (``ENGINE_EXT_SOURCES``, comma-separated)."""

    def __init__(self, prefixes: list[str]):
        self.raw = [p.strip() for p in prefixes if p.strip()]
        self.prefixes = [_normalise(p) for p in self.raw]

    @classmethod
    def from_env(cls) -> "Sources":
        return cls(os.environ.get(SOURCES_ENV, "").split(","))

    def check(self, uri: str) -> str:
        """Return ``uri`` if it lies under an allowed prefix, else raise (HTTP 403)."""
        if not self.prefixes:
            raise ForbiddenSourceError(f"no sources allowed: set {SOURCES_ENV} to the store prefixes this server may read")
        scheme, auth, path = _normalise(uri)
        for s, a, p in self.prefixes:
            if s == scheme and a == auth and _under(path, p):
                return path if scheme == "file" else uri
        raise ForbiddenSourceError(f"source {uri!r} is not under an allowed prefix ({SOURCES_ENV}={','.join(self.raw)})")


# --------------------------------------------------------------------------- fingerprints


def combine_fingerprints(reports: list[dict[str, list]], names=None) -> dict[str, int]:
    """The whole-tensor fingerprints from per-rank ``{name: [fp_hex, covered, numel]}``.

    A rank that covers every element of a tensor holds its whole fingerprint (and
    all such ranks must agree); otherwise the ranks hold disjoint shards whose
    partial sums add up, which needs their element counts to add up to the tensor.
    """
    names = sorted({n for r in reports for n in r}) if names is None else names
    out = {}
    for name in names:
        entries = [r[name] for r in reports if name in r]
        if not entries:
            raise VerifyError(f"{name}: no rank holds this tensor")
        numel = entries[0][2]
        full = {e[0] for e in entries if e[1] == numel}
        if len(full) > 1:
            raise VerifyError(f"{name}: ranks holding the whole tensor disagree ({sorted(full)})")
        if full:
            out[name] = fpr.parse(full.pop())
            continue
        covered = sum(e[1] for e in entries)
        if covered != numel:
            raise VerifyError(f"{name}: ranks cover {covered} of {numel} elements (overlapping or missing shards), cannot verify")
        out[name] = sum(fpr.parse(e[0]) for e in entries) & fpr.MASK64
    return out


# --------------------------------------------------------------------------- engine protocol


class Engine(Protocol):
    """What the controller needs from an engine adapter (vLLM, SGLang)."""

    async def call_ranks(self, op: str, **kwargs) -> list[dict]:
        """Run ``op`` of :class:`engine_ext.updater.Updater` on every rank; one reply each."""

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def after_update(self, version: int) -> None:
        """Reset prefix/radix caches and set the engine's weight version."""


def stage_dir() -> str:
    """Where decoded deltas are handed to the ranks: shared memory when there is one."""
    d = os.environ.get(STAGE_DIR_ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return d


def initial_version(model_dir: str | None) -> int | None:
    """``ENGINE_EXT_BASE_VERSION``, else the ``engine_ext_version`` file in the model dir."""
    v = os.environ.get(BASE_VERSION_ENV)
    if not v and model_dir and os.path.isfile(os.path.join(model_dir, VERSION_SIDECAR)):
        v = Path(model_dir, VERSION_SIDECAR).read_text().strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"base version {v!r} is not an integer") from None


def _ms(s: float) -> float:
    return round(s * 1000, 3)


class Controller:
    """One update at a time, all ranks or none; keeps version, fingerprints and history."""

    def __init__(self, engine: Engine, sources: Sources | None = None, version: int | None = None,
                 history: int = 32, engine_name: str = "vllm"):
        self.engine = engine
        self.sources = sources or Sources.from_env()
        self.version = version
        self.engine_name = engine_name
        self.tensor_fps: dict[str, int] = {}
        self.shapes: dict[str, tuple[list[int], str]] = {}
        self.history: collections.deque = collections.deque(maxlen=history)
        self._lock = asyncio.Lock()
        self.layout: dict = {}  # from the start-up probe: dense fallback, converting maps, engine paths per rank
        self.ready = False
        self.start_error: str | None = None

    # ---- start-up
    async def start(self) -> None:
        """Probe every rank and record the start-up fingerprint of the live weights."""
        try:
            replies = self._check(await self.engine.call_ranks("setup"))
        except Exception as e:
            self.start_error = str(e)
            raise
        self.tensor_fps = combine_fingerprints([r["fingerprints"] for r in replies])
        self.shapes = replies[0]["tensors"]
        self.layout = {"fallback": sorted({n for r in replies for n in r.get("fallback", [])}),
                       "converted": sorted({n for r in replies for n in r.get("converted", [])}),
                       "engine": [r.get("engine", {}) for r in replies]}
        self.ready = True
        if self.version is not None:
            metrics.VERSION.set(self.version)
        log.info("engine_ext: %d checkpoint tensors mapped on %d rank(s); version %s, fingerprint %s; dense fallback: %s; "
                 "converting maps: %d; engine paths: %s", len(self.tensor_fps), len(replies), self.version,
                 fpr.fmt(self.model_fingerprint), self.layout["fallback"], len(self.layout["converted"]), self.layout["engine"][0])

    async def resync(self, reason: str = "weights changed outside engine_ext") -> None:
        """Re-read every rank's live fingerprints after the engine's own weight update.

        The version becomes unknown; a delta whose base fingerprint matches the new
        weights is still accepted.
        """
        async with self._lock:
            replies = self._check(await self.engine.call_ranks("resync"))
            self.tensor_fps = combine_fingerprints([r["fingerprints"] for r in replies])
            self.version = None
            metrics.VERSION.set(-1)
            self.history.append({"ok": True, "outside_update": True, "version": None,
                                 "fingerprint": fpr.fmt(self.model_fingerprint), "time": time.time()})
            log.info("engine_ext: %s; fingerprint now %s", reason, fpr.fmt(self.model_fingerprint))

    @property
    def model_fingerprint(self) -> int:
        return fpr.model_fingerprint(self.tensor_fps)

    def status(self) -> dict:
        return {
            "engine": self.engine_name,
            "version": self.version,
            "fingerprint": fpr.fmt(self.model_fingerprint) if self.ready else None,
            "tensors": len(self.tensor_fps),
            "busy": self._lock.locked(),
            "error": self.start_error,
            "layout": self.layout,
            "history": list(self.history),
        }

    # ---- update
    async def update(self, req: UpdateRequest) -> dict:
        t0 = time.perf_counter()
        try:
            url = self.sources.check(req.url)  # 403 before anything is fetched
            if self._lock.locked() and not req.wait:
                raise Busy("another update is running; retry, or send \"wait\": true to queue")
            async with self._lock:
                answer = await self._update_locked(req, url, t0)
        except DeltaError as e:
            metrics.record_failure(e.reason)
            self.history.append({"url": req.url, "ok": False, "reason": e.reason, "error": str(e), "time": time.time()})
            raise
        except Exception as e:  # noqa: BLE001 - an unexpected failure is still an answer, never a crash
            metrics.record_failure("internal")
            self.history.append({"url": req.url, "ok": False, "reason": "internal", "error": repr(e), "time": time.time()})
            log.exception("engine_ext: update failed")
            raise ApplyError(f"internal error: {e!r}") from e
        return answer

    async def _update_locked(self, req: UpdateRequest, url: str, t0: float) -> dict:
        if not self.ready:
            raise ApplyError(f"the engine_ext start-up probe did not complete: {self.start_error or 'still running'}")
        if req.base_version is not None and req.base_version != self.version:
            raise BaseMismatchError(f"request expects base version {req.base_version}, server holds {self.version}")
        phases: dict[str, float] = {}
        t = time.perf_counter()
        delta = await asyncio.to_thread(self._fetch, url)
        phases["fetch_decode"] = time.perf_counter() - t
        self._check_shapes(delta)

        t = time.perf_counter()
        staged = await asyncio.to_thread(self._stage, delta)
        phases["stage"] = time.perf_counter() - t
        try:
            pause_s, inner = await self._apply_paused(delta, staged, req.pause_mode)
        finally:
            shutil.rmtree(os.path.dirname(staged), ignore_errors=True)
        elements, fallback = inner.pop("_elements"), inner.pop("_fallback")
        phases.update(inner)
        phases["pause"] = pause_s
        phases["total"] = time.perf_counter() - t0

        old_version = self._old_version
        metrics.record_success(delta.version, delta.payload_bytes, elements, phases)
        answer = {
            "ok": True,
            "version": delta.version,
            "base_version": old_version,
            "fingerprint": fpr.fmt(self.model_fingerprint),
            "tensors": len(delta.tensors),
            "elements": int(sum(t.nnz for t in delta.tensors)),
            "payload_bytes": int(delta.payload_bytes),
            "manifests": list(delta.manifests),
            "fallback": fallback,
            "pause_mode": req.pause_mode,
            "pause_ms": _ms(pause_s),
            "phases_ms": {k: _ms(v) for k, v in phases.items()},
        }
        self.history.append({k: answer[k] for k in ("version", "base_version", "elements", "payload_bytes", "pause_ms")}
                            | {"url": req.url, "ok": True, "time": time.time()})
        return answer

    def _fetch(self, url: str):
        """Decode what leads from the served weights to ``url``'s version (the delta itself,
        a chain of deltas, or an anchor plus chain: the reader picks the fewest bytes)."""
        from . import reader

        delta = reader.resolve(url, self.version, self.model_fingerprint)
        if not self._base_ok(delta):
            raise BaseMismatchError(
                f"v{delta.version} applies to version {delta.base_version} "
                f"(fingerprint {fpr.fmt(delta.base_fingerprint)}); server holds version {self.version} "
                f"(fingerprint {fpr.fmt(self.model_fingerprint)})")
        return delta

    def _base_ok(self, d) -> bool:
        if d.base_fingerprint is None:  # anchor: absolute values for the whole model
            return True
        if d.base_fingerprint != self.model_fingerprint:
            return False
        return self.version is None or d.base_version is None or d.base_version == self.version

    def _check_shapes(self, delta) -> None:
        for td in delta.tensors:
            have = self.shapes.get(td.name)
            if have is None:
                raise BaseMismatchError(f"delta names tensor {td.name!r}, which the served checkpoint does not have")
            if list(td.shape) != list(have[0]) or td.dtype.name != have[1]:
                raise BaseMismatchError(f"{td.name}: delta is {list(td.shape)}/{td.dtype.name}, served checkpoint has {have[0]}/{have[1]}")

    def _stage(self, delta) -> str:
        from .updater import stage_delta

        d = tempfile.mkdtemp(prefix="engine_ext_", dir=stage_dir())
        return stage_delta(delta.tensors, os.path.join(d, "delta.safetensors"))

    async def _apply_paused(self, delta, staged: str, mode: str) -> tuple[float, dict]:
        inner: dict[str, Any] = {}
        t_pause = time.perf_counter()
        await self.engine.pause(mode)
        inner["pause_enter"] = time.perf_counter() - t_pause
        try:
            t = time.perf_counter()
            replies = await self.engine.call_ranks("apply", path=staged)
            inner["apply"] = time.perf_counter() - t
            failed = [r for r in replies if not r.get("ok")]
            try:
                if failed:
                    raise ApplyError("; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed))
                t = time.perf_counter()
                new = self._verify(delta, replies)
                inner["verify"] = time.perf_counter() - t
            except BaseException:
                t = time.perf_counter()
                self._check(await self.engine.call_ranks("rollback"))
                inner["rollback"] = time.perf_counter() - t
                raise
            self._check(await self.engine.call_ranks("commit", version=delta.version))
            self.tensor_fps, self._old_version, self.version = new, self.version, delta.version
            t = time.perf_counter()
            try:  # the weights are committed: a cache/version-label hiccup must not report failure
                await self.engine.after_update(delta.version)
            except Exception:  # noqa: BLE001
                log.exception("engine_ext: v%s applied, but resetting caches / setting the weight version failed", delta.version)
            inner["reset_cache"] = time.perf_counter() - t
            inner["_elements"] = int(sum(r.get("written", 0) for r in replies))
            inner["_fallback"] = sorted({n for r in replies for n in r.get("fallback", [])})
        finally:
            t = time.perf_counter()
            await self.engine.resume()
            inner["resume"] = time.perf_counter() - t
        return time.perf_counter() - t_pause, inner

    def _verify(self, delta, replies) -> dict[str, int]:
        names = [td.name for td in delta.tensors]
        got = combine_fingerprints([r["fingerprints"] for r in replies], names)
        bad = [f"{td.name}: {fpr.fmt(got[td.name])} != {fpr.fmt(td.fingerprint)}" for td in delta.tensors
               if td.fingerprint is not None and got[td.name] != td.fingerprint]
        if bad:
            raise VerifyError(f"fingerprint mismatch after apply in {len(bad)} tensor(s), rolled back: " + "; ".join(bad[:5]))
        new = dict(self.tensor_fps) | got
        if delta.fingerprint is not None and fpr.model_fingerprint(new) != delta.fingerprint:
            raise VerifyError(f"model fingerprint after apply {fpr.fmt(fpr.model_fingerprint(new))} != manifest's {fpr.fmt(delta.fingerprint)}, rolled back")
        return new

    @staticmethod
    def _check(replies: list[dict]) -> list[dict]:
        failed = [r for r in replies if not r.get("ok")]
        if failed:
            raise ApplyError("; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed))
        return replies


def error_answer(e: Exception) -> tuple[int, dict]:
    """HTTP status and JSON body for an exception (DeltaError carries both)."""
    if isinstance(e, DeltaError):
        return e.http_status, {"ok": False, "reason": e.reason, "error": str(e)}
    return 500, {"ok": False, "reason": "internal", "error": repr(e)}
