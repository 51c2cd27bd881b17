"""The driver of updates for one engine: one update at a time, with history and metrics.

One :class:`Controller` lives where updates are driven from: the process that answers
HTTP (vLLM's API server, SGLang's TokenizerManager process, which also serves the
in-process ``sglang.Engine`` hook), or rank 0 of an in-process vLLM engine (the
``delta`` weight-transfer backend). It checks the source against the allow-list
before anything is fetched, serialises updates, runs each as an
:class:`~engine_ext.transaction.UpdateTransaction` over the engine adapter's
:class:`~engine_ext.transaction.Ranks`, and records the outcome (history, Prometheus
metrics). The HTTP routes of both engines use :func:`check_token` and
:func:`error_answer` from here.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
from pathlib import Path

from . import fingerprint as fpr
from . import metrics, settings
from .errors import DeltaError
from .protocol import UpdateRequest
from .sources import Sources
from .transaction import ApplyError, Ranks, ServedState, UpdateTransaction, check_replies, combine_fingerprints

log = logging.getLogger("engine_ext")

ROUTE = "/update_weights_delta"
VERSION_SIDECAR = "engine_ext_version"  # optional file in the model dir holding the checkpoint's version


class Unauthorized(DeltaError):
    reason, http_status = "unauthorized", 401


class Busy(DeltaError):
    reason, http_status = "busy", 409


def check_token(authorization: str | None, token: str | None = None) -> None:
    """With a token configured (``ENGINE_EXT_TOKEN``), require ``Authorization: Bearer <token>``."""
    token = settings.current().token if token is None else token
    if not token:
        return
    given = (authorization or "").removeprefix("Bearer ").strip()
    if not (authorization or "").startswith("Bearer ") or not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("missing or wrong bearer token (ENGINE_EXT_TOKEN is set)")


def error_answer(e: Exception) -> tuple[int, dict]:
    """HTTP status and JSON body for an exception (DeltaError carries both)."""
    if isinstance(e, DeltaError):
        return e.http_status, {"ok": False, "reason": e.reason, "error": str(e)}
    return 500, {"ok": False, "reason": "internal", "error": repr(e)}


def initial_version(model_dir: str | None) -> int | None:
    """``ENGINE_EXT_BASE_VERSION``, else the ``engine_ext_version`` file in the model dir."""
    v = settings.current().base_version
    if v is None and model_dir and Path(model_dir, VERSION_SIDECAR).is_file():
        text = Path(model_dir, VERSION_SIDECAR).read_text().strip()
        try:
            v = int(text)
        except ValueError:
            raise ValueError(f"{Path(model_dir, VERSION_SIDECAR)}: version {text!r} is not an integer") from None
    return v


class Controller:
    """One update at a time, all ranks or none; keeps the served state and the history."""

    def __init__(self, ranks: Ranks, sources: Sources | None = None, version: int | None = None,
                 history: int = 32, engine_name: str = "vllm"):
        self.ranks = ranks
        self.sources = sources or Sources.from_settings()
        self.engine_name = engine_name
        self.state = ServedState(version, {}, {})
        self.history: collections.deque = collections.deque(maxlen=history)
        self._lock = asyncio.Lock()
        self.ready = False
        self.start_error: str | None = None

    # ---- start-up
    async def start(self) -> None:
        """Probe every rank and record the start-up fingerprint of the live weights."""
        try:
            self.state = ServedState.from_setup(await self.ranks.call("setup"), self.state.version)
        except Exception as e:
            self.start_error = str(e)
            raise
        self.ready = True
        metrics.VERSION.set(-1 if self.state.version is None else self.state.version)
        layout = self.state.layout
        log.info("engine_ext: %d checkpoint tensors mapped on %d rank(s); version %s, fingerprint %s; dense fallback: %s; "
                 "converting maps: %d; engine paths: %s", len(self.state.tensor_fps), len(layout["engine"]),
                 self.state.version, fpr.fmt(self.state.model_fingerprint), layout["fallback"], len(layout["converted"]),
                 layout["engine"][0])

    async def resync(self, reason: str = "weights changed outside engine_ext") -> None:
        """Re-read every rank's live fingerprints after the engine's own weight update.

        The version becomes unknown; a delta whose base fingerprint matches the new
        weights is still accepted.
        """
        async with self._lock:
            replies = check_replies(await self.ranks.call("resync"))
            self.state.tensor_fps, self.state.version = combine_fingerprints(replies), None
            metrics.VERSION.set(-1)
            self.history.append({"ok": True, "outside_update": True, "version": None,
                                 "fingerprint": fpr.fmt(self.state.model_fingerprint), "time": time.time()})
            log.info("engine_ext: %s; fingerprint now %s", reason, fpr.fmt(self.state.model_fingerprint))

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def model_fingerprint(self) -> int:
        return self.state.model_fingerprint

    def status(self) -> dict:
        return {
            "engine": self.engine_name,
            "version": self.state.version,
            "fingerprint": fpr.fmt(self.state.model_fingerprint) if self.ready else None,
            "tensors": len(self.state.tensor_fps),
            "busy": self._lock.locked(),
            "error": self.start_error,
            "layout": self.state.layout,
            "history": list(self.history),
        }

    # ---- update
    async def update(self, req: UpdateRequest) -> dict:
        """Run one update transaction; the answer as JSON, or a DeltaError saying why nothing changed."""
        try:
            source = self.sources.check(req.url)  # 403 before anything is fetched
            if self._lock.locked() and not req.wait:
                raise Busy("another update is running; retry, or send \"wait\": true to queue")
            async with self._lock:
                if not self.ready:
                    raise ApplyError(f"the engine_ext start-up probe did not complete: {self.start_error or 'still running'}")
                txn = UpdateTransaction(self.ranks, self.state, req, source)
                answer = await txn.run()
        except DeltaError as e:
            metrics.record_failure(e.reason)
            self.history.append({"url": req.url, "ok": False, "reason": e.reason, "error": str(e), "time": time.time()})
            raise
        except Exception as e:  # noqa: BLE001 - an unexpected failure is still an answer, never a crash
            metrics.record_failure("internal")
            self.history.append({"url": req.url, "ok": False, "reason": "internal", "error": repr(e), "time": time.time()})
            log.exception("engine_ext: update failed")
            raise ApplyError(f"internal error: {e!r}") from e
        metrics.record_success(answer.version, answer.payload_bytes, answer.written, txn.phases)
        self.history.append({"version": answer.version, "base_version": answer.base_version, "elements": answer.elements,
                             "payload_bytes": answer.payload_bytes, "pause_ms": answer.pause_ms, "url": req.url,
                             "ok": True, "time": time.time()})
        return answer.to_json()


__all__ = ["Controller", "ROUTE", "Busy", "Unauthorized", "check_token", "error_answer", "initial_version"]
